package store

import (
	"testing"
	"time"
)

// The floor's bookkeeping over a sequence of claims (the statements' side is tested against
// PostgreSQL in drivers/postgres, claimfloor_test.go): a finding becomes the floor only once a
// later claim's snapshot xmin has passed the finding's snapshot xmax; a rescan that finds an
// effect below the floor lowers it; a claim begun before the floor was lowered changes nothing.
func TestClaimFloorBookkeeping(t *testing.T) {
	now := time.Now()
	var f claimFloor
	claim := func(front bool, found bool, lo, xmin, xmax, seqLast int64) floorLook {
		l := f.start(now, front)
		l.seen, l.found, l.lo, l.xmin, l.xmax, l.seqLast = true, found, lo, xmin, xmax, seqLast
		return l
	}
	if l := f.start(now, true); l.floor != 0 {
		t.Fatalf("first claim from floor %d, want 0", l.floor)
	}
	now = now.Add(time.Second)
	f.end(claim(true, true, 99, 1000, 1005, 150))
	if f.floor != 0 {
		t.Fatalf("floor %d at once from a finding: want it to wait for the transactions running then", f.floor)
	}
	// A transaction that was running at xid 1003 is still running: xmin 1003 < 1005.
	f.end(claim(true, true, 120, 1003, 1010, 160))
	if f.floor != 0 {
		t.Fatalf("floor %d while a transaction running at the finding still runs", f.floor)
	}
	// It has ended, and what it committed (id 100) is pending: the floor goes to the first
	// finding, 99, and no further than this claim's, which sees the late effect.
	f.end(claim(true, true, 99, 1006, 1012, 170))
	if f.floor != 99 {
		t.Fatalf("floor %d, want 99 (below the late effect 100)", f.floor)
	}
	// Nothing pending above the floor: the candidate is the sequence's last id as the claim
	// read it, and it waits for the transactions below the claim's own ID (1014).
	f.end(claim(true, false, 99, 1013, 1014, 180))
	if f.floor != 99 {
		t.Fatalf("floor %d, want 99 until a later claim", f.floor)
	}
	f.end(claim(true, false, 99, 1014, 1015, 190))
	if f.floor != 180 {
		t.Fatalf("floor %d, want 180: the sequence's last id as the claim before read it", f.floor)
	}
	// A claim after an id (within a pass) starts from the floor and moves nothing.
	if l := f.start(now, false); l.floor != 180 {
		t.Fatalf("claim after an id from floor %d, want 180", l.floor)
	}
	// A claim under way while an effect is unparked: its finding is dropped.
	stale := claim(true, false, 180, 1016, 1017, 200)
	f.lower(42)
	f.end(stale)
	if f.floor != 41 || f.hasCand {
		t.Fatalf("floor %d (candidate %v) after an unpark of 42 and a claim begun before it: want 41, none", f.floor, f.hasCand)
	}
	// The rescan, a minute on: from the start, and a finding below the floor lowers it.
	f.floor = 300
	now = now.Add(claimFloorRescan)
	l := claim(true, true, 250, 1020, 1021, 400)
	if l.floor != 0 {
		t.Fatalf("rescan from floor %d, want 0", l.floor)
	}
	f.end(l)
	if f.floor != 250 {
		t.Fatalf("floor %d after a rescan found an effect at 251: want 250", f.floor)
	}
	if l := f.start(now, true); l.floor != 250 {
		t.Fatalf("the claim after the rescan from floor %d, want 250", l.floor)
	}
}

// A rescan whose claim failed (a timeout, a lost connection, a serialization failure run again)
// is not spent: the next claim from the front rescans, rather than wait claimFloorRescan more for
// what only a rescan finds.
func TestClaimFloorRescanSurvivesAFailedClaim(t *testing.T) {
	now := time.Now()
	var f claimFloor
	f.floor, f.rescanAt = 500, now
	if l := f.start(now, true); l.floor != 0 {
		t.Fatalf("a claim due to rescan starts from %d, want 0", l.floor)
	}
	// That claim failed: end is not called. The next claim, a moment later, rescans.
	l := f.start(now.Add(time.Millisecond), true)
	if l.floor != 0 {
		t.Fatalf("after a failed rescan the next claim starts from %d, want 0 (the rescan was spent by a claim that failed)", l.floor)
	}
	l.seen, l.found, l.lo, l.xmin, l.xmax, l.seqLast = true, true, 700, 10, 12, 800
	f.end(l)
	if l := f.start(now.Add(2*time.Millisecond), true); l.floor == 0 {
		t.Error("after a rescan that succeeded, the next claim rescans again, want the floor until claimFloorRescan passed")
	}
}
