package outbox_test

import (
	"context"
	"database/sql"
	"database/sql/driver"
	"errors"
	"net"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/lib/pq"

	"github.com/watermill-outbox/outbox"
	"github.com/watermill-outbox/outbox/drivers/postgres"
	"github.com/watermill-outbox/outbox/internal/logtest"
	"github.com/watermill-outbox/outbox/internal/pgtest"
	"github.com/watermill-outbox/outbox/outboxtest"
)

// switchedConnector refuses every connection while down, counting them, as a database that is
// gone does.
type switchedConnector struct {
	driver.Connector
	down  atomic.Bool
	dials atomic.Int64
	// goesAt, when set, takes the database away as a statement it returns true for is about
	// to run: that statement fails as its connection attempt would have.
	goesAt atomic.Pointer[func(query string) bool]
	// commitGoes, when set, takes the database away (for a second) as the next COMMIT of a
	// connection made with goesAt set takes effect, before its answer arrives.
	commitGoes atomic.Bool
	// commitLost, when set, loses the answer of the next COMMIT of a connection made with goesAt
	// set, which takes effect; the database stays.
	commitLost atomic.Bool
	// onDial, when set, is called as a connection is made; its error fails the attempt.
	onDial atomic.Pointer[func(ctx context.Context) error]
}

func (c *switchedConnector) Connect(ctx context.Context) (driver.Conn, error) {
	if f := c.onDial.Load(); f != nil {
		if err := (*f)(ctx); err != nil {
			return nil, err
		}
	}
	if c.down.Load() {
		c.dials.Add(1)
		return nil, &net.OpError{Op: "dial", Net: "tcp", Err: syscall.ECONNREFUSED}
	}
	conn, err := c.Connector.Connect(ctx)
	if err != nil || c.goesAt.Load() == nil {
		return conn, err
	}
	return &goingConn{Conn: conn, c: c}, nil
}

// goingConn is a connection of a switchedConnector with goesAt set.
type goingConn struct {
	driver.Conn
	c *switchedConnector
}

func (g *goingConn) goes(query string) error {
	if f := g.c.goesAt.Load(); f != nil && (*f)(query) {
		g.c.down.Store(true)
		g.c.dials.Add(1)
		return &net.OpError{Op: "dial", Net: "tcp", Err: syscall.ECONNREFUSED}
	}
	return nil
}

func (g *goingConn) QueryContext(ctx context.Context, query string, args []driver.NamedValue) (driver.Rows, error) {
	if err := g.goes(query); err != nil {
		return nil, err
	}
	return g.Conn.(driver.QueryerContext).QueryContext(ctx, query, args)
}

func (g *goingConn) ExecContext(ctx context.Context, query string, args []driver.NamedValue) (driver.Result, error) {
	if err := g.goes(query); err != nil {
		return nil, err
	}
	return g.Conn.(driver.ExecerContext).ExecContext(ctx, query, args)
}

func (g *goingConn) BeginTx(ctx context.Context, opts driver.TxOptions) (driver.Tx, error) {
	tx, err := g.Conn.(driver.ConnBeginTx).BeginTx(ctx, opts)
	if err != nil || !g.c.commitGoes.Load() && !g.c.commitLost.Load() {
		return tx, err
	}
	return &goingTx{Tx: tx, c: g.c}, nil
}

// goingTx is a transaction of a goingConn with commitGoes set: its COMMIT takes effect, and the
// database goes before its answer arrives.
type goingTx struct {
	driver.Tx
	c *switchedConnector
}

func (t *goingTx) Commit() error {
	if err := t.Tx.Commit(); err != nil {
		return err
	}
	if t.c.commitGoes.CompareAndSwap(true, false) {
		t.c.down.Store(true)
		time.AfterFunc(time.Second, func() { t.c.down.Store(false) })
		return driver.ErrBadConn
	}
	if t.c.commitLost.CompareAndSwap(true, false) {
		return driver.ErrBadConn
	}
	return nil
}

// switchedDB opens the test database through a switchedConnector.
func switchedDB(t *testing.T) (*sql.DB, *switchedConnector) {
	t.Helper()
	pc, err := pq.NewConnector(pgtest.DSN(t))
	if err != nil {
		t.Fatal(err)
	}
	conn := &switchedConnector{Connector: pc}
	db := sql.OpenDB(conn)
	t.Cleanup(func() { _ = db.Close() })
	return db, conn
}

// TestBackgroundPassStopsAtAnUnreachableDatabase: a relay pass or a cleanup pass under way when
// the database goes makes one connection attempt, fails with an error that says the database is
// unreachable (which the gate reports and waits out), and goes no further. Each went on through
// every statement it had left, each one more attempt: the relay's look, its sweep and its claim,
// the cleanup's record of the retention and its batches; with ten Outboxes on one pool, the
// passes under way when the outage began dialed 25 to 66 times in 3 s after the gate had shut,
// beside its probes.
func TestBackgroundPassStopsAtAnUnreachableDatabase(t *testing.T) {
	db, conn := switchedDB(t)
	ob, err := outbox.New(outbox.Config{DB: db, Driver: postgres.Driver{}, Publisher: &outboxtest.Recorder{}, TablePrefix: "passdial_",
		RelayGrace: time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = ob.Close() })
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := ob.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	// A pass with the database up first: the relay's look at delayed effects is behind it, and
	// its pass goes to the store's look, sweep and claim.
	if err := outbox.RelayPass(ctx, ob); err != nil {
		t.Fatal(err)
	}
	time.Sleep(150 * time.Millisecond) // the sweep is due again
	db.SetMaxIdleConns(0)              // every statement opens a connection
	for _, pass := range []struct {
		name string
		run  func(context.Context, *outbox.Outbox) error
	}{{"relay", outbox.RelayPass}, {"cleanup", outbox.CleanupPass}} {
		conn.down.Store(true)
		before := conn.dials.Load()
		err := pass.run(ctx, ob)
		dials := conn.dials.Load() - before
		conn.down.Store(false)
		var op *net.OpError
		if !errors.As(err, &op) {
			t.Errorf("%s pass with the database gone: %v, want the refused connection", pass.name, err)
		}
		if dials != 1 {
			t.Errorf("%s pass with the database gone: %d connection attempts, want 1", pass.name, dials)
		}
		// The database back, the gate opens at its next probe or the next success.
		if err := db.PingContext(ctx); err != nil {
			t.Fatal(err)
		}
	}
}

// downOnPublish takes the database away as the broker takes the effect: the round's marks meet
// the outage.
type downOnPublish struct {
	outboxtest.Recorder
	conn  *switchedConnector
	back  time.Duration
	armed atomic.Bool // until armed, calls are refused: the effect waits for the relay
}

func (p *downOnPublish) Publish(topic string, msgs ...*message.Message) error {
	if !p.armed.Load() {
		return errors.New("broker refused")
	}
	// Recorded first: a statement that meets the outage finds the message sent.
	if err := p.Recorder.Publish(topic, msgs...); err != nil {
		return err
	}
	if !p.conn.down.Load() {
		p.conn.down.Store(true)
		time.AfterFunc(p.back, func() { p.conn.down.Store(false) })
	}
	return nil
}

// TestRelayMarksWaitForTheGate: the database goes while a relay round is at the broker. Its
// marks wait for the gate's probes and land once the database is back, instead of trying to
// connect again every second up to the marks' bound of 30 s (with ten Outboxes on a pool, some
// 700 connection attempts in an outage's first minute, none counted or held back by the gate).
func TestRelayMarksWaitForTheGate(t *testing.T) {
	db, conn := switchedDB(t)
	pub := &downOnPublish{conn: conn, back: 3 * time.Second}
	ob, err := outbox.New(outbox.Config{DB: db, Driver: postgres.Driver{}, Publisher: pub, TablePrefix: "markgate_",
		RelayGrace: time.Millisecond, ReconnectDelay: time.Second, ReconnectDelayMax: 4 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = ob.Close() })
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	if err := ob.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	if err := ob.InTx(ctx, func(ctx context.Context, _ *sql.Tx) error {
		return outbox.Publish(ctx, "out", message.NewMessage("e1", []byte(`{}`)))
	}); err != nil {
		t.Fatal(err)
	}
	// A pass with the database up: the relay's first look at delayed effects is behind it.
	if err := outbox.RelayPass(ctx, ob); err != nil {
		t.Fatalf("relay pass: %v", err)
	}
	db.SetMaxIdleConns(0) // every statement opens a connection
	// Passes until the relay sends the effect (its failed dispatch backs off): the database goes
	// then, and the pass ends once the round's marks land.
	pub.armed.Store(true)
	for deadline := time.Now().Add(20 * time.Second); len(pub.Messages("out")) == 0; time.Sleep(100 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("the relay did not send the effect within 20 s")
		}
		if err := outbox.RelayPass(ctx, ob); err != nil {
			// A claim the pass made while the round was at the broker may meet the outage
			// (under load): the pass ends with its error, the round's marks landed on the way out.
			var op *net.OpError
			if !errors.As(err, &op) || len(pub.Messages("out")) == 0 {
				t.Fatalf("relay pass: %v", err)
			}
		}
	}
	// Marked: the next pass has nothing to send.
	if err := outbox.RelayPass(ctx, ob); err != nil {
		t.Fatalf("relay pass after: %v", err)
	}
	if n := len(pub.Messages("out")); n != 1 {
		t.Errorf("effect sent %d times, want once (marked after the outage)", n)
	}
	// 3 s of outage: the mark's first attempt and the gate's probes, 1 s (jittered over its
	// upper half) and 2 s apart: three or four, and the claim that may overlap the round. Retried
	// on its own every second it made eight.
	if n := conn.dials.Load(); n > 5 {
		t.Errorf("%d connection attempts in 3 s of outage, want at most 5 (the mark's, the gate's probes, an overlapping claim's)", n)
	}
	t.Logf("%d connection attempts", conn.dials.Load())
}

// TestRecoveredDestinationsWaitOutAnOutage: a relay turn that is to make the effects of
// destinations that came back due, when the database has gone meanwhile, makes one connection
// attempt and keeps those destinations for its next turn. It made one attempt per destination
// (and logged each), then its claim one more, and forgot them: their backed-off effects waited
// for their own retry time, up to five minutes after both outages had ended.
func TestRecoveredDestinationsWaitOutAnOutage(t *testing.T) {
	db, conn := switchedDB(t)
	ob, err := outbox.New(outbox.Config{DB: db, Driver: postgres.Driver{}, Publisher: &outboxtest.Recorder{}, TablePrefix: "recovdial_",
		RelayGrace: time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = ob.Close() })
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := ob.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	if err := outbox.RelayPass(ctx, ob); err != nil {
		t.Fatal(err)
	}
	topics := []string{"a", "b", "c", "d", "e"}
	outbox.MakeDestinationsDue(ob, topics...)
	db.SetMaxIdleConns(0) // every statement opens a connection
	conn.down.Store(true)
	err = outbox.RelayPass(ctx, ob)
	dials := conn.dials.Load()
	conn.down.Store(false)
	var op *net.OpError
	if !errors.As(err, &op) {
		t.Errorf("relay pass with the database gone: %v, want the refused connection", err)
	}
	if dials != 1 {
		t.Errorf("relay pass with the database gone: %d connection attempts, want 1", dials)
	}
	// The pass's caller (the engine) tells the gate of the error the pass returns: a pass that
	// told it as well counted its one attempt twice (outbox.db.unreachable_attempts, the
	// attempts an outage reports).
	if n := outbox.GateAttempts(ob); n != 0 {
		t.Errorf("the relay pass told the gate of %d attempts itself, and returned the error to its caller, which tells it again", n)
	}
	if n := outbox.DestinationsDue(ob); n != len(topics) {
		t.Errorf("%d destinations kept for the turn after the outage, want %d", n, len(topics))
	}
	// Back: the next turn makes them due, and forgets them.
	if err := outbox.RelayPass(ctx, ob); err != nil {
		t.Fatal(err)
	}
	if n := outbox.DestinationsDue(ob); n != 0 {
		t.Errorf("%d destinations still kept after a turn with the database back, want 0", n)
	}
}

// failOnPublish takes the database away as the broker refuses the effect: the failed dispatch
// is recorded during the outage.
type failOnPublish struct{ conn *switchedConnector }

func (p *failOnPublish) Publish(string, ...*message.Message) error {
	p.conn.down.Store(true)
	return errors.New("broker refused")
}

func (p *failOnPublish) Close() error { return nil }

// TestFailedDispatchAtAnOutageIsTheGates: a dispatch that fails as the database goes makes one
// connection attempt after it (the record of its failure), which the gate hears of and
// reports; the notice to the other relays waits for the database, and the outage is not logged
// beside the gate's report. The notice was tried as well, and each failure logged.
func TestFailedDispatchAtAnOutageIsTheGates(t *testing.T) {
	db, conn := switchedDB(t)
	logs := &logtest.Errors{}
	ob, err := outbox.New(outbox.Config{DB: db, Driver: postgres.Driver{}, Publisher: &failOnPublish{conn: conn}, TablePrefix: "faildial_",
		Logger: logs, RelayMaxAttempts: 1})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = ob.Close() })
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := ob.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	db.SetMaxIdleConns(0) // every statement opens a connection
	if err := ob.InTx(ctx, func(ctx context.Context, _ *sql.Tx) error {
		return outbox.Publish(ctx, "out", message.NewMessage("e1", []byte(`{}`)))
	}); err != nil {
		t.Fatal(err)
	}
	dials := conn.dials.Load()
	conn.down.Store(false)
	if dials != 1 {
		t.Errorf("a failed dispatch as the database went: %d connection attempts after it, want 1", dials)
	}
	for _, line := range logs.Lines() {
		if strings.Contains(line, "Recording a failed dispatch failed") || strings.Contains(line, "Notifying the relays failed") ||
			strings.Contains(line, "Side effect parked") {
			t.Errorf("the outage logged beside the gate's report: %s", line)
		}
	}
}

// TestHandlerFailureAtAnOutageWaitsForTheGate: a unit of work that fails as the database goes
// (most likely for that reason) is not counted as a failed attempt and runs again as soon as a
// probe of the gate answers. Its count failed on the outage as well, unheard by the gate, and
// Handle waited RetryDelay (30 s here) before the next try.
func TestHandlerFailureAtAnOutageWaitsForTheGate(t *testing.T) {
	db, conn := switchedDB(t)
	ob, err := outbox.New(outbox.Config{DB: db, Driver: postgres.Driver{}, Publisher: &outboxtest.Recorder{}, TablePrefix: "attemptdial_",
		RetryDelay: 30 * time.Second, HandlerRetries: 1})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = ob.Close() })
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := ob.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	db.SetMaxIdleConns(0) // every statement opens a connection
	var runs atomic.Int32
	msg := message.NewMessage("m1", nil)
	mctx, mcancel := context.WithTimeout(ctx, 10*time.Second)
	defer mcancel()
	msg.SetContext(mctx)
	began := time.Now()
	err = ob.Handle(msg, outbox.HandleParams{Consumer: "c1", MessageID: msg.UUID}, func(*message.Message) ([]*message.Message, error) {
		if runs.Add(1) == 1 {
			conn.down.Store(true)
			time.AfterFunc(time.Second, func() { conn.down.Store(false) })
			return nil, errors.New("the database went")
		}
		return nil, nil
	})
	if err != nil || runs.Load() != 2 {
		t.Fatalf("handled in %d runs and %s: %v; want 2 runs, the second once the database answers", runs.Load(), time.Since(began).Round(time.Millisecond), err)
	}
	var attempts int
	if err := db.QueryRowContext(ctx, `SELECT count(*) FROM attemptdial_attempts`).Scan(&attempts); err != nil {
		t.Fatal(err)
	}
	if attempts != 0 {
		t.Errorf("%d failed attempts counted, want none: the outage failed the unit", attempts)
	}
}

// TestOrderingCheckAtAnOutageIsTheGates: the look for earlier effects of an ordering key, made
// after the commit, that meets the database gone makes that one connection attempt: the effects
// are committed, and the relay's claims after the outage find them. The effects were handed to
// the relay as well (a statement), the relays notified (another), and both failures logged.
func TestOrderingCheckAtAnOutageIsTheGates(t *testing.T) {
	db, conn := switchedDB(t)
	logs := &logtest.Errors{}
	ob, err := outbox.New(outbox.Config{DB: db, Driver: postgres.Driver{}, Publisher: &outboxtest.Recorder{}, TablePrefix: "keydial_",
		Logger: logs,
		Failpoint: func(_ context.Context, point string) error {
			if point == outbox.FailpointAfterCommit {
				conn.down.Store(true)
			}
			return nil
		}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = ob.Close() })
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := ob.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	db.SetMaxIdleConns(0) // every statement opens a connection
	if err := ob.InTx(ctx, func(ctx context.Context, _ *sql.Tx) error {
		return outbox.Publish(outbox.WithOrderingKey(ctx, "customer-7"), "out", message.NewMessage("e1", []byte(`{}`)))
	}); err != nil {
		t.Fatal(err)
	}
	dials := conn.dials.Load()
	conn.down.Store(false)
	if dials != 1 {
		t.Errorf("the ordering check as the database went: %d connection attempts after the commit, want 1", dials)
	}
	for _, line := range logs.Lines() {
		if strings.Contains(line, "ordering keys failed") || strings.Contains(line, "Handing effects to the relay failed") {
			t.Errorf("the outage logged beside the gate's report: %s", line)
		}
	}
}

// TestConsumerOrderingCheckAtAnOutageWaitsForTheGate: on the consumer path, the look for earlier
// effects of an ordering key after the commit that meets the database gone has Handle wait for
// the gate's probes and then send the committed effects (the duplicate path), rather than wait
// RetryDelay (30 s here) with the gate unaware.
func TestConsumerOrderingCheckAtAnOutageWaitsForTheGate(t *testing.T) {
	db, conn := switchedDB(t)
	pub := &outboxtest.Recorder{}
	ob, err := outbox.New(outbox.Config{DB: db, Driver: postgres.Driver{}, Publisher: pub, TablePrefix: "ckeydial_",
		RetryDelay: 30 * time.Second, HandlerRetries: 1, DuplicateWait: 10 * time.Second,
		Failpoint: func(_ context.Context, point string) error {
			if point == outbox.FailpointAfterCommit && !conn.down.Load() {
				conn.down.Store(true)
				time.AfterFunc(time.Second, func() { conn.down.Store(false) })
			}
			return nil
		}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = ob.Close() })
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := ob.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	db.SetMaxIdleConns(0) // every statement opens a connection
	msg := message.NewMessage("m1", nil)
	mctx, mcancel := context.WithTimeout(ctx, 20*time.Second)
	defer mcancel()
	msg.SetContext(mctx)
	began := time.Now()
	err = ob.Handle(msg, outbox.HandleParams{Consumer: "c1", MessageID: msg.UUID}, func(m *message.Message) ([]*message.Message, error) {
		return nil, outbox.Publish(outbox.WithOrderingKey(m.Context(), "customer-7"), "out", message.NewMessage("e1", []byte(`{}`)))
	})
	if err != nil {
		t.Fatalf("handled in %s: %v; want it done once the database answers", time.Since(began).Round(time.Millisecond), err)
	}
	if n := len(pub.Messages("out")); n != 1 {
		t.Errorf("effect sent %d times, want once", n)
	}
	// The run after the outage sends at once: this process's dispatch is known to have ended,
	// and the duplicate path does not wait DuplicateWait (10 s) for it.
	if took := time.Since(began); took > 6*time.Second {
		t.Errorf("handled in %s, want about the 1 s outage", took.Round(time.Millisecond))
	}
}

// TestClaimedEffectsGoOutWhenTheDatabaseGoesAfterTheClaim: a relay claim that leased effects
// and found delayed effects due, whose move then meets the database gone, sends the leased
// effects (their marks wait for the gate) before the pass ends. The pass returned at once, and
// the effects stayed leased, unsent, until their lease ended (a minute by default).
func TestClaimedEffectsGoOutWhenTheDatabaseGoesAfterTheClaim(t *testing.T) {
	db, conn := switchedDB(t)
	pub := &outboxtest.Recorder{}
	var crashCommit atomic.Bool
	ob, err := outbox.New(outbox.Config{DB: db, Driver: postgres.Driver{}, Publisher: pub, TablePrefix: "leasedial_",
		RelayGrace: time.Millisecond, ReconnectDelay: 200 * time.Millisecond,
		Failpoint: func(_ context.Context, point string) error {
			if point == outbox.FailpointAfterCommit && crashCommit.Load() {
				return errors.New("crash after the commit") // the effect is left to the relay
			}
			return nil
		}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = ob.Close() })
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	if err := ob.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	// A pass with the database up: the relay reads the delayed effects' due time with its claim.
	if err := outbox.RelayPass(ctx, ob); err != nil {
		t.Fatal(err)
	}
	if err := ob.InTx(ctx, func(ctx context.Context, _ *sql.Tx) error {
		return outbox.Publish(outbox.WithDelay(ctx, 50*time.Millisecond), "later", message.NewMessage("d1", []byte(`{}`)))
	}); err != nil {
		t.Fatal(err)
	}
	crashCommit.Store(true)
	if err := ob.InTx(ctx, func(ctx context.Context, _ *sql.Tx) error {
		return outbox.Publish(ctx, "now", message.NewMessage("e1", []byte(`{}`)))
	}); err == nil {
		t.Fatal("InTx passed its failpoint")
	}
	crashCommit.Store(false)
	time.Sleep(100 * time.Millisecond) // the delayed effect is due, the other past RelayGrace
	db.SetMaxIdleConns(0)              // every statement opens a connection
	// The database goes as the claim's move of the due delayed effect begins, back a second later.
	var once atomic.Bool
	goes := func(query string) bool {
		if strings.Contains(query, "moved AS (DELETE FROM") && strings.Contains(query, "leasedial_delayed") && once.CompareAndSwap(false, true) {
			time.AfterFunc(time.Second, func() { conn.down.Store(false) })
			return true
		}
		return false
	}
	conn.goesAt.Store(&goes)
	err = outbox.RelayPass(ctx, ob)
	var op *net.OpError
	if !errors.As(err, &op) {
		t.Errorf("relay pass with the database gone after its claim: %v, want the refused connection", err)
	}
	if n := len(pub.Messages("now")); n != 1 {
		t.Errorf("the claimed effect sent %d times by the pass, want once", n)
	}
	// The database back, the delayed effect goes out too, and nothing twice.
	for deadline := time.Now().Add(20 * time.Second); len(pub.Messages("later")) == 0; time.Sleep(100 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("the delayed effect was not sent within 20 s of the outage")
		}
		_ = outbox.RelayPass(ctx, ob)
	}
	if err := outbox.RelayPass(ctx, ob); err != nil {
		t.Fatal(err)
	}
	if a, b := len(pub.Messages("now")), len(pub.Messages("later")); a != 1 || b != 1 {
		t.Errorf("sent %d and %d times, want once each", a, b)
	}
}

// TestRejectionsWaitForTheGate: a message the consumer rejects (no usable ID) while the
// database is gone waits for the gate's probes, as a unit of work does, and is nacked with
// ErrDatabaseUnreachable once its delivery ends; once a probe answers, it is dead-lettered. Each
// rejection made a connection attempt of its own (the look for an earlier dead letter), so a
// broker redelivering it at once dialed in a loop, unseen by the gate.
func TestRejectionsWaitForTheGate(t *testing.T) {
	db, conn := switchedDB(t)
	ob, err := outbox.New(outbox.Config{DB: db, Driver: postgres.Driver{}, Publisher: &outboxtest.Recorder{}, TablePrefix: "rejectdial_"})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = ob.Close() })
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	if err := ob.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	db.SetMaxIdleConns(0) // every statement opens a connection
	conn.down.Store(true)
	if err := ob.InTx(ctx, func(context.Context, *sql.Tx) error { return nil }); err == nil {
		t.Fatal("InTx succeeded with the database gone")
	}
	before := conn.dials.Load()
	const deliveries = 20
	for i := range deliveries {
		msg := message.NewMessage("m1", []byte("no usable ID"))
		mctx, mcancel := context.WithTimeout(ctx, 100*time.Millisecond)
		msg.SetContext(mctx)
		err := ob.Handle(msg, outbox.HandleParams{Consumer: "c1", MessageID: ""}, func(*message.Message) ([]*message.Message, error) {
			t.Error("the handler ran for a message without an ID")
			return nil, nil
		})
		mcancel()
		if !errors.Is(err, outbox.ErrDatabaseUnreachable) {
			t.Fatalf("delivery %d during the outage: %v; want ErrDatabaseUnreachable", i+1, err)
		}
	}
	// The gate's probes, 100 ms apart and doubling, made about five attempts in the 2 s.
	if dials := conn.dials.Load() - before; dials >= deliveries {
		t.Errorf("%d deliveries rejected during the outage made %d connection attempts; want the gate's probes only", deliveries, dials)
	}
	conn.down.Store(false)
	msg := message.NewMessage("m1", []byte("no usable ID"))
	msg.SetContext(ctx)
	if err := ob.Handle(msg, outbox.HandleParams{Consumer: "c1", MessageID: ""}, nil); err != nil {
		t.Fatalf("the delivery once the database answers: %v; want it dead-lettered and acked", err)
	}
	dead, err := ob.DeadLetters(ctx, outbox.DeadLetterFilter{})
	if err != nil {
		t.Fatal(err)
	}
	if len(dead) != 1 {
		t.Fatalf("%d dead letters, want 1", len(dead))
	}
}

// TestCallersDeadlineIsNoOutage: the caller's context (the one JoinTx's done is given) ends while
// done dials. done goes on past it, as InTx's dispatch does: its connections are not cut short
// (one cut short by the caller was taken for an outage once), the effect is sent, and the gate
// is told nothing.
func TestCallersDeadlineIsNoOutage(t *testing.T) {
	db, conn := switchedDB(t)
	rec := &outboxtest.Recorder{}
	ob, err := outbox.New(outbox.Config{DB: db, Driver: postgres.Driver{}, Publisher: rec, TablePrefix: "cutdial_"})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = ob.Close() })
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := ob.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	db.SetMaxIdleConns(0) // every statement opens a connection
	tx, err := db.BeginTx(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	jctx, done := ob.JoinTx(ctx, tx)
	if err := outbox.Publish(outbox.WithOrderingKey(jctx, "customer-7"), "out", message.NewMessage("e1", []byte(`{}`))); err != nil {
		t.Fatal(err)
	}
	if err := tx.Commit(); err != nil {
		t.Fatal(err)
	}
	cctx, ccancel := context.WithCancel(ctx)
	defer ccancel()
	var dials atomic.Int32
	cut := func(context.Context) error {
		if dials.Add(1) == 1 {
			ccancel() // the caller gives up as done reads the committed effects back
		}
		return nil
	}
	conn.onDial.Store(&cut)
	done(cctx)
	conn.onDial.Store(nil)
	if dials.Load() < 2 {
		t.Fatalf("%d connections made by done, want the read and the look for earlier effects of the key", dials.Load())
	}
	if n := outbox.GateAttempts(ob); n != 0 {
		t.Errorf("the gate was told of %d failed attempts", n)
	}
	if n := len(rec.Messages("out")); n != 1 {
		t.Errorf("%d messages sent, want the one committed", n)
	}
}

// TestGateDoesNotFlapOnAPoolThatKeepsAConnection: the database refuses new connections (too many
// connections, a listener gone) while a connection kept idle in the pool still works. A probe
// that takes that connection answers and ends the outage; the waiting units dial, are refused, and
// the next outage begins. That is one outage, whose probes go on backing off: each new one was
// reported anew (a log line each way, the alert's unreachable-for reset) and probed again 100 ms
// on, so the units dialed in a tight cycle for as long as it lasted.
func TestGateDoesNotFlapOnAPoolThatKeepsAConnection(t *testing.T) {
	db, conn := switchedDB(t)
	logs := &logtest.Errors{}
	ob, err := outbox.New(outbox.Config{DB: db, Driver: postgres.Driver{}, Publisher: &outboxtest.Recorder{}, TablePrefix: "flapdial_",
		Logger: logs})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = ob.Close() })
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	if err := ob.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	db.SetMaxIdleConns(1)
	conn.down.Store(true) // new connections refused; the idle one works
	var wg sync.WaitGroup
	stop := time.Now().Add(3 * time.Second)
	for range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for time.Now().Before(stop) {
				uctx, ucancel := context.WithTimeout(ctx, 500*time.Millisecond)
				_ = ob.InTx(uctx, func(ctx context.Context, tx *sql.Tx) error {
					_, err := tx.ExecContext(ctx, `SELECT pg_sleep(0.01)`)
					return err
				})
				ucancel()
			}
		}()
	}
	wg.Wait()
	conn.down.Store(false)
	outages := 0
	for _, line := range logs.Lines() {
		if strings.Contains(line, "The database is unreachable") {
			outages++
		}
	}
	t.Logf("%d outages reported, %d connection attempts", outages, conn.dials.Load())
	// One outage, its probes 100 ms apart and doubling, each jittered over its upper half: it
	// may end and begin again when each answers, about five to eight times in 3 s (67 on the old
	// code, with 262 connection attempts; 33 now).
	if outages > 10 {
		t.Errorf("%d outages reported in 3 s of one database refusing new connections, want its probes' backoff to space them", outages)
	}
}

// armedFailOnPublish refuses every message, and takes the database away as it does once armed
// with a connector.
type armedFailOnPublish struct {
	conn atomic.Pointer[switchedConnector]
}

func (p *armedFailOnPublish) Publish(string, ...*message.Message) error {
	if c := p.conn.Load(); c != nil {
		c.down.Store(true)
	}
	return errors.New("broker refused")
}

func (p *armedFailOnPublish) Close() error { return nil }

// TestRelayFailureRecordAtAnOutageIsTheGates: the broker refuses a relay round's effect for the
// last time allowed as the database goes, so its failure (a parking) cannot be recorded. The gate
// reports the outage; nothing is logged as parked, since nothing was: the effect is retried once
// its lease ends. Both were logged: the failed record, and the effect "parked".
func TestRelayFailureRecordAtAnOutageIsTheGates(t *testing.T) {
	db, conn := switchedDB(t)
	logs := &logtest.Errors{}
	pub := &armedFailOnPublish{}
	ob, err := outbox.New(outbox.Config{DB: db, Driver: postgres.Driver{}, Publisher: pub, TablePrefix: "relayfaildial_",
		Logger: logs, RelayGrace: time.Millisecond, RelayMaxAttempts: 1})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = ob.Close() })
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := ob.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	// Committed with the broker refusing and the database up: left to the relay, due at once.
	if err := ob.InTx(ctx, func(ctx context.Context, _ *sql.Tx) error {
		return outbox.Publish(outbox.WithDelay(ctx, time.Millisecond), "out", message.NewMessage("e1", []byte(`{}`)))
	}); err != nil {
		t.Fatal(err)
	}
	db.SetMaxIdleConns(0) // every statement opens a connection
	pub.conn.Store(conn)  // from now on the database goes as the broker refuses
	for deadline := time.Now().Add(10 * time.Second); !conn.down.Load(); time.Sleep(20 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("the relay did not try the effect within 10 s")
		}
		_ = outbox.RelayPass(ctx, ob)
	}
	conn.down.Store(false)
	for _, line := range logs.Lines() {
		if strings.Contains(line, "could not record failed dispatches") || strings.Contains(line, "Side effect parked") {
			t.Errorf("logged at the outage: %s", line)
		}
	}
}

// TestCommitLostAtAnOutageWaitsForTheGate: a COMMIT whose answer is lost as the database goes
// (it took effect) leaves its outcome to be asked of the database, which is gone too: the unit
// runs again once a probe answers, finds its claim, and sends its effect. It waited RetryDelay
// (30 s here) for the next try, and the look for its outcome was no outage to the gate.
func TestCommitLostAtAnOutageWaitsForTheGate(t *testing.T) {
	db, conn := switchedDB(t)
	never := func(string) bool { return false }
	conn.goesAt.Store(&never) // connections that can lose a COMMIT's answer
	pub := &outboxtest.Recorder{}
	ob, err := outbox.New(outbox.Config{DB: db, Driver: postgres.Driver{}, Publisher: pub, TablePrefix: "commitdial_",
		RetryDelay: 30 * time.Second, HandlerRetries: 1})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = ob.Close() })
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	if err := ob.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	db.SetMaxIdleConns(0) // every statement opens a connection
	msg := message.NewMessage("m1", nil)
	mctx, mcancel := context.WithTimeout(ctx, 20*time.Second)
	defer mcancel()
	msg.SetContext(mctx)
	conn.commitGoes.Store(true)
	began := time.Now()
	var runs atomic.Int32
	err = ob.Handle(msg, outbox.HandleParams{Consumer: "c1", MessageID: msg.UUID}, func(m *message.Message) ([]*message.Message, error) {
		runs.Add(1)
		return nil, outbox.Publish(m.Context(), "out", message.NewMessage("e1", []byte(`{}`)))
	})
	took := time.Since(began)
	if err != nil {
		t.Fatalf("handled in %s: %v; want it done once the database answers", took.Round(time.Millisecond), err)
	}
	if conn.commitGoes.Load() {
		t.Fatal("no COMMIT lost its answer")
	}
	if n := len(pub.Messages("out")); n != 1 || runs.Load() != 1 {
		t.Errorf("handler ran %d times, effect sent %d times; want once each", runs.Load(), n)
	}
	if took > 6*time.Second {
		t.Errorf("handled in %s, want about the 1 s outage", took.Round(time.Millisecond))
	}
}

// A COMMIT whose answer is lost while the database stays (it took effect): the look for its
// outcome finds the claim, and the unit sends its own effects at once. It waited up to
// DuplicateWait first, as for a copy of the message another process might be sending: this
// process is the one that sends them.
func TestLostCommitSendsItsEffectsAtOnce(t *testing.T) {
	db, conn := switchedDB(t)
	never := func(string) bool { return false }
	conn.goesAt.Store(&never) // connections that can lose a COMMIT's answer
	pub := &outboxtest.Recorder{}
	ob, err := outbox.New(outbox.Config{DB: db, Driver: postgres.Driver{}, Publisher: pub, TablePrefix: "lostcommit_",
		DuplicateWait: 10 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = ob.Close() })
	ctx := context.Background()
	if err := ob.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	db.SetMaxIdleConns(0) // connections made from now on can lose the answer
	conn.commitLost.Store(true)
	msg := message.NewMessage("m1", nil)
	began := time.Now()
	err = ob.Handle(msg, outbox.HandleParams{Consumer: "c1", MessageID: msg.UUID}, func(m *message.Message) ([]*message.Message, error) {
		return nil, outbox.Publish(m.Context(), "out", message.NewMessage("e1", []byte(`{}`)))
	})
	took := time.Since(began)
	if err != nil {
		t.Fatalf("Handle: %v", err)
	}
	if conn.commitLost.Load() {
		t.Fatal("no COMMIT lost its answer")
	}
	if n := len(pub.Messages("out")); n != 1 {
		t.Errorf("effect sent %d times, want once", n)
	}
	if took > 3*time.Second {
		t.Errorf("handled in %s: it waited for a copy's dispatch (DuplicateWait 10 s) before sending its own effects", took.Round(time.Millisecond))
	}
}
