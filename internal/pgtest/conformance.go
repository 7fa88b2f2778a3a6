package pgtest

import (
	"context"
	"database/sql"
	"testing"
	"time"

	"github.com/watermill-outbox/outbox/outboxdriver"
	"github.com/watermill-outbox/outbox/store/storetest"
)

// ConformanceHarness is the storetest harness of a PostgreSQL Store on db (the test's view of the
// database) with its tables in schema and prefix; open opens the Store under test. Both
// PostgreSQL drivers (lib/pq, pgx) run the suite with it.
func ConformanceHarness(db *sql.DB, schema, prefix string, open func(t testing.TB) outboxdriver.Store) storetest.Harness {
	table := func(name string) string {
		if name == "effects" {
			name = "effects_all" // the partitioned parent (migration 023)
		}
		return `"` + schema + `"."` + prefix + name + `"`
	}
	return storetest.Harness{
		DB:    db,
		Open:  open,
		Table: table,
		CountEffects: func(t testing.TB) int {
			var n int
			if err := db.QueryRow(`SELECT (SELECT count(*) FROM ` + table("effects") + `) + (SELECT count(*) FROM ` + table("dispatched") + `)`).Scan(&n); err != nil {
				t.Fatal(err)
			}
			return n
		},
		Age: func(t testing.TB, tbl, column string, src outboxdriver.Source, d time.Duration) {
			if tbl == "effects" && column == "dispatched_at" {
				tbl = "dispatched" // dispatched effects kept for EffectRetention live there
			}
			q := `UPDATE ` + table(tbl) + ` SET ` + column + ` = ` + column + ` - $1 * interval '1 millisecond'`
			args := []any{d.Milliseconds()}
			if src != (outboxdriver.Source{}) {
				c, id := storetest.KeyColumns(tbl)
				q += ` WHERE ` + c + ` = $2 AND ` + id + ` = $3`
				args = append(args, src.Consumer, src.ID)
			}
			if _, err := db.Exec(q, args...); err != nil {
				t.Fatalf("age %s.%s: %v", tbl, column, err)
			}
		},
		HoldCleanupLock: func(t testing.TB) func() {
			tx, err := db.BeginTx(context.Background(), nil)
			if err != nil {
				t.Fatal(err)
			}
			if _, err := tx.Exec(`SELECT pg_advisory_xact_lock(x'6f757462'::int, hashtext('` + schema + `.` + prefix + `cleanup'))`); err != nil {
				t.Fatal(err)
			}
			return func() { _ = tx.Rollback() }
		},
		Blocked: func(t testing.TB) bool {
			var waiting bool
			if err := db.QueryRow(`SELECT EXISTS (SELECT 1 FROM pg_stat_activity
				WHERE datname = current_database() AND wait_event_type = 'Lock')`).Scan(&waiting); err != nil {
				t.Fatal(err)
			}
			return waiting
		},
		Capabilities: storetest.Capabilities{Listen: true, RowLocks: true, CleanupSkips: true, ClaimReportsConcurrent: true, ClaimReportsSettled: true, KeyInFlight: true},
	}
}
