package middleware_test

import (
	"context"
	"database/sql"
	"errors"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wsql "github.com/ThreeDotsLabs/watermill-sql/v3/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"

	"github.com/watermill-outbox/outbox"
	"github.com/watermill-outbox/outbox/drivers/postgres"
	"github.com/watermill-outbox/outbox/internal/pgtest"
	"github.com/watermill-outbox/outbox/middleware"
)

func TestMain(m *testing.M) { os.Exit(pgtest.Run(m)) }

var schema = wsql.DefaultPostgreSQLSchema{GeneratePayloadType: func(string) string { return "BYTEA" }}

type harness struct {
	db  *sql.DB
	pub *wsql.Publisher
	ob  *outbox.Outbox

	mu    sync.Mutex
	calls map[string]int // handler name -> calls
}

func newHarness(t *testing.T, topics ...string) *harness {
	t.Helper()
	db := pgtest.DB(t)
	for _, topic := range topics {
		for _, q := range schema.SchemaInitializingQueries(topic) {
			if _, err := db.Exec(q.Query, q.Args...); err != nil {
				t.Fatal(err)
			}
		}
	}
	pub, err := wsql.NewPublisher(db, wsql.PublisherConfig{SchemaAdapter: schema}, nil)
	if err != nil {
		t.Fatal(err)
	}
	ob, err := outbox.New(outbox.Config{DB: db, Driver: postgres.Driver{}, Publisher: pub})
	if err != nil {
		t.Fatal(err)
	}
	if err := ob.Migrate(context.Background()); err != nil {
		t.Fatal(err)
	}
	return &harness{db: db, pub: pub, ob: ob, calls: map[string]int{}}
}

func (h *harness) handler(name string) message.NoPublishHandlerFunc {
	return func(msg *message.Message) error {
		h.mu.Lock()
		h.calls[name]++
		h.mu.Unlock()
		ctx := msg.Context()
		_, err := outbox.Tx(ctx).ExecContext(ctx, `SELECT 1`)
		return err
	}
}

func (h *harness) callCount(name string) int {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.calls[name]
}

// route runs a Router until every message of topic was acked by each handler's consumer group.
func (h *harness) route(t *testing.T, topic string, add func(r *message.Router, sub func(group string) message.Subscriber)) {
	t.Helper()
	r, err := message.NewRouter(message.RouterConfig{}, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	var groups []string
	add(r, func(group string) message.Subscriber {
		groups = append(groups, group)
		sub, err := wsql.NewSubscriber(h.db, wsql.SubscriberConfig{
			ConsumerGroup: group, SchemaAdapter: schema, OffsetsAdapter: wsql.DefaultPostgreSQLOffsetsAdapter{},
			InitializeSchema: true, PollInterval: 10 * time.Millisecond, ResendInterval: 20 * time.Millisecond,
		}, nil)
		if err != nil {
			t.Fatal(err)
		}
		if err := sub.SubscribeInitialize(topic); err != nil {
			t.Fatal(err)
		}
		return sub
	})
	done := make(chan error)
	go func() { done <- r.Run(context.Background()) }()
	<-r.Running()
	deadline := time.Now().Add(30 * time.Second)
	for _, g := range groups {
		for {
			var behind bool
			err := h.db.QueryRow(`SELECT coalesce((SELECT max("offset") FROM "watermill_`+topic+`"), 0) >
				coalesce((SELECT max(offset_acked) FROM "watermill_offsets_`+topic+`" WHERE consumer_group = $1), 0)`, g).Scan(&behind)
			if err != nil {
				t.Fatal(err)
			}
			if !behind {
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("consumer group %s did not catch up", g)
			}
			time.Sleep(10 * time.Millisecond)
		}
	}
	if err := r.Close(); err != nil {
		t.Fatal(err)
	}
	if err := <-done; err != nil {
		t.Fatal(err)
	}
}

func (h *harness) publish(t *testing.T, topic string, msgs ...*message.Message) {
	t.Helper()
	if err := h.pub.Publish(topic, msgs...); err != nil {
		t.Fatal(err)
	}
}

func TestDefaultConsumerIsTheHandlerName(t *testing.T) {
	h := newHarness(t, "in")
	m := message.NewMessage(uuid.NewString(), nil)
	h.publish(t, "in", m, m.Copy()) // a redelivered copy
	h.route(t, "in", func(r *message.Router, sub func(string) message.Subscriber) {
		r.AddConsumerHandler("reserve", "in", sub("g1"), h.handler("reserve")).AddMiddleware(middleware.New(h.ob))
		r.AddConsumerHandler("notify", "in", sub("g2"), h.handler("notify")).AddMiddleware(middleware.New(h.ob))
	})
	if h.callCount("reserve") != 1 || h.callCount("notify") != 1 {
		t.Fatalf("each consumer must run once: %v", h.calls)
	}
	var consumers int
	if err := h.db.QueryRow(`SELECT count(DISTINCT consumer) FROM outbox_processed WHERE consumer IN ('reserve', 'notify')`).Scan(&consumers); err != nil {
		t.Fatal(err)
	}
	if consumers != 2 {
		t.Fatalf("claims under %d consumer names, want 2", consumers)
	}
}

func TestWithConsumerSharesTheIdentity(t *testing.T) {
	h := newHarness(t, "in")
	h.publish(t, "in", message.NewMessage(uuid.NewString(), nil))
	h.route(t, "in", func(r *message.Router, sub func(string) message.Subscriber) {
		shared := middleware.New(h.ob, middleware.WithConsumer("stock"))
		r.AddConsumerHandler("a", "in", sub("g1"), h.handler("a")).AddMiddleware(shared)
		r.AddConsumerHandler("b", "in", sub("g2"), h.handler("b")).AddMiddleware(shared)
	})
	if got := h.callCount("a") + h.callCount("b"); got != 1 {
		t.Fatalf("one shared consumer identity must run the message once, ran %d times", got)
	}
}

func TestWithMessageIDDeduplicatesByBusinessKey(t *testing.T) {
	h := newHarness(t, "in", "in_poison")
	for i := 0; i < 3; i++ { // three producers' messages about one order, with different UUIDs
		m := message.NewMessage(uuid.NewString(), nil)
		m.Metadata.Set("order_id", "order-1")
		h.publish(t, "in", m)
	}
	noKey := message.NewMessage(uuid.NewString(), nil)
	h.publish(t, "in", noKey)
	byOrder := middleware.WithMessageID(func(m *message.Message) (string, error) {
		if id := m.Metadata.Get("order_id"); id != "" {
			return id, nil
		}
		return "", errors.New("no order_id")
	})
	ob, err := outbox.New(outbox.Config{DB: h.db, Driver: postgres.Driver{}, Publisher: h.pub, PoisonTopic: "in_poison"})
	if err != nil {
		t.Fatal(err)
	}
	h.route(t, "in", func(r *message.Router, sub func(string) message.Subscriber) {
		r.AddConsumerHandler("orders", "in", sub("g1"), h.handler("orders")).AddMiddleware(middleware.New(ob, byOrder))
	})
	if got := h.callCount("orders"); got != 1 {
		t.Fatalf("messages with one business key ran %d times, want 1", got)
	}
	// The message without a key could not be deduplicated: it went to the poison topic, not nowhere.
	var n int
	if err := h.db.QueryRow(`SELECT count(*) FROM watermill_in_poison WHERE uuid = $1`, noKey.UUID).Scan(&n); err != nil {
		t.Fatal(err)
	}
	if n != 1 {
		t.Fatalf("message without a key on the poison topic: %d, want 1", n)
	}
}

// A WithRefusal check that panics refuses the message, as its error would: here to the poison
// topic, and the next message is handled. Unrecovered, the panic crashed the process (or, under
// a Recoverer, nacked the message for ever).
func TestWithRefusalThatPanicsRefuses(t *testing.T) {
	h := newHarness(t, "in", "in_poison")
	bad, good := message.NewMessage(uuid.NewString(), nil), message.NewMessage(uuid.NewString(), nil)
	bad.Metadata.Set("tenant", "unknown")
	h.publish(t, "in", bad)
	h.publish(t, "in", good)
	refuse := middleware.WithRefusal(func(m *message.Message) error {
		if m.Metadata.Get("tenant") == "unknown" {
			panic("no such tenant")
		}
		return nil
	})
	ob, err := outbox.New(outbox.Config{DB: h.db, Driver: postgres.Driver{}, Publisher: h.pub, PoisonTopic: "in_poison"})
	if err != nil {
		t.Fatal(err)
	}
	h.route(t, "in", func(r *message.Router, sub func(string) message.Subscriber) {
		r.AddConsumerHandler("orders", "in", sub("g1"), h.handler("orders")).AddMiddleware(middleware.New(ob, refuse))
	})
	if got := h.callCount("orders"); got != 1 {
		t.Errorf("handler ran %d times, want once (the good message)", got)
	}
	var reason string
	if err := h.db.QueryRow(`SELECT metadata::text FROM watermill_in_poison WHERE uuid = $1`, bad.UUID).Scan(&reason); err != nil {
		t.Fatalf("the message whose check panicked is not on the poison topic: %v", err)
	}
	if !strings.Contains(reason, "panicked") {
		t.Errorf("its poison copy's metadata %s does not say the check panicked", reason)
	}
}

func TestNoHandlerNameIsAnError(t *testing.T) {
	h := newHarness(t)
	mw := middleware.New(h.ob)
	_, err := mw(func(*message.Message) ([]*message.Message, error) { return nil, nil })(message.NewMessage(uuid.NewString(), nil))
	if !errors.Is(err, outbox.ErrNoConsumerName) {
		t.Fatalf("want ErrNoConsumerName outside a Router, got %v", err)
	}
}
