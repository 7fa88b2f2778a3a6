package outbox

import "testing"

// TestRecoveryPerDestination: a success makes due only a destination that was down (or one whose
// effect had failed while its target was down, at most once per retriedRecall), each once, and
// never another destination; a success while nothing failed costs no lock.
func TestRecoveryPerDestination(t *testing.T) {
	var r recovery
	a := Effect{Kind: KindPublish, Topic: "a"}
	b := Effect{Kind: KindPublish, Topic: "b"}
	refund := Effect{Kind: "refund"}
	if r.succeededCall(a, false) {
		t.Fatal("a success with nothing down made a destination due")
	}
	r.failedCall(a)
	r.failedCall(refund)
	if r.succeededCall(b, false) {
		t.Fatal("a success of topic b made it due, though it never failed")
	}
	if !r.succeededCall(a, false) || r.succeededCall(a, false) {
		t.Fatal("topic a back: want it due once")
	}
	due := r.take()
	if len(due) != 1 || due[destinationOf(a)] != (destination{kind: KindPublish, topic: "a"}) {
		t.Fatalf("due after topic a came back: %v", due)
	}
	if !r.succeededCall(refund, false) || r.take()[destinationOf(refund)] != (destination{kind: "refund"}) {
		t.Fatal("applier refund back: want it due")
	}
	if r.failing.Load() != 0 {
		t.Fatalf("%d destinations still down after each came back", r.failing.Load())
	}
	// An effect that had failed while its target was down tells that b is back, once a while.
	if !r.succeededCall(b, true) || r.succeededCall(b, true) {
		t.Fatal("retried effects of topic b: want it due once per retriedRecall")
	}
	if r.take() == nil || r.take() != nil {
		t.Fatal("take must hand the due destinations over once")
	}
}
