package main

import (
	"context"
	"database/sql"
	"encoding/binary"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"runtime"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"

	"github.com/watermill-outbox/outbox"
	"github.com/watermill-outbox/outbox/internal/proccpu"
)

// env is what every contender shares: one database, one broker.
type env struct {
	dsn    string
	admin  *sql.DB
	broker *broker
	pub    message.Publisher
	// pooledDSN is the bench database through PgBouncer in transaction mode (the -pgbouncer
	// contenders); empty when PgBouncer could not start, for the reason in poolerErr.
	pooledDSN string
	poolerErr error
	// router: every contender is built behind a Watermill Router (-broker none; router.go).
	router bool
	// stmts logs the statements that took the server's time per scale run (OUTBOX_BENCH_PGSS).
	stmts *drainEnv
	// defaultGrace: the framework's contenders keep the default RelayGrace (the scaling run,
	// which crashes nothing), not the 2 s that keeps the crash checks short.
	defaultGrace bool
	// tune adjusts the framework's contenders' Config before outbox.New (the held-xmin run sets
	// Retention and CleanupInterval); nil leaves it as built.
	tune func(*outbox.Config)

	lastRecord *runRecord // the recorder of the last run with runOpts.keepSrc

	// postmaster is the server's postmaster PID (for its CPU time), 0 before the first run
	// looked it up, -1 when the server is not on this machine.
	postmaster int
}

// serverCPUNow is the server's CPU time so far, or ok false when the server is not on this
// machine.
func (e *env) serverCPUNow(ctx context.Context) (time.Duration, bool) {
	if e.postmaster == 0 {
		e.postmaster = -1
		if pm, err := proccpu.Postmaster(ctx, e.admin); err == nil {
			e.postmaster = pm
		}
	}
	if e.postmaster < 0 {
		return 0, false
	}
	d, err := proccpu.Server(e.postmaster)
	return d, err == nil
}

// relayGrace is the RelayGrace of the framework's contenders: 2 s, so that the crash checks do
// not wait 10 s for the relay, or the default (0) with defaultGrace.
func (e *env) relayGrace() time.Duration {
	if e.defaultGrace {
		return 0
	}
	return 2 * time.Second
}

// makeDeliveries returns n deliveries: n - round(n*dupRate) distinct messages, in order, and
// copies of randomly chosen ones, each placed minGap..minGap+window-1 positions after its
// original. With minGap 1 and enough consumers some copies are handled at the same time as their
// original (a producer that retried a publish, a consumer group rebalance); see also
// runOpts.redelivered. The same seed gives the same list.
func makeDeliveries(n int, dupRate float64, minGap, window int, seed uint64) []delivery {
	rng := rand.New(rand.NewPCG(seed, 0x6f757462))
	dups := int(float64(n)*dupRate + 0.5)
	uniq := n - dups
	type item struct {
		key float64
		d   delivery
	}
	items := make([]item, 0, n)
	for i := 0; i < uniq; i++ {
		var b [16]byte
		binary.LittleEndian.PutUint64(b[:8], rng.Uint64())
		binary.LittleEndian.PutUint64(b[8:], rng.Uint64())
		b[6] = b[6]&0x0f | 0x40
		b[8] = b[8]&0x3f | 0x80
		id := uuid.UUID(b).String()
		items = append(items, item{key: float64(i), d: delivery{id: id, payload: []byte(fmt.Sprintf(`{"order":%q,"n":%d}`, id, i))}})
	}
	for j := 0; j < dups; j++ {
		k := rng.IntN(uniq)
		orig := items[k].d
		items = append(items, item{key: float64(k+minGap+rng.IntN(window)) - 0.5 + rng.Float64()*0.25, d: delivery{id: orig.id, payload: orig.payload, dup: true}})
	}
	sort.SliceStable(items, func(a, b int) bool { return items[a].key < items[b].key })
	out := make([]delivery, n)
	first := map[string]int{}
	for i, it := range items {
		out[i] = it.d
		out[i].idx = i
		out[i].orig = -1
		if j, ok := first[it.d.id]; ok {
			out[i].orig = j
		} else {
			first[it.d.id] = i
		}
	}
	return out
}

// redeliveryGap is the least distance, in deliveries, between a message and its redelivered copy
// in the main runs: two rounds of the consumers plus 100 deliveries (tens of milliseconds here),
// standing for a broker's redelivery after an ack deadline, never concurrent with the original.
func redeliveryGap(conc int) int { return 2*conc + 100 }

// runResult is what one run of one contender at one concurrency measured.
type runResult struct {
	Contender   string
	Path        string
	Conc        int
	Messages    int
	Elapsed     time.Duration // until every delivery was handled and its outgoing message published
	Latencies   []time.Duration
	Wire        wireSnapshot
	WALBytes    int64
	Errors      int
	Crashes     int
	PeakHeap    uint64
	HeapRetain  int64
	Undelivered int      // outgoing messages a relay had not published when the run gave up waiting
	Published   int64    // outgoing messages published more than once for one delivery (re-sends)
	LiveHeap    []uint64 // with runOpts.memProbe: live heap (after a GC) at 10%, 50% and 90% of the run
	// ServerCPU is the server's CPU time over the run (every PostgreSQL process: backends,
	// WAL writer, checkpointer, autovacuum), -1 when the server is not on this machine.
	ServerCPU time.Duration
	// ClientCPU is this process's CPU time over the run (getrusage): the contender's, the
	// harness's and the null broker's or NATS's alike.
	ClientCPU time.Duration
	Allocs    uint64 // Go heap allocations over the run (runtime.MemStats.Mallocs)
}

type runOpts struct {
	conc      int
	keepSrc   bool          // record every outgoing (source, UUID): for the safety check
	crashID   string        // arm a crash for this message
	drainWait time.Duration // how long to wait for relays to publish what was committed
	stopAt    *atomic.Bool  // when set: workers stop taking deliveries once it is true
	noReset   bool          // keep the contender's tables (scale runs on a prefilled table)
	// redelivered holds a duplicate back until its original was handled (acked), as a broker
	// redelivers after an ack deadline; without it a copy may run at the same time as its original.
	redelivered bool
	memProbe    bool // measure the live heap during the run (three forced GCs)
}

func (e *env) walLSN(ctx context.Context) (string, error) {
	var lsn string
	err := e.admin.QueryRowContext(ctx, `SELECT pg_current_wal_lsn()::text`).Scan(&lsn)
	return lsn, err
}

func (e *env) walDiff(ctx context.Context, from, to string) (int64, error) {
	var n int64
	err := e.admin.QueryRowContext(ctx, `SELECT pg_wal_lsn_diff($1::pg_lsn, $2::pg_lsn)::bigint`, to, from).Scan(&n)
	return n, err
}

// reset empties the business table and the contender's tables and the broker's stream, and
// checkpoints, so that every run starts from the same state.
func (e *env) reset(ctx context.Context, c contender, keepContender bool) error {
	tables := workloadTables()
	if !keepContender {
		tables = append(tables, c.tables()...)
	}
	for _, t := range tables {
		if _, err := e.admin.ExecContext(ctx, "TRUNCATE "+t); err != nil {
			return fmt.Errorf("truncate %s: %w", t, err)
		}
	}
	if err := e.broker.purge(); err != nil {
		return err
	}
	_, err := e.admin.ExecContext(ctx, "CHECKPOINT")
	return err
}

// run drives ds through c with opts.conc goroutines and measures it. Each goroutine takes the
// next delivery, calls the contender's handler and records the time from taking it until the
// outgoing message reached the broker (or until the handler returned, when nothing was published
// asynchronously). A simulated crash or an error puts the delivery back at the end of the queue,
// as a broker redelivers a nacked or unacked message.
func (e *env) run(ctx context.Context, c contender, ds []delivery, opts runOpts) (runResult, error) {
	res := runResult{Contender: c.name(), Path: c.path(), Conc: opts.conc, Messages: len(ds)}
	if err := e.reset(ctx, c, opts.noReset); err != nil {
		return res, err
	}
	if opts.crashID != "" {
		c.armCrash(opts.crashID)
	}
	if err := c.start(ctx); err != nil {
		return res, fmt.Errorf("%s: start: %w", c.name(), err)
	}
	runtime.GC()
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	heapBefore, mallocs0 := ms.HeapAlloc, ms.Mallocs
	cpu0, cpuOK := e.serverCPUNow(ctx)
	self0 := proccpu.Self()
	lsn0, err := e.walLSN(ctx)
	if err != nil {
		return res, err
	}
	wire0 := c.counters().snapshot()

	startAt := make([]int64, len(ds))
	doneAt := make([]atomic.Int64, len(ds))
	async := make([]bool, len(ds))
	var asyncN atomic.Int64
	var next atomic.Int64
	var mu sync.Mutex
	var again []delivery // redeliveries
	var errs, crashes atomic.Int64
	var lastErr atomic.Pointer[error] // errors of different types: an atomic.Value panics on the second
	var handled atomic.Int64

	stopSampler := make(chan struct{})
	var peak atomic.Uint64
	go func() {
		t := time.NewTicker(20 * time.Millisecond)
		defer t.Stop()
		var m runtime.MemStats
		for {
			select {
			case <-stopSampler:
				return
			case <-t.C:
				runtime.ReadMemStats(&m)
				if m.HeapAlloc > peak.Load() {
					peak.Store(m.HeapAlloc)
				}
			}
		}
	}()

	probeDone := make(chan struct{})
	if opts.memProbe {
		go func() {
			defer close(probeDone)
			var m runtime.MemStats
			for _, frac := range []float64{0.1, 0.5, 0.9} {
				for handled.Load() < int64(frac*float64(len(ds))) {
					select {
					case <-stopSampler:
						return
					case <-time.After(time.Millisecond):
					}
				}
				runtime.GC()
				runtime.GC() // the heap profile is as of the last completed cycle
				runtime.ReadMemStats(&m)
				res.LiveHeap = append(res.LiveHeap, m.HeapAlloc-min(m.HeapAlloc, brokerHeap()))
			}
		}()
	} else {
		close(probeDone)
	}

	rr := e.broker.rec.begin(len(ds), opts.keepSrc)
	origin := rr.start
	var wg sync.WaitGroup
	for w := 0; w < opts.conc; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			gid := goroutineID()
			consumerGoroutines.Store(gid, true)
			defer consumerGoroutines.Delete(gid)
			for {
				if opts.stopAt != nil && opts.stopAt.Load() {
					return
				}
				var d delivery
				if i := next.Add(1) - 1; i < int64(len(ds)) {
					d = ds[i]
				} else {
					mu.Lock()
					if len(again) == 0 {
						mu.Unlock()
						if handled.Load() >= int64(len(ds)) {
							return
						}
						time.Sleep(time.Millisecond) // a redelivery may still come
						continue
					}
					d = again[0]
					again = again[1:]
					mu.Unlock()
				}
				if opts.redelivered && d.orig >= 0 {
					for t0 := time.Now(); doneAt[d.orig].Load() == 0 && time.Since(t0) < 10*time.Second; {
						time.Sleep(100 * time.Microsecond)
					}
				}
				if startAt[d.idx] == 0 {
					startAt[d.idx] = int64(time.Since(origin))
				}
				isAsync, err := c.handle(ctx, d)
				if errors.Is(err, errCrash) && c.path() == "boundary" {
					// A boundary call has no incoming message to redeliver: what it committed
					// is the relay's to publish.
					crashes.Add(1)
					c.restart()
					isAsync, err = true, nil
				}
				if err != nil {
					if errors.Is(err, errCrash) {
						crashes.Add(1)
						c.restart()
					} else {
						errs.Add(1)
						last := err
						lastErr.Store(&last)
						if errs.Load() > 100 {
							return
						}
					}
					mu.Lock()
					again = append(again, d)
					mu.Unlock()
					continue
				}
				doneAt[d.idx].Store(int64(time.Since(origin)))
				if isAsync {
					async[d.idx] = true
					asyncN.Add(1)
				}
				handled.Add(1)
			}
		}()
	}
	wg.Wait()
	handledAll := time.Since(origin)
	if errs.Load() > 100 {
		close(stopSampler)
		<-probeDone
		e.broker.rec.end()
		_ = c.stop()
		var last error
		if p := lastErr.Load(); p != nil {
			last = *p
		}
		return res, fmt.Errorf("%s: too many errors, last: %w", c.name(), last)
	}
	// Wait for the relays to publish everything that was committed for publishing later.
	deadline := time.Now().Add(opts.drainWait)
	for asyncN.Load() > 0 {
		missing := 0
		for i := range ds {
			if async[i] && rr.pubAt[i].Load() == 0 {
				missing++
			}
		}
		res.Undelivered = missing
		if missing == 0 || time.Now().After(deadline) {
			break
		}
		time.Sleep(2 * time.Millisecond)
	}
	end := handledAll
	n := int(handled.Load())
	res.Latencies = make([]time.Duration, 0, n)
	for i := range ds {
		fin := doneAt[i].Load()
		if fin == 0 {
			continue
		}
		if async[i] {
			if p := rr.pubAt[i].Load(); p != 0 {
				fin = p
				if d := time.Duration(p); d > end {
					end = d
				}
			}
		}
		res.Latencies = append(res.Latencies, time.Duration(fin-startAt[i]))
	}
	res.Elapsed = end
	close(stopSampler)
	<-probeDone
	// Background work after the last ack (relays, marks written in the background) still counts
	// towards the wire and WAL numbers, and what it publishes towards the copies.
	if err := c.stop(); err != nil {
		e.broker.rec.end()
		return res, fmt.Errorf("%s: stop: %w", c.name(), err)
	}
	e.broker.rec.end()
	res.Published = rr.count.Load()
	for i := range rr.pubAt {
		if rr.pubAt[i].Load() != 0 {
			res.Published--
		}
	}
	res.Wire = c.counters().snapshot().sub(wire0)
	res.ClientCPU = proccpu.Self() - self0
	res.ServerCPU = -1
	if cpu1, ok := e.serverCPUNow(ctx); ok && cpuOK {
		res.ServerCPU = cpu1 - cpu0
	}
	lsn1, err := e.walLSN(ctx)
	if err != nil {
		return res, err
	}
	if res.WALBytes, err = e.walDiff(ctx, lsn0, lsn1); err != nil {
		return res, err
	}
	runtime.GC()
	runtime.ReadMemStats(&ms)
	res.Allocs = ms.Mallocs - mallocs0
	res.PeakHeap = peak.Load()
	res.HeapRetain = int64(ms.HeapAlloc) - int64(heapBefore)
	res.Messages = n
	res.Errors = int(errs.Load())
	res.Crashes = int(crashes.Load())
	if opts.keepSrc {
		e.lastRecord = rr
	}
	return res, nil
}

func percentile(sorted []time.Duration, p float64) time.Duration {
	if len(sorted) == 0 {
		return 0
	}
	i := int(p*float64(len(sorted)-1) + 0.5)
	return sorted[i]
}

// brokerHeap estimates the live heap held by the in-process NATS server, from the heap profile
// (sampled, scaled as pprof scales it): its stream's block buffers grow with the stream, up to a
// cap, and are the broker's memory, not the framework's.
func brokerHeap() uint64 {
	var recs []runtime.MemProfileRecord
	n, _ := runtime.MemProfile(nil, false)
	for {
		recs = make([]runtime.MemProfileRecord, n+50)
		var ok bool
		if n, ok = runtime.MemProfile(recs, false); ok {
			recs = recs[:n]
			break
		}
	}
	rate := float64(runtime.MemProfileRate)
	var total float64
	for _, r := range recs {
		objs, bytes := r.InUseObjects(), r.InUseBytes()
		if objs <= 0 || bytes <= 0 || !inBroker(r.Stack()) {
			continue
		}
		scale := 1.0
		if rate > 1 {
			scale = 1 / (1 - math.Exp(-float64(bytes)/float64(objs)/rate))
		}
		total += float64(bytes) * scale
	}
	return uint64(total)
}

func inBroker(stack []uintptr) bool {
	frames := runtime.CallersFrames(stack)
	for {
		f, more := frames.Next()
		if strings.Contains(f.Function, "nats-server/v2/server.") {
			return true
		}
		if !more {
			return false
		}
	}
}
