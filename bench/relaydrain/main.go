// Command relaydrain drains a backlog of side effects with relay instances of the library it is
// built against, and prints effects per second. It uses only the library's public API, so that the
// same file builds against an older commit of the library (copied into that commit's bench/): the
// two binaries, run alternately against one PostgreSQL, compare two relays with nothing else
// different (see docs/benchmarks.md, "The relay against the one before it").
//
//	relaydrain -dsn postgres://postgres@127.0.0.1:5432/postgres -instances 3 -reps 3 -label new
//
// Each repetition creates a fresh database, builds the backlog through InTx as instances killed
// after their commits leave it (30,000 effects on 300 ordering keys, ten per call) and drains it
// with -instances relays, each with its own pool, to a publisher that only counts (or that takes
// -per-message for each message of a call; calls overlap). It checks that no effect was sent twice
// or out of its key's store order.
package main

import (
	"context"
	"database/sql"
	"errors"
	"flag"
	"fmt"
	"net/url"
	"os"
	"reflect"
	"runtime/pprof"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/lib/pq"

	"github.com/watermill-outbox/outbox"
	"github.com/watermill-outbox/outbox/drivers/postgres"
)

var errCrash = errors.New("crash after commit")

func main() {
	dsn := flag.String("dsn", os.Getenv("OUTBOX_BENCH_DSN"), "superuser DSN of the server (a database relaydrain_<label> is created on it)")
	label := flag.String("label", "run", "name of this contender in the output and in the database's name")
	instances := flag.Int("instances", 3, "relay instances")
	effects := flag.Int("effects", 30000, "effects in the backlog")
	keys := flag.Int("keys", 300, "ordering keys the backlog is spread over")
	reps := flag.Int("reps", 1, "repetitions")
	perMessage := flag.Duration("per-message", 0, "time the destination takes per message of a call")
	concurrency := flag.Int("concurrency", 0, "RelayConcurrency (0: the library's default; ignored by a library without it)")
	batch := flag.Int("batch", 0, "RelayBatchSize (0: the library's default)")
	pause := flag.Float64("pause", 0, "RelayPauseFactor (0: the library's default)")
	cpuprofile := flag.String("cpuprofile", "", "write a CPU profile of the drains (not of the backlog's build) to this file")
	reuse := flag.Bool("reuse", false, "keep the database and a copy of the backlog after the run, and restore the backlog from that copy when it is there instead of building it again (a drain every few seconds: more alternations in the same time)")
	analyze := flag.Bool("analyze", false, "VACUUM ANALYZE the database after the backlog is built (default: leave it to autovacuum, as a real backlog is)")
	pgss := flag.Bool("pgss", false, "print the statements that took most of the server's time during each drain (needs pg_stat_statements loaded)")
	flag.Parse()
	if err := run(*dsn, *label, *instances, *effects, *keys, *reps, *perMessage, *concurrency, *batch, *pause, *cpuprofile, *reuse, *analyze, *pgss); err != nil {
		fmt.Fprintln(os.Stderr, "relaydrain:", err)
		os.Exit(1)
	}
}

func run(dsn, label string, instances, effects, keys, reps int, perMessage time.Duration, concurrency, batch int, pause float64, cpuprofile string, reuse, analyze, pgss bool) error {
	ctx := context.Background()
	admin, err := sql.Open("postgres", dsn)
	if err != nil {
		return err
	}
	defer admin.Close()
	dbname := "relaydrain_" + label
	u, err := url.Parse(dsn)
	if err != nil {
		return err
	}
	u.Path = "/" + dbname
	var prof *os.File
	if cpuprofile != "" {
		if prof, err = os.Create(cpuprofile); err != nil {
			return err
		}
		defer prof.Close()
	}
	for rep := 0; rep < reps; rep++ {
		d := drain{dsn: u.String(), instances: instances, effects: effects, keys: keys, perMessage: perMessage,
			concurrency: concurrency, batch: batch, pause: pause, analyze: analyze, pgss: pgss}
		restored := false
		if reuse {
			if restored, err = d.restore(ctx); err != nil {
				return fmt.Errorf("restore: %w", err)
			}
		}
		if !restored {
			for _, q := range []string{`DROP DATABASE IF EXISTS ` + dbname + ` WITH (FORCE)`, `CREATE DATABASE ` + dbname} {
				if _, err := admin.ExecContext(ctx, q); err != nil {
					return err
				}
			}
			if err := d.backlog(ctx); err != nil {
				return fmt.Errorf("backlog: %w", err)
			}
		}
		if prof != nil && rep == 0 {
			if err := pprof.StartCPUProfile(prof); err != nil {
				return err
			}
		}
		rate, err := d.drain(ctx)
		if prof != nil && rep == reps-1 {
			pprof.StopCPUProfile()
		}
		if err != nil {
			return fmt.Errorf("drain: %w", err)
		}
		fmt.Printf("%s instances=%d per_message=%s effects/s=%.0f\n", label, instances, perMessage, rate)
	}
	if reuse {
		return nil
	}
	_, err = admin.ExecContext(ctx, `DROP DATABASE IF EXISTS `+dbname+` WITH (FORCE)`)
	return err
}

// restore puts the backlog a run with -reuse kept back in place, as new rows whose store IDs
// follow the order they were recorded in, after a VACUUM that clears what the last drain left.
// It returns false when there is no copy to restore.
func (d *drain) restore(ctx context.Context) (bool, error) {
	db, err := sql.Open("postgres", d.dsn)
	if err != nil {
		return false, err
	}
	defer db.Close()
	var kept sql.NullString
	if err := db.QueryRowContext(ctx, `SELECT to_regclass('relaydrain_backlog')::text`).Scan(&kept); err != nil {
		var pqErr *pq.Error
		if errors.As(err, &pqErr) && pqErr.Code == "3D000" {
			return false, nil // no database yet
		}
		return false, err
	}
	if !kept.Valid {
		return false, nil
	}
	if err := d.findEffects(ctx, db); err != nil {
		return false, err
	}
	const cols = `source_consumer, source_id, seq, kind, topic, uuid, payload, metadata, ordering_key`
	for _, q := range []string{
		`DELETE FROM ` + d.effectsView + ` WHERE dispatched_at IS NULL`,
		`VACUUM`,
		`INSERT INTO ` + d.effectsView + ` (` + cols + `, created_at) SELECT ` + cols + `, now() - interval '1 minute' FROM relaydrain_backlog ORDER BY id`,
		`CHECKPOINT`,
	} {
		if _, err := db.ExecContext(ctx, q); err != nil {
			return false, err
		}
	}
	return true, nil
}

// findEffects names the effects table as the relay reads it: a partitioned parent since
// migration 023.
func (d *drain) findEffects(ctx context.Context, db *sql.DB) error {
	var parent sql.NullString
	if err := db.QueryRowContext(ctx, `SELECT to_regclass('outbox_effects_all')::text`).Scan(&parent); err != nil {
		return err
	}
	d.effectsView = "/* partition 0 */ outbox_effects" // a library from before migration 023: the one table
	if parent.Valid {
		d.effectsView = parent.String
	}
	return nil
}

type drain struct {
	dsn                      string
	instances, effects, keys int
	perMessage               time.Duration
	concurrency, batch       int
	pause                    float64
	analyze, pgss            bool
	effectsView              string
}

// config is the relay's configuration; fields the library does not have are left out.
func (d *drain) config(db *sql.DB, pub message.Publisher) outbox.Config {
	c := outbox.Config{DB: db, Driver: postgres.Driver{}, Publisher: pub,
		RelayGrace: time.Second, RelayInterval: 10 * time.Millisecond, CleanupInterval: time.Hour,
		RelayBatchSize: d.batch, RelayPauseFactor: d.pause}
	if f := reflect.ValueOf(&c).Elem().FieldByName("RelayConcurrency"); f.IsValid() && d.concurrency != 0 {
		f.SetInt(int64(d.concurrency))
	}
	return c
}

// backlog commits the effects through InTx, ten per call, eight callers, each "crashing" after
// its commit so that nothing is dispatched, and waits until they are older than RelayGrace.
func (d *drain) backlog(ctx context.Context) error {
	db, err := sql.Open("postgres", d.dsn)
	if err != nil {
		return err
	}
	defer db.Close()
	c := d.config(db, &counter{})
	c.Failpoint = func(_ context.Context, point string) error {
		if point == outbox.FailpointAfterCommit {
			return errCrash
		}
		return nil
	}
	ob, err := outbox.New(c)
	if err != nil {
		return err
	}
	if err := ob.Migrate(ctx); err != nil {
		return err
	}
	if err := d.findEffects(ctx, db); err != nil {
		return err
	}
	const perTx = 10
	var next atomic.Int64
	seq := make([]atomic.Int64, d.keys)
	var wg sync.WaitGroup
	errs := make(chan error, 8)
	for w := 0; w < 8; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				i := int(next.Add(perTx)) - perTx
				if i >= d.effects {
					return
				}
				key := i / perTx % d.keys
				err := ob.InTx(ctx, func(ctx context.Context, _ *sql.Tx) error {
					ctx = outbox.WithOrderingKey(ctx, fmt.Sprintf("key-%d", key))
					var msgs []*message.Message
					for j := 0; j < perTx && i+j < d.effects; j++ {
						msgs = append(msgs, message.NewMessage(uuid.NewString(), []byte(fmt.Sprintf("key-%d %d", key, seq[key].Add(1)))))
					}
					return outbox.Publish(ctx, "out", msgs...)
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
	if _, err := db.ExecContext(ctx, `CREATE TABLE relaydrain_backlog AS SELECT source_consumer, source_id, seq, kind, topic, uuid, payload, metadata, ordering_key, id FROM `+d.effectsView); err != nil {
		return err
	}
	if d.analyze {
		if _, err := db.ExecContext(ctx, `VACUUM ANALYZE`); err != nil {
			return err
		}
	}
	if _, err := db.ExecContext(ctx, `CHECKPOINT`); err != nil {
		return err
	}
	time.Sleep(time.Second) // RelayGrace
	return nil
}

func (d *drain) drain(ctx context.Context) (float64, error) {
	admin, err := sql.Open("postgres", d.dsn)
	if err != nil {
		return 0, err
	}
	defer admin.Close()
	pub := &counter{perMessage: d.perMessage, seen: map[string]bool{}, last: map[string]int{}}
	if err := pub.expectStoreOrder(ctx, admin, d.effectsView); err != nil {
		return 0, err
	}
	if d.pgss {
		if _, err := admin.ExecContext(ctx, `CREATE EXTENSION IF NOT EXISTS pg_stat_statements`); err != nil {
			return 0, err
		}
		if _, err := admin.ExecContext(ctx, `SELECT pg_stat_statements_reset()`); err != nil {
			return 0, err
		}
	}
	var obs []*outbox.Outbox
	for i := 0; i < d.instances; i++ {
		db, err := sql.Open("postgres", d.dsn)
		if err != nil {
			return 0, err
		}
		db.SetMaxOpenConns(8)
		defer db.Close()
		ob, err := outbox.New(d.config(db, pub))
		if err != nil {
			return 0, err
		}
		obs = append(obs, ob)
	}
	runCtx, stop := context.WithCancel(ctx)
	defer stop()
	var wg sync.WaitGroup
	start := time.Now()
	for _, ob := range obs {
		wg.Add(1)
		go func() { defer wg.Done(); _ = ob.Run(runCtx) }()
	}
	limit := time.Now().Add(10 * time.Minute)
	for pub.n.Load() < int64(d.effects) {
		if time.Now().After(limit) {
			stop()
			wg.Wait()
			return 0, fmt.Errorf("drained %d of %d in 10 minutes", pub.n.Load(), d.effects)
		}
		time.Sleep(time.Millisecond)
	}
	took := time.Since(start)
	// The marks of the last rounds, before the relays stop.
	for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline); time.Sleep(5 * time.Millisecond) {
		var pending int
		if err := admin.QueryRowContext(ctx, `SELECT count(*) FROM `+d.effectsView+` WHERE dispatched_at IS NULL`).Scan(&pending); err != nil {
			return 0, err
		}
		if pending == 0 {
			break
		}
	}
	stop()
	wg.Wait()
	pub.mu.Lock()
	defer pub.mu.Unlock()
	if pub.copies > 0 || pub.reorders > 0 {
		return 0, fmt.Errorf("%d effects sent twice, %d out of their key's order", pub.copies, pub.reorders)
	}
	if d.pgss {
		printStatements(ctx, admin)
	}
	return float64(d.effects) / took.Seconds(), nil
}

func printStatements(ctx context.Context, db *sql.DB) {
	rows, err := db.QueryContext(ctx, `SELECT calls, round(total_exec_time)::bigint, round(mean_exec_time::numeric, 3), rows,
			shared_blks_hit + shared_blks_read, regexp_replace(left(query, 110), '\s+', ' ', 'g')
		FROM pg_stat_statements WHERE dbid = (SELECT oid FROM pg_database WHERE datname = current_database())
		ORDER BY total_exec_time DESC LIMIT 8`)
	if err != nil {
		fmt.Fprintln(os.Stderr, "pg_stat_statements:", err)
		return
	}
	defer rows.Close()
	for rows.Next() {
		var calls, total, n, blks int64
		var mean float64
		var q string
		if err := rows.Scan(&calls, &total, &mean, &n, &blks, &q); err != nil {
			fmt.Fprintln(os.Stderr, "pg_stat_statements:", err)
			return
		}
		fmt.Printf("  %6d calls %6d ms (%.3f ms each) %7d rows %8d blocks  %s\n", calls, total, mean, n, blks, q)
	}
}

// counter takes every message, waits perMessage per message of a call, and checks that no UUID
// comes twice and that each key's messages come in their store order.
type counter struct {
	perMessage time.Duration
	mu         sync.Mutex
	seen       map[string]bool
	expect     map[string][2]any // UUID -> key, rank
	last       map[string]int
	copies     int
	reorders   int
	n          atomic.Int64
}

func (p *counter) expectStoreOrder(ctx context.Context, db *sql.DB, table string) error {
	rows, err := db.QueryContext(ctx, `SELECT uuid, ordering_key, row_number() OVER (PARTITION BY ordering_key ORDER BY id) FROM `+table+` WHERE dispatched_at IS NULL`)
	if err != nil {
		return err
	}
	defer rows.Close()
	p.expect = map[string][2]any{}
	for rows.Next() {
		var id, key string
		var rank int
		if err := rows.Scan(&id, &key, &rank); err != nil {
			return err
		}
		p.expect[id] = [2]any{key, rank}
	}
	return rows.Err()
}

func (p *counter) Publish(_ string, msgs ...*message.Message) error {
	if p.perMessage > 0 {
		time.Sleep(time.Duration(len(msgs)) * p.perMessage)
	}
	if p.seen == nil {
		return nil
	}
	p.mu.Lock()
	for _, m := range msgs {
		if p.seen[m.UUID] {
			p.copies++
			continue
		}
		p.seen[m.UUID] = true
		if kr, ok := p.expect[m.UUID]; ok {
			key, rank := kr[0].(string), kr[1].(int)
			if last, ok := p.last[key]; ok && rank < last {
				p.reorders++
			}
			p.last[key] = rank
		}
	}
	p.mu.Unlock()
	p.n.Add(int64(len(msgs)))
	return nil
}

func (p *counter) Close() error { return nil }
