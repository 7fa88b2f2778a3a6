// Package natstest runs an in-process NATS server with JetStream for the end-to-end tests, and
// makes the connections, streams, Watermill publishers and durable subscribers they use on it,
// each closed when the test ends with nothing of it left running.
package natstest

import (
	"fmt"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wnats "github.com/ThreeDotsLabs/watermill-nats/v2/pkg/nats"
	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"

	"github.com/watermill-outbox/outbox/internal/routertest"
)

// Start runs an in-process NATS server with JetStream that accepts only in-process
// connections, and shuts it down when the test ends.
func Start(t testing.TB) *server.Server {
	t.Helper()
	ns, err := server.NewServer(&server.Options{
		JetStream:  true,
		StoreDir:   t.TempDir(),
		DontListen: true, // clients connect with nats.InProcessServer: no port to pick or leak
		NoLog:      true,
		NoSigs:     true,
	})
	if err != nil {
		t.Fatal(err)
	}
	go ns.Start()
	t.Cleanup(func() {
		ns.Shutdown()
		ns.WaitForShutdown()
	})
	if !ns.ReadyForConnections(10 * time.Second) {
		t.Fatal("NATS server not ready for connections after 10s")
	}
	return ns
}

// Conn returns an in-process connection to ns. At the end of the test it waits for a drain in
// progress (a closed watermill-nats subscriber drains its connection asynchronously), closes the
// connection, and waits until it is closed, so that no client goroutine outlives the test.
func Conn(t testing.TB, ns *server.Server, name string) *nats.Conn {
	t.Helper()
	closed := make(chan struct{})
	nc, err := nats.Connect("", nats.InProcessServer(ns), nats.Name(name),
		nats.ClosedHandler(func(*nats.Conn) { close(closed) }))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if nc.IsDraining() {
			select {
			case <-closed:
			case <-time.After(routertest.Timeout):
				t.Errorf("NATS connection %s still draining after %s", name, routertest.Timeout)
			}
		}
		nc.Close()
		select {
		case <-closed:
		case <-time.After(routertest.Timeout):
			t.Errorf("NATS connection %s not closed after %s", name, routertest.Timeout)
		}
	})
	return nc
}

// AddStreams creates a file-backed stream per topic, named after it (as watermill-nats names
// the stream of a topic), up front rather than letting every publisher and subscriber race to.
// Stream names cannot contain '.'.
func AddStreams(t testing.TB, js nats.JetStreamContext, topics ...string) {
	t.Helper()
	for _, topic := range topics {
		if _, err := js.AddStream(&nats.StreamConfig{Name: topic, Subjects: []string{topic}, Storage: nats.FileStorage}); err != nil {
			t.Fatalf("add stream %s: %v", topic, err)
		}
	}
}

// Publisher returns a JetStream publisher on a connection of its own, named name.
func Publisher(t testing.TB, ns *server.Server, name string, logger watermill.LoggerAdapter) *wnats.Publisher {
	t.Helper()
	pub, err := wnats.NewPublisherWithNatsConn(Conn(t, ns, name), wnats.PublisherPublishConfig{
		Marshaler:         &wnats.NATSMarshaler{},
		SubjectCalculator: wnats.DefaultSubjectCalculator,
		// TrackMsgId stays off: JetStream's own duplicate window (Nats-Msg-Id) would drop the
		// producer's duplicates and the Outbox's re-sends, and hide what the framework must absorb.
		JetStream: wnats.JetStreamConfig{TrackMsgId: false},
	}, logger)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = pub.Close() })
	return pub
}

// Subscriber returns a subscriber of the JetStream durable consumer durable (one per topic it
// subscribes to), on a connection of its own: every message delivered once to the durable, acked
// explicitly, and delivered again when it was nacked (after 50 ms) or not acked within ackWait.
// extra options come last, and override these (nats.MaxAckPending(1): one message at a time, in
// order).
func Subscriber(t testing.TB, ns *server.Server, durable string, ackWait time.Duration, logger watermill.LoggerAdapter, extra ...nats.SubOpt) *wnats.Subscriber {
	t.Helper()
	sub, err := wnats.NewSubscriberWithNatsConn(Conn(t, ns, durable), wnats.SubscriberSubscriptionConfig{
		Unmarshaler:      &wnats.NATSMarshaler{},
		SubscribersCount: 1,
		AckWaitTimeout:   ackWait,
		CloseTimeout:     30 * time.Second,
		SubscribeTimeout: 30 * time.Second,
		QueueGroupPrefix: durable, // a queue subscription's deliver group must equal its durable
		NakDelay:         wnats.NewStaticDelay(50 * time.Millisecond),
		JetStream: wnats.JetStreamConfig{
			DurablePrefix: durable,
			SubscribeOptions: append([]nats.SubOpt{
				// As in the example (examples/order-processing/broker.go): without ManualAck the
				// client acks every message its callback returns from, also one the subscriber
				// gave up on, and a failed delivery would never come back.
				nats.ManualAck(),
				nats.AckExplicit(),
				nats.DeliverAll(),
				nats.AckWait(ackWait),
				nats.MaxAckPending(64),
			}, extra...),
		},
	}, logger)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = sub.Close() }) // a Router closes it first; a second Close is a no-op
	return sub
}

// CaughtUp reports whether the durable consumer of stream has had every message delivered and
// acked, and otherwise what it still holds.
func CaughtUp(js nats.JetStreamContext, stream, durable string) (bool, string) {
	info, err := js.ConsumerInfo(stream, durable)
	if err != nil {
		return false, fmt.Sprintf("consumer info %s/%s: %v", stream, durable, err)
	}
	if info.NumPending != 0 || info.NumAckPending != 0 {
		return false, fmt.Sprintf("%s/%s: %d undelivered, %d unacked, %d redelivered",
			stream, durable, info.NumPending, info.NumAckPending, info.NumRedelivered)
	}
	return true, ""
}
