package outboxpgx_test

import (
	"context"
	"database/sql"
	"errors"
	"net"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/watermill-outbox/outbox"
	"github.com/watermill-outbox/outbox/drivers/outboxpgx"
	"github.com/watermill-outbox/outbox/outboxtest"
)

// slowReadConn holds back the first read after it is armed: the server's answer to what the
// client sent last arrives late, as over a congested network or from a starved client process.
type slowReadConn struct {
	net.Conn
	armed *atomic.Bool
	delay time.Duration
}

func (c *slowReadConn) Read(p []byte) (int, error) {
	if c.armed.CompareAndSwap(true, false) {
		time.Sleep(c.delay)
	}
	return c.Conn.Read(p)
}

// TestInUnitCommitAnsweredAfterHandlerTimeout: when HandlerTimeout ends while the COMMIT of a
// boundary unit is on the wire, the server may have committed it; InUnit must not report the unit
// as rolled back (a caller told so sends the request again and applies it twice), but as an
// unknown outcome, which a keyed retry resolves by replaying. The answer to the COMMIT is held
// back past HandlerTimeout after the server has committed.
func TestInUnitCommitAnsweredAfterHandlerTimeout(t *testing.T) {
	dsn := outboxtest.DSN(t)
	var armed atomic.Bool
	cfg, err := pgxpool.ParseConfig(dsn)
	if err != nil {
		t.Fatal(err)
	}
	cfg.MaxConns = 1 // one connection: the warm-up prepared the COMMIT's batch on it
	cfg.ConnConfig.DialFunc = func(ctx context.Context, network, addr string) (net.Conn, error) {
		var d net.Dialer
		c, err := d.DialContext(ctx, network, addr)
		if err != nil {
			return nil, err
		}
		return &slowReadConn{Conn: c, armed: &armed, delay: 2500 * time.Millisecond}, nil
	}
	cfg.ShouldPing = func(context.Context, pgxpool.ShouldPingParams) bool { return false }
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	ob := ready(t, pool, outbox.Config{Publisher: &outboxtest.Recorder{}, HandlerTimeout: time.Second})

	// pgx prepares the statements of the COMMIT's batch on first use, in a round trip of its own:
	// a unit before warms the connection, so that the answer held back is the COMMIT's.
	unit := func(ctx context.Context, id string, arm bool) error {
		return ob.InUnit(ctx, func(ctx context.Context) error {
			if _, err := outboxpgx.Tx(ctx).Exec(ctx, `INSERT INTO applied (message_id) VALUES ($1)`, id); err != nil {
				return err
			}
			armed.Store(arm) // the next answer is the COMMIT's
			return nil
		})
	}
	if err := unit(context.Background(), "warm-up", false); err != nil {
		t.Fatal(err)
	}
	err = unit(context.Background(), "late-commit", true)
	var n int
	if qerr := pool.QueryRow(context.Background(), `SELECT count(*) FROM applied WHERE message_id = 'late-commit'`).Scan(&n); qerr != nil {
		t.Fatal(qerr)
	}
	if n != 1 {
		t.Fatalf("the server did not commit (%d rows; InUnit: %v): the test did not hold back the COMMIT's answer", n, err)
	}
	if !errors.Is(err, outbox.ErrCommitOutcomeUnknown) {
		t.Fatalf("InUnit = %v after the server committed; want ErrCommitOutcomeUnknown", err)
	}

	// A keyed unit the same way (on a new connection, warmed again): its retry finds out, and
	// replays the committed run.
	keyed := func(key string) context.Context {
		return outbox.WithIdempotencyKey(context.Background(), "late", key)
	}
	if err := unit(keyed("k0"), "keyed-warm-up", false); err != nil {
		t.Fatal(err)
	}
	if err := unit(keyed("k1"), "keyed-late", true); !errors.Is(err, outbox.ErrCommitOutcomeUnknown) {
		t.Fatalf("keyed InUnit = %v with its COMMIT answered late; want ErrCommitOutcomeUnknown", err)
	}
	retry := keyed("k1")
	if err := unit(retry, "keyed-late", false); err != nil {
		t.Fatal(err)
	}
	if _, replayed := outbox.IdempotencyResult(retry); !replayed {
		t.Fatal("the retry ran the keyed unit again after its COMMIT had taken effect")
	}
}

// HandlerTimeout ends while the COMMIT is in flight (a deferred trigger makes it slow): the
// server may well commit. The consumer path took pgx's timeout (it wraps the
// context's deadline) for a COMMIT never sent and counted a failed attempt (at MaxAttempts the
// message is dead-lettered although processed); an unknown outcome is not counted.
func TestCommitInFlightAtHandlerTimeoutIsNotCounted(t *testing.T) {
	for mname, mode := range modes {
		t.Run(mname, func(t *testing.T) {
			h := outboxtest.NewWith(t, form(mode), outbox.Config{RelayInterval: time.Hour, HandlerTimeout: time.Second, RetryDelay: -1},
				func(ctx context.Context, db *sql.DB) error {
					if err := setup(ctx, db); err != nil {
						return err
					}
					_, err := db.ExecContext(ctx, `CREATE FUNCTION slow() RETURNS trigger LANGUAGE plpgsql AS $$
							BEGIN PERFORM pg_sleep(1.5); RETURN NULL; END $$;
						CREATE CONSTRAINT TRIGGER slow AFTER INSERT ON applied DEFERRABLE INITIALLY DEFERRED
							FOR EACH ROW EXECUTE FUNCTION slow()`)
					return err
				})
			res := h.Run("c", message.NewMessage("m1", nil), consume(handler))
			t.Logf("Handle: %v", res.Err)
			if !errors.Is(res.Err, outbox.ErrCommitOutcomeUnknown) {
				t.Errorf("Handle: %v; want ErrCommitOutcomeUnknown", res.Err)
			}
			var attempts int
			if err := h.DB.QueryRow(`SELECT count(*) FROM outbox_attempts`).Scan(&attempts); err != nil {
				t.Fatal(err)
			}
			if attempts != 0 {
				t.Errorf("%d failed attempts counted for a COMMIT whose outcome was unknown (Handle: %v); want none", attempts, res.Err)
			}
		})
	}
}
