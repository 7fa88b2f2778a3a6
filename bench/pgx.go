package main

import (
	"context"
	"sync/atomic"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"

	"github.com/watermill-outbox/outbox"
	"github.com/watermill-outbox/outbox/drivers/outboxpgx"
	"github.com/watermill-outbox/outbox/middleware"
)

// --- pgx contenders -----------------------------------------------------------------------------

// openCountedPool opens a pgxpool whose connections are counted in c, as openCounted does for
// lib/pq: pgx writes from the calling goroutine too, so waited-for round trips are told alike.
func openCountedPool(dsn string, c *wireCounters, maxConns int32) (*pgxpool.Pool, error) {
	cfg, err := pgxpool.ParseConfig(dsn)
	if err != nil {
		return nil, err
	}
	cfg.MaxConns = maxConns
	cfg.ConnConfig.DialFunc = countingDialer{c: c}.DialContext
	return pgxpool.NewWithConfig(context.Background(), cfg)
}

func newPgxBase(e *env) (base, *pgxpool.Pool, error) { return newPgxBaseDSN(e, e.dsn, "") }

// newPgxBaseDSN is newPgxBase on dsn (the pooler's) with suffix after the contender's name.
func newPgxBaseDSN(e *env, dsn, suffix string) (base, *pgxpool.Pool, error) {
	wc := &wireCounters{}
	pool, err := openCountedPool(dsn, wc, 64)
	if err != nil {
		return base{}, nil, err
	}
	// base's *sql.DB (closed with it) is a database/sql view of the same pool.
	return base{e: e, db: stdlib.OpenDBFromPool(pool), wc: wc, crash: new(atomic.Pointer[string]), suffix: suffix}, pool, nil
}

// barePgx is bare on pgx: a plain pgx transaction (BEGIN, the write, COMMIT: a round trip each),
// publish after commit.
type barePgx struct {
	base
	pool *pgxpool.Pool
}

func newBarePgx(e *env) (contender, error) {
	b, pool, err := newPgxBase(e)
	return &barePgx{base: b, pool: pool}, err
}

func (c *barePgx) name() string       { return "bare-pgx" + c.suffix }
func (c *barePgx) path() string       { return "consumer" }
func (c *barePgx) safe() bool         { return false }
func (c *barePgx) crashPoint() string { return "after commit, before publish" }
func (c *barePgx) tables() []string   { return nil }
func (c *barePgx) close()             { c.base.close(); c.pool.Close() }

func (c *barePgx) handle(ctx context.Context, d delivery) (bool, error) {
	tx, err := c.pool.Begin(ctx)
	if err != nil {
		return false, err
	}
	if err := businessPgx(ctx, tx, d.id); err != nil {
		_ = tx.Rollback(ctx)
		if isUniqueViolation(err) {
			return false, nil // a redelivered copy whose reservation is committed: dropped
		}
		return false, err
	}
	if err := tx.Commit(ctx); err != nil {
		return false, err
	}
	if c.crashes(d.id) {
		return false, errCrash
	}
	return false, c.e.pub.Publish(outTopic, outgoing(d, uuid.NewString()))
}

// newFrameworkPgx is the framework's consumer path on pgx (outboxpgx.New, middleware.New, the
// handler writing through outboxpgx.Tx).
func newFrameworkPgx(e *env, prefix string, mode outboxpgx.Concurrency) (*framework, error) {
	return newFrameworkPgxDSN(e, prefix, mode, e.dsn, "")
}

// newFrameworkPgxDSN is newFrameworkPgx on dsn (the pooler's) with suffix after its name and
// more options (the pooled form's direct listener).
func newFrameworkPgxDSN(e *env, prefix string, mode outboxpgx.Concurrency, dsn, suffix string, opts ...outboxpgx.Option) (*framework, error) {
	b, pool, err := newPgxBaseDSN(e, dsn, suffix)
	if err != nil {
		return nil, err
	}
	_ = b.db.Close() // outboxpgx.New opens its own view of the pool
	c := &framework{base: b, prefix: prefix, pool: pool, pessimistic: mode == outboxpgx.Pessimistic}
	cfg := outbox.Config{
		Publisher:   e.pub,
		TablePrefix: prefix,
		RelayGrace:  e.relayGrace(),
		Failpoint:   c.failpoint,
	}
	if e.tune != nil {
		e.tune(&cfg)
	}
	c.ob, err = outboxpgx.New(pool, cfg, append([]outboxpgx.Option{outboxpgx.WithConcurrency(mode)}, opts...)...)
	if err != nil {
		pool.Close()
		return nil, err
	}
	c.db = c.ob.Config().DB
	if err := c.ob.Migrate(context.Background()); err != nil {
		return nil, err
	}
	c.h = middleware.New(c.ob, middleware.WithConsumer("bench"))(func(msg *message.Message) ([]*message.Message, error) {
		ctx := msg.Context()
		if err := businessPgx(ctx, outboxpgx.Tx(ctx), msg.UUID); err != nil {
			return nil, err
		}
		d := ctx.Value(deliveryKey{}).(delivery)
		return nil, outbox.Publish(ctx, outTopic, outgoing(d, uuid.NewString()))
	})
	return c, nil
}
