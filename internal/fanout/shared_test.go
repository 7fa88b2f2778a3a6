package fanout

import (
	"sync/atomic"
	"testing"
	"time"

	"go.uber.org/goleak"
)

// The callers that come while a call is out share it: one call, and each gets its value. Once it
// returned, the next caller begins a new one.
func TestSharedCallIsOneAtATime(t *testing.T) {
	defer goleak.VerifyNone(t)
	var s Shared[string, int]
	var calls atomic.Int32
	release := make(chan struct{})
	call := func() int { calls.Add(1); <-release; return 7 }
	a := s.Join("m", time.Minute, call)
	b := s.Join("m", time.Minute, call)
	other := s.Join("n", time.Minute, func() int { return 1 })
	if a != b {
		t.Error("a second caller while the call is out began another")
	}
	if got := other.Value(); got != 1 {
		t.Errorf("another key's call = %d, want 1 (a call of its own)", got)
	}
	if began := s.Began("m"); began != a.Began {
		t.Errorf("Began = %v, want the call under way's %v", began, a.Began)
	}
	close(release)
	if a.Value() != 7 || b.Value() != 7 {
		t.Errorf("values %d and %d, want 7", a.Value(), b.Value())
	}
	waitUntil(t, func() bool { return s.Began("m").IsZero() })
	c := s.Join("m", time.Minute, func() int { calls.Add(1); return 8 })
	if c.Value() != 8 || calls.Load() != 2 {
		t.Errorf("after the call returned: value %d after %d calls, want a new call (8, 2 calls)", c.Value(), calls.Load())
	}
}

// A call out past giveUp is given up for a new one, and its return, later, leaves the new one as
// the call under way.
func TestSharedGivesUpAStalledCall(t *testing.T) {
	defer goleak.VerifyNone(t)
	var s Shared[string, string]
	release := make(chan struct{})
	stalled := s.Join("m", time.Hour, func() string { <-release; return "old" })
	time.Sleep(20 * time.Millisecond)
	hold := make(chan struct{})
	fresh := s.Join("m", 10*time.Millisecond, func() string { <-hold; return "new" })
	if fresh == stalled {
		t.Fatal("a call out past giveUp was joined, not given up")
	}
	close(release)
	if stalled.Value() != "old" {
		t.Errorf("the given-up call's value = %q", stalled.Value())
	}
	if s.Join("m", time.Hour, nil) != fresh {
		t.Error("the given-up call's return took the new call out of the Shared")
	}
	close(hold)
	if fresh.Value() != "new" {
		t.Errorf("the new call's value = %q", fresh.Value())
	}
	waitUntil(t, func() bool { return s.Began("m").IsZero() })
}

func waitUntil(t *testing.T, cond func() bool) {
	t.Helper()
	for deadline := time.Now().Add(5 * time.Second); !cond(); time.Sleep(time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("condition not met within 5 s")
		}
	}
}
