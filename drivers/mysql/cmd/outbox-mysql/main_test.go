package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"strings"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/watermill-outbox/outbox/drivers/mysql"
	"github.com/watermill-outbox/outbox/drivers/mysql/internal/mysqltest"
	"github.com/watermill-outbox/outbox/ops"
	"github.com/watermill-outbox/outbox/outboxdriver"
)

func TestMain(m *testing.M) {
	code := mysqltest.Run(m)
	if code == 0 {
		if err := goleak.Find(); err != nil {
			fmt.Fprintln(os.Stderr, "goleak:", err)
			code = 1
		}
	}
	os.Exit(code)
}

// cli runs the command on dsn as alice and returns its exit status, stdout and stderr.
func cli(t *testing.T, dsn string, args ...string) (int, string, string) {
	t.Helper()
	var out, errOut bytes.Buffer
	env := map[string]string{"OUTBOX_DSN": dsn, "USER": "alice"}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	code := run(ctx, args, &out, &errOut, func(k string) string { return env[k] })
	return code, out.String(), errOut.String()
}

// bareDSN is a fresh database's DSN without the parameters the outbox needs: the command sets
// them.
func bareDSN(t *testing.T) string {
	dsn := mysqltest.DSN(t)
	return "mysql://" + dsn[:strings.Index(dsn, "?")]
}

// seed stores, for consumer "billing", m1 with two parked effects to "invoices", m2 with one
// parked effect to "receipts", m3 failing and m4 poisoned; it returns the store IDs of m2's.
func seed(t *testing.T, dsn string) []int64 {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	db, err := open(dsn, time.Time{})
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	o, err := ops.OpenWith(db, ops.Options{Driver: mysql.Driver{}})
	if err != nil {
		t.Fatal(err)
	}
	st := o.Store()
	var m2 []int64
	for _, m := range []struct {
		id     string
		topics []string
	}{{"m1", []string{"invoices", "invoices"}}, {"m2", []string{"receipts"}}} {
		src := outboxdriver.Source{Consumer: "billing", ID: m.id}
		tx, err := db.BeginTx(ctx, nil)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := st.MessageClaim(ctx, tx, src); err != nil {
			t.Fatal(err)
		}
		var e []outboxdriver.Effect
		for i, topic := range m.topics {
			e = append(e, outboxdriver.Effect{Seq: i, Topic: topic, UUID: fmt.Sprint("u", i), Payload: []byte("x"), Metadata: map[string]string{}, OrderingKey: m.id})
		}
		if _, err := st.EffectInsert(ctx, tx, src, e); err != nil {
			t.Fatal(err)
		}
		if err := tx.Commit(); err != nil {
			t.Fatal(err)
		}
		for _, e := range e {
			if err := st.EffectRecordFailures(ctx, outboxdriver.EffectFailure{StoreID: e.StoreID, Reason: "refused", Counted: true, Park: true, RetryAfter: time.Hour}); err != nil {
				t.Fatal(err)
			}
			if m.id == "m2" {
				m2 = append(m2, e.StoreID)
			}
		}
	}
	if _, err := st.AttemptRecord(ctx, outboxdriver.Source{Consumer: "billing", ID: "m3"}, "boom"); err != nil {
		t.Fatal(err)
	}
	if err := st.MessagePoison(ctx, outboxdriver.Source{Consumer: "billing", ID: "m4"}); err != nil {
		t.Fatal(err)
	}
	time.Sleep(5 * time.Millisecond)
	return m2
}

func TestCommandsOnMySQL(t *testing.T) {
	dsn := bareDSN(t)
	if code, _, errOut := cli(t, dsn, "status"); code != 1 || !strings.Contains(errOut, "run `outbox migrate up`") {
		t.Errorf("status without the tables: exit %d: %s; want 1 and the fix", code, errOut)
	}
	code, out, errOut := cli(t, dsn, "migrate", "up")
	if code != 0 || !strings.Contains(out, "applied 9 migration(s): 001_init, 002_idempotency, 003_delayed, 004_binary_identifiers, 005_dead_letters, 006_delayed_key, 007_dead_letter_now, 008_backoff_until, 009_dead_letter_uuid") {
		t.Fatalf("migrate up: exit %d: %s%s", code, out, errOut)
	}
	if code, out, _ := cli(t, dsn, "migrate", "up"); code != 0 || !strings.Contains(out, "no migration to apply") {
		t.Errorf("migrate up again: exit %d: %s", code, out)
	}
	m2 := seed(t, dsn)

	code, out, errOut = cli(t, dsn, "-o", "json", "status")
	var s ops.Status
	if code != 0 || json.Unmarshal([]byte(out), &s) != nil {
		t.Fatalf("status: exit %d: %s%s", code, out, errOut)
	}
	if s.Totals.Parked != 3 || s.Totals.Failing != 1 || len(s.Groups) != 2 || s.Retained["billing"] != 3 {
		t.Errorf("status %+v", s)
	}

	if code, _, errOut := cli(t, dsn, "parked", "retry"); code != 2 || !strings.Contains(errOut, "select the effects") {
		t.Errorf("retry without a selection: exit %d: %s", code, errOut)
	}
	code, out, _ = cli(t, dsn, "parked", "retry", "-topic", "invoices", "-dry-run")
	if code != 0 || !strings.Contains(out, "dry run: retry would change 2 parked effect(s)") {
		t.Errorf("retry dry run: exit %d: %s", code, out)
	}
	code, out, _ = cli(t, dsn, "-o", "json", "parked", "list")
	var parked []ops.Parked
	if code != 0 || json.Unmarshal([]byte(out), &parked) != nil || len(parked) != 3 {
		t.Fatalf("list after the dry run: exit %d: %s; want 3 parked", code, out)
	}
	if code, out, _ := cli(t, dsn, "parked", "retry", "-topic", "invoices"); code != 0 || !strings.Contains(out, "retry: 2 of 2 parked effect(s) changed (audited as alice)") {
		t.Errorf("retry: exit %d: %s", code, out)
	}
	if code, out, _ := cli(t, dsn, "parked", "discard", "-id", fmt.Sprint(m2[0])); code != 0 || !strings.Contains(out, "discard: 1 of 1") {
		t.Errorf("discard: exit %d: %s", code, out)
	}
	if code, _, errOut := cli(t, dsn, "parked", "discard", "-all"); code != 1 || !strings.Contains(errOut, "no parked effect matched") {
		t.Errorf("discard with none parked: exit %d: %s", code, errOut)
	}
	if code, out, _ := cli(t, dsn, "failing", "list"); code != 0 || !strings.Contains(out, "m3") || !strings.Contains(out, "boom") {
		t.Errorf("failing list: exit %d: %s", code, out)
	}
	if code, out, _ := cli(t, dsn, "replay", "-dry-run", "billing", "m4"); code != 0 || !strings.Contains(out, "dry run: billing/m4 is poisoned") {
		t.Errorf("replay dry run: exit %d: %s", code, out)
	}
	if code, out, _ := cli(t, dsn, "replay", "billing", "m4"); code != 0 || !strings.Contains(out, "its next delivery runs the handler") {
		t.Errorf("replay: exit %d: %s", code, out)
	}
	if code, out, _ := cli(t, dsn, "lookup", "billing", "m1"); code != 0 || strings.Count(out, "pending") != 2 || !strings.Contains(out, "processed at") {
		t.Errorf("lookup: exit %d: %s", code, out)
	}

	if code, _, errOut := cli(t, dsn, "cleanup", "-retention", "1h"); code != 1 || !strings.Contains(errOut, "below the default") {
		t.Errorf("cleanup below the default retention: exit %d: %s", code, errOut)
	}
	code, out, errOut = cli(t, dsn, "-o", "json", "cleanup", "-retention", "1ms", "-effect-retention", "1ms", "-force", "-dry-run")
	var rep ops.CleanupReport
	if code != 0 || json.Unmarshal([]byte(out), &rep) != nil || !rep.DryRun || rep.Claims != 1 || rep.Effects != 1 {
		t.Errorf("cleanup dry run: exit %d: %s%s; want the claim and the effect of m2", code, out, errOut)
	}
	if code, out, _ := cli(t, dsn, "lookup", "billing", "m2"); code != 0 || !strings.Contains(out, "discarded") {
		t.Errorf("m2 after the dry run: exit %d: %s; want kept", code, out)
	}
	if code, out, errOut := cli(t, dsn, "cleanup", "-retention", "1ms", "-effect-retention", "1ms", "-force"); code != 0 || !strings.Contains(out, "deleted 1 claims, 1 dispatched effects") {
		t.Errorf("cleanup: exit %d: %s%s", code, out, errOut)
	}

	code, out, _ = cli(t, dsn, "status")
	if code != 0 {
		t.Fatalf("status: exit %d", code)
	}
	recent := out[strings.Index(out, "RECENT CHANGES"):]
	for _, want := range []string{"cleanup-done", "cleanup ", "replay-poisoned", "discard-parked", "retry-parked"} {
		if !strings.Contains(recent, "alice") || !strings.Contains(recent, want) {
			t.Errorf("recent changes lack %q by alice:\n%s", want, recent)
		}
	}
	if strings.Count(recent, "\n") != 6 {
		t.Errorf("recent changes: want the 6 changes (dry runs and refusals are not written):\n%s", recent)
	}
}

func TestMigrateSQLAndGrantsOnMySQL(t *testing.T) {
	code, out, _ := cli(t, "", "-schema", "shop", "migrate", "sql")
	if code != 0 || !strings.Contains(out, "CREATE DATABASE IF NOT EXISTS `shop`") || !strings.Contains(out, "CREATE TABLE IF NOT EXISTS `shop`.`outbox_audit`") ||
		!strings.Contains(out, "INSERT IGNORE INTO `shop`.`outbox_migrations` (version, applied_at) VALUES (3,") {
		t.Errorf("migrate sql: exit %d:\n%s", code, out)
	}
	if code, _, errOut := cli(t, "", "migrate", "grants", "app"); code != 2 || !strings.Contains(errOut, "not available for MySQL") {
		t.Errorf("migrate grants: exit %d: %s", code, errOut)
	}
	// The script is what Migrate applies: run on an empty database, it leaves the tables Migrate
	// finds current.
	dsn := bareDSN(t)
	code, script, _ := cli(t, "", "migrate", "sql")
	if code != 0 {
		t.Fatal("migrate sql failed")
	}
	db, err := open(dsn+"?multiStatements=true", time.Time{})
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	if _, err := db.Exec(script); err != nil {
		t.Fatalf("run the script: %v", err)
	}
	if code, out, _ := cli(t, dsn, "migrate", "up"); code != 0 || !strings.Contains(out, "no migration to apply") {
		t.Errorf("migrate up after the script: exit %d: %s", code, out)
	}
}

func TestPasswordNeverPrinted(t *testing.T) {
	for _, dsn := range []string{"app:s3cr3t-pw@tcp(127.0.0.1:1)/shop", "mysql://app:s3cr3t-pw@tcp(127.0.0.1:1)/shop", "app:s3cr3t-pw@tcp(127.0.0.1:1)/shop?bogus"} {
		code, out, errOut := cli(t, dsn, "-timeout", "10s", "status")
		if code == 0 || strings.Contains(out+errOut, "s3cr3t-pw") {
			t.Errorf("%s: exit %d, printed %s%s", dsn, code, out, errOut)
		}
	}
}

// The help of outbox-mysql is its own: MySQL's DSN and default schema, no database needed; an
// empty list exits 0 and a repair that matched nothing 1 here too.
func TestHelpOnMySQL(t *testing.T) {
	for _, args := range [][]string{{"-h"}, {"help", "status"}, {"parked", "retry", "--help"}, {"migrate", "grants", "-h"}} {
		code, out, errOut := cli(t, "", args...)
		if code != 0 || errOut != "" || !strings.Contains(out, "usage: outbox") {
			t.Errorf("outbox-mysql %s: exit %d, want 0 and the help: %s%s", strings.Join(args, " "), code, out, errOut)
		}
	}
	if _, out, _ := cli(t, "", "-h"); !strings.Contains(out, "go-sql-driver/mysql format") || !strings.Contains(out, "(default: the DSN's database)") {
		t.Errorf("outbox-mysql -h: want the DSN format and the default schema: %s", out)
	}
	dsn := bareDSN(t)
	if code, _, errOut := cli(t, dsn, "migrate", "up"); code != 0 {
		t.Fatalf("migrate up: %d %s", code, errOut)
	}
	if code, out, errOut := cli(t, dsn, "parked", "list", "-o", "json"); code != 0 || strings.TrimSpace(out) != "[]" {
		t.Errorf("parked list on empty tables: exit %d, want 0 and [] (an empty list is an answer): %s%s", code, out, errOut)
	}
	if code, _, errOut := cli(t, dsn, "parked", "retry", "-id", "999"); code != 1 || !strings.Contains(errOut, "nothing matched") {
		t.Errorf("parked retry of no parked effect: exit %d, want 1 and nothing matched: %s", code, errOut)
	}
}
