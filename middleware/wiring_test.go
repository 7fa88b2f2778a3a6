package middleware_test

import (
	"context"
	"errors"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	wmw "github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/google/uuid"

	"github.com/watermill-outbox/outbox"
	"github.com/watermill-outbox/outbox/drivers/postgres"
	"github.com/watermill-outbox/outbox/internal/logtest"
	"github.com/watermill-outbox/outbox/middleware"
)

// wiringHarness counts the handler's runs and the business rows it committed: each run inserts a
// row, and the first run of a message fails after its insert.
type wiringHarness struct {
	*harness
	runs atomic.Int32
}

func newWiringHarness(t *testing.T) *wiringHarness {
	t.Helper()
	h := &wiringHarness{harness: newHarness(t, "poison")}
	if _, err := h.db.Exec(`CREATE TABLE applied (id serial PRIMARY KEY, msg text NOT NULL)`); err != nil {
		t.Fatal(err)
	}
	return h
}

// handle inserts a business row; its first run fails after the insert.
func (h *wiringHarness) handle(msg *message.Message) ([]*message.Message, error) {
	ctx := msg.Context()
	if _, err := outbox.Tx(ctx).ExecContext(ctx, `INSERT INTO applied (msg) VALUES ($1)`, msg.UUID); err != nil {
		return nil, err
	}
	if h.runs.Add(1) == 1 {
		return nil, errors.New("the first run fails after its write")
	}
	return nil, nil
}

func (h *wiringHarness) applied(t *testing.T) int {
	t.Helper()
	var n int
	if err := h.db.QueryRow(`SELECT count(*) FROM applied`).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

// deliver calls the Router's chain for one fresh message, as the Router would.
func deliver(chain message.HandlerFunc) (*message.Message, error) {
	msg := message.NewMessage(uuid.NewString(), []byte("order"))
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	msg.SetContext(ctx)
	_, err := chain(msg)
	return msg, err
}

var noConsumerName = middleware.WithConsumer("orders")

// chain applies middleware to h as the Router does (the first outermost), through function
// values, so that nothing is inlined into the test.
func chain(h message.HandlerFunc, mws ...message.HandlerMiddleware) message.HandlerFunc {
	for i := len(mws) - 1; i >= 0; i-- {
		h = mws[i](h)
	}
	return h
}

// TestRetryInsideTheOutboxIsRefusedAtRunTime: Watermill's Retry directly inside the outbox
// middleware would run the handler again in the same transaction and commit the failed
// attempt's write with the successful one's. The middleware sees it as it runs and refuses the
// message; Wrap puts the outbox inside Retry, where each try is a whole unit of work.
func TestRetryInsideTheOutboxIsRefusedAtRunTime(t *testing.T) {
	retry := wmw.Retry{MaxRetries: 3, InitialInterval: time.Millisecond}.Middleware

	t.Run("inside", func(t *testing.T) {
		h := newWiringHarness(t)
		cfg := h.ob.Config()
		cfg.RetryDelay = -1 // the backoff of a wiring error is not what this test waits for
		ob, err := outbox.New(cfg)
		if err != nil {
			t.Fatal(err)
		}
		_, err = deliver(chain(h.handle, middleware.New(ob, noConsumerName), retry))
		if !errors.Is(err, outbox.ErrUnsafeMiddlewareOrder) {
			t.Fatalf("want ErrUnsafeMiddlewareOrder, got %v", err)
		}
		if !strings.Contains(err.Error(), "Retry") || !strings.Contains(err.Error(), "middleware.Wrap") {
			t.Fatalf("the error must name Retry and the fix: %v", err)
		}
		if runs, n := h.runs.Load(), h.applied(t); runs != 0 || n != 0 {
			t.Fatalf("refused wiring ran the handler %d times and committed %d rows", runs, n)
		}
		var attempts int
		if err := h.db.QueryRow(`SELECT count(*) FROM outbox_attempts`).Scan(&attempts); err != nil {
			t.Fatal(err)
		}
		if attempts != 0 {
			t.Fatalf("a wiring error was counted as a failed attempt of the message (%d rows)", attempts)
		}
	})
	t.Run("wrapped", func(t *testing.T) {
		h := newWiringHarness(t)
		if _, err := deliver(chain(middleware.Wrap(h.ob, h.handle, noConsumerName), retry)); err != nil {
			t.Fatal(err)
		}
		if runs, n := h.runs.Load(), h.applied(t); runs != 2 || n != 1 {
			t.Fatalf("Retry outside Wrap: %d runs, %d rows committed; want 2 runs and 1 row", runs, n)
		}
	})
}

// Duplicator directly inside the outbox middleware ran the handler twice in one transaction and
// committed its writes (and side effects) twice; IgnoreErrors inside committed what a failed
// attempt wrote when it ignored the error. Both are refused before the handler runs, and the
// wiring error is not counted against the message.
func TestDuplicatorAndIgnoreErrorsInsideAreRefused(t *testing.T) {
	failure := errors.New("the first run fails after its write")
	for name, mw := range map[string]message.HandlerMiddleware{
		"Duplicator":   wmw.Duplicator,
		"IgnoreErrors": wmw.NewIgnoreErrors([]error{failure}).Middleware,
	} {
		t.Run(name, func(t *testing.T) {
			h := newWiringHarness(t)
			cfg := h.ob.Config()
			cfg.RetryDelay = -1
			ob, err := outbox.New(cfg)
			if err != nil {
				t.Fatal(err)
			}
			_, err = deliver(chain(h.handle, middleware.New(ob, noConsumerName), mw))
			if !errors.Is(err, outbox.ErrUnsafeMiddlewareOrder) || !strings.Contains(err.Error(), name) {
				t.Fatalf("want ErrUnsafeMiddlewareOrder naming %s, got %v", name, err)
			}
			if runs, n := h.runs.Load(), h.applied(t); runs != 0 || n != 0 {
				t.Fatalf("refused wiring ran the handler %d times and committed %d rows", runs, n)
			}
		})
	}
}

// TestPoisonQueueInsideTheOutboxRollsBack: a PoisonQueue inside the outbox middleware, even behind
// another middleware where its name cannot be seen, turns the handler's failure into a success;
// committing would keep the failed attempt's write. The middleware notices the poisoned message
// and rolls the unit of work back.
func TestPoisonQueueInsideTheOutboxRollsBack(t *testing.T) {
	h := newWiringHarness(t)
	poison, err := wmw.PoisonQueue(h.pub, "poison")
	if err != nil {
		t.Fatal(err)
	}
	hidden := func(next message.HandlerFunc) message.HandlerFunc { // hides PoisonQueue's name
		return func(msg *message.Message) ([]*message.Message, error) { return next(msg) }
	}
	_, err = deliver(chain(h.handle, middleware.New(h.ob, noConsumerName), hidden, poison))
	if !errors.Is(err, outbox.ErrUnsafeMiddlewareOrder) {
		t.Fatalf("want ErrUnsafeMiddlewareOrder, got %v", err)
	}
	if n := h.applied(t); n != 0 {
		t.Fatalf("the poisoned attempt's write was committed (%d rows)", n)
	}

	// Directly inside, it is refused before the handler runs.
	h.runs.Store(0)
	_, err = deliver(chain(h.handle, middleware.New(h.ob, noConsumerName), poison))
	if !errors.Is(err, outbox.ErrUnsafeMiddlewareOrder) || h.runs.Load() != 0 {
		t.Fatalf("PoisonQueue directly inside: err %v after %d runs", err, h.runs.Load())
	}

	// A message that was poisoned before (replayed from the poison topic) is not mistaken for it.
	h.runs.Store(1) // the next run succeeds
	msg := message.NewMessage(uuid.NewString(), nil)
	msg.Metadata.Set("reason_poisoned", "an earlier failure")
	msg.SetContext(context.Background())
	if _, err := middleware.Wrap(h.ob, h.handle, noConsumerName)(msg); err != nil {
		t.Fatalf("a replayed poisoned message: %v", err)
	}
	if n := h.applied(t); n != 1 {
		t.Fatalf("the replayed message committed %d rows, want 1", n)
	}
}

// TestInstantAckOutsideIsLoggedOnce: a message acked before it reaches the outbox middleware
// cannot be refused (the broker already forgot it): it is handled, and the wiring named once.
func TestInstantAckOutsideIsLoggedOnce(t *testing.T) {
	h := newWiringHarness(t)
	h.runs.Store(1) // no failing first run
	logs := &logtest.Errors{}
	ob, err := outbox.New(outbox.Config{DB: h.db, Driver: postgres.Driver{}, Publisher: h.pub, Logger: logs})
	if err != nil {
		t.Fatal(err)
	}
	acking := chain(middleware.Wrap(ob, h.handle, noConsumerName), wmw.InstantAck)
	for range 2 {
		if _, err := deliver(acking); err != nil {
			t.Fatal(err)
		}
	}
	if n := h.applied(t); n != 2 {
		t.Fatalf("%d of 2 acked messages applied", n)
	}
	var named int
	for _, l := range logs.Lines() {
		if strings.Contains(l, "InstantAck") {
			named++
		}
	}
	if named != 1 {
		t.Fatalf("the early ack must be logged once, logged %d times: %q", named, logs.Lines())
	}

	// Directly inside, InstantAck is refused before it acks, whether the Router applied it or it
	// wraps the handler function in the caller's code (where the compiler inlines its closure).
	for name, c := range map[string]message.HandlerFunc{
		"applied": chain(h.handle, middleware.New(ob, noConsumerName), wmw.InstantAck),
		"inlined": middleware.New(ob, noConsumerName)(wmw.InstantAck(h.handle)),
	} {
		msg, err := deliver(c)
		if !errors.Is(err, outbox.ErrUnsafeMiddlewareOrder) {
			t.Fatalf("InstantAck directly inside (%s): %v", name, err)
		}
		select {
		case <-msg.Acked():
			t.Fatalf("InstantAck directly inside (%s) acked a refused message", name)
		default:
		}
	}
}

// TestWrapConsumer: WrapConsumer gives a consumer handler the unit of work, under the Router's
// handler name.
func TestWrapConsumer(t *testing.T) {
	h := newHarness(t, "in")
	m := message.NewMessage(uuid.NewString(), nil)
	h.publish(t, "in", m, m.Copy())
	h.route(t, "in", func(r *message.Router, sub func(string) message.Subscriber) {
		r.AddMiddleware(wmw.Retry{MaxRetries: 2, InitialInterval: time.Millisecond}.Middleware)
		r.AddConsumerHandler("reserve", "in", sub("g1"), middleware.WrapConsumer(h.ob, h.handler("reserve")))
	})
	if n := h.callCount("reserve"); n != 1 {
		t.Fatalf("the handler ran %d times for one message and its copy", n)
	}
	var claims int
	if err := h.db.QueryRow(`SELECT count(*) FROM outbox_processed WHERE consumer = 'reserve'`).Scan(&claims); err != nil {
		t.Fatal(err)
	}
	if claims != 1 {
		t.Fatalf("%d claims under the handler name", claims)
	}
}
