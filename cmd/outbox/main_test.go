package main

import (
	"bytes"
	"context"
	"database/sql"
	"encoding/json"
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
	"github.com/watermill-outbox/outbox/ops"
	"github.com/watermill-outbox/outbox/outboxdriver"
)

func TestMain(m *testing.M) { os.Exit(pgtest.Run(m)) }

// refusing is a Publisher that refuses the messages whose payload is "poison", and takes the rest.
type refusing struct{ sent atomic.Int32 }

func (p *refusing) Publish(_ string, msgs ...*message.Message) error {
	for _, m := range msgs {
		if string(m.Payload) == "poison" {
			return errors.New("broker refused message: schema v2 required for id 4711")
		}
	}
	p.sent.Add(int32(len(msgs)))
	return nil
}
func (p *refusing) Close() error { return nil }

// fixture is a database with two parked effects (two topics, one failure), a failing message, a
// poisoned one and a processed one.
type fixture struct {
	dsn string
	db  *sql.DB
	ob  *outbox.Outbox
	pub *refusing
}

func newFixture(t *testing.T) *fixture {
	t.Helper()
	f := &fixture{dsn: pgtest.DSN(t), pub: &refusing{}}
	var err error
	if f.db, err = sql.Open("postgres", f.dsn); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = f.db.Close() })
	f.ob, err = outbox.New(outbox.Config{DB: f.db, Driver: postgres.Driver{}, Publisher: f.pub, RelayMaxAttempts: 1,
		MaxAttempts: 1, PoisonTopic: "poison", RetryDelay: -1, EffectRetention: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	if err := f.ob.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	handle := func(id string, h message.HandlerFunc) error {
		return f.ob.Handle(message.NewMessage(id, nil), outbox.HandleParams{Consumer: "billing", MessageID: id}, h)
	}
	publish := func(topics ...string) message.HandlerFunc {
		return func(msg *message.Message) ([]*message.Message, error) {
			ctx := msg.Context()
			if err := outbox.Publish(ctx, "ok", message.NewMessage("", []byte("fine"))); err != nil {
				return nil, err
			}
			for _, topic := range topics {
				if err := outbox.Publish(ctx, topic, message.NewMessage("", []byte("poison"))); err != nil {
					return nil, err
				}
			}
			return nil, nil
		}
	}
	// Parked: the first effect goes out, the second is refused while the broker is healthy.
	if err := handle("m-parked-1", publish("invoices")); !errors.Is(err, outbox.ErrDispatchFailed) {
		t.Fatalf("parking: %v", err)
	}
	if err := handle("m-parked-2", publish("receipts")); !errors.Is(err, outbox.ErrDispatchFailed) {
		t.Fatalf("parking: %v", err)
	}
	if err := handle("m-ok", publish()); err != nil {
		t.Fatal(err)
	}
	// Poisoned (MaxAttempts 1), and failing (the attempt counted, no poison topic for it).
	if err := handle("m-poisoned", func(*message.Message) ([]*message.Message, error) { return nil, errors.New("bad input") }); err != nil {
		t.Fatalf("poisoning: %v", err)
	}
	if _, err := f.db.Exec(`INSERT INTO outbox_attempts (consumer, message_id, attempts, last_error) VALUES ('billing', 'm-failing', 3, 'timeout')`); err != nil {
		t.Fatal(err)
	}
	f.ob.FlushMarks()
	return f
}

// cli runs the command with args and returns its exit status and output.
func (f *fixture) cli(t *testing.T, args ...string) (int, string) {
	t.Helper()
	var out, errOut bytes.Buffer
	env := map[string]string{"OUTBOX_DSN": f.dsn, "USER": "alice"}
	code := run(context.Background(), args, &out, &errOut, func(k string) string { return env[k] })
	return code, out.String() + errOut.String()
}

func (f *fixture) jsonOf(t *testing.T, v any, args ...string) {
	t.Helper()
	code, out := f.cli(t, append([]string{"-o", "json"}, args...)...)
	if code != 0 {
		t.Fatalf("outbox %v: exit %d: %s", args, code, out)
	}
	if err := json.Unmarshal([]byte(out), v); err != nil {
		t.Fatalf("outbox %v: %v: %s", args, err, out)
	}
}

// jsonOfNothing runs a command that matches nothing: exit 1, "nothing matched" on stderr, and
// the empty result in JSON on stdout, decoded into v.
func (f *fixture) jsonOfNothing(t *testing.T, v any, args ...string) {
	t.Helper()
	var out, errOut bytes.Buffer
	env := map[string]string{"OUTBOX_DSN": f.dsn, "USER": "alice"}
	code := run(context.Background(), append([]string{"-o", "json"}, args...), &out, &errOut, func(k string) string { return env[k] })
	if code != 1 || !strings.Contains(errOut.String(), "nothing matched") {
		t.Fatalf("outbox %v: exit %d, want 1 and nothing matched: %s%s", args, code, out.String(), errOut.String())
	}
	if err := json.Unmarshal(out.Bytes(), v); err != nil {
		t.Fatalf("outbox %v: %v: %s", args, err, out.String())
	}
}

func TestStatusAndLists(t *testing.T) {
	f := newFixture(t)
	var s ops.Status
	f.jsonOf(t, &s, "status")
	if s.Totals.Parked != 2 || s.Totals.Failing != 1 || s.Totals.Pending != 0 || s.Retained["billing"] != 4 {
		t.Errorf("status: %+v, want 2 parked, 1 failing, 0 pending, 4 retained IDs of billing", s)
	}
	code, text := f.cli(t, "status")
	if code != 0 || !strings.Contains(text, "parked") || !strings.Contains(text, "invoices") {
		t.Errorf("status text: %d %s", code, text)
	}

	var parked []ops.Parked
	f.jsonOf(t, &parked, "parked", "list", "-topic", "invoices")
	if len(parked) != 1 || parked[0].Topic != "invoices" || parked[0].Source.ID != "m-parked-1" {
		t.Errorf("parked list -topic invoices: %+v", parked)
	}
	var groups []ops.FailureGroup
	f.jsonOf(t, &groups, "parked", "groups")
	if len(groups) != 1 || groups[0].Count != 2 || len(groups[0].Topics) != 2 ||
		!strings.Contains(groups[0].Fingerprint, "schema v2 required for id <n>") {
		t.Errorf("parked groups: %+v, want one group of two across two topics", groups)
	}
	var failing []ops.Failing
	f.jsonOf(t, &failing, "failing", "list")
	if len(failing) != 1 || failing[0].MessageID != "m-failing" || failing[0].Attempts != 3 {
		t.Errorf("failing list: %+v", failing)
	}
	var l ops.Lookup
	f.jsonOf(t, &l, "lookup", "billing", "m-parked-1")
	if !l.Processed || len(l.Effects) != 2 || l.Effects[0].State != "dispatched" || l.Effects[1].State != "parked" {
		t.Errorf("lookup: %+v, want processed with one dispatched and one parked effect", l)
	}
	f.jsonOfNothing(t, &l, "lookup", "billing", "never-seen")
	if l.Processed || len(l.Effects) != 0 {
		t.Errorf("lookup of an unknown message: %+v", l)
	}
}

func TestRepairsAreAuditedAndDryRunChangesNothing(t *testing.T) {
	f := newFixture(t)
	var ch ops.Change
	f.jsonOf(t, &ch, "parked", "retry", "-topic", "invoices", "-dry-run")
	if !ch.DryRun || ch.Matched != 1 || ch.Changed != 0 {
		t.Fatalf("dry run: %+v", ch)
	}
	var parked []ops.Parked
	f.jsonOf(t, &parked, "parked", "list")
	if len(parked) != 2 {
		t.Fatalf("after a dry run: %d parked, want 2 still", len(parked))
	}
	f.jsonOf(t, &ch, "-actor", "bob", "parked", "discard", "-topic", "receipts")
	if ch.Changed != 1 {
		t.Fatalf("discard: %+v", ch)
	}
	f.jsonOf(t, &ch, "parked", "retry", "-error", "schema v2", "-batch", "1")
	if ch.Changed != 1 {
		t.Fatalf("retry: %+v", ch)
	}
	f.jsonOf(t, &parked, "parked", "list")
	if len(parked) != 0 {
		t.Fatalf("after retry and discard: %+v parked", parked)
	}
	var replay map[string]any
	f.jsonOf(t, &replay, "replay", "billing", "m-poisoned")
	if replay["poisoned"] != true {
		t.Fatalf("replay: %v", replay)
	}
	f.jsonOfNothing(t, &replay, "replay", "billing", "m-ok")
	if replay["poisoned"] != false {
		t.Fatalf("replay of a processed message: %v, want it left alone", replay)
	}
	var s ops.Status
	f.jsonOf(t, &s, "status")
	var actions []string
	for _, a := range s.Audit {
		actions = append(actions, a.Actor+":"+a.Action)
	}
	if got := strings.Join(actions, " "); got != "alice:replay-poisoned alice:retry-parked bob:discard-parked" {
		t.Errorf("audit log: %q", got)
	}
	// A repair without a selection is refused, not applied to everything.
	if code, out := f.cli(t, "parked", "discard"); code != 2 || !strings.Contains(out, "select the effects") {
		t.Errorf("discard without a filter: %d %s", code, out)
	}
}

func TestMigrateAndCleanup(t *testing.T) {
	f := &fixture{dsn: pgtest.DSN(t)}
	code, out := f.cli(t, "-schema", "billing", "-prefix", "ob_", "migrate", "status")
	if code != 0 || strings.Contains(out, "true") || !strings.Contains(out, "001") {
		t.Fatalf("migrate status before: %d %s", code, out)
	}
	if code, out := f.cli(t, "-schema", "billing", "-prefix", "ob_", "migrate", "up"); code != 0 {
		t.Fatalf("migrate up: %d %s", code, out)
	}
	code, out = f.cli(t, "-schema", "billing", "-prefix", "ob_", "migrate", "status")
	if code != 0 || strings.Contains(out, "false") {
		t.Fatalf("migrate status after: %d %s", code, out)
	}
	// The SQL for another schema and prefix, applied by hand, gives the same tables.
	code, ddl := f.cli(t, "-schema", "other", "-prefix", "x_", "migrate", "sql")
	if code != 0 || !strings.Contains(ddl, `"other"."x_effects"`) {
		t.Fatalf("migrate sql: %d %s", code, ddl)
	}
	db, err := sql.Open("postgres", f.dsn)
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	if _, err := db.Exec(ddl); err != nil {
		t.Fatalf("applying the printed SQL: %v", err)
	}
	if code, out := f.cli(t, "-schema", "other", "-prefix", "x_", "migrate", "status"); code != 0 || strings.Contains(out, "false") {
		t.Fatalf("status after applying the SQL by hand: %d %s", code, out)
	}
	if _, err := db.Exec(`INSERT INTO billing.ob_processed (consumer, message_id, processed_at, dispatched_at)
		SELECT 'c', 'm' || i, now() - interval '8 days', now() - interval '8 days' FROM generate_series(1, 25) i`); err != nil {
		t.Fatal(err)
	}
	var res struct{ Claims int64 }
	f.jsonOf(t, &res, "-schema", "billing", "-prefix", "ob_", "cleanup", "-retention", "168h", "-batch", "10")
	if res.Claims != 25 {
		t.Errorf("cleanup: %+v, want 25 claims deleted", res)
	}
}

func TestBadInput(t *testing.T) {
	f := &fixture{dsn: pgtest.DSN(t)}
	for _, args := range [][]string{
		{},
		{"frobnicate"},
		{"-o", "yaml", "status"},
		{"-prefix", "x; DROP TABLE y", "status"},
		{"parked", "list", "-id", "abc"},
		{"lookup", "only-one"},
	} {
		if code, out := f.cli(t, args...); code != 2 || !strings.Contains(out, "usage:") {
			t.Errorf("outbox %q: exit %d, want 2 with the usage: %s", args, code, out)
		}
	}
	var out, errOut bytes.Buffer
	if code := run(context.Background(), []string{"status"}, &out, &errOut, func(string) string { return "" }); code != 2 ||
		!strings.Contains(errOut.String(), "no database") {
		t.Errorf("without a DSN: %d %s", code, errOut.String())
	}
}

// Two operators retrying the same parked effects at the same moment change each one once.
func TestConcurrentRepairs(t *testing.T) {
	f := newFixture(t)
	const n = 4
	changes := make([]ops.Change, n)
	var wg sync.WaitGroup
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			var out, errOut bytes.Buffer
			env := map[string]string{"OUTBOX_DSN": f.dsn, "USER": fmt.Sprintf("op%d", i)}
			// An operator who finds every effect retried by another already is told that nothing
			// matched (exit 1), with the empty change in JSON.
			if code := run(context.Background(), []string{"-o", "json", "parked", "retry", "-error", "schema v2"}, &out, &errOut,
				func(k string) string { return env[k] }); code != 0 && (code != 1 || !strings.Contains(errOut.String(), "no parked effect matched")) {
				t.Errorf("operator %d: exit %d: %s", i, code, errOut.String())
				return
			}
			if err := json.Unmarshal(out.Bytes(), &changes[i]); err != nil {
				t.Errorf("operator %d: %v: %s", i, err, out.String())
			}
		}()
	}
	wg.Wait()
	total := 0
	for _, c := range changes {
		total += c.Changed
	}
	if total != 2 {
		t.Errorf("concurrent retries changed %d effects in all (%+v), want each of the 2 parked ones once", total, changes)
	}
}

// kept returns how many effects of topic are kept in the dispatched table, noted as discarded.
func (f *fixture) kept(t *testing.T, topic string) int {
	t.Helper()
	var n int
	if err := f.db.QueryRow(`SELECT count(*) FROM outbox_dispatched WHERE topic = $1 AND last_error LIKE '%(discarded)'`, topic).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

// A discarded effect is kept as the service keeps dispatched effects: in the dispatched table,
// noted as discarded, unless told that the service keeps none (-effect-retention 0). Not knowing
// the service's EffectRetention, the command keeps it: the service's cleanup deletes it in time.
func TestDiscardKeepsTheEffectAsTheServiceDoes(t *testing.T) {
	f := newFixture(t)
	var ch ops.Change
	f.jsonOf(t, &ch, "parked", "discard", "-topic", "receipts")
	if ch.Changed != 1 {
		t.Fatalf("discard: %+v", ch)
	}
	if n := f.kept(t, "receipts"); n != 1 {
		t.Errorf("the discarded effect: %d kept, want 1 (marked discarded, as Outbox.DiscardParked keeps it)", n)
	}
	f.jsonOf(t, &ch, "parked", "discard", "-topic", "invoices", "-effect-retention", "0")
	if ch.Changed != 1 {
		t.Fatalf("discard with -effect-retention 0: %+v", ch)
	}
	if n := f.kept(t, "invoices"); n != 0 {
		t.Errorf("discarded with -effect-retention 0: %d kept, want it deleted as that service deletes what it sends", n)
	}
}

// ops.ForOutbox discards as the Outbox it is given would: kept with EffectRetention, deleted
// without.
func TestOpsForOutboxDiscardsAsTheService(t *testing.T) {
	for _, keep := range []bool{true, false} {
		t.Run(fmt.Sprint("keep=", keep), func(t *testing.T) {
			f := newFixture(t)
			cfg := f.ob.Config()
			cfg.EffectRetention = 0
			if keep {
				cfg.EffectRetention = time.Hour
			}
			ob, err := outbox.New(cfg)
			if err != nil {
				t.Fatal(err)
			}
			o, err := ops.ForOutbox(ob)
			if err != nil {
				t.Fatal(err)
			}
			ch, err := o.DiscardParked(context.Background(), ops.ParkedFilter{Topic: "receipts"}, ops.RepairOptions{Actor: "alice"})
			if err != nil || ch.Changed != 1 {
				t.Fatalf("discard: %+v %v", ch, err)
			}
			want := map[bool]int{true: 1, false: 0}[keep]
			if n := f.kept(t, "receipts"); n != want {
				t.Errorf("EffectRetention %s: %d discarded effects kept, want %d", cfg.EffectRetention, n, want)
			}
		})
	}
}

// cleanup -retention alone deletes no dispatched effect younger than the retention: one kept
// for a service's EffectRetention is not deleted because the command was not told it.
func TestCleanupKeepsYoungDispatchedEffects(t *testing.T) {
	f := newFixture(t)
	var before int
	if err := f.db.QueryRow(`SELECT count(*) FROM outbox_dispatched`).Scan(&before); err != nil || before == 0 {
		t.Fatalf("dispatched effects kept by the fixture: %d (%v)", before, err)
	}
	if _, err := f.db.Exec(`INSERT INTO outbox_dispatched (id, source_consumer, source_id, seq, kind, topic, uuid, payload, metadata,
			ordering_key, created_at, dispatched_at, attempts, failures)
		VALUES (1000000, 'billing', 'old', 0, '', 'ok', 'old-1', '', '', 'k', now() - interval '9 days', now() - interval '8 days', 0, 0)`); err != nil {
		t.Fatal(err)
	}
	var res struct{ Effects int64 }
	f.jsonOf(t, &res, "cleanup", "-retention", "168h")
	if res.Effects != 1 {
		t.Errorf("cleanup -retention 168h deleted %d dispatched effects, want only the one dispatched 8 days ago", res.Effects)
	}
	f.jsonOf(t, &res, "cleanup", "-retention", "168h", "-effect-retention", "0")
	if res.Effects != int64(before) {
		t.Errorf("cleanup -effect-retention 0 deleted %d dispatched effects, want all %d (asked for explicitly)", res.Effects, before)
	}
}

// A cleanup stopped by another process taking the cleanup lock between two of its batches (a
// service's own cleanup starting during a manual one) deleted rows, and its audit entry and its
// output said that nothing was deleted.
func TestCleanupStoppedByTheLockSaysWhatItDeleted(t *testing.T) {
	f := &fixture{dsn: pgtest.DSN(t)}
	if code, out := f.cli(t, "migrate", "up"); code != 0 {
		t.Fatalf("migrate up: %d %s", code, out)
	}
	db, err := sql.Open("postgres", f.dsn)
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	if _, err := db.Exec(`INSERT INTO outbox_processed (consumer, message_id, processed_at, dispatched_at)
		SELECT 'c', 'm' || i, now() - interval '8 days', now() - interval '8 days' FROM generate_series(1, 3) i`); err != nil {
		t.Fatal(err)
	}
	o, err := ops.Open(db, "", "")
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	other, err := db.BeginTx(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = other.Rollback() }()
	taken := false
	rep, err := o.Cleanup(ctx, ops.CleanupOptions{Actor: "alice", Retention: 7 * 24 * time.Hour, BatchSize: 1,
		Progress: func(outboxdriver.CleanupResult) {
			if !taken {
				taken = true
				// Another process's cleanup takes the lock after the first batch.
				if _, err := other.Exec(`SELECT pg_advisory_xact_lock(x'6f757462'::int, hashtext('public.outbox_cleanup'))`); err != nil {
					t.Error(err)
				}
			}
		}})
	if err != nil {
		t.Fatal(err)
	}
	if rep.Claims != 1 || !rep.Skipped {
		t.Fatalf("report: %+v, want 1 claim deleted, then stopped by the lock", rep)
	}
	var detail string
	if err := db.QueryRow(`SELECT detail FROM outbox_audit WHERE action = 'cleanup-done' ORDER BY at DESC LIMIT 1`).Scan(&detail); err != nil {
		t.Fatal(err)
	}
	if strings.Contains(detail, "nothing deleted") || !strings.Contains(detail, "deleted 1 claims") || !strings.Contains(detail, "took the cleanup lock") {
		t.Errorf("audit detail %q: want the claim deleted and the stop", detail)
	}
}
