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
		INSERT INTO outbox_effects_all (id, source_consumer, source_id, seq, kind, topic, uuid, payload, metadata, ordering_key, created_at)
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
			if err := e.db.QueryRow(`SELECT coalesce(max(next_attempt_at - now())::text, 'not leased') FROM outbox_effects_all`).Scan(&leased); err != nil {
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

// TestSurvivingLeaseEndsByTheNewPrimarysClock: a relay lease that survives a failover
// (next_attempt_at, written by the old primary's clock) ends by the new primary's clock. Two
// servers' clocks cannot differ on one machine, so the leases are written as the old primary
// would have written them: one by a clock in step (it still holds for a minute), one by a clock
// 90 s behind the new primary's (a default lease taken just before the failover, already over by
// the new clock). The second effect goes out at once, the first waits.
func TestSurvivingLeaseEndsByTheNewPrimarysClock(t *testing.T) {
	e := newEnv(t)
	msg := message.NewMessage(uuid.NewString(), nil)
	if err := handle(e.ob, msg, applyAndPublish(nil)); err != nil {
		t.Fatal(err)
	}
	e.flush()
	effects := e.storedEffects("c1", msg.UUID)
	mustEqual(t, "effects stored", len(effects), 2)
	// Pending again with the leases the old primary left: seq 0 leased for another minute, seq 1
	// leased for 90 s from a time 90 s behind the new primary's clock. Their ordering keys
	// differ, so that neither waits behind the other.
	res, err := e.db.Exec(`WITH d AS (DELETE FROM outbox_dispatched WHERE source_consumer = 'c1' AND source_id = $1 RETURNING *)
		INSERT INTO outbox_effects_all (id, source_consumer, source_id, seq, kind, topic, uuid, payload, metadata, ordering_key, created_at, next_attempt_at)
		SELECT id, source_consumer, source_id, seq, kind, topic, uuid, payload, metadata, ordering_key || '-' || seq, created_at,
			CASE seq WHEN 0 THEN now() + interval '60 seconds' ELSE (now() - interval '90 seconds') + interval '90 seconds' END FROM d`, msg.UUID)
	if err != nil {
		t.Fatal(err)
	}
	if n, _ := res.RowsAffected(); n != 2 {
		t.Fatalf("%d effects made pending again, want 2", n)
	}
	// Another instance's relay: the one that sent them would hold them back while it remembers
	// their marks (TestLostMarkIsSentAgainSoon).
	ob := e.newOutbox(func(c *outbox.Config) { c.RelayInterval = 20 * time.Millisecond })
	ctx, stop := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- ob.Run(ctx) }()
	defer func() {
		stop()
		if err := <-done; err != nil {
			t.Errorf("Run: %v", err)
		}
	}()
	waitFor(t, "the effect whose lease is over by the new primary's clock sent again", func() bool {
		return e.wire("out_b")[effects[1]] == 2
	})
	time.Sleep(time.Second) // a relay round or fifty
	mustEqual(t, "copies of the effect whose lease holds by the new primary's clock", e.wire("out_a")[effects[0]], 1)
	mustEqual(t, "effects pending", e.pendingEffects(), 1)
}
