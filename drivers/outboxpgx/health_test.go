package outboxpgx_test

import (
	"bytes"
	"context"
	"net"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/watermill-outbox/outbox"
	"github.com/watermill-outbox/outbox/drivers/outboxpgx"
	"github.com/watermill-outbox/outbox/internal/logtest"
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

// muteConn is a connection whose peer goes silent once dead is set, after it sent LISTEN: what
// it writes is lost and nothing comes back, as over a half-open TCP connection.
type muteConn struct {
	net.Conn
	dead      *atomic.Bool
	listening atomic.Bool
}

func (c *muteConn) Write(p []byte) (int, error) {
	if bytes.Contains(p, []byte("LISTEN ")) {
		c.listening.Store(true)
	}
	if c.listening.Load() && c.dead.Load() {
		return len(p), nil
	}
	return c.Conn.Write(p)
}

// The listener's connection goes silent (its peer gone without a word): the listener pings it
// once quiet for a while, as the database/sql one does, and Health reports it down. It waited on
// it until the kernel's keepalive gave up, reported connected all the while.
func TestListenerNoticesASilentConnection(t *testing.T) {
	restore := outboxpgx.SetListenTimings(300*time.Millisecond, 500*time.Millisecond)
	defer restore()
	dsn := outboxtest.DSN(t)
	ready(t, openPool(t, dsn, 2, nil), outbox.Config{Publisher: &outboxtest.Recorder{}}) // migrated
	var dead atomic.Bool
	cfg, err := pgxpool.ParseConfig(dsn)
	if err != nil {
		t.Fatal(err)
	}
	cfg.ConnConfig.DialFunc = func(ctx context.Context, network, addr string) (net.Conn, error) {
		var d net.Dialer
		c, err := d.DialContext(ctx, network, addr)
		if err != nil {
			return nil, err
		}
		return &muteConn{Conn: c, dead: &dead}, nil
	}
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	logs := &logtest.Errors{}
	ob, err := newOutbox(t, pool, outbox.Config{Publisher: &outboxtest.Recorder{}, RelayInterval: time.Hour, Logger: logs})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- ob.Run(ctx) }()
	defer func() { cancel(); <-done }()
	listener := func() outbox.HealthCheck {
		for _, c := range ob.Health(context.Background()).Checks {
			if c.Name == outbox.CheckListener {
				return c
			}
		}
		t.Fatal("no listener check")
		return outbox.HealthCheck{}
	}
	waitUntil := func(what string, cond func(outbox.HealthCheck) bool) {
		t.Helper()
		deadline := time.Now().Add(20 * time.Second)
		for c := listener(); !cond(c); c = listener() {
			if time.Now().After(deadline) {
				t.Fatalf("%s: listener check %+v after 20 s", what, c)
			}
			time.Sleep(50 * time.Millisecond)
		}
	}
	waitUntil("connected", func(c outbox.HealthCheck) bool { return c.OK })
	// A sound connection stays: quiet periods end in a ping, not in a new connection.
	time.Sleep(2 * time.Second) // six quiet periods
	if c := listener(); !c.OK || len(logs.Lines()) > 0 {
		t.Fatalf("after quiet periods on a sound connection: listener %+v, errors %q", c, logs.Lines())
	}
	dead.Store(true)
	waitUntil("the silent connection noticed", func(c outbox.HealthCheck) bool { return !c.OK })
}
