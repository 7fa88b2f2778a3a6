package outbox_test

import (
	"context"
	"database/sql"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	_ "github.com/lib/pq"

	"github.com/watermill-outbox/outbox"
	"github.com/watermill-outbox/outbox/drivers/postgres"
)

// TestFailedDispatchWakesTheRelayOfAnotherInstance: instance A (no relay) fails to dispatch after
// commit; instance B's relay, which would poll only hourly, is woken by NOTIFY and sends it.
func TestFailedDispatchWakesTheRelayOfAnotherInstance(t *testing.T) {
	e := newEnv(t)
	b := e.newOutbox(func(c *outbox.Config) {
		c.Driver = postgres.Driver{ListenDSN: e.dsn}
		c.RelayInterval = time.Hour
		c.RelayGrace = time.Hour
	})
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error)
	go func() { done <- b.Run(ctx) }()
	defer func() {
		cancel()
		if err := <-done; err != nil {
			t.Error(err)
		}
	}()
	waitListening(t, e)

	e.pub.fail.Store(1) // the fast path fails once, then the broker is back
	var id string
	err := e.ob.InTx(context.Background(), func(ctx context.Context, tx *sql.Tx) error {
		m := message.NewMessage(uuid.NewString(), []byte("woken"))
		id = m.UUID
		return outbox.Publish(ctx, "out_a", m)
	})
	if err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	waitFor(t, "the woken relay", func() bool { return e.wire("out_a")[id] == 1 })
	t.Logf("sent by the other instance's relay %v after the failed dispatch", time.Since(start))
	// The relay marks what it sent right after the Publisher returned: wait for that write, then
	// check that it was sent once.
	waitFor(t, "the relay's mark", func() bool { return e.pendingEffects() == 0 })
	mustEqual(t, "copies on the wire", e.wire("out_a")[id], 1)
}

// TestListenerConnectingIsNoHandoff: the listener wakes the relay once it is connected, since
// notifications sent before were missed; that wake-up is not another instance's hand-off, after
// which the relay runs a round behind every batch of marks for a minute (effects handed off may
// wait behind the ones being marked). Sending messages one after another after the listener
// connected costs no relay round per batch of marks.
func TestListenerConnectingIsNoHandoff(t *testing.T) {
	e := newEnv(t)
	d := &claimCounter{Driver: postgres.Driver{ListenDSN: e.dsn}}
	claims := func() int { n, _ := d.counts(); return n }
	ob := e.newOutbox(func(c *outbox.Config) {
		c.Driver = d
		c.RelayInterval = time.Hour
	})
	startRun(t, ob)
	waitListening(t, e)
	waitFor(t, "the relay's first rounds", func() bool { return claims() > 0 })
	time.Sleep(200 * time.Millisecond)
	before := claims()
	const messages = 20
	for i := 0; i < messages; i++ {
		err := ob.InTx(context.Background(), func(ctx context.Context, tx *sql.Tx) error {
			return outbox.Publish(ctx, "out_a", message.NewMessage(uuid.NewString(), []byte("m")))
		})
		if err != nil {
			t.Fatal(err)
		}
		time.Sleep(20 * time.Millisecond) // a batch of marks each
	}
	waitFor(t, "the marks", func() bool { return e.pendingEffects() == 0 })
	time.Sleep(200 * time.Millisecond)
	if n := claims() - before; n > 2 {
		t.Fatalf("the relay claimed %d times while %d messages were sent on the fast path, nothing handed off; want at most 2", n, messages)
	}
}

// waitListening waits until a relay's listener of the database of e has sent LISTEN.
func waitListening(t *testing.T, e *env) {
	t.Helper()
	waitFor(t, "the relay to listen", func() bool {
		return e.count(`SELECT count(*) FROM pg_stat_activity WHERE query LIKE 'LISTEN %'`) > 0
	})
}
