package main

import (
	"fmt"
	"math"
	"os"
	"path/filepath"
	"strings"
)

type machine struct {
	CPUs           int
	CPU            string
	MemGB          float64
	OS             string
	Go             string
	Postgres       string
	ServerSettings string
	LoadAtStart    string
	LoadAtEnd      string `json:",omitempty"`
	// Pooler is the PgBouncer the -pgbouncer contenders go through, when they ran.
	Pooler string `json:",omitempty"`
	// MySQL is the server of the -mysql contenders (bench/mysql.go), when they ran.
	MySQL string `json:",omitempty"`
}

type cell struct {
	Contender      string
	Path           string
	Conc           int
	Messages       int
	Seconds        float64
	Throughput     float64
	P50, P99       float64 // ms
	RoundTrips     float64 // per message, all (background work included)
	SyncRoundTrips float64 // per message, made from the consumer goroutine: the ones a message waits for
	Statements     float64
	Parses         float64
	WALBytes       float64
	Errors         int
	Undelivered    int
	PeakHeapMB     float64
	Resent         int64 // outgoing messages published again (same delivery), e.g. by a relay racing a late mark
	// ServerCPUus is the server's CPU time per message (all its processes; -1: not measured, the
	// server is not on this machine), ClientCPUus the benchmark process's (the contender's, the
	// harness's and the broker's), Allocs its Go heap allocations per message.
	ServerCPUus, ClientCPUus, Allocs float64
}

type safetyRow struct {
	Contender      string
	Path           string
	Safe           bool
	CrashPoint     string
	Deliveries     int
	Unique         int
	InjectedDups   int
	Crashes        int
	DupsApplicable bool
	DupApplied     int // business changes applied more than once
	Lost           int // messages whose business change or outgoing message never happened
	ResentSameID   int // extra copies on the wire with the same UUID (a wrapped consumer drops them)
	CopiesNewID    int // extra outgoing messages with a new UUID (nothing downstream can tell them apart)
	Throughput     float64
	P99            float64
	Undelivered    int // committed for a relay but not published when the 30 s wait ran out (counted in Lost)
	HashCollisions int // watermill-stack: distinct messages whose default dedup keys (Adler-32 of the payload) collide
}

type memRow struct {
	Messages   int
	PeakHeapMB float64
	LiveMB     []float64 // live heap after a GC at 10%, 50%, 90% of the run
}

// growthMB is the live heap's growth over the second half of the run, after the warm-up (pools,
// buffers, prepared statements) that the first part includes.
func (m memRow) growthMB() float64 {
	if len(m.LiveMB) < 2 {
		return 0
	}
	return m.LiveMB[len(m.LiveMB)-1] - m.LiveMB[len(m.LiveMB)-2]
}

type report struct {
	Mode        string
	Config      config
	Started     string
	DurationSec float64
	Command     string
	Machine     machine
	Cells       []cell
	Safety      []safetyRow
	Scale       struct {
		Retained int
		TableMB  float64
		Rows     []cell
	}
	Cleanup struct {
		Expired int
		Conc    int
		Deleted int64
		Seconds float64
		Rows    []cell
	}
	Memory []memRow
	Notes  []string
	// Ratios are the framework's throughput over its bare form's, per concurrency (ratios).
	Ratios []ratioRow `json:",omitempty"`
}

// retainedPair finds the empty and the retained row of the retained-IDs run at conc of the form
// of label (either of its two labels: "empty", "retained", "empty-pgx", "retained-pgx").
func (r *report) retainedPair(label string, conc int) (empty, retained cell, ok bool) {
	suffix := ""
	if strings.HasSuffix(label, "-pgx") {
		suffix = "-pgx"
	}
	want := "retained" + suffix
	if strings.HasPrefix(label, "retained-ordered") {
		want = "retained-ordered" + suffix
	}
	for _, c := range r.Scale.Rows {
		if c.Conc != conc {
			continue
		}
		switch c.Contender {
		case "empty" + suffix:
			empty = c
		case want:
			retained = c
		}
	}
	return empty, retained, empty.Messages > 0 && retained.Messages > 0 && empty.Throughput > 0
}

func (r *report) cell(name string, conc int) (cell, bool) {
	for _, c := range r.Cells {
		if c.Contender == name && c.Conc == conc {
			return c, true
		}
	}
	return cell{}, false
}

const (
	beginMarker = "<!-- BEGIN GENERATED: bench (make bench-quick / make bench-full rewrite everything up to the END marker) -->"
	endMarker   = "<!-- END GENERATED: bench -->"
)

// writeDocs writes benchmarks.svg and the generated part of benchmarks.md; text outside the
// markers (for example a section on the micro-benchmarks) is kept as it is.
func writeDocs(dir string, r *report) error {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	if len(r.Ratios) == 0 {
		r.Ratios = ratios(r) // results written before the ratios were
	}
	if err := os.WriteFile(filepath.Join(dir, "benchmarks.svg"), []byte(chart(r)), 0o644); err != nil {
		return err
	}
	path := filepath.Join(dir, "benchmarks.md")
	gen := beginMarker + "\n" + markdown(r) + endMarker + "\n"
	old, err := os.ReadFile(path)
	var out string
	switch {
	case err == nil && strings.Contains(string(old), beginMarker) && strings.Contains(string(old), endMarker):
		s := string(old)
		i := strings.Index(s, beginMarker)
		j := strings.Index(s, endMarker) + len(endMarker)
		if j < len(s) && s[j] == '\n' {
			j++
		}
		out = s[:i] + gen + s[j:]
	case err == nil:
		out = strings.TrimRight(string(old), "\n") + "\n\n" + gen
	case os.IsNotExist(err):
		out = introSection + gen + "\n" + microSection
	default:
		return err
	}
	return os.WriteFile(path, []byte(out), 0o644)
}

// introSection and microSection open and close a benchmarks.md that does not exist yet; once it
// does, only the generated part between the markers is rewritten.
const introSection = `# Benchmarks

What exactly-once costs here, measured against the alternatives and against the database's own
commit limit, by the benchmark program in [` + "`" + `bench/` + "`" + `](../bench) (its own Go module, so that River and
rbaliyan/event never enter the library's ` + "`" + `go.mod` + "`" + `):

` + "`" + `` + "`" + `` + "`" + `sh
make bench-quick   # reduced sizes: 80-110 s on this machine kind (2 CPUs), plus the first compile
make bench-full    # the full sizes (10M retained IDs, 1M expired rows): 15-30 minutes here
                   # (27 min on a busy machine, 5 of them loading the 10M rows)
` + "`" + `` + "`" + `` + "`" + `

Both start a throwaway PostgreSQL from the local binaries (` + "`" + `apt-get install postgresql` + "`" + `; or set
` + "`" + `OUTBOX_BENCH_DSN` + "`" + ` to a superuser DSN) and an in-process NATS JetStream, run every contender, and
rewrite the part of this file between the markers below and [` + "`" + `benchmarks.svg` + "`" + `](benchmarks.svg); the
raw numbers go to ` + "`" + `bench/results-<mode>.json` + "`" + `, from which ` + "`" + `cd bench && go run . -render
results-<mode>.json` + "`" + ` renders the same tables and chart again without running anything. Numbers from a
machine that is busy with other work are noisy: compare contenders within one run (they are
interleaved), not across runs.

`

const microSection = `## Micro-benchmarks of the hot path

` + "```sh" + `
go test -run '^$' -bench . -benchtime 2s .          # library: BenchmarkHandle, BenchmarkBareHandler, BenchmarkHandleDuplicate, BenchmarkMark, BenchmarkClaim
cd bench && go test -run '^$' -bench . -benchtime 2s # claim, store, dispatch, mark, one step at a time (starts its own PostgreSQL and NATS)
` + "```" + `

They time one step of the unit of work at a time against a real PostgreSQL and broker, on one
connection (no concurrency): use them to see which step a change makes cheaper; use the table above
for what it does to throughput.
`

func f0(v float64) string { return fmt.Sprintf("%.0f", v) }
func f1(v float64) string { return fmt.Sprintf("%.1f", v) }
func f2(v float64) string { return fmt.Sprintf("%.2f", v) }

func markdown(r *report) string {
	var b strings.Builder
	w := func(format string, args ...any) { fmt.Fprintf(&b, format, args...) }
	cfg := r.Config
	reduced := ""
	if r.Mode == "quick" {
		reduced = " **Quick mode: reduced sizes** (full mode: `make bench-full`)."
	}
	w("## The cost of exactly-once, side by side\n\n")
	w("Produced by `%s` (mode `%s`, %s, took %.0f s).%s\n\n", r.Command, r.Mode, r.Started, r.DurationSec, reduced)
	w("Machine: %d CPUs (%s), %.0f GiB, %s, %s, %s; load average at start %s. Server settings: %s.\n\n",
		r.Machine.CPUs, r.Machine.CPU, r.Machine.MemGB, r.Machine.OS, r.Machine.Go, r.Machine.Postgres, r.Machine.LoadAtStart, r.Machine.ServerSettings)
	if r.Machine.LoadAtEnd != "" {
		w("Load average at the end: %s.", r.Machine.LoadAtEnd)
		if r.Machine.Pooler != "" {
			w(" ")
		} else {
			w("\n\n")
		}
	}
	if r.Machine.Pooler != "" {
		w("Pooler of the -pgbouncer contenders: %s.\n\n", r.Machine.Pooler)
	}
	w("Parameters: %d deliveries per contender and concurrency, in %d interleaved repetitions; concurrency %s; "+
		"%.0f%% of the deliveries are duplicates, each 2c+100..2c+%d deliveries after its original (c consumers) and handed out only once "+
		"the original was acked, as a broker redelivers after an ack deadline; safety check: %d deliveries; "+
		"retained IDs: %s; expired rows cleaned: %s.\n\n",
		cfg.N, cfg.Reps, joinInts(cfg.Concs), cfg.DupRate*100, 100+cfg.DupWindow-1, cfg.SafetyN, human(cfg.Retained), human(cfg.Expired))

	if cfg.Broker == "none" || cfg.Workload == workloadTwoStatement {
		w("**This run differs from the standard one:** broker `%s`, workload `%s` (see \"Framework over bare\" below).\n\n", or(cfg.Broker, "nats"), or(cfg.Workload, workloadInsert))
	}
	w("### What is measured\n\n")
	w(whatIsMeasured)
	w("%s", ratiosMarkdown(r))

	w("\n### Results\n\n")
	w("![throughput and p99 per contender and concurrency](benchmarks.svg)\n\n")
	w("| contender | path | consumers | msg/s | p50 ms | p99 ms | p50 added vs bare, ms | round trips/msg: waited for / all | statements/msg | WAL bytes/msg | re-sent |\n")
	w("|---|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|\n")
	for _, c := range withoutMySQL(r).Cells { // theirs: mysqlSection
		note := ""
		if c.Errors > 0 {
			note += fmt.Sprintf(" (%d errors)", c.Errors)
		}
		if c.Undelivered > 0 {
			note += fmt.Sprintf(" (%d undelivered)", c.Undelivered)
		}
		added := "–"
		if b, ok := r.cell("bare", c.Conc); ok && c.Contender != "bare" && c.Path != "floor" {
			added = fmt.Sprintf("%+.2f", c.P50-b.P50)
		}
		w("| %s%s | %s | %d | %s | %s | %s | %s | %s / %s | %s | %s | %d |\n", c.Contender, note, c.Path, c.Conc, f0(c.Throughput), f2(c.P50), f2(c.P99),
			added, f2(c.SyncRoundTrips), f2(c.RoundTrips), f2(c.Statements), f0(c.WALBytes), c.Resent)
	}
	w("\nRound trips and statements are per delivery (duplicates included), read off the wire of the contender's own connections. " +
		"\"Waited for\" counts the round trips written from the consumer goroutine itself (database/sql runs the driver in the caller's goroutine): " +
		"the ones a message waits for before it is acked. Telling the goroutine costs a stack dump per round trip, so it is read in a short untimed pass " +
		"(300 deliveries per contender and concurrency) before the timed runs, which only count; \"all\" adds background work (relays, River's producer, completer and maintenance, " +
		"the forwarder's polling, the framework's relay and anything it writes after the ack). " +
		"Latency is from taking a delivery to its outgoing message being acknowledged by the broker " +
		"(for a duplicate that publishes nothing: until the handler returns). Re-sent: outgoing messages published again for a delivery " +
		"that had already published one, by a duplicate or a relay, counted until the contender's background work stopped (same UUID: harmless downstream).\n")

	w("\n### Targets\n\n")
	w("| target | measured | met |\n|---|---|---|\n")
	for _, t := range targets(r) {
		w("| %s | %s | %s |\n", t.name, t.measured, yesNo(t.met, t.known))
	}
	var why []string
	for _, t := range targets(r) {
		if t.known && !t.met && t.why != "" {
			why = append(why, "- **"+t.name+"**: "+t.why)
		}
	}
	if len(why) > 0 {
		w("\nWhy the missed targets are missed:\n\n%s\n", strings.Join(why, "\n"))
	}

	w("\n### Duplicates and losses (safety check)\n\n")
	w("%d deliveries at %d consumers; on the consumer path %.0f%% are duplicates, each 1..%d deliveries after its original and handed out "+
		"without waiting for it, so that some copies run at the same time as their original (a producer's retried publish, a consumer group "+
		"rebalance); one message crashes once at the point shown and is then redelivered (the process is restarted: in-memory state is lost). "+
		"Then the relays get up to 30 s to finish. msg/s and p99 are of this run (concurrent copies and a crash), for comparison with the table above, "+
		"where a copy is only handed out after its original was acked.\n\n", cfg.SafetyN, slicesMax(cfg.Concs), cfg.DupRate*100, cfg.DupWindow)
	w("| contender | claims exactly-once | crash point | business changes applied twice | messages lost | re-sent, same ID | extra copies, new ID | msg/s | p99 ms |\n")
	w("|---|---|---|--:|--:|--:|--:|--:|--:|\n")
	for _, s := range r.Safety {
		dup := fmt.Sprint(s.DupApplied)
		if !s.DupsApplicable {
			dup = "n/a (no incoming ID)"
		}
		lost := fmt.Sprint(s.Lost)
		var notes []string
		if s.Undelivered > 0 {
			notes = append(notes, fmt.Sprintf("%d not sent within 30 s", s.Undelivered))
		}
		if s.HashCollisions > 0 {
			notes = append(notes, fmt.Sprintf("%d Adler-32 key collision(s) among distinct payloads", s.HashCollisions))
		}
		if len(notes) > 0 {
			lost += " (" + strings.Join(notes, "; ") + ")"
		}
		w("| %s | %s | %s | %s | %s | %d | %d | %s | %s |\n", s.Contender, yesNo(s.Safe, true), s.CrashPoint, dup, lost, s.ResentSameID, s.CopiesNewID,
			f0(s.Throughput), f2(s.P99))
	}
	w("\n\"Re-sent, same ID\" copies are harmless: a consumer that deduplicates (this framework's middleware) drops them. " +
		"\"Extra copies, new ID\" are not: nothing downstream can tell them from new messages.\n")

	if len(r.Scale.Rows) > 0 {
		w("\n### Scale: %s retained IDs in the dedup table\n\n", human(r.Scale.Retained))
		w("The consumer path of each form (outbox-middleware: database/sql; outbox-pgx: pgx, optimistic) on an empty processed table and on one "+
			"holding %s retained claims (up to %.0f MiB with its indexes; loaded with INSERT ... SELECT and the primary key rebuilt, so its index "+
			"is denser than one grown by random inserts), all interleaved. Retained / empty is the throughput ratio of the form's rows. "+
			"On retained-ordered, the same retained table receives the same deliveries with time-ordered message IDs (UUID version 7, "+
			"as outbox.NewUUID makes outside a unit of work) instead of random ones: each claim then lands at the right edge of the "+
			"primary key instead of on a random page of it.\n\n",
			human(r.Scale.Retained), r.Scale.TableMB)
		w("| table | form | consumers | msg/s | p50 ms | p99 ms | WAL bytes/msg | retained / empty |\n|---|---|--:|--:|--:|--:|--:|--:|\n")
		for _, c := range r.Scale.Rows {
			ratio := "–"
			if e, big, ok := r.retainedPair(c.Contender, c.Conc); ok && c.Contender == big.Contender {
				ratio = f2(big.Throughput / e.Throughput)
			}
			w("| %s | %s | %d | %s | %s | %s | %s | %s |\n", strings.TrimSuffix(c.Contender, "-pgx"), or(c.Path, "outbox-middleware"), c.Conc,
				f0(c.Throughput), f2(c.P50), f2(c.P99), f0(c.WALBytes), ratio)
		}
	}
	if len(r.Cleanup.Rows) > 0 {
		w("\n### Scale: retention cleanup while consuming\n\n")
		w("%s expired claims; the consumer path at %d consumers before, during and after `Store.Cleanup` "+
			"(what `Outbox.Run` calls: batches of 1000, one short transaction each) deleted them: %d rows in %.1f s.\n\n",
			human(r.Cleanup.Expired), r.Cleanup.Conc, r.Cleanup.Deleted, r.Cleanup.Seconds)
		w("| phase | messages | msg/s | p50 ms | p99 ms |\n|---|--:|--:|--:|--:|\n")
		for _, c := range r.Cleanup.Rows {
			w("| %s | %d | %s | %s | %s |\n", c.Contender, c.Messages, f0(c.Throughput), f2(c.P50), f2(c.P99))
		}
	}
	if len(r.Memory) > 0 {
		w("\n### Memory\n\n")
		w("The consumer path at 4 consumers with n and 4n messages: the live Go heap (after a forced GC), less what the in-process NATS server " +
			"holds (its stream's block buffers grow with the stream, up to a cap; estimated from the heap profile), at 10%%, 50%% and 90%% of the run, " +
			"and the peak heap (live and garbage, sampled every 20 ms). The harness allocates its per-delivery arrays before the run, " +
			"so growth during a run is the framework's; the first part of a run includes warm-up (connection pools, buffers), so flatness is " +
			"judged from 50%% to 90%%, and across n and 4n (the live heap at 10%% also holds the harness's list of n deliveries).\n\n")
		w("| messages | live heap at 10%% / 50%% / 90%%, MiB | growth 50%%→90%%, MiB | peak heap MiB |\n|--:|--|--:|--:|\n")
		for _, m := range r.Memory {
			parts := make([]string, len(m.LiveMB))
			for i, v := range m.LiveMB {
				parts[i] = f2(v)
			}
			w("| %d | %s | %+.2f | %s |\n", m.Messages, strings.Join(parts, " / "), m.growthMB(), f1(m.PeakHeapMB))
		}
	}
	w("%s", mysqlSection(r))
	if len(r.Notes) > 0 {
		w("\n### Notes\n\n")
		for _, n := range r.Notes {
			w("- %s\n", n)
		}
	}
	w("\nRaw numbers: `bench/results-%s.json`; re-render without running: `cd bench && go run . -render results-%s.json`.\n\n", r.Mode, r.Mode)
	return b.String()
}

const whatIsMeasured = `The workload is the same for every contender: take an incoming message (a pre-generated list of
deliveries, duplicates included), run one business write (` + "`INSERT INTO applied (message_id) VALUES ($1)`" + `
through ` + "`tx.ExecContext`" + `, in a transaction where the contender has one) and produce one outgoing message to a
real broker, from N goroutines (the "consumers"). The broker is an in-process NATS JetStream server (file storage, publish
waits for the stream's ack), shared by all contenders; PostgreSQL is one throwaway server (synchronous_commit on).
Measured is the consumer side: from taking a delivery to its outgoing message acknowledged by the broker. Subscribing to the
incoming broker and acking are left out, alike for every contender. Contenders whose relay publishes later (watermill-stack,
River) are timed until the relay has published everything; the framework's relay runs (Outbox.Run) but the fast path publishes.

- **floor**: pgbench-style single-row INSERT per transaction (prepared, autocommit), no broker: the database's commit limit.
- **bare**: the handler in a plain transaction, publish after commit, no deduplication (fast, unsafe).
- **ceiling**: bare plus two no-op round trips (a prepared ` + "`SELECT 1`" + ` before and one after the business write) where a design that
  claims the message before the handler and stores its effect in the transaction has its two statements; no claim, no effect row.
  It is not a contender but the most such a design can reach through database/sql, which sends BEGIN and every statement on
  their own and waits for each (lib/pq and pgx's stdlib alike; neither can pipeline them).
- **naive**: SELECT the processed table; if new: transaction with the business write; publish; INSERT the mark: separate statements.
- **watermill-stack**: Watermill's own parts: the built-in ` + "`middleware.Deduplicator`" + ` (defaults: in memory, one-minute window) on the consumer;
  the business write and a watermill-sql publisher on the same transaction, wrapped by ` + "`components/forwarder`" + `'s publisher; the
  forwarder (a watermill-sql subscriber, poll interval 100 ms) relays to the broker.
- **river**: River v0.25.0 (database/sql driver over lib/pq) as a transactional outbox on the boundary path: business write and
  ` + "`InsertTx`" + ` of a job in one transaction; a River worker publishes (100 workers, fetch cooldown 100 ms as by default; fetch poll
  interval 100 ms instead of 1 s, since the database/sql driver cannot LISTEN and an insert in a transaction does not wake the producer).
- **rbaliyan-event**: rbaliyan/event/v3's PostgreSQL idempotency store as its docs show: ` + "`IsDuplicateTx`" + `, business write,
  ` + "`MarkProcessedTx`" + ` in one transaction; publish after commit.
- **outbox-middleware**: this framework's ` + "`middleware.New`" + ` around the handler (consumer path), database/sql over lib/pq: the claim at BEGIN, the effect written into it, cleared once sent.
- **protocol-sql**: the database/sql form's statements written out by hand on tables its migrations made, through lib/pq and
  prepared per connection as the framework prepares them: BEGIN, the claim, the business write, the effect written into the claim,
  COMMIT, the publish called in place, the mark batched in the background; no timeouts, telemetry, relay or recovery (not in the
  safety check). protocol-sql / bare is the most any client of these statements reaches through database/sql,
  outbox-middleware / protocol-sql what the framework's code adds to them.
- **bare-pgx**: bare on pgx v5 (` + "`pgxpool`" + `, ` + "`pool.Begin`" + `, ` + "`tx.Exec`" + `, ` + "`tx.Commit`" + `: a round trip each), publish after commit, no deduplication.
- **protocol-pgx**: the pgx form's statements written out by hand on tables its migrations made (the same columns and indexes):
  BEGIN with the claim's look-up, the business write, the claim with the effect inline and COMMIT, the publish called in place,
  the mark batched in the background; no timeouts, telemetry, relay or recovery (not exactly-once when something fails, so not
  in the safety check). Not a contender but what the protocol itself costs: protocol-pgx / bare-pgx is the most any client of
  these statements reaches, outbox-pgx / protocol-pgx what the framework's code adds to them.
- **outbox-pgx**: this framework's pgx form (` + "`outboxpgx.New`" + `, ` + "`middleware.New`" + `, the write through ` + "`outboxpgx.Tx`" + `) in its default, optimistic mode: BEGIN with the claim's look-up in one round trip, the claim with the effect inline and COMMIT in one.
- **outbox-pgx-pessimistic**: the same in the claim-first mode: BEGIN with the claim in one round trip, the effect row and COMMIT in one.
- **outbox-intx**: this framework's boundary path, ` + "`Outbox.InTx`" + `, with the relay running.
- **bare-pgbouncer**, **outbox-middleware-pgbouncer**, **bare-pgx-pgbouncer**, **outbox-pgx-pgbouncer**: bare, outbox-middleware,
  bare-pgx and outbox-pgx through PgBouncer in transaction mode (on loopback, in front of the same server), configured as a
  deployment behind such a pooler must be (docs/operations.md, "Connection poolers"): lib/pq with ` + "`binary_parameters=yes`" + `,
  pgx with ` + "`default_query_exec_mode=exec`" + `, the pgx form's listener on a direct connection (` + "`outboxpgx.WithListenDSN`" + `).
  The settings change the protocol as well as the route: lib/pq sends a statement with its parameters in one message instead
  of preparing it first, pgx prepares nothing; compare the round trips per message. Their exactly-once behind the pooler is
  tested (` + "`TestBehindPgBouncer`" + `), not checked again here: they are left out of the safety check.

On the boundary path (river, outbox-intx) there is no incoming message: every delivery, duplicates included, is one independent
call (an HTTP request, say), so duplicates are not deduplicated there and the comparison is between the two boundary contenders.

The framework runs with its defaults except ` + "`RelayGrace`" + ` (2 s instead of 10 s, so that the crash check does not wait for it).
Round trips are counted below lib/pq, on the wire: every client write that follows a read is one synchronous wait for the server.
WAL bytes are the difference of ` + "`pg_current_wal_lsn()`" + ` around a run (every run starts after a CHECKPOINT, on emptied tables).
`

type target struct {
	name, measured string
	met, known     bool
	why            string
}

// pessimisticWAL describes the WAL per message of outbox-pgx-pessimistic at conc, if it ran.
func pessimisticWAL(r *report, conc int) string {
	if c, ok := r.cell("outbox-pgx-pessimistic", conc); ok {
		return fmt.Sprintf("%.0f WAL bytes: a claim and an effect row, deleted once sent", c.WALBytes)
	}
	return "a claim and an effect row, deleted once sent"
}

func targets(r *report) []target {
	var ts []target
	const fw, bare, stack, river, intx = "outbox-middleware", "bare", "watermill-stack", "river", "outbox-intx"
	for _, conc := range r.Config.Concs {
		f, ok1 := r.cell(fw, conc)
		b, ok2 := r.cell(bare, conc)
		t := target{name: fmt.Sprintf("throughput >= 0.8x bare at %d consumers", conc), known: ok1 && ok2}
		if t.known {
			ratio := f.Throughput / b.Throughput
			t.measured = fmt.Sprintf("%.2fx (%s vs %s msg/s)", ratio, f0(f.Throughput), f0(b.Throughput))
			t.met = ratio >= 0.8
			t.why = fmt.Sprintf("the framework waits for %.2f round trips and writes %.2f statements and %.0f WAL bytes per message, bare %.2f, %.2f and %.0f: "+
				"on this machine every round trip costs both processes a wake-up and two system calls, and the extra rows "+
				"(the claim, written again with the effects inline, then the mark that clears them) cost WAL and index work.",
				f.SyncRoundTrips, f.Statements, f.WALBytes, b.SyncRoundTrips, b.Statements, b.WALBytes)
			if cl, ok := r.cell("ceiling", conc); ok {
				t.why += fmt.Sprintf(" The two round trips alone, without their rows, leave %.2fx of bare (the ceiling row: %s msg/s)", cl.Throughput/b.Throughput, f0(cl.Throughput))
				if cl.Throughput < 0.8*b.Throughput {
					t.why += ": no design that claims the message before the handler (so that a concurrent copy never runs it) and stores " +
						"its effect in the transaction can reach 0.8x through database/sql here"
				}
				t.why += fmt.Sprintf("; the framework reaches %.2fx of that ceiling, the rest being the rows themselves: the claim, which a "+
					"concurrent copy must find before its handler runs, and the effects it holds, which must commit with the business write "+
					"and are cleared once sent.", f.Throughput/cl.Throughput)
			}
			if p, ok := r.cell("protocol-sql", conc); ok {
				t.why += fmt.Sprintf(" The same statements with their rows, sent by hand with nothing around them (protocol-sql), reach %.2fx of bare "+
					"(%s msg/s); the framework reaches %.2fx of that.", p.Throughput/b.Throughput, f0(p.Throughput), f.Throughput/p.Throughput)
			}
			if f.P99 > 500 {
				t.why += fmt.Sprintf(" The p99 of %.0f ms is DuplicateWait (1 s by default): redelivered copies found their original's effects "+
					"not yet marked dispatched and waited, holding their consumer, before sending what was still pending (re-sent: %d).", f.P99, f.Resent)
			}
		}
		ts = append(ts, t)
	}
	for _, conc := range r.Config.Concs {
		f, ok1 := r.cell(fw, conc)
		s, ok2 := r.cell(stack, conc)
		t := target{name: fmt.Sprintf("throughput >= 2x watermill-stack at %d consumers", conc), known: ok1 && ok2}
		if t.known {
			t.measured = fmt.Sprintf("%.2fx (%s vs %s msg/s)", f.Throughput/s.Throughput, f0(f.Throughput), f0(s.Throughput))
			t.met = f.Throughput >= 2*s.Throughput
			t.why = fmt.Sprintf("the stack does less per message on the consumer's path: its deduplication is in memory (not durable) and its outbox "+
				"row is one INSERT (%.2f statements, %.0f WAL bytes per message against the framework's %.2f and %.0f); its relay works "+
				"outside the consumer's path, which shows in its latency (p50 %.1f ms) more than in its throughput.",
				s.Statements, s.WALBytes, f.Statements, f.WALBytes, s.P50)
		}
		ts = append(ts, t)
	}
	for _, conc := range r.Config.Concs {
		f, ok1 := r.cell(intx, conc)
		rv, ok2 := r.cell(river, conc)
		t := target{name: fmt.Sprintf("boundary path (InTx) >= 2x River at %d consumers", conc), known: ok1 && ok2}
		if t.known {
			t.measured = fmt.Sprintf("%.2fx (%s vs %s msg/s)", f.Throughput/rv.Throughput, f0(f.Throughput), f0(rv.Throughput))
			t.met = f.Throughput >= 2*rv.Throughput
			t.why = fmt.Sprintf("a call waits for %.2f round trips with InTx and %.2f with River, and writes %.0f and %.0f WAL bytes; River's job insert is one "+
				"statement in the caller's transaction and its workers publish and complete jobs in batches, off the caller's path "+
				"(its latency, p50 %.1f ms, is its poll interval).", f.SyncRoundTrips, rv.SyncRoundTrips, f.WALBytes, rv.WALBytes, rv.P50)
		}
		ts = append(ts, t)
	}
	{
		// Round trips on the common path: a first delivery, c = 1, where nothing is amortized.
		f, ok1 := r.cell(fw, 1)
		b, ok2 := r.cell(bare, 1)
		if !ok1 || !ok2 {
			f, ok1 = r.cell(fw, r.Config.Concs[0])
			b, ok2 = r.cell(bare, r.Config.Concs[0])
		}
		t := target{name: "at most 1 synchronous round trip per message beyond bare", known: ok1 && ok2}
		if t.known {
			extra := f.SyncRoundTrips - b.SyncRoundTrips
			t.measured = fmt.Sprintf("%+.2f waited-for round trips/msg (%.2f vs %.2f, %d consumers; %.2f vs %.2f with background work)",
				extra, f.SyncRoundTrips, b.SyncRoundTrips, f.Conc, f.RoundTrips, b.RoundTrips)
			t.met = extra <= 1.05
			t.why = fmt.Sprintf("beyond bare's BEGIN, business write (unnamed parse + execute) and COMMIT, a first delivery waits for the claim "+
				"(INSERT ... ON CONFLICT) and the effect's write into it (an UPDATE of the claim), each its own round trip (prepared once per connection, so one each)%s.",
				map[bool]string{true: ", and for what is written after the publish", false: ""}[extra > 2.05])
		}
		ts = append(ts, t)
	}
	for _, conc := range r.Config.Concs {
		f, ok1 := r.cell("outbox-pgx", conc)
		b, ok2 := r.cell("bare-pgx", conc)
		t := target{name: fmt.Sprintf("pgx: outbox-pgx >= 0.8x bare-pgx at %d consumers", conc), known: ok1 && ok2}
		if t.known {
			ratio := f.Throughput / b.Throughput
			t.measured = fmt.Sprintf("%.2fx (%s vs %s msg/s)", ratio, f0(f.Throughput), f0(b.Throughput))
			t.met = ratio >= 0.8
			t.why = fmt.Sprintf("the round trips are bare-pgx's (%.2f vs %.2f waited for per message, duplicates included); what is left is "+
				"the database's work per message: the claim's look-up with BEGIN, the claim row with its effects inline and its primary-key entry "+
				"(bare-pgx writes no index entry), and the mark that clears the effects once sent, a HOT update in a batch (%.2f vs %.2f statements, "+
				"%.0f vs %.0f WAL bytes per message; the pessimistic mode writes %s). The server spends about twice bare-pgx's CPU per message "+
				"(see \"The pgx form\" below): with one consumer that is latency, with 16 the two CPUs it shares with the consumers and the broker are saturated.",
				f.SyncRoundTrips, b.SyncRoundTrips, f.Statements, b.Statements, f.WALBytes, b.WALBytes, pessimisticWAL(r, conc))
			if p, ok := r.cell("protocol-pgx", conc); ok {
				t.why += fmt.Sprintf(" The same statements sent by hand, with nothing around them (protocol-pgx), reach %.2fx of bare-pgx (%s msg/s); "+
					"the framework reaches %.2fx of that.", p.Throughput/b.Throughput, f0(p.Throughput), f.Throughput/p.Throughput)
			}
		}
		ts = append(ts, t)
	}
	{
		f, ok1 := r.cell("outbox-pgx", r.Config.Concs[0])
		b, ok2 := r.cell("bare-pgx", r.Config.Concs[0])
		t := target{name: "pgx: a first delivery waits for as many round trips as bare-pgx", known: ok1 && ok2}
		if t.known {
			t.measured = fmt.Sprintf("%.2f vs %.2f waited-for round trips/msg (%d consumers; duplicates included)", f.SyncRoundTrips, b.SyncRoundTrips, f.Conc)
			// A duplicate waits for BEGIN+claim and the ROLLBACK (and reads what is pending when the
			// claim still holds some): a tenth of the deliveries are duplicates, so the average may
			// exceed bare's by their share.
			t.met = f.SyncRoundTrips <= b.SyncRoundTrips+0.35
			t.why = "a first delivery waits for BEGIN with the claim, the business write and the effects with COMMIT; the average also holds the duplicates (a tenth of the deliveries), which roll back instead, and read what is pending when their claim still holds some."
		}
		ts = append(ts, t)
	}
	for _, conc := range r.Config.Concs {
		f, ok1 := r.cell(fw, conc)
		b, ok2 := r.cell(bare, conc)
		t := target{name: fmt.Sprintf("database/sql: outbox-middleware >= 0.7x bare at %d consumers", conc), known: ok1 && ok2}
		if t.known {
			ratio := f.Throughput / b.Throughput
			t.measured = fmt.Sprintf("%.2fx (%s vs %s msg/s)", ratio, f0(f.Throughput), f0(b.Throughput))
			t.met = ratio >= 0.7
			t.why = "database/sql sends BEGIN, the claim and the effects' write into it each on their own and waits for each, and the rows cost the server more than those round trips do (see the 0.8x row above); the pgx form removes the round trips and one write of the claim, the database/sql form cannot (see \"What the statements cost, and what the framework adds\")."
		}
		ts = append(ts, t)
	}
	for _, form := range []struct{ label, suffix string }{{"", ""}, {"pgx: ", "-pgx"}} {
		if len(r.Scale.Rows) == 0 {
			break
		}
		for _, conc := range r.Config.ScaleConcs {
			e, big, ok := r.retainedPair("empty"+form.suffix, conc)
			if !ok && form.suffix != "" {
				continue // a report from before the pgx form ran here
			}
			t := target{name: fmt.Sprintf("%s%s retained IDs cost <= 10%% throughput (%d consumers)", form.label, human(r.Scale.Retained), conc), known: ok}
			if t.known {
				loss := 1 - big.Throughput/e.Throughput
				t.measured = fmt.Sprintf("%+.1f%% (%s vs %s msg/s; p99 %.1f vs %.1f ms)", -loss*100, f0(big.Throughput), f0(e.Throughput), big.P99, e.P99)
				t.met = loss <= 0.10
				t.why = fmt.Sprintf("WAL per message %.0f vs %.0f bytes: a claim into a %s-row primary key lands on a random leaf page, whose first "+
					"change after a checkpoint writes a full-page image (every run starts right after a CHECKPOINT: the worst case of a checkpoint cycle), "+
					"and the larger index is less often in cache.", big.WALBytes, e.WALBytes, human(r.Scale.Retained))
			}
			ts = append(ts, t)
			e, ord, ok := r.retainedPair("retained-ordered"+form.suffix, conc)
			if !ok {
				continue // a report from before the time-ordered run
			}
			loss := 1 - ord.Throughput/e.Throughput
			ts = append(ts, target{
				name:     fmt.Sprintf("%s%s retained IDs, time-ordered message IDs, cost <= 10%% throughput (%d consumers)", form.label, human(r.Scale.Retained), conc),
				known:    true,
				measured: fmt.Sprintf("%+.1f%% (%s vs %s msg/s; p99 %.1f vs %.1f ms)", -loss*100, f0(ord.Throughput), f0(e.Throughput), ord.P99, e.P99),
				met:      loss <= 0.10,
				why: fmt.Sprintf("WAL per message %.0f vs %.0f bytes: time-ordered IDs are claimed at the right edge of the primary key, "+
					"a few pages that stay in cache, whatever the table retains.", ord.WALBytes, e.WALBytes),
			})
		}
	}
	if len(r.Cleanup.Rows) >= 2 {
		var before, during, after cell
		for _, c := range r.Cleanup.Rows {
			switch c.Contender {
			case "before":
				before = c
			case "during":
				during = c
			case "after":
				after = c
			}
		}
		base := before.P99
		if after.Messages > 0 {
			base = (before.P99 + after.P99) / 2
		}
		t := target{name: "cleanup raises consumer p99 by <= 20%", known: base > 0 && during.Messages > 0}
		if t.known {
			rise := during.P99/base - 1
			t.measured = fmt.Sprintf("%+.0f%% (p99 %.2f ms during vs %.2f ms before/after)", rise*100, during.P99, base)
			t.met = rise <= 0.20
			t.why = fmt.Sprintf("each cleanup batch is a DELETE of 1000 claims in its own transaction, committed asynchronously, and "+
				"each pause lasts at least twice the batch before it (CleanupPauseFactor, and CleanupPause): cleanup keeps to a third of one connection's "+
				"time (%d rows in %.0f s here), yet while a batch runs it competes for the 2 CPUs, shared with the consumers and the "+
				"server, and for the WAL writer, whose flushes the consumers' commits wait for. A fixed 20 ms pause measured +52%%; "+
				"three times the batch +28%% too, with cleanup barely faster than the consumers wrote. A larger CleanupPauseFactor or a "+
				"smaller CleanupBatchSize trades cleanup speed for consumer latency.", r.Cleanup.Deleted, r.Cleanup.Seconds)
		}
		ts = append(ts, t)
	}
	if len(r.Memory) >= 2 {
		a, b := r.Memory[0], r.Memory[len(r.Memory)-1]
		t := target{name: "memory flat in the number of messages", known: len(a.LiveMB) > 0 && len(b.LiveMB) > 0}
		if t.known {
			t.measured = fmt.Sprintf("live heap from 50%% to 90%% of the run: %+.2f MiB at %d messages, %+.2f MiB at %d", a.growthMB(), a.Messages, b.growthMB(), b.Messages)
			t.met = b.growthMB() < 1 && a.growthMB() < 1
			t.why = "the live heap kept growing after the warm-up: something is kept per message (for example a queue that falls behind)."
		}
		ts = append(ts, t)
	}
	return ts
}

func yesNo(v, known bool) string {
	switch {
	case !known:
		return "not measured"
	case v:
		return "yes"
	default:
		return "**no**"
	}
}

func joinInts(v []int) string {
	s := make([]string, len(v))
	for i, x := range v {
		s[i] = fmt.Sprint(x)
	}
	return strings.Join(s, ", ")
}

func slicesMax(v []int) int {
	m := 0
	for _, x := range v {
		m = max(m, x)
	}
	return m
}

func human(n int) string {
	switch {
	case n >= 1_000_000 && n%1_000_000 == 0:
		return fmt.Sprintf("%dM", n/1_000_000)
	case n >= 1000 && n%1000 == 0:
		return fmt.Sprintf("%dk", n/1000)
	}
	return fmt.Sprint(n)
}

// --- chart -------------------------------------------------------------------------------------

// palette has a colour for each of the sixteen contenders, so that none shares one in the chart.
var palette = []string{"#7f7f7f", "#1f77b4", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#2ca02c", "#17becf", "#bcbd22", "#d62728",
	"#aec7e8", "#ffbb78", "#98df8a", "#c5b0d5", "#c49c94", "#f7b6d2"}

// chart draws two panels of grouped bars (one group per concurrency, one bar per contender):
// throughput on a linear axis and p99 latency on a logarithmic one.
func chart(r *report) string {
	r = withoutMySQL(r) // another server: compared in their own section
	var names []string
	for _, c := range r.Cells {
		if !contains(names, c.Contender) {
			names = append(names, c.Contender)
		}
	}
	concs := r.Config.Concs
	const W, panelH, top, left, right = 980, 300, 40, 70, 20
	H := top + 2*panelH + 110
	var b strings.Builder
	fmt.Fprintf(&b, `<svg xmlns="http://www.w3.org/2000/svg" width="%d" height="%d" viewBox="0 0 %d %d" font-family="sans-serif" font-size="12">`+"\n", W, H, W, H)
	fmt.Fprintf(&b, `<rect width="%d" height="%d" fill="white"/>`+"\n", W, H)
	fmt.Fprintf(&b, `<text x="%d" y="22" font-size="15" font-weight="bold">Exactly-once cost: throughput and p99 per contender and concurrency (%s mode)</text>`+"\n", left, r.Mode)

	panel := func(y0 int, title string, val func(cell) float64, logScale bool, unit string) {
		plotW := W - left - right
		plotH := panelH - 60
		py := y0 + 20
		fmt.Fprintf(&b, `<text x="%d" y="%d" font-size="13" font-weight="bold">%s</text>`+"\n", left, y0+10, title)
		maxV := 0.0
		minV := math.Inf(1)
		for _, c := range r.Cells {
			v := val(c)
			maxV = math.Max(maxV, v)
			if v > 0 {
				minV = math.Min(minV, v)
			}
		}
		if maxV <= 0 {
			maxV = 1
		}
		var scale func(float64) float64
		var ticks []float64
		if logScale {
			lo := math.Pow(10, math.Floor(math.Log10(math.Max(minV, 1e-3))))
			hi := math.Pow(10, math.Ceil(math.Log10(maxV)))
			scale = func(v float64) float64 {
				if v <= lo {
					return 0
				}
				return (math.Log10(v) - math.Log10(lo)) / (math.Log10(hi) - math.Log10(lo)) * float64(plotH)
			}
			for t := lo; t <= hi*1.0001; t *= 10 {
				ticks = append(ticks, t)
			}
		} else {
			step := niceStep(maxV / 5)
			hi := math.Ceil(maxV/step) * step
			scale = func(v float64) float64 { return v / hi * float64(plotH) }
			for t := 0.0; t <= hi*1.0001; t += step {
				ticks = append(ticks, t)
			}
		}
		for _, t := range ticks {
			y := float64(py+plotH) - scale(t)
			fmt.Fprintf(&b, `<line x1="%d" y1="%.1f" x2="%d" y2="%.1f" stroke="#e0e0e0"/>`+"\n", left, y, W-right, y)
			fmt.Fprintf(&b, `<text x="%d" y="%.1f" text-anchor="end">%s</text>`+"\n", left-6, y+4, tickLabel(t))
		}
		fmt.Fprintf(&b, `<text x="14" y="%d" transform="rotate(-90 14 %d)" text-anchor="middle">%s</text>`+"\n", py+plotH/2, py+plotH/2, unit)
		groupW := float64(plotW) / float64(len(concs))
		barW := (groupW - 30) / float64(len(names))
		for gi, conc := range concs {
			gx := float64(left) + float64(gi)*groupW + 15
			for ni, name := range names {
				c, ok := r.cell(name, conc)
				if !ok {
					continue
				}
				h := scale(val(c))
				x := gx + float64(ni)*barW
				fmt.Fprintf(&b, `<rect x="%.1f" y="%.1f" width="%.1f" height="%.1f" fill="%s"><title>%s, %d consumers: %s %s</title></rect>`+"\n",
					x, float64(py+plotH)-h, barW-2, h, palette[ni%len(palette)], name, conc, tickLabel(val(c)), unit)
			}
			fmt.Fprintf(&b, `<text x="%.1f" y="%d" text-anchor="middle">%d consumer%s</text>`+"\n", gx+(groupW-30)/2, py+plotH+16, conc, plural(conc))
		}
		fmt.Fprintf(&b, `<line x1="%d" y1="%d" x2="%d" y2="%d" stroke="#333"/>`+"\n", left, py+plotH, W-right, py+plotH)
	}
	panel(top, "Throughput (messages/s, higher is better)", func(c cell) float64 { return c.Throughput }, false, "msg/s")
	panel(top+panelH, "p99 latency (ms, log scale, lower is better)", func(c cell) float64 { return c.P99 }, true, "ms")
	ly := top + 2*panelH + 10
	for i, name := range names {
		x := left + (i%5)*180
		y := ly + (i/5)*20
		fmt.Fprintf(&b, `<rect x="%d" y="%d" width="12" height="12" fill="%s"/><text x="%d" y="%d">%s</text>`+"\n", x, y, palette[i%len(palette)], x+18, y+10, name)
	}
	fmt.Fprintf(&b, `<text x="%d" y="%d" fill="#555">%s; %d CPUs; %s deliveries per bar, %.0f%% duplicates</text>`+"\n",
		left, H-12, r.Started, r.Machine.CPUs, human(r.Config.N), r.Config.DupRate*100)
	b.WriteString("</svg>\n")
	return b.String()
}

func niceStep(raw float64) float64 {
	if raw <= 0 {
		return 1
	}
	p := math.Pow(10, math.Floor(math.Log10(raw)))
	for _, m := range []float64{1, 2, 2.5, 5, 10} {
		if m*p >= raw {
			return m * p
		}
	}
	return 10 * p
}

func tickLabel(v float64) string {
	switch {
	case v >= 1000:
		return fmt.Sprintf("%.0f", v)
	case v >= 10:
		return fmt.Sprintf("%.0f", v)
	case v >= 1:
		return fmt.Sprintf("%.1f", v)
	case v == 0:
		return "0"
	default:
		return fmt.Sprintf("%.2g", v)
	}
}

func plural(n int) string {
	if n == 1 {
		return ""
	}
	return "s"
}

func contains(s []string, v string) bool {
	for _, x := range s {
		if x == v {
			return true
		}
	}
	return false
}
