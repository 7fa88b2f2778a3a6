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
	if err := db.QueryRow(`SELECT count(*) FROM outbox_effects_all WHERE topic = 'orders' AND uuid = 'm1' AND dispatched_at IS NULL`).Scan(&pending); err != nil || pending != 1 {
		t.Fatalf("the retried message as a pending effect: %d, %v", pending, err)
	}
	if dead, err := o.DeadLetters(ctx, outboxdriver.DeadLetterFilter{State: outboxdriver.DeadLetterDead}); err != nil || len(dead) != 1 || dead[0].MessageID != "m2" {
		t.Fatalf("dead letters left: %+v, %v", dead, err)
	}
}

// TestReplayOfADeadLetterSettlesIt: replaying a dead-lettered message (the message put back on
// its topic by hand) marks its dead letter retried by the actor, in the replay's transaction: it
// is no longer listed as dead, a retry from it afterwards hands nothing over, and the next
// delivery runs the handler once.
func TestReplayOfADeadLetterSettlesIt(t *testing.T) {
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
	runs := 0
	fixed := false
	handle := func() error {
		return ob.Handle(message.NewMessage("m1", []byte("m1")), outbox.HandleParams{Consumer: "billing", MessageID: "m1", Topic: "orders"},
			func(*message.Message) ([]*message.Message, error) {
				runs++
				if !fixed {
					return nil, outbox.Permanent(errors.New("no customer 4711"))
				}
				return nil, nil
			})
	}
	if err := handle(); err != nil {
		t.Fatal(err)
	}
	o, err := ops.Open(db, "", "")
	if err != nil {
		t.Fatal(err)
	}
	m1 := outboxdriver.Source{Consumer: "billing", ID: "m1"}
	dead := func() []outboxdriver.DeadLetter {
		dls, err := o.DeadLetters(ctx, outboxdriver.DeadLetterFilter{Consumer: "billing"})
		if err != nil || len(dls) != 1 {
			t.Fatalf("dead letters: %+v, %v; want m1's", dls, err)
		}
		return dls
	}
	if ok, err := o.ReplayPoisoned(ctx, m1.Consumer, m1.ID, ops.RepairOptions{Actor: "alice", DryRun: true}); err != nil || !ok {
		t.Fatalf("replay dry run: %v, %v", ok, err)
	}
	if d := dead()[0]; d.State != outboxdriver.DeadLetterDead {
		t.Fatalf("the dry run changed the dead letter: %+v", d)
	}
	if ok, err := o.ReplayPoisoned(ctx, m1.Consumer, m1.ID, ops.RepairOptions{Actor: "alice"}); err != nil || !ok {
		t.Fatalf("replay: %v, %v", ok, err)
	}
	if d := dead()[0]; d.State != outboxdriver.DeadLetterRetried || d.ChangedBy != "alice" || d.Retries != 1 {
		t.Fatalf("dead letter after the replay: %+v; want retried by alice", d)
	}
	if n, err := o.RetryDeadLetters(ctx, []outboxdriver.Source{m1}, ops.RepairOptions{Actor: "bob"}); err != nil || n != 0 {
		t.Fatalf("retry after the replay: %d, %v; want nothing handed over again", n, err)
	}
	fixed = true
	for range 2 {
		if err := handle(); err != nil {
			t.Fatal(err)
		}
	}
	if runs != 2 {
		t.Fatalf("the handler ran %d times; want once when dead-lettered and once after the replay", runs)
	}
	var audited int
	if err := db.QueryRow(`SELECT count(*) FROM outbox_audit WHERE actor = 'alice' AND action = 'replay-poisoned'`).Scan(&audited); err != nil || audited != 1 {
		t.Fatalf("audit entries of the replay: %d, %v", audited, err)
	}
}

// TestDeadLetterDryRunFindsAnyKey: a dry run of a retry or discard counts the dead letter it
// names however many its consumer has. It looked among the oldest 10,000 only, and said "nothing
// matched" of a newer one that the same command without -dry-run retried.
func TestDeadLetterDryRunFindsAnyKey(t *testing.T) {
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
	if _, err := db.ExecContext(ctx, `INSERT INTO outbox_dead_letters (consumer, message_id, source_topic, payload, metadata, reason, attempts, permanent, dead_at)
		SELECT 'billing', 'old-' || i, 'orders', '', '', 'no customer', 1, true, now() - interval '1 hour' + i * interval '1 ms'
		FROM generate_series(1, 10000) i`); err != nil {
		t.Fatal(err)
	}
	err = ob.Handle(message.NewMessage("newest", nil), outbox.HandleParams{Consumer: "billing", MessageID: "newest", Topic: "orders"},
		func(*message.Message) ([]*message.Message, error) {
			return nil, outbox.Permanent(errors.New("no customer 12"))
		})
	if err != nil {
		t.Fatal(err)
	}
	o, err := ops.Open(db, "", "")
	if err != nil {
		t.Fatal(err)
	}
	key := []outboxdriver.Source{{Consumer: "billing", ID: "newest"}, {Consumer: "billing", ID: "newest"}, {Consumer: "billing", ID: "none"}}
	if n, err := o.RetryDeadLetters(ctx, key, ops.RepairOptions{Actor: "alice", DryRun: true}); err != nil || n != 1 {
		t.Errorf("dry run of a retry of the newest of 10,001 dead letters (named twice) and of none: %d, %v; want 1", n, err)
	}
	if n, err := o.DiscardDeadLetters(ctx, key, ops.RepairOptions{Actor: "alice", DryRun: true}); err != nil || n != 1 {
		t.Errorf("dry run of a discard: %d, %v; want 1", n, err)
	}
	if n, err := o.RetryDeadLetters(ctx, key, ops.RepairOptions{Actor: "alice"}); err != nil || n != 1 {
		t.Errorf("the retry itself: %d, %v; want 1", n, err)
	}
}
