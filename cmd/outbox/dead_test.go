package main

import (
	"context"
	"database/sql"
	"errors"
	"strings"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/watermill-outbox/outbox"
	"github.com/watermill-outbox/outbox/outboxdriver"
)

// TestDeadLetterCommands: `outbox dead` lists, groups, retries and discards dead letters, with the
// exit statuses of the other commands: 1 and "nothing matched" for a retry of what is no dead
// letter (any more), 2 for a mistake in the command line.
func TestDeadLetterCommands(t *testing.T) {
	f := newFixture(t)
	err := f.ob.Handle(message.NewMessage("m-dead", []byte("order")), outbox.HandleParams{Consumer: "billing", MessageID: "m-dead", Topic: "orders"},
		func(*message.Message) ([]*message.Message, error) {
			return nil, outbox.Permanent(errors.New("unknown sku 42"))
		})
	if err != nil {
		t.Fatal(err)
	}
	var list []outboxdriver.DeadLetter
	f.jsonOf(t, &list, "dead", "list", "-consumer", "billing")
	if len(list) != 2 || list[0].MessageID != "m-poisoned" || list[1].MessageID != "m-dead" || list[1].SourceTopic != "orders" {
		t.Fatalf("dead list: %+v", list)
	}
	if code, out := f.cli(t, "dead", "groups"); code != 0 || !strings.Contains(out, "unknown sku") || !strings.Contains(out, "bad input") {
		t.Fatalf("dead groups: exit %d: %s", code, out)
	}
	if code, out := f.cli(t, "dead", "retry", "-dry-run", "billing", "m-dead"); code != 0 || !strings.Contains(out, "dry run") {
		t.Fatalf("dead retry -dry-run: exit %d: %s", code, out)
	}
	if code, out := f.cli(t, "dead", "retry", "billing", "m-dead"); code != 0 || !strings.Contains(out, "retried") {
		t.Fatalf("dead retry: exit %d: %s", code, out)
	}
	var res map[string]any
	f.jsonOfNothing(t, &res, "dead", "retry", "billing", "m-dead")
	if res["changed"] != float64(0) {
		t.Fatalf("second retry: %v", res)
	}
	// Handed to Handle without a topic: it cannot go back to one.
	if code, out := f.cli(t, "dead", "retry", "billing", "m-poisoned"); code != 1 || !strings.Contains(out, "source topic is unknown") {
		t.Fatalf("dead retry without a source topic: exit %d: %s", code, out)
	}
	if code, out := f.cli(t, "dead", "discard", "billing", "m-poisoned"); code != 0 || !strings.Contains(out, "discarded") {
		t.Fatalf("dead discard: exit %d: %s", code, out)
	}
	f.jsonOf(t, &list, "dead", "list", "-state", "dead")
	if len(list) != 0 {
		t.Fatalf("dead letters still dead: %+v", list)
	}
	if code, _ := f.cli(t, "dead", "list", "-state", "gone"); code != 2 {
		t.Fatalf("dead list -state gone: exit %d, want 2", code)
	}
	if code, _ := f.cli(t, "dead", "retry", "billing"); code != 2 {
		t.Fatalf("dead retry without a message ID: exit %d, want 2", code)
	}
	var n int
	if err := f.db.QueryRowContext(context.Background(), `SELECT count(*) FROM outbox_audit WHERE action IN ('retry-dead-letter', 'discard-dead-letter')`).Scan(&n); err != nil || n != 2 {
		t.Fatalf("audit entries: %d, %v", n, err)
	}
}

// TestDeadNowCommand: `outbox dead now` asks that a failing message be dead-lettered on its next
// delivery (a dry run changes nothing); a message that is not failing matches nothing (exit 1).
func TestDeadNowCommand(t *testing.T) {
	f := newFixture(t)
	ctx := context.Background()
	if _, err := f.db.ExecContext(ctx, `INSERT INTO outbox_attempts (consumer, message_id, attempts, last_error) VALUES ('shipping', 'm-slow', 2, 'carrier API timeout')`); err != nil {
		t.Fatal(err)
	}
	requested := func() string {
		var by sql.NullString
		if err := f.db.QueryRowContext(ctx, `SELECT dead_letter_by FROM outbox_attempts WHERE consumer = 'shipping' AND message_id = 'm-slow'`).Scan(&by); err != nil {
			t.Fatal(err)
		}
		return by.String
	}
	if code, out := f.cli(t, "dead", "now", "-dry-run", "shipping", "m-slow"); code != 0 || !strings.Contains(out, "dry run") || requested() != "" {
		t.Fatalf("dead now -dry-run: exit %d, requested by %q: %s", code, requested(), out)
	}
	if code, out := f.cli(t, "dead", "now", "-actor", "alice", "shipping", "m-slow"); code != 0 || !strings.Contains(out, "next delivery") || requested() != "alice" {
		t.Fatalf("dead now: exit %d, requested by %q: %s", code, requested(), out)
	}
	if code, out := f.cli(t, "dead", "now", "shipping", "m-unknown"); code != 1 || !strings.Contains(out, "not failing") {
		t.Fatalf("dead now of a message that is not failing: exit %d: %s", code, out)
	}
	if code, _ := f.cli(t, "dead", "now", "shipping"); code != 2 {
		t.Fatalf("dead now without a message ID: exit %d, want 2", code)
	}
}
