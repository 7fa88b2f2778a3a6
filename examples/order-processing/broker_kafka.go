package main

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/ThreeDotsLabs/watermill/message"
	metrics "github.com/rcrowley/go-metrics"

	"github.com/watermill-outbox/outbox"
)

// kafkaBroker is Kafka through watermill-kafka v3 (Sarama): a topic per event type, created up
// front when missing, and a consumer group per consumer. Events carry the order ID as their
// ordering key (outbox.WithOrderingKey), and the marshaler makes it the message key: the events
// of one order share a partition, so each consumer sees them in the order they were committed.
type kafkaBroker struct {
	brokers []string
	logger  watermill.LoggerAdapter
	client  sarama.Client // for the offsets CaughtUp reads
	admin   sarama.ClusterAdmin
	flight  inflight
}

func init() {
	// Sarama's own metrics start a goroutine that never ends; the service exports its metrics
	// through OpenTelemetry (GET /metrics), not Sarama's registry.
	metrics.UseNilMetrics = true
}

// kafkaPartitions is the number of partitions of the topics the service creates. Topics made
// here have one replica, which is a demo's; production topics have three and
// min.insync.replicas=2 (docs/brokers.md), created before the service starts.
const kafkaPartitions = 8

var kafkaMarshaler = kafka.NewWithPartitioningMarshaler(outbox.PartitionKey)

// kafkaProducerConfig: Publish returns once every in-sync replica has the event (WaitForAll, which
// outbox.New checks), and a retried batch is written once (idempotence).
func kafkaProducerConfig() *sarama.Config {
	c := kafka.DefaultSaramaSyncPublisherConfig()
	c.Version = sarama.V2_8_0_0
	c.Producer.RequiredAcks = sarama.WaitForAll
	c.Producer.Idempotent = true
	c.Net.MaxOpenRequests = 1
	c.Producer.Retry.Backoff = 100 * time.Millisecond
	c.Metadata.Retry.Backoff = 250 * time.Millisecond
	return c
}

// kafkaConsumerConfig: a new group reads its topic from the start, acked offsets are committed
// every 200 ms (what a crash makes the next owner read again), and a member that stops
// heartbeating loses its partitions after 6 s.
func kafkaConsumerConfig() *sarama.Config {
	c := kafka.DefaultSaramaSubscriberConfig()
	c.Version = sarama.V2_8_0_0
	c.Consumer.Offsets.Initial = sarama.OffsetOldest
	c.Consumer.Offsets.AutoCommit.Interval = 200 * time.Millisecond
	c.Consumer.Group.Session.Timeout = 6 * time.Second
	c.Consumer.Group.Heartbeat.Interval = 500 * time.Millisecond
	c.Consumer.Group.Rebalance.Retry.Backoff = 250 * time.Millisecond
	c.Metadata.Retry.Backoff = 250 * time.Millisecond
	return c
}

func startKafka(brokers []string, logger watermill.LoggerAdapter) (_ broker, err error) {
	b := &kafkaBroker{brokers: brokers, logger: logger}
	if b.client, err = sarama.NewClient(brokers, kafkaConsumerConfig()); err != nil {
		return nil, fmt.Errorf("connect to Kafka at %v: %w", brokers, err)
	}
	defer func() {
		if err != nil {
			_ = b.Close()
		}
	}()
	if b.admin, err = sarama.NewClusterAdminFromClient(b.client); err != nil {
		return nil, fmt.Errorf("connect to Kafka at %v: %w", brokers, err)
	}
	existing, err := b.admin.ListTopics()
	if err != nil {
		return nil, fmt.Errorf("list the topics: %w", err)
	}
	for _, topic := range topics {
		if _, ok := existing[topic]; ok {
			continue
		}
		err := b.admin.CreateTopic(topic, &sarama.TopicDetail{NumPartitions: kafkaPartitions, ReplicationFactor: 1}, false)
		if err != nil && !errors.Is(err, sarama.ErrTopicAlreadyExists) {
			return nil, fmt.Errorf("create topic %s: %w", topic, err)
		}
	}
	return b, nil
}

func (b *kafkaBroker) Publisher() (message.Publisher, error) {
	return kafka.NewPublisher(kafka.PublisherConfig{Brokers: b.brokers, Marshaler: kafkaMarshaler,
		OverwriteSaramaConfig: kafkaProducerConfig()}, b.logger)
}

func (b *kafkaBroker) Subscriber(name string) (message.Subscriber, error) {
	sub, err := kafka.NewSubscriber(kafka.SubscriberConfig{Brokers: b.brokers, Unmarshaler: kafkaMarshaler,
		ConsumerGroup: name, OverwriteSaramaConfig: kafkaConsumerConfig(),
		// The outbox's RetryDelay spaces the nacks already.
		NackResendSleep: 50 * time.Millisecond, ReconnectRetrySleep: 250 * time.Millisecond,
	}, b.logger)
	if err != nil {
		return nil, err
	}
	return b.flight.track(sub), nil
}

// CaughtUp: every group has committed the end of every partition of its topic, and no subscriber
// holds an unanswered message.
func (b *kafkaBroker) CaughtUp(context.Context) (bool, string, error) {
	if err := b.client.RefreshMetadata(topics...); err != nil {
		return false, "", err
	}
	for _, c := range consumers {
		partitions, err := b.client.Partitions(c.topic)
		if err != nil {
			return false, "", err
		}
		committed, err := b.admin.ListConsumerGroupOffsets(c.name, map[string][]int32{c.topic: partitions})
		if err != nil {
			return false, "", err
		}
		for _, p := range partitions {
			end, err := b.client.GetOffset(c.topic, p, sarama.OffsetNewest)
			if err != nil {
				return false, "", err
			}
			at := int64(0) // nothing committed yet: the group starts at the beginning
			if blk := committed.GetBlock(c.topic, p); blk != nil && blk.Offset >= 0 {
				at = blk.Offset
			}
			if at < end {
				return false, fmt.Sprintf("%s: partition %d of %s committed up to %d of %d", c.name, p, c.topic, at, end), nil
			}
		}
	}
	return b.flight.quiet()
}

func (b *kafkaBroker) Close() error {
	if b.admin != nil {
		return b.admin.Close() // closes the client it was made from
	}
	return b.client.Close()
}
