package mysql_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	gomysql "github.com/go-sql-driver/mysql"

	"github.com/watermill-outbox/outbox"
	"github.com/watermill-outbox/outbox/console"
	"github.com/watermill-outbox/outbox/drivers/mysql"
	"github.com/watermill-outbox/outbox/drivers/mysql/internal/mysqltest"
	"github.com/watermill-outbox/outbox/ops"
	"github.com/watermill-outbox/outbox/outboxdriver"
	"github.com/watermill-outbox/outbox/outboxtest"
	"github.com/watermill-outbox/outbox/store"
)

// opsFixture is a database with, for consumer "billing": m1 with two effects to "invoices" and m2
// with one to "receipts", all three parked; m3 failing twice; m4 poisoned after one failure.
type opsFixture struct {
	db     *sql.DB
	dsn    string
	o      *ops.Ops
	st     outboxdriver.Store
	parked map[string][]int64 // store IDs by message ID
}

func newOpsFixture(t *testing.T) opsFixture {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	dsn := mysqltest.DSN(t)
	db, err := sql.Open("mysql", dsn)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = db.Close() })
	o, err := ops.OpenWith(db, ops.Options{Driver: mysql.Driver{}})
	if err != nil {
		t.Fatal(err)
	}
	st := o.Store()
	if err := st.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	f := opsFixture{db: db, dsn: dsn, o: o, st: st, parked: map[string][]int64{}}
	for _, m := range []struct {
		id     string
		topics []string
	}{{"m1", []string{"invoices", "invoices"}}, {"m2", []string{"receipts"}}} {
		src := outboxdriver.Source{Consumer: "billing", ID: m.id}
		tx, err := db.BeginTx(ctx, nil)
		if err != nil {
			t.Fatal(err)
		}
		if c, err := st.MessageClaim(ctx, tx, src); err != nil || !c.Claimed {
			t.Fatalf("claim %s: %+v, %v", m.id, c, err)
		}
		var effects []outboxdriver.Effect
		for i, topic := range m.topics {
			effects = append(effects, outboxdriver.Effect{Seq: i, Kind: outboxdriver.KindPublish, Topic: topic,
				UUID: fmt.Sprintf("%s-%d", m.id, i), Payload: []byte("x"), Metadata: map[string]string{}, OrderingKey: m.id})
		}
		if _, err := st.EffectInsert(ctx, tx, src, effects); err != nil {
			t.Fatal(err)
		}
		if err := tx.Commit(); err != nil {
			t.Fatal(err)
		}
		var failures []outboxdriver.EffectFailure
		for _, e := range effects {
			f.parked[m.id] = append(f.parked[m.id], e.StoreID)
			failures = append(failures, outboxdriver.EffectFailure{StoreID: e.StoreID, Reason: `publish to "` + e.Topic + `": refused for order 4711`,
				Counted: true, Park: true, RetryAfter: time.Hour})
		}
		if err := st.EffectRecordFailures(ctx, failures...); err != nil {
			t.Fatal(err)
		}
	}
	for range 2 {
		if _, err := st.AttemptRecord(ctx, outboxdriver.Source{Consumer: "billing", ID: "m3"}, "boom"); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := st.AttemptRecord(ctx, outboxdriver.Source{Consumer: "billing", ID: "m4"}, "bad payload"); err != nil {
		t.Fatal(err)
	}
	if err := st.MessagePoison(ctx, outboxdriver.Source{Consumer: "billing", ID: "m4"}); err != nil {
		t.Fatal(err)
	}
	// Parked at the time of the statement: a filter on how long ago is strict.
	time.Sleep(5 * time.Millisecond)
	return f
}

func (f opsFixture) auditActions(t *testing.T) []string {
	t.Helper()
	log, err := f.o.AuditLog(context.Background(), 100)
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, a := range log {
		if a.Actor != "alice" || a.Role == "" {
			t.Errorf("audit entry %+v: want actor alice and the database user", a)
		}
		out = append(out, a.Action+" "+a.Target)
	}
	return out
}

func storeIDs(ps []ops.Parked) []int64 {
	var out []int64
	for _, p := range ps {
		out = append(out, p.StoreID)
	}
	return out
}

func TestOpsStatusAndLists(t *testing.T) {
	f := newOpsFixture(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	s, err := f.o.Status(ctx, time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	if s.Totals.Parked != 3 || s.Totals.Failing != 1 {
		t.Errorf("totals %+v: want 3 parked, 1 failing", s.Totals)
	}
	want := []ops.Group{{Consumer: "billing", Topic: "invoices", Parked: 2}, {Consumer: "billing", Topic: "receipts", Parked: 1}}
	if fmt.Sprint(s.Groups) != fmt.Sprint(want) {
		t.Errorf("groups %+v, want %+v", s.Groups, want)
	}
	if len(s.Failing) != 1 || s.Failing[0] != (ops.FailingCount{Consumer: "billing", Messages: 1, Attempts: 2}) {
		t.Errorf("failing %+v, want billing: 1 message, 2 attempts", s.Failing)
	}
	if s.Retained["billing"] != 3 || len(s.Retained) != 1 {
		t.Errorf("retained %v, want billing: 3 (m1, m2, m4)", s.Retained)
	}
	// The count stops at the cap (NULL: more), as outboxdriver.StatsCountCap bounds the status's.
	q, err := f.st.(interface {
		OpsQueries() (store.OpsQueries, error)
	}).OpsQueries()
	if err != nil {
		t.Fatal(err)
	}
	for limit, want := range map[int]string{2: "{0 false}", 3: "{3 true}", 4: "{3 true}"} {
		var n sql.NullInt64
		if err := f.db.QueryRowContext(ctx, q.Retained, limit).Scan(new(string), &n); err != nil || fmt.Sprint(n) != want {
			t.Errorf("retained with a cap of %d: %v, %v; want %s", limit, n, err, want)
		}
	}
	if age := time.Since(s.LastDispatch); s.LastDispatch.IsZero() || age > time.Hour || age < -time.Hour {
		t.Errorf("last dispatch %v, want about now", s.LastDispatch)
	}

	all, err := f.o.ParkedEffects(ctx, ops.ParkedFilter{})
	if err != nil {
		t.Fatal(err)
	}
	if len(all) != 3 || all[0].Source.ID != "m1" || all[0].Attempts != 1 || all[0].Fingerprint != `publish to <str>: refused for order <n>` {
		t.Fatalf("parked %+v", all)
	}
	for _, c := range []struct {
		name string
		f    ops.ParkedFilter
		want []int64
	}{
		{"topic", ops.ParkedFilter{Topic: "invoices"}, f.parked["m1"]},
		{"consumer", ops.ParkedFilter{Consumer: "billing"}, storeIDs(all)},
		{"other consumer", ops.ParkedFilter{Consumer: "Billing"}, nil},
		{"ids", ops.ParkedFilter{IDs: f.parked["m2"]}, f.parked["m2"]},
		{"error", ops.ParkedFilter{ErrorContains: `"receipts"`}, f.parked["m2"]},
		{"error is case-sensitive", ops.ParkedFilter{ErrorContains: "REFUSED"}, nil},
		{"older", ops.ParkedFilter{OlderThan: time.Hour}, nil},
		{"after", ops.ParkedFilter{AfterID: all[0].StoreID, Limit: 1}, storeIDs(all[1:2])},
	} {
		got, err := f.o.ParkedEffects(ctx, c.f)
		if err != nil {
			t.Fatalf("%s: %v", c.name, err)
		}
		if fmt.Sprint(storeIDs(got)) != fmt.Sprint(c.want) {
			t.Errorf("%s: parked %v, want %v", c.name, storeIDs(got), c.want)
		}
	}

	failing, err := f.o.FailingMessages(ctx, "", 0)
	if err != nil {
		t.Fatal(err)
	}
	if len(failing) != 1 || failing[0].MessageID != "m3" || failing[0].Attempts != 2 || failing[0].LastError != "boom" || failing[0].FirstFailedAt.IsZero() {
		t.Errorf("failing %+v, want m3 with 2 attempts", failing)
	}
	if failing, err := f.o.FailingMessages(ctx, "shipping", 0); err != nil || len(failing) != 0 {
		t.Errorf("failing of shipping: %+v, %v; want none", failing, err)
	}
	poisoned, err := f.o.PoisonedMessages(ctx, "billing", 0)
	if err != nil {
		t.Fatal(err)
	}
	if len(poisoned) != 1 || poisoned[0].MessageID != "m4" || poisoned[0].Attempts != 1 || poisoned[0].Reason != "bad payload" {
		t.Errorf("poisoned %+v, want m4 after 1 attempt", poisoned)
	}

	l, err := f.o.Lookup(ctx, "billing", "m1")
	if err != nil {
		t.Fatal(err)
	}
	if !l.Processed || l.Poisoned || len(l.Effects) != 2 || l.Effects[0].State != "parked" || l.Effects[0].Topic != "invoices" || l.Effects[0].LastError == "" {
		t.Errorf("lookup m1: %+v", l)
	}
	if l, err := f.o.Lookup(ctx, "billing", "m3"); err != nil || l.Processed || l.Attempts != 2 || l.LastError != "boom" || len(l.Effects) != 0 {
		t.Errorf("lookup m3: %+v, %v", l, err)
	}

	v, err := f.o.Overview(ctx, ops.OverviewParams{Window: 2})
	if err != nil {
		t.Fatal(err)
	}
	if !v.WindowFull || v.ServiceSampled >= 0 || len(v.Groups) != 1 || v.Groups[0].Parked != 2 {
		t.Errorf("overview with a window of 2: %+v; want the full window, never sampled, 2 parked of invoices", v)
	}
	if v, err := f.o.Overview(ctx, ops.OverviewParams{Window: 3}); err != nil || v.WindowFull || len(v.Groups) != 2 {
		t.Errorf("overview with a window of 3: %+v, %v", v, err)
	}
}

func TestOpsRepairsAreGuardedDryRunnableAndAudited(t *testing.T) {
	f := newOpsFixture(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if _, err := f.o.RetryParked(ctx, ops.ParkedFilter{Limit: 5}, ops.RepairOptions{Actor: "alice"}); !errors.Is(err, ops.ErrNoSelection) {
		t.Errorf("retry without a selection: %v, want ErrNoSelection", err)
	}
	if _, err := f.o.RetryParked(ctx, ops.ParkedFilter{All: true}, ops.RepairOptions{}); err == nil {
		t.Error("retry without an actor: no error")
	}
	ch, err := f.o.RetryParked(ctx, ops.ParkedFilter{Topic: "invoices"}, ops.RepairOptions{Actor: "alice", DryRun: true})
	if err != nil {
		t.Fatal(err)
	}
	if ch.Matched != 2 || ch.Changed != 0 || fmt.Sprint(ch.IDs) != fmt.Sprint(f.parked["m1"]) {
		t.Errorf("dry run: %+v", ch)
	}
	if got, _ := f.o.ParkedEffects(ctx, ops.ParkedFilter{}); len(got) != 3 {
		t.Errorf("after the dry run %d parked, want 3", len(got))
	}
	if a := f.auditActions(t); len(a) != 0 {
		t.Errorf("a dry run wrote %v to the audit table", a)
	}

	ch, err = f.o.RetryParked(ctx, ops.ParkedFilter{Topic: "invoices", Limit: 1}, ops.RepairOptions{Actor: "alice"})
	if err != nil {
		t.Fatal(err)
	}
	if ch.Changed != 1 || !ch.More {
		t.Errorf("retry with limit 1: %+v; want 1 changed, more matched", ch)
	}
	ch, err = f.o.RetryParked(ctx, ops.ParkedFilter{Topic: "invoices"}, ops.RepairOptions{Actor: "alice", BatchSize: 1})
	if err != nil || ch.Changed != 1 || ch.More {
		t.Errorf("retry of the rest: %+v, %v", ch, err)
	}
	if l, _ := f.o.Lookup(ctx, "billing", "m1"); len(l.Effects) != 2 || l.Effects[0].State != "pending" || l.Effects[1].State != "pending" {
		t.Errorf("m1 after the retry: %+v; want both pending", l.Effects)
	}
	pending, err := f.st.Stats(ctx, outboxdriver.StatsParams{})
	if err != nil || pending.Pending != 2 || pending.Parked != 1 {
		t.Errorf("stats after the retry: %+v, %v; want 2 pending, 1 parked", pending, err)
	}

	if ch, err := f.o.DiscardParked(ctx, ops.ParkedFilter{All: true}, ops.RepairOptions{Actor: "alice", DryRun: true}); err != nil || ch.Matched != 1 || ch.Changed != 0 {
		t.Errorf("discard dry run: %+v, %v", ch, err)
	}
	if ch, err := f.o.DiscardParked(ctx, ops.ParkedFilter{All: true}, ops.RepairOptions{Actor: "alice", Remote: "10.0.0.7"}); err != nil || ch.Changed != 1 {
		t.Errorf("discard: %+v, %v", ch, err)
	}
	l, err := f.o.Lookup(ctx, "billing", "m2")
	if err != nil || len(l.Effects) != 1 || l.Effects[0].State != "discarded" || !l.Effects[0].DispatchedAt.IsZero() || l.Effects[0].DiscardedAt.IsZero() {
		t.Errorf("m2 after the discard: %+v, %v", l, err)
	}

	if ok, err := f.o.ReplayPoisoned(ctx, "billing", "m4", ops.RepairOptions{}); err == nil || ok {
		t.Error("replay without an actor: no error")
	}
	if ok, err := f.o.ReplayPoisoned(ctx, "billing", "m4", ops.RepairOptions{Actor: "alice", DryRun: true}); err != nil || !ok {
		t.Errorf("replay dry run: %v, %v; want poisoned", ok, err)
	}
	if l, _ := f.o.Lookup(ctx, "billing", "m4"); !l.Poisoned {
		t.Errorf("m4 after the dry run: %+v; want still poisoned", l)
	}
	if ok, err := f.o.ReplayPoisoned(ctx, "billing", "m3", ops.RepairOptions{Actor: "alice"}); err != nil || ok {
		t.Errorf("replay of a message not poisoned: %v, %v", ok, err)
	}
	if ok, err := f.o.ReplayPoisoned(ctx, "billing", "m4", ops.RepairOptions{Actor: "alice"}); err != nil || !ok {
		t.Errorf("replay: %v, %v", ok, err)
	}
	if l, _ := f.o.Lookup(ctx, "billing", "m4"); l.Processed || l.Attempts != 0 {
		t.Errorf("m4 after the replay: %+v; want neither claim nor attempts", l)
	}
	if p, err := f.o.PoisonedMessages(ctx, "", 0); err != nil || len(p) != 0 {
		t.Errorf("poisoned after the replay: %+v, %v", p, err)
	}

	m1 := f.parked["m1"]
	want := []string{
		"replay-poisoned billing/m4", // and none for m3: nothing was replayed
		fmt.Sprintf("discard-parked effects %d", f.parked["m2"][0]),
		fmt.Sprintf("retry-parked effects %d", m1[1]),
		fmt.Sprintf("retry-parked effects %d", m1[0]),
	}
	if got := f.auditActions(t); fmt.Sprint(got) != fmt.Sprint(want) {
		t.Errorf("audit log\n%q, want\n%q", got, want)
	}
	log, _ := f.o.AuditLog(ctx, 3)
	if len(log) != 3 || log[1].Remote != "10.0.0.7" || log[1].Detail != "1 of 1 changed" || log[1].At.IsZero() {
		t.Errorf("audit entry of the discard: %+v", log[1])
	}
}

func TestOpsCleanupGuardAndDryRun(t *testing.T) {
	f := newOpsFixture(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if _, err := f.o.DiscardParked(ctx, ops.ParkedFilter{IDs: f.parked["m2"]}, ops.RepairOptions{Actor: "alice"}); err != nil {
		t.Fatal(err)
	}
	if _, err := f.o.Cleanup(ctx, ops.CleanupOptions{Actor: "alice", Retention: time.Hour}); !errors.Is(err, ops.ErrRetentionTooShort) {
		t.Errorf("cleanup below the default retention with none recorded: %v, want ErrRetentionTooShort", err)
	}
	if _, err := f.o.Cleanup(ctx, ops.CleanupOptions{Actor: "alice"}); !errors.Is(err, ops.ErrRetentionUnknown) {
		t.Errorf("cleanup with no retention: %v, want ErrRetentionUnknown", err)
	}
	rec, ok := f.st.(outboxdriver.ConfigRecorder)
	if !ok {
		t.Fatalf("%T records no configuration", f.st)
	}
	if err := rec.RecordServiceConfig(ctx, outboxdriver.ServiceConfig{Retention: 2 * time.Hour, EffectRetention: time.Hour}); err != nil {
		t.Fatal(err)
	}
	c, err := f.o.ServiceConfig(ctx)
	if err != nil || c.Retention != 2*time.Hour || c.EffectRetention != time.Hour || c.RecordedAt.IsZero() {
		t.Fatalf("service configuration %+v, %v", c, err)
	}
	if _, err := f.o.Cleanup(ctx, ops.CleanupOptions{Actor: "alice", Retention: time.Hour}); !errors.Is(err, ops.ErrRetentionTooShort) {
		t.Errorf("cleanup below the service's retention: %v, want ErrRetentionTooShort", err)
	}
	if a := f.auditActions(t); len(a) != 1 {
		t.Errorf("refused cleanups wrote to the audit table: %v", a)
	}

	time.Sleep(5 * time.Millisecond)
	forced := ops.CleanupOptions{Actor: "alice", Retention: time.Millisecond, EffectRetention: time.Millisecond, Force: true}
	dry := forced
	dry.DryRun = true
	rep, err := f.o.Cleanup(ctx, dry)
	if err != nil {
		t.Fatal(err)
	}
	// The claims of m2 (its only effect discarded) and m4 (poisoned), m2's effect, and the
	// attempt counters of m3 and m4; m1's claim stays with its parked effects.
	if !rep.DryRun || rep.Claims != 2 || rep.Effects != 1 || rep.Attempts != 2 {
		t.Errorf("dry run: %+v; want 2 claims (m2, m4), 1 effect, 2 attempt counters", rep)
	}
	if l, _ := f.o.Lookup(ctx, "billing", "m2"); !l.Processed || len(l.Effects) != 1 {
		t.Errorf("m2 after the dry run: %+v; want kept", l)
	}
	if a := f.auditActions(t); len(a) != 1 {
		t.Errorf("the dry run wrote to the audit table: %v", a)
	}
	rep, err = f.o.Cleanup(ctx, forced)
	if err != nil {
		t.Fatal(err)
	}
	if rep.Claims != 2 || rep.Effects != 1 || rep.Attempts != 2 {
		t.Errorf("cleanup: %+v; want what the dry run counted", rep)
	}
	if l, _ := f.o.Lookup(ctx, "billing", "m2"); l.Processed || len(l.Effects) != 0 {
		t.Errorf("m2 after the cleanup: %+v; want gone", l)
	}
	got := f.auditActions(t)
	if len(got) != 3 || got[0] != "cleanup-done expired rows" || got[1] != "cleanup expired rows" {
		t.Errorf("audit log %q: want cleanup and cleanup-done", got)
	}
	log, _ := f.o.AuditLog(ctx, 2)
	if !strings.Contains(log[0].Detail, "deleted 2 claims, 1 dispatched effects, 2 attempt counters") || !strings.Contains(log[1].Detail, "forced") {
		t.Errorf("cleanup entries %+v", log)
	}
}

// TestIsInsufficientPrivilege: the refusals that make the audit log unreadable to an application
// account (ops.ErrAuditUnreadable). The tests' own server runs without grant tables, so the
// refusal itself cannot be provoked there.
func TestIsInsufficientPrivilege(t *testing.T) {
	for n, want := range map[uint16]bool{1142: true, 1143: true, 1044: true, 1227: true, 1146: false, 1213: false} {
		err := fmt.Errorf("read the audit log: %w", &gomysql.MySQLError{Number: n})
		if got := mysql.IsInsufficientPrivilege(err); got != want {
			t.Errorf("error %d: insufficient privilege %v, want %v", n, got, want)
		}
	}
}

// TestConsoleOnMySQL: ops.ForOutbox takes the Outbox's driver, and the console, which reads and
// repairs through ops, serves MySQL's tables.
func TestConsoleOnMySQL(t *testing.T) {
	f := newOpsFixture(t)
	ob, err := outbox.New(outbox.Config{DB: f.db, Driver: mysql.Driver{}, Publisher: &outboxtest.Recorder{}})
	if err != nil {
		t.Fatal(err)
	}
	defer ob.Close()
	o, err := ops.ForOutbox(ob)
	if err != nil {
		t.Fatal(err)
	}
	h, err := console.New(o, console.Options{
		Authenticate: func(r *http.Request) (string, bool) { return "alice", true },
		Authorize:    func(*http.Request, string, console.Action) bool { return true },
	})
	if err != nil {
		t.Fatal(err)
	}
	rec := httptest.NewRecorder()
	h.ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/", nil))
	body := rec.Body.String()
	if rec.Code != http.StatusOK || !strings.Contains(body, "invoices") || !strings.Contains(body, "receipts") || !strings.Contains(body, "m4") {
		t.Errorf("console page: %d\n%s", rec.Code, body)
	}
}
