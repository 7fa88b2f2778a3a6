package outbox_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"

	"github.com/watermill-outbox/outbox"
)

// commitKey commits two effects with ordering key k and leaves them to the relay (a crash after
// the commit): the first to out_b, the second to out_a, so that a round sends them in two calls.
// It returns their UUIDs in order.
func commitKey(t *testing.T, e *env, k string) (first, second string) {
	t.Helper()
	crashing := e.newOutbox(func(c *outbox.Config) { c.Failpoint = crashAfterCommit })
	first, second = uuid.NewString(), uuid.NewString()
	err := crashing.InTx(context.Background(), func(ctx context.Context, _ *sql.Tx) error {
		ctx = outbox.WithOrderingKey(ctx, k)
		if err := outbox.Publish(ctx, "out_b", message.NewMessage(first, []byte("first"))); err != nil {
			return err
		}
		return outbox.Publish(ctx, "out_a", message.NewMessage(second, []byte("second")))
	})
	if !errors.Is(err, outbox.ErrFailpoint) {
		t.Fatalf("InTx with a crash after commit: %v, want ErrFailpoint", err)
	}
	// Each row is as old as its statement: on a loaded machine the second may still be within
	// the relays' grace when the first is past it, and a round would take the first alone.
	waitFor(t, "both effects to pass the relays' grace", func() bool {
		return e.count(`SELECT count(*) FROM outbox_effects_all WHERE created_at < now() - $1 * interval '1 millisecond'`,
			relayGrace.Milliseconds()) == 2
	})
	return first, second
}

// leasedFor returns how long the effect with UUID id is still leased (zero or negative: due).
func (e *env) leasedFor(id string) time.Duration {
	e.t.Helper()
	var ms float64
	if err := e.db.QueryRow(`SELECT coalesce(extract(epoch FROM next_attempt_at - now()) * 1000, 0)
		FROM outbox_effects_all WHERE uuid = $1`, id).Scan(&ms); err != nil {
		e.t.Fatal(err)
	}
	return time.Duration(ms) * time.Millisecond
}

const relayGrace = 50 * time.Millisecond

// relayConfig makes a relay that claims effects left behind at once.
func relayConfig(c *outbox.Config) {
	c.RelayInterval = 20 * time.Millisecond
	c.RelayGrace = relayGrace
	c.PublishTimeout = 5 * time.Second // a lease of 40 s, a round's deadline of 20 s
}

// TestRelayShutdownKeepsTheLeaseOfACallInFlight: a relay shuts down (a rolling deploy) while its
// Publish call of an effect is in flight to a slow broker. A Publisher takes no context, so the
// call goes on and may deliver: the effect was tried, and another instance must not claim it
// while that call may still be running (until the round's lease ends), as after a crash. The
// effect is the second of its key, behind one the round sent and marked, so it was not the row
// the claim leased: the round must lease it itself. (Before, the round released it as not tried,
// due at once: the other instance sent it a few milliseconds later, beside the call in flight.)
func TestRelayShutdownKeepsTheLeaseOfACallInFlight(t *testing.T) {
	e := newEnv(t)
	first, second := commitKey(t, e, "order-1")
	gate := &gatePublisher{next: e.pub, uuid: second, entered: make(chan struct{}), release: make(chan struct{})}
	var releaseOnce sync.Once
	release := func() { releaseOnce.Do(func() { close(gate.release) }) }
	t.Cleanup(release)
	a := e.newOutbox(relayConfig, func(c *outbox.Config) { c.Publisher = gate })
	b := e.newOutbox(relayConfig)

	stopA := startRun(t, a)
	select {
	case <-gate.entered:
	case <-time.After(30 * time.Second):
		t.Fatal("the relay never called the Publisher with the second effect")
	}
	stopA() // the call is still in flight
	stoppedAt := time.Now()
	mustEqual(t, "copies of the first effect on the wire", e.wire("out_b")[first], 1)
	if d := e.leasedFor(second); d < 10*time.Second {
		t.Errorf("the effect whose call is in flight is leased for %s after the shutdown, want the rest of the round's lease (about 40 s)", d)
	}

	stopB := startRun(t, b)
	time.Sleep(1500 * time.Millisecond) // many of b's rounds
	stopB()
	if n := e.wire("out_a")[second]; n != 0 {
		t.Fatalf("another instance sent the effect %d time(s) within %s of the shutdown, while the first call was still in flight",
			n, time.Since(stoppedAt).Round(time.Millisecond))
	}
	release() // the slow call delivers
	waitFor(t, "the call in flight to deliver", func() bool { return e.wire("out_a")[second] == 1 })
}

// TestRelayShutdownWaitsBrieflyForACallUnderWay: a relay shuts down while its Publish call is
// under way, and the call returns a moment later (most return within milliseconds): the effect is
// marked sent, not kept leased for another instance to send again once the lease ends. Before,
// the call was taken for in flight the moment the shutdown came, and every effect in a call at a
// rolling deploy was sent twice.
func TestRelayShutdownWaitsBrieflyForACallUnderWay(t *testing.T) {
	e := newEnv(t)
	_, second := commitKey(t, e, "order-1")
	gate := &gatePublisher{next: e.pub, uuid: second, entered: make(chan struct{}), release: make(chan struct{})}
	var releaseOnce sync.Once
	release := func() { releaseOnce.Do(func() { close(gate.release) }) }
	t.Cleanup(release)
	a := e.newOutbox(relayConfig, func(c *outbox.Config) { c.Publisher = gate })
	stopA := startRun(t, a)
	select {
	case <-gate.entered:
	case <-time.After(30 * time.Second):
		t.Fatal("the relay never called the Publisher with the second effect")
	}
	go func() {
		time.Sleep(100 * time.Millisecond)
		release() // the call returns 100 ms into the shutdown
	}()
	stopA()
	if n := e.pendingEffects(); n != 0 {
		t.Errorf("%d effects left pending by a shutdown whose call returned 100 ms into it (leased for %s), want 0",
			n, e.leasedFor(second).Round(time.Second))
	}
	mustEqual(t, "copies of the second effect on the wire", e.wire("out_a")[second], 1)
}

// TestRelayFailureRecordKeepsAnotherRelaysLease: a round sends the first effect of a key and fails
// on the second. Once the round's mark of the first has landed, the second is the key's first
// pending effect and another relay may lease it; the failure the round records for it must not
// end that lease (a first failure has no backoff: it would be due at once, and sent a second time
// while the other relay's call is in flight). The other relay claims it right after the mark
// (the failpoint there), and its lease must still hold once the round has written its outcome.
func TestRelayFailureRecordKeepsAnotherRelaysLease(t *testing.T) {
	e := newEnv(t)
	first, second := commitKey(t, e, "order-1")
	gate := &gatePublisher{next: e.pub, uuid: second, entered: make(chan struct{}), release: make(chan struct{})}
	var releaseOnce sync.Once
	release := func() { releaseOnce.Do(func() { close(gate.release) }) }
	t.Cleanup(release)
	b := e.newOutbox(relayConfig, func(c *outbox.Config) { c.Publisher = gate })
	var (
		bStarted  = make(chan func(), 1) // b's stop, once the hook started it
		recorded  = -1                   // the failures recorded on the second effect when the mark had landed
		hookRan   bool
		refuseOut = &rejectingPublisher{next: e.pub, reject: func(m *message.Message) bool { return m.UUID == second }}
	)
	a := e.newOutbox(relayConfig, func(c *outbox.Config) {
		c.Publisher = refuseOut
		c.Failpoint = func(_ context.Context, point string) error {
			if point != outbox.FailpointAfterRelayMark || hookRan {
				return nil
			}
			hookRan = true
			if err := e.db.QueryRow(`SELECT failures FROM outbox_effects_all WHERE uuid = $1`, second).Scan(&recorded); err != nil {
				return err
			}
			// The other relay claims what is due now and calls its Publisher with it.
			bStarted <- startRun(t, b)
			select {
			case <-gate.entered:
			case <-time.After(5 * time.Second):
			}
			return nil
		}
	})

	stopA := startRun(t, a)
	var stopB func()
	select {
	case stopB = <-bStarted:
	case <-time.After(30 * time.Second):
		t.Fatal("the round never reached its mark")
	}
	stopA()
	mustEqual(t, "copies of the first effect on the wire", e.wire("out_b")[first], 1)
	if recorded < 1 {
		t.Errorf("when the round's mark landed, the failure of the effect behind the sent one was not recorded yet (%d failures)", recorded)
	}
	select {
	case <-gate.entered:
	default:
		t.Fatal("the other relay did not call its Publisher with the effect after the round's mark")
	}
	if d := e.leasedFor(second); d < 10*time.Second {
		t.Errorf("the other relay's call is in flight, yet the effect is leased for only %s: the round's failure record ended that relay's lease", d)
	}
	release() // the other relay's call delivers
	waitFor(t, "the other relay's call to deliver", func() bool { return e.wire("out_a")[second] == 1 })
	stopB()
	e.flush()
	mustEqual(t, "copies of the second effect on the wire", e.wire("out_a")[second], 1)
	mustEqual(t, "pending effects", e.pendingEffects(), 0)
}

// recordingPublisher counts the messages it takes by UUID, after a delay per call.
type recordingPublisher struct {
	delay time.Duration
	mu    sync.Mutex
	sent  map[string]int
	when  map[string]time.Time
}

func (p *recordingPublisher) Publish(_ string, msgs ...*message.Message) error {
	time.Sleep(p.delay)
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, m := range msgs {
		p.sent[m.UUID]++
		if p.when[m.UUID].IsZero() {
			p.when[m.UUID] = time.Now()
		}
	}
	return nil
}

func (p *recordingPublisher) Close() error { return nil }

func (p *recordingPublisher) sentAt(id string) (int, time.Time) {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.sent[id], p.when[id]
}

// TestRelayPauseLandsTheRoundInFlight: a relay draining a backlog pauses between its turns
// (RelayPauseFactor) for as long as its last turn took, times the factor, while the round it has
// just launched sends. That round's outcome must be written once its calls end, within its lease,
// not once the pause is over: with a factor of 10 and calls of 0.4 s the pause outlasts a 3 s
// lease, and another instance (b) claimed the round's effects when the lease ended and sent them
// a second time, although every one of them had gone out long before.
func TestRelayPauseLandsTheRoundInFlight(t *testing.T) {
	e := newEnv(t)
	const lease = 3 * time.Second
	crashing := e.newOutbox(func(c *outbox.Config) { c.Failpoint = crashAfterCommit })
	ids := []string{uuid.NewString(), uuid.NewString(), uuid.NewString()}
	for i, id := range ids {
		err := crashing.InTx(context.Background(), func(ctx context.Context, _ *sql.Tx) error {
			ctx = outbox.WithOrderingKey(ctx, fmt.Sprint("key-", i))
			return outbox.Publish(ctx, "out_a", message.NewMessage(id, []byte("x")))
		})
		if !errors.Is(err, outbox.ErrFailpoint) {
			t.Fatalf("InTx with a crash after commit: %v, want ErrFailpoint", err)
		}
	}
	pubA := &recordingPublisher{delay: 400 * time.Millisecond, sent: map[string]int{}, when: map[string]time.Time{}}
	pubB := &recordingPublisher{sent: map[string]int{}, when: map[string]time.Time{}}
	a := e.newOutbox(relayConfig, func(c *outbox.Config) {
		c.Publisher = pubA
		c.RelayPauseFactor = 10
		c.RelayBatchSize = 1 // a round per effect
		c.RelayConcurrency = 1
	})
	outbox.SetRelayLease(a, lease)
	stopA := startRun(t, a)
	defer stopA()
	// The second round is launched after a turn that waited for the first one's calls (0.4 s):
	// the pause after it is about 4 s.
	var secondAt time.Time
	waitFor(t, "the relay to send the second effect", func() bool {
		n, at := pubA.sentAt(ids[1])
		secondAt = at
		return n > 0
	})
	b := e.newOutbox(relayConfig, func(c *outbox.Config) { c.Publisher = pubB })
	stopB := startRun(t, b)
	defer stopB()
	time.Sleep(time.Until(secondAt.Add(lease + time.Second)))
	if n, _ := pubB.sentAt(ids[1]); n > 0 {
		t.Errorf("an effect the relay sent at once was sent again by another instance after its lease ended (%d times): the round's outcome waited for the pause", n)
	}
	stopA()
	stopB()
	for _, id := range ids {
		na, _ := pubA.sentAt(id)
		nb, _ := pubB.sentAt(id)
		if na+nb != 1 {
			t.Errorf("effect %s sent %d times by the pausing relay and %d times by the other, want once in all", id, na, nb)
		}
	}
}
