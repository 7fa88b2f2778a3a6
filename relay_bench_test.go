package outbox_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"os"
	"slices"
	"strconv"
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
// three relay instances to a publisher that does nothing (OUTBOX_BENCH_PER_MESSAGE: that takes
// this long per message), and reports effects per second. OUTBOX_BENCH_RELAY_CONCURRENCY and
// OUTBOX_BENCH_RELAY_PAUSE set RelayConcurrency and RelayPauseFactor.
func BenchmarkRelayDrain(b *testing.B) {
	for _, instances := range []int{1, 3} {
		b.Run(fmt.Sprintf("instances=%d", instances), func(b *testing.B) {
			const n, keys = 30000, 300
			var total time.Duration
			for i := 0; i < b.N; i++ {
				b.StopTimer()
				e := newEnv(b, func(c *outbox.Config) { c.EffectRetention = 0 })
				if ff := os.Getenv("FF"); ff != "" {
					// A partitioned table has no storage of its own: each partition is set.
					for _, part := range []string{"outbox_effects /* partition 0 */", "outbox_effects_1", "outbox_effects_2"} {
						mustExec(b, e, `ALTER TABLE `+part+` SET (fillfactor = `+ff+`)`)
					}
				}
				backlog(b, e, n, keys)
				pub := &latencyPublisher{nullPublisher: newNullPublisher()}
				if v := os.Getenv("OUTBOX_BENCH_PER_MESSAGE"); v != "" {
					pub.perMessage, _ = time.ParseDuration(v)
				}
				pub.expectStoreOrder(b, e.db, "outbox_effects_all")
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
						if v := os.Getenv("OUTBOX_BENCH_RELAY_CONCURRENCY"); v != "" {
							c.RelayConcurrency, _ = strconv.Atoi(v)
						}
						if v := os.Getenv("OUTBOX_BENCH_RELAY_PAUSE"); v != "" {
							c.RelayPauseFactor, _ = strconv.ParseFloat(v, 64)
						}
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
		pub.expectStoreOrder(t, e.db, "outbox_effects_all")
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

// latencyPublisher is a nullPublisher behind a destination that takes perMessage for each
// message of a call (calls of different callers overlap, as on a broker connection that
// pipelines), and hangs on every call to topic hung until release is closed.
type latencyPublisher struct {
	*nullPublisher
	perMessage time.Duration
	hung       string
	release    chan struct{}
	// sentAt records, per UUID, when it was handed over; for the fairness benchmark.
	mu     sync.Mutex
	sentAt map[string]time.Time
}

func (p *latencyPublisher) Publish(topic string, msgs ...*message.Message) error {
	if topic == p.hung && p.hung != "" {
		<-p.release
		return errors.New("broker hung")
	}
	time.Sleep(time.Duration(len(msgs)) * p.perMessage)
	if p.sentAt != nil {
		now := time.Now()
		p.mu.Lock()
		for _, m := range msgs {
			if _, ok := p.sentAt[m.UUID]; !ok {
				p.sentAt[m.UUID] = now
			}
		}
		p.mu.Unlock()
	}
	return p.nullPublisher.Publish(topic, msgs...)
}

// BenchmarkRelayDrainLatency drains a backlog of effects on 300 ordering keys with one relay
// whose destination takes 0 or 1 ms per message, with RelayConcurrency 1, 8 and 32, and
// reports effects per second. OUTBOX_BENCH_RELAY_PAUSE sets RelayPauseFactor (default: the
// library's).
func BenchmarkRelayDrainLatency(b *testing.B) {
	for _, perMessage := range []time.Duration{0, time.Millisecond} {
		for _, conc := range []int{1, 8, 32} {
			n := 30000
			if perMessage > 0 && conc == 1 {
				n = 3000 // about 500 effects/s: keep it short
			}
			b.Run(fmt.Sprintf("per_message=%s/concurrency=%d", perMessage, conc), func(b *testing.B) {
				const keys = 300
				var total time.Duration
				for i := 0; i < b.N; i++ {
					b.StopTimer()
					e := newEnv(b, func(c *outbox.Config) { c.EffectRetention = 0 })
					backlog(b, e, n, keys)
					pub := &latencyPublisher{nullPublisher: newNullPublisher(), perMessage: perMessage}
					pub.expectStoreOrder(b, e.db, "outbox_effects_all")
					ob := e.newOutbox(func(c *outbox.Config) {
						c.Publisher = pub
						c.RelayGrace = time.Millisecond
						c.RelayInterval = 10 * time.Millisecond
						c.EffectRetention = 0
						c.RelayConcurrency = conc
						if v := os.Getenv("OUTBOX_BENCH_RELAY_PAUSE"); v != "" {
							c.RelayPauseFactor, _ = strconv.ParseFloat(v, 64)
						}
					})
					b.StartTimer()
					start := time.Now()
					runCtx, stop := context.WithCancel(context.Background())
					done := make(chan struct{})
					go func() { defer close(done); _ = ob.Run(runCtx) }()
					for pub.n.Load() < int64(n) {
						time.Sleep(2 * time.Millisecond)
					}
					total += time.Since(start)
					stop()
					<-done
					b.StopTimer()
					if pub.dups > 0 || pub.reorders > 0 {
						b.Fatalf("%d copies sent twice, %d out of order", pub.dups, pub.reorders)
					}
				}
				b.ReportMetric(float64(n*b.N)/total.Seconds(), "effects/s")
			})
		}
	}
}

// BenchmarkRelayFairness measures how long a fresh effect of topic B waits behind topic A, for a
// relay with the default settings: A with a backlog of 20,000 effects on 1,000 keys and a
// destination that takes 2 ms per call, or A hung (PublishTimeout 250 ms) with 200 effects on 80
// keys. B's 50 effects are committed after A's; it reports the p50 and p99 of B's wait from the
// start of the relay to its hand-over to the Publisher. OUTBOX_BENCH_RELAY_CONCURRENCY sets
// RelayConcurrency (default: the library's).
func BenchmarkRelayFairness(b *testing.B) {
	for _, scenario := range []string{"backlog", "hung"} {
		b.Run("a="+scenario, func(b *testing.B) {
			var waits []time.Duration
			for i := 0; i < b.N; i++ {
				b.StopTimer()
				e := newEnv(b, func(c *outbox.Config) { c.EffectRetention = 0 })
				pub := &latencyPublisher{nullPublisher: newNullPublisher(), sentAt: map[string]time.Time{}, release: make(chan struct{})}
				if scenario == "backlog" {
					backlog(b, e, 20000, 1000)
					pub.perMessage = 0
				} else {
					backlogTo(b, e, "out_a", 200, 80, 1)
					pub.hung = "out_a"
				}
				bIDs := backlogTo(b, e, "out_b", 50, 10, 5)
				var dest message.Publisher = pub
				if scenario == "backlog" {
					dest = &callLatency{next: pub, perCall: 2 * time.Millisecond}
				}
				ob := e.newOutbox(func(c *outbox.Config) {
					c.Publisher = dest
					c.PublishTimeout = 250 * time.Millisecond
					c.RelayGrace = time.Millisecond
					c.RelayInterval = 10 * time.Millisecond
					c.EffectRetention = 0
					if v := os.Getenv("OUTBOX_BENCH_RELAY_CONCURRENCY"); v != "" {
						c.RelayConcurrency, _ = strconv.Atoi(v)
					}
				})
				b.StartTimer()
				start := time.Now()
				runCtx, stop := context.WithCancel(context.Background())
				done := make(chan struct{})
				go func() { defer close(done); _ = ob.Run(runCtx) }()
				limit := time.Now().Add(time.Minute)
				for {
					pub.mu.Lock()
					got := 0
					for _, id := range bIDs {
						if _, ok := pub.sentAt[id]; ok {
							got++
						}
					}
					pub.mu.Unlock()
					if got == len(bIDs) || time.Now().After(limit) {
						break
					}
					time.Sleep(5 * time.Millisecond)
				}
				stop()
				<-done
				close(pub.release)
				b.StopTimer()
				pub.mu.Lock()
				for _, id := range bIDs {
					if t, ok := pub.sentAt[id]; ok {
						waits = append(waits, t.Sub(start))
					} else {
						waits = append(waits, time.Minute) // not sent: reported as a minute
					}
				}
				pub.mu.Unlock()
			}
			slices.Sort(waits)
			b.ReportMetric(waits[len(waits)/2].Seconds(), "B_p50_s")
			b.ReportMetric(waits[len(waits)*99/100].Seconds(), "B_p99_s")
		})
	}
}

// callLatency takes perCall for each call before it hands it on.
type callLatency struct {
	next    message.Publisher
	perCall time.Duration
}

func (p *callLatency) Publish(topic string, msgs ...*message.Message) error {
	time.Sleep(p.perCall)
	return p.next.Publish(topic, msgs...)
}

func (p *callLatency) Close() error { return nil }

// backlogTo commits n effects to topic on keys ordering keys ("topic-0", ...), perTx per
// transaction, left pending as by a crash after each commit, and returns their UUIDs.
func backlogTo(tb testing.TB, e *env, topic string, n, keys, perTx int) []string {
	tb.Helper()
	crashing := e.newOutbox(func(c *outbox.Config) { c.Failpoint = crashAfterCommit })
	var ids []string
	for i := 0; i < n; i += perTx {
		key := fmt.Sprintf("%s-%d", topic, i/perTx%keys)
		err := crashing.InTx(context.Background(), func(ctx context.Context, _ *sql.Tx) error {
			ctx = outbox.WithOrderingKey(ctx, key)
			var msgs []*message.Message
			for j := i; j < i+perTx && j < n; j++ {
				m := message.NewMessage(uuid.NewString(), []byte(key))
				ids = append(ids, m.UUID)
				msgs = append(msgs, m)
			}
			return outbox.Publish(ctx, topic, msgs...)
		})
		if err != nil && !errors.Is(err, outbox.ErrFailpoint) {
			tb.Fatal(err)
		}
	}
	return ids
}
