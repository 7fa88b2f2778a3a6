package outbox_test

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"

	"github.com/watermill-outbox/outbox"
	"github.com/watermill-outbox/outbox/drivers/postgres"
	"github.com/watermill-outbox/outbox/internal/logtest"
	"github.com/watermill-outbox/outbox/internal/routertest"
	"github.com/watermill-outbox/outbox/internal/silent"
	"github.com/watermill-outbox/outbox/outboxdriver"
	"github.com/watermill-outbox/outbox/outboxtest"
)

func TestValidateHoldsRetentionAgainstTheRedeliveryHorizon(t *testing.T) {
	base := outbox.Config{DB: &sql.DB{}, Driver: postgres.Driver{}, Publisher: nopPublisher{}}
	for _, c := range []struct {
		retention, horizon time.Duration
		ok                 bool
	}{
		{time.Hour, 2 * time.Hour, false},
		{0, 8 * 24 * time.Hour, false}, // the default Retention, 7 days
		{0, 3 * 24 * time.Hour, true},
		{2 * time.Hour, 2 * time.Hour, true},
		{time.Hour, 0, true}, // not stated: not checked
	} {
		cfg := base
		cfg.Retention, cfg.RedeliveryHorizon = c.retention, c.horizon
		err := cfg.Validate()
		if c.ok != (err == nil) || (err != nil && !errors.Is(err, outbox.ErrRetentionTooShort)) {
			t.Errorf("Retention %s, RedeliveryHorizon %s: %v, want ok=%v (or ErrRetentionTooShort)", c.retention, c.horizon, err, c.ok)
		}
	}
}

// "No timeout" written as the largest duration: the relay's lease and ShutdownTimeout, derived
// from PublishTimeout, overflowed into negative durations, and Validate blamed ShutdownTimeout,
// which the caller never set (or, with BackgroundTimeout set, let a negative lease through).
func TestValidateBoundsTheTimeouts(t *testing.T) {
	base := outbox.Config{DB: &sql.DB{}, Driver: postgres.Driver{}, Publisher: nopPublisher{}}
	for _, c := range []outbox.Config{
		{PublishTimeout: math.MaxInt64},
		{PublishTimeout: math.MaxInt64, BackgroundTimeout: time.Hour, ShutdownTimeout: time.Hour},
		{HandlerTimeout: 25 * time.Hour},
		{BackgroundTimeout: math.MaxInt64},
	} {
		cfg := base
		cfg.PublishTimeout, cfg.HandlerTimeout, cfg.BackgroundTimeout, cfg.ShutdownTimeout = c.PublishTimeout, c.HandlerTimeout, c.BackgroundTimeout, c.ShutdownTimeout
		err := cfg.Validate()
		if err == nil || strings.Contains(err.Error(), "ShutdownTimeout must not") || !strings.Contains(err.Error(), "must be at most 24h0m0s") {
			t.Errorf("PublishTimeout %d, HandlerTimeout %s: %v; want the bound named", c.PublishTimeout, c.HandlerTimeout, err)
		}
	}
	cfg := base
	cfg.PublishTimeout, cfg.HandlerTimeout = 24*time.Hour, 24*time.Hour
	if err := cfg.Validate(); err != nil {
		t.Errorf("24 h timeouts: %v", err)
	}
}

type nopPublisher struct{}

func (nopPublisher) Publish(string, ...*message.Message) error { return nil }
func (nopPublisher) Close() error                              { return nil }

// TestHealth: each check fails for its reason and passes once the cause is gone.
func TestHealth(t *testing.T) {
	e := newEnv(t, func(c *outbox.Config) {
		c.Driver = postgres.Driver{ListenDSN: ""}
		c.RelayInterval = 20 * time.Millisecond
		c.StatsInterval = 20 * time.Millisecond
		c.RelayGrace = time.Hour
		c.HealthMaxPending = 2
	})
	ctx := context.Background()
	failed := func(r outbox.HealthReport) []string {
		var out []string
		for _, c := range r.Checks {
			if !c.OK {
				out = append(out, c.Name+": "+c.Reason)
			}
		}
		return out
	}
	// Before Run: the relay and the listener are reported, the database and schema are fine.
	r := e.ob.Health(ctx)
	if r.Healthy || len(failed(r)) != 2 || !strings.Contains(r.Err().Error(), "relay: not running") || !errors.Is(r.Err(), outbox.ErrUnhealthy) {
		t.Fatalf("before Run: %+v, want the relay and the listener reported", r)
	}
	runCtx, stop := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- e.ob.Run(runCtx) }()
	defer func() { stop(); <-done }()

	// Three pending effects (their dispatch fails, and the relay's retries fail while the broker
	// is down) are more than HealthMaxPending.
	e.pub.failAll.Store(true)
	for i := 0; i < 3; i++ {
		if err := e.ob.InTx(ctx, func(ctx context.Context, tx *sql.Tx) error {
			return outbox.Publish(ctx, "out_a", message.NewMessage(uuid.NewString(), nil))
		}); err != nil {
			t.Fatal(err)
		}
	}
	routertest.WaitUntil(t, "the backlog reported", func() (bool, string) {
		r := e.ob.Health(ctx)
		return len(failed(r)) == 1 && strings.Contains(r.Err().Error(), "backlog: 3 side effects pending, more than HealthMaxPending (2)"), fmt.Sprint(r.Err())
	})
	e.pub.failAll.Store(false)
	routertest.WaitUntil(t, "healthy once the relay sent the backlog", func() (bool, string) {
		r := e.ob.Health(ctx)
		return r.Healthy, fmt.Sprint(r.Err())
	})

	// A database that does not answer.
	bad, err := sql.Open("postgres", "host=127.0.0.1 port=1 dbname=none sslmode=disable connect_timeout=2")
	if err != nil {
		t.Fatal(err)
	}
	defer bad.Close()
	unreachable := e.newOutbox(func(c *outbox.Config) { c.DB = bad })
	r = unreachable.Health(ctx)
	if r.Healthy || r.Checks[0].Name != outbox.CheckDatabase || r.Checks[0].OK || !strings.Contains(r.Checks[0].Reason, "ping") {
		t.Errorf("with an unreachable database: %+v, want the database reported first", r)
	}
}

// TestHealthListener: with ListenDSN, the listener check passes once the LISTEN connection is up.
func TestHealthListener(t *testing.T) {
	e := newEnv(t)
	ob := e.newOutbox(func(c *outbox.Config) { c.Driver = postgres.Driver{ListenDSN: e.dsn} })
	listener := func() outbox.HealthCheck {
		for _, c := range ob.Health(context.Background()).Checks {
			if c.Name == outbox.CheckListener {
				return c
			}
		}
		t.Fatal("no listener check")
		return outbox.HealthCheck{}
	}
	if c := listener(); c.OK || !strings.Contains(c.Reason, "not started") {
		t.Errorf("listener before Run: %+v, want not started", c)
	}
	ctx, stop := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- ob.Run(ctx) }()
	routertest.WaitUntil(t, "the listener connected", func() (bool, string) {
		c := listener()
		return c.OK && c.Reason == "connected", fmt.Sprintf("%+v", c)
	})
	stop()
	<-done
	if c := listener(); c.OK {
		t.Errorf("listener after Run: %+v, want it reported", c)
	}
}

// An extra check of HealthHandler that panics or fails makes the report unhealthy, with its
// reason, and takes nothing else down.
func TestHealthHandlerExtraChecks(t *testing.T) {
	e := newEnv(t)
	stop := startRun(t, e.ob)
	defer stop()
	// Run's relay and listener start in the background: healthy first (a loaded machine asked
	// before the listener connected and found four checks failing).
	waitFor(t, "the Outbox healthy once Run started", func() bool { return e.ob.Health(context.Background()).Healthy })
	h := e.ob.HealthHandler(map[string]func(context.Context) error{
		"router":  func(context.Context) error { return errors.New("router not running") },
		"panicky": func(context.Context) error { panic("boom") },
	})
	rec := httptest.NewRecorder()
	h.ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/ready", nil))
	var r outbox.HealthReport
	if err := json.Unmarshal(rec.Body.Bytes(), &r); err != nil {
		t.Fatalf("%v: %s", err, rec.Body)
	}
	reasons := map[string]string{}
	for _, c := range r.Checks {
		if !c.OK {
			reasons[c.Name] = c.Reason
		}
	}
	if rec.Code != http.StatusServiceUnavailable || r.Healthy || len(reasons) != 2 ||
		!strings.Contains(reasons["panicky"], "boom") || reasons["router"] != "router not running" {
		t.Errorf("health with a failing and a panicking check: %d %+v", rec.Code, r)
	}
}

// TestHealthHandlerCachesAndShowsStatusOnly: a report is served again for CacheFor without
// querying the database (a schema broken meanwhile shows only after it), and the status-only mode
// shows neither the checks nor the database's errors.
func TestHealthHandlerCachesAndShowsStatusOnly(t *testing.T) {
	e := newEnv(t)
	stop := startRun(t, e.ob)
	defer stop()
	get := func(h http.Handler) (int, string) {
		rec := httptest.NewRecorder()
		h.ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/ready", nil))
		return rec.Code, rec.Body.String()
	}
	// Run's listener connects in the background: a loaded machine asked before it had (CI).
	waitFor(t, "the Outbox healthy once Run started", func() bool { return e.ob.Health(context.Background()).Healthy })
	detailed := e.ob.HealthHandler(nil)
	if code, body := get(detailed); code != http.StatusOK {
		t.Fatalf("healthy: %d %s", code, body)
	}
	if _, err := e.db.Exec(`ALTER TABLE outbox_migrations RENAME TO outbox_migrations_away`); err != nil {
		t.Fatal(err)
	}
	defer func() {
		if _, err := e.db.Exec(`ALTER TABLE outbox_migrations_away RENAME TO outbox_migrations`); err != nil {
			t.Error(err)
		}
	}()
	if code, body := get(detailed); code != http.StatusOK {
		t.Fatalf("within a second of a healthy report: %d %s, want the report served again", code, body)
	}
	time.Sleep(1100 * time.Millisecond)
	code, body := get(detailed)
	if code != http.StatusServiceUnavailable || !strings.Contains(body, `"schema"`) {
		t.Fatalf("a second later: %d %s, want 503 naming the schema", code, body)
	}
	code, body = get(e.ob.HealthHandlerWith(outbox.HealthHandlerOptions{}))
	if code != http.StatusServiceUnavailable || strings.TrimSpace(body) != `{"healthy":false}` {
		t.Fatalf("status only: %d %s", code, body)
	}
}

// TestHealthReportsAReadOnlyServer: a server that takes no writes (a standby reached by mistake
// after a failover, or a database set read-only) is not ready, and the report says why.
func TestHealthReportsAReadOnlyServer(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	var dbname string
	if err := e.db.QueryRow(`SELECT current_database()`).Scan(&dbname); err != nil {
		t.Fatal(err)
	}
	// New sessions of this database start read-only, as every session on a standby does.
	if _, err := e.db.Exec(`ALTER DATABASE ` + dbname + ` SET default_transaction_read_only = on`); err != nil {
		t.Fatal(err)
	}
	ro, err := sql.Open("postgres", e.dsn)
	if err != nil {
		t.Fatal(err)
	}
	defer ro.Close()
	r := e.newOutbox(func(c *outbox.Config) { c.DB = ro }).Health(ctx)
	if r.Healthy || r.Checks[0].Name != outbox.CheckDatabase || r.Checks[0].OK || !strings.Contains(r.Checks[0].Reason, "read-only") {
		t.Fatalf("on a read-only database: %+v, want the database check failed as read-only", r)
	}
	t.Logf("reported: %s", r.Checks[0].Reason)

	if _, err := e.db.Exec(`ALTER DATABASE ` + dbname + ` RESET default_transaction_read_only`); err != nil {
		t.Fatal(err)
	}
	rw, err := sql.Open("postgres", e.dsn)
	if err != nil {
		t.Fatal(err)
	}
	defer rw.Close()
	if r := e.newOutbox(func(c *outbox.Config) { c.DB = rw }).Health(ctx); !r.Checks[0].OK {
		t.Fatalf("writable again: %+v, want the database check passed", r)
	}
}

// TestRelayOnAReadOnlyServerSaysSo: a relay whose connection lands on a server that takes no
// writes (a standby reached after a failover) logs that, not only the server's bare refusal.
func TestRelayOnAReadOnlyServerSaysSo(t *testing.T) {
	e := newEnv(t)
	var dbname string
	if err := e.db.QueryRow(`SELECT current_database()`).Scan(&dbname); err != nil {
		t.Fatal(err)
	}
	if _, err := e.db.Exec(`ALTER DATABASE ` + dbname + ` SET default_transaction_read_only = on`); err != nil {
		t.Fatal(err)
	}
	ro, err := sql.Open("postgres", e.dsn)
	if err != nil {
		t.Fatal(err)
	}
	defer ro.Close()
	logs := &logtest.Errors{}
	ob := e.newOutbox(func(c *outbox.Config) {
		c.DB = ro
		c.Logger = logs
		c.RelayInterval = 20 * time.Millisecond
	})
	ctx, stop := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- ob.Run(ctx) }()
	defer func() { stop(); <-done }()
	routertest.WaitUntil(t, "the relay's error names the read-only server", func() (bool, string) {
		return logs.Contains(outboxdriver.ErrReadOnly.Error()), strings.Join(logs.Lines(), "\n")
	})
}

// TestHealthReportsAFailingRelay: a relay whose rounds cannot claim (the effects table is gone,
// the database refuses) is reported by its last rounds' error, not only minutes later as a round
// that did not finish; one success clears it.
func TestHealthReportsAFailingRelay(t *testing.T) {
	e := newEnv(t)
	ob := e.newOutbox(func(c *outbox.Config) { c.RelayInterval = 20 * time.Millisecond })
	ctx, stop := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- ob.Run(ctx) }()
	defer func() { stop(); <-done }()
	relayCheck := func() outbox.HealthCheck {
		for _, c := range ob.Health(context.Background()).Checks {
			if c.Name == outbox.CheckRelay {
				return c
			}
		}
		t.Fatal("no relay check")
		return outbox.HealthCheck{}
	}
	routertest.WaitUntil(t, "the relay healthy", func() (bool, string) {
		c := relayCheck()
		return c.OK, c.Reason
	})
	if _, err := e.db.Exec(`ALTER TABLE outbox_effects_all RENAME TO outbox_effects_away`); err != nil {
		t.Fatal(err)
	}
	routertest.WaitUntil(t, "the relay reported failing with its error", func() (bool, string) {
		c := relayCheck()
		return !c.OK && strings.Contains(c.Reason, "failing") && strings.Contains(c.Reason, "outbox_effects_all"), c.Reason
	})
	if _, err := e.db.Exec(`ALTER TABLE outbox_effects_away RENAME TO outbox_effects_all`); err != nil {
		t.Fatal(err)
	}
	routertest.WaitUntil(t, "the relay healthy again", func() (bool, string) {
		c := relayCheck()
		return c.OK, c.Reason
	})
}

// Health keeps to its bound when the database accepts connections and never answers (lib/pq
// does not watch the context while it connects): a readiness probe gets its answer, unhealthy,
// and probes while the first ping is still out do not each open one more connection. A ping out
// for longer than Health gives it (30 s; 2.5 s here) is given up for a new one: the database
// may be back.
func TestHealthOfADatabaseThatNeverAnswers(t *testing.T) {
	outbox.GiveUpHealthPingAfter(t, 2500*time.Millisecond)
	srv, err := silent.Start()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = srv.Close() })
	db, err := sql.Open("postgres", srv.DSN())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = db.Close() })
	ob, err := outbox.New(outbox.Config{DB: db, Driver: postgres.Driver{}, Publisher: &outboxtest.Recorder{}})
	if err != nil {
		t.Fatal(err)
	}
	for probe := range 3 {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		done := make(chan outbox.HealthReport, 1)
		began := time.Now()
		go func() { done <- ob.Health(ctx) }()
		select {
		case r := <-done:
			if took := time.Since(began); took > 3*time.Second {
				t.Errorf("probe %d: Health took %v with a context of 1 s", probe, took.Round(time.Millisecond))
			}
			if r.Healthy || checkOK(r, outbox.CheckDatabase) {
				t.Errorf("probe %d: %+v, want the database reported unhealthy", probe, r)
			}
		case <-time.After(20 * time.Second):
			cancel()
			t.Fatalf("probe %d: Health did not return within 20 s with a context of 1 s", probe)
		}
		cancel()
	}
	if n := srv.Conns(); n != 1 {
		t.Errorf("%d connections opened by three probes while the first ping was out, want 1", n)
	}
	time.Sleep(100 * time.Millisecond) // the first ping is 3 s out by now
	ctx, cancel := context.WithTimeout(context.Background(), 500*time.Millisecond)
	defer cancel()
	if r := ob.Health(ctx); checkOK(r, outbox.CheckDatabase) {
		t.Errorf("%+v, want the database reported unhealthy", r)
	}
	if !srv.WaitConns(2, 5*time.Second) {
		t.Errorf("%d connections after a check 3 s into the first ping, want a second ping", srv.Conns())
	}
}

// An extra check that ignores its context (a broker ping without a timeout) is not started again
// while an earlier run has not returned: it fails, saying since when it runs. Started again at
// every request, each request left a goroutine behind, without bound.
func TestStuckExtraCheckIsNotStartedAgain(t *testing.T) {
	e := newEnv(t)
	release := make(chan struct{})
	var runs atomic.Int32
	h := e.ob.HealthHandlerWith(outbox.HealthHandlerOptions{CacheFor: -1, Detail: true, Extra: map[string]func(context.Context) error{
		"broker": func(context.Context) error { runs.Add(1); <-release; return nil },
	}})
	t.Cleanup(func() { close(release) })
	for i := range 5 {
		ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
		req := httptest.NewRequest(http.MethodGet, "/health", nil).WithContext(ctx)
		rec := httptest.NewRecorder()
		h.ServeHTTP(rec, req)
		cancel()
		if rec.Code != http.StatusServiceUnavailable {
			t.Errorf("request %d: %d, want 503 while the check hangs", i, rec.Code)
		}
		if i > 0 && !strings.Contains(rec.Body.String(), "has not returned") {
			t.Errorf("request %d: %s; want the check named as still running", i, rec.Body.String())
		}
	}
	if n := runs.Load(); n != 1 {
		t.Errorf("the stuck check was started %d times, want once", n)
	}
}

// Two handlers with a check of one name (a readiness and a liveness probe, both asking for the
// Router) run theirs at the same time: neither takes the other's run for a stuck one.
func TestExtraChecksOfTwoHandlersRunTogether(t *testing.T) {
	e := newEnv(t, func(c *outbox.Config) { c.Driver = postgres.Driver{} })
	check := map[string]func(context.Context) error{"router": func(context.Context) error { time.Sleep(300 * time.Millisecond); return nil }}
	handlers := []http.Handler{
		e.ob.HealthHandlerWith(outbox.HealthHandlerOptions{CacheFor: -1, Detail: true, Extra: check}),
		e.ob.HealthHandlerWith(outbox.HealthHandlerOptions{CacheFor: -1, Detail: true, Extra: check}),
	}
	bodies := make([]string, len(handlers))
	var wg sync.WaitGroup
	for i, h := range handlers {
		wg.Go(func() {
			rec := httptest.NewRecorder()
			h.ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/health", nil))
			bodies[i] = rec.Body.String()
		})
	}
	wg.Wait()
	for i, b := range bodies {
		if strings.Contains(b, "has not returned") {
			t.Errorf("handler %d took the other's run for a stuck one: %s", i, b)
		}
	}
}

// A process that starts while its relay cannot finish a round (a lock held on the effects table:
// every claim waits until the engine's BackgroundTimeout ends the pass) never finished one, and
// Health took that for "first round under way" for as long as it lasted: a readiness probe said
// ready through the whole stall. Now a claim cut off by that bound counts as a failed round, and
// a relay that finished no round since it started is timed from its start.
func TestHealthReportsARelayStalledSinceItsStart(t *testing.T) {
	e := newEnv(t)
	ob := e.newOutbox(func(c *outbox.Config) {
		c.RelayInterval = 20 * time.Millisecond
		c.BackgroundTimeout = 500 * time.Millisecond
	})
	lock, err := e.db.Begin()
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = lock.Rollback() }()
	if _, err := lock.Exec(`LOCK TABLE outbox_effects_all IN ACCESS EXCLUSIVE MODE`); err != nil {
		t.Fatal(err)
	}
	ctx, stop := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- ob.Run(ctx) }()
	defer func() { stop(); <-done }()
	routertest.WaitUntil(t, "the stalled relay reported", func() (bool, string) {
		for _, c := range ob.Health(context.Background()).Checks {
			if c.Name == outbox.CheckRelay {
				return !c.OK, c.Reason
			}
		}
		return false, "no relay check"
	})
	if err := lock.Rollback(); err != nil {
		t.Fatal(err)
	}
	routertest.WaitUntil(t, "the relay healthy once the lock is gone", func() (bool, string) {
		for _, c := range ob.Health(context.Background()).Checks {
			if c.Name == outbox.CheckRelay {
				return c.OK, c.Reason
			}
		}
		return false, "no relay check"
	})
}

// statsCounter is the PostgreSQL driver, with the store's Stats calls counted.
type statsCounter struct {
	postgres.Driver
	n atomic.Int32
}

func (d *statsCounter) Open(db *sql.DB, opts outboxdriver.StoreOptions) (outboxdriver.Store, error) {
	st, err := d.Driver.Open(db, opts)
	if err != nil {
		return nil, err
	}
	return &statsCountingStore{Store: st, d: d}, nil
}

type statsCountingStore struct {
	outboxdriver.Store
	d *statsCounter
}

func (s *statsCountingStore) Stats(ctx context.Context, p outboxdriver.StatsParams) (outboxdriver.Stats, error) {
	s.d.n.Add(1)
	return s.Store.Stats(ctx, p)
}

// Health's backlog checks (HealthMaxPending) read the sampled statistics; without a recent
// sample (sampling fails, or is off) each probe took a full sample of its own, every count of the
// tables, at each probe of each instance: when sampling fails on a slow database, the moment it
// can least afford it. Now at most one per StatsInterval.
func TestHealthSamplesAtMostOncePerInterval(t *testing.T) {
	e := newEnv(t)
	d := &statsCounter{}
	ob := e.newOutbox(func(c *outbox.Config) {
		c.Driver = d
		c.StatsInterval = -1 // no sampling: Health samples for itself
		c.HealthMaxPending = 1000
	})
	for range 10 {
		for _, c := range ob.Health(context.Background()).Checks {
			if c.Name == outbox.CheckBacklog && !c.OK {
				t.Fatalf("backlog check: %s", c.Reason)
			}
		}
	}
	if n := d.n.Load(); n != 1 {
		t.Errorf("10 health checks within a second took %d samples of the tables, want 1", n)
	}
}

// WaitIdle ends with its context, also while a mark is being written: it waited for the marks
// queued without a context, up to the 30 s a mark may retry, whatever its caller's deadline.
func TestWaitIdleEndsWithItsContextWhileAMarkWaits(t *testing.T) {
	e := newEnv(t)
	ob := e.newOutbox()
	lock, err := e.db.Begin()
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = lock.Rollback() }()
	if err := ob.InTx(context.Background(), func(ctx context.Context, _ *sql.Tx) error {
		return outbox.Publish(ctx, "out_a", message.NewMessage(uuid.NewString(), nil))
	}); err != nil {
		t.Fatal(err)
	}
	// The mark of the effect just sent waits on this lock (it is written in the background).
	if _, err := lock.Exec(`LOCK TABLE outbox_effects_all IN ACCESS EXCLUSIVE MODE`); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
	defer cancel()
	began := time.Now()
	err = ob.WaitIdle(ctx)
	if took := time.Since(began); took > 5*time.Second {
		t.Errorf("WaitIdle with a context of 300 ms returned after %s (%v)", took.Round(time.Millisecond), err)
	}
	if err == nil {
		t.Error("WaitIdle returned nil while the effect's mark could not be written")
	}
	_ = lock.Rollback()
	ob.FlushMarks()
}
