package sqlite_test

import (
	"context"
	"database/sql"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"

	"github.com/watermill-outbox/outbox"
)

// Delayed effects over SQLite: not sent after the commit, sent by the relay once due (woken by
// the due time), once; a later unit of work cancels one for good; Stats counts them apart.
func TestDelayedEffects(t *testing.T) {
	e := newEnv(t)
	ob := e.newOutbox(func(c *outbox.Config) { c.RelayInterval = time.Hour })
	ctx := context.Background()
	const delay = time.Second
	ids := map[string]string{}
	recorded := time.Now()
	for _, key := range []string{"kept", "cancelled"} {
		err := ob.InTx(ctx, func(ctx context.Context, tx *sql.Tx) error {
			m := message.NewMessage(uuid.NewString(), []byte(key))
			ids[key] = m.UUID
			return outbox.Publish(outbox.WithCancelKey(outbox.WithDelay(ctx, delay), key), topic, m)
		})
		if err != nil {
			t.Fatal(err)
		}
	}
	if n := len(e.wire()); n != 0 {
		t.Fatalf("%d delayed messages sent after commit", n)
	}
	s, err := ob.Stats(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if s.Delayed != 2 || s.Pending != 0 {
		t.Fatalf("stats %+v: want 2 delayed, none pending", s)
	}
	var cancelled int
	err = ob.InTx(ctx, func(ctx context.Context, tx *sql.Tx) error {
		var err error
		cancelled, err = outbox.CancelDelayed(ctx, "cancelled")
		return err
	})
	if err != nil || cancelled != 1 {
		t.Fatalf("cancel: %d cancelled, %v", cancelled, err)
	}

	runCtx, stop := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- ob.Run(runCtx) }()
	defer func() { stop(); <-done }()
	deadline := time.Now().Add(waitMax)
	for e.wire()[ids["kept"]] == 0 {
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
	wire := e.wire()
	if wire[ids["kept"]] != 1 || wire[ids["cancelled"]] != 0 || len(wire) != 1 {
		t.Fatalf("on the wire: %v; want the kept message once, the cancelled one never", wire)
	}
	if n := e.count(`SELECT count(*) FROM outbox_delayed`); n != 0 {
		t.Fatalf("%d delayed effects left", n)
	}
}
