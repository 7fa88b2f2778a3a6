package main

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
)

// The broker-free comparison (-broker none): every contender's handler runs as a handler of a
// real Watermill Router, fed by feedSubscriber with the run's pre-generated deliveries, and
// publishes to a null publisher (no broker). The bare contenders and the framework take the same
// path (subscriber, Router, ack), so that what differs between them is the framework's own cost,
// not the broker's, which on this machine takes a large share of the CPUs.

// inTopic is the topic the Router's handlers subscribe to; feedSubscriber ignores it.
const inTopic = "bench_in"

// routerHandler is implemented by contenders whose handler is a Watermill handler already (the
// framework's consumer path: middleware.New around the business function): the Router runs
// that handler itself rather than a function calling handle.
type routerHandler interface {
	routerHandler() message.HandlerFunc
}

// routerHandler is the middleware-wrapped handler; nil on the boundary path, which has none.
func (c *framework) routerHandler() message.HandlerFunc {
	if c.boundary {
		return nil
	}
	return c.h
}

// routedResultKey carries a *routedResult in a delivered message's context: what the handler
// returned, which the Router's ack or nack does not say (a simulated crash must be told from an
// error).
type routedResultKey struct{}

type routedResult struct {
	async bool
	err   error
}

// feedSubscriber is a message.Subscriber that hands out the messages routed.handle gives it: the
// run's consumers are its partitions, each waiting for its message's ack or nack before taking
// the next delivery, as a broker's consumer with one message in flight per partition does.
type feedSubscriber struct {
	out  chan *message.Message
	once sync.Once
}

func (s *feedSubscriber) Subscribe(context.Context, string) (<-chan *message.Message, error) {
	return s.out, nil
}

// Close ends the subscription. The Router calls it when it closes, which is after the last run:
// no handle sends any more.
func (s *feedSubscriber) Close() error {
	s.once.Do(func() { close(s.out) })
	return nil
}

// routed is a contender whose deliveries go through its own Router.
type routed struct {
	contender
	sub    *feedSubscriber
	router *message.Router
	done   chan struct{}
}

// newRouted starts a Router with c's handler.
func newRouted(c contender) (*routed, error) {
	r := &routed{contender: c, sub: &feedSubscriber{out: make(chan *message.Message)}, done: make(chan struct{})}
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 30 * time.Second}, watermill.NopLogger{})
	if err != nil {
		return nil, err
	}
	var h message.NoPublishHandlerFunc
	if rh, ok := c.(routerHandler); ok && rh.routerHandler() != nil {
		wrapped := rh.routerHandler()
		h = func(msg *message.Message) error {
			_, err := wrapped(msg)
			msg.Context().Value(routedResultKey{}).(*routedResult).err = err
			return err
		}
	} else {
		h = func(msg *message.Message) error {
			res := msg.Context().Value(routedResultKey{}).(*routedResult)
			res.async, res.err = c.handle(msg.Context(), msg.Context().Value(deliveryKey{}).(delivery))
			return res.err
		}
	}
	router.AddConsumerHandler(c.name(), inTopic, r.sub, consumerGoroutine(h))
	r.router = router
	go func() { defer close(r.done); _ = router.Run(context.Background()) }()
	select {
	case <-router.Running():
		return r, nil
	case <-r.done:
		return nil, errors.New("router stopped while starting")
	case <-time.After(30 * time.Second):
		_ = router.Close()
		return nil, errors.New("router did not start within 30 s")
	}
}

// consumerGoroutine marks the goroutine the Router runs h in as a consumer goroutine while round
// trips are classified: a handler's round trips are written from there, not from the goroutine
// that handed the message to the Router.
func consumerGoroutine(h message.NoPublishHandlerFunc) message.NoPublishHandlerFunc {
	return func(msg *message.Message) error {
		if classifyRoundTrips.Load() {
			gid := goroutineID()
			consumerGoroutines.Store(gid, true)
			defer consumerGoroutines.Delete(gid)
		}
		return h(msg)
	}
}

// handle hands d to the Router and waits for the handler's ack or nack.
func (r *routed) handle(ctx context.Context, d delivery) (bool, error) {
	res := &routedResult{}
	msg := message.NewMessage(d.id, d.payload)
	mctx := context.WithValue(context.WithValue(ctx, deliveryKey{}, d), crashIDKey{}, d.id)
	msg.SetContext(context.WithValue(mctx, routedResultKey{}, res))
	select {
	case r.sub.out <- msg:
	case <-ctx.Done():
		return false, ctx.Err()
	}
	select {
	case <-msg.Acked():
		return res.async, nil
	case <-msg.Nacked():
		if res.err == nil {
			res.err = fmt.Errorf("%s: message nacked without an error", r.name())
		}
		return false, res.err
	case <-ctx.Done():
		return false, ctx.Err()
	}
}

// closeRouter stops the Router (not the contender).
func (r *routed) closeRouter() {
	_ = r.router.Close()
	<-r.done
}

func (r *routed) close() {
	r.closeRouter()
	r.contender.close()
}

// unwrap is the contender under the Router, or c.
func unwrap(c contender) contender {
	if r, ok := c.(*routed); ok {
		return r.contender
	}
	return c
}

// nullPublishedCount is how many messages the null publisher took (-broker none).
func (b *broker) nullPublishedCount() int64 { return b.nullCount.Load() }
