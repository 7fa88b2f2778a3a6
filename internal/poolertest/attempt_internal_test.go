package poolertest

import (
	"slices"
	"testing"
)

// An attempt keeps its failures to itself, ends at a fatal one as a test would, and runs its
// clean-ups last first, each even when one before it failed fatally.
func TestAttemptKeepsItsFailures(t *testing.T) {
	a := &attempt{TB: t}
	var order []int
	after := false
	done := make(chan struct{})
	go func() {
		defer close(done)
		defer a.cleanUp()
		a.Cleanup(func() { order = append(order, 1) })
		a.Cleanup(func() { order = append(order, 2); a.Fatal("cleanup 2 failed") })
		a.Cleanup(func() { order = append(order, 3) })
		a.Errorf("first: %d", 1)
		a.Fatalf("second: %s", "fatal")
		after = true
	}()
	<-done
	if after {
		t.Error("the attempt went on after Fatalf")
	}
	if !a.Failed() || !slices.Equal(a.failures, []string{"first: 1", "second: fatal", "cleanup 2 failed"}) {
		t.Errorf("failures %q", a.failures)
	}
	if !slices.Equal(order, []int{3, 2, 1}) {
		t.Errorf("clean-ups ran in the order %v, want [3 2 1]", order)
	}
	if t.Failed() {
		t.Fatal("the attempt's failures reached the test")
	}
}
