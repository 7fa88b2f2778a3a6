package outbox

import (
	"context"
	"testing"
	"time"

	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/metric/embedded"

	"github.com/watermill-outbox/outbox/internal/engine"
	"github.com/watermill-outbox/outbox/outboxdriver"
)

// gaugeRecorder is a metric.Observer that keeps the last value observed for each gauge.
type gaugeRecorder struct {
	embedded.Observer
	names  map[metric.Observable]string
	values map[string]float64
}

func (r *gaugeRecorder) ObserveFloat64(o metric.Float64Observable, v float64, opts ...metric.ObserveOption) {
	name := r.names[o]
	set := metric.NewObserveConfig(opts).Attributes()
	if table, ok := set.Value(AttrTable); ok {
		name += "{" + table.AsString() + "}"
	}
	r.values[name] = v
}

func (r *gaugeRecorder) ObserveInt64(o metric.Int64Observable, v int64, _ ...metric.ObserveOption) {
	r.values[r.names[o]] = float64(v)
}

// observeGauges runs the gauges' callback once and returns what it reported, by metric name.
func observeGauges(t *testing.T, tel *telemetry) map[string]float64 {
	t.Helper()
	order := []string{MetricEffectsPending, MetricPendingOldestAge, MetricEffectsParked, MetricParkedOldestAge,
		MetricMessagesFailing, MetricMessagesDead, MetricProcessedRetained, MetricCleanupLag, MetricStatsAge, MetricRelayLastRoundAge, MetricUptime,
		MetricEffectsDelayed, MetricXminHeldAge, MetricXminHeldXacts, MetricTableDeadTuples, MetricDBUnreachableFor}
	if len(order) != len(tel.gauges) {
		t.Fatalf("%d gauges, the test knows %d", len(tel.gauges), len(order))
	}
	r := &gaugeRecorder{names: map[metric.Observable]string{}, values: map[string]float64{}}
	for i, g := range tel.gauges {
		r.names[g] = order[i]
	}
	if err := tel.observe(context.Background(), r); err != nil {
		t.Fatal(err)
	}
	return r.values
}

// Delayed effects not due yet are reported apart: neither the backlog nor its age counts them.
func TestTelemetryDelayedEffectsApart(t *testing.T) {
	tel, err := newTelemetry(&Outbox{cfg: Config{StatsInterval: 15 * time.Second}})
	if err != nil {
		t.Fatal(err)
	}
	tel.setStats(Stats{SampledAt: time.Now(), Delayed: 10_000, DeadLetters: 3})
	got := observeGauges(t, tel)
	if got[MetricEffectsDelayed] != 10_000 || got[MetricEffectsPending] != 0 || got[MetricPendingOldestAge] != 0 {
		t.Errorf("gauges %v: want 10,000 delayed, nothing pending", got)
	}
	if got[MetricMessagesDead] != 3 || got[MetricMessagesFailing] != 0 {
		t.Errorf("gauges %v: want 3 dead letters, not counted as failing", got)
	}
}

// On PostgreSQL the holder of the xmin horizon and the dead tuples of each table are reported;
// with no holder the age is zero (not absent, so that an alert resolves); a stale sample's age
// grows with it. On a database without such a horizon (no Tables) neither is reported.
func TestTelemetryXminHeldAndDeadTuples(t *testing.T) {
	tel, err := newTelemetry(&Outbox{cfg: Config{StatsInterval: 15 * time.Second}})
	if err != nil {
		t.Fatal(err)
	}
	tel.setStats(Stats{SampledAt: time.Now(),
		XminHold: &outboxdriver.XminHold{Holder: outboxdriver.XminBackend, Age: 11 * time.Minute, Transactions: 42_000, PID: 7},
		Tables:   []outboxdriver.TableVacuum{{Table: "effects", DeadTuples: 1_234}, {Table: "processed", DeadTuples: 5}}})
	got := observeGauges(t, tel)
	if got[MetricXminHeldAge] != 660 || got[MetricXminHeldXacts] != 42_000 {
		t.Errorf("gauges %v: want the horizon held 660 s, 42,000 transactions", got)
	}
	if got[MetricTableDeadTuples+"{effects}"] != 1_234 || got[MetricTableDeadTuples+"{processed}"] != 5 {
		t.Errorf("gauges %v: want 1,234 dead tuples in effects and 5 in processed", got)
	}

	tel.setStats(Stats{SampledAt: time.Now(), Tables: []outboxdriver.TableVacuum{{Table: "effects"}}})
	got = observeGauges(t, tel)
	if a, ok := got[MetricXminHeldAge]; !ok || a != 0 {
		t.Errorf("no holder: age %v (reported %v), want 0", a, ok)
	}

	tel.setStats(Stats{SampledAt: time.Now().Add(-10 * time.Minute), Tables: []outboxdriver.TableVacuum{},
		XminHold: &outboxdriver.XminHold{Age: time.Minute}})
	if a := observeGauges(t, tel)[MetricXminHeldAge]; a < 660 || a > 720 {
		t.Errorf("stale sample: held %v s, want the sample's 60 s plus its 600 s age", a)
	}

	tel.setStats(Stats{SampledAt: time.Now(), Pending: 1})
	got = observeGauges(t, tel)
	if _, ok := got[MetricXminHeldAge]; ok {
		t.Errorf("a database with no xmin horizon: gauges %v, want no xmin age", got)
	}
}

// A sample that could not be refreshed (a stalled database, a sampling query that keeps failing)
// must not keep reporting the healthy ages it had: past staleAfter, the oldest pending effect is
// reported as old as the sample at least, and the ages that were not zero grow with it.
func TestTelemetryStaleSampleAges(t *testing.T) {
	tel, err := newTelemetry(&Outbox{cfg: Config{StatsInterval: 15 * time.Second}})
	if err != nil {
		t.Fatal(err)
	}

	fresh := Stats{SampledAt: time.Now().Add(-5 * time.Second), Pending: 3, OldestPending: 2 * time.Second,
		Parked: 1, OldestParked: time.Hour, CleanupLag: 0}
	tel.setStats(fresh)
	got := observeGauges(t, tel)
	if got[MetricPendingOldestAge] != 2 || got[MetricParkedOldestAge] != 3600 || got[MetricCleanupLag] != 0 {
		t.Errorf("fresh sample: ages %v, want the sample's own (2 s, 3600 s, 0)", got)
	}
	if got[MetricUptime] < 0 || got[MetricUptime] > 60 {
		t.Errorf("uptime %v s, want the seconds since newTelemetry", got[MetricUptime])
	}

	// A database that stalled 10 minutes ago with nothing pending then: nothing is known of what
	// was committed since, so a healthy zero is no longer reported.
	tel.setStats(Stats{SampledAt: time.Now().Add(-10 * time.Minute)})
	got = observeGauges(t, tel)
	if a := got[MetricPendingOldestAge]; a < 600 || a > 660 {
		t.Errorf("stale sample (10 min) with nothing pending: oldest pending age %v s, want about 600", a)
	}
	if got[MetricParkedOldestAge] != 0 || got[MetricCleanupLag] != 0 {
		t.Errorf("stale sample with nothing parked and no cleanup lag: parked age %v, cleanup lag %v, want 0",
			got[MetricParkedOldestAge], got[MetricCleanupLag])
	}

	stale := fresh
	stale.SampledAt = time.Now().Add(-10 * time.Minute)
	stale.CleanupLag = time.Minute
	tel.setStats(stale)
	got = observeGauges(t, tel)
	if a := got[MetricPendingOldestAge]; a < 602 || a > 662 {
		t.Errorf("stale sample: oldest pending age %v s, want the sample's 2 s plus its 600 s age", a)
	}
	if a := got[MetricParkedOldestAge]; a < 4200 || a > 4260 {
		t.Errorf("stale sample: oldest parked age %v s, want 3600 + 600", a)
	}
	if a := got[MetricCleanupLag]; a < 660 || a > 720 {
		t.Errorf("stale sample: cleanup lag %v s, want 60 + 600", a)
	}
	if a := got[MetricStatsAge]; a < 600 {
		t.Errorf("stats age %v s, want the sample's age", a)
	}
}

// An idle member's sampling backs off (up to statsIdleMax): its last sample, minutes old, is not
// stale while the next is not yet due, so its gauges do not age an empty backlog. A sample that
// fails ends that: the sample is then stale staleAfter after it was taken, as any other.
func TestTelemetryIdleSampleStaleLater(t *testing.T) {
	tel, err := newTelemetry(&Outbox{cfg: Config{StatsInterval: 15 * time.Second}})
	if err != nil {
		t.Fatal(err)
	}
	tel.setStatsIdleMax(statsIdleMax(15*time.Second, 30*time.Second), 0)
	tel.setSample(Stats{SampledAt: time.Now().Add(-140 * time.Second)}, true)
	if a := observeGauges(t, tel)[MetricPendingOldestAge]; a != 0 {
		t.Errorf("idle sample 140 s old, next due up to 150 s after it: oldest pending age %v s, want 0", a)
	}
	tel.statsFailed()
	if a := observeGauges(t, tel)[MetricPendingOldestAge]; a < 140 {
		t.Errorf("idle sample 140 s old, and the sample after it failed: oldest pending age %v s, want its age (140 s)", a)
	}
	tel.setSample(Stats{SampledAt: time.Now().Add(-240 * time.Second)}, true)
	if a := observeGauges(t, tel)[MetricPendingOldestAge]; a < 240 {
		t.Errorf("idle sample 240 s old, past the backoff (150 s) and a minute: oldest pending age %v s, want its age", a)
	}
	tel.setSample(Stats{SampledAt: time.Now().Add(-100 * time.Second)}, false)
	if a := observeGauges(t, tel)[MetricPendingOldestAge]; a < 100 {
		t.Errorf("a sample that found work, 100 s old: oldest pending age %v s, want its age (stale after a minute)", a)
	}
	if d := statsIdleMax(15*time.Second, 0); d != 0 {
		t.Errorf("statsIdleMax without a backoff: %v, want 0", d)
	}
	if d := statsIdleMax(time.Minute, 30*time.Second); d != engine.StatsMaxGap {
		t.Errorf("statsIdleMax(1m, 30s) = %v, want the cap %v (ten minutes would trip OutboxStatsStale)", d, engine.StatsMaxGap)
	}
}

// A Set's member whose samples a budget shared with the other members may hold up to its
// MaxGap: a sample that found work, 100 s old, is not stale while the next may be held that long
// (the gauges would otherwise age the backlog of every busy member of a large Set); past the
// gap and a minute it is.
func TestTelemetryBudgetedSampleStaleAfterTheGap(t *testing.T) {
	tel, err := newTelemetry(&Outbox{cfg: Config{StatsInterval: 15 * time.Second}})
	if err != nil {
		t.Fatal(err)
	}
	tel.setStatsIdleMax(statsIdleMax(15*time.Second, 30*time.Second), engine.StatsMaxGap)
	tel.setSample(Stats{SampledAt: time.Now().Add(-100 * time.Second)}, false)
	if a := observeGauges(t, tel)[MetricPendingOldestAge]; a != 0 {
		t.Errorf("busy sample 100 s old, the next held up to 150 s: oldest pending age %v s, want 0", a)
	}
	tel.setSample(Stats{SampledAt: time.Now().Add(-240 * time.Second)}, false)
	if a := observeGauges(t, tel)[MetricPendingOldestAge]; a < 240 {
		t.Errorf("busy sample 240 s old, past the gap (150 s) and a minute: oldest pending age %v s, want its age", a)
	}
}

// A relay that an engine backs off while idle (a tenant.Set's IdleMax) is not reported stuck
// between two rounds IdleMax apart; under Run, the same gap is.
func TestRelayHealthAllowsTheEnginesIdleBackoff(t *testing.T) {
	o := &Outbox{cfg: Config{RelayInterval: time.Second, PublishTimeout: 30 * time.Second}}
	o.relaysRunning.Add(1)
	o.tel = &telemetry{created: time.Now().Add(-time.Hour)}
	ago := func(d time.Duration) int64 { return int64(time.Since(o.tel.created)-d) + 1 } // a stamp
	o.tel.relayStarted.Store(ago(50 * time.Minute))
	o.tel.lastRelayRound.Store(ago(4 * time.Minute))
	if err := o.relayHealth(); err == nil {
		t.Error("a relay under Run whose last round was 4 minutes ago is reported healthy")
	}
	o.relayIdleMax.Store(int64(5 * time.Minute))
	if err := o.relayHealth(); err != nil {
		t.Errorf("a relay backed off to 5 minutes while idle, its last round 4 minutes ago: %v", err)
	}
	o.tel.lastRelayRound.Store(ago(10 * time.Minute))
	if err := o.relayHealth(); err == nil {
		t.Error("a relay backed off to 5 minutes, its last round 10 minutes ago, is reported healthy")
	}
}

// An Outbox removed from a Set and added again under another name has its metrics named anew;
// Config.Member stays whatever a Set calls it.
func TestMetricsTakeTheMembersNewName(t *testing.T) {
	tel, err := newTelemetry(&Outbox{cfg: Config{StatsInterval: 15 * time.Second}})
	if err != nil {
		t.Fatal(err)
	}
	tel.nameMember("acme")
	tel.nameMember("acme-eu")
	if got := tel.memberName(); got != "acme-eu" {
		t.Errorf("metrics of a member added again as acme-eu are named %q", got)
	}
	fixed, err := newTelemetry(&Outbox{cfg: Config{StatsInterval: 15 * time.Second, Member: "configured"}})
	if err != nil {
		t.Fatal(err)
	}
	fixed.nameMember("acme")
	if got := fixed.memberName(); got != "configured" {
		t.Errorf("metrics of an Outbox with Config.Member %q are named %q once a Set ran it", "configured", got)
	}
}

// A relay that started and has not finished a round, and a sampling that has not sampled since
// (a process started while the effects table is locked), are as old as their start: the gauges
// were not reported at all, and OutboxRelayStalled and OutboxStatsStale could not fire.
func TestGaugesOfARelayThatFinishedNoRound(t *testing.T) {
	o := &Outbox{cfg: Config{StatsInterval: 15 * time.Second}}
	tel, err := newTelemetry(o)
	if err != nil {
		t.Fatal(err)
	}
	o.tel = tel
	tel.created = time.Now().Add(-time.Hour)
	o.relaysRunning.Add(1)
	tel.relayStarted.Store(int64(50*time.Minute) + 1) // 10 minutes ago
	got := observeGauges(t, tel)
	for _, name := range []string{MetricRelayLastRoundAge, MetricStatsAge} {
		if v, ok := got[name]; !ok || v < 599 || v > 700 {
			t.Errorf("%s: %v (reported: %v), want about 600 s, the time since the relay started", name, v, ok)
		}
	}
}
