package outbox

import (
	"context"
	"errors"
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
