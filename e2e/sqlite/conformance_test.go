package sqlite_test

import (
	"context"
	"testing"
	"time"

	"github.com/watermill-outbox/outbox/drivers/sqlite"
	"github.com/watermill-outbox/outbox/outboxdriver"
	"github.com/watermill-outbox/outbox/store/storetest"
)

// TestConformance runs the shared Store suite against SQLite (modernc.org/sqlite, a file per
// test, opened with sqlite.DSN) with a table prefix other than the default.
func TestConformance(t *testing.T) {
	const prefix = "ob_"
	storetest.Run(t, func(t *testing.T) storetest.Harness {
		db := openDB(t)
		table := func(name string) string { return `"main"."` + prefix + name + `"` }
		return storetest.Harness{
			DB: db,
			Open: func(t testing.TB) outboxdriver.Store {
				st, err := sqlite.Driver{}.Open(db, outboxdriver.StoreOptions{TablePrefix: prefix})
				if err != nil {
					t.Fatal(err)
				}
				return st
			},
			Table: table,
			Age: func(t testing.TB, tbl, column string, src outboxdriver.Source, d time.Duration) {
				q := `UPDATE ` + table(tbl) + ` SET ` + column + ` = strftime('%Y-%m-%d %H:%M:%f', ` + column +
					`, printf('%+.3f seconds', -?1 / 1000.0))`
				args := []any{d.Milliseconds()}
				if src != (outboxdriver.Source{}) {
					c, id := storetest.KeyColumns(tbl)
					q += ` WHERE ` + c + ` = ?2 AND ` + id + ` = ?3`
					args = append(args, src.Consumer, src.ID)
				}
				if _, err := db.Exec(q, args...); err != nil {
					t.Fatalf("age %s.%s: %v", tbl, column, err)
				}
			},
			CountEffects: func(t testing.TB) int {
				var n int
				if err := db.QueryRow(`SELECT count(*) FROM ` + table("effects")).Scan(&n); err != nil {
					t.Fatal(err)
				}
				return n
			},
			// Another process's cleanup holds the database's write lock while it deletes.
			HoldCleanupLock: func(t testing.TB) func() {
				tx, err := db.BeginTx(context.Background(), nil)
				if err != nil {
					t.Fatal(err)
				}
				if _, err := tx.Exec(`DELETE FROM ` + table("attempts") + ` WHERE 0`); err != nil {
					t.Fatal(err)
				}
				return func() { _ = tx.Rollback() }
			},
			// With _txlock=immediate a transaction waits for the write lock inside BEGIN, holding
			// a connection: a second connection in use means a second transaction is waiting (the
			// tests that poll this run nothing else on the DB meanwhile).
			Blocked: func(testing.TB) bool { return db.Stats().InUse >= 2 },
			// No LISTEN, one writer at a time, no cleanup lock to skip on.
			Capabilities: storetest.Capabilities{},
		}
	})
}
