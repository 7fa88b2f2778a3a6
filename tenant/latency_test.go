package tenant_test

import (
	"context"
	"database/sql"
	"fmt"
	"os"
	"slices"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/watermill-outbox/outbox"
	"github.com/watermill-outbox/outbox/drivers/postgres"
	"github.com/watermill-outbox/outbox/internal/pgproxy"
	"github.com/watermill-outbox/outbox/internal/pgtest"
	"github.com/watermill-outbox/outbox/middleware"
	"github.com/watermill-outbox/outbox/tenant"
)

// latencySet is a Set of n tenants, a database and a pool each, each pool keeping idle idle
// connections, with an orders table.
type latencySet struct {
	set   *tenant.Set
	h     message.NoPublishHandlerFunc
	names []string
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
	for i := range n {
		name := fmt.Sprintf("%s_t%d", base, i)
		if _, err := admin.Exec(`CREATE DATABASE ` + name); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _, _ = admin.Exec(`DROP DATABASE IF EXISTS ` + name + ` WITH (FORCE)`) })
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
		ob, err := outbox.New(outbox.Config{DB: db, Driver: postgres.Driver{}, Publisher: w, HandlerTimeout: 20 * time.Second})
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
	}
	sh := newShop(func(string) string { return "orders" })
	ls.h = set.WrapConsumer(sh.handle, middleware.WithConsumer("shop"))
	return ls
}

// offer runs rate messages a second for d, spread over the tenants names in turn (nil: all), each
// delivery in a goroutine of its own as a subscriber with enough handlers would, and
// returns the handle times of those that succeeded and the count of those that failed.
func (ls *latencySet) offer(rate int, d time.Duration, names []string, tag string) (times []time.Duration, failed int) {
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
			err := ls.h(msg)
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
// p50/p99 of each round and their ratio. With OUTBOX_TENANT_DOWN=S it then takes the last of 10
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
	var ratios []float64
	for r := range rounds {
		a, fa := one.offer(rate, window, nil, fmt.Sprint("r", r))
		b, fb := many.offer(rate, window, nil, fmt.Sprint("r", r))
		ratio := float64(percentile(b, 0.99)) / float64(percentile(a, 0.99))
		ratios = append(ratios, ratio)
		t.Logf("round %d, %d msg/s for %v: 1 tenant p50 %v p99 %v (%d failed); %d tenant databases p50 %v p99 %v (%d failed); p99 ratio %.2f",
			r, rate, window, percentile(a, 0.5), percentile(a, 0.99), fa, n, percentile(b, 0.5), percentile(b, 0.99), fb, ratio)
	}
	slices.Sort(ratios)
	t.Logf("%d tenant databases vs 1: p99 ratio, median of %d rounds: %.2f", n, rounds, ratios[len(ratios)/2])
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
