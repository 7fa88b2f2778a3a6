package outbox_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"

	"github.com/watermill-outbox/outbox"
)

func TestHandleCommitsBusinessAndEffectsThenDispatches(t *testing.T) {
	e := newEnv(t)
	var calls atomic.Int32
	msg := message.NewMessage(uuid.NewString(), []byte("order"))
	msg.Metadata.Set(outbox.MetadataCorrelationID, "corr-1")
	msg.Metadata.Set(outbox.MetadataTraceparent, "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01")

	if err := handle(e.ob, msg, applyAndPublish(&calls)); err != nil {
		t.Fatal(err)
	}
	mustEqual(t, "business rows", e.count(`SELECT count(*) FROM applied WHERE message_id = $1`, msg.UUID), 1)
	ids := e.storedEffects("c1", msg.UUID)
	mustEqual(t, "stored effects", len(ids), 2)
	mustEqual(t, "copies of effect 1 on the wire", e.wire("out_a")[ids[0]], 1)
	mustEqual(t, "copies of effect 2 on the wire", e.wire("out_b")[ids[1]], 1)
	mustEqual(t, "pending effects", e.pendingEffects(), 0)
	// Sent right after the claim: the time its effects were written into it stands for the
	// dispatch (see ClaimClockSlack); the mark leaves it.
	mustEqual(t, "claims keeping their time", e.count(`SELECT count(*) FROM outbox_processed
		WHERE dispatched_at >= processed_at AND dispatched_at < processed_at + interval '1 second'`), 1)

	var causation, correlation, traceparent string
	if err := e.db.QueryRow(`SELECT metadata->>'causation_id', metadata->>'correlation_id', metadata->>'traceparent' FROM watermill_out_a`).Scan(&causation, &correlation, &traceparent); err != nil {
		t.Fatal(err)
	}
	mustEqual(t, "causation id", causation, msg.UUID)
	mustEqual(t, "correlation id", correlation, "corr-1")
	mustEqual(t, "traceparent", traceparent, "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01")
}

func TestRedeliveredMessageSkipsTheHandler(t *testing.T) {
	e := newEnv(t)
	var calls atomic.Int32
	msg := message.NewMessage(uuid.NewString(), nil)
	for i := 0; i < 3; i++ {
		if err := handle(e.ob, copyOf(msg), applyAndPublish(&calls)); err != nil {
			t.Fatal(err)
		}
	}
	mustEqual(t, "handler calls", calls.Load(), int32(1))
	mustEqual(t, "business rows", e.count(`SELECT count(*) FROM applied`), 1)
	mustEqual(t, "messages on the wire", len(e.wire("out_a"))+len(e.wire("out_b")), 2)
}

// TestCrashAtEveryStep kills the unit of work at each failpoint, then lets a fresh process handle
// the redelivered message: one business effect, every committed effect sent with its stored UUID,
// and nothing from a rolled-back attempt on the wire.
func TestCrashAtEveryStep(t *testing.T) {
	points := []struct {
		point string
		hit   int // which occurrence of the point crashes
	}{
		{outbox.FailpointAfterClaim, 1},
		{outbox.FailpointAfterHandler, 1},
		{outbox.FailpointAfterCommit, 1},
		{outbox.FailpointAfterPublish, 1},
		{outbox.FailpointAfterPublish, 2},
		{outbox.FailpointAfterMark, 1},
	}
	for _, p := range points {
		t.Run(fmt.Sprintf("%s#%d", p.point, p.hit), func(t *testing.T) {
			e := newEnv(t)
			var seen int
			crashing := e.newOutbox(func(c *outbox.Config) {
				c.Failpoint = func(_ context.Context, point string) error {
					if point == p.point {
						if seen++; seen == p.hit {
							return errors.New("crash")
						}
					}
					return nil
				}
			})
			var calls atomic.Int32
			msg := message.NewMessage(uuid.NewString(), nil)
			err := handle(crashing, copyOf(msg), applyAndPublish(&calls))
			if !errors.Is(err, outbox.ErrFailpoint) {
				t.Fatalf("want the failpoint error, got %v", err)
			}

			// The broker redelivers to a restarted process.
			if err := handle(e.newOutbox(), copyOf(msg), applyAndPublish(&calls)); err != nil {
				t.Fatal(err)
			}
			mustEqual(t, "business rows", e.count(`SELECT count(*) FROM applied WHERE message_id = $1`, msg.UUID), 1)
			ids := e.storedEffects("c1", msg.UUID)
			mustEqual(t, "stored effects", len(ids), 2)
			wire := map[string]int{}
			for id, n := range e.wire("out_a") {
				wire[id] += n
			}
			for id, n := range e.wire("out_b") {
				wire[id] += n
			}
			for _, id := range ids {
				if wire[id] == 0 {
					t.Fatalf("effect %s never sent", id)
				}
				delete(wire, id)
			}
			if len(wire) != 0 {
				t.Fatalf("messages from a rolled-back attempt reached the wire: %v", wire)
			}
			mustEqual(t, "pending effects", e.pendingEffects(), 0)
			// A further redelivery changes nothing.
			before := calls.Load()
			if err := handle(e.newOutbox(), copyOf(msg), applyAndPublish(&calls)); err != nil {
				t.Fatal(err)
			}
			mustEqual(t, "handler calls after processing", calls.Load(), before)
		})
	}
}

// TestConcurrentCopiesRunTheHandlerOnce delivers copies of one message to several processes at once.
func TestConcurrentCopiesRunTheHandlerOnce(t *testing.T) {
	e := newEnv(t)
	var calls atomic.Int32
	slow := func(msg *message.Message) ([]*message.Message, error) {
		out, err := applyAndPublish(&calls)(msg)
		time.Sleep(100 * time.Millisecond) // keep the claim open while the copies arrive
		return out, err
	}
	const copies = 8
	for round := 0; round < 5; round++ {
		msg := message.NewMessage(uuid.NewString(), nil)
		var wg sync.WaitGroup
		errs := make([]error, copies)
		for i := 0; i < copies; i++ {
			// A generous wait: the winner must be given the time to finish even on a loaded machine,
			// and waiting ends as soon as it has.
			ob := e.newOutbox(func(c *outbox.Config) { c.DuplicateWait = 10 * time.Second })
			wg.Add(1)
			go func() {
				defer wg.Done()
				errs[i] = handle(ob, copyOf(msg), slow)
			}()
		}
		wg.Wait()
		for _, err := range errs {
			if err != nil {
				t.Fatal(err)
			}
		}
		mustEqual(t, "business rows", e.count(`SELECT count(*) FROM applied WHERE message_id = $1`, msg.UUID), 1)
	}
	mustEqual(t, "handler calls", calls.Load(), int32(5))
	mustEqual(t, "pending effects", e.pendingEffects(), 0)
	// The losers waited for the winner's dispatch instead of sending a second copy.
	for topic, copies := range map[string]map[string]int{"out_a": e.wire("out_a"), "out_b": e.wire("out_b")} {
		mustEqual(t, "distinct effects on "+topic, len(copies), 5)
		for id, n := range copies {
			mustEqual(t, "copies of "+id, n, 1)
		}
	}
}

func TestReturnedMessagesAreStoredNotRepublished(t *testing.T) {
	e := newEnv(t)
	out := message.NewMessage(uuid.NewString(), []byte("reply"))
	h := func(msg *message.Message) ([]*message.Message, error) { return []*message.Message{out}, nil }
	msg := message.NewMessage(uuid.NewString(), nil)
	err := e.ob.Handle(msg, outbox.HandleParams{Consumer: "c1", MessageID: msg.UUID, ReplyTopic: "replies"}, h)
	if err != nil {
		t.Fatal(err)
	}
	mustEqual(t, "reply on the wire", e.wire("replies")[out.UUID], 1)

	// Without a publish topic the returned messages cannot go anywhere: an error, nothing committed.
	msg2 := message.NewMessage(uuid.NewString(), nil)
	if err := handle(e.ob, msg2, h); err == nil {
		t.Fatal("want an error for returned messages without a publish topic")
	}
	mustEqual(t, "claims", e.count(`SELECT count(*) FROM outbox_processed WHERE message_id = $1`, msg2.UUID), 0)
}

func TestCustomSideEffectsAreAppliedAtLeastOnceWithStableIDs(t *testing.T) {
	e := newEnv(t)
	if _, err := e.db.Exec(`CREATE TABLE emails (effect_id text, body text)`); err != nil {
		t.Fatal(err)
	}
	var failNext atomic.Bool
	sendEmail := func(ctx context.Context, ef outbox.Effect) error {
		if failNext.Swap(false) {
			return errors.New("smtp down")
		}
		_, err := e.db.ExecContext(ctx, `INSERT INTO emails VALUES ($1, $2)`, ef.UUID, string(ef.Payload))
		return err
	}
	for _, ob := range []*outbox.Outbox{e.ob} {
		if err := ob.RegisterApplier("send-email", sendEmail); err != nil {
			t.Fatal(err)
		}
	}
	h := func(msg *message.Message) ([]*message.Message, error) {
		return nil, outbox.Record(msg.Context(), "send-email", []byte("receipt for "+msg.UUID))
	}
	msg := message.NewMessage(uuid.NewString(), nil)
	failNext.Store(true)
	if err := handle(e.ob, copyOf(msg), h); err == nil {
		t.Fatal("want the applier's error")
	}
	mustEqual(t, "emails after failure", e.count(`SELECT count(*) FROM emails`), 0)
	if err := handle(e.ob, copyOf(msg), h); err != nil {
		t.Fatal(err)
	}
	ids := e.storedEffects("c1", msg.UUID)
	mustEqual(t, "emails", e.count(`SELECT count(*) FROM emails WHERE effect_id = $1`, ids[0]), 1)

	// Recording an unregistered applier is an error inside the handler, before anything commits.
	bad := func(msg *message.Message) ([]*message.Message, error) {
		return nil, outbox.Record(msg.Context(), "no-such", nil)
	}
	if err := handle(e.ob, message.NewMessage(uuid.NewString(), nil), bad); !errors.Is(err, outbox.ErrUnknownApplier) {
		t.Fatalf("want ErrUnknownApplier, got %v", err)
	}
}

func TestPublishOutsideAUnitOfWork(t *testing.T) {
	err := outbox.Publish(context.Background(), "t", message.NewMessage("x", nil))
	if !errors.Is(err, outbox.ErrNoUnitOfWork) {
		t.Fatalf("want ErrNoUnitOfWork, got %v", err)
	}
	// The text names what a newcomer should reach for: WrapConsumer, the way the README wraps a
	// handler, and InTx for code without an incoming message.
	if msg := err.Error(); !strings.Contains(msg, "middleware.WrapConsumer") || !strings.Contains(msg, "InTx") || strings.Contains(msg, "middleware.New") {
		t.Errorf("ErrNoUnitOfWork says %q: want it to name middleware.WrapConsumer and InTx", msg)
	}
	if tx, ok := outbox.TxOK(context.Background()); ok || tx != nil {
		t.Fatal("TxOK outside a unit of work must report none")
	}
	defer func() {
		err, _ := recover().(error)
		if !errors.Is(err, outbox.ErrNoUnitOfWork) {
			t.Fatalf("Tx outside a unit of work: want a panic with ErrNoUnitOfWork, got %v", err)
		}
	}()
	outbox.Tx(context.Background())
	t.Fatal("Tx outside a unit of work returned")
}

// refusingTopic refuses every message to one topic while refuse is set, and hands the rest on.
type refusingTopic struct {
	next   message.Publisher
	topic  string
	refuse atomic.Bool
}

func (p *refusingTopic) Publish(topic string, msgs ...*message.Message) error {
	if topic == p.topic && p.refuse.Load() {
		return fmt.Errorf("topic %q refuses messages", topic)
	}
	return p.next.Publish(topic, msgs...)
}

func (p *refusingTopic) Close() error { return nil }

// TestOneMessageToTwoTopicsRedeliveredAtOnce: one message (one UUID) published to two topics,
// the second refusing it; the redelivery comes at once, before the mark of what went out is
// written. Each topic gets the message exactly once.
func TestOneMessageToTwoTopicsRedeliveredAtOnce(t *testing.T) {
	e := newEnv(t)
	pub := &refusingTopic{next: e.pub, topic: "out_b"}
	ob := e.newOutbox(func(c *outbox.Config) {
		c.Publisher, c.RetryDelay = pub, -1
		c.RelayGrace, c.RelayInterval, c.RelayMaxAttempts = 50*time.Millisecond, 20*time.Millisecond, 100
	})
	out := uuid.NewString()
	h := func(msg *message.Message) ([]*message.Message, error) {
		ctx := msg.Context()
		if _, err := outbox.Tx(ctx).ExecContext(ctx, `INSERT INTO applied (message_id) VALUES ($1)`, msg.UUID); err != nil {
			return nil, err
		}
		if err := outbox.Publish(ctx, "out_a", message.NewMessage(out, nil)); err != nil {
			return nil, err
		}
		return nil, outbox.Publish(ctx, "out_b", message.NewMessage(out, nil))
	}
	msg := message.NewMessage(uuid.NewString(), nil)
	pub.refuse.Store(true)
	if err := handle(ob, msg, h); !errors.Is(err, outbox.ErrDispatchFailed) {
		t.Fatalf("dispatch with out_b refusing: %v", err)
	}
	pub.refuse.Store(false)
	if err := handle(ob, copyOf(msg), h); err != nil {
		t.Fatalf("redelivery: %v", err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	runCtx, stop := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- ob.Run(runCtx) }()
	idleErr := ob.WaitIdle(ctx)
	stop()
	<-done
	if idleErr != nil {
		t.Fatal(idleErr)
	}
	mustEqual(t, "copies on out_a", e.wire("out_a")[out], 1)
	mustEqual(t, "copies on out_b", e.wire("out_b")[out], 1)
	mustEqual(t, "business rows", e.count(`SELECT count(*) FROM applied WHERE message_id = $1`, msg.UUID), 1)
}
