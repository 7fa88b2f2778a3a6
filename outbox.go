package outbox

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"io"
	"sync"
	"sync/atomic"
	"time"
	"unicode/utf8"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/watermill-outbox/outbox/outboxdriver"
)

// Applier applies one custom side effect after commit. It may be called more than once for the same
// effect (at-least-once): use e.UUID as an idempotency key where the target supports one.
type Applier func(ctx context.Context, e Effect) error

// Outbox is the framework's entry point: it owns the configuration, the store and the appliers.
// It is safe for concurrent use.
type Outbox struct {
	cfg    Config
	db     *sql.DB
	store  outboxdriver.Store
	units  outboxdriver.UnitStore // begins the transactions of units of work
	pub    message.Publisher
	logger watermill.LoggerAdapter

	mu       sync.RWMutex
	appliers map[string]Applier

	kick  chan struct{} // wakes the relay
	due   dueTimer      // wakes the relay when a delayed effect is due
	marks *marker
	tel   *telemetry
	// claimSeesDelayed: the store's claim reads when the next delayed effect is due
	// (EffectClaim.Delayed), so a relay pass moves delayed effects only when one is due.
	claimSeesDelayed atomic.Bool
	// health tells a poison effect from an outage (see health.counts).
	health health
	// recovery holds the destinations whose calls failed, so that the effects that back off for
	// one become due once it takes a call again.
	recovery recovery
	// breakers holds the destinations the relay leaves alone for a while because their calls hung.
	breakers breakers
	// failedHere holds the sources whose dispatch failed in this process lately: a redelivered
	// copy of one of them never waits for an original that is known to have failed.
	failedHere recentSources
	// failingHere holds the messages whose handler failed in this process lately: only their
	// deliveries look for an operator's request to dead-letter them at once (outbox dead now),
	// so that the others pay no read for it.
	failingHere recentSources
	// relaysRunning counts the Run calls in progress; noRelayWarned lets the missing relay be
	// reported once a minute.
	relaysRunning atomic.Int32
	noRelayWarned oncePer
	// lastHandoff is when (UnixNano) effects were last left to the relays, here or, as far as a
	// notification told, in another instance: until they are sent, each written mark wakes the
	// relay, since effects handed over behind the marked ones may be free to go.
	lastHandoff atomic.Int64
	// gate holds work back while the database is unreachable (see dbGate); nil when
	// ReconnectDelay is negative.
	gate *dbGate
	// keysHeld wakes the retries of this process that wait for a key a unit of this process holds.
	keysHeld heldKeys
}

// New returns an Outbox. It does no I/O: call Migrate (or check the schema) and Run yourself.
func New(cfg Config) (*Outbox, error) {
	cfg.setDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, fmt.Errorf("outbox: invalid config: %w", err)
	}
	logger, storeErrs := cfg.Logger, &oncePer{}
	var gate *dbGate
	if cfg.ReconnectDelay >= 0 {
		gate = &dbGate{minDelay: cfg.ReconnectDelay, maxDelay: cfg.ReconnectDelayMax, probe: cfg.DB.PingContext}
	}
	var storeFailpoint func(context.Context, string) error
	if fp := cfg.Failpoint; fp != nil {
		storeFailpoint = func(ctx context.Context, point string) error {
			if err := fp(ctx, point); err != nil {
				return fmt.Errorf("%w %s: %w", ErrFailpoint, point, err)
			}
			return nil
		}
	}
	st, err := cfg.Driver.Open(cfg.DB, outboxdriver.StoreOptions{
		Schema: cfg.Schema, TablePrefix: cfg.TablePrefix, DeleteDispatched: cfg.EffectRetention == 0,
		OnError: func(what string, err error) {
			gate.observe(err)
			if storeErrs.allow(time.Minute) { // it retries every relay round
				logger.Error("outbox: "+what+" failed", err, nil)
			}
		},
		Failpoint: storeFailpoint,
	})
	if err != nil {
		return nil, fmt.Errorf("outbox: open store: %w", err)
	}
	o := &Outbox{
		cfg:      cfg,
		db:       cfg.DB,
		store:    st,
		pub:      cfg.Publisher,
		logger:   cfg.Logger,
		appliers: map[string]Applier{},
		kick:     make(chan struct{}, 1),
	}
	o.due.kick = o.kickRelay
	if gate != nil {
		o.gate = gate
		gate.unreachable = o.unreachable
		gate.onAttempt = func() { o.tel.dbUnreachable.Add(context.Background(), 1) }
		gate.onChange = o.reachabilityChanged
	}
	o.units = sqlUnits{db: cfg.DB, store: st, spilled: func(ctx context.Context) { o.tel.spills.Add(ctx, 1) }}
	if us, ok := st.(outboxdriver.UnitStore); ok {
		o.units = us
	}
	o.failedHere.ttl = cfg.DuplicateWait + cfg.PublishTimeout + time.Minute
	o.failingHere.ttl = time.Hour
	o.marks = newMarker(o)
	if o.tel, err = newTelemetry(o); err != nil {
		return nil, fmt.Errorf("outbox: create instruments: %w", err)
	}
	o.warnUnsafePublisher()
	return o, nil
}

// Migrate creates or upgrades the outbox tables. It is idempotent and safe to call from several
// instances at once.
func (o *Outbox) Migrate(ctx context.Context) error {
	if err := o.store.Migrate(ctx); err != nil {
		return fmt.Errorf("outbox: migrate: %w", err)
	}
	return nil
}

// CheckSchema returns an error wrapping ErrSchemaMissing or ErrSchemaOutdated when Migrate is needed.
func (o *Outbox) CheckSchema(ctx context.Context) error {
	return o.store.SchemaCheck(ctx)
}

// Close releases what the Outbox holds: the store's prepared statements, and the database/sql
// handle a driver opened itself (the pgx driver's, on its pool: the pool stays open). It does not
// close Config.DB or the Publisher, which are the caller's. Call it after Run returned and the
// handlers stopped.
func (o *Outbox) Close() error {
	o.marks.wait()
	if c, ok := o.store.(io.Closer); ok {
		if err := c.Close(); err != nil {
			return fmt.Errorf("outbox: close: %w", err)
		}
	}
	return nil
}

// Config returns the configuration the Outbox runs with, defaults applied.
func (o *Outbox) Config() Config { return o.cfg }

// Store returns the store, for operations tooling and tests.
func (o *Outbox) Store() outboxdriver.Store { return o.store }

// RegisterApplier registers fn under name for side effects recorded with Record. Register every
// applier before messages that record it can be dispatched, in every process: an effect whose
// applier is unknown is retried and eventually parked, never dropped.
func (o *Outbox) RegisterApplier(name string, fn Applier) error {
	if err := validateName(name); err != nil {
		return fmt.Errorf("outbox: applier name: %w", err)
	}
	if fn == nil {
		return fmt.Errorf("outbox: applier %q is nil", name)
	}
	o.mu.Lock()
	defer o.mu.Unlock()
	if _, ok := o.appliers[name]; ok {
		return fmt.Errorf("outbox: applier %q registered twice", name)
	}
	o.appliers[name] = fn
	o.tel.startKind(context.Background(), kindName(name))
	return nil
}

func (o *Outbox) applier(name string) (Applier, bool) {
	o.mu.RLock()
	defer o.mu.RUnlock()
	fn, ok := o.appliers[name]
	return fn, ok
}

// Run runs the background work until ctx is cancelled: the relay that dispatches side effects left
// undispatched (after a crash, a broker outage, or a message that was never redelivered), and the
// retention cleanup. Run it in every instance; cleanup runs on one instance at a time. It returns
// nil when ctx is cancelled, after the dispatched marks queued so far were written.
func (o *Outbox) Run(ctx context.Context) error {
	o.relaysRunning.Add(1)
	defer o.relaysRunning.Add(-1)
	if stop, err := o.tel.registerGauges(); err != nil {
		o.logger.Error("Registering the outbox gauges failed; they are not reported", err, nil)
	} else {
		defer stop()
	}
	var wg sync.WaitGroup
	wg.Add(3)
	go func() { defer wg.Done(); o.listen(ctx) }()
	go func() { defer wg.Done(); o.runEvery(ctx, o.cfg.RelayInterval, o.kick, "relay", o.relayOnce) }()
	go func() { defer wg.Done(); o.runEvery(ctx, o.cfg.CleanupInterval, nil, "cleanup", o.cleanupOnce) }()
	if o.cfg.StatsInterval > 0 {
		wg.Add(1)
		go func() { defer wg.Done(); o.runEvery(ctx, o.cfg.StatsInterval, nil, "stats sampling", o.sampleStats) }()
	}
	if o.cfg.Redrive.After > 0 && o.deadLetterStore() != nil {
		wg.Add(1)
		go func() {
			defer wg.Done()
			o.runEvery(ctx, min(o.cfg.Redrive.After, time.Minute), nil, "dead-letter redrive", o.redriveOnce)
		}()
	}
	wg.Wait()
	o.due.stop()
	o.marks.wait() // a clean shutdown leaves no mark unwritten, so nothing is re-sent after it
	return nil
}

func (o *Outbox) runEvery(ctx context.Context, every time.Duration, wake <-chan struct{}, name string, fn func(context.Context) error) {
	t := time.NewTicker(every)
	defer t.Stop()
	for {
		// In an outage the loop waits for the database, rather than fail against it every round.
		if err := o.gate.wait(ctx); err == nil {
			err := fn(ctx)
			if !o.gate.observe(err) && err != nil && ctx.Err() == nil {
				o.logger.Error("outbox "+name+" failed", err, nil)
			}
		}
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		case <-wake:
		}
	}
}

func (o *Outbox) failpoint(ctx context.Context, point string) error {
	if o.cfg.Failpoint == nil {
		return nil
	}
	if err := o.cfg.Failpoint(ctx, point); err != nil {
		return fmt.Errorf("%w %s: %w", ErrFailpoint, point, err)
	}
	return nil
}

// validateName checks a message ID, topic or name that is stored as text.
func validateName(s string) error {
	switch {
	case s == "":
		return fmt.Errorf("empty")
	case len(s) > maxIDLength:
		return fmt.Errorf("%d bytes, more than %d", len(s), maxIDLength)
	case !utf8.ValidString(s):
		return fmt.Errorf("%q is not valid UTF-8", s)
	}
	for i := 0; i < len(s); i++ {
		if s[i] == 0 {
			return fmt.Errorf("%q contains a NUL byte", s)
		}
	}
	return nil
}

// ParkedEffects lists up to limit side effects the relay gave up on, oldest first.
func (o *Outbox) ParkedEffects(ctx context.Context, limit int) ([]ParkedEffect, error) {
	return o.store.EffectListParked(ctx, limit)
}

// RetryParked makes parked effects due again, with a fresh attempt count, and wakes the relay.
func (o *Outbox) RetryParked(ctx context.Context, storeIDs ...int64) (int, error) {
	n, err := o.store.EffectUnpark(ctx, storeIDs)
	if err == nil {
		o.kickRelay()
	}
	return n, err
}

// DiscardParked gives parked effects up for good: they are marked dispatched without being sent,
// which unblocks the later effects with their ordering keys. The retention of the message that
// caused them counts from the discard.
func (o *Outbox) DiscardParked(ctx context.Context, storeIDs ...int64) (int, error) {
	n, err := o.store.EffectDiscard(ctx, storeIDs)
	if err == nil {
		o.kickRelay()
	}
	return n, err
}

// ReplayPoisoned lets a message that was moved to the poison topic be processed again, once the
// cause is fixed: it forgets its poisoned claim and its failed attempts, so that the next delivery
// of the message to consumer runs the handler (a copy still in the broker, or the message put back
// on its topic from the poison topic, with its ID unchanged). It reports whether the message was
// poisoned; a message that was processed normally is left alone. The dead letter of a message
// dead-lettered, if still dead, is marked retried in the same transaction (with no actor), so
// that it is no longer listed as dead and RetryDeadLetters does not hand it over again.
func (o *Outbox) ReplayPoisoned(ctx context.Context, consumer, messageID string) (bool, error) {
	src := Source{Consumer: consumer, ID: messageID}
	if err := validateName(consumer); err != nil {
		return false, fmt.Errorf("%w: %w", ErrNoConsumerName, err)
	}
	if err := validateName(messageID); err != nil {
		return false, fmt.Errorf("%w: %w", ErrInvalidMessageID, err)
	}
	ok, err := o.store.MessageReplay(ctx, src)
	if err != nil {
		return false, fmt.Errorf("outbox: replay poisoned message %q of %q: %w", messageID, consumer, err)
	}
	return ok, nil
}

// listenDeafRetry is how long the relay polls before it listens again after a listener that
// received nothing (ErrListenerDeaf): the cause (a pooler in transaction mode) is configuration.
const listenDeafRetry = 30 * time.Second

// listen wakes the relay on notifications from other instances, reconnecting after failures.
func (o *Outbox) listen(ctx context.Context) {
	defer o.tel.listening.Store(false)
	for ctx.Err() == nil {
		if o.gate.wait(ctx) != nil {
			return
		}
		connected := false
		err := o.store.EffectListen(ctx, func() {
			o.tel.listening.Store(true)
			o.tel.listenDeaf.Store(nil)
			if connected {
				// A notification: another instance handed effects off, which may wait behind
				// effects whose marks this process is writing. The first call is the listener
				// connecting, after which one round looks for what was missed meanwhile; taken
				// for a hand-off it had the relay run a round behind every batch of marks for
				// a minute after every start.
				o.lastHandoff.Store(time.Now().UnixNano())
			}
			connected = true
			o.kickRelay()
		})
		o.tel.listening.Store(false)
		o.gate.observe(err)
		if errors.Is(err, outboxdriver.ErrListenUnsupported) {
			o.tel.listenUnsupported.Store(true)
			return
		}
		if err != nil && ctx.Err() == nil {
			retry := time.Second
			if errors.Is(err, outboxdriver.ErrListenerDeaf) {
				retry = listenDeafRetry
				reason := err.Error()
				o.tel.listenDeaf.Store(&reason)
				o.tel.listenerDeaf.Add(ctx, 1)
				if o.tel.deafWarned.allow(10 * time.Minute) {
					o.logger.Error("The relay's listener receives no notifications; the relay polls every RelayInterval, "+
						"and other instances' failed dispatches wait for its next round", err, nil)
				}
			} else {
				o.logger.Error("Listening for relay wake-ups failed; retrying", err, nil)
			}
			select {
			case <-ctx.Done():
			case <-time.After(retry):
			}
		}
	}
}

// unreachable tells a failure that means the database cannot be reached now: one the framework
// knows (a failed dial, PostgreSQL's SQLSTATEs), or one the store says is.
func (o *Outbox) unreachable(err error) bool {
	if unreachable(err) {
		return true
	}
	c, ok := o.store.(outboxdriver.ReachabilityClassifier)
	return ok && c.Unreachable(err)
}

// reachabilityChanged logs an outage of the database when it begins and when it ends.
func (o *Outbox) reachabilityChanged(since time.Time, attempts int64, err error) {
	if err != nil {
		o.logger.Error("The database is unreachable; work on it waits for one probe at a time, ReconnectDelay apart, doubling up to ReconnectDelayMax",
			err, watermill.LogFields{"since": since})
		return
	}
	o.logger.Info("The database is reachable again", watermill.LogFields{
		"unreachable_for": time.Since(since).Round(time.Millisecond).String(), "failed_attempts": attempts})
}

// wakeRelays wakes this process's relay and, through the store, the relays of the other instances.
func (o *Outbox) wakeRelays(ctx context.Context) {
	o.lastHandoff.Store(time.Now().UnixNano())
	o.kickRelay()
	if err := o.store.EffectNotify(ctx); err != nil {
		o.logger.Error("Notifying the relays failed; they pick the effects up at their next poll", err, nil)
	}
}

// handoffsInFlight tells whether effects were left to the relays recently enough that they may
// still wait behind effects whose marks are being written: long enough for their predecessors'
// dispatch (PublishTimeout) and mark (markTimeout) to finish.
func (o *Outbox) handoffsInFlight() bool {
	return time.Since(time.Unix(0, o.lastHandoff.Load())) < o.cfg.PublishTimeout+markTimeout
}

// kickRelay wakes this process's relay without waiting for RelayInterval.
func (o *Outbox) kickRelay() {
	select {
	case o.kick <- struct{}{}:
	default:
	}
}

// oncePer lets one caller through per interval: for log lines that would otherwise repeat with
// every message.
type oncePer struct{ last atomic.Int64 } // UnixNano of the last caller let through

func (r *oncePer) allow(every time.Duration) bool {
	now := time.Now().UnixNano()
	last := r.last.Load()
	return now-last >= int64(every) && r.last.CompareAndSwap(last, now)
}
