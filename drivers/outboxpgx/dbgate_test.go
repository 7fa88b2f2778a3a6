package outboxpgx_test

import (
	"context"
	"fmt"
	"net"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/watermill-outbox/outbox"
	"github.com/watermill-outbox/outbox/drivers/outboxpgx"
	"github.com/watermill-outbox/outbox/outboxtest"
)

// refusingPool returns a pool on the test database (of at most maxConns connections; 0: pgx's
// default) whose dials are refused while down is set, counted in dials.
func refusingPool(t *testing.T, maxConns int32) (pool *pgxpool.Pool, down *atomic.Bool, dials *atomic.Int64) {
	t.Helper()
	pc, err := pgxpool.ParseConfig(outboxtest.DSN(t))
	if err != nil {
		t.Fatal(err)
	}
	if maxConns > 0 {
		pc.MaxConns = maxConns
	}
	down, dials = new(atomic.Bool), new(atomic.Int64)
	pc.ConnConfig.DialFunc = func(ctx context.Context, network, addr string) (net.Conn, error) {
		if down.Load() {
			dials.Add(1)
			return nil, &net.OpError{Op: "dial", Net: network, Err: syscall.ECONNREFUSED}
		}
		var d net.Dialer
		return d.DialContext(ctx, network, addr)
	}
	pool, err = pgxpool.NewWithConfig(context.Background(), pc)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	return pool, down, dials
}

// TestUnreachableDatabaseIsProbedWithBackoff is the root module's test of the same name on the pgx
// form: the pool's dials are refused for 3 s, its connections dropped, while eight consumers have
// a message in flight each and redeliver it at once on every nack. The pool dials about once per
// probe, not once per message per RetryDelay; nothing is acked meanwhile, and every message is
// processed exactly once after.
func TestUnreachableDatabaseIsProbedWithBackoff(t *testing.T) {
	pool, down, dials := refusingPool(t, 8)
	rec := &outboxtest.Recorder{}
	ob := ready(t, pool, outbox.Config{Publisher: rec, HandlerTimeout: time.Second})
	ctx, cancel := context.WithCancel(context.Background())
	ran := make(chan struct{})
	go func() { defer close(ran); _ = ob.Run(ctx) }()
	defer func() { cancel(); <-ran }()
	h := func(msg *message.Message) ([]*message.Message, error) { return nil, handler(msg) }
	deliver := func(id string) error {
		return ob.Handle(message.NewMessage(id, nil), outbox.HandleParams{Consumer: "c1", MessageID: id}, h)
	}
	first := uuid.NewString()
	if err := deliver(first); err != nil {
		t.Fatal(err)
	}

	down.Store(true)
	pool.Reset() // the outage breaks the connections the pool holds
	var outage atomic.Bool
	outage.Store(true)
	const consumers = 8
	var ackedInOutage atomic.Int32
	var lastErr atomic.Value
	var wg sync.WaitGroup
	ids := make([]string, consumers)
	for i := range consumers {
		ids[i] = uuid.NewString()
		wg.Add(1)
		go func() {
			defer wg.Done()
			for ctx.Err() == nil {
				err := deliver(ids[i])
				if err == nil {
					if outage.Load() {
						ackedInOutage.Add(1)
					}
					return
				}
				lastErr.Store(err.Error())
			}
		}()
	}
	time.Sleep(time.Second)
	early := dials.Load()
	time.Sleep(2 * time.Second)
	attempts := dials.Load()
	r := ob.Health(context.Background())
	outage.Store(false)
	down.Store(false)
	t.Logf("dials during 3 s of outage: %d (%d in the first second); a nack: %v", attempts, early, lastErr.Load())

	waited := make(chan struct{})
	go func() { wg.Wait(); close(waited) }()
	select {
	case <-waited:
	case <-time.After(30 * time.Second):
		t.Fatalf("messages not processed 30 s after the outage; last error: %v", lastErr.Load())
	}
	if n := ackedInOutage.Load(); n != 0 {
		t.Errorf("%d messages acked during the outage", n)
	}
	// Before the first failure closes the gate, each consumer's unit and each background task may
	// dial once, and a unit that began before the gate closed once more: on a loaded machine up to
	// 24 in all were seen. Without the gate, the eight consumers alone dial hundreds of times in
	// 3 s; the backoff itself is the bound on the last 2 s below.
	if attempts > consumers+20 {
		t.Errorf("%d dials during 3 s of outage, want at most %d", attempts, consumers+20)
	}
	if late := attempts - early; late > 4 {
		t.Errorf("%d dials in the last 2 s of the outage, want at most 4 (a probe with exponential backoff)", late)
	}
	if r.Checks[0].Name != outbox.CheckDatabase || r.Checks[0].OK || !strings.Contains(r.Checks[0].Reason, "unreachable since") {
		t.Errorf("Health during the outage: %+v, want the database reported unreachable since a time", r.Checks[0])
	}
	db := ob.Config().DB
	sent := map[string]int{}
	for _, m := range rec.Messages("out") {
		sent[m.UUID]++
	}
	for _, id := range append(ids, first) {
		if n := count(t, db, id); n != 1 {
			t.Errorf("message %s applied %d times, want once", id, n)
		}
		if n := sent["out-"+id]; n != 1 {
			t.Errorf("effect of %s sent %d times, want once", id, n)
		}
	}
	if r := ob.Health(context.Background()); !r.Checks[0].OK {
		t.Errorf("Health after the outage: %+v", r.Checks[0])
	}
}

// TestOutboxesOfOnePoolProbeOnce: ten Outboxes on one pgxpool (a table prefix each, each its own
// *sql.DB on the pool), running, meet an outage, each with a unit that fails on it. The pool then
// dials once per probe of one gate, not once per probe of each Outbox's (fifty in 3 s).
func TestOutboxesOfOnePoolProbeOnce(t *testing.T) {
	pool, down, dials := refusingPool(t, 0)
	const outboxes = 10
	var obs []*outbox.Outbox
	for i := range outboxes {
		obs = append(obs, ready(t, pool, outbox.Config{Publisher: &outboxtest.Recorder{}, TablePrefix: fmt.Sprintf("p%d_", i)}))
	}
	// Each runs: its relay and cleanup wait for its gate, which probes.
	ctx, cancel := context.WithCancel(context.Background())
	var running sync.WaitGroup
	defer func() { cancel(); running.Wait() }()
	for _, ob := range obs {
		running.Go(func() { _ = ob.Run(ctx) })
	}
	deliver := func(ob *outbox.Outbox, timeout time.Duration) error {
		ctx, cancel := context.WithTimeout(context.Background(), timeout)
		defer cancel()
		return outboxpgx.InTx(ctx, ob, func(ctx context.Context, tx pgx.Tx) error {
			_, err := tx.Exec(ctx, `SELECT 1`)
			return err
		})
	}
	down.Store(true)
	pool.Reset()
	var wg sync.WaitGroup
	for _, ob := range obs {
		wg.Go(func() { _ = deliver(ob, time.Second) })
	}
	wg.Wait()
	// The background runs under way when the outage began make one attempt each (each stops at
	// it), which a loaded machine may spread over a second or more after the units gave up.
	time.Sleep(time.Second)
	before := dials.Load()
	time.Sleep(3 * time.Second)
	probes := dials.Load() - before
	down.Store(false)
	t.Logf("%d dials as %d Outboxes met the outage, then %d in 3 s", before, outboxes, probes)
	// One gate's probes, 100 ms doubling, each over its upper half: two or three in these 3 s;
	// a gate each made 20 or more.
	if probes > 7 {
		t.Errorf("%d dials in 3 s of an outage of %d Outboxes on one pool, want at most 7 (one gate's probes)", probes, outboxes)
	}
	for i, ob := range obs {
		var err error
		for deadline := time.Now().Add(20 * time.Second); ; time.Sleep(50 * time.Millisecond) {
			if err = deliver(ob, 5*time.Second); err == nil || time.Now().After(deadline) {
				break
			}
		}
		if err != nil {
			t.Errorf("Outbox %d after the outage: %v", i, err)
		}
	}
}
