package outbox

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"net/http"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill"

	"github.com/watermill-outbox/outbox/outboxdriver"
)

// Stats takes a sample of the outbox tables now: pending and parked side effects and the age of
// the oldest of each, messages with failed attempts that are neither processed nor poisoned,
// retained message IDs and the cleanup lag; on PostgreSQL also what holds back the xmin horizon
// and the dead tuples of the outbox tables. Its cost is bounded whatever the size of the tables
// (counts above StatsCountCap are estimated). Run samples the same every StatsInterval, on one
// instance at a time, for the metrics.
func (o *Outbox) Stats(ctx context.Context) (Stats, error) {
	s, err := o.store.Stats(ctx, outboxdriver.StatsParams{Retention: o.cfg.Retention})
	if err != nil {
		return Stats{}, fmt.Errorf("outbox: stats: %w", err)
	}
	return s, nil
}

// sampleStats refreshes the sample the gauges report: taken here if no other instance took one
// within StatsInterval, read from the database otherwise.
// It reports idle when the sample found nothing waiting (no pending, parked, delayed or failing
// work, no dead letter, no cleanup lag), nothing changed since the sample before (the retained
// IDs) and no xmin horizon held for long: the gauges of such a member change only when work
// comes, and the alert on the horizon needs its age while it is held.
func (o *Outbox) sampleStats(ctx context.Context) (idle bool, err error) {
	ctx, cancel := context.WithTimeout(ctx, storeTimeout)
	defer cancel()
	s, err := o.store.Stats(ctx, outboxdriver.StatsParams{Interval: o.cfg.StatsInterval, Retention: o.cfg.Retention,
		CleanupFrom: o.cleanupAt.claims()})
	if err != nil {
		o.tel.statsFailed()
		return false, err
	}
	if s.SampledAt.IsZero() {
		return false, nil
	}
	prev := o.statsPrev
	o.statsPrev = s.Retained
	idle = s.Pending == 0 && s.Parked == 0 && s.Delayed == 0 && s.Failing == 0 && s.DeadLetters == 0 && s.CleanupLag == 0 &&
		s.Retained == prev && (s.XminHold == nil || s.XminHold.Age < xminHeldLong)
	o.tel.setSample(s, idle)
	return idle, nil
}

// xminHeldLong is the age of a held xmin horizon past which a sample is not idle: an idle
// member's samples, minutes apart, would make the OutboxXminHeld alert (600 s) late by as much.
const xminHeldLong = time.Minute

// HealthCheck is one check of a HealthReport.
type HealthCheck struct {
	Name string `json:"name"`
	OK   bool   `json:"ok"`
	// Reason says what is wrong, or what was found.
	Reason string `json:"reason,omitempty"`
}

// HealthReport is the outcome of Outbox.Health.
type HealthReport struct {
	Healthy bool          `json:"healthy"`
	Checks  []HealthCheck `json:"checks"`
}

// Err returns nil when the report is healthy, and otherwise an error that names every failed check.
func (r HealthReport) Err() error {
	var errs []error
	for _, c := range r.Checks {
		if !c.OK {
			errs = append(errs, fmt.Errorf("%s: %s", c.Name, c.Reason))
		}
	}
	if len(errs) == 0 {
		return nil
	}
	return fmt.Errorf("%w: %w", ErrUnhealthy, errors.Join(errs...))
}

// ErrUnhealthy is wrapped by HealthReport.Err.
var ErrUnhealthy = errors.New("outbox: unhealthy")

// Names of the checks of Outbox.Health.
const (
	CheckDatabase = "database"
	CheckSchema   = "schema"
	CheckRelay    = "relay"
	CheckListener = "listener"
	CheckBacklog  = "backlog"
	CheckParked   = "parked"
)

// Health checks, with reasons: the database answers and takes writes (a standby reached after a
// failover does not; while it is unreachable the check says since when and how many connection
// attempts failed, without trying one more, and while a stall is suspected it takes the answer
// of the gate's probe), the schema is current, the relay is running
// in this process and finished a round recently, the notification listener is connected
// (PostgreSQL), and the backlog and the parked effects are under the thresholds of Config
// (HealthMaxPending, HealthMaxPendingAge, HealthMaxParked; checked only when set, against the
// newest sample, or a new one when Run samples nothing). Each database check is bounded by ctx
// and by five seconds. Wire it to a readiness probe (HealthHandler) with the Router's own state.
func (o *Outbox) Health(ctx context.Context) HealthReport {
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	var r HealthReport
	add := func(name string, err error, ok string) {
		c := HealthCheck{Name: name, OK: err == nil, Reason: ok}
		if err != nil {
			c.Reason = err.Error()
		}
		r.Checks = append(r.Checks, c)
	}
	var pingErr, dbErr error
	if probed, ok := o.gate.suspicion(); ok && probed != nil {
		// A connection had no answer and the probe asks whether the database does: a ping now
		// could open one more connection that hangs, past the check's bound (lib/pq ignores the
		// context while it connects). The check takes the probe's answer instead.
		select {
		case <-probed:
		case <-ctx.Done():
		}
	}
	if out, down := o.gate.outage(); down {
		// The probe asks the database on its own schedule; a ping per check would be one more
		// connection attempt in the storm the gate keeps away.
		pingErr = fmt.Errorf("%w %s", ErrDatabaseUnreachable, out)
		dbErr = pingErr
	} else if _, suspected := o.gate.suspicion(); suspected && ctx.Err() != nil {
		pingErr = fmt.Errorf("no answer: a connection had none, and the probe under way none within the check's bound: %w", ctx.Err())
		dbErr = pingErr
	} else if pingErr = o.pingForHealth(ctx); errors.Is(pingErr, errPingOut) {
		dbErr = pingErr
	} else if pingErr != nil {
		dbErr = fmt.Errorf("ping (waited for a connection and an answer, at most 5s): %w", pingErr)
	} else if w, ok := o.store.(outboxdriver.WritableChecker); ok {
		// Reachable is not enough: a standby answers every read and refuses every unit of work.
		dbErr = w.CheckWritable(ctx)
	}
	add(CheckDatabase, dbErr, "reachable")
	if pingErr == nil {
		add(CheckSchema, o.store.SchemaCheck(ctx), "current")
	}
	since, _ := o.sinceRelayRound()
	add(CheckRelay, o.relayHealth(), fmt.Sprintf("running, last round %s ago", since.Round(time.Millisecond)))
	deaf := o.tel.listenDeaf.Load()
	switch {
	case o.tel.listenUnsupported.Load():
		add(CheckListener, nil, "not supported by the store: the relay polls every RelayInterval")
	case o.relaysRunning.Load() == 0:
		add(CheckListener, errors.New("not started (Outbox.Run is not running)"), "")
	case !o.tel.listening.Load() && deaf != nil:
		add(CheckListener, fmt.Errorf("not receiving notifications, the relay polls every RelayInterval: %s", *deaf), "")
	case !o.tel.listening.Load():
		add(CheckListener, errors.New("not connected: the relay polls every RelayInterval until it reconnects"), "")
	default:
		add(CheckListener, nil, "connected")
	}
	if o.cfg.HealthMaxPending > 0 || o.cfg.HealthMaxPendingAge > 0 || o.cfg.HealthMaxParked > 0 {
		s, err := o.healthStats(ctx, dbErr)
		if err != nil {
			add(CheckBacklog, err, "")
		} else {
			var backlog []string
			if m := o.cfg.HealthMaxPending; m > 0 && s.Pending > m {
				backlog = append(backlog, fmt.Sprintf("%d side effects pending, more than HealthMaxPending (%d)", s.Pending, m))
			}
			if m := o.cfg.HealthMaxPendingAge; m > 0 && s.OldestPending > m {
				backlog = append(backlog, fmt.Sprintf("the oldest pending side effect is %s old, more than HealthMaxPendingAge (%s)", s.OldestPending.Round(time.Second), m))
			}
			var backlogErr error
			if len(backlog) > 0 {
				backlogErr = errors.New(strings.Join(backlog, "; "))
			}
			add(CheckBacklog, backlogErr, fmt.Sprintf("%d pending, oldest %s (sampled %s ago)", s.Pending, s.OldestPending.Round(time.Millisecond), time.Since(s.SampledAt).Round(time.Second)))
			var parkedErr error
			if m := o.cfg.HealthMaxParked; m > 0 && s.Parked > m {
				parkedErr = fmt.Errorf("%d side effects parked, more than HealthMaxParked (%d): retry or discard them (see docs/operations.md)", s.Parked, m)
			}
			add(CheckParked, parkedErr, fmt.Sprintf("%d parked", s.Parked))
		}
	}
	r.Healthy = true
	for _, c := range r.Checks {
		r.Healthy = r.Healthy && c.OK
	}
	return r
}

// healthStats returns the newest sample if it is recent (two StatsIntervals, and for an idle
// member of a Set the longest wait for its next sample on top), or takes one: a probe every few
// seconds must not sample each idle member that the sampling left alone.
func (o *Outbox) healthStats(ctx context.Context, dbErr error) (Stats, error) {
	if s := o.tel.lastStats(); s != nil && o.cfg.StatsInterval > 0 && time.Since(s.SampledAt) < o.tel.idleGrace(2*o.cfg.StatsInterval) {
		return *s, nil
	}
	if dbErr != nil {
		return Stats{}, errors.New("no recent sample, and the database is unreachable")
	}
	// A sample of its own, at most one per StatsInterval (15 s when sampling is off): every
	// count of the tables at every probe of every instance, when sampling fails on a slow
	// database, is what it can least afford. A probe that comes while another samples gets the
	// last one taken.
	h := &o.healthSample
	if !h.mu.TryLock() {
		h.lastMu.Lock()
		defer h.lastMu.Unlock()
		if h.taken {
			return h.s, h.err
		}
		return Stats{}, errors.New("no recent sample, and another health check is taking one")
	}
	defer h.mu.Unlock()
	every := o.cfg.StatsInterval
	if every <= 0 {
		every = defaultStatsInterval
	}
	if h.taken && time.Since(h.at) < every {
		return h.s, h.err
	}
	s, err := o.Stats(ctx)
	h.lastMu.Lock()
	defer h.lastMu.Unlock()
	h.s, h.err, h.at, h.taken = s, err, time.Now(), true
	return s, err
}

// sinceRelayRound is how long ago this process's relay last finished a round, counted from when
// it started (Run, or a Set's engine) when it finished none since: a relay that cannot finish
// its first round (a lock on the effects table, a database that does not answer its claims) is
// as stuck as one that stopped finishing them. ok is false when no relay ran. By the monotonic
// clock: a clock stepped back hid a stuck relay for as long as the step.
func (o *Outbox) sinceRelayRound() (d time.Duration, ok bool) {
	return o.tel.sinceRelayRound(o.relaysRunning.Load() > 0)
}

// sinceRelayRound is Outbox.sinceRelayRound, told whether a relay runs.
func (t *telemetry) sinceRelayRound(running bool) (d time.Duration, ok bool) {
	last := t.lastRelayRound.Load()
	if running {
		last = max(last, t.relayStarted.Load())
	}
	if last == 0 {
		return 0, false
	}
	return t.since(last), true
}

// relayStreak is a run of relay rounds that failed in a row.
type relayStreak struct {
	since time.Time
	n     int
	last  error
}

// relayFailingAfter is how many rounds in a row must fail before Health reports the relay: one
// failed claim (a connection reset, a deadlock) is retried at the next round and means nothing.
const relayFailingAfter = 3

// relayClaimFailed records a round that could not claim; relayClaimed ends the streak.
func (o *Outbox) relayClaimFailed(err error) {
	s := &relayStreak{since: time.Now(), n: 1, last: err}
	if prev := o.tel.relayFailing.Load(); prev != nil {
		s.since, s.n = prev.since, prev.n+1
	}
	o.tel.relayFailing.Store(s)
}

func (o *Outbox) relayClaimed() {
	if o.tel.relayFailing.Load() != nil {
		o.tel.relayFailing.Store(nil)
	}
}

// relayHealth reports a relay that is not running, that has failed its last rounds, or whose
// last round is older than a round may take (RelayInterval, or the IdleMax its engine backs an
// idle member off to when longer, plus a lease's worth of publishing, plus a minute). Without the
// IdleMax, every idle member of a tenant.Set with an IdleMax past about two and a half minutes
// was reported stuck between its rounds, and the Set's readiness with it.
func (o *Outbox) relayHealth() error {
	if s := o.tel.relayFailing.Load(); s != nil && s.n >= relayFailingAfter && o.relaysRunning.Load() > 0 {
		return fmt.Errorf("failing: its last %d rounds could not claim effects, for %s: %w", s.n, time.Since(s.since).Round(time.Second), s.last)
	}
	if o.relaysRunning.Load() == 0 {
		return errors.New("not running: start Outbox.Run in every instance")
	}
	since, _ := o.sinceRelayRound()
	every := max(o.cfg.RelayInterval, time.Duration(o.relayIdleMax.Load()))
	if limit := every + o.relayLease() + time.Minute; since > limit {
		if o.tel.lastRelayRound.Load() < o.tel.relayStarted.Load() {
			return fmt.Errorf("no round finished in the %s since it started (more than %s): stuck in a Publisher or the database", since.Round(time.Second), limit)
		}
		return fmt.Errorf("no round finished for %s (more than %s): stuck in a Publisher or the database", since.Round(time.Second), limit)
	}
	return nil
}

// HealthHandler returns an http.Handler for a readiness probe: 200 with the report as JSON when
// Health and every extra check (for example the Router's: func(context.Context) error { if
// !router.IsRunning() { return errors.New("router not running") }; return nil }) pass, 503
// otherwise. Each extra check gets the request's context, bounded with the rest to 10 seconds.
// The report gives each check's reason, which may name the database's address and quote its
// errors: mount it on an internal port only; where anyone may reach the endpoint, serve
// HealthHandlerWith without Detail. A report is served again for a second before the checks run
// again (HealthHandlerOptions.CacheFor).
func (o *Outbox) HealthHandler(extra map[string]func(context.Context) error) http.Handler {
	return o.HealthHandlerWith(HealthHandlerOptions{Extra: extra, Detail: true})
}

// HealthHandlerOptions configure HealthHandlerWith.
type HealthHandlerOptions struct {
	// Extra checks, by name, run with Health (the Router's state, for example).
	Extra map[string]func(context.Context) error
	// Detail serves the whole report, each check with its reason. False (the default, for an
	// endpoint anyone may reach): only {"healthy": true|false} and the status code, 200 or 503.
	Detail bool
	// CacheFor is how long a report is served again before the checks run again, so that
	// probes, or anyone, calling the endpoint often do not query the database on every request.
	// Default: one second; negative: never.
	CacheFor time.Duration
}

// HealthHandlerWith returns an http.Handler for a readiness probe as HealthHandler does, with
// the options of opt: by default it shows the status only.
func (o *Outbox) HealthHandlerWith(opt HealthHandlerOptions) http.Handler {
	if opt.CacheFor == 0 {
		opt.CacheFor = time.Second
	}
	var (
		turn    = make(chan struct{}, 1) // one request runs the checks; the others wait for its report
		at      time.Time
		last    HealthReport
		running sync.Map // the extra checks under way (healthWith)
	)
	return http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
		ctx, cancel := context.WithTimeout(req.Context(), 10*time.Second)
		defer cancel()
		w.Header().Set("Content-Type", "application/json")
		w.Header().Set("Cache-Control", "no-store")
		w.Header().Set("X-Content-Type-Options", "nosniff")
		select {
		case turn <- struct{}{}:
		case <-ctx.Done():
			w.WriteHeader(http.StatusServiceUnavailable)
			_, _ = w.Write([]byte(`{"healthy":false}` + "\n"))
			return
		}
		r := last
		if at.IsZero() || opt.CacheFor < 0 || time.Since(at) >= opt.CacheFor {
			r = o.healthWith(ctx, opt.Extra, &running)
			if req.Context().Err() == nil { // a report cut short by a client that left is not kept
				at, last = time.Now(), r
			}
		}
		<-turn
		if !r.Healthy {
			w.WriteHeader(http.StatusServiceUnavailable)
		}
		var body any = r
		if !opt.Detail {
			body = struct {
				Healthy bool `json:"healthy"`
			}{r.Healthy}
		}
		if err := json.NewEncoder(w).Encode(body); err != nil {
			o.logger.Debug("Writing the health report failed", watermill.LogFields{"error": err.Error()})
		}
	})
}

// healthWith is Health with the extra checks. A check whose earlier run has not returned (one
// that ignores its context: a broker ping without a timeout) is not started again: it fails,
// saying since when it runs. Started again at every request, each left a goroutine behind.
// running holds the checks under way, by name, when each started: the handler's own, whose
// requests take turns, so that one found there has outlived the request that started it (two
// handlers with a check of one name each run theirs).
func (o *Outbox) healthWith(ctx context.Context, extra map[string]func(context.Context) error, running *sync.Map) HealthReport {
	r := o.Health(ctx)
	for _, name := range slices.Sorted(maps.Keys(extra)) {
		started := time.Now()
		if prev, busy := running.LoadOrStore(name, started); busy {
			r.Healthy = false
			r.Checks = append(r.Checks, HealthCheck{Name: name, Reason: fmt.Sprintf("an earlier run of the check has not returned (running since %s)",
				prev.(time.Time).UTC().Format(time.RFC3339))})
			continue
		}
		err := o.bounded(ctx, func() string { return "health check " + name }, func() error {
			defer running.Delete(name)
			return extra[name](ctx)
		})
		c := HealthCheck{Name: name, OK: err == nil, Reason: "ok"}
		if err != nil {
			c.Reason = err.Error()
			r.Healthy = false
		}
		r.Checks = append(r.Checks, c)
	}
	return r
}

// WaitIdle waits until every side effect committed so far was dispatched and marked (parked
// effects aside), or ctx ends: for integration tests that assert on what reached a real broker.
// It polls the tables every 20 ms; a relay (Run) or a redelivery must be sending what a failed
// dispatch left pending.
func (o *Outbox) WaitIdle(ctx context.Context) error {
	var last *Stats
	for {
		// The marks queued are waited for as long as ctx lasts (a mark may retry for 30 s); the
		// wait left behind ends with them.
		flushed := make(chan struct{})
		go func() { o.marks.wait(); close(flushed) }()
		select {
		case <-flushed:
		case <-ctx.Done():
			return fmt.Errorf("outbox: wait until idle: the dispatched marks queued are still being written: %w", ctx.Err())
		}
		s, err := o.store.Stats(ctx, outboxdriver.StatsParams{Retention: o.cfg.Retention})
		switch {
		case err != nil && ctx.Err() != nil && last != nil:
			return fmt.Errorf("outbox: wait until idle: %d side effects still pending (the oldest %s old): %w",
				last.Pending, last.OldestPending.Round(time.Millisecond), ctx.Err())
		case err != nil:
			return fmt.Errorf("outbox: wait until idle: %w", err)
		case s.Pending == 0:
			return nil
		}
		last = &s
		select {
		case <-ctx.Done():
			return fmt.Errorf("outbox: wait until idle: %d side effects still pending (the oldest %s old): %w",
				s.Pending, s.OldestPending.Round(time.Millisecond), ctx.Err())
		case <-time.After(20 * time.Millisecond):
		}
	}
}

// healthPingBound bounds Health's ping.
const healthPingBound = 5 * time.Second

// healthPingGiveUp is when Health gives up on a ping that has not returned and begins another:
// the database may be back, and a check must not report for ever on a connection attempt that
// will never end. A database that never answers costs a goroutine and a connection attempt per
// healthPingGiveUp, not one per check.
var healthPingGiveUp = 30 * time.Second

// errPingOut says that Health's ping has not returned.
var errPingOut = errors.New("no answer: the ping has not returned (connecting to the database, or its answer)")

// pingForHealth pings the database for Health, bounded by ctx: one ping at a time, which the
// checks that come while it is out share. A driver may not watch the context while it connects
// (lib/pq, to a server that accepts connections and never answers, without connect_timeout):
// Health waited for such a ping for ever, and each probe of a readiness check opened one more
// connection that hung. A ping out past its bound is reported at once, without a wait, and one
// out past healthPingGiveUp is given up for a new one. The ping's failure is the gate's to see
// once, not once per check that shared it.
func (o *Outbox) pingForHealth(ctx context.Context) error {
	p := o.pings.Join(struct{}{}, healthPingGiveUp, func() error {
		// Not the caller's context: a check that gives up must not cut short the ping that the
		// others share.
		pctx, cancel := context.WithTimeout(context.Background(), healthPingBound)
		defer cancel()
		err := o.db.PingContext(pctx)
		if err != nil {
			o.gate.observe(err)
		}
		return err
	})
	if age := time.Since(p.Began); age > healthPingBound {
		select {
		case <-p.Done(): // returned just now: its outcome is known
			return p.Value()
		default:
		}
		return fmt.Errorf("%w: it began %v ago", errPingOut, age.Round(time.Millisecond))
	}
	select {
	case <-p.Done():
		return p.Value()
	case <-ctx.Done():
		return fmt.Errorf("%w: it began %v ago, and the check's context ended: %w", errPingOut, time.Since(p.Began).Round(time.Millisecond), ctx.Err())
	}
}
