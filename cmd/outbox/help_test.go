package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"strings"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/watermill-outbox/outbox"
	"github.com/watermill-outbox/outbox/ops"
)

// noDSN runs the command with no DSN anywhere: help must not need a database.
func noDSN(args ...string) (int, string, string) {
	var out, errOut bytes.Buffer
	code := run(context.Background(), args, &out, &errOut, func(string) string { return "" })
	return code, out.String(), errOut.String()
}

// The commands and subcommands, each with its own help.
var commands = []string{
	"status", "parked", "parked list", "parked groups", "parked retry", "parked discard",
	"failing", "failing list", "dead", "dead list", "dead groups", "dead retry", "dead discard", "dead now",
	"replay", "lookup",
	"migrate", "migrate up", "migrate status", "migrate sql", "migrate grants", "cleanup", "help",
}

// Item: every -h or --help printed the same global usage and exited 2; status -h needed a DSN;
// `migrate up -h` said "want up, status, sql or grants". Each command has its own help, on
// stdout, exit 0, without a database, by -h, --help or `outbox help COMMAND`.
func TestEveryCommandHasItsOwnHelp(t *testing.T) {
	seen := map[string]string{}
	for _, c := range commands {
		words := strings.Fields(c)
		for _, args := range [][]string{append(words[:len(words):len(words)], "-h"), append(words[:len(words):len(words)], "--help"), append([]string{"help"}, words...)} {
			code, out, errOut := noDSN(args...)
			if code != 0 || !strings.Contains(out, "usage: outbox "+c) || errOut != "" {
				t.Errorf("outbox %s: exit %d, want 0 and the help of %q on stdout, nothing on stderr:\n%s%s", strings.Join(args, " "), code, c, out, errOut)
				continue
			}
			if other, ok := seen[out]; ok && other != c {
				t.Errorf("outbox %s prints the help of %q", strings.Join(args, " "), other)
			}
			seen[out] = c
		}
	}
	for _, args := range [][]string{{"-h"}, {"--help"}, {"help"}} {
		code, out, _ := noDSN(args...)
		if code != 0 || !strings.Contains(out, "usage: outbox [flags] COMMAND") || !strings.Contains(out, "parked retry") {
			t.Errorf("outbox %s: exit %d, want 0 and the list of commands: %s", args, code, out)
		}
	}
	if code, _, errOut := noDSN("help", "frobnicate"); code != 2 || !strings.Contains(errOut, `unknown command "frobnicate"`) {
		t.Errorf("outbox help frobnicate: exit %d, want 2: %s", code, errOut)
	}
}

// Item: defaults were never shown. Each help shows the defaults of its flags, and the global
// help the defaults of the global flags, without printing the DSN it would use.
func TestHelpShowsDefaults(t *testing.T) {
	for _, c := range []struct{ args, want []string }{
		{[]string{"-h"}, []string{`-prefix string`, `(default "outbox_")`, `(default 1m0s)`, `(default "text")`, "$OUTBOX_DSN", "Exit status: 0 done (a list with nothing in it too"}},
		{[]string{"parked", "list", "-h"}, []string{"-limit int", "(default 1000)", "-topic string"}},
		{[]string{"parked", "retry", "-h"}, []string{"-batch int", "(default 500)", "-dry-run"}},
		{[]string{"failing", "list", "-h"}, []string{"(default 1000)"}},
		{[]string{"cleanup", "-h"}, []string{"-batch int", "(default 1000)", "-retention duration", "-force"}},
		{[]string{"migrate", "sql", "-h"}, []string{"-grant string", "-operator string"}},
		{[]string{"migrate", "grants", "-h"}, []string{"-operator", "ROLE"}},
	} {
		var out, errOut bytes.Buffer
		env := map[string]string{"OUTBOX_DSN": "postgres://app:s3cret@db/shop"}
		code := run(context.Background(), c.args, &out, &errOut, func(k string) string { return env[k] })
		for _, w := range c.want {
			if code != 0 || !strings.Contains(out.String(), w) {
				t.Errorf("outbox %s: exit %d, want 0 and %q in:\n%s%s", strings.Join(c.args, " "), code, w, out.String(), errOut.String())
			}
		}
		if strings.Contains(out.String(), "s3cret") {
			t.Errorf("outbox %s prints the DSN's password: %s", strings.Join(c.args, " "), out.String())
		}
	}
}

// Item: global flags were refused after the command (`parked retry -actor x`). They are
// accepted anywhere, and the arguments of a command may come before its flags.
func TestGlobalFlagsAfterTheCommand(t *testing.T) {
	f := newFixture(t)
	code, out := f.cli(t, "parked", "retry", "-topic", "invoices", "-actor", "bob")
	if code != 0 || !strings.Contains(out, "audited as bob") {
		t.Fatalf("parked retry -topic invoices -actor bob: exit %d: %s", code, out)
	}
	var s ops.Status
	code, out = f.cli(t, "status", "-o", "json")
	if code != 0 || json.Unmarshal([]byte(out), &s) != nil {
		t.Errorf("status -o json: exit %d, want JSON: %s", code, out)
	}
	var l ops.Lookup
	code, out = f.cli(t, "lookup", "billing", "m-parked-1", "-o", "json", "-timeout", "30s")
	if code != 0 || json.Unmarshal([]byte(out), &l) != nil || !l.Processed {
		t.Errorf("lookup CONSUMER ID -o json: exit %d, want JSON of a processed message: %s", code, out)
	}
	code, out = f.cli(t, "replay", "billing", "m-poisoned", "-dry-run")
	if code != 0 || !strings.Contains(out, "dry run") {
		t.Errorf("replay CONSUMER ID -dry-run: exit %d, want a dry run: %s", code, out)
	}
	if code, out := f.cli(t, "replay", "--", "billing", "-dash"); code != 1 || !strings.Contains(out, "billing/-dash") {
		t.Errorf("replay -- billing -dash: exit %d, want -dash taken as the message ID: %s", code, out)
	}
	if code, out := f.cli(t, "status", "-prefix"); code != 2 || !strings.Contains(out, "flag needs an argument: -prefix") {
		t.Errorf("status -prefix: exit %d, want 2: %s", code, out)
	}
}

// Item: replay exited 0 when nothing matched, parked retry 1. One rule: a command that names
// what it acts on or looks up exits 1 when nothing matched, says "nothing matched" on stderr,
// and still prints the (empty) result on stdout; an empty list is an answer (exit 0).
func TestNothingMatchedExitsOne(t *testing.T) {
	f := newFixture(t)
	for _, args := range [][]string{
		{"replay", "billing", "m-ok"},
		{"replay", "-dry-run", "billing", "m-ok"},
		{"parked", "retry", "-id", "999"},
		{"parked", "discard", "-topic", "nowhere"},
		{"lookup", "billing", "never-seen"},
	} {
		var out, errOut bytes.Buffer
		env := map[string]string{"OUTBOX_DSN": f.dsn, "USER": "alice"}
		code := run(context.Background(), append([]string{"-o", "json"}, args...), &out, &errOut, func(k string) string { return env[k] })
		var v any
		if code != 1 || !strings.Contains(errOut.String(), "nothing matched") || json.Unmarshal(out.Bytes(), &v) != nil {
			t.Errorf("outbox -o json %s: exit %d, want 1, \"nothing matched\" on stderr and JSON on stdout:\n%s\n%s", strings.Join(args, " "), code, out.String(), errOut.String())
		}
		out.Reset()
		errOut.Reset()
		if code := run(context.Background(), args, &out, &errOut, func(k string) string { return env[k] }); code != 1 || !strings.Contains(errOut.String(), "nothing matched") {
			t.Errorf("outbox %s: exit %d, want 1 and \"nothing matched\" on stderr:\n%s\n%s", strings.Join(args, " "), code, out.String(), errOut.String())
		}
	}
	for _, args := range [][]string{{"parked", "list"}, {"failing", "list"}, {"lookup", "billing", "m-ok"}, {"replay", "-dry-run", "billing", "m-poisoned"}} {
		if code, out := f.cli(t, args...); code != 0 {
			t.Errorf("outbox %s: exit %d, want 0 (something matched): %s", strings.Join(args, " "), code, out)
		}
	}
	// A list is an answer whatever it holds: empty, it exits 0 ([] in JSON), so that a check for
	// parked effects under set -e does not stop at the healthy state.
	for _, args := range [][]string{{"parked", "list", "-topic", "nowhere"}, {"parked", "groups", "-consumer", "nobody"}, {"failing", "list", "-consumer", "nobody"}} {
		var out, errOut bytes.Buffer
		env := map[string]string{"OUTBOX_DSN": f.dsn, "USER": "alice"}
		code := run(context.Background(), append([]string{"-o", "json"}, args...), &out, &errOut, func(k string) string { return env[k] })
		if code != 0 || strings.TrimSpace(out.String()) != "[]" {
			t.Errorf("outbox -o json %s: exit %d, want 0 and []:\n%s\n%s", strings.Join(args, " "), code, out.String(), errOut.String())
		}
		if code, out := f.cli(t, args...); code != 0 || out == "" {
			t.Errorf("outbox %s: exit %d, want 0 and a line saying the list is empty: %q", strings.Join(args, " "), code, out)
		}
	}
}

// Item: every connection error read "ops: read the service's configuration: dial tcp ...": it
// says the command could not connect.
func TestConnectionErrorSaysConnect(t *testing.T) {
	var out, errOut bytes.Buffer
	env := map[string]string{"OUTBOX_DSN": "postgres://app:s3cret@127.0.0.1:1/shop?sslmode=disable&connect_timeout=5"}
	code := run(context.Background(), []string{"status"}, &out, &errOut, func(k string) string { return env[k] })
	if code != 1 || strings.Contains(errOut.String(), "service's configuration") || !strings.Contains(errOut.String(), "connect to PostgreSQL") ||
		strings.Contains(errOut.String(), "s3cret") {
		t.Errorf("status against a closed port: exit %d, want 1 and \"connect to PostgreSQL\": %s", code, errOut.String())
	}
}

// Item: lookup printed "last dispatch 0001-01-01T00:00:00Z" for a processed message whose
// effects were not sent yet (its claim has no dispatch time until the last one goes out).
func TestLookupOfAnUnsentEffect(t *testing.T) {
	f := newFixture(t)
	if _, err := f.db.Exec(`INSERT INTO outbox_processed (consumer, message_id) VALUES ('billing', 'm-unsent')`); err != nil {
		t.Fatal(err)
	}
	code, out := f.cli(t, "lookup", "billing", "m-unsent")
	if code != 0 || strings.Contains(out, "0001-01-01") || !strings.Contains(out, "not all dispatched yet") {
		t.Errorf("lookup of a message whose effects were not sent: exit %d, want \"not all dispatched yet\": %s", code, out)
	}
	code, out = f.cli(t, "lookup", "billing", "m-ok")
	if code != 0 || !strings.Contains(out, "last dispatch") {
		t.Errorf("lookup of a message whose effects went out: exit %d: %s", code, out)
	}
}

// Item: lookup showed "last dispatch" for an effect never sent. A discarded effect is kept beside
// the dispatched ones, with the discard's time as its dispatch time, so lookup listed it as
// dispatched and, when it was the message's only effect, printed its discard as a dispatch.
func TestLookupOfADiscardedEffect(t *testing.T) {
	f := newFixture(t)
	err := f.ob.Handle(message.NewMessage("m-refused", nil), outbox.HandleParams{Consumer: "billing", MessageID: "m-refused"},
		func(msg *message.Message) ([]*message.Message, error) {
			return nil, outbox.Publish(msg.Context(), "refunds", message.NewMessage("", []byte("poison")))
		})
	if !errors.Is(err, outbox.ErrDispatchFailed) {
		t.Fatalf("dispatch: %v", err)
	}
	// One refusal parks an effect only while something else reaches the broker; this one is
	// parked as the relay would after more of them.
	if _, err := f.db.Exec(`UPDATE outbox_effects_all SET parked_at = now() WHERE topic = 'refunds'`); err != nil {
		t.Fatal(err)
	}
	var ch ops.Change
	f.jsonOf(t, &ch, "parked", "discard", "-topic", "refunds")
	if ch.Changed != 1 {
		t.Fatalf("discard: %+v", ch)
	}
	code, out := f.cli(t, "lookup", "billing", "m-refused")
	if code != 0 || strings.Contains(out, "last dispatch") || strings.Contains(out, "dispatched") || !strings.Contains(out, "discarded") {
		t.Errorf("lookup of a message whose only effect was discarded: exit %d, want it discarded and no dispatch:\n%s", code, out)
	}
	var l ops.Lookup
	f.jsonOf(t, &l, "lookup", "billing", "m-refused")
	if len(l.Effects) != 1 || l.Effects[0].State != "discarded" || !l.Effects[0].DispatchedAt.IsZero() ||
		l.Effects[0].DiscardedAt.IsZero() || !strings.Contains(l.Effects[0].LastError, "schema v2 required") || strings.Contains(l.Effects[0].LastError, "(discarded)") {
		t.Errorf("lookup -o json of the discarded effect: %+v", l.Effects)
	}
}
