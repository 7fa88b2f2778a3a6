package outboxpgx_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"

	"github.com/watermill-outbox/outbox"
	"github.com/watermill-outbox/outbox/drivers/outboxpgx"
	"github.com/watermill-outbox/outbox/outboxtest"
)

// A delayed effect goes to the delayed table in both modes, never inline in the optimistic
// mode's claim (whose inline effects are the ones sent after commit): it is not sent after the
// commit, a savepoint rolled back takes it along, a later unit of work cancels it, and the
// relay sends the others once due, once each.
func TestDelayedEffects(t *testing.T) {
	for name, mode := range modes {
		t.Run(name, func(t *testing.T) { delayedEffects(t, mode) })
	}
}

func delayedEffects(t *testing.T, mode outboxpgx.Concurrency) {
	pool := openPool(t, outboxtest.DSN(t), 8, nil)
	ctx := context.Background()
	rec := &outboxtest.Recorder{}
	ob := ready(t, pool, outbox.Config{Publisher: rec, RelayInterval: time.Hour}, outboxpgx.WithConcurrency(mode))
	const delay = 1200 * time.Millisecond
	h := func(msg *message.Message) error {
		ctx := msg.Context()
		tx := outboxpgx.Tx(ctx)
		if err := outbox.Publish(ctx, "out", message.NewMessage("now-"+msg.UUID, nil)); err != nil {
			return err
		}
		dctx := outbox.WithCancelKey(outbox.WithDelay(ctx, delay), "timeout/"+msg.UUID)
		if err := outbox.Publish(dctx, "later", message.NewMessage("later-"+msg.UUID, nil)); err != nil {
			return err
		}
		// One more inside a savepoint that rolls back: never stored, never sent.
		sp, err := tx.Begin(ctx)
		if err != nil {
			return err
		}
		if err := outbox.Publish(dctx, "later", message.NewMessage("rolledback-"+msg.UUID, nil)); err != nil {
			return err
		}
		return sp.Rollback(ctx)
	}
	recorded := time.Now()
	for _, id := range []string{"a", "b"} {
		if err := ob.Handle(message.NewMessage(id, nil), outbox.HandleParams{Consumer: "c", MessageID: id}, consume(h)); err != nil {
			t.Fatal(err)
		}
	}
	ob.FlushMarks()
	if n := len(rec.Messages("out")); n != 2 {
		t.Fatalf("%d messages sent after commit; want 2", n)
	}
	if n := len(rec.Messages("later")); n != 0 {
		t.Fatalf("%d delayed messages sent after commit; want none", n)
	}
	var inlineLeft, delayed int
	if err := pool.QueryRow(ctx, `SELECT (SELECT count(*) FROM outbox_processed WHERE effects IS NOT NULL),
		(SELECT count(*) FROM outbox_delayed)`).Scan(&inlineLeft, &delayed); err != nil {
		t.Fatal(err)
	}
	if inlineLeft != 0 || delayed != 2 {
		t.Fatalf("%d claims with inline effects left, %d delayed effects; want 0, 2", inlineLeft, delayed)
	}
	// The payment of b arrives: its timeout is cancelled with the payment's write.
	var cancelled int
	err := outboxpgx.InTx(ctx, ob, func(ctx context.Context, tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, `INSERT INTO applied (message_id, note) VALUES ('b', 'paid')`); err != nil {
			return err
		}
		var err error
		cancelled, err = outbox.CancelDelayed(ctx, "timeout/b")
		return err
	})
	if err != nil || cancelled != 1 {
		t.Fatalf("cancel: %d cancelled, %v; want 1", cancelled, err)
	}

	runCtx, stop := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- ob.Run(runCtx) }()
	defer func() { stop(); <-done }()
	deadline := time.Now().Add(20 * time.Second)
	for len(rec.Messages("later")) == 0 {
		if time.Now().After(deadline) {
			t.Fatal("the delayed message was not sent")
		}
		time.Sleep(10 * time.Millisecond)
	}
	// The due time woke the relay, not its poll (an hour); the bound leaves room for a loaded machine.
	if took := time.Since(recorded); took < delay || took > delay+5*time.Second {
		t.Errorf("the delayed message was sent %s after it was recorded; due after %s (RelayInterval 1 h)", took, delay)
	} else {
		t.Logf("sent %s after it was due", took-delay)
	}
	time.Sleep(300 * time.Millisecond)
	var got []string
	for _, m := range rec.Messages("later") {
		got = append(got, m.UUID)
	}
	if len(got) != 1 || got[0] != "later-a" {
		t.Fatalf("delayed messages sent: %v; want [later-a] once (b's was cancelled)", got)
	}
	// JoinTx: a delayed effect stored in the caller's transaction, not sent by dispatch.
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	jctx, dispatch, err := outboxpgx.JoinTx(ctx, ob, tx)
	if err != nil {
		t.Fatal(err)
	}
	if err := outbox.Publish(outbox.WithDelay(jctx, time.Hour), "later", message.NewMessage("joined", nil)); err != nil {
		t.Fatal(err)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	dispatch(ctx)
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM outbox_delayed WHERE uuid = 'joined'`).Scan(&delayed); err != nil || delayed != 1 {
		t.Fatalf("the joined unit's delayed effect: %d stored (%v)", delayed, err)
	}
	if n := len(rec.Messages("later")); n != 1 {
		t.Fatalf("%d delayed messages sent; the joined one is not due", n)
	}
	if _, err := outbox.CancelDelayed(ctx, "x"); !errors.Is(err, outbox.ErrNoUnitOfWork) {
		t.Fatalf("cancel outside a unit of work: %v", err)
	}
}

// The crash matrix with a delayed effect (the optimistic mode's claim keeps the others inline):
// whatever crashes before the due time, it is sent once, by the relay, when due.
func TestCrashMatrixDelayedEffect(t *testing.T) {
	for name, mode := range modes {
		t.Run(name, func(t *testing.T) {
			crashMatrixOf(t, form(mode), func(msg *message.Message) error {
				if err := handler(msg); err != nil {
					return err
				}
				ctx := outbox.WithCancelKey(outbox.WithDelay(msg.Context(), 300*time.Millisecond), "expiry/"+msg.UUID)
				return outbox.Publish(ctx, "expired", message.NewMessage("expired-"+msg.UUID, nil))
			})
		})
	}
}

// A delayed effect due while its unit's other effects are still inline in the claim (a crash
// after commit, before their dispatch) waits for them: it shares their ordering key, the
// message's, and is sent after them.
func TestDelayedEffectWaitsForInlineEffectsOfItsUnit(t *testing.T) {
	pool := openPool(t, outboxtest.DSN(t), 8, nil)
	ctx := context.Background()
	rec := &outboxtest.Recorder{}
	crash := errors.New("crash")
	ob := ready(t, pool, outbox.Config{Publisher: rec, RelayGrace: time.Second, RelayInterval: 20 * time.Millisecond,
		RetryDelay: -1, Failpoint: func(_ context.Context, point string) error {
			if point == outbox.FailpointAfterCommit {
				return crash
			}
			return nil
		}})
	h := func(msg *message.Message) error {
		if err := handler(msg); err != nil {
			return err
		}
		return outbox.Publish(outbox.WithDelay(msg.Context(), 50*time.Millisecond), "out", message.NewMessage("later-"+msg.UUID, nil))
	}
	if err := ob.Handle(message.NewMessage("m", nil), outbox.HandleParams{Consumer: "c", MessageID: "m"}, consume(h)); !errors.Is(err, crash) {
		t.Fatalf("crash after commit: %v", err)
	}
	var inline int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM outbox_processed WHERE effects IS NOT NULL`).Scan(&inline); err != nil || inline != 1 {
		t.Fatalf("claims holding inline effects: %d (%v); want 1", inline, err)
	}
	runCtx, stop := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- ob.Run(runCtx) }()
	defer func() { stop(); <-done }()
	deadline := time.Now().Add(20 * time.Second)
	for len(rec.Messages("out")) < 2 {
		if time.Now().After(deadline) {
			t.Fatalf("sent: %v; want both messages", rec.All())
		}
		time.Sleep(10 * time.Millisecond)
	}
	got := rec.Messages("out")
	if got[0].UUID != "out-m" || got[1].UUID != "later-m" {
		t.Fatalf("sent in the order %s, %s; the delayed message must follow the one recorded before it", got[0].UUID, got[1].UUID)
	}
}
