// Package failover_test runs both forms of the framework (database/sql and pgx) against a
// PostgreSQL primary with a streaming standby, kills the primary mid-stream and promotes the
// standby: with synchronous replication exactly-once must hold across the failover; with
// asynchronous replication the test measures what is lost (docs/guarantees.md, "Failover").
//
// make e2e runs them (make failover alone) in about a minute; a larger run, for instance:
//
//	go test -race -count=1 -v -run TestFailover ./failover -failover.orders 3000 -failover.rate 300 -failover.lag 2s
package failover_test

import (
	"context"
	"database/sql"
	"encoding/json"
	"flag"
	"fmt"
	"net"
	"os"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"
	_ "github.com/lib/pq"
	"github.com/nats-io/nats-server/v2/server"
	"go.uber.org/goleak"

	"github.com/watermill-outbox/outbox"
	"github.com/watermill-outbox/outbox/drivers/outboxpgx"
	"github.com/watermill-outbox/outbox/drivers/postgres"
	"github.com/watermill-outbox/outbox/e2e/internal/natstest"
	"github.com/watermill-outbox/outbox/internal/logtest"
	"github.com/watermill-outbox/outbox/internal/pgserver"
	"github.com/watermill-outbox/outbox/internal/pgtest"
	"github.com/watermill-outbox/outbox/internal/routertest"
	"github.com/watermill-outbox/outbox/middleware"
	"github.com/watermill-outbox/outbox/outboxdriver"
)

var (
	ordersFlag = flag.Int("failover.orders", 300, "orders produced in each failover run")
	rateFlag   = flag.Int("failover.rate", 100, "orders produced per second")
	lagFlag    = flag.Duration("failover.lag", 300*time.Millisecond, "how long the replication link is held before the primary is killed")
)

func TestMain(m *testing.M) {
	flag.Parse()
	goleak.VerifyTestMain(m)
}

// publishTimeout is the Outboxes' PublishTimeout: short, so that a relay lease (2 x
// PublishTimeout + 30 s) is 34 s rather than the default 90 s.
const publishTimeout = 2 * time.Second

// settleBound is what the failover may add, after the primary is killed, to the time the orders
// left at the kill take at the consumers' pace before it (the backlog: about 2 s on an idle
// machine, tens of seconds on one so loaded that the consumers apply a few rows a second) until
// every order is applied and every effect sent on the promoted standby (synchronous
// replication). It is one relay lease, plus 10 s. The lease: a relay round whose claim reached
// the standby before the kill and whose mark did not (marks commit asynchronously, and the link
// is held before the kill) leaves its effects leased on the new primary, and they wait it out
// (docs/operations.md, "Leases that survive the failover"). The 10 s: the promotion (1 to 2 s
// measured, more on a loaded machine), the redelivery of what failed meanwhile (ackWait, 5 s,
// for a delivery whose ack was lost) and the relay's grace. Measured on a loaded 2-core machine
// (load average 12 to 17, GOMAXPROCS=1 among the runs), 30 runs: 4 to 35 s after the kill, the
// longest where the backlog alone took most of it; none with a surviving lease.
const settleBound = 2*publishTimeout + 30*time.Second + 10*time.Second

// forms are the two consumers, each its own Outbox, NATS durable and downstream topic.
var forms = []string{"sql", "pgx"}

const standbyName = "standby1"

// TestFailoverSynchronous: with synchronous replication every commit the framework saw survives
// the failover: each order is applied once per consumer, each of its effects reaches the broker
// under one UUID, nothing is lost, and everything settles within settleBound.
func TestFailoverSynchronous(t *testing.T) {
	r := runFailover(t, true)
	for _, form := range forms {
		routertest.MustEqual(t, form+": orders applied on the new primary", r.applied[form], r.orders)
		routertest.MustEqual(t, form+": business rows (an order applied twice?)", r.rows[form], r.orders)
		routertest.MustEqual(t, form+": orders whose effect reached the broker", r.delivered[form], r.orders)
		routertest.MustEqual(t, form+": orders whose effect reached the broker under two UUIDs", r.twoUUIDs[form], 0)
		routertest.MustEqual(t, form+": effects delivered whose commit was lost", r.orphans[form], 0)
	}
	if r.settled > r.bound {
		t.Errorf("settled %s after the primary was killed, more than %s", r.settled.Round(time.Millisecond), r.bound.Round(time.Millisecond))
	}
}

// TestFailoverAsynchronous measures what asynchronous replication loses at a failover: commits
// the framework saw, whose effects it had sent, are missing on the promoted standby. Their
// orders are then either lost (the message was acked) or applied again and their effects sent
// again under new UUIDs (it was redelivered), which no downstream deduplication can recognise.
func TestFailoverAsynchronous(t *testing.T) {
	r := runFailover(t, false)
	lost := 0
	for _, form := range forms {
		lost += r.orphans[form]
		// What the new primary holds is still consistent with itself: never two rows per order.
		routertest.MustEqual(t, form+": business rows (an order applied twice on the new primary?)", r.rows[form], r.applied[form])
	}
	// The replication link was held while orders committed: the standby cannot have them all.
	if lost == 0 {
		t.Errorf("no commit was lost with asynchronous replication while the link was held for %s: the test did not exercise the failure", *lagFlag)
	}
}

// result is what one failover run measured, per form.
type result struct {
	orders    int
	applied   map[string]int // distinct orders in the business table of the new primary
	rows      map[string]int // business rows
	delivered map[string]int // distinct orders with an effect that reached the broker
	twoUUIDs  map[string]int // orders whose effects reached the broker under more than one UUID
	orphans   map[string]int // effect UUIDs delivered that the new primary never committed
	settled   time.Duration  // from the kill to everything settled
	bound     time.Duration  // settleBound and the backlog at the kill
}

func runFailover(t *testing.T, synchronous bool) result {
	start := time.Now()
	ctx := context.Background()
	n := *ordersFlag

	// The primary, and a standby that streams from it through a link the test can hold.
	primary := startServer(t, pgserver.Options{})
	link := newProxy(t, addrOf(primary))
	standby := startServer(t, pgserver.Options{StandbyOf: fmt.Sprintf("host=127.0.0.1 port=%d user=postgres application_name=%s", link.port(), standbyName)})
	admin := openDB(t, primary.DSN("postgres"))
	// Set after the base backup: the promoted standby must not wait for a standby of its own.
	if synchronous {
		mustExec(t, admin, `ALTER SYSTEM SET synchronous_standby_names = '`+standbyName+`'`)
		mustExec(t, admin, `ALTER SYSTEM SET synchronous_commit = 'on'`)
		mustExec(t, admin, `SELECT pg_reload_conf()`)
	}
	wantState := map[bool]string{true: "sync", false: "async"}[synchronous]
	routertest.WaitUntil(t, "the standby streaming ("+wantState+")", func() (bool, string) {
		var state string
		err := admin.QueryRow(`SELECT coalesce(max(sync_state), 'none') FROM pg_stat_replication WHERE application_name = $1 AND state = 'streaming'`, standbyName).Scan(&state)
		return err == nil && state == wantState, fmt.Sprintf("%s (%v)", state, err)
	})

	// The database/sql form reaches the writable server through an address that is moved to the
	// standby (lib/pq has no target_session_attrs); the pgx form through a multi-host DSN that
	// takes the host that accepts writes.
	app := newProxy(t, addrOf(primary))
	sqlDSN := fmt.Sprintf("postgres://postgres@%s/postgres?sslmode=disable&connect_timeout=2", app.addr())
	pgxDSN := fmt.Sprintf("postgres://postgres@%s,%s/postgres?sslmode=disable&connect_timeout=2&target_session_attrs=read-write",
		addrOf(primary), addrOf(standby))

	sqlDB := openDB(t, sqlDSN)
	mustExec(t, admin, `CREATE TABLE reserved (message_id text NOT NULL, instance text NOT NULL)`)
	pool, err := pgxpool.New(ctx, pgxDSN)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)

	ns := natstest.Start(t)
	js, err := natstest.Conn(t, ns, "admin").JetStream()
	if err != nil {
		t.Fatal(err)
	}
	const ordersTopic = "orders_placed"
	topics := []string{ordersTopic}
	for _, form := range forms {
		topics = append(topics, "stock_"+form)
	}
	natstest.AddStreams(t, js, topics...)

	logs := map[string]*logtest.Errors{}
	t.Cleanup(func() {
		if t.Failed() {
			for form, l := range logs {
				t.Logf("%s form: errors logged: %s", form, summarize(l.Lines()))
				if lines := l.Lines(); len(lines) > 0 {
					t.Logf("%s form: first error: %s", form, lines[0])
				}
			}
		}
	})
	obs := map[string]*outbox.Outbox{}
	var calls atomic.Int32
	for _, form := range forms {
		logs[form] = &logtest.Errors{}
		cfg := outbox.Config{
			Publisher:       natstest.Publisher(t, ns, form+"-outbox", logs[form]),
			Logger:          logs[form],
			EffectRetention: time.Hour, // keep dispatched effects, to compare with what was delivered
			RelayInterval:   100 * time.Millisecond,
			RelayGrace:      time.Second,
			// A relay round cut short by the kill leaves its effects leased (2 x PublishTimeout +
			// 30 s) on the new primary too (the lease was replicated): settleBound allows one lease.
			PublishTimeout: publishTimeout,
			StatsInterval:  200 * time.Millisecond,
			HandlerTimeout: 10 * time.Second,
			RetryDelay:     50 * time.Millisecond,
			RetryDelayMax:  500 * time.Millisecond,
			MaxAttempts:    1000, // a failover is no reason to poison an order
		}
		var ob *outbox.Outbox
		switch form {
		case "sql":
			cfg.DB, cfg.Driver = sqlDB, postgres.Driver{ListenDSN: sqlDSN}
			ob, err = outbox.New(cfg)
		case "pgx":
			ob, err = outboxpgx.New(pool, cfg)
		}
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = ob.Close() })
		if err := ob.Migrate(ctx); err != nil {
			t.Fatal(err)
		}
		obs[form] = ob
		routertest.RunOutbox(t, ob)
		r := routertest.NewRouter(t, logs[form])
		r.AddConsumerHandler("reserve-stock-"+form, ordersTopic, natstest.Subscriber(t, ns, form, ackWait, logs[form]),
			reserveStock(form, &calls)).
			AddMiddleware(middleware.New(ob))
		routertest.RunRouter(t, r)
	}
	mustExec(t, admin, `CREATE VIEW all_effects AS
		SELECT source_consumer, source_id, topic, uuid FROM outbox_effects_all
		UNION ALL SELECT source_consumer, source_id, topic, uuid FROM outbox_dispatched`)

	// Downstream: every effect that reaches the broker, by topic, order and UUID.
	down := newRecorder(t, ns, topics[1:])

	// Orders at a steady rate, from a producer that does not depend on the database.
	producer := natstest.Publisher(t, ns, "producer", &logtest.Errors{})
	ids := make([]string, n)
	for i := range ids {
		ids[i] = uuid.NewString()
	}
	// Every order is sent twice, the copy a second later (a producer's retry, a redelivery after
	// a lost ack): a copy that arrives after the failover must find its order's claim.
	copyLag := *rateFlag
	produced := make(chan error, 1)
	go func() {
		tick := time.NewTicker(time.Second / time.Duration(*rateFlag))
		defer tick.Stop()
		for i := 0; i < n+copyLag; i++ {
			<-tick.C
			for _, j := range []int{i, i - copyLag} {
				if j < 0 || j >= n {
					continue
				}
				if err := producer.Publish(ordersTopic, message.NewMessage(ids[j], []byte(`{}`))); err != nil {
					produced <- fmt.Errorf("produce %s: %w", ids[j], err)
					return
				}
			}
		}
		produced <- nil
	}()

	// Mid-stream: hold the replication link (a slow or broken network to the standby), keep
	// committing for a while, then kill the primary as a machine loss would.
	// The consumers' pace before the failover, from the first rows to the hold: on a loaded
	// machine it, not the failover, decides how long the orders left at the kill take.
	var firstRows int
	routertest.WaitUntil(t, "the first orders applied", func() (bool, string) {
		err := admin.QueryRow(`SELECT count(*) FROM reserved`).Scan(&firstRows)
		return err == nil && firstRows >= 10, fmt.Sprintf("%d business rows (%v)", firstRows, err)
	})
	paceFrom := time.Now()
	routertest.WaitUntil(t, "a third of the orders applied by both forms", func() (bool, string) {
		var a, b int
		err := admin.QueryRow(`SELECT count(*) FILTER (WHERE instance = 'sql'), count(*) FILTER (WHERE instance = 'pgx') FROM reserved`).Scan(&a, &b)
		return err == nil && a >= n/3 && b >= n/3, fmt.Sprintf("sql %d, pgx %d (%v)", a, b, err)
	})
	var beforeHold int
	if err := admin.QueryRow(`SELECT count(*) FROM reserved`).Scan(&beforeHold); err != nil {
		t.Fatal(err)
	}
	pace := max(float64(beforeHold-firstRows)/time.Since(paceFrom).Seconds(), 1) // business rows a second
	link.pause()
	time.Sleep(*lagFlag)
	if !synchronous {
		// A loaded machine may commit little in lagFlag: hold the link until some commits are in
		// it, so that every run exercises their loss.
		routertest.WaitUntil(t, "commits made while the link is held", func() (bool, string) {
			var n int
			err := admin.QueryRow(`SELECT count(*) FROM reserved`).Scan(&n)
			return err == nil && n >= beforeHold+20, fmt.Sprintf("%d business rows, %d before the hold (%v)", n, beforeHold, err)
		})
	}
	var atKill int
	if err := admin.QueryRow(`SELECT count(*) FROM reserved`).Scan(&atKill); err != nil && !synchronous {
		t.Fatal(err)
	}
	_ = admin.Close()
	killed := time.Now()
	if err := primary.Kill(); err != nil {
		t.Fatal(err)
	}
	link.cut() // what the standby had not received when the primary died never reaches it
	// What was left to apply at the kill would take backlog at that pace without a failover: the
	// bound is on what the failover adds to it.
	backlog := time.Duration(float64(len(forms)*n-max(atKill, beforeHold)) / pace * float64(time.Second))
	bound := settleBound + backlog
	t.Logf("primary killed at %s, %s after start; %d business rows committed before the link was held, %d visible at the kill; %.0f rows a second before, so %s of backlog: settle bound %s",
		killed.Format("15:04:05.000"), killed.Sub(start).Round(time.Millisecond), beforeHold, atKill, pace, backlog.Round(time.Millisecond), bound.Round(time.Millisecond))

	// The address moves to the standby before it is promoted (a DNS name or virtual IP moved
	// early): the database/sql form reaches a read-only server, and its health says so.
	app.repoint(addrOf(standby))
	routertest.WaitUntil(t, "the sql form's health reports the standby", func() (bool, string) {
		h := obs["sql"].Health(ctx)
		return !h.Healthy && strings.Contains(h.Checks[0].Reason, "standby"), fmt.Sprint(h.Checks[0])
	})
	routertest.WaitUntil(t, "the sql form's relay reports the read-only server", func() (bool, string) {
		return logs["sql"].Contains(outboxdriver.ErrReadOnly.Error()), summarize(logs["sql"].Lines())
	})
	if err := standby.Promote(); err != nil {
		t.Fatal(err)
	}
	promoted := time.Now()
	t.Logf("standby promoted %s after the kill", promoted.Sub(killed).Round(time.Millisecond))
	db := openDB(t, standby.DSN("postgres"))

	select {
	case err := <-produced:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(routertest.Timeout):
		t.Fatalf("producer not done after %s", routertest.Timeout)
	}
	// Settled: every order delivered to each form and acked, no effect pending, the downstream
	// recorder caught up, twice in a row a second apart (a nacked message waits out its delay).
	stable := 0
	var lastDump time.Time
	waitUntil(t, killed.Add(bound+20*time.Second), "every order handled, no effect pending, downstream caught up", func() (bool, string) {
		for _, form := range forms {
			if ok, state := natstest.CaughtUp(js, ordersTopic, form); !ok {
				stable = 0
				return false, state
			}
		}
		var pending int
		if err := db.QueryRow(`SELECT count(*) FROM outbox_effects_all WHERE dispatched_at IS NULL`).Scan(&pending); err != nil || pending > 0 {
			stable = 0
			if time.Since(lastDump) > 5*time.Second {
				lastDump = time.Now()
				t.Logf("%s after the kill: %s", time.Since(killed).Round(time.Millisecond), pendingRows(db))
			}
			return false, fmt.Sprintf("%d effects pending (%v): %s", pending, err, pendingRows(db))
		}
		for _, topic := range topics[1:] {
			if ok, state := natstest.CaughtUp(js, topic, "downstream"); !ok {
				stable = 0
				return false, state
			}
		}
		if synchronous {
			var applied int
			if err := db.QueryRow(`SELECT count(DISTINCT (message_id, instance)) FROM reserved`).Scan(&applied); err != nil || applied < len(forms)*n {
				stable = 0
				return false, fmt.Sprintf("%d of %d orders applied (%v)", applied, len(forms)*n, err)
			}
		}
		stable++
		if stable < 2 {
			time.Sleep(time.Second)
			return false, "settling"
		}
		return true, ""
	})
	settled := time.Since(killed) - time.Second // the last stability pause
	routertest.WaitUntil(t, "both forms healthy on the new primary (the listeners reconnected)", func() (bool, string) {
		var reasons []string
		for _, form := range forms {
			for _, ob := range []*outbox.Outbox{obs[form]} {
				ob.FlushMarks()
				if err := ob.Health(ctx).Err(); err != nil {
					reasons = append(reasons, form+": "+err.Error())
				}
			}
		}
		return len(reasons) == 0, strings.Join(reasons, "; ")
	})

	r := result{orders: n, settled: settled, bound: bound, applied: map[string]int{}, rows: map[string]int{}, delivered: map[string]int{},
		twoUUIDs: map[string]int{}, orphans: map[string]int{}}
	committed := map[string]bool{}
	rows, err := db.Query(`SELECT uuid FROM all_effects`)
	if err != nil {
		t.Fatal(err)
	}
	for rows.Next() {
		var u string
		if err := rows.Scan(&u); err != nil {
			t.Fatal(err)
		}
		committed[u] = true
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	rows.Close()
	for _, form := range forms {
		var applied, businessRows int
		if err := db.QueryRow(`SELECT count(DISTINCT message_id), count(*) FROM reserved WHERE instance = $1`, form).Scan(&applied, &businessRows); err != nil {
			t.Fatal(err)
		}
		r.applied[form], r.rows[form] = applied, businessRows
		byOrder := down.byOrder("stock_" + form)
		r.delivered[form] = len(byOrder)
		for _, uuids := range byOrder {
			if len(uuids) > 1 {
				r.twoUUIDs[form]++
			}
			for u := range uuids {
				if !committed[u] {
					r.orphans[form]++
				}
			}
		}
		t.Logf("%s form: %d orders, %d applied on the new primary (%d rows), %d reached the broker, %d of them under two UUIDs, %d effects delivered whose commit was lost",
			form, n, r.applied[form], r.rows[form], r.delivered[form], r.twoUUIDs[form], r.orphans[form])
		t.Logf("%s form: errors logged during the failover: %s", form, summarize(logs[form].Lines()))
		if os.Getenv("FAILOVER_LOGS") != "" {
			for _, l := range logs[form].Lines() {
				t.Logf("%s form: %.300s", form, l)
			}
		}
		// Nothing spins: every failing loop waits between tries, so the errors of a failover of
		// a few seconds are counted in hundreds, not in the hundreds of thousands a hot loop logs.
		if l := len(logs[form].Lines()); l > 5000 {
			t.Errorf("%s form: %d errors logged during a failover of %s: something retries without waiting", form, l, settled.Round(time.Second))
		}
	}
	t.Logf("settled %s after the kill (%s after the promotion); %d handler runs for %d orders x %d forms; took %s",
		settled.Round(time.Millisecond), (settled - promoted.Sub(killed)).Round(time.Millisecond), calls.Load(), n, len(forms), time.Since(start).Round(time.Millisecond))
	return r
}

// pendingRows describes the pending effects: what holds them back (a lease or a backoff in
// next_attempt_at, a park), for a run that does not settle.
func pendingRows(db *sql.DB) string {
	rows, err := db.Query(`SELECT id, source_consumer, source_id, attempts, failures, coalesce(last_error, ''),
			coalesce(to_char(failed_at, 'HH24:MI:SS.MS'), '-'), coalesce(to_char(next_attempt_at, 'HH24:MI:SS.MS'), '-'),
			coalesce(to_char(parked_at, 'HH24:MI:SS.MS'), '-'), to_char(created_at, 'HH24:MI:SS.MS'), to_char(clock_timestamp(), 'HH24:MI:SS.MS')
		FROM outbox_effects_all WHERE dispatched_at IS NULL ORDER BY id LIMIT 5`)
	if err != nil {
		return err.Error()
	}
	defer rows.Close()
	var b strings.Builder
	for rows.Next() {
		var id int64
		var attempts, failures int
		var consumer, source, lastErr, failedAt, next, parked, created, now string
		if err := rows.Scan(&id, &consumer, &source, &attempts, &failures, &lastErr, &failedAt, &next, &parked, &created, &now); err != nil {
			return err.Error()
		}
		fmt.Fprintf(&b, "[effect %d of %s/%s: created %s, attempts %d, failures %d, failed %s, next attempt %s, parked %s, now %s, last error %.200q] ",
			id, consumer, source, created, attempts, failures, failedAt, next, parked, now, lastErr)
	}
	if err := rows.Err(); err != nil {
		return err.Error()
	}
	return b.String()
}

// reserveStock is the consumer of each form: a business row through the unit of work's
// transaction and one effect to its downstream topic that names the order.
func reserveStock(form string, calls *atomic.Int32) message.NoPublishHandlerFunc {
	return func(msg *message.Message) error {
		calls.Add(1)
		ctx := msg.Context()
		const insert = `INSERT INTO reserved (message_id, instance) VALUES ($1, $2)`
		var err error
		if form == "pgx" {
			_, err = outboxpgx.Tx(ctx).Exec(ctx, insert, msg.UUID, form)
		} else {
			_, err = outbox.Tx(ctx).ExecContext(ctx, insert, msg.UUID, form)
		}
		if err != nil {
			return err
		}
		payload := []byte(fmt.Sprintf(`{"order":%q}`, msg.UUID))
		return outbox.Publish(ctx, "stock_"+form, message.NewMessage(uuid.NewString(), payload))
	}
}

// waitUntil polls cond until it holds, failing at deadline with the last state it described.
func waitUntil(t *testing.T, deadline time.Time, what string, cond func() (bool, string)) {
	t.Helper()
	for {
		ok, state := cond()
		if ok {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("timed out at %s waiting for %s; last state: %s", deadline.Format("15:04:05.000"), what, state)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// summarize counts log lines by their first words.
func summarize(lines []string) string {
	counts := map[string]int{}
	for _, l := range lines {
		k := l
		if i := strings.Index(k, ":"); i > 0 {
			k = k[:i]
		}
		if len(k) > 70 {
			k = k[:70]
		}
		counts[k]++
	}
	keys := routertest.Keys(counts)
	sort.Slice(keys, func(i, j int) bool { return counts[keys[i]] > counts[keys[j]] })
	var b strings.Builder
	fmt.Fprintf(&b, "%d in all", len(lines))
	for _, k := range keys {
		fmt.Fprintf(&b, "; %d× %q", counts[k], k)
	}
	return b.String()
}

func startServer(t *testing.T, opts pgserver.Options) *pgserver.Server {
	t.Helper()
	opts.Logf = t.Logf
	s, err := pgserver.Start(opts)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := s.Stop(); err != nil {
			t.Errorf("stop server: %v", err)
		}
	})
	return s
}

func addrOf(s *pgserver.Server) string { return net.JoinHostPort("127.0.0.1", strconv.Itoa(s.Port())) }

func openDB(t *testing.T, dsn string) *sql.DB {
	t.Helper()
	db, err := sql.Open("postgres", dsn)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = db.Close() })
	return db
}

func mustExec(t *testing.T, db *sql.DB, q string) {
	t.Helper()
	pgtest.CheckEffectsParent(t, q)
	if _, err := db.Exec(q); err != nil {
		t.Fatalf("%s: %v", q, err)
	}
}

// recorder consumes the downstream topics and keeps, per topic and order, the UUIDs delivered.
type recorder struct {
	mu   sync.Mutex
	seen map[string]map[string]map[string]int // topic -> order -> UUID -> deliveries
}

func newRecorder(t *testing.T, ns *server.Server, topics []string) *recorder {
	t.Helper()
	rec := &recorder{seen: map[string]map[string]map[string]int{}}
	sub := natstest.Subscriber(t, ns, "downstream", ackWait, &logtest.Errors{})
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	t.Cleanup(func() {
		cancel()
		_ = sub.Close()
		wg.Wait()
	})
	for _, topic := range topics {
		msgs, err := sub.Subscribe(ctx, topic)
		if err != nil {
			t.Fatal(err)
		}
		rec.seen[topic] = map[string]map[string]int{}
		wg.Add(1)
		go func() {
			defer wg.Done()
			for m := range msgs {
				var p struct{ Order string }
				if err := json.Unmarshal(m.Payload, &p); err != nil {
					t.Errorf("downstream %s: %v", topic, err)
				}
				rec.mu.Lock()
				if rec.seen[topic][p.Order] == nil {
					rec.seen[topic][p.Order] = map[string]int{}
				}
				rec.seen[topic][p.Order][m.UUID]++
				rec.mu.Unlock()
				m.Ack()
			}
		}()
	}
	return rec
}

func (r *recorder) byOrder(topic string) map[string]map[string]int {
	r.mu.Lock()
	defer r.mu.Unlock()
	out := map[string]map[string]int{}
	for order, uuids := range r.seen[topic] {
		out[order] = map[string]int{}
		for u, c := range uuids {
			out[order][u] = c
		}
	}
	return out
}

// ackWait bounds how long a delivery whose ack was lost (its consumer's connection to the
// database was cut mid-way) waits before it is redelivered.
const ackWait = 5 * time.Second
