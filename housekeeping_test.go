package outbox_test

import (
	"context"
	"database/sql"
	"fmt"
	"math"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"

	"github.com/watermill-outbox/outbox"
)

// TestEffectsTableStaysSmallUnderLoad: with cleanup running, dispatched effects are deleted in
// bounded batches while traffic continues, and nothing pending is touched.
func TestEffectsTableStaysSmallUnderLoad(t *testing.T) {
	e := newEnv(t, func(c *outbox.Config) {
		c.EffectRetention = time.Millisecond
		c.CleanupInterval = 20 * time.Millisecond
		c.CleanupBatchSize = 50
	})
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error)
	go func() { done <- e.ob.Run(ctx) }()
	defer func() { cancel(); <-done }()

	maxRows := 0
	for i := 0; i < 1500; i++ {
		err := e.ob.InTx(context.Background(), func(ctx context.Context, tx *sql.Tx) error {
			return outbox.Publish(ctx, "out_a", message.NewMessage(uuid.NewString(), nil))
		})
		if err != nil {
			t.Fatal(err)
		}
		if i%100 == 0 {
			maxRows = max(maxRows, e.count(`SELECT count(*) FROM all_effects`))
		}
	}
	waitFor(t, "cleanup to catch up", func() bool { return e.count(`SELECT count(*) FROM all_effects`) == 0 })
	t.Logf("largest effects table seen during 1500 boundary calls: %d rows", maxRows)
	if maxRows > 750 {
		t.Fatalf("the effects table grew to %d rows: cleanup is not keeping up", maxRows)
	}
	mustEqual(t, "messages on the wire", len(e.wire("out_a")), 1500)
}

// TestDispatchedEffectsAreDeleted covers the default EffectRetention (zero): effects are deleted
// when they are marked dispatched, on the fast path, on redelivery and by the relay, and the claim
// still remembers the message.
func TestDispatchedEffectsAreDeleted(t *testing.T) {
	e := newEnv(t, func(c *outbox.Config) {
		c.EffectRetention = 0
		c.RelayGrace = time.Millisecond
		c.RelayInterval = 20 * time.Millisecond
	})
	var calls atomic.Int32
	msg := message.NewMessage(uuid.NewString(), nil)
	if err := handle(e.ob, msg, applyAndPublish(&calls)); err != nil {
		t.Fatal(err)
	}
	mustEqual(t, "effect rows after the fast path", e.count(`SELECT count(*) FROM all_effects`), 0)
	if err := handle(e.ob, copyOf(msg), applyAndPublish(&calls)); err != nil {
		t.Fatal(err)
	}
	mustEqual(t, "handler calls", calls.Load(), int32(1))
	mustEqual(t, "messages on the wire", len(e.wire("out_a"))+len(e.wire("out_b")), 2)
	mustEqual(t, "claims keeping their time (sent right after it)", e.count(`SELECT count(*) FROM outbox_processed
		WHERE dispatched_at >= processed_at AND dispatched_at < processed_at + interval '1 second'`), 1)

	// The relay deletes what it sends too.
	e.pub.failAll.Store(true)
	if err := e.ob.InTx(context.Background(), func(ctx context.Context, tx *sql.Tx) error {
		return outbox.Publish(ctx, "out_a", message.NewMessage(uuid.NewString(), nil))
	}); err != nil {
		t.Fatal(err)
	}
	mustEqual(t, "pending after a failed dispatch", e.pendingEffects(), 1)
	e.pub.failAll.Store(false)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error)
	go func() { done <- e.ob.Run(ctx) }()
	waitFor(t, "the relay", func() bool { return e.count(`SELECT count(*) FROM all_effects`) == 0 })
	cancel()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	mustEqual(t, "messages on the wire", len(e.wire("out_a")), 2)
}

// TestRetentionClockFollowsLateDispatch: effects sent long after their claim (a slow unit of work,
// a re-send on redelivery) move the claim's dispatch time, from which retention counts; effects
// sent right after it leave the claim as written.
func TestRetentionClockFollowsLateDispatch(t *testing.T) {
	for _, keep := range []time.Duration{0, time.Hour} {
		t.Run(fmt.Sprint("EffectRetention ", keep), func(t *testing.T) { retentionClockFollowsLateDispatch(t, keep) })
	}
}

func retentionClockFollowsLateDispatch(t *testing.T, keep time.Duration) {
	e := newEnv(t, func(c *outbox.Config) { c.EffectRetention = keep })
	slow := message.NewMessage(uuid.NewString(), nil)
	apply := applyAndPublish(nil)
	if err := handle(e.ob, slow, func(msg *message.Message) ([]*message.Message, error) {
		// The effects are stored at once (in the claim, with their time), sent long after.
		produced, err := apply(msg)
		time.Sleep(outbox.ClaimClockSlack + 100*time.Millisecond)
		return produced, err
	}); err != nil {
		t.Fatal(err)
	}

	resent := message.NewMessage(uuid.NewString(), nil)
	e.pub.failAll.Store(true)
	if err := handle(e.ob, resent, apply); err == nil {
		t.Fatal("dispatch through a failing publisher reported success")
	}
	e.pub.failAll.Store(false)
	time.Sleep(50 * time.Millisecond)
	var before time.Time
	if err := e.db.QueryRow(`SELECT now()`).Scan(&before); err != nil {
		t.Fatal(err)
	}
	if err := handle(e.ob, copyOf(resent), apply); err != nil {
		t.Fatal(err)
	}
	e.ob.FlushMarks()
	mustEqual(t, "pending effects", e.pendingEffects(), 0)
	mustEqual(t, "slow unit of work: clock moved", e.count(`SELECT count(*) FROM outbox_processed
		WHERE message_id = $1 AND dispatched_at > processed_at + interval '1 second'`, slow.UUID), 1)
	mustEqual(t, "re-sent on redelivery: clock moved", e.count(`SELECT count(*) FROM outbox_processed
		WHERE message_id = $1 AND dispatched_at >= $2`, resent.UUID, before), 1)
}

// TestCleanupPauseFactorIsValidated: the factor must be a finite number; a negative one is valid
// (it turns the proportional pause off).
func TestCleanupPauseFactorIsValidated(t *testing.T) {
	for _, f := range []float64{math.NaN(), math.Inf(1), math.Inf(-1)} {
		err := outbox.Config{CleanupPauseFactor: f}.Validate()
		if err == nil || !strings.Contains(err.Error(), "CleanupPauseFactor") {
			t.Fatalf("CleanupPauseFactor %v: got %v, want an error naming it", f, err)
		}
	}
	if err := (outbox.Config{CleanupPauseFactor: -1}).Validate(); err != nil && strings.Contains(err.Error(), "CleanupPauseFactor") {
		t.Fatalf("CleanupPauseFactor -1 was refused: %v", err)
	}
}
