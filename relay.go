package outbox

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/trace"

	"github.com/watermill-outbox/outbox/outboxdriver"
)

// relayLease is how long the relay reserves the effects of one round: long enough to publish
// them (a round ends its calls after half of it, see relayBudget), short enough that the effects
// of an instance that died mid-round are soon taken over by another.
// relayErrored counts a relay step that failed (outbox.relay.errors): not one a shutdown cut off,
// nor one that found the database unreachable (the gate counts those, and the relay waits for
// its probe: the counter stays still during an outage, as docs/observability.md says).
func (o *Outbox) relayErrored(ctx context.Context, err error) {
	if ctx.Err() != nil && !errors.Is(ctx.Err(), context.DeadlineExceeded) || o.unreachable(err) {
		return
	}
	o.tel.relayErrors.Add(context.WithoutCancel(ctx), 1, o.tel.own())
}

func (o *Outbox) relayLease() time.Duration {
	if o.leaseForTest > 0 {
		return o.leaseForTest
	}
	return relayLeaseFor(o.cfg.PublishTimeout)
}

func relayLeaseFor(publishTimeout time.Duration) time.Duration {
	return 2*publishTimeout + 30*time.Second
}

// relayBudget is how long a round may spend on its Publish and applier calls, counted from
// before its claim: half the lease, so that the outcome is written (markTimeout at most, usually
// milliseconds) while the lease still holds, and no other instance claims the effects while this
// one may still send them.
func (o *Outbox) relayBudget() time.Duration { return o.relayLease() / 2 }

// relayOnce dispatches committed side effects that the path that wrote them left undispatched,
// round after round, until a round finds nothing due. A round leases its effects in one short
// statement and holds nothing (no transaction, no lock) while it publishes them.
//
// Under a backlog to a destination whose calls take at least half as long as a claim, the rounds
// overlap: the next round is claimed while the current one sends, and the current one's outcome
// is written while the next one sends, so that a round costs about the longer of its calls and
// its statements rather than their sum. One round sends at a time (at most RelayConcurrency
// calls). A claim never takes an effect of a key that has an effect in the round still sending:
// the claim leases the first effect of each key it takes, and the later effects of a key wait
// behind a leased one (see EffectClaimDue) until the round's outcome is written; the claim is
// told to skip those keys, so that it does not spend its limit on them. Every claim is
// made after the outcome of every round but the one sending was written, so that it never finds
// a key half marked, nor a failed effect before its retry time is written. It reports idle when
// the pass found nothing to send and moved no delayed effect, so that the engine may poll an idle
// member less often, and drained when the pass ended on a claim that took nothing after every
// round's outcome was written, and the store told (EffectClaim.Pending) when what is left falls
// due: then dueBy is when the earliest pending effect that is not due yet falls due by itself (a
// lease of a relay that crashed ends, a backoff ends), which nothing would wake the relay for;
// zero when none is pending. A pass that is idle is drained too when the store can tell.
func (o *Outbox) relayOnce(ctx context.Context) (idle, drained bool, dueBy time.Time, err error) {
	worked := false
	o.due.takeFired() // this pass looks at what is due from its start
	if !o.claimSeesDelayed.Load() {
		// Delayed effects that are due become pending ones first.
		n, err := o.promoteDelayed(ctx)
		if err != nil {
			return false, false, time.Time{}, err
		}
		worked = n > 0
	}
	var (
		after   int64
		fl      *relayFlight       // the round whose calls are under way
		claimed time.Duration      // how long the last claim took
		sent    time.Duration = -1 // how long the calls of the last round took; -1: none yet
		ahead   int64              // where the claim after the last one would look, were the rounds one after another
	)
	defer func() {
		// A pass that ends (nothing due, an error, a shutdown) writes the outcome of the round
		// still sending, but a crash (a failpoint) abandons it.
		if fl != nil {
			if errors.Is(err, ErrFailpoint) {
				fl.abandon()
			} else if lerr := o.relayLand(fl); lerr != nil && err == nil {
				err = lerr
			}
		}
	}()
	// A pass bounded by its context's deadline (the engine's, see Config.BackgroundTimeout)
	// starts no turn after half of it: the turn under way and the outcome of the round still
	// sending fit in the other half, so that a healthy pass, a backlog drained at any length,
	// never meets its deadline; the next pass goes on at once.
	stop, bounded := passStop(ctx, time.Now())
	overHalf := func() bool { return bounded && !time.Now().Before(stop) }
	var busy time.Duration // how long the last turn took besides its claim, for the pause
	pendingKnown := true   // every claim of the pass that took nothing told when its window falls due
	stuckDelayed := false  // a move of due delayed effects in this pass moved none
	// land waits for the calls of f to end and writes its outcome; the wait and the writing count
	// toward the pause, less the time the calls waited for calls that hung.
	land := func(f *relayFlight) error {
		t := time.Now()
		f.wait()
		sent = f.took
		busy += max(time.Since(t)-f.stalled, 0)
		t = time.Now()
		err := o.relayLand(f)
		busy += time.Since(t)
		return err
	}
	for ctx.Err() == nil {
		if overHalf() {
			return false, false, time.Time{}, nil
		}
		if fl != nil && sent >= 0 && 2*sent < claimed {
			// Claiming while the round sends gains little when its calls take much less time
			// than a claim, and costs some: the next claim looks at this one's window again.
			f := fl
			fl = nil
			if err := land(f); err != nil {
				return false, false, time.Time{}, err
			}
		}
		// The pause leaves the database and the CPUs to the consumers for as long as the relay
		// used them in its last turn, besides its claim (as when the rounds did not overlap: a
		// claim costs about as much whatever it finds). The round that is sending goes on
		// meanwhile.
		// Its outcome is written as soon as its calls end, during the pause: written after it, a
		// pause longer than what is left of the round's lease (a factor above 1 after a turn that
		// waited long for a slow destination) let another instance claim the sent effects when
		// the lease ended, and send them again.
		var landed time.Duration // the part of the pause spent writing the round's outcome
		if f := o.cfg.RelayPauseFactor; f > 0 && busy > 0 {
			d := time.Duration(f * float64(busy))
			if bounded {
				d = min(d, time.Until(stop))
			}
			pause := time.NewTimer(d)
			for paused := true; paused; {
				var sending <-chan struct{}
				if fl != nil {
					sending = fl.done
				}
				select {
				case <-ctx.Done():
					paused = false
				case <-pause.C:
					paused = false
				case <-sending:
					f := fl
					fl = nil
					was := busy
					busy = 0
					if err := land(f); err != nil {
						pause.Stop()
						return false, false, time.Time{}, err
					}
					landed, busy = busy, was
				}
			}
			pause.Stop()
			if overHalf() {
				return false, false, time.Time{}, nil
			}
		}
		busy = landed
		// A delayed effect fell due during the pass (the due timer fired): moved now, or, where
		// the claim reads the delayed effects, looked at again by this turn's even after a move
		// that moved none. The pass, draining a backlog, may last minutes.
		if o.due.takeFired() {
			if o.claimSeesDelayed.Load() {
				stuckDelayed = false
			} else if n, err := o.promoteDelayed(ctx); err != nil {
				return false, false, time.Time{}, err
			} else {
				worked = worked || n > 0
			}
		}
		// Destinations that took a call again since the last turn: the effects that back off
		// for them are claimed by this turn, not when their retry time comes.
		if err := o.retryRecovered(ctx); err != nil {
			o.relayErrored(ctx, err)
			return false, false, time.Time{}, err
		}
		overlapping := fl != nil
		var skip []string
		if overlapping {
			skip = fl.keys()
		}
		began := time.Now()
		claim, err := o.store.EffectClaimDue(ctx, outboxdriver.EffectClaimParams{
			Grace:    o.cfg.RelayGrace,
			Limit:    o.cfg.RelayBatchSize,
			MaxBytes: o.cfg.RelayBatchBytes,
			Lease:    o.relayLease(),
			After:    after,
			Skip:     skip,
		})
		if err != nil {
			o.relayErrored(ctx, err)
			return false, false, time.Time{}, err // a failed pass (relayTask)
		}
		o.relayClaimed()
		claimed = time.Since(began)
		// A store that reads the next due time of delayed effects with the claim lets an idle
		// pass be the claim alone: the due ones are moved when the claim says so, and claimed
		// by the next claim of this pass.
		// A due one that could not be moved (a cancel holds it) is not tried again in this pass:
		// the move armed the timer to look again soon.
		promoted := false
		var gone error // the database went after the claim: the pass ends once its effects are launched
		if d := claim.Delayed; d != nil {
			o.claimSeesDelayed.Store(true)
			switch {
			case d.Waiting && d.In <= 0 && !stuckDelayed:
				n, err := o.promoteDelayed(ctx)
				if err != nil && len(claim.Effects) == 0 {
					return false, false, time.Time{}, err
				}
				// The claim leased effects: they go to the broker (which may well be up) and
				// their marks wait for the gate; returning at once left them leased, unsent,
				// until their lease ended (a minute by default).
				gone = err
				promoted = n > 0
				stuckDelayed = !promoted
			case d.Waiting && d.In > 0:
				o.due.arm(time.Now().Add(d.In))
			}
		}
		o.tel.lastRelayRound.Store(o.tel.stamp())
		n := len(claim.Effects)
		if n == 0 {
			switch p := claim.Pending; {
			case p == nil:
				pendingKnown = false
			case p.Waiting:
				if at := time.Now().Add(p.In); dueBy.IsZero() || at.Before(dueBy) {
					dueBy = at
				}
			}
		}
		worked = worked || n > 0 || promoted
		if n > 0 {
			if err := o.failpoint(ctx, FailpointAfterRelayClaim); err != nil {
				return false, false, time.Time{}, err
			}
			o.tel.relayRounds.Add(ctx, 1, o.tel.own())
			o.tel.relayEffects.Record(ctx, int64(n), o.tel.own())
		}
		// The round that was sending ends its calls; the claimed one starts sending, and the
		// outcome of the one before is written meanwhile.
		prev := fl
		fl = nil
		if prev != nil {
			t := time.Now()
			prev.wait()
			sent = prev.took
			busy += max(time.Since(t)-prev.stalled, 0)
		}
		if n > 0 {
			fl = o.relayLaunch(ctx, claim.Effects, began.Add(o.relayBudget()))
		}
		if prev != nil {
			t := time.Now()
			if err := o.relayLand(prev); err != nil {
				return false, false, time.Time{}, err
			}
			busy += time.Since(t)
		}
		if gone != nil {
			return false, false, time.Time{}, gone // the launched round is landed on the way out
		}
		var next int64 // where the claim after this one would look, were the rounds one after another
		switch {
		case claim.Next > 0 && n == o.cfg.RelayBatchSize:
			// The window may hold more: go on from the last claimed effect, unless the claim took
			// effects from the end of the pending ones too. Then it took topics and keys in turns
			// and may have left earlier effects of the window behind: look at it again.
			next = after
			if last := claim.Effects[n-1].StoreID; last <= claim.Next {
				next = last
			}
		case claim.Next > 0:
			next = claim.Next // nothing more due in this window: look further
		case n > 0 || overlapping:
			next = 0 // the end: from the front again, where effects behind the sent ones are due now
		case promoted:
			next = 0 // delayed effects became pending: claim them
		default:
			if !pendingKnown {
				return !worked, false, time.Time{}, nil
			}
			return !worked, true, dueBy, nil
		}
		if overlapping && claim.Next > 0 {
			// A claim made while a round was sending left the effects of its window that wait
			// behind that round's keys. The next claim, made once that round's outcome is written,
			// looks at this window again: it goes on from where the claim before this one would
			// have gone on, one claim behind.
			after, ahead = ahead, next
		} else {
			after, ahead = next, next
		}
	}
	if errors.Is(ctx.Err(), context.DeadlineExceeded) {
		// A healthy pass starts no turn after half its bound and ends well before it: a step
		// ran into it (a lock on the outbox tables, a database that stopped answering), which is
		// a failed pass, not an empty one.
		return false, false, time.Time{}, fmt.Errorf("relay pass: a step did not end within the pass's bound (BackgroundTimeout): %w", ctx.Err())
	}
	return false, false, time.Time{}, nil
}

// passStop returns when a pass that began at began, on a context with a deadline, starts no more
// turns: half way to the deadline. bounded is false for a context without one.
func passStop(ctx context.Context, began time.Time) (stop time.Time, bounded bool) {
	deadline, ok := ctx.Deadline()
	if !ok {
		return time.Time{}, false
	}
	return began.Add(deadline.Sub(began) / 2), true
}

// passHalfOver tells whether a pass that began at began on ctx is past half its bound, so may have
// been cut short there.
func passHalfOver(ctx context.Context, began time.Time) bool {
	stop, ok := passStop(ctx, began)
	return ok && !time.Now().Before(stop)
}

// errNotTried is the outcome of an effect that a relay round did not try: it waited behind a
// failed effect with its ordering key, or the round ran out of time.
var errNotTried = errors.New("not tried")

// errInFlight is the outcome of an effect whose call a shutdown stopped waiting for. The call goes
// on (a Publisher takes no context) and may still deliver: the effect was tried, and it keeps
// the round's lease until the lease ends, as after a crash, so that no other instance sends it
// beside that call.
var errInFlight = errors.New("call in flight at shutdown")

// destinationDown is the outcome of an effect that a relay round did not try because its
// destination hung on an earlier call (see breakers): it is due again at until.
type destinationDown struct{ until time.Time }

func (d destinationDown) Error() string {
	return "destination down until " + d.until.Format(time.RFC3339Nano)
}

// relayFlight is a relay round whose leased effects are being sent.
type relayFlight struct {
	ctx     context.Context // the round's span's
	cancel  context.CancelFunc
	effects []Effect
	span    trace.Span
	done    chan struct{} // closed when every call of the round has ended
	errs    []error       // the outcome of each effect, once done
	stalled time.Duration // how long it waited for calls that hung, once done
	took    time.Duration // how long its calls took, once done
	// leaseEnd is when the lease the claim took ends, by this process's clock (counted from
	// before the claim, so a little early).
	leaseEnd time.Time
}

// relayLaunch starts sending leased effects; the round's calls end by deadline. It returns nil
// when there is nothing to send.
func (o *Outbox) relayLaunch(ctx context.Context, claimed []Effect, deadline time.Time) *relayFlight {
	// Effects this process sent and whose mark is still being written are not sent again: the
	// mark takes them out. A round that starts right after a dispatch (its mark lingers a few
	// milliseconds, longer on a loaded database) would otherwise put a second copy on the wire.
	effects, held := o.marks.split(claimed)
	if len(held) > 0 {
		effects = notBehind(effects, held)
		o.releaseSent(ctx, held)
	}
	if len(effects) == 0 {
		return nil
	}
	ctx, span := o.tel.tracer.Start(ctx, "outbox relay", trace.WithLinks(o.tel.producerLinks(effects)...),
		trace.WithAttributes(AttrPath.String(PathRelay), attribute.Int("outbox.effects", len(effects))))
	// No call starts after a shutdown (ctx) or once the round is abandoned (a crash): stopped.
	// The calls under way at a shutdown get shutdownCallGrace to return before they are taken
	// for in flight; abandoned, they end at once.
	stopped, cancel := context.WithCancel(ctx)
	calls, cancelCalls := context.WithCancel(context.WithoutCancel(stopped))
	grace := o.shutdownCallGrace()
	unwatch := context.AfterFunc(ctx, func() { time.AfterFunc(grace, cancelCalls) })
	f := &relayFlight{ctx: ctx, effects: effects, span: span, done: make(chan struct{}),
		leaseEnd: deadline.Add(o.relayLease() - o.relayBudget())}
	f.cancel = func() { unwatch(); cancel(); cancelCalls() }
	go func() {
		defer close(f.done)
		began := time.Now()
		f.errs, f.stalled = o.relayDispatch(stopped, calls, effects, deadline)
		f.took = time.Since(began)
	}()
	return f
}

// notBehind returns those of effects that no held effect of their ordering key comes before. The
// claim leased the first effect of each key it took, and the later ones wait behind that lease
// for every other claim; a held effect (sent lately: its mark is queued, or written) is not sent
// again, and once its mark lands the lease goes with it, so that the key's later effects were
// due for every other instance while this round sent them. They wait, unleased, behind it for the
// next claim instead (released, it falls due again only when the memory of its mark ends).
func notBehind(effects, held []Effect) []Effect {
	first := make(map[string]int64, len(held)) // the first held effect of each key
	for _, e := range held {
		if e.StoreID == 0 {
			continue // inline in its claim: no place among the rows (a claim takes rows)
		}
		if id, ok := first[e.OrderingKey]; !ok || e.StoreID < id {
			first[e.OrderingKey] = e.StoreID
		}
	}
	out := effects[:0]
	for _, e := range effects {
		if id, ok := first[e.OrderingKey]; !ok || e.StoreID < id {
			out = append(out, e)
		}
	}
	return out
}

// shutdownCallGrace is how long a relay's calls under way at a shutdown may take to return before
// they are taken for in flight (errInFlight: kept leased, sent again by another instance once the
// lease ends). Most return within milliseconds: cut short at once, every effect in a call at a
// rolling deploy was sent twice. A quarter of ShutdownTimeout, at most a second.
func (o *Outbox) shutdownCallGrace() time.Duration {
	return min(o.cfg.ShutdownTimeout/4, time.Second)
}

// keys returns the ordering keys of f's effects.
func (f *relayFlight) keys() []string {
	seen := make(map[string]bool, len(f.effects))
	var keys []string
	for _, e := range f.effects {
		if !seen[e.OrderingKey] {
			seen[e.OrderingKey] = true
			keys = append(keys, e.OrderingKey)
		}
	}
	return keys
}

// wait waits until every call of f has ended.
func (f *relayFlight) wait() { <-f.done }

// abandon ends the calls of f and writes nothing, as a crash would: its effects are due again
// when their lease ends.
func (f *relayFlight) abandon() {
	f.cancel()
	<-f.done
	f.span.End()
}

// relayLand waits for the calls of f to end and records the outcome of each of its effects. It
// returns an error only when a failpoint stops it.
func (o *Outbox) relayLand(f *relayFlight) error {
	f.wait()
	defer f.cancel()
	defer f.span.End()
	ctx := f.ctx
	effects, errs := f.effects, f.errs
	// The outcome is written even when ctx was cancelled meanwhile (a shutdown): what was sent
	// must be marked, or it is sent again.
	wctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), markTimeout)
	defer cancel()
	var marks []outboxdriver.DispatchMark
	bySource := map[Source]int{}
	var fails []outboxdriver.EffectFailure
	inFlightFor := max(time.Until(f.leaseEnd), 0) // one delay for them all: one statement
	for i, e := range effects {
		var down destinationDown
		switch {
		case errs[i] == nil:
			k, ok := bySource[e.Source]
			if !ok {
				k = len(marks)
				bySource[e.Source] = k
				marks = append(marks, outboxdriver.DispatchMark{Source: e.Source, MoveClaim: e.Source.Consumer != ""})
			}
			marks[k].StoreIDs = append(marks[k].StoreIDs, e.StoreID)
		case errors.Is(errs[i], errNotTried):
			fails = append(fails, outboxdriver.EffectFailure{StoreID: e.StoreID})
		case errors.Is(errs[i], errInFlight):
			// Leased again, not released: the claim leased only the first effect of each key, and
			// once the effects before it are marked this one would be due at once.
			fails = append(fails, outboxdriver.EffectFailure{StoreID: e.StoreID, RetryAfter: inFlightFor})
		case errors.As(errs[i], &down):
			fails = append(fails, outboxdriver.EffectFailure{StoreID: e.StoreID, RetryAfter: max(time.Until(down.until), 0)})
		default:
			fails = append(fails, o.failures(effects[i:i+1], 0, 1, errs[i], time.Now())...)
		}
	}
	// The failures first, then the marks. Until the marks land, every effect the failures touch
	// still waits behind the round's lease: the first effect of its key in the round is leased
	// and undispatched (or is the failed one itself). Once an effect before it is marked, another
	// relay may lease it, and a failure recorded then (a first one has no backoff) would end
	// that lease while the other relay's call is in flight. A crash between the two leaves the
	// sent effects leased and unmarked: sent again when the lease ends, as after a crash before
	// the mark.
	if len(fails) > 0 {
		if err := o.store.EffectRecordFailures(wctx, fails...); err != nil {
			// Nothing recorded, nothing parked: an outage is the gate's to report.
			if !o.gate.observe(err) {
				o.logger.Error("Relay could not record failed dispatches; the effects are retried when their lease ends", err, nil)
			}
			fails = nil
		}
		for _, f := range fails {
			if f.Park {
				// The failure's text is the error: a logger prints it where it prints every error.
				o.logger.Error(logParked, errors.New(f.Reason), watermill.LogFields{"store_id": f.StoreID})
			}
		}
	}
	if len(marks) > 0 {
		pause := 20 * time.Millisecond
		for {
			err := o.store.EffectMarkDispatched(wctx, marks...)
			if err == nil {
				break
			}
			if wctx.Err() != nil || permanent(err) {
				o.tel.markFailures.Add(wctx, 1, o.tel.own())
				o.logger.Error("Relay could not mark side effects dispatched; they are sent again when their lease ends", err, nil)
				break
			}
			if o.gate.observe(err) {
				// The database is gone: the marks wait for the gate's probes (one at a time,
				// backing off) and go as soon as one answers, rather than try to connect
				// again every second for markTimeout; a wait that ends first is a failure.
				if werr := o.gate.wait(wctx); werr != nil {
					o.tel.markFailures.Add(wctx, 1, o.tel.own())
					// Returned, not only logged: a nil would tell the gate the database answered.
					return fmt.Errorf("relay could not mark side effects dispatched; they are sent again when their lease ends: %w", werr)
				}
				continue
			}
			select {
			case <-wctx.Done():
			case <-time.After(pause):
			}
			pause = min(2*pause, time.Second)
		}
	}
	if err := o.failpoint(wctx, FailpointAfterRelayMark); err != nil {
		return err // as a crash, with nothing left to write
	}
	return nil
}

// releaseSent ends the lease the claim took on effects this process sent lately (their mark is
// queued or was written in the last markRecall), which the round does not send: they are due
// again when that memory ends. A mark that landed makes this a no-op; one the database lost
// (marks commit asynchronously: a failover loses what the standby had not received) leaves the
// effects pending, and they go out again then, not when the lease ends (2 x PublishTimeout + 30 s).
func (o *Outbox) releaseSent(ctx context.Context, held []Effect) {
	fs := make([]outboxdriver.EffectFailure, len(held))
	for i, e := range held {
		fs[i] = outboxdriver.EffectFailure{StoreID: e.StoreID, RetryAfter: markRecall}
	}
	wctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), markTimeout)
	defer cancel()
	if err := o.store.EffectRecordFailures(wctx, fs...); err != nil {
		o.logger.Error("Relay could not release side effects sent lately; they are due again when their lease ends", err, nil)
	}
}

// relayRun is the state one relay round shares between its lanes.
type relayRun struct {
	ctx      context.Context // the round's: done at its deadline
	parent   context.Context // the caller's: done at a shutdown
	deadline time.Time
	effects  []Effect
	errs     []error

	mu         sync.Mutex
	lastReturn time.Time // when the last call that did not hang returned
}

func (r *relayRun) returned() {
	r.mu.Lock()
	r.lastReturn = time.Now()
	r.mu.Unlock()
}

// relayDispatch sends effects on up to RelayConcurrency lanes at a time. Each ordering key is on
// one lane, and the keys are spread over the lanes by their number of effects; a lane sends its
// effects in store order, consecutive messages to one topic in one Publish call (whatever their
// keys: a destination that costs per call, not per message, takes a round in a few calls). Once
// an effect fails, the later effects with its key are not tried, so that they never overtake it.
// Every call ends by deadline (a call that has not returned by then counts as failed: it may
// have reached the broker), and none starts after it or after ctx is done. A destination whose
// call hangs until its timeout is not tried again in this round (nor for a while after it, see
// breakers), so that it holds up each lane for one timeout at most, not for each of its keys.
// It returns the outcome of each effect and how long the round waited, after its last call that
// did not hang returned, for calls that hung. The calls run on calls (which ends a little after
// ctx at a shutdown: see shutdownCallGrace).
func (o *Outbox) relayDispatch(ctx, calls context.Context, effects []Effect, deadline time.Time) ([]error, time.Duration) {
	began := time.Now()
	rctx, cancel := context.WithDeadline(calls, deadline)
	defer cancel()
	r := &relayRun{ctx: rctx, parent: ctx, deadline: deadline, effects: effects, errs: make([]error, len(effects)), lastReturn: began}
	lanes := relayLanes(effects, max(o.cfg.RelayConcurrency, 1))
	if len(lanes) == 1 {
		o.relayLane(r, lanes[0])
	} else {
		var wg sync.WaitGroup
		for _, l := range lanes {
			wg.Add(1)
			go func() { defer wg.Done(); o.relayLane(r, l) }()
		}
		wg.Wait()
	}
	return r.errs, max(time.Since(r.lastReturn), 0)
}

// relayLanes spreads the ordering keys of effects over at most n lanes, each key (in the order
// of its first effect) to the lane with the fewest effects so far, and returns each lane's
// effects (their indices) in store order.
func relayLanes(effects []Effect, n int) [][]int {
	count := map[string]int{}
	var keys []string
	for _, e := range effects {
		if count[e.OrderingKey] == 0 {
			keys = append(keys, e.OrderingKey)
		}
		count[e.OrderingKey]++
	}
	n = min(n, len(keys))
	load := make([]int, n)
	laneOf := make(map[string]int, len(keys))
	for _, k := range keys {
		l := 0
		for i := 1; i < n; i++ {
			if load[i] < load[l] {
				l = i
			}
		}
		laneOf[k] = l
		load[l] += count[k]
	}
	lanes := make([][]int, n)
	for i, e := range effects {
		l := laneOf[e.OrderingKey]
		lanes[l] = append(lanes[l], i)
	}
	return lanes
}

// relayLane sends the effects at (in store order) and records their outcome in r.errs.
func (o *Outbox) relayLane(r *relayRun, at []int) {
	es := make([]Effect, len(at))
	for i, k := range at {
		es[i] = r.effects[k]
	}
	failed := map[string]bool{}
	fail := func(from, to int, err error) {
		for p := from; p < to; p++ {
			r.errs[at[p]] = err
			failed[es[p].OrderingKey] = true
		}
	}
	for p := 0; p < len(es); {
		if failed[es[p].OrderingKey] || r.parent.Err() != nil || !time.Now().Before(r.deadline) {
			r.errs[at[p]] = errNotTried
			p++
			continue
		}
		dest := destinationOf(es[p])
		until, ok, probe := o.breakers.allow(dest)
		if !ok {
			fail(p, p+1, destinationDown{until: until}) // and the key's later effects wait behind it
			p++
			continue
		}
		q := p + 1
		if es[p].Kind == KindPublish {
			for q < len(es) && es[q].Kind == KindPublish && es[q].Topic == es[p].Topic && !failed[es[q].OrderingKey] {
				q++
			}
		}
		sent, n, err := o.dispatch(r.ctx, PathRelay, es[p:q])
		if probe {
			o.breakers.probed(dest)
		}
		switch {
		case err == nil:
			r.returned()
			o.breakers.succeeded(dest)
		case r.parent.Err() != nil || n == 0:
			// A shutdown (or a failpoint after a call), not a failure of the effects. The call a
			// shutdown cut short was tried (see errInFlight); the ones after it were not.
			for k := p + sent; k < q; k++ {
				r.errs[at[k]] = errNotTried
				if k < p+sent+n && r.parent.Err() != nil {
					r.errs[at[k]] = errInFlight
				}
			}
		case hung(err):
			// The call did not return: its messages may have reached the broker, so they count
			// as failed. The destination is left alone for a while, unless it was the round's
			// deadline that cut the call short.
			if time.Now().Before(r.deadline) {
				o.breakers.hung(dest, o.logger, err)
			}
			o.relayFailed(es[p+sent], err)
			fail(p+sent, q, err)
		case q-p-sent > 1:
			// One Publish call failed for several effects: send them one by one, so that only the
			// culprit is charged and effects of other keys still go out.
			r.returned()
			o.relayEach(r, es[p+sent:q], at[p+sent:q], failed)
		default:
			r.returned()
			o.relayFailed(es[p+sent], err)
			fail(p+sent, q, err)
		}
		p = q
	}
}

// relayEach sends effects (to one destination) one call each; once an effect fails, the later
// effects with its key are not tried. Each call asks the destination's breaker first, as a batch
// call does: once one of them hangs, the others wait for the destination rather than each hang
// for a PublishTimeout of its own.
func (o *Outbox) relayEach(r *relayRun, es []Effect, at []int, failed map[string]bool) {
	for k, e := range es {
		if failed[e.OrderingKey] || r.parent.Err() != nil || !time.Now().Before(r.deadline) {
			r.errs[at[k]] = errNotTried
			continue
		}
		dest := destinationOf(e)
		until, ok, probe := o.breakers.allow(dest)
		if !ok {
			r.errs[at[k]] = destinationDown{until: until}
			failed[e.OrderingKey] = true // the key's later effects wait behind it
			continue
		}
		_, n, err := o.dispatch(r.ctx, PathRelay, es[k:k+1])
		if probe {
			o.breakers.probed(dest)
		}
		switch {
		case err == nil:
			r.returned()
			// A call that returned: the destination answers again (a half-open breaker's probe may
			// have been the batch call that brought the round here).
			o.breakers.succeeded(dest)
			continue
		case r.parent.Err() != nil && n > 0:
			r.errs[at[k]] = errInFlight
			continue
		case r.parent.Err() != nil || n == 0:
			r.errs[at[k]] = errNotTried
			continue
		case !hung(err):
			r.returned()
		case time.Now().Before(r.deadline):
			o.breakers.hung(dest, o.logger, err)
		}
		o.relayFailed(e, err)
		r.errs[at[k]] = err
		failed[e.OrderingKey] = true
	}
}

func (o *Outbox) relayFailed(e Effect, err error) {
	o.logger.Error("Relay could not dispatch a side effect; it will be retried", err, watermill.LogFields{
		"store_id": e.StoreID, "effect_uuid": e.UUID, "topic": e.Topic, "kind": kindName(e.Kind), "failures": e.Failures + 1,
	})
}

// hung tells a call that did not return in time (a Publisher or applier that hung, or the round's
// deadline) from one that failed by itself.
func hung(err error) bool {
	return errors.Is(err, ErrPublishTimeout) ||
		(errors.Is(err, context.DeadlineExceeded) && !errors.Is(err, errCallerDeadline))
}

// destinationOf names where e goes: its topic, or its applier.
func destinationOf(e Effect) string {
	if e.Kind == KindPublish {
		return "topic " + e.Topic
	}
	return "applier " + e.Kind
}

// breakers remembers the destinations whose calls hung lately, per process. A hung call costs a
// relay lane the whole PublishTimeout, and a destination that is down hangs on every call: the
// relay stops sending to it for a while (1 s after the first hung call, doubling with each
// further one, up to breakerMaxOpen), then lets one call through as a probe; the first call
// that returns closes it again. Effects of other destinations flow meanwhile.
type breakers struct {
	mu sync.Mutex
	m  map[string]*breaker
}

type breaker struct {
	trips     int       // hung calls since the last call that returned
	openUntil time.Time // no call before this
	probing   bool      // a probe is in flight
}

const (
	breakerFirstOpen = time.Second
	breakerMaxOpen   = time.Minute
)

// allow tells whether a call to dest may start now, and whether it is the probe of a breaker
// that was open (the caller then calls probed once the call is over); when not, until is when it
// is worth trying again.
func (b *breakers) allow(dest string) (until time.Time, ok, probe bool) {
	b.mu.Lock()
	defer b.mu.Unlock()
	br := b.m[dest]
	if br == nil {
		return time.Time{}, true, false
	}
	now := time.Now()
	switch {
	case now.Before(br.openUntil):
		return br.openUntil, false, false
	case br.probing:
		// The probe's outcome is known by the end of this round: try again then.
		return now, false, false
	}
	br.probing = true
	return time.Time{}, true, true
}

// probed ends the probe of dest, whatever became of it (a probe cut short by the round's
// deadline neither opens nor closes the breaker).
func (b *breakers) probed(dest string) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if br := b.m[dest]; br != nil {
		br.probing = false
	}
}

// succeeded closes dest's breaker.
func (b *breakers) succeeded(dest string) {
	b.mu.Lock()
	defer b.mu.Unlock()
	delete(b.m, dest) // a no-op, without allocation, for a destination that never hung
}

// hung opens dest's breaker after a call that did not return in time.
func (b *breakers) hung(dest string, logger watermill.LoggerAdapter, err error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.m == nil {
		b.m = map[string]*breaker{}
	}
	br := b.m[dest]
	if br == nil {
		br = &breaker{}
		b.m[dest] = br
	}
	if time.Now().Before(br.openUntil) {
		return // several lanes hung on it at once: one trip
	}
	br.trips++
	br.probing = false
	open := min(breakerFirstOpen<<min(br.trips-1, 16), breakerMaxOpen)
	br.openUntil = time.Now().Add(open)
	logger.Error(fmt.Sprintf("Relay stops sending to %s for %s: a call did not return in time", dest, open), err,
		watermill.LogFields{"hung_calls": br.trips})
}
