package middleware_test

import (
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	wmw "github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"

	"github.com/watermill-outbox/outbox"
	"github.com/watermill-outbox/outbox/drivers/postgres"
	"github.com/watermill-outbox/outbox/internal/pgtest"
	"github.com/watermill-outbox/outbox/middleware"
)

// TestCheckRouter: the orders in which Watermill's Retry, PoisonQueue and InstantAck break the
// guarantee are reported; the safe orders are not.
func TestCheckRouter(t *testing.T) {
	pubSub := gochannel.NewGoChannel(gochannel.Config{}, watermill.NopLogger{})
	defer pubSub.Close()
	ob, err := outbox.New(outbox.Config{DB: pgtest.DB(t), Driver: postgres.Driver{}, Publisher: pubSub})
	if err != nil {
		t.Fatal(err)
	}
	poison, err := wmw.PoisonQueue(pubSub, "poison")
	if err != nil {
		t.Fatal(err)
	}
	retry := wmw.Retry{MaxRetries: 3, InitialInterval: time.Millisecond}.Middleware
	noop := func(*message.Message) error { return nil }
	for _, c := range []struct {
		name  string
		build func(r *message.Router)
		want  []string // "" for safe
	}{
		{"handler-level outbox after the Router's Retry and PoisonQueue", func(r *message.Router) {
			r.AddMiddleware(retry, poison)
			r.AddConsumerHandler("h", "in", pubSub, noop).AddMiddleware(middleware.New(ob))
		}, nil},
		{"Router-level outbox added last", func(r *message.Router) {
			r.AddMiddleware(wmw.Recoverer, retry, middleware.New(ob))
			r.AddConsumerHandler("h", "in", pubSub, noop)
		}, nil},
		{"Retry added to the Router after the handler's outbox", func(r *message.Router) {
			r.AddConsumerHandler("h", "in", pubSub, noop).AddMiddleware(middleware.New(ob))
			r.AddMiddleware(retry)
		}, []string{`handler "h": Retry runs inside the outbox middleware`}},
		{"PoisonQueue on the handler after the outbox", func(r *message.Router) {
			h := r.AddConsumerHandler("h", "in", pubSub, noop)
			h.AddMiddleware(middleware.New(ob), poison)
		}, []string{`handler "h": PoisonQueue runs inside the outbox middleware`}},
		{"Router-level outbox before Retry", func(r *message.Router) {
			r.AddMiddleware(middleware.New(ob), retry)
			r.AddConsumerHandler("h", "in", pubSub, noop)
		}, []string{`the Router: Retry runs inside the outbox middleware`}},
		{"Duplicator on the handler after the outbox", func(r *message.Router) {
			r.AddConsumerHandler("h", "in", pubSub, noop).AddMiddleware(middleware.New(ob), wmw.Duplicator)
		}, []string{`handler "h": Duplicator runs inside the outbox middleware`}},
		{"the outbox on the Router and on the handler", func(r *message.Router) {
			r.AddMiddleware(middleware.New(ob))
			r.AddConsumerHandler("h", "in", pubSub, noop).AddMiddleware(middleware.New(ob))
		}, []string{`handler "h": the outbox middleware is applied twice`}},
		{"InstantAck anywhere", func(r *message.Router) {
			r.AddMiddleware(wmw.InstantAck)
			r.AddConsumerHandler("h", "in", pubSub, noop).AddMiddleware(middleware.New(ob))
		}, []string{"InstantAck acks messages before their unit of work commits"}},
	} {
		t.Run(c.name, func(t *testing.T) {
			r, err := message.NewRouter(message.RouterConfig{}, watermill.NopLogger{})
			if err != nil {
				t.Fatal(err)
			}
			c.build(r)
			err = middleware.CheckRouter(r)
			if len(c.want) == 0 {
				if err != nil {
					t.Fatalf("a safe order was reported: %v", err)
				}
				return
			}
			if !errors.Is(err, middleware.ErrUnsafeMiddlewareOrder) {
				t.Fatalf("want ErrUnsafeMiddlewareOrder, got %v", err)
			}
			for _, w := range c.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("the report %q does not say %q", err, w)
				}
			}
		})
	}
}
