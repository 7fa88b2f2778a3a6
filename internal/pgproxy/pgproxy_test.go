package pgproxy_test

import (
	"context"
	"database/sql"
	"errors"
	"os"
	"testing"
	"time"

	"github.com/lib/pq"

	"github.com/watermill-outbox/outbox/internal/pgproxy"
	"github.com/watermill-outbox/outbox/internal/pgtest"
)

func TestMain(m *testing.M) {
	os.Exit(pgtest.Run(m))
}

// TestOutageRefusesThenHangsThenCarriesOn: a connection made before the outage breaks with it;
// one made while down is refused as by a server starting up; one made while down in hang mode
// gets no answer until the proxy comes back, and then connects. Each one made while down counts.
func TestOutageRefusesThenHangsThenCarriesOn(t *testing.T) {
	p, dsn, err := pgproxy.StartFor(pgtest.DSN(t))
	if err != nil {
		t.Skipf("no proxy for the test DSN: %v", err)
	}
	t.Cleanup(func() { _ = p.Close() })
	db, err := sql.Open("postgres", dsn)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = db.Close() })
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	conn, err := db.Conn(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	if err := conn.PingContext(ctx); err != nil {
		t.Fatal(err)
	}

	p.SetDown(true)
	if err := conn.PingContext(ctx); err == nil {
		t.Error("a connection carried before the outage still answers during it")
	}
	var pqErr *pq.Error
	if err := db.PingContext(ctx); !errors.As(err, &pqErr) || pqErr.Code != "57P03" {
		t.Errorf("a new connection during the outage: %v, want FATAL 57P03", err)
	}

	p.SetHang(true)
	pinged := make(chan error, 1)
	go func() { pinged <- db.PingContext(ctx) }()
	select {
	case err := <-pinged:
		t.Fatalf("a connection opened while the proxy hangs got an answer: %v", err)
	case <-time.After(300 * time.Millisecond):
	}
	p.SetDown(false)
	select {
	case err := <-pinged:
		if err != nil {
			t.Errorf("the connection that hung, once the proxy is back: %v, want it connected", err)
		}
	case <-ctx.Done():
		t.Fatal("the connection that hung did not go on once the proxy was back")
	}
	if n := p.Attempts(); n != 2 {
		t.Errorf("%d connection attempts counted during the outage, want 2", n)
	}
	if err := db.PingContext(ctx); err != nil {
		t.Errorf("after the outage: %v", err)
	}
}
