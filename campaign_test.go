package outbox_test

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"math/rand/v2"
	"os"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wsql "github.com/ThreeDotsLabs/watermill-sql/v3/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"

	"github.com/watermill-outbox/outbox"
	"github.com/watermill-outbox/outbox/drivers/postgres"
)

// The fault campaign: many short runs, each a random schedule of deliveries of a few messages to
// several processes, with faults injected everywhere, checked against the guarantee at the end.
//
//	go test -run TestFaultCampaign .                                  # the budget of make test
//	go test -run TestFaultCampaign . -args -campaign.runs=500         # longer (or OUTBOX_CAMPAIGN_RUNS)
//	go test -run TestFaultCampaign . -args -campaign.seed=1234        # replay one run
var (
	campaignRuns = flag.Int("campaign.runs", 0, "fault campaign: number of runs (default $OUTBOX_CAMPAIGN_RUNS, else 24)")
	campaignSeed = flag.Uint64("campaign.seed", 0, "fault campaign: run only this seed")
)

const defaultCampaignRuns = 24

func TestFaultCampaign(t *testing.T) {
	runs := *campaignRuns
	if runs == 0 {
		runs = defaultCampaignRuns
		if v := os.Getenv("OUTBOX_CAMPAIGN_RUNS"); v != "" {
			n, err := strconv.Atoi(v)
			if err != nil || n <= 0 {
				t.Fatalf("OUTBOX_CAMPAIGN_RUNS=%q: want a positive number", v)
			}
			runs = n
		}
	}
	seeds := make([]uint64, runs)
	base := uint64(time.Now().UnixNano())
	for i := range seeds {
		seeds[i] = base + uint64(i)
	}
	if *campaignSeed != 0 {
		seeds = []uint64{*campaignSeed}
	}
	e := newEnv(t) // one database; each run has its own tables (a prefix of its own) and topic
	st := &campaignStats{outcomes: map[string]int{}}
	for i, seed := range seeds {
		if !runCampaign(t, e, i, seed, st) {
			t.Fatalf("fault campaign run %d failed; replay it with: go test -race -run TestFaultCampaign . -args -campaign.seed=%d", i, seed)
		}
	}
	t.Logf("%d runs passed: %d deliveries; outcomes %v", len(seeds), st.deliveries, st.outcomes)
	// The campaign must have reached the paths it is for.
	for _, want := range []string{"acked", "dispatch failed", "crash", "handler panicked", "handler failed", "timed out"} {
		if st.outcomes[want] == 0 && len(seeds) >= defaultCampaignRuns {
			t.Errorf("no delivery ended %q in %d runs: the campaign does not exercise that path", want, len(seeds))
		}
	}
}

// campaignStats counts how the deliveries of a campaign ended.
type campaignStats struct {
	mu         sync.Mutex
	deliveries int
	outcomes   map[string]int
}

func (s *campaignStats) add(err error) {
	kind := "other error"
	switch {
	case err == nil:
		kind = "acked"
	case errors.Is(err, outbox.ErrFailpoint):
		kind = "crash"
	case errors.Is(err, outbox.ErrDispatchFailed):
		kind = "dispatch failed"
	case errors.Is(err, outbox.ErrHandlerPanicked):
		kind = "handler panicked"
	case errors.Is(err, context.DeadlineExceeded):
		kind = "timed out"
	case strings.Contains(err.Error(), "cancelled"):
		kind = "cancelled"
	case strings.Contains(err.Error(), "handler failed"):
		kind = "handler failed"
	case strings.Contains(err.Error(), "connection killed"):
		kind = "connection killed"
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	s.deliveries++
	s.outcomes[kind]++
}

// plan is what one delivery of one message does wrong; the failpoint, the publisher and the
// handler find it in the message's context.
type plan struct {
	crashAt        string // a failpoint name, or ""
	publishFails   bool   // the broker refuses the first call
	publishLoses   bool   // the broker takes the first call, then the connection breaks
	publishPanics  bool
	publishHangs   bool // longer than PublishTimeout
	handlerFails   bool
	handlerPanics  bool
	handlerSlow    bool // longer than HandlerTimeout
	cancel         bool // the message context is cancelled (Router shutdown)
	killConnection bool
	savepoint      bool // one effect is recorded in a savepoint that is rolled back
	concurrent     bool // the effects are recorded from several goroutines

	mu        sync.Mutex
	published int
}

type planKey struct{}

func planOf(ctx context.Context) *plan {
	p, _ := ctx.Value(planKey{}).(*plan)
	if p == nil {
		return &plan{}
	}
	return p
}

func randomPlan(r *rand.Rand) *plan {
	p := &plan{
		publishFails:   r.IntN(10) == 0,
		publishLoses:   r.IntN(10) == 0,
		publishPanics:  r.IntN(40) == 0,
		publishHangs:   r.IntN(40) == 0,
		handlerFails:   r.IntN(12) == 0,
		handlerPanics:  r.IntN(30) == 0,
		handlerSlow:    r.IntN(30) == 0,
		cancel:         r.IntN(30) == 0,
		killConnection: r.IntN(30) == 0,
		savepoint:      r.IntN(4) == 0,
		concurrent:     r.IntN(4) == 0,
	}
	if r.IntN(5) == 0 {
		points := []string{outbox.FailpointAfterClaim, outbox.FailpointAfterHandler, outbox.FailpointAfterCommit,
			outbox.FailpointAfterPublish, outbox.FailpointAfterMark}
		p.crashAt = points[r.IntN(len(points))]
	}
	return p
}

func (p *plan) String() string {
	var parts []string
	for name, on := range map[string]bool{"publish-fails": p.publishFails, "publish-loses": p.publishLoses,
		"publish-panics": p.publishPanics, "publish-hangs": p.publishHangs, "handler-fails": p.handlerFails,
		"handler-panics": p.handlerPanics, "handler-slow": p.handlerSlow, "cancel": p.cancel,
		"kill-connection": p.killConnection, "savepoint": p.savepoint, "concurrent": p.concurrent} {
		if on {
			parts = append(parts, name)
		}
	}
	if p.crashAt != "" {
		parts = append(parts, "crash@"+p.crashAt)
	}
	return strings.Join(parts, ",")
}

// campaignPublisher applies the plan of the message it is given.
type campaignPublisher struct {
	next  message.Publisher
	stuck chan struct{} // hung calls return when the run ends
}

func (p *campaignPublisher) Publish(topic string, msgs ...*message.Message) error {
	pl := planOf(msgs[0].Context())
	pl.mu.Lock()
	pl.published++
	first := pl.published == 1
	pl.mu.Unlock()
	if first {
		switch {
		case pl.publishPanics:
			panic("broker client bug")
		case pl.publishHangs:
			<-p.stuck
			return errors.New("hung call released")
		case pl.publishFails:
			return errors.New("broker refused the connection")
		case pl.publishLoses:
			if err := p.next.Publish(topic, msgs...); err != nil {
				return err
			}
			return errors.New("connection reset after the broker took the message")
		}
	}
	return p.next.Publish(topic, msgs...)
}

func (p *campaignPublisher) Close() error { return nil }

// runCampaign runs one random schedule and checks the invariants; it reports failures on t and
// returns false when any was found.
func runCampaign(t *testing.T, e *env, run int, seed uint64, stats *campaignStats) (ok bool) {
	t.Helper()
	r := rand.New(rand.NewPCG(seed, seed^0x9e3779b97f4a7c15))
	prefix := fmt.Sprintf("c%d_", run)
	topic := fmt.Sprintf("campaign_%d", run)
	applied := prefix + "applied"
	ctx := context.Background()
	failed := false
	fail := func(format string, args ...any) {
		failed = true
		t.Errorf("run %d (seed %d): %s", run, seed, fmt.Sprintf(format, args...))
	}
	mustExec(t, e, `CREATE TABLE `+applied+` (message_id text NOT NULL)`)
	e.initTopics(topic)
	broker, err := wsql.NewPublisher(e.db, wsql.PublisherConfig{SchemaAdapter: brokerSchema()}, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	pub := &campaignPublisher{next: broker, stuck: make(chan struct{})}
	defer close(pub.stuck)

	cfg := func(c *outbox.Config) {
		c.TablePrefix = prefix
		c.Publisher = pub
		c.Driver = postgres.Driver{}
		c.EffectRetention = time.Hour // keep dispatched effects: the check compares them with the wire
		c.MaxAttempts = 1000
		c.RelayMaxAttempts = 1000
		c.HandlerTimeout = 300 * time.Millisecond
		c.PublishTimeout = 200 * time.Millisecond
		c.DuplicateWait = 100 * time.Millisecond
		c.RelayGrace = 200 * time.Millisecond
		c.RelayInterval = 50 * time.Millisecond
		c.Failpoint = func(ctx context.Context, point string) error {
			if planOf(ctx).crashAt == point {
				return errors.New("crash")
			}
			return nil
		}
	}
	procs := []*outbox.Outbox{e.newOutbox(cfg), e.newOutbox(cfg), e.newOutbox(cfg)}
	if err := procs[0].Migrate(ctx); err != nil {
		t.Fatal(err)
	}

	// effect labels are "<message>/<n>"; "undone" ones are recorded in a rolled-back savepoint.
	handler := func(m *message.Message) ([]*message.Message, error) {
		ctx := m.Context()
		pl := planOf(ctx)
		tx := outbox.Tx(ctx)
		if _, err := tx.ExecContext(ctx, `INSERT INTO `+applied+` (message_id) VALUES ($1)`, m.UUID); err != nil {
			return nil, err
		}
		publish := func(label string) error {
			return outbox.Publish(ctx, topic, message.NewMessage(uuid.NewString(), []byte(m.UUID+"/"+label)))
		}
		if pl.concurrent {
			var wg sync.WaitGroup
			errs := make([]error, 3)
			for i := range errs {
				wg.Add(1)
				go func() { defer wg.Done(); errs[i] = publish(fmt.Sprint(i)) }()
			}
			wg.Wait()
			if err := errors.Join(errs...); err != nil {
				return nil, err
			}
		} else {
			for i := 0; i < 3; i++ {
				if err := publish(fmt.Sprint(i)); err != nil {
					return nil, err
				}
			}
		}
		if pl.savepoint {
			if _, err := tx.ExecContext(ctx, `SAVEPOINT s`); err != nil {
				return nil, err
			}
			if err := publish("undone"); err != nil {
				return nil, err
			}
			if _, err := tx.ExecContext(ctx, `ROLLBACK TO SAVEPOINT s`); err != nil {
				return nil, err
			}
		}
		switch {
		case pl.killConnection:
			_, err := tx.ExecContext(ctx, `SELECT pg_terminate_backend(pg_backend_pid())`)
			return nil, fmt.Errorf("connection killed: %w", err)
		case pl.handlerPanics:
			panic("handler bug")
		case pl.handlerFails:
			return nil, errors.New("handler failed")
		case pl.handlerSlow:
			_, err := tx.ExecContext(ctx, `SELECT pg_sleep(1)`)
			return nil, err
		}
		return nil, publish("3")
	}

	// Deliver each message until one delivery is acked, sometimes two copies at once to two
	// processes, then a few late copies.
	const messages = 12
	ids := make([]string, messages)
	for i := range ids {
		ids[i] = uuid.NewString()
	}
	var log strings.Builder
	deliver := func(proc int, id string, pl *plan) error {
		msgCtx, cancel := context.WithCancel(context.WithValue(context.Background(), planKey{}, pl))
		defer cancel()
		m := message.NewMessage(id, nil)
		m.SetContext(msgCtx)
		h := handler
		if pl.cancel {
			h = func(m *message.Message) ([]*message.Message, error) {
				cancel()
				return handler(m)
			}
		}
		err := procs[proc].Handle(m, outbox.HandleParams{Consumer: "c", MessageID: id}, h)
		stats.add(err)
		return err
	}
	var wg sync.WaitGroup
	for _, id := range ids {
		wg.Add(1)
		plans := make([]*plan, 0, 16)
		for i := 0; i < 16; i++ {
			plans = append(plans, randomPlan(r))
		}
		concurrentAt := r.IntN(4)
		late := r.IntN(3)
		go func() {
			defer wg.Done()
			acked := false
			for d := 0; d < len(plans) && !acked; d++ {
				if d == concurrentAt {
					var copyErr error
					var cw sync.WaitGroup
					cw.Add(1)
					go func() { defer cw.Done(); copyErr = deliver(2, id, &plan{}) }()
					acked = deliver(d%2, id, plans[d]) == nil
					cw.Wait()
					acked = acked || copyErr == nil
					continue
				}
				acked = deliver(d%2, id, plans[d]) == nil
			}
			for d := 0; d < 8 && !acked; d++ { // the broker keeps redelivering
				acked = deliver(d%3, id, &plan{}) == nil
			}
			if !acked {
				fail("message %s was never acked", id)
			}
			for d := 0; d < late; d++ {
				if err := deliver(d%3, id, &plan{}); err != nil {
					fail("late copy of %s: %v", id, err)
				}
			}
		}()
		fmt.Fprintf(&log, "%s: concurrent copy at delivery %d, %d late; plans %v\n", id[:8], concurrentAt, late, plans[:4])
	}
	wg.Wait()

	// The relays send whatever is left.
	runCtx, stop := context.WithCancel(ctx)
	var rw sync.WaitGroup
	for _, ob := range procs {
		rw.Add(1)
		go func() { defer rw.Done(); _ = ob.Run(runCtx) }()
	}
	pendingLeft := func() int {
		for _, ob := range procs {
			ob.FlushMarks()
		}
		var n int
		if err := e.db.QueryRow(`SELECT count(*) FROM ` + prefix + `effects WHERE dispatched_at IS NULL`).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}
	deadline := time.Now().Add(30 * time.Second)
	for pendingLeft() > 0 && time.Now().Before(deadline) {
		time.Sleep(50 * time.Millisecond)
	}
	stop()
	rw.Wait()
	if n := pendingLeft(); n > 0 {
		fail("%d effects still pending after the relays ran for 30 s", n)
	}

	// Each business change once.
	for _, id := range ids {
		var n int
		if err := e.db.QueryRow(`SELECT count(*) FROM `+applied+` WHERE message_id = $1`, id).Scan(&n); err != nil {
			t.Fatal(err)
		}
		if n != 1 {
			fail("message %s applied %d times", id, n)
		}
	}
	// Every committed effect on the wire, each with one stable UUID, nothing that did not
	// commit, and the effects of each message in the order they were recorded.
	committed := map[string]string{} // label -> UUID
	// Committed effects: pending ones, and the dispatched ones kept for EffectRetention.
	all := `(SELECT source_id, seq, uuid, payload FROM ` + prefix + `effects UNION ALL SELECT source_id, seq, uuid, payload FROM ` + prefix + `dispatched) e`
	rows, err := e.db.Query(`SELECT uuid, convert_from(payload, 'UTF8') FROM ` + all)
	if err != nil {
		t.Fatal(err)
	}
	for rows.Next() {
		var id, label string
		if err := rows.Scan(&id, &label); err != nil {
			t.Fatal(err)
		}
		if prev, ok := committed[label]; ok {
			fail("effect %s committed twice (%s and %s)", label, prev, id)
		}
		committed[label] = id
	}
	rows.Close()
	for _, id := range ids {
		for i := 0; i < 4; i++ {
			if _, ok := committed[fmt.Sprintf("%s/%d", id, i)]; !ok {
				fail("effect %s/%d never committed", id, i)
			}
		}
	}
	wireUUIDs := map[string]map[string]bool{} // label -> UUIDs seen
	firstOffset := map[string]int64{}         // label -> offset of its first copy
	wire := e.wireInOrder(topic)
	for _, c := range wire {
		if strings.HasSuffix(c.payload, "/undone") {
			fail("%s (recorded in a rolled-back savepoint) reached the wire", c.payload)
		}
		if committed[c.payload] != c.uuid {
			fail("%s reached the wire with UUID %s, committed with %q", c.payload, c.uuid, committed[c.payload])
		}
		if wireUUIDs[c.payload] == nil {
			wireUUIDs[c.payload] = map[string]bool{}
			firstOffset[c.payload] = c.offset
		}
		wireUUIDs[c.payload][c.uuid] = true
	}
	for label := range committed {
		if len(wireUUIDs[label]) != 1 {
			fail("effect %s: %d UUIDs on the wire, want 1", label, len(wireUUIDs[label]))
		}
	}
	rows, err = e.db.Query(`SELECT source_id, convert_from(payload, 'UTF8') FROM ` + all + ` ORDER BY source_id, seq`)
	if err != nil {
		t.Fatal(err)
	}
	prevSource, prevOffset := "", int64(-1)
	for rows.Next() {
		var source, label string
		if err := rows.Scan(&source, &label); err != nil {
			t.Fatal(err)
		}
		if source != prevSource {
			prevSource, prevOffset = source, -1
		}
		if off, ok := firstOffset[label]; ok {
			if off < prevOffset {
				fail("effect %s reached the wire (offset %d) before an effect recorded before it (offset %d)", label, off, prevOffset)
			}
			prevOffset = off
		}
	}
	rows.Close()
	if failed {
		t.Logf("run %d (seed %d) schedule:\n%s", run, seed, log.String())
	}
	return !failed
}
