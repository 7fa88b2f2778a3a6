package main

import (
	"fmt"
	"strings"
	"testing"

	"github.com/watermill-outbox/outbox/drivers/postgres"
	"github.com/watermill-outbox/outbox/internal/pgtest"
)

// Item: a command against a database that has no outbox tables (or the wrong -schema/-prefix)
// printed PostgreSQL's raw "relation does not exist"; it says what to do.
func TestCommandWithoutTheTablesSaysRunMigrateUp(t *testing.T) {
	f := &fixture{dsn: pgtest.DSN(t)}
	for _, args := range [][]string{{"status"}, {"parked", "list"}, {"-prefix", "other_", "failing", "list"}} {
		code, out := f.cli(t, args...)
		if code != 1 || !strings.Contains(out, "outbox migrate up") || strings.Contains(out, "usage:") {
			t.Errorf("outbox %q on a database without the tables: exit %d, want 1 and advice to run `outbox migrate up`: %s", args, code, out)
		}
	}
}

// Item: a repair whose selection matches no parked effect said "0 of 0" and exited 0, which a
// script or a tired operator reads as success: it says nothing matched and exits 1.
func TestRepairThatMatchesNothingFails(t *testing.T) {
	f := newFixture(t)
	for _, args := range [][]string{
		{"parked", "discard", "-id", "999"},
		{"parked", "retry", "-topic", "no-such-topic"},
		{"parked", "discard", "-dry-run", "-id", "999"},
	} {
		code, out := f.cli(t, args...)
		if code != 1 || !strings.Contains(out, "no parked effect matched") {
			t.Errorf("outbox %q: exit %d, want 1 saying no parked effect matched: %s", args, code, out)
		}
	}
}

// Item: migrate up said "the outbox tables are current" whether it applied every migration or
// none; it names the ones it applied.
func TestMigrateUpSaysWhatItApplied(t *testing.T) {
	f := &fixture{dsn: pgtest.DSN(t)}
	all, err := postgres.Migrations("", "outbox_")
	if err != nil {
		t.Fatal(err)
	}
	last := all[len(all)-1]
	code, out := f.cli(t, "migrate", "up")
	if code != 0 || !strings.Contains(out, fmt.Sprintf("applied %d migration(s)", len(all))) || !strings.Contains(out, "001_init") ||
		!strings.Contains(out, fmt.Sprintf("%03d_%s", last.Version, last.Name)) {
		t.Errorf("migrate up on an empty database: exit %d, want it to name the %d migrations it applied: %s", code, len(all), out)
	}
	code, out = f.cli(t, "migrate", "up")
	if code != 0 || !strings.Contains(out, "no migration to apply") {
		t.Errorf("migrate up again: exit %d, want it to say it applied none: %s", code, out)
	}
	var res struct{ Applied []string }
	f.jsonOf(t, &res, "migrate", "up")
	if res.Applied == nil || len(res.Applied) != 0 {
		t.Errorf("migrate up -o json again: %+v, want an empty applied list", res)
	}
}
