// Package engine runs the periodic background work of one or more members (an Outbox each: its
// relay rounds, cleanup, statistics sampling, dead-letter redrive) on one scheduler goroutine and
// a bounded number of concurrent calls.
//
// A goroutine and a ticker per task and per member make the idle cost of a process linear in its
// members, and let every member's work hit the databases at once. Here the work of all members
// shares one budget: at most MaxConcurrent calls run at a time, the task due the longest goes
// first (so a member with a slow task delays the others by one slot, never starves them), a
// member whose database is unreachable is left alone until its gate opens, and a task that found
// nothing to do may be run less and less often until something wakes it.
//
// Every run is bounded (Task.Timeout): a run that has not returned some grace after its deadline
// (a driver that ignores its context while it connects to a server that accepts and never
// answers) is abandoned. Its slot goes to the other members' tasks, and its member's gate is told
// that the database does not answer; the task is not started again until the abandoned call
// returns, so that a stalled member costs at most one goroutine per task.
package engine

import (
	"context"
	"errors"
	"fmt"
	"runtime/debug"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill"
)

// DefaultMaxConcurrent is the number of background calls that run at once when Config leaves it
// unset: an Outbox's four periodic services, each free to run while another does.
const DefaultMaxConcurrent = 4

// DefaultTimeout bounds a run of a task that leaves Task.Timeout unset.
const DefaultTimeout = 5 * time.Minute

// DefaultAbandonGrace is how long after its deadline a run that has not returned is abandoned,
// when Config leaves AbandonGrace unset: a call that honours its context returns within
// milliseconds of its deadline, and one that writes its outcome after it (with a context of its
// own) within seconds.
const DefaultAbandonGrace = 5 * time.Second

// ErrNoAnswer is the error a member's gate observes when a run of the member's task was
// abandoned: the call has not returned within its bound and its grace, which a database that
// accepts connections and never answers does to a driver that ignores its context.
var ErrNoAnswer = errors.New("the database did not answer within the bound of the run")

// Outcome is what a run of a task found: Worked, Idle, or IdleUntil a time.
type Outcome struct {
	idle  bool
	more  bool
	dueBy time.Time // when not zero: something falls due then, without a wake
}

var (
	// Worked: the run did something (or cannot tell); the next run is Every after its start.
	Worked = Outcome{}
	// More: the run stopped short of its work, to stay within its bound (Task.Timeout); the
	// next run is due at once.
	More = Outcome{more: true}
	// Idle: the run found nothing to do; a task with IdleMax waits longer before the next one.
	Idle = Outcome{idle: true}
)

// IdleUntil is Idle for a run that found nothing to do now but knows that something falls due at
// t by itself (a lease or a backoff that ends): the next run is no later than t, nor earlier than
// Every after this one's start, however far the task backed off.
func IdleUntil(t time.Time) Outcome { return Outcome{idle: true, dueBy: t} }

// Task is one periodic piece of background work of a member.
type Task struct {
	// Name names the task in log lines ("relay", "cleanup").
	Name string
	// Every is the interval between the starts of two runs. A run that outlasts it is followed by
	// the next at once, as by a ticker.
	Every time.Duration
	// IdleMax, when longer than Every, lets the interval double after each run that reports Idle,
	// up to IdleMax; a run that worked, or a wake, brings it back to Every.
	IdleMax time.Duration
	// Wake, when set, runs the task at once when woken (or right after the run under way).
	Wake *Wakeup
	// Timeout bounds a run: its context carries the deadline Timeout after its start. A run that
	// has not returned AbandonGrace after it is abandoned (see Engine). Pick a bound that a
	// healthy run never reaches. 0: DefaultTimeout.
	Timeout time.Duration
	// Resume, when set, ends the task's idle backoff when woken, without running it at once: its
	// next run is at most Every after the start of its last. For work that should keep its pace
	// while the member is busy (the statistics sampling) but must not run once per wake-up.
	Resume *Wakeup
	// Budget, when set, spaces the starts of the runs of every task that shares it, across
	// members (see Budget).
	Budget *Budget
	// Run is the work. Its context ends at its deadline, when the engine stops, or when the
	// member is removed.
	Run func(context.Context) (Outcome, error)
}

// Budget is a rate shared by tasks of a kind across the members of one engine: the runs of its
// tasks start at most one per Every, in the order they fell due, so that many busy members cost
// the databases what a few would, each served in turn. Work that every member does for itself
// on a timer (the statistics sampling) would otherwise grow with the members at any load.
// A run is held by the budget only up to MaxGap after its task's last start (or after the
// task was added): then it starts whatever the budget says, and counts against it, so that no
// task's runs are ever further apart than the longer of MaxGap and its own interval.
// A Budget belongs to one engine.
type Budget struct {
	// Every is the least time between two starts of the budget's runs. 0: no limit.
	Every time.Duration
	// MaxGap bounds how late the budget makes a run. While more tasks share the budget than
	// MaxGap/Every, some runs start at MaxGap, beyond the budget's rate. 0: no bound.
	MaxGap time.Duration
	next   time.Time // the earliest start of the next run held by the budget; e.mu
}

// StatsMaxGap is the longest wait between two statistics samples of a member, however idle it is
// and however many members share a sampling budget (the Budget's MaxGap): half of the
// OutboxStatsStale alert's threshold (300 s), so that no member's sample age nears it.
const StatsMaxGap = 150 * time.Second

// hold reports until when the budget holds back a run of t that is due now: zero when it may
// start. e.mu held.
func (b *Budget) hold(t *task, now time.Time) time.Time {
	if b == nil || b.Every <= 0 || !b.next.After(now) {
		return time.Time{}
	}
	if b.MaxGap > 0 {
		last := t.lastStart
		if last.IsZero() {
			last = t.added
		}
		if deadline := last.Add(b.MaxGap); !deadline.After(now) {
			return time.Time{}
		} else if deadline.Before(b.next) {
			return deadline
		}
	}
	return b.next
}

// take counts a run started at now. A run that MaxGap let through while the budget held it
// leaves the next start where it was, not later: the budget's debt would otherwise grow while
// more tasks share it than it serves within MaxGap, and hold every run up to MaxGap long after
// the load fell. e.mu held.
func (b *Budget) take(now time.Time) {
	if b == nil || b.Every <= 0 {
		return
	}
	if next := now.Add(b.Every); next.After(b.next) {
		b.next = next
	}
}

// Gate tells whether a member's database may be worked on (an Outbox's database gate).
type Gate interface {
	// Ready reports whether the member's tasks may run now. When they may not, it tells when to
	// ask again (and may start a probe of the database); wake, when not nil, is called once when
	// the answer may have changed before then. wake does not block, and may be called with the
	// gate's locks held.
	Ready(wake func()) (ok bool, again time.Time)
	// Observe takes the outcome of a run, and reports whether err says that the database is
	// unreachable (which the gate, not the log, reports).
	Observe(err error) bool
}

// Prober is implemented by a Gate that can ping its database: the engine asks it when a run has
// had no answer for StallAfter. A server that accepts connections and answers nothing fails
// nothing, and each of its runs held a slot until its bound (4.5 minutes by default), the other
// members' work waiting; a run whose database does not answer a ping either is abandoned then,
// its context ended. A run that is only slow (the ping answers) goes on to its bound.
type Prober interface {
	// Probe pings the database, within a bound of its own, and reports whether it answered
	// (a refusal is an answer); judged is false when it cannot tell (every connection of the
	// pool is taken: a ping would wait for the pool, not the database).
	Probe() (answered, judged bool)
}

// Member is the background work of one database.
type Member struct {
	// Name identifies the member in log lines.
	Name string
	// Gate, when not nil, holds the member's tasks back while its database is unreachable.
	Gate Gate
	// Logger receives the errors of the member's tasks; nil: the engine's.
	Logger watermill.LoggerAdapter
	// Pool, when not nil, caps the runs in progress at once of the members that share it.
	Pool  *Pool
	Tasks []Task
}

// Pool caps the runs in progress at once of the members that share it: the members whose
// databases are one connection pool. A database/sql pool keeps two idle connections unless told
// otherwise and closes what it gets back beyond them: more runs at once than that on one pool
// open connections that are closed when they return, a connection (a server process) forked
// and torn down for a background statement of idle members. An abandoned run keeps its slot of
// the Pool (not of MaxConcurrent) until its call returns: it still holds, or waits for, a
// connection of the pool, and a pool whose server stopped answering then has at most Max calls
// stalled in it, not one more each time a call is abandoned. A Pool belongs to one engine.
type Pool struct {
	// Max is the cap; 0 or less: none.
	Max     int
	running int // e.mu
}

// full tells whether p holds no slot for another run. e.mu held.
func (p *Pool) full() bool { return p != nil && p.Max > 0 && p.running >= p.Max }

// take and give count a run's slot of p. e.mu held.
func (p *Pool) take() {
	if p != nil {
		p.running++
	}
}

func (p *Pool) give() {
	if p != nil {
		p.running--
	}
}

// Config configures an Engine.
type Config struct {
	// MaxConcurrent caps the task runs in progress at once, across all members; an abandoned
	// run no longer counts. 0: DefaultMaxConcurrent.
	MaxConcurrent int
	// AbandonGrace is how long after its deadline a run that has not returned is abandoned.
	// 0: DefaultAbandonGrace.
	AbandonGrace time.Duration
	// StallAfter is how long a run may go without returning before its member's gate pings the
	// database (Prober). 0: DefaultStallAfter; negative: never (a stalled run is abandoned at
	// its bound only).
	StallAfter time.Duration
	Logger     watermill.LoggerAdapter
}

// DefaultStallAfter: a ping after 5 s without an answer.
const DefaultStallAfter = 5 * time.Second

// Stats counts what an engine did since it was made.
type Stats struct {
	Runs      int64 // runs ended
	Errors    int64 // runs that returned an error or panicked
	Panics    int64
	Abandoned int64 // runs abandoned for not returning within their bound
}

// ErrStopped is returned by Add to an engine that was stopped.
var ErrStopped = errors.New("engine: stopped")

// Engine schedules the tasks of its members. Its zero value is not usable: use New.
type Engine struct {
	max    int
	grace  time.Duration
	logger watermill.LoggerAdapter
	// stallAfter: see Config.
	stallAfter time.Duration

	poke chan struct{} // wakes the scheduler: a run ended, a task was woken, a member came or went

	mu       sync.Mutex
	members  map[*member]struct{}
	draining map[*member]struct{} // removed, with runs still in progress
	inflight int                  // runs holding a slot: in progress and not abandoned
	calls    int                  // runs whose call has not returned, abandoned ones too
	ctx      context.Context      // the runs' context; nil until Start
	cancel   context.CancelFunc
	started  bool
	stopped  bool
	done     chan struct{} // closed when the scheduler returned and no call is out
	loopExit chan struct{} // closed when the scheduler returned
	loopDone bool

	runs, errs, panics, abandoned atomic.Int64
	passes                        atomic.Uint64 // the scheduler's passes so far (for the tests)
}

type member struct {
	Member
	logger  watermill.LoggerAdapter
	tasks   []*task
	ctx     context.Context
	cancel  context.CancelFunc
	running int
	removed bool
	drained chan struct{} // closed when removed and no run of it is in progress
	// watching: the gate holds a wake of ours, so that the scheduler does not hand it another.
	watching atomic.Bool
	// gateSeen, gateOK: the gate's answer in the scheduler's current pass.
	gateSeen  uint64
	gateOK    bool
	gateAgain time.Time
}

type task struct {
	Task
	m         *member
	due       time.Time
	added     time.Time
	interval  time.Duration
	lastStart time.Time
	running   bool
	// seq numbers the runs, so that the abandonment of a run that returned meanwhile is not
	// taken for one of the next run.
	seq       uint64
	startedAt time.Time
	// abandoned: the run in progress was abandoned; the task stays running until its call
	// returns, so that at most one abandoned call per task is out.
	abandoned bool
	woken     atomic.Bool
	resumed   atomic.Bool
	poke      func()
}

func (t *task) wake() {
	t.woken.Store(true)
	t.poke()
}

// resume ends the task's backoff at the scheduler's next pass. Only the first of a burst of
// calls pokes the scheduler: a busy member resumes its sampling at every commit.
func (t *task) resume() {
	if !t.resumed.Swap(true) {
		t.poke()
	}
}

// New returns an engine; call Start to have it run the tasks of the members added.
func New(cfg Config) *Engine {
	if cfg.MaxConcurrent <= 0 {
		cfg.MaxConcurrent = DefaultMaxConcurrent
	}
	if cfg.AbandonGrace <= 0 {
		cfg.AbandonGrace = DefaultAbandonGrace
	}
	if cfg.Logger == nil {
		cfg.Logger = watermill.NopLogger{}
	}
	if cfg.StallAfter == 0 {
		cfg.StallAfter = DefaultStallAfter
	}
	return &Engine{
		max:        cfg.MaxConcurrent,
		grace:      cfg.AbandonGrace,
		stallAfter: cfg.StallAfter,
		logger:     cfg.Logger,
		poke:       make(chan struct{}, 1),
		members:    map[*member]struct{}{},
		draining:   map[*member]struct{}{},
		done:       make(chan struct{}),
		loopExit:   make(chan struct{}),
	}
}

func (e *Engine) pokeScheduler() {
	select {
	case e.poke <- struct{}{}:
	default:
	}
}

// Stats returns the engine's counters.
func (e *Engine) Stats() Stats {
	panics := e.panics.Load() // before errs: a panic counts as an error first (see call)
	return Stats{Runs: e.runs.Load(), Errors: e.errs.Load(), Panics: panics, Abandoned: e.abandoned.Load()}
}

// Start starts the scheduler. The runs' contexts derive from ctx: when it ends, the scheduler
// starts no more runs, and Stop waits for those in progress.
func (e *Engine) Start(ctx context.Context) error {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.started || e.stopped {
		return errors.New("engine: started twice, or after Stop")
	}
	e.started = true
	e.ctx, e.cancel = context.WithCancel(ctx)
	for m := range e.members {
		m.ctx, m.cancel = context.WithCancel(e.ctx)
	}
	go e.loop(e.ctx)
	return nil
}

// Stop ends the runs' context and waits until the scheduler returned and no call is out, abandoned
// ones too, or ctx ends: then the error names the runs still out, and which were abandoned. An
// engine stopped is not started again.
func (e *Engine) Stop(ctx context.Context) error {
	e.mu.Lock()
	e.stopped = true
	started := e.started
	if e.cancel != nil {
		e.cancel()
	}
	var tasks []*task
	for m := range e.members {
		tasks = append(tasks, m.tasks...)
	}
	e.mu.Unlock()
	// A stopped engine's tasks are woken no more: attached, each Stop left them on their
	// Wakeups for good (an Outbox's relay and sampling, once per Run), and every wake (each
	// commit) went through them.
	for _, t := range tasks {
		if t.Wake != nil {
			t.Wake.detach(t)
		}
		if t.Resume != nil {
			t.Resume.detach(t)
		}
	}
	if !started {
		return nil
	}
	// Not bounded by ctx: the scheduler returns as soon as it sees its context end, holding
	// nothing that a call could keep, and a Stop that returns leaves no goroutine of the engine's
	// but the calls still out.
	<-e.loopExit
	select {
	case <-e.done:
		return nil
	default:
	}
	select {
	case <-e.done:
		return nil
	case <-ctx.Done():
		e.mu.Lock()
		var running []string
		for m := range e.members {
			running = append(running, m.runningNames()...)
		}
		for m := range e.draining {
			running = append(running, m.runningNames()...)
		}
		e.mu.Unlock()
		slices.Sort(running)
		return fmt.Errorf("engine: stop: runs still in progress (%s): %w", strings.Join(running, ", "), ctx.Err())
	}
}

// runningNames names the runs of m in progress, for an error that says what was waited for.
// e.mu held.
func (m *member) runningNames() []string {
	var names []string
	for _, t := range m.tasks {
		switch {
		case t.abandoned:
			names = append(names, fmt.Sprintf("%s, abandoned, out for %s", m.taskName(t), time.Since(t.startedAt).Round(time.Millisecond)))
		case t.running:
			names = append(names, m.taskName(t))
		}
	}
	return names
}

func (m *member) taskName(t *task) string {
	if m.Name == "" {
		return t.Name
	}
	return fmt.Sprintf("%s of member %q", t.Name, m.Name)
}

// Handle is a member added to an engine.
type Handle struct {
	e *Engine
	m *member
}

// Add adds a member; its tasks are first due at once.
func (e *Engine) Add(mb Member) (*Handle, error) {
	for _, t := range mb.Tasks {
		if t.Every <= 0 || t.Run == nil || t.Timeout < 0 {
			return nil, fmt.Errorf("engine: member %q: task %q needs an interval, a func and no negative timeout", mb.Name, t.Name)
		}
	}
	m := &member{Member: mb, logger: mb.Logger, drained: make(chan struct{})}
	if m.logger == nil {
		m.logger = e.logger
	}
	now := time.Now()
	for _, spec := range mb.Tasks {
		if spec.Timeout == 0 {
			spec.Timeout = DefaultTimeout
		}
		t := &task{Task: spec, m: m, due: now, added: now, interval: spec.Every, poke: e.pokeScheduler}
		m.tasks = append(m.tasks, t)
	}
	e.mu.Lock()
	if e.stopped {
		e.mu.Unlock()
		return nil, ErrStopped
	}
	if e.ctx != nil {
		m.ctx, m.cancel = context.WithCancel(e.ctx)
	}
	e.members[m] = struct{}{}
	e.mu.Unlock()
	for _, t := range m.tasks {
		if t.Wake != nil {
			t.Wake.attach(t, t.wake)
		}
		if t.Resume != nil {
			t.Resume.attach(t, t.resume)
		}
	}
	e.pokeScheduler()
	return &Handle{e: e, m: m}, nil
}

// Remove takes the member out: none of its tasks starts again, the context of those in progress
// ends, and Remove waits for them to return, abandoned ones too, or for ctx to end: then the error
// names the runs still out.
func (h *Handle) Remove(ctx context.Context) error {
	e, m := h.e, h.m
	for _, t := range m.tasks {
		if t.Wake != nil {
			t.Wake.detach(t)
		}
		if t.Resume != nil {
			t.Resume.detach(t)
		}
	}
	e.mu.Lock()
	if !m.removed {
		m.removed = true
		delete(e.members, m)
		if m.cancel != nil {
			m.cancel()
		}
		if m.running == 0 {
			close(m.drained)
		} else {
			e.draining[m] = struct{}{}
		}
	}
	e.mu.Unlock()
	select {
	case <-m.drained:
		// Drained already: a context that ended too is no reason to fail.
		return nil
	default:
	}
	select {
	case <-m.drained:
		return nil
	case <-ctx.Done():
		e.mu.Lock()
		running := m.runningNames()
		e.mu.Unlock()
		return fmt.Errorf("engine: remove member %q: runs still in progress (%s): %w", m.Name, strings.Join(running, ", "), ctx.Err())
	}
}

// loop is the scheduler: it starts the runs that are due, up to the cap, and sleeps until the
// next is due or something pokes it.
func (e *Engine) loop(ctx context.Context) {
	defer close(e.loopExit)
	timer := time.NewTimer(time.Hour)
	defer timer.Stop()
	var pass uint64
	for {
		pass++
		e.passes.Store(pass)
		next := e.dispatch(pass)
		d := time.Hour
		if !next.IsZero() {
			d = max(time.Until(next), 0)
		}
		if !timer.Stop() {
			select {
			case <-timer.C:
			default:
			}
		}
		timer.Reset(d)
		select {
		case <-ctx.Done():
			e.mu.Lock()
			e.loopDone = true
			e.closeDoneIfIdle()
			e.mu.Unlock()
			return
		case <-e.poke:
		case <-timer.C:
		}
	}
}

// closeDoneIfIdle closes done once the scheduler returned and no call is out. e.mu held.
func (e *Engine) closeDoneIfIdle() {
	if e.loopDone && e.calls == 0 {
		select {
		case <-e.done:
		default:
			close(e.done)
		}
	}
}

// dispatch starts the runs that are due, earliest due first, while fewer than the cap are in
// progress, and returns when the next one is due (zero: none is).
func (e *Engine) dispatch(pass uint64) time.Time {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.ctx.Err() != nil {
		return time.Time{}
	}
	now := time.Now()
	// One walk over the tasks gathers those due, earliest first; they start in that order while
	// the cap allows. A walk per start cost a pass over every member's tasks for each run
	// started: with hundreds of members, most of the scheduler's time.
	var due []*task
	for m := range e.members {
		for _, t := range m.tasks {
			if t.running {
				continue
			}
			if t.woken.Swap(false) {
				t.due, t.interval = now, t.Every
			}
			if t.resumed.Swap(false) && t.interval > t.Every {
				t.interval = t.Every
				if d := t.lastStart.Add(t.Every); d.Before(t.due) {
					t.due = d
				}
			}
			if !t.due.After(now) && !m.Pool.full() && e.gateOpen(m, pass) {
				due = append(due, t)
			}
		}
	}
	slices.SortStableFunc(due, func(a, b *task) int { return a.due.Compare(b.due) })
	for _, t := range due {
		if e.inflight >= e.max {
			break
		}
		// Asked at its turn: a run started before it may have taken the budget or the pool's
		// slots they share.
		if !t.m.Pool.full() && t.Budget.hold(t, now).IsZero() {
			e.start(t)
		}
	}
	if e.inflight >= e.max {
		return time.Time{} // a run that ends pokes the scheduler
	}
	// Nothing due can start: sleep until the next task is due, or the next gate may open.
	var next time.Time
	later := func(t time.Time) {
		if !t.IsZero() && (next.IsZero() || t.Before(next)) {
			next = t
		}
	}
	for m := range e.members {
		for _, t := range m.tasks {
			switch {
			case t.running:
			case t.due.After(now):
				later(t.due)
			case m.Pool.full():
				// Its gate was not asked this pass, and what it said last may be past: a run of
				// the pool that ends pokes the scheduler.
			case m.Gate != nil && !m.gateOK:
				later(m.gateAgain) // asked this pass: its pool had a free slot
			default:
				later(t.Budget.hold(t, now))
			}
		}
	}
	return next
}

// gateOpen asks the member's gate, once a pass, whether its tasks may run. e.mu held.
func (e *Engine) gateOpen(m *member, pass uint64) bool {
	if m.Gate == nil {
		return true
	}
	if m.gateSeen != pass {
		m.gateSeen = pass
		var wake func()
		if m.watching.CompareAndSwap(false, true) {
			wake = func() {
				m.watching.Store(false)
				e.pokeScheduler()
			}
		}
		m.gateOK, m.gateAgain = m.Gate.Ready(wake)
		if wake != nil && m.gateOK {
			// Not kept by a gate that is open: the next pass that finds it shut hands another.
			m.watching.Store(false)
		}
	}
	return m.gateOK
}

// start starts a run of t. e.mu held.
func (e *Engine) start(t *task) {
	t.running = true
	t.seq++
	t.startedAt = time.Now()
	t.m.running++
	e.inflight++
	t.m.Pool.take()
	e.calls++
	t.lastStart = t.startedAt
	t.Budget.take(t.startedAt)
	go e.run(t.m.ctx, t, t.seq, t.startedAt)
}

func (e *Engine) run(mctx context.Context, t *task, seq uint64, started time.Time) {
	ctx, cancel := context.WithDeadline(mctx, started.Add(t.Timeout))
	defer cancel()
	// A timer, not a goroutine that waits for the call: a run that returns in time costs none.
	// Added one after the other: their sum as a Duration overflows for a Timeout meant as "none".
	abandon := time.AfterFunc(time.Until(started.Add(t.Timeout).Add(e.grace)), func() {
		e.abandon(t, seq, started, fmt.Sprintf("(bound %s)", t.Timeout))
	})
	stopStall := e.watchStall(t, seq, started, cancel)
	out, err := e.call(ctx, t)
	abandon.Stop()
	stopStall()
	m := t.m
	// A nil from a run whose context ended (its member removed, the engine stopped, its bound
	// passed, or abandoned) says nothing of the database: taken for a success, it ended an
	// outage under way, and every unit of work waiting for it dialed again.
	if m.Gate != nil && (err != nil || ctx.Err() == nil) {
		if m.Gate.Observe(err) {
			err = nil // the gate reports the outage
		}
	}
	fields := watermill.LogFields{"task": t.Name}
	if m.Name != "" {
		fields["member"] = m.Name
	}
	// A run cut short by its deadline or its member's removal fails as it must, and says nothing
	// new; a panic is a bug wherever it happens, and is logged with its stack.
	var pe *panicError
	if errors.As(err, &pe) {
		m.logger.Error("outbox "+t.Name+" failed", err, fields.Add(watermill.LogFields{"stack": pe.stack}))
	} else if err != nil && ctx.Err() == nil {
		m.logger.Error("outbox "+t.Name+" failed", err, fields)
	}
	e.runs.Add(1)

	e.mu.Lock()
	defer e.mu.Unlock()
	if t.abandoned {
		m.logger.Info("outbox "+t.Name+" returned after it was abandoned", fields.Add(watermill.LogFields{
			"took": time.Since(started).Round(time.Millisecond).String(), "err": fmt.Sprint(err)}))
	}
	if out.idle && t.IdleMax > t.Every {
		t.interval = min(2*t.interval, t.IdleMax)
	} else {
		t.interval = t.Every
	}
	// A run that outlasted its interval is followed by the next at once, as by a ticker, but
	// due from its end: due from its start it would go before every task that fell due
	// meanwhile, and a slow task would keep the slots to itself.
	t.due = started.Add(t.interval)
	if !out.dueBy.IsZero() && out.dueBy.Before(t.due) {
		// Not before Every: a due time that the run's own clock or a lock keeps from being
		// met would otherwise have the task run back to back.
		t.due = out.dueBy
		if floor := started.Add(t.Every); t.due.Before(floor) {
			t.due = floor
		}
	}
	if now := time.Now(); t.due.Before(now) || out.more {
		t.due = now
	}
	if !t.abandoned {
		e.inflight-- // else abandon freed it
	}
	m.Pool.give() // held until the call returns, abandoned or not
	t.running, t.abandoned = false, false
	m.running--
	e.calls--
	if m.removed && m.running == 0 {
		close(m.drained)
		delete(e.draining, m)
	}
	e.closeDoneIfIdle()
	e.pokeScheduler()
}

// watchStall has the member's gate ping its database when run seq of t has not returned after
// StallAfter, and when the ping gets no answer either ends the run's context and abandons it (see
// Prober). The returned func stops the watch, for a run that returned; it waits for an abandon
// under way, so that a run that returned is not abandoned after it.
func (e *Engine) watchStall(t *task, seq uint64, started time.Time, cancel context.CancelFunc) (stop func()) {
	p, ok := t.m.Gate.(Prober)
	if !ok || e.stallAfter <= 0 || e.stallAfter >= t.Timeout {
		return func() {}
	}
	var mu sync.Mutex
	stopped := false
	timer := time.AfterFunc(e.stallAfter, func() {
		answered, judged := p.Probe()
		mu.Lock()
		defer mu.Unlock()
		if stopped || answered || !judged {
			return
		}
		cancel() // as at its bound: a driver that honours it returns now
		e.abandon(t, seq, started, "and a ping of its database had no answer")
	})
	return func() {
		timer.Stop()
		mu.Lock()
		stopped = true
		mu.Unlock()
	}
}

// abandon gives up waiting for run seq of t, started at started, if its call is still out: its slot
// goes to other tasks, and its member's gate is told that the database did not answer. The task
// stays running, so that it is not started again before the call returns.
func (e *Engine) abandon(t *task, seq uint64, started time.Time, why string) {
	e.mu.Lock()
	if !t.running || t.seq != seq || t.abandoned {
		e.mu.Unlock()
		return
	}
	t.abandoned = true // from now on, the slot is freed here, not by the run
	e.mu.Unlock()
	e.abandoned.Add(1)
	m := t.m
	took := time.Since(started).Round(time.Millisecond)
	err := fmt.Errorf("%w: %s has not returned %s after it began %s", ErrNoAnswer, m.taskName(t), took, why)
	// The gate is told before the slot is freed, so that the slot goes to another member, not
	// to the next task of this one.
	if m.Gate != nil {
		m.Gate.Observe(err)
	}
	e.mu.Lock()
	e.inflight-- // the Pool's slot stays taken: the call still holds its connection
	e.mu.Unlock()
	e.pokeScheduler()
	fields := watermill.LogFields{"task": t.Name, "running_for": took.String(), "timeout": t.Timeout.String()}
	if m.Name != "" {
		fields["member"] = m.Name
	}
	m.logger.Error("outbox "+t.Name+" abandoned: no answer; its slot goes to other work", err, fields)
}

// call runs the task, making a panic an error: one task's bug must not end every member's
// background work.
func (e *Engine) call(ctx context.Context, t *task) (out Outcome, err error) {
	defer func() {
		r := recover()
		if r != nil {
			out, err = Worked, &panicError{value: r, stack: string(debug.Stack())}
		}
		if err != nil {
			e.errs.Add(1)
		}
		if r != nil {
			e.panics.Add(1) // after errs, which Stats reads after panics: never fewer errors than panics
		}
	}()
	return t.Run(ctx)
}

// panicError is a task's panic, with the stack it was raised on.
type panicError struct {
	value any
	stack string
}

// Error says what the panic carried. It does not unwrap: a panic is a bug in the task, never the
// database's answer (the member's gate must not take a panic with a connection error for an
// outage).
func (p *panicError) Error() string { return fmt.Sprintf("panic: %v", p.value) }

// Wakeup wakes a task at once, from outside the engine (an Outbox's commits wake its relay). It
// may be woken before, while and after the task is on an engine; a wake with no task attached is
// dropped, as the task's first run is at once anyway. Its zero value is ready to use.
type Wakeup struct {
	mu    sync.Mutex
	tasks map[*task]func() // what a wake does to the task: run it (Task.Wake) or resume it (Task.Resume)
}

// Wake runs the tasks that have w as their Wake at once, or right after their runs under way, and
// ends the backoff of those that have it as their Resume. It does not block.
func (w *Wakeup) Wake() {
	w.mu.Lock()
	defer w.mu.Unlock()
	for _, fn := range w.tasks {
		fn()
	}
}

func (w *Wakeup) attach(t *task, fn func()) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.tasks == nil {
		w.tasks = map[*task]func(){}
	}
	w.tasks[t] = fn
}

func (w *Wakeup) detach(t *task) {
	w.mu.Lock()
	defer w.mu.Unlock()
	delete(w.tasks, t)
}
