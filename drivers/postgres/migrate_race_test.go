package postgres_test

import (
	"context"
	"database/sql"
	"testing"
	"time"

	"github.com/watermill-outbox/outbox/drivers/postgres"
	"github.com/watermill-outbox/outbox/internal/pgtest"
	"github.com/watermill-outbox/outbox/outboxdriver"
)

// TestMigrateAfterWaitingForAnotherThatCreatedTheSchema: a Migrate that waits for another's
// migration lock while that one creates the schema must find it when it gets the lock. Migrate
// first looks at the migrations table (SchemaCheck) and fails on a missing schema; the session
// caches that the schema does not exist, and reads other sessions' catalog changes only at a
// transaction's start or when it locks a table, which the advisory lock Migrate then waits on
// is not: CREATE SCHEMA IF NOT EXISTS took the schema created meanwhile for missing (CI, Set
// conformance: "concurrent Migrate #3: create migrations table: pq: duplicate key value violates
// unique constraint \"pg_namespace_nspname_index\"").
func TestMigrateAfterWaitingForAnotherThatCreatedTheSchema(t *testing.T) {
	dsn := pgtest.DSN(t)
	open := func(conns int) *sql.DB {
		db, err := sql.Open("postgres", dsn)
		if err != nil {
			t.Fatal(err)
		}
		db.SetMaxOpenConns(conns)
		t.Cleanup(func() { _ = db.Close() })
		return db
	}
	// The Migrate's pool has one connection: its SchemaCheck and its transaction share a session.
	mdb, db := open(1), open(3)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	for i := range 5 { // the stale entry was missed in one try of twenty
		schema := "late_schema_" + string(rune('a'+i))
		st, err := postgres.Driver{}.Open(mdb, outboxdriver.StoreOptions{Schema: schema, TablePrefix: "ob_"})
		if err != nil {
			t.Fatal(err)
		}
		// Another migrator holds the lock.
		htx, err := db.BeginTx(ctx, nil)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := htx.ExecContext(ctx, postgres.MigrationLockForTest(schema, "ob_")); err != nil {
			t.Fatal(err)
		}
		done := make(chan error, 1)
		go func() { done <- st.Migrate(ctx) }()
		waitForLockWaiter(t, ctx, db)
		// It creates the schema and the migrations table, and commits: the lock goes to Migrate.
		if _, err := htx.ExecContext(ctx, `CREATE SCHEMA `+schema+`; CREATE TABLE `+schema+`.ob_migrations (version integer PRIMARY KEY, applied_at timestamptz NOT NULL DEFAULT now())`); err != nil {
			t.Fatal(err)
		}
		if err := htx.Commit(); err != nil {
			t.Fatal(err)
		}
		if err := <-done; err != nil {
			t.Fatalf("schema %s: Migrate after waiting for the lock: %v", schema, err)
		}
		if err := st.SchemaCheck(ctx); err != nil {
			t.Fatal(err)
		}
	}
}

// waitForLockWaiter waits until a session of db's database waits for an advisory lock.
func waitForLockWaiter(t *testing.T, ctx context.Context, db *sql.DB) {
	t.Helper()
	for {
		var n int
		if err := db.QueryRowContext(ctx, `SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted`).Scan(&n); err != nil {
			t.Fatal(err)
		}
		if n > 0 {
			return
		}
		select {
		case <-ctx.Done():
			t.Fatalf("no Migrate waited for the lock: %v", ctx.Err())
		case <-time.After(10 * time.Millisecond):
		}
	}
}
