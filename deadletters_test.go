package outbox_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wsql "github.com/ThreeDotsLabs/watermill-sql/v3/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"

	"github.com/watermill-outbox/outbox"
	"github.com/watermill-outbox/outbox/internal/logtest"
	"github.com/watermill-outbox/outbox/internal/routertest"
	"github.com/watermill-outbox/outbox/middleware"
	"github.com/watermill-outbox/outbox/outboxdriver"
)

// TestRetriedDeadLetterIsProcessedOnce runs a consumer behind a real Router over the
// watermill-sql pub/sub. A message its handler cannot process yet is dead-lettered (with the
// topic it came from) and acked; once the cause is fixed, two operators retry it at the same
// moment. The consumer must then process it exactly once, with its own UUID, while a second
// consumer of the topic, which processed it the first time, does not process it again.
func TestRetriedDeadLetterIsProcessedOnce(t *testing.T) {
	retriedDeadLetterIsProcessedOnce(t, false, false)
}

// TestRetriedDeadLetterKeepsTheUUID is TestRetriedDeadLetterIsProcessedOnce with a consumer that
// reads its message ID from the metadata (middleware.WithMessageID): the dead letter is keyed by
// that ID, and the retry must still publish the message with its own UUID. Republished under
// that ID as its UUID, it was a new message to the topic's second consumer, which processed it
// again.
func TestRetriedDeadLetterKeepsTheUUID(t *testing.T) {
	retriedDeadLetterIsProcessedOnce(t, true, false)
}

// TestRetriedDeadLetterIsForItsConsumerOnly is TestRetriedDeadLetterIsProcessedOnce with the
// retry made after the other consumer's claim of the message was cleaned up (a dead letter
// retried, or redriven, past Retention). The retried copy goes to the topic, which every
// consumer group reads: it is addressed to the consumer of the dead letter, and the others ack
// it without running their handlers. Unaddressed, the other consumer, which no longer knew the
// message, processed it a second time.
func TestRetriedDeadLetterIsForItsConsumerOnly(t *testing.T) {
	retriedDeadLetterIsProcessedOnce(t, false, true)
}

func retriedDeadLetterIsProcessedOnce(t *testing.T, idFromMetadata bool, pastRetention bool) {
	const topic = "orders.dead"
	e := newEnv(t)
	e.initTopics(topic)
	if _, err := e.db.Exec(`CREATE TABLE dl_applied (consumer text NOT NULL, message_id text NOT NULL, payload bytea NOT NULL)`); err != nil {
		t.Fatal(err)
	}
	logs := &logtest.Errors{}
	var broken atomic.Bool
	broken.Store(true)
	apply := func(consumer string, fails bool) message.NoPublishHandlerFunc {
		return func(msg *message.Message) error {
			ctx := msg.Context()
			if v, ok := msg.Metadata[outbox.MetadataRetryFor]; ok {
				t.Errorf("%s's handler saw the retry's address (%q): a handler that copies the metadata to its messages would pass it on", consumer, v)
			}
			if _, err := outbox.Tx(ctx).ExecContext(ctx, `INSERT INTO dl_applied VALUES ($1, $2, $3)`, consumer, msg.UUID, msg.Payload); err != nil {
				return err
			}
			if fails && broken.Load() {
				return outbox.Permanent(errors.New("unknown product"))
			}
			return nil
		}
	}
	cfg := func(c *outbox.Config) {
		c.RelayInterval = 50 * time.Millisecond
		c.RetryDelay = -1
	}
	ob := e.newOutbox(withRealPublisher(t, e.db), routertest.WithLogger(logs), cfg)
	routertest.RunOutbox(t, ob)
	r := routertest.NewRouter(t, logs)
	var opts []middleware.Option
	if idFromMetadata {
		opts = append(opts, middleware.WithMessageID(func(m *message.Message) (string, error) { return m.Metadata.Get("order_id"), nil }))
	}
	r.AddConsumerHandler("stock", topic, newSQLSubscriber(t, e.db, "stock", topic), apply("stock", true)).AddMiddleware(middleware.New(ob, opts...))
	other := e.newOutbox(withRealPublisher(t, e.db), routertest.WithLogger(logs), cfg)
	routertest.RunOutbox(t, other)
	r.AddConsumerHandler("billing", topic, newSQLSubscriber(t, e.db, "billing", topic), apply("billing", false)).AddMiddleware(middleware.New(other))
	routertest.RunRouter(t, r)

	producer, err := wsql.NewPublisher(e.db, wsql.PublisherConfig{SchemaAdapter: brokerSchema()}, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	msg := message.NewMessage(uuid.NewString(), []byte("order 1"))
	msg.Metadata.Set("tenant", "t1")
	msg.Metadata.Set("order_id", "order-1")
	stockID := msg.UUID
	if idFromMetadata {
		stockID = "order-1"
	}
	if err := producer.Publish(topic, msg); err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	var dead []outbox.DeadLetter
	routertest.WaitUntil(t, "the message dead-lettered and the topic consumed", func() (bool, string) {
		var err error
		dead, err = ob.DeadLetters(ctx, outbox.DeadLetterFilter{State: outboxdriver.DeadLetterDead})
		if err != nil {
			t.Fatal(err)
		}
		caught, state := sqlCaughtUp(t, e.db, topic, "stock", "billing")
		return len(dead) == 1 && caught, fmt.Sprintf("%d dead letters; %s", len(dead), state)
	})
	if d := dead[0]; d.Consumer != "stock" || d.MessageID != stockID || d.SourceTopic != topic || !d.Permanent ||
		string(d.Payload) != "order 1" || d.Metadata["tenant"] != "t1" {
		t.Fatalf("dead letter: %+v", d)
	}
	mustEqual(t, "rows applied by stock before the retry", e.count(`SELECT count(*) FROM dl_applied WHERE consumer = 'stock'`), 0)
	mustEqual(t, "rows applied by billing", e.count(`SELECT count(*) FROM dl_applied WHERE consumer = 'billing'`), 1)

	if pastRetention {
		// What the cleanup does to billing's claim once Retention passed.
		if _, err := e.db.Exec(`DELETE FROM outbox_processed WHERE consumer = 'billing'`); err != nil {
			t.Fatal(err)
		}
	}
	broken.Store(false)
	var retried atomic.Int32
	var wg sync.WaitGroup
	for _, actor := range []string{"ops-a", "ops-b"} {
		wg.Add(1)
		go func() {
			defer wg.Done()
			n, err := ob.RetryDeadLetters(ctx, actor, outbox.Source{Consumer: "stock", ID: stockID})
			if err != nil {
				t.Error(err)
			}
			retried.Add(int32(n))
		}()
	}
	wg.Wait()
	mustEqual(t, "dead letters retried by the two operators", retried.Load(), int32(1))
	routertest.WaitUntil(t, "the retried message applied and everything settled", func() (bool, string) {
		applied := e.count(`SELECT count(*) FROM dl_applied WHERE consumer = 'stock'`)
		if applied == 0 || e.pendingEffects() != 0 {
			return false, fmt.Sprintf("%d applied, %d effects pending", applied, e.pendingEffects())
		}
		return sqlCaughtUp(t, e.db, topic, "stock", "billing")
	})
	mustEqual(t, "rows applied by stock (the retried message)", e.count(`SELECT count(*) FROM dl_applied WHERE consumer = 'stock' AND message_id = $1 AND payload = 'order 1'`, msg.UUID), 1)
	mustEqual(t, "rows applied by billing (a retry is no new message for it)", e.count(`SELECT count(*) FROM dl_applied WHERE consumer = 'billing'`), 1)
	mustEqual(t, "copies of the message on the topic", e.wire(topic)[msg.UUID], 2)
	all, err := ob.DeadLetters(ctx, outbox.DeadLetterFilter{})
	if err != nil {
		t.Fatal(err)
	}
	if len(all) != 1 || all[0].State != outboxdriver.DeadLetterRetried || all[0].Retries != 1 {
		t.Fatalf("dead letter after the retry: %+v", all)
	}
	mustEqual(t, "poisoned claims left", e.count(`SELECT count(*) FROM outbox_processed WHERE poisoned`), 0)
}

// TestFailedDeliveryBesideAProcessedCopySendsItsEffects: a delivery fails for good while a copy
// of its message is processed (the copy waited for its claim, then committed while the failed
// one stored its dead letter), and the copy's process stops right after its commit (a crash:
// nothing dispatched). The failed delivery is acked as a duplicate and, as any duplicate, sends
// the effects the copy left pending. Acked without them, they waited for the relay's sweep.
func TestFailedDeliveryBesideAProcessedCopySendsItsEffects(t *testing.T) {
	errCrash := errors.New("the process stops after its commit")
	var crash atomic.Bool
	e := newEnv(t, func(c *outbox.Config) {
		c.DuplicateWait = 100 * time.Millisecond
		c.Failpoint = func(_ context.Context, point string) error {
			if point == outbox.FailpointAfterCommit && crash.Load() {
				return errCrash
			}
			return nil
		}
	})
	e.initTopics("out_a", "out_b")
	waiting := func() int {
		return e.count(`SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND datname = current_database()`)
	}
	msg := message.NewMessage(uuid.NewString(), nil)
	bStarted, releaseB := make(chan struct{}), make(chan struct{})
	aErr, bErr := make(chan error, 1), make(chan error, 1)
	go func() {
		aErr <- handle(e.ob, copyOf(msg), func(*message.Message) ([]*message.Message, error) {
			// The copy is delivered meanwhile, and waits for this claim.
			go func() {
				bErr <- handle(e.ob, copyOf(msg), func(m *message.Message) ([]*message.Message, error) {
					close(bStarted)
					<-releaseB
					crash.Store(true)
					return applyAndPublish(nil)(m)
				})
			}()
			waitFor(t, "the copy to wait for the claim", func() bool { return waiting() == 1 })
			return nil, outbox.Permanent(errors.New("unknown product"))
		})
	}()
	// This delivery rolled back, the copy has the claim, and the dead letter waits for it.
	<-bStarted
	waitFor(t, "the dead letter to wait for the copy's claim", func() bool { return waiting() == 1 })
	close(releaseB)
	if err := <-bErr; !errors.Is(err, errCrash) {
		t.Fatalf("the copy: %v, want its crash after the commit", err)
	}
	if err := <-aErr; err != nil {
		t.Fatalf("the failed delivery: %v, want it acked as a duplicate of the processed copy", err)
	}
	mustEqual(t, "business rows", e.count(`SELECT count(*) FROM applied`), 1)
	mustEqual(t, "dead letters", e.count(`SELECT count(*) FROM outbox_dead_letters`), 0)
	waitFor(t, "the copy's effects sent", func() bool { return len(e.wire("out_a")) == 1 && len(e.wire("out_b")) == 1 })
	mustEqual(t, "effects pending", e.pendingEffects(), 0)
}

// TestPoisonTopicSkipsAMessageProcessedMeanwhile: with dead letters off and a PoisonTopic, a
// delivery fails for good while a copy of its message waits for its claim and is then
// processed. The failed delivery published the message to the poison topic before it recorded
// the poisoned claim, which the copy's claim had taken meanwhile: a message that was processed
// was on the poison topic as well. The claim and the copy for the topic are now written in one
// transaction, which finds the copy's claim: the delivery is acked as a duplicate.
func TestPoisonTopicSkipsAMessageProcessedMeanwhile(t *testing.T) {
	e := newEnv(t, func(c *outbox.Config) {
		c.DuplicateWait = 100 * time.Millisecond
		c.DeadLetters = outbox.DeadLettersOff
		c.PoisonTopic = "poison"
	})
	e.initTopics("out_a", "out_b", "poison")
	waiting := func() int {
		return e.count(`SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND datname = current_database()`)
	}
	msg := message.NewMessage(uuid.NewString(), nil)
	bStarted, releaseB := make(chan struct{}), make(chan struct{})
	aErr, bErr := make(chan error, 1), make(chan error, 1)
	go func() {
		aErr <- handle(e.ob, copyOf(msg), func(*message.Message) ([]*message.Message, error) {
			go func() {
				bErr <- handle(e.ob, copyOf(msg), func(m *message.Message) ([]*message.Message, error) {
					close(bStarted)
					<-releaseB
					return applyAndPublish(nil)(m)
				})
			}()
			waitFor(t, "the copy to wait for the claim", func() bool { return waiting() == 1 })
			return nil, outbox.Permanent(errors.New("unknown product"))
		})
	}()
	<-bStarted
	// Give the failed delivery time to reach the poison topic, or the copy's claim.
	time.Sleep(300 * time.Millisecond)
	close(releaseB)
	if err := <-bErr; err != nil {
		t.Fatalf("the copy: %v", err)
	}
	if err := <-aErr; err != nil {
		t.Fatalf("the failed delivery: %v, want it acked as a duplicate of the processed copy", err)
	}
	mustEqual(t, "business rows", e.count(`SELECT count(*) FROM applied`), 1)
	mustEqual(t, "messages on the poison topic", len(e.wire("poison")), 0)
	mustEqual(t, "poisoned claims", e.count(`SELECT count(*) FROM outbox_processed WHERE poisoned`), 0)
	// A message that fails for good alone still goes there, once, and its copies are acked.
	bad := message.NewMessage(uuid.NewString(), []byte("bad"))
	for range 2 {
		if err := handle(e.ob, copyOf(bad), func(*message.Message) ([]*message.Message, error) {
			return nil, outbox.Permanent(errors.New("unknown product"))
		}); err != nil {
			t.Fatal(err)
		}
	}
	mustEqual(t, "copies on the poison topic", e.wire("poison")[bad.UUID], 1)
	mustEqual(t, "effects pending", e.pendingEffects(), 0)
}

// A message acked before its unit of work failed (InstantAck outside the outbox middleware, or a
// handler that acked it itself): the nack that followed the failure was a no-op, the broker had
// forgotten the message, and nothing redelivered it: lost, with an attempt counted and nothing
// else. It is dead-lettered at once now (not as permanent: the redrive policy may retry it).
func TestAckedMessageThatFailsIsDeadLettered(t *testing.T) {
	e := newEnv(t, func(c *outbox.Config) { c.RetryDelay = -1 })
	for name, ackFirst := range map[string]bool{"acked before": true, "acked by the handler": false} {
		msg := message.NewMessage(uuid.NewString(), []byte(name))
		if ackFirst {
			msg.Ack()
		}
		err := handle(e.ob, msg, func(m *message.Message) ([]*message.Message, error) {
			m.Ack()
			return nil, errors.New("the stock service refused")
		})
		if err != nil {
			t.Errorf("%s: %v; want it dead-lettered", name, err)
		}
		mustEqual(t, name+": dead letters", e.count(`SELECT count(*) FROM outbox_dead_letters WHERE message_id = $1 AND NOT permanent
			AND reason LIKE '%acked before its unit of work ended%'`, msg.UUID), 1)
	}
}
