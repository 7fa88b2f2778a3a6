package outbox

import (
	"sync"
	"testing"
	"time"
)

// newTestMarker is a marker that rides, whose worker never starts (running), on an Outbox with
// relayGrace and Run running.
func newTestMarker(relayGrace, rideFor time.Duration) *marker {
	o := &Outbox{cfg: Config{RelayGrace: relayGrace}}
	o.relaysRunning.Add(1)
	m := &marker{o: o, queued: map[int64]int{}, inline: map[Source]int{}, recent: map[int64]int{}, recentI: map[Source]int{},
		nudge: make(chan struct{}, 1), rides: true, rideFor: rideFor, running: true}
	m.idle = sync.NewCond(&m.mu)
	return m
}

// A mark rides for rideFor after it was queued, and never past half of RelayGrace after its
// claim: a send that took seconds (a slow broker) leaves the ride only what is left of that
// margin, and none once it is used up, after which another instance's relay may take the
// effects; such a mark is the worker's, and no unit takes it.
func TestMarkRidesNoLaterThanHalfTheRelayGraceAfterItsClaim(t *testing.T) {
	m := newTestMarker(10*time.Second, 5*time.Second)
	now := time.Now()
	for _, c := range []struct {
		name    string
		claimed time.Time
		want    time.Time
	}{
		{"claim unknown", time.Time{}, now.Add(5 * time.Second)},
		{"sent at once", now.Add(-10 * time.Millisecond), now.Add(4990 * time.Millisecond)},
		{"sent 3 s after its claim", now.Add(-3 * time.Second), now.Add(2 * time.Second)},
		{"sent 6 s after its claim", now.Add(-6 * time.Second), now.Add(-time.Second)},
	} {
		if got := m.rideDeadline(now, c.claimed); !got.Equal(c.want) {
			t.Errorf("%s: rides until %v from now, want %v", c.name, got.Sub(now), c.want.Sub(now))
		}
	}

	inline := []Effect{{Source: Source{Consumer: "c", ID: "m1"}}}
	m.add(Source{Consumer: "c", ID: "m1"}, inline, false, now.Add(-6*time.Second))
	if until := m.rideUntil(); !until.IsZero() && until.After(time.Now()) {
		t.Errorf("a mark whose claim is 6 s old waits for a unit until %v from now", time.Until(until))
	}
	if sent, late, batch := m.take(Source{Consumer: "c", ID: "m2"}); len(batch) != 0 {
		t.Errorf("the next claim took a mark past its time to ride: sent %v, late %v", sent, late)
	}
	m.add(Source{Consumer: "c", ID: "m3"}, []Effect{{Source: Source{Consumer: "c", ID: "m3"}}}, false, time.Now())
	if sent, _, batch := m.take(Source{Consumer: "c", ID: "m4"}); len(batch) != 1 || len(sent) != 1 || sent[0] != "m3" {
		t.Errorf("the next claim took %v (sent %v), want the mark of m3 alone", batch, sent)
	}
}
