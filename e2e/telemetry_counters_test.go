package e2e

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/google/uuid"
	"github.com/prometheus/client_golang/prometheus"
	otelprom "go.opentelemetry.io/otel/exporters/prometheus"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"

	"github.com/watermill-outbox/outbox"
	"github.com/watermill-outbox/outbox/drivers/postgres"
	"github.com/watermill-outbox/outbox/internal/pgtest"
)

// counterEnv is an Outbox on a real PostgreSQL with an SDK meter provider (an in-memory reader
// and the Prometheus exporter) and an in-process broker that an outage can be switched on for.
type counterEnv struct {
	ob  *outbox.Outbox
	db  *sql.DB
	tel *telemetryEnv // reader and reg only: for collect and the served names
	pub *gatedPublisher
}

func newCounterEnv(t *testing.T, cfg outbox.Config) *counterEnv {
	t.Helper()
	db := pgtest.DB(t)
	t.Cleanup(func() { _ = db.Close() })
	ch := gochannel.NewGoChannel(gochannel.Config{}, watermill.NopLogger{})
	t.Cleanup(func() { _ = ch.Close() })
	pub := &gatedPublisher{Publisher: ch, refused: telRefused}
	reader := sdkmetric.NewManualReader()
	reg := prometheus.NewRegistry()
	exporter, err := otelprom.New(otelprom.WithRegisterer(reg))
	if err != nil {
		t.Fatal(err)
	}
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader), sdkmetric.WithReader(exporter))
	t.Cleanup(func() { _ = mp.Shutdown(context.Background()) })
	cfg.DB, cfg.Driver, cfg.Publisher, cfg.MeterProvider = db, postgres.Driver{}, pub, mp
	if cfg.Logger == nil {
		cfg.Logger = watermill.NopLogger{}
	}
	ob, err := outbox.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	if err := ob.Migrate(context.Background()); err != nil {
		t.Fatal(err)
	}
	return &counterEnv{ob: ob, db: db, tel: &telemetryEnv{reader: reader, reg: reg}, pub: pub}
}

// run runs ob.Run until the test ends.
func (e *counterEnv) run(t *testing.T) {
	ctx, stop := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- e.ob.Run(ctx) }()
	t.Cleanup(func() {
		stop()
		select {
		case <-done:
		case <-time.After(time.Minute):
			t.Error("Run did not return within a minute of its cancellation")
		}
	})
}

// waitCount waits up to timeout for the counter name (points with attributes want) to reach n.
func (e *counterEnv) waitCount(t *testing.T, name string, want map[string]string, n int64, timeout time.Duration) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for {
		got := sumInt(t, e.tel.collect(t), name, want)
		if got >= n {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s%v = %d after %v, want %d", name, want, got, timeout, n)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// Every InTx counts by its outcome: committed, dispatch_failed (committed, the broker refused),
// rolled_back (fn returned an error) and failed (the commit failed); each series exists at zero
// before the first unit, so that rate() sees the first of each.
func TestTelemetryBoundaryOutcomes(t *testing.T) {
	e := newCounterEnv(t, outbox.Config{})
	ctx := context.Background()
	if _, err := e.db.Exec(`CREATE TABLE tel_boundary (id int UNIQUE DEFERRABLE INITIALLY DEFERRED)`); err != nil {
		t.Fatal(err)
	}
	outcome := func(o string) map[string]string { return map[string]string{string(outbox.AttrOutcome): o} }
	all := []string{outbox.OutcomeCommitted, outbox.OutcomeDispatchFailed, outbox.OutcomeRolledBack, outbox.OutcomeFailed}
	rm := e.tel.collect(t)
	for _, o := range all {
		if !hasPoint(rm, outbox.MetricBoundaryUnits, outcome(o)) {
			t.Errorf("%s{outcome=%s} not reported at zero before the first unit of work", outbox.MetricBoundaryUnits, o)
		}
	}

	publish := func(ctx context.Context, tx *sql.Tx) error {
		return outbox.Publish(ctx, telEvents, message.NewMessage(uuid.NewString(), []byte("x")))
	}
	if err := e.ob.InTx(ctx, publish); err != nil {
		t.Fatal(err)
	}
	refused := errors.New("refused by the application")
	if err := e.ob.InTx(ctx, func(context.Context, *sql.Tx) error { return refused }); !errors.Is(err, refused) {
		t.Fatalf("InTx: %v, want fn's error", err)
	}
	e.pub.down.Store(true)
	if err := e.ob.InTx(ctx, publish); err != nil {
		t.Fatal(err)
	}
	e.pub.down.Store(false)
	// A deferred constraint fails at COMMIT: the unit could not finish, InTx answers an error.
	dup := func(ctx context.Context, tx *sql.Tx) error {
		_, err := tx.ExecContext(ctx, `INSERT INTO tel_boundary VALUES (1), (1)`)
		return err
	}
	if err := e.ob.InTx(ctx, dup); err == nil {
		t.Fatal("InTx with a deferred unique violation: no error, want the commit's")
	}

	rm = e.tel.collect(t)
	for _, o := range all {
		if n := sumInt(t, rm, outbox.MetricBoundaryUnits, outcome(o)); n != 1 {
			t.Errorf("%s{outcome=%s} = %d, want 1", outbox.MetricBoundaryUnits, o, n)
		}
	}
}

// A cleanup pass that fails counts in outbox.cleanup.errors (zero before), and a batch of marks the
// relay could not write counts in outbox.marks.failures as the commit path's do: without them the
// first sign of a failing cleanup is the lag alert a retention later, and the relay's re-sends
// go unseen.
func TestTelemetryCleanupAndRelayMarkFailures(t *testing.T) {
	e := newCounterEnv(t, outbox.Config{
		CleanupInterval: 100 * time.Millisecond, RelayInterval: 50 * time.Millisecond,
		RelayGrace: 200 * time.Millisecond, StatsInterval: -1,
	})
	ctx := context.Background()
	if n := sumInt(t, e.tel.collect(t), outbox.MetricCleanupErrors, nil); n != 0 || !hasPoint(e.tel.collect(t), outbox.MetricCleanupErrors, nil) {
		t.Errorf("%s not reported at zero before the first pass (%d)", outbox.MetricCleanupErrors, n)
	}
	var processed, effects string
	if err := e.db.QueryRow(`SELECT to_regclass('outbox_processed')::text, to_regclass('outbox_effects_all')::text`).Scan(&processed, &effects); err != nil {
		t.Fatalf("the outbox tables (default prefix): %v", err)
	}

	// The relay's marks: the commit path fails (outage), the relay sends the effect once the
	// broker is back, and its mark is refused (a trigger stands for a database that refuses).
	e.pub.down.Store(true)
	if err := e.ob.InTx(ctx, func(ctx context.Context, tx *sql.Tx) error {
		return outbox.Publish(ctx, telEvents, message.NewMessage(uuid.NewString(), []byte("x")))
	}); err != nil {
		t.Fatal(err)
	}
	if _, err := e.db.Exec(`CREATE FUNCTION tel_refuse() RETURNS trigger LANGUAGE plpgsql AS $$
		BEGIN RAISE EXCEPTION 'refused by the test' USING ERRCODE = '42P01'; END $$;
		CREATE TRIGGER tel_refuse_mark BEFORE DELETE ON ` + effects + ` FOR EACH STATEMENT EXECUTE FUNCTION tel_refuse();
		ALTER TABLE ` + processed + ` RENAME TO tel_processed_away`); err != nil {
		t.Fatal(err)
	}
	e.pub.down.Store(false)
	e.run(t)
	e.waitCount(t, outbox.MetricCleanupErrors, nil, 1, 20*time.Second)
	e.waitCount(t, outbox.MetricMarkFailures, nil, 1, 30*time.Second)
	if _, err := e.db.Exec(`ALTER TABLE tel_processed_away RENAME TO ` + processed); err != nil {
		t.Fatal(err)
	}
}

// dashPanel is a panel of the shipped Grafana dashboard.
type dashPanel struct {
	Title   string
	Type    string
	Targets []struct{ Expr string }
}

// Every panel of the shipped dashboard has a series to show on a healthy service that has
// handled a few messages and run cleanup, with nothing gone wrong: a panel whose series appear
// only at the first failure shows "No data", which reads as a broken dashboard, not as zero.
func TestDashboardPanelsHaveDataOnAHealthyService(t *testing.T) {
	e := newCounterEnv(t, outbox.Config{CleanupInterval: 50 * time.Millisecond, StatsInterval: 50 * time.Millisecond,
		RelayInterval: 50 * time.Millisecond})
	e.run(t)
	for i := range 3 {
		msg := message.NewMessage(uuid.NewString(), []byte(fmt.Sprint(i)))
		err := e.ob.Handle(msg, outbox.HandleParams{Consumer: "c1", MessageID: msg.UUID}, func(msg *message.Message) ([]*message.Message, error) {
			return nil, outbox.Publish(msg.Context(), telEvents, message.NewMessage(uuid.NewString(), msg.Payload))
		})
		if err != nil {
			t.Fatal(err)
		}
	}
	e.waitCount(t, outbox.MetricCleanupBatches, nil, 1, 20*time.Second)
	e.ob.FlushMarks()

	raw, err := os.ReadFile("../deploy/grafana/outbox-dashboard.json")
	if err != nil {
		t.Fatal(err)
	}
	var dash struct{ Panels []dashPanel }
	if err := json.Unmarshal(raw, &dash); err != nil {
		t.Fatal(err)
	}
	name := regexp.MustCompile(`\b(?:outbox|messaging)_[a-z0-9_]+`)
	matchers := regexp.MustCompile(`\{[^}]*\}`)
	labels := regexp.MustCompile(`^(?:outbox|messaging)_(?:consumer_group_name|outcome|dispatch_path|effect_kind|table|tables)$`)
	// A relay round and a stats sample after the work: every 50 ms, later on a loaded machine
	// under -race (200 ms once saw no relay round yet): the panels are read until all show or
	// 20 s have passed.
	var empty []string
	for deadline := time.Now().Add(20 * time.Second); ; time.Sleep(100 * time.Millisecond) {
		families, err := e.tel.reg.Gather()
		if err != nil {
			t.Fatal(err)
		}
		served := map[string]bool{}
		for _, f := range families {
			served[f.GetName()] = true
		}
		empty = emptyPanels(dash.Panels, served, name, matchers, labels)
		if len(empty) == 0 || time.Now().After(deadline) {
			break
		}
	}
	for _, title := range empty {
		t.Errorf("panel %q has no series on a healthy service: it shows \"No data\"", title)
	}
}

// emptyPanels returns the titles of the panels none of whose targets has every series it names
// among served.
func emptyPanels(panels []dashPanel, served map[string]bool, name, matchers, labels *regexp.Regexp) []string {
	var empty []string
	for _, p := range panels {
		if p.Type == "row" || len(p.Targets) == 0 {
			continue
		}
		// Duplicates need a duplicate delivery: their panels are read once one came.
		if strings.Contains(strings.ToLower(p.Title), "duplicate") {
			continue
		}
		shows := false
		for _, tg := range p.Targets {
			all := true
			for _, n := range name.FindAllString(matchers.ReplaceAllString(tg.Expr, ""), -1) {
				if labels.MatchString(n) {
					continue
				}
				base := n
				for _, suffix := range []string{"_bucket", "_sum", "_count"} {
					if b, ok := strings.CutSuffix(n, suffix); ok && served[b] {
						base = b
					}
				}
				all = all && served[base]
			}
			shows = shows || all
		}
		if !shows {
			empty = append(empty, p.Title)
		}
	}
	return empty
}

// A unit that cannot finish because the database does not answer counts as failed, not as rolled
// back, whether its caller gives up (a client's timeout cancels the request's context) or
// HandlerTimeout ends it: OutboxBoundaryFailing is the alert for a stalled database at the
// boundary, and an application's own refusals (rolled_back) must not be mistaken for it.
func TestTelemetryBoundaryStalledUnitsFail(t *testing.T) {
	e := newCounterEnv(t, outbox.Config{HandlerTimeout: time.Second, StatsInterval: -1})
	outcome := func(o string) map[string]string { return map[string]string{string(outbox.AttrOutcome): o} }

	// The stall: a side transaction holds the effects table as an operator's migration might.
	lock, err := e.db.BeginTx(context.Background(), nil)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = lock.Rollback() }()
	if _, err := lock.Exec(`LOCK TABLE outbox_effects_all IN ACCESS EXCLUSIVE MODE`); err != nil {
		t.Fatal(err)
	}
	publish := func(ctx context.Context, tx *sql.Tx) error {
		return outbox.Publish(ctx, telEvents, message.NewMessage(uuid.NewString(), []byte("x")))
	}

	// The caller gives up first.
	ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
	err = e.ob.InTx(ctx, publish)
	cancel()
	if err == nil {
		t.Fatal("InTx against a locked effects table with a 300 ms context: no error")
	}
	t.Logf("caller's deadline: %v", err)
	// HandlerTimeout ends it.
	start := time.Now()
	err = e.ob.InTx(context.Background(), publish)
	if err == nil {
		t.Fatal("InTx against a locked effects table with a 1 s HandlerTimeout: no error")
	}
	if took := time.Since(start); took > 30*time.Second {
		t.Errorf("InTx took %v with a 1 s HandlerTimeout", took)
	}
	t.Logf("HandlerTimeout: %v", err)

	rm := e.tel.collect(t)
	if n := sumInt(t, rm, outbox.MetricBoundaryUnits, outcome(outbox.OutcomeFailed)); n != 2 {
		t.Errorf("%s{outcome=failed} = %d after two units stalled on the database, want 2 (rolled_back: %d)", outbox.MetricBoundaryUnits, n,
			sumInt(t, rm, outbox.MetricBoundaryUnits, outcome(outbox.OutcomeRolledBack)))
	}
	if n := sumInt(t, rm, outbox.MetricBoundaryUnits, outcome(outbox.OutcomeRolledBack)); n != 0 {
		t.Errorf("%s{outcome=rolled_back} = %d, want 0: no fn refused anything", outbox.MetricBoundaryUnits, n)
	}
}

// A unit whose delayed effect the store refuses counts as failed too, as one whose effect the
// store refuses: the database said no, not the application.
func TestTelemetryBoundaryRefusedDelayedEffectFails(t *testing.T) {
	e := newCounterEnv(t, outbox.Config{StatsInterval: -1})
	outcome := func(o string) map[string]string { return map[string]string{string(outbox.AttrOutcome): o} }
	// The delayed table is missing (an operator's mistake): every delayed record fails at once.
	if _, err := e.db.Exec(`ALTER TABLE outbox_delayed RENAME TO outbox_delayed_away`); err != nil {
		t.Fatal(err)
	}
	defer func() {
		if _, err := e.db.Exec(`ALTER TABLE outbox_delayed_away RENAME TO outbox_delayed`); err != nil {
			t.Error(err)
		}
	}()
	err := e.ob.InTx(context.Background(), func(ctx context.Context, tx *sql.Tx) error {
		return outbox.Publish(outbox.WithDelay(ctx, time.Minute), telEvents, message.NewMessage(uuid.NewString(), []byte("x")))
	})
	if err == nil {
		t.Fatal("InTx with a delayed effect and no delayed table: no error")
	}
	rm := e.tel.collect(t)
	if n := sumInt(t, rm, outbox.MetricBoundaryUnits, outcome(outbox.OutcomeFailed)); n != 1 {
		t.Errorf("%s{outcome=failed} = %d after the store refused a delayed effect, want 1 (rolled_back: %d)", outbox.MetricBoundaryUnits, n,
			sumInt(t, rm, outbox.MetricBoundaryUnits, outcome(outbox.OutcomeRolledBack)))
	}
}

// A unit of work of the database/sql form that records its messages one Publish call at a time
// moves them from its claim to rows once rewriting them costs more (the spill): counted, from a
// series at zero, once per unit, not per record after it.
func TestTelemetryEffectsSpilled(t *testing.T) {
	e := newCounterEnv(t, outbox.Config{})
	if got := sumInt(t, e.tel.collect(t), outbox.MetricEffectsSpilled, nil); got != 0 {
		t.Fatalf("%s = %d before any unit, want 0", outbox.MetricEffectsSpilled, got)
	}
	publish := func(n int) message.HandlerFunc {
		return func(msg *message.Message) ([]*message.Message, error) {
			for range n {
				if err := outbox.Publish(msg.Context(), "spilled", message.NewMessage(uuid.NewString(), make([]byte, 300))); err != nil {
					return nil, err
				}
			}
			return nil, nil
		}
	}
	for _, n := range []int{2, 12} { // two records stay in the claim; twelve spill once
		msg := message.NewMessage(uuid.NewString(), nil)
		if err := e.ob.Handle(msg, outbox.HandleParams{Consumer: "spill", MessageID: msg.UUID}, publish(n)); err != nil {
			t.Fatal(err)
		}
	}
	if got := sumInt(t, e.tel.collect(t), outbox.MetricEffectsSpilled, nil); got != 1 {
		t.Fatalf("%s = %d after a unit of 2 records and one of 12, want 1", outbox.MetricEffectsSpilled, got)
	}
}

// The Outboxes of one pool share its gate, and each counts the gate's attempts under its own
// member name; two without member names (two sets of tables on one pool) counted each attempt
// twice into the one series they share: outbox.db.unreachable_attempts said twice the attempts
// the pool made. Now one count per attempt and member name.
func TestTelemetryUnreachableAttemptsOncePerSeries(t *testing.T) {
	attempts := func(outboxes int) int64 {
		obs, env := unreachableOutboxes(t, outboxes, nil)
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		if err := obs[0].InTx(ctx, func(context.Context, *sql.Tx) error { return nil }); err == nil {
			t.Fatal("InTx on a database that refuses connections succeeded")
		}
		st := obs[0].Health(ctx)
		for _, c := range st.Checks {
			if c.Name == outbox.CheckDatabase && c.OK {
				t.Fatalf("the database check passed on a database that refuses connections: %s", c.Reason)
			}
		}
		return sumInt(t, env.collect(t), outbox.MetricDBUnreachable, nil)
	}
	one, two := attempts(1), attempts(2)
	if one == 0 {
		t.Fatal("no unreachable attempt counted by one Outbox on a database that refuses connections")
	}
	if two != one {
		t.Errorf("the same attempts counted %d times by two Outboxes of one pool without member names, %d times by one; want the same count", two, one)
	}
}

// While the database is unreachable the relay waits for the gate's probe and
// outbox.relay.errors stays still (docs/observability.md): outbox.db.unreachable_attempts counts
// the outage. The relay's first claim of the outage counted one error all the same, and every
// shutdown that cut a claim short another.
func TestTelemetryRelayErrorsStillWhileUnreachable(t *testing.T) {
	obs, env := unreachableOutboxes(t, 1, func(c *outbox.Config) { c.RelayInterval = 20 * time.Millisecond })
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- obs[0].Run(ctx) }()
	deadline := time.Now().Add(30 * time.Second)
	for sumInt(t, env.collect(t), outbox.MetricDBUnreachable, nil) < 2 {
		if time.Now().After(deadline) {
			t.Fatal("no unreachable attempts counted in 30 s on a database that refuses connections")
		}
		time.Sleep(50 * time.Millisecond)
	}
	cancel()
	<-done
	if n := sumInt(t, env.collect(t), outbox.MetricRelayErrors, nil); n != 0 {
		t.Errorf("outbox.relay.errors counted %d while the database was unreachable, want 0 (the outage is counted as unreachable attempts)", n)
	}
}

// unreachableOutboxes returns n Outboxes (tables t0_, t1_, ...) on one pool of a database that
// refuses every connection, with one SDK meter provider, closed when t ends.
func unreachableOutboxes(t *testing.T, n int, mutate func(*outbox.Config)) ([]*outbox.Outbox, *telemetryEnv) {
	t.Helper()
	db, err := sql.Open("postgres", "postgres://nobody@127.0.0.1:1/none?sslmode=disable&connect_timeout=2")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = db.Close() })
	reader := sdkmetric.NewManualReader()
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
	t.Cleanup(func() { _ = mp.Shutdown(context.Background()) })
	ch := gochannel.NewGoChannel(gochannel.Config{}, watermill.NopLogger{})
	t.Cleanup(func() { _ = ch.Close() })
	var obs []*outbox.Outbox
	for i := range n {
		cfg := outbox.Config{DB: db, Driver: postgres.Driver{}, Publisher: ch, MeterProvider: mp,
			TablePrefix: fmt.Sprintf("t%d_", i), Logger: watermill.NopLogger{}}
		if mutate != nil {
			mutate(&cfg)
		}
		ob, err := outbox.New(cfg)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = ob.Close() })
		obs = append(obs, ob)
	}
	return obs, &telemetryEnv{reader: reader}
}
