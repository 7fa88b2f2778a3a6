package outbox_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/watermill-outbox/outbox"
	"github.com/watermill-outbox/outbox/drivers/postgres"
	"github.com/watermill-outbox/outbox/internal/pgtest"
	"github.com/watermill-outbox/outbox/outboxtest"
)

// markRideEnv is an Outbox on a pool of its own, with an in-memory publisher: every transaction on
// the test's database is the Outbox's, counted by pg_stat_database once its connections closed.
type markRideEnv struct {
	t      *testing.T
	e      *env
	admin  *sql.DB
	dbName string
	db     *sql.DB
	ob     *outbox.Outbox
	rec    *outboxtest.Recorder
}

func newMarkRideEnv(t *testing.T) *markRideEnv {
	outbox.EnableMarkRides(t)
	e := newEnv(t)
	admin, err := sql.Open("postgres", pgtest.AdminDSN(t))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = admin.Close() })
	m := &markRideEnv{t: t, e: e, admin: admin, rec: &outboxtest.Recorder{}}
	if err := e.db.QueryRow(`SELECT current_database()`).Scan(&m.dbName); err != nil {
		t.Fatal(err)
	}
	// The server's autovacuum visits each database once a minute (autovacuum_naptime) and
	// analyzes the tables filled since: a transaction each, counted in pg_stat_database with the
	// Outbox's. A visit within the 100 messages of TestMarkRidesOnTheNextClaim made them 134
	// transactions instead of 118 (reproduced with a naptime of 1 s: 128-134). Switched off for
	// the test's tables, a visit costs the worker's own few transactions (a naptime of 1 s, two
	// or three visits a run: 128-130), and one a minute fits in the test's bound.
	pgtest.NoAutovacuum(t, e.db)
	if m.db, err = sql.Open("postgres", e.dsn); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = m.db.Close() })
	// The default: sent effects deleted, not kept (EffectRetention 0). Run's services, which
	// marks ride only while they run, do no work of their own in the test's time but at start.
	if m.ob, err = outbox.New(outbox.Config{DB: m.db, Driver: postgres.Driver{}, Publisher: m.rec,
		RelayInterval: time.Hour, CleanupInterval: time.Hour, StatsInterval: -1}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = m.ob.Close() })
	return m
}

// run runs the Outbox's Run until the test ends, after its first passes.
func (m *markRideEnv) run() {
	m.t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- m.ob.Run(ctx) }()
	m.t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			m.t.Error(err)
		}
	})
	time.Sleep(300 * time.Millisecond) // the relay's and cleanup's first passes, at start
}

// oneAtATime handles n messages 10 ms apart (past the marks' linger: each mark is alone) and
// returns the transactions they committed, every mark written, and how many of the messages
// began more than half a second after the previous one ended (a mark waits up to a second for a
// claim to ride on: on a loaded machine it may not get one, and its writer writes it alone).
func (m *markRideEnv) oneAtATime(prefix string, n int) (commits int64, slow int, autovacuum int64) {
	m.t.Helper()
	av := m.autovacuumRuns()
	defer func() { autovacuum = m.autovacuumRuns() - av }()
	before := m.commits()
	var ended time.Time
	for i := range n {
		if !ended.IsZero() && time.Since(ended) > 500*time.Millisecond {
			slow++
		}
		if err := m.handle(fmt.Sprint(prefix, i), false); err != nil {
			m.t.Fatal(err)
		}
		ended = time.Now()
		time.Sleep(10 * time.Millisecond)
	}
	m.ob.FlushMarks()
	return m.commits() - before, slow, 0 // autovacuum: set by the deferred call
}

// autovacuumRuns returns how many times autovacuum vacuumed or analyzed a table of the test's
// database, its catalogs included (which every migration's CREATE TABLE churns, and which the
// test cannot leave out of autovacuum): each is a transaction of the worker's that the server
// counts in pg_stat_database with the Outbox's.
func (m *markRideEnv) autovacuumRuns() int64 {
	m.t.Helper()
	var n int64
	if err := m.e.db.QueryRow(`SELECT coalesce(sum(autovacuum_count + autoanalyze_count), 0) FROM pg_stat_all_tables`).Scan(&n); err != nil {
		m.t.Fatal(err)
	}
	return n
}

// commits returns the transactions committed on the test's database so far, once every
// connection to it but the env's own pool (closed before: idle) has gone: a backend's counts
// reach pg_stat_database when it exits, or up to 10 s after its last transaction.
func (m *markRideEnv) commits() int64 {
	m.t.Helper()
	m.e.db.SetMaxIdleConns(0)
	m.db.SetMaxIdleConns(0)
	waitFor(m.t, "no connection to the test's database", func() bool {
		var n int
		if err := m.admin.QueryRow(`SELECT count(*) FROM pg_stat_activity WHERE datname = $1`, m.dbName).Scan(&n); err != nil {
			m.t.Fatal(err)
		}
		return n == 0
	})
	var c int64
	if err := m.admin.QueryRow(`SELECT xact_commit FROM pg_stat_database WHERE datname = $1`, m.dbName).Scan(&c); err != nil {
		m.t.Fatal(err)
	}
	m.db.SetMaxIdleConns(2)
	return c
}

func (m *markRideEnv) handle(id string, fail bool) error {
	msg := message.NewMessage(id, nil)
	return m.ob.Handle(msg, outbox.HandleParams{Consumer: "c1", MessageID: id}, func(msg *message.Message) ([]*message.Message, error) {
		ctx := msg.Context()
		if _, err := outbox.Tx(ctx).ExecContext(ctx, `INSERT INTO applied (message_id) VALUES ($1)`, msg.UUID); err != nil {
			return nil, err
		}
		if err := outbox.Publish(ctx, "out_a", message.NewMessage("event-"+msg.UUID, nil)); err != nil {
			return nil, err
		}
		if fail {
			return nil, errors.New("the handler failed")
		}
		return nil, nil
	})
}

// handleAndLock handles message id, then locks its claim in a transaction of its own (rolled
// back when the test ends, if not before), as a copy of the message being handled would.
func (m *markRideEnv) handleAndLock(id string) *sql.Tx {
	m.t.Helper()
	if err := m.handle(id, false); err != nil {
		m.t.Fatal(err)
	}
	lock, err := m.e.db.Begin()
	if err != nil {
		m.t.Fatal(err)
	}
	m.t.Cleanup(func() { _ = lock.Rollback() })
	var one int
	if err := lock.QueryRow(`SELECT 1 FROM outbox_processed WHERE consumer = 'c1' AND message_id = $1 FOR UPDATE`, id).Scan(&one); err != nil {
		m.t.Fatal(err)
	}
	return lock
}

// pending tells whether the claim of message id still holds its inline effects (unmarked).
func (m *markRideEnv) pending(id string) bool {
	m.t.Helper()
	var p bool
	if err := m.e.db.QueryRow(`SELECT effects IS NOT NULL FROM outbox_processed WHERE consumer = 'c1' AND message_id = $1`, id).Scan(&p); err != nil {
		m.t.Fatal(err)
	}
	return p
}

// unmarked returns the claims that still hold inline effects.
func (m *markRideEnv) unmarked() int {
	m.t.Helper()
	var n int
	if err := m.e.db.QueryRow(`SELECT count(*) FROM outbox_processed WHERE effects IS NOT NULL`).Scan(&n); err != nil {
		m.t.Fatal(err)
	}
	return n
}

// Messages that come a few milliseconds apart, one at a time (one database of many, whose marks
// cannot be batched): the mark of each rides on the claim of the next, in its transaction, rather
// than being a transaction of its own. 100 messages cost 118 transactions: a unit each, the last
// one's mark and the preparation of the statements on the pool's connections (some 17, each an
// implicit transaction); each mark written on its own made them 217. Every effect is sent once and
// every claim ends up marked.
//
// The transactions are counted by the server, which counts autovacuum's with them: a visit of its
// worker to the test's database (once a minute) costs some 5 more, even with the test's tables
// left out (newMarkRideEnv), and more when it vacuums or analyzes the catalogs that the
// migrations churned (130 in a run where the Outbox's own count was unchanged); the bound leaves
// room for a visit, and two transactions for each table autovacuum took meanwhile. The marker's own count of the marks it
// wrote alone says whether they rode, whatever else the server counted.
func TestMarkRidesOnTheNextClaim(t *testing.T) {
	m := newMarkRideEnv(t)
	m.run()
	const n = 100
	got, slow, av := m.oneAtATime("ride-", n)
	alone := outbox.MarksWrittenAlone(m.ob)
	t.Logf("%d messages, one at a time: %d transactions, %d batches of marks written alone, %d messages began more than 0.5 s after the previous one, %d tables vacuumed or analyzed by autovacuum meanwhile",
		n, got, alone, slow, av)
	if limit := int64(1 + slow); alone > limit {
		t.Errorf("the marker wrote %d batches of marks alone, want at most %d (the last mark, and one for each message that came late)", alone, limit)
	}
	if limit := n + n/4 + int64(slow) + 2*av; got > limit {
		t.Errorf("%d messages committed %d transactions, want at most %d (a unit each, the last mark, the statements' preparation, a visit of autovacuum, a mark for each message that came late, two for each table autovacuum took)", n, got, limit)
	}
	if u := m.unmarked(); u != 0 {
		t.Errorf("%d claims still hold their effects after FlushMarks", u)
	}
	sent := map[string]int{}
	for _, s := range m.rec.All() {
		sent[s.Message.UUID]++
	}
	for i := range n {
		if c := sent[fmt.Sprint("event-ride-", i)]; c != 1 {
			t.Errorf("event of message %d sent %d times", i, c)
		}
	}
}

// Without Run (a process that only handles messages, a test, a shutdown after Run returned),
// marks do not wait for a next claim: nothing would write them when the process stops, and the
// marker's goroutine would outlive the handlers by up to the ride's window. Each mark is a
// transaction of its own again.
func TestMarkRidesOnlyWhileRunRuns(t *testing.T) {
	m := newMarkRideEnv(t)
	const n = 40
	got, _, _ := m.oneAtATime("alone-", n)
	t.Logf("%d messages, one at a time, without Run: %d transactions", n, got)
	if got < 2*n-n/8 {
		t.Errorf("%d messages without Run committed %d transactions, want at least %d: marks rode on claims", n, got, 2*n-n/8)
	}
	if alone := outbox.MarksWrittenAlone(m.ob); alone < n-n/8 {
		t.Errorf("the marker wrote %d batches of marks alone, want at least %d: marks rode on claims", alone, n-n/8)
	}
	if u := m.unmarked(); u != 0 {
		t.Errorf("%d claims still hold their effects after FlushMarks", u)
	}
}

// A unit whose marks ride on its claim and that rolls back (its handler failed) hands them back:
// they are written on their own, and no claim keeps effects that were sent.
func TestMarkRideOnARolledBackUnitIsWrittenAnyway(t *testing.T) {
	m := newMarkRideEnv(t)
	m.run()
	for i := range 5 {
		if err := m.handle(fmt.Sprint("ok-", i), false); err != nil {
			t.Fatal(err)
		}
		failed := fmt.Sprint("fails-", i)
		if err := m.handle(failed, true); err == nil {
			t.Fatalf("message %s: the handler failed, Handle did not", failed)
		}
	}
	// Written once the ride's window is over, without a flush.
	waitFor(t, "every sent effect's claim marked", func() bool { return m.unmarked() == 0 })
	var applied int
	if err := m.e.db.QueryRow(`SELECT count(*) FROM applied`).Scan(&applied); err != nil {
		t.Fatal(err)
	}
	mustEqual(t, "messages applied", applied, 5)
	if got := len(m.rec.All()); got != 5 {
		t.Errorf("%d events sent, want 5", got)
	}
}

// A unit whose claim carries the marks of other messages does not wait for a lock another
// transaction holds on one of their claims (a copy of that message on the duplicate path, say,
// its publish hanging): the carried update skips that claim, the unit goes on with the others'
// marks, and the skipped mark is handed back to the marker, which writes it once the lock is
// gone. A carrying unit that waited held its connection, and the units behind it theirs, for as
// long as the other transaction lasted.
func TestMarkRideSkipsALockedClaim(t *testing.T) {
	t.Run("linger as set", func(t *testing.T) { testMarkRideSkipsALockedClaim(t, 0) })
	// The skipped mark and that of the message that skipped it (queued a moment later, once its
	// unit ended) in the worker's queue together, as when the worker, woken by the skip, runs
	// only after that unit ended (a CI run under load failed so): written in one statement, the
	// free mark waited for the lock with the other, and the next unit found nothing to carry.
	// Here the worker sleeps 200 ms (its linger) before it looks at its queue, and the next
	// message comes 250 ms after the free one.
	t.Run("marks gathered together", func(t *testing.T) { testMarkRideSkipsALockedClaim(t, 200*time.Millisecond) })
}

func testMarkRideSkipsALockedClaim(t *testing.T, linger time.Duration) {
	m := newMarkRideEnv(t)
	if linger > 0 {
		outbox.LingerMarks(m.ob, linger)
	}
	m.run()
	lock := m.handleAndLock("held")
	// "free" carries the mark of "held", whose claim is locked; "next" carries that of "free".
	var freeDone, nextBegan time.Time
	for _, id := range []string{"free", "next"} {
		if id == "next" {
			if linger > 0 {
				time.Sleep(linger + 50*time.Millisecond)
			}
			nextBegan = time.Now()
		}
		done := make(chan error, 1)
		go func() { done <- m.handle(id, false) }()
		select {
		case err := <-done:
			if err != nil {
				t.Fatal(err)
			}
			if id == "free" {
				freeDone = time.Now()
			}
		case <-time.After(10 * time.Second):
			_ = lock.Rollback()
			t.Fatalf("message %s: the unit carrying a mark waited 10 s for the lock held on another message's claim: %v", id, <-done)
		}
	}
	effects := m.pending
	// A mark waits up to 1 s for a claim to ride on (markRide); on a loaded machine (CI's run with
	// the oldest Go, every package at once) "next" began later than that, and the marker wrote
	// the mark itself, as it should.
	if gap := nextBegan.Sub(freeDone); gap < 500*time.Millisecond {
		if effects("free") {
			t.Error("the mark of the claim nobody held did not ride on the next claim")
		}
	} else {
		t.Logf("the next claim began %v after the first unit ended, past a mark's ride: its mark is the marker's", gap)
		waitFor(t, "the mark of the claim nobody held written", func() bool { return !effects("free") })
	}
	if !effects("held") {
		t.Error("the locked claim was marked through its lock")
	}
	if err := lock.Rollback(); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "the skipped mark written by the marker", func() bool { return !effects("held") })
	m.ob.FlushMarks()
	if u := m.unmarked(); u != 0 {
		t.Errorf("%d claims still hold their effects after FlushMarks", u)
	}
}

// The crash matrix with riding marks on (the default; OUTBOX_MARK_RIDES=0 runs the package's other
// tests with them off): a carrier message's mark rides on the claim of the unit that crashes, at
// every step, and nothing is lost or doubled. At least one scenario must have carried a mark, or
// the matrix did not cover a ride (of 6 scenarios a message, the 2 that roll back before the
// claim is written hand the mark back).
func TestCrashMatrixRidingMarks(t *testing.T) {
	outbox.EnableMarkRides(t)
	var rode atomic.Int32
	open := func(t testing.TB, dsn string, cfg outbox.Config) (*outbox.Outbox, error) {
		db, err := sql.Open("postgres", dsn)
		if err != nil {
			return nil, err
		}
		t.Cleanup(func() { _ = db.Close() })
		t.Cleanup(func() {
			var n int
			if err := db.QueryRow(`SELECT count(*) FROM outbox_crash_audit c JOIN outbox_crash_audit m ON m.xid = c.xid
				WHERE c.what = 'claim' AND m.what = 'inline' AND m.source <> c.source`).Scan(&n); err != nil {
				t.Errorf("read the audit: %v", err)
			}
			rode.Add(int32(n))
		})
		cfg.DB, cfg.Driver = db, postgres.Driver{}
		return outbox.New(cfg)
	}
	handler := func(*sql.DB) message.HandlerFunc {
		return func(msg *message.Message) ([]*message.Message, error) {
			ctx := msg.Context()
			if _, err := outbox.Tx(ctx).ExecContext(ctx, `INSERT INTO reservations VALUES ($1)`, string(msg.Payload)); err != nil {
				return nil, err
			}
			if err := outbox.Publish(ctx, "stock.reserved", message.NewMessage("", msg.Payload)); err != nil {
				return nil, err
			}
			return nil, outbox.Publish(ctx, "audit", message.NewMessage("", msg.Payload))
		}
	}
	outboxtest.CrashMatrix{
		Consumer: "reserve",
		Handler:  handler,
		Messages: []*message.Message{message.NewMessage("order-1", []byte("o-1")), message.NewMessage("order-2", []byte("o-2"))},
		Setup: func(ctx context.Context, db *sql.DB) error {
			_, err := db.ExecContext(ctx, `CREATE TABLE reservations (order_id text NOT NULL)`)
			return err
		},
		Applied: func(ctx context.Context, db *sql.DB, msg *message.Message) (int, error) {
			var n int
			err := db.QueryRowContext(ctx, `SELECT count(*) FROM reservations WHERE order_id = $1`, string(msg.Payload)).Scan(&n)
			return n, err
		},
		Open:       open,
		DeleteSent: true,
	}.Run(t)
	t.Logf("%d marks rode on a claim", rode.Load())
	if rode.Load() == 0 {
		t.Error("no carrier's mark rode on a claim: the matrix did not cover a ride")
	}
}

// A mark whose claim another transaction locks (skipped by the unit that carried it, and handed
// back) is written by a worker of its own, which waits for the lock: the marks that come after it
// are written meanwhile. Written by the one worker, it held every other mark of the Outbox back
// for as long as the lock lasted: here the mark of "free", whose ride ends a second after it
// (no unit comes to take it), waited for the lock on "held".
func TestMarkBehindALockedClaimIsNotHeldBack(t *testing.T) {
	m := newMarkRideEnv(t)
	m.run()
	lock := m.handleAndLock("held")
	if err := m.handle("free", false); err != nil { // carries the mark of "held", skips it
		t.Fatal(err)
	}
	pending := m.pending
	deadline := time.Now().Add(5 * time.Second)
	for pending("free") && time.Now().Before(deadline) {
		time.Sleep(20 * time.Millisecond)
	}
	if pending("free") {
		t.Error("the mark of the claim nobody held waited for the lock on another claim")
	}
	if !pending("held") {
		t.Error("the locked claim was marked through its lock")
	}
	if err := lock.Rollback(); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "the skipped mark written once the lock is gone", func() bool { return !pending("held") })
}

// The marks whose ride failed (handed back for a lock, or their unit rolled back) are written
// skipping the claims another transaction holds locked, and the skipped ones again after a pause:
// written waiting for the lock, a mark held back every mark written with it, here the mark of
// "free" (carried by a unit that rolled back, its claim locked by nobody) behind the locks on
// "held-1" and "held-2". And a mark whose claim stays locked is given up after a while
// (markTimeout, shortened here), as a write that timed out is: with two such claims in one
// statement, past markTimeout it was cancelled and every mark of it dropped, "free"'s too.
func TestFailedRidesAreNotHeldBackByALock(t *testing.T) {
	m := newMarkRideEnv(t)
	// The marker's worker looks at its queue only after 2 s: each mark is there for the next
	// unit to carry, however loaded the machine.
	outbox.LingerMarks(m.ob, 2*time.Second)
	const holdFor = 3 * time.Second
	outbox.HoldLockedMarksFor(m.ob, holdFor)
	m.run()
	// Each carries the mark of the one before, whose claim it finds locked (handed back).
	lock1 := m.handleAndLock("held-1")
	lock2 := m.handleAndLock("held-2")
	if err := m.handle("free", false); err != nil {
		t.Fatal(err)
	}
	freeDone := time.Now()
	if err := m.handle("fails", true); err == nil { // carries the mark of "free", rolls back
		t.Fatal("the handler of fails failed, Handle did not")
	}
	if gap := time.Since(freeDone); gap > 900*time.Millisecond {
		t.Fatalf("the unit after free ended %v after it, past a mark's ride (1 s): the test did not carry free's mark on a unit that rolled back", gap)
	}
	waitUntil := time.Now().Add(holdFor - 500*time.Millisecond)
	for m.pending("free") && time.Now().Before(waitUntil) {
		time.Sleep(20 * time.Millisecond)
	}
	if m.pending("free") {
		t.Error("the mark of the claim nobody held, handed back by a unit that rolled back, waited for the locks on other claims")
	}
	flushed := make(chan struct{})
	go func() { m.ob.FlushMarks(); close(flushed) }()
	select {
	case <-flushed:
	case <-time.After(holdFor + 10*time.Second):
		_, _ = lock1.Rollback(), lock2.Rollback()
		<-flushed
		t.Fatal("FlushMarks waited past the time a mark whose claim is locked is written again")
	}
	if !m.pending("held-1") || !m.pending("held-2") {
		t.Error("a locked claim was marked through its lock")
	}
	if err := lock1.Rollback(); err != nil {
		t.Fatal(err)
	}
	if err := lock2.Rollback(); err != nil {
		t.Fatal(err)
	}
	// Given up: their effects are the relay's to send again, with their UUIDs.
	time.Sleep(200 * time.Millisecond)
	if !m.pending("held-1") || !m.pending("held-2") {
		t.Error("a mark given up was written once the lock was gone")
	}
	var applied int
	if err := m.e.db.QueryRow(`SELECT count(*) FROM applied`).Scan(&applied); err != nil {
		t.Fatal(err)
	}
	mustEqual(t, "messages applied", applied, 3)
}

// A mark skipped for a lock that ends before the mark is given up is written once it ended.
func TestFailedRideWrittenOnceTheLockIsGone(t *testing.T) {
	m := newMarkRideEnv(t)
	outbox.LingerMarks(m.ob, 2*time.Second)
	m.run()
	lock := m.handleAndLock("held")
	if err := m.handle("next", false); err != nil { // carries the mark of "held", skips it
		t.Fatal(err)
	}
	time.Sleep(300 * time.Millisecond)
	if !m.pending("held") {
		t.Error("the locked claim was marked through its lock")
	}
	if err := lock.Rollback(); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "the skipped mark written once the lock is gone", func() bool { return !m.pending("held") })
	m.ob.FlushMarks()
	if u := m.unmarked(); u != 0 {
		t.Errorf("%d claims still hold their effects after FlushMarks", u)
	}
}
