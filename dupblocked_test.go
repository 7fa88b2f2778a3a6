package outbox_test

import (
	"context"
	"database/sql"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/watermill-outbox/outbox"
)

// TestRedeliveryBehindABlockedKeyLeasesNothing: a redelivery finds its unit's effects unsent (the
// process stopped after the commit), one of them kept in the claim and one with an ordering key
// behind another unit's pending effect. Its effects become rows and are left to the relay, which
// sends them in order once the earlier one goes. They were leased for the redelivery's own
// dispatch (relayLease, 90 s by default) before it found the key blocked, and the relay left them
// alone, also the one of the message's own key, until the lease ended.
func TestRedeliveryBehindABlockedKeyLeasesNothing(t *testing.T) {
	e := newEnv(t)
	e.initTopics("blocked", "own")
	pub := &refusingTopic{next: e.pub, topic: "blocked"}
	pub.refuse.Store(true)
	var crash atomic.Bool
	ob := e.newOutbox(func(c *outbox.Config) {
		c.Publisher = pub
		c.RelayGrace = time.Millisecond
		c.DuplicateWait = time.Millisecond
		c.Failpoint = func(_ context.Context, point string) error {
			if point == outbox.FailpointAfterCommit && crash.Load() {
				return errors.New("the process stops")
			}
			return nil
		}
	})
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	// Another unit's effect with key K, refused: pending.
	_ = ob.InTx(ctx, func(ctx context.Context, _ *sql.Tx) error {
		return outbox.Publish(outbox.WithOrderingKey(ctx, "K"), "blocked", message.NewMessage("x", nil))
	})
	msg := message.NewMessage("m1", nil)
	h := func(m *message.Message) ([]*message.Message, error) {
		ctx := m.Context()
		if err := outbox.Publish(ctx, "own", message.NewMessage("a", nil)); err != nil {
			return nil, err
		}
		return nil, outbox.Publish(outbox.WithOrderingKey(ctx, "K"), "blocked", message.NewMessage("b", nil))
	}
	crash.Store(true)
	if err := handle(ob, msg.Copy(), h); err == nil {
		t.Fatal("the first delivery did not stop after its commit")
	}
	crash.Store(false)
	if err := handle(ob, msg.Copy(), h); err != nil {
		t.Fatalf("the redelivery: %v", err)
	}
	pub.refuse.Store(false)
	outbox.MakeDestinationsDue(ob, "blocked") // the topic takes messages again
	began := time.Now()
	for e.wire("own")["a"] == 0 || e.wire("blocked")["b"] == 0 {
		if time.Since(began) > 15*time.Second {
			t.Fatalf("after 15 s: own %v, blocked %v; want a, x and b sent", e.wire("own"), e.wire("blocked"))
		}
		if err := outbox.RelayPass(ctx, ob); err != nil {
			t.Fatal(err)
		}
		time.Sleep(50 * time.Millisecond)
	}
	order := e.wireInOrder("blocked")
	if len(order) != 2 || order[0].uuid != "x" || order[1].uuid != "b" {
		t.Errorf("key K on the wire: %+v; want x, then b", order)
	}
}
