package tenant_test

import (
	"context"
	"database/sql"
	"fmt"
	"os"
	"path/filepath"
	"runtime/pprof"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/watermill-outbox/outbox"
	"github.com/watermill-outbox/outbox/drivers/postgres"
	"github.com/watermill-outbox/outbox/internal/pgproxy"
	"github.com/watermill-outbox/outbox/internal/pgtest"
	"github.com/watermill-outbox/outbox/internal/proccpu"
	"github.com/watermill-outbox/outbox/middleware"
	"github.com/watermill-outbox/outbox/tenant"
)

// latencySet is a Set of n tenants, a database and a pool each, each pool keeping idle idle
// connections, with an orders table.
type latencySet struct {
	set   *tenant.Set
	h     message.NoPublishHandlerFunc
	bare  message.NoPublishHandlerFunc // the same work without the outbox: the control
	names []string
	dbs   []string       // the tenants' databases, for their counters in pg_stat_database
	proxy *pgproxy.Proxy // in front of the last tenant's database, when asked for
}

func newLatencySet(t *testing.T, admin *sql.DB, base string, n, idle int, proxied bool) *latencySet {
	t.Helper()
	w := newWire()
	set, err := tenant.New(tenant.Config{Resolver: tenant.FromMetadata("tenant"), NackUnresolved: true}) // every message names its member
	if err != nil {
		t.Fatal(err)
	}
	ls := &latencySet{set: set}
	pools := map[string]*sql.DB{}
	for i := range n {
		name := fmt.Sprintf("%s_t%d", base, i)
		if _, err := admin.Exec(`CREATE DATABASE ` + name); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _, _ = admin.Exec(`DROP DATABASE IF EXISTS ` + name + ` WITH (FORCE)`) })
		ls.dbs = append(ls.dbs, name)
		dsn, err := withDatabase(pgtest.AdminDSN(t), name)
		if err != nil {
			t.Fatal(err)
		}
		if proxied && i == n-1 {
			if ls.proxy, dsn, err = pgproxy.StartFor(dsn); err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { _ = ls.proxy.Close() })
		}
		db, err := sql.Open("postgres", dsn)
		if err != nil {
			t.Fatal(err)
		}
		db.SetMaxIdleConns(idle)
		db.SetConnMaxIdleTime(5 * time.Minute)
		t.Cleanup(func() { _ = db.Close() })
		cfg := outbox.Config{DB: db, Driver: postgres.Driver{}, Publisher: w, HandlerTimeout: 20 * time.Second}
		if s, err := strconv.Atoi(os.Getenv("OUTBOX_TENANT_STATS_INTERVAL")); err == nil {
			cfg.StatsInterval = time.Duration(s) * time.Second // negative: no sampling
		}
		ob, err := outbox.New(cfg)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = ob.Close() })
		if err := ob.Migrate(context.Background()); err != nil {
			t.Fatal(err)
		}
		if _, err := db.Exec(`CREATE TABLE orders (id text, tenant text)`); err != nil {
			t.Fatal(err)
		}
		member := fmt.Sprint("t", i)
		if err := set.Add(member, ob); err != nil {
			t.Fatal(err)
		}
		ls.names = append(ls.names, member)
		pools[member] = db
	}
	sh := newShop(func(string) string { return "orders" })
	ls.h = set.WrapConsumer(sh.handle, middleware.WithConsumer("shop"))
	// What a service without the outbox does with the message: the same INSERT in a transaction
	// of the tenant's pool, then the event published, at most once.
	ls.bare = func(msg *message.Message) error {
		tn := msg.Metadata.Get("tenant")
		ctx := context.Background()
		tx, err := pools[tn].BeginTx(ctx, nil)
		if err != nil {
			return err
		}
		if _, err := tx.ExecContext(ctx, `INSERT INTO orders VALUES ($1, $2)`, msg.UUID, tn); err != nil {
			_ = tx.Rollback()
			return err
		}
		if err := tx.Commit(); err != nil {
			return err
		}
		return w.Publish("events", message.NewMessage("event-"+msg.UUID, nil))
	}
	return ls
}

// offer runs rate messages a second for d, spread over the tenants names in turn (nil: all), each
// delivery in a goroutine of its own as a subscriber with enough handlers would, and
// returns the handle times of those that succeeded and the count of those that failed.
func (ls *latencySet) offer(rate int, d time.Duration, names []string, tag string) (times []time.Duration, failed int) {
	return ls.offerTo(ls.h, rate, d, names, tag)
}

// offerTo is offer with each message handed to h (the control: ls.bare).
func (ls *latencySet) offerTo(h message.NoPublishHandlerFunc, rate int, d time.Duration, names []string, tag string) (times []time.Duration, failed int) {
	if names == nil {
		names = ls.names
	}
	var mu sync.Mutex
	var wg sync.WaitGroup
	tick := time.NewTicker(time.Second / time.Duration(rate))
	defer tick.Stop()
	end := time.Now().Add(d)
	for i := 0; time.Now().Before(end); i++ {
		<-tick.C
		name := names[i%len(names)]
		msg := message.NewMessage(fmt.Sprintf("%s-%s-%d", tag, name, i), nil)
		msg.Metadata.Set("tenant", name)
		wg.Add(1)
		go func() {
			defer wg.Done()
			begin := time.Now()
			err := h(msg)
			took := time.Since(begin)
			mu.Lock()
			defer mu.Unlock()
			if err != nil {
				failed++
				return
			}
			times = append(times, took)
		}()
	}
	wg.Wait()
	return times, failed
}

// saturate runs inFlight senders, each handing the next message (to the tenants in turn) to h
// (nil: the Set's consumer) as soon as its last one returned, for d, and returns how many
// succeeded and failed.
func (ls *latencySet) saturate(h message.NoPublishHandlerFunc, inFlight int, d time.Duration, tag string) (done, failed int) {
	if h == nil {
		h = ls.h
	}
	var next, ok, bad atomic.Int64
	var wg sync.WaitGroup
	end := time.Now().Add(d)
	for range inFlight {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for time.Now().Before(end) {
				i := next.Add(1)
				name := ls.names[int(i)%len(ls.names)]
				msg := message.NewMessage(fmt.Sprintf("%s-%s-%d", tag, name, i), nil)
				msg.Metadata.Set("tenant", name)
				if err := h(msg); err != nil {
					bad.Add(1)
					continue
				}
				ok.Add(1)
			}
		}()
	}
	wg.Wait()
	return int(ok.Load()), int(bad.Load())
}

// cost is what a window cost: this process's CPU time; the server's, all of it and that of the
// measured Set's connections (-1: the server is not on this machine); and the measured Set's
// transactions and new connections.
type cost struct {
	wall, client, server, own time.Duration
	xacts, sessions           int64
	gone                      int // the Set's backends that exited during the window: their time is not in own
}

// costMeter reads the counters a cost is the difference of.
type costMeter struct {
	t          *testing.T
	admin      *sql.DB
	postmaster int // 0: the server is not on this machine
}

// counters reads the transactions and sessions of dbs (pg_stat_database).
func (cm *costMeter) counters(dbs []string) (xacts, sessions int64) {
	if err := cm.admin.QueryRow(`SELECT coalesce(sum(xact_commit + xact_rollback), 0), coalesce(sum(sessions), 0) FROM pg_stat_database WHERE datname = ANY ($1::text[])`,
		"{"+strings.Join(dbs, ",")+"}").Scan(&xacts, &sessions); err != nil {
		cm.t.Fatal(err)
	}
	return xacts, sessions
}

// backends returns the CPU time so far of each client backend of dbs: the server's work for the
// Set's connections, told apart from the other Set's and from the server's own (autovacuum
// visits every database, and with 201 of them that is no small part).
func (cm *costMeter) backends(dbs []string) map[int]time.Duration {
	if cm.postmaster <= 0 {
		return nil
	}
	rows, err := cm.admin.Query(`SELECT pid FROM pg_stat_activity WHERE datname = ANY ($1::text[]) AND backend_type = 'client backend'`,
		"{"+strings.Join(dbs, ",")+"}")
	if err != nil {
		cm.t.Fatal(err)
	}
	defer rows.Close()
	cpu := map[int]time.Duration{}
	for rows.Next() {
		var pid int
		if err := rows.Scan(&pid); err != nil {
			cm.t.Fatal(err)
		}
		if d, err := proccpu.Process(pid); err == nil {
			cpu[pid] = d
		}
	}
	if err := rows.Err(); err != nil {
		cm.t.Fatal(err)
	}
	return cpu
}

func (cm *costMeter) serverCPU() time.Duration {
	if cm.postmaster > 0 {
		if d, err := proccpu.Server(cm.postmaster); err == nil {
			return d
		}
	}
	return -1
}

// statsSettle is how long the round waits before it reads the transactions of its databases: a
// backend reports its counters to pg_stat_database at most once a second, once idle.
const statsSettle = 3 * time.Second

// measure runs load (which returns the messages that succeeded) against the Set whose databases
// are dbs and returns its cost: the CPU times over the load, the transactions and sessions until
// statsSettle after it.
func (cm *costMeter) measure(dbs []string, load func() int) (c cost, msgs int) {
	x0, s0 := cm.counters(dbs)
	b0 := cm.backends(dbs)
	start, cl0, sv0 := time.Now(), proccpu.Self(), cm.serverCPU()
	msgs = load()
	c.wall, c.client, c.server = time.Since(start), proccpu.Self()-cl0, cm.serverCPU()
	b1 := cm.backends(dbs)
	if c.server < 0 || sv0 < 0 {
		c.server, c.own = -1, -1
	} else {
		c.server -= sv0
		for pid, d := range b1 {
			c.own += d - b0[pid] // a backend new to the window counts from its start
		}
		for pid := range b0 {
			if _, ok := b1[pid]; !ok {
				c.gone++
			}
		}
	}
	time.Sleep(statsSettle)
	x1, s1 := cm.counters(dbs)
	c.xacts, c.sessions = x1-x0, s1-s0
	return c, msgs
}

// slope is what a message added from base's window to c's (as long, at a lower rate): the
// difference of their costs over more messages, in microseconds and transactions.
func (c cost) slope(base cost, more int) (client, server, own, xacts float64) {
	m := float64(max(more, 1))
	server, own = -1, -1
	if c.server >= 0 && base.server >= 0 {
		server, own = float64(c.server-base.server)/1e3/m, float64(c.own-base.own)/1e3/m
	}
	return float64(c.client-base.client) / 1e3 / m, server, own, float64(c.xacts-base.xacts) / m
}

// perMsg is c per message: client, server and own (the Set's connections') CPU in microseconds
// (-1: not measured), transactions and new connections.
func (c cost) perMsg(msgs int) (client, server, own, xacts, conns float64) {
	n := float64(max(msgs, 1))
	server, own = -1, -1
	if c.server >= 0 {
		server, own = float64(c.server)/1e3/n, float64(c.own)/1e3/n
	}
	return float64(c.client) / 1e3 / n, server, own, float64(c.xacts) / n, float64(c.sessions) / n
}

func median(v []float64) float64 {
	if len(v) == 0 {
		return 0
	}
	s := slices.Clone(v)
	slices.Sort(s)
	return s[len(s)/2]
}

func percentile(ts []time.Duration, p float64) time.Duration {
	if len(ts) == 0 {
		return 0
	}
	s := slices.Clone(ts)
	slices.Sort(s)
	return s[min(len(s)-1, int(p*float64(len(s))))]
}

// TestTenantLatency measures the latency of messages spread over many tenant databases against
// one tenant, and of the others while one tenant's database is down. Run it on its own:
//
//	OUTBOX_TENANT_LATENCY=200 go test -count=1 -run TestTenantLatency -v -timeout 30m ./tenant/
//
// It makes a Set of one tenant (its pool keeping 8 idle connections) and a Set of N tenants (a
// database and a pool each, one idle connection per pool), both running (set.Run), and offers 50 messages a second (each an INSERT
// and an event, through set.WrapConsumer) to one, then the other, in alternating rounds
// (OUTBOX_TENANT_ROUNDS, default 3, of OUTBOX_TENANT_WINDOW seconds, default 20), and prints the
// p50/p99 of each round and their ratio. It prints the cost per message of each round and its
// ratio too: this process's CPU (getrusage), the server's (every PostgreSQL process's, /proc, and
// that of the measured Set's own connections alone: the other Set's background and autovacuum
// run all along) and the transactions and new connections of the Set's databases
// (pg_stat_database), beside the same rounds of the control without the outbox (below) and the
// outbox's ratios over the control's. With
// OUTBOX_TENANT_SLOPE=R each round also offers R messages a second to each Set and prints what a
// message adds from the lower rate to R: the members' background, the same at either rate, taken
// out. With OUTBOX_TENANT_SATURATE=S it then offers each Set as much as OUTBOX_TENANT_INFLIGHT (default 8)
// messages in flight take, for S seconds in alternating rounds, and prints the throughputs' ratio,
// beside the same rounds of a control without the outbox (the INSERT in a transaction of the
// tenant's pool, then the event published): what 200 databases cost whatever runs on them, and
// the outbox's ratios over the control's, what the framework adds to that;
// with OUTBOX_TENANT_PROFILE=dir it writes a CPU profile of one more round of each Set there
// (one.pprof, many.pprof). OUTBOX_TENANT_STATS_INTERVAL sets every member's StatsInterval in
// seconds (-1: no statistics sampling). With OUTBOX_TENANT_DOWN=S it then takes the last of 10
// tenants down for S seconds (its database refusing connections, as a server starting up does,
// through a proxy that counts the connection attempts), the load going on for all ten, and
// compares the other nine tenants' p99 with a window of the same length without the outage.
func TestTenantLatency(t *testing.T) {
	n, _ := strconv.Atoi(os.Getenv("OUTBOX_TENANT_LATENCY"))
	if n <= 0 {
		t.Skip("set OUTBOX_TENANT_LATENCY to the number of tenants to measure")
	}
	window := 20 * time.Second
	if s, _ := strconv.Atoi(os.Getenv("OUTBOX_TENANT_WINDOW")); s > 0 {
		window = time.Duration(s) * time.Second
	}
	rounds := 3
	if s, _ := strconv.Atoi(os.Getenv("OUTBOX_TENANT_ROUNDS")); s > 0 {
		rounds = s
	}
	const rate = 50
	db := pgtest.DB(t)
	var dbname string
	if err := db.QueryRow(`SELECT current_database()`).Scan(&dbname); err != nil {
		t.Fatal(err)
	}
	admin, err := sql.Open("postgres", pgtest.AdminDSN(t))
	if err != nil {
		t.Fatal(err)
	}
	defer admin.Close()
	admin.SetMaxOpenConns(1)

	run := func(ls *latencySet) (stop func()) {
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan struct{})
		go func() { defer close(done); _ = ls.set.Run(ctx) }()
		return func() { cancel(); <-done }
	}
	// One tenant's pool keeps what its load needs (at 50 msg/s with one idle connection, every
	// message in flight beside another opened a connection of its own, and the one tenant's p99
	// was the connections' 250 ms); the many keep one each, as docs/scaling.md advises.
	one := newLatencySet(t, admin, dbname+"_one", 1, 8, false)
	many := newLatencySet(t, admin, dbname+"_many", n, 1, false)
	stopOne, stopMany := run(one), run(many)
	// Warm up: every member's pool connected, its statements prepared, its engine passes begun.
	one.offer(rate, 5*time.Second, nil, "warm")
	many.offer(rate, max(5*time.Second, time.Duration(n)*time.Second/rate*2), nil, "warm")
	// And settled: the first runs of every member's background tasks, all due at Run's start,
	// and the server's first autovacuum visits of the new databases, are no round's cost (in a
	// first run a window without load right after the warm-up cost 4-7 times the later ones).
	time.Sleep(30 * time.Second)
	cm := &costMeter{t: t, admin: admin}
	pctx, pcancel := context.WithTimeout(context.Background(), 10*time.Second)
	if pm, err := proccpu.Postmaster(pctx, admin); err == nil {
		cm.postmaster = pm
	} else {
		t.Logf("the server's CPU is not measured: %v", err)
	}
	pcancel()
	var ratios []float64
	var clientR, serverR, ownR, xactR []float64
	var slopeClientR, slopeOwnR, slopeXactR []float64
	var ctlClientR, ctlServerR, ctlOwnR, ctlXactR []float64 // the control's ratios, 200 / 1
	var netClientR, netServerR, netOwnR, netXactR []float64 // the outbox's ratios over the control's
	slopeRate, _ := strconv.Atoi(os.Getenv("OUTBOX_TENANT_SLOPE"))
	for r := range rounds {
		var a, b []time.Duration
		var fa, fb int
		ca, na := cm.measure(one.dbs, func() int { a, fa = one.offer(rate, window, nil, fmt.Sprint("r", r)); return len(a) })
		cb, nb := cm.measure(many.dbs, func() int { b, fb = many.offer(rate, window, nil, fmt.Sprint("r", r)); return len(b) })
		if slopeRate > rate {
			// The same windows at a second rate: what a message adds is the difference of the
			// costs over the difference of the messages, the background of the members (which
			// a per-message share carries, the more members the more) taken out.
			ca2, na2 := cm.measure(one.dbs, func() int { s, _ := one.offer(slopeRate, window, nil, fmt.Sprint("s", r)); return len(s) })
			cb2, nb2 := cm.measure(many.dbs, func() int { s, _ := many.offer(slopeRate, window, nil, fmt.Sprint("s", r)); return len(s) })
			acl, _, aown, ax := ca2.slope(ca, na2-na)
			bcl, _, bown, bx := cb2.slope(cb, nb2-nb)
			slopeClientR, slopeOwnR, slopeXactR = append(slopeClientR, bcl/acl), append(slopeOwnR, bown/aown), append(slopeXactR, bx/ax)
			t.Logf("round %d, what a message adds from %d to %d msg/s: 1 tenant client CPU %.0f us, its connections' server CPU %.0f us, %.2f transactions; "+
				"%d tenant databases %.0f us, %.0f us, %.2f transactions; ratios client %.2f, connections' %.2f, transactions %.2f",
				r, rate, slopeRate, acl, aown, ax, n, bcl, bown, bx, bcl/acl, bown/aown, bx/ax)
		}
		// The control at the same rate (the same work without the outbox, ls.bare): what a
		// message over 200 databases costs whatever runs on them, against which what the
		// outbox adds is flat or not.
		cca, cna := cm.measure(one.dbs, func() int { s, _ := one.offerTo(one.bare, rate, window, nil, fmt.Sprint("c", r)); return len(s) })
		ccb, cnb := cm.measure(many.dbs, func() int { s, _ := many.offerTo(many.bare, rate, window, nil, fmt.Sprint("c", r)); return len(s) })
		ratio := float64(percentile(b, 0.99)) / float64(percentile(a, 0.99))
		ratios = append(ratios, ratio)
		t.Logf("round %d, %d msg/s for %v: 1 tenant p50 %v p99 %v (%d failed); %d tenant databases p50 %v p99 %v (%d failed); p99 ratio %.2f",
			r, rate, window, percentile(a, 0.5), percentile(a, 0.99), fa, n, percentile(b, 0.5), percentile(b, 0.99), fb, ratio)
		acl, asv, aown, ax, acn := ca.perMsg(na)
		bcl, bsv, bown, bx, bcn := cb.perMsg(nb)
		clientR, serverR, ownR, xactR = append(clientR, bcl/acl), append(serverR, bsv/asv), append(ownR, bown/aown), append(xactR, bx/ax)
		t.Logf("round %d, per message: 1 tenant client CPU %.0f us, server CPU %.0f us (its connections' %.0f us, %d exited), %.2f transactions, %.3f new connections; "+
			"%d tenant databases client CPU %.0f us, server CPU %.0f us (their connections' %.0f us, %d exited), %.2f transactions, %.3f new connections; "+
			"ratios client %.2f, server %.2f (connections' %.2f), transactions %.2f",
			r, acl, asv, aown, ca.gone, ax, acn, n, bcl, bsv, bown, cb.gone, bx, bcn, bcl/acl, bsv/asv, bown/aown, bx/ax)
		kcl, ksv, kown, kx, _ := cca.perMsg(cna)
		lcl, lsv, lown, lx, _ := ccb.perMsg(cnb)
		cClient, cServer, cOwn, cXact := lcl/kcl, lsv/ksv, lown/kown, lx/kx
		ctlClientR, ctlServerR, ctlOwnR, ctlXactR = append(ctlClientR, cClient), append(ctlServerR, cServer), append(ctlOwnR, cOwn), append(ctlXactR, cXact)
		netClientR, netServerR, netOwnR, netXactR = append(netClientR, bcl/acl/cClient), append(netServerR, bsv/asv/cServer), append(netOwnR, bown/aown/cOwn), append(netXactR, bx/ax/cXact)
		t.Logf("round %d, control without the outbox, per message: 1 tenant client CPU %.0f us, server CPU %.0f us (its connections' %.0f us), %.2f transactions; "+
			"%d tenant databases client CPU %.0f us, server CPU %.0f us (their connections' %.0f us), %.2f transactions; ratios client %.2f, server %.2f (connections' %.2f), transactions %.2f; "+
			"the outbox's ratios over the control's: client %.2f, server %.2f (connections' %.2f), transactions %.2f",
			r, kcl, ksv, kown, kx, n, lcl, lsv, lown, lx, cClient, cServer, cOwn, cXact,
			netClientR[r], netServerR[r], netOwnR[r], netXactR[r])
	}
	t.Logf("%d tenant databases vs 1: p99 ratio, median of %d rounds: %.2f", n, rounds, median(ratios))
	if len(slopeXactR) > 0 {
		t.Logf("%d tenant databases vs 1, what a message adds from %d to %d msg/s, median of %d rounds: client CPU %.2f, the Sets' connections' server CPU %.2f, transactions %.2f",
			n, rate, slopeRate, rounds, median(slopeClientR), median(slopeOwnR), median(slopeXactR))
	}
	t.Logf("%d tenant databases vs 1, per message, median of %d rounds: client CPU %.2f, server CPU %.2f (the Sets' connections' %.2f), transactions %.2f",
		n, rounds, median(clientR), median(serverR), median(ownR), median(xactR))
	t.Logf("%d tenant databases vs 1, per message, the control without the outbox, median of %d rounds: client CPU %.2f, server CPU %.2f (the Sets' connections' %.2f), transactions %.2f",
		n, rounds, median(ctlClientR), median(ctlServerR), median(ctlOwnR), median(ctlXactR))
	t.Logf("%d tenant databases vs 1, per message, the outbox over the control, median of %d rounds: client CPU %.2f, server CPU %.2f (the Sets' connections' %.2f), transactions %.2f",
		n, rounds, median(netClientR), median(netServerR), median(netOwnR), median(netXactR))

	if sat, _ := strconv.Atoi(os.Getenv("OUTBOX_TENANT_SATURATE")); sat > 0 {
		inFlight := 8
		if k, _ := strconv.Atoi(os.Getenv("OUTBOX_TENANT_INFLIGHT")); k > 0 {
			inFlight = k
		}
		d := time.Duration(sat) * time.Second
		// Each round also runs the control (the same work without the outbox, ls.bare) on both:
		// what 200 databases cost PostgreSQL and the client whatever runs on them (a backend,
		// a pool and their caches each) shows in the control's ratio, and what the framework
		// adds to it is the outbox's ratio over the control's.
		type sat struct {
			tput, cl, sv, own, x float64
		}
		one1 := func(ls *latencySet, h message.NoPublishHandlerFunc, tag string) (sat, int) {
			var done, failed int
			c, _ := cm.measure(ls.dbs, func() int { done, failed = ls.saturate(h, inFlight, d, tag); return done })
			cl, sv, own, x, _ := c.perMsg(done)
			return sat{float64(done) / c.wall.Seconds(), cl, sv, own, x}, failed
		}
		ratio := func(a, b sat) sat { return sat{b.tput / a.tput, b.cl / a.cl, b.sv / a.sv, b.own / a.own, b.x / a.x} }
		var outR, ctlR, netR []sat
		for r := range rounds {
			a, fa := one1(one, nil, fmt.Sprint("s", r))
			b, fb := one1(many, nil, fmt.Sprint("s", r))
			ca, fca := one1(one, one.bare, fmt.Sprint("c", r))
			cb, fcb := one1(many, many.bare, fmt.Sprint("c", r))
			o, c := ratio(a, b), ratio(ca, cb)
			nr := sat{o.tput / c.tput, o.cl / c.cl, o.sv / c.sv, o.own / c.own, o.x / c.x}
			outR, ctlR, netR = append(outR, o), append(ctlR, c), append(netR, nr)
			t.Logf("saturating round %d, %d in flight for %v: 1 tenant %.0f msg/s (%d failed), client %.0f us, server %.0f us (connections' %.0f), %.2f transactions a message; "+
				"%d tenant databases %.0f msg/s (%d failed), client %.0f us, server %.0f us (connections' %.0f), %.2f transactions; ratios throughput %.2f, client %.2f, server %.2f (connections' %.2f), transactions %.2f",
				r, inFlight, d, a.tput, fa, a.cl, a.sv, a.own, a.x, n, b.tput, fb, b.cl, b.sv, b.own, b.x, o.tput, o.cl, o.sv, o.own, o.x)
			t.Logf("saturating round %d, control without the outbox: 1 tenant database %.0f msg/s (%d failed), client %.0f us, server %.0f us (connections' %.0f), %.2f transactions; "+
				"%d %.0f msg/s (%d failed), client %.0f us, server %.0f us (connections' %.0f), %.2f transactions; ratios throughput %.2f, client %.2f, server %.2f (connections' %.2f); "+
				"the outbox's ratios over the control's: throughput %.2f, client %.2f, server %.2f (connections' %.2f), transactions %.2f",
				r, ca.tput, fca, ca.cl, ca.sv, ca.own, ca.x, n, cb.tput, fcb, cb.cl, cb.sv, cb.own, cb.x, c.tput, c.cl, c.sv, c.own, nr.tput, nr.cl, nr.sv, nr.own, nr.x)
		}
		med := func(v []sat, f func(sat) float64) float64 {
			var xs []float64
			for _, s := range v {
				xs = append(xs, f(s))
			}
			return median(xs)
		}
		for _, row := range []struct {
			what string
			v    []sat
		}{{"the outbox", outR}, {"the control without it", ctlR}, {"the outbox over the control", netR}} {
			t.Logf("saturating, %d tenant databases vs 1, %s, median of %d rounds: throughput %.2f, client CPU %.2f, server CPU %.2f (connections' %.2f), transactions %.2f a message",
				n, row.what, rounds, med(row.v, func(s sat) float64 { return s.tput }), med(row.v, func(s sat) float64 { return s.cl }),
				med(row.v, func(s sat) float64 { return s.sv }), med(row.v, func(s sat) float64 { return s.own }), med(row.v, func(s sat) float64 { return s.x }))
		}
	}

	// A CPU profile of this process in one more round of each Set, apart from the measured
	// rounds (profiling costs CPU of its own): where the many tenants' messages spend more.
	if dir := os.Getenv("OUTBOX_TENANT_PROFILE"); dir != "" {
		for _, p := range []struct {
			name string
			ls   *latencySet
		}{{"one", one}, {"many", many}} {
			f, err := os.Create(filepath.Join(dir, p.name+".pprof"))
			if err != nil {
				t.Fatal(err)
			}
			if err := pprof.StartCPUProfile(f); err != nil {
				_ = f.Close()
				t.Fatalf("profile (not with go test -cpuprofile): %v", err)
			}
			p.ls.offer(rate, window, nil, "prof")
			pprof.StopCPUProfile()
			if err := f.Close(); err != nil {
				t.Fatal(err)
			}
		}
		t.Logf("CPU profiles of a round of each: %s/one.pprof, %s/many.pprof", dir, dir)
	}
	stopOne()
	stopMany()

	down, _ := strconv.Atoi(os.Getenv("OUTBOX_TENANT_DOWN"))
	if down <= 0 {
		return
	}
	outage := time.Duration(down) * time.Second
	ten := newLatencySet(t, admin, dbname+"_ten", 10, 2, true)
	stopTen := run(ten)
	defer stopTen()
	ten.offer(rate, 5*time.Second, nil, "warm")
	up, downName := ten.names[:9], ten.names[9:]
	for r := range rounds {
		base, _ := ten.offer(rate, outage, up, fmt.Sprint("base", r))
		before := ten.proxy.Attempts()
		ten.proxy.SetDown(true)
		var failedDown int
		var wg sync.WaitGroup
		wg.Add(1)
		go func() {
			// The down tenant's messages keep coming: they wait for its database, and fail.
			defer wg.Done()
			_, failedDown = ten.offer(rate/10, outage, downName, fmt.Sprint("downonly", r))
		}()
		during, _ := ten.offer(rate, outage, up, fmt.Sprint("down", r))
		attempts := ten.proxy.Attempts() - before
		ten.proxy.SetDown(false)
		wg.Wait()
		t.Logf("round %d, one of 10 tenant databases down for %v: the other nine's p99 %v without the outage, %v during it (ratio %.2f); connection attempts to the down one: %d (%.1f/s); its messages that failed: %d",
			r, outage, percentile(base, 0.99), percentile(during, 0.99), float64(percentile(during, 0.99))/float64(percentile(base, 0.99)),
			attempts, float64(attempts)/outage.Seconds(), failedDown)
		time.Sleep(3 * time.Second) // the down tenant back
	}
}
