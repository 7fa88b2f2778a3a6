package main

import (
	"context"
	"fmt"
	"math"
	"slices"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	wmw "github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/google/uuid"

	"github.com/watermill-outbox/outbox"
	"github.com/watermill-outbox/outbox/drivers/outboxpgx"
)

// aggregate sums the runs of one contender at one concurrency over the repetitions.
type aggregate struct {
	contender, path string
	conc            int
	messages        int
	elapsed         time.Duration
	lat             []time.Duration
	wire            wireSnapshot
	wal             int64
	errors          int
	undelivered     int
	peakHeap        uint64
	resent          int64
	serverCPU       time.Duration // -1 once a run could not read it
	clientCPU       time.Duration
	allocs          uint64
}

func (a *aggregate) add(r runResult) {
	a.messages += r.Messages
	a.elapsed += r.Elapsed
	a.lat = append(a.lat, r.Latencies...)
	a.wire = a.wire.add(r.Wire)
	a.wal += r.WALBytes
	a.errors += r.Errors
	a.undelivered += r.Undelivered
	a.peakHeap = max(a.peakHeap, r.PeakHeap)
	a.resent += r.Published
	if r.ServerCPU < 0 || a.serverCPU < 0 {
		a.serverCPU = -1
	} else {
		a.serverCPU += r.ServerCPU
	}
	a.clientCPU += r.ClientCPU
	a.allocs += r.Allocs
}

func (a *aggregate) cell() cell {
	n := float64(a.messages)
	c := cell{
		Contender: a.contender, Path: a.path, Conc: a.conc, Messages: a.messages,
		Seconds:    a.elapsed.Seconds(),
		Throughput: n / a.elapsed.Seconds(),
		P50:        ms(pct(a.lat, 0.50)), P99: ms(pct(a.lat, 0.99)),
		RoundTrips: float64(a.wire.RoundTrips) / n, SyncRoundTrips: float64(a.wire.SyncRoundTrips) / n,
		Statements: float64(a.wire.Statements) / n,
		Parses:     float64(a.wire.Parses) / n, WALBytes: float64(a.wal) / n,
		Errors: a.errors, Undelivered: a.undelivered, PeakHeapMB: float64(a.peakHeap) / (1 << 20),
		Resent:      a.resent,
		ServerCPUus: -1, ClientCPUus: float64(a.clientCPU.Microseconds()) / n, Allocs: float64(a.allocs) / n,
	}
	if a.serverCPU >= 0 {
		c.ServerCPUus = float64(a.serverCPU.Microseconds()) / n
	}
	return c
}

func ms(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }

func pct(lat []time.Duration, p float64) time.Duration {
	s := slices.Clone(lat)
	slices.Sort(s)
	return percentile(s, p)
}

// safety runs c once with duplicates (consumer path) and one crash, and counts what it let
// through: business changes applied twice, outgoing messages lost, and copies on the wire.
func (e *env) safety(ctx context.Context, c contender, cfg config, conc int, seed uint64) (safetyRow, error) {
	rate := cfg.DupRate
	if c.path() == "boundary" {
		rate = 0 // a boundary call has no incoming message ID to deduplicate
	}
	ds := makeDeliveries(cfg.SafetyN, rate, 1, cfg.DupWindow, seed)
	crash := ""
	for _, d := range ds[len(ds)/3:] {
		if !d.dup {
			crash = d.id
			break
		}
	}
	stock0, err := stockSum(ctx, e.admin)
	if err != nil {
		return safetyRow{}, err
	}
	res, err := e.run(ctx, c, ds, runOpts{conc: conc, keepSrc: true, crashID: crash, drainWait: 30 * time.Second})
	if err != nil {
		return safetyRow{}, err
	}
	row := safetyRow{Contender: c.name(), Path: c.path(), Safe: c.safe(), CrashPoint: c.crashPoint(),
		Deliveries: len(ds), Crashes: res.Crashes, DupsApplicable: rate > 0,
		Throughput: float64(res.Messages) / res.Elapsed.Seconds(), P99: ms(pct(res.Latencies, 0.99))}
	uniq := map[string]bool{}
	for _, d := range ds {
		if d.dup {
			row.InjectedDups++
		}
		uniq[d.id] = true
	}
	row.Unique = len(uniq)
	row.Undelivered = res.Undelivered
	if c.name() == "watermill-stack" {
		// The built-in Deduplicator's default key is an Adler-32 of the payload: distinct messages
		// whose payloads collide are dropped as duplicates.
		hash := wmw.NewMessageHasherAdler32(math.MaxInt64)
		seen := map[string]string{}
		for _, d := range ds {
			k, err := hash(message.NewMessage(d.id, d.payload))
			if err != nil {
				return row, err
			}
			if prev, ok := seen[k]; ok && prev != d.id {
				row.HashCollisions++
			}
			seen[k] = d.id
		}
	}
	applied, extra, err := appliedCounts(ctx, appliedDB(e, c), stock0)
	if err != nil {
		return row, err
	}
	if rate > 0 {
		row.DupApplied += extra
	}
	rr := e.lastRecord
	for id := range uniq {
		n := applied[id]
		if n > 1 && rate > 0 {
			row.DupApplied += n - 1
		}
		if n == 0 {
			row.Lost++ // the business change never happened
			continue
		}
		copies := rr.bySrc[id]
		if len(copies) == 0 {
			row.Lost++ // committed, never published
			continue
		}
		total := 0
		for _, k := range copies {
			total += k
		}
		if c.path() == "boundary" {
			// Every call is its own source: copies are re-sends of one call's message.
			row.ResentSameID += total - len(copies)
			row.CopiesNewID += len(copies) - n
			continue
		}
		row.ResentSameID += total - len(copies)
		row.CopiesNewID += len(copies) - 1
	}
	return row, nil
}

// prefill fills the processed table of an outbox with n claims of consumer "bench", random UUIDs,
// processed and dispatched age ago. The primary key is dropped during the load and rebuilt.
func (e *env) prefill(ctx context.Context, prefix string, n int, age string) error {
	t0 := time.Now()
	stmts := []string{
		`ALTER TABLE ` + prefix + `processed DROP CONSTRAINT ` + prefix + `processed_pkey`,
		fmt.Sprintf(`INSERT INTO %sprocessed (consumer, message_id, processed_at, dispatched_at)
			SELECT 'bench', gen_random_uuid()::text, now() - interval '%s', now() - interval '%s' FROM generate_series(1, %d)`, prefix, age, age, n),
		`ALTER TABLE ` + prefix + `processed ADD PRIMARY KEY (consumer, message_id)`,
		`VACUUM ANALYZE ` + prefix + `processed`,
		`CHECKPOINT`,
	}
	for _, s := range stmts {
		if _, err := e.admin.ExecContext(ctx, s); err != nil {
			return fmt.Errorf("prefill %s: %w", prefix, err)
		}
	}
	logf("prefilled %sprocessed with %d rows (%s old) in %.1f s", prefix, n, age, time.Since(t0).Seconds())
	return nil
}

// retainedForm is one form of the framework in the retained-IDs run: labels of its rows and the
// prefix of its prefilled tables.
type retainedForm struct {
	name              string // the matrix contender it is
	empty, retained   string // labels of its rows
	ordered           string // label of the row on the retained table with time-ordered message IDs
	bigPrefix         string
	build             func(prefix string) (*framework, error)
	defaultEmptyTable string
}

// retainedForms are the two forms of the framework the retained-IDs run measures: the
// database/sql form (its rows keep the labels of the report before the pgx form ran here) and
// the pgx form.
func (e *env) retainedForms() []retainedForm {
	return []retainedForm{
		{name: "outbox-middleware", empty: "empty", retained: "retained", ordered: "retained-ordered", bigPrefix: "big_", defaultEmptyTable: "outbox_",
			build: func(prefix string) (*framework, error) { return newFramework(e, false, prefix) }},
		{name: "outbox-pgx", empty: "empty-pgx", retained: "retained-pgx", ordered: "retained-ordered-pgx", bigPrefix: "bigx_", defaultEmptyTable: "pgx_",
			build: func(prefix string) (*framework, error) { return newFrameworkPgx(e, prefix, outboxpgx.Optimistic) }},
	}
}

// scaleRetained compares the consumer path of each form on an empty dedup table with the same on a
// table that retains cfg.Retained IDs, interleaved. The empty one is the matrix's contender when
// it ran (cs), else one built here.
func (e *env) scaleRetained(ctx context.Context, cfg config, cs []contender, rep *report) error {
	rep.Scale.Retained = cfg.Retained
	type pair struct {
		f          retainedForm
		empty, big *framework
	}
	var pairs []pair
	defer func() {
		for _, p := range pairs {
			p.big.close()
		}
	}()
	for _, f := range e.retainedForms() {
		var empty *framework
		for _, c := range cs {
			if fw, ok := unwrap(c).(*framework); ok && fw.name() == f.name {
				empty = fw
			}
		}
		if empty == nil {
			fw, err := f.build(f.defaultEmptyTable)
			if err != nil {
				return err
			}
			defer fw.close()
			empty = fw
		}
		big, err := f.build(f.bigPrefix)
		if err != nil {
			return err
		}
		pairs = append(pairs, pair{f: f, empty: empty, big: big})
		if err := e.prefill(ctx, f.bigPrefix, cfg.Retained, "1 day"); err != nil {
			return err
		}
		var size int64
		_ = e.admin.QueryRowContext(ctx, `SELECT pg_total_relation_size('`+f.bigPrefix+`processed')`).Scan(&size)
		rep.Scale.TableMB = max(rep.Scale.TableMB, float64(size)/(1<<20))
	}
	aggs := map[string]*aggregate{}
	perRep := cfg.ScaleN / cfg.Reps
	k := 0
	for r := 0; r < cfg.Reps; r++ {
		for ci, conc := range cfg.ScaleConcs {
			ds := makeDeliveries(perRep, cfg.DupRate, redeliveryGap(conc), cfg.DupWindow, 7_000_000+uint64(r*100+ci))
			type step struct {
				f       *framework
				label   string
				big     bool
				ordered bool // the deliveries' IDs time-ordered
			}
			var runs []step
			for _, p := range pairs {
				runs = append(runs, step{p.empty, p.f.empty, false, false}, step{p.big, p.f.retained, true, false},
					step{p.big, p.f.ordered, true, true})
			}
			for j := range runs {
				st := runs[(j+k)%len(runs)]
				f, label, run := st.f, st.label, ds
				if st.ordered {
					run = timeOrdered(ds)
				}
				e.stmts.statements(ctx, "before")
				res, err := e.run(ctx, f, run, runOpts{conc: conc, noReset: st.big, redelivered: true, drainWait: 30 * time.Second})
				if err != nil {
					return err
				}
				e.stmts.statements(ctx, fmt.Sprintf("%s c=%d", label, conc))
				key := fmt.Sprintf("%s/%d", label, conc)
				if aggs[key] == nil {
					aggs[key] = &aggregate{contender: label, path: f.name(), conc: conc}
				}
				aggs[key].add(res)
				logf("scale %-12s c=%-2d %7.0f msg/s  p99 %7.2f ms  WAL %5.0f B/msg", label, conc, float64(res.Messages)/res.Elapsed.Seconds(),
					ms(pct(res.Latencies, 0.99)), float64(res.WALBytes)/float64(res.Messages))
			}
			k++
		}
	}
	for _, conc := range cfg.ScaleConcs {
		for _, p := range pairs {
			for _, label := range []string{p.f.empty, p.f.retained, p.f.ordered} {
				rep.Scale.Rows = append(rep.Scale.Rows, aggs[fmt.Sprintf("%s/%d", label, conc)].cell())
			}
		}
	}
	return nil
}

// scaleCleanup measures the consumer path before, during and after the retention cleanup of
// cfg.Expired expired claims, which Outbox.Run would do (Store.Cleanup with the default batch).
func (e *env) scaleCleanup(ctx context.Context, cfg config, rep *report) error {
	f, err := newFramework(e, false, "clean_")
	if err != nil {
		return err
	}
	defer f.close()
	f.noRun = true
	if err := e.prefill(ctx, "clean_", cfg.Expired, "30 days"); err != nil {
		return err
	}
	rep.Cleanup.Expired = cfg.Expired
	rep.Cleanup.Conc = cfg.CleanupC
	phase := func(name string, ds []delivery, stopAt *atomic.Bool) (runResult, error) {
		res, err := e.run(ctx, f, ds, runOpts{conc: cfg.CleanupC, noReset: true, stopAt: stopAt, redelivered: true, drainWait: 30 * time.Second})
		if err != nil {
			return res, err
		}
		a := &aggregate{contender: name, conc: cfg.CleanupC}
		a.add(res)
		rep.Cleanup.Rows = append(rep.Cleanup.Rows, a.cell())
		logf("cleanup %-7s %7.0f msg/s  p50 %6.2f ms  p99 %7.2f ms (%d messages)", name, float64(res.Messages)/res.Elapsed.Seconds(),
			ms(pct(res.Latencies, 0.5)), ms(pct(res.Latencies, 0.99)), res.Messages)
		return res, nil
	}
	if _, err := phase("before", makeDeliveries(cfg.CleanupN, cfg.DupRate, redeliveryGap(cfg.CleanupC), cfg.DupWindow, 8_000_001), nil); err != nil {
		return err
	}
	var done atomic.Bool
	var cleanupErr error
	var res outbox.CleanupResult
	var took time.Duration
	finished := make(chan struct{})
	go func() {
		defer close(finished)
		// Let the consumers get going first.
		time.Sleep(200 * time.Millisecond)
		t0 := time.Now()
		// One pass as Outbox.Run makes it: default retention, batches of 1000, the default pause.
		res, cleanupErr = f.ob.Cleanup(ctx)
		took = time.Since(t0)
		done.Store(true)
	}()
	if _, err := phase("during", makeDeliveries(max(50*cfg.CleanupN, 200_000), cfg.DupRate, redeliveryGap(cfg.CleanupC), cfg.DupWindow, 8_000_002), &done); err != nil {
		return err
	}
	<-finished
	if cleanupErr != nil {
		return cleanupErr
	}
	rep.Cleanup.Deleted = res.Claims
	rep.Cleanup.Seconds = took.Seconds()
	logf("cleanup deleted %d claims in %.1f s", res.Claims, took.Seconds())
	_, err = phase("after", makeDeliveries(cfg.CleanupN, cfg.DupRate, redeliveryGap(cfg.CleanupC), cfg.DupWindow, 8_000_003), nil)
	return err
}

// memoryCheck runs the consumer path with n and 4n messages and reports the live heap (after a
// forced GC) at 10%, 50% and 90% of each run. The harness allocates its per-delivery arrays before
// the run starts, so what grows during a run is the framework's (or a leak).
func (e *env) memoryCheck(ctx context.Context, cfg config, mw *framework, rep *report) error {
	for i, n := range []int{cfg.MemN, 4 * cfg.MemN} {
		res, err := e.run(ctx, mw, makeDeliveries(n, cfg.DupRate, redeliveryGap(4), cfg.DupWindow, 9_000_000+uint64(i)),
			runOpts{conc: 4, redelivered: true, memProbe: true, drainWait: 30 * time.Second})
		if err != nil {
			return err
		}
		row := memRow{Messages: n, PeakHeapMB: float64(res.PeakHeap) / (1 << 20)}
		for _, h := range res.LiveHeap {
			row.LiveMB = append(row.LiveMB, float64(h)/(1<<20))
		}
		rep.Memory = append(rep.Memory, row)
		logf("memory n=%d live heap at 10/50/90%%: %.2f MB; peak %.1f MB", n, row.LiveMB, row.PeakHeapMB)
	}
	return nil
}

// timeOrdered returns ds with each message ID replaced by a time-ordered one (a version 7 UUID,
// made in the order of first appearance; copies keep their original's), as a producer that makes
// time-ordered IDs (outbox.NewUUID outside a unit of work, watermill.NewULID) sends them.
func timeOrdered(ds []delivery) []delivery {
	ids := make(map[string]string, len(ds))
	out := make([]delivery, len(ds))
	for i, d := range ds {
		id, ok := ids[d.id]
		if !ok {
			id = uuid.Must(uuid.NewV7()).String()
			ids[d.id] = id
		}
		d.id = id
		out[i] = d
	}
	return out
}
