package campaign

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wsql "github.com/ThreeDotsLabs/watermill-sql/v3/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"

	"github.com/watermill-outbox/outbox"
	"github.com/watermill-outbox/outbox/internal/pgproxy"
	"github.com/watermill-outbox/outbox/middleware"
	"github.com/watermill-outbox/outbox/tenant"
)

const (
	consumer  = "c"
	messages  = 12
	instances = 3
	// drainFor bounds the final drain by the relays: effects that a redelivery leased and sent,
	// and whose mark a crash lost, wait for the lease to end (2*PublishTimeout + 30 s).
	drainFor = 45 * time.Second
	// relayInterval is every instance's RelayInterval.
	relayInterval = 50 * time.Millisecond
	// lookBack is more than the sweep of inline effects looks behind where it got to (a minute).
	lookBack = "interval '2 minutes'"
	// clockStep is how far ahead the database clock runs in the clock-step scenario.
	clockStep = "interval '10 minutes'"
)

// run is one run of the campaign: its own tables (a prefix of its own) and topics.
type run struct {
	t     *testing.T
	db    *sql.DB // the test's view of the database, and the broker's
	n     int
	seed  uint64
	dep   Deployment
	on    map[string]bool
	stats *stats

	database *Database

	r       *rand.Rand
	prefix  string
	topics  [2]string
	inTopic string // the topic the messages come from, where a retried dead letter goes back to
	applied string
	forms   []Form
	procs   []*outbox.Outbox // each instance's Outbox; of a Set, its first member's
	// dbs and dsns are the databases of the tenants (one but for a Tenants deployment): each
	// holds the run's outbox tables and business table; the broker's topics are on db (dbs[0]).
	dbs  []*sql.DB
	dsns []string
	// members are each instance's Outboxes, by tenant; sets and wrapped, for a Tenants
	// deployment, each instance's Set and the handler wrapped by its middleware.
	members [][]*outbox.Outbox
	sets    []*tenant.Set
	wrapped []message.HandlerFunc
	pub     *publisher
	timeout time.Duration // HandlerTimeout
	// proxy, in a Tenants deployment with member-down on, stands between the members of tenant
	// downMember and its database; proxied is that database's DSN through it. outage is the
	// run's outage, if it has one.
	proxy   *pgproxy.Proxy
	proxied string
	outage  *outage

	// auditTimes are the first and last stored times of the effects read from the audit of
	// deleted effects (installAudit), by UUID.
	auditTimes map[string][2]time.Time

	clockAhead atomic.Bool // claims committed now are stamped clockStep ahead
	failed     atomic.Bool
	logMu      sync.Mutex
	log        strings.Builder
}

func (c *run) fail(format string, args ...any) {
	c.failed.Store(true)
	c.t.Errorf("run %d (%s, seed %d): %s", c.n, c.dep.Name, c.seed, fmt.Sprintf(format, args...))
}

// note adds a line to the run's log, shown when it fails.
func (c *run) note(format string, args ...any) {
	c.logMu.Lock()
	defer c.logMu.Unlock()
	fmt.Fprintf(&c.log, format+"\n", args...)
}

// exec runs a statement of the test's own on the database of tenant k.
func (c *run) exec(k int, query string, args ...any) int64 {
	res, err := c.dbs[k].Exec(c.database.Bind(query), args...)
	if err != nil {
		c.fail("%s: %v", query, err)
		return 0
	}
	n, _ := res.RowsAffected()
	return n
}

// do runs the schedule and checks the invariants; it returns false when some failed.
func (c *run) do() bool {
	t := c.t
	c.r = rand.New(rand.NewPCG(c.seed, c.seed^0x9e3779b97f4a7c15))
	r := c.r
	c.prefix = fmt.Sprintf("c%d_", c.n)
	c.topics = [2]string{fmt.Sprintf("campaign_%d_a", c.n), fmt.Sprintf("campaign_%d_b", c.n)}
	c.inTopic = fmt.Sprintf("campaign_%d_in", c.n)
	c.applied = c.prefix + "applied"
	for _, db := range c.dbs {
		if _, err := db.Exec(`CREATE TABLE ` + c.applied + ` (message_id ` + c.database.IDType + ` NOT NULL)`); err != nil {
			t.Fatal(err)
		}
	}
	schema := c.database.Broker
	for _, topic := range append(c.topics[:], c.inTopic) {
		for _, q := range schema.SchemaInitializingQueries(topic) {
			if _, err := c.db.Exec(q.Query, q.Args...); err != nil {
				t.Fatal(err)
			}
		}
	}
	broker, err := wsql.NewPublisher(c.db, wsql.PublisherConfig{SchemaAdapter: schema}, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	c.pub = &publisher{next: broker, stuck: make(chan struct{}), first: map[wireKey]int{}}
	defer close(c.pub.stuck)

	// Run-level choices, all drawn before anything runs, so that the seed replays the schedule.
	// Every value is drawn whichever scenarios are on, so that a seed gives the same schedule
	// with a scenario switched off, less that scenario.
	bigAt := -1
	if big, at := r.IntN(8) == 0, r.IntN(messages); big && c.on["big-unit"] {
		bigAt = at
		c.stats.reached("big-unit")
	}
	if fails, topic, calls := r.IntN(2) == 0, r.IntN(2), 1+r.IntN(4); fails && c.on["topic-fails"] {
		c.pub.failTopic = c.topics[topic]
		c.pub.failCalls.Store(int32(calls))
		c.note("the broker refuses the first %d calls for %s", calls, c.pub.failTopic)
		c.stats.reached("topic-fails")
	}
	clockAt, clockFor := time.Duration(-1), time.Duration(0)
	if step, at, d := r.IntN(3) == 0, r.IntN(100), 200+r.IntN(800); step && c.on["clock-step"] {
		clockAt, clockFor = time.Duration(at)*time.Millisecond, time.Duration(d)*time.Millisecond
	}
	anyHeld := false
	relaysDuring := r.IntN(2) == 0
	c.forms = append([]Form(nil), c.dep.Forms...)
	if c.dep.Shuffle {
		r.Shuffle(len(c.forms), func(i, j int) { c.forms[i], c.forms[j] = c.forms[j], c.forms[i] })
	}
	drainers := []int{0, 1, 2}
	if one, pick := r.IntN(2) == 0, r.IntN(instances); one && c.on["relay-one"] {
		// Any one instance: every form's relay moves the inline effects left behind (docs/pgx.md).
		drainers = []int{pick}
	}
	if slow, topic, by := r.IntN(3) == 0, r.IntN(2), 20+r.IntN(100); slow && c.on["slow-topic"] {
		c.pub.slowTopic, c.pub.slowBy = c.topics[topic], time.Duration(by)*time.Millisecond
		c.note("every call for %s takes %s", c.pub.slowTopic, c.pub.slowBy)
		c.stats.reached("slow-topic")
	}
	if hung, topic, d := r.IntN(3) == 0, r.IntN(2), 300+r.IntN(1200); hung && c.on["hung-topic"] {
		// From now on: the instances open in a few milliseconds, and the deliveries begin.
		c.pub.hungTopic, c.pub.hungUntil = c.topics[topic], time.Now().Add(time.Duration(d)*time.Millisecond)
		c.note("every call for %s hangs for the first %d ms", c.pub.hungTopic, d)
	}
	c.outage = c.drawOutage(r)
	var names []string
	for i, f := range c.forms {
		names = append(names, fmt.Sprintf("%d=%s", i, f.Name))
	}
	c.note("instances %s; drain by %v; relays during the deliveries: %v; big unit: message %d", strings.Join(names, " "), drainers, relaysDuring, bigAt)

	// Which instances delete what they sent: drawn from a stream of their own, so that the
	// schedules of the seeds drawn before this scenario stay as they were.
	deletes := make([]bool, len(c.forms))
	if c.on["deleted-effects"] && c.database == postgresDatabase {
		dr := rand.New(rand.NewPCG(c.seed, 47))
		for i := range deletes {
			deletes[i] = dr.IntN(2) == 0
		}
		if slices.Contains(deletes, true) {
			c.note("instances that delete sent effects (EffectRetention 0): %v", deletes)
			c.stats.reached("deleted-effects")
		}
	}

	c.timeout = 300 * time.Millisecond
	publishTimeout := 200 * time.Millisecond
	if bigAt >= 0 {
		// 9,400 effects take longer than the usual bounds to record, commit and publish.
		c.timeout, publishTimeout = 5*time.Second, 3*time.Second
	}
	cfg := outbox.Config{
		TablePrefix:      c.prefix,
		Publisher:        c.pub,
		Logger:           watermill.NopLogger{},
		EffectRetention:  time.Hour, // keep dispatched effects: the check compares them with the wire
		MaxAttempts:      1000,
		RetryDelay:       10 * time.Millisecond,
		RetryDelayMax:    50 * time.Millisecond,
		RelayMaxAttempts: 1000,
		HandlerTimeout:   c.timeout,
		PublishTimeout:   publishTimeout,
		DuplicateWait:    100 * time.Millisecond,
		RelayGrace:       200 * time.Millisecond,
		RelayInterval:    relayInterval,
		StatsInterval:    -1,
		Failpoint:        c.failpoint,
	}
	for i, f := range c.forms {
		var members []*outbox.Outbox
		for k, dsn := range c.dsns {
			mcfg := cfg
			if deletes[i] {
				mcfg.EffectRetention = 0
			}
			if k == downMember && c.proxy != nil {
				dsn, mcfg.Failpoint = c.proxied, c.memberFailpoint
				// After an outage the work waits for the next probe: one at most 400 ms away, not
				// up to 30 s, so that the down member's messages get through within the broker's
				// redeliveries and its effects within the drain.
				mcfg.ReconnectDelayMax = 400 * time.Millisecond
			}
			ob, closeFn, err := f.Open(dsn, mcfg)
			if err != nil {
				t.Fatalf("open %s: %v", f.Name, err)
			}
			defer closeFn()
			members = append(members, ob)
		}
		c.members = append(c.members, members)
		c.procs = append(c.procs, members[0])
		if c.dep.Tenants {
			// The members' relays back off while idle, up to IdleMax: 30 s by default, which an
			// effect committed by another instance (no in-process wake) after a member's last pass,
			// or kept in a claim until a pass moves it, may wait on top, past the drain's bound (3
			// effects of a run were still pending after 45 s, before a pass learned when leases
			// and backoffs end). The campaign checks what is sent, not how soon: a short IdleMax
			// keeps the backoff and its wakes in play within the drain.
			// Every message of the campaign names its member: none is nacked as unresolved.
			set, err := tenant.New(tenant.Config{Resolver: tenant.FromMetadata(tenantKey), NackUnresolved: true, IdleMax: 8 * relayInterval})
			if err != nil {
				t.Fatal(err)
			}
			for k, ob := range members {
				if err := set.Add(tenantName(k), ob); err != nil {
					t.Fatal(err)
				}
			}
			c.sets = append(c.sets, set)
			c.wrapped = append(c.wrapped, set.Wrap(c.handler(f), middleware.WithConsumer(consumer)))
		}
	}
	ctx := context.Background()
	for _, ob := range c.members[0] {
		if err := ob.Migrate(ctx); err != nil {
			t.Fatal(err)
		}
	}
	if c.database == postgresDatabase {
		for _, db := range c.dbs {
			c.installAudit(db)
		}
	}

	// The schedule: each message is delivered until one delivery is acked (sometimes with a copy
	// at the same moment, during the handler or after the commit, to another instance), then a
	// few late copies arrive.
	type schedule struct {
		msg          *spec
		plans        []*plan
		procs        []int // the instance of each delivery: the plans', then the broker's redeliveries, then the late copies
		concurrentAt int
		late         int
	}
	scheds := make([]schedule, messages)
	for i := range scheds {
		sp := &spec{id: uuid.NewString(), shared: r.IntN(3) == 0 && c.on["shared-uuid"], big: i == bigAt, bigCalls: 1 + 9*r.IntN(2), delay: -1}
		if c.dep.Tenants {
			sp.tenant = i % len(c.dbs) // interleaved, and drawn from nothing: a seed's schedule is the same
		}
		switch i % 4 {
		case 0:
			// 35 characters, so that the next one's with a space fits the broker's UUID column
			// (watermill-sql: 36), where a retried dead letter goes.
			sp.id = sp.id[:35]
		case 1:
			// An ID that differs from the one before only by a trailing space: another message
			// on every driver (IDs, and the cancel keys made of them, compare byte for byte).
			sp.id = scheds[i-1].msg.id + " "
		}
		if delayed, delay, cancel, proc, jitter := r.IntN(2) == 0, r.IntN(600), r.IntN(2) == 0, r.IntN(instances), r.IntN(450)-300; delayed && c.on["delayed"] {
			sp.delay = time.Duration(delay) * time.Millisecond
			sp.cancel, sp.cancelProc, sp.cancelAt = cancel, proc, max(sp.delay+time.Duration(jitter)*time.Millisecond, 0)
			c.stats.reached("delayed")
		}
		if poison, retry := r.IntN(5) == 0, r.IntN(2) == 0; poison && c.on["poison"] {
			sp.poison, sp.retry = true, retry
			sp.broken.Store(true)
		}
		if follow, proc, after := r.IntN(2) == 0, r.IntN(instances), r.IntN(10); follow && sp.delay >= 0 && c.on["delayed-key"] {
			sp.follow, sp.followProc, sp.followAt = true, proc, sp.delay+time.Duration(after)*time.Millisecond
		}
		s := schedule{msg: sp, concurrentAt: -1}
		for range 16 {
			pl := randomPlan(r, sp, c.on)
			if r.IntN(6) == 0 && clockAt >= 0 {
				// What the clock's step can lose: effects left in their claim by a crash, for
				// the relay's sweep to find.
				pl.crashAt = outbox.FailpointAfterCommit
			}
			s.plans = append(s.plans, pl)
		}
		if at := r.IntN(4); c.on["copy-during"] {
			s.concurrentAt = at
		}
		for d, pl := range s.plans {
			if c.database.AnyClaimAfterRollback && pl.endsTx && (pl.copyDuring || d == s.concurrentAt) {
				// Not with a copy at the same time where a copy that claims between the
				// handler's ROLLBACK and its next record lets that record find the copy's claim
				// and commit on its own (MySQL; docs/guarantees.md), a known limit.
				pl.endsTx = false
			}
		}
		if late := r.IntN(3); c.on["late-copies"] {
			s.late = late
		}
		for range 16 + 8 + 2 {
			s.procs = append(s.procs, r.IntN(instances))
		}
		for d, pl := range s.plans {
			pl.copyTo = (s.procs[d] + 1 + r.IntN(instances-1)) % instances
			anyHeld = anyHeld || pl.held
		}
		if sp.shared {
			c.stats.reached("shared-uuid")
		}
		c.note("%s: shared UUID %v, big %v (in %d calls), delayed by %v (cancelled %v on instance %d at %v; followed on its key %v on instance %d at %v), poison %v (retried %v), concurrent copy at delivery %d, %d late; instances %v; plans %v",
			sp.id[:8], sp.shared, sp.big, sp.bigCalls, sp.delay, sp.cancel, sp.cancelProc, sp.cancelAt, sp.follow, sp.followProc, sp.followAt,
			sp.poison, sp.retry, s.concurrentAt, s.late, s.procs[:4], s.plans[:4])
		scheds[i] = s
	}
	rqs := c.drawRequests(r)
	if anyHeld || clockAt >= 0 {
		relaysDuring = true // the sweep's watermark moves only while a relay runs
	}

	runCtx, stopRelays := context.WithCancel(ctx)
	var relays sync.WaitGroup
	startRelays := func(which []int) {
		for _, i := range which {
			relays.Add(1)
			if c.sets != nil {
				go func() { defer relays.Done(); _ = c.sets[i].Run(runCtx) }()
				continue
			}
			go func() { defer relays.Done(); _ = c.procs[i].Run(runCtx) }()
		}
	}
	if relaysDuring {
		startRelays([]int{0, 1, 2})
	}
	var clock sync.WaitGroup
	if clockAt >= 0 {
		clock.Add(1)
		go func() { defer clock.Done(); c.stepClock(clockAt, clockFor, cfg.RelayGrace) }()
	}

	var down sync.WaitGroup
	if c.outage != nil {
		down.Add(1)
		go func() { defer down.Done(); c.takeDown() }()
	}

	began := time.Now()
	acked := make([]atomic.Bool, messages)
	var wg sync.WaitGroup
	for i, s := range scheds {
		wg.Add(1)
		go func() {
			defer wg.Done()
			var copies sync.WaitGroup
			defer copies.Wait()
			var lastMu sync.Mutex
			var last error // the last failed delivery's error, for the report
			deliver := func(proc int, pl *plan) error {
				pl.startCopy = func() func() {
					done := make(chan struct{})
					copies.Add(1)
					go func() {
						defer copies.Done()
						defer close(done)
						if c.deliver(pl.copyTo, &plan{msg: s.msg}) == nil {
							acked[i].Store(true)
						}
					}()
					return func() { <-done }
				}
				err := c.deliver(proc, pl)
				if err == nil {
					acked[i].Store(true)
				} else {
					lastMu.Lock()
					last = fmt.Errorf("delivery to instance %d (%s), plan %v: %w", proc, c.forms[proc].Name, pl, err)
					lastMu.Unlock()
				}
				return err
			}
			for d := 0; d < len(s.plans) && !acked[i].Load(); d++ {
				if d == s.concurrentAt {
					var cw sync.WaitGroup
					cw.Add(1)
					go func() { defer cw.Done(); _ = deliver(s.plans[d].copyTo, &plan{msg: s.msg}) }()
					_ = deliver(s.procs[d], s.plans[d])
					cw.Wait()
					continue
				}
				_ = deliver(s.procs[d], s.plans[d])
			}
			// The broker keeps redelivering, to the instances drawn for it in turn.
			for d, began := 0, time.Now(); !acked[i].Load() && !givesUp(d, began); d++ {
				if err := deliver(s.procs[16+d%8], &plan{msg: s.msg}); err != nil && !acked[i].Load() {
					redeliveryPause(d)
				}
			}
			if !acked[i].Load() {
				lastMu.Lock()
				c.fail("message %s was never acked; the last failure: %v", s.msg.id, last)
				lastMu.Unlock()
				return
			}
			copies.Wait()
			if s.msg.cancel {
				copies.Add(1)
				go func() { defer copies.Done(); c.cancelDelayed(s.msg) }()
			}
			if s.msg.follow {
				copies.Add(1)
				go func() { defer copies.Done(); c.followDelayed(s.msg) }()
			}
			for d := 0; d < s.late; d++ {
				// A late copy may find effects whose mark is not written yet and send them
				// again, or wait for a connection: on a loaded machine a publish or the claim
				// can time out, which is a nack, and the broker redelivers. That the handler
				// does not run again is checked on the business table.
				for try, began := 0, time.Now(); ; try++ {
					err := deliver(s.procs[24+d], &plan{msg: s.msg})
					if err == nil {
						break
					}
					if givesUp(try, began) {
						c.fail("late copy of %s to instance %d (%s): %v", s.msg.id, s.procs[24+d], c.forms[s.procs[24+d]].Name, err)
						break
					}
					redeliveryPause(try)
				}
			}
		}()
	}
	for _, rq := range rqs {
		wg.Add(1)
		go func() { defer wg.Done(); c.send(rq) }()
	}
	wg.Wait()
	clock.Wait()
	down.Wait()

	// The relays send whatever is left.
	stopRelays()
	relays.Wait()
	runCtx, stopRelays = context.WithCancel(ctx)
	startRelays(drainers)
	specs := make([]*spec, len(scheds))
	for i, s := range scheds {
		specs[i] = s.msg
	}
	c.retryDeadLetters(specs, acked)
	drainBegan := time.Now()
	deadline := drainBegan.Add(drainFor)
	for c.pending() > 0 && time.Now().Before(deadline) {
		time.Sleep(50 * time.Millisecond)
	}
	// How long the drain took says which effects waited on what (a lease, a backoff): a run that
	// passes may still have been slow.
	c.note("deliveries took %s, the drain %s", drainBegan.Sub(began).Round(time.Millisecond), time.Since(drainBegan).Round(time.Millisecond))
	stopRelays()
	relays.Wait()
	c.flushMarks()
	if c.pub.hungCalls.Load() > 0 {
		c.stats.reached("hung-topic") // a call for the topic hung while the run went on
	}
	c.check(specs, acked, rqs)
	if c.failed.Load() || *flagLog {
		t.Logf("run %d (%s, seed %d) schedule:\n%s", c.n, c.dep.Name, c.seed, c.log.String())
	}
	return !c.failed.Load()
}

// deliver hands one copy of a message to instance proc, as a broker would.
func (c *run) deliver(proc int, pl *plan) error {
	pl.proc = proc
	msgCtx, cancel := context.WithCancel(context.WithValue(context.Background(), planKey{}, pl))
	defer cancel()
	// The payload names the message, so that a retried dead letter's copy on the wire is told
	// from another's.
	m := message.NewMessage(pl.msg.id, []byte(pl.msg.id+"/in"))
	m.SetContext(msgCtx)
	pl.cancelMessage = cancel
	var err error
	if c.sets != nil {
		m.Metadata.Set(tenantKey, tenantName(pl.msg.tenant))
		_, err = c.wrapped[proc](m)
	} else {
		err = c.procs[proc].Handle(m, outbox.HandleParams{Consumer: consumer, MessageID: pl.msg.id, Topic: c.inTopic}, c.handler(c.forms[proc]))
	}
	c.stats.add(err)
	return err
}

// tenantKey is the metadata key that names a message's tenant in a Tenants deployment.
const tenantKey = "tenant"

func tenantName(k int) string { return fmt.Sprintf("t%d", k) }

// inUnit runs fn as a unit of work of tenant k on instance proc: through its Set, if it is one.
func (c *run) inUnit(ctx context.Context, proc, k int, fn func(ctx context.Context) error) error {
	if c.sets != nil {
		return c.sets[proc].Do(ctx, tenantName(k), func(ctx context.Context, ob *outbox.Outbox) error { return ob.InUnit(ctx, fn) })
	}
	return c.procs[proc].InUnit(ctx, fn)
}

// flushMarks writes the dispatched marks every Outbox of the run has queued.
func (c *run) flushMarks() {
	for _, members := range c.members {
		for _, ob := range members {
			ob.FlushMarks()
		}
	}
}

// handler is the consumer: one business write and the effects of the message's spec, with the
// faults of the delivery's plan. Effect payloads are "<message>/<label>"; "undone" ones are
// recorded in a savepoint that is rolled back.
func (c *run) handler(f Form) message.HandlerFunc {
	return func(m *message.Message) ([]*message.Message, error) {
		ctx := m.Context()
		pl := planOf(ctx)
		if pl.cancel && pl.cancelMessage != nil {
			pl.cancelMessage()
		}
		if err := f.Exec(ctx, c.database.Bind(`INSERT INTO `+c.applied+` (message_id) VALUES ($1)`), m.UUID); err != nil {
			return nil, err
		}
		if pl.held {
			// A long transaction: its first write (and its transaction ID) comes well before
			// its commit, while the relays sweep.
			time.Sleep(c.timeout / 2)
		}
		if pl.copyDuring && pl.startCopy != nil {
			pl.copyOnce.Do(func() {
				c.stats.reached("copy-during")
				pl.startCopy()
				time.Sleep(30 * time.Millisecond) // the copy reaches its claim, or its handler
			})
		}
		publish := func(topic int, label string) error {
			return outbox.Publish(ctx, c.topics[topic], message.NewMessage(uuid.NewString(), []byte(m.UUID+"/"+label)))
		}
		if pl.concurrent {
			var wg sync.WaitGroup
			errs := make([]error, 3)
			for i := range errs {
				wg.Add(1)
				go func() { defer wg.Done(); errs[i] = publish(i%2, fmt.Sprint(i)) }()
			}
			wg.Wait()
			if err := errors.Join(errs...); err != nil {
				return nil, err
			}
		} else {
			for i := range 3 {
				if err := publish(i%2, fmt.Sprint(i)); err != nil {
					return nil, err
				}
			}
		}
		if pl.msg.shared {
			// The same message to both topics: two effects with one UUID.
			id := uuid.NewString()
			for _, topic := range c.topics {
				if err := outbox.Publish(ctx, topic, message.NewMessage(id, []byte(m.UUID+"/shared"))); err != nil {
					return nil, err
				}
			}
		}
		if pl.msg.big {
			msgs := make([]*message.Message, bigEffects)
			for i := range msgs {
				msgs[i] = message.NewMessage(uuid.NewString(), []byte(fmt.Sprintf("%s/big%d", m.UUID, i)))
			}
			for part := range pl.msg.bigCalls {
				n := len(msgs) / pl.msg.bigCalls
				if err := outbox.Publish(ctx, c.topics[0], msgs[part*n:(part+1)*n]...); err != nil {
					return nil, err
				}
			}
		}
		if pl.savepoint {
			rollback, err := f.Savepoint(ctx)
			if err != nil {
				return nil, err
			}
			if err := publish(0, "undone"); err != nil {
				return nil, err
			}
			if err := rollback(); err != nil {
				return nil, err
			}
		}
		if pl.msg.poison && pl.msg.broken.Load() {
			// After its writes and effects, which roll back with it.
			return nil, outbox.Permanent(errors.New("poison message"))
		}
		if pl.endsTx {
			// A handler bug: it ends the unit's transaction itself, then records. Nothing of this
			// delivery may commit (the business row was rolled back; the record must not write
			// outside the transaction), and the unit fails as the handler's doing.
			c.stats.reached("tx-by-sql")
			if err := f.Exec(ctx, "ROLLBACK"); err != nil {
				return nil, err
			}
			return nil, publish(0, "after-rollback")
		}
		switch {
		case pl.killConnection:
			err := f.Exec(ctx, c.database.KillConnection)
			return nil, fmt.Errorf("connection killed: %w", err)
		case pl.handlerPanics:
			panic("handler bug")
		case pl.handlerFails:
			return nil, errors.New("handler failed")
		case pl.handlerSlow:
			return nil, f.Exec(ctx, c.database.Bind(c.database.Sleep), (c.timeout + 200*time.Millisecond).Seconds())
		}
		if err := publish(1, "3"); err != nil || pl.msg.delay < 0 {
			return nil, err
		}
		// Last, so that on the message's key it follows every other effect, by its due time.
		dctx := outbox.WithCancelKey(outbox.WithDelay(ctx, pl.msg.delay), c.cancelKey(pl.msg))
		if pl.msg.follow {
			dctx = outbox.WithOrderingKey(dctx, c.followKey(pl.msg))
		}
		pl.msg.recordedAt.Store(time.Now().UnixNano())
		return nil, outbox.Publish(dctx, c.topics[1], message.NewMessage(uuid.NewString(), []byte(m.UUID+"/delayed")))
	}
}

func (c *run) cancelKey(sp *spec) string { return c.prefix + sp.id }

func (c *run) followKey(sp *spec) string { return c.prefix + "order/" + sp.id }

// followDelayed records, in a unit of work of its own, an effect with the ordering key of the
// delayed effect of sp, followAt after the delayed one was recorded (at once when the message
// was acked later): once it is due, and before or after a relay moved it.
func (c *run) followDelayed(sp *spec) {
	time.Sleep(time.Until(time.Unix(0, sp.recordedAt.Load()).Add(sp.followAt)))
	err := c.inUnit(context.Background(), sp.followProc, sp.tenant, func(ctx context.Context) error {
		return outbox.Publish(outbox.WithOrderingKey(ctx, c.followKey(sp)), c.topics[0],
			message.NewMessage(uuid.NewString(), []byte(sp.id+"/after")))
	})
	if err != nil {
		sp.followed.Store(-1)
		c.note("%s: the unit after the delayed effect failed: %v", sp.id[:8], err)
		return
	}
	sp.followed.Store(1)
	c.stats.reached("delayed-key followed")
	c.note("%s: an effect with the delayed effect's key recorded on instance %d", sp.id[:8], sp.followProc)
}

// cancelDelayed cancels the delayed effect of sp in a unit of work of its own, cancelAt after
// the effect was recorded (at once when the message was acked later): around its due time,
// racing the relays that move it. Timed from the record, not the ack, so that a slow ack (a
// crash, a redelivery, the race detector) does not make every cancel come too late.
func (c *run) cancelDelayed(sp *spec) {
	time.Sleep(time.Until(time.Unix(0, sp.recordedAt.Load()).Add(sp.cancelAt)))
	var n int
	err := c.inUnit(context.Background(), sp.cancelProc, sp.tenant, func(ctx context.Context) error {
		var err error
		n, err = outbox.CancelDelayed(ctx, c.cancelKey(sp))
		return err
	})
	switch {
	case err != nil:
		sp.cancelled.Store(-1)
		c.note("%s: the cancel of the delayed effect failed: %v", sp.id[:8], err)
	case n == 1:
		sp.cancelled.Store(1)
		c.stats.reached("delayed cancelled")
	default:
		sp.cancelled.Store(0)
		c.stats.reached("delayed too late to cancel")
	}
	c.note("%s: cancel of the delayed effect on instance %d: %d cancelled (%v)", sp.id[:8], sp.cancelProc, n, err)
}

// wantEffects are the (topic, payload) of the effects a processed message committed.
func (c *run) wantEffects(sp *spec) []wireKey {
	out := []wireKey{{c.topics[0], sp.id + "/0"}, {c.topics[1], sp.id + "/1"}, {c.topics[0], sp.id + "/2"}, {c.topics[1], sp.id + "/3"}}
	if sp.shared {
		out = append(out, wireKey{c.topics[0], sp.id + "/shared"}, wireKey{c.topics[1], sp.id + "/shared"})
	}
	if sp.big {
		for i := range bigEffects {
			out = append(out, wireKey{c.topics[0], fmt.Sprintf("%s/big%d", sp.id, i)})
		}
	}
	if sp.delay >= 0 && sp.cancelled.Load() != 1 {
		out = append(out, wireKey{c.topics[1], sp.id + "/delayed"})
	}
	return out
}

// afterCommit runs in the failpoint after a commit, before the dispatch: it ages the claim past the
// sweep's look-back (as a commit that became visible that long after its timestamp would be),
// stamps it ahead while the database clock is ahead, and sends the plan's copy after the commit.
func (c *run) afterCommit(_ context.Context, pl *plan) {
	claim := ` WHERE consumer = $1 AND message_id = $2`
	if pl.held {
		if c.exec(pl.msg.tenant, `UPDATE `+c.prefix+`processed SET processed_at = processed_at - `+lookBack+`, dispatched_at = dispatched_at - `+lookBack+claim, consumer, pl.msg.id) > 0 {
			c.stats.reached("held-claim")
			c.note("%s: claim aged by %s after its commit", pl.msg.id[:8], lookBack)
		}
	}
	if c.clockAhead.Load() {
		c.exec(pl.msg.tenant, `UPDATE `+c.prefix+`processed SET processed_at = processed_at + `+clockStep+`, dispatched_at = dispatched_at + `+clockStep+claim, consumer, pl.msg.id)
		c.stats.reached("clock-step")
		if pl.crashAt == outbox.FailpointAfterCommit {
			c.stats.reached("clock-step crash")
		}
		c.note("%s: committed by instance %d while the clock was ahead (plan %v)", pl.msg.id[:8], pl.proc, pl)
	}
	if pl.copyAfter > 0 && pl.startCopy != nil {
		pl.copyOnce.Do(func() {
			c.stats.reached("copy-after")
			wait := pl.startCopy()
			if pl.copyAfter == 1 {
				wait()
			}
		})
	}
}

// stepClock simulates a database clock that runs clockStep ahead for d from at on and then steps
// back: the claims committed meanwhile are stamped ahead, and so is the sweep's watermark.
func (c *run) stepClock(at, d, grace time.Duration) {
	time.Sleep(at)
	c.clockAhead.Store(true)
	c.note("the database clock runs %s ahead for %s", clockStep, d)
	time.Sleep(d)
	c.clockAhead.Store(false)
	for k := range c.dbs {
		c.exec(k, `UPDATE `+c.prefix+`stats SET swept_to = greatest(coalesce(swept_to, '-infinity'), now() + `+clockStep+` - $1 * interval '1 millisecond') WHERE id = 1`,
			grace.Milliseconds())
	}
	c.note("the database clock stepped back")
}
