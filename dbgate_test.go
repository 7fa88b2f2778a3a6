package outbox_test

import (
	"context"
	"database/sql"
	"errors"
	"net"
	"net/url"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"

	"github.com/watermill-outbox/outbox"
	"github.com/watermill-outbox/outbox/drivers/postgres"
	"github.com/watermill-outbox/outbox/internal/logtest"
	"github.com/watermill-outbox/outbox/internal/pgproxy"
	"github.com/watermill-outbox/outbox/internal/pgtest"
	"github.com/watermill-outbox/outbox/outboxtest"
)

// startDBProxy starts a proxy (internal/pgproxy) in front of the server at target, closed when
// the test ends.
func startDBProxy(t testing.TB, target string) *pgproxy.Proxy {
	t.Helper()
	p, err := pgproxy.Start(target)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = p.Close() })
	return p
}

// TestUnreachableDatabaseIsProbedWithBackoff takes the database away from one Outbox for 3 s
// while eight consumers have a message in flight each and redeliver it at once on every nack,
// as a Router does. The in-flight messages wait for one probe at a time instead of each trying
// to connect every RetryDelay, nothing is acked meanwhile, Health says since when the database
// is unreachable, and after the outage every message is processed exactly once.
func TestUnreachableDatabaseIsProbedWithBackoff(t *testing.T) {
	e := newEnv(t)
	u, err := url.Parse(e.dsn)
	if err != nil || u.Host == "" {
		t.Skipf("the test DSN is not a URL with a host (%v): the proxy needs one", err)
	}
	proxy := startDBProxy(t, u.Host)
	u.Host = proxy.Addr()
	pdb, err := sql.Open("postgres", u.String())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = pdb.Close() })
	// A short HandlerTimeout: the messages are nacked during the outage, after waiting that long.
	ob := e.newOutbox(func(c *outbox.Config) { c.DB = pdb; c.HandlerTimeout = time.Second })
	ctx, cancel := context.WithCancel(context.Background())
	ran := make(chan struct{})
	go func() { defer close(ran); _ = ob.Run(ctx) }()
	defer func() { cancel(); <-ran }()

	// Before the outage: the pool holds connections, which the outage breaks.
	var calls atomic.Int32
	first := message.NewMessage(uuid.NewString(), nil)
	if err := handle(ob, first, applyAndPublish(&calls)); err != nil {
		t.Fatal(err)
	}

	proxy.SetDown(true)
	var outage atomic.Bool
	outage.Store(true)
	const consumers = 8
	var ackedInOutage atomic.Int32
	var lastErr atomic.Value
	var wg sync.WaitGroup
	ids := make([]string, consumers)
	for i := range consumers {
		msg := message.NewMessage(uuid.NewString(), nil)
		ids[i] = msg.UUID
		wg.Add(1)
		go func() {
			defer wg.Done()
			for ctx.Err() == nil {
				err := handle(ob, copyOf(msg), applyAndPublish(&calls))
				if err == nil {
					if outage.Load() {
						ackedInOutage.Add(1)
					}
					return
				}
				if outage.Load() {
					lastErr.Store(err.Error())
				}
			}
		}()
	}
	time.Sleep(time.Second)
	early := proxy.Attempts()
	time.Sleep(2 * time.Second)
	attempts := proxy.Attempts()
	hctx, hcancel := context.WithTimeout(context.Background(), 10*time.Second)
	report := ob.Health(hctx)
	hcancel()
	outage.Store(false)
	proxy.SetDown(false)
	ended := time.Now()
	t.Logf("connection attempts during 3 s of outage: %d (%d in the first second); a nack: %v", attempts, early, lastErr.Load())

	waited := make(chan struct{})
	go func() { wg.Wait(); close(waited) }()
	select {
	case <-waited:
	case <-time.After(30 * time.Second):
		t.Fatalf("messages not processed 30 s after the outage; last error: %v", lastErr.Load())
	}

	mustEqual(t, "messages acked during the outage", ackedInOutage.Load(), int32(0))
	// Neither the outage nor the wait counts against a message: a unit that begins when the
	// database answers has its whole HandlerTimeout.
	// A unit that began once the database answered may still run out of its HandlerTimeout (1 s
	// here) on a loaded machine, and that failure counts, as it should: such an attempt failed on
	// its deadline, a whole HandlerTimeout after the outage ended at the earliest. Any other
	// (the outage, or the wait for the database, counted against the message) fails the test.
	rows, err := e.db.Query(`SELECT message_id, attempts, last_error, first_failed_at FROM outbox_attempts`)
	if err != nil {
		t.Fatal(err)
	}
	for rows.Next() {
		var id, last string
		var n int
		var at time.Time
		if err := rows.Scan(&id, &n, &last, &at); err != nil {
			t.Fatal(err)
		}
		after := at.Sub(ended)
		t.Logf("counted: %s, %d attempt(s), the first %s after the outage ended: %s", id, n, after.Round(time.Millisecond), last)
		// Its error is the unit's deadline: the context's own, or lib/pq's cancellation of the
		// statement in flight (57014).
		timedOut := strings.Contains(last, "deadline exceeded") || strings.Contains(last, "57014")
		if after < time.Second-50*time.Millisecond || !timedOut {
			t.Errorf("a failed attempt of %s was counted %s after the outage ended, want none but a HandlerTimeout (1 s) run out after it: %s", id, after.Round(time.Millisecond), last)
		}
	}
	if err := rows.Close(); err != nil {
		t.Fatal(err)
	}
	// At most one probe at a time, 100 ms doubling: about five in 3 s, after the first failures
	// of what was in flight (the consumers, the relay, the cleanup, the listener).
	// Before the first failure closes the gate, each consumer's unit and each background task may
	// dial once, and a unit that began before the gate closed once more: on a loaded machine up to
	// 24 in all were seen. Without the gate, the eight consumers alone dial hundreds of times in
	// 3 s; the backoff itself is the bound on the last 2 s below.
	if attempts > consumers+20 {
		t.Errorf("%d connection attempts during 3 s of outage, want at most %d", attempts, consumers+20)
	}
	if late := attempts - early; late > 4 {
		t.Errorf("%d connection attempts in the last 2 s of the outage, want at most 4 (a probe with exponential backoff)", late)
	}
	var dbCheck outbox.HealthCheck
	for _, c := range report.Checks {
		if c.Name == outbox.CheckDatabase {
			dbCheck = c
		}
	}
	if dbCheck.OK || !strings.Contains(dbCheck.Reason, "unreachable since") || !strings.Contains(dbCheck.Reason, "attempts") {
		t.Errorf("Health's database check during the outage: %+v; want it to say since when it is unreachable and how many attempts", dbCheck)
	}
	if msg, ok := lastErr.Load().(string); !ok || !strings.Contains(msg, "unreachable since") {
		t.Errorf("the nack of a message during the outage: %v; want it to say the database is unreachable since when", lastErr.Load())
	}

	for _, id := range append(ids, first.UUID) {
		mustEqual(t, "business rows of "+id, e.count(`SELECT count(*) FROM applied WHERE message_id = $1`, id), 1)
	}
	waitFor(t, "the effects sent", func() bool { return e.pendingEffects() == 0 })
	wire := e.wire("out_a")
	mustEqual(t, "messages on out_a", len(wire), consumers+1)
	for id, n := range wire {
		mustEqual(t, "copies of "+id, n, 1)
	}
	hctx, hcancel = context.WithTimeout(context.Background(), 10*time.Second)
	defer hcancel()
	if r := ob.Health(hctx); !checkOK(r, outbox.CheckDatabase) {
		t.Errorf("Health after the outage: %+v", r)
	}
}

// TestUnitGivesUpAProbeThatHangs: the database first refuses (the gate opens), then stalls, so
// that each probe hangs until the unit of work that took its turn at it gives up. Each unit
// still ends at its HandlerTimeout, nacked as unreachable; none goes on probing with its
// context ended.
func TestUnitGivesUpAProbeThatHangs(t *testing.T) {
	e := newEnv(t)
	u, err := url.Parse(e.dsn)
	if err != nil || u.Host == "" {
		t.Skipf("the test DSN is not a URL with a host (%v): the proxy needs one", err)
	}
	proxy := startDBProxy(t, u.Host)
	u.Host = proxy.Addr()
	pdb, err := sql.Open("postgres", u.String())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = pdb.Close() })
	const timeout = 500 * time.Millisecond
	ob := e.newOutbox(func(c *outbox.Config) {
		c.DB = pdb
		c.HandlerTimeout = timeout
		c.ReconnectDelay = 10 * time.Millisecond
	})
	proxy.SetDown(true)
	msg := message.NewMessage(uuid.NewString(), nil)
	if err := handle(ob, copyOf(msg), applyAndPublish(nil)); !errors.Is(err, outbox.ErrDatabaseUnreachable) {
		t.Fatalf("a unit of work while the database refuses: %v, want ErrDatabaseUnreachable", err)
	}
	proxy.SetHang(true)
	for i := range 3 {
		began := time.Now()
		done := make(chan error, 1)
		go func() { done <- handle(ob, copyOf(msg), applyAndPublish(nil)) }()
		select {
		case err := <-done:
			if !errors.Is(err, outbox.ErrDatabaseUnreachable) || !strings.Contains(err.Error(), "unreachable since") {
				t.Fatalf("delivery %d while the database stalls: %v, want ErrDatabaseUnreachable since a time", i, err)
			}
			t.Logf("delivery %d nacked after %s", i, time.Since(began).Round(time.Millisecond))
		case <-time.After(10 * timeout):
			t.Fatalf("delivery %d while the database stalls has not returned after %s (HandlerTimeout %s)", i, 10*timeout, timeout)
		}
	}
	proxy.SetHang(false)
	proxy.SetDown(false)
	waitFor(t, "the message processed after the outage", func() bool { return handle(ob, copyOf(msg), applyAndPublish(nil)) == nil })
	mustEqual(t, "business rows", e.count(`SELECT count(*) FROM applied WHERE message_id = $1`, msg.UUID), 1)
}

func checkOK(r outbox.HealthReport, name string) bool {
	for _, c := range r.Checks {
		if c.Name == name {
			return c.OK
		}
	}
	return false
}

// TestOutboxesOfOneDBShareAGate: the Outboxes of one *sql.DB with the same reconnect delays share
// their gate (one probe for all, one outage); others have their own, none without a gate. A
// closed Outbox stops hearing of outages, and a gate no Outbox holds any more is dropped.
func TestOutboxesOfOneDBShareAGate(t *testing.T) {
	db1, err := sql.Open("postgres", "host=127.0.0.1 port=1 dbname=none")
	if err != nil {
		t.Fatal(err)
	}
	defer db1.Close()
	db2, err := sql.Open("postgres", "host=127.0.0.1 port=2 dbname=none")
	if err != nil {
		t.Fatal(err)
	}
	defer db2.Close()
	open := func(db *sql.DB, prefix string, delay time.Duration) *outbox.Outbox {
		t.Helper()
		ob, err := outbox.New(outbox.Config{DB: db, Driver: postgres.Driver{}, Publisher: &outboxtest.Recorder{}, TablePrefix: prefix, ReconnectDelay: delay})
		if err != nil {
			t.Fatal(err)
		}
		return ob
	}
	func() {
		a, b := open(db1, "a_", 0), open(db1, "b_", 0)
		if outbox.GateOf(a) == nil || outbox.GateOf(a) != outbox.GateOf(b) {
			t.Fatal("two Outboxes of one *sql.DB have gates of their own")
		}
		if outbox.GateOf(open(db1, "c_", 200*time.Millisecond)) == outbox.GateOf(a) {
			t.Error("an Outbox with another ReconnectDelay shares the gate")
		}
		if outbox.GateOf(open(db2, "a_", 0)) == outbox.GateOf(a) {
			t.Error("an Outbox of another *sql.DB shares the gate")
		}
		if outbox.GateOf(open(db1, "d_", -1)) != nil {
			t.Error("an Outbox with a negative ReconnectDelay has a gate")
		}
		if n := outbox.GateUsers(a); n != 2 {
			t.Fatalf("the shared gate has %d users, want 2", n)
		}
		if err := b.Close(); err != nil {
			t.Fatal(err)
		}
		if n := outbox.GateUsers(a); n != 1 {
			t.Fatalf("after a Close the shared gate has %d users, want 1", n)
		}
		runtime.KeepAlive(a)
	}()
	// Dropped: the gates go with their Outboxes.
	for deadline := time.Now().Add(10 * time.Second); outbox.SharedGates(db1) > 0; time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("%d gates of db1 left 10 s after their Outboxes were dropped", outbox.SharedGates(db1))
		}
		runtime.GC()
	}
}

// TestListenerThatCannotConnectIsNoOutage: the relay's listener dials an address of its own
// (ListenDSN) that refuses it. The pool's database is fine: nothing reports it unreachable and
// no unit waits for it. Taken for an outage, each failed listener connection (one a second)
// opened the gate: an outage and its end logged every second, and the work of every Outbox on
// the pool held back until the probe's answer. The listener's retries back off meanwhile.
func TestListenerThatCannotConnectIsNoOutage(t *testing.T) {
	db := pgtest.DB(t)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	refused := ln.Addr().String()
	_ = ln.Close() // nothing listens there now: connections are refused
	logs := &logtest.Errors{}
	ob, err := outbox.New(outbox.Config{DB: db, Publisher: &outboxtest.Recorder{}, Logger: logs,
		Driver: postgres.Driver{ListenDSN: "postgres://postgres@" + refused + "/none?sslmode=disable&connect_timeout=2"}})
	if err != nil {
		t.Fatal(err)
	}
	if err := ob.Migrate(context.Background()); err != nil {
		t.Fatal(err)
	}
	stop := outbox.WatchGate(ob)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); _ = ob.Run(ctx) }()
	defer func() { cancel(); <-done }()
	deadline := time.Now().Add(4 * time.Second)
	for time.Now().Before(deadline) {
		if err := ob.InTx(context.Background(), func(ctx context.Context, tx *sql.Tx) error { return nil }); err != nil {
			t.Fatalf("InTx while the listener cannot connect: %v", err)
		}
		if r := ob.Health(context.Background()); !r.Checks[0].OK {
			t.Fatalf("Health while the listener cannot connect: %+v", r.Checks[0])
		}
		time.Sleep(50 * time.Millisecond)
	}
	probes, held := stop()
	failures := strings.Count(strings.Join(logs.Lines(), "\n"), "Listening for relay wake-ups failed")
	t.Logf("in 4 s: %d listener failures logged, %d probes, held: %v", failures, probes, held)
	if logs.Contains("The database is unreachable") {
		t.Errorf("an outage was reported for a listener that could not connect: %v", logs.Lines())
	}
	// 1, 2 s apart and doubling: at most 3 failures in 4 s (4 a second apart before).
	if failures > 3 {
		t.Errorf("%d listener failures in 4 s, want at most 3 (its retries back off)", failures)
	}
}
