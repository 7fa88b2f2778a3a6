package outboxpgx_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/watermill-outbox/outbox"
	"github.com/watermill-outbox/outbox/drivers/outboxpgx"
	"github.com/watermill-outbox/outbox/internal/pgtest"
	"github.com/watermill-outbox/outbox/outboxtest"
)

// writesPerMessage is how many units of work each form runs in TestWritesPerMessage.
const writesPerMessage = 40

// measureWrites runs n units of work through a fresh pgx-form Outbox in mode and returns what
// they wrote to each table, the background marks included. The pool is closed before the counts
// are read (a backend reports them at its exit), and the migration's writes are left out.
func measureWrites(t *testing.T, n int, mode outboxpgx.Concurrency, unit func(ctx context.Context, ob *outbox.Outbox, i int) error) map[string]pgtest.Writes {
	t.Helper()
	return measureWritesWith(t, n, mode, nil, unit, nil)
}

// measureWritesWith is measureWrites on an Outbox whose configuration mutate changes (when not
// nil), followed by then (when not nil), whose writes count too.
func measureWritesWith(t *testing.T, n int, mode outboxpgx.Concurrency, mutate func(*outbox.Config),
	unit func(ctx context.Context, ob *outbox.Outbox, i int) error, then func(ctx context.Context, ob *outbox.Outbox, reader *sql.DB)) map[string]pgtest.Writes {
	t.Helper()
	ctx := context.Background()
	dsn := outboxtest.DSN(t)
	reader, err := sql.Open("postgres", dsn)
	if err != nil {
		t.Fatal(err)
	}
	defer reader.Close()
	phase := func(do func(ob *outbox.Outbox)) {
		pool, err := pgxpool.New(ctx, dsn)
		if err != nil {
			t.Fatal(err)
		}
		defer pool.Close()
		cfg := outbox.Config{Publisher: &outboxtest.Recorder{}}
		if mutate != nil {
			mutate(&cfg)
		}
		ob, err := outboxpgx.New(pool, cfg, outboxpgx.WithConcurrency(mode))
		if err != nil {
			t.Fatal(err)
		}
		do(ob)
		if err := ob.Close(); err != nil { // waits for the background marks
			t.Fatal(err)
		}
	}
	phase(func(ob *outbox.Outbox) {
		if err := ob.Migrate(ctx); err != nil {
			t.Fatal(err)
		}
		if _, err := reader.Exec(`CREATE TABLE applied (message_id text NOT NULL, note text NOT NULL DEFAULT '')`); err != nil {
			t.Fatal(err)
		}
	})
	before := pgtest.TableWrites(t, reader, "public")
	phase(func(ob *outbox.Outbox) {
		for i := range n {
			if err := unit(ctx, ob, i); err != nil {
				t.Fatalf("unit %d: %v", i, err)
			}
		}
		if then != nil {
			then(ctx, ob, reader)
		}
	})
	got, names := pgtest.WritesSince(pgtest.TableWrites(t, reader, "public"), before)
	for _, name := range names {
		t.Logf("%-20s per unit: %s", name, got[name].Per(n))
	}
	return got
}

// atMost fails the test unless every count of got is at most n times the one of want.
func atMost(t *testing.T, what string, got pgtest.Writes, n int, want pgtest.Writes) {
	t.Helper()
	if got.Inserts > want.Inserts*int64(n) || got.Updates > want.Updates*int64(n) ||
		got.NonHOT() > want.NonHOT()*int64(n) || got.Deletes > want.Deletes*int64(n) {
		t.Errorf("%s: %s per unit, want at most %s", what, got.Per(n), want.Per(1))
	}
}

// TestWritesPerMessage counts the row versions a unit of work with two effects writes to the
// outbox tables in each mode of the pgx form, its mark included (docs/benchmarks.md, "Writes per
// message"; the database/sql forms: the root module's test of that name). The bounds are what the
// forms write today; a change that writes more per message fails here.
func TestWritesPerMessage(t *testing.T) {
	record := func(ctx context.Context, tx pgx.Tx, id string) error {
		if _, err := tx.Exec(ctx, `INSERT INTO applied (message_id) VALUES ($1)`, id); err != nil {
			return err
		}
		if err := outbox.Publish(ctx, "out_a", message.NewMessage(watermill.NewUUID(), []byte(`{"step":1}`))); err != nil {
			return err
		}
		return outbox.Publish(ctx, "out_b", message.NewMessage(watermill.NewUUID(), []byte(`{"step":2}`)))
	}
	consume := func(ctx context.Context, ob *outbox.Outbox, i int) error {
		msg := message.NewMessage(fmt.Sprint("m-", i), nil)
		return ob.Handle(msg, outbox.HandleParams{Consumer: "c1", MessageID: msg.UUID}, func(msg *message.Message) ([]*message.Message, error) {
			return nil, record(msg.Context(), outboxpgx.Tx(msg.Context()), msg.UUID)
		})
	}

	t.Run("optimistic", func(t *testing.T) {
		// The claim is written at COMMIT with the effects in it; the mark clears them.
		got := measureWrites(t, writesPerMessage, outboxpgx.Optimistic, consume)
		atMost(t, "claims", got["outbox_processed"], writesPerMessage, pgtest.Writes{Inserts: 1, Updates: 1, HOT: 1})
		atMost(t, "effect rows", got["outbox_effects_all"], writesPerMessage, pgtest.Writes{})
	})
	t.Run("pessimistic", func(t *testing.T) {
		// The claim is written at BEGIN, the effects as rows at COMMIT; the mark deletes them.
		got := measureWrites(t, writesPerMessage, outboxpgx.Pessimistic, consume)
		atMost(t, "claims", got["outbox_processed"], writesPerMessage, pgtest.Writes{Inserts: 1})
		atMost(t, "effect rows", got["outbox_effects_all"], writesPerMessage, pgtest.Writes{Inserts: 2, Deletes: 2})
	})
	t.Run("boundary", func(t *testing.T) {
		got := measureWrites(t, writesPerMessage, outboxpgx.Optimistic, func(ctx context.Context, ob *outbox.Outbox, i int) error {
			return outboxpgx.InTx(ctx, ob, func(ctx context.Context, tx pgx.Tx) error { return record(ctx, tx, fmt.Sprint("b-", i)) })
		})
		atMost(t, "claims", got["outbox_processed"], writesPerMessage, pgtest.Writes{})
		atMost(t, "effect rows", got["outbox_effects_all"], writesPerMessage, pgtest.Writes{Inserts: 2, Deletes: 2})
	})

	t.Run("optimistic, left to the relay", func(t *testing.T) {
		// Units that crash after their commit leave their effects in their claims: the relay's
		// sweep moves them to rows (an update of the claim), leases each key's first (an update of
		// a row), sends them and marks them (the rows deleted, the claim's dispatch time moved).
		crash := errors.New("crash after the commit")
		var crashing atomic.Bool
		crashing.Store(true)
		got := measureWritesWith(t, writesPerMessage, outboxpgx.Optimistic, func(c *outbox.Config) {
			c.RelayGrace, c.RelayInterval = time.Millisecond, 20*time.Millisecond
			c.Failpoint = func(_ context.Context, point string) error {
				if point == outbox.FailpointAfterCommit && crashing.Load() {
					return crash
				}
				return nil
			}
		}, func(ctx context.Context, ob *outbox.Outbox, i int) error {
			if err := consume(ctx, ob, i); !errors.Is(err, crash) {
				return fmt.Errorf("want the crash, got %w", err)
			}
			return nil
		}, func(ctx context.Context, ob *outbox.Outbox, reader *sql.DB) {
			crashing.Store(false)
			ctx, cancel := context.WithCancel(ctx)
			done := make(chan error, 1)
			go func() { done <- ob.Run(ctx) }()
			deadline := time.Now().Add(30 * time.Second)
			for {
				var n int
				if err := reader.QueryRow(`SELECT (SELECT count(*) FROM outbox_effects_all)
					+ (SELECT count(*) FROM outbox_processed WHERE effects IS NOT NULL)`).Scan(&n); err != nil {
					t.Fatal(err)
				}
				if n == 0 {
					break
				}
				if time.Now().After(deadline) {
					t.Fatalf("%d effects still pending after 30 s", n)
				}
				time.Sleep(20 * time.Millisecond)
			}
			cancel()
			if err := <-done; err != nil && !errors.Is(err, context.Canceled) {
				t.Fatal(err)
			}
		})
		// The sweep clears the claims of a page in one transaction, and a page filled with claims
		// that hold their effects has no room for all of their new versions at once: 3 of the 80
		// updates are not HOT.
		claims := got["outbox_processed"]
		atMost(t, "claims", pgtest.Writes{Inserts: claims.Inserts, Updates: claims.Updates, HOT: claims.Updates, Deletes: claims.Deletes},
			writesPerMessage, pgtest.Writes{Inserts: 1, Updates: 2, HOT: 2})
		if claims.NonHOT() > writesPerMessage/10 {
			t.Errorf("claims: %s per unit, want at most 0.1 non-HOT updates", claims.Per(writesPerMessage))
		}
		atMost(t, "effect rows", got["outbox_effects_all"], writesPerMessage, pgtest.Writes{Inserts: 2, Updates: 1, HOT: 1, Deletes: 2})
	})
}
