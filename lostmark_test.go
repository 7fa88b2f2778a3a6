package outbox_test

import (
	"context"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"

	"github.com/watermill-outbox/outbox"
)

// TestLostMarkIsSentAgainSoon: a dispatched mark commits asynchronously, so a failover can lose
// one this process saw committed (on the old primary, with the link to the standby held). On the
// new primary the effect is pending again, and this process's relay must send it again once its
// memory of the mark (markRecall, five seconds) is over: not skip it while leaving the effect
// leased for a whole relay lease (2 x PublishTimeout + 30 s, 90 s here), and not skip it for as
// long as this process writes no other mark (that memory was pruned only by the next mark).
func TestLostMarkIsSentAgainSoon(t *testing.T) {
	e := newEnv(t, func(c *outbox.Config) {
		c.RelayInterval = 20 * time.Millisecond
		c.RelayGrace = 100 * time.Millisecond
	})
	msg := message.NewMessage(uuid.NewString(), nil)
	if err := handle(e.ob, msg, applyAndPublish(nil)); err != nil {
		t.Fatal(err)
	}
	e.flush()
	effects := e.storedEffects("c1", msg.UUID)
	mustEqual(t, "effects stored", len(effects), 2)
	// The effects as a new primary holds them when their mark never reached it: pending again.
	res, err := e.db.Exec(`WITH d AS (DELETE FROM outbox_dispatched WHERE source_consumer = 'c1' AND source_id = $1 RETURNING *)
		INSERT INTO outbox_effects (id, source_consumer, source_id, seq, kind, topic, uuid, payload, metadata, ordering_key, created_at)
		SELECT id, source_consumer, source_id, seq, kind, topic, uuid, payload, metadata, ordering_key, created_at FROM d`, msg.UUID)
	if err != nil {
		t.Fatal(err)
	}
	if n, _ := res.RowsAffected(); n != 2 {
		t.Fatalf("%d effects made pending again, want 2", n)
	}
	lost := time.Now()

	ctx, stop := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- e.ob.Run(ctx) }()
	defer func() {
		stop()
		if err := <-done; err != nil {
			t.Errorf("Run: %v", err)
		}
	}()
	// markRecall (5 s), then a relay interval; the rest is room for a loaded machine. Without the
	// fix the effects wait out the lease (90 s) or are skipped for good.
	const bound = 20 * time.Second
	for e.pendingEffects() > 0 {
		if time.Since(lost) > bound {
			var leased string
			if err := e.db.QueryRow(`SELECT coalesce(max(next_attempt_at - now())::text, 'not leased') FROM outbox_effects`).Scan(&leased); err != nil {
				t.Fatal(err)
			}
			t.Fatalf("the effects whose mark was lost are still pending %s later: %d pending, due in %s", bound, e.pendingEffects(), leased)
		}
		time.Sleep(50 * time.Millisecond)
	}
	t.Logf("sent again %s after their mark was lost", time.Since(lost).Round(time.Millisecond))
	mustEqual(t, "copies of the first effect on the wire", e.wire("out_a")[effects[0]], 2)
	mustEqual(t, "copies of the second effect on the wire", e.wire("out_b")[effects[1]], 2)
}
