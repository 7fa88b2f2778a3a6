package mysql_test

import (
	"context"
	"database/sql"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/watermill-outbox/outbox/drivers/mysql"
	"github.com/watermill-outbox/outbox/drivers/mysql/internal/mysqltest"
	"github.com/watermill-outbox/outbox/ops"
	"github.com/watermill-outbox/outbox/outboxdriver"
)

// migrationStatements splits a migration into its statements, without its comment lines.
func migrationStatements(sql string) []string {
	var out []string
	for _, s := range strings.Split(sql, ";\n") {
		var lines []string
		for _, l := range strings.Split(s, "\n") {
			if t := strings.TrimSpace(l); t != "" && !strings.HasPrefix(t, "--") {
				lines = append(lines, l)
			}
		}
		if len(lines) > 0 {
			out = append(out, strings.TrimSuffix(strings.Join(lines, "\n"), ";"))
		}
	}
	return out
}

// TestBinaryIdentifiersMigration: tables made by migrations 001-003 (utf8mb4_bin, PAD SPACE), where
// "a " is taken for "a", keep every stored identifier byte for byte through migration 004, and
// tell them apart after it; the migration runs again without harm (it may be interrupted).
func TestBinaryIdentifiersMigration(t *testing.T) {
	db := mysqltest.DB(t)
	ctx := context.Background()
	ms, err := mysql.Migrations("", "")
	if err != nil {
		t.Fatal(err)
	}
	if len(ms) < 4 || ms[3].Version != 4 {
		t.Fatalf("migrations %v: want 004 fourth", ms)
	}
	exec := func(q string, args ...any) {
		t.Helper()
		if _, err := db.ExecContext(ctx, q, args...); err != nil {
			t.Fatalf("%s: %v", q, err)
		}
	}
	exec("CREATE TABLE migrations (version INT NOT NULL PRIMARY KEY, applied_at DATETIME(6) NOT NULL)")
	for _, m := range ms[:3] {
		for _, s := range migrationStatements(m.SQL) {
			exec(s)
		}
		exec("INSERT INTO migrations VALUES (?, UTC_TIMESTAMP(6))", m.Version)
	}
	st, err := mysql.Driver{}.Open(db, outboxdriver.StoreOptions{})
	if err != nil {
		t.Fatal(err)
	}
	ds := st.(outboxdriver.DelayedStore)
	// 254 bytes of two-byte characters and a four-byte one: the column's old length was counted
	// in characters, the new one in bytes.
	long := strings.Repeat("é", 127)
	ids := []string{"a", long, "\U0001F600 x", "e\u0301"}
	claim := func(id string) bool {
		t.Helper()
		tx, err := db.BeginTx(ctx, nil)
		if err != nil {
			t.Fatal(err)
		}
		defer func() { _ = tx.Rollback() }()
		c, err := st.MessageClaim(ctx, tx, outboxdriver.Source{Consumer: "c", ID: id})
		if err != nil {
			t.Fatalf("MessageClaim(%q): %v", id, err)
		}
		if err := tx.Commit(); err != nil {
			t.Fatal(err)
		}
		return c.Claimed
	}
	tx, err := db.BeginTx(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	for _, id := range ids {
		src := outboxdriver.Source{Consumer: "c", ID: id}
		if c, err := st.MessageClaim(ctx, tx, src); err != nil || !c.Claimed {
			t.Fatalf("MessageClaim(%q) = %+v, %v", id, c, err)
		}
		e := outboxdriver.Effect{Kind: outboxdriver.KindPublish, Topic: "t-" + id, UUID: "u-" + id, Payload: []byte("p"), OrderingKey: "k-" + id, Source: src}
		if _, err := st.EffectInsert(ctx, tx, src, []outboxdriver.Effect{e}); err != nil {
			t.Fatalf("EffectInsert: %v", err)
		}
		e.DueAt, e.CancelKey = time.Now().Add(time.Hour), "x-"+id
		if err := ds.DelayedInsert(ctx, tx, src, []outboxdriver.Effect{e}); err != nil {
			t.Fatalf("DelayedInsert: %v", err)
		}
		if _, err := tx.ExecContext(ctx, "INSERT INTO idempotency VALUES (?, ?, 'fp', 'r', UTC_TIMESTAMP(6), UTC_TIMESTAMP(6) + INTERVAL 1 HOUR)", "s-"+id, "k-"+id); err != nil {
			t.Fatal(err)
		}
	}
	if err := tx.Commit(); err != nil {
		t.Fatal(err)
	}
	if claim("a ") {
		t.Fatal(`before migration 004, "a " was claimed beside "a": the old tables told them apart`)
	}

	if err := st.Migrate(ctx); err != nil {
		t.Fatalf("Migrate: %v", err)
	}
	check := func(when string) {
		t.Helper()
		for _, table := range []string{"processed", "attempts", "effects", "delayed", "idempotency"} {
			var n int
			if err := db.QueryRowContext(ctx, `SELECT count(*) FROM information_schema.columns
				WHERE table_schema = database() AND table_name = ? AND column_name IN
				('consumer', 'message_id', 'source_consumer', 'source_id', 'topic', 'ordering_key', 'cancel_key', 'scope', 'key')
				AND data_type NOT IN ('varbinary', 'blob')`, table).Scan(&n); err != nil || n != 0 {
				t.Fatalf("%s: %d identifier columns of table %s are not binary (%v)", when, n, table, err)
			}
		}
		for _, id := range ids {
			src := outboxdriver.Source{Consumer: "c", ID: id}
			if ok, err := st.MessageIsProcessed(ctx, src); err != nil || !ok {
				t.Fatalf("%s: message %q processed: %v, %v", when, id, ok, err)
			}
			es, err := st.EffectListPending(ctx, src)
			if err != nil || len(es) != 1 || es[0].Topic != "t-"+id || es[0].OrderingKey != "k-"+id || es[0].Source != src {
				t.Fatalf("%s: effects of %q: %+v, %v", when, id, es, err)
			}
			var scope, key string
			if err := db.QueryRowContext(ctx, "SELECT scope, `key` FROM idempotency WHERE scope = ?", "s-"+id).Scan(&scope, &key); err != nil || key != "k-"+id {
				t.Fatalf("%s: idempotency key of scope %q: %q, %v", when, scope, key, err)
			}
			var cancel sql.NullString
			if err := db.QueryRowContext(ctx, "SELECT cancel_key FROM `delayed` WHERE source_id = ?", id).Scan(&cancel); err != nil || cancel.String != "x-"+id {
				t.Fatalf("%s: cancel key of %q: %q, %v", when, id, cancel.String, err)
			}
		}
	}
	check("after migration 004")
	if !claim("a ") || !claim(" a") || !claim("e\u0301 ") {
		t.Fatal(`after migration 004, "a " is still taken for "a"`)
	}
	// Interrupted before its version was recorded, the migration runs again whole.
	for _, s := range migrationStatements(ms[3].SQL) {
		exec(s)
	}
	check("after migration 004 ran again")
	tx, err = db.BeginTx(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback() }()
	if n, err := ds.DelayedCancel(ctx, tx, "x-a "); err != nil || n != 0 {
		t.Fatalf(`DelayedCancel("x-a ") = %d, %v; want none`, n, err)
	}
	if n, err := ds.DelayedCancel(ctx, tx, "x-a"); err != nil || n != 1 {
		t.Fatalf(`DelayedCancel("x-a") = %d, %v; want 1`, n, err)
	}
}

// TestOpsTellLookalikesApart: the operators' statements filter and group by consumer, topic and
// message ID byte for byte too: a consumer or topic that differs from another by a trailing space
// is listed, counted and looked up on its own.
func TestOpsTellLookalikesApart(t *testing.T) {
	db := mysqltest.DB(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	o, err := ops.OpenWith(db, ops.Options{Driver: mysql.Driver{}})
	if err != nil {
		t.Fatal(err)
	}
	st := o.Store()
	if err := st.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	parked := map[string]int64{}
	// Of two messages, so that the claims take no part.
	for i, s := range []string{"", " "} {
		src := outboxdriver.Source{Consumer: "billing" + s, ID: fmt.Sprint("m", i+1)}
		tx, err := db.BeginTx(ctx, nil)
		if err != nil {
			t.Fatal(err)
		}
		e := []outboxdriver.Effect{{Kind: outboxdriver.KindPublish, Topic: "invoices" + s, UUID: "u" + s, Payload: []byte("x"), OrderingKey: "k"}}
		if c, err := st.MessageClaim(ctx, tx, src); err != nil || !c.Claimed {
			t.Fatalf("claim %q: %+v, %v", src, c, err)
		}
		if _, err := st.EffectInsert(ctx, tx, src, e); err != nil {
			t.Fatal(err)
		}
		if err := tx.Commit(); err != nil {
			t.Fatal(err)
		}
		parked[s] = e[0].StoreID
		if err := st.EffectRecordFailures(ctx, outboxdriver.EffectFailure{StoreID: e[0].StoreID, Reason: "refused" + s, Counted: true, Park: true}); err != nil {
			t.Fatal(err)
		}
		if _, err := st.AttemptRecord(ctx, outboxdriver.Source{Consumer: src.Consumer, ID: "failing"}, "boom"+s); err != nil {
			t.Fatal(err)
		}
	}
	s, err := o.Status(ctx, time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	if len(s.Groups) != 2 || len(s.Failing) != 2 || len(s.Retained) != 2 {
		t.Errorf("status: groups %+v, failing %+v, retained %v; want two of each (billing and \"billing \")", s.Groups, s.Failing, s.Retained)
	}
	for _, c := range []struct {
		name string
		f    ops.ParkedFilter
		want int64
	}{
		{"topic invoices", ops.ParkedFilter{Topic: "invoices"}, parked[""]},
		{`topic "invoices "`, ops.ParkedFilter{Topic: "invoices "}, parked[" "]},
		{"consumer billing", ops.ParkedFilter{Consumer: "billing"}, parked[""]},
		{`consumer "billing "`, ops.ParkedFilter{Consumer: "billing "}, parked[" "]},
		// An error filter of a space is a filter: only "refused " holds one.
		{`error " "`, ops.ParkedFilter{ErrorContains: " "}, parked[" "]},
	} {
		got, err := o.ParkedEffects(ctx, c.f)
		if err != nil || len(got) != 1 || got[0].StoreID != c.want {
			t.Errorf("parked, %s: %+v, %v; want effect %d only", c.name, got, err, c.want)
		}
	}
	if f, err := o.FailingMessages(ctx, "billing", 0); err != nil || len(f) != 1 || f[0].LastError != "boom" {
		t.Errorf("failing of billing: %+v, %v; want its one message", f, err)
	}
	if l, err := o.Lookup(ctx, "billing", "m1"); err != nil || !l.Processed || len(l.Effects) != 1 || l.Effects[0].Topic != "invoices" {
		t.Errorf("lookup of billing/m1: %+v, %v; want its one effect", l, err)
	}
	if l, err := o.Lookup(ctx, "billing", "m2"); err != nil || l.Processed || len(l.Effects) != 0 {
		t.Errorf(`lookup of billing/m2: %+v, %v; want nothing (m2 is "billing "'s)`, l, err)
	}
}
