package outbox

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"maps"
	"runtime/debug"
	"slices"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"go.opentelemetry.io/otel/trace"

	"github.com/watermill-outbox/outbox/outboxdriver"
)

// Metadata keys the framework sets on the messages it publishes, unless they are already set.
const (
	// MetadataCausationID holds the ID of the incoming message (or boundary transaction) that caused the message.
	MetadataCausationID = "causation_id"
	// MetadataCorrelationID is copied from the incoming message; it is Watermill's correlation ID key.
	MetadataCorrelationID = "correlation_id"
	// MetadataTraceparent and MetadataTracestate (W3C trace context) are copied from the incoming message.
	MetadataTraceparent = "traceparent"
	MetadataTracestate  = "tracestate"
	// MetadataOrderingKey holds the effect's ordering key (the key set with WithOrderingKey, or
	// DefaultOrderingKey of its source). Unlike the keys above it is always the framework's: it
	// is set when the message is handed to the Publisher, on every path (after commit, on
	// redelivery, by the relay), replacing a value the message had. A broker that orders per
	// partition keeps the outbox's order per key only if the key picks the partition: see
	// PartitionKey.
	MetadataOrderingKey = "outbox_ordering_key"
	// MetadataRetryFor addresses a retried dead letter to its consumer (RetryDeadLetters): the
	// Outbox's other consumers of its topic ack it without running their handlers, and its own
	// takes the key off before its handler sees the message. Consumers of the topic outside the
	// outbox receive the copy as any message.
	MetadataRetryFor = outboxdriver.MetadataRetryFor
)

// PartitionKey returns the ordering key the outbox set on msg (MetadataOrderingKey), for a
// Publisher that routes messages to partitions by key, so that effects with one ordering key
// land on one partition and a consumer of the topic sees them in the order the outbox dispatched
// them. Its signature is watermill-kafka's GeneratePartitionKey:
//
//	kafka.NewWithPartitioningMarshaler(outbox.PartitionKey)
//
// A message the outbox did not publish has no such metadata: its key is its UUID, which spreads
// such messages over the partitions and keeps the copies of one on one partition. (An empty key
// would not: watermill-kafka's partitioning marshaler sends an empty key, not a missing one, and
// every such message would land on one partition.)
func PartitionKey(topic string, msg *message.Message) (string, error) {
	if key := msg.Metadata.Get(MetadataOrderingKey); key != "" {
		return key, nil
	}
	return msg.UUID, nil
}

// propagated are the incoming metadata keys copied onto the messages a handler records.
var propagated = []string{MetadataCorrelationID, MetadataTraceparent, MetadataTracestate}

// unit is one unit of work: the transaction of one incoming message or one boundary call, and the
// side effects recorded in it. Publish and Record may be called from several goroutines at once
// (a *sql.Tx is safe for concurrent use, so handlers do this): mu orders the records.
type unit struct {
	o        *Outbox
	tx       outboxdriver.UnitTx
	src      Source
	incoming *message.Message // nil at the boundary
	begun    time.Time

	mu       sync.Mutex
	effects  []Effect  // sent after commit, in order; delayed effects are not among them
	recorded int       // effects recorded, delayed ones included: the next Seq
	finished bool      // no more records: the transaction is being committed or rolled back
	warned   bool      // an incoming value too large to copy was logged
	derived  int       // UUIDs derived so far (NewUUID)
	due      time.Time // the earliest due time of the delayed effects recorded; zero: none

	key    *keyed // the idempotency key of a keyed boundary unit; nil otherwise
	result []byte // set with SetResult, stored with the key

	// storeFailed: the store refused or did not answer a record of effects (recordErr, the
	// first). A boundary unit that then fails counts as failed, not as the application's
	// rollback; one whose function ignored the error does not commit (see committedEffects).
	storeFailed bool
	recordErr   error
}

func newUnit(o *Outbox, tx outboxdriver.UnitTx, src Source, incoming *message.Message) *unit {
	return &unit{o: o, tx: tx, src: src, incoming: incoming, begun: time.Now()}
}

// dueCommitted wakes this process's relay at the earliest due time of the delayed effects u
// committed, or at once when it has passed: the wake-up armed when they were recorded may have
// fired before the commit (WithDelay of 0, or shorter than the rest of the unit), into a pass that
// could not see them, and nothing else woke the relay until its next poll.
func (u *unit) dueCommitted() {
	u.mu.Lock()
	due := u.due
	u.mu.Unlock()
	if !due.IsZero() {
		u.o.due.arm(due)
	}
}

// finish stops recording and returns the effects recorded so far.
func (u *unit) finish() []Effect {
	u.mu.Lock()
	defer u.mu.Unlock()
	u.finished = true
	return u.effects
}

// storeRefused tells whether a record of effects failed in the store.
func (u *unit) storeRefused() bool {
	u.mu.Lock()
	defer u.mu.Unlock()
	return u.storeFailed
}

// committedEffects stops recording and returns the recorded effects that will commit with the
// transaction: those recorded inside a savepoint that the handler rolled back must never be sent.
//
// A record the store refused fails the unit even when the handler or fn ignored its error: on
// PostgreSQL the failed statement aborts the transaction, but MySQL and SQLite would commit the
// business writes without the effects, and those would never be sent.
func (u *unit) committedEffects(ctx context.Context) ([]Effect, error) {
	effects := u.finish()
	u.mu.Lock()
	recordErr := u.recordErr
	u.mu.Unlock()
	if recordErr != nil {
		return nil, fmt.Errorf("outbox: a record of side effects failed in this unit of work (its error was not returned); nothing commits: %w", recordErr)
	}
	return u.tx.Survivors(ctx, effects)
}

// customKeys returns the ordering keys set with WithOrderingKey among effects: effects with such a
// key may have to wait behind effects of other transactions.
func (o *Outbox) customKeys(src Source, effects []Effect) []string {
	def := defaultOrderingKey(src)
	var keys []string
	for _, e := range effects {
		if e.OrderingKey != def && !slices.Contains(keys, e.OrderingKey) {
			keys = append(keys, e.OrderingKey)
		}
	}
	return keys
}

func defaultOrderingKey(src Source) string { return outboxdriver.DefaultOrderingKey(src) }

// DefaultOrderingKey is the ordering key of the side effects of src recorded without
// WithOrderingKey.
func DefaultOrderingKey(src Source) string { return outboxdriver.DefaultOrderingKey(src) }

// keyBlocked tells whether an earlier effect of another transaction with one of the custom ordering
// keys of effects is still undispatched; then these effects must go through the relay, in order.
func (o *Outbox) keyBlocked(ctx context.Context, src Source, effects []Effect) (bool, error) {
	keys := o.customKeys(src, effects)
	if len(keys) == 0 {
		return false, nil // the default key is the source's own: nothing else holds it
	}
	ctx, cancel := context.WithTimeout(ctx, storeTimeout)
	defer cancel()
	for _, key := range keys {
		blocked, err := o.store.EffectKeyBlocked(ctx, src, key)
		if err != nil || blocked {
			return blocked, err
		}
	}
	return false, nil
}

// handToRelay leaves effects that must wait behind earlier ones to the relay.
func (o *Outbox) handToRelay(ctx context.Context, src Source) error {
	ctx, cancel := context.WithTimeout(ctx, storeTimeout)
	defer cancel()
	if err := o.store.EffectHandToRelay(ctx, src); err != nil {
		return fmt.Errorf("outbox: hand side effects to the relay: %w", err)
	}
	o.relayNeeded(watermill.LogFields{"consumer": src.Consumer, "source_id": src.ID})
	o.wakeRelays(ctx)
	return nil
}

type unitKey struct{}
type orderingKeyKey struct{}
type metadataKey struct{}

// WithMetadata returns a context in which every message recorded with Publish gets metadata key set
// to value, unless the message sets it itself. At the boundary, where there is no incoming message
// to copy them from, use it for the correlation ID (MetadataCorrelationID) and the W3C trace
// context (MetadataTraceparent) of the request.
func WithMetadata(ctx context.Context, key, value string) context.Context {
	prev, _ := ctx.Value(metadataKey{}).(map[string]string)
	md := maps.Clone(prev)
	if md == nil {
		md = map[string]string{}
	}
	md[key] = value
	return context.WithValue(ctx, metadataKey{}, md)
}

func withUnit(ctx context.Context, u *unit) context.Context {
	return context.WithValue(ctx, unitKey{}, u)
}

func unitFrom(ctx context.Context) *unit {
	u, _ := ctx.Value(unitKey{}).(*unit)
	return u
}

// Tx returns the transaction of the unit of work in ctx: the handler's business writes go through
// it so that they commit together with the processed-message claim and the side effects. Do not
// commit or roll it back: the framework does. Outside a unit of work (a handler not wrapped by
// the middleware, a context that is not the message's) it panics with an error wrapping
// ErrNoUnitOfWork, rather than return a nil *sql.Tx that fails later without saying why; use
// TxOK to ask. With the pgx driver the transaction is a pgx.Tx: use its package's Tx.
func Tx(ctx context.Context) *sql.Tx {
	tx, ok := TxOK(ctx)
	if !ok {
		if t, found := TxOf(ctx); found {
			panic(fmt.Errorf("outbox.Tx: %w: the unit of work runs on a %T (take it with the driver's Tx)", ErrNoUnitOfWork, t))
		}
		panic(fmt.Errorf("outbox.Tx: %w", ErrNoUnitOfWork))
	}
	return tx
}

// TxOK returns the *sql.Tx of the unit of work in ctx, and false outside a unit of work (or in one
// that runs on another transaction type).
func TxOK(ctx context.Context) (*sql.Tx, bool) {
	t, _ := TxOf(ctx)
	tx, ok := t.(*sql.Tx)
	return tx, ok
}

// TxOf returns the transaction of the unit of work in ctx whatever its type (a *sql.Tx, or a
// pgx.Tx with the pgx driver), and false outside a unit of work. Driver packages build their
// typed accessors on it.
func TxOf(ctx context.Context) (any, bool) {
	if u := unitFrom(ctx); u != nil {
		return u.tx.Tx(), true
	}
	return nil, false
}

// WithOrderingKey returns a context whose side effects recorded with Publish and Record share the
// ordering key key: the relay dispatches effects with the same key in the order they were recorded.
// The default key is the source (the incoming message, or the boundary transaction).
func WithOrderingKey(ctx context.Context, key string) context.Context {
	return context.WithValue(ctx, orderingKeyKey{}, key)
}

// Publish records msgs as side effects to topic in the unit of work of ctx. They are stored in the
// transaction, so they exist if and only if the business writes commit, and they are published after
// commit with their UUIDs unchanged on every retry. A message without UUID gets a new one, once.
// The messages are copied: changing them after Publish has no effect.
func Publish(ctx context.Context, topic string, msgs ...*message.Message) error {
	u := unitFrom(ctx)
	if u == nil {
		return ErrNoUnitOfWork
	}
	if err := validateName(topic); err != nil {
		return fmt.Errorf("%w: %w", ErrInvalidTopic, err)
	}
	effects := make([]Effect, 0, len(msgs))
	for _, m := range msgs {
		if m == nil {
			return fmt.Errorf("outbox: Publish to %q: nil message", topic)
		}
		id := m.UUID
		if id == "" {
			id = newID()
		}
		if err := validateName(id); err != nil {
			return fmt.Errorf("%w: outgoing message to %q: %w", ErrInvalidMessageID, topic, err)
		}
		md := maps.Clone(map[string]string(m.Metadata))
		if md == nil {
			md = map[string]string{}
		}
		u.addCausation(ctx, md)
		effects = append(effects, Effect{
			Kind:     KindPublish,
			Topic:    topic,
			UUID:     id,
			Payload:  append([]byte(nil), m.Payload...),
			Metadata: md,
		})
	}
	return u.record(ctx, effects)
}

// Record records a custom side effect for the applier registered under kind, with payload as its
// input. It is applied after commit, at least once, with a stable UUID (Effect.UUID), by which
// the applier deduplicates.
//
// The UUID is derived as NewUUID derives one: from the cause of the unit of work (the consumer
// and ID of the incoming message, or the scope and key of a keyed boundary unit) and its position
// among the UUIDs derived in the unit, those of NewUUID and NewMessage included. A run of the same
// cause again after its commit was lost (a failover to an asynchronous standby, a restore) that
// records in the same order hands the applier the UUIDs of the first run, which it has seen. In a
// boundary unit without a key, whose cause is new on every call, it is random (version 7). See
// docs/boundary.md, "Effect UUIDs derived from their cause".
func Record(ctx context.Context, kind string, payload []byte) error {
	u := unitFrom(ctx)
	if u == nil {
		return ErrNoUnitOfWork
	}
	if _, ok := u.o.applier(kind); !ok {
		return fmt.Errorf("%w: %q (register it with Outbox.RegisterApplier)", ErrUnknownApplier, kind)
	}
	return u.record(ctx, []Effect{{Kind: kind, UUID: NewUUID(ctx), Payload: append([]byte(nil), payload...)}})
}

// addCausation ties a recorded message to its cause: the causation ID, the metadata set with
// WithMetadata, and the correlation ID and trace context of the incoming message. What the message
// sets itself wins.
func (u *unit) addCausation(ctx context.Context, md map[string]string) {
	setDefault := func(k, v string) {
		if _, ok := md[k]; !ok && v != "" {
			md[k] = v
		}
	}
	setDefault(MetadataCausationID, u.src.ID)
	if extra, ok := ctx.Value(metadataKey{}).(map[string]string); ok {
		for k, v := range extra {
			setDefault(k, v)
		}
	}
	if _, ok := md[MetadataTraceparent]; !ok && trace.SpanContextFromContext(ctx).IsValid() {
		// The span that records the message (the handler's, or the application's own inside it)
		// is the message's parent.
		tc := map[string]string{}
		u.o.tel.prop.Inject(ctx, metadataCarrier(tc))
		for k, v := range tc {
			setDefault(k, v)
		}
	}
	if u.incoming != nil {
		for _, k := range propagated {
			v := u.incoming.Metadata.Get(k)
			if len(v) > maxPropagatedBytes {
				// Copied onto every message the handler sends, a value this large would multiply
				// (a 4 MiB correlation ID stored 20 MiB for five small messages) or push each one
				// over MaxPayloadBytes: the messages go without it.
				u.warnNotPropagated(k, len(v))
				continue
			}
			setDefault(k, v)
		}
	}
}

// maxPropagatedBytes bounds an incoming correlation ID or trace header copied onto the messages a
// handler sends (W3C asks tracestate to fit in 512 bytes; IDs are much shorter).
const maxPropagatedBytes = 4096

// warnNotPropagated logs, once per unit of work, an incoming value too large to copy.
func (u *unit) warnNotPropagated(key string, size int) {
	u.mu.Lock()
	defer u.mu.Unlock()
	if u.warned {
		return
	}
	u.warned = true
	u.o.logger.Info("Incoming metadata too large to copy onto the messages sent: not copied", watermill.LogFields{
		"consumer": u.src.Consumer, "message_id": u.src.ID, "key": key, "bytes": size, "limit": maxPropagatedBytes})
}

// record stores effects in the transaction at once, so that they commit with the business writes
// even if the handler finishes the transaction itself. Records of concurrent callers take turns:
// each gets its own positions (Seq), in the order of the inserts.
func (u *unit) record(ctx context.Context, effects []Effect) error {
	if len(effects) == 0 {
		return nil
	}
	key, _ := ctx.Value(orderingKeyKey{}).(string)
	if key == "" {
		key = defaultOrderingKey(u.src)
	}
	if err := validateName(key); err != nil {
		return fmt.Errorf("outbox: ordering key: %w", err)
	}
	for i := range effects {
		// Metadata is stored and sent with every message: it counts within the limit.
		md := 0
		for k, v := range effects[i].Metadata {
			md += len(k) + len(v)
		}
		if len(effects[i].Payload)+md > u.o.cfg.MaxPayloadBytes {
			return fmt.Errorf("%w: payload %d bytes and metadata %d bytes, the limit of the two is %d (Config.MaxPayloadBytes)",
				ErrPayloadTooLarge, len(effects[i].Payload), md, u.o.cfg.MaxPayloadBytes)
		}
		effects[i].OrderingKey = key
		effects[i].Source = u.src
	}
	due, delayed := ctx.Value(dueKey{}).(time.Time)
	cancelKey, _ := ctx.Value(cancelKeyKey{}).(string)
	if cancelKey != "" && !delayed {
		return ErrCancelKeyWithoutDelay
	}
	if cancelKey != "" {
		if err := validateName(cancelKey); err != nil {
			return fmt.Errorf("outbox: cancel key: %w", err)
		}
	}
	u.mu.Lock()
	defer u.mu.Unlock()
	if u.finished {
		return ErrUnitOfWorkFinished
	}
	for i := range effects {
		effects[i].Seq = u.recorded + i
	}
	if delayed {
		dt, ok := u.tx.(outboxdriver.DelayedUnitTx)
		if !ok {
			return ErrDelayUnsupported
		}
		for i := range effects {
			effects[i].DueAt, effects[i].CancelKey = due, cancelKey
		}
		if err := dt.RecordDelayed(ctx, effects); err != nil {
			return u.failed(fmt.Errorf("outbox: store delayed side effects: %w", err))
		}
		u.recorded += len(effects)
		// This process's relay wakes at the due time (another's finds it at its next pass).
		// Armed before the commit: a wake-up for a unit that rolls back costs one empty pass.
		// Armed again once it committed (dueCommitted): a due time that comes before the
		// commit wakes a relay that cannot see the effect yet.
		u.o.due.arm(due)
		if u.due.IsZero() || due.Before(u.due) {
			u.due = due
		}
		return nil
	}
	if err := u.tx.Record(ctx, effects); err != nil {
		return u.failed(fmt.Errorf("outbox: store side effects: %w", err))
	}
	u.effects = append(u.effects, effects...)
	u.recorded += len(effects)
	return nil
}

// failed notes a record the store refused (u.mu held) and returns its error.
func (u *unit) failed(err error) error {
	u.storeFailed = true
	if u.recordErr == nil {
		u.recordErr = err
	}
	return err
}

// dispatch sends effects in order and stops at the first failure, so that later effects never
// overtake an earlier one. Consecutive messages to one topic go in one Publish call. It returns
// how many effects were sent, and how many the call that failed covered (effects[sent:sent+failed]).
// path names the dispatch path in the metrics.
func (o *Outbox) dispatch(ctx context.Context, path string, effects []Effect) (sent, failed int, err error) {
	for i := 0; i < len(effects); {
		e := effects[i]
		j := i + 1
		if e.Kind != KindPublish {
			err = o.apply(ctx, e)
		} else {
			for j < len(effects) && effects[j].Kind == KindPublish && effects[j].Topic == e.Topic {
				j++
			}
			err = o.publish(ctx, e.Topic, effects[i:j])
		}
		set := o.tel.attrs(AttrPath, path, AttrKind, kindName(e.Kind))
		if err != nil {
			o.tel.dispatchFailures.Add(ctx, int64(j-i), set)
			return i, j - i, err
		}
		o.tel.dispatched.Add(ctx, int64(j-i), set)
		lagSet := o.tel.attrs(AttrPath, path, "", "")
		for _, d := range effects[i:j] {
			if !d.StoredAt.IsZero() {
				o.tel.dispatchLag.Record(ctx, time.Since(d.StoredAt).Seconds(), lagSet)
			}
		}
		o.health.succeeded(e)
		retried := false
		for _, d := range effects[i:j] {
			retried = retried || d.Failures > d.Attempts // it failed while its target was down
		}
		if o.recovery.succeededCall(e, retried) {
			o.kickRelay() // its next turn makes the destination's backed-off effects due
		}
		if err := o.failpoint(ctx, FailpointAfterPublish); err != nil {
			return j, 0, err
		}
		i = j
	}
	return len(effects), 0, nil
}

// apply calls the applier of e, bounded by PublishTimeout (its context carries the deadline, and
// an applier that ignores it is waited for no longer), with its panics turned into errors.
func (o *Outbox) apply(ctx context.Context, e Effect) error {
	fn, ok := o.applier(e.Kind)
	if !ok {
		return fmt.Errorf("%w: %q (effect %s)", ErrUnknownApplier, e.Kind, e.UUID)
	}
	ctx, cancel := context.WithTimeout(ctx, o.cfg.PublishTimeout)
	defer cancel()
	err := o.bounded(ctx, func() string { return fmt.Sprintf("applier %q (effect %s)", e.Kind, e.UUID) }, func() error { return fn(ctx, e) })
	if err != nil {
		return fmt.Errorf("outbox: applier %q (effect %s): %w", e.Kind, e.UUID, err)
	}
	return nil
}

func (o *Outbox) publish(ctx context.Context, topic string, effects []Effect) error {
	msgs := make([]*message.Message, len(effects))
	for i, e := range effects {
		m := message.NewMessage(e.UUID, e.Payload)
		m.Metadata = maps.Clone(e.Metadata)
		if m.Metadata == nil {
			m.Metadata = message.Metadata{}
		}
		if e.OrderingKey != "" {
			m.Metadata.Set(MetadataOrderingKey, e.OrderingKey)
		}
		m.SetContext(ctx)
		msgs[i] = m
	}
	// Publisher.Publish takes no context; a hung broker must not hang the consumer forever.
	ctx, cancel := context.WithTimeout(ctx, o.cfg.PublishTimeout)
	defer cancel()
	err := o.bounded(ctx, func() string { return fmt.Sprintf("publish %d message(s) to %q", len(msgs), topic) },
		func() error { return o.pub.Publish(topic, msgs...) })
	if errors.Is(err, context.DeadlineExceeded) && !errors.Is(err, errCallerDeadline) {
		return fmt.Errorf("%w: %d message(s) to %q after %s", ErrPublishTimeout, len(msgs), topic, o.cfg.PublishTimeout)
	}
	if err != nil {
		return fmt.Errorf("outbox: publish %d message(s) to %q: %w", len(msgs), topic, err)
	}
	return nil
}

// errCallerDeadline marks a call that returned its own deadline error (rather than one that
// bounded gave up waiting for).
var errCallerDeadline = errors.New("returned by the call")

// bounded runs call (a Publisher or an applier: code that may ignore ctx) in a goroutine of its
// own, which first grows its stack, and waits for it until ctx is done. A panic in call is
// returned as an error wrapping ErrEffectPanicked. A call that never returns keeps its goroutine,
// but not the caller. what names the call in an error (made only for one).
func (o *Outbox) bounded(ctx context.Context, what func() string, call func() error) error {
	done := make(chan error, 1)
	go func() {
		defer func() {
			if r := recover(); r != nil {
				done <- fmt.Errorf("%w: %s: %v\n%s", ErrEffectPanicked, what(), r, debug.Stack())
			}
		}()
		growStack()
		err := call()
		if errors.Is(err, context.DeadlineExceeded) {
			err = fmt.Errorf("%w (%w)", err, errCallerDeadline)
		}
		done <- err
	}()
	select {
	case err := <-done:
		return err
	case <-ctx.Done():
		select {
		case err := <-done: // it returned just as ctx ended: its outcome is known
			return err
		default:
		}
		return fmt.Errorf("waiting for %s: %w", what(), ctx.Err())
	}
}

// publishStack is the stack a publishing goroutine grows to before it calls the Publisher.
const publishStack = 24 << 10

// growStack grows the calling goroutine's stack to more than publishStack while it is still
// shallow, where the runtime's copy of it costs next to nothing. A new goroutine starts with a
// small stack; broker clients call deep (NATS decodes its acknowledgement as JSON), and growing it
// there copies a deep stack, once or twice per message: a tenth of the consumer path's throughput
// in the benchmark. Handle and InUnit call it too, on the goroutine of the message or request.
//
//go:noinline
func growStack() byte {
	var buf [publishStack]byte
	return lastByte(buf[:])
}

//go:noinline
func lastByte(b []byte) byte { return b[len(b)-1] }

// storeProduced turns the messages an AddHandler handler returns into side effects, so that the
// Router does not publish them a second time outside the transaction.
func (o *Outbox) storeProduced(ctx context.Context, topic string, produced []*message.Message) error {
	if topic == "" {
		return fmt.Errorf("outbox: the handler returned %d message(s) but has no publish topic (use AddConsumerHandler with outbox.Publish, or AddHandler with a topic)", len(produced))
	}
	return Publish(ctx, topic, produced...)
}

// dispatchAndMark sends effects and queues their mark. claimed is no later than the time the claim
// of src was written with (zero if unknown): when the effects went out within ClaimClockSlack of
// it, that time stands for their dispatch and the mark leaves the claim alone. A failed dispatch
// is recorded at once, and returned as ErrDispatchFailed.
func (o *Outbox) dispatchAndMark(ctx context.Context, path string, src Source, effects []Effect, claimed time.Time, fields watermill.LogFields) (err error) {
	if len(effects) == 0 {
		return nil
	}
	ctx, traced := o.tel.startDispatch(ctx, path, effects, true)
	defer func() { traced(err) }()
	if blocked, err := o.keyBlocked(ctx, src, effects); err != nil {
		if o.outage(ctx, err) {
			// The database went since the commit: Handle runs the unit again once a probe
			// answers, and finds the claim committed (the duplicate path sends the effects,
			// without waiting for this dispatch, which is known to have ended).
			o.failedHere.add(src)
			return fmt.Errorf("%w: outbox: check ordering keys: %w", errWaitForDatabase, err)
		}
		return fmt.Errorf("outbox: check ordering keys: %w", err)
	} else if blocked {
		// The effects are committed; the relay sends them after the earlier ones, in order. Those
		// kept in the claim (the database/sql form keeps there the ones of the message's own key)
		// become rows first, which the relay sends at once rather than after the grace period.
		if hasInline(effects) {
			if _, err := o.materialize(ctx, src, effects, 0); err != nil {
				return fmt.Errorf("outbox: hand side effects to the relay: %w", err)
			}
		}
		return o.handToRelay(ctx, src)
	}
	sent, failed, err := o.dispatch(ctx, path, effects)
	// What a failure counts is judged as of the failure, not after the move below, whose time
	// would let a success just before it look older than the effects.
	failedAt := time.Now()
	if err != nil && hasInline(effects) {
		// Inline effects are marked all at once; after a partial failure each is marked,
		// counted and retried on its own, as a row.
		rows, merr := o.materialize(ctx, src, effects, 0) // the failure recorded next sets their retry time
		if merr != nil || len(rows) != len(effects) {
			o.failedHere.add(src)
			o.relayNeeded(fields)
			return fmt.Errorf("%w: %d of %d side effects of %q for %q: %w (they stay with the claim until the relay takes them over: %v)",
				ErrDispatchFailed, len(effects)-sent, len(effects), src.ID, src.Consumer, err, merr)
		}
		effects = rows
	}
	o.marks.add(src, effects[:sent], claimed.IsZero() || time.Since(claimed) > ClaimClockSlack, claimed)
	if err != nil {
		if failed > 0 {
			o.dispatchFailed(ctx, src, effects, sent, failed, err, failedAt)
		}
		// Committed effects stay pending: redelivery or the relay sends them with the same UUIDs.
		err = fmt.Errorf("%w: %d of %d side effects of %q for %q: %w", ErrDispatchFailed, len(effects)-sent, len(effects), src.ID, src.Consumer, err)
		if failed > 0 {
			return counted(err, effects[sent].Failures+1)
		}
		return err
	}
	return o.failpoint(ctx, FailpointAfterMark)
}
