package outbox

import (
	"cmp"
	"context"
	"database/sql"
	"errors"
	"fmt"
	"math"
	"reflect"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/trace"

	"github.com/watermill-outbox/outbox/outboxdriver"
)

// Config configures an Outbox. Zero values take the documented defaults.
type Config struct {
	// DB is the database that holds the business tables and the outbox tables. Required.
	DB *sql.DB
	// Driver is the database dialect, for example postgres.Driver{}. Required.
	Driver outboxdriver.Driver
	// Publisher sends message side effects after commit. Required.
	Publisher message.Publisher
	// Logger receives the framework's logs. Default: watermill.NopLogger.
	Logger watermill.LoggerAdapter

	// Schema is the database schema of the outbox tables. Default: the driver's ("public" on PostgreSQL).
	Schema string
	// TablePrefix is prepended to the outbox table names. Default: "outbox_".
	// Schema and TablePrefix must match ^[a-z_][a-z0-9_]*$ (at most 40 characters).
	TablePrefix string

	// Retention is how long a processed message ID is remembered, counted from the moment its side
	// effects were dispatched. A redelivery later than that runs the handler again. Default: 7 days.
	Retention time.Duration
	// EffectRetention is how long dispatched side effects are kept for inspection. Zero (the
	// default): they are deleted when they are marked dispatched, which writes far less than
	// keeping them (the SQLite driver keeps them until the next cleanup).
	EffectRetention time.Duration
	// CleanupInterval is how often Run deletes expired rows. Default: 1 minute.
	CleanupInterval time.Duration
	// CleanupBatchSize is the number of rows one cleanup transaction deletes. Default: 1000.
	CleanupBatchSize int
	// CleanupPause is the least pause between two cleanup batches, so that a large cleanup does
	// not compete head-on with the consumers for the database. Default: 20 milliseconds.
	CleanupPause time.Duration
	// CleanupPauseFactor makes each pause between cleanup batches last at least this many times
	// as long as the batch before it: cleanup then keeps to 1/(1+factor) of one connection's time
	// and slows down when the database is busy. Default: 2. Negative: only CleanupPause.
	CleanupPauseFactor float64

	// MaxAttempts is how many times a failing handler runs before the message is dead-lettered
	// (see DeadLetters). Attempts are counted durably. Default: 5.
	MaxAttempts int
	// DeadLetters is what happens to a message the consumer gives up on: one whose handler failed
	// MaxAttempts times, failed with a permanent error (Permanent), or whose ID is unusable.
	// DeadLettersStore (the default, ""): it is stored in the dead letters table (payload,
	// metadata, source topic, consumer, reason, attempts) and acked, in one transaction, so that
	// one bad message cannot hold up its consumer; an operator lists, retries or discards it
	// (Outbox.DeadLetters, RetryDeadLetters, DiscardDeadLetters, `outbox dead`). DeadLettersOff,
	// or a driver that keeps none: nothing is stored; the message goes to PoisonTopic when one is
	// set (after MaxAttempts, or at once for a permanent error), and is otherwise nacked again on
	// every delivery, forever.
	DeadLetters DeadLetterPolicy
	// Redrive retries dead letters on its own, for causes that pass (a downstream that comes
	// back): off unless Redrive.After is set. See DeadLetterRedrive.
	Redrive DeadLetterRedrive
	// PoisonTopic, when set, receives a copy of every dead-lettered message, with the reason in
	// its metadata (MetadataPoisonReason and the others): with DeadLetters stored, the copy is
	// recorded in the dead letter's transaction and sent like a side effect; with DeadLettersOff,
	// in the transaction of the message's poisoned claim (a copy processed meanwhile: acked as a
	// duplicate, not moved), then sent as well.
	PoisonTopic string

	// RetryDelay is how long Handle waits before it returns a failure (a nack), and before each
	// of its own retries (HandlerRetries): RetryDelay after the first failed attempt of the
	// message, doubling with each further one, up to RetryDelayMax. Most brokers redeliver a
	// nacked message at once: without the wait, a message that keeps failing (a broker that is
	// down, a bug) comes straight back in a loop, and an ordered subscriber (a Kafka partition, a
	// watermill-sql consumer group) retries without backing off. The wait ends when the
	// message's context does (a Router shutting down). Default: 100 ms. Negative: no wait.
	RetryDelay time.Duration
	// RetryDelayMax bounds the growth of RetryDelay. Default: 10 seconds.
	RetryDelayMax time.Duration
	// AfterDispatchFailure says what Handle returns for a message whose unit of work committed but
	// whose side effects could not all be dispatched (the broker refused a topic, an applier
	// failed). Either way the effects are committed, with the failure recorded, and nothing is
	// lost. DispatchFailureNack (the default, ""): the message is nacked after RetryDelay, and its
	// redelivery sends what is pending; while one topic or applier keeps failing, every message
	// that records an effect for it is retried with backoff, so that the consumer handles only a
	// few messages a minute (with an ordered subscriber, none behind it). DispatchFailureAck: the
	// message is acked and the relay sends the effects, after their retry backoff (up to 5
	// minutes apart), parking them after RelayMaxAttempts; the consumer goes on at full speed.
	// docs/guarantees.md ("After a failed dispatch") explains the trade.
	AfterDispatchFailure DispatchFailurePolicy
	// HandlerRetries is how many times Handle runs a failed unit of work again itself, each time
	// after RetryDelay and in a new transaction (a redelivery that finds the message processed
	// dispatches what is pending), before it returns the failure; each attempt is counted toward
	// MaxAttempts as a redelivery's would be. It takes the place of Watermill's Retry middleware,
	// which must not run inside the outbox middleware. Default: 0.
	HandlerRetries int

	// ReconnectDelay is how long the work on a database that became unreachable (a connection
	// refused, a name not found, a dial that timed out, a server starting up, shutting down or
	// with too many connections) waits before one probe connects again: the units of work in
	// flight and the background loops wait, without a connection, for that probe, the first
	// success closes the outage and wakes them all. The delay doubles after each failed probe up
	// to ReconnectDelayMax, each spread over its upper half at random so that the instances of
	// one outage do not probe in step. A unit of work waits at most HandlerTimeout (a budget of its
	// own: one that begins when the database answers has a whole HandlerTimeout for its work) and
	// while its message's context lasts, then is nacked with ErrDatabaseUnreachable (not counted
	// as a failed attempt).
	// Default: 100 ms. Negative: no waiting, every unit of work and loop connects again itself
	// (after RetryDelay), as many times a second as there are messages in flight.
	ReconnectDelay time.Duration
	// ReconnectDelayMax bounds the growth of ReconnectDelay. Default: 30 seconds.
	ReconnectDelayMax time.Duration

	// DuplicateWait is how long a duplicate delivery that finds side effects committed less than
	// this long ago waits for the process that committed them to send them, before sending what is
	// still pending itself. It keeps concurrent copies from putting a second copy of every effect on
	// the wire. Default: 1 second.
	DuplicateWait time.Duration

	// HandlerTimeout bounds one unit of work up to its commit: the wait for a database connection
	// and for the claim of a copy being processed elsewhere, the handler (its context carries the
	// deadline, so the queries it runs with that context are cancelled) and the commit. A unit of
	// work that exceeds it is rolled back, and counted as a failed attempt once it held its claim;
	// one that ran out waiting for a connection or a copy's claim is nacked, not counted.
	// Default: 1 minute; at most 24 hours.
	HandlerTimeout time.Duration
	// PublishTimeout bounds one call of Publisher.Publish and one call of an applier (whose
	// context carries the deadline). Default: 30 seconds; at most 24 hours.
	PublishTimeout time.Duration
	// ShutdownTimeout bounds how long Run (and a tenant.Set, per member it stops) waits, once
	// its context ended, for the background calls in progress to return and the dispatched marks
	// queued to be written; then it returns an error that names what it waited for. The calls
	// all take the shutdown's context and the marks are bounded by a timeout of their own, so
	// reaching it means a call ignores its context (a driver stuck connecting to a server that
	// does not answer). What such a call leaves unwritten is safe: its effects are sent again,
	// with the same UUIDs, when their lease ends. Default: PublishTimeout + 30 seconds (a round's
	// outcome is written within 30 seconds).
	ShutdownTimeout time.Duration
	// BackgroundTimeout bounds one run of a background service (a relay pass, a cleanup, a
	// dead-letter redrive; a statistics sample is bounded by 30 seconds, or by this when shorter):
	// its context carries the deadline. A relay pass starts no round after half of it, and the
	// next pass goes on at once, so a healthy pass never meets it; a cleanup that meets it goes
	// on at its next run. A run that has not returned a few seconds after its deadline (a driver
	// that ignores its context while it connects to a server that accepts connections and never
	// answers: lib/pq without connect_timeout) is abandoned: its share of the background work
	// goes to the other services, and to the other members of a tenant.Set; the database is
	// taken for unreachable (logged, and Health says since when) and probed, each probe bounded,
	// until it answers; the service runs again once the abandoned call returns.
	// Default: 2 x PublishTimeout + 210 seconds (4.5 minutes): a relay round's claim, its calls
	// and the writes of its outcome, twice. At most 24 hours.
	BackgroundTimeout time.Duration
	// MaxPayloadBytes is the largest side effect accepted: its payload and its metadata (keys and
	// values, with what the framework adds) together. Default: 16 MiB.
	MaxPayloadBytes int

	// RelayInterval is how often Run looks for side effects left undispatched. Default: 1 second.
	RelayInterval time.Duration
	// RelayGrace is how old an undispatched side effect must be before the relay sends it, so that
	// the relay does not race the dispatch that follows every commit. Default: 10 seconds.
	RelayGrace time.Duration
	// RelayBatchSize is how many side effects one relay round claims. Default: 500.
	RelayBatchSize int
	// RelayBatchBytes bounds the payload and metadata bytes one relay round loads (it always
	// loads at least one effect). Default: 16 MiB.
	RelayBatchBytes int
	// RelayConcurrency is how many ordering keys one relay round sends to at the same time. The
	// effects of one key are sent one call after another, in order, and after a failure the key's
	// later effects wait; different keys go concurrently, so that a slow destination or a long
	// backlog of one key does not hold up the others. A relay sends at most about
	// RelayConcurrency / call latency calls per second (16 calls of 1 ms each: 16,000 a second
	// while it sends); raise it for a slower destination, lower it for a Publisher that takes a
	// scarce resource per call (a database connection); 1 sends one call at a time. See
	// docs/operations.md, "Sizing the relay". Default: 16.
	RelayConcurrency int
	// RelayPauseFactor makes a relay that is draining a backlog pause, before each claim, for
	// this many times as long as its last turn took besides its claim: waiting for the calls of a
	// round (less the time they waited for calls that did not return within PublishTimeout,
	// which used neither the database nor the CPUs) and writing its outcome. The calls of a round
	// that run while the relay claims the next one are not counted (they mostly wait on the
	// destination), and they go on during the pause. So a relay draining a backlog keeps to about
	// 1/(1+factor) of its time and leaves the database and the CPUs to the consumers. Default: 1
	// (what it costs in drain speed is in docs/benchmarks.md). Negative: no pause, the fastest
	// drain.
	RelayPauseFactor float64
	// RelayMaxAttempts is how many failed dispatches of one side effect, on any path, park it.
	// Only failures while the target is otherwise healthy count (something else reached the
	// Publisher, or the same applier succeeded, since the effect's previous failure): during an
	// outage effects are retried with backoff (up to 5 minutes apart) and never parked. Default: 10.
	RelayMaxAttempts int

	// MeterProvider and TracerProvider receive the framework's metrics and spans (see
	// docs/observability.md). Default: the global providers (otel.GetMeterProvider,
	// otel.GetTracerProvider), which do nothing until the application installs an SDK.
	MeterProvider  metric.MeterProvider
	TracerProvider trace.TracerProvider
	// Member names this Outbox in its metrics (attribute outbox.member) when it is one of many
	// in a process, a database per tenant or per shard, so that each has series of its own:
	// outbox.tables alone ("public.outbox_") is the same for every database. Keep the names a
	// bounded set (tenants, shards), never a per-message value. A tenant.Set names each member
	// it runs after its member name when Member is empty. Default: none (no attribute).
	Member string
	// StatsInterval is how often the gauges that come from the database (pending and parked side
	// effects, failing messages, retained IDs, cleanup lag; see Outbox.Stats) are sampled. One
	// instance at a time takes the sample, at a bounded cost; every instance reports the newest.
	// A member of a tenant.Set whose samples find nothing waiting and nothing changed is sampled
	// less and less often, up to ten intervals (at most 150 s), until it works again.
	// Default: 15 seconds. Negative: no sampling (those gauges are not reported).
	StatsInterval time.Duration
	// RedeliveryHorizon is how long after a message was first delivered the broker may still
	// deliver it again (a JetStream replay, a Kafka offset reset, a dead-letter replay; see
	// docs/operations.md). Validate refuses a Retention shorter than it: a copy redelivered after
	// its ID was forgotten runs the handler a second time. Zero: not checked. At run time a
	// duplicate whose claim is older than half of Retention is reported whatever this says.
	RedeliveryHorizon time.Duration
	// IdempotencyRetention is how long an idempotency key (WithIdempotencyKey) is kept, counted
	// from its claim: a request retried with the key within it gets the stored result and runs
	// nothing; one retried later runs again. Each key is stored with its expiry, so a cleanup
	// run with another retention (the operators' CLI) cannot forget it sooner. Default: 24 hours.
	IdempotencyRetention time.Duration
	// ClientRetryHorizon is how long after a request the clients that send idempotency keys may
	// retry it (their retry policy's longest span, an offline queue's replay). Validate refuses
	// an IdempotencyRetention shorter than it: a retry after its key was forgotten runs the unit
	// of work a second time. Zero: not checked.
	ClientRetryHorizon time.Duration
	// HealthMaxPending, HealthMaxPendingAge and HealthMaxParked are the thresholds above which
	// Outbox.Health reports the backlog as unhealthy. Zero: not checked.
	HealthMaxPending    int64
	HealthMaxPendingAge time.Duration
	HealthMaxParked     int64

	// Failpoint, when set, is called at each named step of a unit of work, a relay round and the
	// relay's sweep of inline effects (see the Failpoint* constants, and docs/protocol.md for the steps); a
	// non-nil error aborts the unit of work, round or sweep there as a crash would (a unit of work
	// so aborted is not counted as a failed attempt: a dead process records nothing). For tests.
	Failpoint func(ctx context.Context, point string) error
}

// Names of the failpoints passed to Config.Failpoint, in the order they are reached. Each is a
// step of the protocol's model (model/outbox.pml, docs/protocol.md), and TestModelFailpoints
// keeps the two lists equal.
const (
	FailpointAfterClaim   = "after-claim"
	FailpointAfterHandler = "after-handler"
	FailpointAfterCommit  = "after-commit"
	FailpointAfterPublish = "after-publish" // after each publish call or applier call, on every path
	FailpointAfterMark    = "after-mark"
	// FailpointAfterMaterialize follows the move of a message's inline effects to rows (a failed
	// dispatch, a redelivery that sends them).
	FailpointAfterMaterialize = "after-materialize"
	// FailpointAfterRelayClaim follows the lease of a relay round's effects; FailpointAfterRelayMark
	// the mark of those it sent, the round's last write (the failures of the others come first).
	FailpointAfterRelayClaim = "after-relay-claim"
	FailpointAfterRelayMark  = "after-relay-mark"
	// FailpointAfterSweepMove and FailpointBeforeSweepWatermark are steps of the relay's sweep of
	// inline effects left behind, inside its transaction: after the move to rows, and before the
	// watermark advances. A failure there rolls the whole sweep back.
	FailpointAfterSweepMove       = "after-sweep-move"
	FailpointBeforeSweepWatermark = "before-sweep-watermark"
)

const (
	defaultTablePrefix      = "outbox_"
	defaultRetention        = 7 * 24 * time.Hour
	defaultCleanupInterval  = time.Minute
	defaultCleanupBatchSize = 1000
	defaultCleanupPause     = 20 * time.Millisecond
	defaultCleanupFactor    = 2
	defaultRelayPauseFactor = 1
	defaultRetryDelay       = 100 * time.Millisecond
	defaultRetryDelayMax    = 10 * time.Second
	defaultMaxAttempts      = 5
	defaultPublishTimeout   = 30 * time.Second
	maxTimeout              = 24 * time.Hour // PublishTimeout, HandlerTimeout, BackgroundTimeout
	defaultDuplicateWait    = time.Second
	defaultMaxPayloadBytes  = 16 << 20
	defaultRelayInterval    = time.Second
	defaultRelayGrace       = 10 * time.Second
	defaultRelayBatchSize   = 500
	defaultRelayBatchBytes  = 16 << 20
	defaultRelayConcurrency = 16
	defaultHandlerTimeout   = time.Minute
	defaultRelayMaxAttempts = 10
	defaultStatsInterval    = 15 * time.Second
	defaultKeyRetention     = 24 * time.Hour

	defaultReconnectDelay = 100 * time.Millisecond
	reconnectDelayMax     = 30 * time.Second

	// maxIDLength bounds message IDs and topics so that they index well.
	maxIDLength = 255
)

func (c *Config) setDefaults() {
	if c.Logger == nil {
		c.Logger = watermill.NopLogger{}
	}
	if c.TablePrefix == "" {
		c.TablePrefix = defaultTablePrefix
	}
	if c.Retention == 0 {
		c.Retention = defaultRetention
	}
	if c.CleanupInterval == 0 {
		c.CleanupInterval = defaultCleanupInterval
	}
	if c.CleanupBatchSize == 0 {
		c.CleanupBatchSize = defaultCleanupBatchSize
	}
	if c.CleanupPause == 0 {
		c.CleanupPause = defaultCleanupPause
	}
	if c.CleanupPauseFactor == 0 {
		c.CleanupPauseFactor = defaultCleanupFactor
	}
	if c.RetryDelay == 0 {
		c.RetryDelay = defaultRetryDelay
	}
	if c.RetryDelayMax == 0 {
		c.RetryDelayMax = defaultRetryDelayMax
	}
	if c.ReconnectDelay == 0 {
		c.ReconnectDelay = defaultReconnectDelay
	}
	if c.ReconnectDelayMax == 0 {
		c.ReconnectDelayMax = reconnectDelayMax
	}
	if c.RelayPauseFactor == 0 {
		c.RelayPauseFactor = defaultRelayPauseFactor
	}
	if c.MaxAttempts == 0 {
		c.MaxAttempts = defaultMaxAttempts
	}
	if c.Redrive.After > 0 && c.Redrive.MaxRetries == 0 {
		c.Redrive.MaxRetries = defaultRedriveRetries
	}
	if c.DuplicateWait == 0 {
		c.DuplicateWait = defaultDuplicateWait
	}
	if c.IdempotencyRetention == 0 {
		c.IdempotencyRetention = defaultKeyRetention
	}
	if c.HandlerTimeout == 0 {
		c.HandlerTimeout = defaultHandlerTimeout
	}
	if c.PublishTimeout == 0 {
		c.PublishTimeout = defaultPublishTimeout
	}
	// Past maxTimeout Validate refuses PublishTimeout: what derives from it would overflow.
	if c.ShutdownTimeout == 0 && c.PublishTimeout <= maxTimeout {
		c.ShutdownTimeout = c.PublishTimeout + markTimeout
	}
	if c.BackgroundTimeout == 0 && c.PublishTimeout <= maxTimeout {
		// A relay pass past half its bound starts no round; what it may still do is a round:
		// its claim (a statement, storeTimeout), its calls (up to relayBudget from before its
		// claim) and the writes of its outcome and the previous round's (markTimeout each).
		relayBudget := relayLeaseFor(c.PublishTimeout) / 2 // as Outbox.relayBudget
		c.BackgroundTimeout = 2 * (storeTimeout + relayBudget + 2*markTimeout)
	}
	if c.MaxPayloadBytes == 0 {
		c.MaxPayloadBytes = defaultMaxPayloadBytes
	}
	if c.RelayInterval == 0 {
		c.RelayInterval = defaultRelayInterval
	}
	if c.RelayGrace == 0 {
		c.RelayGrace = defaultRelayGrace
	}
	if c.RelayBatchSize == 0 {
		c.RelayBatchSize = defaultRelayBatchSize
	}
	if c.RelayBatchBytes == 0 {
		c.RelayBatchBytes = defaultRelayBatchBytes
	}
	if c.RelayConcurrency == 0 {
		c.RelayConcurrency = defaultRelayConcurrency
	}
	if c.StatsInterval == 0 {
		c.StatsInterval = defaultStatsInterval
	}
	if c.RelayMaxAttempts == 0 {
		c.RelayMaxAttempts = defaultRelayMaxAttempts
	}
}

// Validate reports the first invalid setting.
func (c Config) Validate() error {
	var errs []error
	if c.DB == nil {
		errs = append(errs, errors.New("DB is required"))
	}
	if c.Driver == nil {
		errs = append(errs, errors.New("Driver is required (for example postgres.Driver{})"))
	} else if isNilPointer(c.Driver) {
		errs = append(errs, fmt.Errorf("Driver is a nil %T", c.Driver))
	}
	if c.Publisher == nil {
		errs = append(errs, errors.New("Publisher is required"))
	} else if isNilPointer(c.Publisher) {
		// A publisher variable declared but never assigned: it would pass as set and panic at
		// the first dispatch, in the relay, far from the mistake.
		errs = append(errs, fmt.Errorf("Publisher is a nil %T (declared but never assigned?)", c.Publisher))
	}
	if c.Member != "" {
		if err := validMember(c.Member); err != nil {
			errs = append(errs, fmt.Errorf("Member: %w", err))
		}
	}
	if c.PublishTimeout > maxTimeout || c.HandlerTimeout > maxTimeout || c.BackgroundTimeout > maxTimeout {
		// "No timeout" written as the largest duration: the relay's lease and the shutdown's
		// bound, derived from it, and the engine's bound of a run plus its grace, would overflow
		// into negative durations.
		errs = append(errs, fmt.Errorf("PublishTimeout (%s), HandlerTimeout (%s) and BackgroundTimeout (%s) must be at most %s",
			c.PublishTimeout, c.HandlerTimeout, c.BackgroundTimeout, maxTimeout))
	}
	for name, d := range map[string]time.Duration{
		"Retention": c.Retention, "EffectRetention": c.EffectRetention, "CleanupInterval": c.CleanupInterval,
		"CleanupPause":   c.CleanupPause,
		"HandlerTimeout": c.HandlerTimeout, "PublishTimeout": c.PublishTimeout, "DuplicateWait": c.DuplicateWait,
		"ShutdownTimeout": c.ShutdownTimeout, "BackgroundTimeout": c.BackgroundTimeout,
		"RetryDelayMax": c.RetryDelayMax, "ReconnectDelayMax": c.ReconnectDelayMax,
		"RelayInterval": c.RelayInterval, "RelayGrace": c.RelayGrace,
		"RedeliveryHorizon": c.RedeliveryHorizon, "HealthMaxPendingAge": c.HealthMaxPendingAge,
		"IdempotencyRetention": c.IdempotencyRetention, "ClientRetryHorizon": c.ClientRetryHorizon,
	} {
		if d < 0 {
			errs = append(errs, fmt.Errorf("%s must not be negative", name))
		}
	}
	for name, n := range map[string]int{
		"CleanupBatchSize": c.CleanupBatchSize, "MaxAttempts": c.MaxAttempts, "MaxPayloadBytes": c.MaxPayloadBytes,
		"HandlerRetries": c.HandlerRetries,
		"RelayBatchSize": c.RelayBatchSize, "RelayBatchBytes": c.RelayBatchBytes, "RelayMaxAttempts": c.RelayMaxAttempts,
		"RelayConcurrency": c.RelayConcurrency,
	} {
		if n < 0 {
			errs = append(errs, fmt.Errorf("%s must not be negative", name))
		}
	}
	for name, f := range map[string]float64{"CleanupPauseFactor": c.CleanupPauseFactor, "RelayPauseFactor": c.RelayPauseFactor} {
		if math.IsNaN(f) || math.IsInf(f, 0) {
			errs = append(errs, fmt.Errorf("%s must be a finite number, not %v", name, f))
		}
	}
	if c.HealthMaxPending < 0 || c.HealthMaxParked < 0 {
		errs = append(errs, errors.New("HealthMaxPending and HealthMaxParked must not be negative"))
	}
	if retention := cmp.Or(c.Retention, defaultRetention); c.RedeliveryHorizon > 0 && retention < c.RedeliveryHorizon {
		errs = append(errs, fmt.Errorf("%w: Retention (%s) is shorter than RedeliveryHorizon (%s): a copy the broker "+
			"redelivers after the ID was forgotten would run the handler a second time; raise Retention to at least %s",
			ErrRetentionTooShort, retention, c.RedeliveryHorizon, c.RedeliveryHorizon))
	}
	if retention := cmp.Or(c.IdempotencyRetention, defaultKeyRetention); c.ClientRetryHorizon > 0 && retention < c.ClientRetryHorizon {
		errs = append(errs, fmt.Errorf("%w: IdempotencyRetention (%s) is shorter than ClientRetryHorizon (%s): a request "+
			"retried after its key was forgotten would run a second time; raise IdempotencyRetention to at least %s",
			ErrRetentionTooShort, retention, c.ClientRetryHorizon, c.ClientRetryHorizon))
	}
	switch c.AfterDispatchFailure {
	case "", DispatchFailureNack, DispatchFailureAck:
	default:
		errs = append(errs, fmt.Errorf("AfterDispatchFailure must be %q or %q, not %q", DispatchFailureNack, DispatchFailureAck, c.AfterDispatchFailure))
	}
	switch c.DeadLetters {
	case "", DeadLettersStore, DeadLettersOff:
	default:
		errs = append(errs, fmt.Errorf("DeadLetters must be %q or %q, not %q", DeadLettersStore, DeadLettersOff, c.DeadLetters))
	}
	if c.Redrive.After < 0 || c.Redrive.MaxRetries < 0 {
		errs = append(errs, fmt.Errorf("Redrive: After (%s) and MaxRetries (%d) must not be negative", c.Redrive.After, c.Redrive.MaxRetries))
	}
	if c.Redrive.After > 0 && c.DeadLetters == DeadLettersOff {
		errs = append(errs, errors.New("Redrive retries dead letters, which DeadLettersOff does not store: set one or the other"))
	}
	if c.PoisonTopic != "" {
		if err := validateName(c.PoisonTopic); err != nil {
			errs = append(errs, fmt.Errorf("PoisonTopic: %w", err))
		}
	}
	return errors.Join(errs...)
}

// DispatchFailurePolicy is what Handle does with a message whose side effects failed to dispatch
// after its commit (Config.AfterDispatchFailure).
type DispatchFailurePolicy string

// The values of Config.AfterDispatchFailure.
const (
	// DispatchFailureNack nacks the message: its redelivery drives the dispatch (the default).
	DispatchFailureNack DispatchFailurePolicy = "nack"
	// DispatchFailureAck acks the message and leaves the dispatch to the relay.
	DispatchFailureAck DispatchFailurePolicy = "ack"
)

// DeadLetterPolicy is what Handle does with a message the consumer gives up on (Config.DeadLetters).
type DeadLetterPolicy string

// The values of Config.DeadLetters.
const (
	// DeadLettersStore stores the message in the dead letters table and acks it (the default).
	DeadLettersStore DeadLetterPolicy = "store"
	// DeadLettersOff stores nothing: the message goes to PoisonTopic if set, and is otherwise
	// nacked forever.
	DeadLettersOff DeadLetterPolicy = "off"
)

// DeadLetterRedrive is a policy that retries dead letters on its own (Config.Redrive), as
// Outbox.RetryDeadLetters does, by actor RedriveActor: each dead letter After it was stored, while
// it was retried fewer than MaxRetries times in all (DeadLetter.Retries, which an operator's
// retries count too); then it stays dead until an operator acts. Dead letters marked permanent
// (no attempt can succeed) and those without a source topic are left to the operator. Every
// Outbox.Run looks, every After (at most every minute), at the oldest 1,000 dead letters it may
// retry (those it may not are not read); when
// several look at once, the retry of a dead letter another one retried a moment before changes
// nothing, and the limit is checked by the statement that retries it, so that they retry a dead
// letter at most MaxRetries times in all. An operator's retry is not bound by it.
type DeadLetterRedrive struct {
	// After is how long a dead letter waits before it is retried. Zero: no redrive (the
	// default).
	After time.Duration
	// MaxRetries bounds the retries of a dead letter. Default, with After set: 3.
	MaxRetries int
}

// RedriveActor is who the redrive policy retries dead letters as (DeadLetter.ChangedBy).
const RedriveActor = "redrive policy"

const defaultRedriveRetries = 3

// isNilPointer reports whether v, a non-nil interface, holds a nil pointer, map, channel or func.
func isNilPointer(v any) bool {
	switch rv := reflect.ValueOf(v); rv.Kind() {
	case reflect.Pointer, reflect.Map, reflect.Chan, reflect.Func, reflect.Slice, reflect.Interface:
		return rv.IsNil()
	}
	return false
}

// validMember checks a member name for a metric attribute: what a metric backend takes as a
// label value without loss, and short enough to stay one.
func validMember(name string) error {
	switch {
	case len(name) > 255:
		return fmt.Errorf("%d bytes, at most 255", len(name))
	case !utf8.ValidString(name):
		return errors.New("not valid UTF-8")
	case strings.ContainsRune(name, 0):
		return errors.New("contains NUL")
	}
	return nil
}
