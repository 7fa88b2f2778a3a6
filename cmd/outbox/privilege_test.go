package main

import (
	"bytes"
	"context"
	"crypto/rand"
	"database/sql"
	"encoding/hex"
	"errors"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/watermill-outbox/outbox"
	"github.com/watermill-outbox/outbox/drivers/postgres"
	"github.com/watermill-outbox/outbox/internal/pgtest"
	"github.com/watermill-outbox/outbox/ops"
)

// cliAs runs the command against dsn and returns its exit status, stdout and stderr.
func cliAs(dsn string, args ...string) (int, string, string) {
	var out, errOut bytes.Buffer
	env := map[string]string{"OUTBOX_DSN": dsn, "USER": "alice"}
	code := run(context.Background(), args, &out, &errOut, func(k string) string { return env[k] })
	return code, out.String(), errOut.String()
}

// newRole creates a login role on the server of ownerDSN that holds exactly what
// `outbox migrate grants` prints for the tables of schema and prefix (with -operator when
// operator), and returns a DSN that connects as it.
func newRole(t *testing.T, ownerDSN, schema, prefix string, operator bool) (dsn, role string) {
	t.Helper()
	var b [4]byte
	_, _ = rand.Read(b[:])
	role = "r_" + hex.EncodeToString(b[:])
	args := []string{"-schema", schema, "-prefix", prefix, "migrate", "grants", role}
	if operator {
		args = []string{"-schema", schema, "-prefix", prefix, "migrate", "grants", "-operator", role}
	}
	code, grants, errOut := cliAs("", args...)
	if code != 0 {
		t.Fatalf("outbox %v: %d %s", args, code, errOut)
	}
	owner := openDB(t, ownerDSN)
	if _, err := owner.Exec(`CREATE ROLE ` + role + ` LOGIN PASSWORD 'pw-` + role + `'`); err != nil {
		t.Fatal(err)
	}
	if _, err := owner.Exec(grants); err != nil {
		t.Fatalf("applying the grants: %v\n%s", err, grants)
	}
	u, err := url.Parse(ownerDSN)
	if err != nil {
		t.Fatal(err)
	}
	u.User = url.UserPassword(role, "pw-"+role)
	return u.String(), role
}

func openDB(t *testing.T, dsn string) *sql.DB {
	t.Helper()
	db, err := sql.Open("postgres", dsn)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = db.Close() })
	return db
}

// Every table and sequence the migrations create is granted to the application's role, which
// can change no schema, for the default names and for a schema and prefix of its own.
func TestGrantsCoverEveryTable(t *testing.T) {
	ownerDSN := pgtest.DSN(t)
	owner := openDB(t, ownerDSN)
	for _, names := range [][2]string{{"public", "outbox_"}, {"shop", "ob_"}} {
		schema, prefix := names[0], names[1]
		if code, out, errOut := cliAs(ownerDSN, "-schema", schema, "-prefix", prefix, "migrate", "up"); code != 0 {
			t.Fatalf("migrate up: %s %s", out, errOut)
		}
		_, role := newRole(t, ownerDSN, schema, prefix, false)
		rows, err := owner.Query(`SELECT c.relname, c.relkind::text,
				CASE WHEN c.relkind = 'S' THEN has_sequence_privilege($2, c.oid, 'USAGE')
				     ELSE has_table_privilege($2, c.oid, 'SELECT') OR has_table_privilege($2, c.oid, 'INSERT') END,
				c.relkind <> 'S' AND (has_table_privilege($2, c.oid, 'REFERENCES, TRIGGER')
					-- The relay empties the partitions of the effects table (migration 023).
					OR c.relname NOT IN ($3 || 'effects', $3 || 'effects_1', $3 || 'effects_2') AND has_table_privilege($2, c.oid, 'TRUNCATE'))
			FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
			WHERE n.nspname = $1 AND c.relkind IN ('r', 'p', 'S') ORDER BY 1`, schema, role, prefix)
		if err != nil {
			t.Fatal(err)
		}
		var tables, sequences int
		for rows.Next() {
			var name, kind string
			var granted, tooMuch bool
			if err := rows.Scan(&name, &kind, &granted, &tooMuch); err != nil {
				t.Fatal(err)
			}
			if kind == "S" {
				sequences++
			} else {
				tables++
			}
			if !granted {
				t.Errorf("%s.%s (relkind %s) is not granted to the application role", schema, name, kind)
			}
			if tooMuch {
				t.Errorf("%s.%s: the application role may truncate it (other than a partition of the effects table), or reference or trigger on it", schema, name)
			}
		}
		if err := errors.Join(rows.Err(), rows.Close()); err != nil {
			t.Fatal(err)
		}
		if tables < 7 || sequences < 2 {
			t.Fatalf("%s: %d tables, %d sequences found; the migrations create at least 7 and 2", schema, tables, sequences)
		}
		var create, auditRead bool
		if err := owner.QueryRow(`SELECT has_schema_privilege($1, $2, 'CREATE'),
			has_table_privilege($1, format('%I.%I', $2::text, $3::text || 'audit'), 'SELECT')`, role, schema, prefix).Scan(&create, &auditRead); err != nil {
			t.Fatal(err)
		}
		if create || auditRead {
			t.Errorf("%s: the application role may create in the schema (%v) or read the audit table (%v)", schema, create, auditRead)
		}
	}
}

// psql returns the path of psql: on PATH, or PostgreSQL 15's.
func psql(t *testing.T) string {
	t.Helper()
	if p, err := exec.LookPath("psql"); err == nil {
		return p
	}
	p := "/usr/lib/postgresql/15/bin/psql"
	if _, err := os.Stat(p); err != nil {
		t.Skip("no psql")
	}
	return p
}

// `outbox migrate sql` applied with psql to an empty database gives the tables Migrate gives:
// CheckSchema is satisfied, and Migrate then changes nothing.
func TestMigrateSQLAppliesToAnEmptyDatabase(t *testing.T) {
	for _, names := range [][2]string{{"", "outbox_"}, {"billing", "ob_"}} {
		schema, prefix := names[0], names[1]
		t.Run(schema+prefix, func(t *testing.T) {
			dsn := pgtest.DSN(t)
			args := []string{"-prefix", prefix, "migrate", "sql"}
			if schema != "" {
				args = append([]string{"-schema", schema}, args...)
			}
			code, script, errOut := cliAs("", args...)
			if code != 0 {
				t.Fatalf("migrate sql: %d %s", code, errOut)
			}
			file := filepath.Join(t.TempDir(), "outbox.sql")
			if err := os.WriteFile(file, []byte(script), 0o600); err != nil {
				t.Fatal(err)
			}
			ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			defer cancel()
			out, err := exec.CommandContext(ctx, psql(t), "-X", "-q", "-v", "ON_ERROR_STOP=1", "-d", dsn, "-f", file).CombinedOutput()
			if err != nil {
				t.Fatalf("psql -f (migrate sql): %v\n%s", err, out)
			}
			o, err := ops.Open(openDB(t, dsn), schema, prefix)
			if err != nil {
				t.Fatal(err)
			}
			if err := o.Store().SchemaCheck(ctx); err != nil {
				t.Fatalf("CheckSchema after applying the script: %v", err)
			}
			db := openDB(t, dsn)
			if schema == "" {
				schema = "public"
			}
			applied := func() string {
				var s string
				if err := db.QueryRow(`SELECT string_agg(version || '@' || applied_at, ',' ORDER BY version) FROM "` + schema + `"."` + prefix + `migrations"`).Scan(&s); err != nil {
					t.Fatal(err)
				}
				return s
			}
			before := applied()
			if err := o.Store().Migrate(ctx); err != nil {
				t.Fatal(err)
			}
			if after := applied(); after != before {
				t.Errorf("Migrate after the script changed the applied migrations:\n%s\n%s", before, after)
			}
		})
	}
}

// errorLog is a watermill logger that keeps the errors.
type errorLog struct {
	watermill.LoggerAdapter
	mu   sync.Mutex
	errs []string
}

func (l *errorLog) Error(msg string, err error, _ watermill.LogFields) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.errs = append(l.errs, msg+": "+err.Error())
}
func (l *errorLog) With(watermill.LogFields) watermill.LoggerAdapter { return l }
func (l *errorLog) all() []string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return append([]string(nil), l.errs...)
}

// The service runs as the application's role, holding exactly the grants the command prints:
// it migrates (nothing to do), sends what a crash left, samples its stats, records its
// retention and parks what the broker refuses; an operator's role then runs every repair of
// docs/operations.md, and the application's role retries too, every change audited.
func TestLeastPrivilegedRoles(t *testing.T) {
	ownerDSN := pgtest.DSN(t)
	if code, out, errOut := cliAs(ownerDSN, "migrate", "up"); code != 0 {
		t.Fatalf("migrate up: %s %s", out, errOut)
	}
	appDSN, _ := newRole(t, ownerDSN, "public", "outbox_", false)
	opDSN, _ := newRole(t, ownerDSN, "public", "outbox_", true)
	owner := openDB(t, ownerDSN)
	appDB := openDB(t, appDSN)
	ctx := context.Background()

	pub := &refusing{}
	logs := &errorLog{LoggerAdapter: watermill.NopLogger{}}
	crash := errors.New("crash")
	crashNow := make(chan bool, 1)
	ob, err := outbox.New(outbox.Config{DB: appDB, Driver: postgres.Driver{}, Publisher: pub, Logger: logs,
		RelayMaxAttempts: 1, MaxAttempts: 1, PoisonTopic: "poison", RetryDelay: -1, RelayGrace: 100 * time.Millisecond,
		RelayInterval: 50 * time.Millisecond, StatsInterval: 50 * time.Millisecond, RedeliveryHorizon: 48 * time.Hour,
		Failpoint: func(_ context.Context, point string) error {
			if point != outbox.FailpointAfterCommit {
				return nil
			}
			select {
			case <-crashNow:
				return crash
			default:
				return nil
			}
		}})
	if err != nil {
		t.Fatal(err)
	}
	if err := ob.Migrate(ctx); err != nil {
		t.Fatalf("Migrate as the application role (nothing to do): %v", err)
	}
	handle := func(id, payload string) error {
		return ob.Handle(message.NewMessage(id, nil), outbox.HandleParams{Consumer: "billing", MessageID: id, Topic: "orders"},
			func(msg *message.Message) ([]*message.Message, error) {
				if payload == "bad input" {
					return nil, errors.New("bad input")
				}
				if err := outbox.Publish(msg.Context(), "ok", message.NewMessage(watermill.NewUUID(), []byte("fine"))); err != nil {
					return nil, err
				}
				return nil, outbox.Publish(msg.Context(), "invoices", message.NewMessage(watermill.NewUUID(), []byte(payload)))
			})
	}
	crashNow <- true
	if err := handle("m-crashed", "fine"); !errors.Is(err, crash) {
		t.Fatalf("crash after commit: %v", err)
	}
	if err := handle("m-parked", "poison"); !errors.Is(err, outbox.ErrDispatchFailed) {
		t.Fatalf("parking: %v", err)
	}
	for _, id := range []string{"m-poisoned", "m-dead-retried", "m-dead-discarded"} {
		if err := handle(id, "bad input"); err != nil {
			t.Fatalf("dead-lettering %s: %v", id, err)
		}
	}

	logs.mu.Lock()
	logs.errs = nil // those of the crash, the parking and the poisoning
	logs.mu.Unlock()
	runCtx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- ob.Run(runCtx) }()
	var once sync.Once
	stop := func() { once.Do(func() { cancel(); <-done }) }
	t.Cleanup(stop)
	deadline := time.Now().Add(20 * time.Second)
	for {
		var sampled, recorded bool
		var left int
		if err := owner.QueryRow(`SELECT sampled_at IS NOT NULL, retention_ms IS NOT NULL,
			(SELECT count(*) FROM outbox_effects_all WHERE parked_at IS NULL) FROM outbox_stats`).Scan(&sampled, &recorded, &left); err != nil {
			t.Fatal(err)
		}
		if left == 0 && sampled && recorded {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("as the application role: %d effects not sent nor parked (want the crashed ones sent), stats sampled %v, retention recorded %v; errors: %v",
				left, sampled, recorded, logs.all())
		}
		time.Sleep(20 * time.Millisecond)
	}
	stop()
	ob.FlushMarks()
	if errs := logs.all(); len(errs) > 0 {
		t.Errorf("the service logged errors as the application role: %v", errs)
	}

	var parkedID string
	if err := owner.QueryRow(`SELECT id::text FROM outbox_effects_all WHERE parked_at IS NOT NULL`).Scan(&parkedID); err != nil {
		t.Fatal(err)
	}
	audits := func() int {
		var n int
		if err := owner.QueryRow(`SELECT count(*) FROM outbox_audit`).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}
	// The application's role repairs through ops (the console's path): audited, though it may
	// not read the audit table back.
	o, err := ops.ForOutbox(ob)
	if err != nil {
		t.Fatal(err)
	}
	s, err := o.Status(ctx, 0)
	if err != nil || !s.AuditUnreadable {
		t.Fatalf("status as the application role: %v, audit unreadable %v", err, s.AuditUnreadable)
	}
	if ch, err := o.RetryParked(ctx, ops.ParkedFilter{Topic: "invoices"}, ops.RepairOptions{Actor: "app"}); err != nil || ch.Changed != 1 {
		t.Fatalf("retry as the application role: %+v %v", ch, err)
	}
	if n := audits(); n != 1 {
		t.Fatalf("after the application role's retry: %d audit rows, want 1", n)
	}
	if _, err := owner.Exec(`UPDATE outbox_effects_all SET parked_at = now() - interval '2 hours' WHERE id = $1`, parkedID); err != nil {
		t.Fatal(err)
	}
	// A message whose handler failed once, for dead now.
	if _, err := owner.Exec(`INSERT INTO outbox_attempts (consumer, message_id, attempts, last_error) VALUES ('billing', 'm-failing', 1, 'carrier API timeout')`); err != nil {
		t.Fatal(err)
	}
	// The operator's role runs every command of docs/operations.md.
	for _, args := range [][]string{
		{"status"},
		{"-o", "json", "status"},
		{"parked", "list", "-topic", "invoices", "-older-than", "1h"},
		{"parked", "groups"},
		{"parked", "retry", "-error", "schema v2", "-dry-run"},
		{"parked", "retry", "-error", "schema v2", "-batch", "200"},
		{"failing", "list", "-consumer", "billing"},
		{"dead", "now", "-dry-run", "billing", "m-failing"},
		{"dead", "now", "billing", "m-failing"},
		{"lookup", "billing", "m-parked"},
		{"replay", "billing", "m-poisoned"},
		{"dead", "list"},
		{"dead", "list", "-consumer", "billing", "-state", "dead"},
		{"-o", "json", "dead", "groups"},
		{"dead", "retry", "-dry-run", "billing", "m-dead-retried"},
		{"migrate", "status"},
		{"cleanup", "-dry-run"},
		{"cleanup"},
		{"cleanup", "-retention", "1h", "-force"},
	} {
		// Nothing matched (exit 1, saying so) is an answer too: the role may run the command.
		code, out, errOut := cliAs(opDSN, args...)
		if code != 0 && (code != 1 || !strings.HasPrefix(errOut, "outbox: nothing matched:")) {
			t.Errorf("outbox %v as the operator's role: exit %d: %s%s", args, code, out, errOut)
		}
	}
	if _, err := owner.Exec(`UPDATE outbox_effects_all SET parked_at = now(), dispatched_at = NULL WHERE id = $1`, parkedID); err != nil {
		t.Fatal(err)
	}
	// The changes must change something: "nothing matched" would hide a refused statement.
	for _, args := range [][]string{
		{"parked", "discard", "-id", parkedID},
		{"dead", "retry", "billing", "m-dead-retried"},
		{"dead", "discard", "billing", "m-dead-discarded"},
	} {
		if code, out, errOut := cliAs(opDSN, args...); code != 0 {
			t.Errorf("outbox %v as the operator's role: exit %d: %s%s", args, code, out, errOut)
		}
	}
	code, out, _ := cliAs(opDSN, "status")
	for _, action := range []string{"retry-parked", "replay-poisoned", "cleanup", "discard-parked", "retry-dead-letter", "discard-dead-letter", "dead-letter-now"} {
		if code != 0 || !strings.Contains(out, action) {
			t.Errorf("status as the operator's role: want %s among the recent changes: %d %s", action, code, out)
		}
	}
	if code, out, errOut := cliAs(appDSN, "parked", "list"); code != 0 && (code != 1 || !strings.HasPrefix(errOut, "outbox: nothing matched:")) {
		t.Errorf("parked list as the application role: %d %s%s", code, out, errOut)
	}
}

// A repair whose audit entry cannot be written is not applied: the entry is written in the
// transaction of the change.
func TestRepairWithoutItsAuditEntryIsNotApplied(t *testing.T) {
	f := newFixture(t)
	if _, err := f.db.Exec(`CREATE ROLE noaudit LOGIN PASSWORD 'pw';
		GRANT SELECT, INSERT, UPDATE, DELETE ON outbox_processed, outbox_effects_all, outbox_dispatched, outbox_attempts, outbox_stats, outbox_migrations, outbox_dead_letters TO noaudit;
		GRANT USAGE ON ALL SEQUENCES IN SCHEMA public TO noaudit;`); err != nil {
		t.Fatal(err)
	}
	u, _ := url.Parse(f.dsn)
	u.User = url.UserPassword("noaudit", "pw")
	parked := func() int {
		var n int
		if err := f.db.QueryRow(`SELECT count(*) FROM outbox_effects_all WHERE parked_at IS NOT NULL`).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}
	code, out, errOut := cliAs(u.String(), "parked", "retry", "-topic", "invoices")
	if code != 1 || parked() != 2 {
		t.Errorf("retry without the right to audit: exit %d (want 1), %d parked (want 2, unchanged): %s%s", code, parked(), out, errOut)
	}
	code, out, errOut = cliAs(u.String(), "replay", "billing", "m-poisoned")
	var poisoned bool
	if err := f.db.QueryRow(`SELECT poisoned FROM outbox_processed WHERE message_id = 'm-poisoned'`).Scan(&poisoned); err != nil || code != 1 || !poisoned {
		t.Errorf("replay without the right to audit: exit %d (want 1), still poisoned %v (%v): %s%s", code, poisoned, err, out, errOut)
	}
	if !strings.Contains(errOut, "outbox_audit") {
		t.Errorf("replay without the right to audit: want the audit table named as the cause: %s", errOut)
	}
	var state string
	if err := f.db.QueryRow(`SELECT state FROM outbox_dead_letters WHERE message_id = 'm-poisoned'`).Scan(&state); err != nil || state != "dead" {
		t.Errorf("replay without the right to audit: its dead letter is %q (%v), want it left dead", state, err)
	}
}

// docs/operations.md shows the grants the command prints.
func TestDocumentedGrantsAreTheCommands(t *testing.T) {
	doc, err := os.ReadFile("../../docs/operations.md")
	if err != nil {
		t.Fatal(err)
	}
	code, grants, errOut := cliAs("", "migrate", "grants", "app")
	if code != 0 {
		t.Fatalf("migrate grants: %d %s", code, errOut)
	}
	if !strings.Contains(string(doc), "```sql\n"+grants+"```") {
		t.Errorf("docs/operations.md does not show the grants of `outbox migrate grants app`:\n%s", grants)
	}
}
