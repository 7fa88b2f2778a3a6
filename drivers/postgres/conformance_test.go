package postgres_test

import (
	"context"
	"database/sql"
	"testing"
	"time"

	"github.com/watermill-outbox/outbox/drivers/postgres"
	"github.com/watermill-outbox/outbox/internal/pgtest"
	"github.com/watermill-outbox/outbox/outboxdriver"
	"github.com/watermill-outbox/outbox/store/storetest"
)

// TestConformance runs the shared Store suite against PostgreSQL, in a schema and with a prefix
// other than the defaults, with LISTEN enabled.
func TestConformance(t *testing.T) {
	const schema, prefix = "conformance", "ob_"
	storetest.Run(t, func(t *testing.T) storetest.Harness {
		dsn := pgtest.DSN(t)
		db, err := sql.Open("postgres", dsn)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = db.Close() })
		table := func(name string) string { return `"` + schema + `"."` + prefix + name + `"` }
		return storetest.Harness{
			DB: db,
			Open: func(t testing.TB) outboxdriver.Store {
				st, err := postgres.Driver{ListenDSN: dsn}.Open(db, outboxdriver.StoreOptions{Schema: schema, TablePrefix: prefix})
				if err != nil {
					t.Fatal(err)
				}
				return st
			},
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
			Capabilities: storetest.Capabilities{Listen: true, RowLocks: true, CleanupSkips: true, ClaimReportsConcurrent: true},
		}
	})
}
