// Package outboxpgx runs the outbox framework on pgx v5: handlers write through a pgx.Tx (so
// sqlc's New(tx) works), and the relay, cleanup, the metrics' sampling and LISTEN run on the same
// pgxpool.Pool. It is a module of its own, so that users of the database/sql form never download
// pgx.
//
// A unit of work on pgx waits for as many round trips as a bare pgx transaction: BEGIN goes with
// the claim of the message in one round trip, the handler's statements run as they would anyway,
// and the side effects go with COMMIT in one round trip. The effects wait in memory until then:
// the handler's pgx.Tx is the framework's, which refuses Commit, so the handler cannot commit
// without them.
//
//	ob, err := outboxpgx.New(pool, outbox.Config{Publisher: pub})
//	if err != nil {
//		return err
//	}
//	router.AddConsumerHandler("reserve", "orders", sub, middleware.WrapConsumer(ob, func(msg *message.Message) error {
//		ctx := msg.Context()
//		tx := outboxpgx.Tx(ctx) // a pgx.Tx: queries.New(tx) with sqlc
//		if _, err := tx.Exec(ctx, `INSERT INTO reservations (order_id) VALUES ($1)`, msg.UUID); err != nil {
//			return err
//		}
//		return outbox.Publish(ctx, "reserved", message.NewMessage(watermill.NewUUID(), msg.Payload))
//	})) // the handler name, "reserve", is the consumer identity
//
// Savepoints: take them with tx.Begin (pgx's nested transactions): effects recorded inside one
// that is rolled back are dropped with it. Do not send SAVEPOINT, COMMIT or ROLLBACK as SQL.
package outboxpgx

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"io"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"

	"github.com/watermill-outbox/outbox"
	"github.com/watermill-outbox/outbox/drivers/postgres"
	"github.com/watermill-outbox/outbox/outboxdriver"
	"github.com/watermill-outbox/outbox/store"
)

// Concurrency is how a unit of work guards against a copy of its message processed at the same
// moment (see docs/pgx.md).
type Concurrency int

const (
	// Optimistic (the default) looks the claim up in the round trip of BEGIN, runs the handler,
	// and INSERTs the claim, with the side effects inline in it, in the round trip of COMMIT. A
	// copy processed at the same moment runs its handler too, then fails on the claim's unique
	// key and rolls back whole: the business change commits once. A later copy finds the claim
	// and never runs the handler. One row is written per message.
	Optimistic Concurrency = iota
	// Pessimistic INSERTs the claim in the round trip of BEGIN: a concurrent copy waits for it
	// and never runs its handler. The side effects are rows of their own, inserted in the round
	// trip of COMMIT. Pick it for handlers that are expensive to run twice, or when copies often
	// arrive together.
	Pessimistic
)

// Option changes the pgx driver's defaults (New).
type Option func(*Driver)

// WithConcurrency sets the concurrency mode (default Optimistic).
func WithConcurrency(c Concurrency) Option { return func(d *Driver) { d.Concurrency = c } }

// WithListenDSN sets Driver.ListenDSN: the relay LISTENs on a connection of its own dialed with
// dsn instead of one of the pool's (needed when the pool goes through a pooler in transaction
// mode).
func WithListenDSN(dsn string) Option { return func(d *Driver) { d.ListenDSN = dsn } }

// WithRotateEvery sets Driver.RotateEvery (postgres.Driver.RotateEvery: how often the relay
// rotates the partitions of the effects table).
func WithRotateEvery(every time.Duration) Option { return func(d *Driver) { d.RotateEvery = every } }

// New returns an Outbox on pool: cfg.DB and cfg.Driver are set from it (cfg.DB becomes a
// database/sql handle on the same pool, for the operator tools; leave both unset). Close the
// Outbox when done with it (the pool stays open).
func New(pool *pgxpool.Pool, cfg outbox.Config, opts ...Option) (*outbox.Outbox, error) {
	if pool == nil {
		return nil, fmt.Errorf("outboxpgx: the pool is nil")
	}
	if cfg.DB != nil || cfg.Driver != nil {
		return nil, fmt.Errorf("outboxpgx: leave Config.DB and Config.Driver unset: they are set from the pool")
	}
	d := Driver{Pool: pool, closeDB: true}
	for _, opt := range opts {
		opt(&d)
	}
	cfg.DB = stdlib.OpenDBFromPool(pool)
	cfg.Driver = d
	ob, err := outbox.New(cfg)
	if err != nil {
		_ = cfg.DB.Close()
	}
	return ob, err
}

// Driver is the pgx dialect: Config.Driver for an Outbox whose Config.DB is a database/sql handle
// on Pool (stdlib.OpenDBFromPool; New sets both).
type Driver struct {
	Pool        *pgxpool.Pool
	Concurrency Concurrency
	// ListenDSN, when set, is the connection string (pgx format) of the connection on which the
	// relay LISTENs for wake-ups, apart from the pool. Set it to reach PostgreSQL directly (or
	// through a pooler in session mode) when the pool goes through a pooler in transaction mode:
	// a LISTEN there succeeds, but its notifications never arrive. Default: "" (a connection
	// taken out of the pool).
	ListenDSN string
	// RotateEvery is postgres.Driver.RotateEvery: how long a partition of the effects table stays
	// the one new effects go to. Default 0: postgres.DefaultRotateEvery; negative: never rotates.
	RotateEvery time.Duration

	closeDB bool // the Store's Close closes the DB (New opened it)
}

var _ outboxdriver.Driver = Driver{}

// Open implements outboxdriver.Driver.
func (d Driver) Open(db *sql.DB, opts outboxdriver.StoreOptions) (outboxdriver.Store, error) {
	if d.Pool == nil {
		return nil, fmt.Errorf("outboxpgx: Driver.Pool is nil")
	}
	if d.Concurrency != Optimistic && d.Concurrency != Pessimistic {
		return nil, fmt.Errorf("outboxpgx: unknown Concurrency %d", d.Concurrency)
	}
	schema := opts.Schema
	if schema == "" {
		schema = postgres.DefaultSchema
	}
	names, err := postgres.NewNames(schema, opts.TablePrefix)
	if err != nil {
		return nil, err
	}
	// Everything off the hot path (the relay, marks, cleanup, stats, the operator tools) runs the
	// postgres driver's statements through database/sql on the same pool; pgx caches their
	// prepared statements per connection, so database/sql need not prepare them.
	base, err := postgres.Driver{DisablePreparedStatements: true, Listener: d.listen, RotateEvery: d.RotateEvery}.Open(db, opts)
	if err != nil {
		return nil, err
	}
	pg, ok := base.(postgresStore)
	if !ok {
		return nil, fmt.Errorf("outboxpgx: the postgres driver's Store (%T) does not handle inline effects", base)
	}
	// The effect inserts follow the partition that the base Store's relay rotates to.
	st := &pgxStore{postgresStore: pg, pool: d.Pool, names: names, optimistic: d.Concurrency == Optimistic,
		q: newQueries(names, opts.DeleteDispatched, pg.EffectsGeneration())}
	if d.closeDB {
		st.db = db
	}
	return st, nil
}

// postgresStore is the postgres driver's Store, which handles inline effects.
type postgresStore interface {
	outboxdriver.Store
	outboxdriver.InlineStore
	outboxdriver.DeadLetterStore
	outboxdriver.PoisonStore
	outboxdriver.TablesIdentifier
	EffectsGeneration() *postgres.Generation
}

// pgxStore is the postgres driver's Store whose units of work run on pgx, with their effects
// inline in the claim in the optimistic mode.
// PoolFull implements outboxdriver.PoolReporter: a unit slow to begin while the pool is full
// waits for a connection of it, not for the database.
func (s *pgxStore) PoolFull() bool {
	st := s.pool.Stat()
	return st.AcquiredConns()+st.ConstructingConns() >= st.MaxConns()
}

type pgxStore struct {
	postgresStore
	db         *sql.DB // closed with the Store, when New opened it
	pool       *pgxpool.Pool
	names      store.Names
	optimistic bool
	q          queries
	// watchDial is the framework's watch of a connection being opened (WatchDials); nil when
	// the Outbox has no gate.
	watchDial func() (end func())
}

// WatchDials implements outboxdriver.DialWatcher: pgx honours the context while it connects and
// on a pooled connection, so a unit needs no goroutine to leave a server that stalls; only the
// opening of a connection is watched, never a claim's wait for a copy's.
func (s *pgxStore) WatchDials(watch func() (end func())) { s.watchDial = watch }

// PoolIdentity implements outboxdriver.PoolIdentifier: the Outboxes of one pgxpool share their
// database gate.
func (s *pgxStore) PoolIdentity() any { return s.pool }

var (
	_ outboxdriver.UnitStore          = (*pgxStore)(nil)
	_ outboxdriver.InlineStore        = (*pgxStore)(nil)
	_ outboxdriver.ConfigRecorder     = (*pgxStore)(nil)
	_ outboxdriver.WritableChecker    = (*pgxStore)(nil)
	_ outboxdriver.DeadLetterStore    = (*pgxStore)(nil)
	_ outboxdriver.DeadLetterNowStore = (*pgxStore)(nil)
	_ outboxdriver.EffectRetrier      = (*pgxStore)(nil)
	_ outboxdriver.DialWatcher        = (*pgxStore)(nil)
)

// DeadLetterNow implements outboxdriver.DeadLetterNowStore through the postgres driver's store.
func (s *pgxStore) DeadLetterNow(ctx context.Context, src outboxdriver.Source, actor string) (bool, error) {
	if d, ok := s.postgresStore.(outboxdriver.DeadLetterNowStore); ok {
		return d.DeadLetterNow(ctx, src, actor)
	}
	return false, outboxdriver.ErrDeadLetterNowUnsupported
}

// DeadLetterRequested implements outboxdriver.DeadLetterNowStore through the postgres driver's
// store: the handler path of a pgx unit of work reads the requests as database/sql's does.
func (s *pgxStore) DeadLetterRequested(ctx context.Context, src outboxdriver.Source) (outboxdriver.DeadLetterRequest, error) {
	if d, ok := s.postgresStore.(outboxdriver.DeadLetterNowStore); ok {
		return d.DeadLetterRequested(ctx, src)
	}
	return outboxdriver.DeadLetterRequest{}, nil
}

// RecordServiceConfig implements outboxdriver.ConfigRecorder through the postgres driver's store.
func (s *pgxStore) RecordServiceConfig(ctx context.Context, c outboxdriver.ServiceConfig) error {
	if r, ok := s.postgresStore.(outboxdriver.ConfigRecorder); ok {
		return r.RecordServiceConfig(ctx, c)
	}
	return nil
}

// EffectRetryNow implements outboxdriver.EffectRetrier through the postgres driver's store.
func (s *pgxStore) EffectRetryNow(ctx context.Context, kind, topic string, limit int) (int, error) {
	if r, ok := s.postgresStore.(outboxdriver.EffectRetrier); ok {
		return r.EffectRetryNow(ctx, kind, topic, limit)
	}
	return 0, nil
}

// CheckWritable implements outboxdriver.WritableChecker through the postgres driver's store.
func (s *pgxStore) CheckWritable(ctx context.Context) error {
	if w, ok := s.postgresStore.(outboxdriver.WritableChecker); ok {
		return w.CheckWritable(ctx)
	}
	return nil
}

// Close closes the prepared statements and the database/sql handle New opened.
func (s *pgxStore) Close() error {
	var errs []error
	if c, ok := s.postgresStore.(io.Closer); ok {
		errs = append(errs, c.Close())
	}
	if s.db != nil {
		errs = append(errs, s.db.Close())
	}
	return errors.Join(errs...)
}

// Tx returns the pgx.Tx of the unit of work in ctx (a handler wrapped by the middleware, InTx).
// Do not commit or roll it back: the framework does (Commit returns an error). Outside a unit of
// work it panics with an error wrapping outbox.ErrNoUnitOfWork; use TxOK to ask.
func Tx(ctx context.Context) pgx.Tx {
	tx, ok := TxOK(ctx)
	if !ok {
		panic(fmt.Errorf("outboxpgx.Tx: %w", outbox.ErrNoUnitOfWork))
	}
	return tx
}

// TxOK returns the pgx.Tx of the unit of work in ctx, and false outside one (or in one that runs
// on database/sql).
func TxOK(ctx context.Context) (pgx.Tx, bool) {
	t, _ := outbox.TxOf(ctx)
	tx, ok := t.(pgx.Tx)
	return tx, ok
}

// InTx is outbox.Outbox.InTx on pgx: fn runs in a new transaction of the pool, outbox.Publish and
// outbox.Record work in its ctx, and if fn returns nil the transaction commits (with the effects,
// in one round trip) and the effects are dispatched at once.
func InTx(ctx context.Context, ob *outbox.Outbox, fn func(ctx context.Context, tx pgx.Tx) error) error {
	return ob.InUnit(ctx, func(ctx context.Context) error {
		tx, ok := TxOK(ctx)
		if !ok {
			t, _ := outbox.TxOf(ctx)
			return fmt.Errorf("outboxpgx.InTx: %w: the Outbox runs units of work on a %T (make it with outboxpgx.New)", outbox.ErrNoUnitOfWork, t)
		}
		return fn(ctx, tx)
	})
}

// JoinTx is outbox.Outbox.JoinTx on pgx: side effects recorded with the returned context are
// stored in tx, a transaction the caller owns, as they are recorded. After committing tx, call
// dispatch to send them at once; if the caller never does, the relay sends them after
// Config.RelayGrace.
func JoinTx(ctx context.Context, ob *outbox.Outbox, tx pgx.Tx) (context.Context, func(context.Context), error) {
	return ob.JoinUnit(ctx, tx)
}
