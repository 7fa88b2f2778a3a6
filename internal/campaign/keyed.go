package campaign

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"math/rand/v2"
	"strings"
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
	id      string // the request's business row and payloads
	caller  string // who sends it: keys are scoped per caller (outbox.CallerScope)
	key     string // its idempotency key, which another caller's request also sends
	plans   []*plan
	procs   []int
	waits   []bool // the attempt waits for one in flight (WaitInFlight)
	pairAt  int    // the attempt that runs with a second one at once; -1: none
	late    int    // retries after one returned
	effects int    // effects each run records
	// expire: after its late retries the key expires, and a retry takes it over while a cleanup
	// runs on another instance; the request is then run a second time (gen 1), and a retry after
	// that must replay the second run's response, not run a third time.
	expire bool
	// lost: the first attempt of the retry after the key expired commits and then fails (a crash
	// after COMMIT, as when HandlerTimeout ends while COMMIT is on the wire), so that the client
	// does not know it ran: its next attempt replays the second run's response.
	lost     bool
	mu       sync.Mutex
	gen      int // the run of the request that attempts now belong to
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
		rq.expire = r.IntN(3) == 0
		out = append(out, rq)
	}
	// Drawn after the rest, so that the schedules of seeds drawn before it stay as they were.
	for _, rq := range out {
		rq.lost = r.IntN(2) == 0
	}
	if !c.on["keyed"] {
		return nil
	}
	for _, rq := range out {
		c.note("request %s (%s, key %s): %d effects, attempt pair at %d, %d late, expires %v (retry's commit lost %v); instances %v; plans %v",
			rq.id[:10], rq.caller, rq.key[:10], rq.effects, rq.pairAt, rq.late, rq.expire, rq.lost, rq.procs[:4], rq.plans[:4])
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
		c.retry(rq, rq.procs[d], "late retry", nil)
	}
	if rq.expire && c.database.ExpireKey != "" {
		c.expire(rq)
	}
}

// retry sends rq again on instance proc until an attempt returns nil, the first attempt with the
// faults of first (nil: none). It returns how many attempts failed before: one of them may have
// committed (its commit's outcome lost to a timeout or a crash), and the next then replays.
func (c *run) retry(rq *request, proc int, what string, first *plan) (failed int) {
	began := time.Now()
	for try := 0; ; try++ {
		pl := &plan{}
		if try == 0 && first != nil {
			pl = first
		}
		err := c.attempt(rq, proc, pl, true)
		if err == nil {
			return try
		}
		c.note("%s of request %s: attempt %d on instance %d: %v", what, rq.id[:10], try, proc, err)
		if givesUp(try, began) {
			c.fail("%s of request %s: %v", what, rq.id, err)
			return try + 1
		}
		redeliveryPause(try)
	}
}

// cleanupDuring runs a cleanup on instance proc while rq's retry takes its expired key over.
// A cleanup that did not end in 10 s (a loaded machine's database has left every BEGIN
// unanswered for seconds: CI saw both cleanups of one run end so) deleted nothing it must not
// have, and is run again, as a scheduled cleanup is, until it ends or givesUp; any other error
// is a failure.
func (c *run) cleanupDuring(rq *request, proc int) {
	began := time.Now()
	for try := 0; ; try++ {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		_, err := c.procs[proc].Cleanup(ctx)
		ended := ctx.Err() != nil
		cancel()
		if err == nil {
			return
		}
		if (!ended && !errors.Is(err, outbox.ErrDatabaseUnreachable)) || givesUp(try, began) {
			c.fail("cleanup while request %s's key expired: %v", rq.id, err)
			return
		}
		c.note("cleanup while request %s's key expired: attempt %d on instance %d: %v", rq.id[:10], try, proc, err)
		redeliveryPause(try)
	}
}

// redeliveryPause waits before the next of the tries of a delivery or a request that failed, as a
// broker's redelivery or a client's retry does: growing, up to 3 s apart. Without it a loaded
// machine whose database gate took a slow BEGIN for an outage (and answers "unreachable" until its
// probe gets through, by design) failed all nine tries within the same second.
func redeliveryPause(try int) {
	time.Sleep(min(50*time.Millisecond<<try, 3*time.Second))
}

// redeliverFor is how long a broker (or a client) goes on redelivering a message (or retrying a
// request) that keeps failing, at least 8 tries. A broker redelivers for as long as the message
// is not acked; the campaign gives up after this long and reports it never acked. A machine
// running the race detector beside other test binaries (CI's) has had every BEGIN take longer
// than the campaign's HandlerTimeout of 300 ms for several seconds in a row, so that 8 tries over
// 9 s all timed out: nothing is lost or doubled then, but a message is not acked yet.
const redeliverFor = time.Minute

// givesUp tells whether the tries of something that failed, the first of them at began, stop
// after try (counted from 0): after 8 tries and redeliverFor.
func givesUp(try int, began time.Time) bool {
	return try >= 8 && time.Since(began) > redeliverFor
}

// expire lets the key of rq expire, then sends rq again while another instance runs a cleanup:
// the retry takes the key over and runs the request a second time, and the cleanup, which may
// have found the key expired before the retry took it, must not delete what the retry committed.
// A retry after that replays the second run.
func (c *run) expire(rq *request) {
	scope := outbox.CallerScope(rq.caller, "campaign")
	var res sql.Result
	var err error
	for try := 0; try < 5; try++ {
		// The test's own statement: InnoDB may pick it as a deadlock's victim (a claim of the
		// key or a cleanup at the same moment); it runs again.
		if res, err = c.db.Exec(c.database.Bind(fmt.Sprintf(c.database.ExpireKey, c.prefix)), scope, rq.key); err == nil {
			break
		}
		time.Sleep(10 * time.Millisecond)
	}
	if err != nil {
		c.fail("expire the key of request %s: %v", rq.id, err)
		return
	}
	if n, _ := res.RowsAffected(); n != 1 {
		c.fail("request %s: its key was not there to expire", rq.id)
		return
	}
	rq.mu.Lock()
	rq.gen, rq.done = 1, false
	replayed := rq.replayed
	rq.mu.Unlock()
	proc := rq.procs[0]
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		c.cleanupDuring(rq, (proc+1)%instances)
	}()
	var first *plan
	if rq.lost {
		first = &plan{crashAt: outbox.FailpointAfterCommit}
	}
	failed := c.retry(rq, proc, "retry after the key expired", first)
	wg.Wait()
	c.stats.reached("keyed expired and retaken")
	rq.mu.Lock()
	retaken := rq.replayed
	rq.mu.Unlock()
	// That it ran the request again, rather than replaying the first run, is checked on the
	// business table (checkRequests). An attempt after a failed one replays when the failed one
	// committed: a crash after COMMIT, or a HandlerTimeout that ended during COMMIT.
	if failed > 0 && retaken-replayed == 1 {
		c.stats.reached("keyed expired, retaken, commit outcome lost")
		c.note("request %s: the retry after its key expired replayed after %d failed attempts: one of them committed", rq.id[:10], failed)
	}
	if retaken-replayed > min(failed, 1) {
		c.fail("request %s: the retry after its key expired replayed %d times after %d failed attempts", rq.id, retaken-replayed, failed)
	}
	c.retry(rq, (proc+2)%instances, "retry after the key was retaken", nil)
	rq.mu.Lock()
	defer rq.mu.Unlock()
	if rq.replayed != retaken+1 {
		c.fail("request %s: the retry after its expired key was retaken ran again (%d replays before, %d after)", rq.id, retaken, rq.replayed)
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
	rq.mu.Lock()
	gen := rq.gen
	rq.mu.Unlock()
	return c.inUnit(ctx, proc, 0, func(ctx context.Context) error {
		if err := f.Exec(ctx, c.database.Bind(`INSERT INTO `+c.applied+` (message_id) VALUES ($1)`), rq.id); err != nil {
			return err
		}
		for i := range rq.effects {
			m := outbox.NewMessage(ctx, []byte(fmt.Sprintf("%s/g%d/k%d", rq.id, gen, i)))
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
	owner := map[string]string{} // run of a request ("r-.../g0") -> the source of its committed effects
	for src, effects := range bySource {
		for _, e := range effects {
			for _, rq := range rqs {
				for gen := range rq.gen + 1 {
					run := fmt.Sprintf("%s/g%d", rq.id, gen)
					if !strings.HasPrefix(e.payload, run+"/") {
						continue
					}
					if prev, ok := owner[run]; ok && prev != src {
						c.fail("run %s of request %s committed effects in two units of work (%s and %s)", run, rq.id, prev, src)
					}
					owner[run] = src
				}
			}
		}
	}
	for _, rq := range rqs {
		var n int
		if err := c.db.QueryRow(c.database.Bind(`SELECT count(*) FROM `+c.applied+` WHERE message_id = $1`), rq.id).Scan(&n); err != nil {
			c.t.Fatal(err)
		}
		if n != rq.gen+1 {
			c.fail("request %s applied %d times, want %d (its key expired %d times)", rq.id, n, rq.gen+1, rq.gen)
		}
		for gen := range rq.gen + 1 {
			if got := len(bySource[owner[fmt.Sprintf("%s/g%d", rq.id, gen)]]); got != rq.effects {
				c.fail("run %d of request %s committed %d effects, want %d", gen, rq.id, got, rq.effects)
			}
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
