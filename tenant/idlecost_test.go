package tenant_test

import (
	"context"
	"database/sql"
	"fmt"
	"net/url"
	"os"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/watermill-outbox/outbox"
	"github.com/watermill-outbox/outbox/drivers/postgres"
	"github.com/watermill-outbox/outbox/internal/pgserver"
	"github.com/watermill-outbox/outbox/tenant"
)

// TestIdleCost measures what N idle tenants cost on one PostgreSQL, a schema (TablePrefix) per
// tenant on one default pool, with default Outbox settings: each member's own Outbox.Run against
// the Set's one engine, interleaved. It prints the goroutines the background work adds, the server
// connections of the database (mean and peak, sampled every second), the new connections, the
// transactions (pg_stat_database) and the statements (pg_stat_statements' calls, BEGIN, COMMIT,
// ROLLBACK and SET counted apart) per second over the window, and the most frequent statements.
// It starts a PostgreSQL server of its own, which loads pg_stat_statements. Run it on its own:
//
//	OUTBOX_IDLE_COST=200 go test -count=1 -run TestIdleCost -v ./tenant/
//
// OUTBOX_IDLE_WINDOW sets the window in seconds (default 30), OUTBOX_IDLE_WARMUP the wait before
// it (default 5), OUTBOX_IDLE_STATS the members' StatsInterval in seconds (negative: none),
// OUTBOX_IDLE_ROUNDS the rounds (default 2), OUTBOX_IDLE_SET_ONLY=1 skips Outbox.Run per member,
// OUTBOX_IDLE_DBS=1 gives each tenant a database and a pool of its own instead of a schema,
// OUTBOX_IDLE_LAYOUTS=schemas,dbs measures both side by side (each counted by its databases),
// OUTBOX_IDLE_POOL_IDLE sets the idle connections each tenant database's pool keeps and
// OUTBOX_IDLE_SCHEMA_POOL_IDLE those of the schemas' one pool (SetMaxIdleConns; default 2).
func TestIdleCost(t *testing.T) {
	n, _ := strconv.Atoi(os.Getenv("OUTBOX_IDLE_COST"))
	if n <= 0 {
		t.Skip("set OUTBOX_IDLE_COST to the number of tenants to measure")
	}
	window := 30 * time.Second
	if s, _ := strconv.Atoi(os.Getenv("OUTBOX_IDLE_WINDOW")); s > 0 {
		window = time.Duration(s) * time.Second
	}
	warmup := 5 * time.Second
	if s, _ := strconv.Atoi(os.Getenv("OUTBOX_IDLE_WARMUP")); s > 0 {
		warmup = time.Duration(s) * time.Second
	}
	var stats time.Duration
	if s, _ := strconv.Atoi(os.Getenv("OUTBOX_IDLE_STATS")); s != 0 {
		stats = time.Duration(s) * time.Second
	}
	rounds := 2
	if s, _ := strconv.Atoi(os.Getenv("OUTBOX_IDLE_ROUNDS")); s > 0 {
		rounds = s
	}
	// A server of the test's own: pg_stat_statements counts the statements, and it loads only at
	// the server's start (the shared test server does not). track_utility counts BEGIN, COMMIT and
	// SET apart from the statements; max holds every tenant's statements (each names its own
	// tables) without evicting any during the window.
	srv, err := pgserver.Start(pgserver.Options{Settings: []string{
		"shared_preload_libraries=pg_stat_statements", "pg_stat_statements.track_utility=on", "pg_stat_statements.max=20000",
	}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := srv.Stop(); err != nil {
			t.Error(err)
		}
	})
	adminDSN := srv.DSN("postgres")
	admin, err := sql.Open("postgres", adminDSN)
	if err != nil {
		t.Fatal(err)
	}
	defer admin.Close()
	admin.SetMaxOpenConns(1)
	const dbname = "idlecost"
	if _, err := admin.Exec(`CREATE DATABASE ` + dbname); err != nil {
		t.Fatal(err)
	}
	if _, err := admin.Exec(`CREATE EXTENSION pg_stat_statements`); err != nil {
		t.Fatal(err)
	}
	db, err := sql.Open("postgres", srv.DSN(dbname))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = db.Close() })

	w := newWire()
	// The layouts measured, side by side on the one server, each counted by its own databases:
	// a schema (TablePrefix) per tenant on the test's database and one pool, and a database per
	// tenant, each with a pool of its own (database/sql's defaults, as a service opens them) and
	// the default tables. OUTBOX_IDLE_LAYOUTS picks them ("schemas", "dbs" or both, comma
	// separated); without it, OUTBOX_IDLE_DBS=1 means dbs alone, else schemas alone.
	type layout struct {
		name  string
		obs   []*outbox.Outbox
		names string // the databases measured, as a PostgreSQL array
	}
	want := strings.Split(os.Getenv("OUTBOX_IDLE_LAYOUTS"), ",")
	if want[0] == "" {
		want = []string{"schemas"}
		if os.Getenv("OUTBOX_IDLE_DBS") != "" {
			want = []string{"dbs"}
		}
	}
	if k, err := strconv.Atoi(os.Getenv("OUTBOX_IDLE_SCHEMA_POOL_IDLE")); err == nil {
		db.SetMaxIdleConns(k)
	}
	var layouts []*layout
	for _, lname := range want {
		l := &layout{name: lname}
		var dbnames []string
		switch lname {
		case "schemas":
			l.name = "a schema each, one pool"
			dbnames = []string{dbname}
		case "dbs":
			l.name = "a database and a pool each"
		default:
			t.Fatalf("OUTBOX_IDLE_LAYOUTS: unknown layout %q (schemas, dbs)", lname)
		}
		for i := range n {
			cfg := outbox.Config{DB: db, Driver: postgres.Driver{}, Publisher: w, TablePrefix: fmt.Sprintf("t%d_", i), StatsInterval: stats}
			if lname == "dbs" {
				name := fmt.Sprintf("%s_t%d", dbname, i)
				if _, err := admin.Exec(`CREATE DATABASE ` + name); err != nil {
					t.Fatal(err)
				}
				dsn, err := withDatabase(adminDSN, name)
				if err != nil {
					t.Fatal(err)
				}
				tdb, err := sql.Open("postgres", dsn)
				if err != nil {
					t.Fatal(err)
				}
				t.Cleanup(func() {
					_ = tdb.Close()
					_, _ = admin.Exec(`DROP DATABASE IF EXISTS ` + name + ` WITH (FORCE)`)
				})
				if k, err := strconv.Atoi(os.Getenv("OUTBOX_IDLE_POOL_IDLE")); err == nil {
					tdb.SetMaxIdleConns(k)
				}
				cfg.DB, cfg.TablePrefix = tdb, ""
				dbnames = append(dbnames, name)
			}
			ob, err := outbox.New(cfg)
			if err != nil {
				t.Fatal(err)
			}
			if err := ob.Migrate(context.Background()); err != nil {
				t.Fatal(err)
			}
			l.obs = append(l.obs, ob)
		}
		l.names = "{" + strings.Join(dbnames, ",") + "}"
		layouts = append(layouts, l)
	}

	counters := func(names string) (xacts, sessions int64) {
		if err := admin.QueryRow(`SELECT sum(xact_commit + xact_rollback), sum(sessions) FROM pg_stat_database WHERE datname = ANY ($1::text[])`, names).Scan(&xacts, &sessions); err != nil {
			t.Fatal(err)
		}
		return xacts, sessions
	}
	conns := func(names string) int {
		var c int
		if err := admin.QueryRow(`SELECT count(*) FROM pg_stat_activity WHERE datname = ANY ($1::text[]) AND backend_type = 'client backend'`, names).Scan(&c); err != nil {
			t.Fatal(err)
		}
		return c
	}

	// statements are pg_stat_statements' calls in the measured databases since the last reset:
	// transaction control (BEGIN, COMMIT, ROLLBACK, SET) apart from the rest, and the rest by
	// statement, the tenants' table prefixes taken out, most calls first.
	type stmt struct {
		query string
		calls int64
	}
	statements := func(names string) (control, other int64, top []stmt) {
		rows, err := admin.Query(`SELECT regexp_replace(query, '\mt[0-9]+_', 't_', 'g'), sum(calls)::bigint
			FROM pg_stat_statements WHERE dbid IN (SELECT oid FROM pg_database WHERE datname = ANY ($1::text[]))
			GROUP BY 1 ORDER BY 2 DESC`, names)
		if err != nil {
			t.Fatal(err)
		}
		defer rows.Close()
		for rows.Next() {
			var st stmt
			if err := rows.Scan(&st.query, &st.calls); err != nil {
				t.Fatal(err)
			}
			if isControl(st.query) {
				control += st.calls
			} else {
				other += st.calls
			}
			top = append(top, st)
		}
		if err := rows.Err(); err != nil {
			t.Fatal(err)
		}
		return control, other, top
	}

	modes := []struct {
		name  string
		start func(ctx context.Context, obs []*outbox.Outbox) (wait func())
	}{
		{"Outbox.Run per member", func(ctx context.Context, obs []*outbox.Outbox) func() {
			var wg sync.WaitGroup
			for _, ob := range obs {
				wg.Add(1)
				go func() { defer wg.Done(); _ = ob.Run(ctx) }()
			}
			return wg.Wait
		}},
		{"Set.Run, one engine", func(ctx context.Context, obs []*outbox.Outbox) func() {
			set, err := tenant.New(tenant.Config{Resolver: tenant.FromMetadata("tenant"), NackUnresolved: true}) // no messages here
			if err != nil {
				t.Fatal(err)
			}
			for i, ob := range obs {
				if err := set.Add(fmt.Sprint("t", i), ob); err != nil {
					t.Fatal(err)
				}
			}
			done := make(chan struct{})
			go func() { defer close(done); _ = set.Run(ctx) }()
			return func() { <-done }
		}},
	}
	if os.Getenv("OUTBOX_IDLE_SET_ONLY") != "" {
		modes = modes[1:]
	}
	for round := range rounds {
		for _, m := range modes {
			runtime.GC()
			base := runtime.NumGoroutine()
			ctx, cancel := context.WithCancel(context.Background())
			var waits []func()
			for _, l := range layouts {
				waits = append(waits, m.start(ctx, l.obs))
			}
			time.Sleep(warmup) // past the first passes of every service
			goroutines := runtime.NumGoroutine() - base
			if _, err := admin.Exec(`SELECT pg_stat_statements_reset()`); err != nil {
				t.Fatal(err)
			}
			type sample struct {
				x0, s0          int64
				sum, peak, seen int
			}
			samples := make([]sample, len(layouts))
			for i, l := range layouts {
				samples[i].x0, samples[i].s0 = counters(l.names)
			}
			begin := time.Now()
			for time.Since(begin) < window {
				time.Sleep(time.Second)
				for i, l := range layouts {
					c := conns(l.names)
					samples[i].sum += c
					samples[i].peak = max(samples[i].peak, c)
					samples[i].seen++
				}
			}
			secs := time.Since(begin).Seconds()
			for i, l := range layouts {
				x1, s1 := counters(l.names)
				control, other, top := statements(l.names)
				sm := samples[i]
				t.Logf("round %d, %d idle tenants (%s), %s, StatsInterval %v, window %v after %v: goroutines %d (all layouts' together), server connections mean %.0f peak %d, new connections %.1f/s, transactions %.1f/s, statements %.1f/s (and %.1f/s BEGIN, COMMIT, ROLLBACK, SET)",
					round, n, l.name, m.name, l.obs[0].Config().StatsInterval, window, warmup, goroutines, float64(sm.sum)/float64(sm.seen), sm.peak,
					float64(s1-sm.s0)/secs, float64(x1-sm.x0)/secs, float64(other)/secs, float64(control)/secs)
				for _, st := range top[:min(len(top), 15)] {
					t.Logf("  %6.2f/s  %s", float64(st.calls)/secs, strings.Join(strings.Fields(st.query), " "))
				}
			}
			cancel()
			for _, wait := range waits {
				wait()
			}
			time.Sleep(2 * time.Second)
		}
	}
	for _, l := range layouts {
		for _, ob := range l.obs {
			_ = ob.Close()
		}
	}
}

// isControl tells whether query, as pg_stat_statements shows it, is transaction control or a
// session setting rather than a statement that reads or writes.
func isControl(query string) bool {
	f := strings.Fields(strings.ToUpper(query))
	if len(f) == 0 {
		return false
	}
	switch f[0] {
	case "BEGIN", "START", "COMMIT", "END", "ROLLBACK", "SET", "RESET", "SAVEPOINT", "RELEASE":
		return true
	}
	return false
}

// withDatabase is dsn (a URL) with its database replaced by name.
func withDatabase(dsn, name string) (string, error) {
	u, err := url.Parse(dsn)
	if err != nil || u.Host == "" {
		return "", fmt.Errorf("the admin DSN is not a URL with a host (%v): a database per tenant needs one", err)
	}
	u.Path = "/" + name
	return u.String(), nil
}
