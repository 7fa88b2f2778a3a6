package outbox

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"time"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"
)

// InstrumentationName is the name of the meter and the tracer the framework uses.
const InstrumentationName = "github.com/watermill-outbox/outbox"

// Names of the metrics the framework emits (OpenTelemetry instrument names; a Prometheus
// exporter turns the dots into underscores and appends the unit and, for counters, "_total").
// docs/observability.md says what each means and what to do when it moves.
const (
	MetricProcessDuration   = "messaging.process.duration"       // histogram, s: one unit of work, claim to ack
	MetricMessagesHandled   = "outbox.messages.handled"          // counter: incoming messages by consumer and outcome
	MetricEffectsDispatched = "outbox.effects.dispatched"        // counter: side effects sent, by path and kind
	MetricDispatchFailures  = "outbox.effects.dispatch_failures" // counter: side effects whose dispatch failed
	MetricDispatchLag       = "outbox.effects.dispatch_lag"      // histogram, s: commit to dispatch
	MetricEffectsPending    = "outbox.effects.pending"           // gauge: undispatched, not parked
	MetricPendingOldestAge  = "outbox.effects.pending.oldest_age"
	MetricEffectsParked     = "outbox.effects.parked"
	MetricParkedOldestAge   = "outbox.effects.parked.oldest_age"
	MetricMessagesFailing   = "outbox.messages.failing" // gauge: failed attempts, not yet poisoned
	MetricMessagesDead      = "outbox.messages.dead"    // gauge: dead letters not retried or discarded
	MetricProcessedRetained = "outbox.processed.retained"
	MetricCleanupLag        = "outbox.cleanup.lag"          // gauge, s: oldest claim past retention
	MetricStatsAge          = "outbox.stats.age"            // gauge, s: age of the sample the gauges above show
	MetricRelayRounds       = "outbox.relay.rounds"         // counter
	MetricRelayRoundEffects = "outbox.relay.round.effects"  // histogram: effects per round that found some
	MetricRelayErrors       = "outbox.relay.errors"         // counter
	MetricCleanupBatches    = "outbox.cleanup.batches"      // counter
	MetricCleanupDeleted    = "outbox.cleanup.deleted"      // counter: rows, by table
	MetricDuplicateClaimAge = "outbox.duplicate.claim_age"  // histogram, s: age of the claim a duplicate finds
	MetricDuplicatesLate    = "outbox.duplicates.late"      // counter: duplicates whose claim is older than Retention/2
	MetricMarkFailures      = "outbox.marks.failures"       // counter: batches of dispatched marks that could not be written
	MetricRelayLastRoundAge = "outbox.relay.last_round_age" // gauge, s: since this process's relay last finished a round
	MetricRelayRunning      = "outbox.relay.running"        // gauge: 1 while this process runs the Outbox's relay, 0 while it holds the Outbox and runs none
	MetricBoundaryUnits     = "outbox.boundary.units"       // counter: InTx and InUnit units of work, by outcome
	MetricCleanupErrors     = "outbox.cleanup.errors"       // counter: cleanup passes that failed
	MetricUptime            = "outbox.uptime"               // gauge, s: since this Outbox was created
	MetricListenerDeaf      = "outbox.listener.deaf"        // counter: listeners that LISTENed but did not receive their own notification
	MetricEffectsDelayed    = "outbox.effects.delayed"      // gauge: delayed effects not yet due (no backlog)
	MetricDelayedPromoted   = "outbox.effects.delayed.due"  // counter: delayed effects the relay made pending once due
	MetricEffectsSpilled    = "outbox.effects.spilled"      // counter: units of work that moved the effects kept in their claim to rows
	MetricXminHeldAge       = "outbox.db.xmin_held_age"     // gauge, s: how long the oldest holder of the xmin horizon has held it (PostgreSQL)
	MetricXminHeldXacts     = "outbox.db.xmin_held_xacts"   // gauge: transactions begun since the xmin horizon held (PostgreSQL)
	MetricTableDeadTuples   = "outbox.table.dead_tuples"    // gauge: dead row versions of an outbox table, by table (PostgreSQL)
	// MetricDBUnreachable counts the connection attempts that found the database unreachable;
	// MetricDBUnreachableFor is how long it has been (0 while it is reachable).
	MetricDBUnreachable    = "outbox.db.unreachable_attempts"
	MetricDBUnreachableFor = "outbox.db.unreachable_for"
)

// Attribute keys. Consumer and topic names are bounded by the application; message IDs are never
// attributes.
const (
	AttrConsumer = attribute.Key("messaging.consumer.group.name")
	AttrTopic    = attribute.Key("messaging.destination.name")
	AttrOutcome  = attribute.Key("outbox.outcome")
	AttrPath     = attribute.Key("outbox.dispatch.path")
	AttrKind     = attribute.Key("outbox.effect.kind")
	AttrTable    = attribute.Key("outbox.table")
	AttrErrType  = attribute.Key("error.type")
	// AttrTables names the outbox tables ("schema.prefix") a gauge was sampled from, so that
	// Outboxes of different tables can share one MeterProvider.
	AttrTables = attribute.Key("outbox.tables")
	// AttrMember names the Outbox (Config.Member, or its tenant.Set member name) on every metric
	// it reports, so that Outboxes of several databases with the same tables can share one
	// MeterProvider. Absent when the Outbox has no member name.
	AttrMember = attribute.Key("outbox.member")
)

// Outcomes of a unit of work (AttrOutcome).
const (
	OutcomeProcessed      = "processed"       // the handler ran, committed, and its effects went out
	OutcomeDuplicate      = "duplicate"       // processed before: the handler was skipped
	OutcomeFailed         = "failed"          // nacked: the handler failed, or the unit of work could not finish
	OutcomeDispatchFailed = "dispatch_failed" // committed, but its effects are left to a retry
	OutcomePoisoned       = "poisoned"        // moved to the poison topic after MaxAttempts
	OutcomeRejected       = "rejected"        // unusable message ID: dead-lettered or poison topic at once, or nacked
	OutcomeDeadLettered   = "dead_lettered"   // stored as a dead letter and acked (Config.DeadLetters)
	OutcomeNotAddressed   = "not_addressed"   // another consumer's retried dead letter (MetadataRetryFor): acked, the handler skipped
)

// Outcomes of a unit of work at the boundary (InTx, InUnit), beside OutcomeDispatchFailed.
const (
	OutcomeCommitted  = "committed"   // committed, and its effects went out
	OutcomeRolledBack = "rolled_back" // fn returned an error or panicked: rolled back, nothing sent
	OutcomeReplayed   = "replayed"    // keyed: the key was committed before, fn did not run
	// OutcomeKeyConflict: keyed, fn did not run: the key is in flight in another unit of work, or
	// was committed with another request fingerprint.
	OutcomeKeyConflict = "key_conflict"
	// OutcomeFailed (above) at the boundary: the transaction could not begin or commit, the
	// effects could not be stored, or the unit's context ended (its caller gave up, or
	// HandlerTimeout) before it finished; InTx returned the error.
)

// Dispatch paths (AttrPath).
const (
	PathCommit     = "commit"     // right after the commit, from memory (InTx and JoinTx too)
	PathRedelivery = "redelivery" // by a redelivered copy of a processed message
	PathRelay      = "relay"      // by the relay
)

// kindName names an effect's kind for the metrics: "publish", or the applier's name.
func kindName(kind string) string {
	if kind == KindPublish {
		return "publish"
	}
	return kind
}

// attrKey identifies a cached attribute set of the member and one or two attributes.
type attrKey struct {
	member, k1, v1, k2, v2 string
}

// attrs returns the measurement option of the attributes k1=v1 (unless k1 is empty) and k2=v2
// (unless k2 is empty), with the Outbox's member name when it has one, built once: their values
// are member and consumer names, outcomes, paths, kinds and tables, a bounded set.
func (t *telemetry) attrs(k1 attribute.Key, v1 string, k2 attribute.Key, v2 string) metric.MeasurementOption {
	member := t.memberName()
	key := attrKey{member, string(k1), v1, string(k2), v2}
	if opt, ok := t.attrSets.Load(key); ok {
		return opt.(metric.MeasurementOption)
	}
	kvs := make([]attribute.KeyValue, 0, 3)
	if member != "" {
		kvs = append(kvs, AttrMember.String(member))
	}
	if k1 != "" {
		kvs = append(kvs, k1.String(v1))
	}
	if k2 != "" {
		kvs = append(kvs, k2.String(v2))
	}
	opt, _ := t.attrSets.LoadOrStore(key, metric.WithAttributeSet(attribute.NewSet(kvs...)))
	return opt.(metric.MeasurementOption)
}

// own is the measurement option of a metric with no attribute of its own: the member name alone.
func (t *telemetry) own() metric.MeasurementOption { return t.attrs("", "", "", "") }

// memberName is the member name the metrics carry ("" for none).
func (t *telemetry) memberName() string {
	if m := t.member.Load(); m != nil {
		return *m
	}
	return ""
}

// nameMember names the Outbox's metrics after member from now on, when Config.Member named
// none, and starts its counters at zero under that name. An Outbox removed from a Set and added
// again under another name is named anew: set once, its metrics kept the first name while its
// health and the console said the second.
func (t *telemetry) nameMember(member string) {
	if member == "" || t.memberFixed {
		return
	}
	if old := t.member.Load(); old != nil && *old == member {
		return
	}
	t.member.Store(&member)
	t.startCounters(context.Background())
	t.consumers.Range(func(c, _ any) bool {
		t.startConsumerCounters(context.Background(), c.(string))
		return true
	})
}

// telemetry holds the framework's instruments. With the default (global, no-op until the
// application installs an SDK) providers every call is a no-op.
type telemetry struct {
	tracer trace.Tracer
	prop   propagation.TextMapPropagator

	processDuration  metric.Float64Histogram
	handled          metric.Int64Counter
	dispatched       metric.Int64Counter
	dispatchFailures metric.Int64Counter
	dispatchLag      metric.Float64Histogram
	relayRounds      metric.Int64Counter
	relayEffects     metric.Int64Histogram
	relayErrors      metric.Int64Counter
	cleanupBatches   metric.Int64Counter
	cleanupDeleted   metric.Int64Counter
	duplicateAge     metric.Float64Histogram
	duplicatesLate   metric.Int64Counter
	markFailures     metric.Int64Counter
	boundaryUnits    metric.Int64Counter
	cleanupErrors    metric.Int64Counter
	listenerDeaf     metric.Int64Counter
	delayedPromoted  metric.Int64Counter
	spills           metric.Int64Counter
	dbUnreachable    metric.Int64Counter

	attrSets sync.Map // attrKey -> metric.MeasurementOption
	// member is the name on every metric (AttrMember): Config.Member (memberFixed), else the
	// name a tenant.Set runs the Outbox under (nameMember); nil: none.
	member      atomic.Pointer[string]
	memberFixed bool
	// kinds are the effect kinds whose dispatch counters were started at zero (startKind).
	kinds sync.Map

	// The gauges are observed only while Run runs (it samples what they report): Run registers
	// observe for them and unregisters it when it returns, so that an Outbox that stopped
	// neither reports a stale sample nor stays referenced by the MeterProvider.
	meter   metric.Meter
	gauges  []metric.Observable
	observe metric.Callback
	// relayRunning is reported from New until Close, apart from the gauges above (see
	// Outbox.reportPresence); tablesName is the tables' name the gauges carry.
	relayRunning metric.Int64ObservableGauge
	tablesName   string
	// consumers holds the consumers whose per-outcome counters were started at zero.
	consumers sync.Map

	// stats is the last sample of the database gauges (see Outbox.sampleStats).
	statsMu sync.Mutex
	stats   *Stats
	// lastRelayRound is when this process's relay last finished a round, and relayStarted when
	// it last started (a Run, or a Set's engine, while none ran): stamps (0: never).
	lastRelayRound atomic.Int64
	relayStarted   atomic.Int64
	// relayFailing is the relay's current streak of rounds that failed to claim (the database
	// refused or did not answer), nil once one succeeds.
	relayFailing atomic.Pointer[relayStreak]
	// listening tells whether the relay's notification listener is connected.
	listening atomic.Bool
	// listenUnsupported: the store cannot listen (SQLite); the relay polls.
	listenUnsupported atomic.Bool
	// listenDeaf is why the last listener received no notification (ErrListenerDeaf), until one
	// connects that does; deafWarned lets that be logged once every ten minutes.
	listenDeaf atomic.Pointer[string]
	deafWarned oncePer
	// lateWarned lets a late duplicate be logged once a minute.
	lateWarned oncePer
	// created is when the Outbox was created (outbox.uptime).
	created time.Time
	// staleAfter is the age past which the database sample is stale: the age gauges then add
	// the time since the sample (see observe).
	staleAfter time.Duration
	// statsIdleMax is how far the sampling backs off while its samples are idle (0: not at all),
	// and statsIdle whether the last one was (statsMu): the next sample of an idle member may
	// come statsIdleMax after it, so that sample is stale only staleAfter later than that.
	statsIdleMax time.Duration
	statsIdle    bool
	// statsMaxGap, when not zero, is how long after a sample the next may come while a budget
	// shared with other members holds it (a Set's): busy or idle, the sample is stale only
	// staleAfter later than that.
	statsMaxGap time.Duration
}

// Bucket boundaries, in seconds.
var (
	durationBuckets = []float64{0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60}
	lagBuckets      = []float64{0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 10, 30, 60, 300, 1800, 3600, 21600, 86400}
	claimAgeBuckets = []float64{0.01, 0.1, 1, 10, 60, 600, 3600, 6 * 3600, 86400, 3 * 86400, 7 * 86400, 14 * 86400, 30 * 86400}
	roundBuckets    = []float64{1, 2, 5, 10, 20, 50, 100, 200, 500, 1000}
)

func newTelemetry(o *Outbox) (*telemetry, error) {
	mp, tp := o.cfg.MeterProvider, o.cfg.TracerProvider
	if mp == nil {
		mp = otel.GetMeterProvider()
	}
	if tp == nil {
		tp = otel.GetTracerProvider()
	}
	t := &telemetry{
		tracer:     tp.Tracer(InstrumentationName),
		prop:       propagation.TraceContext{},
		created:    time.Now(),
		staleAfter: staleAfter(o.cfg.StatsInterval),
	}
	m := mp.Meter(InstrumentationName)
	var errs []error
	f64h := func(name, unit, desc string, buckets []float64) metric.Float64Histogram {
		h, err := m.Float64Histogram(name, metric.WithUnit(unit), metric.WithDescription(desc), metric.WithExplicitBucketBoundaries(buckets...))
		errs = append(errs, err)
		return h
	}
	i64c := func(name, unit, desc string) metric.Int64Counter {
		c, err := m.Int64Counter(name, metric.WithUnit(unit), metric.WithDescription(desc))
		errs = append(errs, err)
		return c
	}
	t.processDuration = f64h(MetricProcessDuration, "s", "Duration of one unit of work of an incoming message, from the claim to the ack or nack.", durationBuckets)
	t.handled = i64c(MetricMessagesHandled, "{message}", "Incoming messages handled, by consumer and outcome.")
	t.dispatched = i64c(MetricEffectsDispatched, "{effect}", "Side effects dispatched, by path and kind.")
	t.dispatchFailures = i64c(MetricDispatchFailures, "{effect}", "Side effects whose dispatch failed, by path and kind; they stay pending and are retried.")
	t.dispatchLag = f64h(MetricDispatchLag, "s", "Time from the commit that stored a side effect to its dispatch, by path.", lagBuckets)
	t.relayRounds = i64c(MetricRelayRounds, "{round}", "Relay rounds that claimed side effects.")
	var err error
	t.relayEffects, err = m.Int64Histogram(MetricRelayRoundEffects, metric.WithUnit("{effect}"),
		metric.WithDescription("Side effects claimed per relay round."), metric.WithExplicitBucketBoundaries(roundBuckets...))
	errs = append(errs, err)
	t.relayErrors = i64c(MetricRelayErrors, "{error}", "Relay rounds that failed (the database could not be asked).")
	t.cleanupBatches = i64c(MetricCleanupBatches, "{batch}", "Cleanup batches run.")
	t.cleanupDeleted = i64c(MetricCleanupDeleted, "{row}", "Rows deleted by cleanup, by table (processed, dispatched, attempts, idempotency, dead_letters).")
	t.duplicateAge = f64h(MetricDuplicateClaimAge, "s", "Age of the claim a duplicate delivery finds: how late duplicates come, by consumer.", claimAgeBuckets)
	t.duplicatesLate = i64c(MetricDuplicatesLate, "{message}", "Duplicates whose claim was older than half of Retention: the broker redelivers close to the end of the dedup window.")
	t.markFailures = i64c(MetricMarkFailures, "{batch}", "Batches of dispatched marks that could not be written; their effects may be sent again.")
	t.boundaryUnits = i64c(MetricBoundaryUnits, "{unit}", "Units of work at the boundary (InTx, InUnit), by outcome: committed, dispatch_failed, rolled_back, failed, replayed, key_conflict.")
	t.cleanupErrors = i64c(MetricCleanupErrors, "{error}", "Cleanup passes that failed (the database refused or timed out).")
	t.delayedPromoted = i64c(MetricDelayedPromoted, "{effect}", "Delayed side effects the relay made pending once due (then sent as any other).")
	t.spills = i64c(MetricEffectsSpilled, "{unit}", "Units of work of the database/sql form on PostgreSQL that moved the side effects kept in their claim to effect rows, past the cost of rewriting them (record many messages in one Publish call).")
	t.listenerDeaf = i64c(MetricListenerDeaf, "{listener}", "Relay listeners that LISTENed but did not receive a notification of their own (a pooler in transaction mode): the relay polls.")
	t.dbUnreachable = i64c(MetricDBUnreachable, "{attempt}", "Connection attempts (of units of work, background statements and probes) that found the database unreachable: refused, not found, timed out, starting up, shutting down or full. The Outboxes of one pool share their gate, and each member name counts every attempt of the pool once.")

	gauge := func(name, unit, desc string) metric.Float64ObservableGauge {
		g, err := m.Float64ObservableGauge(name, metric.WithUnit(unit), metric.WithDescription(desc))
		errs = append(errs, err)
		return g
	}
	pending := gauge(MetricEffectsPending, "{effect}", "Side effects committed and not yet dispatched (parked ones not included).")
	pendingAge := gauge(MetricPendingOldestAge, "s", "Age of the oldest pending side effect.")
	parked := gauge(MetricEffectsParked, "{effect}", "Side effects the relay gave up on; an operator must retry or discard them.")
	parkedAge := gauge(MetricParkedOldestAge, "s", "Age of the oldest parked side effect.")
	failing := gauge(MetricMessagesFailing, "{message}", "Messages with failed attempts that are not yet poisoned.")
	dead := gauge(MetricMessagesDead, "{message}", "Dead letters neither retried nor discarded: messages a consumer gave up on, which wait for a person.")
	retained := gauge(MetricProcessedRetained, "{message}", "Processed message IDs retained for deduplication (estimated above 100,000).")
	cleanupLag := gauge(MetricCleanupLag, "s", "How long the oldest claim past retention has waited for cleanup.")
	statsAge := gauge(MetricStatsAge, "s", "Age of the database sample the outbox gauges show.")
	relayAge := gauge(MetricRelayLastRoundAge, "s", "Time since this process's relay last finished a round.")
	uptime := gauge(MetricUptime, "s", "Time since this Outbox was created: its counters count from then.")
	delayed := gauge(MetricEffectsDelayed, "{effect}", "Delayed side effects committed and not yet due: no backlog (once due they count as pending).")
	xminAge := gauge(MetricXminHeldAge, "s", "How long the oldest holder of the xmin horizon the service's role can see (a transaction, a replication slot, a prepared transaction) has held it: nothing deleted since can be vacuumed.")
	xminXacts := gauge(MetricXminHeldXacts, "{transaction}", "Transactions begun since the oldest xmin horizon the service's role can see was held.")
	deadTuples := gauge(MetricTableDeadTuples, "{row}", "Dead row versions of an outbox table not yet vacuumed, by table.")
	unreachableFor := gauge(MetricDBUnreachableFor, "s", "How long the database has been unreachable (0 while it is reachable): work on it waits for a probe meanwhile.")
	t.relayRunning, err = m.Int64ObservableGauge(MetricRelayRunning, metric.WithUnit("{relay}"),
		metric.WithDescription("1 while this process runs the Outbox's relay (Run, or a tenant.Set), 0 while it holds the Outbox and runs none; reported from outbox.New until Close or Retire (a removal from its tenant.Set)."))
	errs = append(errs, err)
	t.gauges = []metric.Observable{pending, pendingAge, parked, parkedAge, failing, dead, retained, cleanupLag, statsAge, relayAge, uptime, delayed, xminAge, xminXacts, deadTuples, unreachableFor}
	tablesName := o.cfg.TablePrefix
	if o.cfg.Schema != "" {
		tablesName = o.cfg.Schema + "." + tablesName
	}
	t.tablesName = tablesName
	t.observe = func(_ context.Context, obs metric.Observer) error {
		opt := t.attrs(AttrTables, tablesName, "", "")
		obs.ObserveFloat64(uptime, time.Since(t.created).Seconds(), opt)
		var down time.Duration
		if out, ok := o.gate.outage(); ok {
			down = time.Since(out.Since)
		}
		obs.ObserveFloat64(unreachableFor, down.Seconds(), opt)
		if d, ok := t.sinceRelayRound(o.relaysRunning.Load() > 0); ok {
			obs.ObserveFloat64(relayAge, d.Seconds(), opt)
		}
		s := t.lastStats()
		if s == nil {
			if started := t.relayStarted.Load(); started != 0 && o.cfg.StatsInterval > 0 && o.relaysRunning.Load() > 0 {
				// Sampling runs and has not sampled since the start: as old as the start, so
				// that a process started while the database cannot be sampled shows it.
				obs.ObserveFloat64(statsAge, t.since(started).Seconds(), opt)
			}
			return nil
		}
		age := time.Since(s.SampledAt)
		oldestPending, oldestParked, cleanupBehind := t.aged(*s, age)
		obs.ObserveFloat64(pending, float64(s.Pending), opt)
		obs.ObserveFloat64(pendingAge, oldestPending.Seconds(), opt)
		obs.ObserveFloat64(parked, float64(s.Parked), opt)
		obs.ObserveFloat64(parkedAge, oldestParked.Seconds(), opt)
		obs.ObserveFloat64(failing, float64(s.Failing), opt)
		obs.ObserveFloat64(dead, float64(s.DeadLetters), opt)
		obs.ObserveFloat64(retained, float64(s.Retained), opt)
		obs.ObserveFloat64(cleanupLag, cleanupBehind.Seconds(), opt)
		obs.ObserveFloat64(statsAge, age.Seconds(), opt)
		obs.ObserveFloat64(delayed, float64(s.Delayed), opt)
		if s.Tables != nil { // PostgreSQL's: the other databases have no such horizon
			var held time.Duration
			var xacts int64
			if h := s.XminHold; h != nil {
				held, xacts = h.Age, h.Transactions
				if age > t.staleAge() { // a stall must not hold the age at a healthy value
					held += age
				}
			}
			obs.ObserveFloat64(xminAge, held.Seconds(), opt)
			obs.ObserveFloat64(xminXacts, float64(xacts), opt)
			for _, tv := range s.Tables {
				obs.ObserveFloat64(deadTuples, float64(tv.DeadTuples), t.attrs(AttrTables, tablesName, AttrTable, tv.Table))
			}
		}
		return nil
	}
	t.meter = m
	if err := errors.Join(errs...); err != nil {
		return nil, err
	}
	// Counters without attributes start at zero, so that rate() and increase() over them work
	// (and alerts on them can fire) from the first failure, not the second.
	// The same holds for the series with attributes that the dashboard and the alerts read before
	// anything went wrong: the boundary's outcomes, cleanup's tables, and the dispatches of
	// publishes on every path (appliers' kinds start when they are registered).
	if o.cfg.Member != "" {
		t.member.Store(&o.cfg.Member)
		t.memberFixed = true
	}
	t.startCounters(context.Background())
	t.startKind(context.Background(), kindName(KindPublish))
	return t, nil
}

// startCounters starts the counters read before anything went wrong at zero, under the member
// name the metrics carry now.
func (t *telemetry) startCounters(ctx context.Context) {
	for _, c := range []metric.Int64Counter{t.relayRounds, t.relayErrors, t.cleanupBatches, t.markFailures, t.cleanupErrors, t.listenerDeaf, t.delayedPromoted, t.spills, t.dbUnreachable} {
		c.Add(ctx, 0, t.own())
	}
	for _, outcome := range []string{OutcomeCommitted, OutcomeDispatchFailed, OutcomeRolledBack, OutcomeFailed, OutcomeReplayed, OutcomeKeyConflict} {
		t.boundaryUnits.Add(ctx, 0, t.attrs(AttrOutcome, outcome, "", ""))
	}
	for _, table := range []string{"processed", "dispatched", "attempts", "idempotency", "dead_letters"} {
		t.cleanupDeleted.Add(ctx, 0, t.attrs(AttrTable, table, "", ""))
	}
	t.kinds.Range(func(k, _ any) bool {
		t.startKindCounters(ctx, k.(string))
		return true
	})
}

// staleAfter is the age past which a database sample taken every interval is stale: three
// samples missed (a stalled database, a sampling query that keeps failing), and at least a
// minute, so that one slow sample does not count.
func staleAfter(interval time.Duration) time.Duration {
	return max(3*interval, time.Minute)
}

// aged returns the ages the gauges report from sample s, taken age ago. While the sample is
// fresh they are the sample's. Once it is stale, nothing tells that what was pending then was
// sent since, nor that nothing older piled up: the oldest pending effect is reported as old as
// the sample at least (the sample's oldest plus the time since), so that a stall of the database
// or of sampling does not hold the age gauges, and the alerts on them, at a healthy value. The
// parked age and the cleanup lag, when not zero, age with time too.
func (t *telemetry) aged(s Stats, age time.Duration) (oldestPending, oldestParked, cleanupLag time.Duration) {
	oldestPending, oldestParked, cleanupLag = s.OldestPending, s.OldestParked, s.CleanupLag
	if age <= t.staleAge() {
		return
	}
	oldestPending = max(oldestPending+age, age)
	if s.Parked > 0 {
		oldestParked += age
	}
	if cleanupLag > 0 {
		cleanupLag += age
	}
	return
}

// startKind starts the dispatch counters of effect kind at zero on every path, so that a
// dispatch failure of a kind shows (and can be alerted on) from its first.
func (t *telemetry) startKind(ctx context.Context, kind string) {
	t.kinds.Store(kind, true)
	t.startKindCounters(ctx, kind)
}

func (t *telemetry) startKindCounters(ctx context.Context, kind string) {
	for _, path := range []string{PathCommit, PathRedelivery, PathRelay} {
		set := t.attrs(AttrPath, path, AttrKind, kind)
		t.dispatched.Add(ctx, 0, set)
		t.dispatchFailures.Add(ctx, 0, set)
	}
}

// registerGauges starts observing the gauges; call the returned function to stop.
func (t *telemetry) registerGauges() (func(), error) {
	reg, err := t.meter.RegisterCallback(t.observe, t.gauges...)
	if err != nil {
		return nil, err
	}
	return func() { _ = reg.Unregister() }, nil
}

// startConsumer starts the per-outcome counters of consumer at zero the first time it is seen,
// so that rate() and increase() over them (and the alerts on them) see the first increment.
func (t *telemetry) startConsumer(ctx context.Context, consumer string) {
	if _, seen := t.consumers.Load(consumer); seen {
		return
	}
	if _, seen := t.consumers.LoadOrStore(consumer, true); seen {
		return
	}
	t.startConsumerCounters(ctx, consumer)
}

func (t *telemetry) startConsumerCounters(ctx context.Context, consumer string) {
	for _, outcome := range []string{OutcomeProcessed, OutcomeDuplicate, OutcomeFailed, OutcomeDispatchFailed, OutcomePoisoned, OutcomeRejected, OutcomeDeadLettered, OutcomeNotAddressed} {
		t.handled.Add(ctx, 0, t.attrs(AttrConsumer, consumer, AttrOutcome, outcome))
	}
	t.duplicatesLate.Add(ctx, 0, t.attrs(AttrConsumer, consumer, "", ""))
}

// stamp is now as lastRelayRound and relayStarted keep it: the time since the telemetry was made,
// by the monotonic clock (a wall clock stepped back made a stuck relay look fresh), plus one, so
// that 0 stays "never".
func (t *telemetry) stamp() int64 { return int64(time.Since(t.created)) + 1 }

// since is how long ago a stamp was.
func (t *telemetry) since(stamp int64) time.Duration {
	return time.Since(t.created) - time.Duration(stamp-1)
}

func (t *telemetry) lastStats() *Stats {
	t.statsMu.Lock()
	defer t.statsMu.Unlock()
	return t.stats
}

func (t *telemetry) setStats(s Stats) { t.setSample(s, false) }

// setSample stores sample s, and whether it was idle (the sampling then backs off).
func (t *telemetry) setSample(s Stats, idle bool) {
	t.statsMu.Lock()
	defer t.statsMu.Unlock()
	t.stats = &s
	t.statsIdle = idle
}

// statsFailed notes a sample that failed: the sampling no longer backs off, and the last sample
// is stale staleAfter after it was taken, as when it was not idle.
func (t *telemetry) statsFailed() {
	t.statsMu.Lock()
	defer t.statsMu.Unlock()
	t.statsIdle = false
}

func (t *telemetry) setStatsIdleMax(d, maxGap time.Duration) {
	t.statsMu.Lock()
	defer t.statsMu.Unlock()
	t.statsIdleMax, t.statsMaxGap = d, maxGap
}

// staleAge is the age past which the last sample is stale: staleAfter, and for an idle sample
// the longest wait for the next one on top of it.
func (t *telemetry) staleAge() time.Duration { return t.idleGrace(t.staleAfter) }

// idleGrace is d, plus the longest wait for the next sample when the last one was idle or a
// budget may hold it.
func (t *telemetry) idleGrace(d time.Duration) time.Duration {
	t.statsMu.Lock()
	defer t.statsMu.Unlock()
	wait := t.statsMaxGap
	if t.statsIdle {
		wait = max(wait, t.statsIdleMax)
	}
	return d + wait
}

// metadataCarrier reads and writes the W3C trace context in message metadata.
type metadataCarrier map[string]string

func (c metadataCarrier) Get(key string) string { return c[key] }
func (c metadataCarrier) Set(key, value string) { c[key] = value }
func (c metadataCarrier) Keys() []string {
	keys := make([]string, 0, len(c))
	for k := range c {
		keys = append(keys, k)
	}
	return keys
}

// remoteParent returns ctx with the trace context carried in md as its remote parent, unless ctx
// holds a span already (an instrumented subscriber or middleware started one).
func (t *telemetry) remoteParent(ctx context.Context, md map[string]string) context.Context {
	if trace.SpanContextFromContext(ctx).IsValid() || md[MetadataTraceparent] == "" {
		return ctx
	}
	return t.prop.Extract(ctx, metadataCarrier(md))
}

// producerLinks returns links to the trace contexts stored with effects (the spans that recorded
// them), at most maxLinks, for a span that sends them again.
func (t *telemetry) producerLinks(effects []Effect) []trace.Link {
	const maxLinks = 32
	var links []trace.Link
	for _, e := range effects {
		if len(links) == maxLinks {
			break
		}
		if e.Metadata[MetadataTraceparent] == "" {
			continue
		}
		sc := trace.SpanContextFromContext(t.prop.Extract(context.Background(), metadataCarrier(e.Metadata)))
		if sc.IsValid() {
			links = append(links, trace.Link{SpanContext: sc})
		}
	}
	return links
}

// startDispatch traces the dispatch of effects on path. Right after a commit, in a unit of work or
// InTx (inUnit), it is an event of that span, which costs far less than a span; a re-send
// (by a redelivery or the relay) and JoinTx's dispatch get a span of their own, linked to the
// spans that recorded the effects. Call the returned function with the outcome.
func (t *telemetry) startDispatch(ctx context.Context, path string, effects []Effect, inUnit bool) (context.Context, func(error)) {
	n := attribute.Int("outbox.effects", len(effects))
	if path == PathCommit && inUnit {
		// It starts right after the commit event; one event, at its end, says how it went.
		span := trace.SpanFromContext(ctx)
		return ctx, func(err error) {
			span.AddEvent("outbox.dispatched", trace.WithAttributes(n, attribute.Bool("outbox.dispatch.failed", err != nil)))
		}
	}
	var links []trace.Link
	if path != PathCommit {
		links = t.producerLinks(effects)
	}
	ctx, span := t.tracer.Start(ctx, "outbox dispatch", trace.WithLinks(links...), trace.WithAttributes(AttrPath.String(path), n))
	return ctx, func(err error) { endSpan(span, err) }
}

// endSpan ends span with err's status.
func endSpan(span trace.Span, err error) {
	if err != nil {
		span.RecordError(err)
		span.SetStatus(codes.Error, err.Error())
	}
	span.End()
}
