package ops_test

import (
	"context"
	"errors"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/watermill-outbox/outbox"
	"github.com/watermill-outbox/outbox/drivers/postgres"
	"github.com/watermill-outbox/outbox/ops"
	"github.com/watermill-outbox/outbox/outboxdriver"
)

// TestDeadLetterRepairsAreAudited: the dead letters are grouped by consumer and cause, and a
// retry or discard needs an actor, changes nothing in a dry run, and writes its audit entry.
func TestDeadLetterRepairsAreAudited(t *testing.T) {
	db, closeDB := exampleDB()
	defer closeDB()
	ctx := context.Background()
	ob, err := outbox.New(outbox.Config{DB: db, Driver: postgres.Driver{}, Publisher: &broker{}})
	if err != nil {
		t.Fatal(err)
	}
	defer ob.Close()
	if err := ob.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	for _, m := range []struct{ consumer, id, reason string }{
		{"billing", "m1", "no customer 4711"}, {"billing", "m2", "no customer 12"}, {"shipping", "m3", "bad address"},
	} {
		err := ob.Handle(message.NewMessage(m.id, []byte(m.id)), outbox.HandleParams{Consumer: m.consumer, MessageID: m.id, Topic: "orders"},
			func(*message.Message) ([]*message.Message, error) { return nil, outbox.Permanent(errors.New(m.reason)) })
		if err != nil {
			t.Fatal(err)
		}
	}
	o, err := ops.Open(db, "", "")
	if err != nil {
		t.Fatal(err)
	}
	groups, more, err := o.DeadLetterGroups(ctx, "")
	if err != nil || more || len(groups) != 2 || groups[0].Consumer != "billing" || groups[0].Count != 2 || groups[1].Count != 1 {
		t.Fatalf("groups: %+v, %v, %v", groups, more, err)
	}
	m1 := []outboxdriver.Source{{Consumer: "billing", ID: "m1"}}
	if _, err := o.RetryDeadLetters(ctx, m1, ops.RepairOptions{}); err == nil {
		t.Fatal("retry without an actor: want an error")
	}
	if n, err := o.RetryDeadLetters(ctx, m1, ops.RepairOptions{Actor: "alice", DryRun: true}); err != nil || n != 1 {
		t.Fatalf("dry run: %d, %v", n, err)
	}
	audited := func() int {
		var n int
		if err := db.QueryRow(`SELECT count(*) FROM outbox_audit WHERE actor = 'alice' AND action LIKE '%-dead-letter'`).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}
	if n := audited(); n != 0 {
		t.Fatalf("the dry run wrote %d audit entries", n)
	}
	if n, err := o.RetryDeadLetters(ctx, m1, ops.RepairOptions{Actor: "alice"}); err != nil || n != 1 {
		t.Fatalf("retry: %d, %v", n, err)
	}
	if n, err := o.DiscardDeadLetters(ctx, []outboxdriver.Source{{Consumer: "shipping", ID: "m3"}}, ops.RepairOptions{Actor: "alice"}); err != nil || n != 1 {
		t.Fatalf("discard: %d, %v", n, err)
	}
	if n := audited(); n != 2 {
		t.Fatalf("audit entries: %d, want the retry's and the discard's", n)
	}
	var pending int
	if err := db.QueryRow(`SELECT count(*) FROM outbox_effects WHERE topic = 'orders' AND uuid = 'm1' AND dispatched_at IS NULL`).Scan(&pending); err != nil || pending != 1 {
		t.Fatalf("the retried message as a pending effect: %d, %v", pending, err)
	}
	if dead, err := o.DeadLetters(ctx, outboxdriver.DeadLetterFilter{State: outboxdriver.DeadLetterDead}); err != nil || len(dead) != 1 || dead[0].MessageID != "m2" {
		t.Fatalf("dead letters left: %+v, %v", dead, err)
	}
}
