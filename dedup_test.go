package outbox_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"

	"github.com/watermill-outbox/outbox"
	"github.com/watermill-outbox/outbox/internal/pgtest"
	"github.com/watermill-outbox/outbox/outboxdriver"
)

func failing(calls *atomic.Int32) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		calls.Add(1)
		ctx := msg.Context()
		if _, err := outbox.Tx(ctx).ExecContext(ctx, `INSERT INTO applied (message_id) VALUES ($1)`, msg.UUID); err != nil {
			return nil, err
		}
		if err := outbox.Publish(ctx, "out_a", message.NewMessage(uuid.NewString(), nil)); err != nil {
			return nil, err
		}
		return nil, errors.New("payment provider said no")
	}
}

// TestFailingMessageGoesToPoisonTopicAfterMaxAttempts counts attempts across process restarts
// (each attempt on a new Outbox) and checks the poisoned message carries its reason.
func TestFailingMessageGoesToPoisonTopicAfterMaxAttempts(t *testing.T) {
	e := newEnv(t)
	cfg := func(c *outbox.Config) { c.MaxAttempts = 3; c.PoisonTopic = "poison" }
	var calls atomic.Int32
	msg := message.NewMessage(uuid.NewString(), []byte("bad order"))
	msg.Metadata.Set("k", "v")
	for attempt := 1; attempt <= 2; attempt++ {
		err := handle(e.newOutbox(cfg), copyOf(msg), failing(&calls))
		if err == nil || !strings.Contains(err.Error(), fmt.Sprintf("attempt %d of 3", attempt)) {
			t.Fatalf("attempt %d: want a counted failure, got %v", attempt, err)
		}
	}
	if err := handle(e.newOutbox(cfg), copyOf(msg), failing(&calls)); err != nil {
		t.Fatalf("third attempt: want the message acked after moving it to the poison topic, got %v", err)
	}
	mustEqual(t, "business rows", e.count(`SELECT count(*) FROM applied`), 0)
	mustEqual(t, "side effects on the wire", len(e.wire("out_a")), 0)
	mustEqual(t, "poisoned copies", e.wire("poison")[msg.UUID], 1)
	var reason, consumer, attempts, k string
	if err := e.db.QueryRow(`SELECT metadata->>'outbox_poison_reason', metadata->>'outbox_poison_consumer',
		metadata->>'outbox_poison_attempts', metadata->>'k' FROM watermill_poison`).Scan(&reason, &consumer, &attempts, &k); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(reason, "payment provider said no") || consumer != "c1" || attempts != "3" || k != "v" {
		t.Fatalf("poison metadata: reason=%q consumer=%q attempts=%q k=%q", reason, consumer, attempts, k)
	}
	// A copy still in the broker does not run the handler again.
	if err := handle(e.newOutbox(cfg), copyOf(msg), failing(&calls)); err != nil {
		t.Fatal(err)
	}
	mustEqual(t, "handler calls", calls.Load(), int32(3))
	mustEqual(t, "poisoned copies", e.wire("poison")[msg.UUID], 1)
}

// TestFailingMessageWithDeadLettersOffIsNackedForever: the opt-out keeps the behaviour before
// dead letters: without a poison topic, a failing message is nacked on every delivery.
func TestFailingMessageWithDeadLettersOffIsNackedForever(t *testing.T) {
	e := newEnv(t)
	cfg := func(c *outbox.Config) { c.MaxAttempts = 2; c.DeadLetters = outbox.DeadLettersOff }
	var calls atomic.Int32
	msg := message.NewMessage(uuid.NewString(), nil)
	for i := 0; i < 4; i++ {
		if err := handle(e.newOutbox(cfg), copyOf(msg), failing(&calls)); err == nil {
			t.Fatalf("attempt %d: a failing message without dead letters or poison topic must be nacked", i+1)
		}
	}
	mustEqual(t, "handler calls", calls.Load(), int32(4))
	mustEqual(t, "attempts counted", e.count(`SELECT attempts FROM outbox_attempts WHERE message_id = $1`, msg.UUID), 4)
	mustEqual(t, "business rows", e.count(`SELECT count(*) FROM applied`), 0)
	mustEqual(t, "dead letters", e.count(`SELECT count(*) FROM outbox_dead_letters`), 0)
}

// TestFailingMessageIsDeadLetteredAfterMaxAttempts: by default, with no poison topic, a message
// that fails MaxAttempts times is stored as a dead letter (payload, metadata, reason, attempts)
// and acked, and a copy still in the broker is acked without running the handler.
func TestFailingMessageIsDeadLetteredAfterMaxAttempts(t *testing.T) {
	e := newEnv(t)
	cfg := func(c *outbox.Config) { c.MaxAttempts = 2 }
	var calls atomic.Int32
	msg := message.NewMessage(uuid.NewString(), []byte("bad \x00 order"))
	msg.Metadata.Set("k", "v")
	if err := handle(e.newOutbox(cfg), copyOf(msg), failing(&calls)); err == nil {
		t.Fatal("first attempt: want a nack")
	}
	if err := handle(e.newOutbox(cfg), copyOf(msg), failing(&calls)); err != nil {
		t.Fatalf("attempt %d of %d: want the message dead-lettered and acked, got %v", 2, 2, err)
	}
	dls := deadLetters(t, e)
	if len(dls) != 1 {
		t.Fatalf("dead letters: %+v", dls)
	}
	d := dls[0]
	if d.Consumer != "c1" || d.MessageID != msg.UUID || string(d.Payload) != "bad \x00 order" || d.Metadata["k"] != "v" ||
		!strings.Contains(d.Reason, "payment provider said no") || d.Attempts != 2 || d.Permanent || d.State != outboxdriver.DeadLetterDead {
		t.Fatalf("dead letter: %+v", d)
	}
	if err := handle(e.newOutbox(cfg), copyOf(msg), failing(&calls)); err != nil {
		t.Fatalf("copy of a dead-lettered message: want an ack, got %v", err)
	}
	mustEqual(t, "handler calls", calls.Load(), int32(2))
	mustEqual(t, "business rows", e.count(`SELECT count(*) FROM applied`), 0)
	mustEqual(t, "side effects on the wire", len(e.wire("out_a")), 0)
}

// notFound is a user's error type that marks itself permanent.
type notFound struct{ what string }

func (e notFound) Error() string   { return e.what + " not found" }
func (e notFound) Permanent() bool { return true }

// TestPermanentErrorIsDeadLetteredAtOnce: a handler error marked permanent (outbox.Permanent,
// or an error type with Permanent() true, wrapped or not) dead-letters the message on its first
// attempt, with the attempt counted.
func TestPermanentErrorIsDeadLetteredAtOnce(t *testing.T) {
	e := newEnv(t)
	for i, herr := range []error{
		outbox.Permanent(errors.New("cannot parse")),
		fmt.Errorf("order 7: %w", notFound{"customer"}),
	} {
		if !outbox.IsPermanent(herr) {
			t.Fatalf("IsPermanent(%v) = false", herr)
		}
		var calls atomic.Int32
		msg := message.NewMessage(uuid.NewString(), []byte(fmt.Sprint(i)))
		// Outside a Router, the topic the message came from is told by HandleParams.Topic.
		err := e.ob.Handle(msg, outbox.HandleParams{Consumer: "c1", MessageID: msg.UUID, Topic: "orders.in"}, func(m *message.Message) ([]*message.Message, error) {
			calls.Add(1)
			return nil, herr
		})
		if err != nil {
			t.Fatalf("%v: want the message dead-lettered and acked at once, got %v", herr, err)
		}
		mustEqual(t, "handler calls", calls.Load(), int32(1))
		mustEqual(t, "attempts counted", e.count(`SELECT attempts FROM outbox_attempts WHERE message_id = $1`, msg.UUID), 1)
	}
	dls := deadLetters(t, e)
	if len(dls) != 2 || !dls[0].Permanent || !dls[1].Permanent || dls[0].Attempts != 1 || !strings.Contains(dls[1].Reason, "customer not found") ||
		dls[0].SourceTopic != "orders.in" {
		t.Fatalf("dead letters: %+v", dls)
	}
	if outbox.IsPermanent(errors.New("timeout")) || outbox.IsPermanent(nil) || outbox.Permanent(nil) != nil {
		t.Fatal("IsPermanent of an ordinary error, or Permanent(nil), is wrong")
	}
}

func deadLetters(t *testing.T, e *env) []outboxdriver.DeadLetter {
	t.Helper()
	dls, err := e.ob.Store().(outboxdriver.DeadLetterStore).DeadLetterList(context.Background(), outboxdriver.DeadLetterFilter{})
	if err != nil {
		t.Fatal(err)
	}
	return dls
}

func TestRetentionCountsFromDispatchAndCleanupIsBounded(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	// 35 messages dispatched long ago, 5 processed long ago whose effects are still pending,
	// 5 dispatched recently.
	for i := 0; i < 45; i++ {
		if err := handle(e.ob, message.NewMessage(fmt.Sprintf("m%02d", i), nil), applyAndPublish(nil)); err != nil {
			t.Fatal(err)
		}
	}
	mustExec(t, e, `UPDATE outbox_processed SET processed_at = now() - interval '30 days', dispatched_at = now() - interval '8 days' WHERE message_id < 'm35'`)
	mustExec(t, e, `UPDATE outbox_processed SET processed_at = now() - interval '30 days', dispatched_at = now() - interval '8 days' WHERE message_id BETWEEN 'm35' AND 'm39'`)
	mustExec(t, e, `UPDATE outbox_processed SET processed_at = now() - interval '30 days', dispatched_at = now() - interval '1 day' WHERE message_id >= 'm40'`)
	mustExec(t, e, `UPDATE outbox_dispatched SET dispatched_at = now() - interval '2 hours'`)
	// m35..m39 were processed long ago but one of their effects is still undispatched.
	mustExec(t, e, `WITH back AS (DELETE FROM outbox_dispatched WHERE seq = 1 AND source_id BETWEEN 'm35' AND 'm39' RETURNING *)
		INSERT INTO outbox_effects_all (id, source_consumer, source_id, seq, kind, topic, uuid, payload, metadata, ordering_key, created_at, attempts, failures, last_error)
		SELECT id, source_consumer, source_id, seq, kind, topic, uuid, payload, metadata, ordering_key, created_at, attempts, failures, last_error FROM back`)

	res, err := e.ob.Store().Cleanup(ctx, outboxdriver.CleanupParams{Retention: 7 * 24 * time.Hour, EffectRetention: time.Hour, BatchSize: 10})
	if err != nil {
		t.Fatal(err)
	}
	mustEqual(t, "claims deleted", res.Claims, int64(35))
	mustEqual(t, "effects deleted", res.Effects, int64(85))
	mustEqual(t, "claims left", e.count(`SELECT count(*) FROM outbox_processed`), 10)
	mustEqual(t, "claims with pending effects kept", e.count(`SELECT count(*) FROM outbox_processed WHERE message_id BETWEEN 'm35' AND 'm39'`), 5)

	// Another instance holding the cleanup lock makes this one skip at once.
	tx, err := e.db.Begin()
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback() }()
	if _, err := tx.Exec(`SELECT pg_advisory_xact_lock(x'6f757462'::int, hashtext('public.outbox_cleanup'))`); err != nil {
		t.Fatal(err)
	}
	res, err = e.ob.Store().Cleanup(ctx, outboxdriver.CleanupParams{Retention: time.Nanosecond, EffectRetention: time.Nanosecond, BatchSize: 10})
	if err != nil {
		t.Fatal(err)
	}
	if !res.Skipped || res.Claims != 0 {
		t.Fatalf("cleanup while another instance holds the lock: %+v", res)
	}
}

// A cleanup run with Resume begins where the run before it ended, past the claims that run
// deleted (which stay as dead index entries while the xmin horizon is held back), and leaves
// behind it what expired there since; a run from the start takes that.
func TestCleanupResumesWhereItLeftOff(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	for i := 0; i < 12; i++ {
		if err := handle(e.ob, message.NewMessage(fmt.Sprintf("m%02d", i), nil), applyAndPublish(nil)); err != nil {
			t.Fatal(err)
		}
	}
	// m00..m09 expired, processed in that order; m10 and m11 processed before them, their
	// effects sent only a day ago.
	mustExec(t, e, `UPDATE outbox_processed SET processed_at = now() - interval '30 days' + substr(message_id, 2)::int * interval '1 second',
		dispatched_at = now() - interval '8 days' WHERE message_id < 'm10'`)
	mustExec(t, e, `UPDATE outbox_processed SET processed_at = now() - interval '40 days', dispatched_at = now() - interval '1 day' WHERE message_id >= 'm10'`)
	params := func(resume *outboxdriver.CleanupResume) outboxdriver.CleanupParams {
		return outboxdriver.CleanupParams{Retention: 7 * 24 * time.Hour, EffectRetention: time.Hour, BatchSize: 4, Resume: resume}
	}
	var resume outboxdriver.CleanupResume
	res, err := e.ob.Store().Cleanup(ctx, params(&resume))
	if err != nil {
		t.Fatal(err)
	}
	mustEqual(t, "claims deleted by the first run", res.Claims, int64(10))
	var newest time.Time
	if err := e.db.QueryRow(`SELECT now() - interval '30 days' + interval '9 seconds'`).Scan(&newest); err != nil {
		t.Fatal(err)
	}
	if d := resume.Claims.Sub(newest); d < -time.Second || d > time.Second {
		t.Fatalf("the run ended at %v, want the newest deleted claim's processed_at, %v", resume.Claims, newest)
	}

	mustExec(t, e, `UPDATE outbox_processed SET dispatched_at = now() - interval '8 days' WHERE message_id >= 'm10'`)
	res, err = e.ob.Store().Cleanup(ctx, params(&resume))
	if err != nil {
		t.Fatal(err)
	}
	mustEqual(t, "claims deleted by a run resumed past them", res.Claims, int64(0))
	res, err = e.ob.Store().Cleanup(ctx, params(nil))
	if err != nil {
		t.Fatal(err)
	}
	mustEqual(t, "claims deleted by a run from the start", res.Claims, int64(2))
	mustEqual(t, "claims left", e.count(`SELECT count(*) FROM outbox_processed`), 0)
}

// The stats sample looks for the cleanup lag from where the cleanup service got to
// (StatsParams.CleanupFrom), not through the claims deleted before it; without it, from the start.
func TestStatsCleanupLagFromTheCleanupsPosition(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	for i := 0; i < 4; i++ {
		if err := handle(e.ob, message.NewMessage(fmt.Sprintf("m%02d", i), nil), applyAndPublish(nil)); err != nil {
			t.Fatal(err)
		}
	}
	// m00, m01 processed 40 days ago, m02, m03 30 days ago; all sent 8 days ago (Retention 7 days).
	mustExec(t, e, `UPDATE outbox_processed SET processed_at = now() - CASE WHEN message_id < 'm02' THEN interval '40 days' ELSE interval '30 days' END,
		dispatched_at = now() - interval '8 days'`)
	var from time.Time
	if err := e.db.QueryRow(`SELECT now() - interval '35 days'`).Scan(&from); err != nil {
		t.Fatal(err)
	}
	lag := func(p outboxdriver.StatsParams) time.Duration {
		t.Helper()
		p.Retention = 7 * 24 * time.Hour
		s, err := e.ob.Store().Stats(ctx, p)
		if err != nil {
			t.Fatal(err)
		}
		return s.CleanupLag
	}
	// The lag is how long the oldest expired claim has waited past its retention: a day, by its dispatch.
	if l := lag(outboxdriver.StatsParams{}); l < 23*time.Hour || l > 25*time.Hour {
		t.Errorf("cleanup lag from the start: %v, want a day", l)
	}
	if l := lag(outboxdriver.StatsParams{CleanupFrom: from}); l < 23*time.Hour || l > 25*time.Hour {
		t.Errorf("cleanup lag from the cleanup's position: %v, want a day (m02, m03 are after it)", l)
	}
	mustExec(t, e, `UPDATE outbox_processed SET dispatched_at = now() - interval '9 days' WHERE message_id < 'm02'`)
	if l := lag(outboxdriver.StatsParams{}); l < 47*time.Hour || l > 49*time.Hour {
		t.Errorf("cleanup lag from the start: %v, want two days (m00, m01)", l)
	}
	if l := lag(outboxdriver.StatsParams{CleanupFrom: from}); l < 23*time.Hour || l > 25*time.Hour {
		t.Errorf("cleanup lag from the cleanup's position: %v, want a day: m00 and m01 are behind it", l)
	}
}

func mustExec(t testing.TB, e *env, query string, args ...any) {
	t.Helper()
	pgtest.CheckEffectsParent(t, query)
	e.flush()
	if _, err := e.db.Exec(query, args...); err != nil {
		t.Fatalf("%s: %v", query, err)
	}
}

// TestRelaySendsWhatTheFastPathLeftBehind: the broker is down at dispatch and the message is never
// redelivered (dead-lettered); the relay sends the committed effects, in order, once.
func TestRelaySendsWhatTheFastPathLeftBehind(t *testing.T) {
	e := newEnv(t, func(c *outbox.Config) { c.RelayGrace = time.Millisecond; c.RelayInterval = 20 * time.Millisecond })
	e.pub.failAll.Store(true)
	msg := message.NewMessage(uuid.NewString(), nil)
	if err := handle(e.ob, msg, applyAndPublish(nil)); err == nil {
		t.Fatal("want a dispatch error while the broker is down")
	}
	mustEqual(t, "pending effects", e.pendingEffects(), 2)
	e.pub.failAll.Store(false)
	var before time.Time
	if err := e.db.QueryRow(`SELECT now()`).Scan(&before); err != nil {
		t.Fatal(err)
	}

	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error)
	go func() { done <- e.ob.Run(ctx) }()
	waitFor(t, "the relay", func() bool { return e.pendingEffects() == 0 })
	cancel()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	ids := e.storedEffects("c1", msg.UUID)
	mustEqual(t, "effect 1 copies", e.wire("out_a")[ids[0]], 1)
	mustEqual(t, "effect 2 copies", e.wire("out_b")[ids[1]], 1)
	mustEqual(t, "retention clock moved to the dispatch", e.count(`SELECT count(*) FROM outbox_processed WHERE dispatched_at >= $1`, before), 1)
}

// TestRelayParksWhatCannotBeSentAndKeepsOtherKeysFlowing.
func TestRelayParksWhatCannotBeSentAndKeepsOtherKeysFlowing(t *testing.T) {
	e := newEnv(t)
	e.pub.failAll.Store(true)
	poisonMsg := message.NewMessage(uuid.NewString(), nil)
	goodMsg := message.NewMessage(uuid.NewString(), nil)
	for _, m := range []*message.Message{poisonMsg, goodMsg} {
		if err := handle(e.ob, m, applyAndPublish(nil)); err == nil {
			t.Fatal("want a dispatch error")
		}
	}
	ctx := context.Background()
	st := e.ob.Store()
	poisonFirst := e.storedEffects("c1", poisonMsg.UUID)[0]
	mustExec(t, e, `UPDATE outbox_effects_all SET next_attempt_at = now()`) // skip the backoff of the failed fast path
	// A relay round by hand, through the store: claim, dispatch, mark and record.
	round := func() {
		claim, err := st.EffectClaimDue(ctx, outboxdriver.EffectClaimParams{Limit: 100, Lease: time.Minute})
		if err != nil {
			t.Fatal(err)
		}
		effects := claim.Effects
		var marks []outboxdriver.DispatchMark
		var fails []outboxdriver.EffectFailure
		failed := map[string]bool{}
		for _, ef := range effects {
			switch {
			case failed[ef.OrderingKey]:
				fails = append(fails, outboxdriver.EffectFailure{StoreID: ef.StoreID})
			case ef.UUID == poisonFirst:
				failed[ef.OrderingKey] = true
				fails = append(fails, outboxdriver.EffectFailure{StoreID: ef.StoreID, Reason: "rejected", Counted: true, Park: ef.Attempts+1 >= 3})
			default:
				if err := e.pub.next.Publish(ef.Topic, message.NewMessage(ef.UUID, ef.Payload)); err != nil {
					t.Fatal(err)
				}
				marks = append(marks, outboxdriver.DispatchMark{Source: ef.Source, StoreIDs: []int64{ef.StoreID}, MoveClaim: true})
			}
		}
		if err := st.EffectMarkDispatched(ctx, marks...); err != nil {
			t.Fatal(err)
		}
		if err := st.EffectRecordFailures(ctx, fails...); err != nil {
			t.Fatal(err)
		}
	}
	for i := 0; e.count(`SELECT count(*) FROM outbox_effects_all WHERE parked_at IS NOT NULL`) == 0 ||
		e.count(`SELECT count(*) FROM outbox_effects_all WHERE dispatched_at IS NULL AND source_id = $1`, goodMsg.UUID) > 0; i++ {
		if i == 50 {
			t.Fatal("the relay did not park the poison effect or send the others")
		}
		round()
	}
	mustEqual(t, "parked", e.count(`SELECT count(*) FROM outbox_effects_all WHERE parked_at IS NOT NULL`), 1)
	mustEqual(t, "attempts of the parked effect", e.count(`SELECT attempts FROM outbox_effects_all WHERE uuid = $1`, poisonFirst), 3)
	mustEqual(t, "last error kept", e.count(`SELECT count(*) FROM outbox_effects_all WHERE uuid = $1 AND last_error = 'rejected'`, poisonFirst), 1)
	// The other key flowed; the poison's own later effect waits behind it.
	for _, id := range e.storedEffects("c1", goodMsg.UUID) {
		mustEqual(t, "good effect sent", e.wire("out_a")[id]+e.wire("out_b")[id], 1)
	}
	mustEqual(t, "effect behind the parked one", e.wire("out_b")[e.storedEffects("c1", poisonMsg.UUID)[1]], 0)
}

// A cleanup whose deadline passes while a batch waits (here on a lock another session holds)
// returns the deadline, saying what was not answered: the transaction's own context, which the
// caller's end cancels, made it "context canceled", which reads as a shutdown.
func TestCleanupPastItsDeadlineSaysSo(t *testing.T) {
	e := newEnv(t)
	if err := handle(e.ob, message.NewMessage("m1", nil), applyAndPublish(nil)); err != nil {
		t.Fatal(err)
	}
	mustExec(t, e, `UPDATE outbox_processed SET processed_at = now() - interval '30 days', dispatched_at = now() - interval '8 days'`)
	tx, err := e.db.Begin()
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback() }()
	if _, err := tx.Exec(`LOCK TABLE outbox_processed IN ACCESS EXCLUSIVE MODE`); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
	defer cancel()
	_, err = e.ob.Store().Cleanup(ctx, outboxdriver.CleanupParams{Retention: 7 * 24 * time.Hour, EffectRetention: time.Hour, BatchSize: 10})
	if !errors.Is(err, context.DeadlineExceeded) || !strings.Contains(err.Error(), "no answer before the context ended") {
		t.Fatalf("cleanup past its deadline: %v, want context.DeadlineExceeded and what was waited for", err)
	}
}
