package outboxtest

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/watermill-outbox/outbox"
	"github.com/watermill-outbox/outbox/drivers/postgres"
	"github.com/watermill-outbox/outbox/internal/pgtest"
)

func TestMain(m *testing.M) { os.Exit(Main(m)) }

const pgtestEnvDSN = pgtest.EnvDSN

func setupOrders(ctx context.Context, db *sql.DB) error {
	_, err := db.ExecContext(ctx, `CREATE TABLE reservations (order_id text NOT NULL)`)
	return err
}

func applied(ctx context.Context, db *sql.DB, msg *message.Message) (int, error) {
	var n int
	err := db.QueryRowContext(ctx, `SELECT count(*) FROM reservations WHERE order_id = $1`, string(msg.Payload)).Scan(&n)
	return n, err
}

// reserve is a correct handler: its write and its two messages go through the unit of work.
func reserve(*sql.DB) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		ctx := msg.Context()
		if _, err := outbox.Tx(ctx).ExecContext(ctx, `INSERT INTO reservations VALUES ($1)`, string(msg.Payload)); err != nil {
			return nil, err
		}
		if err := outbox.Publish(outbox.WithOrderingKey(ctx, "stock"), "stock.reserved", message.NewMessage("", msg.Payload)); err != nil {
			return nil, err
		}
		return nil, outbox.Publish(ctx, "audit", message.NewMessage("", msg.Payload))
	}
}

// reserveOutsideTheTransaction writes through the pool instead of the unit of work's transaction.
func reserveOutsideTheTransaction(db *sql.DB) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		ctx := msg.Context()
		if _, err := db.ExecContext(ctx, `INSERT INTO reservations VALUES ($1)`, string(msg.Payload)); err != nil {
			return nil, err
		}
		return nil, outbox.Publish(ctx, "stock.reserved", message.NewMessage("", msg.Payload))
	}
}

func orders() []*message.Message {
	return []*message.Message{message.NewMessage("order-1", []byte("o-1"))}
}

// reserveWithTimeout also records a delayed effect (the reservation's expiry), which must be
// sent once, with its committed UUID, whatever crashed before it was due.
func reserveWithTimeout(*sql.DB) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		ctx := msg.Context()
		if _, err := outbox.Tx(ctx).ExecContext(ctx, `INSERT INTO reservations VALUES ($1)`, string(msg.Payload)); err != nil {
			return nil, err
		}
		expiry := outbox.WithCancelKey(outbox.WithDelay(ctx, 300*time.Millisecond), "expiry/"+string(msg.Payload))
		if err := outbox.Publish(expiry, "reservation.expired", message.NewMessage("", msg.Payload)); err != nil {
			return nil, err
		}
		return nil, outbox.Publish(ctx, "stock.reserved", message.NewMessage("", msg.Payload))
	}
}

// The matrix covers delayed effects: a crash at any step of the unit of work comes before the
// due time; the copies and the later delivery must not send the delayed effect early or twice,
// and the relay sends it once when due.
func TestCrashMatrixDelayedEffects(t *testing.T) {
	CrashMatrix{Consumer: "reserve", Handler: reserveWithTimeout, Messages: orders(), Setup: setupOrders, Applied: applied,
		Config: outbox.Config{RelayInterval: 20 * time.Millisecond}}.Run(t)
}

func TestCrashMatrixPassesACorrectHandler(t *testing.T) {
	CrashMatrix{Consumer: "reserve", Handler: reserve, Messages: orders(), Setup: setupOrders, Applied: applied}.Run(t)
}

// The matrix catches a handler that writes outside the transaction: a crash after the handler
// rolls the claim back but not that write, and the redelivery applies it again.
func TestCrashMatrixCatchesAWriteOutsideTheTransaction(t *testing.T) {
	c := CrashMatrix{Consumer: "reserve", Handler: reserveOutsideTheTransaction, Messages: orders(), Setup: setupOrders, Applied: applied}
	failures := c.scenario(t, orders()[0], outbox.FailpointAfterHandler, 2)
	if len(failures) == 0 || !strings.Contains(failures[0], "happened 2 times") {
		t.Fatalf("failures: %q, want the business change reported twice", failures)
	}
	if failures := c.scenario(t, orders()[0], "", 2); len(failures) != 0 {
		t.Fatalf("without a crash: %q, want none (the flaw shows only with a crash)", failures)
	}
}

// A crash the matrix never injected passed as the no-crash scenario: an Open that builds its
// Config without the matrix's Failpoint turned every crash scenario into a repeat of the first.
func TestCrashMatrixCatchesACrashNeverInjected(t *testing.T) {
	open := func(t testing.TB, dsn string, cfg outbox.Config) (*outbox.Outbox, error) {
		db, err := sql.Open("postgres", dsn)
		if err != nil {
			return nil, err
		}
		t.Cleanup(func() { _ = db.Close() })
		cfg.DB, cfg.Driver, cfg.Failpoint = db, postgres.Driver{}, nil
		return outbox.New(cfg)
	}
	c := CrashMatrix{Consumer: "reserve", Handler: reserve, Messages: orders(), Setup: setupOrders, Applied: applied, Open: open}
	for _, point := range []string{outbox.FailpointAfterCommit, outbox.FailpointAfterPublish} {
		failures := c.scenario(t, orders()[0], point, 2)
		if len(failures) == 0 || !strings.Contains(failures[0], "never injected") {
			t.Errorf("%s: failures %q, want the crash reported as never injected", point, failures)
		}
	}
	if failures := c.scenario(t, orders()[0], "", 2); len(failures) != 0 {
		t.Fatalf("without a crash: %q, want none", failures)
	}
}

// The matrix catches a side effect that a crash loses: here the handler records its audit
// effect only at its first call (as a framework path that dropped a redelivery's effects would
// look). The crash after the handler rolls the first call back, and the redelivery commits the
// business change and one effect: nothing was sent twice and nothing committed was lost, so only
// the comparison with the run without a crash tells.
func TestCrashMatrixCatchesAnEffectLostByACrash(t *testing.T) {
	var mu sync.Mutex
	calls := map[string]int{}
	forgetful := func(*sql.DB) message.HandlerFunc {
		return func(msg *message.Message) ([]*message.Message, error) {
			ctx := msg.Context()
			mu.Lock()
			calls[msg.UUID]++
			first := calls[msg.UUID] == 1
			mu.Unlock()
			if _, err := outbox.Tx(ctx).ExecContext(ctx, `INSERT INTO reservations VALUES ($1)`, string(msg.Payload)); err != nil {
				return nil, err
			}
			if err := outbox.Publish(ctx, "stock.reserved", message.NewMessage("", msg.Payload)); err != nil || !first {
				return nil, err
			}
			return nil, outbox.Publish(ctx, "audit", message.NewMessage("", msg.Payload))
		}
	}
	c := CrashMatrix{Consumer: "reserve", Handler: forgetful, Messages: orders(), Setup: setupOrders, Applied: applied}
	failures, baseline := c.run(t, orders()[0], "", 2, nil)
	if len(failures) != 0 || len(baseline) != 2 {
		t.Fatalf("without a crash: %q, effects %q; want no failure and two effects", failures, baseline)
	}
	clear(calls)
	failures, _ = c.run(t, orders()[0], outbox.FailpointAfterHandler, 2, baseline)
	if len(failures) == 0 || !strings.Contains(failures[0], "differ from those of the run without a crash") {
		t.Fatalf("failures: %q, want the lost effect reported", failures)
	}
}

func TestRunReturnsWhatTheUnitOfWorkCommitted(t *testing.T) {
	h := New(t, outbox.Config{}, setupOrders)
	msg := message.NewMessage("order-2", []byte("o-2"))
	msg.Metadata.Set("correlation_id", "c-9")
	res := h.Run("reserve", msg, reserve(h.DB))
	if res.Err != nil || !res.Committed || len(res.Effects) != 2 || len(res.Sent) != 2 {
		t.Fatalf("Run: %+v, want committed with two effects sent", res)
	}
	e := res.Effects[0]
	if e.Topic != "stock.reserved" || e.OrderingKey != "stock" || string(e.Payload) != "o-2" ||
		e.Metadata[outbox.MetadataCausationID] != "order-2" || e.Metadata["correlation_id"] != "c-9" {
		t.Errorf("first effect: %+v", e)
	}
	if res.Effects[1].OrderingKey != "reserve/order-2" {
		t.Errorf("second effect's ordering key %q, want the default reserve/order-2", res.Effects[1].OrderingKey)
	}
	again := h.Run("reserve", msg, reserve(h.DB))
	if again.Err != nil || len(again.Sent) != 0 || len(again.Effects) != 2 {
		t.Errorf("a duplicate: %+v, want acked with nothing new", again)
	}
	failed := h.Run("reserve", message.NewMessage("order-3", []byte("o-3")), func(*message.Message) ([]*message.Message, error) {
		return nil, errors.New("boom")
	})
	if failed.Err == nil || failed.Committed || len(failed.Effects) != 0 {
		t.Errorf("a failing handler: %+v, want nacked, nothing committed", failed)
	}
}

func TestWaitIdle(t *testing.T) {
	h := New(t, outbox.Config{RelayInterval: 10 * time.Millisecond}, nil)
	ctx := context.Background()
	h.Pub.Fail(errors.New("broker down"))
	if err := h.Ob.InTx(ctx, func(ctx context.Context, tx *sql.Tx) error {
		return outbox.Publish(ctx, "events", message.NewMessage("", nil))
	}); err != nil {
		t.Fatal(err)
	}
	short, cancel := context.WithTimeout(ctx, 3*time.Second)
	defer cancel()
	if err := h.Ob.WaitIdle(short); err == nil || !strings.Contains(err.Error(), "1 side effects still pending") {
		t.Fatalf("WaitIdle during the outage: %v, want the pending effect reported", err)
	}
	cancelled, cancelNow := context.WithCancel(ctx)
	cancelNow()
	if err := h.Ob.WaitIdle(cancelled); !errors.Is(err, context.Canceled) {
		t.Fatalf("WaitIdle with a cancelled context: %v, want context.Canceled", err)
	}
	h.Pub.Fail(nil)
	runCtx, stop := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- h.Ob.Run(runCtx) }()
	defer func() { stop(); <-done }()
	waitCtx, cancelWait := context.WithTimeout(ctx, 30*time.Second)
	defer cancelWait()
	if err := h.Ob.WaitIdle(waitCtx); err != nil {
		t.Fatal(err)
	}
	if n := len(h.Pub.Messages("events")); n != 1 {
		t.Errorf("%d messages on events, want 1", n)
	}
}

func TestEnvDSNIsPgtests(t *testing.T) {
	if EnvDSN != pgtestEnvDSN {
		t.Fatalf("EnvDSN %q, but the server is taken from %q", EnvDSN, pgtestEnvDSN)
	}
}

// spills counts the units of reserveInSteps whose claim held effects after their second record
// and none after their third: they had moved to rows.
var spills atomic.Int32

// reserveInSteps records four messages of the message's own key one call at a time, the third
// inside a savepoint that it rolls back.
func reserveInSteps(*sql.DB) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		ctx := msg.Context()
		tx := outbox.Tx(ctx)
		if _, err := tx.ExecContext(ctx, `INSERT INTO reservations VALUES ($1)`, string(msg.Payload)); err != nil {
			return nil, err
		}
		var inClaim [2]bool // the claim held effects after the second record, after the third
		for i, step := range []string{"first", "second", "sp", "undone", "rb", "third", "fourth"} {
			var err error
			switch step {
			case "sp":
				_, err = tx.ExecContext(ctx, `SAVEPOINT sp`)
			case "rb":
				_, err = tx.ExecContext(ctx, `ROLLBACK TO SAVEPOINT sp`)
			default:
				err = outbox.Publish(ctx, "steps", message.NewMessage("", []byte(step)))
			}
			if err != nil {
				return nil, err
			}
			if i == 1 || i == 3 {
				if err := tx.QueryRowContext(ctx, `SELECT effects IS NOT NULL FROM outbox_processed WHERE message_id = $1`, msg.UUID).Scan(&inClaim[i/2]); err != nil {
					return nil, err
				}
			}
		}
		if inClaim[0] && !inClaim[1] {
			spills.Add(1)
		}
		return nil, nil
	}
}

// The matrix on units that move the effects kept in their claim to rows at their third record,
// inside a savepoint that they roll back (postgres.Driver.MaxInlineBytes), on the database/sql
// form: what commits is kept in one place, in order, and sent once with its committed UUIDs.
func TestCrashMatrixSpillingUnits(t *testing.T) {
	spills.Store(0)
	open := func(t testing.TB, dsn string, cfg outbox.Config) (*outbox.Outbox, error) {
		db, err := sql.Open("postgres", dsn)
		if err != nil {
			return nil, err
		}
		t.Cleanup(func() { _ = db.Close() })
		cfg.DB, cfg.Driver = db, postgres.Driver{MaxInlineBytes: 400}
		return outbox.New(cfg)
	}
	CrashMatrix{Consumer: "reserve", Handler: reserveInSteps, Messages: orders(), Setup: setupOrders, Applied: applied, Open: open}.Run(t)
	if spills.Load() == 0 {
		t.Fatal("no unit moved its effects to rows at its third record: the matrix did not cover a spill")
	}
}

// The matrix with PostgreSQL's effects table rotating every 50 ms (postgres.Driver.RotateEvery,
// 10 s by default, longer than a scenario): the relay moves what is pending and truncates
// partitions while copies, crashes and the later delivery run. At least one scenario must have
// rotated, or the matrix did not cover a rotation. The relay runs only from the end of the
// deliveries until nothing is pending, which on a loaded machine may leave no scenario of a run
// time for a rotation: the matrix runs again, up to 3 times, until one rotated.
func TestCrashMatrixRotatingEffects(t *testing.T) {
	var rotated atomic.Int32
	open := openWatched(postgres.Driver{RotateEvery: 50 * time.Millisecond}, func(t testing.TB, db *sql.DB) {
		var gen int
		if err := db.QueryRow(`SELECT gen FROM outbox_effects_rotation`).Scan(&gen); err == nil && gen != 0 {
			rotated.Add(1)
		}
	})
	for try := 1; rotated.Load() == 0; try++ {
		if try > 3 {
			t.Fatal("no scenario rotated the effects table in 3 runs of the matrix: the matrix did not cover a rotation")
		}
		t.Run(fmt.Sprint("run-", try), func(t *testing.T) {
			CrashMatrix{Consumer: "reserve", Handler: reserveWithTimeout, Messages: orders(), Setup: setupOrders, Applied: applied, Open: open,
				Config: outbox.Config{RelayInterval: 20 * time.Millisecond}}.Run(t)
		})
	}
	t.Logf("%d scenarios ended with another partition current", rotated.Load())
}

// reserveUnkeyed is reserve without an ordering key: its effects stay in the claim (inline),
// whose marks may ride on the next claim (a keyed effect is a row, whose mark does not ride).
func reserveUnkeyed(*sql.DB) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		ctx := msg.Context()
		if _, err := outbox.Tx(ctx).ExecContext(ctx, `INSERT INTO reservations VALUES ($1)`, string(msg.Payload)); err != nil {
			return nil, err
		}
		if err := outbox.Publish(ctx, "stock.reserved", message.NewMessage("", msg.Payload)); err != nil {
			return nil, err
		}
		return nil, outbox.Publish(ctx, "audit", message.NewMessage("", msg.Payload))
	}
}

// The matrix with EffectRetention 0, the default: sent effects are deleted when marked (an audit
// keeps them for the check), and the mark of a carrier message delivered just before rides on
// the claim of the unit that crashes, at every step: in a unit that rolls back (after the claim,
// after the handler) the mark is handed back and written anyway; in one that commits it is
// written with the claim. At least one scenario must have carried a mark on a claim, or the
// matrix did not cover a ride. The keyed handler's effects are rows, deleted when marked, whose
// marks do not ride.
func TestCrashMatrixDeleteSent(t *testing.T) {
	for _, c := range []struct {
		name    string
		handler func(*sql.DB) message.HandlerFunc
		rides   bool
	}{{"unkeyed", reserveUnkeyed, true}, {"keyed", reserve, false}} {
		t.Run(c.name, func(t *testing.T) {
			var rode atomic.Int32
			open := openWatched(postgres.Driver{}, func(t testing.TB, db *sql.DB) {
				var n int
				if err := db.QueryRow(`SELECT count(*) FROM outbox_crash_audit c JOIN outbox_crash_audit m ON m.xid = c.xid
					WHERE c.what = 'claim' AND m.what = 'inline' AND m.source <> c.source`).Scan(&n); err != nil {
					t.Errorf("read the audit: %v", err)
				}
				rode.Add(int32(n))
			})
			two := []*message.Message{message.NewMessage("order-1", []byte("o-1")), message.NewMessage("order-2", []byte("o-2"))}
			CrashMatrix{Consumer: "reserve", Handler: c.handler, Messages: two, Setup: setupOrders, Applied: applied, Open: open, DeleteSent: true}.Run(t)
			if c.rides && rode.Load() == 0 {
				t.Fatal("no carrier's mark rode on a claim: the matrix did not cover a ride")
			}
			t.Logf("%d marks rode on a claim", rode.Load())
		})
	}
}

// openWatched opens each scenario's Outbox with driver on a pool of its own, and calls atEnd with
// that pool when the scenario ends, before the pool closes.
func openWatched(driver postgres.Driver, atEnd func(t testing.TB, db *sql.DB)) Opener {
	return func(t testing.TB, dsn string, cfg outbox.Config) (*outbox.Outbox, error) {
		db, err := sql.Open("postgres", dsn)
		if err != nil {
			return nil, err
		}
		t.Cleanup(func() { _ = db.Close() })
		t.Cleanup(func() { atEnd(t, db) })
		cfg.DB, cfg.Driver = db, driver
		return outbox.New(cfg)
	}
}
