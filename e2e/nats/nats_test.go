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
	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"

	"github.com/watermill-outbox/outbox"
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
	ns := startNATS(t)

	js, err := natsConn(t, ns, "admin").JetStream()
	if err != nil {
		t.Fatal(err)
	}
	// Create the streams up front rather than letting every publisher and subscriber race to.
	for _, topic := range []string{ordersTopic, stockTopic} {
		if _, err := js.AddStream(&nats.StreamConfig{Name: topic, Subjects: []string{topic}, Storage: nats.FileStorage}); err != nil {
			t.Fatal(err)
		}
	}
	newPublisher := func(name string) *wnats.Publisher {
		pub, err := wnats.NewPublisherWithNatsConn(natsConn(t, ns, name), wnats.PublisherPublishConfig{
			Marshaler:         &wnats.NATSMarshaler{},
			SubjectCalculator: wnats.DefaultSubjectCalculator,
			// TrackMsgId stays off: JetStream's own duplicate window (Nats-Msg-Id) would drop the
			// producer's duplicates and the Outbox's re-sends, and hide what the framework must absorb.
			JetStream: wnats.JetStreamConfig{TrackMsgId: false},
		}, logs)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = pub.Close() })
		return pub
	}
	newSubscriber := func(durable string) *wnats.Subscriber {
		sub, err := wnats.NewSubscriberWithNatsConn(natsConn(t, ns, durable), wnats.SubscriberSubscriptionConfig{
			Unmarshaler:      &wnats.NATSMarshaler{},
			SubscribersCount: 1,
			AckWaitTimeout:   30 * time.Second,
			CloseTimeout:     30 * time.Second,
			SubscribeTimeout: 30 * time.Second,
			QueueGroupPrefix: durable, // a queue subscription's deliver group must equal its durable
			NakDelay:         wnats.NewStaticDelay(50 * time.Millisecond),
			JetStream: wnats.JetStreamConfig{
				DurablePrefix: durable,
				SubscribeOptions: []nats.SubOpt{
					// As in the example (examples/order-processing/broker.go): without ManualAck the
					// client acks every message its callback returns from, also one the subscriber
					// gave up on, and a failed delivery would never come back.
					nats.ManualAck(),
					nats.AckExplicit(),
					nats.DeliverAll(),
					nats.AckWait(30 * time.Second),
					nats.MaxAckPending(64),
				},
			},
		}, logs)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = sub.Close() }) // the Router closes it first; a second Close is a no-op
		return sub
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
			if ok, state := jsCaughtUp(t, js, ordersTopic, d); !ok {
				return false, state
			}
		}
		if p := e.pendingEffects(); p != 0 {
			return false, fmt.Sprintf("%d side effects pending", p)
		}
		return jsCaughtUp(t, js, stockTopic, notifyDurable)
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

// startNATS runs an in-process NATS server with JetStream that accepts only in-process
// connections, and shuts it down when the test ends.
func startNATS(t *testing.T) *server.Server {
	t.Helper()
	ns, err := server.NewServer(&server.Options{
		JetStream:  true,
		StoreDir:   t.TempDir(),
		DontListen: true, // clients connect with nats.InProcessServer: no port to pick or leak
		NoLog:      true,
		NoSigs:     true,
	})
	if err != nil {
		t.Fatal(err)
	}
	go ns.Start()
	t.Cleanup(func() {
		ns.Shutdown()
		ns.WaitForShutdown()
	})
	if !ns.ReadyForConnections(10 * time.Second) {
		t.Fatal("NATS server not ready for connections after 10s")
	}
	return ns
}

// natsConn returns an in-process connection to ns. At the end of the test it waits for a drain in
// progress (a closed watermill-nats subscriber drains its connection asynchronously), closes the
// connection, and waits until it is closed, so that no client goroutine outlives the test.
func natsConn(t *testing.T, ns *server.Server, name string) *nats.Conn {
	t.Helper()
	closed := make(chan struct{})
	nc, err := nats.Connect("", nats.InProcessServer(ns), nats.Name(name),
		nats.ClosedHandler(func(*nats.Conn) { close(closed) }))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if nc.IsDraining() {
			select {
			case <-closed:
			case <-time.After(routertest.Timeout):
				t.Errorf("NATS connection %s still draining after %s", name, routertest.Timeout)
			}
		}
		nc.Close()
		select {
		case <-closed:
		case <-time.After(routertest.Timeout):
			t.Errorf("NATS connection %s not closed after %s", name, routertest.Timeout)
		}
	})
	return nc
}

// jsCaughtUp reports whether the durable consumer of stream has had every message delivered and acked.
func jsCaughtUp(t *testing.T, js nats.JetStreamContext, stream, durable string) (bool, string) {
	t.Helper()
	info, err := js.ConsumerInfo(stream, durable)
	if err != nil {
		t.Fatalf("consumer info %s/%s: %v", stream, durable, err)
	}
	if info.NumPending != 0 || info.NumAckPending != 0 {
		return false, fmt.Sprintf("%s/%s: %d undelivered, %d unacked, %d redelivered",
			stream, durable, info.NumPending, info.NumAckPending, info.NumRedelivered)
	}
	return true, ""
}

func withPublisher(pub message.Publisher) func(*outbox.Config) {
	return func(c *outbox.Config) { c.Publisher = pub }
}
