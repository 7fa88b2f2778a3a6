package main

import (
	"context"
	"database/sql"
	"fmt"
	"strings"
	"testing"
)

// On PostgreSQL, `outbox status` names the session that holds back the xmin horizon (what an
// operator terminates) and the outbox tables' dead tuples.
func TestStatusNamesTheXminHolder(t *testing.T) {
	f := newFixture(t)
	ctx := context.Background()
	db := openDB(t, f.dsn)
	conn, err := db.Conn(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = conn.Close() }()
	if _, err := conn.ExecContext(ctx, `SET application_name = 'report-job'`); err != nil {
		t.Fatal(err)
	}
	tx, err := conn.BeginTx(ctx, &sql.TxOptions{Isolation: sql.LevelRepeatableRead})
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback() }()
	var pid int
	if err := tx.QueryRowContext(ctx, `SELECT pg_backend_pid() FROM (SELECT count(*) FROM outbox_processed) p`).Scan(&pid); err != nil {
		t.Fatal(err)
	}
	code, text := f.cli(t, "status")
	want := fmt.Sprintf("by backend pid %d (report-job, idle in transaction)", pid)
	if code != 0 || !strings.Contains(text, "xmin held") || !strings.Contains(text, want) || !strings.Contains(text, "dead tuples") {
		t.Errorf("status: exit %d, want a line naming %q and the dead tuples:\n%s", code, want, text)
	}
	_ = tx.Rollback()
	if code, text = f.cli(t, "status"); code != 0 || strings.Contains(text, fmt.Sprintf("pid %d ", pid)) {
		t.Errorf("status after the session ended: exit %d, still names pid %d:\n%s", code, pid, text)
	}
}
