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

	"github.com/watermill-outbox/outbox/internal/engine"
	"github.com/watermill-outbox/outbox/internal/fanout"
	"github.com/watermill-outbox/outbox/outboxdriver"
)

// Applier applies one custom side effect after commit. It may be called more than once for the same
// effect (at-least-once): use e.UUID as an idempotency key where the target supports one.
type Applier func(ctx context.Context, e Effect) error

// Outbox is the framework's entry point: it owns the configuration, the store and the appliers.
// It is safe for concurrent use.
type Outbox struct {
	cfg       Config
	cleanupAt cleanupResume // where the cleanup service's runs got to
	db        *sql.DB
	store     outboxdriver.Store
	units     outboxdriver.UnitStore // begins the transactions of units of work
	pub       message.Publisher
	logger    watermill.LoggerAdapter

	mu       sync.RWMutex
	appliers map[string]Applier

	kick  engine.Wakeup // wakes the relay
	due   dueTimer      // wakes the relay when a delayed effect is due
	marks *marker
	tel   *telemetry
	// busy ends the backoff of the statistics sampling: a commit, a notification, a relay pass
	// that sent something. Its gauges then change, and are sampled every StatsInterval again.
	busy engine.Wakeup
	// statsPrev is the previous sample's Retained: only sampleStats, which the engine never runs
	// twice at once, touches it.
	statsPrev int64
	// claimSeesDelayed: the store's claim reads when the next delayed effect is due
	// (EffectClaim.Delayed), so a relay pass moves delayed effects only when one is due.
	claimSeesDelayed atomic.Bool
	// health tells a poison effect from an outage (see health.counts).
	health health
	// recovery holds the destinations whose calls failed, so that the effects that back off for
	// one become due once it takes a call again.
	recovery recovery
	// healthSample is the last sample Health took itself (healthStats).
	healthSample struct {
		mu     sync.Mutex // held while one is taken
		lastMu sync.Mutex // guards the fields below
		taken  bool
		at     time.Time
		s      Stats
		err    error
	}
	// leaseForTest, when set (by a test, before Run), is the relay's lease instead of relayLease's.
	leaseForTest time.Duration
	// breakers holds the destinations the relay leaves alone for a while because their calls hung.
	breakers breakers
	// failedHere holds the sources whose dispatch failed in this process lately: a redelivered
	// copy of one of them never waits for an original that is known to have failed.
	failedHere recentSources
	// failingHere holds the messages whose handler failed in this process lately: only their
	// deliveries look for an operator's request to dead-letter them at once (outbox dead now),
	// so that the others pay no read for it.
	failingHere recentSources
	// relaysRunning counts the Run calls (and engines joined) in progress; noRelayWarned lets the
	// missing relay be reported once a minute.
	relaysRunning atomic.Int32
	// retired: closed, or removed from its tenant.Set, and not run since: outbox.relay.running is
	// not reported (see reportPresence).
	retired       atomic.Bool
	noRelayWarned oncePer
	// lifeMu guards life: the background life of the Outbox now (nil when none). One Outbox runs
	// one background life at a time: two (Run twice at once, Run and a tenant.Set, two Sets)
	// stopped each other's timers, doubled its gauges' registration, and the first to stop wrote
	// the marks while the other still queued them. A life whose shutdown gave up (a call that
	// ignores its context) lets a new one begin: its stop, should the call ever return, then
	// leaves the new life's timer alone.
	lifeMu sync.Mutex
	life   *backgroundLife
	// relayIdleMax is the IdleMax of the engine the relay runs on (nanoseconds; 0 under Run):
	// how far apart an idle member's relay rounds may be, for relayHealth.
	relayIdleMax atomic.Int64
	// lastHandoff is when (UnixNano) effects were last left to the relays, here or, as far as a
	// notification told, in another instance: until they are sent, each written mark wakes the
	// relay, since effects handed over behind the marked ones may be free to go.
	lastHandoff atomic.Int64
	// gate holds work back while the database is unreachable (see dbGate); nil when
	// ReconnectDelay is negative.
	gate *dbGate

	// pings holds the ping of Health under way, shared by the checks that come while it is out.
	pings fanout.Shared[struct{}, error]
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
	var gate *dbGate // set once the store is open (joinGate)
	var ob *Outbox   // likewise
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
		Unreachable: func(err error) bool {
			if ob == nil {
				return unreachable(err)
			}
			return ob.unreachable(err)
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
	}
	o.due.kick = o.kickRelay
	o.joinGate()
	gate, ob = o.gate, o
	o.units = sqlUnits{db: cfg.DB, store: st, spilled: func(ctx context.Context) { o.tel.spills.Add(ctx, 1, o.tel.own()) },
		watch: newBeginWatch(gate, cfg.DB)}
	if us, ok := st.(outboxdriver.UnitStore); ok {
		o.units = us
		if dw, ok := st.(outboxdriver.DialWatcher); ok && gate != nil {
			dw.WatchDials(func() func() {
				t := time.AfterFunc(beginStall, func() {
					gate.suspect(fmt.Errorf("a new connection had no answer within %s", beginStall))
				})
				return func() { t.Stop() }
			})
		} else if gate != nil {
			o.units = watchedUnits{UnitStore: us, watch: &beginWatch{gate: gate, db: cfg.DB, blind: func() bool { return true }}}
		}
	}
	o.failedHere.ttl = cfg.DuplicateWait + cfg.PublishTimeout + time.Minute
	o.failingHere.ttl = time.Hour
	o.marks = newMarker(o)
	if su, ok := o.units.(sqlUnits); ok {
		su.marks = o.marks
		o.units = su
	}
	if o.tel, err = newTelemetry(o); err != nil {
		return nil, fmt.Errorf("outbox: create instruments: %w", err)
	}
	if gate != nil {
		gate.users.add(o) // ready to hear of outages from the work of the others
	}
	o.reportPresence()
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
	o.retired.Store(true)
	if o.gate != nil {
		o.gate.users.remove(o) // its handle on the pool may be closed with it
	}
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
// nil when ctx is cancelled, after the dispatched marks queued so far were written, or an error
// after ShutdownTimeout when a background call ignores its context and keeps it from returning.
func (o *Outbox) Run(ctx context.Context) error {
	life, err := o.beginLife("Run")
	if err != nil {
		return fmt.Errorf("outbox: run: %w", err)
	}
	o.relayIdleMax.Store(0)
	o.startServices(ctx, life)
	// The periodic services run on an engine of their own, as its one member: the engine a Set
	// of Outboxes shares is the same code with more members (JoinEngine).
	// No ping of a run without an answer (engine.Prober): the Outbox is the engine's only
	// member, and its other tasks wait for its gate anyway; abandoned early, the run would free
	// nothing for anyone.
	eng := engine.New(engine.Config{Logger: o.logger, StallAfter: -1})
	if _, err := eng.Add(o.engineMember("", 0, nil)); err != nil {
		life.stop()
		return fmt.Errorf("outbox: run: %w", err)
	}
	if err := eng.Start(ctx); err != nil {
		life.stop()
		return fmt.Errorf("outbox: run: %w", err)
	}
	<-ctx.Done()
	if err := o.shutdown(ctx, eng.Stop, life); err != nil {
		return fmt.Errorf("outbox: run: %w", err)
	}
	return nil
}

// shutdown waits, up to ShutdownTimeout, for the engine's runs in progress to return (leave) and
// then for the services beside them to stop and the marks queued to be written (life.stop), in
// that order, so that no mark is queued after the marks were written. A run that ignores its
// context keeps the rest waiting in the background, and shutdown returns an error naming what it
// waited for: life.stop then runs once that run returns, if the process lives that long, and the
// life is abandoned meanwhile (a new one may begin: a supervisor that runs the Outbox again).
// What the run leaves unwritten is safe: its effects stay leased, and are sent again with the
// same UUIDs when the lease ends (at-least-once, the ID stable).
func (o *Outbox) shutdown(ctx context.Context, leave func(context.Context) error, life *backgroundLife) error {
	timeout := o.cfg.ShutdownTimeout
	sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), timeout)
	defer cancel()
	left := make(chan error, 1)
	stopped := make(chan struct{})
	go func() {
		defer close(stopped)
		err := leave(sctx)
		left <- err
		if err != nil {
			_ = leave(context.WithoutCancel(ctx))
		}
		life.stop()
	}()
	// leave returns by sctx's deadline, naming the runs it still waits for.
	if err := <-left; err != nil {
		life.abandon()
		return fmt.Errorf("gave up after ShutdownTimeout (%s) waiting for the background work to return: %w", timeout, err)
	}
	select {
	case <-stopped:
		return nil
	case <-sctx.Done():
		select {
		case <-stopped:
			return nil
		default:
		}
		life.abandon()
		return fmt.Errorf("gave up after ShutdownTimeout (%s) waiting for the listener to stop and the dispatched marks queued to be written: %w",
			timeout, sctx.Err())
	}
}

// JoinEngine runs the Outbox's background work as member name of eng, an engine shared with
// other Outboxes, until leave is called: the seam through which package tenant's Set runs its
// members on one engine (eng is of an internal package, so no caller outside this module can
// make one). What Run does besides its engine is done here too: the gauges, the listener (when
// the driver has a ListenDSN), the metrics named after the member (unless Config.Member named
// them), and on leave the due timer stopped and the marks queued written.
// With idleMax longer than RelayInterval, a relay pass that found nothing to send doubles the
// wait before the next, up to idleMax; a commit of this process, a notification or a delayed
// effect falling due wakes it at once. The statistics sampling backs off while a sample finds
// nothing waiting and nothing changed, up to statsIdleMax, until work in this process resumes it;
// the cleanup up to ten CleanupIntervals while it deletes nothing. statsBudget, when not nil, is
// shared by the statistics sampling of the engine's members: a busy member's samples may then be
// further apart than StatsInterval, up to the budget's MaxGap, and its gauges count a sample
// stale only that much later.
// pool, when not nil, is shared by the members whose databases are one connection pool: it caps
// their runs at once.
// leave takes the member off eng and waits for its runs in progress, which see their context
// end, and then for the marks queued, up to ShutdownTimeout, as Run does (see shutdown).
func (o *Outbox) JoinEngine(ctx context.Context, eng *engine.Engine, name string, idleMax time.Duration,
	statsBudget *engine.Budget, pool *engine.Pool) (leave func() error, err error) {
	life, err := o.beginLife(fmt.Sprintf("member %q of an engine (a tenant.Set)", name))
	if err != nil {
		return nil, fmt.Errorf("outbox: join engine: %w", err)
	}
	o.tel.nameMember(name) // before the gauges are registered
	o.relayIdleMax.Store(int64(max(idleMax, 0)))
	o.startServices(ctx, life)
	m := o.engineMember(name, idleMax, statsBudget)
	m.Pool = pool
	h, err := eng.Add(m)
	if err != nil {
		life.stop()
		return nil, fmt.Errorf("outbox: join engine: %w", err)
	}
	return func() error {
		if err := o.shutdown(ctx, h.Remove, life); err != nil {
			return fmt.Errorf("outbox: leave engine: %w", err)
		}
		return nil
	}, nil
}

// Retire tells the Outbox that the process no longer runs it, nor holds it to run: a tenant.Set
// calls it for a member it removes. Its outbox.relay.running gauge, which the OutboxRelayStalled
// alert reads to find an Outbox that nothing runs, stops until the Outbox runs again. Close
// retires it too. It changes nothing while the Outbox's background work runs (Run, a Set).
func (o *Outbox) Retire() {
	o.lifeMu.Lock()
	defer o.lifeMu.Unlock()
	if o.life == nil || o.life.abandoned {
		o.retired.Store(true)
	}
}

// startServices starts what runs beside the Outbox's engine tasks (the gauges, the listener) for
// life (from beginLife), and sets life.stop, which ends them and, once the engine tasks returned,
// writes the marks queued. Run and JoinEngine both call it: one life cycle for one Outbox and a
// Set's members.
func (o *Outbox) startServices(ctx context.Context, life *backgroundLife) {
	if o.relaysRunning.Add(1) == 1 {
		o.tel.relayStarted.Store(o.tel.stamp())
	}
	stopGauges := func() {}
	if st, err := o.tel.registerGauges(); err != nil {
		o.logger.Error("Registering the outbox gauges failed; they are not reported", err, nil)
	} else {
		stopGauges = st
	}
	lctx, cancel := context.WithCancel(ctx)
	var wg sync.WaitGroup
	wg.Add(1)
	go func() { defer wg.Done(); o.listen(lctx) }()
	// What reports the life as running ends once: at its stop, or when it is abandoned, which
	// may be long before its stuck call returns and its stop runs, if ever.
	var ended sync.Once
	end := func() {
		ended.Do(func() {
			stopGauges()
			o.relaysRunning.Add(-1)
		})
	}
	life.stop = func() {
		cancel()
		wg.Wait()
		o.lifeMu.Lock()
		current := o.life == life
		if current {
			o.life = nil
		}
		o.lifeMu.Unlock()
		if current {
			o.due.stop() // else the timer is a newer life's
		}
		o.marks.wait() // a clean shutdown leaves no mark unwritten, so nothing is re-sent after it
		end()
		o.marks.poke() // a mark queued since the wait rides no more: written now
	}
	life.abandon = func() {
		o.lifeMu.Lock()
		life.abandoned = true
		o.lifeMu.Unlock()
		// Nothing of it runs that counts: its listener stops, and its relay is reported not
		// running (outbox.relay.running, Health), rather than running with its last round ever
		// older, until the call it waits for returns.
		cancel()
		end()
		o.marks.poke()
	}
}

// beginLife begins a background life of the Outbox (see life), or returns an error wrapping
// ErrRunning while another runs; who says what runs it, for that error.
func (o *Outbox) beginLife(who string) (*backgroundLife, error) {
	o.lifeMu.Lock()
	defer o.lifeMu.Unlock()
	if l := o.life; l != nil && !l.abandoned {
		return nil, fmt.Errorf("%w: %s runs it (or its shutdown still waits for its background work)", ErrRunning, l.who)
	}
	o.life = &backgroundLife{who: who}
	o.retired.Store(false)
	return o.life, nil
}

// backgroundLife is one run of an Outbox's background work (Run, or a membership of an engine).
type backgroundLife struct {
	who       string
	abandoned bool   // its shutdown gave up waiting (o.lifeMu): a new life may begin
	stop      func() // ends what startServices started, once the engine's runs returned
	abandon   func() // marks the life abandoned
}

// ErrRunning is wrapped by Run (and a tenant.Set starting a member) when the Outbox's background
// work runs already: one Outbox runs one background life at a time.
var ErrRunning = errors.New("outbox: the Outbox's background work runs already")

// engineMember returns the Outbox's periodic services as a member of an engine: the relay (woken
// by kickRelay), the retention cleanup, the statistics sampling and the dead-letter redrive, held
// back by the database gate. Run hands it to an engine of its own; a Set hands those of its
// Outboxes to one engine. The listener is not among them: it holds a connection of its own.
// idleMax, when positive, backs idle services off (see JoinEngine); Run passes 0, as effects
// committed by another process without LISTEN would wait up to idleMax.
func (o *Outbox) engineMember(name string, idleMax time.Duration, statsBudget *engine.Budget) engine.Member {
	worked := func(fn func(context.Context) error) func(context.Context) (engine.Outcome, error) {
		return func(ctx context.Context) (engine.Outcome, error) { return engine.Worked, fn(ctx) }
	}
	bound := o.cfg.BackgroundTimeout
	m := engine.Member{Name: name, Logger: o.logger, Tasks: []engine.Task{
		{Name: "relay", Every: o.cfg.RelayInterval, IdleMax: idleMax, Wake: &o.kick, Timeout: bound, Run: o.relayTask},
		{Name: "cleanup", Every: o.cfg.CleanupInterval, Timeout: bound, Run: outcome(o.cleanupOnce)},
	}}
	if idleMax > 0 {
		// Rows expire only Retention after work: an idle member's cleanup finding nothing may
		// wait up to ten intervals.
		m.Tasks[1].IdleMax = idleCleanupIntervals * o.cfg.CleanupInterval
	}
	if o.cfg.StatsInterval > 0 {
		// Its statistics, unchanged without work, are sampled less and less often too, up to
		// statsIdleMax: with hundreds of idle members the samples were most of the statements of
		// the process. Work in this process (busy) brings the sampling back to StatsInterval. A
		// sample is a few statements, each bounded by storeTimeout.
		statsIdle := statsIdleMax(o.cfg.StatsInterval, idleMax)
		var maxGap time.Duration
		if statsBudget != nil && statsBudget.Every > 0 {
			maxGap = statsBudget.MaxGap
		}
		o.tel.setStatsIdleMax(statsIdle, maxGap)
		m.Tasks = append(m.Tasks, engine.Task{Name: "stats sampling", Every: o.cfg.StatsInterval, IdleMax: statsIdle, Resume: &o.busy,
			Budget: statsBudget, Timeout: min(bound, storeTimeout), Run: outcome(o.sampleStats)})
	}
	if o.cfg.Redrive.After > 0 && o.deadLetterStore() != nil {
		m.Tasks = append(m.Tasks, engine.Task{Name: "dead-letter redrive", Every: min(o.cfg.Redrive.After, time.Minute),
			Timeout: bound, Run: worked(o.redriveOnce)})
	}
	if o.gate != nil {
		m.Gate = engineGate{o.gate}
	}
	return m
}

// idleCleanupIntervals bounds the backoff of an idle member's cleanup, in CleanupIntervals.
const idleCleanupIntervals = 10

// statsIdleMax is how far an idle member's statistics sampling backs off with idleMax (0: not at
// all): up to ten StatsIntervals, at most engine.StatsMaxGap, and never less than idleMax (what it
// was before, and what the relay backs off to).
func statsIdleMax(interval, idleMax time.Duration) time.Duration {
	if idleMax <= 0 {
		return 0
	}
	return max(idleMax, min(idleCleanupIntervals*interval, engine.StatsMaxGap))
}

// outcome tells the engine whether a run of a periodic service found anything to do.
func outcome(fn func(context.Context) (idle bool, err error)) func(context.Context) (engine.Outcome, error) {
	return func(ctx context.Context) (engine.Outcome, error) {
		idle, err := fn(ctx)
		if idle && err == nil {
			return engine.Idle, nil
		}
		return engine.Worked, err
	}
}

// relayTask is a relay pass as the engine runs it: an idle pass that knows when a pending effect
// falls due (a lease or a backoff that ends) has the next pass then at the latest, however far
// the member backed off, since no wake-up comes for it. A pass that sent something and drained
// what was due counts as idle too: the pass after it, a RelayInterval later, would find what its
// last claim found, nothing, unless a commit of this process (which wakes the relay), a
// notification (which does too), or a commit of another process without one (which an idle
// member polls for up to IdleMax) left some since. So a member that gets a message now and then
// does not spend two empty passes on each. For an Outbox's own Run, which does not back off,
// this changes nothing.
func (o *Outbox) relayTask(ctx context.Context) (engine.Outcome, error) {
	began := time.Now()
	idle, drained, dueBy, err := o.relayOnce(ctx)
	if err != nil && !errors.Is(err, ErrFailpoint) && (ctx.Err() == nil || errors.Is(ctx.Err(), context.DeadlineExceeded)) {
		// A pass that failed before it could claim (its claim, or the move of due delayed
		// effects before it), also one the pass's bound (BackgroundTimeout) cut off: a lock on
		// the effects table held every pass that long, and Health saw no failure. Not one a
		// shutdown cut off. A claim that succeeds ends the streak.
		o.relayClaimFailed(err)
	}
	if err == nil && !idle {
		o.busy.Wake() // effects were sent or moved: the gauges change
	}
	switch {
	case err == nil && !idle && passHalfOver(ctx, began):
		return engine.More, nil // a pass cut short at half its bound: the next one goes on at once
	case err != nil || !idle && !drained:
		return engine.Worked, err
	case !dueBy.IsZero():
		return engine.IdleUntil(dueBy), nil
	}
	return engine.Idle, nil
}

// engineGate is the database gate as the engine asks it.
type engineGate struct{ g *dbGate }

func (g engineGate) Ready(wake func()) (bool, time.Time) { return g.g.ready(wake) }

// Probe implements engine.Prober: one ping of the database, bounded as the gate's probes are,
// that holds no work back. Only no answer within the bound (a server that stalls) is none: a
// refusal is an answer, and the run it was asked for, on a connection made before, may be
// getting answers. With every connection of the pool taken the ping would wait for the pool,
// which tells nothing of the database.
func (g engineGate) Probe() (answered, judged bool) {
	if g.g.poolFull != nil && g.g.poolFull() {
		return false, false
	}
	return !errors.Is(g.g.boundedProbe(), context.DeadlineExceeded), true
}

// Observe takes the abandonment of a run (engine.ErrNoAnswer) as a failed connection attempt: a
// database that accepts connections and never answers is unreachable, though no error says so,
// and the gate holds the member's work back and probes it, each probe bounded, until it answers.
func (g engineGate) Observe(err error) bool {
	if errors.Is(err, engine.ErrNoAnswer) {
		g.g.failed(err)
		return true
	}
	return g.g.observe(err)
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

// listenRetryMax bounds the backoff of a listener that keeps failing to connect: its retries start
// a second apart and double.
const listenRetryMax = 30 * time.Second

// listen wakes the relay on notifications from other instances, reconnecting after failures.
func (o *Outbox) listen(ctx context.Context) {
	defer o.tel.listening.Store(false)
	failed := 0 // failures in a row, since the listener last connected
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
		if connected {
			failed = 0
		}
		if err != nil && ctx.Err() == nil && o.unreachable(err) {
			// A suspicion, not an outage: the listener may dial an address of its own
			// (ListenDSN), which says nothing of the pool's database. A probe of the pool tells;
			// taken for an outage, a listener that could not connect every second held back the
			// work of every Outbox on the pool, and logged an outage and its end each time.
			o.gate.suspect(fmt.Errorf("the relay's listener could not connect: %w", err))
		}
		if errors.Is(err, outboxdriver.ErrListenUnsupported) {
			o.tel.listenUnsupported.Store(true)
			return
		}
		if err != nil && ctx.Err() == nil {
			failed++
			retry := min(time.Second<<min(failed-1, 5), listenRetryMax)
			if errors.Is(err, outboxdriver.ErrListenerDeaf) {
				retry = listenDeafRetry
				reason := err.Error()
				o.tel.listenDeaf.Store(&reason)
				o.tel.listenerDeaf.Add(ctx, 1, o.tel.own())
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

// outage tells the gate of err, a failure of work done in ctx, and reports whether err says the
// database is unreachable. A failure of work whose ctx had ended tells it nothing: the caller's
// deadline or cancel may have cut the dial short (InTx's, JoinTx's), which says nothing of the
// database, and taken for an outage it held every unit of work on the pool back.
func (o *Outbox) outage(ctx context.Context, err error) bool {
	if ctx.Err() != nil {
		return false
	}
	return o.gate.observe(err)
}

// gateAttempt counts a connection attempt that found the database unreachable.
func (o *Outbox) gateAttempt() {
	o.tel.dbUnreachable.Add(context.Background(), 1, o.tel.own())
}

// poolFull tells whether every connection the units of work may take is taken: they then wait
// for the pool, which tells nothing of the database (see dbGate.suspect).
func (o *Outbox) poolFull() bool {
	if pr, ok := o.store.(outboxdriver.PoolReporter); ok {
		return pr.PoolFull()
	}
	ps := o.db.Stats()
	return ps.MaxOpenConnections > 0 && ps.OpenConnections >= ps.MaxOpenConnections
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

// wakeRelays wakes this process's relay and, through the store, the relays of the other instances
// (not while the database gate is shut: theirs find the effects once it answers).
func (o *Outbox) wakeRelays(ctx context.Context) {
	o.lastHandoff.Store(time.Now().UnixNano())
	o.kickRelay()
	if o.gate.holding() {
		return // the database is gone: the notice would be one more connection attempt
	}
	if err := o.store.EffectNotify(ctx); err != nil && !o.outage(ctx, err) {
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
// It also ends the backoff of the statistics sampling: what wakes the relay is work.
func (o *Outbox) kickRelay() {
	o.kick.Wake()
	o.busy.Wake()
}

// oncePer lets one caller through per interval: for log lines that would otherwise repeat with
// every message.
type oncePer struct{ last atomic.Int64 } // UnixNano of the last caller let through

func (r *oncePer) allow(every time.Duration) bool {
	now := time.Now().UnixNano()
	last := r.last.Load()
	return now-last >= int64(every) && r.last.CompareAndSwap(last, now)
}
