package main

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/lib/pq"

	"github.com/watermill-outbox/outbox"
	"github.com/watermill-outbox/outbox/console"
	"github.com/watermill-outbox/outbox/drivers/postgres"
	"github.com/watermill-outbox/outbox/drivers/sqlite"
	"github.com/watermill-outbox/outbox/outboxdriver"
	"github.com/watermill-outbox/outbox/tenant"
)

// With -tenants acme,globex the service keeps each tenant's orders in a database of its own and
// runs one tenant.Set over their Outboxes (docs/scaling.md, step 3): the API picks the tenant of a
// request from its X-Tenant header, every message the service publishes carries the tenant in its
// metadata, and the Set's middleware runs each incoming message in the database of the tenant it
// names. A message that names no tenant of the Set is dead-lettered in a member of its own,
// "unresolved", which has a database of its own too.

const (
	// metadataTenant is the metadata key that names a message's tenant (tenant.Config.Metadata).
	metadataTenant = "tenant"
	// headerTenant is the request header that names the tenant at the API.
	headerTenant = "X-Tenant"
	// unresolvedMember is the Set's Config.Unresolved: it keeps, as its dead letters, the
	// messages whose tenant is not a member.
	unresolvedMember = "unresolved"
)

// tenantName is the rule for -tenants: a subset of what package tenant accepts (tenant.Set.Add
// checks that again), narrow enough that a name is safe in a file name and, quoted, in a
// PostgreSQL database name.
var tenantName = regexp.MustCompile(`^[a-z0-9][a-z0-9_-]{0,31}$`)

// parseTenants reads -tenants: comma-separated names, each at most once.
func parseTenants(list string) ([]string, error) {
	if strings.TrimSpace(list) == "" {
		return nil, nil
	}
	var names []string
	for _, n := range strings.Split(list, ",") {
		n = strings.TrimSpace(n)
		switch {
		case !tenantName.MatchString(n):
			return nil, fmt.Errorf("-tenants: %q is not a tenant name: 1 to 32 of a-z, 0-9, '_' and '-', starting with a letter or digit", n)
		case n == unresolvedMember:
			return nil, fmt.Errorf("-tenants: %q is the member that keeps the messages of unknown tenants: pick another name", n)
		case slices.Contains(names, n):
			return nil, fmt.Errorf("-tenants: %q is named twice", n)
		}
		names = append(names, n)
	}
	return names, nil
}

// checkTenants refuses the combinations -tenants does not run with.
func checkTenants(cfg config) error {
	switch {
	case len(cfg.tenants) == 0:
		return nil
	case cfg.mysql != "":
		return errors.New("-tenants is supported on SQLite and PostgreSQL")
	case cfg.form != formSQL:
		return errors.New("-tenants runs on the database/sql form (-form sql)")
	case cfg.chaos:
		return errors.New("-tenants does not run with -chaos")
	}
	return nil
}

// tenantDB is a member's database.
type tenantDB struct {
	name   string // the member name: a tenant, or unresolvedMember
	db     *sql.DB
	driver outboxdriver.Driver
}

// openTenants opens (and on PostgreSQL creates) a database per tenant and one for the
// unresolved member, and creates the business tables in the tenants' ones. On PostgreSQL s.db is
// the database of the DSN, which keeps no orders: it creates the others, and holds the broker's
// tables with -broker postgres. It returns what to print where the data lives.
func (s *service) openTenants(ctx context.Context, cfg config) (string, error) {
	names := append(slices.Clone(cfg.tenants), unresolvedMember)
	var (
		open func(ctx context.Context, name string) (*sql.DB, error)
		desc string
	)
	if cfg.postgres == "" {
		open = func(ctx context.Context, name string) (*sql.DB, error) {
			return openSQLite(ctx, filepath.Join(cfg.dataDir, "orders-"+name+".db"))
		}
		desc = "SQLite, a file per tenant: " + filepath.Join(cfg.dataDir, "orders-{"+strings.Join(names, ",")+"}.db")
	} else {
		base, err := pq.NewConfig(cfg.postgres)
		if err != nil {
			return "", fmt.Errorf("-postgres: %w", err)
		}
		// 32 connections as the single database has (openDatabase): with -broker postgres, every
		// consumer's subscriber polls on this one.
		if s.db, err = openPostgres(ctx, base, 32); err != nil {
			return "", err
		}
		var dbname string
		if err := s.db.QueryRowContext(ctx, `SELECT current_database()`).Scan(&dbname); err != nil {
			return "", fmt.Errorf("read the database name: %w", err)
		}
		open = func(ctx context.Context, name string) (*sql.DB, error) {
			c := base.Clone()
			c.Database = dbname + "_" + name
			if err := createDatabase(ctx, s.db, c.Database); err != nil {
				return nil, err
			}
			// Fewer than the single database's 32: each tenant's pool keeps its idle
			// connections open, and the Set runs at most four background calls at once.
			return openPostgres(ctx, c, 8)
		}
		desc = fmt.Sprintf("PostgreSQL, a database per tenant: %s_{%s}", dbname, strings.Join(names, ","))
	}
	for _, name := range names {
		db, err := open(ctx, name)
		if err != nil {
			return "", fmt.Errorf("tenant %s: %w", name, err)
		}
		t := tenantDB{name: name, db: db, driver: sqlite.Driver{}}
		if cfg.postgres != "" {
			// No ListenDSN: a listener is a connection and a goroutine per member; a commit of
			// this process wakes its member's relay without one (docs/scaling.md, step 3).
			t.driver = postgres.Driver{}
		}
		s.tenantDBs = append(s.tenantDBs, t)
		if name == unresolvedMember {
			continue // the handlers never run there: it needs the outbox tables only
		}
		if err := createSchema(ctx, db, t.driver); err != nil {
			return "", fmt.Errorf("tenant %s: %w", name, err)
		}
	}
	return desc, nil
}

// openSQLite opens a tenant's SQLite file as openDatabase opens the service's one.
func openSQLite(ctx context.Context, path string) (*sql.DB, error) {
	db, err := sql.Open("sqlite", sqlite.DSN(path))
	if err != nil {
		return nil, err
	}
	db.SetMaxOpenConns(1) // one writer: see openDatabase
	if err := pingDB(ctx, db); err != nil {
		return nil, fmt.Errorf("connect to SQLite %s: %w", path, err)
	}
	return db, nil
}

// openPostgres opens the database of c with a pool of at most conns connections.
func openPostgres(ctx context.Context, c pq.Config, conns int) (*sql.DB, error) {
	conn, err := pq.NewConnectorConfig(c)
	if err != nil {
		return nil, err
	}
	db := sql.OpenDB(conn)
	db.SetMaxOpenConns(conns)
	db.SetMaxIdleConns(conns)
	if err := pingDB(ctx, db); err != nil {
		return nil, fmt.Errorf("connect to PostgreSQL database %s: %w", c.Database, err)
	}
	return db, nil
}

func pingDB(ctx context.Context, db *sql.DB) error {
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	if err := db.PingContext(ctx); err != nil {
		_ = db.Close()
		return err
	}
	return nil
}

// createDatabase creates database name on the server of db unless it exists.
func createDatabase(ctx context.Context, db *sql.DB, name string) error {
	if len(name) > 63 {
		return fmt.Errorf("database name %s is longer than PostgreSQL's 63 bytes: pick a shorter tenant name", name)
	}
	var exists bool
	if err := db.QueryRowContext(ctx, `SELECT EXISTS (SELECT 1 FROM pg_database WHERE datname = $1)`, name).Scan(&exists); err != nil {
		return fmt.Errorf("look for database %s: %w", name, err)
	}
	if exists {
		return nil
	}
	_, err := db.ExecContext(ctx, `CREATE DATABASE `+pq.QuoteIdentifier(name))
	var pqErr *pq.Error
	// Another instance starting at the same time created it first.
	if errors.As(err, &pqErr) && (pqErr.Code == "42P04" || pqErr.Code == "23505") {
		return nil
	}
	if err != nil {
		return fmt.Errorf("create database %s: %w", name, err)
	}
	return nil
}

// tenantAPI serves the API of every tenant: the X-Tenant header picks the tenant's api, whose
// database holds its orders and whose units of work run on its member of the Set.
type tenantAPI struct {
	apis    map[string]*api
	metrics http.Handler
	health  http.Handler
	console http.Handler // nil: no /outbox/
}

func (t *tenantAPI) routes() http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("POST /orders", t.forTenant((*api).placeOrder))
	mux.HandleFunc("GET /orders/{id}", t.forTenant((*api).getOrder))
	mux.Handle("GET /metrics", t.metrics)
	mux.Handle("GET /healthz", t.health)
	if t.console != nil {
		mux.Handle("/outbox/", http.StripPrefix("/outbox", t.console))
	}
	return mux
}

// tenantsConsole returns the web console of every member of set (console.NewMembersFunc: a page
// of members, and each member's page and repairs on its own database), the unresolved member's
// too, whose dead letters are the messages of unknown tenants, and what to tell the user, with
// ADDR standing for the listen address. It follows the Set: a tenant added while the service runs
// is served at once. On SQLite it returns none (package ops has no SQLite statements).
func tenantsConsole(cfg config, set *tenant.Set) (http.Handler, string, error) {
	if cfg.postgres == "" {
		return nil, "(needs PostgreSQL: start with -postgres DSN)", nil
	}
	opt, note, err := consoleOptions(cfg)
	if err != nil {
		return nil, "", err
	}
	h, err := console.NewMembersFunc(console.MembersOf(set), opt)
	if err != nil {
		return nil, "", err
	}
	return h, note, nil
}

// forTenant runs h with the api of the request's tenant; a request that names none, or one that
// is not served here, is refused before anything is read or written.
func (t *tenantAPI) forTenant(h func(*api, http.ResponseWriter, *http.Request)) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		name := r.Header.Get(headerTenant)
		a, ok := t.apis[name]
		switch {
		case name == "":
			writeError(w, http.StatusBadRequest, "the "+headerTenant+" header is required: "+strings.Join(t.names(), ", "))
		case !ok:
			writeError(w, http.StatusNotFound, fmt.Sprintf("no tenant %q", name))
		default:
			h(a, w, r)
		}
	}
}

func (t *tenantAPI) names() []string {
	names := make([]string, 0, len(t.apis))
	for n := range t.apis {
		names = append(names, n)
	}
	slices.Sort(names)
	return names
}

// tenantsHealth answers readiness probes from every member's checks (tenant.Set.Health) and the
// consumers' Router, with the status only, as the single Outbox's probe does.
func tenantsHealth(set *tenant.Set, consumersRunning func(context.Context) error) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		ctx, cancel := context.WithTimeout(r.Context(), 10*time.Second)
		defer cancel()
		rep := set.Health(ctx)
		healthy := rep.Healthy && consumersRunning(ctx) == nil
		w.Header().Set("Cache-Control", "no-store")
		status := http.StatusOK
		if !healthy {
			status = http.StatusServiceUnavailable
		}
		writeJSON(w, status, map[string]bool{"healthy": healthy})
	})
}

// serveTenants is serve with -tenants: an Outbox per tenant database in one tenant.Set.
func serveTenants(ctx context.Context, cfg config, out io.Writer, ready func(addr string)) error {
	s, err := openService(ctx, cfg, 30*time.Second)
	if err != nil {
		return err
	}
	defer s.close()

	// Metadata: a message resolves by its "tenant", and what a member's units of work publish
	// (its consumers' events, the API's OrderPlaced) carries the member's name under it.
	set, err := tenant.New(tenant.Config{Metadata: metadataTenant, Unresolved: unresolvedMember, Logger: s.logger})
	if err != nil {
		return err
	}
	s.set = set
	obs := map[string]*outbox.Outbox{}
	for _, t := range s.tenantDBs {
		ob, pub, err := s.newOutbox(func(c *outbox.Config) {
			// Member names the metrics of this Outbox (outbox_member="acme").
			c.DB, c.Driver, c.Member = t.db, t.driver, t.name
		})
		if err != nil {
			return fmt.Errorf("tenant %s: %w", t.name, err)
		}
		defer func() { _ = pub.Close() }()
		if err := ob.Migrate(ctx); err != nil {
			return fmt.Errorf("tenant %s: %w", t.name, err)
		}
		if err := set.Add(t.name, ob); err != nil {
			return err
		}
		obs[t.name] = ob
	}
	feats, err := probeFeatures(ctx, obs[cfg.tenants[0]]) // one driver for all
	if err != nil {
		return err
	}

	runCtx, cancel := context.WithCancel(ctx)
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		// Every member's relay, cleanup and statistics, on one scheduler.
		if err := set.Run(runCtx); err != nil {
			s.logger.Error("The background work of the tenants stopped", err, nil)
		}
	}()
	defer func() { cancel(); wg.Wait() }()

	stopConsumers, consumersRunning, err := startConsumers(runCtx, s, nil, nil)
	if err != nil {
		return err
	}
	defer func() { _ = stopConsumers() }()

	ln, err := net.Listen("tcp", cfg.addr)
	if err != nil {
		return err
	}
	ta := &tenantAPI{apis: map[string]*api{}, metrics: s.metrics, health: tenantsHealth(set, consumersRunning)}
	var consoleNote string
	if ta.console, consoleNote, err = tenantsConsole(cfg, set); err != nil {
		return err
	}
	for _, t := range s.tenantDBs {
		if t.name != unresolvedMember {
			ta.apis[t.name] = &api{db: t.db, ob: obs[t.name], set: set, member: t.name}
		}
	}
	srv := &http.Server{Handler: ta.routes(), ReadHeaderTimeout: 10 * time.Second}
	served := make(chan error, 1)
	go func() { served <- srv.Serve(ln) }()

	addr := ln.Addr().String()
	first := cfg.tenants[0]
	fmt.Fprintf(out, "order-processing listening on http://%s for tenants %s\n%s\n\n", addr, strings.Join(cfg.tenants, ", "), s.desc)
	fmt.Fprintf(out, "Place an order for tenant %s (the %s header names the tenant):\n"+
		"  curl -si http://%s/orders -H '%s: %s' -d '{\"customer\":\"ada@example.com\",\"sku\":\"espresso-beans\",\"quantity\":2}'\n",
		first, headerTenant, addr, headerTenant, first)
	fmt.Fprintf(out, "Then look at it (another tenant gets 404):\n  curl -s http://%s/orders/<id> -H '%s: %s'\n", addr, headerTenant, first)
	fmt.Fprint(out, feats.notes())
	fmt.Fprintf(out, "Metrics per tenant (Prometheus):\n  curl -s http://%s/metrics | grep outbox_member=\n", addr)
	fmt.Fprintf(out, "Readiness probe (200 or 503):\n  curl -s http://%s/healthz\n", addr)
	fmt.Fprintf(out, "Web console (the tenants; a tenant's page: /outbox/?member=%s):\n  %s\n\nCtrl-C stops.\n\n",
		first, strings.ReplaceAll(consoleNote, "ADDR", addr))
	wg.Add(1)
	go func() { defer wg.Done(); printTenantsProgress(runCtx, out, s.tenantDBs, obs) }()
	if ready != nil {
		ready(addr)
	}

	return serveUntil(ctx, srv, served)
}

// printTenantsProgress is printProgress for every tenant: a line per tenant whose numbers changed.
func printTenantsProgress(ctx context.Context, out io.Writer, dbs []tenantDB, obs map[string]*outbox.Outbox) {
	t := time.NewTicker(time.Second)
	defer t.Stop()
	last := map[string]string{}
	for {
		for _, d := range dbs {
			if d.name == unresolvedMember {
				continue
			}
			line := progressLine(ctx, d.db, obs[d.name])
			if ctx.Err() != nil {
				return
			}
			if line != last[d.name] {
				fmt.Fprintf(out, "%s  %s: %s\n", time.Now().Format(time.TimeOnly), d.name, line)
				last[d.name] = line
			}
		}
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}
