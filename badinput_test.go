package outbox_test

import (
	"bytes"
	"context"
	"errors"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"

	"github.com/watermill-outbox/outbox"
)

func TestInvalidIncomingMessageIDsAreRejectedNotAcked(t *testing.T) {
	e := newEnv(t)
	off := e.newOutbox(func(c *outbox.Config) { c.DeadLetters = outbox.DeadLettersOff })
	for name, id := range map[string]string{
		"empty":     "",
		"too long":  strings.Repeat("x", 256),
		"NUL":       "abc\x00def",
		"not UTF-8": "abc\xffdef",
	} {
		t.Run(name, func(t *testing.T) {
			// With dead letters off and no poison topic, it is nacked, never silently acked.
			var calls atomic.Int32
			msg := message.NewMessage(id, []byte("rejected "+name))
			err := handle(off, msg, applyAndPublish(&calls))
			if !errors.Is(err, outbox.ErrInvalidMessageID) {
				t.Fatalf("want ErrInvalidMessageID, got %v", err)
			}
			// By default it is dead-lettered at once, under an ID every copy derives alike, and
			// acked; a second copy finds the dead letter and is acked too.
			for copyNo := 1; copyNo <= 2; copyNo++ {
				if err := handle(e.ob, copyOf(msg), applyAndPublish(&calls)); err != nil {
					t.Fatalf("copy %d: want it dead-lettered and acked, got %v", copyNo, err)
				}
			}
			mustEqual(t, "handler calls", calls.Load(), int32(0))
			mustEqual(t, "dead letters", e.count(`SELECT count(*) FROM outbox_dead_letters WHERE payload = $1
				AND permanent AND reason LIKE '%invalid message ID%'`, []byte("rejected "+name)), 1)
		})
	}
	// With a poison topic a copy goes there too (with a usable ID), never dropped.
	ob := e.newOutbox(func(c *outbox.Config) { c.PoisonTopic = "poison" })
	if err := handle(ob, message.NewMessage("", []byte("orphan")), applyAndPublish(nil)); err != nil {
		t.Fatal(err)
	}
	mustEqual(t, "poisoned", e.count(`SELECT count(*) FROM watermill_poison WHERE payload = 'orphan'::bytea AND metadata->>'outbox_poison_reason' LIKE '%invalid message ID%'`), 1)
	// And with dead letters off, as before them: published there and acked.
	ob = e.newOutbox(func(c *outbox.Config) { c.PoisonTopic = "poison"; c.DeadLetters = outbox.DeadLettersOff })
	if err := handle(ob, message.NewMessage("", []byte("orphan, no dead letters")), applyAndPublish(nil)); err != nil {
		t.Fatal(err)
	}
	mustEqual(t, "poisoned", e.count(`SELECT count(*) FROM watermill_poison WHERE payload = 'orphan, no dead letters'::bytea`), 1)
}

func TestArbitraryBytesSurviveStorageByteForByte(t *testing.T) {
	e := newEnv(t)
	payload := []byte("a\x00b\xff\xfe{not json")
	md := map[string]string{"nul\x00key": "v\x00al", "bad-utf8": "\xff\xfe", "empty": ""}
	e.pub.failAll.Store(true) // keep the effect pending so that it is read back from storage
	h := func(msg *message.Message) ([]*message.Message, error) {
		out := message.NewMessage(uuid.NewString(), payload)
		for k, v := range md {
			out.Metadata.Set(k, v)
		}
		return nil, outbox.Publish(msg.Context(), "out_a", out)
	}
	msg := message.NewMessage(uuid.NewString(), nil)
	if err := handle(e.ob, msg, h); err == nil {
		t.Fatal("want a dispatch error")
	}
	pending, err := e.ob.Store().EffectListPending(context.Background(), outbox.Source{Consumer: "c1", ID: msg.UUID})
	if err != nil {
		t.Fatal(err)
	}
	mustEqual(t, "pending", len(pending), 1)
	if !bytes.Equal(pending[0].Payload, payload) {
		t.Fatalf("payload changed: %q", pending[0].Payload)
	}
	for k, v := range md {
		if pending[0].Metadata[k] != v {
			t.Fatalf("metadata %q: got %q want %q", k, pending[0].Metadata[k], v)
		}
	}
	// The redelivery sends the stored bytes; the broker's BYTEA payload column keeps them exact.
	e.pub.failAll.Store(false)
	if err := handle(e.ob, copyOf(msg), h); err != nil {
		t.Fatal(err)
	}
	var got []byte
	if err := e.db.QueryRow(`SELECT payload FROM watermill_out_a`).Scan(&got); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, payload) {
		t.Fatalf("payload on the wire: %q", got)
	}
}

func TestOversizedPayloadsAndBadTopicsFailTheHandlerAndCommitNothing(t *testing.T) {
	e := newEnv(t, func(c *outbox.Config) { c.MaxPayloadBytes = 1 << 20 })
	cases := map[string]struct {
		topic   string
		payload []byte
		want    error
	}{
		"huge payload": {"out_a", make([]byte, 1<<20+1), outbox.ErrPayloadTooLarge},
		"empty topic":  {"", nil, outbox.ErrInvalidTopic},
		"NUL topic":    {"a\x00b", nil, outbox.ErrInvalidTopic},
	}
	for name, c := range cases {
		t.Run(name, func(t *testing.T) {
			msg := message.NewMessage(uuid.NewString(), nil)
			h := func(m *message.Message) ([]*message.Message, error) {
				ctx := m.Context()
				if _, err := outbox.Tx(ctx).ExecContext(ctx, `INSERT INTO applied (message_id) VALUES ($1)`, m.UUID); err != nil {
					return nil, err
				}
				return nil, outbox.Publish(ctx, c.topic, message.NewMessage(uuid.NewString(), c.payload))
			}
			if err := handle(e.ob, msg, h); !errors.Is(err, c.want) {
				t.Fatalf("want %v, got %v", c.want, err)
			}
			mustEqual(t, "business rows", e.count(`SELECT count(*) FROM applied WHERE message_id = $1`, msg.UUID), 0)
			mustEqual(t, "claims", e.count(`SELECT count(*) FROM outbox_processed WHERE message_id = $1`, msg.UUID), 0)
		})
	}
	// A large payload under the limit (with the metadata the framework adds) goes through intact.
	big := bytes.Repeat([]byte{0, 1, 2, 255}, 1<<18-256)
	msg := message.NewMessage(uuid.NewString(), nil)
	h := func(m *message.Message) ([]*message.Message, error) {
		return nil, outbox.Publish(m.Context(), "out_a", message.NewMessage(uuid.NewString(), big))
	}
	if err := handle(e.ob, msg, h); err != nil {
		t.Fatal(err)
	}
	mustEqual(t, "big payload on the wire", e.count(`SELECT count(*) FROM watermill_out_a WHERE length(payload) = $1`, len(big)), 1)
}

func TestPanickingHandlerRollsBackAndIsRetried(t *testing.T) {
	e := newEnv(t)
	var calls atomic.Int32
	h := func(msg *message.Message) ([]*message.Message, error) {
		if _, err := applyAndPublish(nil)(msg); err != nil {
			return nil, err
		}
		if calls.Add(1) == 1 {
			panic("nil map somewhere")
		}
		return nil, nil
	}
	msg := message.NewMessage(uuid.NewString(), nil)
	err := handle(e.ob, copyOf(msg), h)
	if !errors.Is(err, outbox.ErrHandlerPanicked) || !strings.Contains(err.Error(), "nil map somewhere") {
		t.Fatalf("want ErrHandlerPanicked with the panic value, got %v", err)
	}
	mustEqual(t, "business rows after panic", e.count(`SELECT count(*) FROM applied`), 0)
	mustEqual(t, "attempt counted", e.count(`SELECT attempts FROM outbox_attempts`), 1)
	if err := handle(e.ob, copyOf(msg), h); err != nil {
		t.Fatal(err)
	}
	mustEqual(t, "business rows", e.count(`SELECT count(*) FROM applied`), 1)
	mustEqual(t, "effects sent", len(e.wire("out_a"))+len(e.wire("out_b")), 2)
}

func TestHandlerThatCommitsTheTransactionItselfLosesNothing(t *testing.T) {
	e := newEnv(t)
	var calls atomic.Int32
	h := func(msg *message.Message) ([]*message.Message, error) {
		if _, err := applyAndPublish(&calls)(msg); err != nil {
			return nil, err
		}
		return nil, outbox.Tx(msg.Context()).Commit()
	}
	msg := message.NewMessage(uuid.NewString(), nil)
	if err := handle(e.ob, copyOf(msg), h); !errors.Is(err, outbox.ErrTxFinishedByHandler) {
		t.Fatalf("want ErrTxFinishedByHandler, got %v", err)
	}
	// The redelivery finds the message processed and sends what the handler's commit stored.
	if err := handle(e.ob, copyOf(msg), h); err != nil {
		t.Fatal(err)
	}
	mustEqual(t, "handler calls", calls.Load(), int32(1))
	mustEqual(t, "business rows", e.count(`SELECT count(*) FROM applied`), 1)
	mustEqual(t, "effects sent", len(e.wire("out_a"))+len(e.wire("out_b")), 2)
}

func TestHandlerThatRollsBackTheTransactionItselfIsRetried(t *testing.T) {
	e := newEnv(t)
	var calls atomic.Int32
	h := func(msg *message.Message) ([]*message.Message, error) {
		if _, err := applyAndPublish(&calls)(msg); err != nil {
			return nil, err
		}
		if calls.Load() == 1 {
			return nil, outbox.Tx(msg.Context()).Rollback()
		}
		return nil, nil
	}
	msg := message.NewMessage(uuid.NewString(), nil)
	if err := handle(e.ob, copyOf(msg), h); !errors.Is(err, outbox.ErrTxFinishedByHandler) {
		t.Fatalf("want ErrTxFinishedByHandler, got %v", err)
	}
	mustEqual(t, "business rows after rollback", e.count(`SELECT count(*) FROM applied`), 0)
	if err := handle(e.ob, copyOf(msg), h); err != nil {
		t.Fatal(err)
	}
	mustEqual(t, "business rows", e.count(`SELECT count(*) FROM applied`), 1)
	mustEqual(t, "effects sent", len(e.wire("out_a"))+len(e.wire("out_b")), 2)
}

func TestFailingOrHangingPublisherKeepsEffectsForRedelivery(t *testing.T) {
	e := newEnv(t, func(c *outbox.Config) { c.PublishTimeout = 200 * time.Millisecond })
	msg := message.NewMessage(uuid.NewString(), nil)

	e.pub.fail.Store(1)
	if err := handle(e.ob, copyOf(msg), applyAndPublish(nil)); err == nil || !strings.Contains(err.Error(), "broker unavailable") {
		t.Fatalf("want the broker's error, got %v", err)
	}
	hang := make(chan struct{})
	e.pub.mu.Lock()
	e.pub.hang = hang
	e.pub.mu.Unlock()
	err := handle(e.ob, copyOf(msg), applyAndPublish(nil))
	e.pub.mu.Lock()
	e.pub.hang = nil
	e.pub.mu.Unlock()
	close(hang) // release the stuck Publish call
	if !errors.Is(err, outbox.ErrPublishTimeout) {
		t.Fatalf("want ErrPublishTimeout, got %v", err)
	}
	mustEqual(t, "pending effects", e.pendingEffects(), 2)
	// The redelivery reaches another instance, whose PublishTimeout is the default: the 200 ms
	// above is for the hang, and a loaded machine's INSERT into the SQL broker may take longer.
	if err := handle(e.newOutbox(), copyOf(msg), applyAndPublish(nil)); err != nil {
		t.Fatal(err)
	}
	mustEqual(t, "business rows", e.count(`SELECT count(*) FROM applied`), 1)
	mustEqual(t, "effects sent", len(e.wire("out_a"))+len(e.wire("out_b")), 2)
	mustEqual(t, "pending effects", e.pendingEffects(), 0)
}

// TestDatabaseConnectionKilledMidMessage terminates the handler's backend, as a database restart
// would, then redelivers.
func TestDatabaseConnectionKilledMidMessage(t *testing.T) {
	e := newEnv(t)
	var calls atomic.Int32
	h := func(msg *message.Message) ([]*message.Message, error) {
		ctx := msg.Context()
		tx := outbox.Tx(ctx)
		if calls.Add(1) == 1 {
			var pid int
			if err := tx.QueryRowContext(ctx, `SELECT pg_backend_pid()`).Scan(&pid); err != nil {
				return nil, err
			}
			if _, err := e.db.Exec(`SELECT pg_terminate_backend($1)`, pid); err != nil {
				return nil, err
			}
		}
		return applyAndPublish(nil)(msg)
	}
	msg := message.NewMessage(uuid.NewString(), nil)
	if err := handle(e.ob, copyOf(msg), h); err == nil {
		t.Fatal("want an error when the connection dies")
	}
	if err := handle(e.ob, copyOf(msg), h); err != nil {
		t.Fatal(err)
	}
	mustEqual(t, "business rows", e.count(`SELECT count(*) FROM applied`), 1)
	mustEqual(t, "effects sent", len(e.wire("out_a"))+len(e.wire("out_b")), 2)
}

// TestMessageContextCancelledBeforeCommit: the ack deadline or Router shutdown cancels msg.Context()
// after the handler returned; the commit must still go through whole.
func TestMessageContextCancelledBeforeCommit(t *testing.T) {
	e := newEnv(t)
	ctx, cancel := context.WithCancel(context.Background())
	msg := message.NewMessage(uuid.NewString(), nil)
	msg.SetContext(ctx)
	h := func(m *message.Message) ([]*message.Message, error) {
		out, err := applyAndPublish(nil)(m)
		cancel()
		return out, err
	}
	if err := handle(e.ob, msg, h); err != nil {
		t.Fatal(err)
	}
	mustEqual(t, "business rows", e.count(`SELECT count(*) FROM applied`), 1)
	mustEqual(t, "effects sent", len(e.wire("out_a"))+len(e.wire("out_b")), 2)
}

// A message whose own deadline (Watermill's Timeout middleware outside the outbox's) passes
// during its unit of work: counted as a failed attempt, as HandlerTimeout's is. Taken for a
// shutdown, it was never counted: a message that always outlasts its deadline was rolled back and
// redelivered for ever, never dead-lettered, and no metric said so. A cancel (a shutdown, a
// broker's ack timeout) is still not counted.
func TestMessageDeadlineCountsTheAttempt(t *testing.T) {
	e := newEnv(t, func(c *outbox.Config) { c.MaxAttempts = 2; c.RetryDelay = -1 })
	slow := func(m *message.Message) ([]*message.Message, error) {
		if _, err := applyAndPublish(nil)(m); err != nil {
			return nil, err
		}
		<-m.Context().Done() // a handler slower than the deadline, that heeds its context
		return nil, m.Context().Err()
	}
	deliver := func(msg *message.Message, end func(context.Context) (context.Context, context.CancelFunc)) error {
		ctx, cancel := end(context.Background())
		defer cancel()
		m := copyOf(msg)
		m.SetContext(ctx)
		return handle(e.ob, m, slow)
	}
	deadline := func(ctx context.Context) (context.Context, context.CancelFunc) {
		return context.WithTimeout(ctx, 100*time.Millisecond)
	}
	cancelled := func(ctx context.Context) (context.Context, context.CancelFunc) {
		ctx, cancel := context.WithCancel(ctx)
		time.AfterFunc(100*time.Millisecond, cancel)
		return ctx, cancel
	}
	msg := message.NewMessage(uuid.NewString(), nil)
	if err := deliver(msg, cancelled); err == nil {
		t.Fatal("a cancelled unit of work was acked")
	}
	mustEqual(t, "attempts counted after a cancel", e.count(`SELECT count(*) FROM outbox_attempts WHERE message_id = $1`, msg.UUID), 0)
	if err := deliver(msg, deadline); err == nil {
		t.Fatal("the first delivery past its deadline was acked")
	}
	mustEqual(t, "attempts counted", e.count(`SELECT coalesce(max(attempts), 0) FROM outbox_attempts WHERE message_id = $1`, msg.UUID), 1)
	if err := deliver(msg, deadline); err != nil {
		t.Fatalf("the second delivery past its deadline (MaxAttempts 2): %v; want it dead-lettered", err)
	}
	mustEqual(t, "dead letters", e.count(`SELECT count(*) FROM outbox_dead_letters WHERE message_id = $1`, msg.UUID), 1)
	mustEqual(t, "business rows", e.count(`SELECT count(*) FROM applied`), 0)
}

// TestHandlerTimeoutCountsTheAttempt: a handler that outlives HandlerTimeout is rolled back by
// database/sql; that must be reported as a timeout (not as a handler that finished the transaction
// itself) and counted as a failed attempt, and the redelivery must apply the message once.
func TestHandlerTimeoutCountsTheAttempt(t *testing.T) {
	// A second: the redelivery must fit in it on a loaded machine; the first call outlives it.
	e := newEnv(t, func(c *outbox.Config) { c.HandlerTimeout = time.Second })
	var calls atomic.Int32
	h := func(msg *message.Message) ([]*message.Message, error) {
		out, err := applyAndPublish(nil)(msg)
		if calls.Add(1) == 1 {
			<-msg.Context().Done()
			time.Sleep(100 * time.Millisecond)
		}
		return out, err
	}
	msg := message.NewMessage(uuid.NewString(), nil)
	err := handle(e.ob, copyOf(msg), h)
	if !errors.Is(err, context.DeadlineExceeded) || errors.Is(err, outbox.ErrTxFinishedByHandler) {
		t.Fatalf("want a HandlerTimeout error, got %v", err)
	}
	mustEqual(t, "attempt counted", e.count(`SELECT attempts FROM outbox_attempts WHERE message_id = $1`, msg.UUID), 1)
	mustEqual(t, "business rows after the timeout", e.count(`SELECT count(*) FROM applied`), 0)
	mustEqual(t, "messages on the wire after the timeout", len(e.wire("out_a"))+len(e.wire("out_b")), 0)
	if err := handle(e.ob, copyOf(msg), h); err != nil {
		t.Fatal(err)
	}
	mustEqual(t, "business rows", e.count(`SELECT count(*) FROM applied`), 1)
	mustEqual(t, "effects sent", len(e.wire("out_a"))+len(e.wire("out_b")), 2)
}

// TestLongMessageIDsGetAStorableDefaultOrderingKey: a valid message ID of 250 bytes publishes.
// The default ordering key (consumer, "/", ID) would be longer than a stored key may be: it is
// shortened, the same way on every attempt, and a short one is left as it is.
func TestLongMessageIDsGetAStorableDefaultOrderingKey(t *testing.T) {
	e := newEnv(t)
	e.pub.failAll.Store(true) // keep the effects pending, to read their keys
	for _, id := range []string{strings.Repeat("é", 125), "short-" + uuid.NewString()} {
		msg := message.NewMessage(id, nil)
		h := func(m *message.Message) ([]*message.Message, error) {
			return nil, outbox.Publish(m.Context(), "out_a", message.NewMessage(uuid.NewString(), []byte("x")))
		}
		err := e.ob.Handle(msg, outbox.HandleParams{Consumer: "billing", MessageID: id}, h)
		if !errors.Is(err, outbox.ErrDispatchFailed) {
			t.Fatalf("message ID of %d bytes: want the dispatch to fail (the broker is down), got %v", len(id), err)
		}
		var key string
		if err := e.db.QueryRow(`SELECT ordering_key FROM outbox_effects_all WHERE source_id = $1`, id).Scan(&key); err != nil {
			t.Fatal(err)
		}
		want := outbox.DefaultOrderingKey(outbox.Source{Consumer: "billing", ID: id})
		if key != want || len(key) > 255 {
			t.Fatalf("ordering key of a %d-byte ID: %q (%d bytes), want %q", len(id), key, len(key), want)
		}
		if len("billing/"+id) <= 255 && key != "billing/"+id {
			t.Fatalf("a short default key changed: %q", key)
		}
	}
}

// TestMetadataCountsWithinTheSizeLimit: metadata is counted with the payload against
// MaxPayloadBytes, and an incoming correlation ID or trace header too large to copy is not copied
// onto every outgoing message: the messages go out without it, nothing is lost.
func TestMetadataCountsWithinTheSizeLimit(t *testing.T) {
	e := newEnv(t, func(c *outbox.Config) { c.MaxPayloadBytes = 1 << 20 })
	// The application's own metadata over the limit fails the handler, and nothing commits.
	msg := message.NewMessage(uuid.NewString(), nil)
	err := handle(e.ob, msg, func(m *message.Message) ([]*message.Message, error) {
		out := message.NewMessage(uuid.NewString(), []byte("small"))
		out.Metadata.Set("blob", strings.Repeat("m", 1<<20))
		return nil, outbox.Publish(m.Context(), "out_a", out)
	})
	if !errors.Is(err, outbox.ErrPayloadTooLarge) || !strings.Contains(err.Error(), "metadata") {
		t.Fatalf("want ErrPayloadTooLarge naming the metadata, got %v", err)
	}
	mustEqual(t, "claims", e.count(`SELECT count(*) FROM outbox_processed WHERE message_id = $1`, msg.UUID), 0)

	// A 4 MiB correlation ID on the incoming message: five small messages go out without it.
	msg = message.NewMessage(uuid.NewString(), nil)
	msg.Metadata.Set(outbox.MetadataCorrelationID, strings.Repeat("c", 4<<20))
	msg.Metadata.Set(outbox.MetadataTracestate, strings.Repeat("t", 64<<10))
	err = handle(e.ob, msg, func(m *message.Message) ([]*message.Message, error) {
		for i := 0; i < 5; i++ {
			if err := outbox.Publish(m.Context(), "out_a", message.NewMessage(uuid.NewString(), []byte("small"))); err != nil {
				return nil, err
			}
		}
		return nil, nil
	})
	if err != nil {
		t.Fatal(err)
	}
	mustEqual(t, "sent", e.count(`SELECT count(*) FROM watermill_out_a WHERE length(metadata::text) < 1000`), 5)
	mustEqual(t, "stored metadata over 4 KiB", e.count(`SELECT count(*) FROM outbox_dispatched WHERE octet_length(metadata) > 4096`), 0)
	// A correlation ID of a usual size is still copied.
	msg = message.NewMessage(uuid.NewString(), nil)
	msg.Metadata.Set(outbox.MetadataCorrelationID, "corr-1")
	if err := handle(e.ob, msg, func(m *message.Message) ([]*message.Message, error) {
		return nil, outbox.Publish(m.Context(), "out_a", message.NewMessage(uuid.NewString(), nil))
	}); err != nil {
		t.Fatal(err)
	}
	mustEqual(t, "copied", e.count(`SELECT count(*) FROM watermill_out_a WHERE metadata->>'correlation_id' = 'corr-1'`), 1)
}

// A member name becomes a label value: one a metric backend would mangle is refused at New, with
// the field named, not carried into every series.
func TestMemberNamesAreValidated(t *testing.T) {
	for _, bad := range []string{"\xff\xfe", "a\x00b", strings.Repeat("m", 256)} {
		err := outbox.Config{Member: bad}.Validate()
		if err == nil || !strings.Contains(err.Error(), "Member") {
			t.Errorf("Member %q: %v, want an error naming Member", bad, err)
		}
	}
	if err := (outbox.Config{Member: strings.Repeat("m", 255)}).Validate(); err != nil && strings.Contains(err.Error(), "Member") {
		t.Errorf("a 255-byte Member refused: %v", err)
	}
}

// A message that cannot be processed and cannot be set aside (dead letters off, no poison
// topic) is nacked, and its redelivery comes at once: without a wait, every copy a broker
// redelivers at once was thousands of failures (and error lines) a second. It waits RetryDelay
// as a failed handler does; a shutdown ends the wait.
func TestNackedRejectionWaitsRetryDelay(t *testing.T) {
	const delay = 300 * time.Millisecond
	e := newEnv(t)
	off := e.newOutbox(func(c *outbox.Config) { c.DeadLetters = outbox.DeadLettersOff; c.RetryDelay = delay })
	began := time.Now()
	err := handle(off, message.NewMessage("", []byte("no ID")), applyAndPublish(nil))
	if !errors.Is(err, outbox.ErrInvalidMessageID) {
		t.Fatalf("want ErrInvalidMessageID, got %v", err)
	}
	if took := time.Since(began); took < delay {
		t.Errorf("the rejection was nacked after %s; want it to wait RetryDelay (%s) first", took, delay)
	}
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	msg := message.NewMessage("", []byte("no ID"))
	msg.SetContext(ctx)
	began = time.Now()
	if err := handle(off, msg, applyAndPublish(nil)); err == nil {
		t.Fatal("a rejection was acked")
	}
	if took := time.Since(began); took >= delay {
		t.Errorf("a rejection whose message context had ended waited %s", took)
	}
}

// A handler that swallows a failed statement (the "ignore a duplicate" pattern) and returns nil:
// PostgreSQL has aborted the transaction, and lib/pq answers the COMMIT with
// ErrInFailedTransaction (it sends ROLLBACK), an error without SQLSTATE. It was taken for a
// COMMIT whose outcome is unknown, not counted: the message was nacked on every delivery, for
// ever, never dead-lettered. It is a rollback, counted as a failed attempt.
func TestSwallowedStatementFailureIsCounted(t *testing.T) {
	e := newEnv(t, func(c *outbox.Config) { c.MaxAttempts = 2; c.RetryDelay = -1 })
	mustExec(t, e, `CREATE UNIQUE INDEX applied_once ON applied (message_id)`)
	mustExec(t, e, `INSERT INTO applied (message_id) VALUES ('taken')`)
	h := func(m *message.Message) ([]*message.Message, error) {
		ctx := m.Context()
		_, _ = outbox.Tx(ctx).ExecContext(ctx, `INSERT INTO applied (message_id) VALUES ('taken')`) // ignored
		return nil, nil
	}
	msg := message.NewMessage(uuid.NewString(), nil)
	err := handle(e.ob, copyOf(msg), h)
	if err == nil || errors.Is(err, outbox.ErrCommitOutcomeUnknown) {
		t.Fatalf("first delivery: %v; want a rolled-back commit, counted", err)
	}
	mustEqual(t, "attempts counted", e.count(`SELECT coalesce(max(attempts), 0) FROM outbox_attempts WHERE message_id = $1`, msg.UUID), 1)
	if err := handle(e.ob, copyOf(msg), h); err != nil {
		t.Fatalf("second delivery (MaxAttempts 2): %v; want it dead-lettered", err)
	}
	mustEqual(t, "dead letters", e.count(`SELECT count(*) FROM outbox_dead_letters WHERE message_id = $1`, msg.UUID), 1)
}
