package postgres_test

import (
	"database/sql"
	"testing"

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
		return pgtest.ConformanceHarness(db, schema, prefix, func(t testing.TB) outboxdriver.Store {
			st, err := postgres.Driver{ListenDSN: dsn}.Open(db, outboxdriver.StoreOptions{Schema: schema, TablePrefix: prefix})
			if err != nil {
				t.Fatal(err)
			}
			return st
		})
	})
}
