package main

import (
	"bytes"
	"context"
	"io"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/watermill-outbox/outbox/internal/pgtest"
)

// Item: through psql, the script of `migrate sql` ran outside transactions, so psql warned "SET
// LOCAL can only be used in transaction blocks" and the lock_timeout of migrations 015-017 was
// not in force: a migration behind a long transaction waited for it, and held back every writer
// of the table meanwhile. Each migration runs in a transaction of its own: applied again, the
// script warns of nothing, and behind a lock it gives up after the migration's lock_timeout.
func TestMigrateSQLThroughPsqlKeepsTheLockTimeout(t *testing.T) {
	code, script, errOut := cliAs("", "migrate", "sql")
	if code != 0 {
		t.Fatalf("migrate sql: %d %s", code, errOut)
	}
	dsn := pgtest.DSN(t)
	db := openDB(t, dsn)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()

	// Everything up to the migration of the dispatched table's index goes in first.
	cut := strings.Index(script, "-- 017_dispatched_time")
	if cut < 0 {
		t.Fatalf("no migration 017 in the script:\n%s", script)
	}
	pctx, pcancel := context.WithTimeout(ctx, 40*time.Second)
	defer pcancel()
	cmd := exec.CommandContext(pctx, psql(t), "-X", "-q", "-v", "ON_ERROR_STOP=1", "-d", dsn)
	stdin, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	if _, err := io.WriteString(stdin, script[:cut]); err != nil {
		t.Fatal(err)
	}
	// Once migration 016 is recorded, a transaction holds the dispatched table as a writer
	// does, which CREATE INDEX waits for.
	for {
		var n int
		if err := db.QueryRowContext(ctx, `SELECT count(*) FROM outbox_migrations WHERE version = 16`).Scan(&n); err == nil && n == 1 {
			break
		}
		if ctx.Err() != nil {
			t.Fatalf("migration 016 never recorded: %s", out.String())
		}
		time.Sleep(50 * time.Millisecond)
	}
	holder, err := db.BeginTx(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = holder.Rollback() }()
	if _, err := holder.ExecContext(ctx, `LOCK TABLE outbox_dispatched IN ROW EXCLUSIVE MODE`); err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	if _, err := io.WriteString(stdin, script[cut:]); err != nil {
		t.Fatal(err)
	}
	_ = stdin.Close()
	err = cmd.Wait()
	took := time.Since(start)
	if pctx.Err() != nil {
		t.Fatalf("psql still waited for the lock after %s: the migration's lock_timeout is not in force:\n%s", took.Round(time.Second), out.String())
	}
	if err == nil || !strings.Contains(out.String(), "lock timeout") || took < 9*time.Second {
		t.Errorf("psql behind a lock: %v after %s, want it to give up after the 10 s lock_timeout:\n%s", err, took.Round(time.Second), out.String())
	}
	if strings.Contains(out.String(), "SET LOCAL can only be used") {
		t.Errorf("psql warns:\n%s", out.String())
	}
	var n int
	if err := db.QueryRowContext(ctx, `SELECT count(*) FROM outbox_migrations WHERE version = 17`).Scan(&n); err != nil || n != 0 {
		t.Errorf("migration 017 recorded (%d, %v) though it gave up", n, err)
	}

	// Without the lock, the script applies the rest, and applied again warns of nothing.
	_ = holder.Rollback()
	for range 2 {
		c := exec.CommandContext(ctx, psql(t), "-X", "-q", "-v", "ON_ERROR_STOP=1", "-d", dsn)
		c.Stdin = strings.NewReader(script)
		got, err := c.CombinedOutput()
		if err != nil || strings.Contains(string(got), "WARNING") {
			t.Fatalf("psql (migrate sql): %v, want no error or warning:\n%s", err, got)
		}
	}
	if err := db.QueryRowContext(ctx, `SELECT count(*) FROM outbox_migrations WHERE version = 17`).Scan(&n); err != nil || n != 1 {
		t.Errorf("migration 017 not recorded (%d, %v)", n, err)
	}
}
