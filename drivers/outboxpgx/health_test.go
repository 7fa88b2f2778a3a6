package outboxpgx_test

import (
	"context"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/watermill-outbox/outbox"
	"github.com/watermill-outbox/outbox/outboxtest"
)

// TestHealthReportsAReadOnlyServer: the pgx form's readiness check reports a server that takes no
// writes (a standby a multi-host DSN without target_session_attrs=read-write may reach).
func TestHealthReportsAReadOnlyServer(t *testing.T) {
	dsn := outboxtest.DSN(t)
	ready(t, openPool(t, dsn, 2, nil), outbox.Config{Publisher: &outboxtest.Recorder{}})
	cfg, err := pgxpool.ParseConfig(dsn)
	if err != nil {
		t.Fatal(err)
	}
	// Every session read-only, as on a standby.
	cfg.ConnConfig.RuntimeParams["default_transaction_read_only"] = "on"
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	ob, err := newOutbox(t, pool, outbox.Config{Publisher: &outboxtest.Recorder{}})
	if err != nil {
		t.Fatal(err)
	}
	r := ob.Health(context.Background())
	if r.Checks[0].Name != outbox.CheckDatabase || r.Checks[0].OK || !strings.Contains(r.Checks[0].Reason, "read-only") {
		t.Fatalf("on a read-only server: %+v, want the database check failed as read-only", r)
	}
}
