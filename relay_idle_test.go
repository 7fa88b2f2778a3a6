package outbox_test

import (
	"bytes"
	"context"
	"database/sql"
	"encoding/binary"
	"net"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/lib/pq"

	"github.com/watermill-outbox/outbox"
	"github.com/watermill-outbox/outbox/drivers/postgres"
)

// TestIdleRelayPassIsOneStatement: with nothing due and a delayed effect waiting, each relay
// pass sends one statement, its claim, which reads the delayed effect's due time too: no move of
// delayed effects, no look-up of the next due time (three statements a pass before). The other
// statements of a pass (the sweep's, every quarter of RelayGrace) do not run here.
func TestIdleRelayPassIsOneStatement(t *testing.T) {
	e := newEnv(t)
	if err := e.ob.InTx(context.Background(), func(ctx context.Context, _ *sql.Tx) error {
		return outbox.Publish(outbox.WithDelay(ctx, time.Hour), "out_a", message.NewMessage(uuid.NewString(), nil))
	}); err != nil {
		t.Fatal(err)
	}
	db, wire := countedDB(t, e.dsn)
	ob, err := outbox.New(outbox.Config{DB: db, Driver: postgres.Driver{}, Publisher: e.pub, Logger: watermill.NopLogger{},
		RelayInterval: 20 * time.Millisecond, RelayGrace: time.Hour, CleanupInterval: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- ob.Run(ctx) }()
	// The first pass sweeps and moves delayed effects before it claims: the window starts once
	// it has ended and a later pass has claimed, however slow the machine.
	waitFor(t, "three claims", func() bool { return wire.snapshot().claims >= 3 })
	before := wire.snapshot()
	time.Sleep(time.Second)
	during := wire.snapshot().minus(before)
	cancel()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if during.claims < 5 {
		t.Fatalf("%d claims in a second with RelayInterval 20 ms: the relay did not poll", during.claims)
	}
	// Only the delayed effects' statements are counted against the passes: besides them an
	// instance samples the tables' statistics, as often as its load lets it.
	if during.moves != 0 || during.nextDue != 0 {
		t.Fatalf("%d idle passes sent %d moves of delayed effects and %d look-ups of their next due time (%d statements in all); want the claim alone",
			during.claims, during.moves, during.nextDue, during.statements)
	}
}

// countedDB opens a database/sql pool on dsn (lib/pq) whose connections count the statements
// they send, closed when the test ends.
func countedDB(t *testing.T, dsn string) (*sql.DB, *statementCounter) {
	t.Helper()
	wire := &statementCounter{}
	connector, err := pq.NewConnector(dsn)
	if err != nil {
		t.Fatal(err)
	}
	connector.Dialer(wire)
	db := sql.OpenDB(connector)
	t.Cleanup(func() { _ = db.Close() })
	return db, wire
}

// statementCounter is a lib/pq Dialer whose connections count the statements the client sends
// (Query and Execute messages of the protocol), and by their text the claims, the moves of
// delayed effects and the look-ups of their next due time among them.
type statementCounter struct {
	mu     sync.Mutex
	counts wireCounts
}

type wireCounts struct{ statements, claims, moves, nextDue, marks, markParses int }

func (c wireCounts) minus(o wireCounts) wireCounts {
	return wireCounts{c.statements - o.statements, c.claims - o.claims, c.moves - o.moves, c.nextDue - o.nextDue,
		c.marks - o.marks, c.markParses - o.markParses}
}

func (s *statementCounter) snapshot() wireCounts {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.counts
}

func (s *statementCounter) Dial(network, address string) (net.Conn, error) {
	return s.DialTimeout(network, address, 0)
}

func (s *statementCounter) DialTimeout(network, address string, timeout time.Duration) (net.Conn, error) {
	conn, err := net.DialTimeout(network, address, timeout)
	if err != nil {
		return nil, err
	}
	return &countingConn{Conn: conn, s: s}, nil
}

// countingConn reads the frontend messages it writes: the startup message (a length, no type),
// then a type byte and a length each.
type countingConn struct {
	net.Conn
	s       *statementCounter
	buf     []byte
	started bool
	kinds   map[string]string // statement name -> kind of its text
	bound   string            // kind of the statement last bound
}

func (c *countingConn) Write(b []byte) (int, error) {
	c.buf = append(c.buf, b...)
	for {
		head := 5
		if !c.started {
			head = 4
		}
		if len(c.buf) < head {
			break
		}
		var typ byte
		var n int
		if c.started {
			typ, n = c.buf[0], 1+int(binary.BigEndian.Uint32(c.buf[1:5]))
		} else {
			n = int(binary.BigEndian.Uint32(c.buf[:4]))
		}
		if len(c.buf) < n {
			break
		}
		msg := c.buf[:n]
		if !c.started {
			// An SSL request (8 bytes, code 80877103) comes before the startup message.
			c.started = !(n == 8 && binary.BigEndian.Uint32(msg[4:8]) == 80877103)
		} else {
			c.count(typ, msg[5:])
		}
		c.buf = c.buf[n:]
	}
	return c.Conn.Write(b)
}

// count counts a statement at its execution (Query, or Execute of the statement last bound),
// by the kind of its text: with arguments, lib/pq sends Parse in one round trip and Bind and
// Execute in the next, which may fall on either side of a snapshot.
func (c *countingConn) count(typ byte, body []byte) {
	c.s.mu.Lock()
	defer c.s.mu.Unlock()
	switch typ {
	case 'Q': // Query: its text
		c.s.counts.statements++
		c.s.counts.add(kindOf(body))
	case 'P': // Parse: the statement's name, then its text
		if i := bytes.IndexByte(body, 0); i >= 0 {
			if c.kinds == nil {
				c.kinds = map[string]string{}
			}
			kind := kindOf(body[i+1:])
			c.kinds[string(body[:i])] = kind
			if kind == "mark" {
				c.s.counts.markParses++
			}
		}
	case 'B': // Bind: the portal's name, then the statement's
		if i := bytes.IndexByte(body, 0); i >= 0 {
			if j := bytes.IndexByte(body[i+1:], 0); j >= 0 {
				c.bound = c.kinds[string(body[i+1:i+1+j])]
			}
		}
	case 'E': // Execute: the statement last bound
		c.s.counts.statements++
		c.s.counts.add(c.bound)
	}
}

func kindOf(text []byte) string {
	switch {
	case bytes.HasPrefix(text, []byte("WITH bounds AS MATERIALIZED")):
		return "claim"
	case bytes.HasPrefix(text, []byte("WITH due AS")):
		return "move"
	case bytes.HasPrefix(text, []byte("SELECT (extract(epoch FROM min(due_at)")):
		return "next due"
	case bytes.HasPrefix(text, []byte("UPDATE ")) && bytes.Contains(text, []byte(" p SET effects = NULL")) &&
		bytes.Contains(text, []byte("set_config('synchronous_commit', 'off', true)")):
		return "mark"
	}
	return ""
}

func (c *wireCounts) add(kind string) {
	switch kind {
	case "claim":
		c.claims++
	case "move":
		c.moves++
	case "next due":
		c.nextDue++
	case "mark":
		c.marks++
	}
}

// countedOutbox is an Outbox (database/sql form) on a countedDB, closed when the test ends.
func countedOutbox(t *testing.T, e *env) (*outbox.Outbox, *sql.DB, *statementCounter) {
	t.Helper()
	db, wire := countedDB(t, e.dsn)
	ob, err := outbox.New(outbox.Config{DB: db, Driver: postgres.Driver{}, Publisher: e.pub, Logger: watermill.NopLogger{}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = ob.Close() })
	return ob, db, wire
}

// publishOne is a handler that publishes one message to out_a.
func publishOne(msg *message.Message) ([]*message.Message, error) {
	return nil, outbox.Publish(msg.Context(), "out_a", message.NewMessage(uuid.NewString(), nil))
}

// TestSettledDuplicateReadsNothingMore: on database/sql, a copy of a message whose effects went
// out sends BEGIN, the claim (which finds the claim and that nothing of it is pending) and
// ROLLBACK: three statements, no read of the pending effects (four before).
func TestSettledDuplicateReadsNothingMore(t *testing.T) {
	e := newEnv(t)
	ob, _, wire := countedOutbox(t, e)
	duplicate := func(msg *message.Message) int {
		t.Helper()
		ob.FlushMarks()
		before := wire.snapshot()
		ran := false
		if err := handle(ob, copyOf(msg), func(*message.Message) ([]*message.Message, error) { ran = true; return nil, nil }); err != nil {
			t.Fatal(err)
		}
		if ran {
			t.Fatal("the handler ran for a copy")
		}
		return wire.snapshot().minus(before).statements
	}
	// The first message and its copy prepare what is prepared once per connection; a copy that
	// lands on another connection of the pool (the mark's, say) prepares its claim there first
	// (CI's once counted 9): of a few copies, the fewest statements count.
	for i, want := range []int{-1, 3} {
		msg := message.NewMessage(uuid.NewString(), nil)
		if err := handle(ob, msg, publishOne); err != nil {
			t.Fatal(err)
		}
		got := duplicate(msg)
		for range 4 {
			got = min(got, duplicate(msg))
		}
		if want >= 0 && got != want {
			t.Errorf("a copy of a message whose effect went out (%d): %d statements at fewest of 5 copies, want %d (BEGIN, the claim, ROLLBACK)", i, got, want)
		}
	}
	mustEqual(t, "messages sent", len(e.wire("out_a")), 2)
}

// TestMarksArePrepared: on database/sql the marks that clear sent inline effects are statements
// prepared per connection, as the other frequent statements are. Sent unprepared, every mark was
// parsed and planned again (lib/pq sends a statement with arguments as an unnamed one): more
// server work than its updates in the small batches of a service at low concurrency.
func TestMarksArePrepared(t *testing.T) {
	e := newEnv(t)
	ob, db, wire := countedOutbox(t, e)
	markOne := func() {
		t.Helper()
		if err := handle(ob, message.NewMessage(uuid.NewString(), nil), publishOne); err != nil {
			t.Fatal(err)
		}
		ob.FlushMarks()
	}
	// The first ones prepare what is prepared once per connection (and may go unprepared while
	// the store checks for a pooler).
	for range 3 {
		markOne()
	}
	before := wire.snapshot()
	const n = 12
	for range n {
		markOne()
	}
	got := wire.snapshot().minus(before)
	if got.marks != n {
		t.Errorf("%d marks sent for %d messages flushed one by one, want %d", got.marks, n, n)
	}
	if conns := db.Stats().OpenConnections; got.markParses > conns {
		t.Errorf("%d marks parsed %d times on %d connections: not prepared per connection", got.marks, got.markParses, conns)
	}
	mustEqual(t, "messages sent", len(e.wire("out_a")), 3+n)
}
