package outbox

import (
	"context"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill"
)

// markTimeout bounds the write of one batch of marks.
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
	o       *Outbox
	mu      sync.Mutex
	queue   []DispatchMark
	queued  map[Source]int // sources whose mark is queued or being written
	running bool
	idle    *sync.Cond // signalled when the worker exits
}

func newMarker(o *Outbox) *marker {
	m := &marker{o: o, queued: map[Source]int{}}
	m.idle = sync.NewCond(&m.mu)
	return m
}

// add queues the mark of src; moveClaim as in DispatchMark.
func (m *marker) add(src Source, moveClaim bool) {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.queue = append(m.queue, DispatchMark{Source: src, MoveClaim: moveClaim})
	m.queued[src]++
	if !m.running {
		m.running = true
		go m.work()
	}
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
		// Bounded, so that a database that stopped answering cannot hold up Run's shutdown forever;
		// a mark that times out only causes a re-send.
		ctx, cancel := context.WithTimeout(context.Background(), markTimeout)
		err := m.o.store.EffectMarkDispatched(ctx, batch...)
		cancel()
		if err != nil {
			m.o.logger.Error("Marking side effects dispatched failed; they may be sent again", err,
				watermill.LogFields{"sources": len(batch), "first_source_id": batch[0].Source.ID})
		}
		m.mu.Lock()
		for _, mk := range batch {
			if m.queued[mk.Source]--; m.queued[mk.Source] <= 0 {
				delete(m.queued, mk.Source)
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

// dispatched tells whether this process sent the effects of src and has not written their mark yet:
// a duplicate that finds them pending then knows they were sent.
func (m *marker) dispatched(src Source) bool {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.queued[src] > 0
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
