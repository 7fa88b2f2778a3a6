package engine

import (
	"context"
	"errors"
	"fmt"
	"math"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/watermill-outbox/outbox/internal/logtest"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// started starts e and stops it when the test ends, failing the test if a run outlives it.
func started(t *testing.T, e *Engine) {
	t.Helper()
	if err := e.Start(context.Background()); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		if err := e.Stop(ctx); err != nil {
			t.Error(err)
		}
	})
}

func add(t *testing.T, e *Engine, m Member) *Handle {
	t.Helper()
	h, err := e.Add(m)
	if err != nil {
		t.Fatal(err)
	}
	return h
}

func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// counter counts the runs of one task.
type counter struct{ n atomic.Int64 }

func (c *counter) task(name string, every time.Duration) Task {
	return Task{Name: name, Every: every, Run: func(context.Context) (Outcome, error) {
		c.n.Add(1)
		return Worked, nil
	}}
}

// 50 members with 4 tasks each, all due all the time: never more than the cap run at once, the
// cap is used, and every task of every member runs.
func TestCapHoldsAcrossManyMembers(t *testing.T) {
	const members, tasks, capacity = 50, 4, 3
	e := New(Config{MaxConcurrent: capacity})
	var inFlight, most atomic.Int64
	runs := make([]atomic.Int64, members*tasks)
	for i := range members {
		m := Member{Name: fmt.Sprint("member", i)}
		for j := range tasks {
			n := &runs[i*tasks+j]
			m.Tasks = append(m.Tasks, Task{Name: fmt.Sprint("task", j), Every: time.Millisecond,
				Run: func(context.Context) (Outcome, error) {
					cur := inFlight.Add(1)
					defer inFlight.Add(-1)
					for {
						old := most.Load()
						if cur <= old || most.CompareAndSwap(old, cur) {
							break
						}
					}
					time.Sleep(time.Millisecond)
					n.Add(1)
					return Worked, nil
				}})
		}
		add(t, e, m)
	}
	started(t, e)
	waitFor(t, "every task to run twice", func() bool {
		for i := range runs {
			if runs[i].Load() < 2 {
				return false
			}
		}
		return true
	})
	if got := most.Load(); got > capacity {
		t.Fatalf("%d runs at once; the cap is %d", got, capacity)
	} else if got < capacity {
		t.Fatalf("at most %d runs at once with %d tasks always due; want the cap, %d, used", got, members*tasks, capacity)
	}
}

// A member whose task takes long holds one slot at a time: with a cap of 1, the tasks of the
// other members that fell due meanwhile run before it runs again.
func TestSlowMemberDoesNotStarveOthers(t *testing.T) {
	e := New(Config{MaxConcurrent: 1})
	var slow atomic.Int64
	add(t, e, Member{Name: "slow", Tasks: []Task{{Name: "slow", Every: time.Millisecond,
		Run: func(ctx context.Context) (Outcome, error) {
			slow.Add(1)
			select {
			case <-time.After(50 * time.Millisecond):
			case <-ctx.Done():
			}
			return Worked, nil
		}}}})
	quick := make([]*counter, 4)
	for i := range quick {
		quick[i] = &counter{}
		add(t, e, Member{Name: fmt.Sprint("quick", i), Tasks: []Task{quick[i].task("quick", 10*time.Millisecond)}})
	}
	started(t, e)
	waitFor(t, "ten slow runs", func() bool { return slow.Load() >= 10 })
	for i, c := range quick {
		// Each slow run is followed by a run of every quick member (all due by then).
		if n := c.n.Load(); n < 8 {
			t.Errorf("member quick%d ran %d times during %d runs of the slow member; want about one per slow run", i, n, slow.Load())
		}
	}
}

// A task that finds nothing to do runs less and less often, up to IdleMax; a wake runs it at
// once and brings its interval back to Every.
func TestIdleBackoffGrowsAndWakeRunsAtOnce(t *testing.T) {
	e := New(Config{})
	var mu sync.Mutex
	var at []time.Time
	var idle atomic.Bool
	idle.Store(true)
	wake := &Wakeup{}
	add(t, e, Member{Name: "m", Tasks: []Task{{Name: "relay", Every: 10 * time.Millisecond, IdleMax: 160 * time.Millisecond, Wake: wake,
		Run: func(context.Context) (Outcome, error) {
			mu.Lock()
			at = append(at, time.Now())
			mu.Unlock()
			if idle.Load() {
				return Idle, nil
			}
			return Worked, nil
		}}}})
	runs := func() []time.Time {
		mu.Lock()
		defer mu.Unlock()
		return append([]time.Time(nil), at...)
	}
	started(t, e)
	waitFor(t, "seven idle runs", func() bool { return len(runs()) >= 7 })
	r := runs()
	// The gaps double: 20, 40, 80, 160, 160 ms. A run is due an interval after its start was
	// scheduled, and the task notes the time once its goroutine runs, which may be late: so a
	// gap may come out shorter than its interval by that delay (159.4 ms for 160 on a loaded
	// machine). A quarter of slack still tells a doubling from Every (10 ms).
	for i, want := range []time.Duration{20, 40, 80, 160, 160} {
		want *= time.Millisecond
		if gap := r[i+2].Sub(r[i+1]); gap < want*3/4 {
			t.Fatalf("gap %d between idle runs: %s, want about %s (at least %s; runs at %v)", i+1, gap, want, want*3/4, r)
		}
	}
	// The interval is at its cap: a wake runs the task long before its next turn.
	time.Sleep(20 * time.Millisecond)
	idle.Store(false)
	before := len(runs())
	woken := time.Now()
	wake.Wake()
	waitFor(t, "the woken run", func() bool { return len(runs()) > before })
	if d := runs()[before].Sub(woken); d > 100*time.Millisecond {
		t.Fatalf("the woken run started %s after the wake; want at once", d)
	}
	// It worked: the next runs are Every apart again.
	waitFor(t, "three runs after the wake", func() bool { return len(runs()) >= before+3 })
	if gap := runs()[before+2].Sub(runs()[before+1]); gap > 100*time.Millisecond {
		t.Fatalf("%s between runs that worked; want about Every (10ms)", gap)
	}
}

// fakeGate is a database gate that is shut until opened.
type fakeGate struct {
	mu      sync.Mutex
	open    bool
	asked   int
	wake    func()
	observe []error
}

func (g *fakeGate) Ready(wake func()) (bool, time.Time) {
	g.mu.Lock()
	defer g.mu.Unlock()
	g.asked++
	if g.open {
		return true, time.Time{}
	}
	if wake != nil {
		g.wake = wake
	}
	return false, time.Now().Add(30 * time.Millisecond) // the next probe
}

func (g *fakeGate) Observe(err error) bool {
	g.mu.Lock()
	defer g.mu.Unlock()
	g.observe = append(g.observe, err)
	return errors.Is(err, errUnreachable)
}

func (g *fakeGate) setOpen() {
	g.mu.Lock()
	g.open = true
	wake := g.wake
	g.wake = nil
	g.mu.Unlock()
	if wake != nil {
		wake()
	}
}

var errUnreachable = errors.New("connection refused")

// A member whose gate is shut is not run, while the others are; the gate is asked again when it
// says (not in a busy loop); once it opens, its wake runs the member's due tasks at once.
func TestShutGateHoldsTheMemberBack(t *testing.T) {
	e := New(Config{MaxConcurrent: 1})
	gate := &fakeGate{}
	var down, up counter
	add(t, e, Member{Name: "down", Gate: gate, Tasks: []Task{down.task("relay", time.Millisecond)}})
	add(t, e, Member{Name: "up", Tasks: []Task{up.task("relay", 5*time.Millisecond)}})
	started(t, e)
	waitFor(t, "20 runs of the other member", func() bool { return up.n.Load() >= 20 })
	time.Sleep(100 * time.Millisecond)
	if n := down.n.Load(); n != 0 {
		t.Fatalf("the member whose database is unreachable ran %d times", n)
	}
	gate.mu.Lock()
	asked := gate.asked
	gate.mu.Unlock()
	// One pass per run of the other member, and one per probe (30 ms apart): not a busy loop.
	if limit := 2*int(up.n.Load()) + 40; asked > limit {
		t.Fatalf("the shut gate was asked %d times (the other member ran %d times); want the scheduler to wait for it", asked, up.n.Load())
	}
	gate.setOpen()
	waitFor(t, "the member to run once its gate opened", func() bool { return down.n.Load() > 0 })
}

// An error that says the database is unreachable goes to the gate, not to the log; any other is
// logged.
func TestRunErrorsGoToTheGateOrTheLog(t *testing.T) {
	logs := &logtest.Errors{}
	e := New(Config{Logger: logs})
	gate := &fakeGate{open: true}
	var n atomic.Int64
	add(t, e, Member{Name: "m", Gate: gate, Tasks: []Task{{Name: "relay", Every: time.Millisecond,
		Run: func(context.Context) (Outcome, error) {
			if n.Add(1)%2 == 1 {
				return Worked, errUnreachable
			}
			return Worked, errors.New("deadlock detected")
		}}}})
	started(t, e)
	waitFor(t, "four runs", func() bool { return n.Load() >= 4 })
	if !logs.Contains("outbox relay failed: deadlock detected") {
		t.Fatalf("the failure was not logged: %q", logs.Lines())
	}
	if logs.Contains(errUnreachable.Error()) {
		t.Fatalf("an unreachable database was logged by the engine, which the gate reports: %q", logs.Lines())
	}
}

// A run whose context ended (its member removed, the engine stopped, its bound passed) and that
// returns nil says nothing of the database: the gate is not told of a success, which would end
// an outage under way (every waiting unit of work then dialed again, and the outage was reported
// over while the database was still gone).
func TestEndedRunsNilIsNoSuccess(t *testing.T) {
	e := New(Config{})
	gate := &fakeGate{open: true}
	inside := make(chan struct{})
	h := add(t, e, Member{Name: "m", Gate: gate, Tasks: []Task{{Name: "relay", Every: time.Hour,
		Run: func(ctx context.Context) (Outcome, error) {
			close(inside)
			<-ctx.Done() // a relay whose marks waited for the gate, given up as the member leaves
			return Worked, nil
		}}}})
	started(t, e)
	<-inside
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := h.Remove(ctx); err != nil {
		t.Fatal(err)
	}
	gate.mu.Lock()
	defer gate.mu.Unlock()
	if len(gate.observe) != 0 {
		t.Fatalf("the gate was told %v of a run its member's removal ended; want nothing", gate.observe)
	}
}

// Stop waits for the run in progress (whose context it ended), and nothing outlives it.
func TestStopWaitsForTheRunInProgress(t *testing.T) {
	defer goleak.VerifyNone(t)
	e := New(Config{})
	inside, release := make(chan struct{}), make(chan struct{})
	var returned atomic.Bool
	add(t, e, Member{Name: "m", Tasks: []Task{{Name: "relay", Every: time.Hour,
		Run: func(ctx context.Context) (Outcome, error) {
			close(inside)
			<-ctx.Done()
			<-release // a call that takes its time to see its context end
			returned.Store(true)
			return Worked, ctx.Err()
		}}}})
	if err := e.Start(context.Background()); err != nil {
		t.Fatal(err)
	}
	<-inside
	short, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel()
	if err := e.Stop(short); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("Stop with a run in progress and a short context: %v, want its deadline", err)
	}
	time.AfterFunc(50*time.Millisecond, func() { close(release) })
	ctx, cancel2 := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel2()
	if err := e.Stop(ctx); err != nil {
		t.Fatal(err)
	}
	if !returned.Load() {
		t.Fatal("Stop returned before the run in progress")
	}
	if _, err := e.Add(Member{Name: "late"}); !errors.Is(err, ErrStopped) {
		t.Fatalf("Add after Stop: %v, want ErrStopped", err)
	}
}

// A task that panics is logged and counted as an error; the engine, and the task, go on.
func TestPanicInATaskIsAnError(t *testing.T) {
	logs := &logtest.Errors{}
	e := New(Config{MaxConcurrent: 1, Logger: logs})
	var panics atomic.Int64
	var other counter
	add(t, e, Member{Name: "buggy", Tasks: []Task{{Name: "stats sampling", Every: time.Millisecond,
		Run: func(context.Context) (Outcome, error) {
			panics.Add(1)
			var m map[string]int
			m["boom"]++ // a nil map: panics
			return Worked, nil
		}}}})
	add(t, e, Member{Name: "fine", Tasks: []Task{other.task("relay", time.Millisecond)}})
	started(t, e)
	waitFor(t, "three panics and runs of the other member", func() bool { return panics.Load() >= 3 && other.n.Load() >= 3 })
	st := e.Stats()
	if st.Panics < 3 || st.Errors < st.Panics {
		t.Fatalf("stats %+v after %d panics; want each counted as a panic and an error", st, panics.Load())
	}
	if !logs.Contains("outbox stats sampling failed: panic: assignment to entry in nil map") {
		t.Fatalf("the panic was not logged: %q", logs.Lines())
	}
	if stack := logs.Field("panic: assignment to entry in nil map", "stack"); !strings.Contains(stack, "engine_test.go") {
		t.Errorf("the panic was logged without the stack it was raised on: %q", stack)
	}
}

// A task that panics after its deadline passed (a call that outlived its bound, then crashed on
// what it got back) is logged as any panic: only the error a run's end brings is left unsaid.
// Before, a panic on that path was counted and never logged, and no stack was kept of any.
func TestPanicPastTheDeadlineIsLogged(t *testing.T) {
	logs := &logtest.Errors{}
	e := New(Config{MaxConcurrent: 1, Logger: logs})
	var panics atomic.Int64
	add(t, e, Member{Name: "late", Tasks: []Task{{Name: "cleanup", Every: time.Millisecond, Timeout: 10 * time.Millisecond,
		Run: func(ctx context.Context) (Outcome, error) {
			<-ctx.Done()
			panics.Add(1)
			panic(fmt.Errorf("after %w", ctx.Err()))
		}}}})
	started(t, e)
	waitFor(t, "a panic past the deadline", func() bool { return panics.Load() >= 1 && e.Stats().Panics >= 1 })
	waitFor(t, "the panic logged", func() bool { return logs.Contains("outbox cleanup failed: panic: after context deadline exceeded") })
	if stack := logs.Field("panic: after context deadline exceeded", "stack"); !strings.Contains(stack, "TestPanicPastTheDeadlineIsLogged") {
		t.Errorf("the panic was logged without the stack it was raised on: %q", stack)
	}
}

// Members come and go while the engine runs: a member added is run at once; Remove ends the
// context of its run in progress, waits for it, and none of its tasks runs again; its wake-up no
// longer reaches the engine.
func TestAddAndRemoveWhileRunning(t *testing.T) {
	e := New(Config{MaxConcurrent: 2})
	var first counter
	add(t, e, Member{Name: "first", Tasks: []Task{first.task("relay", time.Millisecond)}})
	started(t, e)
	waitFor(t, "the first member to run", func() bool { return first.n.Load() > 0 })

	inside := make(chan struct{}, 1)
	var runs atomic.Int64
	var returned atomic.Bool
	wake := &Wakeup{}
	h := add(t, e, Member{Name: "second", Tasks: []Task{{Name: "relay", Every: time.Hour, Wake: wake,
		Run: func(ctx context.Context) (Outcome, error) {
			runs.Add(1)
			select {
			case inside <- struct{}{}:
			default:
			}
			<-ctx.Done()
			time.Sleep(20 * time.Millisecond)
			returned.Store(true)
			return Worked, nil
		}}}})
	select {
	case <-inside:
	case <-time.After(10 * time.Second):
		t.Fatal("a member added to a running engine was not run")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := h.Remove(ctx); err != nil {
		t.Fatal(err)
	}
	if !returned.Load() {
		t.Fatal("Remove returned before the member's run in progress")
	}
	wake.Wake()
	before := first.n.Load()
	waitFor(t, "the first member to go on", func() bool { return first.n.Load() > before+5 })
	if n := runs.Load(); n != 1 {
		t.Fatalf("the removed member ran %d times; want once, before its removal", n)
	}
}

// A member added before Start is run when the engine starts.
func TestMemberAddedBeforeStart(t *testing.T) {
	e := New(Config{})
	var c counter
	add(t, e, Member{Name: "m", Tasks: []Task{c.task("cleanup", time.Hour)}})
	time.Sleep(20 * time.Millisecond)
	if c.n.Load() != 0 {
		t.Fatal("a task ran before Start")
	}
	started(t, e)
	waitFor(t, "the first run", func() bool { return c.n.Load() == 1 })
}

// A run that ignores its context keeps Remove and Stop waiting only until their own contexts
// end, and their errors name the runs they waited for.
func TestStopNamesTheRunsItWaitsFor(t *testing.T) {
	e := New(Config{})
	entered, release := make(chan struct{}), make(chan struct{})
	stuck := Task{Name: "relay", Every: time.Hour, Run: func(context.Context) (Outcome, error) {
		close(entered)
		<-release // ignores its context
		return Worked, nil
	}}
	h := add(t, e, Member{Name: "acme", Tasks: []Task{stuck}})
	if err := e.Start(context.Background()); err != nil {
		t.Fatal(err)
	}
	<-entered
	short := func() context.Context {
		ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
		t.Cleanup(cancel)
		return ctx
	}
	if err := h.Remove(short()); err == nil || !strings.Contains(err.Error(), `relay of member "acme"`) || !errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("Remove = %v, want the stuck run named", err)
	}
	if err := e.Stop(short()); err == nil || !strings.Contains(err.Error(), `relay of member "acme"`) {
		t.Errorf("Stop = %v, want the stuck run of the removed member named", err)
	}
	close(release)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := e.Stop(ctx); err != nil {
		t.Errorf("Stop once the run returned: %v", err)
	}
}

// A run that reports IdleUntil a time is followed by the next no later than that time, however
// far the task backed off, and no sooner than Every after its start: a due time already past
// does not make the task run back to back.
func TestIdleUntilBringsTheNextRunForward(t *testing.T) {
	e := New(Config{})
	var mu sync.Mutex
	var at []time.Time
	add(t, e, Member{Name: "m", Tasks: []Task{{Name: "relay", Every: 50 * time.Millisecond, IdleMax: time.Hour,
		Run: func(context.Context) (Outcome, error) {
			mu.Lock()
			defer mu.Unlock()
			now := time.Now()
			at = append(at, now)
			switch len(at) {
			case 6: // backed off to 3.2 s by now: something falls due in 300 ms
				return IdleUntil(now.Add(300 * time.Millisecond)), nil
			case 7: // a due time already past
				return IdleUntil(now.Add(-time.Second)), nil
			}
			return Idle, nil
		}}}})
	runs := func() []time.Time {
		mu.Lock()
		defer mu.Unlock()
		return append([]time.Time(nil), at...)
	}
	started(t, e)
	// Idle runs 100, 200, 400, 800 and 1,600 ms apart; then the sixth and seventh.
	waitFor(t, "eight runs", func() bool { return len(runs()) >= 8 })
	r := runs()
	if gap := r[6].Sub(r[5]); gap > 450*time.Millisecond || gap < 290*time.Millisecond {
		t.Errorf("the run after IdleUntil 300 ms came %s after the one before, want about 300 ms, not the backoff's 3.2 s (runs at %v)", gap, r)
	}
	if gap := r[7].Sub(r[6]); gap < 40*time.Millisecond || gap > time.Second {
		t.Errorf("the run after IdleUntil a past time came %s after the one before, want Every (50 ms): not at once, nor backed off", gap)
	}
}

// stalledTasks returns n tasks that each block, ignoring their context, until release is closed
// (a driver connecting to a server that accepts and never answers), and counts their calls and
// the most calls of one task out at once.
type stalledTasks struct {
	release     chan struct{}
	calls       []atomic.Int64
	out, mostIn atomic.Int64
}

func newStalled(n int) *stalledTasks {
	return &stalledTasks{release: make(chan struct{}), calls: make([]atomic.Int64, n)}
}

func (s *stalledTasks) tasks(every, timeout time.Duration) []Task {
	var ts []Task
	for i := range s.calls {
		ts = append(ts, Task{Name: fmt.Sprint("task", i), Every: every, Timeout: timeout,
			Run: func(context.Context) (Outcome, error) {
				s.calls[i].Add(1)
				cur := s.out.Add(1)
				defer s.out.Add(-1)
				for {
					old := s.mostIn.Load()
					if cur <= old || s.mostIn.CompareAndSwap(old, cur) {
						break
					}
				}
				<-s.release
				return Worked, nil
			}})
	}
	return ts
}

// A member whose tasks all block ignoring their context, more of them than the cap: each run is
// abandoned once its bound and the grace passed, so that the other member's task keeps running
// on schedule. Each stalled task has one call out at most (it is not started again while its call
// is out), the member's gate and the log are told which task did not answer and for how long,
// and once the calls return the tasks run again as usual.
func TestStalledRunsAreAbandoned(t *testing.T) {
	logs := &logtest.Errors{}
	const timeout, grace = 100 * time.Millisecond, 50 * time.Millisecond
	e := New(Config{MaxConcurrent: 2, AbandonGrace: grace, Logger: logs})
	stalled := newStalled(3)
	gate := &fakeGate{open: true}
	add(t, e, Member{Name: "stalled", Gate: gate, Tasks: stalled.tasks(10*time.Millisecond, timeout)})
	healthy := &counter{}
	add(t, e, Member{Name: "healthy", Tasks: []Task{healthy.task("relay", 20*time.Millisecond)}})
	started(t, e)
	defer func() {
		select {
		case <-stalled.release:
		default:
			close(stalled.release)
		}
	}()

	// The stalled runs hold the two slots for at most timeout+grace, then the third one does.
	time.Sleep(2*(timeout+grace) + 200*time.Millisecond)
	before := healthy.n.Load()
	time.Sleep(time.Second)
	// Every 20 ms: about 50 runs in a second.
	if n := healthy.n.Load() - before; n < 25 {
		t.Fatalf("the healthy member's task ran %d times in 1 s beside a stalled member (every 20 ms: about 50)", n)
	}
	for i := range stalled.calls {
		if n := stalled.calls[i].Load(); n != 1 {
			t.Errorf("stalled task%d was called %d times while its first call was out, want 1", i, n)
		}
	}
	if got := e.Stats().Abandoned; got != 3 {
		t.Errorf("%d runs abandoned, want 3", got)
	}
	gate.mu.Lock()
	var told int
	for _, err := range gate.observe {
		if errors.Is(err, ErrNoAnswer) {
			told++
		}
	}
	gate.mu.Unlock()
	if told != 3 {
		t.Errorf("the gate observed %d ErrNoAnswer, want one per abandoned run (3)", told)
	}
	if !logs.Contains(`task0 of member "stalled" has not returned`) || !logs.Contains("(bound 100ms)") {
		t.Errorf("no log line names the abandoned task, its member and how long it ran: %q", logs.Lines())
	}

	close(stalled.release)
	waitFor(t, "the stalled tasks to run again once their calls returned", func() bool {
		for i := range stalled.calls {
			if stalled.calls[i].Load() < 3 {
				return false
			}
		}
		return true
	})
	if n := stalled.mostIn.Load(); n != 3 {
		t.Errorf("at most %d stalled calls out at once, want 3 (one per task)", n)
	}
}

// Stop and Remove wait for an abandoned call only as long as their contexts allow, and their
// errors name it as abandoned and say for how long it has been out.
func TestStopNamesAbandonedRuns(t *testing.T) {
	e := New(Config{AbandonGrace: 10 * time.Millisecond})
	stalled := newStalled(1)
	h := add(t, e, Member{Name: "acme", Tasks: stalled.tasks(time.Hour, 20*time.Millisecond)})
	if err := e.Start(context.Background()); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "the run abandoned", func() bool { return e.Stats().Abandoned == 1 })
	short := func() context.Context {
		ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
		t.Cleanup(cancel)
		return ctx
	}
	began := time.Now()
	if err := h.Remove(short()); err == nil || !strings.Contains(err.Error(), `task0 of member "acme", abandoned, out for`) ||
		!errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("Remove = %v, want the abandoned run named", err)
	}
	if err := e.Stop(short()); err == nil || !strings.Contains(err.Error(), `task0 of member "acme", abandoned`) {
		t.Errorf("Stop = %v, want the abandoned run of the removed member named", err)
	}
	if took := time.Since(began); took > 2*time.Second {
		t.Errorf("Remove and Stop with 200 ms each took %s", took)
	}
	close(stalled.release)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := e.Stop(ctx); err != nil {
		t.Errorf("Stop once the abandoned call returned: %v", err)
	}
}

// Resume ends a task's backoff without running it at once: a member that comes back to work has
// its sampling at its normal pace again, and a burst of resumes (one per commit) does not run it
// once per resume.
func TestResumeEndsBackoffWithoutRunningAtOnce(t *testing.T) {
	e := New(Config{})
	var mu sync.Mutex
	var at []time.Time
	resume := &Wakeup{}
	const every = 100 * time.Millisecond
	add(t, e, Member{Name: "m", Tasks: []Task{{Name: "stats sampling", Every: every, IdleMax: time.Hour, Resume: resume,
		Run: func(context.Context) (Outcome, error) {
			mu.Lock()
			at = append(at, time.Now())
			mu.Unlock()
			return Idle, nil
		}}}})
	runs := func() []time.Time {
		mu.Lock()
		defer mu.Unlock()
		return append([]time.Time(nil), at...)
	}
	started(t, e)
	// Idle runs at 0, 200 ms, 600 ms, then 1.4 s: wait for the third and resume 50 ms after it,
	// at once and then again and again for 300 ms.
	waitFor(t, "three idle runs", func() bool { return len(runs()) >= 3 })
	third := runs()[2]
	time.Sleep(time.Until(third.Add(50 * time.Millisecond)))
	end := time.Now().Add(300 * time.Millisecond)
	for time.Now().Before(end) {
		resume.Wake()
		time.Sleep(time.Millisecond)
	}
	r := runs()
	if len(r) < 4 {
		t.Fatalf("no run within 350 ms of the last (which backed off to 800 ms) after resumes; want one Every (100 ms) after it (runs at %v)", r)
	}
	if gap := r[3].Sub(third); gap < every*3/4 || gap > 300*time.Millisecond {
		t.Errorf("the run after the resume came %s after the one before; want about Every (100 ms), not at once nor the backoff's 800 ms", gap)
	}
	// Three runs at most in the 350 ms of resumes (at about 100, 200, 300 ms after the third):
	// resumed, the task runs at Every, not once per resume.
	if n := len(r) - 3; n > 4 {
		t.Errorf("%d runs during 300 ms of resumes every millisecond; want about three (Every is 100 ms)", n)
	}
}

// budgeted returns n members with one task each, due every interval and sharing b, which record
// the starts of their runs.
func budgeted(n int, interval time.Duration, b *Budget) (members []Member, starts func() [][]time.Time) {
	var mu sync.Mutex
	runs := make([][]time.Time, n)
	for i := range n {
		members = append(members, Member{Name: fmt.Sprint("member", i), Tasks: []Task{{Name: "sample", Every: interval, Budget: b,
			Run: func(context.Context) (Outcome, error) {
				mu.Lock()
				runs[i] = append(runs[i], time.Now())
				mu.Unlock()
				return Worked, nil
			}}}})
	}
	return members, func() [][]time.Time {
		mu.Lock()
		defer mu.Unlock()
		out := make([][]time.Time, n)
		for i, r := range runs {
			out[i] = slices.Clone(r)
		}
		return out
	}
}

// 20 members whose task is due every 10 ms share a budget of one run per 50 ms: the runs of all
// of them keep to the budget (each alone would run a hundred times a second), and the members
// are served in turn: none runs twice more than another.
func TestBudgetSpacesRunsAcrossMembers(t *testing.T) {
	const n, every = 20, 50 * time.Millisecond
	e := New(Config{})
	members, starts := budgeted(n, 10*time.Millisecond, &Budget{Every: every, MaxGap: time.Minute})
	for _, m := range members {
		add(t, e, m)
	}
	started(t, e)
	time.Sleep(2500 * time.Millisecond)
	runs := starts()
	var all []time.Time
	fewest, most := int(^uint(0)>>1), 0
	for _, r := range runs {
		all = append(all, r...)
		fewest, most = min(fewest, len(r)), max(most, len(r))
	}
	slices.SortFunc(all, func(a, b time.Time) int { return a.Compare(b) })
	if len(all) < 2 {
		t.Fatalf("%d runs", len(all))
	}
	span := all[len(all)-1].Sub(all[0])
	// Starts are recorded inside the runs, a little after the budget let them go: a few ms of
	// slack on the span.
	if allowed := int((span+10*time.Millisecond)/every) + 1; len(all) > allowed {
		t.Errorf("%d runs in %s, more than the budget's %d (one per %s)", len(all), span.Round(time.Millisecond), allowed, every)
	}
	if fewest < 2 || most-fewest > 1 {
		t.Errorf("runs per member from %d to %d: want each served in turn, at least twice", fewest, most)
	}
}

// While more members share a budget than it serves within MaxGap, each member's runs are still at
// most MaxGap apart: 10 members due every 10 ms on a budget of one run per 100 ms would each run
// once a second; with MaxGap 300 ms, every 300 ms.
func TestBudgetMaxGapBoundsTheHold(t *testing.T) {
	const n, gap = 10, 300 * time.Millisecond
	e := New(Config{})
	members, starts := budgeted(n, 10*time.Millisecond, &Budget{Every: 100 * time.Millisecond, MaxGap: gap})
	for _, m := range members {
		add(t, e, m)
	}
	started(t, e)
	time.Sleep(2 * time.Second)
	for i, r := range starts() {
		if len(r) < 4 {
			t.Errorf("member %d ran %d times in 2 s: want every %s at most", i, len(r), gap)
			continue
		}
		for j := 1; j < len(r); j++ {
			if d := r[j].Sub(r[j-1]); d > gap+100*time.Millisecond {
				t.Errorf("member %d: %s between two runs, more than MaxGap %s", i, d.Round(time.Millisecond), gap)
			}
		}
	}
}

// A task alone on its budget, due less often than the budget allows, runs at its own interval:
// as often as the same task without a budget, beside it on the same engine (a loaded machine
// delays the timers of both alike; counted against the wall clock, CI's once ran 38 in a second).
func TestBudgetLeavesAMemberWithinItUnaffected(t *testing.T) {
	e := New(Config{})
	members, starts := budgeted(1, 20*time.Millisecond, &Budget{Every: 5 * time.Millisecond, MaxGap: time.Minute})
	control, controlStarts := budgeted(1, 20*time.Millisecond, nil)
	control[0].Name = "control"
	add(t, e, members[0])
	add(t, e, control[0])
	started(t, e)
	time.Sleep(time.Second)
	got, want := len(starts()[0]), len(controlStarts()[0])
	t.Logf("runs in 1 s at an interval of 20 ms: %d under a budget of one per 5 ms, %d without one", got, want)
	if want < 10 {
		t.Fatalf("the task without a budget ran %d times in 1 s at an interval of 20 ms: the machine is too loaded to tell", want)
	}
	if got < want*8/10 {
		t.Errorf("%d runs under a budget of one per 5 ms against %d without one, at an interval of 20 ms: the budget held the task back", got, want)
	}
}

// Members that share a Pool run at most its Max at once, whatever MaxConcurrent allows; a member
// of another pool, or of none, is not held back by it.
func TestPoolCapsRunsOfItsMembers(t *testing.T) {
	e := New(Config{MaxConcurrent: 8})
	shared := &Pool{Max: 2}
	var mu sync.Mutex
	running := map[string]int{}
	most := map[string]int{}
	release := make(chan struct{})
	task := func(group string) Task {
		return Task{Name: "work", Every: time.Hour, Run: func(ctx context.Context) (Outcome, error) {
			mu.Lock()
			running[group]++
			most[group] = max(most[group], running[group])
			mu.Unlock()
			select {
			case <-release:
			case <-ctx.Done():
			}
			mu.Lock()
			running[group]--
			mu.Unlock()
			return Worked, nil
		}}
	}
	for i := range 5 {
		add(t, e, Member{Name: fmt.Sprint("shared", i), Pool: shared, Tasks: []Task{task("shared")}})
	}
	add(t, e, Member{Name: "own", Pool: &Pool{Max: 2}, Tasks: []Task{task("own")}})
	add(t, e, Member{Name: "none", Tasks: []Task{task("none")}})
	started(t, e)
	waitFor(t, "the runs that may start", func() bool {
		mu.Lock()
		defer mu.Unlock()
		return running["shared"] == 2 && running["own"] == 1 && running["none"] == 1
	})
	time.Sleep(100 * time.Millisecond) // a third run of the shared pool would start meanwhile
	mu.Lock()
	if most["shared"] != 2 {
		t.Errorf("%d runs of the shared pool's members at once, want 2", most["shared"])
	}
	mu.Unlock()
	close(release) // the other three of the shared pool run, two at a time
	waitFor(t, "every run", func() bool { return e.Stats().Runs >= 7 })
	mu.Lock()
	defer mu.Unlock()
	if most["shared"] != 2 {
		t.Errorf("%d runs of the shared pool's members at once, want 2", most["shared"])
	}
}

// A pool whose server stopped answering: its members' calls stall, ignoring their contexts, and
// are abandoned. An abandoned call still holds a connection of its pool, so it keeps its slot of
// the Pool (not of MaxConcurrent) until it returns: the pool's other members start no more calls
// into it than Pool.Max in all, rather than one more stalled goroutine and connection attempt
// per task of every member each time one is abandoned. A member of another pool runs on.
func TestAbandonedRunsKeepTheirPoolSlot(t *testing.T) {
	const timeout, grace = 50 * time.Millisecond, 20 * time.Millisecond
	e := New(Config{MaxConcurrent: 4, AbandonGrace: grace, Logger: &logtest.Errors{}})
	hung := &Pool{Max: 2}
	stalled := newStalled(3)
	for i := range 6 {
		// A gate per member, as every Outbox has: each is told of its own abandoned runs only.
		add(t, e, Member{Name: fmt.Sprint("hung", i), Pool: hung, Gate: &fakeGate{open: true}, Tasks: stalled.tasks(10*time.Millisecond, timeout)})
	}
	healthy := &counter{}
	add(t, e, Member{Name: "healthy", Pool: &Pool{Max: 2}, Tasks: []Task{healthy.task("relay", 20*time.Millisecond)}})
	started(t, e)
	defer func() {
		select {
		case <-stalled.release:
		default:
			close(stalled.release)
		}
	}()

	// Long enough for every member's tasks to be started and abandoned in turn, were the pool's
	// slots freed at abandonment: 18 tasks, two at a time, 70 ms each.
	time.Sleep(10 * (timeout + grace))
	before := healthy.n.Load()
	time.Sleep(500 * time.Millisecond)
	if n := stalled.mostIn.Load(); n > int64(hung.Max) {
		t.Errorf("%d calls out at once into the hung pool, want at most its Max (%d): an abandoned call still holds its connection", n, hung.Max)
	}
	if n := healthy.n.Load() - before; n < 10 {
		t.Errorf("the member of another pool ran %d times in 500 ms beside the hung pool (every 20 ms: about 25)", n)
	}
	close(stalled.release)
	waitFor(t, "the hung pool's members to run once its calls returned", func() bool {
		for i := range stalled.calls {
			if stalled.calls[i].Load() < 2 {
				return false
			}
		}
		return true
	})
}

// A member whose gate is shut, in a pool whose slot another member's run holds, leaves the
// scheduler asleep until that run ends: its gate is not asked while the pool is full, and what it
// said when last asked (ask again in 30 ms) is not taken for a time to wake up at once, again and
// again. Before, once that time had passed, the scheduler woke at once on every pass for as long
// as the pool stayed full (a call abandoned in a stalled pool keeps its slot until it returns).
func TestShutGateInAFullPoolLeavesTheSchedulerAsleep(t *testing.T) {
	e := New(Config{MaxConcurrent: 4})
	pool := &Pool{Max: 1}
	release := make(chan struct{})
	var held atomic.Bool
	add(t, e, Member{Name: "busy", Pool: pool, Tasks: []Task{{Name: "relay", Every: time.Millisecond,
		Run: func(context.Context) (Outcome, error) {
			if held.CompareAndSwap(false, true) {
				<-release // holds the pool's one slot
			}
			return Worked, nil
		}}}})
	gate := &fakeGate{}
	var down counter
	add(t, e, Member{Name: "down", Pool: pool, Gate: gate, Tasks: []Task{down.task("relay", time.Millisecond)}})
	started(t, e)
	defer func() {
		if held.Load() {
			select {
			case <-release:
			default:
				close(release)
			}
		}
	}()
	waitFor(t, "the busy member to hold the pool's slot", held.Load)
	time.Sleep(100 * time.Millisecond) // past the gate's "ask again in 30 ms"
	before := e.passes.Load()
	time.Sleep(300 * time.Millisecond)
	if n := e.passes.Load() - before; n > 20 {
		t.Errorf("the scheduler made %d passes in 300 ms while the pool was full and nothing could start, want a few", n)
	}
	if n := down.n.Load(); n != 0 {
		t.Errorf("the member behind its shut gate ran %d times", n)
	}
	close(release)
	gate.setOpen()
	waitFor(t, "the member to run once its gate opened and the pool's slot was free", func() bool { return down.n.Load() > 0 })
}

// A stopped engine's tasks leave their Wakeups: an Outbox's commits wake its relay through one
// Wakeup for the life of the Outbox, and each Run's engine, once stopped, stayed attached to it.
func TestStopDetachesTheWakeups(t *testing.T) {
	wake, resume := &Wakeup{}, &Wakeup{}
	attached := func(w *Wakeup) int {
		w.mu.Lock()
		defer w.mu.Unlock()
		return len(w.tasks)
	}
	for range 3 { // three Runs one after another
		e := New(Config{})
		add(t, e, Member{Name: "m", Tasks: []Task{{Name: "relay", Every: time.Hour, Wake: wake, Resume: resume,
			Run: func(context.Context) (Outcome, error) { return Idle, nil }}}})
		if err := e.Start(context.Background()); err != nil {
			t.Fatal(err)
		}
		if n := attached(wake); n != 1 {
			t.Errorf("%d tasks on the Wakeup while one engine runs, want 1", n)
		}
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		if err := e.Stop(ctx); err != nil {
			t.Fatal(err)
		}
		cancel()
	}
	if n, r := attached(wake), attached(resume); n != 0 || r != 0 {
		t.Errorf("%d tasks on the Wake and %d on the Resume after every engine stopped, want none", n, r)
	}
	wake.Wake() // wakes nothing, and does not block
}

// proberGate is a fakeGate that can be asked to ping its database (Prober).
type proberGate struct {
	fakeGate
	answers bool
	probes  atomic.Int32
}

func (g *proberGate) Probe() (answered, judged bool) {
	g.probes.Add(1)
	return g.answers, true
}

// A run without an answer for StallAfter has its member's gate ping the database; when the ping
// gets none either, the run's context ends and it is abandoned then, not at its bound, its slot
// going to the other member and the gate told. When the ping answers (a run that is only slow),
// nothing is abandoned.
func TestStalledRunIsProbedAndAbandonedBeforeItsBound(t *testing.T) {
	for _, answers := range []bool{false, true} {
		t.Run(fmt.Sprint("ping answered ", answers), func(t *testing.T) {
			e := New(Config{MaxConcurrent: 1, StallAfter: 50 * time.Millisecond})
			gate := &proberGate{fakeGate: fakeGate{open: true}, answers: answers}
			release := make(chan struct{})
			var ended atomic.Bool
			add(t, e, Member{Name: "stalled", Gate: gate, Tasks: []Task{{Name: "relay", Every: 10 * time.Millisecond, Timeout: time.Minute,
				Run: func(ctx context.Context) (Outcome, error) {
					select {
					case <-release:
					case <-ctx.Done():
						ended.Store(true)
						<-release // a call that returns later all the same
					}
					return Worked, nil
				}}}})
			healthy := &counter{}
			add(t, e, Member{Name: "healthy", Tasks: []Task{healthy.task("relay", 10*time.Millisecond)}})
			started(t, e)
			defer close(release)
			time.Sleep(500 * time.Millisecond)
			if n := gate.probes.Load(); n != 1 {
				t.Errorf("the gate was asked to ping %d times, want once", n)
			}
			if answers {
				if got := e.Stats().Abandoned; got != 0 || ended.Load() {
					t.Errorf("%d runs abandoned (context ended: %v) though the ping answered", got, ended.Load())
				}
				return
			}
			if got := e.Stats().Abandoned; got != 1 || !ended.Load() {
				t.Fatalf("%d runs abandoned (context ended: %v) 500 ms into a run whose ping got no answer, want 1 (its bound is a minute)", got, ended.Load())
			}
			gate.mu.Lock()
			told := len(gate.observe) == 1 && errors.Is(gate.observe[0], ErrNoAnswer)
			gate.mu.Unlock()
			if !told {
				t.Errorf("the gate observed %v, want the run's ErrNoAnswer", gate.observe)
			}
			before := healthy.n.Load()
			waitFor(t, "the other member's task to run on the freed slot", func() bool { return healthy.n.Load() > before+5 })
		})
	}
}

// A task whose Timeout means "none" (the largest duration): the abandon timer's bound, the
// Timeout plus the grace, overflowed into the past, and every run was abandoned at once, each
// telling the gate that the database did not answer.
func TestLargestTimeoutAbandonsNothing(t *testing.T) {
	e := New(Config{})
	gate := &fakeGate{open: true}
	var runs atomic.Int64
	add(t, e, Member{Name: "m", Gate: gate, Tasks: []Task{{Name: "relay", Every: time.Hour, Timeout: math.MaxInt64,
		Run: func(context.Context) (Outcome, error) {
			time.Sleep(100 * time.Millisecond)
			runs.Add(1)
			return Worked, nil
		}}}})
	started(t, e)
	waitFor(t, "the run", func() bool { return runs.Load() == 1 })
	if got := e.Stats().Abandoned; got != 0 {
		t.Errorf("%d runs abandoned, want none", got)
	}
	gate.mu.Lock()
	defer gate.mu.Unlock()
	for _, err := range gate.observe {
		if errors.Is(err, ErrNoAnswer) {
			t.Errorf("the gate was told the database did not answer: %v", err)
		}
	}
}

// Remove of a member with nothing running returns nil whatever its context: with the context
// ended as well, it chose at random between the two and failed half the time.
func TestRemoveOfADrainedMemberWithAnEndedContext(t *testing.T) {
	e := New(Config{})
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	for i := range 100 {
		var c counter
		h := add(t, e, Member{Name: fmt.Sprintf("m%d", i), Tasks: []Task{c.task("cleanup", time.Hour)}})
		if err := h.Remove(ctx); err != nil {
			t.Fatalf("Remove %d: %v", i, err)
		}
	}
}
