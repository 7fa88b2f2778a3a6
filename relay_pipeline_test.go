package outbox_test

import (
	"context"
	"errors"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/watermill-outbox/outbox"
)

// failFirstPublisher fails the first call that carries the payload fail, and holds that call
// until release returns true (bounded by a few seconds); it records the payloads of the calls
// that succeed, in the order they returned.
type failFirstPublisher struct {
	fail    string
	release func() bool

	mu     sync.Mutex
	failed bool
	held   bool // the failing call was held until release said so
	sent   []string
}

func (p *failFirstPublisher) Publish(_ string, msgs ...*message.Message) error {
	p.mu.Lock()
	fail := !p.failed && slices.ContainsFunc(msgs, func(m *message.Message) bool { return string(m.Payload) == p.fail })
	p.failed = p.failed || fail
	p.mu.Unlock()
	if fail {
		deadline := time.Now().Add(5 * time.Second)
		for !p.release() && time.Now().Before(deadline) {
			time.Sleep(5 * time.Millisecond)
		}
		p.mu.Lock()
		p.held = p.release()
		p.mu.Unlock()
		return errors.New("broker refused")
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, m := range msgs {
		p.sent = append(p.sent, string(m.Payload))
	}
	return nil
}

func (p *failFirstPublisher) Close() error { return nil }

func (p *failFirstPublisher) log() (sent []string, held bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	return slices.Clone(p.sent), p.held
}

// TestRelayNextRoundLeavesAFailingKeyAlone: the relay claims its next round while the current one
// sends. Key k-0's first effect is in a round whose call for it fails, and that call returns only
// after the next round was claimed; the key's second effect, committed after the others of the
// first round, goes out only after the first one was sent again, not in the round claimed early.
func TestRelayNextRoundLeavesAFailingKeyAlone(t *testing.T) {
	e := newEnv(t)
	commitPending(t, e, "out_a", "k", 1, 1)   // "k-0 1"
	commitPending(t, e, "out_a", "o", 3, 3)   // o-0, o-1, o-2: the rest of the first round
	commitPending(t, e, "out_a", "k", 1, 1)   // k-0 again, with its payload set below
	commitPending(t, e, "out_a", "p", 40, 40) // the rounds after, beyond the first claim's window
	// The second effect of k-0 carries its own payload, so that the wire tells the two apart.
	mustExec(t, e, `UPDATE outbox_effects_all SET payload = 'k-0 2'::bytea
		WHERE id = (SELECT max(id) FROM outbox_effects_all WHERE ordering_key = 'k-0')`)

	d := &claimCounter{}
	pub := &failFirstPublisher{fail: "k-0 1"}
	pub.release = func() bool {
		// The first claim took k-0's first effect: a second one is a later round, claimed
		// while the failing call is in flight.
		claims, _ := d.counts()
		return claims >= 2
	}
	relay := e.newOutbox(func(c *outbox.Config) {
		c.Driver = d
		c.Publisher = pub
		c.RelayGrace = time.Millisecond
		c.RelayInterval = 20 * time.Millisecond
		c.RelayBatchSize = 4
		c.RelayPauseFactor = -1
	})
	ctx, stop := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- relay.Run(ctx) }()
	defer func() { stop(); <-done }()
	waitFor(t, "k-0's second effect sent", func() bool {
		sent, _ := pub.log()
		return slices.Contains(sent, "k-0 2")
	})
	sent, held := pub.log()
	if !held {
		t.Fatal("no round was claimed while the failing call was in flight: the test tests nothing")
	}
	first, second := slices.Index(sent, "k-0 1"), slices.Index(sent, "k-0 2")
	if first < 0 || second < first {
		t.Fatalf("k-0's second effect went out before its first was sent: %q", sent)
	}
	for _, payload := range []string{"k-0 1", "k-0 2", "o-0 1", "p-39 1"} {
		if n := countOf(sent, payload); n != 1 {
			t.Errorf("%q sent %d times: %q", payload, n, sent)
		}
	}
}

func countOf(s []string, v string) int {
	n := 0
	for _, x := range s {
		if x == v {
			n++
		}
	}
	return n
}
