package e2e

import (
	"database/sql"
	"testing"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill"
	amqp "github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"

	"github.com/watermill-outbox/outbox"
	"github.com/watermill-outbox/outbox/drivers/postgres"
	"github.com/watermill-outbox/outbox/internal/brokertest"
	"github.com/watermill-outbox/outbox/internal/logtest"
	"github.com/watermill-outbox/outbox/internal/pgtest"
)

// TestRabbitMQPublisherSettingsAreChecked: outbox.New reports a watermill-amqp v3 Publisher that
// publishes without confirms or transactions (a broker crash loses what it "sent"), and accepts
// one with either.
func TestRabbitMQPublisherSettingsAreChecked(t *testing.T) {
	srv, err := brokertest.Start(brokertest.RabbitMQ)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(srv.Close)
	db, err := sql.Open("postgres", pgtest.DSN(t))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = db.Close() })
	for _, c := range []struct {
		name   string
		set    func(*amqp.Config)
		unsafe bool
	}{
		{"the durable-queue defaults", func(*amqp.Config) {}, true},
		{"publisher confirms", func(c *amqp.Config) { c.Publish.ConfirmDelivery = true }, false},
		{"transactions", func(c *amqp.Config) { c.Publish.Transactional = true }, false},
	} {
		cfg := amqp.NewDurableQueueConfig(srv.Addr())
		c.set(&cfg)
		pub, err := amqp.NewPublisher(cfg, watermill.NopLogger{})
		if err != nil {
			t.Fatal(err)
		}
		logs := &logtest.Errors{}
		if _, err := outbox.New(outbox.Config{DB: db, Driver: postgres.Driver{}, Publisher: pub, Logger: logs}); err != nil {
			t.Fatal(err)
		}
		_ = pub.Close()
		if got := logs.Contains(outbox.ErrUnsafePublisher.Error()); got != c.unsafe {
			t.Errorf("%s: reported as unsafe: %v, want %v (logged: %v)", c.name, got, c.unsafe, logs.Lines())
		}
	}
}

// TestKafkaPublisherSettingsAreChecked: outbox.New reports a watermill-kafka v3 Publisher whose
// Sarama producer does not wait for every in-sync replica (RequiredAcks other than WaitForAll,
// Sarama's default among them: a leader that fails before its followers copied a message loses
// it), and accepts one that does.
func TestKafkaPublisherSettingsAreChecked(t *testing.T) {
	srv, err := brokertest.Start(brokertest.Kafka)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(srv.Close)
	db, err := sql.Open("postgres", pgtest.DSN(t))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = db.Close() })
	for _, c := range []struct {
		name   string
		config func() *sarama.Config
		unsafe bool
	}{
		{"watermill-kafka's defaults (WaitForLocal)", func() *sarama.Config { return nil }, true},
		{"NoResponse", func() *sarama.Config {
			c := kafkaProducerConfig()
			c.Producer.RequiredAcks, c.Producer.Idempotent = sarama.NoResponse, false
			return c
		}, true},
		{"WaitForLocal", func() *sarama.Config {
			c := kafkaProducerConfig()
			c.Producer.RequiredAcks, c.Producer.Idempotent = sarama.WaitForLocal, false
			return c
		}, true},
		{"WaitForAll, idempotent", kafkaProducerConfig, false},
	} {
		pub, err := kafka.NewPublisher(kafka.PublisherConfig{Brokers: []string{srv.Addr()}, Marshaler: kafkaMarshaler,
			OverwriteSaramaConfig: c.config()}, watermill.NopLogger{})
		if err != nil {
			t.Fatalf("%s: %v", c.name, err)
		}
		logs := &logtest.Errors{}
		if _, err := outbox.New(outbox.Config{DB: db, Driver: postgres.Driver{}, Publisher: pub, Logger: logs}); err != nil {
			t.Fatal(err)
		}
		_ = pub.Close()
		if got := logs.Contains(outbox.ErrUnsafePublisher.Error()); got != c.unsafe {
			t.Errorf("%s: reported as unsafe: %v, want %v (logged: %v)", c.name, got, c.unsafe, logs.Lines())
		}
	}
}
