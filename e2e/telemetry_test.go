package e2e

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"net/http"
	"net/http/httptest"
	"os"
	"regexp"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/prometheus/client_golang/prometheus"
	"go.opentelemetry.io/otel/attribute"
	otelprom "go.opentelemetry.io/otel/exporters/prometheus"
	"go.opentelemetry.io/otel/propagation"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"
	"gopkg.in/yaml.v3"

	"github.com/watermill-outbox/outbox"
	"github.com/watermill-outbox/outbox/drivers/postgres"
	"github.com/watermill-outbox/outbox/internal/brokertest"
	"github.com/watermill-outbox/outbox/internal/logtest"
	"github.com/watermill-outbox/outbox/internal/pgtest"
	"github.com/watermill-outbox/outbox/middleware"
)

// gatedPublisher is the real Publisher with two faults the scenario switches on: an outage
// (every Publish fails) and a topic the "broker" refuses (a poison effect).
type gatedPublisher struct {
	message.Publisher
	down    atomic.Bool
	refused string
}

func (p *gatedPublisher) Publish(topic string, msgs ...*message.Message) error {
	if p.down.Load() {
		return errors.New("broker unreachable (test outage)")
	}
	if topic == p.refused {
		return errors.New("message refused by the broker (test poison effect)")
	}
	return p.Publisher.Publish(topic, msgs...)
}

// telemetryEnv is an Outbox with an SDK meter provider (an in-memory reader and a Prometheus
// exporter) and an in-memory span recorder, on a real PostgreSQL and Redis Streams.
type telemetryEnv struct {
	ob     *outbox.Outbox
	db     *sql.DB
	reader *sdkmetric.ManualReader
	reg    *prometheus.Registry
	spans  *tracetest.SpanRecorder
	pub    *gatedPublisher
	log    *logtest.Errors
	b      broker
}

const (
	telOrders   = "tel_orders"
	telEvents   = "tel_events"
	telRefused  = "tel_refused"
	telPoison   = "tel_poison"
	telConsumer = "tel-consumer"
	telRetain   = 4 * time.Second
)

func newTelemetryEnv(t *testing.T) *telemetryEnv {
	t.Helper()
	srv, err := brokertest.Start(brokertest.Redis)
	if err != nil {
		t.Fatalf("start Redis (install redis-server; .ci/run does): %v", err)
	}
	t.Cleanup(srv.Close)
	e := &telemetryEnv{db: pgtest.DB(t), b: broker{kind: brokertest.Redis, addr: srv.Addr()}, log: &logtest.Errors{}}
	t.Cleanup(func() { _ = e.db.Close() })
	pub, closePub, err := e.b.publisher()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(closePub)
	e.pub = &gatedPublisher{Publisher: pub, refused: telRefused}

	e.reader = sdkmetric.NewManualReader()
	e.reg = prometheus.NewRegistry()
	exporter, err := otelprom.New(otelprom.WithRegisterer(e.reg))
	if err != nil {
		t.Fatal(err)
	}
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(e.reader), sdkmetric.WithReader(exporter))
	t.Cleanup(func() { _ = mp.Shutdown(context.Background()) })
	e.spans = tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(e.spans))
	t.Cleanup(func() { _ = tp.Shutdown(context.Background()) })

	e.ob, err = outbox.New(outbox.Config{
		DB: e.db, Driver: postgres.Driver{}, Publisher: e.pub, Logger: e.log,
		MeterProvider: mp, TracerProvider: tp,
		// The outcomes poisoned and rejected are those of the opt-out of dead letters, with a
		// poison topic; dead_lettered, the default's, is checked by TestDeadLetterTelemetry.
		DeadLetters: outbox.DeadLettersOff,
		PoisonTopic: telPoison, MaxAttempts: 2, RetryDelay: 50 * time.Millisecond,
		Retention: telRetain, CleanupInterval: 200 * time.Millisecond,
		RelayInterval: 50 * time.Millisecond, RelayGrace: 5 * time.Second, RelayMaxAttempts: 1,
		DuplicateWait: 50 * time.Millisecond, StatsInterval: 100 * time.Millisecond,
		HealthMaxPending: 1000, HealthMaxParked: 5,
		Failpoint: func(ctx context.Context, point string) error {
			if point == outbox.FailpointAfterCommit && crashAfterCommit.CompareAndSwap(true, false) {
				return errors.New("simulated crash after commit")
			}
			return nil
		},
	})
	if err != nil {
		t.Fatal(err)
	}
	if err := e.ob.Migrate(context.Background()); err != nil {
		t.Fatal(err)
	}
	return e
}

// crashAfterCommit makes the next unit of work stop after its commit, as a crash would.
var crashAfterCommit atomic.Bool

// telHandler plays the part the incoming message's "kind" names.
func telHandler(seen *sync.Map) message.NoPublishHandlerFunc {
	return func(msg *message.Message) error {
		ctx := msg.Context()
		if _, err := outbox.Tx(ctx).ExecContext(ctx, `INSERT INTO tel_applied (id) VALUES ($1)`, msg.UUID); err != nil {
			return err
		}
		kind := msg.Metadata.Get("kind")
		n, _ := seen.LoadOrStore(msg.UUID, new(atomic.Int32))
		attempt := n.(*atomic.Int32).Add(1)
		switch {
		case kind == "fail-once" && attempt == 1, kind == "poison":
			return fmt.Errorf("handler failed (%s, attempt %d)", kind, attempt)
		case kind == "crash":
			crashAfterCommit.Store(true)
		}
		if err := outbox.Publish(ctx, telEvents, message.NewMessage(uuid.NewString(), []byte(msg.UUID))); err != nil {
			return err
		}
		if kind == "refuse" {
			return outbox.Publish(ctx, telRefused, message.NewMessage(uuid.NewString(), []byte(msg.UUID)))
		}
		return nil
	}
}

// TestTelemetryScenario runs a scripted scenario through a Router on Redis Streams (a duplicate, a
// late duplicate, a handler failure, a poisoned message, a rejected one, a crash after commit, a
// publisher outage at the boundary, an effect the broker refuses, a cleanup) and checks each
// metric and span it must produce, and that the shipped dashboard and alert rules query only
// metrics the library emits.
func TestTelemetryScenario(t *testing.T) {
	e := newTelemetryEnv(t)
	ctx := context.Background()
	if _, err := e.db.Exec(`CREATE TABLE tel_applied (id text)`); err != nil {
		t.Fatal(err)
	}
	runCtx, stopRun := context.WithCancel(ctx)
	runDone := make(chan error, 1)
	go func() { runDone <- e.ob.Run(runCtx) }()
	defer func() { stopRun(); <-runDone }()

	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	sub, closeSub, err := e.b.subscriber(telConsumer, "tel-1")
	if err != nil {
		t.Fatal(err)
	}
	defer closeSub()
	seen := &sync.Map{}
	router.AddConsumerHandler(telConsumer, telOrders, sub, telHandler(seen)).
		AddMiddleware(middleware.New(e.ob, middleware.WithMessageID(func(m *message.Message) (string, error) {
			if id := m.Metadata.Get("order_id"); id != "" {
				return id, nil
			}
			return "", errors.New("no order_id in metadata")
		})))
	routerDone := make(chan error, 1)
	go func() { routerDone <- router.Run(ctx) }()
	defer func() { _ = router.Close(); <-routerDone }()
	<-router.Running()

	// The incoming messages carry a trace context: the unit of work's span must continue it.
	incomingTrace := trace.SpanContextConfig{TraceID: trace.TraceID{1, 2, 3}, SpanID: trace.SpanID{4, 5, 6}, TraceFlags: trace.FlagsSampled}
	send := func(id, kind string) {
		t.Helper()
		m := message.NewMessage(id, []byte(kind))
		if id != "" {
			m.Metadata.Set("order_id", id)
		}
		m.Metadata.Set("kind", kind)
		propagation.TraceContext{}.Inject(trace.ContextWithSpanContext(ctx, trace.NewSpanContext(incomingTrace)), propagation.MapCarrier(m.Metadata))
		if err := e.pub.Publisher.Publish(telOrders, m); err != nil {
			t.Fatal(err)
		}
	}
	handled := func(outcome string) int64 {
		return sumInt(t, e.collect(t), outbox.MetricMessagesHandled, map[string]string{"outbox.outcome": outcome})
	}
	waitFor := func(what string, cond func() bool) {
		t.Helper()
		deadline := time.Now().Add(30 * time.Second)
		for !cond() {
			if time.Now().After(deadline) {
				t.Fatalf("waited 30s for %s; ERROR logs: %q", what, e.log.Lines())
			}
			time.Sleep(20 * time.Millisecond)
		}
	}

	send("o-1", "ok")
	waitFor("o-1 processed", func() bool { return handled(outbox.OutcomeProcessed) == 1 })
	send("o-1", "ok") // a duplicate
	waitFor("the duplicate", func() bool { return handled(outbox.OutcomeDuplicate) == 1 })
	send("o-2", "fail-once")
	waitFor("o-2 failed then processed", func() bool {
		return handled(outbox.OutcomeFailed) == 1 && handled(outbox.OutcomeProcessed) == 2
	})
	send("o-3", "poison")
	waitFor("o-3 poisoned", func() bool { return handled(outbox.OutcomePoisoned) == 1 })
	send("", "no-id")
	waitFor("the message without an ID rejected", func() bool { return handled(outbox.OutcomeRejected) == 1 })
	send("o-4", "crash") // committed, crashed before dispatch: the redelivery sends its effect
	waitFor("o-4 re-sent by its redelivery", func() bool {
		return sumInt(t, e.collect(t), outbox.MetricEffectsDispatched, map[string]string{"outbox.dispatch.path": outbox.PathRedelivery}) == 1
	})
	send("o-5", "refuse") // its second effect is refused while the first went out: parked at once
	waitFor("o-5's refused effect parked", func() bool { return handled(outbox.OutcomeDispatchFailed) == 1 })

	// A publisher outage at the boundary: the relay sends the effects once it is over.
	e.pub.down.Store(true)
	for i := 0; i < 3; i++ {
		if err := e.ob.InTx(ctx, func(ctx context.Context, tx *sql.Tx) error {
			return outbox.Publish(ctx, telEvents, message.NewMessage(uuid.NewString(), nil))
		}); err != nil {
			t.Fatal(err)
		}
	}
	waitFor("the stats sample to see the outage's backlog", func() bool {
		return gauge(t, e.collect(t), outbox.MetricEffectsPending) == 3 && gauge(t, e.collect(t), outbox.MetricEffectsParked) == 1
	})
	e.pub.down.Store(false)
	waitFor("the relay to send the backlog", func() bool {
		return sumInt(t, e.collect(t), outbox.MetricEffectsDispatched, map[string]string{"outbox.dispatch.path": outbox.PathRelay}) == 3
	})

	// A late duplicate: o-7 again after more than half of Retention.
	send("o-7", "ok")
	waitFor("o-7 processed", func() bool { return handled(outbox.OutcomeProcessed) == 3 })
	time.Sleep(telRetain/2 + 300*time.Millisecond)
	send("o-7", "ok")
	// Counted, then logged (the log line follows the count in the handler's goroutine).
	waitFor("the late duplicate counted and logged with ErrRetentionTooShort", func() bool {
		return sumInt(t, e.collect(t), outbox.MetricDuplicatesLate, nil) == 1 && e.log.Contains(outbox.ErrRetentionTooShort.Error())
	})
	// Cleanup deletes the claims once Retention has passed since their dispatch.
	waitFor("cleanup to delete expired claims", func() bool {
		return sumInt(t, e.collect(t), outbox.MetricCleanupDeleted, map[string]string{"outbox.table": "processed"}) >= 3
	})
	waitFor("pending back to zero in the sample", func() bool { return gauge(t, e.collect(t), outbox.MetricEffectsPending) == 0 })

	rm := e.collect(t)
	for _, c := range []struct {
		outcome string
		want    int64
	}{{outbox.OutcomeProcessed, 3}, {outbox.OutcomeDuplicate, 4}, {outbox.OutcomeFailed, 3}, {outbox.OutcomePoisoned, 1},
		{outbox.OutcomeRejected, 1}, {outbox.OutcomeDispatchFailed, 1}} {
		// failed: o-2's first attempt, o-3's first attempt, o-4's crash after commit.
		// processed: o-1, o-2, o-7; duplicate: o-1's copy, the redeliveries of o-4 and o-5 (its
		// parked effect does not keep it from being acked), o-7's late copy.
		if got := sumInt(t, rm, outbox.MetricMessagesHandled, map[string]string{"outbox.outcome": c.outcome}); got != c.want {
			t.Errorf("%s{outcome=%s} = %d, want %d", outbox.MetricMessagesHandled, c.outcome, got, c.want)
		}
	}
	if got, want := histCount(t, rm, outbox.MetricProcessDuration, nil), sumInt(t, rm, outbox.MetricMessagesHandled, nil); got != uint64(want) {
		t.Errorf("%s count = %d, want one per handled message (%d)", outbox.MetricProcessDuration, got, want)
	}
	// Sent on the commit path: o-1, o-2, o-5's first, o-7 (o-4 crashed first), and o-3's copy
	// for the poison topic, recorded with its poisoned claim and sent as a side effect; by
	// redelivery o-4's; by the relay the three of the outage.
	for path, want := range map[string]int64{outbox.PathCommit: 5, outbox.PathRedelivery: 1, outbox.PathRelay: 3} {
		if got := sumInt(t, rm, outbox.MetricEffectsDispatched, map[string]string{"outbox.dispatch.path": path}); got != want {
			t.Errorf("%s{path=%s} = %d, want %d", outbox.MetricEffectsDispatched, path, got, want)
		}
		if got := histCount(t, rm, outbox.MetricDispatchLag, map[string]string{"outbox.dispatch.path": path}); got != uint64(want) {
			t.Errorf("%s{path=%s} count = %d, want %d", outbox.MetricDispatchLag, path, got, want)
		}
	}
	// Failed: o-5's refused effect, and the three boundary effects during the outage (the relay
	// may have tried them again before the outage ended).
	if got := sumInt(t, rm, outbox.MetricDispatchFailures, nil); got < 4 {
		t.Errorf("%s = %d, want at least 4", outbox.MetricDispatchFailures, got)
	}
	if got := histCount(t, rm, outbox.MetricDuplicateClaimAge, map[string]string{"messaging.consumer.group.name": telConsumer}); got != 4 {
		t.Errorf("%s count = %d, want 4", outbox.MetricDuplicateClaimAge, got)
	}
	if got := sumInt(t, rm, outbox.MetricRelayRounds, nil); got < 1 {
		t.Errorf("%s = %d, want at least 1", outbox.MetricRelayRounds, got)
	}
	if got := histCount(t, rm, outbox.MetricRelayRoundEffects, nil); got < 1 {
		t.Errorf("%s count = %d, want at least 1", outbox.MetricRelayRoundEffects, got)
	}
	if got := sumInt(t, rm, outbox.MetricCleanupBatches, nil); got < 1 {
		t.Errorf("%s = %d, want at least 1", outbox.MetricCleanupBatches, got)
	}
	if got := gauge(t, rm, outbox.MetricEffectsParked); got != 1 {
		t.Errorf("%s = %v, want 1", outbox.MetricEffectsParked, got)
	}
	if got := gauge(t, rm, outbox.MetricParkedOldestAge); got <= 0 {
		t.Errorf("%s = %v, want > 0", outbox.MetricParkedOldestAge, got)
	}
	if got := gauge(t, rm, outbox.MetricStatsAge); got < 0 || got > 10 {
		t.Errorf("%s = %v s, want a recent sample", outbox.MetricStatsAge, got)
	}
	if got := gauge(t, rm, outbox.MetricRelayLastRoundAge); got < 0 || got > 10 {
		t.Errorf("%s = %v s, want a recent round", outbox.MetricRelayLastRoundAge, got)
	}
	// Failing: a message whose handler failed once and was not delivered again.
	err = e.ob.Handle(message.NewMessage("o-6", nil), outbox.HandleParams{Consumer: "tel-fresh", MessageID: "o-6"},
		func(*message.Message) ([]*message.Message, error) {
			return nil, errors.New("fails once, never redelivered")
		})
	if err == nil {
		t.Fatal("the failing handler's message was acked")
	}
	waitFor("the failing message in the sample", func() bool { return gauge(t, e.collect(t), outbox.MetricMessagesFailing) == 1 })
	// The first message of a consumer starts its counters of every outcome at zero.
	if !hasPoint(e.collect(t), outbox.MetricMessagesHandled, map[string]string{"messaging.consumer.group.name": "tel-fresh", "outbox.outcome": outbox.OutcomePoisoned}) ||
		!hasPoint(e.collect(t), outbox.MetricMessagesHandled, map[string]string{"messaging.consumer.group.name": "tel-fresh", "outbox.outcome": outbox.OutcomeDeadLettered}) ||
		!hasPoint(e.collect(t), outbox.MetricMessagesHandled, map[string]string{"messaging.consumer.group.name": "tel-fresh", "outbox.outcome": outbox.OutcomeNotAddressed}) ||
		!hasPoint(e.collect(t), outbox.MetricDuplicatesLate, map[string]string{"messaging.consumer.group.name": "tel-fresh"}) {
		t.Errorf("the counters of consumer tel-fresh did not start at zero for every outcome")
	}
	// And the Outbox's own: every boundary outcome, the rows deleted from every table.
	for _, outcome := range []string{outbox.OutcomeCommitted, outbox.OutcomeReplayed, outbox.OutcomeKeyConflict} {
		if !hasPoint(e.collect(t), outbox.MetricBoundaryUnits, map[string]string{"outbox.outcome": outcome}) {
			t.Errorf("%s of outcome %s did not start at zero", outbox.MetricBoundaryUnits, outcome)
		}
	}
	for _, table := range []string{"processed", "idempotency", "dead_letters"} {
		if !hasPoint(e.collect(t), outbox.MetricCleanupDeleted, map[string]string{"outbox.table": table}) {
			t.Errorf("%s of table %s did not start at zero", outbox.MetricCleanupDeleted, table)
		}
	}
	if got := gauge(t, e.collect(t), outbox.MetricProcessedRetained); got < 1 {
		t.Errorf("%s = %v, want at least the late o-1's claim", outbox.MetricProcessedRetained, got)
	}

	e.checkSpans(t, incomingTrace.TraceID)
	e.checkShippedQueries(t)

	// Health: every check passes while Run runs; HealthHandler says so with 200.
	rec := httptest.NewRecorder()
	e.ob.HealthHandler(map[string]func(context.Context) error{"router": func(context.Context) error {
		if !router.IsRunning() {
			return errors.New("router not running")
		}
		return nil
	}}).ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/ready", nil))
	var report outbox.HealthReport
	if err := json.Unmarshal(rec.Body.Bytes(), &report); err != nil {
		t.Fatalf("health report: %v: %s", err, rec.Body)
	}
	if rec.Code != http.StatusOK || !report.Healthy || len(report.Checks) != 7 {
		t.Errorf("health while running: %d %s, want 200 with 7 passing checks", rec.Code, rec.Body)
	}
	stopRun()
	<-runDone
	runDone <- nil // for the deferred stop
	if d := find(e.collect(t), outbox.MetricEffectsPending); d != nil && len(d.(metricdata.Gauge[float64]).DataPoints) > 0 {
		t.Errorf("after Run stopped, %s is still reported: %v", outbox.MetricEffectsPending, d)
	}
	r := e.ob.Health(ctx)
	if r.Healthy || !strings.Contains(fmt.Sprint(r.Err()), "relay: not running") {
		t.Errorf("health after Run stopped: %+v, want the relay reported not running", r)
	}
}

func (e *telemetryEnv) collect(t *testing.T) metricdata.ResourceMetrics {
	t.Helper()
	var rm metricdata.ResourceMetrics
	if err := e.reader.Collect(context.Background(), &rm); err != nil {
		t.Fatal(err)
	}
	return rm
}

// find returns the data of the metric called name, or nil.
func find(rm metricdata.ResourceMetrics, name string) metricdata.Aggregation {
	for _, sm := range rm.ScopeMetrics {
		for _, m := range sm.Metrics {
			if m.Name == name {
				return m.Data
			}
		}
	}
	return nil
}

func matches(set *attribute.Set, want map[string]string) bool {
	for k, v := range want {
		got, ok := set.Value(attribute.Key(k))
		if !ok || got.Emit() != v {
			return false
		}
	}
	return true
}

// hasPoint tells whether the int64 counter name has a point with the attributes want.
func hasPoint(rm metricdata.ResourceMetrics, name string, want map[string]string) bool {
	s, ok := find(rm, name).(metricdata.Sum[int64])
	if !ok {
		return false
	}
	for _, p := range s.DataPoints {
		if matches(&p.Attributes, want) {
			return true
		}
	}
	return false
}

// sumInt sums the points of an int64 counter whose attributes include want.
func sumInt(t *testing.T, rm metricdata.ResourceMetrics, name string, want map[string]string) int64 {
	t.Helper()
	d := find(rm, name)
	if d == nil {
		return 0
	}
	s, ok := d.(metricdata.Sum[int64])
	if !ok {
		t.Fatalf("%s is a %T, not an int64 sum", name, d)
	}
	var n int64
	for _, p := range s.DataPoints {
		if matches(&p.Attributes, want) {
			n += p.Value
		}
	}
	return n
}

// histCount counts the recordings of a histogram whose attributes include want.
func histCount(t *testing.T, rm metricdata.ResourceMetrics, name string, want map[string]string) uint64 {
	t.Helper()
	var n uint64
	switch h := find(rm, name).(type) {
	case nil:
	case metricdata.Histogram[float64]:
		for _, p := range h.DataPoints {
			if matches(&p.Attributes, want) {
				n += p.Count
			}
		}
	case metricdata.Histogram[int64]:
		for _, p := range h.DataPoints {
			if matches(&p.Attributes, want) {
				n += p.Count
			}
		}
	default:
		t.Fatalf("%s is a %T, not a histogram", name, h)
	}
	return n
}

// gauge returns the value of a float64 gauge with one point, or -1 when it has none.
func gauge(t *testing.T, rm metricdata.ResourceMetrics, name string) float64 {
	t.Helper()
	d := find(rm, name)
	if d == nil {
		return -1
	}
	g, ok := d.(metricdata.Gauge[float64])
	if !ok || len(g.DataPoints) != 1 {
		t.Fatalf("%s: %T with %v, want a gauge with one point", name, d, d)
	}
	return g.DataPoints[0].Value
}

// checkSpans checks the spans of the scenario: a unit of work continues the incoming trace,
// with claim, handler, commit and dispatch spans under it; outgoing messages carry the
// handler's trace context; re-sends link to it.
func (e *telemetryEnv) checkSpans(t *testing.T, incoming trace.TraceID) {
	t.Helper()
	spans := e.spans.Ended()
	byName := map[string][]sdktrace.ReadOnlySpan{}
	for _, s := range spans {
		byName[s.Name()] = append(byName[s.Name()], s)
	}
	process := byName["process "+telOrders]
	if len(process) < 10 {
		t.Fatalf("%d unit-of-work spans, want one per delivery (at least 10); spans: %v", len(process), slices.Sorted(maps.Keys(byName)))
	}
	outcomes := map[string]int{}
	for _, s := range process {
		if s.Parent().TraceID() != incoming || !s.Parent().IsRemote() {
			t.Errorf("unit-of-work span %s has parent %v, want the incoming message's remote span", s.SpanContext().SpanID(), s.Parent())
		}
		if s.SpanKind() != trace.SpanKindConsumer {
			t.Errorf("unit-of-work span kind %v, want consumer", s.SpanKind())
		}
		for _, a := range s.Attributes() {
			if a.Key == outbox.AttrOutcome {
				outcomes[a.Value.AsString()]++
			}
		}
	}
	for _, o := range []string{outbox.OutcomeProcessed, outbox.OutcomeDuplicate, outbox.OutcomeFailed, outbox.OutcomePoisoned, outbox.OutcomeRejected, outbox.OutcomeDispatchFailed} {
		if outcomes[o] == 0 {
			t.Errorf("no unit-of-work span with outcome %s (outcomes: %v)", o, outcomes)
		}
	}
	// Each step of a unit of work is an event of its span: a claim for every one that reached
	// the database, a commit for every one whose handler succeeded, and the dispatch after it.
	processIDs := map[trace.SpanID]bool{}
	steps := map[string]int{}
	for _, s := range process {
		processIDs[s.SpanContext().SpanID()] = true
		for _, ev := range s.Events() {
			steps[ev.Name]++
		}
	}
	if steps["outbox.claim"] < 10 || steps["outbox.commit"] < 5 || steps["outbox.dispatched"] < 4 {
		t.Errorf("unit-of-work span events: %v, want claim, commit and dispatched events", steps)
	}
	// A re-send by a redelivery has a span of its own under the duplicate's unit of work.
	if len(byName["outbox dispatch"]) == 0 {
		t.Error("no span for the re-send by o-4's redelivery")
	}
	for _, s := range byName["outbox dispatch"] {
		if !processIDs[s.Parent().SpanID()] {
			t.Errorf("dispatch span's parent %v is not a unit-of-work span", s.Parent())
		}
	}
	// The messages the handlers sent went out with their unit of work's span as their parent.
	fromHandlers := 0
	for _, m := range e.readEvents(t) {
		sc := trace.SpanContextFromContext(propagation.TraceContext{}.Extract(context.Background(), propagation.MapCarrier(m.Metadata)))
		if sc.TraceID() != incoming {
			continue // the boundary's, with traces of their own
		}
		fromHandlers++
		if !processIDs[sc.SpanID()] {
			t.Errorf("outgoing message caused by %s has traceparent %s, not a unit-of-work span's",
				m.Metadata.Get(outbox.MetadataCausationID), m.Metadata.Get(outbox.MetadataTraceparent))
		}
	}
	if fromHandlers != 5 { // o-1, o-2, o-4, o-5's first, o-7
		t.Errorf("%d outgoing messages in the incoming trace, want 5", fromHandlers)
	}
	// Re-sends link to the span that recorded the effect.
	for _, name := range []string{"outbox relay"} {
		if len(byName[name]) == 0 {
			t.Errorf("no %q span", name)
		}
	}
	linked := 0
	for _, s := range append(byName["outbox dispatch"], byName["outbox relay"]...) {
		linked += len(s.Links())
	}
	if linked < 4 { // o-4's redelivery, and the three effects of the outage
		t.Errorf("re-send spans carry %d links to their producers, want at least 4", linked)
	}
}

// readEvents reads what the scenario published to the events topic.
func (e *telemetryEnv) readEvents(t *testing.T) []*message.Message {
	t.Helper()
	sub, closeSub, err := e.b.subscriber("tel-reader", "r-1")
	if err != nil {
		t.Fatal(err)
	}
	defer closeSub()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	ch, err := sub.Subscribe(ctx, telEvents)
	if err != nil {
		t.Fatal(err)
	}
	var out []*message.Message
	for len(out) < 8 {
		select {
		case m := <-ch:
			m.Ack()
			out = append(out, m)
		case <-ctx.Done():
			t.Fatalf("read %d messages from %s, want 8", len(out), telEvents)
		}
	}
	return out
}

// checkShippedQueries checks that the Grafana dashboard and the Prometheus alert rules in deploy/
// parse, and that every metric they query is one the Prometheus exporter serves for this scenario.
func (e *telemetryEnv) checkShippedQueries(t *testing.T) {
	t.Helper()
	families, err := e.reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	served := map[string]bool{}
	servedLabels := map[string]map[string]bool{} // metric name -> its label names
	for _, f := range families {
		served[f.GetName()] = true
		ls := map[string]bool{}
		for _, m := range f.GetMetric() {
			for _, l := range m.GetLabel() {
				if l.GetValue() != "" { // Prometheus drops empty labels at ingestion
					ls[l.GetName()] = true
				}
			}
		}
		servedLabels[f.GetName()] = ls
	}
	name := regexp.MustCompile(`\b(?:outbox|messaging)_[a-z0-9_]+`)
	matchers := regexp.MustCompile(`\{[^}]*\}`)
	labels := map[string]bool{}
	for _, k := range []attribute.Key{outbox.AttrConsumer, outbox.AttrTopic, outbox.AttrOutcome, outbox.AttrPath, outbox.AttrKind, outbox.AttrTable, outbox.AttrTables, outbox.AttrMember} {
		labels[strings.ReplaceAll(string(k), ".", "_")] = true
	}
	check := func(file, expr string) {
		for _, n := range name.FindAllString(matchers.ReplaceAllString(expr, ""), -1) {
			if labels[n] {
				continue // a label in by (...) or label_values(...)
			}
			base := n
			for _, suffix := range []string{"_bucket", "_sum", "_count"} {
				if b, ok := strings.CutSuffix(n, suffix); ok && served[b] {
					base = b
				}
			}
			if !served[base] {
				t.Errorf("%s queries %s, which the library does not emit (served: %v)", file, n, slices.Sorted(maps.Keys(served)))
			}
		}
	}

	raw, err := os.ReadFile("../deploy/grafana/outbox-dashboard.json")
	if err != nil {
		t.Fatal(err)
	}
	var dash any
	if err := json.Unmarshal(raw, &dash); err != nil {
		t.Fatalf("dashboard JSON: %v", err)
	}
	exprs := 0
	walk(dash, func(k string, v string) {
		if k == "expr" || k == "query" {
			exprs++
			check("dashboard", v)
		}
	})
	if exprs < 10 {
		t.Errorf("dashboard has %d queries, want a panel for each question", exprs)
	}

	raw, err = os.ReadFile("../deploy/prometheus/outbox-alerts.yaml")
	if err != nil {
		t.Fatal(err)
	}
	var rules struct {
		Groups []struct {
			Name  string
			Rules []struct {
				Alert       string
				Expr        string
				Labels      map[string]string
				Annotations map[string]string
			}
		}
	}
	if err := yaml.Unmarshal(raw, &rules); err != nil {
		t.Fatalf("alert rules YAML: %v", err)
	}
	alerts := 0
	for _, g := range rules.Groups {
		for _, r := range g.Rules {
			alerts++
			if r.Alert == "" || r.Expr == "" || r.Labels["severity"] == "" || r.Annotations["summary"] == "" {
				t.Errorf("alert rule %+v lacks a name, an expression, a severity or a summary", r)
			}
			check("alert "+r.Alert, r.Expr)
		}
	}
	if alerts < 8 {
		t.Errorf("%d alert rules, want at least 8", alerts)
	}

	// The rules' unit tests feed series shaped as the exporter serves them: the same names, and
	// the same labels (beside job and instance, which the scrape adds).
	raw, err = os.ReadFile("../deploy/prometheus/outbox-alerts_test.yaml")
	if err != nil {
		t.Fatal(err)
	}
	var tests struct {
		Tests []struct {
			Name        string
			InputSeries []struct{ Series string } `yaml:"input_series"`
		}
	}
	if err := yaml.Unmarshal(raw, &tests); err != nil {
		t.Fatalf("alert rule tests YAML: %v", err)
	}
	series := regexp.MustCompile(`^([a-z_:][a-z0-9_:]*)\{(.*)\}$`)
	label := regexp.MustCompile(`([a-z_][a-z0-9_]*)="[^"]*"`)
	for _, tc := range tests.Tests {
		for _, in := range tc.InputSeries {
			m := series.FindStringSubmatch(in.Series)
			if m == nil {
				t.Errorf("rule test %q: series %q is not name{labels}", tc.Name, in.Series)
				continue
			}
			if m[1] == "up" {
				continue // Prometheus's own
			}
			have := map[string]bool{}
			for _, l := range label.FindAllStringSubmatch(m[2], -1) {
				have[l[1]] = true
			}
			want := servedLabels[m[1]]
			if !served[m[1]] {
				t.Errorf("rule test %q feeds %s, which the library does not serve", tc.Name, m[1])
				continue
			}
			for l := range want {
				if !have[l] {
					t.Errorf("rule test %q: %s lacks the label %s that the exporter serves (has %v)", tc.Name, m[1], l, slices.Sorted(maps.Keys(have)))
				}
			}
			for l := range have {
				// outbox_member is served by an Outbox with a member name (Config.Member, a
				// tenant.Set's member; TestMetricsCarryTheMember), which this scenario's has not.
				if l != "job" && l != "instance" && l != "outbox_member" && !want[l] {
					t.Errorf("rule test %q: %s has the label %s, which the exporter does not serve (serves %v)", tc.Name, m[1], l, slices.Sorted(maps.Keys(want)))
				}
			}
		}
	}
}

// walk calls fn for every string value in v with its key.
func walk(v any, fn func(k, v string)) {
	switch x := v.(type) {
	case map[string]any:
		for k, c := range x {
			if s, ok := c.(string); ok {
				fn(k, s)
			} else {
				walk(c, fn)
			}
		}
	case []any:
		for _, c := range x {
			walk(c, fn)
		}
	}
}

// TestDeadLetterTelemetry: a dead-lettered message counts with outcome dead_lettered, and the
// gauge of dead letters shows it until it is discarded.
func TestDeadLetterTelemetry(t *testing.T) {
	db := pgtest.DB(t)
	t.Cleanup(func() { _ = db.Close() })
	reader := sdkmetric.NewManualReader()
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
	t.Cleanup(func() { _ = mp.Shutdown(context.Background()) })
	ob, err := outbox.New(outbox.Config{DB: db, Driver: postgres.Driver{}, Publisher: nopPublisher{}, MeterProvider: mp,
		StatsInterval: 50 * time.Millisecond, RelayInterval: 50 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = ob.Close() })
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	if err := ob.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	go func() { defer close(done); _ = ob.Run(ctx) }()
	defer func() { cancel(); <-done }()
	collect := func() metricdata.ResourceMetrics {
		var rm metricdata.ResourceMetrics
		if err := reader.Collect(context.Background(), &rm); err != nil {
			t.Fatal(err)
		}
		return rm
	}
	err = ob.Handle(message.NewMessage("d-1", nil), outbox.HandleParams{Consumer: "tel-dead", MessageID: "d-1", Topic: "orders"},
		func(*message.Message) ([]*message.Message, error) {
			return nil, outbox.Permanent(errors.New("unparsable"))
		})
	if err != nil {
		t.Fatal(err)
	}
	if got := sumInt(t, collect(), outbox.MetricMessagesHandled, map[string]string{"outbox.outcome": outbox.OutcomeDeadLettered}); got != 1 {
		t.Fatalf("%s{outcome=dead_lettered} = %d, want 1", outbox.MetricMessagesHandled, got)
	}
	waitUntil := func(what string, cond func() bool) {
		t.Helper()
		deadline := time.Now().Add(30 * time.Second)
		for !cond() {
			if time.Now().After(deadline) {
				t.Fatalf("timed out waiting for %s", what)
			}
			time.Sleep(20 * time.Millisecond)
		}
	}
	waitUntil("the dead letter in the gauge", func() bool { return gauge(t, collect(), outbox.MetricMessagesDead) == 1 })
	if n, err := ob.DiscardDeadLetters(ctx, "test", outbox.Source{Consumer: "tel-dead", ID: "d-1"}); err != nil || n != 1 {
		t.Fatalf("discard: %d, %v", n, err)
	}
	waitUntil("the discarded dead letter out of the gauge", func() bool { return gauge(t, collect(), outbox.MetricMessagesDead) == 0 })
}
