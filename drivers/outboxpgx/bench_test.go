package outboxpgx_test

import (
	"context"
	"fmt"
	"sync"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/watermill-outbox/outbox"
	"github.com/watermill-outbox/outbox/drivers/outboxpgx"
	"github.com/watermill-outbox/outbox/outboxtest"
)

// BenchmarkHandle times one first delivery at a time (one INSERT, one message to an in-memory
// Publisher) through each mode, beside the same write in a bare pgx transaction, alternating in
// one process:
//
//	cd drivers/outboxpgx && go test -run '^$' -bench Handle -benchtime 3000x -count 3
func BenchmarkHandle(b *testing.B) {
	pool := openPool(b, outboxtest.DSN(b), 4, nil)
	ctx := context.Background()
	obs := map[string]*outbox.Outbox{}
	runCtx, stop := context.WithCancel(ctx)
	var wg sync.WaitGroup
	defer func() { stop(); wg.Wait() }()
	for name, mode := range modes {
		ob := ready(b, pool, outbox.Config{Publisher: &outboxtest.Recorder{}, TablePrefix: name + "_"}, outboxpgx.WithConcurrency(mode))
		obs[name] = ob
		wg.Add(1)
		go func() { defer wg.Done(); _ = ob.Run(runCtx) }() // the relay, as in production
	}
	b.Run("bare-pgx", func(b *testing.B) {
		for i := range b.N {
			tx, err := pool.Begin(ctx)
			if err != nil {
				b.Fatal(err)
			}
			if _, err := tx.Exec(ctx, `INSERT INTO applied (message_id) VALUES ($1)`, fmt.Sprint("bare-", b.N, "-", i)); err != nil {
				b.Fatal(err)
			}
			if err := tx.Commit(ctx); err != nil {
				b.Fatal(err)
			}
		}
	})
	for _, name := range []string{"optimistic", "pessimistic"} {
		b.Run(name, func(b *testing.B) {
			for i := range b.N {
				id := fmt.Sprint(name, "-", b.N, "-", i)
				if err := obs[name].Handle(message.NewMessage(id, nil), outbox.HandleParams{Consumer: "c", MessageID: id}, consume(handler)); err != nil {
					b.Fatal(err)
				}
			}
			obs[name].FlushMarks()
		})
	}
}
