package proccpu_test

import (
	"context"
	"database/sql/driver"
	"os"
	"testing"
	"time"

	"github.com/watermill-outbox/outbox/internal/pgtest"
	"github.com/watermill-outbox/outbox/internal/proccpu"
)

func TestMain(m *testing.M) { os.Exit(pgtest.Run(m)) }

// TestServer checks that the server's CPU time read from /proc grows with work done in a
// backend, and keeps the time of a backend that exited in between.
func TestServer(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	db := pgtest.DB(t)
	pm, err := proccpu.Postmaster(ctx, db)
	if err != nil {
		t.Skipf("the server is not on this machine: %v", err)
	}
	before, err := proccpu.Server(pm)
	if err != nil {
		t.Fatal(err)
	}
	conn, err := db.Conn(ctx)
	if err != nil {
		t.Fatal(err)
	}
	var backend int
	if err := conn.QueryRowContext(ctx, `SELECT pg_backend_pid()`).Scan(&backend); err != nil {
		t.Fatal(err)
	}
	own, err := proccpu.Process(backend)
	if err != nil {
		t.Fatal(err)
	}
	var n int64
	if err := conn.QueryRowContext(ctx, `SELECT count(*) FROM generate_series(1, 5000000)`).Scan(&n); err != nil {
		t.Fatal(err)
	}
	if ownAfter, err := proccpu.Process(backend); err != nil {
		t.Fatal(err)
	} else if d := ownAfter - own; d < 100*time.Millisecond {
		t.Errorf("the backend's CPU grew by %v over a query of 5M rows; want at least 100ms", d)
	}
	// End the backend that did the work: its time must move to the postmaster's reaped children.
	if err := conn.Raw(func(any) error { return driver.ErrBadConn }); err == nil {
		t.Fatal("expected the connection to be discarded")
	}
	_ = conn.Close()
	time.Sleep(200 * time.Millisecond)
	after, err := proccpu.Server(pm)
	if err != nil {
		t.Fatal(err)
	}
	if d := after - before; d < 100*time.Millisecond {
		t.Errorf("server CPU grew by %v over a query of 5M rows; want at least 100ms", d)
	}
}

// TestSelf checks that this process's CPU time grows with work done here: a busy loop, bounded
// by 10 s of wall time (the machine may be shared), must show 50 ms of it.
func TestSelf(t *testing.T) {
	before := proccpu.Self()
	deadline := time.Now().Add(10 * time.Second)
	for proccpu.Self()-before < 50*time.Millisecond {
		if time.Now().After(deadline) {
			t.Fatalf("CPU time grew by %v over 10 s of a busy loop; want 50ms", proccpu.Self()-before)
		}
	}
}
