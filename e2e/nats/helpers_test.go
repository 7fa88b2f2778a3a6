package nats_test

import (
	"context"
	"database/sql"
	"os"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/watermill-outbox/outbox"
	"github.com/watermill-outbox/outbox/drivers/postgres"
	"github.com/watermill-outbox/outbox/internal/pgtest"
)

func TestMain(m *testing.M) { os.Exit(pgtest.Run(m)) }

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
		SELECT source_consumer, source_id, topic, uuid FROM outbox_effects_all
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
	pgtest.CheckEffectsParent(e.t, query)
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
	return e.count(`SELECT count(*) FROM outbox_effects_all WHERE dispatched_at IS NULL`)
}

type publisherFunc func(topic string, msgs ...*message.Message) error

func (f publisherFunc) Publish(topic string, msgs ...*message.Message) error {
	return f(topic, msgs...)
}
func (f publisherFunc) Close() error { return nil }
