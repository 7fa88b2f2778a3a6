package outbox_test

import (
	"context"
	"database/sql"
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
			maxRows = max(maxRows, e.count(`SELECT count(*) FROM outbox_effects`))
		}
	}
	waitFor(t, "cleanup to catch up", func() bool { return e.count(`SELECT count(*) FROM outbox_effects`) == 0 })
	t.Logf("largest effects table seen during 1500 boundary calls: %d rows", maxRows)
	if maxRows > 750 {
		t.Fatalf("the effects table grew to %d rows: cleanup is not keeping up", maxRows)
	}
	mustEqual(t, "messages on the wire", len(e.wire("out_a")), 1500)
}
