package mysql_test

import (
	"context"
	"os"
	"strings"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/watermill-outbox/outbox/drivers/mysql"
	"github.com/watermill-outbox/outbox/drivers/mysql/internal/mysqltest"
	"github.com/watermill-outbox/outbox/outboxdriver"
	"github.com/watermill-outbox/outbox/store/storetest"
)

func TestMain(m *testing.M) {
	code := mysqltest.Run(m)
	if code == 0 {
		if err := goleak.Find(); err != nil {
			println("goleak:", err.Error())
			code = 1
		}
	}
	os.Exit(code)
}

// TestConformance runs the shared Store suite against the test server (MariaDB here), with the
// tables in a database named by Schema and a table prefix other than the default.
func TestConformance(t *testing.T) {
	const prefix = "ob_"
	storetest.Run(t, func(t *testing.T) storetest.Harness {
		db := mysqltest.DB(t)
		mariaDB := strings.Contains(mysqltest.Version(t), "MariaDB")
		var schema string
		if err := db.QueryRow(`SELECT database()`).Scan(&schema); err != nil {
			t.Fatal(err)
		}
		table := func(name string) string { return "`" + schema + "`.`" + prefix + name + "`" }
		return storetest.Harness{
			DB: db,
			Open: func(t testing.TB) outboxdriver.Store {
				st, err := mysql.Driver{}.Open(db, outboxdriver.StoreOptions{Schema: schema, TablePrefix: prefix})
				if err != nil {
					t.Fatal(err)
				}
				return st
			},
			Table: table,
			Age: func(t testing.TB, tbl, column string, src outboxdriver.Source, d time.Duration) {
				q := `UPDATE ` + table(tbl) + ` SET ` + column + ` = ` + column + ` - INTERVAL (? * 1000) MICROSECOND`
				args := []any{d.Milliseconds()}
				if src != (outboxdriver.Source{}) {
					c, id := storetest.KeyColumns(tbl)
					q += ` WHERE ` + c + ` = ? AND ` + id + ` = ?`
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
			HoldCleanupLock: func(t testing.TB) func() {
				tx, err := db.BeginTx(context.Background(), nil)
				if err != nil {
					t.Fatal(err)
				}
				if _, err := tx.Exec(`SELECT name FROM ` + table("locks") + ` WHERE name = 'cleanup' FOR UPDATE`); err != nil {
					t.Fatal(err)
				}
				return func() { _ = tx.Rollback() }
			},
			// A statement on this test's tables waits for a row lock: a transaction of InnoDB's
			// in LOCK WAIT whose statement names the database, or a statement of this database
			// that has run for a while (MariaDB 10.11's innodb_trx sometimes misses a waiting
			// transaction, and reports its statement under another thread; the tests that poll
			// Blocked run nothing else long meanwhile).
			Blocked: func(t testing.TB) bool {
				var waiting bool
				long := `p.time >= 1`
				if mariaDB {
					long = `p.time_ms >= 200`
				}
				if err := db.QueryRow(`SELECT EXISTS (SELECT 1 FROM information_schema.innodb_trx x
					WHERE x.trx_state = 'LOCK WAIT' AND x.trx_query LIKE concat('%` + "`" + `', database(), '` + "`" + `%'))
					OR EXISTS (SELECT 1 FROM information_schema.processlist p
					WHERE p.db = database() AND p.command = 'Query' AND p.id <> CONNECTION_ID() AND ` + long + `)`).Scan(&waiting); err != nil {
					t.Fatal(err)
				}
				return waiting
			},
			Capabilities: storetest.Capabilities{RowLocks: true, CleanupSkips: true, ClaimReportsConcurrent: true, KeyInFlight: true},
		}
	})
}
