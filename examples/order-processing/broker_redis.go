package main

import (
	"context"
	"fmt"
	"strings"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-redisstream/pkg/redisstream"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/redis/go-redis/v9"
)

// redisBroker is Redis Streams through watermill-redisstream: a stream per topic and a consumer
// group per consumer, created up front. Durability is the server's: run it with `appendonly yes`
// and `appendfsync always` (docs/brokers.md).
type redisBroker struct {
	addr    string
	client  *redis.Client // for the groups and CaughtUp
	ackWait time.Duration
	logger  watermill.LoggerAdapter
}

func startRedis(ctx context.Context, addr string, ackWait time.Duration, logger watermill.LoggerAdapter) (_ broker, err error) {
	b := &redisBroker{addr: addr, client: redis.NewClient(&redis.Options{Addr: addr}), ackWait: ackWait, logger: logger}
	defer func() {
		if err != nil {
			_ = b.client.Close()
		}
	}()
	for _, c := range consumers {
		// From the stream's first entry ("0"): a group created after events were sent reads them.
		err := b.client.XGroupCreateMkStream(ctx, c.topic, c.name, "0").Err()
		if err != nil && !strings.HasPrefix(err.Error(), "BUSYGROUP") {
			return nil, fmt.Errorf("consumer group %s on %s at %s: %w", c.name, c.topic, addr, err)
		}
	}
	return b, nil
}

// Publisher and Subscriber each get a client of their own: closing them closes it.
func (b *redisBroker) Publisher() (message.Publisher, error) {
	return redisstream.NewPublisher(redisstream.PublisherConfig{Client: redis.NewClient(&redis.Options{Addr: b.addr})}, b.logger)
}

func (b *redisBroker) Subscriber(name string) (message.Subscriber, error) {
	return redisstream.NewSubscriber(redisstream.SubscriberConfig{
		Client:        redis.NewClient(&redis.Options{Addr: b.addr}),
		ConsumerGroup: name,
		// Consumer (the member of the group) is a new random name per subscriber: a killed one's
		// pending messages are claimed by another member once idle for MaxIdleTime.
		MaxIdleTime:   b.ackWait,
		ClaimInterval: b.ackWait / 4,
		BlockTime:     100 * time.Millisecond,
	}, b.logger)
}

// CaughtUp: every group has read its stream to the end and has no message pending (read and not
// acked).
func (b *redisBroker) CaughtUp(ctx context.Context) (bool, string, error) {
	for _, c := range consumers {
		stream, err := b.client.XInfoStream(ctx, c.topic).Result()
		if err != nil {
			return false, "", err
		}
		groups, err := b.client.XInfoGroups(ctx, c.topic).Result()
		if err != nil {
			return false, "", err
		}
		found := false
		for _, g := range groups {
			if g.Name != c.name {
				continue
			}
			found = true
			if g.Pending != 0 || g.LastDeliveredID != stream.LastGeneratedID {
				return false, fmt.Sprintf("%s: %d pending, read up to %s of %s", c.name, g.Pending, g.LastDeliveredID, stream.LastGeneratedID), nil
			}
		}
		if !found {
			return false, "", fmt.Errorf("consumer group %s on %s is gone", c.name, c.topic)
		}
	}
	return true, "", nil
}

func (b *redisBroker) Close() error { return b.client.Close() }
