package sqlite_test

import (
	"context"
	"database/sql"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/watermill-outbox/outbox"
	"github.com/watermill-outbox/outbox/drivers/sqlite"
	"github.com/watermill-outbox/outbox/outboxtest"
)

// TestRollbackSentAsSQLThenPublish: a handler that sends ROLLBACK through the unit's *sql.Tx and
// then publishes, now and delayed. The connection then runs in autocommit: each write finds the
// claim gone, writes nothing and returns ErrTxFinishedByHandler; nothing is sent for the
// rolled-back work. The effect rows and the delayed one committed on their own, and the relay
// sent the effects of work that had been rolled back.
func TestRollbackSentAsSQLThenPublish(t *testing.T) {
	db := openDB(t)
	pub := &outboxtest.Recorder{}
	ob, err := outbox.New(outbox.Config{DB: db, Driver: sqlite.Driver{}, Publisher: pub, RetryDelay: -1})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = ob.Close() })
	if err := ob.Migrate(context.Background()); err != nil {
		t.Fatal(err)
	}
	if _, err := db.Exec(`CREATE TABLE reservations (id TEXT NOT NULL)`); err != nil {
		t.Fatal(err)
	}
	// Another unit's delayed effect with a cancel key, which the cancel after the ROLLBACK must
	// leave alone (in autocommit it deleted it).
	if err := ob.InTx(context.Background(), func(ctx context.Context, _ *sql.Tx) error {
		return outbox.Publish(outbox.WithDelay(outbox.WithCancelKey(ctx, "order-1"), time.Hour), "stock_reserved", message.NewMessage("other", nil))
	}); err != nil {
		t.Fatal(err)
	}
	msg := message.NewMessage("order-1", []byte("o-1"))
	var after, delayed, cancelled error
	h := func(msg *message.Message) ([]*message.Message, error) {
		ctx := msg.Context()
		tx := outbox.Tx(ctx)
		if _, err := tx.ExecContext(ctx, `INSERT INTO reservations VALUES (?)`, msg.UUID); err != nil {
			return nil, err
		}
		if err := outbox.Publish(ctx, "stock_reserved", message.NewMessage("before", nil)); err != nil {
			return nil, err
		}
		if _, err := tx.ExecContext(ctx, "ROLLBACK"); err != nil {
			return nil, err
		}
		after = outbox.Publish(ctx, "stock_reserved", message.NewMessage("after-1", nil), message.NewMessage("after-2", nil))
		delayed = outbox.Publish(outbox.WithDelay(ctx, time.Hour), "stock_reserved", message.NewMessage("after-3", nil))
		_, cancelled = outbox.CancelDelayed(ctx, "order-1")
		return nil, nil
	}
	err = ob.Handle(msg.Copy(), outbox.HandleParams{Consumer: "reserve", MessageID: msg.UUID}, h)
	if !errors.Is(after, outbox.ErrTxFinishedByHandler) || !errors.Is(delayed, outbox.ErrTxFinishedByHandler) ||
		!errors.Is(cancelled, outbox.ErrTxFinishedByHandler) {
		t.Errorf("Publish after ROLLBACK: %v, delayed: %v, CancelDelayed: %v; want ErrTxFinishedByHandler", after, delayed, cancelled)
	}
	if !errors.Is(err, outbox.ErrTxFinishedByHandler) {
		t.Errorf("Handle: %v; want ErrTxFinishedByHandler", err)
	}
	var other int
	if err := db.QueryRow(`SELECT count(*) FROM outbox_delayed WHERE cancel_key = 'order-1'`).Scan(&other); err != nil || other != 1 {
		t.Errorf("the other unit's delayed effect: %d left, %v; want it kept", other, err)
	}
	if _, err := db.Exec(`DELETE FROM outbox_delayed WHERE cancel_key = 'order-1'`); err != nil {
		t.Fatal(err)
	}
	for _, table := range []string{"outbox_effects", "outbox_delayed", "reservations"} {
		var n int
		if err := db.QueryRow(`SELECT count(*) FROM ` + table).Scan(&n); err != nil {
			t.Fatal(err)
		}
		if n != 0 {
			t.Errorf("%d rows in %s committed, want none", n, table)
		}
	}
	if n := len(pub.All()); n != 0 {
		t.Errorf("%d messages sent for rolled-back work, want none", n)
	}
}

// A unit whose record of side effects the store refused, and whose function ignored the error,
// committed the business writes without the effects on SQLite (and MySQL), whose failed
// statement leaves the transaction open: the effects were never sent. Now nothing commits, at
// the boundary and in a handler.
func TestIgnoredRecordFailureCommitsNothing(t *testing.T) {
	db := openDB(t)
	pub := &outboxtest.Recorder{}
	ob, err := outbox.New(outbox.Config{DB: db, Driver: sqlite.Driver{}, Publisher: pub, RetryDelay: -1})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = ob.Close() })
	ctx := context.Background()
	if err := ob.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	for _, q := range []string{`CREATE TABLE reservations (id TEXT NOT NULL)`,
		`CREATE TRIGGER refuse BEFORE INSERT ON outbox_effects BEGIN SELECT RAISE(ABORT, 'effects refused'); END`} {
		if _, err := db.Exec(q); err != nil {
			t.Fatal(err)
		}
	}
	var ignored []error
	work := func(ctx context.Context, tx *sql.Tx, id string) error {
		if _, err := tx.ExecContext(ctx, `INSERT INTO reservations VALUES (?)`, id); err != nil {
			return err
		}
		ignored = append(ignored, outbox.Publish(ctx, "stock_reserved", message.NewMessage("u-"+id, nil)))
		return nil
	}
	err = ob.InTx(ctx, func(ctx context.Context, tx *sql.Tx) error { return work(ctx, tx, "boundary") })
	if err == nil || !strings.Contains(err.Error(), "effects refused") {
		t.Errorf("InTx: %v; want the store's refusal", err)
	}
	msg := message.NewMessage("order-1", nil)
	err = ob.Handle(msg, outbox.HandleParams{Consumer: "reserve", MessageID: msg.UUID}, func(m *message.Message) ([]*message.Message, error) {
		return nil, work(m.Context(), outbox.Tx(m.Context()), "handler")
	})
	if err == nil || !strings.Contains(err.Error(), "effects refused") {
		t.Errorf("Handle: %v; want the store's refusal", err)
	}
	for i, e := range ignored {
		if e == nil {
			t.Errorf("Publish %d: nil; want the store's refusal", i)
		}
	}
	var n int
	if err := db.QueryRow(`SELECT count(*) FROM reservations`).Scan(&n); err != nil || n != 0 {
		t.Errorf("%d reservations committed without their effects (%v); want none", n, err)
	}
}

// Cleanup's batches find what they delete through an index (migration 012): without one, each
// batch scanned the effects kept for EffectRetention and the attempt counters whole, holding
// the database's only write lock while it did, and every unit of work waited for it. The
// statements are those of the driver's cleanup, in the shape it runs them.
func TestCleanupBatchesUseAnIndex(t *testing.T) {
	db := openDB(t)
	ob, err := outbox.New(outbox.Config{DB: db, Driver: sqlite.Driver{}, Publisher: &outboxtest.Recorder{}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = ob.Close() })
	if err := ob.Migrate(context.Background()); err != nil {
		t.Fatal(err)
	}
	for _, q := range []string{
		`SELECT id FROM outbox_effects WHERE dispatched_at < '2026-01-01' ORDER BY dispatched_at LIMIT 1000`,
		`SELECT consumer, message_id FROM outbox_attempts WHERE last_failed_at < '2026-01-01' LIMIT 1000`,
	} {
		rows, err := db.Query(`EXPLAIN QUERY PLAN ` + q)
		if err != nil {
			t.Fatal(err)
		}
		var plan []string
		for rows.Next() {
			var id, parent, unused int
			var detail string
			if err := rows.Scan(&id, &parent, &unused, &detail); err != nil {
				t.Fatal(err)
			}
			plan = append(plan, detail)
		}
		_ = rows.Close()
		if p := strings.Join(plan, "; "); !strings.Contains(p, "USING INDEX") && !strings.Contains(p, "USING COVERING INDEX") {
			t.Errorf("%s: plan %q scans the table", q, p)
		}
	}
}
