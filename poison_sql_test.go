package outbox_test

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
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

var errNoSuchSKU = errors.New("no such SKU")

// TestPoisonAmongOrderedMessagesOnWatermillSQL: a watermill-sql consumer group reads in order, so
// a message nacked for ever holds up every message behind it. With the default configuration
// (dead letters stored, no PoisonTopic), poison messages ahead of and among the orders, one of
// them sent twice, with two subscribers of the group (each its own Outbox): every order is
// applied once, each poison message is exactly one dead letter with its payload, reason, consumer
// and topic, nothing of it is applied, and the group reads to the end of the topic.
func TestPoisonAmongOrderedMessagesOnWatermillSQL(t *testing.T) {
	const (
		topic    = "orders.poison"
		consumer = "reserve"
		n        = 60
	)
	e := newEnv(t)
	e.initTopics(topic)
	logs := &logtest.Errors{}
	r := routertest.NewRouter(t, logs)
	for i := 0; i < 2; i++ {
		ob := e.newOutbox(routertest.WithLogger(logs), func(c *outbox.Config) {
			c.RetryDelay, c.RetryDelayMax = 20*time.Millisecond, 200*time.Millisecond
		})
		routertest.RunOutbox(t, ob)
		r.AddConsumerHandler(fmt.Sprintf("%s-%d", consumer, i), topic, newSQLSubscriber(t, e.db, consumer, topic), func(msg *message.Message) error {
			ctx := msg.Context()
			var o struct{ SKU string }
			if err := json.Unmarshal(msg.Payload, &o); err != nil {
				return outbox.Permanent(fmt.Errorf("decode order %s: %w", msg.UUID, err))
			}
			if _, err := outbox.Tx(ctx).ExecContext(ctx, `INSERT INTO applied (message_id) VALUES ($1)`, msg.UUID); err != nil {
				return err
			}
			if o.SKU != "" {
				return fmt.Errorf("order %s: %w %q", msg.UUID, errNoSuchSKU, o.SKU)
			}
			return nil
		}).AddMiddleware(middleware.New(ob, middleware.WithConsumer(consumer)))
	}
	routertest.RunRouter(t, r)

	payloads := map[string][]byte{}
	orders := make([]string, n)
	for i := range orders {
		orders[i] = uuid.NewString()
		payloads[orders[i]] = []byte(`{}`)
	}
	poison := make([]string, 4)
	for i := range poison {
		poison[i] = uuid.NewString()
		payloads[poison[i]] = []byte(`{"sku":`) // cut short
		if i%2 == 1 {
			payloads[poison[i]] = []byte(`{"sku":"gone"}`)
		}
	}
	sends := append(append([]string(nil), poison[:2]...), orders...)
	for j, id := range append(poison[2:], poison[0]) {
		at := (j + 1) * len(sends) / 4
		sends = append(sends[:at], append([]string{id}, sends[at:]...)...)
	}
	producer, err := wsql.NewPublisher(e.db, wsql.PublisherConfig{SchemaAdapter: brokerSchema()}, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	for _, id := range sends {
		if err := producer.Publish(topic, message.NewMessage(id, payloads[id])); err != nil {
			t.Fatal(err)
		}
	}

	routertest.WaitUntil(t, "every order applied, every poison message dead-lettered, the group at the end of the topic", func() (bool, string) {
		applied := e.count(`SELECT count(DISTINCT message_id) FROM applied`)
		dead := e.count(`SELECT count(*) FROM outbox_dead_letters`)
		state := fmt.Sprintf("%d of %d orders applied, %d of %d poison messages dead-lettered", applied, n, dead, len(poison))
		if applied < n || dead < len(poison) {
			return false, state
		}
		ok, s := sqlCaughtUp(t, e.db, topic, consumer)
		return ok, state + "; " + s
	})

	mustEqual(t, "business rows (an order applied twice, or a poison message applied?)", e.count(`SELECT count(*) FROM applied`), n)
	mustEqual(t, "orders never produced in the business table", routertest.CountMissing(t, e.db, `SELECT message_id FROM applied`, orders), 0)
	dead, err := e.ob.DeadLetters(context.Background(), outbox.DeadLetterFilter{Limit: 1000})
	if err != nil {
		t.Fatal(err)
	}
	mustEqual(t, "dead letters (one dead-lettered twice, or an order?)", len(dead), len(poison))
	byID := map[string]outbox.DeadLetter{}
	for _, d := range dead {
		byID[d.MessageID] = d
	}
	for i, id := range poison {
		d, ok := byID[id]
		permanent, want := i%2 == 0, "decode order"
		if !permanent {
			want = errNoSuchSKU.Error()
		}
		if !ok || d.Consumer != consumer || d.SourceTopic != topic || !bytes.Equal(d.Payload, payloads[id]) ||
			!strings.Contains(d.Reason, want) || d.Permanent != permanent || d.State != outbox.DeadLetterDead {
			t.Errorf("poison message %s: dead letter %t, consumer %q, topic %q, payload %q, reason %q, permanent %t, state %q; want %q, %q, %q, a reason with %q, permanent %t, dead",
				id, ok, d.Consumer, d.SourceTopic, d.Payload, d.Reason, d.Permanent, d.State, consumer, topic, payloads[id], want, permanent)
		}
	}
}
