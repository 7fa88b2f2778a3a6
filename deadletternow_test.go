package outbox_test

import (
	"context"
	"errors"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/watermill-outbox/outbox"
	"github.com/watermill-outbox/outbox/ops"
	"github.com/watermill-outbox/outbox/outboxdriver"
)

// TestDeadLetterNow: an operator asks that a failing message (one failed attempt of five) be
// dead-lettered at once. The next delivery to the process that saw it fail stores it as a dead
// letter and acks it without running the handler; one to a process that has not seen it fail runs
// the handler once more and, as it fails, dead-letters it instead of counting a second attempt. A
// message that is not failing cannot be asked for, and the request is audited.
func TestDeadLetterNow(t *testing.T) {
	e := newEnv(t, func(c *outbox.Config) { c.MaxAttempts = 5; c.RetryDelay = -1 })
	ctx := context.Background()
	var calls atomic.Int32
	failing := func(*message.Message) ([]*message.Message, error) {
		calls.Add(1)
		return nil, errors.New("carrier API timeout")
	}
	deliver := func(ob *outbox.Outbox, id string) error {
		return ob.Handle(message.NewMessage(id, []byte("order "+id)), outbox.HandleParams{Consumer: "shipping", MessageID: id, Topic: "orders"}, failing)
	}
	for _, id := range []string{"m-1", "m-2"} {
		if err := deliver(e.ob, id); err == nil {
			t.Fatalf("first delivery of %s: want the handler's failure", id)
		}
	}
	o, err := ops.ForOutbox(e.ob)
	if err != nil {
		t.Fatal(err)
	}
	opt := ops.RepairOptions{Actor: "alice"}
	if ok, err := o.DeadLetterNow(ctx, outboxdriver.Source{Consumer: "shipping", ID: "m-9"}, opt); err != nil || ok {
		t.Fatalf("dead-letter now of a message that never failed: %v %v, want false", ok, err)
	}
	if ok, err := o.DeadLetterNow(ctx, outboxdriver.Source{Consumer: "shipping", ID: "m-1"}, ops.RepairOptions{Actor: "alice", DryRun: true}); err != nil || !ok {
		t.Fatalf("dry run: %v %v, want true", ok, err)
	}
	if ok, err := o.DeadLetterNow(ctx, outboxdriver.Source{Consumer: "shipping", ID: "m-1"}, ops.RepairOptions{Actor: "alice"}); err != nil || !ok {
		t.Fatalf("dead-letter now of m-1: %v %v", ok, err)
	}
	calls.Store(0)
	if err := deliver(e.ob, "m-1"); err != nil {
		t.Fatalf("the next delivery of m-1: %v, want it acked as a dead letter", err)
	}
	if n := calls.Load(); n != 0 {
		t.Fatalf("the handler ran %d times on the delivery after the request, want 0", n)
	}
	dead, err := e.ob.DeadLetters(ctx, outbox.DeadLetterFilter{Consumer: "shipping", State: outbox.DeadLetterDead})
	if err != nil || len(dead) != 1 || dead[0].MessageID != "m-1" || dead[0].Attempts != 1 || dead[0].SourceTopic != "orders" ||
		!strings.Contains(dead[0].Reason, "alice") || !strings.Contains(dead[0].Reason, "carrier API timeout") {
		t.Fatalf("dead letters: %+v %v; want m-1, 1 attempt, from orders, asked by alice, with its last error", dead, err)
	}
	if err := deliver(e.ob, "m-1"); err != nil || calls.Load() != 0 {
		t.Fatalf("a copy of the dead letter: %v, %d handler calls; want it acked", err, calls.Load())
	}
	mustEqual(t, "audit entries", e.count(`SELECT count(*) FROM outbox_audit WHERE action = 'dead-letter-now' AND actor = 'alice' AND target = 'shipping/m-1'`), 1)

	// m-2 is asked for while a second process, which has not seen it fail, receives it.
	if ok, err := o.DeadLetterNow(ctx, outboxdriver.Source{Consumer: "shipping", ID: "m-2"}, opt); err != nil || !ok {
		t.Fatalf("dead-letter now of m-2: %v %v", ok, err)
	}
	if err := deliver(e.newOutbox(func(c *outbox.Config) { c.MaxAttempts = 5; c.RetryDelay = -1 }), "m-2"); err != nil {
		t.Fatalf("m-2 in another process: %v, want it dead-lettered and acked", err)
	}
	mustEqual(t, "m-2 dead letters", e.count(`SELECT count(*) FROM outbox_dead_letters WHERE message_id = 'm-2' AND state = 'dead' AND attempts = 2`), 1)
	if ok, err := o.DeadLetterNow(ctx, outboxdriver.Source{Consumer: "shipping", ID: "m-2"}, opt); err != nil || ok {
		t.Fatalf("dead-letter now of a dead letter: %v %v, want false", ok, err)
	}
}
