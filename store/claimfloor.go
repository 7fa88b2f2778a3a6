package store

import (
	"sync"
	"time"
)

// claimFloorRescan is how often a claim from the front starts from the first pending effect
// rather than from the floor. It finds what the floor cannot account for: an effect unparked by
// another process (whose floor this store does not hear of), a row whose transaction took its id
// before its transaction ID (a moment within one INSERT), ids handed out by a sequence that
// caches them. Such an effect is sent by the relay at most this long after it became due; an
// effect committed late is sent by its own unit of work anyway, and the relay only matters once
// that process has died.
//
// Ten seconds: an operator's retry of parked effects (the console, the CLI: Ops, whose store is
// not the relay's) is sent within them, where a minute left the operator waiting; behind a held
// xmin horizon one claim in ten or so walks the dead entries, not one in sixty.
const claimFloorRescan = 10 * time.Second

// claimFloor is the low-water mark of the relay's claims from the front (Queries.
// EffectClaimDueFloor): no unparked pending effect has an id at or below floor. A claim then
// looks for the first pending effect above the floor, and for the last one above it too, instead
// of from either end of the effects table: behind a held xmin horizon the effects sent and
// deleted since the horizon stay in its indexes as dead entries, which every look-up from an end
// walked (issue 47: 9,000-12,000 blocks per claim, 15-25 times its cost without a hold).
//
// An id below what a claim saw may still turn up: ids come from a sequence at INSERT, and a
// transaction that took id 100 may commit after id 200 was seen and sent. A claim's finding is
// therefore a candidate; the floor moves to it only once every transaction that may hold an id
// at or below it, unseen, has ended (the snapshot xmin of a later claim has reached the
// candidate's xmax: the claim's own transaction ID, taken after its snapshot and after it read
// the sequence, so above every transaction that had an ID then; not the snapshot's xmax, the
// last completed ID plus one, which a running transaction may equal or pass): such a
// transaction has committed, and the later claim sees what it wrote, or rolled back.
// A read-only session that holds the horizon has no transaction ID and does not hold the floor
// back; a writing one does, for as long as it runs, and the claims then cost what they did
// without a floor. Lowering the floor is always safe.
type claimFloor struct {
	mu       sync.Mutex
	floor    int64
	cand     int64 // the candidate floor, when hasCand
	candXmax int64 // every transaction that may hold an id at or below it has a lesser ID
	hasCand  bool
	// epoch changes whenever the floor is lowered: a claim begun before then does not move it,
	// nor propose a candidate, from a snapshot that may predate the change.
	epoch    uint64
	rescanAt time.Time
}

// floorLook is one claim's use of the floor: what it started from, then what it found.
type floorLook struct {
	floor  int64  // the floor it was given
	epoch  uint64 // claimFloor.epoch when it began
	rescan bool   // it starts from 0 because a rescan is due: spent once it ends (end)
	began  time.Time
	// read by the claim:
	seen    bool  // a row came back
	found   bool  // an unparked pending effect lies above floor
	lo      int64 // where its window started: the first such effect's id less one
	xmin    int64 // of its snapshot
	xmax    int64 // above every transaction that may hold an id it did not see at or below its finding
	seqLast int64 // the sequence's last id, read after its snapshot was taken
}

// start returns the floor a claim starts from; a claim from the front (not after an id) starts
// from 0, the start, once per claimFloorRescan.
func (f *claimFloor) start(now time.Time, front bool) floorLook {
	f.mu.Lock()
	defer f.mu.Unlock()
	l := floorLook{floor: f.floor, epoch: f.epoch}
	if front && !now.Before(f.rescanAt) {
		// The rescan is spent by a claim that ends well (end), not by one that fails: the claim
		// after a timeout or a serialization failure rescans in its place.
		l.floor, l.rescan, l.began = 0, true, now
	}
	return l
}

// end takes what a claim from the front found.
func (f *claimFloor) end(l floorLook) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if l.rescan {
		f.rescanAt = l.began.Add(claimFloorRescan)
	}
	if l.epoch != f.epoch {
		return
	}
	// A claim from below the floor (a rescan) that found a pending effect there: the floor
	// goes back to it.
	if l.found && l.lo < f.floor {
		f.floor = l.lo
		f.epoch++
		f.hasCand = false
	}
	// No id at or below c that the claim sees is pending: the first pending one above the floor
	// less one, or, none pending, the last the sequence had handed out (read after the
	// snapshot: an id it could not see is held by a transaction below l.xmax, the claim's own
	// transaction ID, taken after that read).
	c := l.seqLast
	if l.found {
		c = l.lo
	}
	if f.hasCand && l.xmin >= f.candXmax {
		// Every transaction that may have held an id below the candidate has ended, and this
		// claim saw what they committed: c is no greater than any of it that is pending.
		f.floor = max(f.floor, min(f.cand, c))
		f.hasCand = false
	}
	if !f.hasCand && c > f.floor {
		f.cand, f.candXmax, f.hasCand = c, l.xmax, true
	}
}

// lower moves the floor below id (an effect unparked: pending again, below where the claims
// look), and drops what claims under way may propose from snapshots taken before.
func (f *claimFloor) lower(id int64) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.floor = min(f.floor, id-1)
	f.epoch++
	f.hasCand = false
}

// EffectClaimFloor returns the floor the relay's next claim from the front starts from
// (Queries.EffectClaimDueFloor): no unparked pending effect has an id at or below it.
func (s *SQL) EffectClaimFloor() int64 {
	s.floor.mu.Lock()
	defer s.floor.mu.Unlock()
	return s.floor.floor
}
