package outbox

import (
	"context"
	"errors"
	"fmt"
	"net"
	"sync/atomic"
	"syscall"
	"testing"
	"time"
)

// ready, the gate as the engine's scheduler asks it, never blocks: in an outage it starts the
// probe when one is due (one at a time, ReconnectDelay apart), says when to ask again, and
// wakes its caller when the probe ends; the probe that succeeds opens the gate.
func TestGateReadyProbesWithoutBlocking(t *testing.T) {
	var probes atomic.Int32
	var refuse atomic.Bool
	refuse.Store(true)
	g := &dbGate{minDelay: 20 * time.Millisecond, maxDelay: time.Second, unreachable: unreachable,
		probe: func(context.Context) error {
			probes.Add(1)
			if refuse.Load() {
				return syscall.ECONNREFUSED
			}
			return nil
		}}
	if ok, _ := g.ready(nil); !ok {
		t.Fatal("a gate that saw no failure is shut")
	}
	if !g.observe(syscall.ECONNREFUSED) {
		t.Fatal("a refused connection does not shut the gate")
	}
	woken := make(chan struct{}, 4)
	wake := func() { woken <- struct{}{} }
	ok, again := g.ready(wake)
	if ok || again.IsZero() {
		t.Fatalf("ready in an outage: %v, ask again at %v; want shut, with a time to ask again", ok, again)
	}
	// The first probe is due ReconnectDelay (jittered) after the failure: the scheduler asks again then.
	time.Sleep(time.Until(again))
	if ok, _ := g.ready(nil); ok {
		t.Fatal("the gate opened without a probe that succeeded")
	}
	select {
	case <-woken:
	case <-time.After(5 * time.Second):
		t.Fatal("the end of the probe did not wake the caller of ready")
	}
	if n := probes.Load(); n != 1 {
		t.Fatalf("%d probes; want one", n)
	}
	refuse.Store(false)
	waitForGate(t, g, wake, woken)
	if ok, _ := g.ready(nil); !ok {
		t.Fatal("the gate is shut after a probe that succeeded")
	}
}

// waitForGate asks ready when told to, as the engine does, until the gate opens.
func waitForGate(t *testing.T, g *dbGate, wake func(), woken chan struct{}) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for time.Now().Before(deadline) {
		ok, again := g.ready(wake)
		if ok {
			return
		}
		select {
		case <-woken:
		case <-time.After(time.Until(again)):
		}
	}
	t.Fatal(errors.New("the gate did not open"))
}

// A suspicion holds work back at once and probes at once; it is reported as an outage, from
// when it was suspected, only when the probe fails, and a probe that succeeds ends it unreported.
func TestGateSuspicionIsConfirmedByTheProbe(t *testing.T) {
	var fail atomic.Bool
	probed := make(chan struct{}, 8)
	var changes []string
	var changed atomic.Int32
	g := &dbGate{minDelay: time.Hour, maxDelay: time.Hour, unreachable: unreachable,
		probe: func(context.Context) error {
			defer func() { probed <- struct{}{} }()
			if fail.Load() {
				return errors.New("no answer")
			}
			return nil
		},
		onChange: func(_ time.Time, _ int64, err error) {
			changed.Add(1)
			changes = append(changes, fmt.Sprint(err))
		}}

	g.suspect(errors.New("BEGIN had no answer"))
	if !g.holding() {
		t.Fatal("a suspicion does not hold work back")
	}
	if _, down := g.outage(); down {
		t.Fatal("a suspicion is reported as an outage before its probe failed")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := g.wait(ctx); err != nil {
		t.Fatalf("wait on a suspicion that the probe (due at once, not ReconnectDelay later) clears: %v", err)
	}
	if g.holding() || changed.Load() != 0 {
		t.Fatalf("after a probe that succeeded: holding %v, %d changes reported (%v); want neither", g.holding(), changed.Load(), changes)
	}

	fail.Store(true)
	began := time.Now()
	g.suspect(errors.New("BEGIN had no answer"))
	<-probed
	<-probed
	waitUntil := time.Now().Add(5 * time.Second)
	for changed.Load() == 0 && time.Now().Before(waitUntil) {
		time.Sleep(time.Millisecond)
	}
	out, down := g.outage()
	if !down || out.Since.Before(began) || changed.Load() != 1 {
		t.Fatalf("after a probe that failed: outage %+v (%v), %d changes reported; want one outage since the suspicion", out, down, changed.Load())
	}
	short, cancelShort := context.WithTimeout(context.Background(), 20*time.Millisecond)
	defer cancelShort()
	if err := g.wait(short); !errors.Is(err, ErrDatabaseUnreachable) {
		t.Fatalf("wait in the confirmed outage: %v, want ErrDatabaseUnreachable", err)
	}
}

// A dial its caller cancelled is no outage; a refused one is.
func TestCancelledDialIsNoOutage(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	_, err := (&net.Dialer{}).DialContext(ctx, "tcp", "127.0.0.1:1")
	var op *net.OpError
	if !errors.As(err, &op) || op.Op != "dial" {
		t.Fatalf("a dial with a cancelled context = %v, want a dial OpError", err)
	}
	if unreachable(err) {
		t.Errorf("a dial its caller cancelled (%v) was taken for an unreachable database", err)
	}
	wrapped := fmt.Errorf("begin: %w", err)
	if unreachable(wrapped) {
		t.Errorf("a wrapped cancelled dial (%v) was taken for an unreachable database", wrapped)
	}
	ln, lerr := net.Listen("tcp", "127.0.0.1:0")
	if lerr != nil {
		t.Fatal(lerr)
	}
	addr := ln.Addr().String()
	_ = ln.Close()
	_, err = net.Dial("tcp", addr)
	if err == nil || !unreachable(err) {
		t.Errorf("a refused dial (%v) was not taken for an unreachable database", err)
	}
}

// The outage's reports (a log line and a counter per Outbox sharing the gate) are made without
// the gate's lock: a report that takes its time (a slow log sink, two hundred members) holds no
// one who asks the gate, the engine's scheduler first. Made under the lock, it held them all.
func TestGateReportsOutsideItsLock(t *testing.T) {
	release := make(chan struct{})
	reported := make(chan struct{})
	g := &dbGate{minDelay: time.Hour, maxDelay: time.Hour, unreachable: unreachable,
		probe: func(context.Context) error { return syscall.ECONNREFUSED },
		onChange: func(time.Time, int64, error) {
			close(reported)
			<-release
		}}
	go g.observe(syscall.ECONNREFUSED)
	<-reported
	defer close(release)
	asked := make(chan bool, 1)
	go func() {
		ok, _ := g.ready(nil)
		asked <- ok
	}()
	select {
	case ok := <-asked:
		if ok {
			t.Error("ready during an outage: open")
		}
	case <-time.After(2 * time.Second):
		t.Fatal("ready waited for the outage's report")
	}
}
