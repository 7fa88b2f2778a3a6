// Package routertest has what the end-to-end tests of the root module and of the e2e module share:
// Routers and Outboxes that live exactly as long as the test, a producer of messages with
// duplicates, and the polling and counting the invariants are checked with.
package routertest

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"math/rand/v2"
	"sort"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"

	"github.com/watermill-outbox/outbox"
	"github.com/watermill-outbox/outbox/internal/logtest"
)

// Timeout bounds every wait of the end-to-end tests.
const Timeout = 60 * time.Second

// ErrInjected is the failure the flaky handlers return after their business write.
var ErrInjected = errors.New("injected failure after the business write")

// ReserveStock is the end-to-end tests' consumer: it writes a row of the message into reserved
// (message_id, instance) through the unit of work's transaction and records one message to topic;
// when flaky, it then fails failPercent of the time with ErrInjected. calls and injected count
// its runs and its injected failures.
func ReserveStock(instance, topic string, flaky bool, failPercent int, calls, injected *atomic.Int32) message.NoPublishHandlerFunc {
	return func(msg *message.Message) error {
		calls.Add(1)
		ctx := msg.Context()
		if _, err := outbox.Tx(ctx).ExecContext(ctx, `INSERT INTO reserved (message_id, instance) VALUES ($1, $2)`, msg.UUID, instance); err != nil {
			return err
		}
		payload := []byte(fmt.Sprintf(`{"order":%q}`, msg.UUID))
		if err := outbox.Publish(ctx, topic, message.NewMessage(uuid.NewString(), payload)); err != nil {
			return err
		}
		if flaky && rand.IntN(100) < failPercent {
			injected.Add(1)
			return ErrInjected
		}
		return nil
	}
}

// MustEqual fails the test at once when got is not want.
func MustEqual[T comparable](t testing.TB, what string, got, want T) {
	t.Helper()
	if got != want {
		t.Fatalf("%s: got %v, want %v", what, got, want)
	}
}

// CountMissing returns how many of ids the query (one text column) does not return.
func CountMissing(t testing.TB, db *sql.DB, query string, ids []string) int {
	t.Helper()
	rows, err := db.Query(query)
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	have := map[string]bool{}
	for rows.Next() {
		var s string
		if err := rows.Scan(&s); err != nil {
			t.Fatal(err)
		}
		have[s] = true
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	missing := 0
	for _, id := range ids {
		if !have[id] {
			missing++
		}
	}
	return missing
}

// Keys returns the keys of m, in no order.
func Keys[V any](m map[string]V) []string {
	out := make([]string, 0, len(m))
	for k := range m {
		out = append(out, k)
	}
	return out
}

// WaitUntil polls cond until it holds, failing after Timeout with the last state it described.
func WaitUntil(t testing.TB, what string, cond func() (bool, string)) {
	t.Helper()
	deadline := time.Now().Add(Timeout)
	for {
		ok, state := cond()
		if ok {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %s waiting for %s; last state: %s", Timeout, what, state)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// NewRouter returns a Router that logs to logger.
func NewRouter(t testing.TB, logger watermill.LoggerAdapter) *message.Router {
	t.Helper()
	r, err := message.NewRouter(message.RouterConfig{CloseTimeout: 30 * time.Second}, logger)
	if err != nil {
		t.Fatal(err)
	}
	return r
}

// RunRouter runs r until the test ends and then closes it, waiting for Run to return, so that no
// handler or subscriber goroutine outlives the test (and its database).
func RunRouter(t testing.TB, r *message.Router) {
	t.Helper()
	done := make(chan error, 1)
	go func() { done <- r.Run(context.Background()) }()
	t.Cleanup(func() {
		if err := r.Close(); err != nil {
			t.Errorf("close router: %v", err)
		}
		select {
		case err := <-done:
			if err != nil {
				t.Errorf("router: %v", err)
			}
		case <-time.After(Timeout):
			t.Errorf("router did not stop within %s", Timeout)
		}
	})
	select {
	case <-r.Running():
	case err := <-done:
		t.Fatalf("router stopped before running: %v", err)
	case <-time.After(Timeout):
		t.Fatalf("router not running after %s", Timeout)
	}
}

// RunOutbox runs the Outbox's background work until the test ends.
func RunOutbox(t testing.TB, ob *outbox.Outbox) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		if err := ob.Run(ctx); err != nil {
			t.Errorf("outbox run: %v", err)
		}
	}()
	t.Cleanup(func() {
		cancel()
		<-done
	})
}

// Produce publishes n messages, and dupPercent of them a second time with the same UUID and
// payload a few positions later. It returns the UUIDs of the n distinct messages.
func Produce(t testing.TB, n, dupPercent int, publish func(*message.Message) error) []string {
	t.Helper()
	type send struct {
		at float64
		i  int
	}
	ids := make([]string, n)
	sends := make([]send, 0, n+n*dupPercent/100)
	for i := range ids {
		ids[i] = uuid.NewString()
		sends = append(sends, send{at: float64(i), i: i})
	}
	for _, i := range rand.Perm(n)[:n*dupPercent/100] {
		sends = append(sends, send{at: float64(i) + 0.5 + 10*rand.Float64(), i: i})
	}
	sort.Slice(sends, func(a, b int) bool { return sends[a].at < sends[b].at })
	for _, s := range sends {
		m := message.NewMessage(ids[s.i], []byte(fmt.Sprintf(`{"n":%d}`, s.i)))
		if err := publish(m); err != nil {
			t.Fatalf("produce message %d: %v", s.i, err)
		}
	}
	return ids
}

// WithLogger sets the Outbox's logger.
func WithLogger(l watermill.LoggerAdapter) func(*outbox.Config) {
	return func(c *outbox.Config) { c.Logger = l }
}

// Unexpected returns the errors l kept that are not the injected handler failures.
func Unexpected(l *logtest.Errors) []string {
	var out []string
	for _, e := range l.Lines() {
		if !strings.Contains(e, ErrInjected.Error()) {
			out = append(out, e)
		}
	}
	return out
}
