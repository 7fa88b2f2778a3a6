package console_test

import (
	"context"
	"database/sql"
	"fmt"
	"strings"
	"testing"

	"github.com/watermill-outbox/outbox/console"
)

// The overview names the session that holds back the xmin horizon (PostgreSQL), and says none
// once it ended.
func TestOverviewShowsTheXminHolder(t *testing.T) {
	o, db, _ := parkedEnv(t)
	ctx := context.Background()
	conn, err := db.Conn(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = conn.Close() }()
	if _, err := conn.ExecContext(ctx, `SET application_name = 'nightly-report'`); err != nil {
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
	srv := serve(t, o, console.Options{AllowUnauthenticated: true})
	_, body := get(t, srv.Client(), srv.URL+"/outbox/")
	want := fmt.Sprintf("by backend pid %d (nightly-report, idle in transaction)", pid)
	if !strings.Contains(body, `id="xmin-tile"`) || !strings.Contains(body, want) {
		t.Errorf("overview: want the xmin tile naming %q:\n%s", want, body)
	}
	_ = tx.Rollback()
	_, body = get(t, srv.Client(), srv.URL+"/outbox/")
	if strings.Contains(body, fmt.Sprintf("pid %d ", pid)) {
		t.Errorf("overview after the session ended: still names pid %d", pid)
	}
}
