package tenant_test

import (
	"context"
	"database/sql"
	"database/sql/driver"
	"errors"
	"fmt"
	"os"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/lib/pq"

	"github.com/watermill-outbox/outbox"
	"github.com/watermill-outbox/outbox/drivers/postgres"
	"github.com/watermill-outbox/outbox/internal/pgproxy"
	"github.com/watermill-outbox/outbox/internal/pgtest"
	"github.com/watermill-outbox/outbox/internal/routertest"
	"github.com/watermill-outbox/outbox/middleware"
	"github.com/watermill-outbox/outbox/tenant"
)

// dialCounter is a driver.Connector that counts, while armed, the connections opened through it
// by the frame that asked for them: where the attempts that meet an outage come from.
type dialCounter struct {
	driver.Connector
	armed atomic.Bool
	mu    sync.Mutex
	by    map[string]int
}

func (c *dialCounter) Connect(ctx context.Context) (driver.Conn, error) {
	if c.armed.Load() {
		c.mu.Lock()
		c.by[dialCaller()]++
		c.mu.Unlock()
	}
	return c.Connector.Connect(ctx)
}

// dialCaller names the first frame of the framework (or of the test) above database/sql.
func dialCaller() string {
	pcs := make([]uintptr, 64)
	frames := runtime.CallersFrames(pcs[:runtime.Callers(3, pcs)])
	var first string
	for {
		f, more := frames.Next()
		fn := f.Function
		if first == "" && !strings.HasPrefix(fn, "database/sql") && !strings.HasPrefix(fn, "runtime") {
			first = fn
		}
		if strings.Contains(fn, "watermill-outbox/outbox") && !strings.Contains(fn, "drivers/postgres") {
			return strings.TrimPrefix(fn, "github.com/watermill-outbox/outbox")
		}
		if !more {
			return first
		}
	}
}

func (c *dialCounter) breakdown() string {
	c.mu.Lock()
	defer c.mu.Unlock()
	keys := make([]string, 0, len(c.by))
	for k := range c.by {
		keys = append(keys, k)
	}
	slices.SortFunc(keys, func(a, b string) int { return c.by[b] - c.by[a] })
	var sb strings.Builder
	for _, k := range keys {
		fmt.Fprintf(&sb, "\n\t%4d %s", c.by[k], k)
	}
	return sb.String()
}

// memberDownOutage is how long the database is down in TestMemberDownConnectionAttempts:
// OUTBOX_OUTAGE_SECONDS, 4 s by default (docs/scaling.md has a run of 15 s).
func memberDownOutage() time.Duration {
	if s, _ := strconv.Atoi(os.Getenv("OUTBOX_OUTAGE_SECONDS")); s > 0 {
		return time.Duration(s) * time.Second
	}
	return 4 * time.Second
}

// TestMemberDownConnectionAttempts takes the database of one member of two away (through
// pgproxy) while eight consumers work on the messages of both, interleaved, redelivering a
// nacked message after the others queued (as a broker does), and a REST endpoint calls InTx on
// the down member every 100 ms; likewise for a single Outbox. While down, the only connections
// the database meets are the gate's probes after the first burst of what was in flight: at most
// one a second, nothing of the down member acked, the other member's messages processed; after
// it every message is processed once.
func TestMemberDownConnectionAttempts(t *testing.T) {
	for _, set := range []bool{true, false} {
		for _, hang := range []bool{false, true} {
			name := map[bool]string{true: "Set", false: "Outbox"}[set] + map[bool]string{false: "/refused", true: "/hanging"}[hang]
			t.Run(name, func(t *testing.T) { memberDown(t, set, hang) })
		}
	}
}

func memberDown(t *testing.T, useSet, hang bool) {
	outage := memberDownOutage()
	dbA := pgtest.DB(t)
	proxy, dsnB, err := pgproxy.StartFor(pgtest.DSN(t))
	if err != nil {
		t.Skipf("no proxy: %v", err)
	}
	t.Cleanup(func() { _ = proxy.Close() })
	conn, err := pq.NewConnector(dsnB)
	if err != nil {
		t.Fatal(err)
	}
	dials := &dialCounter{Connector: conn, by: map[string]int{}}
	dbB := sql.OpenDB(dials)
	t.Cleanup(func() { _ = dbB.Close() })

	w := newWire()
	// A HandlerTimeout of 1 s: a message of the down member waits that long for its database,
	// then is nacked and goes back to the queue, behind the other member's. The member that
	// stays up has 10 s: its handler must run once per message, and a unit that runs its handler
	// and times out before COMMIT rightly runs it again on redelivery. CI's loaded machine (the
	// race detector, other packages' tests beside it) saw one of its handlers run twice, the
	// nack's cause not printed (the up member's nacks are now, when a check fails).
	member := func(db *sql.DB, pfx string, timeout time.Duration) *outbox.Outbox {
		ob, err := outbox.New(outbox.Config{DB: db, Driver: postgres.Driver{}, Publisher: w, TablePrefix: pfx,
			RelayInterval: 50 * time.Millisecond, HandlerTimeout: timeout})
		if err != nil {
			t.Fatal(err)
		}
		if err := ob.Migrate(context.Background()); err != nil {
			t.Fatal(err)
		}
		if _, err := db.Exec(`CREATE TABLE ` + pfx + `orders (id text, tenant text)`); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = ob.Close() })
		return ob
	}
	obB := member(dbB, "", time.Second)
	sh := newShop(func(string) string { return "orders" })
	var handler func(*message.Message) error
	var inTx func(ctx context.Context, fn func(context.Context, *sql.Tx) error) error
	ctx, cancel := context.WithCancel(context.Background())
	var bg sync.WaitGroup
	defer func() { cancel(); bg.Wait() }()
	tenants := []string{"b"}
	if useSet {
		tenants = []string{"a", "b"}
		set := newSet(t, tenant.Config{}, map[string]*outbox.Outbox{"a": member(dbA, "", 10*time.Second), "b": obB})
		handler = set.WrapConsumer(sh.handle, middleware.WithConsumer("shop"))
		inTx = func(ctx context.Context, fn func(context.Context, *sql.Tx) error) error {
			return set.InTx(ctx, "b", fn)
		}
		bg.Add(1)
		go func() { defer bg.Done(); _ = set.Run(ctx) }()
	} else {
		handler = func(msg *message.Message) error {
			return obB.Handle(msg, outbox.HandleParams{Consumer: "shop", MessageID: msg.UUID}, func(msg *message.Message) ([]*message.Message, error) {
				return nil, sh.handle(msg)
			})
		}
		inTx = obB.InTx
		bg.Add(1)
		go func() { defer bg.Done(); _ = obB.Run(ctx) }()
	}

	// The consumers: eight handlers on one queue; a nacked message goes back at its end.
	var down atomic.Bool
	var ackedDownInOutage, ackedAInOutage, nacks atomic.Int64
	var lastNack atomic.Value
	// The nacks of the member that stays up (with a Set): none expected; said when a check fails.
	var upNacksMu sync.Mutex
	var upNacks []string
	var outageAt atomic.Int64 // UnixNano when the outage began; 0 before
	queue := make(chan *message.Message, 10000)
	var sent []string
	var pending sync.WaitGroup
	for range 8 {
		bg.Add(1)
		go func() {
			defer bg.Done()
			for {
				var msg *message.Message
				select {
				case <-ctx.Done():
					return
				case msg = <-queue:
				}
				c := msg.Copy()
				c.SetContext(ctx)
				// A unit begun before the outage may have committed before it and return after
				// it began: only one begun during it cannot have reached the database.
				begunDown := down.Load()
				err := handler(c)
				tn := msg.Metadata.Get("tenant")
				switch {
				case err == nil && begunDown && down.Load() && tn == "b":
					ackedDownInOutage.Add(1)
				case err == nil && down.Load():
					ackedAInOutage.Add(1)
				}
				if err != nil {
					nacks.Add(1)
					lastNack.Store(err.Error())
					if tn != "b" {
						upNacksMu.Lock()
						upNacks = append(upNacks, fmt.Sprintf("%s (%s after the outage began): %v", msg.UUID,
							time.Duration(time.Now().UnixNano()-outageAt.Load()).Round(time.Millisecond), err))
						upNacksMu.Unlock()
					}
					queue <- msg
					continue
				}
				pending.Done()
			}
		}()
	}
	produce := func(n int) {
		for range n {
			for _, tn := range tenants {
				id := fmt.Sprintf("%s-%d", tn, len(sent))
				sent = append(sent, id)
				pending.Add(1)
				queue <- tenantMsg(id, tn)
			}
			time.Sleep(20 * time.Millisecond)
		}
	}
	produce(10)
	for deadline := time.Now().Add(30 * time.Second); len(rows(t, dbB, "orders")) == 0; time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("no message processed in 30 s; last nack: %v", lastNack.Load())
		}
	}

	// The REST endpoint: a call every 100 ms, each on a request context of 2 s.
	var restOK, restUnreachable, restStalled, restInFlight, restOther atomic.Int64
	var restOtherErr atomic.Value
	var outageEnd atomic.Int64 // UnixNano when it ended; 0 before
	var restAtEnd atomic.Int64
	var restAtEndErr atomic.Value
	var restAfterEnd atomic.Int64
	var restAfterEndErr atomic.Value
	var restAfterEndLatest atomic.Int64 // how long after the end the latest of them began (ns)
	rest := func() {
		start := time.Now().UnixNano()
		rctx, rcancel := context.WithTimeout(ctx, 2*time.Second)
		defer rcancel()
		err := inTx(rctx, func(ctx context.Context, tx *sql.Tx) error {
			_, err := tx.ExecContext(ctx, `SELECT 1`)
			return err
		})
		switch {
		case err == nil:
			restOK.Add(1)
		case errors.Is(err, outbox.ErrDatabaseUnreachable):
			restUnreachable.Add(1)
		case errors.Is(err, context.DeadlineExceeded):
			if at := outageAt.Load(); at != 0 && start < at {
				// In flight as the server began to hang: its statement waits out the unit's
				// HandlerTimeout, which no one can tell from a slow answer.
				restInFlight.Add(1)
				break
			}
			if end := outageEnd.Load(); end != 0 && start > end {
				// Begun after the outage ended, while the gate had not yet seen the database
				// back (its probe): held, then out of its 1 s on a loaded machine (a run under
				// three CPU burners and -race had one 0.4 s after the end). Not unaware of the
				// outage either; said below.
				restAfterEnd.Add(1)
				restAfterEndErr.Store(fmt.Sprintf("%v (began %s after the outage ended)", err, time.Duration(start-end).Round(time.Millisecond)))
				if after := start - end; after > restAfterEndLatest.Load() {
					restAfterEndLatest.Store(after)
				}
				break
			}
			if end := outageEnd.Load(); end != 0 && time.Now().UnixNano() > end {
				// It waited past the outage's end: held back by the gate until the database
				// answered again, its BEGIN or statement then took the rest of its
				// HandlerTimeout, in the hang mode only (one a run at most so far). Such a call
				// began 3.1-3.5 s into the 4 s hang with a 1 s HandlerTimeout: 0.1-0.5 s left
				// when the gate woke every waiter at once and the proxy carried on every
				// connection it had held. Not unaware of the outage.
				restAtEnd.Add(1)
				restAtEndErr.Store(fmt.Sprintf("%v (began %s after the outage began, ended %s after it ended)", err,
					time.Duration(start-outageAt.Load()).Round(time.Millisecond), time.Duration(time.Now().UnixNano()-end).Round(time.Millisecond)))
				break
			}
			restStalled.Add(1)
			restOtherErr.Store(fmt.Sprintf("%v (began %s after the outage began, ended %s after)", err,
				time.Duration(start-outageAt.Load()).Round(time.Millisecond), time.Duration(time.Now().UnixNano()-outageAt.Load()).Round(time.Millisecond)))
		default:
			restOther.Add(1)
			restOtherErr.Store(err.Error())
		}
	}
	restStop := make(chan struct{})
	var restWG sync.WaitGroup
	restWG.Add(1)
	go func() {
		defer restWG.Done()
		tick := time.NewTicker(100 * time.Millisecond)
		defer tick.Stop()
		for {
			select {
			case <-restStop:
				return
			case <-tick.C:
				restWG.Add(1)
				go func() { defer restWG.Done(); rest() }()
			}
		}
	}()

	time.Sleep(300 * time.Millisecond)
	proxy.SetHang(hang)
	dials.armed.Store(true)
	proxy.SetDown(true)
	// Only now is the database away: a call or a unit begun just before (its BEGIN answered)
	// may still meet the outage in its statements, and is counted as in flight when it began.
	outageAt.Store(time.Now().UnixNano())
	down.Store(true)
	began := time.Now()
	produce(int(outage / (20 * time.Millisecond) / 2))
	time.Sleep(time.Until(began.Add(outage / 2)))
	mid := proxy.Attempts()
	time.Sleep(time.Until(began.Add(outage)))
	attempts := proxy.Attempts()
	dials.armed.Store(false)
	down.Store(false)
	outageEnd.Store(time.Now().UnixNano())
	proxy.SetDown(false)
	proxy.SetHang(false)
	t.Logf("%s outage: %d connection attempts (%d in its first half), %.1f a second; opened by:%s",
		outage, attempts, mid, float64(attempts)/outage.Seconds(), dials.breakdown())
	t.Logf("during it: %d nacks (last: %v), %d messages of the other member acked; InTx calls (from before it to after it): %d ok, %d unreachable, %d ended by their deadline, %d other (%v)",
		nacks.Load(), lastNack.Load(), ackedAInOutage.Load(), restOK.Load(), restUnreachable.Load(), restStalled.Load(), restOther.Load(), restOtherErr.Load())

	produce(10)
	close(restStop)
	restWG.Wait()
	done := make(chan struct{})
	go func() { pending.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(60 * time.Second):
		t.Fatalf("messages not all processed 60 s after the outage; last nack: %v", lastNack.Load())
	}

	// A first burst of what was in flight when it began (eight units, the InTx calls of the
	// first beginStall, the relay), then the probes: at most one a second.
	if attempts > 20 {
		t.Errorf("%d connection attempts met the %s outage, want at most 20", attempts, outage)
	}
	if late, limit := attempts-mid, int64(1+outage/time.Second/2); late > limit {
		t.Errorf("%d connection attempts in the second half of the outage, want at most %d", late, limit)
	}
	mustZero(t, "messages of the down member handled and acked within the outage", ackedDownInOutage.Load())
	// Its messages share the consumers with the down member's, each of which holds one for up
	// to HandlerTimeout (1 s): an eighth of those sent meanwhile at least, not only the handful
	// in flight when the outage began (8, when a BEGIN that hangs held its consumer throughout).
	if sentA := int64(outage / (40 * time.Millisecond)); useSet && ackedAInOutage.Load() < sentA/8 {
		t.Errorf("%d messages of the other member processed during the outage, of %d sent; want at least %d", ackedAInOutage.Load(), sentA, sentA/8)
	}
	// A call whose connection the outage cut fails with it ("the next connection tells"); no
	// call begun after the outage began waits out its context unaware of it. One begun before,
	// whose statement the hang caught, waits for its HandlerTimeout (a call every 100 ms: one
	// or two at most, more likely on a loaded machine, where a call takes longer).
	if n := restInFlight.Load(); n > 2 {
		t.Errorf("%d InTx calls in flight as the outage began ended by their deadline, want at most 2", n)
	}
	if n := restAtEnd.Load(); n > 2 {
		t.Errorf("%d InTx calls held back during the outage ended by their deadline after it, want at most 2: %v", n, restAtEndErr.Load())
	} else if n > 0 {
		t.Logf("%d InTx calls held back during the outage ended by their deadline after it: %v", n, restAtEndErr.Load())
	}
	// Only while the gate has not yet seen the database back: its probe comes at most a second
	// after the end, and a call begun later than that and held ran into a gate that stayed shut.
	if n := restAfterEnd.Load(); n > 0 {
		if latest := time.Duration(restAfterEndLatest.Load()); latest > time.Second {
			t.Errorf("an InTx call begun %v after the outage ended ended by its deadline (%d such calls), want none begun later than the gate's next probe (1 s): %v",
				latest.Round(time.Millisecond), n, restAfterEndErr.Load())
		} else {
			t.Logf("%d InTx calls begun within %v after the outage ended ended by their deadline: %v", n, latest.Round(time.Millisecond), restAfterEndErr.Load())
		}
	}
	if n := restStalled.Load(); n > 0 {
		t.Errorf("%d InTx calls ended by their deadline without ErrDatabaseUnreachable: %v", n, restOtherErr.Load())
	}
	if n := restOther.Load(); n > 3 {
		t.Errorf("%d InTx calls failed otherwise than ErrDatabaseUnreachable, want at most the 3 whose connections were cut: %v", n, restOtherErr.Load())
	}
	for _, tn := range tenants {
		var ids []string
		for _, id := range sent {
			if strings.HasPrefix(id, tn+"-") {
				ids = append(ids, id)
			}
		}
		db := map[string]*sql.DB{"a": dbA, "b": dbB}[tn]
		if tn == "b" {
			// A unit of the down member in flight as the outage began may have run its handler
			// and lost its connection before COMMIT: rolled back, and run again once back.
			checkTenantRows(t, db, "orders", tn, ids, w)
			continue
		}
		checkTenant(t, db, "orders", tn, ids, sh, w)
	}
	if t.Failed() {
		upNacksMu.Lock()
		t.Logf("the up member's nacks: %d%s", len(upNacks), "\n\t"+strings.Join(upNacks, "\n\t"))
		upNacksMu.Unlock()
	}
}

func mustZero(t *testing.T, what string, n int64) {
	t.Helper()
	if n != 0 {
		t.Errorf("%s: %d, want 0", what, n)
	}
}

// TestMembersOfOnePoolProbeOnce: twenty members, a table prefix each on one pool, all in use when
// their database goes away (each fails a unit on it). The database meets one probe at each
// backoff step, not one per member: with a gate each, twenty members probed twenty times a step,
// and came back together. When it is back, every member works again.
func TestMembersOfOnePoolProbeOnce(t *testing.T) {
	const members = 20
	proxy, dsn, err := pgproxy.StartFor(pgtest.DSN(t))
	if err != nil {
		t.Fatalf("no proxy: %v", err)
	}
	t.Cleanup(func() { _ = proxy.Close() })
	conn, err := pq.NewConnector(dsn)
	if err != nil {
		t.Fatal(err)
	}
	dials := &dialCounter{Connector: conn, by: map[string]int{}}
	db := sql.OpenDB(dials)
	t.Cleanup(func() { _ = db.Close() })
	obs := map[string]*outbox.Outbox{}
	for i := range members {
		ob, err := outbox.New(outbox.Config{DB: db, Driver: postgres.Driver{}, Publisher: newWire(),
			TablePrefix: fmt.Sprintf("m%02d_", i), RelayInterval: 50 * time.Millisecond})
		if err != nil {
			t.Fatal(err)
		}
		if err := ob.Migrate(context.Background()); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = ob.Close() })
		obs[fmt.Sprintf("m%02d", i)] = ob
	}
	set := newSet(t, tenant.Config{}, obs)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); _ = set.Run(ctx) }()
	defer func() { cancel(); <-done }()
	each := func(timeout time.Duration) (ok, unreachable int, other []error) {
		var mu sync.Mutex
		var wg sync.WaitGroup
		for name := range obs {
			wg.Go(func() {
				cctx, ccancel := context.WithTimeout(ctx, timeout)
				defer ccancel()
				err := set.InTx(cctx, name, func(ctx context.Context, tx *sql.Tx) error {
					_, err := tx.ExecContext(ctx, `SELECT 1`)
					return err
				})
				mu.Lock()
				defer mu.Unlock()
				switch {
				case err == nil:
					ok++
				case errors.Is(err, outbox.ErrDatabaseUnreachable):
					unreachable++
				default:
					other = append(other, err)
				}
			})
		}
		wg.Wait()
		return
	}
	if ok, _, other := each(10 * time.Second); ok != members {
		t.Fatalf("before the outage: %d of %d members' units committed: %v", ok, members, other)
	}

	proxy.SetDown(true)
	// Every member meets it: a unit each, on connections the outage broke or new ones refused.
	_, unreachable, other := each(time.Second)
	began, atBegin := time.Now(), proxy.Attempts()
	dials.armed.Store(true)
	time.Sleep(4 * time.Second)
	probes := proxy.Attempts() - atBegin
	dials.armed.Store(false)
	proxy.SetDown(false)
	t.Logf("units met the outage: %d unreachable, %d other (%v); then %d connection attempts in %s, opened by:%s",
		unreachable, len(other), other, probes, time.Since(began).Round(time.Millisecond), dials.breakdown())
	// One gate, ReconnectDelay 100 ms doubling, each spread over its upper half: at most six
	// probes in 4 s (at 0.05, 0.15, 0.35, 0.75, 1.55, 3.15 s at the earliest), and a few of what
	// was under way (a relay round, a listener reconnecting). With a gate per member: a hundred.
	if probes > 12 {
		t.Errorf("%d connection attempts in the 4 s after %d members on one pool met an outage, want at most 12 (one probe a backoff step)", probes, members)
	}
	routertest.WaitUntil(t, "every member's unit to commit once the database is back", func() (bool, string) {
		ok, unreachable, other := each(5 * time.Second)
		return ok == members, fmt.Sprintf("%d committed, %d unreachable, other: %v", ok, unreachable, other)
	})
}
