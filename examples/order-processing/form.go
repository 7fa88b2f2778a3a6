package main

import (
	"context"
	"database/sql"
	"database/sql/driver"
	"errors"
	"fmt"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"

	"github.com/watermill-outbox/outbox"
	"github.com/watermill-outbox/outbox/drivers/outboxpgx"
)

// The service runs on either form of the framework (-form): database/sql (lib/pq, or SQLite) or
// pgx (a pgxpool.Pool and drivers/outboxpgx, the faster one on PostgreSQL: docs/pgx.md). A real
// service uses one, and writes through its transaction type directly:
//
//	database/sql: outbox.Tx(ctx).ExecContext(ctx, ...)   ob.InTx(ctx, func(ctx context.Context, tx *sql.Tx) error {...})
//	pgx:          outboxpgx.Tx(ctx).Exec(ctx, ...)       outboxpgx.InTx(ctx, ob, func(ctx context.Context, tx pgx.Tx) error {...})
//
// This example runs on both, so its handlers go through unitTx, which is either of them; copy the
// line of the form you use instead. Everything else (outbox.Publish, outbox.Record,
// middleware.New, the relay, the console) is the same for both.

// Forms of the framework (-form).
const (
	formSQL = "sql"
	formPgx = "pgx"
)

// unitTx is the unit of work's transaction, in either form, as the handlers use it.
type unitTx interface {
	ExecContext(ctx context.Context, query string, args ...any) (sql.Result, error)
	QueryRowContext(ctx context.Context, query string, args ...any) rowScanner
}

type rowScanner interface{ Scan(dest ...any) error }

// txOf returns the transaction of the unit of work in ctx: a message's (in a handler wrapped by
// the middleware) or a boundary call's (inUnit).
func txOf(ctx context.Context) unitTx {
	if tx, ok := outbox.TxOK(ctx); ok {
		return sqlTx{tx}
	}
	if tx, ok := outboxpgx.TxOK(ctx); ok {
		return pgxTx{tx}
	}
	// As outbox.Tx does: a handler that is not wrapped by the middleware is a wiring mistake.
	t, _ := outbox.TxOf(ctx)
	panic(fmt.Sprintf("order-processing: no unit of work in the context (transaction %T): is the handler wrapped by middleware.New?", t))
}

// inUnit runs fn in a new unit of work of ob at the boundary (outbox.InUnit: ob.InTx or
// outboxpgx.InTx, whichever the form).
func inUnit(ctx context.Context, ob *outbox.Outbox, fn func(ctx context.Context, tx unitTx) error) error {
	return ob.InUnit(ctx, func(ctx context.Context) error { return fn(ctx, txOf(ctx)) })
}

type sqlTx struct{ tx *sql.Tx }

func (t sqlTx) ExecContext(ctx context.Context, query string, args ...any) (sql.Result, error) {
	return t.tx.ExecContext(ctx, query, args...)
}

func (t sqlTx) QueryRowContext(ctx context.Context, query string, args ...any) rowScanner {
	return t.tx.QueryRowContext(ctx, query, args...)
}

type pgxTx struct{ tx pgx.Tx }

func (t pgxTx) ExecContext(ctx context.Context, query string, args ...any) (sql.Result, error) {
	tag, err := t.tx.Exec(ctx, query, args...)
	if err != nil {
		return nil, err
	}
	return driver.RowsAffected(tag.RowsAffected()), nil
}

func (t pgxTx) QueryRowContext(ctx context.Context, query string, args ...any) rowScanner {
	return pgxRow{t.tx.QueryRow(ctx, query, args...)}
}

// pgxRow answers sql.ErrNoRows where pgx answers pgx.ErrNoRows, so that the handlers test one.
type pgxRow struct{ row pgx.Row }

func (r pgxRow) Scan(dest ...any) error {
	err := r.row.Scan(dest...)
	if errors.Is(err, pgx.ErrNoRows) {
		return fmt.Errorf("%w (%w)", sql.ErrNoRows, err)
	}
	return err
}

// openPgx opens the pgx form's pool on dsn and a database/sql handle on the same pool, for what
// runs outside a unit of work (the schema, the API's reads, the reconciliation).
func openPgx(ctx context.Context, dsn string) (*pgxpool.Pool, *sql.DB, error) {
	cfg, err := pgxpool.ParseConfig(dsn)
	if err != nil {
		return nil, nil, fmt.Errorf("pgx: %w", err)
	}
	// As the database/sql form's SetMaxOpenConns(32) (store.go).
	cfg.MaxConns = 32
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return nil, nil, fmt.Errorf("pgx: %w", err)
	}
	return pool, stdlib.OpenDBFromPool(pool), nil
}

// newOutboxOn returns an Outbox of cfg in the service's form: on the pgx pool (outboxpgx.New sets
// cfg.DB and cfg.Driver from it) or on cfg.DB with cfg.Driver.
func (s *service) newOutboxOn(cfg outbox.Config) (*outbox.Outbox, error) {
	if s.pool == nil {
		return outbox.New(cfg)
	}
	cfg.DB, cfg.Driver = nil, nil
	return outboxpgx.New(s.pool, cfg)
}

// outboxPublisher is an Outbox's publisher whose Close also closes the Outbox: in the pgx form the
// Outbox holds a database/sql handle on the pool (outboxpgx.New opens it), which Outbox.Close
// releases; in the database/sql form it releases the store's prepared statements.
type outboxPublisher struct {
	message.Publisher
	ob *outbox.Outbox
}

func (p *outboxPublisher) Close() error {
	return errors.Join(p.ob.Close(), p.Publisher.Close())
}
