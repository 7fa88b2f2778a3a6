package main

import (
	"context"
	"errors"
	"sync"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/watermill-outbox/outbox"
	"github.com/watermill-outbox/outbox/drivers/outboxpgx"
	"github.com/watermill-outbox/outbox/drivers/postgres"
	"github.com/watermill-outbox/outbox/outboxdriver"
	"github.com/watermill-outbox/outbox/store"
)

// protocolPgx is the pgx form's protocol written out by hand, with nothing around it: the
// statements outbox-pgx sends for a message, on tables its migrations made (the same columns and
// indexes), from the thinnest client that sends them. BEGIN and the look-up of the claim in one
// round trip; the business write; the claim with its effect inline and COMMIT in one round trip;
// the publish, called in place; the mark, batched in the background (5 ms, as the framework's
// marker) with asynchronous commit. No relay, no sweep, no timeouts, no telemetry, no recovery
// of anything: it is not exactly-once when something fails (a crash after commit leaves the
// effect to a relay it does not have), so it runs in no safety check.
//
// protocol-pgx / bare-pgx is the most any implementation of these statements reaches on this
// machine; outbox-pgx / protocol-pgx is what the framework's client adds to them.
type protocolPgx struct {
	base
	pool  *pgxpool.Pool
	ob    *outbox.Outbox // its migrations made the tables; it is never run
	q     protocolQueries
	marks *protocolMarker
}

type protocolQueries struct{ lookup, claim, mark string }

const protocolPrefix = "proto_"

func newProtocolPgx(e *env) (contender, error) {
	b, pool, err := newPgxBase(e)
	if err != nil {
		return nil, err
	}
	_ = b.db.Close()
	ob, err := outboxpgx.New(pool, outbox.Config{Publisher: e.pub, TablePrefix: protocolPrefix})
	if err != nil {
		pool.Close()
		return nil, err
	}
	if err := ob.Migrate(context.Background()); err != nil {
		_ = ob.Close()
		pool.Close()
		return nil, err
	}
	b.db = ob.Config().DB
	n, err := postgres.NewNames("public", protocolPrefix)
	if err != nil {
		_ = ob.Close()
		pool.Close()
		return nil, err
	}
	t := n.Processed
	c := &protocolPgx{base: b, pool: pool, ob: ob, q: protocolQueries{
		// The framework's statements, as pg_stat_statements shows them (outboxpgx's look-up and
		// optimistic claim, the postgres driver's mark of inline effects).
		lookup: postgres.ClaimLookup(n),
		claim: `INSERT INTO ` + t + ` (consumer, message_id, processed_at, dispatched_at, effects, inline_xid)
			VALUES ($1, $2, clock_timestamp(), clock_timestamp(), $3::bytea,
				CASE WHEN $3::bytea IS NOT NULL THEN pg_current_xact_id()::text::bigint END)`,
		mark: postgres.InlineMark(n),
	}}
	c.marks = &protocolMarker{exec: func(ctx context.Context, ids []string) error {
		_, err := pool.Exec(ctx, c.q.mark, protocolConsumer, ids)
		return err
	}}
	return c, nil
}

func (c *protocolPgx) name() string       { return "protocol-pgx" }
func (c *protocolPgx) path() string       { return "ceiling" }
func (c *protocolPgx) safe() bool         { return false }
func (c *protocolPgx) crashPoint() string { return "" }
func (c *protocolPgx) tables() []string {
	return []string{protocolPrefix + "processed", protocolPrefix + "effects"}
}
func (c *protocolPgx) stop() error { c.marks.wait(); return nil }
func (c *protocolPgx) close() {
	c.marks.wait()
	_ = c.ob.Close()
	c.base.close()
	c.pool.Close()
}

const protocolConsumer = "bench"

func (c *protocolPgx) handle(ctx context.Context, d delivery) (bool, error) {
	conn, err := c.pool.Acquire(ctx)
	if err != nil {
		return false, err
	}
	defer conn.Release()
	b := &pgx.Batch{}
	b.BeginTx(pgx.TxOptions{})
	b.Queue(c.q.lookup, protocolConsumer, d.id)
	br := conn.SendBatch(ctx, b)
	_, err = br.Exec()
	var ms int64
	var settled *bool
	seen := false
	if err == nil {
		switch err = br.QueryRow().Scan(&ms, &settled); {
		case errors.Is(err, pgx.ErrNoRows):
			err = nil
		case err == nil:
			seen = true
		}
	}
	tx := br.Tx()
	if cerr := br.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		_ = tx.Rollback(ctx)
		return false, err
	}
	if seen {
		// A copy: its effect went out with the first delivery and was marked (settled), as the
		// benchmark's copies come after their original; the framework would read what is pending
		// otherwise.
		return false, tx.Rollback(ctx)
	}
	if err := businessPgx(ctx, tx, d.id); err != nil {
		_ = tx.Rollback(ctx)
		if isUniqueViolation(err) {
			return false, nil // a copy whose original committed meanwhile (the two-statement workload's key)
		}
		return false, err
	}
	m := outgoing(d, uuid.NewString())
	effect := outboxdriver.Effect{Kind: outboxdriver.KindPublish, Topic: outTopic, UUID: m.UUID, Payload: m.Payload,
		Metadata: m.Metadata, OrderingKey: d.id}
	cb := &pgx.Batch{}
	cb.Queue(c.q.claim, protocolConsumer, d.id, store.EncodeEffects([]outboxdriver.Effect{effect}))
	cb.Queue("COMMIT")
	cr := conn.SendBatch(ctx, cb)
	_, err = cr.Exec()
	if err == nil {
		_, err = cr.Exec()
	}
	if cerr := cr.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		_ = tx.Rollback(ctx)
		if isUniqueViolation(err) {
			return false, nil // a copy whose original committed its claim first
		}
		return false, err
	}
	if err := c.e.pub.Publish(outTopic, m); err != nil {
		return false, err
	}
	c.marks.add(d.id)
	return false, nil
}

// protocolMarker writes the marks of a protocol contender in batches, as the framework's marker
// does: a worker that lets marks gather for 5 ms, writes them in one statement (exec), and exits
// when none came.
type protocolMarker struct {
	exec    func(ctx context.Context, ids []string) error
	mu      sync.Mutex
	queue   []string
	running bool
	idle    sync.WaitGroup
}

func (m *protocolMarker) add(id string) {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.queue = append(m.queue, id)
	if !m.running {
		m.running = true
		m.idle.Add(1)
		go m.work()
	}
}

func (m *protocolMarker) work() {
	defer m.idle.Done()
	for {
		time.Sleep(5 * time.Millisecond)
		m.mu.Lock()
		batch := m.queue
		m.queue = nil
		if len(batch) == 0 {
			m.running = false
			m.mu.Unlock()
			return
		}
		m.mu.Unlock()
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		_ = m.exec(ctx, batch)
		cancel()
	}
}

// wait returns once the marks queued so far are written.
func (m *protocolMarker) wait() { m.idle.Wait() }
