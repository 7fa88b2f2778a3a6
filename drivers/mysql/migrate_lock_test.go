package mysql_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/watermill-outbox/outbox"
	"github.com/watermill-outbox/outbox/drivers/mysql"
	"github.com/watermill-outbox/outbox/drivers/mysql/internal/mysqltest"
	"github.com/watermill-outbox/outbox/outboxdriver"
	"github.com/watermill-outbox/outbox/outboxtest"
)

// TestMigrationGivesUpBehindAnOpenTransaction: a migration that alters a table waits for the
// transactions that use it, and while it waits every new statement on the table queues behind
// it. Behind a transaction that does not end, it gives up after 10 s (Migrate fails, and runs
// again at the next start), as on PostgreSQL, rather than hold back every unit of work for the
// server's lock_wait_timeout (a day on MariaDB, a year on MySQL). The session's own setting is
// left as it was on the pool's connection.
func TestMigrationGivesUpBehindAnOpenTransaction(t *testing.T) {
	db := openAt(t, isolations[0])
	newOutbox(t, db)
	ctx := context.Background()
	// Migration 009 to do again: its column gone, its record too.
	for _, q := range []string{`ALTER TABLE outbox_dead_letters DROP COLUMN message_uuid`, `DELETE FROM outbox_migrations WHERE version = 9`} {
		if _, err := db.ExecContext(ctx, q); err != nil {
			t.Fatal(err)
		}
	}
	holder, err := db.BeginTx(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = holder.Rollback() }()
	if _, err := holder.ExecContext(ctx, `SELECT 1 FROM outbox_dead_letters LIMIT 1`); err != nil {
		t.Fatal(err)
	}
	ob, err := outbox.New(outbox.Config{DB: db, Driver: mysql.Driver{}, Publisher: &outboxtest.Recorder{}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = ob.Close() })
	mctx, cancel := context.WithTimeout(ctx, 40*time.Second)
	defer cancel()
	began := time.Now()
	err = ob.Migrate(mctx)
	waited := time.Since(began)
	if err == nil || waited > 20*time.Second {
		t.Fatalf("migration behind an open transaction: %v after %s; want it to give up after about 10 s", err, waited.Round(time.Millisecond))
	}
	t.Logf("gave up after %s: %v", waited.Round(time.Millisecond), err)
	if err := holder.Rollback(); err != nil {
		t.Fatal(err)
	}
	if err := ob.Migrate(ctx); err != nil {
		t.Fatalf("the migration once the transaction ended: %v", err)
	}
	db.SetMaxOpenConns(1) // the one connection the migrations used
	var timeout int
	if err := db.QueryRowContext(ctx, `SELECT @@SESSION.lock_wait_timeout`).Scan(&timeout); err != nil {
		t.Fatal(err)
	}
	if timeout == 10 {
		t.Errorf("the migration's lock_wait_timeout (10 s) was left on a connection of the pool")
	}
}

// TestMigrationLockOfBothNamesOfADatabase: a process that names the tables' database (Schema
// "orders") and one that leaves it to the connection (Schema "", the connection's database
// orders) migrate the same tables, but took locks of two names, and ran one migration side by
// side (a failed start: a column or a version added twice). Each takes both names now.
func TestMigrationLockOfBothNamesOfADatabase(t *testing.T) {
	db := openAt(t, isolations[0])
	newOutbox(t, db)
	ctx := context.Background()
	var current string
	if err := db.QueryRowContext(ctx, `SELECT DATABASE()`).Scan(&current); err != nil {
		t.Fatal(err)
	}
	for _, q := range []string{`ALTER TABLE outbox_dead_letters DROP COLUMN message_uuid`, `DELETE FROM outbox_migrations WHERE version = 9`} {
		if _, err := db.ExecContext(ctx, q); err != nil {
			t.Fatal(err)
		}
	}
	// A process with Schema "" migrating: it holds the lock of its name.
	conn, err := db.Conn(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	var got int
	if err := conn.QueryRowContext(ctx, `SELECT GET_LOCK(?, 5)`, mysql.MigrationLockName("", "outbox_")).Scan(&got); err != nil || got != 1 {
		t.Fatalf("GET_LOCK: %d %v", got, err)
	}
	named, err := outbox.New(outbox.Config{DB: db, Driver: mysql.Driver{MigrateLockTimeout: time.Second}, Schema: current, Publisher: &outboxtest.Recorder{}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = named.Close() })
	if err := named.Migrate(ctx); err == nil || !strings.Contains(err.Error(), "another process held it") {
		t.Fatalf("a migration of the same tables named by their database, beside one that leaves it to the connection: %v; want it to wait for the other's lock", err)
	}
	if _, err := conn.ExecContext(ctx, `DO RELEASE_LOCK(?)`, mysql.MigrationLockName("", "outbox_")); err != nil {
		t.Fatal(err)
	}
	if err := named.Migrate(ctx); err != nil {
		t.Fatalf("the migration once the other's lock is released: %v", err)
	}
}

// TestTablesIdentityOfBothNamesOfADatabase: a Store that leaves the database to the connection
// (Schema "") and one that names it are one set of tables: a tenant.Set took them for two, and
// their claims acked each other's messages as duplicates.
func TestTablesIdentityOfBothNamesOfADatabase(t *testing.T) {
	db := mysqltest.DB(t)
	var current string
	if err := db.QueryRow(`SELECT DATABASE()`).Scan(&current); err != nil {
		t.Fatal(err)
	}
	identity := func(schema, prefix string) string {
		st, err := mysql.Driver{}.Open(db, outboxdriver.StoreOptions{Schema: schema, TablePrefix: prefix})
		if err != nil {
			t.Fatal(err)
		}
		return st.(outboxdriver.TablesIdentifier).TablesIdentity()
	}
	if a, b := identity("", "ob_"), identity(current, "ob_"); a != b {
		t.Errorf("Schema \"\" on database %s: %s; Schema %s: %s; want one", current, a, current, b)
	}
	if a, b := identity("", "ob_"), identity("", "other_"); a == b {
		t.Errorf("two prefixes: both %s", a)
	}
}
