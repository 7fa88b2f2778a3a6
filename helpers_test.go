package outbox_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"os"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wsql "github.com/ThreeDotsLabs/watermill-sql/v3/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"

	"github.com/watermill-outbox/outbox"
	"github.com/watermill-outbox/outbox/drivers/postgres"
	"github.com/watermill-outbox/outbox/internal/pgtest"
)

func TestMain(m *testing.M) { os.Exit(pgtest.Run(m)) }

// brokerSchema stores payloads as BYTEA so that arbitrary bytes survive the broker.
func brokerSchema() wsql.DefaultPostgreSQLSchema {
	return wsql.DefaultPostgreSQLSchema{GeneratePayloadType: func(string) string { return "BYTEA" }}
}

// env is one test's database, broker and outbox.
type env struct {
	t   testing.TB
	db  *sql.DB
	dsn string
	pub *faultyPublisher
	ob  *outbox.Outbox
	obs []*outbox.Outbox // every Outbox of the test, to flush their background marks
}

// flush waits for the background dispatched marks of every Outbox of the test, so that what the
// test reads from the tables is settled.
func (e *env) flush() {
	for _, ob := range e.obs {
		ob.FlushMarks()
	}
}

// faultyPublisher forwards to the real watermill-sql publisher, failing or hanging on demand.
type faultyPublisher struct {
	next    message.Publisher
	fail    atomic.Int32 // fail this many calls
	failAll atomic.Bool
	hang    chan struct{} // when non-nil, Publish blocks until it is closed
	refuse  string        // a topic whose messages are refused (set before use)
	mu      sync.Mutex
	calls   int
}

func (p *faultyPublisher) Publish(topic string, msgs ...*message.Message) error {
	p.mu.Lock()
	p.calls++
	hang := p.hang
	p.mu.Unlock()
	if hang != nil {
		<-hang
		return errors.New("broker hung")
	}
	if p.failAll.Load() {
		return errors.New("broker rejected the message")
	}
	if topic == p.refuse {
		return errors.New("broker refused the message: schema mismatch")
	}
	if p.fail.Add(-1) >= 0 {
		return errors.New("broker unavailable")
	}
	p.fail.Store(0)
	return p.next.Publish(topic, msgs...)
}

func (p *faultyPublisher) Close() error { return nil }

func newEnv(t testing.TB, mutate ...func(*outbox.Config)) *env {
	t.Helper()
	dsn := pgtest.DSN(t)
	db, err := sql.Open("postgres", dsn)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = db.Close() })
	real, err := wsql.NewPublisher(db, wsql.PublisherConfig{SchemaAdapter: brokerSchema(), AutoInitializeSchema: true}, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	e := &env{t: t, db: db, dsn: dsn, pub: &faultyPublisher{next: real}}
	e.ob = e.newOutbox(mutate...)
	if err := e.ob.Migrate(context.Background()); err != nil {
		t.Fatal(err)
	}
	if _, err := db.Exec(`CREATE TABLE applied (message_id text NOT NULL, note text)`); err != nil {
		t.Fatal(err)
	}
	// Every effect row, pending (outbox_effects_all) or dispatched and kept for EffectRetention
	// (outbox_dispatched), for the tests that read what was committed.
	if _, err := db.Exec(`CREATE VIEW all_effects AS
		SELECT id, source_consumer, source_id, seq, kind, topic, uuid, payload, metadata, ordering_key, created_at,
			dispatched_at, attempts, failures, last_error, next_attempt_at, parked_at FROM outbox_effects_all
		UNION ALL
		SELECT id, source_consumer, source_id, seq, kind, topic, uuid, payload, metadata, ordering_key, created_at,
			dispatched_at, attempts, failures, last_error, NULL, NULL FROM outbox_dispatched`); err != nil {
		t.Fatal(err)
	}
	// Concurrent publishers race on watermill-sql's own CREATE TABLE: create the topics up front.
	e.initTopics("out_a", "out_b", "replies", "poison")
	return e
}

func (e *env) initTopics(topics ...string) {
	e.t.Helper()
	for _, topic := range topics {
		for _, q := range brokerSchema().SchemaInitializingQueries(topic) {
			if _, err := e.db.Exec(q.Query, q.Args...); err != nil {
				e.t.Fatal(err)
			}
		}
	}
}

// newOutbox returns another Outbox on the same database, as a second process would have.
func (e *env) newOutbox(mutate ...func(*outbox.Config)) *outbox.Outbox {
	e.t.Helper()
	// Keep dispatched effects, so that tests can read what was committed; TestDispatchedEffectsAreDeleted
	// covers the default, deleting them at dispatch.
	cfg := outbox.Config{DB: e.db, Driver: postgres.Driver{}, Publisher: e.pub, Logger: watermill.NopLogger{}, EffectRetention: time.Hour}
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

func (e *env) count(query string, args ...any) int {
	e.t.Helper()
	pgtest.CheckEffectsParent(e.t, query)
	e.flush()
	var n int
	if err := e.db.QueryRow(query, args...).Scan(&n); err != nil {
		e.t.Fatalf("%s: %v", query, err)
	}
	return n
}

// wire returns how many copies of each UUID reached the broker topic.
func (e *env) wire(topic string) map[string]int {
	e.t.Helper()
	out := map[string]int{}
	rows, err := e.db.Query(`SELECT uuid FROM "watermill_` + topic + `"`)
	if err != nil {
		var s interface{ SQLState() string }
		if errors.As(err, &s) && s.SQLState() == "42P01" {
			return out // nothing was ever published to topic
		}
		e.t.Fatal(err)
	}
	defer rows.Close()
	for rows.Next() {
		var id string
		if err := rows.Scan(&id); err != nil {
			e.t.Fatal(err)
		}
		out[id]++
	}
	return out
}

// storedEffects returns the UUIDs of the committed effects of a message, in order.
func (e *env) storedEffects(consumer, id string) []string {
	e.t.Helper()
	return e.strings(`SELECT uuid FROM all_effects WHERE source_consumer = $1 AND source_id = $2 ORDER BY seq`, consumer, id)
}

// strings returns the one text column of the rows of query.
func (e *env) strings(query string, args ...any) []string {
	e.t.Helper()
	pgtest.CheckEffectsParent(e.t, query)
	rows, err := e.db.Query(query, args...)
	if err != nil {
		e.t.Fatal(err)
	}
	defer rows.Close()
	var out []string
	for rows.Next() {
		var s string
		if err := rows.Scan(&s); err != nil {
			e.t.Fatal(err)
		}
		out = append(out, s)
	}
	if err := rows.Err(); err != nil {
		e.t.Fatal(err)
	}
	return out
}

func (e *env) pendingEffects() int {
	return e.count(`SELECT count(*) FROM outbox_effects_all WHERE dispatched_at IS NULL`)
}

// applyAndPublish is the handler of most tests: one business write and two side effects.
func applyAndPublish(calls *atomic.Int32) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		if calls != nil {
			calls.Add(1)
		}
		ctx := msg.Context()
		if _, err := outbox.Tx(ctx).ExecContext(ctx, `INSERT INTO applied (message_id) VALUES ($1)`, msg.UUID); err != nil {
			return nil, err
		}
		if err := outbox.Publish(ctx, "out_a", message.NewMessage(uuid.NewString(), []byte(`{"step":1}`))); err != nil {
			return nil, err
		}
		return nil, outbox.Publish(ctx, "out_b", message.NewMessage(uuid.NewString(), []byte(`{"step":2}`)))
	}
}

func handle(ob *outbox.Outbox, msg *message.Message, h message.HandlerFunc) error {
	return ob.Handle(msg, outbox.HandleParams{Consumer: "c1", MessageID: msg.UUID}, h)
}

// copyOf returns a redelivered copy of msg, as a broker would hand it over again.
func copyOf(msg *message.Message) *message.Message {
	c := msg.Copy()
	c.SetContext(context.Background())
	return c
}

func waitFor(t testing.TB, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func mustEqual[T comparable](t testing.TB, what string, got, want T) {
	t.Helper()
	if got != want {
		t.Fatalf("%s: got %v, want %v", what, got, want)
	}
}

var _ = fmt.Sprintf
