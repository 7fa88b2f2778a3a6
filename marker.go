package outbox

import (
	"context"
	"errors"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill"

	"github.com/watermill-outbox/outbox/outboxdriver"
)

// markTimeout bounds the write of one batch of marks, retries included.
const markTimeout = 30 * time.Second

// markLinger is how long the marker lets marks gather before it writes them: one statement for
// many messages costs the database far less than one each. A mark that is late only delays the
// duplicate check of another instance (this one knows what it sent) by as much.
const markLinger = 5 * time.Millisecond

// marker writes the dispatched marks in the background, so that a message is acked as soon as its
// effects were handed to the Publisher. A mark that never lands (the process dies first) only
// causes a re-send with the same UUIDs, which consumers deduplicate. The workers (work, and
// workFailed for the marks whose ride failed) run only while they have marks to write and exit
// when they have none, so there is nothing to close.
type marker struct {
	o      *Outbox
	mu     sync.Mutex
	queue  []outboxdriver.DispatchMark
	rideBy []time.Time    // until when each mark of queue may ride
	queued map[int64]int  // store IDs whose mark is queued or being written
	inline map[Source]int // sources whose inline effects' mark is queued or being written
	// written remembers, for markRecall, the marks written lately: a relay round whose claim
	// leased effects just before their mark deleted them must not send them again.
	written []writtenMarks
	recent  map[int64]int
	recentI map[Source]int
	running bool
	idle    *sync.Cond // signalled when a worker exits
	// failed holds the marks whose ride failed (their unit rolled back, or its claim skipped
	// them for a lock another transaction held), which a worker of their own writes: its write
	// may wait for that lock, and written by the worker of the others it held every other mark
	// of the Outbox back for as long as the lock lasted (up to markTimeout).
	failed        []outboxdriver.DispatchMark
	failedRunning bool
	failedNudge   chan struct{} // wakes workFailed from its pause when marks are added to failed
	// skipLocked writes the marks whose ride failed skipping the claims another transaction
	// holds locked (nil when the store cannot: then they are written as the others are).
	skipLocked outboxdriver.LockSkippingMarker
	// holdFor is how long a mark skipped for a lock is written again before it is given up:
	// markTimeout; the tests shorten it.
	holdFor time.Duration

	// Marks that ride on units of work (see take): whether the store lets them, when the last
	// claim began (UnixNano), how many callers of wait hurry the worker, and the worker's
	// wake-up while it waits for a unit.
	rides     bool
	rideFor   time.Duration // markRide, or half of RelayGrace when that is shorter
	lastClaim atomic.Int64
	hurry     int
	nudge     chan struct{}

	// alone counts the batches the worker wrote in statements of their own (not riding), for
	// the tests: a mark that rides costs no transaction of its own.
	alone atomic.Int64
	// linger is markLinger; the tests lengthen it to widen the window in which marks gather.
	linger time.Duration
}

func newMarker(o *Outbox) *marker {
	m := &marker{o: o, queued: map[int64]int{}, inline: map[Source]int{}, recent: map[int64]int{}, recentI: map[Source]int{},
		nudge: make(chan struct{}, 1), failedNudge: make(chan struct{}, 1), linger: markLinger, holdFor: markTimeout}
	m.idle = sync.NewCond(&m.mu)
	if cm, ok := o.store.(outboxdriver.ClaimMarker); ok {
		m.rides = markRides && cm.ClaimMarks()
	}
	if m.rides {
		m.skipLocked, _ = o.store.(outboxdriver.LockSkippingMarker)
	}
	m.rideFor = min(markRide, o.cfg.RelayGrace/2)
	return m
}

// markRide is how long a thin batch of marks waits for a unit of work of the same Outbox to take
// it into its claim (outboxdriver.ClaimMarker), when units come that often: then the mark costs
// no statement and no transaction of its own. One database among many cannot batch its marks:
// 200 tenant databases at saturation (a message every 450 ms each) wrote two transactions a
// message, and a window of 250 ms caught none of them. A mark that waits delays by as much the
// duplicate check of another instance (which waits for the unit that carries it, or finds the
// claim unmarked and sends its effects again with their UUIDs), and a crash in that window sends
// its effects again, as for any mark not yet written. It waits at most half of RelayGrace after
// its claim (rideDeadline), after which another instance's relay would take the effects for left
// behind and send them again.
//
// Not longer: at 50 messages a second over 200 databases (one every 4 s each) a window of 5 s
// took 2.55 transactions a message against 2.85 with 1 s (medians of 6 rounds, the members'
// background being most of the rest), and the first round after the warm-up ran ten times
// slower in both runs with it (p50 52-56 ms against 4-5 ms), which no run with 1 s did.
const markRide = time.Second

// rideDeadline is until when a mark queued at now, of a claim written no earlier than claimed
// (zero if unknown), may ride: rideFor, and no later than half of RelayGrace after the claim. The
// relay of another instance takes inline effects left in a claim for RelayGrace after it; a
// slow send (a broker taking seconds) must not use up that margin and the ride's on top of it.
func (m *marker) rideDeadline(now, claimed time.Time) time.Time {
	by := now.Add(m.rideFor)
	if !claimed.IsZero() {
		if end := claimed.Add(m.o.cfg.RelayGrace / 2); end.Before(by) {
			by = end
		}
	}
	return by
}

// markRides switches riding marks on (the default). It was off for a while: a unit that carried
// the marks of other messages updated their claims, and so waited for any lock held on them, such
// as that of a copy of one of those messages being handled (its publish hanging, say): an
// unrelated message then waited on it, with its connection, and the units behind it on theirs.
// The campaign's database/sql runs failed so (the pool emptied, BEGIN went unanswered, the
// database gate called it an outage). The claim now skips locked claims and hands their marks
// back to the worker (outboxdriver.ClaimMarker, handBack), and the campaign has run with it on,
// quiet and under load. The tests switch it off with OUTBOX_MARK_RIDES=0.
var markRides = true

// markRideBelow: a batch of this many marks or more is written at once, one statement for all,
// rather than waiting for a unit.
const markRideBelow = 16

// markRideMax bounds the marks that ride on one claim.
const markRideMax = 200

// ridable tells whether mk may ride on a claim: inline effects only (the claim clears them; rows
// are a statement of their own).
func ridable(mk outboxdriver.DispatchMark) bool { return mk.Inline && len(mk.StoreIDs) == 0 }

// take hands the unit of work about to claim src the marks of src.Consumer that may ride on its
// claim, at most markRideMax of them: their message IDs sent in time and late, and the batch to
// settle once the unit has ended. They stay queued for isQueued until then.
func (m *marker) take(src Source) (sent, late []string, batch []outboxdriver.DispatchMark) {
	m.lastClaim.Store(time.Now().UnixNano())
	if !m.rides {
		return nil, nil, nil
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.hurry > 0 {
		return nil, nil, nil // being flushed: the worker writes them
	}
	now := time.Now()
	n := 0
	lateIDs := map[string]bool{}
	for i, mk := range m.queue {
		// A mark whose time to ride is over is the worker's (one whose ride failed is not in
		// the queue: see settle): a unit that rolls back again and again must not keep it from
		// being written.
		if len(batch) < markRideMax && ridable(mk) && m.rideBy[i].After(now) &&
			mk.Source.Consumer == src.Consumer && mk.Source.ID != src.ID {
			batch = append(batch, mk)
			if mk.MoveClaim {
				lateIDs[mk.Source.ID] = true
			}
			continue
		}
		m.queue[n], m.rideBy[n] = mk, m.rideBy[i]
		n++
	}
	clear(m.queue[n:])
	m.queue, m.rideBy = m.queue[:n], m.rideBy[:n]
	// One claim in one list: two updates of one row in a statement would keep only one of them.
	seen := map[string]bool{}
	for _, mk := range batch {
		id := mk.Source.ID
		if seen[id] {
			continue
		}
		seen[id] = true
		if lateIDs[id] {
			late = append(late, id)
		} else {
			sent = append(sent, id)
		}
	}
	return sent, late, batch
}

// settle ends the ride of batch (from take): written if its unit committed, handed to the
// worker of failed rides otherwise (workFailed; a mark written twice changes nothing the second
// time).
func (m *marker) settle(batch []outboxdriver.DispatchMark, committed bool) {
	if len(batch) == 0 {
		return
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	if committed {
		m.remember(batch, time.Now())
		m.unqueue(batch)
		if m.o.handoffsInFlight() {
			m.o.kickRelay() // as after the worker's writes
		}
	} else {
		m.failed = append(m.failed, batch...) // they ride no more
		if !m.failedRunning {
			m.failedRunning = true
			go m.workFailed()
		} else {
			select {
			case m.failedNudge <- struct{}{}:
			default:
			}
		}
	}
}

// failedPause is the first pause before the marks whose claims another transaction held locked
// are written again; it doubles up to a second.
const failedPause = 50 * time.Millisecond

// workFailed writes the marks whose ride failed, until there are none. With a store that can
// (outboxdriver.LockSkippingMarker), a claim another transaction holds locked is skipped, and its
// mark written again after a pause, until markTimeout after it was first skipped: then it is
// given up, as a write that timed out is (its effects may be sent again, with their UUIDs; the
// lock's holder, a copy of the message, sends and marks them itself). Written waiting for the
// lock, a mark held back every mark written with it, the marks of units that only rolled back
// and whose claims are free, and with two claims locked past markTimeout the statement was
// cancelled and every mark of it dropped.
func (m *marker) workFailed() {
	var held []outboxdriver.DispatchMark // skipped for a lock, written again after a pause
	var giveUp []time.Time               // when each of held is given up
	pause := failedPause
	for {
		m.mu.Lock()
		batch := m.failed
		m.failed = nil
		if len(batch) == 0 && len(held) == 0 {
			m.failedRunning = false
			m.idle.Broadcast()
			m.mu.Unlock()
			return
		}
		m.mu.Unlock()
		if m.skipLocked == nil {
			m.writeAlone(batch)
			continue
		}
		// Only marks that ride fail a ride (take), and the store skips locked claims for those
		// alone: any other is written as the worker writes it.
		if other := slices.DeleteFunc(slices.Clone(batch), ridable); len(other) > 0 {
			m.writeAlone(other)
			batch = slices.DeleteFunc(batch, func(mk outboxdriver.DispatchMark) bool { return !ridable(mk) })
			if len(batch) == 0 && len(held) == 0 {
				continue
			}
		}
		if len(batch) == 0 {
			t := time.NewTimer(pause)
			select {
			case <-t.C:
			case <-m.failedNudge:
			}
			t.Stop()
			pause = min(2*pause, time.Second)
		}
		now := time.Now()
		for range batch {
			giveUp = append(giveUp, now.Add(m.holdFor))
		}
		held, giveUp = m.writeSkipping(append(held, batch...), giveUp)
		if len(held) == 0 {
			pause = failedPause
		}
	}
}

// writeSkipping writes batch skipping the claims another transaction holds locked
// (m.skipLocked), records what it wrote as written, gives up the skipped marks whose time in
// giveUp (one per mark of batch) has come, and returns the others with their times.
func (m *marker) writeSkipping(batch []outboxdriver.DispatchMark, giveUp []time.Time) ([]outboxdriver.DispatchMark, []time.Time) {
	m.alone.Add(1)
	var skipped []outboxdriver.DispatchMark
	ok := m.writeBy(batch, func(ctx context.Context) (err error) {
		skipped, err = m.skipLocked.EffectMarkSkippingLocked(ctx, batch...)
		return err
	})
	if !ok {
		m.mu.Lock()
		m.unqueue(batch)
		m.mu.Unlock()
		return nil, nil
	}
	isSkipped := make(map[outboxdriver.Source]bool, len(skipped))
	for _, mk := range skipped {
		isSkipped[mk.Source] = true
	}
	now := time.Now()
	var written, dropped, held []outboxdriver.DispatchMark
	var heldUntil []time.Time
	for i, mk := range batch {
		switch {
		case !isSkipped[mk.Source]:
			written = append(written, mk)
		case now.Before(giveUp[i]):
			held, heldUntil = append(held, mk), append(heldUntil, giveUp[i])
		default:
			dropped = append(dropped, mk)
		}
	}
	if len(dropped) > 0 {
		m.o.tel.markFailures.Add(context.Background(), 1, m.o.tel.own())
		m.o.logger.Error("Marking side effects dispatched failed; they may be sent again",
			errors.New("their claims were held locked by another transaction for "+m.holdFor.String()),
			watermill.LogFields{"sources": len(dropped), "first_source_id": dropped[0].Source.ID})
	}
	m.mu.Lock()
	if len(written) > 0 {
		m.remember(written, now)
	}
	m.unqueue(written)
	m.unqueue(dropped)
	m.mu.Unlock()
	if len(written) > 0 && m.o.handoffsInFlight() {
		m.o.kickRelay() // as writeAlone
	}
	return held, heldUntil
}

// handBack splits batch (from take) after its claim wrote the marks of the message IDs marked
// only: it returns the marks that ride on on the unit, and hands the others to the worker of
// failed rides, as a unit that rolled back does (they ride no more).
func (m *marker) handBack(batch []outboxdriver.DispatchMark, marked []string) (riding []outboxdriver.DispatchMark) {
	wrote := make(map[string]bool, len(marked))
	for _, id := range marked {
		wrote[id] = true
	}
	var rest []outboxdriver.DispatchMark
	for _, mk := range batch {
		if wrote[mk.Source.ID] {
			riding = append(riding, mk)
		} else {
			rest = append(rest, mk)
		}
	}
	m.settle(rest, false)
	return riding
}

// unqueue forgets batch as queued; m.mu must be held.
func (m *marker) unqueue(batch []outboxdriver.DispatchMark) {
	for _, mk := range batch {
		for _, id := range mk.StoreIDs {
			if m.queued[id]--; m.queued[id] <= 0 {
				delete(m.queued, id)
			}
		}
		if mk.Inline {
			if m.inline[mk.Source]--; m.inline[mk.Source] <= 0 {
				delete(m.inline, mk.Source)
			}
		}
	}
}

// rideUntil is until when the queue may wait for a unit of work to take it (zero: marks of it are
// to be written now, takeDue says which): while Run runs (or the Outbox is a member of an
// engine), every mark in the queue may ride, they are fewer than markRideBelow, a claim began
// within rideFor (units come that often), and no caller of wait hurries. m.mu must be held.
//
// Without Run nothing writes the queue at a shutdown: a process that stops its router and closes
// the database (or a test that checks for goroutines left behind) would lose up to rideFor of
// marks, or find the marker still waiting, where a mark written at once is gone in milliseconds.
// And once Run returned the process is stopping: the units that finish after it write their marks
// at once rather than wait for a next unit that may never come.
func (m *marker) rideUntil() time.Time {
	if !m.mayRide() {
		return time.Time{}
	}
	var until time.Time
	for i, mk := range m.queue {
		if !ridable(mk) || m.rideBy[i].IsZero() {
			return time.Time{}
		}
		if until.IsZero() || m.rideBy[i].Before(until) {
			until = m.rideBy[i]
		}
	}
	return until
}

// mayRide tells whether the queue may wait for units of work at all: riding is on, no caller of
// wait hurries, Run runs, the queue holds fewer than markRideBelow marks and a claim began within
// rideFor. m.mu must be held.
func (m *marker) mayRide() bool {
	if !m.rides || m.hurry > 0 || len(m.queue) == 0 || len(m.queue) >= markRideBelow || m.o.relaysRunning.Load() == 0 {
		return false
	}
	return time.Since(time.Unix(0, m.lastClaim.Load())) <= m.rideFor
}

// takeDue takes out of the queue the marks the worker is to write now: all of them when the
// queue may not wait for units (mayRide), else those that cannot ride or whose time to ride is
// over. The others stay queued for a unit to take: written in one batch with a mark that waits
// for a lock (its claim locked by another transaction), a mark that could still ride waited with
// it, and the next unit found nothing to carry. m.mu must be held.
func (m *marker) takeDue(now time.Time) []outboxdriver.DispatchMark {
	if !m.mayRide() {
		batch := m.queue
		m.queue, m.rideBy = nil, nil
		return batch
	}
	var batch []outboxdriver.DispatchMark
	n := 0
	for i, mk := range m.queue {
		if !ridable(mk) || !m.rideBy[i].After(now) {
			batch = append(batch, mk)
			continue
		}
		m.queue[n], m.rideBy[n] = mk, m.rideBy[i]
		n++
	}
	clear(m.queue[n:])
	m.queue, m.rideBy = m.queue[:n], m.rideBy[:n]
	return batch
}

// poke wakes the worker from its wait for a unit of work.
func (m *marker) poke() {
	select {
	case m.nudge <- struct{}{}:
	default:
	}
}

// add queues the mark of the effects (of src) that were sent; moveClaim as in DispatchMark;
// claimed as in dispatchAndMark (zero if unknown). Inline effects (StoreID 0, see
// outboxdriver.InlineStore) are marked all at once, by source.
func (m *marker) add(src Source, effects []Effect, moveClaim bool, claimed time.Time) {
	if len(effects) == 0 {
		return
	}
	ids := make([]int64, 0, len(effects))
	inline := false
	for _, e := range effects {
		if e.StoreID == 0 {
			inline = true
		} else {
			ids = append(ids, e.StoreID)
		}
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	m.queue = append(m.queue, outboxdriver.DispatchMark{Source: src, StoreIDs: ids, MoveClaim: moveClaim, Inline: inline})
	m.rideBy = append(m.rideBy, m.rideDeadline(time.Now(), claimed))
	if len(m.queue) == markRideBelow {
		m.poke() // enough for a statement of their own
	}
	for _, id := range ids {
		m.queued[id]++
	}
	if inline {
		m.inline[src]++
	}
	if !m.running {
		m.running = true
		go m.work()
	}
}

// markRecall is how long a written mark is remembered. A relay's claim that committed before the
// mark's statement (which then waited on the claim's row locks) returns effects the mark deletes
// right after; the round checks them against the marks queued here a moment later, by which time
// the mark may have been written. Measured under load, that window is milliseconds; a few seconds
// covers it many times over at the cost of a map entry per effect sent in that time.
const markRecall = 5 * time.Second

// writtenMarks is one batch of marks written at a time, for markRecall.
type writtenMarks struct {
	at    time.Time
	batch []outboxdriver.DispatchMark
}

// isQueued tells whether the mark of e is queued, being written, or was written in the last
// markRecall; m.mu must be held.
func (m *marker) isQueued(e Effect) bool {
	if e.StoreID == 0 {
		return m.inline[e.Source] > 0 || m.recentI[e.Source] > 0
	}
	return m.queued[e.StoreID] > 0 || m.recent[e.StoreID] > 0
}

// remember records a batch of marks as written, and forgets those older than markRecall; m.mu
// must be held.
func (m *marker) remember(batch []outboxdriver.DispatchMark, now time.Time) {
	m.written = append(m.written, writtenMarks{at: now, batch: batch})
	for _, mk := range batch {
		for _, id := range mk.StoreIDs {
			m.recent[id]++
		}
		if mk.Inline {
			m.recentI[mk.Source]++
		}
	}
	m.forget(now)
}

// forget drops the written marks older than markRecall; m.mu must be held. It runs on every look
// at them, not only when a mark is written: a mark the database lost (marks commit asynchronously,
// and a failover drops what the standby had not received) would otherwise hold its effects back
// for as long as this process writes no other mark.
func (m *marker) forget(now time.Time) {
	n := 0
	for n < len(m.written) && now.Sub(m.written[n].at) > markRecall {
		for _, mk := range m.written[n].batch {
			for _, id := range mk.StoreIDs {
				if m.recent[id]--; m.recent[id] <= 0 {
					delete(m.recent, id)
				}
			}
			if mk.Inline {
				if m.recentI[mk.Source]--; m.recentI[mk.Source] <= 0 {
					delete(m.recentI, mk.Source)
				}
			}
		}
		n++
	}
	m.written = m.written[n:]
}

func (m *marker) work() {
	for {
		time.Sleep(m.linger)
		m.mu.Lock()
		for {
			// While units of work come often enough, a thin batch waits for one to take it.
			until := m.rideUntil()
			if until.IsZero() || !time.Now().Before(until) {
				break
			}
			m.mu.Unlock()
			t := time.NewTimer(time.Until(until))
			select {
			case <-t.C:
			case <-m.nudge:
			}
			t.Stop()
			m.mu.Lock()
		}
		batch := m.takeDue(time.Now())
		if len(batch) == 0 {
			if len(m.queue) > 0 {
				m.mu.Unlock()
				continue // nothing due yet: they wait for a unit again
			}
			m.running = false
			m.idle.Broadcast()
			m.mu.Unlock()
			return
		}
		m.mu.Unlock()
		// Everything queued while the previous batch was written goes in one statement.
		m.writeAlone(batch)
	}
}

// writeAlone writes batch in statements of its own (not riding on a unit of work) and records it
// as written.
func (m *marker) writeAlone(batch []outboxdriver.DispatchMark) {
	m.alone.Add(1)
	ok := m.write(batch)
	m.mu.Lock()
	if ok {
		m.remember(batch, time.Now())
	}
	m.unqueue(batch)
	m.mu.Unlock()
	// Effects handed to the relay because these were still pending (same ordering key) can go
	// now: wake the relay rather than leave them to its next poll. Without recent hand-offs
	// there is nothing to wake it for, and a relay round per batch of marks costs the database
	// more than the marks.
	if m.o.handoffsInFlight() {
		m.o.kickRelay()
	}
}

// write writes a batch of marks, retrying a failed write (a deadlock, a lost connection) with a
// growing pause until markTimeout has passed: a dropped batch would send every effect of it again.
// It reports whether the batch was written.
func (m *marker) write(batch []outboxdriver.DispatchMark) bool {
	return m.writeBy(batch, func(ctx context.Context) error { return m.o.store.EffectMarkDispatched(ctx, batch...) })
}

// writeBy is write, the batch written by mark.
func (m *marker) writeBy(batch []outboxdriver.DispatchMark, mark func(context.Context) error) bool {
	ctx, cancel := context.WithTimeout(context.Background(), markTimeout)
	defer cancel()
	pause := 20 * time.Millisecond
	for try := 1; ; try++ {
		err := mark(ctx)
		if err == nil {
			m.o.gate.observe(nil)
			return true
		}
		fields := watermill.LogFields{"sources": len(batch), "first_source_id": batch[0].Source.ID, "try": try}
		if permanent(err) {
			m.o.tel.markFailures.Add(ctx, 1, m.o.tel.own())
			m.o.logger.Error("Marking side effects dispatched failed; they may be sent again", err, fields)
			return false
		}
		d := pause
		if m.o.gate.observe(err) {
			d = 0 // the database is unreachable: the batch waits for the probe, as any other work
		}
		select {
		case <-ctx.Done():
			m.o.tel.markFailures.Add(context.Background(), 1, m.o.tel.own())
			m.o.logger.Error("Marking side effects dispatched failed; they may be sent again", err, fields)
			return false
		case <-time.After(d):
		}
		if gerr := m.o.gate.wait(ctx); gerr != nil {
			m.o.tel.markFailures.Add(context.Background(), 1, m.o.tel.own())
			m.o.logger.Error("Marking side effects dispatched failed; they may be sent again", gerr, fields)
			return false
		}
		m.o.logger.Info("Marking side effects dispatched failed; retrying", fields.Add(watermill.LogFields{"error": err.Error()}))
		pause = min(2*pause, time.Second)
	}
}

// unsent returns those of effects whose mark is not queued here nor was written in the last
// markRecall: what this process has not sent lately.
func (m *marker) unsent(effects []Effect) []Effect {
	out, _ := m.split(effects)
	return out
}

// split returns those of effects that this process has not sent lately, and the others (their
// mark is queued here or was written in the last markRecall).
func (m *marker) split(effects []Effect) (unsent, sent []Effect) {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.forget(time.Now())
	unsent = make([]Effect, 0, len(effects))
	for _, e := range effects {
		if m.isQueued(e) {
			sent = append(sent, e)
		} else {
			unsent = append(unsent, e)
		}
	}
	return unsent, sent
}

// wait blocks until every queued mark was written (or failed); the worker stops waiting for units
// of work meanwhile, and no unit takes a mark. Marks riding on a unit in progress are not waited
// for: the unit writes them when it commits, or hands them to workFailed when it ends otherwise (a
// handler may run on after Run returned, and Run's shutdown must not wait for it).
func (m *marker) wait() {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.hurry++
	defer func() { m.hurry-- }()
	m.poke()
	for m.running || m.failedRunning {
		m.idle.Wait()
	}
}

// FlushMarks waits until the dispatched marks queued so far were written. Marks are written in
// the background after a message's effects were sent, or by the claim of the next message (of
// the same consumer, when messages come at most a second apart); call FlushMarks
// before shutting down to avoid re-sends after a restart, and in tests that inspect the tables.
// A mark that rides on a unit of work still in progress is written when that unit commits (or
// in the background when it does not).
func (o *Outbox) FlushMarks() { o.marks.wait() }

// permanent tells an error that a retry cannot get past: the DB was closed, the tables are gone.
func permanent(err error) bool {
	return errors.Is(err, ErrSchemaMissing) || strings.Contains(err.Error(), "sql: database is closed")
}
