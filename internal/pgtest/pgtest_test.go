package pgtest_test

import (
	"context"
	"database/sql"
	"fmt"
	"os"
	"testing"

	"github.com/watermill-outbox/outbox/internal/pgtest"
)

func TestMain(m *testing.M) {
	os.Exit(pgtest.Run(m))
}

// TestDSNIsolation opens two databases per subtest, with the subtests running in parallel (so DSN is called
// concurrently), and checks that the databases are distinct and isolated.
func TestDSNIsolation(t *testing.T) {
	t.Parallel()
	for i := range 4 {
		t.Run(fmt.Sprintf("pair%d", i), func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			dbs := [2]*sql.DB{pgtest.DB(t), pgtest.DB(t)}

			var names [2]string
			for j, db := range dbs {
				if err := db.QueryRowContext(ctx, "SELECT current_database()").Scan(&names[j]); err != nil {
					t.Fatalf("current_database: %v", err)
				}
			}
			if names[0] == names[1] {
				t.Fatalf("both DSNs point to database %q", names[0])
			}

			if _, err := dbs[0].ExecContext(ctx, "CREATE TABLE only_here (id int)"); err != nil {
				t.Fatalf("create table in %s: %v", names[0], err)
			}
			var present [2]bool
			for j, db := range dbs {
				if err := db.QueryRowContext(ctx, "SELECT to_regclass('only_here') IS NOT NULL").Scan(&present[j]); err != nil {
					t.Fatalf("to_regclass in %s: %v", names[j], err)
				}
			}
			if !present[0] || present[1] {
				t.Fatalf("table only_here present in [%s %s] = %v, want [true false]", names[0], names[1], present)
			}
		})
	}
}

// TestDatabaseDroppedOnCleanup checks that the database of a finished test is gone, even with a connection left open.
func TestDatabaseDroppedOnCleanup(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	var name string
	t.Run("use", func(t *testing.T) {
		// Registered before DSN's cleanup, so it runs after the database is dropped: the idle session left in
		// the pool must not block DROP DATABASE ... WITH (FORCE).
		var db *sql.DB
		t.Cleanup(func() {
			if db != nil {
				_ = db.Close()
			}
		})
		var err error
		if db, err = sql.Open("postgres", pgtest.DSN(t)); err != nil {
			t.Fatal(err)
		}
		if err := db.QueryRowContext(ctx, "SELECT current_database()").Scan(&name); err != nil {
			t.Fatal(err)
		}
	})
	if t.Failed() {
		return
	}

	admin, err := sql.Open("postgres", pgtest.AdminDSN(t))
	if err != nil {
		t.Fatal(err)
	}
	defer admin.Close()
	var exists bool
	if err := admin.QueryRowContext(ctx, "SELECT EXISTS (SELECT 1 FROM pg_database WHERE datname = $1)", name).Scan(&exists); err != nil {
		t.Fatal(err)
	}
	if exists {
		t.Fatalf("database %s still exists after its test finished", name)
	}
}
