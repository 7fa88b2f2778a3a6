package outbox

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"net"
	"sync"
	"sync/atomic"
	"syscall"
	"time"
)

// dbGate holds back the work on one database while it is unreachable. Without it every unit of
// work in flight, and every background loop, tries to connect again after each failure: in an
// outage that is a storm of connection attempts, which also meets the database when it comes
// back (measured: 252 in a 3 s outage of one Outbox with eight consumers; 7 to 17 with the
// gate). While the gate is open, work waits without taking a connection for one probe at a time,
// spaced by an exponential backoff with jitter; the first success, of a probe or of any work,
// closes the gate and wakes every waiter.
//
// It knows nothing of an Outbox (a probe and two delays), so that the Outboxes of one database
// share one (joinGate).
type dbGate struct {
	probe func(context.Context) error
	// unreachable tells a failure that means the database cannot be reached.
	unreachable func(error) bool
	minDelay    time.Duration
	maxDelay    time.Duration
	// onChange reports an outage that begins (err set) or ends (err nil).
	onChange func(since time.Time, attempts int64, err error)
	// onAttempt counts a connection attempt that found the database unreachable.
	onAttempt func()
	// poolFull, when not nil, tells that every connection the work may take is taken: work slow
	// to begin then waits for the pool, and tells nothing of the database (see suspect).
	poolFull func() bool
	// users are the Outboxes that share the gate (see joinGate); nil for a gate of its own.
	users *gateUsers
	// notices are the onChange and onAttempt calls due (g.mu), made by flush; flushMu keeps
	// them in order.
	notices []func()
	flushMu sync.Mutex

	down atomic.Bool // an outage is under way: the fast path of every call

	mu        sync.Mutex
	since     time.Time // when the outage began; zero: reachable
	inOutage  int64     // attempts that failed since then
	lastErr   error
	delay     time.Duration // before the next probe, unjittered
	nextProbe time.Time
	probing   bool
	// suspected: the gate holds work back because a connection had no answer (see suspect), and
	// the probe under way tells whether that is an outage. Until it fails, nothing reports one.
	suspected bool
	probed    chan struct{} // closed when the probe under way ends
	up        chan struct{} // closed when the outage ends
	// wakes are called once when the probe under way or the outage ends: the callers of ready
	// that do not block in wait (the engine's scheduler) learn of it so.
	wakes []func()
	// ended is the last outage that ended (g.mu): one that begins again soon after is a relapse
	// of it (see failed).
	ended struct {
		at, since time.Time
		attempts  int64
		delay     time.Duration
	}
}

// dbProbeTimeout bounds one probe: a dial that hangs (a dropped SYN) is an unreachable database.
const dbProbeTimeout = 5 * time.Second

// dbOutage describes an outage under way; its String follows "the database is unreachable".
type dbOutage struct {
	Since    time.Time
	Attempts int64
	LastErr  error
}

func (o dbOutage) String() string {
	return fmt.Sprintf("since %s (%s ago), %d connection attempts failed; last: %v",
		o.Since.UTC().Format(time.RFC3339Nano), time.Since(o.Since).Round(time.Millisecond), o.Attempts, o.LastErr)
}

// outage returns the outage under way, if any.
func (g *dbGate) outage() (dbOutage, bool) {
	if g == nil || !g.down.Load() {
		return dbOutage{}, false
	}
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.since.IsZero() || g.suspected {
		return dbOutage{}, false
	}
	return dbOutage{Since: g.since, Attempts: g.inOutage, LastErr: g.lastErr}, true
}

// suspicion reports whether the gate holds work back on a suspicion (see suspect), with the
// channel closed when its probe ends (nil when none is under way).
func (g *dbGate) suspicion() (<-chan struct{}, bool) {
	if g == nil || !g.down.Load() {
		return nil, false
	}
	g.mu.Lock()
	defer g.mu.Unlock()
	if !g.suspected {
		return nil, false
	}
	if !g.probing {
		return nil, true
	}
	return g.probed, true
}

// holding tells whether work waits in wait: during an outage, and while a suspicion is probed.
func (g *dbGate) holding() bool { return g != nil && g.down.Load() }

// wait returns at once while the database is reachable. In an outage it waits until the outage
// ends, taking its turn at the probe when one is due; it returns an error wrapping
// ErrDatabaseUnreachable and ctx's error if ctx ends first.
func (g *dbGate) wait(ctx context.Context) error {
	if g == nil || !g.down.Load() {
		return nil
	}
	var timer *time.Timer
	defer func() {
		if timer != nil {
			timer.Stop()
		}
	}()
	for {
		g.mu.Lock()
		if g.since.IsZero() {
			g.mu.Unlock()
			return nil
		}
		up, now := g.up, time.Now()
		if ctx.Err() != nil {
			g.mu.Unlock()
			return g.gaveUp(ctx)
		}
		// The probe runs on its own, not on the waiter's context: a waiter that gives up does not
		// cut it short (nor make it count as a failure), and one whose driver ignores contexts
		// while it connects (lib/pq through sql.Open, a server that stalls) does not hold the
		// waiter past its context. One runs at a time.
		g.probeIfDue(now)
		// While a probe is under way the waiters wait for its end, then for the next one it
		// schedules.
		var probed <-chan struct{}
		d := max(g.nextProbe.Sub(now), time.Millisecond)
		if g.probing {
			probed, d = g.probed, dbProbeTimeout
		}
		g.mu.Unlock()
		if timer == nil {
			timer = time.NewTimer(d)
		} else {
			timer.Reset(d)
		}
		select {
		case <-up:
			return nil
		case <-probed:
		case <-ctx.Done():
			return g.gaveUp(ctx)
		case <-timer.C:
		}
	}
}

// probeIfDue starts the probe if one is due and none is under way. Called with g.mu held.
func (g *dbGate) probeIfDue(now time.Time) {
	if !g.probing && !now.Before(g.nextProbe) {
		g.probing = true
		g.probed = make(chan struct{})
		go g.runProbe()
	}
}

// ready is wait for a caller that must not block (the engine's scheduler, for the work of many
// databases): it reports whether the database is reachable. In an outage it starts the probe
// when one is due, returns when to ask again, and has wake (when not nil) called once when the
// probe under way or the outage ends first. wake must not block: it may be called with g.mu held.
func (g *dbGate) ready(wake func()) (bool, time.Time) {
	if g == nil || !g.down.Load() {
		return true, time.Time{}
	}
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.since.IsZero() {
		return true, time.Time{}
	}
	now := time.Now()
	g.probeIfDue(now)
	if wake != nil {
		g.wakes = append(g.wakes, wake)
	}
	if g.probing {
		return false, now.Add(dbProbeTimeout)
	}
	return false, g.nextProbe
}

// wakeReady calls the wakes handed to ready. Called with g.mu held.
func (g *dbGate) wakeReady() {
	for _, w := range g.wakes {
		w()
	}
	g.wakes = nil
}

// gaveUp returns the error of a wait that ctx ended.
func (g *dbGate) gaveUp(ctx context.Context) error {
	g.mu.Lock()
	o, down := dbOutage{Since: g.since, Attempts: g.inOutage, LastErr: g.lastErr}, !g.since.IsZero()
	g.mu.Unlock()
	if !down {
		return nil
	}
	return fmt.Errorf("%w %s: %w", ErrDatabaseUnreachable, o, ctx.Err())
}

// boundedProbe pings the database once, for at most dbProbeTimeout. No answer within the bound
// is an error that wraps context.DeadlineExceeded.
func (g *dbGate) boundedProbe() error {
	ctx, cancel := context.WithTimeout(context.Background(), dbProbeTimeout)
	defer cancel()
	res := make(chan error, 1)
	go func() { res <- g.probe(ctx) }()
	select {
	case err := <-res:
		return err
	case <-ctx.Done():
		// A driver that ignores the context while it connects (lib/pq through sql.Open, without
		// connect_timeout, on a server that stalls) returns when the network gives up: the
		// probe counts as failed now and the next one opens a new connection, rather than the
		// outage last as long as that one connection.
		return fmt.Errorf("no answer within %s: %w", dbProbeTimeout, ctx.Err())
	}
}

func (g *dbGate) runProbe() {
	err := g.boundedProbe()
	if err == nil {
		g.succeeded()
		return
	}
	defer g.flush() // after the unlock
	g.mu.Lock()
	defer g.mu.Unlock()
	g.endProbe()
	if g.since.IsZero() {
		return // other work got through meanwhile
	}
	g.inOutage++
	g.lastErr = err
	if g.onAttempt != nil {
		g.notices = append(g.notices, g.onAttempt)
	}
	g.delay = min(2*g.delay, g.maxDelay)
	g.nextProbe = time.Now().Add(jitter(g.delay))
	g.confirm(err)
}

// confirm turns a suspicion into an outage, which is reported from when it was suspected.
// Called with g.mu held.
func (g *dbGate) confirm(err error) {
	if !g.suspected {
		return
	}
	g.suspected = false
	g.notify(g.since, g.inOutage, err)
}

// notify has onChange called with since, attempts and err once g.mu is released (flush). Called
// with g.mu held.
func (g *dbGate) notify(since time.Time, attempts int64, err error) {
	if g.onChange != nil {
		g.notices = append(g.notices, func() { g.onChange(since, attempts, err) })
	}
}

// flush makes the onChange and onAttempt calls due, in the order they fell due, without g.mu: a
// gate shared by many Outboxes makes a log line and a counter increment for each, which neither
// the engine's scheduler (Ready) nor the waiters must wait behind. Call it after g.mu is released.
func (g *dbGate) flush() {
	g.flushMu.Lock()
	defer g.flushMu.Unlock()
	g.mu.Lock()
	ns := g.notices
	g.notices = nil
	g.mu.Unlock()
	for _, n := range ns {
		n()
	}
}

// jitter spreads d over [d/2, d], so that the processes of one outage do not probe in step.
func jitter(d time.Duration) time.Duration {
	if d <= 1 {
		return d
	}
	return d/2 + rand.N(d/2+1)
}

// observe takes the outcome of work on the database: a success ends an outage, a failure that
// says the database is unreachable begins one (or counts toward it). It reports whether err is
// such a failure.
func (g *dbGate) observe(err error) bool {
	if g == nil {
		return false
	}
	if err == nil {
		if g.down.Load() {
			g.succeeded()
		}
		return false
	}
	if !g.unreachable(err) {
		return false
	}
	g.failed(err)
	return true
}

// failed records err, a failure that says the database is unreachable: it begins an outage, or
// counts toward the one under way.
func (g *dbGate) failed(err error) {
	if g.onAttempt != nil {
		g.onAttempt()
	}
	defer g.flush() // after the unlock
	g.mu.Lock()
	defer g.mu.Unlock()
	g.lastErr = err
	g.inOutage++
	if !g.since.IsZero() {
		g.confirm(err)
		return
	}
	now := time.Now()
	g.since, g.inOutage = now, 1
	g.delay = g.minDelay
	if e := g.ended; !e.at.IsZero() && now.Sub(e.at) < max(e.delay, time.Second) {
		// A relapse: the database answered a probe (on a connection kept in the pool, say) and
		// refuses the next connections (too many connections). The same outage goes on, its
		// probes backing off further: taken for a new one, it ended and began again every
		// 100 ms, each reported, and the units waiting for it dialed in that cycle.
		g.since, g.inOutage = e.since, e.attempts+1
		g.delay = min(2*e.delay, g.maxDelay)
	}
	g.nextProbe = now.Add(jitter(g.delay))
	g.up = make(chan struct{})
	g.down.Store(true)
	g.notify(now, 1, err)
}

// suspect holds work back from now on as in an outage, and probes the database at once, when a
// connection had no answer for a while (err says how): a server that accepts connections and
// answers none (stalled, or a dropped link) fails nothing, and each unit of work would open one
// more connection that hangs (measured: 12 a second with eight consumers and an InTx caller
// every 100 ms, against one a second refused). A failed probe confirms the outage; a success, of
// the probe or of any work, ends the wait, unreported: a pool that is only busy costs the units
// that begin meanwhile a ping's time. A claim waiting for a copy's is no suspicion: only the
// connection and BEGIN are watched (beginWatch, outboxdriver.DialWatcher). A full pool is no
// suspicion: the unit waited for a connection of it, and so would the probe.
func (g *dbGate) suspect(err error) {
	if g == nil || g.down.Load() || (g.poolFull != nil && g.poolFull()) {
		return
	}
	g.mu.Lock()
	defer g.mu.Unlock()
	if !g.since.IsZero() {
		return
	}
	now := time.Now()
	g.since, g.inOutage, g.lastErr = now, 1, err
	g.delay, g.nextProbe = g.minDelay, now
	g.up = make(chan struct{})
	g.suspected = true
	g.down.Store(true)
	g.probeIfDue(now)
}

// endProbe marks the probe under way, if any, ended. Called with g.mu held.
func (g *dbGate) endProbe() {
	if g.probing {
		g.probing = false
		close(g.probed)
		g.wakeReady()
	}
}

func (g *dbGate) succeeded() {
	defer g.flush() // after the unlock
	g.mu.Lock()
	defer g.mu.Unlock()
	g.endProbe()
	if g.since.IsZero() {
		return
	}
	since, n, suspected := g.since, g.inOutage, g.suspected
	if !suspected {
		g.ended.at, g.ended.since, g.ended.attempts, g.ended.delay = time.Now(), since, n, g.delay
	}
	g.since, g.inOutage, g.lastErr, g.suspected = time.Time{}, 0, nil, false
	g.down.Store(false)
	close(g.up)
	g.wakeReady()
	if !suspected {
		g.notify(since, n, nil)
	}
}

// unreachable tells an error that says the database cannot be reached now, whatever the
// statement: no connection could be made (refused, no route, name not found, a dial that timed
// out), or the server takes none (starting up, shutting down, too many connections). An error on
// a connection already made (reset, terminated) is not one: it fails the work it broke, and the
// next connection tells whether the database is gone.
func unreachable(err error) bool {
	if errors.Is(err, context.Canceled) {
		// A dial its caller gave up (a client that went away, a shutdown, a member removed):
		// the dialer says "dial" all the same, and it was taken for an outage, which held
		// every unit of work back until a probe got an answer (and, once the background work
		// had stopped, nothing probed).
		return false
	}
	switch sqlState(err) {
	case "57P03", // cannot_connect_now: starting up, shutting down, in recovery
		"53300", // too_many_connections
		"08001", // sqlclient_unable_to_establish_sqlconnection
		"08004": // sqlserver_rejected_establishment_of_sqlconnection
		return true
	}
	var op *net.OpError
	if errors.As(err, &op) && op.Op == "dial" {
		return true
	}
	var dns *net.DNSError
	if errors.As(err, &dns) {
		return true
	}
	return errors.Is(err, syscall.ECONNREFUSED) || errors.Is(err, syscall.EHOSTUNREACH) || errors.Is(err, syscall.ENETUNREACH)
}
