package main

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/signal"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wsql "github.com/ThreeDotsLabs/watermill-sql/v3/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/components/forwarder"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/riverqueue/river"
	"github.com/riverqueue/river/riverdriver/riverdatabasesql"
	"github.com/riverqueue/river/rivermigrate"

	"github.com/watermill-outbox/outbox"
	"github.com/watermill-outbox/outbox/drivers/postgres"
	"github.com/watermill-outbox/outbox/outboxdriver"
)

// The relay drain: a backlog of side effects committed while the broker was down (or by
// instances killed mid-dispatch), drained to a publisher that does nothing, so that only the
// relay's own cost counts; beside Watermill's forwarder and River draining the same backlog.

type drainConfig struct {
	Mode      string
	Effects   int // the backlog
	Keys      int // ordering keys it is spread over
	PerTx     int // effects per InTx call that built it
	Reps      int
	Filler    int // dispatched effect rows and retained IDs in the scale run
	ConsumerN int // deliveries of the consumer workload, alone and during a drain
	ConsumerC int
}

func drainPresets(mode string) (drainConfig, error) {
	c := drainConfig{Mode: mode, Effects: 30000, Keys: 300, PerTx: 10, ConsumerC: 4}
	switch mode {
	case "quick":
		c.Reps, c.Filler, c.ConsumerN = 3, 200_000, 2000
	case "full":
		c.Reps, c.Filler, c.ConsumerN = 5, 10_000_000, 3000
	default:
		return c, fmt.Errorf("unknown -mode %q (quick or full)", mode)
	}
	return c, nil
}

type drainRow struct {
	Contender string
	Instances int
	Rates     []float64 // effects per second, one per repetition
	Median    float64
	Copies    int     // messages published more than once
	Reorders  int     // messages published before an earlier one of their ordering key (-1: not checked)
	Stmts     float64 // statements per effect (the instances' own connections)
	RTs       float64 // round trips per effect
}

// consumerDuring is the consumer path's latency while some relays drain a backlog.
type consumerDuring struct {
	Relays int
	Pause  float64
	P99    []float64 // ms per repetition
	P50    []float64
	Rise   float64 // median p99 / median p99 alone - 1
}

type drainReport struct {
	Mode, Started, Command string
	DurationSec            float64
	Machine                machine
	Config                 drainConfig
	Rows                   []drainRow
	Scale                  struct {
		Filler      int
		LoadSeconds float64
		Rows        []drainRow
	}
	Consumer struct {
		Conc     int
		AloneP99 []float64 // ms per repetition
		AloneP50 []float64
		During   []consumerDuring
	}
	Idle struct {
		Instances  int
		Seconds    float64
		Interval   float64 // s
		Statements int64
		RoundTrips int64
		PerRound   float64
		ClaimMS    float64 // median time of a claim that finds nothing, at the scale run's size
	}
	Notes []string
}

// drainPublisher takes every message and does nothing with it but count it, count the ones it
// saw before, and check that the messages of each ordering key come in the order of their store
// IDs (expect: UUID -> key and rank).
type drainPublisher struct {
	mu       sync.Mutex
	seen     map[string]bool
	expect   map[string]keyRank
	last     map[string]int
	copies   int
	reorders int
	n        atomic.Int64
	check    bool
}

type keyRank struct {
	key  string
	rank int
}

func newDrainPublisher(check bool) *drainPublisher {
	return &drainPublisher{seen: map[string]bool{}, last: map[string]int{}, check: check}
}

// expectStoreOrder reads the order the relay owes: per ordering key, the order of store IDs.
func (p *drainPublisher) expectStoreOrder(ctx context.Context, db *sql.DB, table string) error {
	rows, err := db.QueryContext(ctx, `SELECT uuid, ordering_key, row_number() OVER (PARTITION BY ordering_key ORDER BY id) FROM `+table+` WHERE dispatched_at IS NULL`)
	if err != nil {
		return err
	}
	defer rows.Close()
	p.expect = map[string]keyRank{}
	for rows.Next() {
		var id string
		var kr keyRank
		if err := rows.Scan(&id, &kr.key, &kr.rank); err != nil {
			return err
		}
		p.expect[id] = kr
	}
	return rows.Err()
}

func (p *drainPublisher) Publish(_ string, msgs ...*message.Message) error {
	if p.check {
		p.mu.Lock()
		for _, m := range msgs {
			if p.seen[m.UUID] {
				p.copies++
				continue
			}
			p.seen[m.UUID] = true
			if kr, ok := p.expect[m.UUID]; ok {
				if last, ok := p.last[kr.key]; ok && kr.rank < last {
					p.reorders++
				}
				p.last[kr.key] = kr.rank
			}
		}
		p.mu.Unlock()
	}
	p.n.Add(int64(len(msgs)))
	return nil
}

func (p *drainPublisher) Close() error { return nil }

// waitCount waits until p has taken n messages, and returns how long it took from start.
func (p *drainPublisher) waitCount(ctx context.Context, n int, start time.Time, limit time.Duration) (time.Duration, error) {
	for p.n.Load() < int64(n) {
		if time.Since(start) > limit {
			return 0, fmt.Errorf("drained %d of %d in %s", p.n.Load(), n, limit)
		}
		select {
		case <-ctx.Done():
			return 0, ctx.Err()
		case <-time.After(time.Millisecond):
		}
	}
	return time.Since(start), nil
}

const drainLimit = 10 * time.Minute

// envInt reads a number from the environment (0 when unset), for experiments.
func envInt(name string) int {
	var n int
	_, _ = fmt.Sscan(os.Getenv(name), &n)
	return n
}

// The RelayPauseFactor values the drain is run with: the library's default (keep in step with
// outbox.Config), none, and a fifth of each relay's time.
const (
	defaultFactor = 1
	noPause       = -1
	pacedFactor   = 4
)

// drainEnv is the database of a drain run.
type drainEnv struct {
	dsn   string
	admin *sql.DB
	cfg   drainConfig
	pgss  bool // OUTBOX_BENCH_PGSS: log the statements that took the server's time, per run
}

// statements logs the statements that took most of the server's time since the last call (with
// OUTBOX_BENCH_PGSS set), and resets the counts.
func (d *drainEnv) statements(ctx context.Context, label string) {
	if !d.pgss {
		return
	}
	rows, err := d.admin.QueryContext(ctx, `SELECT calls, round(total_exec_time)::bigint, round(mean_exec_time::numeric, 2), rows, wal_bytes::bigint,
			shared_blks_hit + shared_blks_read, regexp_replace(left(query, 90), '\s+', ' ', 'g')
		FROM pg_stat_statements WHERE dbid = (SELECT oid FROM pg_database WHERE datname = current_database())
		ORDER BY total_exec_time DESC LIMIT 6`)
	if err != nil {
		logf("pg_stat_statements: %v", err)
		return
	}
	defer rows.Close()
	for rows.Next() {
		var calls, total, rws, wal, blks int64
		var mean float64
		var q string
		if err := rows.Scan(&calls, &total, &mean, &rws, &wal, &blks, &q); err != nil {
			logf("pg_stat_statements: %v", err)
			return
		}
		logf("  %s: %6d calls %6d ms (%.2f ms each) %7d rows %9d WAL bytes %8d blocks  %s", label, calls, total, mean, rws, wal, blks, q)
	}
	rows.Close()
	_, _ = d.admin.ExecContext(ctx, `SELECT pg_stat_statements_reset()`)
}

// outboxBacklog builds the backlog once through InTx, on the tables of prefix, as instances that
// were killed after their commits left it (nothing dispatched, nothing handed over: due once
// RelayGrace has passed), and keeps a copy to restore before every run.
func (d *drainEnv) outboxBacklog(ctx context.Context, prefix string) error {
	db, err := sql.Open("postgres", d.dsn)
	if err != nil {
		return err
	}
	defer db.Close()
	ob, err := outbox.New(outbox.Config{DB: db, Driver: postgres.Driver{}, Publisher: newDrainPublisher(false), TablePrefix: prefix,
		Failpoint: func(_ context.Context, point string) error {
			if point == outbox.FailpointAfterCommit {
				return errCrash
			}
			return nil
		}})
	if err != nil {
		return err
	}
	if err := ob.Migrate(ctx); err != nil {
		return err
	}
	var next atomic.Int64
	seq := make([]atomic.Int64, d.cfg.Keys)
	var wg sync.WaitGroup
	errs := make(chan error, 8)
	for w := 0; w < 8; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				i := int(next.Add(int64(d.cfg.PerTx))) - d.cfg.PerTx
				if i >= d.cfg.Effects {
					return
				}
				key := i / d.cfg.PerTx % d.cfg.Keys
				err := ob.InTx(ctx, func(ctx context.Context, _ *sql.Tx) error {
					ctx = outbox.WithOrderingKey(ctx, fmt.Sprintf("key-%d", key))
					var msgs []*message.Message
					for j := 0; j < d.cfg.PerTx && i+j < d.cfg.Effects; j++ {
						msgs = append(msgs, message.NewMessage(uuid.NewString(), []byte(fmt.Sprintf("key-%d %d", key, seq[key].Add(1)))))
					}
					return outbox.Publish(ctx, outTopic, msgs...)
				})
				if err != nil && !errors.Is(err, errCrash) {
					errs <- err
					return
				}
			}
		}()
	}
	wg.Wait()
	close(errs)
	if err := <-errs; err != nil {
		return err
	}
	_, err = d.admin.ExecContext(ctx, `CREATE TABLE `+prefix+`backlog AS SELECT source_consumer, source_id, seq, kind, topic, uuid, payload, metadata, ordering_key, id FROM `+prefix+`effects_all`)
	return err
}

// restoreBacklog puts the backlog back in place, as new rows (their store IDs follow the order
// they were recorded in), and checkpoints.
func (d *drainEnv) restoreBacklog(ctx context.Context, prefix string) error {
	for _, q := range []string{
		`DELETE FROM ` + prefix + `effects_all WHERE dispatched_at IS NULL`,
		`INSERT INTO ` + prefix + `effects_all (source_consumer, source_id, seq, kind, topic, uuid, payload, metadata, ordering_key, created_at)
			SELECT source_consumer, source_id, seq, kind, topic, uuid, payload, metadata, ordering_key, now() - interval '1 minute'
			FROM ` + prefix + `backlog ORDER BY id`,
		`CHECKPOINT`,
	} {
		if _, err := d.admin.ExecContext(ctx, q); err != nil {
			return fmt.Errorf("restore backlog: %w", err)
		}
	}
	return nil
}

// outboxDrain drains the backlog of prefix with n relay instances, each with its own pool, as
// separate processes would have.
func (d *drainEnv) outboxDrain(ctx context.Context, prefix string, n int, pause float64, effectRetention time.Duration) (rate float64, pub *drainPublisher, wire wireSnapshot, err error) {
	if err := d.restoreBacklog(ctx, prefix); err != nil {
		return 0, nil, wire, err
	}
	pub = newDrainPublisher(true)
	if err := pub.expectStoreOrder(ctx, d.admin, prefix+"effects_all"); err != nil {
		return 0, nil, wire, err
	}
	wc := &wireCounters{}
	var obs []*outbox.Outbox
	for i := 0; i < n; i++ {
		db, err := openCounted(d.dsn, wc, 8)
		if err != nil {
			return 0, nil, wire, err
		}
		defer db.Close()
		ob, err := outbox.New(outbox.Config{DB: db, Driver: postgres.Driver{}, Publisher: pub, TablePrefix: prefix,
			RelayGrace: time.Second, RelayInterval: 10 * time.Millisecond, EffectRetention: effectRetention,
			CleanupInterval: time.Hour, RelayPauseFactor: pause})
		if err != nil {
			return 0, nil, wire, err
		}
		obs = append(obs, ob)
	}
	w0 := wc.snapshot()
	runCtx, stop := context.WithCancel(ctx)
	var wg sync.WaitGroup
	start := time.Now()
	for _, ob := range obs {
		wg.Add(1)
		go func() { defer wg.Done(); _ = ob.Run(runCtx) }()
	}
	took, err := pub.waitCount(ctx, d.cfg.Effects, start, drainLimit)
	// Let the relays write the marks of their last round before they are stopped.
	var pending int
	for deadline := time.Now().Add(10 * time.Second); err == nil; time.Sleep(5 * time.Millisecond) {
		if err = d.admin.QueryRowContext(ctx, `SELECT count(*) FROM `+prefix+`effects_all WHERE dispatched_at IS NULL`).Scan(&pending); err != nil || pending == 0 || time.Now().After(deadline) {
			break
		}
	}
	stop()
	wg.Wait()
	if err != nil {
		return 0, nil, wire, err
	}
	if pending > 0 {
		var state string
		_ = d.admin.QueryRowContext(ctx, `SELECT string_agg(DISTINCT format('failures=%s attempts=%s next=%s err=%s', failures, attempts, next_attempt_at > now(), left(last_error, 80)), '; ') FROM `+prefix+`effects_all WHERE dispatched_at IS NULL`).Scan(&state)
		return 0, nil, wire, fmt.Errorf("%d effects still pending after the drain (%d published, %d of them copies): %s", pending, pub.n.Load(), pub.copies, state)
	}
	return float64(d.cfg.Effects) / took.Seconds(), pub, wc.snapshot().sub(w0), nil
}

const drainFwdTopic = "drain_fwd"

// unpaced and paced are the rows of one relay that never pauses and of three relays that keep to a
// fifth of their time.
var (
	unpaced = fmt.Sprintf("outbox x1, RelayPauseFactor %d (no pause)", noPause)
	paced   = fmt.Sprintf("outbox x3, RelayPauseFactor %d", pacedFactor)
)

// forwarderBacklog publishes the backlog through Watermill's forwarder publisher into its
// watermill-sql topic, ten messages per transaction.
func (d *drainEnv) forwarderBacklog(ctx context.Context) error {
	db, err := sql.Open("postgres", d.dsn)
	if err != nil {
		return err
	}
	defer db.Close()
	sub, err := wsql.NewSubscriber(db, wsql.SubscriberConfig{ConsumerGroup: "drain", SchemaAdapter: wsql.DefaultPostgreSQLSchema{},
		OffsetsAdapter: wsql.DefaultPostgreSQLOffsetsAdapter{}, InitializeSchema: true}, nil)
	if err != nil {
		return err
	}
	if err := sub.SubscribeInitialize(drainFwdTopic); err != nil {
		return err
	}
	_ = sub.Close()
	for i := 0; i < d.cfg.Effects; i += d.cfg.PerTx {
		tx, err := db.BeginTx(ctx, nil)
		if err != nil {
			return err
		}
		pub, err := wsql.NewPublisher(tx, wsql.PublisherConfig{SchemaAdapter: wsql.DefaultPostgreSQLSchema{}}, nil)
		if err != nil {
			return err
		}
		fp := forwarder.NewPublisher(pub, forwarder.PublisherConfig{ForwarderTopic: drainFwdTopic})
		var msgs []*message.Message
		for j := 0; j < d.cfg.PerTx && i+j < d.cfg.Effects; j++ {
			msgs = append(msgs, message.NewMessage(uuid.NewString(), []byte(fmt.Sprintf(`{"n":%d}`, i+j))))
		}
		if err := fp.Publish(outTopic, msgs...); err != nil {
			_ = tx.Rollback()
			return err
		}
		if err := tx.Commit(); err != nil {
			return err
		}
	}
	return nil
}

// forwarderDrain starts a forwarder on the backlog (its consumer group rewound) and times it.
func (d *drainEnv) forwarderDrain(ctx context.Context) (float64, wireSnapshot, error) {
	if _, err := d.admin.ExecContext(ctx, `DELETE FROM "watermill_offsets_`+drainFwdTopic+`"`); err != nil {
		return 0, wireSnapshot{}, err
	}
	if _, err := d.admin.ExecContext(ctx, `CHECKPOINT`); err != nil {
		return 0, wireSnapshot{}, err
	}
	wc := &wireCounters{}
	db, err := openCounted(d.dsn, wc, 8)
	if err != nil {
		return 0, wireSnapshot{}, err
	}
	defer db.Close()
	sub, err := wsql.NewSubscriber(db, wsql.SubscriberConfig{ConsumerGroup: "drain", SchemaAdapter: wsql.DefaultPostgreSQLSchema{},
		OffsetsAdapter: wsql.DefaultPostgreSQLOffsetsAdapter{}, PollInterval: 10 * time.Millisecond}, nil)
	if err != nil {
		return 0, wireSnapshot{}, err
	}
	pub := newDrainPublisher(false)
	fwd, err := forwarder.NewForwarder(sub, pub, watermill.NopLogger{}, forwarder.Config{ForwarderTopic: drainFwdTopic})
	if err != nil {
		return 0, wireSnapshot{}, err
	}
	w0 := wc.snapshot()
	start := time.Now()
	done := make(chan struct{})
	go func() { defer close(done); _ = fwd.Run(context.WithoutCancel(ctx)) }()
	took, err := pub.waitCount(ctx, d.cfg.Effects, start, drainLimit)
	_ = fwd.Close()
	<-done
	_ = sub.Close()
	if err != nil {
		return 0, wireSnapshot{}, err
	}
	return float64(d.cfg.Effects) / took.Seconds(), wc.snapshot().sub(w0), nil
}

type drainArgs struct {
	N int `json:"n"`
}

func (drainArgs) Kind() string { return "drain_publish" }

type drainWorker struct {
	river.WorkerDefaults[drainArgs]
	pub *drainPublisher
}

func (w *drainWorker) Work(_ context.Context, job *river.Job[drainArgs]) error {
	return w.pub.Publish(outTopic, message.NewMessage(uuid.NewString(), nil))
}

// riverDrain inserts the backlog as River jobs, with no client working, then starts a client
// (100 workers, as in the main benchmark) and times it until every job was worked.
func (d *drainEnv) riverDrain(ctx context.Context) (float64, wireSnapshot, error) {
	wc := &wireCounters{}
	db, err := openCounted(d.dsn, wc, 110)
	if err != nil {
		return 0, wireSnapshot{}, err
	}
	defer db.Close()
	m, err := rivermigrate.New(riverdatabasesql.New(db), nil)
	if err != nil {
		return 0, wireSnapshot{}, err
	}
	if _, err := m.Migrate(ctx, rivermigrate.DirectionUp, nil); err != nil {
		return 0, wireSnapshot{}, err
	}
	if _, err := d.admin.ExecContext(ctx, `TRUNCATE river_job`); err != nil {
		return 0, wireSnapshot{}, err
	}
	pub := newDrainPublisher(false)
	workers := river.NewWorkers()
	river.AddWorker(workers, &drainWorker{pub: pub})
	client, err := river.NewClient(riverdatabasesql.New(db), &river.Config{
		Logger:            slog.New(slog.NewTextHandler(io.Discard, nil)),
		Queues:            map[string]river.QueueConfig{river.QueueDefault: {MaxWorkers: 100}},
		Workers:           workers,
		FetchCooldown:     10 * time.Millisecond,
		FetchPollInterval: 10 * time.Millisecond,
	})
	if err != nil {
		return 0, wireSnapshot{}, err
	}
	for i := 0; i < d.cfg.Effects; i += 1000 {
		params := make([]river.InsertManyParams, 0, 1000)
		for j := i; j < min(i+1000, d.cfg.Effects); j++ {
			params = append(params, river.InsertManyParams{Args: drainArgs{N: j}})
		}
		if _, err := client.InsertMany(ctx, params); err != nil {
			return 0, wireSnapshot{}, err
		}
	}
	if _, err := d.admin.ExecContext(ctx, `CHECKPOINT`); err != nil {
		return 0, wireSnapshot{}, err
	}
	w0 := wc.snapshot()
	start := time.Now()
	if err := client.Start(context.WithoutCancel(ctx)); err != nil {
		return 0, wireSnapshot{}, err
	}
	took, err := pub.waitCount(ctx, d.cfg.Effects, start, drainLimit)
	stopCtx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	_ = client.Stop(stopCtx)
	if err != nil {
		return 0, wireSnapshot{}, err
	}
	return float64(d.cfg.Effects) / took.Seconds(), wc.snapshot().sub(w0), nil
}

// prefillDrain fills the tables of prefix with n dispatched effects and n retained IDs.
func (d *drainEnv) prefillDrain(ctx context.Context, prefix string, n int) error {
	for _, q := range []string{
		fmt.Sprintf(`INSERT INTO %sdispatched (id, source_consumer, source_id, seq, kind, topic, uuid, payload, metadata, ordering_key, created_at, dispatched_at, attempts, failures)
			SELECT -g, 'bench', g::text, 0, '', '%s', gen_random_uuid()::text, '{"n":1}'::bytea, ''::bytea, 'bench/' || g, now() - interval '1 day', now() - interval '1 day', 0, 0
			FROM generate_series(1, %d) g`, prefix, outTopic, n),
		fmt.Sprintf(`INSERT INTO %sprocessed (consumer, message_id, processed_at, dispatched_at)
			SELECT 'bench', g::text, now() - interval '1 day', now() - interval '1 day' FROM generate_series(1, %d) g`, prefix, n),
		`VACUUM ANALYZE ` + prefix + `dispatched`,
		`VACUUM ANALYZE ` + prefix + `processed`,
		`CHECKPOINT`,
	} {
		if _, err := d.admin.ExecContext(ctx, q); err != nil {
			return fmt.Errorf("prefill %s: %w", prefix, err)
		}
	}
	return nil
}

func median(v []float64) float64 {
	if len(v) == 0 {
		return 0
	}
	s := slices.Clone(v)
	slices.Sort(s)
	if len(s)%2 == 1 {
		return s[len(s)/2]
	}
	return (s[len(s)/2-1] + s[len(s)/2]) / 2
}

// runDrain runs the whole drain benchmark and writes its part of docs/benchmarks.md.
func runDrain(cfg drainConfig, dsn, docsDir, resultsPath string) error {
	began := time.Now()
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	rep := &drainReport{Mode: cfg.Mode, Config: cfg, Started: began.UTC().Format(time.RFC3339), Command: "make bench-drain-" + cfg.Mode}
	rep.Machine = machineInfo()
	pgss := os.Getenv("OUTBOX_BENCH_PGSS") != ""
	if pgss {
		extraSettings = append(extraSettings, "shared_preload_libraries=pg_stat_statements", "pg_stat_statements.track_utility=off")
	}
	admin, benchDSN, closeDB, err := openBenchDatabase(ctx, dsn, "outbox_drain", &rep.Machine)
	if err != nil {
		return err
	}
	defer closeDB()
	if _, err := admin.ExecContext(ctx, `CREATE TABLE applied (message_id text NOT NULL)`); err != nil {
		return err
	}
	d := &drainEnv{dsn: benchDSN, admin: admin, cfg: cfg, pgss: pgss}
	if pgss {
		if _, err := admin.ExecContext(ctx, `CREATE EXTENSION IF NOT EXISTS pg_stat_statements`); err != nil {
			return err
		}
	}

	logf("building the backlogs: %d effects on %d keys through InTx, and the forwarder's", cfg.Effects, cfg.Keys)
	if err := d.outboxBacklog(ctx, "drain_"); err != nil {
		return err
	}
	if err := d.forwarderBacklog(ctx); err != nil {
		return err
	}

	rows := map[string]*drainRow{}
	order := []string{"outbox x1", "outbox x3", unpaced, paced, "watermill-forwarder", "river"}
	scaleOnly := os.Getenv("OUTBOX_BENCH_DRAIN_SCALE_ONLY") != ""       // to work on the scale run
	consumerOnly := os.Getenv("OUTBOX_BENCH_DRAIN_CONSUMER_ONLY") != "" // to work on the consumer run
	if scaleOnly {
		cfg.Reps = 2
	}
	for _, name := range order {
		rows[name] = &drainRow{Contender: name}
	}
	rows["outbox x1"].Instances, rows["outbox x3"].Instances, rows[unpaced].Instances, rows[paced].Instances = 1, 3, 1, 3
	rows["watermill-forwarder"].Instances, rows["river"].Instances = 1, 1
	rows["watermill-forwarder"].Reorders, rows["river"].Reorders = -1, -1
	wires := map[string]wireSnapshot{}
	for r := 0; r < cfg.Reps && !scaleOnly && !consumerOnly; r++ {
		for j := range order {
			name := order[(j+r)%len(order)]
			row := rows[name]
			var rate float64
			var wire wireSnapshot
			switch name {
			case "outbox x1", "outbox x3", unpaced, paced:
				var pub *drainPublisher
				pause := map[string]float64{unpaced: noPause, paced: pacedFactor}[name] // 0: the default
				rate, pub, wire, err = d.outboxDrain(ctx, "drain_", row.Instances, pause, 0)
				if err == nil {
					row.Copies += pub.copies
					row.Reorders += pub.reorders
				}
			case "watermill-forwarder":
				rate, wire, err = d.forwarderDrain(ctx)
			case "river":
				rate, wire, err = d.riverDrain(ctx)
			}
			if err != nil {
				return fmt.Errorf("%s: %w", name, err)
			}
			row.Rates = append(row.Rates, rate)
			wires[name] = wires[name].add(wire)
			logf("rep %d %-20s %8.0f effects/s", r+1, name, rate)
			d.statements(ctx, name)
		}
	}
	for _, name := range order {
		row := rows[name]
		row.Median = median(row.Rates)
		n := float64(cfg.Effects * cfg.Reps)
		row.Stmts, row.RTs = float64(wires[name].Statements)/n, float64(wires[name].RoundTrips)/n
		rep.Rows = append(rep.Rows, *row)
	}

	// The consumer path's latency, alone and while a drain runs on the same database.
	if !scaleOnly {
		logf("consumer p99 alone and during a drain (c=%d)", cfg.ConsumerC)
		if err := d.consumerDuringDrain(ctx, rep); err != nil {
			return err
		}
	}

	if consumerOnly {
		for _, dv := range rep.Consumer.During {
			logf("consumer p99 alone %.2f, during a drain by %d relays (factor %g) %.2f: %+.0f%%", median(rep.Consumer.AloneP99), dv.Relays, dv.Pause, median(dv.P99), 100*dv.Rise)
		}
		return nil
	}
	// The scale run: the same drains with the tables holding Filler dispatched effects and
	// retained IDs (EffectRetention keeps dispatched rows, as in a deployment that keeps them).
	logf("scale: %s dispatched effects and retained IDs", human(cfg.Filler))
	t0 := time.Now()
	if err := d.outboxBacklog(ctx, "drainfull_"); err != nil {
		return err
	}
	if _, err := admin.ExecContext(ctx, `DELETE FROM drainfull_effects_all`); err != nil {
		return err
	}
	if err := d.prefillDrain(ctx, "drainfull_", cfg.Filler); err != nil {
		return err
	}
	rep.Scale.Filler, rep.Scale.LoadSeconds = cfg.Filler, time.Since(t0).Seconds()
	for _, inst := range []int{1, 3} {
		for _, prefix := range []string{"drain_", "drainfull_"} {
			row := drainRow{Contender: fmt.Sprintf("outbox x%d, %s", inst, map[string]string{"drain_": "empty tables", "drainfull_": human(cfg.Filler) + " rows"}[prefix]), Instances: inst}
			for r := 0; r < cfg.Reps; r++ {
				rate, pub, _, err := d.outboxDrain(ctx, prefix, inst, 0, 7*24*time.Hour)
				if err != nil {
					return err
				}
				row.Rates = append(row.Rates, rate)
				row.Copies += pub.copies
				row.Reorders += pub.reorders
				d.statements(ctx, row.Contender)
			}
			row.Median = median(row.Rates)
			logf("scale %-40s %8.0f effects/s", row.Contender, row.Median)
			rep.Scale.Rows = append(rep.Scale.Rows, row)
		}
	}

	logf("idle relays")
	if err := d.idle(ctx, rep); err != nil {
		return err
	}

	rep.DurationSec = time.Since(began).Seconds()
	logf("done in %.0f s", rep.DurationSec)
	if err := writeResults(resultsPath, rep); err != nil {
		return err
	}
	return writeDrainDocs(docsDir, rep)
}

// consumerDuringDrain runs the consumer workload (the main benchmark's outbox-middleware, at
// ConsumerC) alone and while three relays drain a backlog twice the usual size, interleaved.
func (d *drainEnv) consumerDuringDrain(ctx context.Context, rep *drainReport) error {
	logf("starting NATS JetStream")
	b, err := startBroker()
	if err != nil {
		return err
	}
	defer b.close()
	e := &env{dsn: d.dsn, admin: d.admin, broker: b, pub: b.publisher()}
	c, err := newFramework(e, false, "outbox_")
	if err != nil {
		return err
	}
	defer c.close()
	if _, err := e.run(ctx, c, makeDeliveries(300, 0.1, redeliveryGap(d.cfg.ConsumerC), 64, 1), runOpts{conc: d.cfg.ConsumerC, redelivered: true, drainWait: 30 * time.Second}); err != nil {
		return err
	}
	rep.Consumer.Conc = d.cfg.ConsumerC
	rep.Consumer.During = []consumerDuring{{Relays: 1, Pause: defaultFactor}, {Relays: 3, Pause: defaultFactor},
		{Relays: 1, Pause: noPause}, {Relays: 3, Pause: pacedFactor}}
	for r := 0; r < d.cfg.Reps; r++ {
		ds := makeDeliveries(d.cfg.ConsumerN, 0.1, redeliveryGap(d.cfg.ConsumerC), 64, uint64(100+r))
		for v := -1; v < len(rep.Consumer.During); v++ {
			var drainErr error
			var dwg sync.WaitGroup
			if v >= 0 {
				if err := d.restoreBacklog(ctx, "drain_"); err != nil {
					return err
				}
				// Twice the backlog (the same effects once more, as new rows), so that the drain
				// outlasts the consumer run.
				if _, err := d.admin.ExecContext(ctx, `INSERT INTO drain_effects_all (source_consumer, source_id, seq, kind, topic, uuid, payload, metadata, ordering_key, created_at)
					SELECT source_consumer, source_id || '-2', seq, kind, topic, uuid || '-2', payload, metadata, ordering_key, now() - interval '1 minute' FROM drain_backlog ORDER BY id`); err != nil {
					return err
				}
				dv := rep.Consumer.During[v]
				dwg.Add(1)
				go func() {
					defer dwg.Done()
					_, _, _, drainErr = d.outboxDrainNoRestore(ctx, "drain_", dv.Relays, dv.Pause)
				}()
				time.Sleep(200 * time.Millisecond) // the relays are at work
			}
			res, err := e.run(ctx, c, ds, runOpts{conc: d.cfg.ConsumerC, redelivered: true, noReset: true, drainWait: 60 * time.Second})
			dwg.Wait()
			if err != nil {
				return err
			}
			if drainErr != nil {
				return drainErr
			}
			p50, p99 := ms(pct(res.Latencies, 0.5)), ms(pct(res.Latencies, 0.99))
			what := "alone"
			if v < 0 {
				rep.Consumer.AloneP50 = append(rep.Consumer.AloneP50, p50)
				rep.Consumer.AloneP99 = append(rep.Consumer.AloneP99, p99)
			} else {
				dv := &rep.Consumer.During[v]
				dv.P50, dv.P99 = append(dv.P50, p50), append(dv.P99, p99)
				what = fmt.Sprintf("during a drain by %d relays (RelayPauseFactor %g)", dv.Relays, dv.Pause)
			}
			logf("rep %d consumer c=%d %s: p50 %.2f ms, p99 %.2f ms", r+1, d.cfg.ConsumerC, what, p50, p99)
		}
	}
	for i := range rep.Consumer.During {
		rep.Consumer.During[i].Rise = median(rep.Consumer.During[i].P99)/median(rep.Consumer.AloneP99) - 1
	}
	return nil
}

// outboxDrainNoRestore drains what is in the tables of prefix with n instances.
func (d *drainEnv) outboxDrainNoRestore(ctx context.Context, prefix string, n int, pause float64) (float64, *drainPublisher, wireSnapshot, error) {
	var pending int
	if err := d.admin.QueryRowContext(ctx, `SELECT count(*) FROM `+prefix+`effects_all WHERE dispatched_at IS NULL`).Scan(&pending); err != nil {
		return 0, nil, wireSnapshot{}, err
	}
	cfg := d.cfg
	cfg.Effects = pending
	dd := &drainEnv{dsn: d.dsn, admin: d.admin, cfg: cfg}
	return dd.drainNow(ctx, prefix, n, pause)
}

// drainNow drains what is pending in the tables of prefix with n instances.
func (d *drainEnv) drainNow(ctx context.Context, prefix string, n int, pause float64) (float64, *drainPublisher, wireSnapshot, error) {
	pub := newDrainPublisher(true)
	var obs []*outbox.Outbox
	for i := 0; i < n; i++ {
		db, err := sql.Open("postgres", d.dsn)
		if err != nil {
			return 0, nil, wireSnapshot{}, err
		}
		defer db.Close()
		ob, err := outbox.New(outbox.Config{DB: db, Driver: postgres.Driver{}, Publisher: pub, TablePrefix: prefix,
			RelayGrace: time.Second, RelayInterval: 10 * time.Millisecond, CleanupInterval: time.Hour, RelayPauseFactor: pause,
			RelayBatchSize: envInt("OUTBOX_BENCH_RELAY_BATCH")}) // 0: the default
		if err != nil {
			return 0, nil, wireSnapshot{}, err
		}
		obs = append(obs, ob)
	}
	runCtx, stop := context.WithCancel(ctx)
	var wg sync.WaitGroup
	start := time.Now()
	for _, ob := range obs {
		wg.Add(1)
		go func() { defer wg.Done(); _ = ob.Run(runCtx) }()
	}
	took, err := pub.waitCount(ctx, d.cfg.Effects, start, drainLimit)
	stop()
	wg.Wait()
	if err != nil {
		return 0, nil, wireSnapshot{}, err
	}
	return float64(d.cfg.Effects) / took.Seconds(), pub, wireSnapshot{}, nil
}

// idle runs three relays with nothing due for ten seconds and counts their statements; then times
// a claim that finds nothing, on the scale run's tables.
func (d *drainEnv) idle(ctx context.Context, rep *drainReport) error {
	const instances, interval, seconds = 3, 100 * time.Millisecond, 10
	wc := &wireCounters{}
	var obs []*outbox.Outbox
	for i := 0; i < instances; i++ {
		db, err := openCounted(d.dsn, wc, 8)
		if err != nil {
			return err
		}
		defer db.Close()
		ob, err := outbox.New(outbox.Config{DB: db, Driver: postgres.Driver{}, Publisher: newDrainPublisher(false), TablePrefix: "drainfull_",
			RelayInterval: interval, CleanupInterval: time.Hour, EffectRetention: 7 * 24 * time.Hour})
		if err != nil {
			return err
		}
		obs = append(obs, ob)
	}
	runCtx, stop := context.WithCancel(ctx)
	var wg sync.WaitGroup
	for _, ob := range obs {
		wg.Add(1)
		go func() { defer wg.Done(); _ = ob.Run(runCtx) }()
	}
	time.Sleep(time.Second) // the first rounds and connections
	d.statements(ctx, "before the idle rounds")
	w0 := wc.snapshot()
	time.Sleep(seconds * time.Second)
	w := wc.snapshot().sub(w0)
	d.statements(ctx, "idle rounds")
	stop()
	wg.Wait()
	rep.Idle.Instances, rep.Idle.Seconds, rep.Idle.Interval = instances, seconds, interval.Seconds()
	rep.Idle.Statements, rep.Idle.RoundTrips = w.Statements, w.RoundTrips
	rep.Idle.PerRound = float64(w.Statements) / (float64(instances) * seconds / interval.Seconds())

	st := obs[0].Store()
	var took []float64
	for i := 0; i < 200; i++ {
		t := time.Now()
		c, err := st.EffectClaimDue(ctx, outboxdriver.EffectClaimParams{Grace: time.Second, Limit: 500, Lease: time.Minute})
		if err != nil {
			return err
		}
		if len(c.Effects) > 0 {
			return errors.New("idle claim found effects")
		}
		took = append(took, ms(time.Since(t)))
	}
	rep.Idle.ClaimMS = median(took)
	logf("idle: %d statements in %d s by %d relays polling every %s (%.2f per round); an empty claim takes %.2f ms",
		w.Statements, seconds, instances, interval, rep.Idle.PerRound, rep.Idle.ClaimMS)
	return nil
}

const (
	drainBegin = "<!-- BEGIN GENERATED: drain (make bench-drain-quick / make bench-drain-full rewrite everything up to the END marker) -->"
	drainEnd   = "<!-- END GENERATED: drain -->"
)

// writeDrainDocs rewrites the drain section of benchmarks.md (between its markers; appended at
// the end the first time).
func writeDrainDocs(dir string, r *drainReport) error {
	path := filepath.Join(dir, "benchmarks.md")
	old, err := os.ReadFile(path)
	if err != nil {
		return err
	}
	gen := drainBegin + "\n" + drainMarkdown(r) + drainEnd + "\n"
	s := string(old)
	i, j := strings.Index(s, drainBegin), strings.Index(s, drainEnd)
	if i >= 0 && j > i {
		j += len(drainEnd)
		if j < len(s) && s[j] == '\n' {
			j++
		}
		s = s[:i] + gen + s[j:]
	} else {
		s = strings.TrimRight(s, "\n") + "\n\n" + gen
	}
	return os.WriteFile(path, []byte(s), 0o644)
}

func drainMarkdown(r *drainReport) string {
	var b strings.Builder
	p := func(format string, args ...any) { fmt.Fprintf(&b, format, args...) }
	c := r.Config
	p("## Relay drain\n\n")
	p("A backlog of %s side effects on %d ordering keys, committed through `InTx` (%d per call) by instances that were\n", human(c.Effects), c.Keys, c.PerTx)
	p("killed before they dispatched (or while the broker was down), drained by relay instances (each its own\n")
	p("pool, as separate processes) to a publisher that does nothing but count, so that only the relay's own cost\n")
	p("counts; beside Watermill's forwarder (its watermill-sql topic holding the same number of messages, one\n")
	p("consumer group) and River (the same number of jobs, 100 workers) draining theirs, interleaved, in the same\n")
	p("run (`%s`, %d repetitions, %s, PostgreSQL %s, %d CPUs).\n\n", r.Command, c.Reps, r.Started, strings.TrimPrefix(r.Machine.Postgres, "postgres (PostgreSQL) "), r.Machine.CPUs)
	p("| contender | effects/s (median) | runs | statements / effect | round trips / effect | sent twice | out of key order |\n")
	p("| --- | --- | --- | --- | --- | --- | --- |\n")
	for _, row := range r.Rows {
		var rates []string
		for _, v := range row.Rates {
			rates = append(rates, f0(v))
		}
		order := fmt.Sprint(row.Reorders)
		copies := fmt.Sprint(row.Copies)
		if row.Reorders < 0 {
			order, copies = "not checked", "not checked"
		}
		p("| %s | **%s** | %s | %s | %s | %s | %s |\n", row.Contender, f0(row.Median), strings.Join(rates, ", "), f2(row.Stmts), f2(row.RTs), copies, order)
	}
	p("\nWith %s dispatched effects and %s retained IDs in the tables (`EffectRetention` keeps dispatched rows;\n", human(r.Scale.Filler), human(r.Scale.Filler))
	p("loaded in %.0f s), against the same tables empty:\n\n", r.Scale.LoadSeconds)
	p("| run | effects/s (median) | runs |\n| --- | --- | --- |\n")
	for _, row := range r.Scale.Rows {
		var rates []string
		for _, v := range row.Rates {
			rates = append(rates, f0(v))
		}
		p("| %s | %s | %s |\n", row.Contender, f0(row.Median), strings.Join(rates, ", "))
	}
	p("\nThe consumer path (outbox-middleware at c=%d, as in the main table) alone and while relays drain a backlog\n", r.Consumer.Conc)
	p("of %s on the same database, interleaved (medians of %d runs; everything, the database, the relays and the\n", human(2*c.Effects), len(r.Consumer.AloneP99))
	p("consumers, shares the machine's %d CPUs):\n\n", r.Machine.CPUs)
	p("| run | p50 ms | p99 ms | p99 against alone |\n| --- | --- | --- | --- |\n")
	p("| alone | %s | %s | |\n", f2(median(r.Consumer.AloneP50)), f2(median(r.Consumer.AloneP99)))
	for _, dv := range r.Consumer.During {
		p("| during a drain by %d relay%s (RelayPauseFactor %g) | %s | %s | %+.0f%% |\n", dv.Relays, plural(dv.Relays), dv.Pause, f2(median(dv.P50)), f2(median(dv.P99)), 100*dv.Rise)
	}
	p("\n")
	p("Idle: %d relays polling every %.0f ms with nothing due made %d statements in %.0f s, %.2f per round, with no\n",
		r.Idle.Instances, r.Idle.Interval*1000, r.Idle.Statements, r.Idle.Seconds, r.Idle.PerRound)
	p("transaction; one such claim took %.2f ms (median) with the scale run's %s rows in the table.\n\n", r.Idle.ClaimMS, human(r.Scale.Filler))
	t := func(name string, min float64) string {
		for _, row := range r.Rows {
			if row.Contender == name {
				return fmt.Sprintf("%s (%s)", f0(row.Median), yesNo(row.Median >= min, true))
			}
		}
		return "-"
	}
	flat := "-"
	if len(r.Scale.Rows) == 4 {
		flat = fmt.Sprintf("x1 %.2f, x3 %.2f of the empty tables' rate", r.Scale.Rows[1].Median/r.Scale.Rows[0].Median, r.Scale.Rows[3].Median/r.Scale.Rows[2].Median)
	}
	p("| target | measured |\n| --- | --- |\n")
	p("| one instance >= 10,000 effects/s | %s |\n", t("outbox x1", 10000))
	p("| three instances >= 20,000 effects/s | %s |\n", t("outbox x3", 20000))
	p("| flat with %s dispatched rows and retained IDs | %s |\n", human(r.Scale.Filler), flat)
	p("| per-key order, nothing sent twice | %s |\n", yesNo(r.Rows[0].Copies+r.Rows[1].Copies+r.Rows[0].Reorders+r.Rows[1].Reorders == 0, true))
	for _, dv := range r.Consumer.During {
		p("| consumer p99 during a drain by %d relay%s (RelayPauseFactor %g) <= +50%% | %+.0f%% (%s) |\n", dv.Relays, plural(dv.Relays), dv.Pause, 100*dv.Rise, yesNo(dv.Rise <= 0.5, true))
	}
	p("| an idle round: one statement, no transaction | %.2f statements per round (%s) |\n\n", r.Idle.PerRound, yesNo(r.Idle.PerRound <= 1.05, true))
	for _, n := range r.Notes {
		p("- %s\n", n)
	}
	return b.String()
}
