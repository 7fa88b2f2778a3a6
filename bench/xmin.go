package main

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"regexp"
	"slices"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/google/uuid"

	"github.com/watermill-outbox/outbox"
	"github.com/watermill-outbox/outbox/drivers/postgres"
)

// The held-xmin run (-mode xmin): a fixed offered load through one contender at a time, Run going
// (relay, cleanup, stats sampling), a null publisher; after a baseline a session holds
// REPEATABLE READ idle in transaction, so that nothing deleted or updated after its snapshot can
// be vacuumed, and the run measures what that costs: throughput, handle latency, the server's CPU
// per message, the background statements' time and blocks per call (pg_stat_statements), and the
// sizes of the outbox tables beside the business table's. A design that deletes what it queued
// pays for every dead version its scans pass; one that truncates or never deletes on the hot path
// should not. The hold is compared with the baseline of the same contender, by its last quarter:
// the cost of a hold grows with its length.

var (
	xminWarmupFlag    = flag.Duration("xmin-warmup", 30*time.Second, "-mode xmin: load before the baseline, not measured (the pools, caches and first cleanup settle)")
	xminBaselineFlag  = flag.Duration("xmin-baseline", 4*time.Minute, "-mode xmin: length of the baseline")
	xminHoldFlag      = flag.Duration("xmin-hold", 8*time.Minute, "-mode xmin: how long a session holds the xmin horizon (REPEATABLE READ, idle in transaction)")
	xminAfterFlag     = flag.Duration("xmin-after", 0, "-mode xmin: load after the hold is released (0: none)")
	xminRateFlag      = flag.Int("xmin-rate", 400, "-mode xmin: offered load, messages per second")
	xminInFlightFlag  = flag.Int("xmin-inflight", 8, "-mode xmin: most messages in flight")
	xminRetentionFlag = flag.Duration("xmin-retention", 2*time.Minute, "-mode xmin: the framework's Retention (claims older than this are deleted by cleanup during the run)")
	xminCleanupFlag   = flag.Duration("xmin-cleanup-interval", 20*time.Second, "-mode xmin: the framework's CleanupInterval")
	xminRotateFlag    = flag.Duration("xmin-rotate-every", 0, "-mode xmin: postgres.Driver.RotateEvery of the database/sql contenders (0: the driver's default)")
)

// xminContenders are the contenders of the held-xmin run by default: the boundary path, the pgx
// form in both modes and the database/sql consumer path; bare (no outbox) may be added as a
// control of the server's own cost of a hold.
var xminContenders = []string{"outbox-intx", "outbox-pgx-pessimistic", "outbox-middleware", "outbox-pgx"}

type xminConfig struct {
	Warmup, Baseline, Hold, After time.Duration
	Rate, InFlight                int
	Retention, CleanupInterval    time.Duration
	RotateEvery                   time.Duration `json:",omitempty"` // of the database/sql contenders; 0: the driver's default
	Contenders                    []string
}

// xminClass is a background or hot-path statement the run follows, told by its text.
type xminClass struct {
	Name string
	re   *regexp.Regexp
}

// xminClasses name the statements whose cost a hold may raise. The patterns match the texts the
// drivers send (drivers/postgres, drivers/outboxpgx, store/sql.go); the first that matches wins.
var xminClasses = []xminClass{
	// The emptying of the oldest partition (drivers/postgres/rotate.go): the probe and switch of
	// the rotation row, the lock, the count and move of what is still pending, the TRUNCATE.
	{"rotation", regexp.MustCompile(`(?is)effects_rotation|^\s*(TRUNCATE|LOCK TABLE)\b|^\s*WITH m AS \(DELETE FROM \S*_effects(_[12])?"? RETURNING|^\s*SELECT count\(\*\) FROM \(SELECT \S+ FROM \S*_effects(_[12])?"? LIMIT`)},
	{"relay claim", regexp.MustCompile(`(?is)^\s*WITH bounds AS MATERIALIZED`)},
	// The relay's mark of sent effect rows (deleted), and of effects sent from their claim
	// (cleared: the database/sql consumer path), also when the mark rides on the next claim (a
	// claim's own cost is not counted otherwise: the riding claim counts as a mark).
	{"mark", regexp.MustCompile(`(?is)^\s*WITH m AS \(DELETE FROM \S*_effects_all"? e\b|^\s*UPDATE \S*_processed"? p SET effects = NULL|^\s*WITH lk AS \(SELECT p\.message_id FROM \S*_processed"? p\b`)},
	{"cleanup batch", regexp.MustCompile(`(?is)^\s*WITH d AS \(DELETE FROM|^\s*DELETE FROM \S*_attempts\b`)},
	// The sample in one statement (StatsSampleFull) wraps StatsSample.
	{"stats sample", regexp.MustCompile(`(?is)^\s*(WITH est AS MATERIALIZED|SELECT s\.\*, d\.\*)`)},
	// The sweep of inline effects left in claims (drivers/postgres/inline.go).
	{"sweep", regexp.MustCompile(`(?is)swept_xid|p\.inline_xid >= \$1|SET inline_xid = NULL|SELECT min\(inline_xid\)`)},
}

// xminControl are transaction control and settings, tracked with track_utility so that the
// rotation's TRUNCATE is counted, but no work of their own: left out of the statement time per
// message (a COMMIT's time is mostly its wait for the WAL flush).
var xminControl = regexp.MustCompile(`(?i)^\s*(BEGIN|START|COMMIT|END|ROLLBACK|SAVEPOINT|RELEASE|SET|RESET|DISCARD|DEALLOCATE|PREPARE)\b`)

// xminStmt is one statement's counts over a window.
type xminStmt struct {
	Class    string  `json:",omitempty"`
	Query    string  // its first 240 characters
	Calls    int64   //
	TotalMs  float64 // total execution time
	Blocks   int64   // shared blocks hit + read
	Rows     int64
	MeanMs   float64 `json:"-"`
	BlocksPC float64 `json:"-"`
}

// xminClassStats is a class's sum over a window.
type xminClassStats struct {
	Calls   int64
	TotalMs float64
	Blocks  int64
}

func (c xminClassStats) meanMs() float64 {
	if c.Calls == 0 {
		return 0
	}
	return c.TotalMs / float64(c.Calls)
}

func (c xminClassStats) blocksPerCall() float64 {
	if c.Calls == 0 {
		return 0
	}
	return float64(c.Blocks) / float64(c.Calls)
}

// xminTable is a table's size at the end of a window.
type xminTable struct {
	Name       string
	HeapBytes  int64 // pg_table_size: heap, free space and visibility maps, TOAST
	IndexBytes int64
	Dead       int64 // n_dead_tup
}

// xminWindow is what one window of a contender's run measured.
type xminWindow struct {
	Name       string
	Seconds    float64
	Messages   int64
	Errors     int64
	Throughput float64 // messages per second
	P50, P99   float64 // handle, milliseconds
	// ServerCPUus is the server's CPU time per message in microseconds (/proc: every
	// PostgreSQL process), -1 when the server is not on this machine.
	ServerCPUus float64
	// ExecUs is pg_stat_statements' total execution time per message in microseconds (every
	// statement of the database): the server's time where /proc cannot tell it.
	ExecUs     float64
	Classes    map[string]xminClassStats
	Statements []xminStmt
	Tables     []xminTable
	// Rotations counts the TRUNCATEs of a partition of the effects table.
	Rotations int64
	// XminAgeXacts is age(backend_xmin) of the oldest session at the window's end: how many
	// transactions the horizon is behind.
	XminAgeXacts int64
}

// xminResult is one contender's run.
type xminResult struct {
	Contender string
	Prefix    string
	Windows   []xminWindow
}

type xminReport struct {
	Started  string
	Command  string
	Config   xminConfig
	Machine  machine
	CPUFrom  string
	Results  []xminResult
	Duration float64
}

func xminPresets(only string) xminConfig {
	cfg := xminConfig{Warmup: *xminWarmupFlag, Baseline: *xminBaselineFlag, Hold: *xminHoldFlag, After: *xminAfterFlag,
		Rate: *xminRateFlag, InFlight: *xminInFlightFlag, Retention: *xminRetentionFlag, CleanupInterval: *xminCleanupFlag,
		RotateEvery: *xminRotateFlag, Contenders: xminContenders}
	if only != "" {
		cfg.Contenders = strings.Split(only, ",")
	}
	return cfg
}

func (cfg xminConfig) command() string {
	rotate := ""
	if cfg.RotateEvery != 0 {
		rotate = " -xmin-rotate-every " + cfg.RotateEvery.String()
	}
	return fmt.Sprintf("cd bench && go run . -mode xmin -xmin-warmup %s -xmin-baseline %s -xmin-hold %s -xmin-after %s -xmin-rate %d -xmin-inflight %d -xmin-retention %s%s -contenders %s",
		cfg.Warmup, cfg.Baseline, cfg.Hold, cfg.After, cfg.Rate, cfg.InFlight, cfg.Retention, rotate, strings.Join(cfg.Contenders, ","))
}

// runXmin runs the held-xmin benchmark on every contender of cfg, one after the other on one
// server, and writes the results to resultsPath and the table of ratios to stdout.
func runXmin(cfg xminConfig, dsn, resultsPath string) error {
	if cfg.Rate <= 0 || cfg.InFlight <= 0 || cfg.Baseline <= 0 || cfg.Hold <= 0 {
		return errors.New("-xmin-rate, -xmin-inflight, -xmin-baseline and -xmin-hold must be positive")
	}
	began := time.Now()
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	rep := &xminReport{Started: began.UTC().Format(time.RFC3339), Command: cfg.command(), Config: cfg, Machine: machineInfo()}

	// track_utility: the rotation's TRUNCATE is a utility statement.
	extraSettings = append(extraSettings, "shared_preload_libraries=pg_stat_statements", "pg_stat_statements.track_utility=on")
	admin, benchDSN, closeDB, err := openBenchDatabase(ctx, dsn, "outbox_bench", &rep.Machine)
	if err != nil {
		return err
	}
	defer closeDB()
	if _, err := admin.ExecContext(ctx, `CREATE EXTENSION IF NOT EXISTS pg_stat_statements`); err != nil {
		return fmt.Errorf("pg_stat_statements (the server must load it: -dsn names a server without it?): %w", err)
	}
	if _, err := admin.ExecContext(ctx, `CREATE TABLE applied (message_id text NOT NULL)`); err != nil {
		return err
	}
	if err := setupWorkload(ctx, admin); err != nil {
		return err
	}
	b := newNullBroker()
	e := &env{dsn: benchDSN, admin: admin, broker: b, pub: b.publisher(), defaultGrace: true,
		tune: func(c *outbox.Config) {
			c.Retention = cfg.Retention
			c.CleanupInterval = cfg.CleanupInterval
			if d, ok := c.Driver.(postgres.Driver); ok && cfg.RotateEvery != 0 {
				d.RotateEvery = cfg.RotateEvery
				c.Driver = d
			}
		}}
	rep.CPUFrom = "pg_stat_statements total_exec_time (the server's processes are not readable in /proc)"
	if _, ok := e.serverCPUNow(ctx); ok {
		rep.CPUFrom = "/proc/<pid>/stat utime+stime of every PostgreSQL server process"
	}
	for _, name := range cfg.Contenders {
		if ctx.Err() != nil {
			return ctx.Err()
		}
		res, err := e.xminContender(ctx, cfg, name)
		if err != nil {
			return fmt.Errorf("%s: %w", name, err)
		}
		rep.Results = append(rep.Results, res)
		// Written after every contender, so that an interrupted run keeps what it measured.
		if err := writeResults(resultsPath, rep); err != nil {
			return err
		}
	}
	rep.Machine.LoadAtEnd = loadAverage()
	rep.Duration = time.Since(began).Seconds()
	printXmin(os.Stdout, rep)
	return writeResults(resultsPath, rep)
}

// renderXmin prints the table of a saved run (-mode xmin -render results-xmin.json).
func renderXmin(path string) error {
	b, err := os.ReadFile(path)
	if err != nil {
		return err
	}
	var r xminReport
	if err := json.Unmarshal(b, &r); err != nil {
		return fmt.Errorf("%s: %w", path, err)
	}
	printXmin(os.Stdout, &r)
	return nil
}

// xminLoad offers deliveries at a fixed rate to at most inFlight handlers at once, and records
// each handled one in the current window. When every handler is busy the next delivery waits:
// the offered load is then not met, which the window's throughput shows.
type xminLoad struct {
	mu   sync.Mutex
	lat  []time.Duration
	n    atomic.Int64
	errs atomic.Int64
	last atomic.Pointer[error]
}

func (l *xminLoad) take() (lat []time.Duration, n, errs int64) {
	l.mu.Lock()
	lat, l.lat = l.lat, make([]time.Duration, 0, len(l.lat))
	l.mu.Unlock()
	return lat, l.n.Swap(0), l.errs.Swap(0)
}

func (l *xminLoad) run(ctx context.Context, c contender, rate, inFlight int) {
	jobs := make(chan delivery)
	var wg sync.WaitGroup
	for range inFlight {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for d := range jobs {
				t0 := time.Now()
				_, err := c.handle(ctx, d)
				took := time.Since(t0)
				if err != nil {
					if ctx.Err() == nil {
						l.errs.Add(1)
						l.last.Store(&err)
					}
					continue
				}
				l.mu.Lock()
				l.lat = append(l.lat, took)
				l.mu.Unlock()
				l.n.Add(1)
			}
		}()
	}
	defer wg.Wait()
	defer close(jobs)
	interval := time.Second / time.Duration(rate)
	start := time.Now()
	for i := 0; ; i++ {
		if wait := time.Until(start.Add(time.Duration(i) * interval)); wait > 0 {
			select {
			case <-ctx.Done():
				return
			case <-time.After(wait):
			}
		}
		id := uuid.NewString()
		select {
		case <-ctx.Done():
			return
		case jobs <- delivery{idx: -1, id: id, payload: []byte(`{"order":"` + id + `"}`), orig: -1}:
		}
	}
}

// xminContender runs the phases on contender name: warm-up, baseline, hold (its first three
// quarters and its last one measured apart) and, with cfg.After, after the release.
func (e *env) xminContender(ctx context.Context, cfg xminConfig, name string) (xminResult, error) {
	res := xminResult{Contender: name}
	if _, err := e.admin.ExecContext(ctx, `TRUNCATE `+strings.Join(workloadTables(), ", ")); err != nil {
		return res, err
	}
	c, err := e.newContender(name)
	if err != nil {
		return res, err
	}
	defer c.close()
	if f, ok := unwrap(c).(*framework); ok {
		res.Prefix = f.prefix
	}
	for _, q := range []string{`VACUUM ANALYZE`, `CHECKPOINT`} {
		if _, err := e.admin.ExecContext(ctx, q); err != nil {
			return res, err
		}
	}
	if err := c.start(ctx); err != nil {
		return res, fmt.Errorf("start: %w", err)
	}
	stopped := false
	defer func() {
		if !stopped {
			_ = c.stop()
		}
	}()
	loadCtx, stopLoad := context.WithCancel(ctx)
	defer stopLoad()
	load := &xminLoad{}
	loadDone := make(chan struct{})
	go func() { defer close(loadDone); load.run(loadCtx, c, cfg.Rate, cfg.InFlight) }()
	defer func() { stopLoad(); <-loadDone }()

	sleep := func(d time.Duration) error {
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(d):
			return nil
		}
	}
	var cpu0 time.Duration
	var t0 time.Time
	begin := func() {
		_, _, _ = load.take()
		_, _ = e.admin.ExecContext(ctx, `SELECT pg_stat_statements_reset()`)
		cpu0, _ = e.serverCPUNow(ctx)
		t0 = time.Now()
	}
	end := func(window string) error {
		w, err := e.xminWindow(ctx, window, load, time.Since(t0), cpu0, res.Prefix)
		if err != nil {
			return err
		}
		res.Windows = append(res.Windows, w)
		logf("%-24s %-18s %6.0f msg/s  p50 %6.2f ms  p99 %7.2f ms  server %5.0f us/msg  exec %5.0f us/msg  xmin age %d  rotations %d%s",
			name, window, w.Throughput, w.P50, w.P99, w.ServerCPUus, w.ExecUs, w.XminAgeXacts, w.Rotations, xminErrNote(w, load))
		for _, cl := range xminClassNames() {
			if s, ok := w.Classes[cl]; ok {
				logf("    %-14s %7d calls  %8.2f ms/call  %9.0f blocks/call", cl, s.Calls, s.meanMs(), s.blocksPerCall())
			}
		}
		for _, st := range w.Statements[:min(len(w.Statements), 8)] {
			logf("    top: %-14s %7d calls %8.0f ms %8.2f ms/call %9.0f blocks/call  %s", st.Class, st.Calls, st.TotalMs, st.MeanMs, st.BlocksPC, st.Query[:min(len(st.Query), 120)])
		}
		var heap, idx int64
		for _, t := range w.Tables {
			if t.Name != "applied" {
				heap, idx = heap+t.HeapBytes, idx+t.IndexBytes
			}
		}
		logf("    outbox tables %s + indexes %s; %s", mib(heap), mib(idx), tableSummary(w.Tables))
		return nil
	}

	logf("%s: warm-up %s at %d msg/s, %d in flight", name, cfg.Warmup, cfg.Rate, cfg.InFlight)
	if err := sleep(cfg.Warmup); err != nil {
		return res, err
	}
	begin()
	if err := sleep(cfg.Baseline); err != nil {
		return res, err
	}
	if err := end("baseline"); err != nil {
		return res, err
	}

	holder, err := e.admin.Conn(ctx)
	if err != nil {
		return res, err
	}
	defer holder.Close()
	htx, err := holder.BeginTx(ctx, &sql.TxOptions{Isolation: sql.LevelRepeatableRead})
	if err != nil {
		return res, err
	}
	defer func() { _ = htx.Rollback() }()
	var one int
	if err := htx.QueryRowContext(ctx, `SELECT 1`).Scan(&one); err != nil {
		return res, fmt.Errorf("holding xmin: %w", err)
	}
	logf("%s: a session holds the xmin horizon for %s", name, cfg.Hold)
	// The hold is measured by quarters: the last one is compared with the baseline, and the four
	// tell a cost that grows with the hold's length from one that levels off.
	for q := 1; q <= 4; q++ {
		begin()
		if err := sleep(cfg.Hold*time.Duration(q)/4 - cfg.Hold*time.Duration(q-1)/4); err != nil {
			return res, err
		}
		if err := end(fmt.Sprintf("hold q%d", q)); err != nil {
			return res, err
		}
	}
	if err := htx.Rollback(); err != nil {
		return res, fmt.Errorf("releasing the hold: %w", err)
	}
	_ = holder.Close()
	if cfg.After > 0 {
		logf("%s: released", name)
		begin()
		if err := sleep(cfg.After); err != nil {
			return res, err
		}
		if err := end("after"); err != nil {
			return res, err
		}
	}
	stopLoad()
	<-loadDone
	stopped = true
	if err := c.stop(); err != nil {
		return res, fmt.Errorf("stop: %w", err)
	}
	return res, nil
}

func xminErrNote(w xminWindow, l *xminLoad) string {
	if w.Errors == 0 {
		return ""
	}
	s := fmt.Sprintf("  ERRORS %d", w.Errors)
	if p := l.last.Load(); p != nil {
		s += ": " + (*p).Error()
	}
	return s
}

// xminWindow reads what the window that began at cpu0 measured.
func (e *env) xminWindow(ctx context.Context, name string, load *xminLoad, elapsed, cpu0 time.Duration, prefix string) (xminWindow, error) {
	lat, n, errs := load.take()
	w := xminWindow{Name: name, Seconds: elapsed.Seconds(), Messages: n, Errors: errs, ServerCPUus: -1, Classes: map[string]xminClassStats{}}
	if cpu1, ok := e.serverCPUNow(ctx); ok && n > 0 {
		w.ServerCPUus = float64((cpu1 - cpu0).Microseconds()) / float64(n)
	}
	w.Throughput = float64(n) / elapsed.Seconds()
	slices.Sort(lat)
	w.P50, w.P99 = ms(percentile(lat, 0.5)), ms(percentile(lat, 0.99))

	rows, err := e.admin.QueryContext(ctx, `SELECT calls, total_exec_time, shared_blks_hit + shared_blks_read, rows, query
		FROM pg_stat_statements WHERE dbid = (SELECT oid FROM pg_database WHERE datname = current_database())
		ORDER BY total_exec_time DESC`)
	if err != nil {
		return w, fmt.Errorf("pg_stat_statements: %w", err)
	}
	var execMs float64
	for rows.Next() {
		var s xminStmt
		if err := rows.Scan(&s.Calls, &s.TotalMs, &s.Blocks, &s.Rows, &s.Query); err != nil {
			rows.Close()
			return w, err
		}
		if strings.Contains(s.Query, "pg_stat_statements") || strings.Contains(s.Query, "pg_table_size") ||
			strings.Contains(s.Query, "pg_stat_activity") && strings.Contains(s.Query, "age(") {
			continue // the harness's own
		}
		if !xminControl.MatchString(s.Query) {
			execMs += s.TotalMs
		}
		if strings.HasPrefix(strings.ToUpper(strings.TrimSpace(s.Query)), "TRUNCATE") {
			w.Rotations += s.Calls
		}
		for _, cl := range xminClasses {
			if cl.re.MatchString(s.Query) {
				s.Class = cl.Name
				break
			}
		}
		if s.Class != "" {
			cs := w.Classes[s.Class]
			cs.Calls += s.Calls
			cs.TotalMs += s.TotalMs
			cs.Blocks += s.Blocks
			w.Classes[s.Class] = cs
		}
		s.Query = strings.Join(strings.Fields(s.Query), " ")
		s.Query = s.Query[:min(len(s.Query), 240)]
		if s.Calls > 0 {
			s.MeanMs, s.BlocksPC = s.TotalMs/float64(s.Calls), float64(s.Blocks)/float64(s.Calls)
		}
		w.Statements = append(w.Statements, s)
	}
	rows.Close()
	if err := rows.Err(); err != nil {
		return w, err
	}
	if n > 0 {
		w.ExecUs = execMs * 1000 / float64(n)
	}
	w.Statements = w.Statements[:min(len(w.Statements), 12)]

	// Partitions are tables of their own (relkind r); the partitioned parents hold nothing.
	trows, err := e.admin.QueryContext(ctx, `SELECT c.relname, pg_table_size(c.oid), pg_indexes_size(c.oid), coalesce(s.n_dead_tup, 0)
		FROM pg_class c JOIN pg_namespace ns ON ns.oid = c.relnamespace
		LEFT JOIN pg_stat_user_tables s ON s.relid = c.oid
		WHERE ns.nspname = current_schema() AND c.relkind = 'r'
		  AND (c.relname = ANY($1) OR left(c.relname, length($2)) = $2)
		ORDER BY c.relname`, "{"+strings.Join(workloadTables(), ",")+"}", prefix)
	if err != nil {
		return w, fmt.Errorf("table sizes: %w", err)
	}
	defer trows.Close()
	for trows.Next() {
		var t xminTable
		if err := trows.Scan(&t.Name, &t.HeapBytes, &t.IndexBytes, &t.Dead); err != nil {
			return w, err
		}
		w.Tables = append(w.Tables, t)
	}
	if err := trows.Err(); err != nil {
		return w, err
	}
	_ = e.admin.QueryRowContext(ctx, `SELECT coalesce(max(age(backend_xmin)), 0) FROM pg_stat_activity WHERE backend_xmin IS NOT NULL`).Scan(&w.XminAgeXacts)
	return w, nil
}

func xminClassNames() []string {
	names := make([]string, len(xminClasses))
	for i, c := range xminClasses {
		names[i] = c.Name
	}
	return names
}

func mib(b int64) string { return fmt.Sprintf("%.1f MiB", float64(b)/(1<<20)) }

// tableSummary names each table with rows in it: heap + indexes, and its dead tuples.
func tableSummary(ts []xminTable) string {
	var parts []string
	for _, t := range ts {
		if t.HeapBytes+t.IndexBytes <= 16<<10 {
			continue
		}
		parts = append(parts, fmt.Sprintf("%s %s+%s (%d dead)", t.Name, mib(t.HeapBytes), mib(t.IndexBytes), t.Dead))
	}
	return strings.Join(parts, ", ")
}

// xminSizes is the outbox tables' size (heap + indexes) and the business tables'.
func xminSizes(w xminWindow) (outboxBytes, business int64) {
	for _, t := range w.Tables {
		if slices.Contains(workloadTables(), t.Name) {
			business += t.HeapBytes + t.IndexBytes
		} else {
			outboxBytes += t.HeapBytes + t.IndexBytes
		}
	}
	return outboxBytes, business
}

// xminLast is the window compared with the baseline: the last quarter of the hold.
const xminLast = "hold q4"

func (r xminResult) window(name string) (xminWindow, bool) {
	for _, w := range r.Windows {
		if w.Name == name {
			return w, true
		}
	}
	return xminWindow{}, false
}

func ratio(a, b float64) string {
	if b <= 0 || a < 0 {
		return "-"
	}
	return fmt.Sprintf("%.2fx", a/b)
}

// printXmin writes the table of ratios, the hold's last quarter against the baseline of the same
// contender, in Markdown.
func printXmin(out io.Writer, r *xminReport) {
	c := r.Config
	fmt.Fprintf(out, "\nheld xmin: %s hold (last quarter) vs %s baseline, %d msg/s offered, %d in flight, Retention %s; load %s -> %s; CPU from %s\n\n",
		c.Hold, c.Baseline, c.Rate, c.InFlight, c.Retention, r.Machine.LoadAtStart, r.Machine.LoadAtEnd, r.CPUFrom)
	head := "| hold, last quarter vs baseline |"
	sep := "|---|"
	for _, res := range r.Results {
		head += " " + res.Contender + " |"
		sep += "---|"
	}
	fmt.Fprintln(out, head)
	fmt.Fprintln(out, sep)
	type cell func(b, h xminWindow, res xminResult) string
	row := func(label string, f cell) {
		line := "| " + label + " |"
		for _, res := range r.Results {
			b, ok1 := res.window("baseline")
			h, ok2 := res.window(xminLast)
			if !ok1 || !ok2 {
				line += " - |"
				continue
			}
			line += " " + f(b, h, res) + " |"
		}
		fmt.Fprintln(out, line)
	}
	row("throughput", func(b, h xminWindow, _ xminResult) string {
		return fmt.Sprintf("%s (%.0f -> %.0f msg/s)", ratio(h.Throughput, b.Throughput), b.Throughput, h.Throughput)
	})
	row("handle p50", func(b, h xminWindow, _ xminResult) string {
		return fmt.Sprintf("%s (%.2f -> %.2f ms)", ratio(h.P50, b.P50), b.P50, h.P50)
	})
	row("handle p99", func(b, h xminWindow, _ xminResult) string {
		return fmt.Sprintf("%s (%.1f -> %.1f ms)", ratio(h.P99, b.P99), b.P99, h.P99)
	})
	row("server CPU per message", func(b, h xminWindow, _ xminResult) string {
		return fmt.Sprintf("%s (%.0f -> %.0f µs)", ratio(h.ServerCPUus, b.ServerCPUus), b.ServerCPUus, h.ServerCPUus)
	})
	row("statement time per message", func(b, h xminWindow, _ xminResult) string {
		return fmt.Sprintf("%s (%.0f -> %.0f µs)", ratio(h.ExecUs, b.ExecUs), b.ExecUs, h.ExecUs)
	})
	for _, cl := range xminClassNames() {
		row(cl+", mean per call", func(b, h xminWindow, _ xminResult) string {
			bs, ok1 := b.Classes[cl]
			hs, ok2 := h.Classes[cl]
			if !ok1 && !ok2 {
				return "(none)"
			}
			return fmt.Sprintf("%s (%.2f -> %.2f ms; %.0f -> %.0f blocks)", ratio(hs.meanMs(), bs.meanMs()), bs.meanMs(), hs.meanMs(), bs.blocksPerCall(), hs.blocksPerCall())
		})
	}
	row("rotations (TRUNCATE) per minute", func(b, h xminWindow, _ xminResult) string {
		return fmt.Sprintf("%.1f -> %.1f", float64(b.Rotations)*60/b.Seconds, float64(h.Rotations)*60/h.Seconds)
	})
	row("outbox tables' size, end of hold vs end of baseline", func(b, h xminWindow, _ xminResult) string {
		bo, _ := xminSizes(b)
		ho, _ := xminSizes(h)
		return fmt.Sprintf("%s (%s -> %s)", ratio(float64(ho), float64(bo)), mib(bo), mib(ho))
	})
	row("business table (control)", func(b, h xminWindow, _ xminResult) string {
		_, bb := xminSizes(b)
		_, hb := xminSizes(h)
		return fmt.Sprintf("%s (%s -> %s)", ratio(float64(hb), float64(bb)), mib(bb), mib(hb))
	})
	if c.After > 0 {
		row("after release: p99, CPU/msg, outbox size vs baseline", func(b, _ xminWindow, res xminResult) string {
			a, ok := res.window("after")
			if !ok {
				return "-"
			}
			bo, _ := xminSizes(b)
			ao, _ := xminSizes(a)
			return fmt.Sprintf("%s, %s, %s", ratio(a.P99, b.P99), ratio(a.ServerCPUus, b.ServerCPUus), ratio(float64(ao), float64(bo)))
		})
	}
	fmt.Fprintln(out)
	// Each class by quarter of the hold: a cost that levels off or one that keeps growing.
	for _, res := range r.Results {
		fmt.Fprintf(out, "%s, blocks per call (mean ms) in the baseline | hold q1 q2 q3 q4:\n", res.Contender)
		for _, cl := range xminClassNames() {
			line := fmt.Sprintf("  %-14s", cl)
			for _, wn := range []string{"baseline", "hold q1", "hold q2", "hold q3", "hold q4", "after"} {
				w, ok := res.window(wn)
				if !ok {
					continue
				}
				if wn == "hold q1" || wn == "after" {
					line += " |"
				}
				if s, ok := w.Classes[cl]; ok {
					line += fmt.Sprintf(" %.0f (%.2f)", s.blocksPerCall(), s.meanMs())
				} else {
					line += " -"
				}
			}
			fmt.Fprintln(out, line)
		}
		line := "  server CPU, µs/msg, per window:"
		for _, w := range res.Windows {
			line += fmt.Sprintf(" %.0f", w.ServerCPUus)
		}
		fmt.Fprintln(out, line)
	}
	fmt.Fprintln(out)
	// The tables that grew most, per contender.
	for _, res := range r.Results {
		b, ok1 := res.window("baseline")
		h, ok2 := res.window(xminLast)
		if !ok1 || !ok2 {
			continue
		}
		before := map[string]xminTable{}
		for _, t := range b.Tables {
			before[t.Name] = t
		}
		var lines []string
		for _, t := range h.Tables {
			bt := before[t.Name]
			if t.HeapBytes+t.IndexBytes <= 64<<10 {
				continue
			}
			lines = append(lines, fmt.Sprintf("%s heap %s -> %s, indexes %s -> %s", t.Name, mib(bt.HeapBytes), mib(t.HeapBytes), mib(bt.IndexBytes), mib(t.IndexBytes)))
		}
		sort.Strings(lines)
		fmt.Fprintf(out, "%s: %s\n", res.Contender, strings.Join(lines, "; "))
	}
}
