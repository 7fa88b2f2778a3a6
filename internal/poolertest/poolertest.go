// Package poolertest runs the framework through a real PgBouncer (internal/pgbouncer, started by
// internal/pgtest) in transaction and in session mode, for each form: the database/sql form with
// lib/pq or pgx's stdlib, and the pgx form.
package poolertest

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"net/url"
	"runtime"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/metric/noop"

	"github.com/watermill-outbox/outbox"
	"github.com/watermill-outbox/outbox/internal/pgtest"
	"github.com/watermill-outbox/outbox/outboxdriver"
)

// Form is one way of running the framework.
type Form struct {
	// Setting is the connection string parameter (key=value) the form needs behind a pooler in
	// transaction mode; Open refuses that pooler without it.
	Setting string
	// Open returns an Outbox on dsn with cfg (DB and Driver unset) whose relay LISTENs through
	// listenDSN ("": the form's default, through dsn). What it opens is closed in t.Cleanup.
	Open func(t testing.TB, dsn, listenDSN string, cfg outbox.Config) (*outbox.Outbox, error)
	// Write applies order id in the unit of work of ctx.
	Write func(ctx context.Context, id string) error
}

// WithParam returns dsn (a URL) with the parameter kv (key=value) added.
func WithParam(t testing.TB, dsn, kv string) string {
	t.Helper()
	u, err := url.Parse(dsn)
	if err != nil {
		t.Fatal(err)
	}
	k, v, _ := strings.Cut(kv, "=")
	q := u.Query()
	q.Set(k, v)
	u.RawQuery = q.Encode()
	return u.String()
}

// WithoutParam returns dsn (a URL) without the parameter key.
func WithoutParam(t testing.TB, dsn, key string) string {
	t.Helper()
	u, err := url.Parse(dsn)
	if err != nil {
		t.Fatal(err)
	}
	q := u.Query()
	q.Del(key)
	u.RawQuery = q.Encode()
	return u.String()
}

// logPoolerIfFailed says, when t fails, whether the PgBouncer it ran behind still runs (one that
// died mid-test fails every connection after it: "conn closed", then "connection refused").
func logPoolerIfFailed(t testing.TB, mode string) {
	t.Cleanup(func() {
		if t.Failed() {
			t.Log(pgtest.PoolerStatus(t, mode))
		}
	})
}

// Refused checks that, behind a pooler in transaction mode, the form without its setting is
// refused at Migrate with an error that names the setting, and works with it.
func Refused(t *testing.T, form Form) {
	_, pooled := pgtest.PoolerDSN(t, pgtest.PoolTransaction)
	logPoolerIfFailed(t, pgtest.PoolTransaction)
	ob, err := form.Open(t, pooled, "", outbox.Config{Publisher: &publisher{}})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	err = ob.Migrate(ctx)
	if !errors.Is(err, outboxdriver.ErrUnsafeBehindPooler) {
		t.Fatalf("Migrate behind a pooler in transaction mode without %s: %v, want ErrUnsafeBehindPooler", form.Setting, err)
	}
	if !strings.Contains(err.Error(), form.Setting) {
		t.Errorf("the refusal does not name the fix %s: %v", form.Setting, err)
	}
	if err := ob.CheckSchema(ctx); !errors.Is(err, outboxdriver.ErrUnsafeBehindPooler) {
		t.Errorf("CheckSchema after the refusal: %v", err)
	}
	ob, err = form.Open(t, WithParam(t, pooled, form.Setting), "", outbox.Config{Publisher: &publisher{}})
	if err != nil {
		t.Fatal(err)
	}
	if err := ob.Migrate(ctx); err != nil {
		t.Fatalf("Migrate with %s: %v", form.Setting, err)
	}
}

// Run runs the scenario through a PgBouncer in mode (pgtest.PoolTransaction, with the form's
// Setting, or pgtest.PoolSession, with none): Migrate from several instances at once, the
// consumer path with concurrent copies and a failing publisher, units of work at the boundary,
// cleanup and stats from several instances, the relay's wake-up across instances, shutdown.
// orderMessages are the suffixes of the messages an order's handler publishes.
var orderMessages = []string{"", "-2", "-3"}

func Run(t *testing.T, form Form, mode string) {
	for try := 1; ; try++ {
		a := &attempt{TB: t}
		done := make(chan struct{})
		go func() {
			defer close(done)
			defer a.cleanUp()
			run(a, form, mode)
		}()
		<-done
		if a.Failed() && try == 1 && pgtest.PoolerCrashed(t, mode, pgbouncerBug) {
			// PgBouncer before 1.21 exits when a server answers while a cancel request for it
			// is under way (pgbouncer#822, fixed by pgbouncer#927); Debian 12 ships 1.18. Every
			// connection through it fails after that, which says nothing of the framework: the
			// scenario runs once more, behind a new PgBouncer.
			t.Logf("PgBouncer crashed on its known bug (%q, pgbouncer#822, fixed in 1.21) during the scenario, whose failures were: %s; running it again behind a new PgBouncer",
				pgbouncerBug, strings.Join(a.failures, "; "))
			continue
		}
		for _, f := range a.failures {
			t.Error(f)
		}
		return
	}
}

// pgbouncerBug is what PgBouncer's log ends with when it exits on pgbouncer#822.
const pgbouncerBug = "server_proto: server in bad state: 11"

// attempt is the testing.TB of one run of a scenario: it keeps the failures and the clean-ups to
// itself, so that a run that PgBouncer's own crash spoilt can be run again; those of the run that
// counts become the test's.
type attempt struct {
	testing.TB
	mu       sync.Mutex
	failures []string
	cleanups []func()
}

func (a *attempt) Helper() {}

func (a *attempt) fail(msg string) {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.failures = append(a.failures, msg)
	a.TB.Log("attempt failed: " + msg)
}

func (a *attempt) Error(args ...any)                 { a.fail(strings.TrimSuffix(fmt.Sprintln(args...), "\n")) }
func (a *attempt) Errorf(format string, args ...any) { a.fail(fmt.Sprintf(format, args...)) }
func (a *attempt) Fail()                             { a.fail("failed") }
func (a *attempt) FailNow()                          { a.Fail(); runtime.Goexit() }
func (a *attempt) Fatal(args ...any)                 { a.Error(args...); runtime.Goexit() }
func (a *attempt) Fatalf(format string, args ...any) { a.Errorf(format, args...); runtime.Goexit() }
func (a *attempt) Skip(args ...any)                  { a.Fatal(append([]any{"skipped in a scenario:"}, args...)...) }
func (a *attempt) Skipf(format string, args ...any) {
	a.Fatalf("skipped in a scenario: "+format, args...)
}
func (a *attempt) SkipNow() { a.Fatal("skipped in a scenario") }

func (a *attempt) Failed() bool {
	a.mu.Lock()
	defer a.mu.Unlock()
	return len(a.failures) > 0
}

func (a *attempt) Cleanup(f func()) {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.cleanups = append(a.cleanups, f)
}

// cleanUp runs the clean-ups, last registered first, each on a goroutine of its own so that one
// that fails fatally does not keep the others from running.
func (a *attempt) cleanUp() {
	for {
		a.mu.Lock()
		if len(a.cleanups) == 0 {
			a.mu.Unlock()
			return
		}
		f := a.cleanups[len(a.cleanups)-1]
		a.cleanups = a.cleanups[:len(a.cleanups)-1]
		a.mu.Unlock()
		done := make(chan struct{})
		go func() { defer close(done); f() }()
		<-done
	}
}

func run(t testing.TB, form Form, mode string) {
	direct, pooled := pgtest.PoolerDSN(t, mode)
	logPoolerIfFailed(t, mode)
	if mode == pgtest.PoolTransaction {
		pooled = WithParam(t, pooled, form.Setting)
	}
	db, err := sql.Open("postgres", direct)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = db.Close() })
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	if _, err := db.ExecContext(ctx, `CREATE TABLE orders (id text NOT NULL)`); err != nil {
		t.Fatal(err)
	}
	pub := &publisher{}
	cfg := outbox.Config{Publisher: pub, DuplicateWait: 20 * time.Millisecond, RetryDelay: -1,
		RelayInterval: 100 * time.Millisecond, RelayGrace: 200 * time.Millisecond}

	// Migrate from several instances at once.
	obs := make([]*outbox.Outbox, 4)
	for i := range obs {
		if obs[i], err = form.Open(t, pooled, "", cfg); err != nil {
			t.Fatal(err)
		}
	}
	if err := each(len(obs), func(i int) error { return obs[i].Migrate(ctx) }); err != nil {
		t.Fatalf("Migrate from %d instances at once: %v", len(obs), err)
	}

	// The consumer path: three copies of each order at once, on different instances, with every
	// third publish failing (left to the relay).
	const orders, copies = 30, 3
	pub.failEvery.Store(3)
	var retries atomic.Int64
	var errMu sync.Mutex
	var errs []error
	// Three messages, one Publish call each: a form that keeps them in the claim and moves them
	// to rows past a bound (the database/sql form's spill, with a small MaxInlineBytes) does so
	// here.
	handler := func(msg *message.Message) ([]*message.Message, error) {
		mctx := msg.Context()
		if err := form.Write(mctx, msg.UUID); err != nil {
			return nil, err
		}
		for _, suffix := range orderMessages {
			if err := outbox.Publish(mctx, "out", message.NewMessage("out-"+msg.UUID+suffix, nil)); err != nil {
				return nil, err
			}
		}
		return nil, nil
	}
	_ = each(orders*copies, func(i int) error {
		id := fmt.Sprintf("o%d", i/copies)
		ob := obs[i%len(obs)]
		for attempt := 0; attempt < 10; attempt++ {
			err := ob.Handle(message.NewMessage(id, nil), outbox.HandleParams{Consumer: "orders", MessageID: id}, handler)
			if err == nil || errors.Is(err, outbox.ErrDispatchFailed) {
				return nil // applied; the relay sends what the broker refused
			}
			retries.Add(1)
			errMu.Lock()
			errs = append(errs, err)
			errMu.Unlock()
		}
		return nil
	})
	if n := retries.Load(); n > 0 {
		t.Errorf("%d retries of the consumer path; the errors: %v", n, errors.Join(errs...))
	}

	// Units of work at the boundary.
	const units = 24
	if err := each(units, func(i int) error {
		id := fmt.Sprintf("u%d", i)
		return obs[i%len(obs)].InUnit(ctx, func(ctx context.Context) error {
			if err := form.Write(ctx, id); err != nil {
				return err
			}
			return outbox.Publish(ctx, "out", message.NewMessage("out-"+id, nil))
		})
	}); err != nil {
		t.Errorf("InTx: %v", err)
	}

	// The relays send what the failed publishes left; cleanup and stats run from every instance.
	pub.failEvery.Store(0)
	runCtx, stop := context.WithCancel(ctx)
	var running sync.WaitGroup
	runErrs := make(chan error, len(obs))
	for _, ob := range obs[:2] {
		running.Add(1)
		go func() { defer running.Done(); runErrs <- ob.Run(runCtx) }()
	}
	want := map[string]bool{}
	for i := 0; i < orders; i++ {
		for _, suffix := range orderMessages {
			want[fmt.Sprintf("out-o%d%s", i, suffix)] = true
		}
	}
	for i := 0; i < units; i++ {
		want[fmt.Sprintf("out-u%d", i)] = true
	}
	waitFor(t, 30*time.Second, "every order's message sent", func() bool { return len(pub.uuids()) >= len(want) })
	if err := each(len(obs), func(i int) error {
		if _, err := obs[i].Cleanup(ctx); err != nil {
			return fmt.Errorf("cleanup: %w", err)
		}
		if _, err := obs[i].Stats(ctx); err != nil {
			return fmt.Errorf("stats: %w", err)
		}
		return nil
	}); err != nil {
		t.Errorf("cleanup and stats from %d instances at once: %v", len(obs), err)
	}
	if got := pub.uuids(); !sameKeys(got, want) {
		t.Errorf("sent %d distinct UUIDs, want %d: %v", len(got), len(want), diff(got, want))
	}
	rows, err := db.QueryContext(ctx, `SELECT id, count(*) FROM orders GROUP BY id HAVING count(*) <> 1`)
	if err != nil {
		t.Fatal(err)
	}
	for rows.Next() {
		var id string
		var n int
		if err := rows.Scan(&id, &n); err != nil {
			t.Fatal(err)
		}
		t.Errorf("order %s applied %d times", id, n)
	}
	_ = rows.Close()
	var applied int
	if err := db.QueryRowContext(ctx, `SELECT count(DISTINCT id) FROM orders`).Scan(&applied); err != nil {
		t.Fatal(err)
	}
	if applied != orders+units {
		t.Errorf("%d orders applied, want %d", applied, orders+units)
	}

	// Shutdown: Run returns soon after its context ends.
	shutdown := func(stop func(), running *sync.WaitGroup, runErrs chan error) {
		t.Helper()
		stop()
		done := make(chan struct{})
		go func() { running.Wait(); close(done) }()
		select {
		case <-done:
		case <-time.After(15 * time.Second):
			t.Fatal("Run did not return within 15s of its context's end")
		}
		close(runErrs)
		for err := range runErrs {
			if err != nil {
				t.Errorf("Run: %v", err)
			}
		}
	}
	shutdown(stop, &running, runErrs)

	// The relay's wake-up across instances: a publish that fails in one instance wakes the relay
	// of another, the only one running, which polls only every minute. In transaction mode the
	// listener needs a connection of its own, to PostgreSQL directly.
	runCtx, stop = context.WithCancel(ctx)
	defer stop()
	var wakeRunning sync.WaitGroup
	wakeErrs := make(chan error, 2)
	listenDSN := ""
	if mode == pgtest.PoolTransaction {
		listenDSN = direct
	}
	wakePub := &publisher{}
	wcfg := cfg
	wcfg.Publisher, wcfg.RelayInterval = wakePub, time.Minute
	woken, err := form.Open(t, pooled, listenDSN, wcfg)
	if err != nil {
		t.Fatal(err)
	}
	wakeRunning.Add(1)
	go func() { defer wakeRunning.Done(); wakeErrs <- woken.Run(runCtx) }()
	waitFor(t, 15*time.Second, "the listener connected", func() bool { return listenerOK(runCtx, woken) })
	pub.failEvery.Store(1)
	if err := obs[3].Handle(message.NewMessage("wake", nil), outbox.HandleParams{Consumer: "orders", MessageID: "wake"}, handler); !errors.Is(err, outbox.ErrDispatchFailed) {
		t.Fatalf("the publish meant to fail: %v", err)
	}
	waitFor(t, 10*time.Second, "the woken relay to send", func() bool { return wakePub.uuids()["out-wake"] > 0 })
	wakePub.mu.Lock()
	sentAt := wakePub.sentAt["out-wake"]
	wakePub.mu.Unlock()
	pub.mu.Lock()
	failedAt := pub.failedAt
	pub.mu.Unlock()
	t.Logf("%s mode: another instance's relay sent a failed publish %s after it failed", mode, sentAt.Sub(failedAt).Round(100*time.Microsecond))

	if mode == pgtest.PoolTransaction {
		// A listener through the pooler in transaction mode receives nothing: it says so.
		dcfg := wcfg
		deafCount := &countingMeters{name: outbox.MetricListenerDeaf}
		dcfg.MeterProvider = deafCount
		deaf, err := form.Open(t, pooled, "", dcfg)
		if err != nil {
			t.Fatal(err)
		}
		wakeRunning.Add(1)
		go func() { defer wakeRunning.Done(); wakeErrs <- deaf.Run(runCtx) }()
		var reason string
		waitFor(t, 20*time.Second, "the listener through the pooler to report that it receives nothing", func() bool {
			for _, c := range deaf.Health(runCtx).Checks {
				if c.Name == outbox.CheckListener && c.OK {
					t.Fatalf("a listener through the pooler in transaction mode reported %q", c.Reason)
				}
				if c.Name == outbox.CheckListener && strings.Contains(c.Reason, "notification") {
					reason = c.Reason
					return true
				}
			}
			return false
		})
		t.Logf("listener through the pooler: %s", reason)
		if n := deafCount.n.Load(); n < 1 {
			t.Errorf("%s = %d after the listener reported deaf", outbox.MetricListenerDeaf, n)
		}
	}
	shutdown(stop, &wakeRunning, wakeErrs)
}

func listenerOK(ctx context.Context, ob *outbox.Outbox) bool {
	for _, c := range ob.Health(ctx).Checks {
		if c.Name == outbox.CheckListener {
			return c.OK
		}
	}
	return false
}

// each runs fn(0..n-1) at once and joins their errors.
func each(n int, fn func(i int) error) error {
	errs := make([]error, n)
	var wg sync.WaitGroup
	for i := range n {
		wg.Add(1)
		go func() { defer wg.Done(); errs[i] = fn(i) }()
	}
	wg.Wait()
	return errors.Join(errs...)
}

func waitFor(t testing.TB, d time.Duration, what string, ok func() bool) {
	t.Helper()
	deadline := time.Now().Add(d)
	for !ok() {
		if time.Now().After(deadline) {
			t.Fatalf("waited %s for %s", d, what)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

func sameKeys(got map[string]int, want map[string]bool) bool {
	if len(got) != len(want) {
		return false
	}
	for k := range got {
		if !want[k] {
			return false
		}
	}
	return true
}

func diff(got map[string]int, want map[string]bool) string {
	var missing, extra []string
	for k := range want {
		if got[k] == 0 {
			missing = append(missing, k)
		}
	}
	for k := range got {
		if !want[k] {
			extra = append(extra, k)
		}
	}
	sort.Strings(missing)
	sort.Strings(extra)
	return fmt.Sprintf("missing %v, unexpected %v", missing, extra)
}

// publisher records the UUIDs it sent, and refuses every failEvery-th publish (0: none).
type publisher struct {
	mu        sync.Mutex
	sent      map[string]int
	sentAt    map[string]time.Time // first send
	failedAt  time.Time            // last refusal
	calls     int64
	failEvery atomic.Int64
}

func (p *publisher) Publish(_ string, msgs ...*message.Message) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.calls++
	if n := p.failEvery.Load(); n > 0 && p.calls%n == 0 {
		p.failedAt = time.Now()
		return errors.New("broker down")
	}
	if p.sent == nil {
		p.sent, p.sentAt = map[string]int{}, map[string]time.Time{}
	}
	for _, m := range msgs {
		if p.sent[m.UUID] == 0 {
			p.sentAt[m.UUID] = time.Now()
		}
		p.sent[m.UUID]++
	}
	return nil
}

func (p *publisher) Close() error { return nil }

func (p *publisher) uuids() map[string]int {
	p.mu.Lock()
	defer p.mu.Unlock()
	out := make(map[string]int, len(p.sent))
	for k, v := range p.sent {
		out[k] = v
	}
	return out
}

// countingMeters is a MeterProvider that counts what is added to the Int64Counter name.
type countingMeters struct {
	noop.MeterProvider
	name string
	n    atomic.Int64
}

func (p *countingMeters) Meter(string, ...metric.MeterOption) metric.Meter {
	return countingMeter{p: p}
}

type countingMeter struct {
	noop.Meter
	p *countingMeters
}

func (m countingMeter) Int64Counter(name string, _ ...metric.Int64CounterOption) (metric.Int64Counter, error) {
	if name != m.p.name {
		return noop.Int64Counter{}, nil
	}
	return countingCounter{n: &m.p.n}, nil
}

type countingCounter struct {
	noop.Int64Counter
	n *atomic.Int64
}

func (c countingCounter) Add(_ context.Context, incr int64, _ ...metric.AddOption) { c.n.Add(incr) }
