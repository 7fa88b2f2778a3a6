package outbox

import (
	"context"
	"errors"
	"os"
	"sync"
	"sync/atomic"
	"time"
)

// OUTBOX_MARK_RIDES=0 runs the package's tests (the fault campaign among them) with riding marks
// off, every mark a statement of the writer's as before them; 1 with them on (the default).
func init() {
	switch os.Getenv("OUTBOX_MARK_RIDES") {
	case "0":
		markRides = false
	case "1":
		markRides = true
	}
}

// EnableMarkRides switches riding marks on (markRides) for the Outboxes that t makes, until t
// ends, whatever OUTBOX_MARK_RIDES says. Not for parallel tests.
func EnableMarkRides(t interface{ Cleanup(func()) }) {
	was := markRides
	markRides = true
	t.Cleanup(func() { markRides = was })
}

// WatchGate counts the probes of ob's database gate, and tells whether the gate held ob's work
// back at any time (sampled every millisecond), until the returned stop is called. Call it before
// ob does any work.
func WatchGate(ob *Outbox) (stop func() (probes int64, held bool)) {
	var n atomic.Int64
	var held atomic.Bool
	probe := ob.gate.probe
	ob.gate.probe = func(ctx context.Context) error {
		n.Add(1)
		return probe(ctx)
	}
	done := make(chan struct{})
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		tick := time.NewTicker(time.Millisecond)
		defer tick.Stop()
		for {
			if ob.gate.holding() {
				held.Store(true)
			}
			select {
			case <-done:
				return
			case <-tick.C:
			}
		}
	}()
	return func() (int64, bool) {
		close(done)
		wg.Wait()
		return n.Load(), held.Load()
	}
}

// SuspectStall has ob's gate suspect a stall, as after a connection without an answer, with
// probe as the gate's probe from now on.
func SuspectStall(ob *Outbox, probe func(context.Context) error) {
	ob.gate.probe = probe
	ob.gate.suspect(errors.New("a connection had no answer (test)"))
}

// MarksWrittenAlone returns how many batches of marks ob's marker wrote in statements of their
// own, not riding on a unit of work.
func MarksWrittenAlone(ob *Outbox) int64 { return ob.marks.alone.Load() }

// LingerMarks sets how long ob's marker lets marks gather before it writes them (markLinger).
// Call it before ob does any work.
func LingerMarks(ob *Outbox, d time.Duration) { ob.marks.linger = d }

// HoldLockedMarksFor sets how long a mark whose claim another transaction holds locked is written
// again before it is given up (markTimeout).
func HoldLockedMarksFor(ob *Outbox, d time.Duration) { ob.marks.holdFor = d }

// GiveUpHealthPingAfter sets when Health gives up on a ping that has not returned
// (healthPingGiveUp), until t ends. Not for parallel tests.
func GiveUpHealthPingAfter(t interface{ Cleanup(func()) }, d time.Duration) {
	was := healthPingGiveUp
	healthPingGiveUp = d
	t.Cleanup(func() { healthPingGiveUp = was })
}

// GateOf returns ob's database gate (nil without one), for the tests of its sharing.
func GateOf(ob *Outbox) any {
	if ob.gate == nil {
		return nil
	}
	return ob.gate
}

// GateUsers counts the Outboxes that ob's gate tells of outages.
func GateUsers(ob *Outbox) int { return len(ob.gate.users.live()) }

// GateAttempts counts the failed connection attempts ob's gate was told of in the outage under
// way (0 when there is none).
func GateAttempts(ob *Outbox) int64 {
	ob.gate.mu.Lock()
	defer ob.gate.mu.Unlock()
	return ob.gate.inOutage
}

// RelaysRunning counts the background lives of ob that count as running its relay
// (outbox.relay.running, Health's relay check).
func RelaysRunning(ob *Outbox) int32 { return ob.relaysRunning.Load() }

// SharedGates counts the gates shared on db.
func SharedGates(db any) int {
	sharedGates.Lock()
	defer sharedGates.Unlock()
	n := 0
	for k := range sharedGates.m {
		if k.pool == db {
			n++
		}
	}
	return n
}

// RelayPass makes one relay pass of ob, as its Run does, and returns its error.
func RelayPass(ctx context.Context, ob *Outbox) error {
	_, _, _, err := ob.relayOnce(ctx)
	return err
}

// RedrivePass makes one pass of ob's redrive policy, as its Run does.
func RedrivePass(ctx context.Context, ob *Outbox) error { return ob.redriveOnce(ctx) }

// CleanupPass makes one cleanup pass of ob, as its Run does, and returns its error.
func CleanupPass(ctx context.Context, ob *Outbox) error {
	_, err := ob.cleanupOnce(ctx)
	return err
}

// MakeDestinationsDue has ob's relay make the backed-off effects of these topics due at its next
// turn, as when each took a call again after an outage of its own.
func MakeDestinationsDue(ob *Outbox, topics ...string) {
	for _, topic := range topics {
		e := Effect{Kind: KindPublish, Topic: topic}
		ob.recovery.failedCall(e)
		ob.recovery.succeededCall(e, false)
	}
}

// DestinationsDue returns how many destinations ob's relay is to make the effects of due at its
// next turn, and keeps them so.
func DestinationsDue(ob *Outbox) int {
	ob.recovery.mu.Lock()
	defer ob.recovery.mu.Unlock()
	return len(ob.recovery.due)
}

// SetRelayLease makes the relay rounds of ob lease their effects for d (a round's calls end after
// d/2), not 2 x PublishTimeout + 30 s, for tests of what happens at a lease's end. Before Run.
func SetRelayLease(ob *Outbox, d time.Duration) { ob.leaseForTest = d }
