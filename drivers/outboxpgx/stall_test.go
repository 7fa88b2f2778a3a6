package outboxpgx_test

import (
	"context"
	"errors"
	"io"
	"net"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/watermill-outbox/outbox"
	"github.com/watermill-outbox/outbox/drivers/outboxpgx"
	"github.com/watermill-outbox/outbox/internal/pgproxy"
	"github.com/watermill-outbox/outbox/internal/silent"
	"github.com/watermill-outbox/outbox/outboxtest"
)

// TestStalledDatabaseIsProbedNotDialled: the database accepts connections and answers none for
// 4 s (pgproxy in hang mode) while eight consumers redeliver a message each at once on every nack
// and an InTx caller comes every 100 ms. A stall fails nothing by itself: without the gate's
// suspicion every BEGIN dialled a connection that hung. The pool dials in a first burst, then
// only for the gate's probes; InTx calls fail with ErrDatabaseUnreachable; nothing is acked
// meanwhile, and every message is processed once after.
func TestStalledDatabaseIsProbedNotDialled(t *testing.T) {
	proxy, dsn, err := pgproxy.StartFor(outboxtest.DSN(t))
	if err != nil {
		t.Skipf("no proxy: %v", err)
	}
	t.Cleanup(func() { _ = proxy.Close() })
	pc, err := pgxpool.ParseConfig(dsn)
	if err != nil {
		t.Fatal(err)
	}
	pc.MaxConns = 32 // not full in the outage: what the pool dials is what the framework asks
	pool, err := pgxpool.NewWithConfig(context.Background(), pc)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	rec := &outboxtest.Recorder{}
	ob := ready(t, pool, outbox.Config{Publisher: rec, HandlerTimeout: time.Second})
	ctx, cancel := context.WithCancel(context.Background())
	var bg sync.WaitGroup
	defer func() { cancel(); bg.Wait() }()
	bg.Add(1)
	go func() { defer bg.Done(); _ = ob.Run(ctx) }()
	h := func(msg *message.Message) ([]*message.Message, error) { return nil, handler(msg) }
	deliver := func(id string) error {
		return ob.Handle(message.NewMessage(id, nil), outbox.HandleParams{Consumer: "c1", MessageID: id}, h)
	}
	if err := deliver(uuid.NewString()); err != nil {
		t.Fatal(err)
	}

	const outage = 4 * time.Second
	var down atomic.Bool
	var ackedInOutage atomic.Int32
	var inTxOther, inTxBroken atomic.Int32
	var lastOther atomic.Value
	ids := make([]string, 8)
	var consumers sync.WaitGroup
	proxy.SetHang(true)
	down.Store(true)
	proxy.SetDown(true)
	began := time.Now()
	for i := range ids {
		ids[i] = uuid.NewString()
		consumers.Add(1)
		go func() {
			defer consumers.Done()
			for ctx.Err() == nil {
				if deliver(ids[i]) == nil {
					if down.Load() {
						ackedInOutage.Add(1)
					}
					return
				}
			}
		}()
	}
	var calls sync.WaitGroup
	half := int64(-1)
	for time.Since(began) < outage {
		calls.Add(1)
		go func() {
			defer calls.Done()
			cctx, ccancel := context.WithTimeout(ctx, 2*time.Second)
			defer ccancel()
			err := outboxpgx.InTx(cctx, ob, func(ctx context.Context, tx pgx.Tx) error {
				_, err := tx.Exec(ctx, `SELECT 1`)
				return err
			})
			switch {
			case err == nil, errors.Is(err, outbox.ErrDatabaseUnreachable):
			case errors.Is(err, io.ErrUnexpectedEOF), errors.Is(err, io.EOF), errors.Is(err, net.ErrClosed),
				strings.HasSuffix(err.Error(), ": unexpected EOF"), strings.HasSuffix(err.Error(), ": conn closed"):
				// A pooled connection the outage broke under a call begun as it began: the
				// server went away mid-statement, which says nothing of reaching it again.
				inTxBroken.Add(1)
			default:
				inTxOther.Add(1)
				lastOther.Store(err.Error())
			}
		}()
		time.Sleep(100 * time.Millisecond)
		if half < 0 && time.Since(began) >= outage/2 {
			half = proxy.Attempts()
		}
	}
	attempts := proxy.Attempts()
	down.Store(false)
	proxy.SetDown(false)
	proxy.SetHang(false)
	calls.Wait()
	t.Logf("%s stall: %d connection attempts (%d in its first half); InTx calls failed otherwise than ErrDatabaseUnreachable: %d (%v), on a connection the outage broke: %d",
		outage, attempts, half, inTxOther.Load(), lastOther.Load(), inTxBroken.Load())

	waited := make(chan struct{})
	go func() { consumers.Wait(); close(waited) }()
	select {
	case <-waited:
	case <-time.After(30 * time.Second):
		t.Fatal("messages not processed 30 s after the stall")
	}
	// The first burst: the eight consumers, the InTx calls of the first beginStall (500 ms),
	// the relay, cleanup, statistics and listener, a few more that pgxpool opens for acquires
	// given up; then the probes, one in flight at a time. Before the gate suspected a stall:
	// 33, as many as the pool holds, and every InTx call ended by its deadline.
	if attempts > 28 {
		t.Errorf("%d connection attempts during the %s stall, want at most 28", attempts, outage)
	}
	if late := attempts - half; late > 3 {
		t.Errorf("%d connection attempts in the second half of the stall, want at most 3 (the probes)", late)
	}
	if n := inTxOther.Load(); n > 0 {
		t.Errorf("%d InTx calls failed otherwise than ErrDatabaseUnreachable: %v", n, lastOther.Load())
	}
	if n := ackedInOutage.Load(); n != 0 {
		t.Errorf("%d messages acked during the stall", n)
	}
	db := ob.Config().DB
	sent := map[string]int{}
	for _, m := range rec.Messages("out") {
		sent[m.UUID]++
	}
	for _, id := range ids {
		if n := count(t, db, id); n != 1 {
			t.Errorf("message %s applied %d times, want once", id, n)
		}
		if n := sent["out-"+id]; n != 1 {
			t.Errorf("effect of %s sent %d times, want once", id, n)
		}
	}
}

// The listener's set-up (its connection, LISTEN, its own notification) waited on a server that
// accepts connections and never answers for as long as Run ran: it neither failed nor reached
// its quiet-time ping, and never tried again. It is bounded as the ping is, and tried again.
func TestListenerSetUpOnASilentServerIsBounded(t *testing.T) {
	defer outboxpgx.SetListenTimings(90*time.Second, 300*time.Millisecond)()
	srv, err := silent.Start()
	if err != nil {
		t.Fatal(err)
	}
	defer srv.Close()
	pool := openPool(t, outboxtest.DSN(t), 4, nil)
	ob := ready(t, pool, outbox.Config{Publisher: &outboxtest.Recorder{}, RelayInterval: time.Hour}, outboxpgx.WithListenDSN(srv.DSN()))
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- ob.Run(ctx) }()
	defer func() { cancel(); <-done }()
	deadline := time.Now().Add(30 * time.Second)
	for srv.Conns() < 2 {
		if time.Now().After(deadline) {
			t.Fatalf("the listener's connection to a server that never answers: %d attempts in 30 s, want it given up and tried again", srv.Conns())
		}
		time.Sleep(50 * time.Millisecond)
	}
}
