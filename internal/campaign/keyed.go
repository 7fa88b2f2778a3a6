package campaign

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"sync"
	"time"

	"github.com/google/uuid"

	"github.com/watermill-outbox/outbox"
)

// requests is how many client requests with an idempotency key a run sends, each retried until
// one attempt returns.
const requests = 4

// request is one client request with an idempotency key: its attempts (each a keyed boundary
// unit of work on an instance, with the faults of a plan), some of them two at once.
type request struct {
	id       string // the request's business row and payloads
	caller   string // who sends it: keys are scoped per caller (outbox.CallerScope)
	key      string // its idempotency key, which another caller's request also sends
	plans    []*plan
	procs    []int
	waits    []bool // the attempt waits for one in flight (WaitInFlight)
	pairAt   int    // the attempt that runs with a second one at once; -1: none
	late     int    // retries after one returned
	effects  int    // effects each run records
	mu       sync.Mutex
	done     bool
	results  []string // what each returned attempt got
	replayed int
}

// drawRequests draws the requests of a run; every value is drawn whether the scenario is on or
// not, after the rest of the schedule, so that a seed gives the same schedule either way.
func (c *run) drawRequests(r *rand.Rand) []*request {
	var out []*request
	var key string
	for i := range requests {
		// Two callers pick each key (a counter, a timestamp): each must get a run and a response
		// of its own, never the other's.
		if i%2 == 0 {
			key = "k-" + uuid.NewString()
		}
		rq := &request{id: "r-" + uuid.NewString(), caller: fmt.Sprintf("caller-%d", i%2), key: key,
			pairAt: -1, late: 1 + r.IntN(3), effects: 1 + r.IntN(3)}
		for range 16 {
			pl := randomPlan(r, nil, c.on)
			pl.cancel, pl.copyDuring, pl.copyAfter, pl.held = false, false, 0, false // of messages only
			rq.plans = append(rq.plans, pl)
			rq.procs = append(rq.procs, r.IntN(instances))
			rq.waits = append(rq.waits, r.IntN(2) == 0)
		}
		if pair, at := r.IntN(2) == 0, r.IntN(4); pair {
			rq.pairAt = at
		}
		out = append(out, rq)
	}
	if !c.on["keyed"] {
		return nil
	}
	for _, rq := range out {
		c.note("request %s (%s, key %s): %d effects, attempt pair at %d, %d late; instances %v; plans %v", rq.id[:10], rq.caller, rq.key[:10], rq.effects, rq.pairAt, rq.late, rq.procs[:4], rq.plans[:4])
	}
	return out
}

// send retries rq until an attempt returns nil, then sends its late retries.
func (c *run) send(rq *request) {
	attempt := func(d int) error {
		return c.attempt(rq, rq.procs[d], rq.plans[d], rq.waits[d])
	}
	for d := 0; d < len(rq.plans) && !rq.finished(); d++ {
		if d == rq.pairAt {
			var wg sync.WaitGroup
			wg.Add(1)
			go func() { defer wg.Done(); _ = c.attempt(rq, (rq.procs[d]+1)%instances, &plan{}, rq.waits[d]) }()
			_ = attempt(d)
			wg.Wait()
			continue
		}
		_ = attempt(d)
	}
	for try := 0; try < 40 && !rq.finished(); try++ { // the client keeps retrying
		if err := c.attempt(rq, rq.procs[try%len(rq.procs)], &plan{}, true); errors.Is(err, outbox.ErrIdempotencyInFlight) {
			time.Sleep(20 * time.Millisecond)
		}
	}
	if !rq.finished() {
		c.fail("request %s never returned", rq.id)
		return
	}
	for d := 0; d < rq.late; d++ {
		for try := 0; ; try++ {
			err := c.attempt(rq, rq.procs[d], &plan{}, true)
			if err == nil {
				break
			}
			if try == 8 {
				c.fail("late retry of request %s: %v", rq.id, err)
				break
			}
		}
	}
}

func (rq *request) finished() bool {
	rq.mu.Lock()
	defer rq.mu.Unlock()
	return rq.done
}

// attempt runs one attempt of rq on instance proc with the faults of pl: a keyed unit of work
// that writes the business row, records rq.effects effects with derived UUIDs and sets the
// response.
func (c *run) attempt(rq *request, proc int, pl *plan, wait bool) (err error) {
	f := c.forms[proc]
	var opts []outbox.KeyOption
	if wait {
		opts = append(opts, outbox.WaitInFlight())
	}
	ctx := outbox.WithIdempotencyKey(context.WithValue(context.Background(), planKey{}, pl), outbox.CallerScope(rq.caller, "campaign"), rq.key, opts...)
	defer func() {
		if r := recover(); r != nil {
			err = fmt.Errorf("%w: %v", outbox.ErrHandlerPanicked, r)
		}
		c.stats.add(err)
		switch {
		case errors.Is(err, outbox.ErrIdempotencyInFlight):
			c.stats.reached("keyed in flight")
		case err != nil:
		default:
			res, replayed := outbox.IdempotencyResult(ctx)
			rq.mu.Lock()
			rq.done = true
			rq.results = append(rq.results, string(res))
			if replayed {
				rq.replayed++
				c.stats.reached("keyed replayed")
			}
			rq.mu.Unlock()
		}
	}()
	return c.procs[proc].InUnit(ctx, func(ctx context.Context) error {
		if err := f.Exec(ctx, c.database.Bind(`INSERT INTO `+c.applied+` (message_id) VALUES ($1)`), rq.id); err != nil {
			return err
		}
		for i := range rq.effects {
			m := outbox.NewMessage(ctx, []byte(fmt.Sprintf("%s/k%d", rq.id, i)))
			if err := outbox.Publish(ctx, c.topics[i%2], m); err != nil {
				return err
			}
		}
		switch {
		case pl.killConnection:
			err := f.Exec(ctx, c.database.KillConnection)
			return fmt.Errorf("connection killed: %w", err)
		case pl.handlerPanics:
			panic("handler bug")
		case pl.handlerFails:
			return errors.New("handler failed")
		case pl.handlerSlow:
			return f.Exec(ctx, c.database.Bind(c.database.Sleep), (c.timeout + 200*time.Millisecond).Seconds())
		}
		return outbox.SetResult(ctx, []byte(rq.id+"/result"))
	})
}

// checkRequests checks the requests: each business change applied once, each returned attempt
// given the first run's response, the effects of one run only committed (whatever the attempts
// that crashed or rolled back), and none of it sent under two UUIDs (checked with the messages'
// effects in check).
func (c *run) checkRequests(rqs []*request, bySource map[string][]effect) {
	owner := map[string]string{} // request -> the source of its committed effects
	for src, effects := range bySource {
		for _, e := range effects {
			for _, rq := range rqs {
				if len(e.payload) > len(rq.id) && e.payload[:len(rq.id)+1] == rq.id+"/" {
					if prev, ok := owner[rq.id]; ok && prev != src {
						c.fail("request %s committed effects in two units of work (%s and %s)", rq.id, prev, src)
					}
					owner[rq.id] = src
				}
			}
		}
	}
	for _, rq := range rqs {
		var n int
		if err := c.db.QueryRow(c.database.Bind(`SELECT count(*) FROM `+c.applied+` WHERE message_id = $1`), rq.id).Scan(&n); err != nil {
			c.t.Fatal(err)
		}
		if n != 1 {
			c.fail("request %s applied %d times, want once", rq.id, n)
		}
		if got := len(bySource[owner[rq.id]]); got != rq.effects {
			c.fail("request %s committed %d effects, want %d", rq.id, got, rq.effects)
		}
		for _, res := range rq.results {
			if res != rq.id+"/result" {
				c.fail("an attempt of request %s got the response %q", rq.id, res)
			}
		}
		if rq.replayed < rq.late {
			c.fail("request %s: %d replays, but %d late retries came after it returned", rq.id, rq.replayed, rq.late)
		}
	}
}
