package main

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"path/filepath"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wnats "github.com/ThreeDotsLabs/watermill-nats/v2/pkg/nats"
	wsql "github.com/ThreeDotsLabs/watermill-sql/v3/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
)

// broker carries the events between the API and the consumers: NATS JetStream (an in-process
// server by default, or an external one), or watermill-sql's pub/sub on the PostgreSQL database.
type broker interface {
	// Publisher returns a new publisher; the caller closes it.
	Publisher() (message.Publisher, error)
	// Subscriber returns a new subscriber for the consumer name (its durable consumer or consumer
	// group on the broker). The Router that runs it closes it.
	Subscriber(name string) (message.Subscriber, error)
	// CaughtUp tells whether every consumer has acked every message (the chaos mode waits for it).
	CaughtUp(ctx context.Context) (bool, string, error)
	Close() error
}

// natsBroker is NATS JetStream through watermill-nats. The streams (one per topic, named after it)
// and the durable consumers (one per consumer name) are created up front.
type natsBroker struct {
	server  *server.Server // the in-process server; nil with an external one
	url     string
	ackWait time.Duration
	logger  watermill.LoggerAdapter
	admin   *natsConn
	js      nats.JetStreamContext

	mu    sync.Mutex
	conns []*natsConn // every connection opened, to wait for when closing
}

// startNATS connects to the NATS server at url or, when url is empty, starts one in-process that
// keeps its streams in dir/nats: messages survive a restart of the service, like a real broker's.
func startNATS(dir, url string, ackWait time.Duration, logger watermill.LoggerAdapter) (_ broker, err error) {
	b := &natsBroker{url: url, ackWait: ackWait, logger: logger}
	if url == "" {
		b.server, err = server.NewServer(&server.Options{
			JetStream:  true,
			StoreDir:   filepath.Join(dir, "nats"),
			DontListen: true, // clients connect in-process (nats.InProcessServer): no port to pick
			NoLog:      true,
			NoSigs:     true,
		})
		if err != nil {
			return nil, fmt.Errorf("embedded NATS server: %w", err)
		}
		go b.server.Start()
		if !b.server.ReadyForConnections(30 * time.Second) {
			b.server.Shutdown()
			return nil, errors.New("embedded NATS server not ready after 30s")
		}
	}
	defer func() {
		if err != nil {
			_ = b.Close()
		}
	}()
	if b.admin, err = b.connect("admin"); err != nil {
		return nil, err
	}
	if b.js, err = b.admin.JetStream(); err != nil {
		return nil, err
	}
	for _, topic := range topics {
		if err := b.ensureStream(topic); err != nil {
			return nil, err
		}
	}
	for _, c := range consumers {
		if err := b.ensureConsumer(c.topic, c.name); err != nil {
			return nil, err
		}
	}
	return b, nil
}

func (b *natsBroker) ensureStream(topic string) error {
	_, err := b.js.StreamInfo(topic)
	if errors.Is(err, nats.ErrStreamNotFound) {
		_, err = b.js.AddStream(&nats.StreamConfig{
			Name:     topic,
			Subjects: []string{topic},
			Storage:  nats.FileStorage,
			// Keep messages no longer than the outbox remembers processed IDs (Config.Retention,
			// 7 days by default): an older copy would no longer be recognised as a duplicate.
			MaxAge: 24 * time.Hour,
		})
	}
	if err != nil {
		return fmt.Errorf("stream %s: %w", topic, err)
	}
	return nil
}

// ensureConsumer creates the durable consumer name on the stream of topic, or updates its settings.
// Creating it here matters: a durable that the client library created itself is deleted when its
// subscriber closes, and the next subscriber would start over from the first message.
func (b *natsBroker) ensureConsumer(topic, name string) error {
	cfg := &nats.ConsumerConfig{
		Durable:        name,
		DeliverSubject: "deliver." + name,
		DeliverGroup:   name, // watermill-nats subscribes as a queue group named like the durable
		FilterSubject:  topic,
		DeliverPolicy:  nats.DeliverAllPolicy,
		AckPolicy:      nats.AckExplicitPolicy,
		// A message not acked within AckWait is redelivered: after a crash, that is how long the
		// messages the dead consumer held take to come back. The timer starts when the server
		// pushes the message, so MaxAckPending bounds how many wait in the client meanwhile.
		AckWait:       b.ackWait,
		MaxAckPending: 64,
	}
	info, err := b.js.ConsumerInfo(topic, name)
	switch {
	case errors.Is(err, nats.ErrConsumerNotFound):
		_, err = b.js.AddConsumer(topic, cfg)
	case err == nil && (info.Config.AckWait != cfg.AckWait || info.Config.MaxAckPending != cfg.MaxAckPending):
		cfg.DeliverSubject = info.Config.DeliverSubject
		_, err = b.js.UpdateConsumer(topic, cfg)
	}
	if err != nil {
		return fmt.Errorf("durable consumer %s on %s: %w", name, topic, err)
	}
	return nil
}

func (b *natsBroker) Publisher() (message.Publisher, error) {
	nc, err := b.connect("publisher")
	if err != nil {
		return nil, err
	}
	pub, err := wnats.NewPublisherWithNatsConn(nc.Conn, wnats.PublisherPublishConfig{
		Marshaler:         &wnats.NATSMarshaler{},
		SubjectCalculator: wnats.DefaultSubjectCalculator,
		// Off: JetStream would drop a re-send with the same ID within its duplicate window. The
		// consumers drop copies themselves, and the chaos mode needs its duplicates delivered.
		JetStream: wnats.JetStreamConfig{TrackMsgId: false},
	}, b.logger)
	if err != nil {
		nc.close()
		return nil, err
	}
	return closingPublisher{pub, nc}, nil
}

func (b *natsBroker) Subscriber(name string) (message.Subscriber, error) {
	topic := ""
	for _, c := range consumers {
		if c.name == name {
			topic = c.topic
		}
	}
	nc, err := b.connect(name)
	if err != nil {
		return nil, err
	}
	sub, err := wnats.NewSubscriberWithNatsConn(nc.Conn, wnats.SubscriberSubscriptionConfig{
		Unmarshaler:      &wnats.NATSMarshaler{},
		SubscribersCount: 1,
		AckWaitTimeout:   b.ackWait,
		CloseTimeout:     10 * time.Second,
		SubscribeTimeout: 30 * time.Second,
		QueueGroupPrefix: name,
		NakDelay:         wnats.NewStaticDelay(100 * time.Millisecond), // a failed message comes back soon
		JetStream: wnats.JetStreamConfig{
			// Acks without waiting for the server's confirmation: a lost ack only redelivers the
			// message, and the outbox drops the copy.
			AckAsync:      true,
			DurablePrefix: name,
			SubscribeOptions: []nats.SubOpt{
				nats.Bind(topic, name), // the durable created in ensureConsumer; never create one
				// Without ManualAck the client acks every message its callback returns from,
				// including those watermill-nats gives up on when it closes or times out: a
				// consumer that crashed would lose them instead of having them redelivered.
				nats.ManualAck(),
			},
		},
	}, drainedLogger{b.logger})
	if err != nil {
		nc.close()
		return nil, err
	}
	return closingSubscriber{sub, nc}, nil
}

// drainedLogger drops the error watermill-nats logs when it unsubscribes from a connection that
// Drain has already closed.
type drainedLogger struct{ watermill.LoggerAdapter }

func (l drainedLogger) Error(msg string, err error, fields watermill.LogFields) {
	if !errors.Is(err, nats.ErrConnectionClosed) {
		l.LoggerAdapter.Error(msg, err, fields)
	}
}

func (l drainedLogger) With(fields watermill.LogFields) watermill.LoggerAdapter {
	return drainedLogger{l.LoggerAdapter.With(fields)}
}

func (b *natsBroker) CaughtUp(context.Context) (bool, string, error) {
	for _, c := range consumers {
		info, err := b.js.ConsumerInfo(c.topic, c.name)
		if err != nil {
			return false, "", err
		}
		if info.NumPending != 0 || info.NumAckPending != 0 {
			return false, fmt.Sprintf("%s: %d undelivered, %d unacked", c.name, info.NumPending, info.NumAckPending), nil
		}
	}
	return true, "", nil
}

// Close closes every connection and then stops the in-process server.
func (b *natsBroker) Close() error {
	b.mu.Lock()
	conns := b.conns
	b.conns = nil
	b.mu.Unlock()
	for _, nc := range conns {
		nc.close()
	}
	if b.server != nil {
		b.server.Shutdown()
		b.server.WaitForShutdown()
	}
	return nil
}

// natsConn is a connection whose close waits until the client has really let go of it: a closed
// watermill-nats subscriber drains its connection in the background.
type natsConn struct {
	*nats.Conn
	closed chan struct{}
}

func (b *natsBroker) connect(name string) (*natsConn, error) {
	c := &natsConn{closed: make(chan struct{})}
	opts := []nats.Option{nats.Name("order-processing " + name), nats.ClosedHandler(func(*nats.Conn) { close(c.closed) })}
	url := b.url
	if b.server != nil {
		opts = append(opts, nats.InProcessServer(b.server))
	}
	nc, err := nats.Connect(url, opts...)
	if err != nil {
		return nil, fmt.Errorf("connect to NATS: %w", err)
	}
	c.Conn = nc
	b.mu.Lock()
	b.conns = append(b.conns, c)
	b.mu.Unlock()
	return c, nil
}

func (c *natsConn) close() {
	if c.IsDraining() {
		select {
		case <-c.closed:
		case <-time.After(30 * time.Second):
		}
	}
	c.Conn.Close()
	<-c.closed
}

type closingPublisher struct {
	*wnats.Publisher
	nc *natsConn
}

func (p closingPublisher) Close() error {
	err := p.Publisher.Close()
	p.nc.close()
	return err
}

type closingSubscriber struct {
	*wnats.Subscriber
	nc *natsConn
}

// Drain stops the delivery and waits until every message the server already pushed was handed
// to the Router and acked or nacked, so that no message callback is left running.
func (s closingSubscriber) Drain() {
	if err := s.nc.Drain(); err != nil {
		s.nc.Conn.Close()
	}
	s.nc.close()
}

func (s closingSubscriber) Close() error {
	s.Drain()
	if err := s.Subscriber.Close(); err != nil && !errors.Is(err, nats.ErrConnectionClosed) {
		return err
	}
	return nil
}

// sqlBroker is watermill-sql's pub/sub on the PostgreSQL database: a table per topic, and the
// position of each consumer group in an offsets table.
type sqlBroker struct {
	db     *sql.DB
	logger watermill.LoggerAdapter
}

var sqlSchema = wsql.DefaultPostgreSQLSchema{
	// BYTEA payloads: the default JSON column would reject payloads that are not JSON.
	GeneratePayloadType: func(string) string { return "BYTEA" },
	// A subscriber reads this many messages in one transaction and stores its position at the end:
	// a crash half way delivers the whole batch again. Smaller than the default 100 so that a
	// crashed consumer redoes less (the redone messages are duplicates the outbox drops).
	SubscribeBatchSize: 10,
}

func startSQLBroker(ctx context.Context, db *sql.DB, logger watermill.LoggerAdapter) (broker, error) {
	// Created up front: subscribers that create them concurrently race in CREATE TABLE IF NOT EXISTS.
	for _, topic := range topics {
		queries := append(sqlSchema.SchemaInitializingQueries(topic), wsql.DefaultPostgreSQLOffsetsAdapter{}.SchemaInitializingQueries(topic)...)
		for _, q := range queries {
			if _, err := db.ExecContext(ctx, q.Query, q.Args...); err != nil {
				return nil, fmt.Errorf("create tables of topic %s: %w", topic, err)
			}
		}
	}
	return &sqlBroker{db: db, logger: logger}, nil
}

func (b *sqlBroker) Publisher() (message.Publisher, error) {
	return wsql.NewPublisher(b.db, wsql.PublisherConfig{SchemaAdapter: sqlSchema}, b.logger)
}

func (b *sqlBroker) Subscriber(name string) (message.Subscriber, error) {
	return wsql.NewSubscriber(b.db, wsql.SubscriberConfig{
		ConsumerGroup:  name,
		SchemaAdapter:  sqlSchema,
		OffsetsAdapter: wsql.DefaultPostgreSQLOffsetsAdapter{},
		PollInterval:   20 * time.Millisecond,
		ResendInterval: 100 * time.Millisecond, // a nacked message comes back soon
		RetryInterval:  100 * time.Millisecond,
	}, b.logger)
}

func (b *sqlBroker) CaughtUp(ctx context.Context) (bool, string, error) {
	for _, c := range consumers {
		// Messages are consumed in (transaction_id, offset) order: the last one is not always max(offset).
		var last, acked sql.NullInt64
		err := b.db.QueryRowContext(ctx, `SELECT
			(SELECT "offset" FROM "watermill_`+c.topic+`" ORDER BY transaction_id DESC, "offset" DESC LIMIT 1),
			(SELECT offset_acked FROM "watermill_offsets_`+c.topic+`" WHERE consumer_group = $1)`, c.name).Scan(&last, &acked)
		if err != nil {
			return false, "", err
		}
		if last.Int64 != acked.Int64 {
			return false, fmt.Sprintf("%s: acked offset %d of %d", c.name, acked.Int64, last.Int64), nil
		}
	}
	return true, "", nil
}

func (b *sqlBroker) Close() error { return nil }
