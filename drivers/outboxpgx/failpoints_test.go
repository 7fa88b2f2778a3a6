package outboxpgx_test

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/watermill-outbox/outbox"
	"github.com/watermill-outbox/outbox/outboxtest"
)

// TestSweepFailpoints crashes the sweep of inline effects left behind at its two steps, as the
// protocol's model does: either crash rolls the whole sweep back (the effects stay inline, the
// watermark where it was), and the next sweep moves them.
func TestSweepFailpoints(t *testing.T) {
	pool := openPool(t, outboxtest.DSN(t), 8, nil)
	ctx := context.Background()
	rec := &outboxtest.Recorder{}
	var mu sync.Mutex
	crashAt := outbox.FailpointAfterCommit
	seen := map[string]int{}
	ob := ready(t, pool, outbox.Config{Publisher: rec, RelayGrace: 100 * time.Millisecond, RelayInterval: 20 * time.Millisecond,
		RetryDelay: -1, Failpoint: func(_ context.Context, point string) error {
			mu.Lock()
			defer mu.Unlock()
			seen[point]++
			if point == crashAt {
				return errors.New("crash")
			}
			return nil
		}})
	crashNext := func(point string) {
		mu.Lock()
		defer mu.Unlock()
		crashAt = point
	}
	hits := func(point string) int {
		mu.Lock()
		defer mu.Unlock()
		return seen[point]
	}
	state := func() (inline, rows int, sweptTo int64) {
		t.Helper()
		if err := pool.QueryRow(ctx, `SELECT (SELECT count(*) FROM outbox_processed WHERE effects IS NOT NULL),
			(SELECT count(*) FROM outbox_effects_all), (SELECT coalesce(swept_xid, 0) FROM outbox_stats)`).Scan(&inline, &rows, &sweptTo); err != nil {
			t.Fatal(err)
		}
		return inline, rows, sweptTo
	}
	run := func(what string, until func() bool) {
		t.Helper()
		runCtx, cancel := context.WithCancel(ctx)
		done := make(chan error, 1)
		go func() { done <- ob.Run(runCtx) }()
		deadline := time.Now().Add(20 * time.Second)
		for !until() {
			if time.Now().After(deadline) {
				cancel()
				<-done
				t.Fatalf("timed out after 20s waiting for %s", what)
			}
			time.Sleep(20 * time.Millisecond)
		}
		cancel()
		if err := <-done; err != nil {
			t.Fatalf("Run: %v", err)
		}
	}

	err := ob.Handle(message.NewMessage("m", nil), outbox.HandleParams{Consumer: "c", MessageID: "m"}, consume(handler))
	if !errors.Is(err, outbox.ErrFailpoint) {
		t.Fatalf("crash after commit: %v", err)
	}
	time.Sleep(150 * time.Millisecond) // older than RelayGrace
	_, _, before := state()

	for _, point := range []string{outbox.FailpointAfterSweepMove, outbox.FailpointBeforeSweepWatermark} {
		crashNext(point)
		run("a sweep to crash at "+point, func() bool { return hits(point) > 0 })
		inline, rows, sweptTo := state()
		if inline != 1 || rows != 0 || sweptTo != before {
			t.Fatalf("after a crash at %s: %d claims with inline effects, %d effect rows, watermark %d (was %d); want 1, 0, unchanged",
				point, inline, rows, sweptTo, before)
		}
		if n := len(rec.All()); n != 0 {
			t.Fatalf("after a crash at %s: %d messages sent, want none", point, n)
		}
	}

	crashNext("")
	run("the sweep and the relay to send the effect", func() bool { return len(rec.All()) > 0 })
	if inline, _, _ := state(); inline != 0 {
		t.Fatalf("after a sweep: %d claims still hold inline effects", inline)
	}
	if got := rec.All()[0].Message.UUID; got != "out-m" {
		t.Fatalf("sent %q, want out-m", got)
	}
}
