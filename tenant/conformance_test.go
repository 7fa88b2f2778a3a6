package tenant_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"

	"github.com/watermill-outbox/outbox"
	"github.com/watermill-outbox/outbox/drivers/postgres"
	"github.com/watermill-outbox/outbox/internal/pgtest"
	"github.com/watermill-outbox/outbox/outboxdriver"
	"github.com/watermill-outbox/outbox/store/storetest"
	"github.com/watermill-outbox/outbox/tenant"
)

// TestSetConformance runs the Store conformance suite (store/storetest) on members of a Set in
// the layouts the Set supports on PostgreSQL, while three other members of the Set get traffic of
// their own, interleaved on one subscriber, with the Set's engine running their background work.
// Each case gets a member of its own, fresh and empty, in turn:
//
//   - on the pool of two traffic members (schema-per-tenant on one database), with tables under
//     a prefix of its own beside one's in schema public,
//   - or in a schema of its own with the prefix of the other's, so that only the schema tells
//     them apart,
//   - or in a database of its own, with the same schema and prefix as the third traffic
//     member's, in a database of its own too (database-per-tenant), so that only the database
//     tells them apart.
//
// After each case its tables must hold nothing of the traffic; after the suite, the traffic
// members' tables must hold exactly their own claims, effects, dead letters, keys and delayed
// effects, each order once, and every event of theirs (published, returned by the handler, delayed,
// of a keyed unit) must have gone out, with the member's name in its metadata, and nothing else:
// no cancelled delayed effect, nothing of another member.
func TestSetConformance(t *testing.T) {
	traffic := startTraffic(t)
	var cases atomic.Int32
	storetest.Run(t, func(t *testing.T) storetest.Harness {
		return traffic.harness(t, int(cases.Add(1)))
	})
}

// trafficMember is a member of the Set with traffic of its own.
type trafficMember struct {
	name           string
	db             *sql.DB
	schema, prefix string
}

func (m *trafficMember) table(name string) string {
	return `"` + m.schema + `"."` + m.prefix + name + `"`
}

// setTraffic is a Set of three members with traffic, beside which the suite's cases put theirs.
type setTraffic struct {
	members   []*trafficMember // b and c on one pool, d in a database of its own
	shared    *sql.DB          // the pool of members b and c
	sharedDSN string
	w         *wire
	md        sync.Map // UUID -> the tenant metadata it went out with
}

// The traffic's identifiers all start with this; the suite's never do.
const trafficMark = "set/"

func startTraffic(t *testing.T) *setTraffic {
	tr := &setTraffic{w: newWire()}
	pub := &stampRecorder{w: tr.w, md: &tr.md}
	tr.sharedDSN = pgtest.DSN(t)
	shared := openDB(t, tr.sharedDSN)
	tr.shared = shared
	tr.members = []*trafficMember{
		{name: "b", db: shared, schema: "public", prefix: "b_"},
		{name: "c", db: shared, schema: "tenant_c", prefix: "ob_"},
		{name: "d", db: openDB(t, pgtest.DSN(t)), schema: "public", prefix: "outbox_"},
	}
	set, err := tenant.New(tenant.Config{Metadata: "tenant", NackUnresolved: true, IdleMax: 200 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	for _, m := range tr.members {
		ob, err := outbox.New(outbox.Config{DB: m.db, Driver: postgres.Driver{}, Publisher: pub, Schema: m.schema, TablePrefix: m.prefix,
			RelayInterval: 100 * time.Millisecond, CleanupInterval: time.Second, StatsInterval: time.Second})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = ob.Close() })
		if err := ob.Migrate(ctx); err != nil {
			t.Fatal(err)
		}
		if _, err := m.db.Exec(`CREATE TABLE ` + m.table("orders") + ` (id text, tenant text)`); err != nil {
			t.Fatal(err)
		}
		if err := set.Add(m.name, ob); err != nil {
			t.Fatal(err)
		}
	}
	// Stopped and checked after every case: they run in parallel once the test's function
	// returned.
	t.Cleanup(tr.run(t, set))
	return tr
}

func openDB(t *testing.T, dsn string) *sql.DB {
	db, err := sql.Open("postgres", dsn)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = db.Close() })
	return db
}

// stampRecorder is the members' Publisher: the wire, and the tenant each message went out with.
type stampRecorder struct {
	w  *wire
	md *sync.Map
}

func (r *stampRecorder) Publish(topic string, msgs ...*message.Message) error {
	for _, m := range msgs {
		r.md.Store(m.UUID, m.Metadata.Get("tenant"))
	}
	return r.w.Publish(topic, msgs...)
}

func (r *stampRecorder) Close() error { return nil }

// expected is what the traffic of one member committed.
type expected struct {
	orders  map[string]bool // order IDs
	claims  map[string]bool // message IDs of consumer shop
	dead    map[string]bool // dead-lettered message IDs
	keys    map[string]bool // idempotency keys
	events  map[string]bool // UUIDs that must go out once
	missing map[string]bool // UUIDs that must never go out (cancelled)
}

// run starts the Set, a Router with the Set's handler on one subscriber and the feed of both
// members' messages, interleaved, with keyed boundary units beside them. It returns what stops
// it all and checks the outcome.
func (tr *setTraffic) run(t *testing.T, set *tenant.Set) func() {
	ctx, cancel := context.WithCancel(context.Background())
	// One subscriber, each message handed over once the one before it is acked: the units of a
	// member run in the order fed.
	in := gochannel.NewGoChannel(gochannel.Config{BlockPublishUntilSubscriberAck: true}, watermill.NopLogger{})
	router, err := message.NewRouter(message.RouterConfig{}, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	byName := map[string]*trafficMember{}
	want := map[string]*expected{}
	for _, m := range tr.members {
		byName[m.name] = m
		want[m.name] = &expected{orders: map[string]bool{}, claims: map[string]bool{}, dead: map[string]bool{},
			keys: map[string]bool{}, events: map[string]bool{}, missing: map[string]bool{}}
	}
	router.AddHandler("shop", "orders", in, "replies", in, set.Wrap(func(msg *message.Message) ([]*message.Message, error) {
		ctx := msg.Context()
		tn := msg.Metadata.Get("tenant")
		m := byName[tn]
		id := strings.TrimPrefix(msg.UUID, trafficMark)
		if strings.HasPrefix(id, "poison-") {
			return nil, outbox.Permanent(errors.New("unreadable order"))
		}
		if _, err := outbox.Tx(ctx).ExecContext(ctx, `INSERT INTO `+m.table("orders")+` VALUES ($1, $2)`, msg.UUID, tn); err != nil {
			return nil, err
		}
		var i int
		if _, err := fmt.Sscanf(id, "order-%d", &i); err != nil {
			return nil, fmt.Errorf("message %s: %w", msg.UUID, err)
		}
		mine := trafficMark + tn + "/"
		if err := outbox.Publish(ctx, "events", message.NewMessage(fmt.Sprintf("%sevent-%d", mine, i), nil)); err != nil {
			return nil, err
		}
		// The cancel keys are the same in every member: each cancels its own.
		cancelKey := fmt.Sprintf("%stimeout-%d", trafficMark, i)
		switch i % 4 {
		case 0: // due soon: the relay sends it
			dctx := outbox.WithCancelKey(outbox.WithDelay(ctx, 30*time.Millisecond), cancelKey)
			if err := outbox.Publish(dctx, "events", message.NewMessage(fmt.Sprintf("%sdelayed-%d", mine, i), nil)); err != nil {
				return nil, err
			}
		case 2: // cancelled by the next order of the member, which the subscriber hands over after this one's commit
			dctx := outbox.WithCancelKey(outbox.WithDelay(ctx, time.Hour), cancelKey)
			if err := outbox.Publish(dctx, "events", message.NewMessage(fmt.Sprintf("%scancelled-%d", mine, i), nil)); err != nil {
				return nil, err
			}
		case 3:
			n, err := outbox.CancelDelayed(ctx, fmt.Sprintf("%stimeout-%d", trafficMark, i-1))
			if err != nil {
				return nil, err
			}
			if n != 1 {
				return nil, outbox.Permanent(fmt.Errorf("order %d of %s: CancelDelayed cancelled %d effects, want 1", i, tn, n))
			}
		}
		return []*message.Message{message.NewMessage(fmt.Sprintf("%sreply-%d", mine, i), nil)}, nil
	}))
	var wg sync.WaitGroup
	runErr := make(chan error, 1)
	wg.Add(2)
	go func() { defer wg.Done(); _ = router.Run(ctx) }()
	go func() { defer wg.Done(); runErr <- set.Run(ctx) }()
	<-router.Running()

	feedCtx, stopFeed := context.WithCancel(ctx)
	var fed atomic.Int64
	var feedErr error
	feedDone := make(chan struct{})
	go func() {
		defer close(feedDone)
		send := func(msgs ...*message.Message) bool {
			if err := in.Publish("orders", msgs...); err != nil {
				feedErr = err
				return false
			}
			fed.Add(int64(len(msgs)))
			return true
		}
		// A cancelled delayed effect (i%4 == 2) is cancelled by the member's next order: the
		// feed ends after that order, never between the two.
		for i := 0; feedCtx.Err() == nil || i%4 == 3; i++ {
			var batch []*message.Message
			for _, m := range tr.members {
				w := want[m.name]
				mine := trafficMark + m.name + "/"
				// The same message IDs in every member: each claims its own.
				id := fmt.Sprintf("%sorder-%d", trafficMark, i)
				msg := message.NewMessage(id, nil)
				msg.Metadata.Set("tenant", m.name)
				batch = append(batch, msg)
				w.orders[id], w.claims[id] = true, true
				w.events[fmt.Sprintf("%sevent-%d", mine, i)] = true
				w.events[fmt.Sprintf("%sreply-%d", mine, i)] = true
				switch i % 4 {
				case 0:
					w.events[fmt.Sprintf("%sdelayed-%d", mine, i)] = true
				case 2:
					w.missing[fmt.Sprintf("%scancelled-%d", mine, i)] = true
				}
				if i%3 == 0 && i > 0 { // a copy of an earlier order: nothing of it twice
					cp := message.NewMessage(fmt.Sprintf("%sorder-%d", trafficMark, i-3), nil)
					cp.Metadata.Set("tenant", m.name)
					batch = append(batch, cp)
				}
				// Dead letters of different messages in each member.
				if i%5 == 1+slices.Index(tr.members, m) {
					p := message.NewMessage(fmt.Sprintf("%spoison-%d", trafficMark, i), nil)
					p.Metadata.Set("tenant", m.name)
					batch = append(batch, p)
					w.dead[p.UUID], w.claims[p.UUID] = true, true
				}
			}
			if !send(batch...) {
				return
			}
			// Keyed boundary units beside the subscriber, with the same key in every member: each
			// member's first runs inside the previous member's, while that one holds the key,
			// and must not be told that the key is in flight; then each again, which replays.
			if i%3 == 1 {
				key := fmt.Sprintf("%sreq-%d", trafficMark, i)
				var keyed func(k int) error
				keyed = func(k int) error {
					if k == len(tr.members) {
						return nil
					}
					m := tr.members[k]
					uuid := fmt.Sprintf("%s%s/api-%d", trafficMark, m.name, i)
					// Not feedCtx: a unit cut by the end of the feed would leave its outcome unknown.
					err := set.InTx(outbox.WithIdempotencyKey(ctx, trafficMark+"api", key), m.name, func(uctx context.Context, tx *sql.Tx) error {
						if _, err := tx.ExecContext(uctx, `INSERT INTO `+m.table("orders")+` VALUES ($1, $2)`, key, m.name); err != nil {
							return err
						}
						if err := outbox.Publish(uctx, "events", message.NewMessage(uuid, nil)); err != nil {
							return err
						}
						return keyed(k + 1)
					})
					if err != nil {
						return fmt.Errorf("keyed unit %s of %s: %w", key, m.name, err)
					}
					w := want[m.name]
					w.orders[key], w.keys[key], w.events[uuid] = true, true, true
					return nil
				}
				err := keyed(0)
				for k := 0; err == nil && k < len(tr.members); k++ {
					err = keyed(k) // replays: its effects are not sent again
				}
				if err != nil {
					feedErr = err
					return
				}
			}
			select {
			case <-feedCtx.Done():
			case <-time.After(100 * time.Millisecond):
			}
		}
	}()

	return func() {
		stopFeed()
		select {
		case <-feedDone:
		case <-time.After(30 * time.Second):
			// A message nacked for ever holds its Publish: closing the subscriber ends it.
			t.Errorf("the feed did not stop within 30 s")
			_ = router.Close()
			_ = in.Close()
			<-feedDone
		}
		if feedErr != nil {
			t.Errorf("the traffic: %v", feedErr)
		}
		// Every message fed was acked (Publish waits for it); every event out, the delayed
		// ones once due.
		deadline := time.Now().Add(30 * time.Second)
		for !tr.allOut(want) {
			if time.Now().After(deadline) {
				t.Errorf("the events of the traffic did not all go out within 30 s")
				break
			}
			time.Sleep(20 * time.Millisecond)
		}
		_ = router.Close()
		cancel()
		wg.Wait()
		_ = in.Close()
		if err := <-runErr; err != nil && !errors.Is(err, context.Canceled) {
			t.Errorf("set.Run: %v", err)
		}
		if fed.Load() == 0 {
			t.Errorf("no traffic ran beside the suite")
		}
		tr.w.mu.Lock()
		sent := len(tr.w.sent)
		tr.w.mu.Unlock()
		t.Logf("traffic beside the suite: %d messages, %d events", fed.Load(), sent)
		tr.check(t, want)
	}
}

func (tr *setTraffic) allOut(want map[string]*expected) bool {
	for _, w := range want {
		for uuid := range w.events {
			if tr.w.count(uuid) == 0 {
				return false
			}
		}
	}
	return true
}

// check compares what the traffic members' tables hold and what went out with what the traffic
// committed.
func (tr *setTraffic) check(t *testing.T, want map[string]*expected) {
	for _, m := range tr.members {
		w := want[m.name]
		orders := map[string][]string{}
		for _, r := range strRows(t, m.db, `SELECT id, tenant FROM `+m.table("orders")) {
			orders[r[0]] = append(orders[r[0]], r[1])
		}
		for id := range w.orders {
			if g := orders[id]; len(g) != 1 || g[0] != m.name {
				t.Errorf("member %s: order %s stored %v, want once for %s", m.name, id, g, m.name)
			}
		}
		if len(orders) != len(w.orders) {
			t.Errorf("member %s holds %d orders, want %d", m.name, len(orders), len(w.orders))
		}
		sameSet(t, m.name+"'s claims of consumer shop", w.claims,
			strRows(t, m.db, `SELECT message_id FROM `+m.table("processed")+` WHERE consumer = 'shop'`))
		sameSet(t, m.name+"'s dead letters", w.dead,
			strRows(t, m.db, `SELECT consumer || ':' || message_id FROM `+m.table("dead_letters")), "shop:")
		sameSet(t, m.name+"'s idempotency keys", w.keys,
			strRows(t, m.db, `SELECT scope || ':' || key FROM `+m.table("idempotency")), trafficMark+"api:")
		// No claim, attempt or effect of anyone else: the cases' consumers, or the other member's.
		for _, q := range []string{
			`SELECT consumer || ':' || message_id FROM ` + m.table("processed") + ` WHERE consumer NOT IN ('shop', '')`,
			`SELECT consumer || ':' || message_id FROM ` + m.table("attempts") + ` WHERE consumer <> 'shop' OR message_id NOT LIKE '` + trafficMark + `%'`,
			`SELECT uuid FROM ` + m.table("effects_all") + ` WHERE uuid NOT LIKE '` + trafficMark + m.name + `/%'`,
			`SELECT uuid FROM ` + m.table("dispatched") + ` WHERE uuid NOT LIKE '` + trafficMark + m.name + `/%'`,
			`SELECT uuid FROM ` + m.table("delayed") + ` WHERE uuid NOT LIKE '` + trafficMark + m.name + `/%'`,
		} {
			if rs := strRows(t, m.db, q); len(rs) > 0 {
				t.Errorf("member %s holds rows of others (%s): %v", m.name, q, rs)
			}
		}
		if rs := strRows(t, m.db, `SELECT uuid FROM `+m.table("delayed")+` WHERE uuid LIKE '%/cancelled-%'`); len(rs) > 0 {
			t.Errorf("member %s still holds cancelled delayed effects: %v", m.name, rs)
		}
		for uuid := range w.events {
			// At least once: a send the relay repeats (a mark later than RelayGrace on a
			// loaded machine) carries the same UUID, which the consumers' claims deduplicate.
			if n := tr.w.count(uuid); n < 1 {
				t.Errorf("%s did not go out", uuid)
			} else if n > 1 {
				t.Logf("%s went out %d times", uuid, n)
			}
			if tn, ok := tr.md.Load(uuid); ok && tn != m.name {
				t.Errorf("%s went out with tenant %v, want %s", uuid, tn, m.name)
			}
		}
		for uuid := range w.missing {
			if n := tr.w.count(uuid); n != 0 {
				t.Errorf("%s, cancelled, went out %d times", uuid, n)
			}
		}
	}
	tr.w.mu.Lock()
	defer tr.w.mu.Unlock()
	for uuid := range tr.w.sent {
		mine := false
		for _, w := range want {
			mine = mine || w.events[uuid]
		}
		if !mine {
			t.Errorf("%s went out, which no unit of work of the traffic committed", uuid)
		}
	}
}

// sameSet reports the difference between want and got (with prefix cut from each of got).
func sameSet(t *testing.T, what string, want map[string]bool, got [][]string, prefix ...string) {
	t.Helper()
	seen := map[string]bool{}
	for _, r := range got {
		v := r[0]
		if len(prefix) > 0 {
			var ok bool
			if v, ok = strings.CutPrefix(v, prefix[0]); !ok {
				t.Errorf("%s: %s is not the traffic's", what, r[0])
				continue
			}
		}
		if !want[v] {
			t.Errorf("%s: %s, which the traffic did not commit there", what, v)
		}
		seen[v] = true
	}
	var lost []string
	for v := range want {
		if !seen[v] {
			lost = append(lost, v)
		}
	}
	if len(lost) > 0 {
		slices.Sort(lost)
		t.Errorf("%s: missing %v", what, lost)
	}
}

// strRows returns the rows of q, every column as text.
func strRows(t *testing.T, db *sql.DB, q string) [][]string {
	t.Helper()
	rs, err := db.Query(q)
	if err != nil {
		t.Fatalf("%s: %v", q, err)
	}
	defer rs.Close()
	cols, err := rs.Columns()
	if err != nil {
		t.Fatal(err)
	}
	var out [][]string
	for rs.Next() {
		row := make([]string, len(cols))
		ptrs := make([]any, len(cols))
		for i := range row {
			ptrs[i] = &row[i]
		}
		if err := rs.Scan(ptrs...); err != nil {
			t.Fatal(err)
		}
		out = append(out, row)
	}
	if err := rs.Err(); err != nil {
		t.Fatal(err)
	}
	return out
}

// harness is the storetest harness of case n: a new member of the Set's layouts, with tables of
// its own beside the traffic members'.
func (tr *setTraffic) harness(t *testing.T, n int) storetest.Harness {
	// Fixed width, so that no name is part of another's (Blocked finds a case's statements by it).
	name := fmt.Sprintf("m%03d", n)
	var (
		db             *sql.DB
		dsn            string
		schema, prefix string
	)
	switch b, c, d := tr.members[0], tr.members[1], tr.members[2]; n % 3 {
	case 0:
		db, schema, prefix = b.db, b.schema, name+"_"
	case 1:
		db, schema, prefix = c.db, name, c.prefix
	default:
		dsn = pgtest.DSN(t)
		db, schema, prefix = openDB(t, dsn), d.schema, d.prefix
	}
	if dsn == "" {
		dsn = tr.sharedDSN
	}
	t.Logf("the case's member: tables %s.%s* (%s)", schema, prefix, map[bool]string{true: "on the pool of members b and c", false: "in a database of its own"}[db == tr.shared])
	h := pgtest.ConformanceHarness(db, schema, prefix, func(t testing.TB) outboxdriver.Store {
		st, err := postgres.Driver{ListenDSN: dsn}.Open(db, outboxdriver.StoreOptions{Schema: schema, TablePrefix: prefix})
		if err != nil {
			t.Fatal(err)
		}
		return st
	})
	t.Cleanup(func() {
		// Nothing of the traffic in the case's tables (those it created: the schema cases create none).
		for table, col := range map[string]string{"processed": "message_id", "attempts": "message_id", "dead_letters": "message_id",
			"effects_all": "uuid", "dispatched": "uuid", "delayed": "uuid", "idempotency": "key"} {
			q := `SELECT ` + col + ` FROM "` + schema + `"."` + prefix + table + `" WHERE ` + col + ` LIKE '` + trafficMark + `%'`
			var exists bool
			if err := db.QueryRow(`SELECT to_regclass($1) IS NOT NULL`, `"`+schema+`"."`+prefix+table+`"`).Scan(&exists); err != nil {
				t.Fatal(err)
			}
			if !exists {
				continue
			}
			if rs := strRows(t, db, q); len(rs) > 0 {
				t.Errorf("the case's member %s.%s holds rows of the traffic: %v", schema, prefix+table, rs)
			}
		}
	})
	if db != tr.shared {
		return h
	}
	// The database has other members, and the traffic's units wait for locks of their own now
	// and then: only a session of this case's member counts.
	h.Blocked = func(t testing.TB) bool {
		var waiting bool
		if err := db.QueryRow(`SELECT EXISTS (SELECT 1 FROM pg_stat_activity
			WHERE datname = current_database() AND wait_event_type = 'Lock' AND position($1 in query) > 0)`, name).Scan(&waiting); err != nil {
			t.Fatal(err)
		}
		return waiting
	}
	return h
}
