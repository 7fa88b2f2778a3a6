package fanout

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"go.uber.org/goleak"
)

func TestEachKeepsToItsTurns(t *testing.T) {
	defer goleak.VerifyNone(t)
	var now, most atomic.Int32
	results, states := Each(context.Background(), 10, 3, time.Minute, func(_ context.Context, i int) int {
		n := now.Add(1)
		for {
			m := most.Load()
			if n <= m || most.CompareAndSwap(m, n) {
				break
			}
		}
		time.Sleep(5 * time.Millisecond)
		now.Add(-1)
		return i * i
	})
	for i := range 10 {
		if states[i] != Done || results[i] != i*i {
			t.Errorf("call %d: state %d, result %d", i, states[i], results[i])
		}
	}
	if m := most.Load(); m > 3 || m < 2 {
		t.Errorf("%d calls at once, want at most 3 (and more than one)", m)
	}
}

// Four calls that do not return hold their turns for hold only: the calls after them are read,
// and Each returns with what it has when the context ends, the four left Pending.
func TestEachGivesAStalledCallsTurnAway(t *testing.T) {
	defer goleak.VerifyNone(t)
	release := make(chan struct{})
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	began := time.Now()
	results, states := Each(ctx, 7, 4, 50*time.Millisecond, func(_ context.Context, i int) string {
		if i < 4 {
			<-release // ignores its context, as lib/pq's connect does
		}
		return "read"
	})
	if took := time.Since(began); took > 3*time.Second {
		t.Errorf("Each took %v with a context of 1 s", took)
	}
	for i := range 7 {
		want := Done
		if i < 4 {
			want = Pending
		}
		if states[i] != want {
			t.Errorf("call %d: state %d, want %d", i, states[i], want)
		}
		if want == Done && results[i] != "read" {
			t.Errorf("call %d: result %q", i, results[i])
		}
	}
	close(release) // the stalled calls end on their own, without a reader
	time.Sleep(10 * time.Millisecond)
}

func TestEachStopsBeginningWhenTheContextEnds(t *testing.T) {
	defer goleak.VerifyNone(t)
	release := make(chan struct{})
	ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
	defer cancel()
	var calls atomic.Int32
	_, states := Each(ctx, 3, 1, time.Hour, func(context.Context, int) int {
		calls.Add(1)
		<-release
		return 1
	})
	if states[0] != Pending || states[1] != NotBegun || states[2] != NotBegun || calls.Load() != 1 {
		t.Errorf("states %v after %d calls: want the first pending and the others not begun", states, calls.Load())
	}
	close(release)
	time.Sleep(10 * time.Millisecond)
}
