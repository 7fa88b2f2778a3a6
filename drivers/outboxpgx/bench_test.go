package outboxpgx_test

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/watermill-outbox/outbox"
	"github.com/watermill-outbox/outbox/drivers/outboxpgx"
	"github.com/watermill-outbox/outbox/outboxtest"
)

// BenchmarkHandle times one first delivery at a time (one INSERT, one message to an in-memory
// Publisher) through each mode, beside the same write in a bare pgx transaction, alternating in
// one process, and reports the process's CPU time per delivery (cpu-µs/op: the client's side of
// the cost, background work such as the marks and the two relays included):
//
//	cd drivers/outboxpgx && go test -run '^$' -bench Handle -benchtime 3000x -count 3 -benchmem
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
		defer reportCPU(b)()
		run := runs.Add(1)
		for i := range b.N {
			tx, err := pool.Begin(ctx)
			if err != nil {
				b.Fatal(err)
			}
			if _, err := tx.Exec(ctx, `INSERT INTO applied (message_id) VALUES ($1)`, fmt.Sprint("bare-", run, "-", i)); err != nil {
				b.Fatal(err)
			}
			if err := tx.Commit(ctx); err != nil {
				b.Fatal(err)
			}
		}
	})
	for _, name := range []string{"optimistic", "pessimistic"} {
		b.Run(name, func(b *testing.B) {
			defer reportCPU(b)()
			run := runs.Add(1) // -count runs the same b.N again: new IDs, not duplicates
			for i := range b.N {
				id := fmt.Sprint(name, "-", run, "-", i)
				if err := obs[name].Handle(message.NewMessage(id, nil), outbox.HandleParams{Consumer: "c", MessageID: id}, consume(handler)); err != nil {
					b.Fatal(err)
				}
			}
			obs[name].FlushMarks()
		})
	}
}

// runs numbers the runs of a benchmark in this process.
var runs atomic.Int64

// reportCPU returns a func, to be deferred, that reports the process's CPU time (user and system)
// per iteration since reportCPU was called.
func reportCPU(b *testing.B) func() {
	cpu := func() time.Duration {
		var ru syscall.Rusage
		if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
			b.Fatal(err)
		}
		return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
	}
	start := cpu()
	return func() { b.ReportMetric(float64((cpu()-start).Microseconds())/float64(b.N), "cpu-µs/op") }
}
