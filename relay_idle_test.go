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
// delayed effects, no look-up of the next due time (three statements a pass before).
func TestIdleRelayPassIsOneStatement(t *testing.T) {
	e := newEnv(t)
	if err := e.ob.InTx(context.Background(), func(ctx context.Context, _ *sql.Tx) error {
		return outbox.Publish(outbox.WithDelay(ctx, time.Hour), "out_a", message.NewMessage(uuid.NewString(), nil))
	}); err != nil {
		t.Fatal(err)
	}
	wire := &statementCounter{}
	connector, err := pq.NewConnector(e.dsn)
	if err != nil {
		t.Fatal(err)
	}
	connector.Dialer(wire)
	db := sql.OpenDB(connector)
	t.Cleanup(func() { _ = db.Close() })
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
	// Besides the passes, an instance samples the tables' statistics (writes to the stats row).
	if during.moves != 0 || during.nextDue != 0 || during.statements != during.claims+during.stats {
		t.Fatalf("%d idle passes sent %d statements (%d besides the claims and %d of the stats sampler): %d moves of delayed effects, %d look-ups of their next due time; want the claim alone",
			during.claims, during.statements, during.statements-during.claims-during.stats, during.stats, during.moves, during.nextDue)
	}
}

// statementCounter is a lib/pq Dialer whose connections count the statements the client sends
// (Query and Execute messages of the protocol), and by the text of their Parse messages the
// claims, the moves of delayed effects, the look-ups of their next due time and the statements
// on the stats row among them.
type statementCounter struct {
	mu     sync.Mutex
	counts wireCounts
}

type wireCounts struct{ statements, claims, moves, nextDue, stats int }

func (c wireCounts) minus(o wireCounts) wireCounts {
	return wireCounts{c.statements - o.statements, c.claims - o.claims, c.moves - o.moves, c.nextDue - o.nextDue, c.stats - o.stats}
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

func (c *countingConn) count(typ byte, body []byte) {
	c.s.mu.Lock()
	defer c.s.mu.Unlock()
	switch typ {
	case 'Q', 'E':
		c.s.counts.statements++
	case 'P': // Parse: the statement's name, then its text
		if i := bytes.IndexByte(body, 0); i >= 0 {
			text := body[i+1:]
			switch {
			case bytes.HasPrefix(text, []byte("WITH bounds AS MATERIALIZED")):
				c.s.counts.claims++
			case bytes.HasPrefix(text, []byte("WITH due AS")):
				c.s.counts.moves++
			case bytes.Contains(text, []byte("min(due_at)")):
				c.s.counts.nextDue++
			case bytes.Contains(text, []byte(`_stats"`)):
				c.s.counts.stats++
			}
		}
	}
}
