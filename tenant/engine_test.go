package tenant_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"go.uber.org/goleak"

	"github.com/watermill-outbox/outbox"
	"github.com/watermill-outbox/outbox/drivers/postgres"
	"github.com/watermill-outbox/outbox/internal/pgtest"
	"github.com/watermill-outbox/outbox/internal/silent"
	"github.com/watermill-outbox/outbox/outboxdriver"
	"github.com/watermill-outbox/outbox/tenant"
)

// passCounter counts the relay passes of a member: a pass begins with a claim from the front.
type passCounter struct {
	postgres.Driver
	mu     sync.Mutex
	passes int
}

func (d *passCounter) Open(db *sql.DB, opts outboxdriver.StoreOptions) (outboxdriver.Store, error) {
	st, err := d.Driver.Open(db, opts)
	if err != nil {
		return nil, err
	}
	ds, _ := st.(outboxdriver.DelayedStore)
	return &countingStore{Store: st, DelayedStore: ds, d: d}, nil
}

func (d *passCounter) count() int {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.passes
}

// countingStore keeps the delayed effects of the store it wraps, whose due times wake the relay.
type countingStore struct {
	outboxdriver.Store
	outboxdriver.DelayedStore
	d *passCounter
}

func (s *countingStore) EffectClaimDue(ctx context.Context, p outboxdriver.EffectClaimParams) (outboxdriver.EffectClaim, error) {
	if p.After == 0 {
		s.d.mu.Lock()
		s.d.passes++
		s.d.mu.Unlock()
	}
	return s.Store.EffectClaimDue(ctx, p)
}

// publishDelayed commits one effect due in 200 ms on member name, which only the member's relay
// sends (woken by its due time): so it shows that the member's background work runs.
func publishDelayed(t *testing.T, set *tenant.Set, name string) string {
	t.Helper()
	id := fmt.Sprintf("%s-delayed-%d", name, time.Now().UnixNano())
	if err := set.InTx(context.Background(), name, func(ctx context.Context, _ *sql.Tx) error {
		return outbox.Publish(outbox.WithDelay(ctx, 200*time.Millisecond), "events", message.NewMessage(id, nil))
	}); err != nil {
		t.Fatal(err)
	}
	return id
}

// Three members on one engine that runs one call at a time all relay; a member added while the
// Set runs relays; a removed member's relay stops, Remove returning once its work returned; at
// shutdown every member's marks are written (nothing is pending that went out) and no goroutine
// of the Set is left.
func TestSetRunsMembersOnOneEngine(t *testing.T) {
	db := pgtest.DB(t)
	w := newWire()
	obs := map[string]*outbox.Outbox{}
	for _, n := range []string{"m0", "m1", "m2", "m3"} {
		obs[n] = newMember(t, db, n+"_", w)
	}
	set := newSet(t, tenant.Config{MaxConcurrent: 1}, map[string]*outbox.Outbox{"m0": obs["m0"], "m1": obs["m1"], "m2": obs["m2"]})
	defer goleak.VerifyNone(t, goleak.IgnoreCurrent())

	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- set.Run(ctx) }()

	var ids []string
	for _, n := range []string{"m0", "m1", "m2"} {
		ids = append(ids, publishDelayed(t, set, n))
	}
	eventually(t, "every member's delayed effect sent", func() bool {
		for _, id := range ids {
			if w.count(id) != 1 {
				return false
			}
		}
		return true
	})

	if err := set.Add("m3", obs["m3"]); err != nil {
		t.Fatal(err)
	}
	added := publishDelayed(t, set, "m3")
	eventually(t, "the added member's delayed effect sent", func() bool { return w.count(added) == 1 })

	rctx, rcancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer rcancel()
	if err := set.Remove(rctx, "m1"); err != nil {
		t.Fatal(err)
	}
	// Committed on the removed member's Outbox directly: nothing runs its relay any more.
	gone := fmt.Sprintf("m1-gone-%d", time.Now().UnixNano())
	if err := obs["m1"].InTx(context.Background(), func(ctx context.Context, _ *sql.Tx) error {
		return outbox.Publish(outbox.WithDelay(ctx, 100*time.Millisecond), "events", message.NewMessage(gone, nil))
	}); err != nil {
		t.Fatal(err)
	}
	kept := publishDelayed(t, set, "m2")
	eventually(t, "a remaining member's effect sent", func() bool { return w.count(kept) == 1 })
	time.Sleep(500 * time.Millisecond)
	if w.count(gone) != 0 {
		t.Fatal("the removed member still relays")
	}

	// Effects sent inline at the last moment: their marks are written by the time Run returns.
	var inline []string
	for i := range 20 {
		n := []string{"m0", "m2", "m3"}[i%3]
		id := fmt.Sprintf("%s-inline-%d", n, i)
		inline = append(inline, id)
		if err := set.InTx(context.Background(), n, func(ctx context.Context, _ *sql.Tx) error {
			return outbox.Publish(ctx, "events", message.NewMessage(id, nil))
		}); err != nil {
			t.Fatal(err)
		}
	}
	cancel()
	select {
	case err := <-done:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("Run did not return")
	}
	for _, id := range inline {
		if w.count(id) != 1 {
			t.Errorf("%s went out %d times", id, w.count(id))
		}
	}
	for _, n := range []string{"m0", "m2", "m3"} {
		st, err := obs[n].Stats(context.Background())
		if err != nil {
			t.Fatal(err)
		}
		if st.Pending != 0 || st.Delayed != 0 {
			t.Errorf("%s after Run returned: %d pending, %d delayed; want every mark written", n, st.Pending, st.Delayed)
		}
	}
}

// An idle member's relay is polled at growing intervals up to IdleMax, not every RelayInterval;
// a commit of the process (here a delayed effect falling due) wakes it at once.
func TestSetIdleMemberBacksOff(t *testing.T) {
	db := pgtest.DB(t)
	w := newWire()
	d := &passCounter{}
	ob, err := outbox.New(outbox.Config{DB: db, Driver: d, Publisher: w, RelayInterval: 20 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	if err := ob.Migrate(context.Background()); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = ob.Close() })
	set := newSet(t, tenant.Config{IdleMax: time.Second}, map[string]*outbox.Outbox{"a": ob})
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- set.Run(ctx) }()
	defer func() { cancel(); <-done }()

	time.Sleep(1500 * time.Millisecond) // 20, 40, ... 640 ms, then every second
	before := d.count()
	time.Sleep(2 * time.Second)
	// Every RelayInterval would be 100 passes; backed off to IdleMax, 2 or 3.
	if n := d.count() - before; n > 4 {
		t.Fatalf("an idle member's relay ran %d passes in 2 s, want at most 4 (IdleMax 1 s)", n)
	}

	time.Sleep(300 * time.Millisecond)
	start := time.Now()
	id := fmt.Sprintf("wake-%d", start.UnixNano())
	if err := set.InTx(context.Background(), "a", func(ctx context.Context, _ *sql.Tx) error {
		return outbox.Publish(outbox.WithDelay(ctx, 50*time.Millisecond), "events", message.NewMessage(id, nil))
	}); err != nil {
		t.Fatal(err)
	}
	eventually(t, "the delayed effect sent", func() bool { return w.count(id) == 1 })
	if took := time.Since(start); took > 500*time.Millisecond {
		t.Errorf("the effect due in 50 ms went out after %v: its due time did not wake the idle relay", took)
	}
}

// An idle member's relay looks again when a lease ends: an effect leased by a relay of another
// process that crashed (its lease ends in 3 s here) is sent soon after its lease ends, not up to
// IdleMax later. The member's relay backs off from 200 ms (passes at 0, 0.4, 1.2, 2.8 and 6 s
// after the start, then every 12.8 s), and every pass before the lease ends finds nothing due.
func TestSetIdleRelayWakesAtLeaseEnd(t *testing.T) {
	db := pgtest.DB(t)
	w := newWire()
	ob, err := outbox.New(outbox.Config{DB: db, Driver: postgres.Driver{}, Publisher: w, RelayInterval: 200 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	if err := ob.Migrate(context.Background()); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = ob.Close() })
	// The other process: it commits an effect, crashes before sending it, and a relay of it
	// leases the effect and crashes too.
	crashing, err := outbox.New(outbox.Config{DB: db, Driver: postgres.Driver{}, Publisher: w,
		Failpoint: func(_ context.Context, point string) error {
			if point == outbox.FailpointAfterCommit {
				return errors.New("crash")
			}
			return nil
		}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = crashing.Close() })
	id := fmt.Sprintf("leased-%d", time.Now().UnixNano())
	if err := crashing.InTx(context.Background(), func(ctx context.Context, _ *sql.Tx) error {
		return outbox.Publish(ctx, "events", message.NewMessage(id, nil))
	}); !errors.Is(err, outbox.ErrFailpoint) {
		t.Fatalf("InTx with a crash after its commit: %v", err)
	}
	const lease = 3 * time.Second
	var leftMS float64
	if err := db.QueryRow(`UPDATE outbox_effects_all SET next_attempt_at = now() + $1 * interval '1 millisecond' WHERE uuid = $2
		RETURNING extract(epoch FROM next_attempt_at - now()) * 1000`, lease.Milliseconds(), id).Scan(&leftMS); err != nil {
		t.Fatal(err)
	}
	leaseEnd := time.Now().Add(time.Duration(leftMS) * time.Millisecond)

	set := newSet(t, tenant.Config{IdleMax: 20 * time.Second}, map[string]*outbox.Outbox{"a": ob})
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- set.Run(ctx) }()
	defer func() { cancel(); <-done }()
	deadline := time.Now().Add(30 * time.Second)
	for w.count(id) == 0 && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond)
	}
	late := time.Since(leaseEnd)
	t.Logf("sent %s after its lease ended", late.Round(time.Millisecond))
	if w.count(id) == 0 || late > time.Second {
		t.Errorf("the effect went out %s after its lease ended (sent: %d), want within 1 s (IdleMax 20 s)", late.Round(time.Millisecond), w.count(id))
	}
}

// sampleCounter counts the statistics samples of a member and keeps the last one.
type sampleCounter struct {
	postgres.Driver
	mu      sync.Mutex
	samples []outboxdriver.Stats
}

func (d *sampleCounter) Open(db *sql.DB, opts outboxdriver.StoreOptions) (outboxdriver.Store, error) {
	st, err := d.Driver.Open(db, opts)
	if err != nil {
		return nil, err
	}
	ds, _ := st.(outboxdriver.DelayedStore)
	return &sampleStore{Store: st, DelayedStore: ds, d: d}, nil
}

// since returns the samples taken after t.
func (d *sampleCounter) since(t time.Time) []outboxdriver.Stats {
	d.mu.Lock()
	defer d.mu.Unlock()
	var out []outboxdriver.Stats
	for _, s := range d.samples {
		if s.SampledAt.After(t) {
			out = append(out, s)
		}
	}
	return out
}

type sampleStore struct {
	outboxdriver.Store
	outboxdriver.DelayedStore
	d *sampleCounter
}

func (s *sampleStore) Stats(ctx context.Context, p outboxdriver.StatsParams) (outboxdriver.Stats, error) {
	st, err := s.Store.Stats(ctx, p)
	if err == nil && p.Interval > 0 {
		s.d.mu.Lock()
		s.d.samples = append(s.d.samples, st)
		s.d.mu.Unlock()
	}
	return st, err
}

// An idle member's statistics sampling backs off past IdleMax, up to ten StatsIntervals: nothing
// changes in its tables. A commit of the process brings it back to StatsInterval at once, so
// that its gauges show the change one interval later, not a backed-off one.
func TestSetIdleMemberSamplesRarely(t *testing.T) {
	db := pgtest.DB(t)
	w := newWire()
	d := &sampleCounter{}
	const every = 200 * time.Millisecond
	ob, err := outbox.New(outbox.Config{DB: db, Driver: d, Publisher: w, TablePrefix: "s_", StatsInterval: every})
	if err != nil {
		t.Fatal(err)
	}
	if err := ob.Migrate(context.Background()); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = ob.Close() })
	// IdleMax 400 ms: the relay backs off to it, the sampling to ten StatsIntervals (2 s). The
	// statistics budget (one sample per 50 ms over all members) does not hold a member alone
	// that is sampled less often.
	set := newSet(t, tenant.Config{IdleMax: 2 * every, StatsEvery: every / 4}, map[string]*outbox.Outbox{"a": ob})
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- set.Run(ctx) }()
	defer func() { cancel(); <-done }()

	// Samples at 0, 0.4, 1.2, 2.8, 4.8 s, then every 2 s.
	time.Sleep(5 * time.Second)
	from := time.Now()
	time.Sleep(4 * time.Second)
	if n := len(d.since(from)); n > 3 {
		t.Fatalf("an idle member was sampled %d times in 4 s; want 2 (every ten StatsIntervals, 2 s), not every IdleMax (400 ms: 10)", n)
	}

	// Right after an idle sample, so that the next one of the backoff is 2 s away: a commit that
	// did not bring the sampling back would show in a sample only then. At a random moment, a
	// sample of the backoff fell within the bound by chance (a run under load also took 884 ms to
	// show it, over the 800 ms the bound was).
	idle := time.Now()
	eventually(t, "an idle sample", func() bool { return len(d.since(idle)) > 0 })
	committed := time.Now()
	if err := set.InTx(context.Background(), "a", func(ctx context.Context, _ *sql.Tx) error {
		return outbox.Publish(outbox.WithDelay(ctx, time.Hour), "events", message.NewMessage(fmt.Sprint("later-", committed.UnixNano()), nil))
	}); err != nil {
		t.Fatal(err)
	}
	eventually(t, "a sample that shows the delayed effect", func() bool {
		for _, s := range d.since(committed) {
			if s.Delayed == 1 {
				return true
			}
		}
		return false
	})
	if took := time.Since(committed); took > 6*every {
		t.Errorf("the delayed effect showed in a sample %s after its commit, right after an idle sample; want within about StatsInterval (200 ms), not the backoff's 2 s", took)
	}
	// Something waits now: every StatsInterval again.
	from = time.Now()
	time.Sleep(2 * time.Second)
	if n := len(d.since(from)); n < 6 {
		t.Errorf("%d samples in 2 s of a member with a delayed effect waiting; want about 10 (StatsInterval 200 ms)", n)
	}
}

// Busy members share the statistics budget: six members, each committing every 60 ms and so
// resuming its sampling at StatsInterval (200 ms, 30 samples a second between them), are sampled
// at most once per StatsEvery (250 ms) all together, in turn: each of them within the window.
func TestSetStatsBudgetAcrossBusyMembers(t *testing.T) {
	db := pgtest.DB(t)
	w := newWire()
	const n, every, budget = 6, 200 * time.Millisecond, 250 * time.Millisecond
	counters := make([]*sampleCounter, n)
	obs := map[string]*outbox.Outbox{}
	for i := range n {
		counters[i] = &sampleCounter{}
		ob, err := outbox.New(outbox.Config{DB: db, Driver: counters[i], Publisher: w, TablePrefix: fmt.Sprintf("b%d_", i), StatsInterval: every})
		if err != nil {
			t.Fatal(err)
		}
		if err := ob.Migrate(context.Background()); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = ob.Close() })
		obs[fmt.Sprint("m", i)] = ob
	}
	set := newSet(t, tenant.Config{StatsEvery: budget}, obs)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- set.Run(ctx) }()
	defer func() { cancel(); <-done }()

	busy, stopBusy := context.WithCancel(context.Background())
	busyDone := make(chan struct{})
	go func() {
		defer close(busyDone)
		tick := time.NewTicker(10 * time.Millisecond)
		defer tick.Stop()
		for i := 0; ; i++ {
			select {
			case <-busy.Done():
				return
			case <-tick.C:
			}
			err := set.InTx(busy, fmt.Sprint("m", i%n), func(ctx context.Context, _ *sql.Tx) error {
				return outbox.Publish(ctx, "events", message.NewMessage(fmt.Sprint("busy-", i), nil))
			})
			if err != nil && busy.Err() == nil {
				t.Error(err)
				return
			}
		}
	}()
	defer func() { stopBusy(); <-busyDone }()

	// The first samples, all due at Run's start, go out at the budget's pace too; measure after.
	time.Sleep(2 * time.Second)
	from := time.Now()
	const window = 4 * time.Second
	time.Sleep(window)
	total, fewest := 0, int(^uint(0)>>1)
	for _, c := range counters {
		var got int
		for _, s := range c.since(from) {
			if s.SampledAt.Before(from.Add(window)) {
				got++
			}
		}
		total, fewest = total+got, min(fewest, got)
	}
	t.Logf("%d samples of %d busy members in %s (budget: one per %s), the fewest of a member %d", total, n, window, budget, fewest)
	// A sample's time is read inside it, a little after its start: one of slack.
	if allowed := int(window/budget) + 2; total > allowed {
		t.Errorf("%d samples of %d busy members in %s: want at most %d (one per %s), not one per member per StatsInterval (%d)",
			total, n, window, allowed, budget, int(window/every)*n)
	}
	if fewest < 1 {
		t.Errorf("a member was not sampled in %s: want each in turn (%d members, one sample per %s)", window, n, budget)
	}
}

// claimLog records when a member's relay claimed from the front of its effects, and what.
type claimLog struct {
	postgres.Driver
	mu     sync.Mutex
	claims []claimAt
}

type claimAt struct {
	at   time.Time
	pass time.Time // the deadline of the relay pass's context: the pass's start and its bound, one per pass
	ids  []string
}

func (d *claimLog) Open(db *sql.DB, opts outboxdriver.StoreOptions) (outboxdriver.Store, error) {
	st, err := d.Driver.Open(db, opts)
	if err != nil {
		return nil, err
	}
	ds, _ := st.(outboxdriver.DelayedStore)
	return &claimLogStore{Store: st, DelayedStore: ds, d: d}, nil
}

func (d *claimLog) all() []claimAt {
	d.mu.Lock()
	defer d.mu.Unlock()
	return slices.Clone(d.claims)
}

type claimLogStore struct {
	outboxdriver.Store
	outboxdriver.DelayedStore
	d *claimLog
}

func (s *claimLogStore) EffectClaimDue(ctx context.Context, p outboxdriver.EffectClaimParams) (outboxdriver.EffectClaim, error) {
	at := time.Now()
	c, err := s.Store.EffectClaimDue(ctx, p)
	if p.After == 0 && err == nil {
		var ids []string
		for _, e := range c.Effects {
			ids = append(ids, e.UUID)
		}
		s.d.mu.Lock()
		pass, _ := ctx.Deadline()
		s.d.claims = append(s.d.claims, claimAt{at: at, pass: pass, ids: ids})
		s.d.mu.Unlock()
	}
	return c, err
}

// A relay pass that sent what was pending and ended on a claim that found nothing, nothing
// else falling due, counts as idle: the member's next pass is two RelayIntervals after it, not
// one (which found nothing: a Set's members that each get a message now and then spent about
// two empty passes on each). What it could leave late is covered by its wake-ups: a commit of
// the process wakes the relay, and the claim tells when a lease or a backoff ends.
func TestSetRelayPassThatDrainedCountsIdle(t *testing.T) {
	db := pgtest.DB(t)
	w := newWire()
	d := &claimLog{}
	const every = 300 * time.Millisecond
	ob, err := outbox.New(outbox.Config{DB: db, Driver: d, Publisher: w, RelayInterval: every})
	if err != nil {
		t.Fatal(err)
	}
	if err := ob.Migrate(context.Background()); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = ob.Close() })
	set := newSet(t, tenant.Config{IdleMax: 10 * time.Second}, map[string]*outbox.Outbox{"a": ob})
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- set.Run(ctx) }()
	defer func() { cancel(); <-done }()
	time.Sleep(time.Second) // the first passes, all finding nothing

	for round := range 3 {
		// A delayed effect: only the relay sends it, in a pass its due time wakes.
		id := fmt.Sprintf("drained-%d-%d", round, time.Now().UnixNano())
		if err := set.InTx(context.Background(), "a", func(ctx context.Context, _ *sql.Tx) error {
			return outbox.Publish(outbox.WithDelay(ctx, 50*time.Millisecond), "events", message.NewMessage(id, nil))
		}); err != nil {
			t.Fatal(err)
		}
		eventually(t, "the delayed effect sent", func() bool { return w.count(id) == 1 })
		time.Sleep(4 * every)
		// The claims of one pass share its context, whose deadline is the pass's start plus its
		// bound: the passes after the one that sent are told by theirs, however long the sending
		// pass's claims and sends took on a loaded machine (they were taken for passes of
		// their own when told by the time between claims).
		claims := d.all()
		k := slices.IndexFunc(claims, func(c claimAt) bool { return slices.Contains(c.ids, id) })
		var took time.Time
		var after []time.Duration
		if k >= 0 {
			took = claims[k].pass
			last := took
			for _, c := range claims[k+1:] {
				if c.pass.After(last) {
					after = append(after, c.pass.Sub(took)) // a pass begins
					last = c.pass
				}
			}
		}
		if took.IsZero() || len(after) == 0 {
			t.Fatalf("round %d: the pass that sent %s (at %v) and the next pass (%v) not seen", round, id, took, after)
		}
		t.Logf("round %d: next passes %v after the one that sent", round, after)
		if after[0] < every*3/2 {
			t.Errorf("round %d: the next pass came %s after the one that sent everything, want about two RelayIntervals (%s), not one",
				round, after[0].Round(time.Millisecond), 2*every)
		}
	}
}

// Members on one database/sql pool (schemas or prefixes of one database) run at most
// PoolConcurrent background calls at once, the pool's idle connections by default: the Set's
// background work opens no connection that the pool closes when it gets it back (200 idle
// schemas on one default pool opened 0.4 connections a second, each a server process forked
// and torn down). That the cap binds is shown on a pool whose server accepts connections and
// never answers, where every call holds its connection: two connections with the cap, more
// without it (PoolConcurrent -1).
func TestSetMembersOnOnePoolOpenNoConnectionTheyClose(t *testing.T) {
	closedBeyondIdle := func(poolConcurrent int) int64 {
		db := pgtest.DB(t) // database/sql's defaults: two idle connections
		members := map[string]*outbox.Outbox{}
		for i := range 8 {
			ob, err := outbox.New(outbox.Config{DB: db, Driver: postgres.Driver{}, Publisher: newWire(), TablePrefix: fmt.Sprintf("p%d_", i),
				RelayInterval: 20 * time.Millisecond, CleanupInterval: 50 * time.Millisecond, StatsInterval: 50 * time.Millisecond})
			if err != nil {
				t.Fatal(err)
			}
			if err := ob.Migrate(context.Background()); err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { _ = ob.Close() })
			members[fmt.Sprint("m", i)] = ob
		}
		set := newSet(t, tenant.Config{MaxConcurrent: 8, PoolConcurrent: poolConcurrent, IdleMax: -1}, members)
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan error, 1)
		go func() { done <- set.Run(ctx) }()
		time.Sleep(500 * time.Millisecond) // the first runs, all due at once
		before := db.Stats().MaxIdleClosed
		time.Sleep(2 * time.Second)
		closed := db.Stats().MaxIdleClosed - before
		cancel()
		<-done
		return closed
	}
	if n := closedBeyondIdle(0); n != 0 {
		t.Errorf("the members' background work had the pool close %d connections beyond its idle ones in 2 s, want none", n)
	}
	t.Logf("without the cap: %d connections closed beyond the idle ones in 2 s", closedBeyondIdle(-1))

	connected := func(poolConcurrent int, wait time.Duration) int {
		srv, err := silent.Start()
		if err != nil {
			t.Fatal(err)
		}
		stalled, err := sql.Open("postgres", srv.DSN())
		if err != nil {
			t.Fatal(err)
		}
		members := map[string]*outbox.Outbox{}
		for i := range 4 {
			ob, err := outbox.New(outbox.Config{DB: stalled, Driver: postgres.Driver{}, Publisher: newWire(), TablePrefix: fmt.Sprintf("s%d_", i),
				ShutdownTimeout: 500 * time.Millisecond, StatsInterval: -1})
			if err != nil {
				t.Fatal(err)
			}
			members[fmt.Sprint("s", i)] = ob
		}
		set := newSet(t, tenant.Config{MaxConcurrent: 8, PoolConcurrent: poolConcurrent}, members)
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan error, 1)
		go func() { done <- set.Run(ctx) }()
		srv.WaitConns(3, wait)
		n := srv.Conns()
		cancel()
		<-done          // within the members' ShutdownTimeout: their calls are stuck
		_ = srv.Close() // the stuck calls return
		_ = stalled.Close()
		return n
	}
	if n := connected(0, time.Second); n != 2 {
		t.Errorf("members of one stalled pool opened %d connections in 1 s, want PoolConcurrent's 2", n)
	}
	if n := connected(-1, 10*time.Second); n <= 2 {
		t.Errorf("without the cap, members of one stalled pool opened %d connections in 10 s: the test shows nothing", n)
	}
}
