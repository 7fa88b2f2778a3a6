package main

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/watermill-outbox/outbox/drivers/outboxpgx"
	"github.com/watermill-outbox/outbox/internal/proccpu"
)

// The scaling run (-scaling): 1, 2, 4 and 8 consumer processes against one PostgreSQL, each
// process this program re-executed as a worker (-scaling-worker) with its own connection pool,
// its own Outbox (relay included) and a fixed number of messages in flight. Per process count
// and contender it measures the throughput of all processes together and, per message, the
// server's CPU time (utime + stime of every PostgreSQL server process, from /proc) and the WAL.
// The question it answers: does the database's work per message stay flat as consumers are
// added, or does something (contention on the claim table, the relays of many processes) make
// each message dearer?
//
// There is no broker: each worker publishes to a null publisher, so that the processes share
// only the database, and the machine's CPUs go to the server and the consumers.

// The flags of the scaling run; -mode, -dsn, -docs, -results, -render, -contenders, -n, -reps,
// -seed and -workload are the program's.
var (
	scalingFlag  = flag.Bool("scaling", false, "run the scaling benchmark instead: 1..8 consumer processes against one PostgreSQL (docs/scaling.md; results-scaling-<mode>.json)")
	procsFlag    = flag.String("procs", "", "-scaling: consumer process counts, comma-separated (default 1,2,4,8)")
	inFlightFlag = flag.Int("inflight", 0, "-scaling: messages in flight per consumer process (default 4)")
	tablesFlag   = flag.String("tables", "", "-scaling: Outboxes per process, each on its own TablePrefix, comma-separated (default 1,4; the framework's contenders only)")
	workerFlag   = flag.Bool("scaling-worker", false, "internal: be one consumer process of a -scaling step")
)

// scalingMain runs what the scaling flags ask for (a worker, a render or a run) and exits on an
// error; it tells whether it ran anything.
func scalingMain(mode, dsn, docs, results, render, only string, n, reps int, seed uint64) bool {
	var err error
	switch {
	case *workerFlag:
		tables, _ := strconv.Atoi(*tablesFlag)
		if err := scalingWorker(dsn, only, tables, n, *inFlightFlag, seed); err != nil {
			fmt.Fprintln(os.Stderr, "scaling worker:", err)
			os.Exit(1)
		}
		return true
	case *scalingFlag && render != "":
		var b []byte
		if b, err = os.ReadFile(render); err == nil {
			var r scalingReport
			if err = json.Unmarshal(b, &r); err == nil {
				err = writeScalingDocs(docs, &r)
			}
		}
	case *scalingFlag:
		var cfg scalingConfig
		if cfg, err = scalingPresets(mode); err != nil {
			break
		}
		if n > 0 {
			cfg.N = n
		}
		if reps > 0 {
			cfg.Reps = reps
		}
		if *inFlightFlag > 0 {
			cfg.InFlight = *inFlightFlag
		}
		if only != "" {
			cfg.Contenders = strings.Split(only, ",")
		}
		if *procsFlag != "" {
			if cfg.Procs, err = parseInts(*procsFlag); err != nil {
				break
			}
		}
		if *tablesFlag != "" {
			if cfg.Tables, err = parseInts(*tablesFlag); err != nil {
				break
			}
		}
		cfg.Workload = workload
		if results == "" {
			results = "results-scaling-" + cfg.Mode + ".json"
		}
		err = runScaling(cfg, dsn, docs, results)
	default:
		return false
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "error:", err)
		os.Exit(1)
	}
	return true
}

// parseInts parses a comma-separated list of positive integers.
func parseInts(s string) ([]int, error) {
	var out []int
	for _, f := range strings.Split(s, ",") {
		v, err := strconv.Atoi(strings.TrimSpace(f))
		if err != nil || v < 1 {
			return nil, fmt.Errorf("bad list %q: want positive integers separated by commas", s)
		}
		out = append(out, v)
	}
	return out, nil
}

type scalingConfig struct {
	Mode       string
	Procs      []int // consumer processes per step
	InFlight   int   // messages in flight per process (its consumer goroutines)
	N          int   // messages per step, over all its processes
	Reps       int
	Contenders []string
	Workload   string
	// Tables are the numbers of Outboxes per process (each on its own TablePrefix) to measure the
	// framework's contenders with; the bare ones run with one.
	Tables []int `json:",omitempty"`
}

func scalingPresets(mode string) (scalingConfig, error) {
	c := scalingConfig{Mode: mode, Procs: []int{1, 2, 4, 8}, InFlight: 4, Tables: []int{1, 4}, Contenders: []string{"bare-pgx", "outbox-pgx", "bare", "outbox-middleware"}}
	switch mode {
	case "quick":
		c.N, c.Reps = 3000, 2
	case "full":
		c.N, c.Reps = 20000, 3
	default:
		return c, fmt.Errorf("unknown -mode %q (quick or full)", mode)
	}
	return c, nil
}

// scalingRow is one contender at one process count, summed over the repetitions.
type scalingRow struct {
	Contender string
	Procs     int
	InFlight  int
	// Tables is the number of Outboxes in each process, each on its own tables (TablePrefix),
	// the process's consumers spread over them.
	Tables   int `json:",omitempty"`
	Messages int
	Seconds  float64 // from the start signal to the last process's last message, summed over repetitions
	// Throughput is the messages of all processes over Seconds.
	Throughput float64
	P50, P99   float64 // ms, over every message of every process
	// ServerCPUus is the server's CPU time per message, in microseconds: utime + stime of the
	// postmaster and every process it forked (backends, WAL writer, checkpointer, autovacuum),
	// exited ones included (their times are added to the postmaster's when it reaps them).
	ServerCPUus float64
	// ClientCPUus is the consumer processes' CPU time per message (getrusage in each, over its
	// timed part only).
	ClientCPUus float64
	WALBytes    float64 // per message
	// IdleServerMs is the server's CPU time per second, in ms, in the second before the start
	// signal, the processes connected and their relays running: the background cost of
	// the processes' Outboxes (relay polls, sweeps), which the per-message numbers include
	// for the step's duration.
	IdleServerMs float64
	Errors       int
}

type scalingReport struct {
	Mode        string
	Config      scalingConfig
	Started     string
	DurationSec float64
	Machine     machine
	Rows        []scalingRow
	Notes       []string
}

// workerResult is what a worker prints when its timed part is over.
type workerResult struct {
	Messages  int
	Errors    int
	Seconds   float64
	CPUus     int64     // this process's user + system CPU time over the timed part
	Latencies []float64 // ms, one per message
}

// runScaling runs the scaling steps and writes docs/scaling.md (between its markers) and the
// results JSON.
func runScaling(cfg scalingConfig, dsn, docsDir, resultsPath string) error {
	began := time.Now()
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	rep := &scalingReport{Mode: cfg.Mode, Config: cfg, Started: began.UTC().Format(time.RFC3339), Machine: machineInfo()}
	// OUTBOX_BENCH_PGSS: log, per step, the statements that took the server's time (as -drain does).
	pgss := os.Getenv("OUTBOX_BENCH_PGSS") != ""
	if pgss {
		extraSettings = append(extraSettings, "shared_preload_libraries=pg_stat_statements", "pg_stat_statements.track_utility=off")
	}
	admin, benchDSN, closeDB, err := openBenchDatabase(ctx, dsn, "outbox_scaling", &rep.Machine)
	if err != nil {
		return err
	}
	defer closeDB()
	if _, err := admin.ExecContext(ctx, `CREATE TABLE applied (message_id text NOT NULL)`); err != nil {
		return err
	}
	if err := setupWorkload(ctx, admin); err != nil {
		return err
	}
	stmts := &drainEnv{admin: admin, pgss: pgss}
	if pgss {
		if _, err := admin.ExecContext(ctx, `CREATE EXTENSION IF NOT EXISTS pg_stat_statements`); err != nil {
			return err
		}
	}
	postmaster, err := proccpu.Postmaster(ctx, admin)
	if err != nil {
		rep.Notes = append(rep.Notes, fmt.Sprintf("server CPU not measured: %v", err))
		logf("server CPU not measured: %v", err)
	}

	// The contenders' tables, migrated once here: the workers share them, as the replicas of one
	// service do.
	b := newNullBroker()
	e := &env{dsn: benchDSN, admin: admin, broker: b, pub: b.publisher(), defaultGrace: true}
	var cs []scalingSubject
	defer func() {
		for _, c := range cs {
			for _, o := range c.set {
				o.close()
			}
		}
	}()
	for _, name := range cfg.Contenders {
		if err := checkWorkload(name); err != nil {
			return err
		}
		for _, t := range cfg.Tables {
			if t > 1 && !strings.HasPrefix(name, "outbox-") {
				continue
			}
			set, err := newContenderSet(e, name, t)
			if err != nil {
				return fmt.Errorf("%s: %w", name, err)
			}
			cs = append(cs, scalingSubject{name: name, tables: t, set: set})
		}
	}
	self, err := os.Executable()
	if err != nil {
		return err
	}

	aggs := map[string]*scalingAgg{}
	k := 0
	for r := 0; r < cfg.Reps; r++ {
		for _, procs := range cfg.Procs {
			for j := range cs {
				c := cs[(j+k)%len(cs)]
				if ctx.Err() != nil {
					return ctx.Err()
				}
				stmts.statements(ctx, "before") // resets the counts
				st, err := e.scalingStep(ctx, self, benchDSN, cfg, c, procs, postmaster, uint64(r*10_000+procs*100+j))
				if err != nil {
					return fmt.Errorf("%s with %d processes: %w", c.label(), procs, err)
				}
				key := fmt.Sprintf("%s/%d", c.label(), procs)
				if aggs[key] == nil {
					aggs[key] = &scalingAgg{}
				}
				aggs[key].add(st)
				logf("scaling rep %d %-18s procs %d x %d in flight: %6.0f msg/s  p99 %6.2f ms  server CPU %5.0f us/msg  client CPU %5.0f us/msg  WAL %5.0f B/msg%s",
					r+1, c.label(), procs, cfg.InFlight, float64(st.messages)/st.seconds, ms(pct(st.lat, 0.99)),
					float64(st.serverCPU.Microseconds())/float64(st.messages), float64(st.clientCPUus)/float64(st.messages),
					float64(st.wal)/float64(st.messages), map[bool]string{true: fmt.Sprintf("  errors %d", st.errors), false: ""}[st.errors > 0])
				stmts.statements(ctx, fmt.Sprintf("%s x%d", c.label(), procs))
			}
			k++
		}
	}
	for _, c := range cs {
		for _, procs := range cfg.Procs {
			if a := aggs[fmt.Sprintf("%s/%d", c.label(), procs)]; a != nil {
				row := a.row(c.name, procs, cfg.InFlight, postmaster > 0)
				row.Tables = c.tables
				rep.Rows = append(rep.Rows, row)
			}
		}
	}
	rep.Machine.LoadAtEnd = loadAverage()
	rep.DurationSec = time.Since(began).Seconds()
	logf("done in %.0f s", rep.DurationSec)
	printScaling(os.Stdout, rep)
	if err := writeResults(resultsPath, rep); err != nil {
		return err
	}
	return writeScalingDocs(docsDir, rep)
}

// stepResult is one step: one contender with procs processes.
type stepResult struct {
	messages    int
	errors      int
	seconds     float64
	lat         []time.Duration
	serverCPU   time.Duration
	idleCPU     time.Duration // over idleWindow
	clientCPUus int64
	wal         int64
}

// idleWindow is how long a step measures the server's CPU with its processes connected and idle.
const idleWindow = time.Second

type scalingAgg struct {
	st        stepResult
	stepCount int
}

func (a *scalingAgg) add(s stepResult) {
	a.st.messages += s.messages
	a.st.errors += s.errors
	a.st.seconds += s.seconds
	a.st.lat = append(a.st.lat, s.lat...)
	a.st.serverCPU += s.serverCPU
	a.st.idleCPU += s.idleCPU
	a.st.clientCPUus += s.clientCPUus
	a.st.wal += s.wal
	a.stepCount++
}

func (a *scalingAgg) row(name string, procs, inFlight int, cpuKnown bool) scalingRow {
	n := float64(a.st.messages)
	row := scalingRow{Contender: name, Procs: procs, InFlight: inFlight, Messages: a.st.messages, Seconds: a.st.seconds,
		Throughput: n / a.st.seconds, P50: ms(pct(a.st.lat, 0.5)), P99: ms(pct(a.st.lat, 0.99)),
		ClientCPUus: float64(a.st.clientCPUus) / n, WALBytes: float64(a.st.wal) / n, Errors: a.st.errors}
	if cpuKnown {
		row.ServerCPUus = float64(a.st.serverCPU.Microseconds()) / n
		row.IdleServerMs = ms(a.st.idleCPU) / float64(a.stepCount) / idleWindow.Seconds()
	}
	return row
}

// scalingSubject is a contender of the scaling run with its number of Outboxes per process: the
// parent's instances, which migrated their tables and are used to empty them.
type scalingSubject struct {
	name   string
	tables int
	set    []contender
}

func (s scalingSubject) label() string {
	if s.tables > 1 {
		return fmt.Sprintf("%s x%d tables", s.name, s.tables)
	}
	return s.name
}

// newContenderSet builds n instances of contender name: the first as newContender does, the
// others (the framework's contenders only) each on its own TablePrefix.
func newContenderSet(e *env, name string, n int) ([]contender, error) {
	var set []contender
	for i := range n {
		var c contender
		var err error
		prefix := fmt.Sprintf("t%d_", i)
		switch {
		case i == 0:
			c, err = newContender(e, name)
		case name == "outbox-pgx":
			c, err = newFrameworkPgx(e, "pgx"+prefix, outboxpgx.Optimistic)
		case name == "outbox-pgx-pessimistic":
			c, err = newFrameworkPgx(e, "pgxp"+prefix, outboxpgx.Pessimistic)
		case name == "outbox-middleware":
			c, err = newFramework(e, false, "outbox"+prefix)
		default:
			err = fmt.Errorf("%s has no tables of its own to split", name)
		}
		if err != nil {
			for _, o := range set {
				o.close()
			}
			return nil, err
		}
		set = append(set, c)
	}
	return set, nil
}

// scalingStep runs c in procs worker processes, cfg.N messages over all of them.
func (e *env) scalingStep(ctx context.Context, self, dsn string, cfg scalingConfig, c scalingSubject, procs, postmaster int, seed uint64) (stepResult, error) {
	var res stepResult
	for i, o := range c.set {
		// The business tables once, every Outbox's own.
		if err := e.reset(ctx, o, i > 0); err != nil {
			return res, err
		}
	}
	ctx, cancel := context.WithTimeout(ctx, 4*time.Minute)
	defer cancel()
	type worker struct {
		cmd   *exec.Cmd
		stdin io.WriteCloser
		lines chan string
	}
	ws := make([]*worker, procs)
	defer func() {
		for _, w := range ws {
			if w != nil && w.cmd.ProcessState == nil {
				_ = w.cmd.Process.Kill()
				_ = w.cmd.Wait()
			}
		}
	}()
	per := cfg.N / procs
	for i := range ws {
		cmd := exec.CommandContext(ctx, self, "-scaling-worker", "-dsn", dsn, "-contenders", c.name, "-tables", strconv.Itoa(c.tables), "-workload", workload,
			"-n", strconv.Itoa(per), "-inflight", strconv.Itoa(cfg.InFlight), "-seed", strconv.FormatUint(seed*100+uint64(i), 10))
		cmd.Stderr = os.Stderr
		stdin, err := cmd.StdinPipe()
		if err != nil {
			return res, err
		}
		stdout, err := cmd.StdoutPipe()
		if err != nil {
			return res, err
		}
		if err := cmd.Start(); err != nil {
			return res, err
		}
		w := &worker{cmd: cmd, stdin: stdin, lines: make(chan string, 4)}
		ws[i] = w
		go func() {
			defer close(w.lines)
			sc := bufio.NewScanner(stdout)
			sc.Buffer(make([]byte, 1<<20), 64<<20)
			for sc.Scan() {
				w.lines <- sc.Text()
			}
		}()
	}
	next := func(w *worker, what string) (string, error) {
		select {
		case l, ok := <-w.lines:
			if !ok {
				return "", fmt.Errorf("worker %d exited before it was %s", w.cmd.Process.Pid, what)
			}
			return l, nil
		case <-ctx.Done():
			return "", fmt.Errorf("waiting for a worker to be %s: %w", what, ctx.Err())
		}
	}
	for _, w := range ws {
		if l, err := next(w, "ready"); err != nil {
			return res, err
		} else if l != "ready" {
			return res, fmt.Errorf("worker said %q instead of ready", l)
		}
	}
	if _, err := e.admin.ExecContext(ctx, "CHECKPOINT"); err != nil {
		return res, err
	}
	if idle0, err := proccpu.Server(postmaster); err == nil {
		time.Sleep(idleWindow)
		if idle1, err := proccpu.Server(postmaster); err == nil {
			res.idleCPU = idle1 - idle0
		}
	}
	lsn0, err := e.walLSN(ctx)
	if err != nil {
		return res, err
	}
	cpu0, cpuErr := proccpu.Server(postmaster)
	for _, w := range ws {
		if _, err := io.WriteString(w.stdin, "go\n"); err != nil {
			return res, err
		}
	}
	var mu sync.Mutex
	var last time.Duration
	var wg sync.WaitGroup
	var firstErr atomic.Pointer[error]
	for _, w := range ws {
		wg.Add(1)
		go func() {
			defer wg.Done()
			l, err := next(w, "done")
			if err == nil && !strings.HasPrefix(l, "result ") {
				err = fmt.Errorf("worker said %q instead of its result", l)
			}
			var wr workerResult
			if err == nil {
				err = json.Unmarshal([]byte(strings.TrimPrefix(l, "result ")), &wr)
			}
			if err != nil {
				firstErr.CompareAndSwap(nil, &err)
				return
			}
			mu.Lock()
			last = max(last, time.Duration(wr.Seconds*float64(time.Second)))
			res.messages += wr.Messages
			res.errors += wr.Errors
			res.clientCPUus += wr.CPUus
			for _, v := range wr.Latencies {
				res.lat = append(res.lat, time.Duration(v*float64(time.Millisecond)))
			}
			mu.Unlock()
		}()
	}
	wg.Wait()
	if p := firstErr.Load(); p != nil {
		return res, *p
	}
	res.seconds = last.Seconds()
	// Every worker has stopped its relay and background marks before its result, and keeps its
	// connections until stdin closes: the numbers hold their work, not the backends' exits.
	if cpuErr == nil {
		cpu1, err := proccpu.Server(postmaster)
		if err == nil {
			res.serverCPU = cpu1 - cpu0
		}
	}
	lsn1, err := e.walLSN(ctx)
	if err != nil {
		return res, err
	}
	if res.wal, err = e.walDiff(ctx, lsn0, lsn1); err != nil {
		return res, err
	}
	for _, w := range ws {
		_ = w.stdin.Close()
		if err := w.cmd.Wait(); err != nil {
			return res, fmt.Errorf("worker %d: %w", w.cmd.Process.Pid, err)
		}
	}
	return res, nil
}

// scalingWorker is one consumer process of a scaling step: it builds its contender on its own
// pool, warms up, says "ready", waits for "go" on stdin, consumes its deliveries with conc
// goroutines and prints its result.
func scalingWorker(dsn, name string, tables, n, conc int, seed uint64) error {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	b := newNullBroker()
	e := &env{dsn: dsn, broker: b, pub: b.publisher(), defaultGrace: true}
	set, err := newContenderSet(e, name, max(tables, 1))
	if err != nil {
		return err
	}
	defer func() {
		for _, c := range set {
			c.close()
		}
	}()
	for _, c := range set {
		if err := c.start(ctx); err != nil {
			return err
		}
	}
	consume := func(ds []delivery) (lat []float64, errs int, err error) {
		var next atomic.Int64
		var mu sync.Mutex
		var wg sync.WaitGroup
		var errN atomic.Int64
		lat = make([]float64, 0, len(ds))
		for g := range conc {
			c := set[g%len(set)] // the consumers spread over the Outboxes
			wg.Add(1)
			go func() {
				defer wg.Done()
				local := make([]float64, 0, len(ds)/conc+1)
				defer func() { mu.Lock(); lat = append(lat, local...); mu.Unlock() }()
				for {
					i := next.Add(1) - 1
					if i >= int64(len(ds)) || ctx.Err() != nil {
						return
					}
					for attempt := 0; ; attempt++ {
						t0 := time.Now()
						_, err := c.handle(ctx, ds[i])
						if err == nil {
							local = append(local, ms(time.Since(t0)))
							break
						}
						// A failed delivery is redelivered, as a broker would; give up on it
						// after a few tries so that a broken run ends.
						if errN.Add(1) > 100 || attempt >= 5 || ctx.Err() != nil {
							return
						}
					}
				}
			}()
		}
		wg.Wait()
		if errN.Load() > 100 {
			return lat, int(errN.Load()), errors.New("more than 100 errors")
		}
		return lat, int(errN.Load()), ctx.Err()
	}
	if _, _, err := consume(makeDeliveries(20*conc, 0, 1, 1, seed^0x5eed)); err != nil {
		return fmt.Errorf("warm-up: %w", err)
	}
	ds := makeDeliveries(n, 0, 1, 1, seed)
	fmt.Println("ready")
	goLine := make(chan error, 1)
	stdinClosed := make(chan struct{})
	go func() {
		defer close(stdinClosed)
		r := bufio.NewReader(os.Stdin)
		l, err := r.ReadString('\n')
		if err == nil && strings.TrimSpace(l) != "go" {
			err = fmt.Errorf("expected go, got %q", l)
		}
		goLine <- err
		_, _ = io.Copy(io.Discard, r)
	}()
	select {
	case err := <-goLine:
		if err != nil {
			return err
		}
	case <-time.After(2 * time.Minute):
		return errors.New("no go signal within 2 minutes")
	}
	cpu0 := proccpu.Self()
	t0 := time.Now()
	lat, errs, err := consume(ds)
	elapsed := time.Since(t0)
	// The relay and the background marks stop before the result, so that their work is in the
	// step's numbers; the pool closes only once the parent has read them (stdin closed), so
	// that the backends' exits are not.
	for _, c := range set {
		if err := c.stop(); err != nil {
			return err
		}
	}
	cpu1 := proccpu.Self()
	if err != nil {
		return err
	}
	js, err := json.Marshal(workerResult{Messages: len(lat), Errors: errs, Seconds: elapsed.Seconds(), CPUus: (cpu1 - cpu0).Microseconds(), Latencies: lat})
	if err != nil {
		return err
	}
	fmt.Printf("result %s\n", js)
	select {
	case <-stdinClosed:
	case <-time.After(2 * time.Minute):
	}
	return nil
}

// printScaling writes the scaling table on out.
func printScaling(out io.Writer, r *scalingReport) {
	fmt.Fprintf(out, "\nscaling: %d in flight per process, workload %s, load %s -> %s\n", r.Config.InFlight, r.Config.Workload, r.Machine.LoadAtStart, r.Machine.LoadAtEnd)
	fmt.Fprintf(out, "%-28s %5s %8s %8s %14s %14s %10s %12s %14s\n", "contender", "procs", "msg/s", "p99 ms", "server us/msg", "client us/msg", "WAL B/msg", "server CPU x1", "idle server ms/s")
	for _, row := range r.Rows {
		fmt.Fprintf(out, "%-28s %5d %8.0f %8.2f %14.0f %14.0f %10.0f %12s %14.1f\n", row.label(), row.Procs, row.Throughput, row.P99,
			row.ServerCPUus, row.ClientCPUus, row.WALBytes, relToOne(r, row), row.IdleServerMs)
	}
}

func (row scalingRow) label() string {
	return scalingSubject{name: row.Contender, tables: row.Tables}.label()
}

// relToOne is row's server CPU per message relative to the same contender's with one process.
func relToOne(r *scalingReport, row scalingRow) string {
	for _, o := range r.Rows {
		if o.Contender == row.Contender && o.Tables <= 1 && o.Procs == slices.Min(r.Config.Procs) && o.ServerCPUus > 0 {
			return fmt.Sprintf("%.2fx", row.ServerCPUus/o.ServerCPUus)
		}
	}
	return "-"
}

const (
	scalingBegin = "<!-- BEGIN GENERATED: bench -scaling (cd bench && go run . -scaling rewrites everything up to the END marker) -->"
	scalingEnd   = "<!-- END GENERATED: bench -scaling -->"
)

// writeScalingDocs rewrites the generated part of scaling.md in dir (appended at its end the first
// time; the file is created when missing).
func writeScalingDocs(dir string, r *scalingReport) error {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	path := filepath.Join(dir, "scaling.md")
	old, err := os.ReadFile(path)
	if err != nil && !os.IsNotExist(err) {
		return err
	}
	gen := scalingBegin + "\n" + scalingMarkdown(r) + scalingEnd + "\n"
	s := string(old)
	i, j := strings.Index(s, scalingBegin), strings.Index(s, scalingEnd)
	if i >= 0 && j > i {
		j += len(scalingEnd)
		if j < len(s) && s[j] == '\n' {
			j++
		}
		s = s[:i] + gen + s[j:]
	} else if s == "" {
		s = "# Scaling\n\n" + gen
	} else {
		s = strings.TrimRight(s, "\n") + "\n\n" + gen
	}
	return os.WriteFile(path, []byte(s), 0o644)
}

func scalingMarkdown(r *scalingReport) string {
	var b strings.Builder
	w := func(format string, args ...any) { fmt.Fprintf(&b, format, args...) }
	c := r.Config
	w("### Measured: consumer processes against one PostgreSQL\n\n")
	w("Produced by `cd bench && go run . -scaling -mode %s -workload %s -n %d` (%s, took %.0f s). Machine: %d CPUs (%s), %s; "+
		"load average %s at the start, %s at the end (the machine was shared with other work: the absolute numbers move with it, "+
		"the per-message numbers much less).\n\n",
		r.Mode, c.Workload, c.N, r.Started, r.DurationSec, r.Machine.CPUs, r.Machine.CPU, r.Machine.Postgres, r.Machine.LoadAtStart, r.Machine.LoadAtEnd)
	tablesNote := ""
	if len(c.Tables) > 0 && slices.Max(c.Tables) > 1 {
		tablesNote = "\"x" + fmt.Sprint(slices.Max(c.Tables)) + " tables\" rows give each process that many Outboxes, each on its own " +
			"TablePrefix, the process's consumers spread over them. "
	}
	w("Each step runs %d messages (no duplicates) split over 1 to %d consumer processes, each this program re-executed with "+
		"its own connection pool, its own Outbox with its relay (`Outbox.Run`, default configuration), and %d messages in flight; "+
		"%sThe processes publish to a null publisher, so that they share only the database. Steps of different contenders interleave, "+
		"%d repetitions. Server CPU is utime + stime of every PostgreSQL server process (the postmaster, its backends, the WAL writer, "+
		"checkpointer and autovacuum; `/proc`), read before the start signal and once every process has stopped its relay and written "+
		"its marks (before they disconnect), so it includes that background work; idle server CPU is the same over one second before "+
		"the start, the processes connected and idle. Client CPU is the consumer processes' own (getrusage over their timed part). "+
		"WAL is `pg_current_wal_lsn()` before and after, the whole server's; each step starts after a CHECKPOINT on emptied tables.\n\n",
		c.N, slices.Max(c.Procs), c.InFlight, tablesNote, c.Reps)
	w("| contender | processes | consumers in all | msg/s | p50 ms | p99 ms | server CPU µs/msg | vs 1 process | client CPU µs/msg | WAL bytes/msg | idle server CPU ms/s |\n")
	w("|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|\n")
	for _, row := range r.Rows {
		cpu := "not measured"
		if row.ServerCPUus > 0 {
			cpu = f0(row.ServerCPUus)
		}
		note := ""
		if row.Errors > 0 {
			note = fmt.Sprintf(" (%d errors)", row.Errors)
		}
		w("| %s%s | %d | %d | %s | %s | %s | %s | %s | %s | %s | %s |\n", row.label(), note, row.Procs, row.Procs*row.InFlight, f0(row.Throughput),
			f2(row.P50), f2(row.P99), cpu, relToOne(r, row), f0(row.ClientCPUus), f0(row.WALBytes), f1(row.IdleServerMs))
	}
	for _, n := range r.Notes {
		w("\nNote: %s\n", n)
	}
	w("\nRaw numbers: `bench/results-scaling-%s.json`.\n\n", r.Mode)
	return b.String()
}
