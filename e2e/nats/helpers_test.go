package nats_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"

	"github.com/watermill-outbox/outbox"
	"github.com/watermill-outbox/outbox/drivers/postgres"
	"github.com/watermill-outbox/outbox/internal/pgtest"
)

func TestMain(m *testing.M) { os.Exit(pgtest.Run(m)) }

// e2eTimeout bounds every wait of the end-to-end tests.
const e2eTimeout = 60 * time.Second

// errInjected is the failure the flaky handlers return after their business write.
var errInjected = errors.New("injected failure after the business write")

// env is a test database with the outbox tables, and the Outboxes made on it.
type env struct {
	t   *testing.T
	db  *sql.DB
	obs []*outbox.Outbox
}

func newEnv(t *testing.T) *env {
	t.Helper()
	e := &env{t: t, db: pgtest.DB(t)}
	if err := e.newOutbox().Migrate(context.Background()); err != nil {
		t.Fatal(err)
	}
	// Every effect row, pending or dispatched and kept for EffectRetention.
	if _, err := e.db.Exec(`CREATE VIEW all_effects AS
		SELECT source_consumer, source_id, topic, uuid FROM outbox_effects
		UNION ALL SELECT source_consumer, source_id, topic, uuid FROM outbox_dispatched`); err != nil {
		t.Fatal(err)
	}
	return e
}

// newOutbox returns an Outbox on the test database that keeps dispatched effects for reading.
func (e *env) newOutbox(mutate ...func(*outbox.Config)) *outbox.Outbox {
	e.t.Helper()
	cfg := outbox.Config{DB: e.db, Driver: postgres.Driver{}, Publisher: publisherFunc(func(string, ...*message.Message) error { return nil }),
		Logger: watermill.NopLogger{}, EffectRetention: time.Hour}
	for _, m := range mutate {
		m(&cfg)
	}
	ob, err := outbox.New(cfg)
	if err != nil {
		e.t.Fatal(err)
	}
	e.obs = append(e.obs, ob)
	return ob
}

// count runs a counting query after the Outboxes wrote their queued marks.
func (e *env) count(query string, args ...any) int {
	e.t.Helper()
	for _, ob := range e.obs {
		ob.FlushMarks()
	}
	var n int
	if err := e.db.QueryRow(query, args...).Scan(&n); err != nil {
		e.t.Fatal(err)
	}
	return n
}

func (e *env) pendingEffects() int {
	return e.count(`SELECT count(*) FROM outbox_effects WHERE dispatched_at IS NULL`)
}

func mustEqual[T comparable](t testing.TB, what string, got, want T) {
	t.Helper()
	if got != want {
		t.Fatalf("%s: got %v, want %v", what, got, want)
	}
}

type publisherFunc func(topic string, msgs ...*message.Message) error

func (f publisherFunc) Publish(topic string, msgs ...*message.Message) error {
	return f(topic, msgs...)
}
func (f publisherFunc) Close() error { return nil }

// countMissing returns how many of ids the query (one text column) does not return.
func countMissing(db *sql.DB, t *testing.T, query string, ids []string) int {
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

func keys[V any](m map[string]V) []string {
	out := make([]string, 0, len(m))
	for k := range m {
		out = append(out, k)
	}
	return out
}

// waitUntil polls cond until it holds, failing after e2eTimeout with the last state it described.
func waitUntil(t *testing.T, what string, cond func() (bool, string)) {
	t.Helper()
	deadline := time.Now().Add(e2eTimeout)
	for {
		ok, state := cond()
		if ok {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %s waiting for %s; last state: %s", e2eTimeout, what, state)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func newRouter(t *testing.T, logger watermill.LoggerAdapter) *message.Router {
	t.Helper()
	r, err := message.NewRouter(message.RouterConfig{CloseTimeout: 30 * time.Second}, logger)
	if err != nil {
		t.Fatal(err)
	}
	return r
}

// runRouter runs r until the test ends and then closes it, waiting for Run to return, so that no
// handler or subscriber goroutine outlives the test (and its database).
func runRouter(t testing.TB, r *message.Router) {
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
		case <-time.After(e2eTimeout):
			t.Errorf("router did not stop within %s", e2eTimeout)
		}
	})
	select {
	case <-r.Running():
	case err := <-done:
		t.Fatalf("router stopped before running: %v", err)
	case <-time.After(e2eTimeout):
		t.Fatalf("router not running after %s", e2eTimeout)
	}
}

// produce publishes n messages, and dupPercent of them a second time with the same UUID and
// payload a few positions later. It returns the UUIDs of the n distinct messages.
func produce(t *testing.T, n, dupPercent int, publish func(*message.Message) error) []string {
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

// runOutbox runs the Outbox's background work until the test ends.
func runOutbox(t testing.TB, ob *outbox.Outbox) {
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

// errorLog is a watermill logger that keeps the errors logged, to report the unexpected ones.
type errorLog struct {
	mu     sync.Mutex
	errors []string
}

func (l *errorLog) Error(msg string, err error, fields watermill.LogFields) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.errors = append(l.errors, fmt.Sprintf("%s: %v %v", msg, err, fields))
}

// unexpected returns the logged errors that are not the injected handler failures.
func (l *errorLog) unexpected() []string {
	l.mu.Lock()
	defer l.mu.Unlock()
	var out []string
	for _, e := range l.errors {
		if !strings.Contains(e, errInjected.Error()) {
			out = append(out, e)
		}
	}
	return out
}

func (l *errorLog) summary() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return fmt.Sprintf("%d errors logged by the Routers", len(l.errors))
}

func withLogger(l watermill.LoggerAdapter) func(*outbox.Config) {
	return func(c *outbox.Config) { c.Logger = l }
}

func (l *errorLog) Info(string, watermill.LogFields)                 {}
func (l *errorLog) Debug(string, watermill.LogFields)                {}
func (l *errorLog) Trace(string, watermill.LogFields)                {}
func (l *errorLog) With(watermill.LogFields) watermill.LoggerAdapter { return l }
