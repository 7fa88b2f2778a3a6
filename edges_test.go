package outbox_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"net/url"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"

	"github.com/watermill-outbox/outbox"
	"github.com/watermill-outbox/outbox/drivers/postgres"
	"github.com/watermill-outbox/outbox/internal/logtest"
	"github.com/watermill-outbox/outbox/outboxdriver"
)

// Tests of the guarantee at its edges: each reproduces a way in which an effect could be lost,
// doubled, sent without having committed, or a message stalled or miscounted.

// returnsWithin runs fn and fails the test if it has not returned within d: the code under test
// must never wait forever.
func returnsWithin(t *testing.T, d time.Duration, what string, fn func()) {
	t.Helper()
	done := make(chan struct{})
	go func() { defer close(done); fn() }()
	select {
	case <-done:
	case <-time.After(d):
		t.Fatalf("%s did not return within %s", what, d)
	}
}

// allWire returns the copies of every UUID on the topics.
func (e *env) allWire(topics ...string) map[string]int {
	out := map[string]int{}
	for _, topic := range topics {
		for id, n := range e.wire(topic) {
			out[id] += n
		}
	}
	return out
}

// committedEffects returns the UUIDs of every committed effect.
func (e *env) committedEffects() []string {
	e.t.Helper()
	e.flush()
	rows, err := e.db.Query(`SELECT uuid FROM all_effects ORDER BY id`)
	if err != nil {
		e.t.Fatal(err)
	}
	defer rows.Close()
	var out []string
	for rows.Next() {
		var id string
		if err := rows.Scan(&id); err != nil {
			e.t.Fatal(err)
		}
		out = append(out, id)
	}
	return out
}

// Item: concurrent Publish calls inside one handler, and inside one InTx, each committed effect
// reaches the wire and nothing stays pending.
func TestConcurrentPublishInOneUnitOfWork(t *testing.T) {
	e := newEnv(t)
	const goroutines = 16
	publishConcurrently := func(ctx context.Context) error {
		var wg sync.WaitGroup
		errs := make(chan error, goroutines)
		for i := 0; i < goroutines; i++ {
			wg.Add(1)
			go func() {
				defer wg.Done()
				errs <- outbox.Publish(ctx, "out_a", message.NewMessage(uuid.NewString(), []byte(fmt.Sprint(i))))
			}()
		}
		wg.Wait()
		close(errs)
		for err := range errs {
			if err != nil {
				return err
			}
		}
		return nil
	}
	for i := 0; i < 10; i++ {
		msg := message.NewMessage(uuid.NewString(), nil)
		if err := handle(e.ob, msg, func(m *message.Message) ([]*message.Message, error) {
			return nil, publishConcurrently(m.Context())
		}); err != nil {
			t.Fatal(err)
		}
		if err := e.ob.InTx(context.Background(), func(ctx context.Context, _ *sql.Tx) error {
			return publishConcurrently(ctx)
		}); err != nil {
			t.Fatal(err)
		}
	}
	committed := e.committedEffects()
	mustEqual(t, "committed effects", len(committed), 20*goroutines)
	wire := e.wire("out_a")
	for _, id := range committed {
		if wire[id] != 1 {
			t.Errorf("effect %s: %d copies on the wire, want 1", id, wire[id])
		}
	}
	mustEqual(t, "pending effects", e.pendingEffects(), 0)
	mustEqual(t, "distinct sequence numbers per source",
		e.count(`SELECT count(*) FROM (SELECT DISTINCT source_consumer, source_id, seq FROM all_effects) s`), 20*goroutines)
}

// Item: discarding a parked effect long after the message was processed starts the retention clock
// again, so that cleanup does not forget the claim and a redelivery cannot apply the message twice.
func TestDiscardParkedMovesTheRetentionClock(t *testing.T) {
	e := newEnv(t, func(c *outbox.Config) { c.Retention = time.Hour })
	msg := message.NewMessage(uuid.NewString(), nil)
	e.pub.failAll.Store(true)
	var calls atomic.Int32
	if err := handle(e.ob, copyOf(msg), applyAndPublish(&calls)); err == nil {
		t.Fatal("dispatch through a failing publisher reported success")
	}
	e.pub.failAll.Store(false)
	// The relay parked the effects (as after RelayMaxAttempts); the message was processed long ago.
	mustExec(t, e, `UPDATE outbox_effects_all SET parked_at = now(), attempts = 10, next_attempt_at = now()`)
	mustExec(t, e, `UPDATE outbox_processed SET processed_at = processed_at - interval '2 hours', dispatched_at = dispatched_at - interval '2 hours'`)
	parked, err := e.ob.ParkedEffects(context.Background(), 10)
	if err != nil {
		t.Fatal(err)
	}
	mustEqual(t, "parked effects", len(parked), 2)
	for _, p := range parked {
		if _, err := e.ob.DiscardParked(context.Background(), p.StoreID); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := e.ob.Cleanup(context.Background()); err != nil {
		t.Fatal(err)
	}
	mustEqual(t, "claims kept by cleanup", e.count(`SELECT count(*) FROM outbox_processed WHERE message_id = $1`, msg.UUID), 1)
	if err := handle(e.ob, copyOf(msg), applyAndPublish(&calls)); err != nil {
		t.Fatal(err)
	}
	mustEqual(t, "handler calls", calls.Load(), int32(1))
}

// Item: an effect recorded inside a savepoint that the handler rolled back never committed, so it
// must never be sent (fast path and InTx); one recorded in a released savepoint is sent.
func TestEffectsInARolledBackSavepointAreNeverSent(t *testing.T) {
	e := newEnv(t)
	var kept, undone, released []string
	record := func(ctx context.Context, tx *sql.Tx) error {
		pub := func(label string, into *[]string) error {
			m := message.NewMessage(uuid.NewString(), []byte(label))
			*into = append(*into, m.UUID)
			return outbox.Publish(ctx, "out_a", m)
		}
		if err := pub("kept-before", &kept); err != nil {
			return err
		}
		if _, err := tx.ExecContext(ctx, `SAVEPOINT undo`); err != nil {
			return err
		}
		if err := pub("undone", &undone); err != nil {
			return err
		}
		if _, err := tx.ExecContext(ctx, `ROLLBACK TO SAVEPOINT undo`); err != nil {
			return err
		}
		if _, err := tx.ExecContext(ctx, `SAVEPOINT keep`); err != nil {
			return err
		}
		if err := pub("released", &released); err != nil {
			return err
		}
		if _, err := tx.ExecContext(ctx, `RELEASE SAVEPOINT keep`); err != nil {
			return err
		}
		return pub("kept-after", &kept)
	}
	msg := message.NewMessage(uuid.NewString(), nil)
	if err := handle(e.ob, msg, func(m *message.Message) ([]*message.Message, error) {
		return nil, record(m.Context(), outbox.Tx(m.Context()))
	}); err != nil {
		t.Fatal(err)
	}
	if err := e.ob.InTx(context.Background(), record); err != nil {
		t.Fatal(err)
	}
	wire := e.wire("out_a")
	for _, id := range undone {
		if wire[id] != 0 {
			t.Errorf("an effect recorded in a rolled-back savepoint reached the wire (%d copies)", wire[id])
		}
	}
	for _, id := range append(kept, released...) {
		mustEqual(t, "copies of a committed effect", wire[id], 1)
	}
	mustEqual(t, "pending effects", e.pendingEffects(), 0)
}

// Item: an effect the broker refuses while it accepts everything else is charged on every path,
// parked after RelayMaxAttempts, and from then on the message is acked and the parked effect is not
// published again by redeliveries.
func TestUnsendableEffectIsParkedAndTheMessageAcked(t *testing.T) {
	var refused atomic.Int32
	e := newEnv(t, func(c *outbox.Config) {
		c.RelayMaxAttempts = 3
		c.Publisher = &rejectingPublisher{next: c.Publisher, reject: func(m *message.Message) bool {
			if string(m.Payload) == `{"step":2}` {
				refused.Add(1)
				return true
			}
			return false
		}}
	})
	msg := message.NewMessage(uuid.NewString(), nil)
	acked := false
	for i := 0; i < 10 && !acked; i++ {
		// The broker is healthy: other messages go through between the redeliveries.
		if err := handle(e.ob, message.NewMessage(uuid.NewString(), nil), func(m *message.Message) ([]*message.Message, error) {
			return nil, outbox.Publish(m.Context(), "out_a", message.NewMessage(uuid.NewString(), []byte("fine")))
		}); err != nil {
			t.Fatal(err)
		}
		acked = handle(e.ob, copyOf(msg), applyAndPublish(nil)) == nil
	}
	if !acked {
		t.Fatalf("the message was nacked 10 times for an effect the broker refuses (%d refusals)", refused.Load())
	}
	parked, err := e.ob.ParkedEffects(context.Background(), 10)
	if err != nil {
		t.Fatal(err)
	}
	mustEqual(t, "parked effects", len(parked), 1)
	mustEqual(t, "attempts of the parked effect", parked[0].Attempts, 3)
	before := refused.Load()
	for i := 0; i < 3; i++ {
		if err := handle(e.ob, copyOf(msg), applyAndPublish(nil)); err != nil {
			t.Fatalf("redelivery of a message whose effect is parked: %v", err)
		}
	}
	mustEqual(t, "publish attempts of the parked effect by redeliveries", refused.Load(), before)
	mustEqual(t, "business rows", e.count(`SELECT count(*) FROM applied`), 1)
}

// Item: a message whose ID is unusable goes to the poison topic under one stable ID, however
// often it is delivered.
func TestRejectedMessageGetsAStablePoisonID(t *testing.T) {
	e := newEnv(t, func(c *outbox.Config) { c.PoisonTopic = "poison" })
	msg := message.NewMessage("bad\x00id", []byte("payload"))
	for i := 0; i < 3; i++ {
		if err := handle(e.ob, copyOf(msg), applyAndPublish(nil)); err != nil {
			t.Fatal(err)
		}
	}
	wire := e.wire("poison")
	mustEqual(t, "distinct poison IDs for one message delivered three times", len(wire), 1)
	other := message.NewMessage("bad\x00id", []byte("another payload"))
	if err := handle(e.ob, other, applyAndPublish(nil)); err != nil {
		t.Fatal(err)
	}
	mustEqual(t, "distinct poison IDs for two messages", len(e.wire("poison")), 2)
}

// Item: a pool of two connections with four messages in flight, and the tutorial's pool of one,
// finish: no code path waits on the pool while it holds a transaction.
func TestSmallPoolsDoNotDeadlock(t *testing.T) {
	for _, size := range []int{1, 2} {
		t.Run(fmt.Sprint(size), func(t *testing.T) {
			e := newEnv(t)
			e.db.SetMaxOpenConns(size)
			ob := e.newOutbox(func(c *outbox.Config) { c.HandlerTimeout = time.Minute })
			var wg sync.WaitGroup
			errs := make(chan error, 8)
			returnsWithin(t, 45*time.Second, "4 concurrent messages and 4 InTx calls", func() {
				for i := 0; i < 4; i++ {
					wg.Add(2)
					go func() {
						defer wg.Done()
						errs <- handle(ob, message.NewMessage(uuid.NewString(), nil), applyAndPublish(nil))
					}()
					go func() {
						defer wg.Done()
						errs <- ob.InTx(context.Background(), func(ctx context.Context, tx *sql.Tx) error {
							return outbox.Publish(ctx, "out_a", message.NewMessage(uuid.NewString(), nil))
						})
					}()
				}
				wg.Wait()
			})
			close(errs)
			for err := range errs {
				if err != nil {
					t.Error(err)
				}
			}
			mustEqual(t, "business rows", e.count(`SELECT count(*) FROM applied`), 4)
		})
	}
}

// Item: the outbox middleware applied twice to one handler (Router level and handler level) fails
// at once with a clear error instead of waiting for its own claim.
func TestNestedUnitOfWorkFailsClearly(t *testing.T) {
	e := newEnv(t, func(c *outbox.Config) { c.HandlerTimeout = time.Minute })
	var err error
	returnsWithin(t, 20*time.Second, "a nested Handle", func() {
		err = handle(e.ob, message.NewMessage(uuid.NewString(), nil), func(m *message.Message) ([]*message.Message, error) {
			return nil, handle(e.ob, m, applyAndPublish(nil))
		})
	})
	if err == nil || !strings.Contains(err.Error(), "twice") {
		t.Fatalf("want an error saying the middleware is applied twice, got %v", err)
	}
	mustEqual(t, "business rows", e.count(`SELECT count(*) FROM applied`), 0)
}

// Item: the middleware applied twice fails every message, and the Router redelivers at once: the
// failure waits RetryDelay before it returns, like any other, rather than spinning (thousands of
// failed attempts a second were measured without the wait).
func TestNestedUnitOfWorkWaitsRetryDelay(t *testing.T) {
	const delay = 300 * time.Millisecond
	e := newEnv(t, func(c *outbox.Config) { c.RetryDelay = delay; c.HandlerTimeout = time.Minute })
	began := time.Now()
	var err error
	returnsWithin(t, 20*time.Second, "a nested Handle", func() {
		err = handle(e.ob, message.NewMessage(uuid.NewString(), nil), func(m *message.Message) ([]*message.Message, error) {
			return nil, handle(e.ob, m, applyAndPublish(nil))
		})
	})
	if !errors.Is(err, outbox.ErrNestedUnitOfWork) {
		t.Fatalf("want ErrNestedUnitOfWork, got %v", err)
	}
	if took := time.Since(began); took < delay {
		t.Errorf("the nested Handle failed after %s; want it to wait RetryDelay (%s) first", took, delay)
	}
}

// The outbox middleware applied twice (on the Router and on the handler) fails every message with
// ErrNestedUnitOfWork: a wiring error, not the message's. It was counted as a failed attempt, and
// at MaxAttempts every message of the stream was dead-lettered and acked.
func TestNestedUnitOfWorkIsNotCounted(t *testing.T) {
	e := newEnv(t, func(c *outbox.Config) { c.RetryDelay = time.Millisecond; c.MaxAttempts = 2 })
	msg := message.NewMessage(uuid.NewString(), nil)
	for range 4 { // deliveries, past MaxAttempts
		err := handle(e.ob, copyOf(msg), func(m *message.Message) ([]*message.Message, error) {
			return nil, handle(e.ob, m, applyAndPublish(nil))
		})
		if !errors.Is(err, outbox.ErrNestedUnitOfWork) {
			t.Fatalf("want ErrNestedUnitOfWork, got %v", err)
		}
	}
	mustEqual(t, "dead letters", e.count(`SELECT count(*) FROM outbox_dead_letters`), 0)
	mustEqual(t, "attempts counted", e.count(`SELECT count(*) FROM outbox_attempts`), 0)
	mustEqual(t, "claims", e.count(`SELECT count(*) FROM outbox_processed`), 0)
}

// Item: a redelivery that follows a failed dispatch does not wait DuplicateWait for an original
// that is known to have failed (whether the broker failed before or after taking the message).
func TestRedeliveryAfterAFailedDispatchDoesNotWait(t *testing.T) {
	for _, after := range []bool{false, true} {
		t.Run(fmt.Sprintf("failed-after-sending=%v", after), func(t *testing.T) {
			var failNext atomic.Bool
			e := newEnv(t, func(c *outbox.Config) {
				c.DuplicateWait = time.Hour
				next := c.Publisher
				c.Publisher = publisherFunc(func(topic string, msgs ...*message.Message) error {
					if failNext.CompareAndSwap(true, false) {
						if after {
							if err := next.Publish(topic, msgs...); err != nil {
								return err
							}
						}
						return errors.New("broker connection reset")
					}
					return next.Publish(topic, msgs...)
				})
			})
			for _, ob := range []*outbox.Outbox{e.ob, e.newOutbox()} { // the same process, and another one
				msg := message.NewMessage(uuid.NewString(), nil)
				failNext.Store(true)
				if err := handle(e.ob, copyOf(msg), applyAndPublish(nil)); err == nil {
					t.Fatal("a failed dispatch was acked")
				}
				returnsWithin(t, 20*time.Second, "the redelivery", func() {
					if err := handle(ob, copyOf(msg), applyAndPublish(nil)); err != nil {
						t.Error(err)
					}
				})
			}
			mustEqual(t, "pending effects", e.pendingEffects(), 0)
		})
	}
}

// publisherFunc is a Publisher made of a function.
type publisherFunc func(topic string, msgs ...*message.Message) error

func (f publisherFunc) Publish(topic string, msgs ...*message.Message) error {
	return f(topic, msgs...)
}
func (f publisherFunc) Close() error { return nil }

// Item: a concurrent copy that waited on the claim of a slow handler waits for its dispatch rather
// than putting a second copy of each effect on the wire, however long the handler took.
func TestConcurrentCopyOfASlowHandlerDoesNotSendCopies(t *testing.T) {
	release := make(chan struct{})
	entered := make(chan struct{}, 8)
	e := newEnv(t, func(c *outbox.Config) {
		c.DuplicateWait = 10 * time.Second
		next := c.Publisher
		c.Publisher = publisherFunc(func(topic string, msgs ...*message.Message) error {
			entered <- struct{}{}
			<-release
			return next.Publish(topic, msgs...)
		})
	})
	other := e.newOutbox()
	msg := message.NewMessage(uuid.NewString(), nil)
	slow := func(m *message.Message) ([]*message.Message, error) {
		out, err := applyAndPublish(nil)(m)
		time.Sleep(1500 * time.Millisecond) // longer than the default DuplicateWait
		return out, err
	}
	var wg sync.WaitGroup
	wg.Add(2)
	go func() { defer wg.Done(); _ = handle(e.ob, copyOf(msg), slow) }()
	time.Sleep(200 * time.Millisecond) // the first copy holds the claim
	go func() { defer wg.Done(); _ = handle(other, copyOf(msg), slow) }()
	<-entered // the original is publishing
	time.Sleep(300 * time.Millisecond)
	close(release)
	wg.Wait()
	mustEqual(t, "copies on the wire", len(e.wire("out_a"))+len(e.wire("out_b")), 2)
	for id, n := range e.allWire("out_a", "out_b") {
		mustEqual(t, "copies of "+id, n, 1)
	}
}

// Item: a backwards step of the database clock (an effect stored "in the future") does not make a
// redelivery wait longer than DuplicateWait.
func TestDuplicateWaitIsBoundedWhenTheClockStepsBack(t *testing.T) {
	e := newEnv(t, func(c *outbox.Config) { c.DuplicateWait = 100 * time.Millisecond })
	msg := message.NewMessage(uuid.NewString(), nil)
	if err := handle(e.ob, copyOf(msg), func(m *message.Message) ([]*message.Message, error) {
		out, err := applyAndPublish(nil)(m)
		if err == nil {
			_, err = outbox.Tx(m.Context()).Exec(`UPDATE outbox_effects_all SET created_at = now() + interval '1 hour'`)
		}
		if err == nil {
			err = errors.New("fail after the effects were stored")
		}
		return out, err
	}); err == nil {
		t.Fatal("want the handler's error")
	}
	// Commit with effects "from the future", crash before dispatch.
	crashing := e.newOutbox(func(c *outbox.Config) { c.Failpoint = crashAfterCommit })
	if err := handle(crashing, copyOf(msg), func(m *message.Message) ([]*message.Message, error) {
		out, err := applyAndPublish(nil)(m)
		if err == nil {
			_, err = outbox.Tx(m.Context()).Exec(`UPDATE outbox_effects_all SET created_at = now() + interval '1 hour'`)
		}
		return out, err
	}); !errors.Is(err, outbox.ErrFailpoint) {
		t.Fatalf("want the crash, got %v", err)
	}
	returnsWithin(t, 20*time.Second, "the redelivery", func() {
		if err := handle(e.newOutbox(func(c *outbox.Config) { c.DuplicateWait = 100 * time.Millisecond }), copyOf(msg), applyAndPublish(nil)); err != nil {
			t.Error(err)
		}
	})
}

// Item: the dispatched mark and a transaction that locks an effect and then its claim (the relay's
// order) take their locks in one order: neither fails with a deadlock.
func TestMarkTakesLocksInTheRelaysOrder(t *testing.T) {
	e := newEnv(t)
	msg := message.NewMessage(uuid.NewString(), nil)
	e.pub.failAll.Store(true)
	if err := handle(e.ob, copyOf(msg), applyAndPublish(nil)); err == nil {
		t.Fatal("dispatch through a failing publisher reported success")
	}
	e.pub.failAll.Store(false)
	ids := e.storedEffects("c1", msg.UUID)
	var storeIDs []int64
	rows, err := e.db.Query(`SELECT id FROM outbox_effects_all ORDER BY id`)
	if err != nil {
		t.Fatal(err)
	}
	for rows.Next() {
		var id int64
		if err := rows.Scan(&id); err != nil {
			t.Fatal(err)
		}
		storeIDs = append(storeIDs, id)
	}
	rows.Close()
	mustEqual(t, "stored effects", len(ids), 2)

	tx, err := e.db.Begin()
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback() }()
	if _, err := tx.Exec(`SELECT 1 FROM outbox_effects_all WHERE id = $1 FOR UPDATE`, storeIDs[0]); err != nil {
		t.Fatal(err)
	}
	markErr := make(chan error, 1)
	go func() {
		markErr <- e.ob.Store().EffectMarkDispatched(context.Background(),
			outboxdriver.DispatchMark{Source: outbox.Source{Consumer: "c1", ID: msg.UUID}, MoveClaim: true, StoreIDs: storeIDs})
	}()
	waitFor(t, "the mark to wait for the effect's lock", func() bool {
		return e.count(`SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'`) > 0
	})
	if _, err := tx.Exec(`UPDATE outbox_processed SET dispatched_at = now() WHERE message_id = $1`, msg.UUID); err != nil {
		t.Fatalf("the relay-ordered transaction: %v", err)
	}
	if err := tx.Commit(); err != nil {
		t.Fatal(err)
	}
	if err := <-markErr; err != nil {
		t.Fatalf("the mark: %v", err)
	}
	mustEqual(t, "pending effects", e.pendingEffects(), 0)
}

// Item: a failed batch of marks is retried, not dropped (a dropped mark re-sends every effect of
// the batch).
func TestFailedMarkBatchIsRetried(t *testing.T) {
	e := newEnv(t)
	// A sequence is not rolled back with the failing statement: the first two marks fail.
	mustExec(t, e, `CREATE SEQUENCE mark_failures`)
	mustExec(t, e, `CREATE FUNCTION fail_marks() RETURNS trigger LANGUAGE plpgsql AS $$
		BEGIN
			IF nextval('mark_failures') <= 2 THEN
				RAISE EXCEPTION 'deadlock detected (simulated)' USING ERRCODE = '40P01';
			END IF;
			RETURN OLD;
		END $$`)
	mustExec(t, e, `CREATE TRIGGER fail_marks BEFORE DELETE ON outbox_effects_all FOR EACH ROW EXECUTE FUNCTION fail_marks()`)
	for i := 0; i < 5; i++ {
		if err := handle(e.ob, message.NewMessage(uuid.NewString(), nil), applyAndPublish(nil)); err != nil {
			t.Fatal(err)
		}
	}
	mustEqual(t, "pending effects after the marks", e.pendingEffects(), 0)
}

// Item: a panicking applier or Publisher is a failed dispatch: counted, retried, parked, never a
// crash of the process; a panic in InTx's fn rolls back and re-panics, one in its dispatch does not.
func TestPanickingApplierAndPublisher(t *testing.T) {
	var publisherPanics atomic.Bool
	e := newEnv(t, func(c *outbox.Config) {
		c.RelayMaxAttempts = 2
		c.RelayGrace = 10 * time.Millisecond
		c.RelayInterval = 10 * time.Millisecond
		next := c.Publisher
		c.Publisher = publisherFunc(func(topic string, msgs ...*message.Message) error {
			if publisherPanics.Load() && topic == "out_b" {
				panic("publisher bug")
			}
			return next.Publish(topic, msgs...)
		})
	})
	var applied atomic.Int32
	// The broker and the applier take everything else: the panicking effects are poison.
	if err := e.ob.RegisterApplier("boom", func(ctx context.Context, ef outbox.Effect) error {
		if string(ef.Payload) == "panic" {
			panic("applier bug")
		}
		applied.Add(1)
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	recordBoom := func(payload string) message.HandlerFunc {
		return func(m *message.Message) ([]*message.Message, error) {
			return nil, outbox.Record(m.Context(), "boom", []byte(payload))
		}
	}
	msg := message.NewMessage(uuid.NewString(), nil)
	if err := handle(e.ob, copyOf(msg), recordBoom("panic")); err == nil || !strings.Contains(err.Error(), "applier bug") {
		t.Fatalf("want the applier's panic as an error, got %v", err)
	}
	publisherPanics.Store(true)
	msg2 := message.NewMessage(uuid.NewString(), nil)
	if err := handle(e.ob, copyOf(msg2), applyAndPublish(nil)); err == nil || !strings.Contains(err.Error(), "publisher bug") {
		t.Fatalf("want the publisher's panic as an error, got %v", err)
	}
	if err := e.ob.InTx(context.Background(), func(ctx context.Context, _ *sql.Tx) error {
		return outbox.Record(ctx, "boom", []byte("panic"))
	}); err != nil {
		t.Fatalf("InTx whose dispatch panicked after commit: %v", err)
	}
	func() {
		defer func() {
			if r := recover(); r == nil || fmt.Sprint(r) != "fn bug" {
				t.Errorf("InTx: want fn's panic re-raised, got %v", r)
			}
		}()
		_ = e.ob.InTx(context.Background(), func(ctx context.Context, tx *sql.Tx) error {
			if _, err := tx.Exec(`INSERT INTO applied (message_id) VALUES ('from-panicking-fn')`); err != nil {
				return err
			}
			panic("fn bug")
		})
	}()
	mustEqual(t, "rows of the panicking fn", e.count(`SELECT count(*) FROM applied WHERE message_id = 'from-panicking-fn'`), 0)

	stop := startRun(t, e.ob)
	healthy := func() {
		if err := e.ob.InTx(context.Background(), func(ctx context.Context, _ *sql.Tx) error {
			if err := outbox.Record(ctx, "boom", []byte("fine")); err != nil {
				return err
			}
			return outbox.Publish(ctx, "out_a", message.NewMessage(uuid.NewString(), nil))
		}); err != nil {
			t.Error(err)
		}
	}
	waitFor(t, "the panicking effects to be parked", func() bool {
		healthy()
		parked, err := e.ob.ParkedEffects(context.Background(), 10)
		return err == nil && len(parked) == 3
	})
	stop()
}

// Item: HandlerTimeout bounds the handler (its context has the deadline, so a query it runs is
// cancelled), the wait for a concurrent copy's claim, and appliers get a deadline too.
func TestHandlerTimeoutBoundsEveryWait(t *testing.T) {
	e := newEnv(t, func(c *outbox.Config) {
		c.HandlerTimeout = 300 * time.Millisecond
		c.PublishTimeout = 300 * time.Millisecond
	})
	var sawDeadline atomic.Bool
	returnsWithin(t, 20*time.Second, "a handler running pg_sleep(60)", func() {
		err := handle(e.ob, message.NewMessage(uuid.NewString(), nil), func(m *message.Message) ([]*message.Message, error) {
			ctx := m.Context()
			_, ok := ctx.Deadline()
			sawDeadline.Store(ok)
			_, err := outbox.Tx(ctx).ExecContext(ctx, `SELECT pg_sleep(60)`)
			return nil, err
		})
		if err == nil {
			t.Error("a handler cut short by HandlerTimeout was acked")
		}
	})
	if !sawDeadline.Load() {
		t.Error("the handler's context has no deadline")
	}

	// Another transaction holds the claim of the message (a stuck copy elsewhere).
	msg := message.NewMessage(uuid.NewString(), nil)
	tx, err := e.db.Begin()
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback() }()
	if _, err := tx.Exec(`INSERT INTO outbox_processed (consumer, message_id) VALUES ('c1', $1)`, msg.UUID); err != nil {
		t.Fatal(err)
	}
	returnsWithin(t, 20*time.Second, "a copy waiting on a claim held elsewhere", func() {
		if err := handle(e.ob, copyOf(msg), applyAndPublish(nil)); err == nil {
			t.Error("a copy that could not claim was acked")
		}
	})
	_ = tx.Rollback()

	var applierDeadline atomic.Bool
	if err := e.ob.RegisterApplier("slow", func(ctx context.Context, _ outbox.Effect) error {
		_, ok := ctx.Deadline()
		applierDeadline.Store(ok)
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(30 * time.Second):
			return nil
		}
	}); err != nil {
		t.Fatal(err)
	}
	returnsWithin(t, 20*time.Second, "a message whose applier waits for its context", func() {
		if err := handle(e.ob, message.NewMessage(uuid.NewString(), nil), func(m *message.Message) ([]*message.Message, error) {
			return nil, outbox.Record(m.Context(), "slow", nil)
		}); err == nil {
			t.Error("an applier cut short was reported as dispatched")
		}
	})
	if !applierDeadline.Load() {
		t.Error("the applier's context has no deadline")
	}
}

// Item: a COMMIT that fails deterministically (a deferred unique violation) is a failed attempt:
// counted, and poisoned after MaxAttempts.
func TestDeterministicCommitFailureIsCountedAndPoisoned(t *testing.T) {
	e := newEnv(t, func(c *outbox.Config) { c.MaxAttempts = 2; c.PoisonTopic = "poison" })
	mustExec(t, e, `CREATE TABLE uniq (k text UNIQUE DEFERRABLE INITIALLY DEFERRED)`)
	h := func(m *message.Message) ([]*message.Message, error) {
		out, err := applyAndPublish(nil)(m)
		if err == nil {
			_, err = outbox.Tx(m.Context()).Exec(`INSERT INTO uniq VALUES ('x'), ('x')`)
		}
		return out, err
	}
	msg := message.NewMessage(uuid.NewString(), nil)
	acked := false
	for i := 0; i < 4 && !acked; i++ {
		acked = handle(e.ob, copyOf(msg), h) == nil
	}
	if !acked {
		t.Fatal("a message whose COMMIT always fails was never poisoned")
	}
	mustEqual(t, "poisoned copies", e.wire("poison")[msg.UUID], 1)
	mustEqual(t, "business rows", e.count(`SELECT count(*) FROM applied`), 0)
}

// Item: a serialization failure or deadlock is retried at once, in a new transaction, without
// counting an attempt.
func TestSerializationFailureIsRetriedAtOnce(t *testing.T) {
	for _, code := range []string{"40001", "40P01"} {
		t.Run(code, func(t *testing.T) {
			e := newEnv(t)
			var calls atomic.Int32
			h := func(m *message.Message) ([]*message.Message, error) {
				out, err := applyAndPublish(nil)(m)
				if err == nil && calls.Add(1) == 1 {
					_, err = outbox.Tx(m.Context()).Exec(`DO $$ BEGIN RAISE EXCEPTION 'could not serialize (simulated)' USING ERRCODE = '` + code + `'; END $$`)
				}
				return out, err
			}
			if err := handle(e.ob, message.NewMessage(uuid.NewString(), nil), h); err != nil {
				t.Fatalf("want the unit of work retried at once, got %v", err)
			}
			mustEqual(t, "handler calls", calls.Load(), int32(2))
			mustEqual(t, "attempts counted", e.count(`SELECT count(*) FROM outbox_attempts`), 0)
			mustEqual(t, "business rows", e.count(`SELECT count(*) FROM applied`), 1)
		})
	}
}

// Item: a cancelled message context (Router shutdown, ack deadline) during the handler is not a
// failed attempt.
func TestCancellationIsNotAFailedAttempt(t *testing.T) {
	e := newEnv(t, func(c *outbox.Config) { c.MaxAttempts = 1; c.PoisonTopic = "poison" })
	for i := 0; i < 3; i++ {
		ctx, cancel := context.WithCancel(context.Background())
		msg := message.NewMessage("cancelled-message", nil)
		msg.SetContext(ctx)
		err := handle(e.ob, msg, func(m *message.Message) ([]*message.Message, error) {
			cancel()
			_, err := outbox.Tx(m.Context()).ExecContext(m.Context(), `SELECT pg_sleep(5)`)
			return nil, err
		})
		if err == nil {
			t.Fatal("a cancelled unit of work was acked")
		}
	}
	mustEqual(t, "attempts counted", e.count(`SELECT count(*) FROM outbox_attempts`), 0)
	mustEqual(t, "poisoned copies", len(e.wire("poison")), 0)
}

// Item (likely): a COMMIT whose connection dies in flight has an unknown outcome; it is not counted
// as a failed attempt even when HandlerTimeout passed meanwhile.
func TestCommitLostInFlightIsNotCounted(t *testing.T) {
	e := newEnv(t, func(c *outbox.Config) {
		c.HandlerTimeout = 300 * time.Millisecond
		c.MaxAttempts = 1
		c.PoisonTopic = "poison"
	})
	// A deferred trigger makes COMMIT take a while; the test kills the backend during it.
	mustExec(t, e, `CREATE FUNCTION slow_commit() RETURNS trigger LANGUAGE plpgsql AS $$
		BEGIN PERFORM pg_sleep(2); RETURN NULL; END $$`)
	mustExec(t, e, `CREATE CONSTRAINT TRIGGER slow_commit AFTER INSERT ON applied DEFERRABLE INITIALLY DEFERRED
		FOR EACH ROW EXECUTE FUNCTION slow_commit()`)
	msg := message.NewMessage(uuid.NewString(), nil)
	killed := make(chan struct{})
	go func() {
		defer close(killed)
		waitFor(t, "the slow COMMIT", func() bool {
			return e.count(`SELECT count(*) FROM pg_stat_activity WHERE query = 'COMMIT' AND state = 'active'`) > 0
		})
		time.Sleep(600 * time.Millisecond) // HandlerTimeout passes while the COMMIT is in flight
		mustExec(t, e, `SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE query = 'COMMIT' AND state = 'active'`)
	}()
	err := handle(e.ob, copyOf(msg), applyAndPublish(nil))
	<-killed
	if err == nil {
		t.Fatal("a lost COMMIT was acked")
	}
	mustEqual(t, "attempts counted", e.count(`SELECT count(*) FROM outbox_attempts`), 0)
	mustEqual(t, "poisoned copies", len(e.wire("poison")), 0)
	mustExec(t, e, `DROP TRIGGER slow_commit ON applied`)
	if err := handle(e.ob, copyOf(msg), applyAndPublish(nil)); err != nil {
		t.Fatal(err)
	}
	mustEqual(t, "business rows", e.count(`SELECT count(*) FROM applied`), 1)
}

// Item: a later effect never overtakes an earlier one with its ordering key that another statement
// has locked at the moment the relay looks.
func TestLockedEarlierEffectIsNotOvertaken(t *testing.T) {
	e := newEnv(t, func(c *outbox.Config) {
		c.RelayGrace = 10 * time.Millisecond
		c.RelayInterval = 20 * time.Millisecond
	})
	crashing := e.newOutbox(func(c *outbox.Config) { c.Failpoint = crashAfterCommit })
	var ids []string
	for _, p := range []string{"first", "second"} {
		if err := crashing.InTx(context.Background(), func(ctx context.Context, _ *sql.Tx) error {
			m := message.NewMessage(uuid.NewString(), []byte(p))
			ids = append(ids, m.UUID)
			return outbox.Publish(outbox.WithOrderingKey(ctx, "k"), "out_a", m)
		}); !errors.Is(err, outbox.ErrFailpoint) {
			t.Fatalf("want the crash after commit, got %v", err)
		}
	}
	tx, err := e.db.Begin()
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback() }()
	if _, err := tx.Exec(`SELECT 1 FROM outbox_effects_all WHERE uuid = $1 FOR UPDATE`, ids[0]); err != nil {
		t.Fatal(err)
	}
	stop := startRun(t, e.ob)
	time.Sleep(time.Second) // relay rounds run while the first effect is locked
	mustEqual(t, "copies of the second effect while the first is locked", e.wire("out_a")[ids[1]], 0)
	if err := tx.Rollback(); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "both effects sent", func() bool { return e.pendingEffects() == 0 })
	stop()
	copies := e.wireInOrder("out_a")
	checkKeyOrder(t, firstCopies(copies), map[string][]string{"k": ids})
}

// Item (likely): a broker outage parks nothing: while nothing at all reaches the broker, failed
// dispatches back off but are not counted toward RelayMaxAttempts.
func TestBrokerOutageParksNothing(t *testing.T) {
	e := newEnv(t, func(c *outbox.Config) {
		c.RelayMaxAttempts = 2
		c.RelayGrace = 10 * time.Millisecond
		c.RelayInterval = 20 * time.Millisecond
	})
	e.pub.failAll.Store(true)
	for i := 0; i < 3; i++ {
		if err := e.ob.InTx(context.Background(), func(ctx context.Context, _ *sql.Tx) error {
			return outbox.Publish(ctx, "out_a", message.NewMessage(uuid.NewString(), nil))
		}); err != nil {
			t.Fatal(err)
		}
	}
	stop := startRun(t, e.ob)
	// Backoff from 1 s: within 4 s the relay retries each effect at least twice.
	waitWithin(t, 20*time.Second, "failed relay retries", func() bool {
		return e.count(`SELECT count(*) FROM outbox_effects_all WHERE last_error IS NOT NULL AND next_attempt_at > created_at + interval '2 seconds'`) == 3
	})
	time.Sleep(2 * time.Second)
	mustEqual(t, "effects parked during the outage", e.count(`SELECT count(*) FROM outbox_effects_all WHERE parked_at IS NOT NULL`), 0)
	e.pub.failAll.Store(false)
	mustExec(t, e, `UPDATE outbox_effects_all SET next_attempt_at = now()`)
	waitFor(t, "the backlog after the outage", func() bool { return e.pendingEffects() == 0 })
	stop()
	mustEqual(t, "messages on the wire", len(e.wire("out_a")), 3)
}

// Item: the NOTIFY channel of the longest allowed schema and prefix fits PostgreSQL's 63 bytes, and
// the relay of another instance is woken on it.
func TestLongestNamesNotifyAndListen(t *testing.T) {
	e := newEnv(t)
	schema := strings.Repeat("s", 40)
	prefix := strings.Repeat("p", 39) + "_"
	cfg := func(c *outbox.Config) {
		c.Schema = schema
		c.TablePrefix = prefix
		c.Driver = postgres.Driver{ListenDSN: e.dsn}
		c.RelayGrace = time.Hour
		c.RelayInterval = time.Hour
	}
	a := e.newOutbox(cfg)
	if err := a.Migrate(context.Background()); err != nil {
		t.Fatal(err)
	}
	b := e.newOutbox(cfg)
	stop := startRun(t, b)
	waitFor(t, "the relay to listen", func() bool {
		return e.count(`SELECT count(*) FROM pg_stat_activity WHERE query LIKE 'LISTEN %'`) > 0
	})
	e.pub.fail.Store(1)
	var id string
	if err := a.InTx(context.Background(), func(ctx context.Context, _ *sql.Tx) error {
		m := message.NewMessage(uuid.NewString(), nil)
		id = m.UUID
		return outbox.Publish(ctx, "out_a", m)
	}); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "the woken relay of the other instance", func() bool { return e.wire("out_a")[id] == 1 })
	stop()
}

// Smaller: an application role with DML rights only on the existing tables can start (Migrate
// finds nothing to do and needs no CREATE).
func TestMigrateNeedsNoCreateRightWhenUpToDate(t *testing.T) {
	e := newEnv(t)
	role := "dml_" + strings.ReplaceAll(uuid.NewString()[:8], "-", "")
	mustExec(t, e, `CREATE ROLE `+role+` LOGIN PASSWORD 'pw'`)
	t.Cleanup(func() {
		_, _ = e.db.Exec(`DROP OWNED BY ` + role)
		_, _ = e.db.Exec(`DROP ROLE ` + role)
	})
	var dbName string
	if err := e.db.QueryRow(`SELECT current_database()`).Scan(&dbName); err != nil {
		t.Fatal(err)
	}
	mustExec(t, e, `REVOKE CREATE ON DATABASE "`+dbName+`" FROM PUBLIC`)
	mustExec(t, e, `REVOKE CREATE ON SCHEMA public FROM PUBLIC`)
	mustExec(t, e, `GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA public TO `+role)
	mustExec(t, e, `GRANT USAGE ON ALL SEQUENCES IN SCHEMA public TO `+role)
	db, err := sql.Open("postgres", dsnAs(t, e.dsn, role, "pw"))
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	ob, err := outbox.New(outbox.Config{DB: db, Driver: postgres.Driver{}, Publisher: e.pub, Logger: watermill.NopLogger{}})
	if err != nil {
		t.Fatal(err)
	}
	if err := ob.Migrate(context.Background()); err != nil {
		t.Fatalf("Migrate with DML rights only, every table present: %v", err)
	}
	if err := handle(ob, message.NewMessage(uuid.NewString(), nil), applyAndPublish(nil)); err != nil {
		t.Fatal(err)
	}
}

// dsnAs returns dsn with another user and password.
func dsnAs(t *testing.T, dsn, user, password string) string {
	t.Helper()
	if strings.HasPrefix(dsn, "postgres://") || strings.HasPrefix(dsn, "postgresql://") {
		u, err := url.Parse(dsn)
		if err != nil {
			t.Fatal(err)
		}
		u.User = url.UserPassword(user, password)
		return u.String()
	}
	return dsn + " user=" + user + " password=" + password // later keys win
}

// Smaller: effects left to the relay in a process where Run was never started are reported
// loudly, once, instead of "the relay will retry" with no relay to do it.
func TestMissingRelayIsReported(t *testing.T) {
	logs := &logtest.Errors{}
	e := newEnv(t, func(c *outbox.Config) { c.Logger = logs })
	e.pub.failAll.Store(true)
	if err := e.ob.InTx(context.Background(), func(ctx context.Context, _ *sql.Tx) error {
		return outbox.Publish(ctx, "out_a", message.NewMessage(uuid.NewString(), nil))
	}); err != nil {
		t.Fatal(err)
	}
	if !logs.Contains("Outbox.Run is not running") {
		t.Fatalf("no warning that no relay runs; logged: %v", logs.Lines())
	}
	// With Run started, no such warning.
	running := &logtest.Errors{}
	ob := e.newOutbox(func(c *outbox.Config) { c.Logger = running })
	stop := startRun(t, ob)
	if err := ob.InTx(context.Background(), func(ctx context.Context, _ *sql.Tx) error {
		return outbox.Publish(ctx, "out_a", message.NewMessage(uuid.NewString(), nil))
	}); err != nil {
		t.Fatal(err)
	}
	stop()
	if running.Contains("Outbox.Run is not running") {
		t.Fatal("warned of a missing relay while Run was running")
	}
}

// A goroutine of the handler that records after the handler returned gets ErrUnitOfWorkFinished;
// what it records is neither stored nor sent.
func TestPublishAfterTheUnitOfWorkFinished(t *testing.T) {
	e := newEnv(t)
	late := make(chan error, 1)
	var unitCtx context.Context
	if err := handle(e.ob, message.NewMessage(uuid.NewString(), nil), func(m *message.Message) ([]*message.Message, error) {
		unitCtx = m.Context()
		return nil, nil
	}); err != nil {
		t.Fatal(err)
	}
	go func() { late <- outbox.Publish(unitCtx, "out_a", message.NewMessage(uuid.NewString(), nil)) }()
	if err := <-late; !errors.Is(err, outbox.ErrUnitOfWorkFinished) {
		t.Fatalf("Publish after the unit of work finished: want ErrUnitOfWorkFinished, got %v", err)
	}
	mustEqual(t, "stored effects", len(e.committedEffects()), 0)
}

// An applier that ignores its context and never returns holds neither a transaction nor a lock of
// the relay: the relay gives up on it after PublishTimeout and sends the other effects.
func TestHungApplierDoesNotHoldTheRelay(t *testing.T) {
	release := make(chan struct{})
	defer close(release)
	e := newEnv(t, func(c *outbox.Config) {
		c.PublishTimeout = 200 * time.Millisecond
		c.RelayGrace = 10 * time.Millisecond
		c.RelayInterval = 20 * time.Millisecond
	})
	if err := e.ob.RegisterApplier("hang", func(context.Context, outbox.Effect) error { <-release; return nil }); err != nil {
		t.Fatal(err)
	}
	crashing := e.newOutbox(func(c *outbox.Config) { c.Failpoint = crashAfterCommit })
	if err := crashing.RegisterApplier("hang", func(context.Context, outbox.Effect) error { return nil }); err != nil {
		t.Fatal(err)
	}
	var ids []string
	for i := 0; i < 3; i++ {
		if err := crashing.InTx(context.Background(), func(ctx context.Context, _ *sql.Tx) error {
			if i == 0 {
				return outbox.Record(ctx, "hang", nil)
			}
			m := message.NewMessage(uuid.NewString(), nil)
			ids = append(ids, m.UUID)
			return outbox.Publish(ctx, "out_a", m)
		}); !errors.Is(err, outbox.ErrFailpoint) {
			t.Fatalf("want the crash after commit, got %v", err)
		}
	}
	stop := startRun(t, e.ob)
	waitFor(t, "the effects behind the hung applier's", func() bool {
		// At least once: with a PublishTimeout of 200 ms (for the hung applier), a loaded
		// machine's INSERT into the SQL broker may time out after it landed, and is sent again.
		w := e.wire("out_a")
		return w[ids[0]] > 0 && w[ids[1]] > 0
	})
	stop()
	mustEqual(t, "relay statements waiting on a lock", e.count(`SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'`), 0)
}

// Item: a poisoned message can be replayed once the cause is fixed: ReplayPoisoned forgets its
// claim and attempts, and the next copy runs the handler; copies before that are acked unrun.
func TestReplayPoisonedMessage(t *testing.T) {
	e := newEnv(t, func(c *outbox.Config) { c.MaxAttempts = 2; c.PoisonTopic = "poison" })
	var fixed atomic.Bool
	var calls atomic.Int32
	h := func(m *message.Message) ([]*message.Message, error) {
		calls.Add(1)
		if !fixed.Load() {
			return nil, errors.New("bug")
		}
		return applyAndPublish(nil)(m)
	}
	msg := message.NewMessage(uuid.NewString(), []byte("order"))
	for i := 0; i < 2; i++ {
		_ = handle(e.ob, copyOf(msg), h)
	}
	mustEqual(t, "poisoned copies", e.wire("poison")[msg.UUID], 1)
	if err := handle(e.ob, copyOf(msg), h); err != nil {
		t.Fatal(err)
	}
	mustEqual(t, "handler calls (a copy after poisoning is acked unrun)", calls.Load(), int32(2))

	fixed.Store(true)
	if ok, err := e.ob.ReplayPoisoned(context.Background(), "c1", msg.UUID); err != nil || !ok {
		t.Fatalf("ReplayPoisoned = %v, %v; want true", ok, err)
	}
	if ok, err := e.ob.ReplayPoisoned(context.Background(), "c1", uuid.NewString()); err != nil || ok {
		t.Fatalf("ReplayPoisoned of a message never poisoned = %v, %v; want false", ok, err)
	}
	if err := handle(e.ob, copyOf(msg), h); err != nil {
		t.Fatal(err)
	}
	mustEqual(t, "business rows after the replay", e.count(`SELECT count(*) FROM applied`), 1)
	mustEqual(t, "attempts left after the replay", e.count(`SELECT count(*) FROM outbox_attempts`), 0)
	if ok, err := e.ob.ReplayPoisoned(context.Background(), "c1", msg.UUID); err != nil || ok {
		t.Fatalf("ReplayPoisoned of a message processed after its replay = %v, %v; want false", ok, err)
	}
	if err := handle(e.ob, copyOf(msg), h); err != nil {
		t.Fatal(err)
	}
	mustEqual(t, "business rows after another copy", e.count(`SELECT count(*) FROM applied`), 1)
}

// A failed attempt is not returned (nacked) at once: Handle waits RetryDelay, doubling with each
// further failure of the message, so that a broker that redelivers a nack at once does not turn
// it into a loop; the wait ends when the message's context does.
func TestFailuresBackOffBeforeTheNack(t *testing.T) {
	e := newEnv(t, func(c *outbox.Config) {
		c.RetryDelay = 200 * time.Millisecond
		c.RetryDelayMax = 300 * time.Millisecond
		c.MaxAttempts = 100
	})
	var calls atomic.Int32
	msg := message.NewMessage(uuid.NewString(), nil)
	for i, want := range []time.Duration{200 * time.Millisecond, 300 * time.Millisecond, 300 * time.Millisecond} {
		start := time.Now()
		if err := handle(e.ob, copyOf(msg), failing(&calls)); err == nil {
			t.Fatal("a failing handler was acked")
		}
		if took := time.Since(start); took < want {
			t.Errorf("failure %d was returned after %s, want at least %s", i+1, took, want)
		}
	}
	ctx, cancel := context.WithCancel(context.Background())
	m := copyOf(msg)
	m.SetContext(ctx)
	time.AfterFunc(50*time.Millisecond, cancel)
	returnsWithin(t, 20*time.Second, "a back-off whose message context ends", func() {
		if err := handle(e.ob, m, failing(&calls)); err == nil {
			t.Error("a failing handler was acked")
		}
	})
}

// A failpoint stands for a crash: the unit of work it stops returns at once, without the
// RetryDelay a failure waits (a killed consumer lets go of its messages without waiting).
func TestFailpointDoesNotBackOff(t *testing.T) {
	e := newEnv(t, func(c *outbox.Config) {
		c.RetryDelay, c.RetryDelayMax = time.Hour, time.Hour
		c.Failpoint = func(_ context.Context, point string) error {
			if point == outbox.FailpointAfterClaim {
				return errors.New("crash")
			}
			return nil
		}
	})
	returnsWithin(t, 10*time.Second, "a unit of work stopped by a failpoint", func() {
		if err := handle(e.ob, message.NewMessage(uuid.NewString(), nil), applyAndPublish(nil)); !errors.Is(err, outbox.ErrFailpoint) {
			t.Errorf("Handle = %v, want ErrFailpoint", err)
		}
	})
}

// A failpoint stands for a crash wherever it stops the unit of work: one after the handler (which
// a killed consumer reaches for every message in flight) is not a failed attempt, since a dead
// process records nothing; counted, a message in flight at MaxAttempts kills was dead-lettered
// though it never failed (the example's chaos run with Redis, whose order never finished).
func TestFailpointAfterHandlerIsNotAFailedAttempt(t *testing.T) {
	e := newEnv(t, func(c *outbox.Config) {
		c.MaxAttempts = 2
		c.RetryDelay = time.Millisecond
		c.Failpoint = func(_ context.Context, point string) error {
			if point == outbox.FailpointAfterHandler {
				return errors.New("crash")
			}
			return nil
		}
	})
	msg := message.NewMessage(uuid.NewString(), nil)
	for i := 0; i < 4; i++ {
		if err := handle(e.ob, copyOf(msg), applyAndPublish(nil)); !errors.Is(err, outbox.ErrFailpoint) {
			t.Fatalf("delivery %d: Handle = %v, want ErrFailpoint", i+1, err)
		}
	}
	mustEqual(t, "attempts counted", e.count(`SELECT count(*) FROM outbox_attempts WHERE message_id = $1`, msg.UUID), 0)
	mustEqual(t, "dead letters", e.count(`SELECT count(*) FROM outbox_dead_letters WHERE message_id = $1`, msg.UUID), 0)
	mustEqual(t, "business rows", e.count(`SELECT count(*) FROM applied`), 0)
}

// HandlerRetries runs a failed unit of work again in the same delivery, each time in a new
// transaction and counted, so that Watermill's Retry middleware (which must not run inside the
// outbox middleware) is not needed.
func TestHandlerRetriesInProcess(t *testing.T) {
	e := newEnv(t, func(c *outbox.Config) {
		c.HandlerRetries = 2
		c.RetryDelay = time.Millisecond
	})
	var calls atomic.Int32
	h := func(m *message.Message) ([]*message.Message, error) {
		out, err := applyAndPublish(nil)(m)
		if err == nil && calls.Add(1) <= 2 {
			err = errors.New("flaky downstream")
		}
		return out, err
	}
	msg := message.NewMessage(uuid.NewString(), nil)
	if err := handle(e.ob, msg, h); err != nil {
		t.Fatalf("want the third run to succeed within one delivery, got %v", err)
	}
	mustEqual(t, "handler calls", calls.Load(), int32(3))
	mustEqual(t, "business rows", e.count(`SELECT count(*) FROM applied`), 1)
	mustEqual(t, "attempts counted", e.count(`SELECT attempts FROM outbox_attempts WHERE message_id = $1`, msg.UUID), 2)
	mustEqual(t, "effects on the wire", len(e.wire("out_a"))+len(e.wire("out_b")), 2)
}

// slowMarks is a Driver whose Store holds every mark until release is closed, as a loaded
// database would delay it.
type slowMarks struct {
	outboxdriver.Driver
	release chan struct{}
}

func (d slowMarks) Open(db *sql.DB, opts outboxdriver.StoreOptions) (outboxdriver.Store, error) {
	st, err := d.Driver.Open(db, opts)
	return slowMarkStore{Store: st, release: d.release}, err
}

type slowMarkStore struct {
	outboxdriver.Store
	release chan struct{}
}

func (s slowMarkStore) EffectMarkDispatched(ctx context.Context, marks ...outboxdriver.DispatchMark) error {
	select {
	case <-s.release:
	case <-ctx.Done():
		return ctx.Err()
	}
	return s.Store.EffectMarkDispatched(ctx, marks...)
}

// A relay round that starts while the mark of an effect this process just sent is still being
// written does not send it again.
func TestRelaySkipsEffectsWhoseMarkIsInFlight(t *testing.T) {
	release := make(chan struct{})
	e := newEnv(t, func(c *outbox.Config) {
		c.Driver = slowMarks{Driver: postgres.Driver{}, release: release}
		c.RelayGrace = 10 * time.Millisecond
		c.RelayInterval = 10 * time.Millisecond
	})
	ctx := context.Background()
	var id string
	if err := e.ob.InTx(ctx, func(ctx context.Context, tx *sql.Tx) error {
		m := message.NewMessage(uuid.NewString(), nil)
		id = m.UUID
		return outbox.Publish(ctx, "out_a", m)
	}); err != nil {
		t.Fatal(err)
	}
	stop := startRun(t, e.ob)
	time.Sleep(300 * time.Millisecond) // thirty relay rounds, the effect long past RelayGrace
	close(release)
	stop()
	e.ob.FlushMarks()
	mustEqual(t, "copies on the wire", e.wire("out_a")[id], 1)
	mustEqual(t, "pending effects", e.pendingEffects(), 0)
}

// A handler whose error wraps a framework error of its own calls (ErrDispatchFailed from another
// Outbox's Handle, ErrDatabaseUnreachable from another database's InTx) is a failed handler: its
// unit rolled back. With DispatchFailureAck the first was acked as committed (lost); the second
// skipped the backoff, and the broker's redeliveries used MaxAttempts up in a burst.
func TestHandlerErrorWrappingFrameworkErrorsIsAFailure(t *testing.T) {
	const delay = 300 * time.Millisecond
	e := newEnv(t, func(c *outbox.Config) { c.AfterDispatchFailure = outbox.DispatchFailureAck; c.RetryDelay = delay })
	for _, sentinel := range []error{outbox.ErrDispatchFailed, outbox.ErrDatabaseUnreachable} {
		msg := message.NewMessage(uuid.NewString(), nil)
		began := time.Now()
		err := handle(e.ob, msg, func(m *message.Message) ([]*message.Message, error) {
			if _, err := applyAndPublish(nil)(m); err != nil {
				return nil, err
			}
			return nil, fmt.Errorf("the inventory service's outbox said: %w", sentinel)
		})
		if err == nil {
			t.Errorf("%v: the rolled-back message was acked", sentinel)
		}
		if took := time.Since(began); took < delay {
			t.Errorf("%v: nacked after %s, without the backoff (RetryDelay %s)", sentinel, took, delay)
		}
		mustEqual(t, fmt.Sprint(sentinel, ": attempts counted"), e.count(`SELECT coalesce(max(attempts), 0) FROM outbox_attempts WHERE message_id = $1`, msg.UUID), 1)
	}
	mustEqual(t, "business rows", e.count(`SELECT count(*) FROM applied`), 0)
}
