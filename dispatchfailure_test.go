package outbox_test

import (
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
	"github.com/watermill-outbox/outbox/internal/routertest"
	"github.com/watermill-outbox/outbox/middleware"
)

// refusingPublisher is the real publisher with one topic the broker refuses.
type refusingPublisher struct {
	message.Publisher
	topic string
}

func (p refusingPublisher) Publish(topic string, msgs ...*message.Message) error {
	if topic == p.topic {
		return errors.New("message refused by the broker (test)")
	}
	return p.Publisher.Publish(topic, msgs...)
}

// runRefusedTopic runs a consumer on an ordered broker (a watermill-sql consumer group) over n
// messages, every fifth of which also publishes to a topic the broker refuses, and returns how
// many it processed within window, how long all n took (0: not within window), and how many
// effects on the refused topic are committed and pending.
func runRefusedTopic(t *testing.T, policy outbox.DispatchFailurePolicy, n int, window time.Duration) (int, time.Duration, int) {
	const in, refused = "orders_in", "refused"
	e := newEnv(t, func(c *outbox.Config) { c.AfterDispatchFailure = policy })
	e.initTopics(in, refused)
	ob := e.newOutbox(func(c *outbox.Config) {
		c.AfterDispatchFailure = policy
		c.Publisher = refusingPublisher{Publisher: e.pub, topic: refused}
		c.RelayInterval = 100 * time.Millisecond
	})
	routertest.RunOutbox(t, ob)
	r := routertest.NewRouter(t, watermill.NopLogger{})
	r.AddConsumerHandler("payment", in, newSQLSubscriber(t, e.db, "payment", in), func(msg *message.Message) error {
		ctx := msg.Context()
		if _, err := outbox.Tx(ctx).ExecContext(ctx, `INSERT INTO applied (message_id) VALUES ($1)`, msg.UUID); err != nil {
			return err
		}
		if err := outbox.Publish(ctx, "out_a", message.NewMessage(uuid.NewString(), msg.Payload)); err != nil {
			return err
		}
		if msg.Metadata.Get("refused") == "yes" {
			return outbox.Publish(ctx, refused, message.NewMessage(uuid.NewString(), msg.Payload))
		}
		return nil
	}).AddMiddleware(middleware.New(ob))

	pub, err := wsql.NewPublisher(e.db, wsql.PublisherConfig{SchemaAdapter: brokerSchema()}, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	for i := range n {
		m := message.NewMessage(uuid.NewString(), []byte(fmt.Sprint(i)))
		if i%5 == 0 {
			m.Metadata.Set("refused", "yes")
		}
		if err := pub.Publish(in, m); err != nil {
			t.Fatal(err)
		}
	}
	start := time.Now()
	routertest.RunRouter(t, r)
	processed := func() int {
		return e.count(`SELECT count(DISTINCT message_id) FROM applied`)
	}
	var all time.Duration
	for time.Since(start) < window {
		if processed() == n {
			all = time.Since(start)
			break
		}
		time.Sleep(20 * time.Millisecond)
	}
	return processed(), all, e.count(`SELECT count(*) FROM all_effects WHERE topic = $1 AND dispatched_at IS NULL`, refused)
}

// With one topic refusing publishes, a consumer that nacks after a failed dispatch retries the
// message with backoff and, on an ordered broker, handles nothing behind it; with
// AfterDispatchFailure = ack it handles every message at full speed, and the refused effects
// stay committed for the relay.
func TestAfterDispatchFailureAckKeepsTheConsumerGoing(t *testing.T) {
	const n, window = 100, 15 * time.Second
	done, took, pending := runRefusedTopic(t, outbox.DispatchFailureAck, n, window)
	if done != n {
		t.Fatalf("ack: %d of %d messages processed within %s, want all", done, n, window)
	}
	if pending != n/5 {
		t.Errorf("ack: %d effects on the refused topic pending, want %d: acked, their effects stay committed for the relay", pending, n/5)
	}
	t.Logf("ack: %d messages in %s (%.0f/s), one in five with an effect on a refused topic", n, took.Round(time.Millisecond), float64(n)/took.Seconds())

	nacked, _, _ := runRefusedTopic(t, outbox.DispatchFailureNack, n, 5*time.Second)
	t.Logf("nack: %d of %d messages processed in 5 s (%.1f/s)", nacked, n, float64(nacked)/5)
	if nacked >= n/2 {
		t.Errorf("nack: %d of %d messages processed in 5 s behind a refused topic; the test expects the ordered consumer held back", nacked, n)
	}
}

func TestAfterDispatchFailureValidated(t *testing.T) {
	err := outbox.Config{AfterDispatchFailure: "drop"}.Validate()
	if err == nil || !strings.Contains(err.Error(), "AfterDispatchFailure") || !strings.Contains(err.Error(), `"drop"`) {
		t.Errorf("Validate with AfterDispatchFailure \"drop\": %v, want an error naming the field and the value", err)
	}
}
