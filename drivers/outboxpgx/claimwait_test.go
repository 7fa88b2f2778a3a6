package outboxpgx_test

import (
	"bytes"
	"context"
	"net"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/watermill-outbox/outbox"
	"github.com/watermill-outbox/outbox/drivers/outboxpgx"
	"github.com/watermill-outbox/outbox/outboxtest"
)

// pingCounter counts the pings (the gate's probes) sent on the connections it wraps.
type pingCounter struct {
	net.Conn
	n *atomic.Int64
}

func (c pingCounter) Write(b []byte) (int, error) {
	if bytes.Contains(b, []byte("-- ping")) {
		c.n.Add(1)
	}
	return c.Conn.Write(b)
}

// Item: in the pessimistic mode a copy that waits in the claim for another copy being handled
// is not a database that stalls: the gate sends no probe (a ping) meanwhile.
func TestClaimWaitIsNotTakenForAStall(t *testing.T) {
	cfg, err := pgxpool.ParseConfig(outboxtest.DSN(t))
	if err != nil {
		t.Fatal(err)
	}
	var pings atomic.Int64
	cfg.ConnConfig.DialFunc = func(ctx context.Context, network, addr string) (net.Conn, error) {
		var d net.Dialer
		c, err := d.DialContext(ctx, network, addr)
		if err != nil {
			return nil, err
		}
		return pingCounter{Conn: c, n: &pings}, nil
	}
	// The pool pings a connection idle for a second before handing it out: no probe.
	cfg.ShouldPing = func(context.Context, pgxpool.ShouldPingParams) bool { return false }
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	ob := ready(t, pool, outbox.Config{Publisher: &outboxtest.Recorder{}}, outboxpgx.WithConcurrency(outboxpgx.Pessimistic))
	msg := message.NewMessage(uuid.NewString(), nil)
	params := outbox.HandleParams{Consumer: "c", MessageID: msg.UUID}
	entered := make(chan struct{})
	var once sync.Once
	slow := func(m *message.Message) error {
		once.Do(func() { close(entered) })
		time.Sleep(1500 * time.Millisecond)
		return handler(m)
	}
	first := make(chan error, 1)
	go func() { first <- ob.Handle(msg.Copy(), params, consume(slow)) }()
	<-entered // the first copy holds the claim
	before := pings.Load()
	began := time.Now()
	err = ob.Handle(msg.Copy(), params, consume(handler))
	waited := time.Since(began)
	if ferr := <-first; ferr != nil {
		t.Fatalf("the first copy: %v", ferr)
	}
	t.Logf("the copy waited %s (%v)", waited.Round(time.Millisecond), err)
	if waited < time.Second {
		t.Fatalf("the copy waited %s for the first one's claim; want about 1.5s", waited)
	}
	if n := pings.Load() - before; n != 0 {
		t.Fatalf("a claim that waited for a copy's: %d pings (the gate's probes); want none", n)
	}
}
