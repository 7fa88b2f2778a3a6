// Command bench measures the cost of exactly-once effects: the same workload (consume a message,
// one business INSERT, one outgoing message; 10% duplicate deliveries) through this framework and
// the alternatives, against one throwaway PostgreSQL and one in-process NATS JetStream broker, and
// writes docs/benchmarks.md (tables) and docs/benchmarks.svg (chart).
//
//	go run . -mode quick          # < 2 minutes, reduced sizes (see docs/benchmarks.md)
//	go run . -mode full           # the full sizes
//	go run . -render results.json # re-render the docs from a saved run, without running
//	go run . -mode xmin           # the held-xmin run (bench/xmin.go; 12.5 minutes per contender)
//
// It starts its own PostgreSQL from the local binaries (apt-get install postgresql) unless -dsn or
// OUTBOX_BENCH_DSN names one (a superuser DSN; the database "outbox_bench" is dropped and created),
// and, for the MySQL contenders, its own MariaDB (apt-get install mariadb-server) unless
// OUTBOX_BENCH_MYSQL_DSN names a server (bench/mysql.go).
package main

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"net/url"
	"os"
	"os/signal"
	"path/filepath"
	"runtime"
	"runtime/pprof"
	"slices"
	"strings"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/watermill-outbox/outbox/drivers/outboxpgx"
	"github.com/watermill-outbox/outbox/internal/pgbouncer"

	_ "github.com/lib/pq"
)

type config struct {
	Mode       string
	N          int // deliveries per contender and concurrency, over all repetitions
	Reps       int
	Concs      []int
	DupRate    float64
	DupWindow  int
	SafetyN    int
	Retained   int // prefilled dedup IDs in the retained-IDs scale run
	ScaleN     int // deliveries per scale run
	ScaleConcs []int
	Expired    int // expired rows for the cleanup scale run
	CleanupN   int // deliveries before and after the cleanup
	CleanupC   int
	MemN       int
	ScaleOnly  bool `json:"-"` // -scale-only: skip the matrix and the safety check
	Seed       uint64
	Contenders []string
	// Broker is "nats" (the in-process JetStream; contenders called directly) or "none" (a null
	// publisher; deliveries through a Watermill Router, router.go).
	Broker string `json:",omitempty"`
	// Workload is the business write (workload.go): "insert" or "two-statement".
	Workload   string `json:",omitempty"`
	SkipSafety bool   `json:"-"`
}

var allContenders = []string{"floor", "bare", "ceiling", "protocol-sql", "naive", "watermill-stack", "river", "rbaliyan-event", "outbox-middleware", "outbox-intx",
	"bare-pgx", "protocol-pgx", "outbox-pgx", "outbox-pgx-pessimistic",
	"bare" + pooledSuffix, "outbox-middleware" + pooledSuffix, "bare-pgx" + pooledSuffix, "outbox-pgx" + pooledSuffix,
	"bare" + mysqlSuffix, "outbox" + mysqlSuffix}

func presets(mode string) (config, error) {
	c := config{Mode: mode, Concs: []int{1, 4, 16}, DupRate: 0.10, DupWindow: 64, Seed: 1, Contenders: allContenders}
	switch mode {
	case "quick":
		// 1200 rather than 1500 since the four contenders through PgBouncer joined the matrix
		// (a quarter of its time): the quick mode keeps to its two minutes on an idle machine.
		c.N, c.Reps = 1200, 2
		c.SafetyN = 800
		c.Retained, c.ScaleN, c.ScaleConcs = 200_000, 1500, []int{4, 16}
		c.Expired, c.CleanupN, c.CleanupC = 100_000, 1500, 4
		c.MemN = 1000
	case "full":
		c.N, c.Reps = 20000, 4
		c.SafetyN = 5000
		// Runs of 10,000 deliveries: of 2,500 (a second or two each), single rows moved by 2x.
		c.Retained, c.ScaleN, c.ScaleConcs = 10_000_000, 40000, []int{4, 16}
		c.Expired, c.CleanupN, c.CleanupC = 1_000_000, 10000, 4
		c.MemN = 20000
	default:
		return c, fmt.Errorf("unknown -mode %q (quick or full)", mode)
	}
	return c, nil
}

func main() {
	mode := flag.String("mode", "quick", "quick (reduced sizes, under 2 minutes), full (the full sizes) or xmin (the held-xmin run, bench/xmin.go)")
	dsn := flag.String("dsn", os.Getenv("OUTBOX_BENCH_DSN"), "PostgreSQL superuser DSN to use instead of starting a server (env OUTBOX_BENCH_DSN)")
	n := flag.Int("n", 0, "deliveries per contender and concurrency (default: the mode's)")
	reps := flag.Int("reps", 0, "interleaved repetitions (default: the mode's)")
	concs := flag.String("conc", "", "concurrencies, comma-separated (default 1,4,16)")
	dupRate := flag.Float64("dup-rate", 0.10, "share of deliveries that are duplicates")
	dupWindow := flag.Int("dup-window", 64, "a duplicate comes 1..dup-window deliveries after its original")
	only := flag.String("contenders", "", "comma-separated subset of: "+strings.Join(allContenders, ","))
	skipScale := flag.Bool("skip-scale", false, "skip the scale runs (retained IDs, cleanup) and the memory check")
	scaleOnly := flag.Bool("scale-only", false, "run only the scale runs and the memory check (to work on them; the report lacks the matrix)")
	docs := flag.String("docs", "../docs", "directory of benchmarks.md and benchmarks.svg")
	results := flag.String("results", "", "write the results as JSON here (default: results-<mode>.json)")
	render := flag.String("render", "", "only re-render the docs from this results JSON")
	cpuProfile := flag.String("cpuprofile", "", "write a CPU profile of the whole run (this process only) to this file")
	memProfile := flag.String("memprofile", "", "write an allocation profile of the whole run (this process only; every allocation sampled) to this file")
	drain := flag.Bool("drain", false, "run the relay-drain benchmark instead (its own section of benchmarks.md; results-drain-<mode>.json)")
	brokerKind := flag.String("broker", "nats", "nats (in-process JetStream, contenders called directly) or none (a null publisher; every contender's handler in a Watermill Router)")
	work := flag.String("workload", workloadInsert, "business write: insert (one INSERT) or two-statement (UPDATE a stock row, INSERT a reservation)")
	skipSafety := flag.Bool("skip-safety", false, "skip the safety check (duplicates and one crash)")
	retained := flag.Int("retained", 0, "IDs the retained-IDs scale run loads (default: the mode's)")
	seed := flag.Uint64("seed", 1, "seed of the deliveries")
	flag.Parse()
	switch *brokerKind {
	case "nats", "none":
	default:
		fmt.Fprintln(os.Stderr, "bad -broker (nats or none)")
		os.Exit(2)
	}
	switch *work {
	case workloadInsert, workloadTwoStatement:
		workload = *work
	default:
		fmt.Fprintln(os.Stderr, "bad -workload (insert or two-statement)")
		os.Exit(2)
	}

	if *cpuProfile != "" {
		f, err := os.Create(*cpuProfile)
		if err == nil {
			err = pprof.StartCPUProfile(f)
		}
		if err != nil {
			fmt.Fprintln(os.Stderr, "error:", err)
			os.Exit(1)
		}
		defer pprof.StopCPUProfile()
	}
	if *memProfile != "" {
		runtime.MemProfileRate = 1
		defer func() {
			f, err := os.Create(*memProfile)
			if err == nil {
				err = pprof.Lookup("allocs").WriteTo(f, 0)
			}
			if err != nil {
				fmt.Fprintln(os.Stderr, "error:", err)
			}
		}()
	}

	if *mode == "xmin" {
		if *results == "" {
			*results = "results-xmin.json"
		}
		run := func() error { return runXmin(xminPresets(*only), *dsn, *results) }
		if *render != "" {
			run = func() error { return renderXmin(*render) }
		}
		if err := run(); err != nil {
			fmt.Fprintln(os.Stderr, "error:", err)
			os.Exit(1)
		}
		return
	}
	if *drain {
		cfg, err := drainPresets(*mode)
		if err == nil {
			if *results == "" {
				*results = "results-drain-" + cfg.Mode + ".json"
			}
			err = runDrain(cfg, *dsn, *docs, *results)
		}
		if err != nil {
			fmt.Fprintln(os.Stderr, "error:", err)
			os.Exit(1)
		}
		return
	}

	if scalingMain(*mode, *dsn, *docs, *results, *render, *only, *n, *reps, *seed) {
		return
	}
	if *render != "" {
		b, err := os.ReadFile(*render)
		if err == nil {
			var r report
			if err = json.Unmarshal(b, &r); err == nil {
				err = writeDocs(*docs, &r)
			}
		}
		if err != nil {
			fmt.Fprintln(os.Stderr, "error:", err)
			os.Exit(1)
		}
		return
	}

	cfg, err := presets(*mode)
	if err == nil {
		if *retained > 0 {
			cfg.Retained = *retained
		}
		if *n > 0 {
			cfg.N = *n
		}
		if *reps > 0 {
			cfg.Reps = *reps
		}
		if *concs != "" {
			if cfg.Concs, err = parseInts(*concs); err != nil {
				fmt.Fprintln(os.Stderr, "bad -conc")
				os.Exit(2)
			}
		}
		cfg.Seed = *seed
		cfg.DupRate, cfg.DupWindow = *dupRate, *dupWindow
		cfg.ScaleOnly = *scaleOnly
		cfg.Broker, cfg.Workload, cfg.SkipSafety = *brokerKind, workload, *skipSafety
		if *only != "" {
			cfg.Contenders = strings.Split(*only, ",")
		}
		if *results == "" {
			*results = "results-" + cfg.Mode + ".json"
		}
		err = run(cfg, *dsn, *skipScale, *docs, *results)
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "error:", err)
		os.Exit(1)
	}
}

// classifyN is the number of deliveries of each untimed pass that classifies round trips.
const classifyN = 300

func logf(format string, args ...any) {
	fmt.Fprintf(os.Stderr, "[%s] "+format+"\n", append([]any{time.Now().Format("15:04:05")}, args...)...)
}

func run(cfg config, dsn string, skipScale bool, docsDir, resultsPath string) (err error) {
	began := time.Now()
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()

	rep := &report{Mode: cfg.Mode, Config: cfg, Started: began.UTC().Format(time.RFC3339), Command: commandLine(cfg)}
	rep.Machine = machineInfo()

	pgss := os.Getenv("OUTBOX_BENCH_PGSS") != ""
	if pgss {
		extraSettings = append(extraSettings, "shared_preload_libraries=pg_stat_statements", "pg_stat_statements.track_utility=off")
	}
	admin, benchDSN, closeDB, err := openBenchDatabase(ctx, dsn, "outbox_bench", &rep.Machine)
	if err != nil {
		return err
	}
	defer closeDB()
	if pgss {
		if _, err := admin.ExecContext(ctx, `CREATE EXTENSION IF NOT EXISTS pg_stat_statements`); err != nil {
			return fmt.Errorf("OUTBOX_BENCH_PGSS: %w", err)
		}
	}
	if _, err := admin.ExecContext(ctx, `
		CREATE TABLE applied (message_id text NOT NULL);
		CREATE TABLE naive_processed (message_id text PRIMARY KEY, processed_at timestamptz NOT NULL DEFAULT now());`); err != nil {
		return err
	}
	if err := setupWorkload(ctx, admin); err != nil {
		return err
	}

	var b *broker
	if cfg.Broker == "none" {
		logf("no broker: a null publisher, deliveries through a Watermill Router")
		b = newNullBroker()
	} else {
		logf("starting NATS JetStream")
		if b, err = startBroker(); err != nil {
			return err
		}
	}
	defer b.close()
	e := &env{dsn: benchDSN, admin: admin, broker: b, pub: b.publisher(), router: cfg.Broker == "none", stmts: &drainEnv{admin: admin, pgss: pgss}}
	if slices.ContainsFunc(cfg.Contenders, func(n string) bool { return strings.HasSuffix(n, pooledSuffix) }) {
		logf("starting PgBouncer (transaction mode)")
		pooler, pooled, err := startPooler(benchDSN)
		if err != nil {
			e.poolerErr = err
		} else {
			defer func() { _ = pooler.Stop() }()
			e.pooledDSN = pooled
			rep.Machine.Pooler = fmt.Sprintf("%s in transaction mode on loopback, %d server connections", pgbouncer.Version(), poolerSize)
		}
	}

	stopMySQL, err := startMySQL(ctx, cfg, rep) // bench/mysql.go
	if err != nil {
		return err
	}
	defer stopMySQL()

	var cs []contender
	defer func() {
		for _, c := range cs {
			c.close()
		}
	}()
	for _, name := range cfg.Contenders {
		c, err := e.newContender(name)
		if err != nil {
			msg := fmt.Sprintf("%s left out: %v", name, err)
			logf("%s", msg)
			rep.Notes = append(rep.Notes, msg)
			continue
		}
		cs = append(cs, c)
	}

	maxConc := slices.Max(cfg.Concs)
	logf("warm-up: %d contenders", len(cs))
	for i, c := range cs {
		if _, err := e.run(ctx, c, makeDeliveries(200, cfg.DupRate, redeliveryGap(maxConc), cfg.DupWindow, 1000+uint64(i)), runOpts{conc: maxConc, redelivered: true, drainWait: 30 * time.Second}); err != nil {
			return err
		}
	}

	// Which round trips a message waits for is read in short untimed passes, one per contender and
	// concurrency (see classifyRoundTrips); the timed runs below count every round trip cheaply.
	logf("classifying round trips: %d contenders x %d concurrencies", len(cs), len(cfg.Concs))
	syncRT := map[string]float64{}
	classifyRoundTrips.Store(true)
	for ci, conc := range cfg.Concs {
		if cfg.ScaleOnly {
			break
		}
		for i, c := range cs {
			ds := makeDeliveries(classifyN, cfg.DupRate, redeliveryGap(conc), cfg.DupWindow, 2000+uint64(ci*100+i))
			res, err := e.run(ctx, c, ds, runOpts{conc: conc, redelivered: true, drainWait: 30 * time.Second})
			if err != nil {
				classifyRoundTrips.Store(false)
				return err
			}
			syncRT[fmt.Sprintf("%s/%d", c.name(), conc)] = float64(res.Wire.SyncRoundTrips) / float64(res.Messages)
		}
	}
	classifyRoundTrips.Store(false)

	// The matrix: repetitions interleave every contender at every concurrency; the order of the
	// contenders rotates from one (repetition, concurrency) to the next, so that drift and
	// warm-up hit each one alike.
	agg := map[string]*aggregate{}
	perRep := cfg.N / cfg.Reps
	k := 0
	for r := 0; r < cfg.Reps && !cfg.ScaleOnly; r++ {
		for ci, conc := range cfg.Concs {
			ds := makeDeliveries(perRep, cfg.DupRate, redeliveryGap(conc), cfg.DupWindow, cfg.Seed*1_000_003+uint64(r*100+ci))
			for j := range cs {
				c := cs[(j+k)%len(cs)]
				if ctx.Err() != nil {
					return ctx.Err()
				}
				res, err := e.run(ctx, c, ds, runOpts{conc: conc, redelivered: true, drainWait: 60 * time.Second})
				if err != nil {
					return err
				}
				key := fmt.Sprintf("%s/%d", c.name(), conc)
				if agg[key] == nil {
					agg[key] = &aggregate{contender: c.name(), path: c.path(), conc: conc}
				}
				agg[key].add(res)
				logf("rep %d c=%-2d %-18s %7.0f msg/s  p50 %6.2f ms  p99 %7.2f ms  rt/msg %.2f/%.2f  stmts/msg %.2f  WAL %5.0f B/msg  CPU us/msg %s  allocs/msg %.0f%s",
					r+1, conc, c.name(), float64(res.Messages)/res.Elapsed.Seconds(), ms(pct(res.Latencies, 0.5)), ms(pct(res.Latencies, 0.99)),
					syncRT[key], float64(res.Wire.RoundTrips)/float64(res.Messages), float64(res.Wire.Statements)/float64(res.Messages),
					float64(res.WALBytes)/float64(res.Messages), cpuPair(res.ServerCPU, res.ClientCPU, res.Messages),
					float64(res.Allocs)/float64(res.Messages), errNote(res))
			}
			k++
		}
	}
	for _, name := range cfg.Contenders {
		for _, conc := range cfg.Concs {
			key := fmt.Sprintf("%s/%d", name, conc)
			if a := agg[key]; a != nil {
				cl := a.cell()
				cl.SyncRoundTrips = syncRT[key]
				rep.Cells = append(rep.Cells, cl)
			}
		}
	}

	if !cfg.SkipSafety {
		logf("safety: duplicates and one crash")
	}
	for i, c := range cs {
		// Behind the pooler the framework's exactly-once is the tests' (TestBehindPgBouncer); here
		// the pooled contenders are timed only, which keeps the quick mode within its time.
		if c.path() == "floor" || c.path() == "ceiling" || cfg.ScaleOnly || cfg.SkipSafety || strings.HasSuffix(c.name(), pooledSuffix) {
			continue
		}
		row, err := e.safety(ctx, c, cfg, maxConc, uint64(5000+i))
		if err != nil {
			return err
		}
		rep.Safety = append(rep.Safety, row)
		logf("safety %-18s dup-applied %d lost %d resent-same-id %d new-id-copies %d", c.name(), row.DupApplied, row.Lost, row.ResentSameID, row.CopiesNewID)
	}

	if !skipScale {
		var mw *framework
		for _, c := range cs {
			if f, ok := unwrap(c).(*framework); ok && f.name() == "outbox-middleware" {
				mw = f
			}
		}
		if mw == nil {
			rep.Notes = append(rep.Notes, "scale runs skipped: outbox-middleware not selected")
		} else {
			if err := e.scaleRetained(ctx, cfg, cs, rep); err != nil {
				return err
			}
			if err := e.scaleCleanup(ctx, cfg, rep); err != nil {
				return err
			}
			if err := e.memoryCheck(ctx, cfg, mw, rep); err != nil {
				return err
			}
		}
	}

	rep.Machine.LoadAtEnd = loadAverage()
	rep.DurationSec = time.Since(began).Seconds()
	rep.Ratios = ratios(rep)
	logf("done in %.0f s", rep.DurationSec)
	printRatios(os.Stdout, rep)
	if err := writeResults(resultsPath, rep); err != nil {
		return err
	}
	return writeDocs(docsDir, rep)
}

func errNote(r runResult) string {
	var s string
	if r.Errors > 0 {
		s += fmt.Sprintf("  errors %d", r.Errors)
	}
	if r.Undelivered > 0 {
		s += fmt.Sprintf("  UNDELIVERED %d", r.Undelivered)
	}
	return s
}

// newContender builds contender name for the run's workload, behind a Router with -broker none.
func (e *env) newContender(name string) (contender, error) {
	if err := checkWorkload(name); err != nil {
		return nil, err
	}
	c, err := newContender(e, name)
	if err != nil || !e.router {
		return c, err
	}
	r, err := newRouted(c)
	if err != nil {
		c.close()
		return nil, err
	}
	return r, nil
}

func newContender(e *env, name string) (contender, error) {
	if isMySQL(name) {
		return newMySQLContender(e, name)
	}
	switch name {
	case "floor":
		return newFloor(e)
	case "bare":
		return newBare(e)
	case "ceiling":
		return newCeiling(e)
	case "naive":
		return newNaive(e)
	case "watermill-stack":
		return newWMStack(e)
	case "river":
		return newRiver(e)
	case "rbaliyan-event":
		return newEventIdem(e)
	case "bare-pgx":
		return newBarePgx(e)
	case "protocol-pgx":
		return newProtocolPgx(e)
	case "protocol-sql":
		return newProtocolSQL(e)
	case "outbox-pgx":
		return newFrameworkPgx(e, "pgx_", outboxpgx.Optimistic)
	case "outbox-pgx-pessimistic":
		return newFrameworkPgx(e, "pgxp_", outboxpgx.Pessimistic)
	case "outbox-middleware":
		return newFramework(e, false, "outbox_")
	case "outbox-intx":
		return newFramework(e, true, "intx_")
	}
	if strings.HasSuffix(name, pooledSuffix) {
		return newPooled(e, name)
	}
	return nil, fmt.Errorf("unknown contender %q", name)
}

// createDatabase drops and creates dbname on the server of dsn and returns its DSN.
func createDatabase(ctx context.Context, dsn, dbname string) (string, error) {
	db, err := sql.Open("postgres", dsn)
	if err != nil {
		return "", err
	}
	defer db.Close()
	if _, err := db.ExecContext(ctx, "DROP DATABASE IF EXISTS "+dbname+" WITH (FORCE)"); err != nil {
		return "", err
	}
	if _, err := db.ExecContext(ctx, "CREATE DATABASE "+dbname); err != nil {
		return "", err
	}
	u, err := url.Parse(dsn)
	if err != nil || u.Scheme == "" {
		// key=value form
		return dsn + " dbname=" + dbname, nil
	}
	u.Path = "/" + dbname
	return u.String(), nil
}

func commandLine(cfg config) string {
	if cfg.Broker == "none" || cfg.Workload == workloadTwoStatement {
		return fmt.Sprintf("cd bench && go run . -mode %s -broker %s -workload %s", cfg.Mode, cfg.Broker, cfg.Workload)
	}
	return "make bench-" + cfg.Mode
}

func machineInfo() machine {
	m := machine{CPUs: runtime.NumCPU(), Go: runtime.Version(), OS: runtime.GOOS + "/" + runtime.GOARCH}
	if b, err := os.ReadFile("/proc/cpuinfo"); err == nil {
		for _, l := range strings.Split(string(b), "\n") {
			if strings.HasPrefix(l, "model name") {
				if i := strings.Index(l, ":"); i > 0 {
					m.CPU = strings.TrimSpace(l[i+1:])
				}
				break
			}
		}
	}
	if b, err := os.ReadFile("/proc/meminfo"); err == nil {
		var kb int64
		if _, err := fmt.Sscanf(strings.SplitN(string(b), "\n", 2)[0], "MemTotal: %d kB", &kb); err == nil {
			m.MemGB = float64(kb) / (1 << 20)
		}
	}
	m.LoadAtStart = loadAverage()
	return m
}

// loadAverage is the 1, 5 and 15-minute load average, or "" where /proc/loadavg is missing.
func loadAverage() string {
	if b, err := os.ReadFile("/proc/loadavg"); err == nil {
		return strings.Join(strings.Fields(string(b))[:3], " ")
	}
	return ""
}

var _ = errors.New
var _ = filepath.Join
var _ atomic.Bool

// writeResults writes a run's results as indented JSON to path.
func writeResults(path string, rep any) error {
	js, err := json.MarshalIndent(rep, "", "  ")
	if err != nil {
		return err
	}
	return os.WriteFile(path, js, 0o644)
}

// cpuPair formats the server's and the client's CPU time per message as "server + client".
func cpuPair(server, client time.Duration, messages int) string {
	n := float64(max(messages, 1))
	sv := "?"
	if server >= 0 {
		sv = fmt.Sprintf("%.0f", float64(server.Microseconds())/n)
	}
	return fmt.Sprintf("%s + %.0f", sv, float64(client.Microseconds())/n)
}
