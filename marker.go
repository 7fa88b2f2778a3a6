package outbox

import (
	"context"
	"errors"
	"strings"
	"sync"
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
// causes a re-send with the same UUIDs, which consumers deduplicate. The worker goroutine runs
// only while marks are queued and exits when the queue is empty, so there is nothing to close.
type marker struct {
	o      *Outbox
	mu     sync.Mutex
	queue  []outboxdriver.DispatchMark
	queued map[int64]int  // store IDs whose mark is queued or being written
	inline map[Source]int // sources whose inline effects' mark is queued or being written
	// written remembers, for markRecall, the marks written lately: a relay round whose claim
	// leased effects just before their mark deleted them must not send them again.
	written []writtenMarks
	recent  map[int64]int
	recentI map[Source]int
	running bool
	idle    *sync.Cond // signalled when the worker exits
}

func newMarker(o *Outbox) *marker {
	m := &marker{o: o, queued: map[int64]int{}, inline: map[Source]int{}, recent: map[int64]int{}, recentI: map[Source]int{}}
	m.idle = sync.NewCond(&m.mu)
	return m
}

// add queues the mark of the effects (of src) that were sent; moveClaim as in DispatchMark.
// Inline effects (StoreID 0, see outboxdriver.InlineStore) are marked all at once, by source.
func (m *marker) add(src Source, effects []Effect, moveClaim bool) {
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
		time.Sleep(markLinger)
		m.mu.Lock()
		batch := m.queue
		m.queue = nil
		if len(batch) == 0 {
			m.running = false
			m.idle.Broadcast()
			m.mu.Unlock()
			return
		}
		m.mu.Unlock()
		// Everything queued while the previous batch was written goes in one statement.
		ok := m.write(batch)
		m.mu.Lock()
		if ok {
			m.remember(batch, time.Now())
		}
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
		m.mu.Unlock()
		// Effects handed to the relay because these were still pending (same ordering key) can go
		// now: wake the relay rather than leave them to its next poll. Without recent hand-offs
		// there is nothing to wake it for, and a relay round per batch of marks costs the
		// database more than the marks.
		if m.o.handoffsInFlight() {
			m.o.kickRelay()
		}
	}
}

// write writes a batch of marks, retrying a failed write (a deadlock, a lost connection) with a
// growing pause until markTimeout has passed: a dropped batch would send every effect of it again.
// It reports whether the batch was written.
func (m *marker) write(batch []outboxdriver.DispatchMark) bool {
	ctx, cancel := context.WithTimeout(context.Background(), markTimeout)
	defer cancel()
	pause := 20 * time.Millisecond
	for try := 1; ; try++ {
		err := m.o.store.EffectMarkDispatched(ctx, batch...)
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

// wait blocks until every queued mark was written (or failed).
func (m *marker) wait() {
	m.mu.Lock()
	defer m.mu.Unlock()
	for m.running {
		m.idle.Wait()
	}
}

// FlushMarks waits until the dispatched marks queued so far were written. Marks are written in
// the background after a message's effects were sent; call FlushMarks before shutting down to
// avoid re-sends after a restart, and in tests that inspect the tables.
func (o *Outbox) FlushMarks() { o.marks.wait() }

// permanent tells an error that a retry cannot get past: the DB was closed, the tables are gone.
func permanent(err error) bool {
	return errors.Is(err, ErrSchemaMissing) || strings.Contains(err.Error(), "sql: database is closed")
}
