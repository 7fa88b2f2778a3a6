package outbox_test

import (
	"context"
	"database/sql"
	"errors"
	"net"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/watermill-outbox/outbox"
	"github.com/watermill-outbox/outbox/drivers/postgres"
)

// stalledServer accepts connections and never answers them, as a server that hangs or a network
// that drops every packet after the handshake: lib/pq, which ignores contexts while it connects,
// waits on such a connection for as long as it stays open.
type stalledServer struct {
	ln       net.Listener
	accepted chan struct{} // one token per connection accepted
	mu       sync.Mutex
	conns    []net.Conn
	done     chan struct{}
}

func newStalledServer(t *testing.T) *stalledServer {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	s := &stalledServer{ln: ln, accepted: make(chan struct{}, 64), done: make(chan struct{})}
	go func() {
		defer close(s.done)
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			s.mu.Lock()
			s.conns = append(s.conns, c)
			s.mu.Unlock()
			select {
			case s.accepted <- struct{}{}:
			default:
			}
		}
	}()
	t.Cleanup(s.release)
	return s
}

// release closes the listener and every connection: the calls waiting on them fail.
func (s *stalledServer) release() {
	_ = s.ln.Close()
	<-s.done
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, c := range s.conns {
		_ = c.Close()
	}
	s.conns = nil
}

// Run returns within ShutdownTimeout of its context's end even while a background call ignores
// its context (the relay's claim stuck connecting to a server that does not answer), with an
// error that says what it waited for; the call returns later, once the server lets go.
func TestRunShutdownIsBounded(t *testing.T) {
	srv := newStalledServer(t)
	db, err := sql.Open("postgres", "postgres://outbox@"+srv.ln.Addr().String()+"/outbox?sslmode=disable")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { srv.release(); _ = db.Close() })
	ob, err := outbox.New(outbox.Config{DB: db, Driver: postgres.Driver{}, Publisher: &faultyPublisher{},
		ShutdownTimeout: time.Second, StatsInterval: -1})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- ob.Run(ctx) }()
	select {
	case <-srv.accepted:
	case <-time.After(30 * time.Second):
		t.Fatal("the background work never connected")
	}
	time.Sleep(100 * time.Millisecond) // the other services connect too
	cancel()
	cancelled := time.Now()
	select {
	case err := <-done:
		took := time.Since(cancelled)
		if took > 5*time.Second {
			t.Errorf("Run returned %s after its context ended, want about ShutdownTimeout (1 s)", took.Round(time.Millisecond))
		}
		t.Logf("Run returned %s after its context ended: %v", took.Round(time.Millisecond), err)
		if err == nil || !strings.Contains(err.Error(), "ShutdownTimeout") || !strings.Contains(err.Error(), "relay") {
			t.Errorf("Run = %v, want an error that names ShutdownTimeout and the relay it waited for", err)
		}
	case <-time.After(20 * time.Second):
		srv.release()
		<-done
		t.Fatal("Run did not return within 20 s of its context's end while a background call was stuck")
	}
	// The life given up runs nothing more that counts: its relay is reported not running (a
	// gauge of 1 left the OutboxRelayStalled alert and Health's relay check reporting a relay
	// that nothing ran until the stuck call returned, if ever).
	if n := outbox.RelaysRunning(ob); n != 0 {
		t.Errorf("after a shutdown that gave up, %d relays reported running, want 0", n)
	}
	// A supervisor runs it again: the life whose shutdown gave up lets a new one begin (its stop,
	// once the stuck call returns, leaves the new one alone), and a Run beside the new one is
	// refused.
	ctx2, cancel2 := context.WithCancel(context.Background())
	defer cancel2()
	again := make(chan error, 1)
	go func() { again <- ob.Run(ctx2) }()
	time.Sleep(200 * time.Millisecond)
	select {
	case err := <-again:
		t.Fatalf("Run after a shutdown that gave up = %v, want it running", err)
	default:
	}
	beside, cancelBeside := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancelBeside()
	if err := ob.Run(beside); !errors.Is(err, outbox.ErrRunning) {
		t.Errorf("a Run beside a running one = %v, want ErrRunning at once", err)
	}
	srv.release() // the stuck call returns, and the first life's stop runs
	time.Sleep(500 * time.Millisecond)
	if n := outbox.RelaysRunning(ob); n != 1 {
		t.Errorf("once the first life's stuck call returned, %d relays reported running, want the second Run's 1", n)
	}
	cancel2()
	select {
	case <-again:
	case <-time.After(20 * time.Second):
		t.Fatal("the second Run did not return within 20 s of its context's end")
	}
}
