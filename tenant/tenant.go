// Package tenant runs many Outboxes in one process as one Set: a database (or a schema, or a
// TablePrefix on one pool) per tenant or per shard, each an *outbox.Outbox of its own, and a
// Resolver that names the member of each incoming message. The Set's middleware picks the member
// per message, so that the message's claim, its business writes and its side effects share the
// member's transaction; InTx and Do run boundary units of work on a member; Run runs the
// background work of every member, of those added later too; members are added and removed while
// the process runs.
//
// A message must always resolve to the same member: its claim lives in that member's tables, and
// a copy routed elsewhere would not find it (docs/scaling.md, step 3).
package tenant

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"
	"weak"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/watermill-outbox/outbox"
	"github.com/watermill-outbox/outbox/internal/engine"
	"github.com/watermill-outbox/outbox/internal/membername"
	"github.com/watermill-outbox/outbox/outboxdriver"
)

// Errors of the Set.
var (
	// ErrUnresolved is the reason a message is refused when the Set cannot name its member: the
	// Resolver failed or found nothing, or the member it named is not in the Set.
	ErrUnresolved = errors.New("tenant: message resolves to no member")
	// ErrUnknownMember is returned by InTx and Do for a name that is not a member.
	ErrUnknownMember = errors.New("tenant: no such member")
	// ErrMemberExists is returned by Add for a name that is a member already.
	ErrMemberExists = errors.New("tenant: member exists")
	// ErrUnresolvedMember is returned by Remove for the Unresolved member: without it, the
	// messages the Set cannot route would be nacked and redelivered for ever.
	ErrUnresolvedMember = errors.New("tenant: the Unresolved member stays in the Set")
)

// Resolver names the member an incoming message belongs to. It must give the same name for every
// copy of a message. An error, or an empty name, refuses the message (see Config.Unresolved).
type Resolver func(*message.Message) (string, error)

// FromMetadata resolves a message to the member named by its metadata value under key.
func FromMetadata(key string) Resolver {
	return func(msg *message.Message) (string, error) {
		name := msg.Metadata.Get(key)
		if name == "" {
			return "", fmt.Errorf("the message has no metadata %q", key)
		}
		return name, nil
	}
}

// FromTopic resolves a message to the member that name gives for the topic it was received from
// (a topic per tenant: "orders.acme" to "acme"). The topic is the one the Router subscribed the
// handler to; outside a Router the message has none, and is refused.
func FromTopic(name func(topic string) (string, error)) Resolver {
	return func(msg *message.Message) (string, error) {
		topic := message.SubscribeTopicFromCtx(msg.Context())
		if topic == "" {
			return "", errors.New("the message has no topic (it was not received through a Router)")
		}
		return name(topic)
	}
}

// Config configures a Set.
type Config struct {
	// Resolver names the member of each incoming message. Resolver or Metadata is required.
	Resolver Resolver
	// Metadata is the metadata key that carries the member's name on the messages of the Set.
	// Without a Resolver, a message resolves by it (as with FromMetadata(Metadata)). And every
	// message published in a member's unit of work (a handled message's, or one of InTx or Do:
	// outbox.Publish, and the messages a handler returns) carries it, set to the member's name,
	// unless the message sets it itself: the events a tenant's handler publishes resolve to the
	// same tenant where they are consumed, through this Set or another. With FromMetadata and no
	// Metadata, the events go without it, and their consumers refuse them as unresolved.
	Metadata string
	// Unresolved names the member that refuses the messages the Set cannot route: they are
	// rejected in that member like a message whose ID cannot be read, so stored as its dead
	// letters with the reason (or, as its Config says, sent to its PoisonTopic), and acked; an
	// operator retries them from there (outbox dead retry) once their member exists. Required
	// unless NackUnresolved: a message nacked for ever would freeze its consumer. Run refuses to
	// start while that member is not in the Set, and Remove refuses to take it out; before Run,
	// such messages are nacked with an error wrapping ErrUnresolved.
	Unresolved string
	// NackUnresolved opts out of Unresolved: the messages the Set cannot route are nacked with an
	// error wrapping ErrUnresolved that says why, and the broker redelivers them. Set it only
	// when your router moves them away itself: a poison queue for ErrUnresolved outside the
	// Set's middleware (Watermill's PoisonQueueWithFilter). Without one, each such message is
	// redelivered for ever, and holds up its consumer.
	NackUnresolved bool
	// Logger logs refused messages and members whose background work failed. Default: none.
	Logger watermill.LoggerAdapter
	// MaxConcurrent caps the background calls (relay passes, cleanups, statistics samples,
	// redrives) of all members that run at once, so the connections they hold: Run runs every
	// member's background work on one scheduler. Default: DefaultMaxConcurrent.
	MaxConcurrent int
	// PoolConcurrent caps, within MaxConcurrent, the background calls at once of the members
	// that share one pool (their Config.DB, or the pgx form's pgxpool: schemas or table prefixes
	// of one database). Such a pool keeps two idle connections unless told otherwise
	// (DB.SetMaxIdleConns) and closes every connection it gets back beyond them: more calls at
	// once opened connections only to close them, a server process forked and torn down for a
	// background statement of idle members (200 idle schemas on one default pool: 0.4 new
	// connections a second). Raise it with the pool's idle connections. A call abandoned for
	// not returning (a server that stopped answering) keeps its share of this cap until it
	// returns: a hung pool has at most PoolConcurrent calls stalled in it, whatever its
	// members. Members on pools of their own (a database each) are held back by MaxConcurrent
	// alone. Default:
	// DefaultPoolConcurrent; negative: no cap but MaxConcurrent.
	PoolConcurrent int
	// IdleMax is the longest wait between two relay passes of a member whose passes find nothing
	// to send, or send what was due and end on a claim that found nothing and told when the
	// rest falls due (PostgreSQL): the wait doubles from its RelayInterval after each such pass,
	// up to IdleMax. A commit of this process that leaves work to the relay, a delayed effect
	// falling due or a notification wakes the member's relay at once; effects committed by
	// another process that does not notify (no ListenDSN) wait up to IdleMax. On PostgreSQL a pass that sees effects
	// leased (by a relay that crashed) or backing off has the next pass when the first of them
	// falls due, whatever the backoff. The member's statistics sampling backs off while it finds
	// nothing waiting and nothing changed, further: up to ten StatsIntervals, at most 150 s (half
	// of the OutboxStatsStale alert's threshold), or IdleMax if longer; a commit, a message
	// handled, a notification or a relay pass that sent something brings it back to
	// StatsInterval (within StatsEvery). Its cleanup backs off, while it deletes nothing, up to ten
	// CleanupIntervals. Default: DefaultIdleMax; negative: no backoff. A member's Health allows
	// IdleMax between its relay's rounds; the shipped OutboxRelayStalled alert allows 180 s, so
	// with an IdleMax past about two minutes raise its threshold to IdleMax plus a few minutes,
	// or it fires for every idle member.
	IdleMax time.Duration
	// StatsEvery is the least time between the starts of two statistics samples, over all
	// members: a member's sampling comes back to its StatsInterval at every commit, and 200
	// members with a message every few seconds each were sampled 13 times a second between them
	// (three statements each), where one busy Outbox is sampled once per StatsInterval. The
	// members due are sampled in the order they fell due, each at most 150 s after its last
	// sample whatever the budget (half of the OutboxStatsStale alert's threshold); so a member's
	// gauges count a sample stale only 150 s later than they otherwise would. With fewer
	// members than StatsInterval/StatsEvery (15 at the defaults), each is sampled every
	// StatsInterval as before. Default: DefaultStatsEvery; negative: no budget.
	StatsEvery time.Duration
}

// Defaults of Config.
const (
	DefaultMaxConcurrent = 4 // a member's four services can still run side by side
	// DefaultPoolConcurrent is database/sql's default of idle connections per pool.
	DefaultPoolConcurrent = 2
	DefaultIdleMax        = 30 * time.Second
	DefaultStatsEvery     = time.Second
)

// Set is a set of Outboxes keyed by member name (a tenant or a shard). It is safe for concurrent
// use.
type Set struct {
	cfg     Config
	refused atomic.Int64

	mu       sync.RWMutex
	members  map[string]*member
	removing map[*member]struct{} // members taken out by a Remove still under way
	runCtx   context.Context      // set while Run runs
	runDone  chan struct{}        // closed when the Run under way (running or stopping) returns; nil: none
	eng      *engine.Engine       // the scheduler of every member's background work, while Run runs
	stats    *engine.Budget       // the members' statistics samples on eng; nil: none
	pools    map[any]*engine.Pool // the members' pools (poolOf) on eng, while Run runs
	runWG    sync.WaitGroup       // the members' background work started by start
}

// member is one Outbox of the Set, with its units in flight and its background work.
type member struct {
	name string
	ob   *outbox.Outbox

	mu      sync.Mutex
	active  int           // units in flight
	removed bool          // no new units
	drained chan struct{} // closed once removed and no unit is in flight
	bg      *background   // the background work start started; nil while not running
	wrapped map[weak.Pointer[wrapper]]message.HandlerFunc
}

// New returns an empty Set.
func New(cfg Config) (*Set, error) {
	if cfg.Resolver == nil {
		if cfg.Metadata == "" {
			return nil, errors.New("tenant: Config.Resolver or Config.Metadata is required")
		}
		cfg.Resolver = FromMetadata(cfg.Metadata)
	}
	switch {
	case cfg.Unresolved == "" && !cfg.NackUnresolved:
		return nil, errors.New("tenant: Config.Unresolved is required: name the member that dead-letters the messages " +
			"the Set cannot route (nacked, they would be redelivered for ever), or set NackUnresolved if your router " +
			"has a poison queue for ErrUnresolved")
	case cfg.Unresolved != "" && cfg.NackUnresolved:
		return nil, errors.New("tenant: Config.Unresolved and NackUnresolved exclude each other")
	case cfg.Unresolved != "":
		if err := validName(cfg.Unresolved); err != nil {
			return nil, fmt.Errorf("tenant: Config.Unresolved: %w", err)
		}
	}
	if cfg.Logger == nil {
		cfg.Logger = watermill.NopLogger{}
	}
	if cfg.MaxConcurrent <= 0 {
		cfg.MaxConcurrent = DefaultMaxConcurrent
	}
	if cfg.PoolConcurrent == 0 {
		cfg.PoolConcurrent = DefaultPoolConcurrent
	}
	if cfg.IdleMax == 0 {
		cfg.IdleMax = DefaultIdleMax
	}
	if cfg.StatsEvery == 0 {
		cfg.StatsEvery = DefaultStatsEvery
	}
	return &Set{cfg: cfg, members: map[string]*member{}, removing: map[*member]struct{}{}}, nil
}

// Add adds ob under name. While Run runs, the member's background work starts at once, and an
// Outbox that runs already (its own Run, another Set) is refused with outbox.ErrRunning; one that
// Run finds running so keeps that background work and is logged. Refused too: an Outbox on a
// member's tables (one pool, its Config.DB or the pgx form's pgxpool, and the same tables as the
// driver resolves them: Schema "" is the driver's default, public or the connection's database on
// MySQL; their claims would mix), and as the
// Unresolved member one that keeps no refusals (DeadLettersOff without a PoisonTopic). The Set
// neither migrates ob nor closes it: ob and its database are the caller's. A name is 1 to 200
// bytes of UTF-8 without control characters, bidirectional controls, line separators or '/': it
// is in logs, metrics, health reports and the console, where those make it read as another.
func (s *Set) Add(name string, ob *outbox.Outbox) error {
	if err := validName(name); err != nil {
		return err
	}
	if ob == nil {
		return fmt.Errorf("tenant: member %q: the Outbox is nil", name)
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if _, ok := s.members[name]; ok {
		return fmt.Errorf("%w: %q", ErrMemberExists, name)
	}
	// An Outbox runs one background life: two would stop each other's timers, and a metric
	// carries one member name.
	for other, o := range s.members {
		if o.ob == ob {
			return fmt.Errorf("tenant: member %q: its Outbox is member %q already", name, other)
		}
	}
	for o := range s.removing {
		if o.ob == ob {
			return fmt.Errorf("tenant: member %q: its Outbox is member %q, which a Remove under way is stopping: add it once that returned", name, o.name)
		}
	}
	cfg := ob.Config()
	if name == s.cfg.Unresolved && cfg.DeadLetters == outbox.DeadLettersOff && cfg.PoisonTopic == "" {
		return fmt.Errorf("tenant: member %q: the Unresolved member keeps no dead letters (DeadLettersOff) and has no PoisonTopic: "+
			"the messages the Set cannot route would be nacked and redelivered for ever", name)
	}
	// Two members on one set of tables share their claims: one tenant's message would be acked
	// as a duplicate of another's with the same ID (an order number read by WithMessageID).
	pool, tables := poolOf(ob), tablesOf(ob)
	same := func(o *member) bool { return poolOf(o.ob) == pool && tablesOf(o.ob) == tables }
	for other, o := range s.members {
		if same(o) {
			return fmt.Errorf("tenant: member %q: its tables are member %q's (one DB, Schema %q, TablePrefix %q): "+
				"the claims of one would ack the other's messages as duplicates; give each member a Schema or TablePrefix of its own",
				name, other, cfg.Schema, cfg.TablePrefix)
		}
	}
	for o := range s.removing {
		if same(o) {
			return fmt.Errorf("tenant: member %q: its tables are those of member %q, which a Remove under way is stopping", name, o.name)
		}
	}
	m := &member{name: name, ob: ob, drained: make(chan struct{}), wrapped: map[weak.Pointer[wrapper]]message.HandlerFunc{}}
	if s.runCtx != nil {
		if err := s.start(s.runCtx, m); err != nil {
			return fmt.Errorf("tenant: member %q: %w", name, err)
		}
	}
	s.members[name] = m
	return nil
}

// Remove takes the member name out of the Set: its messages are refused from now on (as
// unresolved), Remove waits for its units of work in flight (handled messages, InTx and Do), then
// stops its background work and waits for that to return. When ctx ends first, the background
// work is stopped all the same and Remove returns an error: the units still in flight finish on
// their own (each is bounded by the member's HandlerTimeout). It does not close the Outbox, but
// the Outbox no longer reports itself as one the process holds (outbox.relay.running, which the
// OutboxRelayStalled alert reads) until it runs again. The
// Unresolved member is not removed (ErrUnresolvedMember).
func (s *Set) Remove(ctx context.Context, name string) error {
	if name == s.cfg.Unresolved {
		return fmt.Errorf("%w: %q: the messages the Set cannot route are refused there", ErrUnresolvedMember, name)
	}
	s.mu.Lock()
	m, ok := s.members[name]
	if ok {
		// Still the Set's to stop until Remove returns: Run's shutdown stops it too, rather than
		// wait for this Remove's drain, which only its ctx bounds.
		delete(s.members, name)
		s.removing[m] = struct{}{}
	}
	removing := false
	if !ok {
		for o := range s.removing {
			removing = removing || o.name == name
		}
	}
	s.mu.Unlock()
	if removing {
		return fmt.Errorf("%w: %q: another Remove of it is under way, and its background work stops when that returns", ErrUnknownMember, name)
	}
	if !ok {
		return fmt.Errorf("%w: %q", ErrUnknownMember, name)
	}
	defer func() {
		s.mu.Lock()
		delete(s.removing, m)
		s.mu.Unlock()
	}()
	m.mu.Lock()
	m.removed = true
	if m.active == 0 {
		close(m.drained)
	}
	m.mu.Unlock()
	var err error
	select {
	case <-m.drained: // first: with none in flight and ctx ended, select picked either
	default:
		select {
		case <-m.drained:
		case <-ctx.Done():
			err = fmt.Errorf("tenant: removing member %q: units of work still in flight: %w", name, ctx.Err())
		}
	}
	if serr := s.stop(m); serr != nil {
		err = errors.Join(err, fmt.Errorf("tenant: removing member %q: %w", name, serr))
	}
	// No Outbox the process holds to run any more, whether the Set ran it or not: its
	// outbox.relay.running stops, or OutboxRelayStalled would take it for one nothing runs.
	m.ob.Retire()
	return err
}

// Member returns the Outbox of member name. A unit of work begun on it directly is not waited
// for by Remove; prefer InTx or Do.
func (s *Set) Member(name string) (*outbox.Outbox, bool) {
	s.mu.RLock()
	defer s.mu.RUnlock()
	m, ok := s.members[name]
	if !ok {
		return nil, false
	}
	return m.ob, true
}

// Members returns the names of the members, sorted.
func (s *Set) Members() []string {
	s.mu.RLock()
	defer s.mu.RUnlock()
	names := make([]string, 0, len(s.members))
	for n := range s.members {
		names = append(names, n)
	}
	slices.Sort(names)
	return names
}

// Refused returns how many messages the Set refused because it could not route them.
func (s *Set) Refused() int64 { return s.refused.Load() }

// InTx runs fn as a boundary unit of work of member name (outbox.Outbox.InTx): outbox.Publish
// and Record with fn's ctx store their effects in the member's database. Remove waits for it.
func (s *Set) InTx(ctx context.Context, name string, fn func(ctx context.Context, tx *sql.Tx) error) error {
	return s.Do(ctx, name, func(ctx context.Context, ob *outbox.Outbox) error { return ob.InTx(ctx, fn) })
}

// Do runs fn with the Outbox of member name, which Remove does not take away until fn returns:
// the pgx form's boundary, for example, is
//
//	set.Do(ctx, "acme", func(ctx context.Context, ob *outbox.Outbox) error { return outboxpgx.InTx(ctx, ob, fn) })
func (s *Set) Do(ctx context.Context, name string, fn func(ctx context.Context, ob *outbox.Outbox) error) error {
	m := s.enter(name)
	if m == nil {
		return fmt.Errorf("%w: %q", ErrUnknownMember, name)
	}
	defer m.leave()
	return fn(s.stamp(ctx, name), m.ob)
}

// stamp is ctx in which the messages published carry the member's name under Config.Metadata.
func (s *Set) stamp(ctx context.Context, name string) context.Context {
	if s.cfg.Metadata == "" {
		return ctx
	}
	return outbox.WithMetadata(ctx, s.cfg.Metadata, name)
}

// enter returns member name with one more unit in flight, or nil when it is not a member.
func (s *Set) enter(name string) *member {
	s.mu.RLock()
	m := s.members[name]
	s.mu.RUnlock()
	if m == nil {
		return nil
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.removed {
		return nil
	}
	m.active++
	return m
}

func (m *member) leave() {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.active--
	if m.removed && m.active == 0 {
		close(m.drained)
	}
}

// Run runs the background work of every member until ctx ends, of members added meanwhile too; a
// member removed meanwhile stops its own. The periodic work of all members (relay passes,
// cleanup, statistics, redrive) runs on one scheduler goroutine, at most MaxConcurrent calls at a
// time; a member's listener, when its driver has a ListenDSN, is a goroutine and a connection of
// its own. It returns once every member's background work returned and its marks were written,
// or, for a member whose background call ignores its context, once its ShutdownTimeout passed:
// then with an error that names the member and what it waited for. One Run at a time: a Run
// called while another runs returns an error at once, and one called while the last is still
// stopping its members (a supervisor that restarts it) starts once that one returned, or returns
// when ctx ends first. It returns an error at once when the Unresolved member is not in the Set.
func (s *Set) Run(ctx context.Context) error {
	s.mu.Lock()
	for s.runDone != nil {
		if s.runCtx != nil {
			s.mu.Unlock()
			return errors.New("tenant: the Set runs already")
		}
		last := s.runDone
		s.mu.Unlock()
		select {
		case <-last:
		case <-ctx.Done():
			return fmt.Errorf("tenant: run: waiting for the last Run to stop the members' background work: %w", ctx.Err())
		}
		s.mu.Lock()
	}
	if u := s.cfg.Unresolved; u != "" && s.members[u] == nil {
		s.mu.Unlock()
		return fmt.Errorf("tenant: run: the Unresolved member %q is not in the Set: add it first, "+
			"or the messages the Set cannot route are nacked and redelivered for ever", u)
	}
	eng := engine.New(engine.Config{MaxConcurrent: s.cfg.MaxConcurrent, Logger: s.cfg.Logger})
	if err := eng.Start(ctx); err != nil {
		s.mu.Unlock()
		return fmt.Errorf("tenant: run: %w", err)
	}
	s.runCtx, s.eng, s.stats, s.pools = ctx, eng, nil, map[any]*engine.Pool{}
	done := make(chan struct{})
	s.runDone = done
	defer func() {
		s.mu.Lock()
		s.runDone = nil
		s.mu.Unlock()
		close(done)
	}()
	if s.cfg.StatsEvery > 0 {
		s.stats = &engine.Budget{Every: s.cfg.StatsEvery, MaxGap: engine.StatsMaxGap}
	}
	for _, m := range s.members {
		if err := s.start(ctx, m); err != nil {
			s.cfg.Logger.Error("tenant: the background work of a member did not start", err, watermill.LogFields{"member": m.name})
		}
	}
	s.mu.Unlock()
	<-ctx.Done()
	s.mu.Lock()
	s.runCtx, s.eng, s.stats, s.pools = nil, nil, nil, nil
	running := s.everyMember()
	s.mu.Unlock()
	// The runs see ctx end and return; each member then writes its marks. A member being
	// removed is stopped here as well (its Remove, waiting for its units, waits for this stop
	// too when it gets there): its units in flight are not waited for.
	// At once, not one after another: a member whose background call ignores its context holds
	// its own stop for its ShutdownTimeout, not every member's after it.
	var (
		errMu sync.Mutex
		errs  []error
		wg    sync.WaitGroup
	)
	for _, m := range running {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if err := s.stop(m); err != nil {
				errMu.Lock()
				errs = append(errs, fmt.Errorf("member %q: %w", m.name, err))
				errMu.Unlock()
			}
		}()
	}
	wg.Wait()
	s.runWG.Wait()
	// Every member left the engine, each within its ShutdownTimeout, and so did those removed
	// meanwhile: a call still out (one that ignores its context, abandoned or not) was reported
	// by its member's stop, so the engine's calls are not waited for again, only its scheduler.
	ectx, cancel := context.WithCancel(context.WithoutCancel(ctx))
	cancel()
	_ = eng.Stop(ectx)
	if len(errs) > 0 {
		slices.SortFunc(errs, func(a, b error) int { return strings.Compare(a.Error(), b.Error()) })
		return fmt.Errorf("tenant: run: %w", errors.Join(errs...))
	}
	return nil
}

// start puts m's background work on the Set's engine until stop. Members start and stop only
// here and in stop, so that what runs a member's background work is one choice. Called with
// s.mu held, while Run runs. It fails when the member's Outbox runs already (outbox.ErrRunning:
// its Run, another Set).
func (s *Set) start(ctx context.Context, m *member) error {
	idleMax := max(s.cfg.IdleMax, 0)
	var pool *engine.Pool
	if id := poolOf(m.ob); id != nil && s.cfg.PoolConcurrent > 0 {
		if pool = s.pools[id]; pool == nil {
			pool = &engine.Pool{Max: s.cfg.PoolConcurrent}
			s.pools[id] = pool
		}
	}
	leave, err := m.ob.JoinEngine(ctx, s.eng, m.name, idleMax, s.stats, pool)
	if err != nil {
		return err
	}
	s.runWG.Add(1)
	m.mu.Lock()
	m.bg = &background{leave: func() error {
		defer s.runWG.Done()
		err := leave()
		if err != nil {
			s.cfg.Logger.Error("tenant: stopping the background work of a member failed", err, watermill.LogFields{"member": m.name})
		}
		return err
	}}
	m.mu.Unlock()
	return nil
}

// background is a member's background work on the engine (start), stopped once however many
// stop it.
type background struct {
	once  sync.Once
	leave func() error
	err   error
}

// stop stops m's background work, if it runs, and waits for it to return, up to the member's
// ShutdownTimeout. Called by Run's shutdown and by Remove at once, both wait for the one stop
// and get its error: neither returns while the work still runs.
func (s *Set) stop(m *member) error {
	m.mu.Lock()
	b := m.bg
	m.mu.Unlock()
	if b == nil {
		return nil
	}
	b.once.Do(func() { b.err = b.leave() })
	m.mu.Lock()
	if m.bg == b {
		m.bg = nil
	}
	m.mu.Unlock()
	return b.err
}

// validName accepts the names that read well in logs, metrics and health reports.
func validName(name string) error {
	if why := membername.Check(name); why != "" {
		return fmt.Errorf("tenant: invalid member name %q: %s", name, why)
	}
	return nil
}

// everyMember returns the members and those a Remove is taking out. s.mu held.
func (s *Set) everyMember() []*member {
	ms := make([]*member, 0, len(s.members)+len(s.removing))
	for _, m := range s.members {
		ms = append(ms, m)
	}
	for m := range s.removing {
		ms = append(ms, m)
	}
	return ms
}

// poolOf names the pool of ob's connections (nil when it has no Config.DB): the pgx form wraps
// one pgxpool in a *sql.DB of its own per Outbox, which outboxdriver.PoolIdentifier sees through.
func poolOf(ob *outbox.Outbox) any {
	if pi, ok := ob.Store().(outboxdriver.PoolIdentifier); ok && pi.PoolIdentity() != nil {
		return pi.PoolIdentity()
	}
	if db := ob.Config().DB; db != nil {
		return db
	}
	return nil
}

// tablesOf names ob's tables on its pool: as the store resolved them (Schema "" and the
// driver's default schema are one), or as configured.
func tablesOf(ob *outbox.Outbox) string {
	if ti, ok := ob.Store().(outboxdriver.TablesIdentifier); ok {
		return ti.TablesIdentity()
	}
	c := ob.Config()
	return c.Schema + "\x00" + c.TablePrefix
}
