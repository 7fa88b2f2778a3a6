package outbox_test

import (
	"context"
	"database/sql"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"

	"github.com/watermill-outbox/outbox"
)

// downPublisher forwards to the real broker, refusing every call to the topics that are down and
// every call with a message it refuses (by UUID).
type downPublisher struct {
	next   message.Publisher
	mu     sync.Mutex
	down   map[string]bool
	refuse map[string]bool
}

func (p *downPublisher) Publish(topic string, msgs ...*message.Message) error {
	p.mu.Lock()
	down := p.down[topic]
	for _, m := range msgs {
		if p.refuse[m.UUID] {
			p.mu.Unlock()
			return errors.New("broker refused the message: schema mismatch")
		}
	}
	p.mu.Unlock()
	if down {
		return errors.New("broker unavailable")
	}
	return p.next.Publish(topic, msgs...)
}

func (p *downPublisher) Close() error { return nil }

func (p *downPublisher) set(topic string, down bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.down[topic] = down
}

// TestRelayRetriesARecoveredDestinationAtOnce: effects to two topics back off after their eighth
// failure (a minute, give or take 20%), as after a long outage. Topic out_a comes back: the first
// message it takes (a unit of work's) makes its backed-off effects due, and the relay sends them
// within about a pass, not a minute later. The effect to out_b, still down, keeps backing off.
func TestRelayRetriesARecoveredDestinationAtOnce(t *testing.T) {
	e := newEnv(t)
	pub := &downPublisher{next: e.pub.next, down: map[string]bool{"out_a": true, "out_b": true}}
	commitPending(t, e, "out_a", "a", 2, 2)
	commitPending(t, e, "out_b", "b", 1, 1)
	// Seven failures so far (of an outage before this process started), and handed to the relay.
	mustExec(t, e, `UPDATE outbox_effects_all SET failures = 7, failed_at = now(), next_attempt_at = now()`)

	// The backed-off effects have a retry time, which the relay goes by, not the grace period;
	// the grace keeps the relay off the effect InTx sends itself below (a relay that took it
	// before InTx's mark was written would send it a second time, as documented).
	relay := e.newOutbox(func(c *outbox.Config) {
		c.Publisher = pub
		c.RelayGrace = time.Minute
		c.RelayInterval = 50 * time.Millisecond
	})
	ctx, stop := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- relay.Run(ctx) }()
	defer func() { stop(); <-done }()
	backingOff := `SELECT count(*) FROM outbox_effects_all WHERE topic = $1 AND failures = 8 AND next_attempt_at > now() + interval '30 seconds'`
	waitFor(t, "the eighth failure of every effect", func() bool {
		return e.count(backingOff, "out_a") == 2 && e.count(backingOff, "out_b") == 1
	})

	pub.set("out_a", false)
	began := time.Now()
	first := uuid.NewString()
	if err := relay.InTx(ctx, func(ctx context.Context, _ *sql.Tx) error {
		return outbox.Publish(ctx, "out_a", message.NewMessage(first, []byte("the first after the outage")))
	}); err != nil {
		t.Fatal(err)
	}
	deadline := began.Add(10 * time.Second)
	for len(e.wire("out_a")) < 3 {
		if time.Now().After(deadline) {
			t.Fatalf("10 s after out_a took a message again, %d of its 2 backed-off effects were sent (pending to out_a: %d)",
				len(e.wire("out_a"))-1, e.count(`SELECT count(*) FROM outbox_effects_all WHERE topic = 'out_a'`))
		}
		time.Sleep(10 * time.Millisecond)
	}
	t.Logf("the backed-off effects of out_a went out %s after it took a message again", time.Since(began).Round(time.Millisecond))
	for id, n := range e.wire("out_a") {
		if n != 1 {
			t.Errorf("effect %s went out %d times (the one InTx sent: %s)", id, n, first)
		}
	}
	if n := len(e.wire("out_b")); n != 0 {
		t.Errorf("%d effects reached out_b, which is still down", n)
	}
	mustEqual(t, "effects to out_b still backing off", e.count(backingOff, "out_b"), 1)
}

// TestRelayRetriesWhatAnotherInstanceBackedOff: the failures were recorded by another instance
// (or before a restart), so this process never saw its destination fail. The first effect that
// had failed and that it sends (one with a short backoff) tells it that the destination is back:
// the effect that backs off for a minute goes out with it, not a minute later.
func TestRelayRetriesWhatAnotherInstanceBackedOff(t *testing.T) {
	e := newEnv(t)
	down := &downPublisher{next: e.pub.next, down: map[string]bool{"out_a": true}}
	commitPending(t, e, "out_a", "a", 2, 2)
	mustExec(t, e, `UPDATE outbox_effects_all SET failed_at = now(), next_attempt_at = now(),
		failures = CASE WHEN ordering_key = 'a-0' THEN 7 ELSE 0 END`)
	first := e.newOutbox(func(c *outbox.Config) {
		c.Publisher = down
		c.RelayGrace = time.Millisecond
		c.RelayInterval = 50 * time.Millisecond
	})
	ctx, stop := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- first.Run(ctx) }()
	waitFor(t, "the long backoff of a-0 and the short one of a-1", func() bool {
		return e.count(`SELECT count(*) FROM outbox_effects_all WHERE ordering_key = 'a-0' AND failures = 8
				AND next_attempt_at > now() + interval '30 seconds'`) == 1 &&
			e.count(`SELECT count(*) FROM outbox_effects_all WHERE ordering_key = 'a-1' AND failures >= 2`) == 1
	})
	stop()
	if err := <-done; err != nil {
		t.Fatal(err)
	}

	began := time.Now()
	second := e.newOutbox(func(c *outbox.Config) {
		c.RelayGrace = time.Millisecond
		c.RelayInterval = 50 * time.Millisecond
	})
	ctx, stop = context.WithCancel(context.Background())
	go func() { done <- second.Run(ctx) }()
	defer func() { stop(); <-done }()
	deadline := began.Add(15 * time.Second)
	for len(e.wire("out_a")) < 2 {
		if time.Now().After(deadline) {
			t.Fatalf("15 s after another instance took over, %d of the 2 effects were sent", len(e.wire("out_a")))
		}
		time.Sleep(10 * time.Millisecond)
	}
	t.Logf("both effects went out %s after the instance started", time.Since(began).Round(time.Millisecond))
}

// TestRelayDoesNotRetryAPoisonEffectAtEachSuccess: the broker refuses one effect and takes
// everything else to its topic. The messages that topic takes do not retry the refused effect at
// once each time (its failures are its own, not an outage's): it keeps backing off.
func TestRelayDoesNotRetryAPoisonEffectAtEachSuccess(t *testing.T) {
	e := newEnv(t)
	commitPending(t, e, "out_a", "poison", 1, 1)
	poison := e.strings(`SELECT uuid FROM outbox_effects_all`)[0]
	pub := &downPublisher{next: e.pub.next, down: map[string]bool{}, refuse: map[string]bool{poison: true}}
	mustExec(t, e, `UPDATE outbox_effects_all SET failures = 7, failed_at = now(), next_attempt_at = now()`)
	relay := e.newOutbox(func(c *outbox.Config) {
		c.Publisher = pub
		c.RelayGrace = time.Minute // see TestRelayRetriesARecoveredDestinationAtOnce
		c.RelayInterval = 50 * time.Millisecond
	})
	ctx, stop := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- relay.Run(ctx) }()
	defer func() { stop(); <-done }()
	backingOff := `SELECT count(*) FROM outbox_effects_all WHERE uuid = $1 AND next_attempt_at > now() + interval '30 seconds'`
	waitFor(t, "the refused effect backing off", func() bool { return e.count(backingOff, poison) == 1 })
	// The process places the failure by the time the effect was read, to a few milliseconds:
	// the first success is clearly after it.
	time.Sleep(100 * time.Millisecond)

	for i := 0; i < 5; i++ {
		if err := relay.InTx(ctx, func(ctx context.Context, _ *sql.Tx) error {
			return outbox.Publish(ctx, "out_a", message.NewMessage(uuid.NewString(), []byte("taken")))
		}); err != nil {
			t.Fatal(err)
		}
		time.Sleep(200 * time.Millisecond)
	}
	time.Sleep(500 * time.Millisecond) // a relay pass or more after the last one
	mustEqual(t, "messages taken by out_a", len(e.wire("out_a")), 5)
	// Its first failure here counted as an outage's (nothing had reached the broker yet), so the
	// first message taken may retry it once; then it fails while the topic takes messages.
	if n := e.count(`SELECT failures FROM outbox_effects_all WHERE uuid = $1`, poison); n > 9 {
		t.Errorf("the refused effect failed %d times: retried at the successes of its topic, not after its backoff", n)
	}
	mustEqual(t, "the refused effect backing off", e.count(backingOff, poison), 1)
}
