package outbox_test

import (
	"context"
	"database/sql"
	"sync"
	"testing"
	"time"

	"github.com/watermill-outbox/outbox"
	"github.com/watermill-outbox/outbox/drivers/postgres"
	"github.com/watermill-outbox/outbox/outboxdriver"
)

// claimCounter is the PostgreSQL driver, with the claims of the relay counted: each one is a
// statement the relay runs against the effects table.
type claimCounter struct {
	postgres.Driver
	mu     sync.Mutex
	claims int // every claim
	passes int // claims from the front (After 0): one per relay pass
}

func (d *claimCounter) Open(db *sql.DB, opts outboxdriver.StoreOptions) (outboxdriver.Store, error) {
	st, err := d.Driver.Open(db, opts)
	if err != nil {
		return nil, err
	}
	return &countingStore{Store: st, d: d}, nil
}

func (d *claimCounter) counts() (claims, passes int) {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.claims, d.passes
}

type countingStore struct {
	outboxdriver.Store
	d *claimCounter
}

func (s *countingStore) EffectClaimDue(ctx context.Context, p outboxdriver.EffectClaimParams) (outboxdriver.EffectClaim, error) {
	s.d.mu.Lock()
	s.d.claims++
	if p.After == 0 {
		s.d.passes++
	}
	s.d.mu.Unlock()
	return s.Store.EffectClaimDue(ctx, p)
}

// TestRelayIdlePassSkipsParkedEffects: 20,000 parked effects sit before everything else that is
// pending. A relay pass that finds nothing to send runs one claim, not one per window of parked
// effects; the parked effects still hold back the later effect of their key, and an effect of
// another key goes out. (Before the claim's window started at the first pending effect that is
// not parked, every idle pass walked all parked effects: 11 claims here, 550 for a million.)
func TestRelayIdlePassSkipsParkedEffects(t *testing.T) {
	e := newEnv(t)
	mustExec(t, e, `INSERT INTO outbox_effects_all (source_consumer, source_id, seq, kind, topic, uuid, payload, metadata,
			ordering_key, created_at, attempts, failures, failed_at, last_error, parked_at)
		SELECT '', 'parked-' || g, 0, '', 'out_a', gen_random_uuid()::text, 'x'::bytea, ''::bytea,
			'parked-' || g, now() - interval '1 hour', 10, 10, now(), 'broken', now()
		FROM generate_series(1, 20000) g`)
	mustExec(t, e, `ANALYZE outbox_effects_all`)
	commitPending(t, e, "out_a", "parked", 1, 2) // key parked-0: no parked effect
	commitPending(t, e, "out_a", "parked", 2, 2) // the second one on parked-1: behind a parked effect
	var blocked string
	if err := e.db.QueryRow(`SELECT uuid FROM outbox_effects_all WHERE ordering_key = 'parked-1' AND parked_at IS NULL`).Scan(&blocked); err != nil {
		t.Fatal(err)
	}

	d := &claimCounter{}
	relay := e.newOutbox(func(c *outbox.Config) {
		c.Driver = d
		c.RelayGrace = time.Millisecond
		c.RelayInterval = 20 * time.Millisecond
	})
	ctx, stop := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- relay.Run(ctx) }()
	defer func() { stop(); <-done }()
	waitFor(t, "the effects of parked-0 sent", func() bool { return len(e.wire("out_a")) >= 2 })
	before, beforePasses := d.counts()
	time.Sleep(time.Second)
	after, afterPasses := d.counts()
	claims, passes := after-before, afterPasses-beforePasses
	if passes < 3 {
		t.Fatalf("only %d relay passes in a second with RelayInterval 20ms", passes)
	}
	if claims > passes {
		t.Errorf("idle relay passes ran %d claims in %d passes; want one each", claims, passes)
	}
	if n := e.wire("out_a")[blocked]; n != 0 {
		t.Errorf("the effect behind a parked one of its key was sent %d times", n)
	}
	mustEqual(t, "effects on the wire", len(e.wire("out_a")), 2)
}

// TestBlockedKeyBacklogDoesNotStarveOtherKeys: a key whose first effect is parked holds back its
// later effects, and only them. With as many of those due as a claim takes (RelayBatchSize), the
// claim's candidates were all of that key, all let go, and the effect of another key after them
// in the same window was never claimed: pass after pass took nothing there, until an operator
// dealt with the parked one.
func TestBlockedKeyBacklogDoesNotStarveOtherKeys(t *testing.T) {
	e := newEnv(t)
	mustExec(t, e, `INSERT INTO outbox_effects_all (source_consumer, source_id, seq, kind, topic, uuid, payload, metadata,
			ordering_key, created_at, attempts, failures, failed_at, last_error, parked_at)
		VALUES ('', 'parked', 0, '', 'out_a', gen_random_uuid()::text, 'x'::bytea, ''::bytea,
			'k-0', now() - interval '1 hour', 10, 10, now(), 'broken', now())`)
	commitPending(t, e, "out_a", "k", 3, 1) // three behind the parked one of k-0
	commitPending(t, e, "out_a", "j", 1, 1) // one of j-0, after them
	relay := e.newOutbox(func(c *outbox.Config) {
		c.RelayGrace = time.Millisecond
		c.RelayInterval = 20 * time.Millisecond
		c.RelayBatchSize = 2
	})
	ctx, stop := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- relay.Run(ctx) }()
	defer func() { stop(); <-done }()
	for deadline := time.Now().Add(10 * time.Second); len(e.wire("out_a")) == 0; time.Sleep(20 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("the effect of j-0 was not sent within 10 s: the backlog behind k-0's parked effect took every claim")
		}
	}
	time.Sleep(200 * time.Millisecond)
	mustEqual(t, "effects on the wire (j-0's; k-0's wait behind the parked one)", len(e.wire("out_a")), 1)
}
