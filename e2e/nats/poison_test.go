package nats_test

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/nats-io/nats.go"

	"github.com/watermill-outbox/outbox"
	"github.com/watermill-outbox/outbox/e2e/internal/natstest"
	"github.com/watermill-outbox/outbox/internal/logtest"
	"github.com/watermill-outbox/outbox/internal/routertest"
	"github.com/watermill-outbox/outbox/middleware"
)

var errUnknownSKU = errors.New("no such SKU")

// TestE2ENATSJetStreamPoison: poison messages among orders on JetStream, with the default
// dead-letter configuration. Two instances of the consumer "reserve-stock" (each its own durable
// consumer, so each sees every message) read one message at a time, in order
// (MaxAckPending 1), so that a message nacked for ever would hold up every order behind it.
// Three poison messages come ahead of the orders and three among them, one of them twice; half
// cannot be decoded (a permanent error), half are refused after the handler's write every time.
// Every order must be applied once, each poison message must be exactly one dead letter (its
// payload, reason, consumer and topic) and be applied never, and both durables must catch up.
func TestE2ENATSJetStreamPoison(t *testing.T) {
	const (
		n           = 100
		ordersTopic = "orders_poison"
		stockTopic  = "stock_poison"
		consumer    = "reserve-stock"
	)
	start := time.Now()
	e := newEnv(t)
	if _, err := e.db.Exec(`CREATE TABLE reserved (message_id text NOT NULL, instance text NOT NULL)`); err != nil {
		t.Fatal(err)
	}
	logs := &logtest.Errors{}
	ns := natstest.Start(t)
	js, err := natstest.Conn(t, ns, "admin").JetStream()
	if err != nil {
		t.Fatal(err)
	}
	natstest.AddStreams(t, js, ordersTopic, stockTopic)
	durables := []string{"poison-a", "poison-b"}
	for _, durable := range durables {
		ob := e.newOutbox(withPublisher(natstest.Publisher(t, ns, durable+"-outbox", logs)), routertest.WithLogger(logs),
			func(c *outbox.Config) {
				c.RetryDelay, c.RetryDelayMax = 20*time.Millisecond, 200*time.Millisecond
				// The control: with OUTBOX_E2E_DEAD_LETTERS=off the test must fail.
				c.DeadLetters = outbox.DeadLetterPolicy(os.Getenv("OUTBOX_E2E_DEAD_LETTERS"))
			})
		routertest.RunOutbox(t, ob)
		r := routertest.NewRouter(t, logs)
		sub := natstest.Subscriber(t, ns, durable, 30*time.Second, logs, nats.MaxAckPending(1))
		r.AddConsumerHandler(consumer, ordersTopic, sub, func(msg *message.Message) error {
			ctx := msg.Context()
			var o struct{ SKU string }
			if err := json.Unmarshal(msg.Payload, &o); err != nil {
				return outbox.Permanent(fmt.Errorf("decode order %s: %w", msg.UUID, err))
			}
			if _, err := outbox.Tx(ctx).ExecContext(ctx, `INSERT INTO reserved (message_id, instance) VALUES ($1, $2)`, msg.UUID, durable); err != nil {
				return err
			}
			if o.SKU != "" {
				return fmt.Errorf("order %s: %w %q", msg.UUID, errUnknownSKU, o.SKU)
			}
			return outbox.Publish(ctx, stockTopic, message.NewMessage(uuid.NewString(), []byte(msg.UUID)))
		}).AddMiddleware(middleware.New(ob))
		routertest.RunRouter(t, r)
	}

	payloads := map[string][]byte{}
	orders := make([]string, n)
	for i := range orders {
		orders[i] = uuid.NewString()
		payloads[orders[i]] = []byte(`{"sku":""}`)
	}
	poison := make([]string, 6)
	for i := range poison {
		poison[i] = uuid.NewString()
		payloads[poison[i]] = []byte(`{"sku":`) // cut short
		if i%2 == 1 {
			payloads[poison[i]] = []byte(`{"sku":"gone"}`)
		}
	}
	sends := append(append([]string(nil), poison[:3]...), orders...)
	for j, id := range append(poison[3:], poison[0]) {
		at := (j + 1) * len(sends) / 5
		sends = append(sends[:at], append([]string{id}, sends[at:]...)...)
	}
	producer := natstest.Publisher(t, ns, "producer", logs)
	for _, id := range sends {
		if err := producer.Publish(ordersTopic, message.NewMessage(id, payloads[id])); err != nil {
			t.Fatal(err)
		}
	}

	routertest.WaitUntil(t, "every order applied, every poison message dead-lettered, both durables caught up", func() (bool, string) {
		applied := e.count(`SELECT count(DISTINCT message_id) FROM reserved`)
		dead := e.count(`SELECT count(*) FROM outbox_dead_letters`)
		state := fmt.Sprintf("%d of %d orders applied, %d of %d poison messages dead-lettered", applied, n, dead, len(poison))
		if applied < n || dead < len(poison) {
			return false, state
		}
		for _, d := range durables {
			if ok, s := natstest.CaughtUp(js, ordersTopic, d); !ok {
				return false, state + "; " + s
			}
		}
		return e.pendingEffects() == 0, state + "; side effects pending"
	})

	routertest.MustEqual(t, "business rows (an order applied twice, or a poison message applied?)", e.count(`SELECT count(*) FROM reserved`), n)
	routertest.MustEqual(t, "orders never produced in the business table", routertest.CountMissing(t, e.db, `SELECT message_id FROM reserved`, orders), 0)
	dead, err := e.obs[0].DeadLetters(context.Background(), outbox.DeadLetterFilter{Limit: 1000})
	if err != nil {
		t.Fatal(err)
	}
	routertest.MustEqual(t, "dead letters (one dead-lettered twice, or an order?)", len(dead), len(poison))
	byID := map[string]outbox.DeadLetter{}
	for _, d := range dead {
		byID[d.MessageID] = d
	}
	for i, id := range poison {
		d, ok := byID[id]
		permanent, want := i%2 == 0, "decode order"
		if !permanent {
			want = errUnknownSKU.Error()
		}
		if !ok || d.Consumer != consumer || d.SourceTopic != ordersTopic || !bytes.Equal(d.Payload, payloads[id]) ||
			!strings.Contains(d.Reason, want) || d.Permanent != permanent || d.State != outbox.DeadLetterDead {
			t.Errorf("poison message %s: dead letter %t, consumer %q, topic %q, payload %q, reason %q, permanent %t, state %q; want %q, %q, %q, a reason with %q, permanent %t, dead",
				id, ok, d.Consumer, d.SourceTopic, d.Payload, d.Reason, d.Permanent, d.State, consumer, ordersTopic, payloads[id], want, permanent)
		}
	}
	t.Logf("%d orders and %d poison messages (+1 sent twice) x %d durables, one message at a time: all applied once, each poison message one dead letter; %d errors logged; took %s",
		n, len(poison), len(durables), len(logs.Lines()), time.Since(start).Round(time.Millisecond))
}
