package outbox_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"os"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"

	"github.com/watermill-outbox/outbox"
)

// nullPublisher takes every message and does nothing with it but count it, check that no UUID
// comes twice, and, once expect is set, that the messages of each ordering key come in the order
// of their store IDs.
type nullPublisher struct {
	mu       sync.Mutex
	seen     map[string]bool
	expect   map[string]keyRank // UUID -> its key and rank in it
	lastRank map[string]int
	dups     int
	reorders int
	n        atomic.Int64
}

type keyRank struct {
	key  string
	rank int
}

func newNullPublisher() *nullPublisher {
	return &nullPublisher{seen: map[string]bool{}, lastRank: map[string]int{}}
}

// expectStoreOrder reads the order the relay owes: per ordering key, the order of store IDs.
func (p *nullPublisher) expectStoreOrder(tb testing.TB, db *sql.DB, table string) {
	tb.Helper()
	rows, err := db.Query(`SELECT uuid, ordering_key, row_number() OVER (PARTITION BY ordering_key ORDER BY id) FROM ` + table + ` WHERE dispatched_at IS NULL`)
	if err != nil {
		tb.Fatal(err)
	}
	defer rows.Close()
	p.expect = map[string]keyRank{}
	for rows.Next() {
		var id string
		var kr keyRank
		if err := rows.Scan(&id, &kr.key, &kr.rank); err != nil {
			tb.Fatal(err)
		}
		p.expect[id] = kr
	}
}

func (p *nullPublisher) Publish(_ string, msgs ...*message.Message) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, m := range msgs {
		if p.seen[m.UUID] {
			p.dups++
			continue
		}
		p.seen[m.UUID] = true
		if kr, ok := p.expect[m.UUID]; ok {
			if last, ok := p.lastRank[kr.key]; ok && kr.rank < last {
				p.reorders++
			}
			p.lastRank[kr.key] = kr.rank
		}
	}
	p.n.Add(int64(len(msgs)))
	return nil
}

func (p *nullPublisher) Close() error { return nil }

// backlog commits n effects through InTx on keys ordering keys, as while the broker was down
// (the process "crashed" after each commit, so nothing was dispatched), ten effects per call.
func backlog(tb testing.TB, e *env, n, keys int) {
	tb.Helper()
	crashing := e.newOutbox(func(c *outbox.Config) { c.Failpoint = crashAfterCommit })
	const perTx, workers = 10, 8
	var wg sync.WaitGroup
	var next atomic.Int64
	seq := make([]atomic.Int64, keys)
	for w := 0; w < workers; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				i := int(next.Add(perTx)) - perTx
				if i >= n {
					return
				}
				key := i / perTx % keys
				err := crashing.InTx(context.Background(), func(ctx context.Context, _ *sql.Tx) error {
					ctx = outbox.WithOrderingKey(ctx, fmt.Sprintf("key-%d", key))
					msgs := make([]*message.Message, 0, perTx)
					for j := 0; j < perTx && i+j < n; j++ {
						msgs = append(msgs, message.NewMessage(uuid.NewString(), []byte(fmt.Sprintf("key-%d %d", key, seq[key].Add(1)))))
					}
					return outbox.Publish(ctx, "out_a", msgs...)
				})
				if err != nil && !errors.Is(err, outbox.ErrFailpoint) {
					tb.Error(err)
					return
				}
			}
		}()
	}
	wg.Wait()
}

// BenchmarkRelayDrain drains a backlog of 30,000 effects on 300 ordering keys with one and with
// three relay instances to a publisher that does nothing, and reports effects per second.
func BenchmarkRelayDrain(b *testing.B) {
	for _, instances := range []int{1, 3} {
		b.Run(fmt.Sprintf("instances=%d", instances), func(b *testing.B) {
			const n, keys = 30000, 300
			var total time.Duration
			for i := 0; i < b.N; i++ {
				b.StopTimer()
				e := newEnv(b, func(c *outbox.Config) { c.EffectRetention = 0 })
				if ff := os.Getenv("FF"); ff != "" {
					mustExec(b, e, `ALTER TABLE outbox_effects SET (fillfactor = `+ff+`)`)
				}
				backlog(b, e, n, keys)
				pub := newNullPublisher()
				pub.expectStoreOrder(b, e.db, "outbox_effects")
				var obs []*outbox.Outbox
				for k := 0; k < instances; k++ {
					db, err := sql.Open("postgres", e.dsn)
					if err != nil {
						b.Fatal(err)
					}
					defer db.Close()
					obs = append(obs, e.newOutbox(func(c *outbox.Config) {
						c.DB = db
						c.Publisher = pub
						c.RelayGrace = time.Millisecond
						c.RelayInterval = 10 * time.Millisecond
						c.EffectRetention = 0
					}))
				}
				b.StartTimer()
				start := time.Now()
				runCtx, stop := context.WithCancel(context.Background())
				var wg sync.WaitGroup
				for _, ob := range obs {
					wg.Add(1)
					go func() { defer wg.Done(); _ = ob.Run(runCtx) }()
				}
				for pub.n.Load() < n {
					time.Sleep(2 * time.Millisecond)
				}
				total += time.Since(start)
				stop()
				wg.Wait()
				b.StopTimer()
				if pub.dups > 0 || pub.reorders > 0 {
					b.Fatalf("%d copies sent twice, %d out of order", pub.dups, pub.reorders)
				}
			}
			b.ReportMetric(float64(n*b.N)/total.Seconds(), "effects/s")
		})
	}
}

// TestRelayDrainSendsEachEffectOnce: one and three relay instances drain a backlog of effects on
// many ordering keys; each effect is sent once, in order per key, and nothing is left pending.
func TestRelayDrainSendsEachEffectOnce(t *testing.T) {
	for _, instances := range []int{1, 3, 3} {
		const n, keys = 6000, 60
		e := newEnv(t, func(c *outbox.Config) { c.EffectRetention = 0 })
		backlog(t, e, n, keys)
		pub := newNullPublisher()
		pub.expectStoreOrder(t, e.db, "outbox_effects")
		var obs []*outbox.Outbox
		for k := 0; k < instances; k++ {
			db, err := sql.Open("postgres", e.dsn)
			if err != nil {
				t.Fatal(err)
			}
			defer db.Close()
			obs = append(obs, e.newOutbox(func(c *outbox.Config) {
				c.DB = db
				c.Publisher = pub
				c.RelayGrace = time.Millisecond
				c.RelayInterval = 10 * time.Millisecond
				c.RelayBatchSize = 100
				c.EffectRetention = 0
			}))
		}
		runCtx, stop := context.WithCancel(context.Background())
		var wg sync.WaitGroup
		for _, ob := range obs {
			wg.Add(1)
			go func() { defer wg.Done(); _ = ob.Run(runCtx) }()
		}
		waitFor(t, "the drain", func() bool { return e.pendingEffects() == 0 })
		stop()
		wg.Wait()
		pub.mu.Lock()
		mustEqual(t, fmt.Sprintf("%d instances: messages sent twice", instances), pub.dups, 0)
		mustEqual(t, fmt.Sprintf("%d instances: messages out of key order", instances), pub.reorders, 0)
		mustEqual(t, fmt.Sprintf("%d instances: distinct messages", instances), len(pub.seen), n)
		pub.mu.Unlock()
	}
}
