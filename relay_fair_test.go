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
	"github.com/watermill-outbox/outbox/outboxdriver"
)

// commitPending commits n effects to topic on keys ordering keys (named prefix-0, prefix-1, ...),
// one transaction per effect, as a process that crashed after each commit leaves them: pending,
// for the relay. Key k's effects carry the payloads "prefix-k 1", "prefix-k 2", ...
func commitPending(t *testing.T, e *env, topic, prefix string, n, keys int) {
	t.Helper()
	crashing := e.newOutbox(func(c *outbox.Config) { c.Failpoint = crashAfterCommit })
	seq := make([]int, keys)
	for i := 0; i < n; i++ {
		k := i % keys
		seq[k]++
		key := fmt.Sprintf("%s-%d", prefix, k)
		err := crashing.InTx(context.Background(), func(ctx context.Context, _ *sql.Tx) error {
			ctx = outbox.WithOrderingKey(ctx, key)
			return outbox.Publish(ctx, topic, message.NewMessage(uuid.NewString(), []byte(fmt.Sprintf("%s %d", key, seq[k]))))
		})
		if err != nil && !errors.Is(err, outbox.ErrFailpoint) {
			t.Fatal(err)
		}
	}
}

// hungTopicPublisher forwards to the real broker, except that every call to the hung topic blocks
// until release is closed (and then fails, as a broker that timed out does).
type hungTopicPublisher struct {
	next    message.Publisher
	hung    string
	release chan struct{}
	mu      sync.Mutex
	hungFor int // calls to the hung topic
}

func (p *hungTopicPublisher) Publish(topic string, msgs ...*message.Message) error {
	if topic == p.hung {
		p.mu.Lock()
		p.hungFor++
		p.mu.Unlock()
		<-p.release
		return errors.New("broker hung")
	}
	return p.next.Publish(topic, msgs...)
}

func (p *hungTopicPublisher) Close() error { return nil }

// TestRelayHungTopicDoesNotStallOthers: the Publisher hangs on every call to topic A, which has 200
// effects pending on 80 ordering keys; topic B has a backlog of 600 effects on 12 keys behind them.
// B's effects all go out, each once and in order per key, while A is still hung, and A's stay
// pending. (Before the relay bounded its rounds and tripped a hung destination, a round cost
// (1 + A's keys) x PublishTimeout and ran out of time before it reached B: no B effect went out.)
func TestRelayHungTopicDoesNotStallOthers(t *testing.T) {
	e := newEnv(t)
	commitPending(t, e, "out_a", "a", 200, 80)
	commitPending(t, e, "out_b", "b", 600, 12)
	pub := &hungTopicPublisher{next: e.pub.next, hung: "out_a", release: make(chan struct{})}
	t.Cleanup(func() { close(pub.release) })
	relay := e.newOutbox(func(c *outbox.Config) {
		c.Publisher = pub
		// Short, so that A's hang costs little; not shorter: on a loaded machine a healthy call
		// to B (an INSERT into the SQL broker) took up to 320 ms, and one that times out is
		// sent again (its outcome unknown), which this test counts as a duplicate.
		c.PublishTimeout = time.Second
		c.RelayGrace = time.Millisecond
		c.RelayInterval = 10 * time.Millisecond
	})
	ctx, stop := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- relay.Run(ctx) }()
	defer func() { stop(); <-done }()

	// A loaded 2-core machine gets a few rounds done in this time; the old relay sent nothing of B
	// in a minute.
	const bound = 20 * time.Second
	deadline := time.Now().Add(bound)
	for len(e.wire("out_b")) < 600 {
		if time.Now().After(deadline) {
			t.Fatalf("%d of B's 600 effects sent in %s while A hung (%d calls to A)", len(e.wire("out_b")), bound, pub.hungCalls())
		}
		time.Sleep(50 * time.Millisecond)
	}
	if pub.hungCalls() == 0 {
		t.Fatal("the relay never tried A: the test tests nothing")
	}
	for id, n := range e.wire("out_b") {
		if n != 1 {
			t.Errorf("B effect %s sent %d times", id, n)
		}
	}
	want := e.effectUUIDsByKey()
	for key := range want {
		if key[0] == 'a' {
			delete(want, key)
		}
	}
	checkKeyOrder(t, firstCopies(e.wireInOrder("out_b")), want)
	mustEqual(t, "A effects on the wire", len(e.wire("out_a")), 0)
	mustEqual(t, "A effects pending", e.count(`SELECT count(*) FROM outbox_effects_all WHERE topic = 'out_a' AND dispatched_at IS NULL`), 200)
}

func (p *hungTopicPublisher) hungCalls() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.hungFor
}

// leaseCheckingPublisher fails every call of several messages at once and hangs on every call of
// one message until release is closed, as a broker that refuses batches and then stops answering.
// It checks, at each call of one message, that the outcome of the previous call of that message
// was recorded (its failures column counts every earlier round that tried it): a call that
// finds it unrecorded was made while another round still held the effect, after its lease ended.
type leaseCheckingPublisher struct {
	db      *sql.DB
	release chan struct{}
	mu      sync.Mutex
	calls   map[string]int // single-message calls per UUID
	overlap []string
}

func (p *leaseCheckingPublisher) Publish(_ string, msgs ...*message.Message) error {
	if len(msgs) > 1 {
		return errors.New("batch refused")
	}
	id := msgs[0].UUID
	var failures int
	err := p.db.QueryRow(`SELECT failures FROM outbox_effects_all WHERE uuid = $1`, id).Scan(&failures)
	p.mu.Lock()
	switch {
	case err != nil:
		p.overlap = append(p.overlap, fmt.Sprintf("%s: %v", id, err))
	case failures < p.calls[id]:
		p.overlap = append(p.overlap, fmt.Sprintf("%s: call %d while %d failure(s) recorded: a round sent it again while another still held it",
			id, p.calls[id]+1, failures))
	}
	p.calls[id]++
	p.mu.Unlock()
	<-p.release
	return errors.New("broker hung")
}

func (p *leaseCheckingPublisher) Close() error { return nil }

// TestRelayRoundEndsWithinItsLease: two instances relay 400 effects on 400 keys to a broker that
// refuses batches and then hangs on each message. No effect is sent by one instance while a
// round of the other still holds it: every round ends, and records what it tried, before its
// lease does. (Before, a round re-sent the refused batch one message at a time, each up to
// PublishTimeout, past the lease: the other instance claimed and sent the same effects again.)
func TestRelayRoundEndsWithinItsLease(t *testing.T) {
	if testing.Short() {
		t.Skip("runs past one relay lease (30 s)")
	}
	// Its database is its own (newEnv): the 31 s it waits pass beside the fault campaign.
	t.Parallel()
	e := newEnv(t)
	commitPending(t, e, "out_a", "k", 400, 400)
	pub := &leaseCheckingPublisher{db: e.db, release: make(chan struct{}), calls: map[string]int{}}
	t.Cleanup(func() { close(pub.release) })
	ctx, stop := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	defer func() { stop(); wg.Wait() }()
	for i := 0; i < 2; i++ {
		if i == 1 {
			time.Sleep(2 * time.Second) // the first instance claims everything in its first round
		}
		relay := e.newOutbox(func(c *outbox.Config) {
			c.Publisher = pub
			c.PublishTimeout = 100 * time.Millisecond // lease: 2 x 100 ms + 30 s
			c.RelayGrace = time.Millisecond
			c.RelayInterval = 10 * time.Millisecond
		})
		wg.Add(1)
		go func() { defer wg.Done(); _ = relay.Run(ctx) }()
	}
	// Past one lease, and a little more: the old relay sent a duplicate at about 30.2 s.
	time.Sleep(31 * time.Second)
	pub.mu.Lock()
	defer pub.mu.Unlock()
	if len(pub.calls) == 0 {
		t.Fatal("no call was made: the test tests nothing")
	}
	for i, o := range pub.overlap {
		if i == 5 {
			t.Errorf("... %d in all", len(pub.overlap))
			break
		}
		t.Error(o)
	}
}

// TestRelayClaimTakesFreshKeysBehindABacklog: topic A has 600 effects pending on 10 keys, more
// than a claim looks at from the front; B's 5 effects on a key of their own were committed after
// them. The first claim takes B's effects with A's: B waits one round, not until the claims have
// crawled through A's backlog. A's keys keep their order: each key's claimed effects are its
// first pending ones.
func TestRelayClaimTakesFreshKeysBehindABacklog(t *testing.T) {
	e := newEnv(t)
	commitPending(t, e, "out_a", "a", 600, 10)
	commitPending(t, e, "out_b", "b", 5, 1)
	time.Sleep(10 * time.Millisecond)
	claim, err := e.ob.Store().EffectClaimDue(context.Background(), outboxdriver.EffectClaimParams{
		Grace: time.Millisecond, Limit: 50, Lease: time.Minute,
	})
	if err != nil {
		t.Fatal(err)
	}
	byTopic := map[string]int{}
	last := map[string]int64{}
	for _, ef := range claim.Effects {
		byTopic[ef.Topic]++
		last[ef.OrderingKey] = max(last[ef.OrderingKey], ef.StoreID)
	}
	mustEqual(t, "B's effects in the first claim", byTopic["out_b"], 5)
	if byTopic["out_a"] == 0 {
		t.Fatal("the claim took nothing of A's backlog")
	}
	for key, id := range last {
		// Nothing of the key pending before its last claimed effect was left out of the claim.
		claimed := 0
		for _, ef := range claim.Effects {
			if ef.OrderingKey == key {
				claimed++
			}
		}
		mustEqual(t, "key "+key+": pending effects up to its last claimed one",
			e.count(`SELECT count(*) FROM outbox_effects_all WHERE ordering_key = $1 AND dispatched_at IS NULL AND id <= $2`, key, id), claimed)
	}
}

// TestRelayClaimSkipsKeysOfARoundInFlight: key a-0 has 20 effects pending and its first one is
// leased (the round the relay is sending); 20 other keys have one effect each, committed after
// a-0's. A claim of 10 made meanwhile, told to skip a-0, takes 10 of the other keys' effects:
// a-0's later effects, which wait behind its leased one, do not use up the claim's limit.
// (Before, the claim took the first 10 due effects of its window, all a-0's, found them behind
// the lease, and claimed nothing from them: a claim made while a round sends came back nearly
// empty.)
func TestRelayClaimSkipsKeysOfARoundInFlight(t *testing.T) {
	e := newEnv(t)
	commitPending(t, e, "out_a", "a", 20, 1)
	commitPending(t, e, "out_a", "b", 20, 20)
	time.Sleep(10 * time.Millisecond)
	mustExec(t, e, `UPDATE outbox_effects_all SET next_attempt_at = now() + interval '1 minute'
		WHERE id = (SELECT min(id) FROM outbox_effects_all WHERE ordering_key = 'a-0')`)
	claim, err := e.ob.Store().EffectClaimDue(context.Background(), outboxdriver.EffectClaimParams{
		Grace: time.Millisecond, Limit: 10, Lease: time.Minute, Skip: []string{"a-0", "x,y\"z"},
	})
	if err != nil {
		t.Fatal(err)
	}
	keys := map[string]bool{}
	for _, ef := range claim.Effects {
		if ef.OrderingKey == "a-0" {
			t.Fatalf("the claim took effect %d of a-0, behind its leased first effect", ef.StoreID)
		}
		keys[ef.OrderingKey] = true
	}
	mustEqual(t, "effects claimed", len(claim.Effects), 10)
	mustEqual(t, "keys claimed", len(keys), 10)
}

// TestRelayHungTopicParksNothing: the Publisher hangs on every call to topic A while topic B
// flows. A hung destination is an outage of that destination, not a poison effect: its calls
// time out whatever they carry. A's effect is tried again and again (each probe of its breaker
// times out) and is never parked, however many of those time-outs there are, while B's effects
// go out. (Before, a time-out counted as evidence against the effect as soon as anything else
// reached the Publisher: with B flowing, RelayMaxAttempts probes of A parked its head effect.)
func TestRelayHungTopicParksNothing(t *testing.T) {
	e := newEnv(t)
	commitPending(t, e, "out_a", "a", 1, 1)
	pub := &hungTopicPublisher{next: e.pub.next, hung: "out_a", release: make(chan struct{})}
	t.Cleanup(func() { close(pub.release) })
	relay := e.newOutbox(func(c *outbox.Config) {
		c.Publisher = pub
		c.PublishTimeout = 200 * time.Millisecond
		c.RelayGrace = time.Millisecond
		c.RelayInterval = 10 * time.Millisecond
		c.RelayMaxAttempts = 2
	})
	ctx, stop := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- relay.Run(ctx) }()
	defer func() { stop(); <-done }()

	// B flows meanwhile: an effect every 50 ms, sent by the same relay.
	b := 0
	for deadline := time.Now().Add(30 * time.Second); ; {
		if e.count(`SELECT count(*) FROM outbox_effects_all WHERE topic = 'out_a' AND (failures >= 3 OR parked_at IS NOT NULL)`) > 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("A's effect failed %d times in 30 s: the test tests too little",
				e.count(`SELECT failures FROM outbox_effects_all WHERE topic = 'out_a'`))
		}
		commitPending(t, e, "out_b", fmt.Sprintf("b%d", b), 1, 1)
		b++
		time.Sleep(50 * time.Millisecond)
	}
	waitFor(t, "B's effects sent", func() bool { return len(e.wire("out_b")) == b })
	mustEqual(t, "A's effect parked", e.count(`SELECT count(*) FROM outbox_effects_all WHERE topic = 'out_a' AND parked_at IS NOT NULL`), 0)
	mustEqual(t, "A's effect pending", e.count(`SELECT count(*) FROM outbox_effects_all WHERE topic = 'out_a' AND dispatched_at IS NULL`), 1)
}
