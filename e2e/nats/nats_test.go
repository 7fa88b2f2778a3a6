package nats_test

import (
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	wnats "github.com/ThreeDotsLabs/watermill-nats/v2/pkg/nats"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/watermill-outbox/outbox"
	"github.com/watermill-outbox/outbox/e2e/internal/natstest"
	"github.com/watermill-outbox/outbox/internal/logtest"
	"github.com/watermill-outbox/outbox/internal/routertest"
	"github.com/watermill-outbox/outbox/middleware"
)

// TestE2ENATSJetStream runs the framework through Watermill Routers over an in-process NATS
// JetStream server: two instances of the consumer "reserve-stock" (each its own Outbox, NATS
// connections and durable consumer, so each sees every copy) receive orders, some of them sent
// twice with the same UUID; one instance fails at random after its business write. The Outbox
// publishes to JetStream, and a wrapped downstream handler consumes what it publishes. Every
// business change must happen exactly once.
func TestE2ENATSJetStream(t *testing.T) {
	const (
		n           = 100
		dupPercent  = 20
		failPercent = 20
		// JetStream stream names cannot contain '.', and watermill-nats names the stream after the topic.
		ordersTopic = "orders_placed"
		stockTopic  = "stock_reserved"
		consumer    = "reserve-stock"
	)
	start := time.Now()
	e := newEnv(t)
	if _, err := e.db.Exec(`CREATE TABLE reserved (message_id text NOT NULL, instance text NOT NULL)`); err != nil {
		t.Fatal(err)
	}
	if _, err := e.db.Exec(`CREATE TABLE notified (message_id text NOT NULL, causation_id text NOT NULL)`); err != nil {
		t.Fatal(err)
	}
	logs := &logtest.Errors{}
	ns := natstest.Start(t)
	js, err := natstest.Conn(t, ns, "admin").JetStream()
	if err != nil {
		t.Fatal(err)
	}
	natstest.AddStreams(t, js, ordersTopic, stockTopic)
	newPublisher := func(name string) *wnats.Publisher { return natstest.Publisher(t, ns, name, logs) }
	newSubscriber := func(durable string) *wnats.Subscriber {
		return natstest.Subscriber(t, ns, durable, 30*time.Second, logs)
	}
	// copies counts what a handler receives before the middleware deduplicates it.
	var copiesMu sync.Mutex
	copies := map[string]map[string]int{}
	countCopies := func(name string) message.HandlerMiddleware {
		return func(next message.HandlerFunc) message.HandlerFunc {
			return func(msg *message.Message) ([]*message.Message, error) {
				copiesMu.Lock()
				if copies[name] == nil {
					copies[name] = map[string]int{}
				}
				copies[name][msg.UUID]++
				copiesMu.Unlock()
				return next(msg)
			}
		}
	}

	notifyDurable := "notify"
	notifyOb := e.newOutbox(withPublisher(newPublisher("notify-outbox")), routertest.WithLogger(logs))
	routertest.RunOutbox(t, notifyOb)
	notifyRouter := routertest.NewRouter(t, logs)
	notifyRouter.AddConsumerHandler("notify", stockTopic, newSubscriber(notifyDurable), func(msg *message.Message) error {
		ctx := msg.Context()
		_, err := outbox.Tx(ctx).ExecContext(ctx, `INSERT INTO notified (message_id, causation_id) VALUES ($1, $2)`,
			msg.UUID, msg.Metadata.Get(outbox.MetadataCausationID))
		return err
	}).AddMiddleware(countCopies(notifyDurable), middleware.New(notifyOb))
	routertest.RunRouter(t, notifyRouter)

	var handlerCalls, injected atomic.Int32
	durables := []string{"reserve-stock-a", "reserve-stock-b"}
	for i, durable := range durables {
		flaky := i == len(durables)-1
		ob := e.newOutbox(withPublisher(newPublisher(durable+"-outbox")), routertest.WithLogger(logs))
		routertest.RunOutbox(t, ob)
		r := routertest.NewRouter(t, logs)
		r.AddConsumerHandler(consumer, ordersTopic, newSubscriber(durable),
			routertest.ReserveStock(durable, stockTopic, flaky, failPercent, &handlerCalls, &injected)).
			AddMiddleware(countCopies(durable), middleware.New(ob))
		routertest.RunRouter(t, r)
	}

	producer := newPublisher("producer")
	orders := routertest.Produce(t, n, dupPercent, func(m *message.Message) error { return producer.Publish(ordersTopic, m) })

	routertest.WaitUntil(t, "every order reserved once and notified", func() (bool, string) {
		reserved := e.count(`SELECT count(DISTINCT message_id) FROM reserved`)
		notified := e.count(`SELECT count(*) FROM notified`)
		return reserved == n && notified >= n, fmt.Sprintf("%d distinct orders reserved, %d notifications", reserved, notified)
	})
	// Settle: every durable has had every message delivered and acked, and no side effect is
	// pending. Once the reserve-stock durables are done nothing publishes to stockTopic any more,
	// so the notify durable's state is then final.
	routertest.WaitUntil(t, "every durable consumer caught up and no side effect pending", func() (bool, string) {
		for _, d := range durables {
			if ok, state := natstest.CaughtUp(js, ordersTopic, d); !ok {
				return false, state
			}
		}
		if p := e.pendingEffects(); p != 0 {
			return false, fmt.Sprintf("%d side effects pending", p)
		}
		return natstest.CaughtUp(js, stockTopic, notifyDurable)
	})

	routertest.MustEqual(t, "business rows (an order applied twice?)", e.count(`SELECT count(*) FROM reserved`), n)
	routertest.MustEqual(t, "distinct orders in the business table", e.count(`SELECT count(DISTINCT message_id) FROM reserved`), n)
	routertest.MustEqual(t, "reserved orders that were never produced", routertest.CountMissing(t, e.db, `SELECT message_id FROM reserved`, orders), 0)
	routertest.MustEqual(t, "downstream rows (a notification applied twice?)", e.count(`SELECT count(*) FROM notified`), n)
	routertest.MustEqual(t, "orders notified (causation ids)", e.count(`SELECT count(DISTINCT causation_id) FROM notified`), n)
	routertest.MustEqual(t, "processed rows of "+consumer, e.count(`SELECT count(*) FROM outbox_processed WHERE consumer = $1`, consumer), n)
	routertest.MustEqual(t, "processed rows of notify", e.count(`SELECT count(*) FROM outbox_processed WHERE consumer = 'notify'`), n)
	routertest.MustEqual(t, "stored "+stockTopic+" effects",
		e.count(`SELECT count(*) FROM all_effects WHERE source_consumer = $1 AND topic = $2`, consumer, stockTopic), n)
	routertest.MustEqual(t, "failed attempts counted by the framework",
		e.count(`SELECT coalesce(sum(attempts), 0) FROM outbox_attempts WHERE consumer = $1`, consumer), int(injected.Load()))

	copiesMu.Lock()
	delivered := copies[notifyDurable]
	deliveredCopies := 0
	for _, c := range delivered {
		deliveredCopies += c
	}
	perDurable := map[string]int{}
	for _, d := range durables {
		for _, c := range copies[d] {
			perDurable[d] += c
		}
		// Each durable sees every copy the producer sent (more when a failed attempt is redelivered).
		if len(copies[d]) != n || perDurable[d] < n+n*dupPercent/100 {
			t.Errorf("durable %s received %d distinct orders in %d deliveries, want %d in at least %d",
				d, len(copies[d]), perDurable[d], n, n+n*dupPercent/100)
		}
	}
	copiesMu.Unlock()
	routertest.MustEqual(t, "distinct "+stockTopic+" UUIDs delivered downstream", len(delivered), n)
	routertest.MustEqual(t, "delivered "+stockTopic+" UUIDs that are not committed effects",
		routertest.CountMissing(t, e.db, `SELECT uuid FROM all_effects WHERE source_consumer = 'reserve-stock'`, routertest.Keys(delivered)), 0)
	stream, err := js.StreamInfo(stockTopic)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("%d orders (+%d duplicates) x %d instances: %d handler calls, %d injected failures, deliveries per durable %v",
		n, n*dupPercent/100, len(durables), handlerCalls.Load(), injected.Load(), perDurable)
	t.Logf("%s: %d messages in the stream, %d deliveries of %d distinct UUIDs downstream; %s",
		stockTopic, stream.State.Msgs, deliveredCopies, len(delivered), fmt.Sprintf("%d errors logged by the Routers", len(logs.Lines())))
	if unexpected := routertest.Unexpected(logs); len(unexpected) > 0 {
		t.Errorf("unexpected errors logged: %s", strings.Join(unexpected, "\n"))
	}
	t.Logf("took %s", time.Since(start).Round(time.Millisecond))
}

func withPublisher(pub message.Publisher) func(*outbox.Config) {
	return func(c *outbox.Config) { c.Publisher = pub }
}
