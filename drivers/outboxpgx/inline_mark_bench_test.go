package outboxpgx_test

import (
	"context"
	"fmt"
	"testing"

	"github.com/jackc/pgx/v5/stdlib"

	"github.com/watermill-outbox/outbox"
	"github.com/watermill-outbox/outbox/drivers/outboxpgx"
	"github.com/watermill-outbox/outbox/outboxdriver"
	"github.com/watermill-outbox/outbox/outboxtest"
	"github.com/watermill-outbox/outbox/store"
)

// BenchmarkInlineMark times the background mark of inline effects sent, in batches of 16
// messages (what the mark worker gathers at a few hundred messages a second):
//
//	cd drivers/outboxpgx && go test -run '^$' -bench InlineMark -benchtime 2000x -count 3
func BenchmarkInlineMark(b *testing.B) {
	const batch = 16
	pool := openPool(b, outboxtest.DSN(b), 4, nil)
	ctx := context.Background()
	ready(b, pool, outbox.Config{Publisher: &outboxtest.Recorder{}})
	db := stdlib.OpenDBFromPool(pool)
	b.Cleanup(func() { _ = db.Close() })
	st, err := outboxpgx.Driver{Pool: pool}.Open(db, outboxdriver.StoreOptions{TablePrefix: "outbox_", DeleteDispatched: true})
	if err != nil {
		b.Fatal(err)
	}
	src := outboxdriver.Source{Consumer: "c", ID: "x"}
	blob := store.EncodeEffects([]outboxdriver.Effect{{Seq: 1, Topic: "out", UUID: "u", Payload: make([]byte, 100), OrderingKey: "c/x", Source: src}})
	if _, err := pool.Exec(ctx, `INSERT INTO outbox_processed (consumer, message_id, dispatched_at, effects)
		SELECT 'c', 'm' || g, now(), $1::bytea FROM generate_series(1, $2::int) g`, blob, b.N*batch); err != nil {
		b.Fatal(err)
	}
	if _, err := pool.Exec(ctx, `VACUUM ANALYZE outbox_processed`); err != nil {
		b.Fatal(err)
	}
	b.ResetTimer()
	for i := range b.N {
		marks := make([]outboxdriver.DispatchMark, batch)
		for j := range marks {
			marks[j] = outboxdriver.DispatchMark{Source: outboxdriver.Source{Consumer: "c", ID: fmt.Sprint("m", i*batch+j+1)}, Inline: true}
		}
		if err := st.EffectMarkDispatched(ctx, marks...); err != nil {
			b.Fatal(err)
		}
	}
	b.StopTimer()
	var left int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM outbox_processed WHERE effects IS NOT NULL`).Scan(&left); err != nil || left != 0 {
		b.Fatalf("%d claims still hold effects (%v)", left, err)
	}
}
