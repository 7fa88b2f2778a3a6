package outbox

import (
	"testing"
	"time"
)

// The cleanup service begins each run where the one before ended, and every cleanupFullEvery-th
// run from the start, which takes what expired behind the others.
func TestCleanupServiceRunsFromTheStartEveryTenth(t *testing.T) {
	var r cleanupResume
	at := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	for run := 1; run <= 2*cleanupFullEvery+1; run++ {
		resume := r.next()
		full := resume.Claims.IsZero()
		if want := run%cleanupFullEvery == 1; full != want {
			t.Fatalf("run %d began from the start: %t, want %t", run, full, want)
		}
		at = at.Add(time.Minute)
		resume.Claims = at
		r.done(resume)
	}
}
