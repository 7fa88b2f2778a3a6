package outbox_test

import (
	"context"
	"database/sql"
	"database/sql/driver"
	"errors"
	"net"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/lib/pq"

	"github.com/watermill-outbox/outbox"
	"github.com/watermill-outbox/outbox/drivers/postgres"
	"github.com/watermill-outbox/outbox/internal/pgtest"
	"github.com/watermill-outbox/outbox/outboxtest"
)

// switchedConnector refuses every connection while down, counting them, as a database that is
// gone does.
type switchedConnector struct {
	driver.Connector
	down  atomic.Bool
	dials atomic.Int64
}

func (c *switchedConnector) Connect(ctx context.Context) (driver.Conn, error) {
	if c.down.Load() {
		c.dials.Add(1)
		return nil, &net.OpError{Op: "dial", Net: "tcp", Err: syscall.ECONNREFUSED}
	}
	return c.Connector.Connect(ctx)
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
	if !p.conn.down.Load() {
		p.conn.down.Store(true)
		time.AfterFunc(p.back, func() { p.conn.down.Store(false) })
	}
	return p.Recorder.Publish(topic, msgs...)
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
			t.Fatalf("relay pass: %v", err)
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
	// upper half) and 2 s apart: three or four. Retried on its own every second it made eight.
	if n := conn.dials.Load(); n > 4 {
		t.Errorf("%d connection attempts in 3 s of outage, want at most 4 (the mark's and the gate's probes)", n)
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
