package outbox_test

import (
	"database/sql"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wsql "github.com/ThreeDotsLabs/watermill-sql/v3/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"

	"github.com/watermill-outbox/outbox"
	"github.com/watermill-outbox/outbox/internal/logtest"
	"github.com/watermill-outbox/outbox/internal/routertest"
	"github.com/watermill-outbox/outbox/middleware"
)

// TestE2ERouterSQLPubSub runs the framework through real Watermill Routers over the watermill-sql
// Postgres pub/sub: three instances of the consumer "reserve-stock" (each its own Outbox, as
// separate processes would have) receive every copy of every order, including copies the producer
// sends twice with the same UUID; one instance fails at random after its business write. A fourth
// Router consumes the produced "stock.reserved" messages. Every business change must happen exactly
// once, and every produced message must be sent with a stable UUID.
func TestE2ERouterSQLPubSub(t *testing.T) {
	const (
		n           = 200
		dupPercent  = 20
		failPercent = 20
		ordersTopic = "orders.placed"
		stockTopic  = "stock.reserved"
		consumer    = "reserve-stock"
	)
	start := time.Now()
	e := newEnv(t)
	e.initTopics(ordersTopic, stockTopic)
	if _, err := e.db.Exec(`CREATE TABLE reserved (message_id text NOT NULL, instance text NOT NULL)`); err != nil {
		t.Fatal(err)
	}
	if _, err := e.db.Exec(`CREATE TABLE notified (message_id text NOT NULL, causation_id text NOT NULL)`); err != nil {
		t.Fatal(err)
	}
	logs := &logtest.Errors{}

	// The downstream consumer starts first, as it would in production.
	notifyGroup := "notify"
	notifyOb := e.newOutbox(withRealPublisher(t, e.db), routertest.WithLogger(logs))
	routertest.RunOutbox(t, notifyOb)
	notifyRouter := routertest.NewRouter(t, logs)
	notifyRouter.AddConsumerHandler("notify", stockTopic, newSQLSubscriber(t, e.db, notifyGroup, stockTopic), func(msg *message.Message) error {
		ctx := msg.Context()
		_, err := outbox.Tx(ctx).ExecContext(ctx, `INSERT INTO notified (message_id, causation_id) VALUES ($1, $2)`,
			msg.UUID, msg.Metadata.Get(outbox.MetadataCausationID))
		return err
	}).AddMiddleware(middleware.New(notifyOb))
	routertest.RunRouter(t, notifyRouter)

	var handlerCalls, injected atomic.Int32
	reserveStock := func(instance string, flaky bool) message.NoPublishHandlerFunc {
		return routertest.ReserveStock(instance, stockTopic, flaky, failPercent, &handlerCalls, &injected)
	}
	groups := []string{"instance-a", "instance-b", "instance-c"}
	for i, group := range groups {
		ob := e.newOutbox(withRealPublisher(t, e.db), routertest.WithLogger(logs))
		routertest.RunOutbox(t, ob)
		r := routertest.NewRouter(t, logs)
		// A different consumer group per Router: every instance receives every copy; the same
		// handler name: one consumer identity, so the instances deduplicate against each other.
		r.AddConsumerHandler(consumer, ordersTopic, newSQLSubscriber(t, e.db, group, ordersTopic), reserveStock(group, i == len(groups)-1)).
			AddMiddleware(middleware.New(ob))
		routertest.RunRouter(t, r)
	}

	// The producer: n orders, and dupPercent of them sent a second time with the same UUID a few
	// messages later, as a broker redelivering them would.
	producer, err := wsql.NewPublisher(e.db, wsql.PublisherConfig{SchemaAdapter: brokerSchema()}, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	orders := routertest.Produce(t, n, dupPercent, func(m *message.Message) error { return producer.Publish(ordersTopic, m) })

	routertest.WaitUntil(t, "every order reserved once and notified", func() (bool, string) {
		reserved := e.count(`SELECT count(DISTINCT message_id) FROM reserved`)
		notified := e.count(`SELECT count(*) FROM notified`)
		return reserved == n && notified >= n, fmt.Sprintf("%d distinct orders reserved, %d notifications", reserved, notified)
	})
	// Settle: every consumer group has consumed every copy, and no side effect is pending. The
	// order of the checks matters: once the reserve-stock groups are caught up nothing publishes to
	// stock.reserved any more, so the notify group's position is then final.
	routertest.WaitUntil(t, "every consumer group caught up and no side effect pending", func() (bool, string) {
		if ok, state := sqlCaughtUp(t, e.db, ordersTopic, groups...); !ok {
			return false, state
		}
		if p := e.pendingEffects(); p != 0 {
			return false, fmt.Sprintf("%d side effects pending", p)
		}
		return sqlCaughtUp(t, e.db, stockTopic, notifyGroup)
	})

	mustEqual(t, "business rows (an order applied twice?)", e.count(`SELECT count(*) FROM reserved`), n)
	mustEqual(t, "distinct orders in the business table", e.count(`SELECT count(DISTINCT message_id) FROM reserved`), n)
	mustEqual(t, "reserved orders that were never produced", routertest.CountMissing(t, e.db, `SELECT message_id FROM reserved`, orders), 0)
	mustEqual(t, "downstream rows (a notification applied twice?)", e.count(`SELECT count(*) FROM notified`), n)
	mustEqual(t, "orders notified (causation ids)", e.count(`SELECT count(DISTINCT causation_id) FROM notified`), n)
	mustEqual(t, "processed rows of "+consumer, e.count(`SELECT count(*) FROM outbox_processed WHERE consumer = $1`, consumer), n)
	mustEqual(t, "processed rows of "+consumer+" not marked dispatched",
		e.count(`SELECT count(*) FROM outbox_processed WHERE consumer = $1 AND dispatched_at IS NULL`, consumer), 0)
	mustEqual(t, "processed rows of notify", e.count(`SELECT count(*) FROM outbox_processed WHERE consumer = 'notify'`), n)

	wire := e.wire(stockTopic)
	copies := 0
	for _, c := range wire {
		copies += c
	}
	mustEqual(t, "distinct UUIDs on "+stockTopic, len(wire), n)
	effects := e.count(`SELECT count(*) FROM all_effects WHERE source_consumer = $1 AND topic = $2`, consumer, stockTopic)
	mustEqual(t, "stored "+stockTopic+" effects", effects, n)
	// Every UUID on the wire is a committed effect: nothing from a failed, rolled-back attempt left.
	mustEqual(t, "UUIDs on the wire that are not committed effects",
		routertest.CountMissing(t, e.db, `SELECT uuid FROM all_effects WHERE source_consumer = 'reserve-stock'`, routertest.Keys(wire)), 0)
	mustEqual(t, "notified messages that are not on the wire", routertest.CountMissing(t, e.db, `SELECT message_id FROM notified`, routertest.Keys(wire)), 0)

	perInstance := map[string]int{}
	rows, err := e.db.Query(`SELECT instance, count(*) FROM reserved GROUP BY instance`)
	if err != nil {
		t.Fatal(err)
	}
	for rows.Next() {
		var inst string
		var c int
		if err := rows.Scan(&inst, &c); err != nil {
			t.Fatal(err)
		}
		perInstance[inst] = c
	}
	_ = rows.Close()
	attempts := e.count(`SELECT coalesce(sum(attempts), 0) FROM outbox_attempts WHERE consumer = $1`, consumer)
	mustEqual(t, "failed attempts counted by the framework", attempts, int(injected.Load()))
	t.Logf("%d orders (+%d duplicates) x %d instances: %d handler calls, %d injected failures, orders applied per instance %v",
		n, n*dupPercent/100, len(groups), handlerCalls.Load(), injected.Load(), perInstance)
	t.Logf("%s: %d distinct UUIDs, %d copies on the wire (re-sends absorbed downstream); %s", stockTopic, len(wire), copies, fmt.Sprintf("%d errors logged by the Routers", len(logs.Lines())))
	if injected.Load() == 0 {
		// Not fatal on purpose: the flaky instance may have lost every claim race.
		t.Logf("note: the flaky instance never failed in this run (it ran its handler %d times)", perInstance[groups[len(groups)-1]])
	}
	if unexpected := routertest.Unexpected(logs); len(unexpected) > 0 {
		t.Errorf("unexpected errors logged: %s", strings.Join(unexpected, "\n"))
	}
	t.Logf("took %s", time.Since(start).Round(time.Millisecond))
}

// TestE2ERouterAddHandlerReturnsMessages adds the wrapped handler with Router.AddHandler: the
// messages it returns are side effects that the middleware stores and dispatches itself, so each
// reaches the publish topic exactly once and the Router's own publisher is never called.
func TestE2ERouterAddHandlerReturnsMessages(t *testing.T) {
	const (
		n        = 50
		inTopic  = "enrich.in"
		outTopic = "enrich.out"
		group    = "enricher"
	)
	start := time.Now()
	e := newEnv(t)
	e.initTopics(inTopic, outTopic)
	if _, err := e.db.Exec(`CREATE TABLE enriched (message_id text NOT NULL)`); err != nil {
		t.Fatal(err)
	}
	logs := &logtest.Errors{}
	ob := e.newOutbox(withRealPublisher(t, e.db), routertest.WithLogger(logs))
	routertest.RunOutbox(t, ob)

	realRouterPub, err := wsql.NewPublisher(e.db, wsql.PublisherConfig{SchemaAdapter: brokerSchema()}, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	routerPub := &countingPublisher{next: realRouterPub}

	var mu sync.Mutex
	returned := map[string]bool{} // UUIDs of the messages the handler returned, per call
	r := routertest.NewRouter(t, logs)
	r.AddHandler("enrich", inTopic, newSQLSubscriber(t, e.db, group, inTopic), outTopic, routerPub,
		func(msg *message.Message) ([]*message.Message, error) {
			ctx := msg.Context()
			if _, err := outbox.Tx(ctx).ExecContext(ctx, `INSERT INTO enriched (message_id) VALUES ($1)`, msg.UUID); err != nil {
				return nil, err
			}
			out := message.NewMessage(uuid.NewString(), []byte(`{"enriched":true}`))
			mu.Lock()
			returned[out.UUID] = true
			mu.Unlock()
			return []*message.Message{out}, nil
		}).AddMiddleware(middleware.New(ob))
	routertest.RunRouter(t, r)

	producer, err := wsql.NewPublisher(e.db, wsql.PublisherConfig{SchemaAdapter: brokerSchema()}, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	orders := routertest.Produce(t, n, 20, func(m *message.Message) error { return producer.Publish(inTopic, m) })

	routertest.WaitUntil(t, "every input enriched and its output on the wire", func() (bool, string) {
		enriched := e.count(`SELECT count(DISTINCT message_id) FROM enriched`)
		out := len(e.wire(outTopic))
		return enriched == n && out >= n, fmt.Sprintf("%d inputs enriched, %d distinct outputs on the wire", enriched, out)
	})
	routertest.WaitUntil(t, "the consumer group caught up and no side effect pending", func() (bool, string) {
		if ok, state := sqlCaughtUp(t, e.db, inTopic, group); !ok {
			return false, state
		}
		p := e.pendingEffects()
		return p == 0, fmt.Sprintf("%d side effects pending", p)
	})

	mustEqual(t, "business rows", e.count(`SELECT count(*) FROM enriched`), n)
	mustEqual(t, "enriched inputs that were never produced", routertest.CountMissing(t, e.db, `SELECT message_id FROM enriched`, orders), 0)
	mustEqual(t, "calls of the Router's publisher (returned messages published a second time)", routerPub.calls.Load(), int32(0))
	wire := e.wire(outTopic)
	mustEqual(t, "distinct UUIDs on "+outTopic, len(wire), n)
	mu.Lock()
	mustEqual(t, "messages the handler returned", len(returned), n)
	for id, copies := range wire {
		if copies != 1 {
			t.Errorf("message %s reached %s %d times, want once", id, outTopic, copies)
		}
		if !returned[id] {
			t.Errorf("message %s on %s was not returned by the handler", id, outTopic)
		}
	}
	mu.Unlock()
	if unexpected := routertest.Unexpected(logs); len(unexpected) > 0 {
		t.Errorf("unexpected errors logged: %s", strings.Join(unexpected, "\n"))
	}
	t.Logf("%d inputs (+%d duplicates), %d outputs on the wire; took %s", n, n/5, len(wire), time.Since(start).Round(time.Millisecond))
}

// withRealPublisher gives an Outbox its own watermill-sql publisher, as a separate process has.
func withRealPublisher(t *testing.T, db *sql.DB) func(*outbox.Config) {
	t.Helper()
	pub, err := wsql.NewPublisher(db, wsql.PublisherConfig{SchemaAdapter: brokerSchema()}, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	return func(c *outbox.Config) { c.Publisher = pub }
}

// newSQLSubscriber returns a watermill-sql Postgres subscriber in consumer group group. It creates
// the topic's tables first, one subscriber at a time: concurrent CREATE TABLE IF NOT EXISTS race
// in Postgres.
func newSQLSubscriber(t testing.TB, db *sql.DB, group, topic string) message.Subscriber {
	t.Helper()
	sub, err := wsql.NewSubscriber(db, wsql.SubscriberConfig{
		ConsumerGroup:    group,
		SchemaAdapter:    brokerSchema(),
		OffsetsAdapter:   wsql.DefaultPostgreSQLOffsetsAdapter{},
		InitializeSchema: true,
		PollInterval:     10 * time.Millisecond,
		ResendInterval:   50 * time.Millisecond,
		RetryInterval:    50 * time.Millisecond,
	}, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	if err := sub.SubscribeInitialize(topic); err != nil {
		t.Fatal(err)
	}
	// The Router closes its subscribers, in a goroutine that may still run when Router.Run has
	// returned; watermill-sql's Close is not safe for concurrent calls, so the test's own Close
	// (for a subscriber no Router closed) takes turns with the Router's.
	once := &onceClosed{Subscriber: sub}
	t.Cleanup(func() { _ = once.Close() })
	return once
}

// onceClosed closes its Subscriber once, however many callers close it at the same time.
type onceClosed struct {
	message.Subscriber
	once sync.Once
	err  error
}

func (s *onceClosed) Close() error {
	s.once.Do(func() { s.err = s.Subscriber.Close() })
	return s.err
}

// sqlCaughtUp reports whether every group has acked the last message of topic.
func sqlCaughtUp(t testing.TB, db *sql.DB, topic string, groups ...string) (bool, string) {
	t.Helper()
	var last int64
	err := db.QueryRow(`SELECT "offset" FROM "watermill_` + topic + `" ORDER BY transaction_id DESC, "offset" DESC LIMIT 1`).Scan(&last)
	if errors.Is(err, sql.ErrNoRows) {
		return false, topic + " is empty"
	}
	if err != nil {
		t.Fatal(err)
	}
	acked := map[string]int64{}
	rows, err := db.Query(`SELECT consumer_group, coalesce(offset_acked, 0) FROM "watermill_offsets_` + topic + `"`)
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	for rows.Next() {
		var g string
		var o int64
		if err := rows.Scan(&g, &o); err != nil {
			t.Fatal(err)
		}
		acked[g] = o
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	for _, g := range groups {
		if acked[g] != last {
			return false, fmt.Sprintf("%s: last offset %d, acked per group %v", topic, last, acked)
		}
	}
	return true, ""
}

// countingPublisher counts the calls of the publisher a Router is given.
type countingPublisher struct {
	next  message.Publisher
	calls atomic.Int32
}

func (p *countingPublisher) Publish(topic string, msgs ...*message.Message) error {
	p.calls.Add(1)
	return p.next.Publish(topic, msgs...)
}

func (p *countingPublisher) Close() error { return p.next.Close() }
