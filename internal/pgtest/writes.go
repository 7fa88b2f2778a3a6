package pgtest

import (
	"context"
	"database/sql"
	"fmt"
	"sort"
	"strings"
	"testing"
	"time"
)

// Writes is what was written to one table: row versions inserted, updated (HOT among them: no
// index entry written, the old version pruned from its page without a vacuum) and deleted. Every
// update and delete leaves a dead version that vacuum (or pruning) must remove, and that stays
// while an older snapshot holds the table's xmin back.
type Writes struct {
	Inserts, Updates, HOT, Deletes int64
}

// NonHOT is the updates that wrote index entries (an indexed column changed, or the new version
// did not fit on the old one's page).
func (w Writes) NonHOT() int64 { return w.Updates - w.HOT }

// Sub returns w less before.
func (w Writes) Sub(before Writes) Writes {
	return Writes{w.Inserts - before.Inserts, w.Updates - before.Updates, w.HOT - before.HOT, w.Deletes - before.Deletes}
}

// Per returns w per one of n (a message), as text: "1 ins, 2 upd (2 HOT), 0 del".
func (w Writes) Per(n int) string {
	f := func(v int64) string {
		return strings.TrimSuffix(strings.TrimRight(fmt.Sprintf("%.2f", float64(v)/float64(n)), "0"), ".")
	}
	return fmt.Sprintf("%s ins, %s upd (%s HOT), %s del", f(w.Inserts), f(w.Updates), f(w.HOT), f(w.Deletes))
}

// NoAutovacuum leaves every table of db's database (outside the system schemas) out of
// autovacuum: a test that counts what the server counts (transactions, row versions, HOT
// updates) is not to count the autovacuum worker's. Its visit is a few transactions of its own,
// and an autoanalyze of a table that a test filled holds a snapshot, under which pruning cannot
// free the old versions of a page and an update that would be HOT is not.
func NoAutovacuum(t testing.TB, db *sql.DB) {
	t.Helper()
	rows, err := db.Query(`SELECT c.oid::regclass::text FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
		WHERE c.relkind = 'r' AND n.nspname NOT IN ('pg_catalog', 'information_schema')`)
	if err != nil {
		t.Fatal(err)
	}
	var tables []string
	for rows.Next() {
		var name string
		if err := rows.Scan(&name); err != nil {
			t.Fatal(err)
		}
		tables = append(tables, name)
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	for _, name := range tables {
		if _, err := db.Exec(`ALTER TABLE ` + name + ` SET (autovacuum_enabled = off, toast.autovacuum_enabled = off)`); err != nil {
			t.Fatal(err)
		}
	}
}

// TableWrites returns the writes counted so far on each table of schema, by table name (a
// partitioned table's: the sum of its partitions'). A
// backend reports its counts when it has been idle for a while or when it exits, so TableWrites
// first waits (up to a minute) until no other client connection to db's database is left: the
// caller closes the connections of the code it measures before. db's own connection writes
// nothing.
func TableWrites(t testing.TB, db *sql.DB, schema string) map[string]Writes {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	conn, err := db.Conn(ctx)
	if err != nil {
		t.Fatalf("pgtest: %v", err)
	}
	defer conn.Close()
	for {
		var others int
		if err := conn.QueryRowContext(ctx, `SELECT count(*) FROM pg_stat_activity
			WHERE datname = current_database() AND pid <> pg_backend_pid() AND backend_type = 'client backend'`).Scan(&others); err != nil {
			t.Fatalf("pgtest: %v", err)
		}
		if others == 0 {
			break
		}
		select {
		case <-ctx.Done():
			t.Fatalf("pgtest: %d other connections to the database still open", others)
		case <-time.After(20 * time.Millisecond):
		}
	}
	if _, err := conn.ExecContext(ctx, `SELECT pg_stat_clear_snapshot()`); err != nil {
		t.Fatalf("pgtest: %v", err)
	}
	// The partitions of a partitioned table (PostgreSQL's effects table, migration 023) are
	// counted under the table's name: which one a row went to changes with the rotation.
	rows, err := conn.QueryContext(ctx, `SELECT coalesce(r.relname, s.relname), sum(s.n_tup_ins)::bigint, sum(s.n_tup_upd)::bigint,
			sum(s.n_tup_hot_upd)::bigint, sum(s.n_tup_del)::bigint
		FROM pg_stat_user_tables s LEFT JOIN pg_class r ON r.oid = pg_partition_root(s.relid)
		WHERE s.schemaname = $1 GROUP BY 1`, schema)
	if err != nil {
		t.Fatalf("pgtest: %v", err)
	}
	defer rows.Close()
	out := map[string]Writes{}
	for rows.Next() {
		var name string
		var w Writes
		if err := rows.Scan(&name, &w.Inserts, &w.Updates, &w.HOT, &w.Deletes); err != nil {
			t.Fatalf("pgtest: %v", err)
		}
		out[name] = w
	}
	if err := rows.Err(); err != nil {
		t.Fatalf("pgtest: %v", err)
	}
	return out
}

// WritesSince returns the writes of each table since before (a TableWrites), leaving out the
// tables nothing was written to, and their names sorted.
func WritesSince(after, before map[string]Writes) (map[string]Writes, []string) {
	out := map[string]Writes{}
	var names []string
	for name, w := range after {
		d := w.Sub(before[name])
		if d == (Writes{}) {
			continue
		}
		out[name] = d
		names = append(names, name)
	}
	sort.Strings(names)
	return out, names
}
