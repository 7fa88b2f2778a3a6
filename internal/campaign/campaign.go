// Package campaign is the randomized fault campaign: many short runs, each a random schedule of
// deliveries of a few messages to three instances (of one form, or of several forms on the same
// tables and consumer group; or three tenant.Sets of two members on two databases), with faults
// injected everywhere, checked effect by effect against the guarantee at the end. The root module
// runs it on the database/sql form; drivers/outboxpgx on the pgx form in both modes and on mixed
// deployments. Every run is replayable from its seed.
//
//	go test -run TestFaultCampaign . -args -campaign.runs=400     # more runs (or OUTBOX_CAMPAIGN_RUNS)
//	go test -run TestFaultCampaign . -args -campaign.seed=1234    # replay one run
//	go test -run TestFaultCampaign . -args -campaign.off=clock-step,held-claim   # without scenarios
//	go test -run TestFaultCampaign . -args -campaign.on=big-unit  # with scenarios that are off by default
package campaign

import (
	"context"
	"database/sql"
	"errors"
	"flag"
	"fmt"
	"maps"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	wsql "github.com/ThreeDotsLabs/watermill-sql/v3/pkg/sql"

	"github.com/watermill-outbox/outbox"
	"github.com/watermill-outbox/outbox/drivers/postgres"
	"github.com/watermill-outbox/outbox/internal/pgproxy"
	"github.com/watermill-outbox/outbox/internal/pgtest"
	"github.com/watermill-outbox/outbox/outboxdriver"
)

var (
	flagRuns = flag.Int("campaign.runs", 0, "fault campaign: number of runs (default $OUTBOX_CAMPAIGN_RUNS, else the test's own)")
	flagSeed = flag.Uint64("campaign.seed", 0, "fault campaign: run only this seed")
	flagOff  = flag.String("campaign.off", "", "fault campaign: comma-separated scenarios to leave out (default $OUTBOX_CAMPAIGN_OFF)")
	flagDep  = flag.String("campaign.deployment", "", "fault campaign: run only the deployment of this name")
	flagLog  = flag.Bool("campaign.log", false, "fault campaign: log the schedule of every run, not only of failed ones")
	flagAll  = flag.Bool("campaign.keepgoing", false, "fault campaign: go on after a failed run, and list the failed seeds at the end")
	flagOn   = flag.String("campaign.on", "", "fault campaign: comma-separated scenarios to run that are off by default, or all (default $OUTBOX_CAMPAIGN_ON)")
)

// Scenarios are the named parts of a schedule that can be switched off (-campaign.off) one by one.
// The faults of every delivery (failing, losing, panicking and hanging publishes, failing,
// panicking and slow handlers, cancelled contexts, killed connections, savepoints rolled back,
// effects recorded from several goroutines) are always on.
var Scenarios = map[string]string{
	"crash":           "a delivery crashes at a failpoint (each of them is reached in a campaign)",
	"copy-during":     "a copy of the message is delivered to another instance while the original's handler runs",
	"copy-after":      "a copy is delivered to another instance after the original committed, before it dispatched",
	"late-copies":     "copies arrive after the message was acked",
	"topic-fails":     "the broker refuses the first calls for one topic (on every path, the relay's too)",
	"shared-uuid":     "one message (one UUID) is published to two topics in one unit of work",
	"big-unit":        "one unit of work records 9,400 effects, more than one statement's bind parameters hold (rare)",
	"held-claim":      "a unit holds its transaction open while the relays sweep, its claim becomes visible later than the sweep's look-back behind its timestamp (simulated), and it crashes after commit",
	"clock-step":      "the database clock runs 10 minutes ahead for a moment and steps back (simulated on the claims and the sweep's watermark)",
	"relay-one":       "the final drain runs on one instance chosen at random, not on all",
	"keyed":           "client requests with an idempotency key are retried through keyed boundary units of work (some attempts at once, waiting or not), with the deliveries' faults; two callers send each key; some keys expire and are retaken by a retry while a cleanup runs, whose first attempt may crash after its COMMIT",
	"slow-topic":      "every call for one topic takes 20-120 ms (within PublishTimeout), on every path",
	"hung-topic":      "for the first 0.3-1.5 s of the run every call for one topic hangs until its context ends (PublishTimeout), on every path, while the other topic flows",
	"tx-by-sql":       "the handler ends its transaction with a ROLLBACK sent as SQL, then publishes: nothing of the delivery may commit, and the attempt is the handler's doing",
	"poison":          "some messages fail with a permanent error on every delivery: they are dead-lettered and acked, never applied, and kept with their payload and source topic; then some are fixed and retried from the dead letters (from two instances at once), and must be applied exactly once",
	"delayed":         "the unit of work also records a delayed effect (due 0 to 600 ms after it is recorded, on the message's key), and a later unit of work on any instance cancels it around its due time, racing the relays",
	"member-down":     "in a tenants deployment, the second tenant's database (every instance's member of it connects through a proxy; the checks do not) goes down for 0.3-2 s during the deliveries and comes back: it refuses connections as a server starting up does (57P03), or accepts them and answers nothing until it is back; at a random moment, or as one of its units of work or relay rounds is in flight",
	"deleted-effects": "some instances keep no sent effect (EffectRetention 0, the default): their marks delete what was sent, or clear it from its claim in the claim of the unit of work that comes next; the check reads what was committed from an audit that triggers keep in the database (PostgreSQL)",
	"delayed-key":     "with delayed: some delayed effects have an ordering key of their own, and once one is due (up to 10 ms after), mostly before a relay moved it, a unit of work on any instance records an effect with its key, which must reach the broker after it",
}

// Form is one way to build an instance of the framework.
type Form struct {
	Name string
	// Open builds an instance on the database dsn from cfg (Publisher, TablePrefix, Failpoint and
	// the timings set; DB and Driver unset); close releases what it opened.
	Open func(dsn string, cfg outbox.Config) (ob *outbox.Outbox, close func(), err error)
	// Exec runs a statement in the transaction of the unit of work in ctx.
	Exec func(ctx context.Context, query string, args ...any) error
	// Savepoint begins a savepoint in that transaction; rollback rolls back to it.
	Savepoint func(ctx context.Context) (rollback func() error, err error)
}

// RotateEvery is the PostgreSQL forms' postgres.Driver.RotateEvery: a few rotations of the
// effects table in every run (a run lasts some seconds; the default, 10 s, would rotate once at
// most), so that the moves and truncations race the faults and the other forms' statements.
const RotateEvery = time.Second

// SQLForm is the database/sql form (lib/pq, drivers/postgres).
func SQLForm() Form {
	return DatabaseSQLForm("database/sql", "postgres", postgres.Driver{RotateEvery: RotateEvery}, 0)
}

// SQLFormInline is the database/sql form with postgres.Driver.MaxInlineBytes maxBytes: with a
// few hundred bytes, units move the effects kept in their claim to rows (spill) after one, two
// or three of the handler's records, some inside its savepoint; negative, they keep none.
func SQLFormInline(maxBytes int) Form {
	return DatabaseSQLForm(fmt.Sprintf("database/sql inline %d", maxBytes), "postgres", postgres.Driver{MaxInlineBytes: maxBytes, RotateEvery: RotateEvery}, 0)
}

// DatabaseSQLForm is a database/sql form on any store driver: name names it in reports; sqlDriver
// and driver open the database; maxOpen, when positive, bounds its pool.
func DatabaseSQLForm(name, sqlDriver string, driver outboxdriver.Driver, maxOpen int) Form {
	return Form{
		Name: name,
		Open: func(dsn string, cfg outbox.Config) (*outbox.Outbox, func(), error) {
			db, err := sql.Open(sqlDriver, dsn)
			if err != nil {
				return nil, nil, err
			}
			if maxOpen > 0 {
				db.SetMaxOpenConns(maxOpen)
			}
			cfg.DB, cfg.Driver = db, driver
			ob, err := outbox.New(cfg)
			if err != nil {
				_ = db.Close()
				return nil, nil, err
			}
			return ob, func() { _ = ob.Close(); _ = db.Close() }, nil
		},
		Exec: func(ctx context.Context, query string, args ...any) error {
			_, err := outbox.Tx(ctx).ExecContext(ctx, query, args...)
			return err
		},
		Savepoint: func(ctx context.Context) (func() error, error) {
			tx := outbox.Tx(ctx)
			if _, err := tx.ExecContext(ctx, `SAVEPOINT campaign`); err != nil {
				return nil, err
			}
			return func() error {
				_, err := tx.ExecContext(ctx, `ROLLBACK TO SAVEPOINT campaign`)
				return err
			}, nil
		},
	}
}

// Database is the database of a campaign other than PostgreSQL (a driver's module runs the
// campaign on its own database with it). Its store keeps every effect in the effects table, with
// dispatched_at set once sent, and none in the claims.
type Database struct {
	// DriverName opens the test's own view of the database (sql.Open).
	DriverName string
	// Broker is the watermill-sql schema of the broker's topics on this database; the payload
	// column must take any bytes.
	Broker wsql.SchemaAdapter
	// Bind rewrites the campaign's statements, whose parameters are $1, $2, ... in order of
	// appearance, into the database's.
	Bind func(query string) string
	// IDType is the column type of a message ID in the business table.
	IDType string
	// Wire is the query of (uuid, payload) of every message of topic, in the order sent.
	Wire func(topic string) string
	// KillConnection is a statement that kills the connection it runs on.
	KillConnection string
	// Sleep is a statement that sleeps $1 seconds.
	Sleep string
	// AnyClaimAfterRollback: after a handler's ROLLBACK sent as SQL, a record may find a claim of
	// the message that a copy made meanwhile (the claim does not name its transaction), so the
	// tx-by-sql deliveries run without a copy at the same moment (docs/guarantees.md).
	AnyClaimAfterRollback bool
	// ExpireKey moves the expiry of idempotency key $2 of scope $1 into the past, in the
	// idempotency table whose name fmt.Sprintf(ExpireKey, prefix) gives.
	ExpireKey string
	// Unsupported are the scenarios that do not apply to the database (forced off), with why.
	Unsupported map[string]string
}

// postgresDatabase is the default: PostgreSQL (lib/pq), its inline effects and dispatched table.
var postgresDatabase = &Database{
	DriverName: "postgres",
	Broker:     wsql.DefaultPostgreSQLSchema{GeneratePayloadType: func(string) string { return "BYTEA" }},
	Bind:       func(q string) string { return q },
	IDType:     "text",
	Wire: func(topic string) string {
		return `SELECT uuid, payload FROM "watermill_` + topic + `" ORDER BY "offset"`
	},
	KillConnection: `SELECT pg_terminate_backend(pg_backend_pid())`,
	Sleep:          `SELECT pg_sleep($1)`,
	ExpireKey:      `UPDATE %sidempotency SET expires_at = now() - interval '1 second' WHERE scope = $1 AND key = $2`,
}

// Deployment is the instances of one run: three of them, one per form given (a form may repeat).
type Deployment struct {
	Name  string
	Forms []Form
	// Shuffle puts the instances in a random order each run, so that any form may get the first
	// delivery, the copies and the drain.
	Shuffle bool
	// Tenants makes each instance a tenant.Set of two members of its form, the first on the
	// campaign's database and the second on Options.SecondDSN (each with the run's tables there),
	// and alternates the messages between the two tenants (metadata "tenant"): every delivery
	// goes through the Set's middleware, the units after a delayed effect and its cancels through
	// Set.Do, keyed requests to the first member through Set.Do, and Set.Run runs the relays.
	// The poison scenario is off for it: a retried dead letter goes back to the topic the
	// message came from, which the middleware learns from a Router only. With member-down, the
	// second members reach their database through a proxy that takes it down for a while.
	Tenants bool
}

// Options configure a campaign.
type Options struct {
	// Deployments: run i (seed s) uses Deployments[s % len].
	Deployments []Deployment
	// Runs is the number of runs by default (-campaign.runs and $OUTBOX_CAMPAIGN_RUNS override it).
	Runs int
	// CoverageRuns: a campaign of at least this many runs must reach every failpoint and every
	// outcome it is for. Zero: Runs.
	CoverageRuns int
	// Off lists the scenarios that run only when switched on (-campaign.on), with why.
	Off map[string]string
	// Replay is the command that replays one seed, with %d for the seed.
	Replay string
	// Database is the database (nil: PostgreSQL).
	Database *Database
	// SecondDSN is a second fresh database, for the second members of Tenants deployments.
	SecondDSN string
}

// Run runs the campaign on a fresh database dsn, each run on tables of its own.
func Run(t *testing.T, dsn string, o Options) {
	if len(o.Deployments) == 0 {
		t.Fatal("campaign: no deployment")
	}
	runs := *flagRuns
	if runs == 0 {
		runs = o.Runs
		if v := os.Getenv("OUTBOX_CAMPAIGN_RUNS"); v != "" {
			n, err := strconv.Atoi(v)
			if err != nil || n <= 0 {
				t.Fatalf("OUTBOX_CAMPAIGN_RUNS=%q: want a positive number", v)
			}
			runs = n
		}
	}
	database := o.Database
	if database == nil {
		database = postgresDatabase
	}
	on, err := scenarios(o.Off)
	if err != nil {
		t.Fatal(err)
	}
	for name, why := range database.Unsupported {
		if on[name] {
			t.Logf("scenario %s off on this database: %s", name, why)
		}
		on[name] = false
	}
	// Run i has seed base+i, whose deployment is Deployments[seed % len]; with -campaign.deployment,
	// only the seeds of that deployment, so that a seed replays alone.
	seeds := make([]uint64, runs)
	base := uint64(time.Now().UnixNano())
	step, first := uint64(1), uint64(0)
	if *flagDep != "" {
		i := slices.IndexFunc(o.Deployments, func(d Deployment) bool { return d.Name == *flagDep })
		if i < 0 {
			t.Fatalf("campaign: no deployment %q", *flagDep)
		}
		step, first = uint64(len(o.Deployments)), uint64(i)
		base -= base % step
	}
	for i := range seeds {
		seeds[i] = base + first + uint64(i)*step
	}
	if *flagSeed != 0 {
		seeds = []uint64{*flagSeed}
	}
	db, err := sql.Open(database.DriverName, dsn)
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	dbs, dsns := []*sql.DB{db}, []string{dsn}
	var proxy *pgproxy.Proxy
	var proxied string
	if slices.ContainsFunc(o.Deployments, func(d Deployment) bool { return d.Tenants }) {
		if o.SecondDSN == "" {
			t.Fatal("campaign: a Tenants deployment needs Options.SecondDSN")
		}
		db2, err := sql.Open(database.DriverName, o.SecondDSN)
		if err != nil {
			t.Fatal(err)
		}
		defer db2.Close()
		dbs, dsns = append(dbs, db2), append(dsns, o.SecondDSN)
		if on["member-down"] {
			p, viaProxy, err := pgproxy.StartFor(o.SecondDSN)
			if err != nil {
				// Turned off with a line in the log, a campaign passed without the outage it
				// claims to run: a DSN it cannot proxy is a set-up to fix, as for PoolerDSN.
				t.Fatalf("campaign: the member-down scenario needs a postgres:// URL over TCP for Options.SecondDSN (the built-in server, or %s as a URL): %v", pgtest.EnvDSN, err)
			} else {
				defer p.Close()
				proxy, proxied = p, viaProxy
			}
		}
	}
	var off []string
	for name := range Scenarios {
		if !on[name] {
			off = append(off, name)
		}
	}
	slices.Sort(off)
	if len(off) > 0 {
		t.Logf("scenarios off: %s (switch on with -campaign.on=%s)", strings.Join(off, ","), strings.Join(off, ","))
	}
	st := &stats{outcomes: map[string]int{}}
	began := time.Now()
	var failed []string
	tenantRuns := 0
	for i, seed := range seeds {
		d := o.Deployments[seed%uint64(len(o.Deployments))]
		c := &run{t: t, db: db, n: i, seed: seed, dep: d, on: on, stats: st, database: database, dbs: dbs[:1], dsns: dsns[:1]}
		if d.Tenants {
			c.dbs, c.dsns = dbs, dsns
			c.proxy, c.proxied = proxy, proxied
			tenantRuns++
			c.on = maps.Clone(on)
			c.on["poison"] = false
		}
		if !c.do() {
			if !*flagAll {
				t.Fatalf("fault campaign run %d (%s, seed %d) failed; replay it with: %s", i, d.Name, seed, fmt.Sprintf(o.Replay, seed))
			}
			failed = append(failed, fmt.Sprintf("%d (%s)", seed, d.Name))
		}
	}
	if len(failed) > 0 {
		t.Fatalf("%d of %d runs failed, seeds: %s; replay one with: %s", len(failed), len(seeds), strings.Join(failed, ", "), o.Replay)
	}
	t.Logf("%d runs passed in %s: %d deliveries; outcomes %v", len(seeds), time.Since(began).Round(time.Second), st.deliveries, st.outcomes)
	coverage := o.CoverageRuns
	if coverage == 0 {
		coverage = o.Runs
	}
	if len(seeds) < coverage {
		return
	}
	// The campaign must have reached the paths it is for.
	want := []string{"acked", "dispatch failed", "handler panicked", "handler failed", "timed out"}
	if on["crash"] {
		for _, p := range failpoints {
			want = append(want, "crash@"+p)
		}
	}
	for _, s := range []string{"copy-during", "copy-after", "shared-uuid", "topic-fails", "held-claim", "clock-step", "slow-topic", "hung-topic", "delayed", "tx-by-sql"} {
		if on[s] {
			want = append(want, s)
		}
	}
	if on["deleted-effects"] && database == postgresDatabase {
		// Some instance of a run deletes what it sends in 7 runs of 8.
		want = append(want, "deleted-effects")
	}
	if on["member-down"] && tenantRuns >= 12 {
		// An outage in half the runs of a Tenants deployment: missed in 12 once in 4,096 campaigns.
		want = append(want, "member-down")
	}
	if on["delayed"] && on["delayed-key"] {
		want = append(want, "delayed-key followed")
	}
	if on["delayed"] {
		// A cancel that won, and one that came too late.
		want = append(want, "delayed cancelled", "delayed too late to cancel")
	}
	if on["keyed"] {
		want = append(want, "keyed replayed", "keyed expired and retaken", "keyed expired, retaken, commit outcome lost")
	}
	if on["poison"] {
		want = append(want, "dead-lettered", "dead letter retried")
	}
	for _, w := range want {
		if st.outcomes[w] == 0 {
			t.Errorf("%q was never reached in %d runs: the campaign does not exercise that path", w, len(seeds))
		}
	}
}

// scenarios returns which scenarios are on: all but those of defaultOff, less -campaign.off, plus
// -campaign.on.
func scenarios(defaultOff map[string]string) (map[string]bool, error) {
	on := map[string]bool{}
	for name := range Scenarios {
		on[name] = defaultOff[name] == ""
	}
	list := func(flagValue, env string) []string {
		v := flagValue
		if v == "" {
			v = os.Getenv(env)
		}
		var out []string
		for _, s := range strings.Split(v, ",") {
			if s = strings.TrimSpace(s); s != "" {
				out = append(out, s)
			}
		}
		return out
	}
	for _, s := range list(*flagOn, "OUTBOX_CAMPAIGN_ON") {
		if s == "all" {
			for name := range Scenarios {
				on[name] = true
			}
			continue
		}
		if _, ok := Scenarios[s]; !ok {
			return nil, fmt.Errorf("campaign: unknown scenario %q (known: %s)", s, strings.Join(slices.Sorted(maps.Keys(Scenarios)), ", "))
		}
		on[s] = true
	}
	for _, s := range list(*flagOff, "OUTBOX_CAMPAIGN_OFF") {
		if _, ok := Scenarios[s]; !ok {
			return nil, fmt.Errorf("campaign: unknown scenario %q (known: %s)", s, strings.Join(slices.Sorted(maps.Keys(Scenarios)), ", "))
		}
		on[s] = false
	}
	return on, nil
}

var failpoints = []string{outbox.FailpointAfterClaim, outbox.FailpointAfterHandler, outbox.FailpointAfterCommit,
	outbox.FailpointAfterPublish, outbox.FailpointAfterMark}

// stats counts how the deliveries of a campaign ended, and which scenarios it reached.
type stats struct {
	mu         sync.Mutex
	deliveries int
	outcomes   map[string]int
}

func (s *stats) add(err error) {
	kind := "other error"
	switch {
	case err == nil:
		kind = "acked"
	case errors.Is(err, outbox.ErrFailpoint):
		kind = "crash"
		for _, p := range failpoints {
			if strings.Contains(err.Error(), "failpoint "+p+":") {
				kind = "crash@" + p
			}
		}
	case errors.Is(err, outbox.ErrDispatchFailed):
		kind = "dispatch failed"
	case errors.Is(err, outbox.ErrDatabaseUnreachable):
		kind = "database unreachable"
	case errors.Is(err, outbox.ErrHandlerPanicked):
		kind = "handler panicked"
	case errors.Is(err, context.DeadlineExceeded):
		kind = "timed out"
	case errors.Is(err, outbox.ErrCommitOutcomeUnknown):
		kind = "commit outcome unknown"
	case strings.Contains(err.Error(), "cancelled"):
		kind = "cancelled"
	case strings.Contains(err.Error(), "handler failed"):
		kind = "handler failed"
	case strings.Contains(err.Error(), "connection killed"):
		kind = "connection killed"
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	s.deliveries++
	s.outcomes[kind]++
}

// reached counts a scenario that a run went through.
func (s *stats) reached(name string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.outcomes[name]++
}
