package e2e

import (
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/ThreeDotsLabs/watermill/message"
	metrics "github.com/rcrowley/go-metrics"

	"github.com/watermill-outbox/outbox"
	"github.com/watermill-outbox/outbox/internal/brokertest"
)

func init() {
	// Sarama's metrics start a goroutine per process that never ends (goleak reports it); the
	// tests read none of them.
	metrics.UseNilMetrics = true
}

// kafkaMarshaler makes the effect's ordering key (outbox.MetadataOrderingKey) the Kafka message
// key, so that Sarama's hash partitioner puts the effects of one key on one partition, where a
// consumer group reads them in order.
var kafkaMarshaler = kafka.NewWithPartitioningMarshaler(outbox.PartitionKey)

// kafkaProducerConfig is the Sarama config of the Publishers here: the settings docs/brokers.md
// asks for.
func kafkaProducerConfig() *sarama.Config {
	c := kafka.DefaultSaramaSyncPublisherConfig()
	c.Version = sarama.V2_8_0_0
	// SendMessage returns once every in-sync replica has the record (kfake has one broker, whose
	// log is fsynced per batch); WaitForLocal, Sarama's default, loses it if the leader fails first.
	c.Producer.RequiredAcks = sarama.WaitForAll
	// A retried batch is written once, and not after a later one (Sarama requires one request in
	// flight per broker for it). The outbox does not need it: it sends the next effect of a key
	// only after Publish returned for the previous one, and copies carry the effect's UUID.
	c.Producer.Idempotent = true
	c.Net.MaxOpenRequests = 1
	c.Producer.Retry.Max = 10
	c.Producer.Retry.Backoff = 100 * time.Millisecond
	// Find the restarted broker quickly (watermill-kafka's default backoff is 2 s).
	c.Metadata.Retry.Backoff = 250 * time.Millisecond
	c.Net.DialTimeout, c.Net.ReadTimeout, c.Net.WriteTimeout = 2*time.Second, 5*time.Second, 5*time.Second
	return c
}

// kafkaConsumerConfig is the Sarama config of the Subscribers here.
func kafkaConsumerConfig() *sarama.Config {
	c := kafka.DefaultSaramaSubscriberConfig()
	c.Version = sarama.V2_8_0_0
	// A new group starts at the beginning of the topic: with Sarama's default (the newest offset)
	// the messages sent before the group first joined are skipped, for good.
	c.Consumer.Offsets.Initial = sarama.OffsetOldest
	// watermill-kafka marks an offset when the message is acked; the marks are committed every
	// interval. A consumer that dies loses at most an interval of marks: those messages are
	// delivered again to the partition's next owner (copies the outbox drops).
	c.Consumer.Offsets.AutoCommit.Interval = 200 * time.Millisecond
	// A killed member's partitions move to the others once the group coordinator has not heard
	// from it for Session.Timeout.
	c.Consumer.Group.Session.Timeout = 6 * time.Second
	c.Consumer.Group.Heartbeat.Interval = 500 * time.Millisecond
	c.Consumer.Group.Rebalance.Timeout = 10 * time.Second
	c.Consumer.Group.Rebalance.Retry.Backoff = 250 * time.Millisecond
	c.Metadata.Retry.Backoff = 250 * time.Millisecond
	c.Net.DialTimeout, c.Net.ReadTimeout, c.Net.WriteTimeout = 2*time.Second, 10*time.Second, 5*time.Second
	return c
}

func (b broker) kafkaPublisher() (message.Publisher, func(), error) {
	p, err := kafka.NewPublisher(kafka.PublisherConfig{Brokers: []string{b.addr}, Marshaler: kafkaMarshaler,
		OverwriteSaramaConfig: kafkaProducerConfig()}, watermill.NopLogger{})
	if err != nil {
		return nil, nil, err
	}
	return p, func() { _ = p.Close() }, nil
}

func (b broker) kafkaSubscriber(group string) (message.Subscriber, func(), error) {
	s, err := kafka.NewSubscriber(kafka.SubscriberConfig{Brokers: []string{b.addr}, Unmarshaler: kafkaMarshaler,
		ConsumerGroup: group, OverwriteSaramaConfig: kafkaConsumerConfig(),
		// The outbox's RetryDelay spaces the nacks already.
		NackResendSleep: 50 * time.Millisecond, ReconnectRetrySleep: 250 * time.Millisecond,
		InitializeTopicDetails: &sarama.TopicDetail{NumPartitions: brokertest.KafkaPartitions, ReplicationFactor: 1},
	}, watermill.NopLogger{})
	if err != nil {
		return nil, nil, err
	}
	return s, func() { _ = s.Close() }, nil
}

// TestKafka is TestRabbitMQ and TestRedisStreams on Kafka (kfake, see brokertest.Kafka): three
// consumer processes in one consumer group, duplicated sends, a member killed with SIGKILL (its
// partitions move to the others after the session timeout, from the last committed offsets), the
// broker stopped and started again, then killed with SIGKILL and started again on its data.
func TestKafka(t *testing.T) { testBroker(t, brokertest.Kafka) }

// waitKafkaGroup waits until group is stable with members members, so that the test's sends
// are spread over all of them: a member that joins later takes over partitions only at the next
// rebalance, after which a quick test may be over.
func waitKafkaGroup(t *testing.T, b broker, group string, members int) {
	t.Helper()
	admin, err := sarama.NewClusterAdmin([]string{b.addr}, kafkaConsumerConfig())
	if err != nil {
		t.Fatal(err)
	}
	defer admin.Close()
	deadline := time.Now().Add(time.Minute)
	for {
		ds, err := admin.DescribeConsumerGroups([]string{group})
		var state string
		var n int
		if err == nil && len(ds) == 1 {
			state, n = ds[0].State, len(ds[0].Members)
			if state == "Stable" && n == members {
				return
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("consumer group %s not stable with %d members after a minute: state %q, %d members (%v)", group, members, state, n, err)
		}
		time.Sleep(200 * time.Millisecond)
	}
}
