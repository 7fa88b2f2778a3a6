package main

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	amqp "github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"
	amqp091 "github.com/rabbitmq/amqp091-go"
)

// amqpBroker is RabbitMQ through watermill-amqp v3: a durable fanout exchange per topic, and a
// durable queue per consumer bound to it ("<topic>_<consumer>"), all declared up front.
type amqpBroker struct {
	url    string
	logger watermill.LoggerAdapter
	admin  *amqp091.Connection // for the queue depths CaughtUp reads
	flight inflight
}

// amqpConfig is the configuration the guarantee needs (docs/brokers.md): durable exchanges and
// queues, persistent messages, and publisher confirms, so that Publish returns only once RabbitMQ
// has the message on disk. queue names the queue of a subscriber; "" for a publisher.
func (b *amqpBroker) amqpConfig(queue string) amqp.Config {
	c := amqp.NewDurablePubSubConfig(b.url, func(topic string) string { return topic + "_" + queue })
	c.Publish.ConfirmDelivery = true
	c.Connection.Reconnect = &amqp.ReconnectConfig{BackoffInitialInterval: 100 * time.Millisecond,
		BackoffRandomizationFactor: 0.5, BackoffMultiplier: 1.5, BackoffMaxInterval: 2 * time.Second}
	// Unacked messages a consumer holds at most; a killed consumer's come back at once.
	c.Consume.Qos.PrefetchCount = 16
	return c
}

func startAMQP(url string, logger watermill.LoggerAdapter) (_ broker, err error) {
	b := &amqpBroker{url: url, logger: logger}
	if b.admin, err = amqp091.Dial(url); err != nil {
		return nil, fmt.Errorf("connect to RabbitMQ: %w", err)
	}
	defer func() {
		if err != nil {
			_ = b.admin.Close()
		}
	}()
	// RabbitMQ drops a message published to an exchange with no queue bound to it, and still
	// confirms it: every queue exists before anything is published.
	for _, c := range consumers {
		sub, err := amqp.NewSubscriber(b.amqpConfig(c.name), logger)
		if err != nil {
			return nil, fmt.Errorf("connect to RabbitMQ: %w", err)
		}
		err = sub.SubscribeInitialize(c.topic)
		_ = sub.Close()
		if err != nil {
			return nil, fmt.Errorf("declare the queue of %s: %w", c.name, err)
		}
	}
	return b, nil
}

func (b *amqpBroker) Publisher() (message.Publisher, error) {
	return amqp.NewPublisher(b.amqpConfig(""), b.logger)
}

func (b *amqpBroker) Subscriber(name string) (message.Subscriber, error) {
	sub, err := amqp.NewSubscriber(b.amqpConfig(name), b.logger)
	if err != nil {
		return nil, err
	}
	return b.flight.track(sub), nil
}

// CaughtUp: no message ready in any consumer's queue, and none delivered but not yet acked. AMQP
// does not tell the unacked count of a queue; the subscribers count their own.
func (b *amqpBroker) CaughtUp(context.Context) (bool, string, error) {
	ch, err := b.admin.Channel()
	if err != nil {
		return false, "", err
	}
	defer ch.Close()
	for _, c := range consumers {
		q, err := ch.QueueDeclarePassive(c.topic+"_"+c.name, true, false, false, false, nil)
		if err != nil {
			return false, "", err
		}
		if q.Messages != 0 {
			return false, fmt.Sprintf("%s: %d messages ready", c.name, q.Messages), nil
		}
	}
	return b.flight.quiet()
}

func (b *amqpBroker) Close() error { return b.admin.Close() }

// inflight counts the messages its subscribers delivered and that were neither acked nor nacked,
// for a broker that does not tell (RabbitMQ). A subscriber's messages stop counting when it is
// closed: the broker takes back what it did not answer.
type inflight struct {
	mu    sync.Mutex
	subs  map[*trackedSubscriber]struct{}
	moved atomic.Int64 // unix nanoseconds of the last delivery
}

type trackedSubscriber struct {
	message.Subscriber
	f       *inflight
	pending atomic.Int64
	wg      sync.WaitGroup
}

func (f *inflight) track(sub message.Subscriber) message.Subscriber {
	t := &trackedSubscriber{Subscriber: sub, f: f}
	f.mu.Lock()
	if f.subs == nil {
		f.subs = map[*trackedSubscriber]struct{}{}
	}
	f.subs[t] = struct{}{}
	f.mu.Unlock()
	return t
}

// quiet tells whether no tracked subscriber holds an unanswered message, and none delivered one
// in the last 300 ms (a message the client library had already received reaches the Router
// within that).
func (f *inflight) quiet() (bool, string, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	var held int64
	for t := range f.subs {
		held += t.pending.Load()
	}
	if held != 0 {
		return false, fmt.Sprintf("%d messages delivered and not yet acked", held), nil
	}
	if since := time.Since(time.Unix(0, f.moved.Load())); since < 300*time.Millisecond {
		return false, "messages still arriving", nil
	}
	return true, "", nil
}

func (t *trackedSubscriber) Subscribe(ctx context.Context, topic string) (<-chan *message.Message, error) {
	in, err := t.Subscriber.Subscribe(ctx, topic)
	if err != nil {
		return nil, err
	}
	out := make(chan *message.Message)
	t.wg.Add(1)
	go func() {
		defer t.wg.Done()
		defer close(out)
		for msg := range in {
			t.pending.Add(1)
			t.f.moved.Store(time.Now().UnixNano())
			t.wg.Add(1)
			go func() {
				defer t.wg.Done()
				select {
				case <-msg.Acked():
				case <-msg.Nacked():
				case <-ctx.Done():
				}
				t.pending.Add(-1)
			}()
			select {
			case out <- msg:
			case <-ctx.Done():
				// The Router is gone: the message is left unanswered, and the broker takes it back.
				msg.Nack()
			}
		}
	}()
	return out, nil
}

func (t *trackedSubscriber) Close() error {
	err := t.Subscriber.Close()
	t.f.mu.Lock()
	delete(t.f.subs, t)
	t.f.mu.Unlock()
	return err
}
