package campaign

import (
	"context"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"time"

	"github.com/watermill-outbox/outbox"
)

// downPoints are the failpoints of the down member at which an outage "in flight" begins: inside a
// unit of work's transaction (after its claim, after its handler), between its commit and its
// dispatch, and between a relay round's lease and its publishes.
var downPoints = []string{outbox.FailpointAfterClaim, outbox.FailpointAfterHandler, outbox.FailpointAfterCommit, outbox.FailpointAfterRelayClaim}

// downMember is the tenant whose database goes down in the member-down scenario: the second.
const downMember = 1

// outage is the member-down scenario of one run: the database of tenant downMember, which every
// instance's member of it reaches through the campaign's proxy, goes down for a while.
type outage struct {
	at    time.Duration // after the deliveries began
	d     time.Duration // how long it is down
	hang  bool          // it accepts connections and answers nothing (else it refuses them: 57P03)
	point string        // "": at; else at the first of these failpoints of the member reached from at on

	armed  atomic.Bool
	once   sync.Once
	began  chan struct{}
	before int64 // the proxy's count of connection attempts while down, before this outage
}

// drawOutage draws the member-down scenario of a run (every value drawn, whether or not it runs,
// so that a seed's schedule is the same with the scenario off, less the outage).
func (c *run) drawOutage(r *rand.Rand) *outage {
	o := &outage{began: make(chan struct{})}
	down, at, d, hang, inFlight, point := r.IntN(2) == 0, r.IntN(1000), 300+r.IntN(1700), r.IntN(3) == 0, r.IntN(2) == 0, downPoints[r.IntN(len(downPoints))]
	if !down || !c.on["member-down"] || c.proxy == nil {
		return nil
	}
	o.at, o.d, o.hang = time.Duration(at)*time.Millisecond, time.Duration(d)*time.Millisecond, hang
	if inFlight {
		o.point = point
	}
	how := "refusing connections"
	if hang {
		how = "answering no connection"
	}
	when := "then"
	if o.point != "" {
		when = "at the first " + o.point + " of its members from then on"
	}
	c.note("tenant %s's database goes down for %s, %s, %s after the deliveries began, %s", tenantName(downMember), o.d, how, o.at, when)
	return o
}

// memberFailpoint is Config.Failpoint of the down member's Outboxes: an outage in flight begins
// inside the step, before the unit or round goes on.
func (c *run) memberFailpoint(ctx context.Context, point string) error {
	if o := c.outage; o != nil && o.armed.Load() && point == o.point {
		o.armed.Store(false)
		c.goDown("in flight, at "+point, true)
	}
	return c.failpoint(ctx, point)
}

// goDown begins the outage, once; how says when, for the log.
func (c *run) goDown(how string, inFlight bool) {
	o := c.outage
	o.once.Do(func() {
		o.before = c.proxy.Attempts()
		c.proxy.SetHang(o.hang)
		c.proxy.SetDown(true)
		close(o.began)
		c.stats.reached("member-down")
		if o.hang {
			c.stats.reached("member-down hanging")
		}
		if inFlight {
			c.stats.reached("member-down in flight")
		}
		c.note("tenant %s's database is down (%s)", tenantName(downMember), how)
	})
}

// takeDown runs the outage of the run: down at its moment (or step), up after its time.
func (c *run) takeDown() {
	o := c.outage
	time.Sleep(o.at)
	if o.point != "" {
		o.armed.Store(true)
		// A step that is not reached soon (no relay round, say) does not hold the outage back
		// past the deliveries.
		t := time.NewTimer(time.Second)
		select {
		case <-o.began:
		case <-t.C:
		}
		t.Stop()
		o.armed.Store(false)
	}
	how := "at its moment"
	if o.point != "" {
		how = "no " + o.point + " of its members within 1 s"
	}
	c.goDown(how, false)
	time.Sleep(o.d)
	c.proxy.SetDown(false)
	c.proxy.SetHang(false)
	c.note("tenant %s's database is back (%d connection attempts met the outage)", tenantName(downMember), c.proxy.Attempts()-o.before)
}
