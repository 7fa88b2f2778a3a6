package outbox_test

import (
	"errors"
	"math/rand/v2"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wsql "github.com/ThreeDotsLabs/watermill-sql/v3/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"

	"github.com/watermill-outbox/outbox"
	"github.com/watermill-outbox/outbox/internal/routertest"
	"github.com/watermill-outbox/outbox/middleware"
)

// flakyBroker fails a share of Publish calls before sending and a share after sending (the broker
// took the messages, the acknowledgement was lost).
type flakyBroker struct {
	next          message.Publisher
	before, after int // percent
	mu            sync.Mutex
	r             *rand.Rand
}

func (p *flakyBroker) Publish(topic string, msgs ...*message.Message) error {
	p.mu.Lock()
	n := p.r.IntN(100)
	p.mu.Unlock()
	switch {
	case n < p.before:
		return errors.New("broker unavailable")
	case n < p.before+p.after:
		if err := p.next.Publish(topic, msgs...); err != nil {
			return err
		}
		return errors.New("acknowledgement lost")
	}
	return p.next.Publish(topic, msgs...)
}

func (p *flakyBroker) Close() error { return nil }

// runSerialGroups sends n orders through three Routers whose watermill-sql consumer groups deliver
// one message at a time (as Kafka partitions do), all three the same consumer identity, with a
// publisher that fails before sending in before% of the calls and after sending in after%. It
// waits until every order is applied once and every side effect is on the wire, checks that,
// and returns how long the orders took.
func runSerialGroups(t testing.TB, n, before, after int, duplicateWait time.Duration) time.Duration {
	const (
		ordersTopic = "orders.serial"
		stockTopic  = "stock.serial"
		consumer    = "reserve-stock"
	)
	e := newEnv(t)
	e.initTopics(ordersTopic, stockTopic)
	mustExec(t, e, `CREATE TABLE reserved (message_id text NOT NULL)`)
	groups := []string{"group-a", "group-b", "group-c"}
	for i, group := range groups {
		real, err := wsql.NewPublisher(e.db, wsql.PublisherConfig{SchemaAdapter: brokerSchema()}, watermill.NopLogger{})
		if err != nil {
			t.Fatal(err)
		}
		ob := e.newOutbox(func(c *outbox.Config) {
			c.Publisher = &flakyBroker{next: real, before: before, after: after, r: rand.New(rand.NewPCG(uint64(i), 7))}
			c.DuplicateWait = duplicateWait
		})
		routertest.RunOutbox(t, ob)
		r, err := message.NewRouter(message.RouterConfig{CloseTimeout: 30 * time.Second}, watermill.NopLogger{})
		if err != nil {
			t.Fatal(err)
		}
		r.AddConsumerHandler(consumer, ordersTopic, newSQLSubscriber(t, e.db, group, ordersTopic), func(msg *message.Message) error {
			ctx := msg.Context()
			if _, err := outbox.Tx(ctx).ExecContext(ctx, `INSERT INTO reserved (message_id) VALUES ($1)`, msg.UUID); err != nil {
				return err
			}
			return outbox.Publish(ctx, stockTopic, message.NewMessage(uuid.NewString(), []byte(msg.UUID)))
		}).AddMiddleware(middleware.New(ob))
		routertest.RunRouter(t, r)
	}
	producer, err := wsql.NewPublisher(e.db, wsql.PublisherConfig{SchemaAdapter: brokerSchema()}, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	for i := 0; i < n; i++ {
		if err := producer.Publish(ordersTopic, message.NewMessage(uuid.NewString(), nil)); err != nil {
			t.Fatal(err)
		}
	}
	deadline := time.Now().Add(routertest.Timeout)
	for {
		caught, state := sqlCaughtUp(t, e.db, ordersTopic, groups...)
		if caught && e.count(`SELECT count(*) FROM reserved`) == n {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("after %s: %d of %d orders applied; %s", routertest.Timeout, e.count(`SELECT count(*) FROM reserved`), n, state)
		}
		time.Sleep(20 * time.Millisecond)
	}
	took := time.Since(start)
	waitWithin(t, routertest.Timeout, "every side effect dispatched", func() bool { return e.pendingEffects() == 0 })
	if got := e.count(`SELECT count(DISTINCT message_id) FROM reserved`); got != n {
		t.Fatalf("distinct orders applied: %d, want %d", got, n)
	}
	wire := e.wire(stockTopic)
	if len(wire) != n {
		t.Fatalf("distinct messages on the wire: %d, want %d (one UUID per order)", len(wire), n)
	}
	return took
}

// TestSerialConsumersUnderPublishFaults: with serial consumer groups and a publisher that fails
// 10% of its calls before sending and 10% after, every order is applied once and every effect sent
// with one UUID. DuplicateWait is an hour: a redelivery that waited for an original known to have
// failed would not finish within the test.
func TestSerialConsumersUnderPublishFaults(t *testing.T) {
	took := runSerialGroups(t, 300, 10, 10, time.Hour)
	t.Logf("300 orders x 3 serial consumer groups under publish faults: %s", took.Round(time.Millisecond))
}

// BenchmarkSerialConsumersUnderPublishFaults runs the same orders without faults and with 10%
// of the Publish calls failing before sending and 10% after, interleaved, and reports how much
// longer the faulty runs took (target: under 2x).
func BenchmarkSerialConsumersUnderPublishFaults(b *testing.B) {
	const n = 300
	var clean, faulty time.Duration
	for i := 0; i < b.N; i++ {
		clean += runSerialGroups(b, n, 0, 0, time.Second)
		faulty += runSerialGroups(b, n, 10, 10, time.Second)
	}
	b.ReportMetric(float64(n*b.N)/clean.Seconds(), "orders/s-fault-free")
	b.ReportMetric(float64(n*b.N)/faulty.Seconds(), "orders/s-faulty")
	b.ReportMetric(faulty.Seconds()/clean.Seconds(), "faulty/fault-free")
}
