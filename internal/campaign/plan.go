package campaign

import (
	"context"
	"errors"
	"math/rand/v2"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/watermill-outbox/outbox"
)

// spec is what the handler of one message does on every delivery.
type spec struct {
	id     string
	shared bool // publishes one message (one UUID) to both topics
	big    bool // records bigEffects effects more
	// bigCalls: the big effects are recorded in one Publish call, or in several (each one
	// statement on database/sql)
	bigCalls int
	// delay, when not negative, is the delay of one more effect, recorded last.
	delay time.Duration
	// cancel: after the message is acked, a unit of work on instance cancelProc cancels the
	// delayed effect cancelAt after it was recorded (its delay, from 300 ms before to 150 ms
	// after: around its due time); cancelled is what it
	// reported: 1 cancelled, 0 too late, -1 unknown (it failed).
	cancel     bool
	cancelProc int
	cancelAt   time.Duration
	cancelled  atomic.Int32
	// poison: the handler fails with a permanent error while broken, so the message is
	// dead-lettered; retry: it is then fixed and retried from the dead letters.
	poison, retry bool
	broken        atomic.Bool
	// follow: the delayed effect has an ordering key of its own, and once it is due (followAt
	// after it was recorded, the delay plus up to 10 ms: mostly before a relay moved it) a unit
	// of work on instance followProc records an effect with that key, which must reach the
	// broker after it; followed is that unit's outcome: 1 committed, -1 unknown (it failed).
	follow     bool
	followProc int
	followAt   time.Duration
	followed   atomic.Int32
	recordedAt atomic.Int64 // when the delayed effect was last recorded (UnixNano)
}

// bigEffects is more effects than one INSERT can carry: 7 bind parameters per effect, at most
// 65,535 in one statement (9,362 effects).
const bigEffects = 9400

// plan is what one delivery of one message does wrong; the failpoint, the publisher and the
// handler find it in the message's context.
type plan struct {
	msg            *spec
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
	copyDuring     bool // a copy goes to another instance while the handler runs
	copyAfter      int  // after commit, a copy goes to another instance: 1 waited for, 2 not
	held           bool // the claim is aged past the sweep's look-back, then the unit crashes
	endsTx         bool // the handler sends ROLLBACK as SQL through the unit's transaction, then publishes

	proc      int           // the instance it is delivered to
	copyTo    int           // the instance of the copy
	startCopy func() func() // starts the copy of copyDuring and copyAfter; the func it returns waits for it
	copyOnce  sync.Once     // one copy, even when the unit of work runs again within the delivery

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

func randomPlan(r *rand.Rand, msg *spec, on map[string]bool) *plan {
	p := &plan{
		msg:            msg,
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
	// Every value is drawn whichever scenarios are on, so that a seed gives the same schedule
	// with a scenario switched off, less that scenario.
	crash, point := r.IntN(4) == 0, failpoints[r.IntN(len(failpoints))]
	if crash && on["crash"] {
		p.crashAt = point
	}
	p.copyDuring = r.IntN(8) == 0 && on["copy-during"]
	copyAfter, how := r.IntN(8) == 0, 1+r.IntN(2)
	if copyAfter && on["copy-after"] {
		p.copyAfter = how
	}
	p.held = r.IntN(10) == 0 && on["held-claim"]
	p.endsTx = r.IntN(25) == 0 && on["tx-by-sql"]
	return p
}

func (p *plan) String() string {
	var parts []string
	for _, f := range []struct {
		name string
		on   bool
	}{{"publish-fails", p.publishFails}, {"publish-loses", p.publishLoses}, {"publish-panics", p.publishPanics},
		{"publish-hangs", p.publishHangs}, {"handler-fails", p.handlerFails}, {"handler-panics", p.handlerPanics},
		{"handler-slow", p.handlerSlow}, {"cancel", p.cancel}, {"kill-connection", p.killConnection},
		{"savepoint", p.savepoint}, {"concurrent", p.concurrent}, {"copy-during", p.copyDuring},
		{"copy-after-waited", p.copyAfter == 1}, {"copy-after", p.copyAfter == 2}, {"held-claim", p.held},
		{"tx-by-sql", p.endsTx}} {
		if f.on {
			parts = append(parts, f.name)
		}
	}
	if p.crashAt != "" {
		parts = append(parts, "crash@"+p.crashAt)
	}
	return "{" + strings.Join(parts, ",") + "}"
}

// publisher applies the plan of the message it is given, fails the first calls for one topic
// whatever the plan, and records the order in which the broker took each (topic, UUID) first.
type publisher struct {
	next  message.Publisher
	stuck chan struct{} // hung calls return when the run ends

	failTopic string       // "": none
	failCalls atomic.Int32 // calls for failTopic still to refuse

	slowTopic string        // "": none
	slowBy    time.Duration // how long every call for slowTopic takes
	hungTopic string        // "": none
	hungUntil time.Time     // until then every call for hungTopic hangs until its context ends
	hungCalls atomic.Int32

	mu    sync.Mutex
	clock int
	first map[wireKey]int // (topic, UUID) -> the clock when the broker first took it
}

type wireKey struct{ topic, uuid string }

func (p *publisher) Publish(topic string, msgs ...*message.Message) error {
	pl := planOf(msgs[0].Context())
	pl.mu.Lock()
	pl.published++
	first := pl.published == 1
	pl.mu.Unlock()
	if topic == p.hungTopic && time.Now().Before(p.hungUntil) {
		// A broker that hangs takes nothing; the call returns when the framework gives up on it
		// (every call's context carries PublishTimeout), or when the run ends.
		p.hungCalls.Add(1)
		select {
		case <-msgs[0].Context().Done():
		case <-p.stuck:
		}
		return errors.New("broker hung on the topic")
	}
	if topic == p.slowTopic {
		time.Sleep(p.slowBy)
	}
	if topic == p.failTopic && p.failCalls.Add(-1) >= 0 {
		return errors.New("broker refused the topic")
	}
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
			if err := p.took(topic, msgs); err != nil {
				return err
			}
			return errors.New("connection reset after the broker took the message")
		}
	}
	return p.took(topic, msgs)
}

// took publishes msgs to the broker and records when it took them.
func (p *publisher) took(topic string, msgs []*message.Message) error {
	if err := p.next.Publish(topic, msgs...); err != nil {
		return err
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, m := range msgs {
		k := wireKey{topic, m.UUID}
		if _, ok := p.first[k]; !ok {
			p.clock++
			p.first[k] = p.clock
		}
	}
	return nil
}

func (p *publisher) Close() error { return nil }

var _ message.Publisher = (*publisher)(nil)

// failpoint is Config.Failpoint of a run: it crashes where the plan says, and after commit it
// runs the plan's copy, ages its claim and shifts it in time as the run's clock says.
func (c *run) failpoint(ctx context.Context, point string) error {
	pl := planOf(ctx)
	if point == outbox.FailpointAfterCommit && pl.msg != nil {
		c.afterCommit(ctx, pl)
	}
	if pl.crashAt == point || (pl.held && point == outbox.FailpointAfterCommit) {
		return errors.New("crash")
	}
	return nil
}
