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

// TestLaterEffectNeverOvertakesAStuckEarlierOneWithItsKey: OrderCreated's dispatch fails; a later
// transaction's OrderUpdated with the same key must wait for it, on the fast path too.
func TestLaterEffectNeverOvertakesAStuckEarlierOneWithItsKey(t *testing.T) {
	e := newEnv(t, func(c *outbox.Config) { c.RelayGrace = time.Hour; c.RelayInterval = 20 * time.Millisecond })
	ctx := context.Background()
	publish := func(name string) {
		t.Helper()
		err := e.ob.InTx(ctx, func(ctx context.Context, tx *sql.Tx) error {
			return outbox.Publish(outbox.WithOrderingKey(ctx, "order-1"), "out_a", message.NewMessage(uuid.NewString(), []byte(name)))
		})
		if err != nil {
			t.Fatal(err)
		}
	}
	e.pub.failAll.Store(true)
	publish("OrderCreated") // committed, fast path fails
	e.pub.failAll.Store(false)
	publish("OrderUpdated") // fast path must not overtake
	mustEqual(t, "messages on the wire before the relay", len(e.wire("out_a")), 0)

	// A message with another key is not held up.
	if err := e.ob.InTx(ctx, func(ctx context.Context, tx *sql.Tx) error {
		return outbox.Publish(outbox.WithOrderingKey(ctx, "order-2"), "out_a", message.NewMessage(uuid.NewString(), []byte("Other")))
	}); err != nil {
		t.Fatal(err)
	}
	mustEqual(t, "other key sent at once", len(e.wire("out_a")), 1)

	runCtx, cancel := context.WithCancel(ctx)
	done := make(chan error)
	go func() { done <- e.ob.Run(runCtx) }()
	waitFor(t, "the relay", func() bool { return e.pendingEffects() == 0 })
	cancel()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	rows, err := e.db.Query(`SELECT convert_from(payload, 'UTF8') FROM watermill_out_a ORDER BY "offset"`)
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	var order []string
	for rows.Next() {
		var s string
		if err := rows.Scan(&s); err != nil {
			t.Fatal(err)
		}
		if s != "Other" {
			order = append(order, s)
		}
	}
	if len(order) != 2 || order[0] != "OrderCreated" || order[1] != "OrderUpdated" {
		t.Fatalf("publish order: %v", order)
	}
}

func TestBoundaryMetadataFromContext(t *testing.T) {
	e := newEnv(t)
	ctx := outbox.WithMetadata(context.Background(), outbox.MetadataCorrelationID, "req-7")
	ctx = outbox.WithMetadata(ctx, outbox.MetadataTraceparent, "00-aaaabbbbccccddddeeeeffff00001111-2222333344445555-01")
	err := e.ob.InTx(ctx, func(ctx context.Context, tx *sql.Tx) error {
		own := message.NewMessage(uuid.NewString(), nil)
		own.Metadata.Set(outbox.MetadataCorrelationID, "mine")
		return outbox.Publish(ctx, "out_a", message.NewMessage(uuid.NewString(), nil), own)
	})
	if err != nil {
		t.Fatal(err)
	}
	mustEqual(t, "messages with the context's correlation id", e.count(`SELECT count(*) FROM watermill_out_a WHERE metadata->>'correlation_id' = 'req-7'`), 1)
	mustEqual(t, "message keeping its own correlation id", e.count(`SELECT count(*) FROM watermill_out_a WHERE metadata->>'correlation_id' = 'mine'`), 1)
	mustEqual(t, "messages with the trace context", e.count(`SELECT count(*) FROM watermill_out_a WHERE metadata->>'traceparent' LIKE '00-aaaa%'`), 2)
	mustEqual(t, "messages with a causation id", e.count(`SELECT count(*) FROM watermill_out_a WHERE metadata->>'causation_id' <> ''`), 2)
}
