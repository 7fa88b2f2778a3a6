package main

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wsql "github.com/ThreeDotsLabs/watermill-sql/v3/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/components/forwarder"
	"github.com/ThreeDotsLabs/watermill/message"
	wmw "github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/rbaliyan/event/v3/idempotency"
	"github.com/riverqueue/river"
	"github.com/riverqueue/river/riverdriver/riverdatabasesql"
	"github.com/riverqueue/river/rivermigrate"

	"github.com/watermill-outbox/outbox"
	"github.com/watermill-outbox/outbox/drivers/postgres"
	"github.com/watermill-outbox/outbox/middleware"
)

// delivery is one delivery of an incoming message to the consumer under test.
type delivery struct {
	idx     int // position in the run's delivery list; the outgoing message carries it
	id      string
	payload []byte
	dup     bool // a second copy of an earlier message
	orig    int  // index of the original when dup, else -1
}

// errCrash is what a contender returns where a simulated crash stops a unit of work: the process
// is gone after that line, so the harness restarts the contender and the broker delivers the
// message again.
var errCrash = errors.New("simulated crash")

// The business write of the workload: the same statement, through the same kind of call
// (tx.ExecContext with a parameter), in every contender. The table has no unique index, so a
// message applied twice shows as two rows.
const businessWrite = `INSERT INTO applied (message_id) VALUES ($1)`

const fwdTopic = "bench_fwd" // the watermill-stack's outbox table (watermill-sql topic)

// contender is one way of consuming a message (or, on the boundary path, of running a business
// call) with one business write and one outgoing message.
type contender interface {
	name() string
	path() string // "floor", "consumer" or "boundary"
	safe() bool   // claims exactly-once effects
	crashPoint() string
	counters() *wireCounters
	// tables are the contender's own tables, emptied before each run.
	tables() []string
	// start starts the background machinery of a run (relays, workers).
	start(ctx context.Context) error
	// handle processes one delivery; async reports that its outgoing message is published later by
	// a relay, not before handle returns.
	handle(ctx context.Context, d delivery) (async bool, err error)
	// stop stops what start started.
	stop() error
	// armCrash makes the first attempt at message id crash right after its commit.
	armCrash(id string)
	// restart simulates the process coming back after a crash: in-memory state is lost.
	restart()
	close()
}

type base struct {
	e     *env
	db    *sql.DB
	wc    *wireCounters
	crash *atomic.Pointer[string]
	// suffix follows the contender's name: pooledSuffix when it reaches the database through
	// PgBouncer.
	suffix string
}

func newBase(e *env) (base, error) { return newBaseDSN(e, e.dsn, "") }

// newBaseDSN is newBase on dsn (the pooler's) with suffix after the contender's name.
func newBaseDSN(e *env, dsn, suffix string) (base, error) {
	wc := &wireCounters{}
	db, err := openCounted(dsn, wc, 64)
	return base{e: e, db: db, wc: wc, crash: new(atomic.Pointer[string]), suffix: suffix}, err
}

func (b *base) counters() *wireCounters { return b.wc }
func (b *base) armCrash(id string)      { b.crash.Store(&id) }
func (b *base) restart()                {}
func (b *base) start(context.Context) error {
	return nil
}
func (b *base) stop() error { return nil }
func (b *base) close()      { _ = b.db.Close() }

// crashes tells whether this attempt at id is the one armed to crash (only the first is).
// commitThenPublish commits tx and publishes d's outgoing message with a fresh ID, crashing in
// between when armed: the unsafe contenders' way of producing a message.
func (b *base) commitThenPublish(tx *sql.Tx, d delivery) error {
	if err := tx.Commit(); err != nil {
		return err
	}
	if b.crashes(d.id) {
		return errCrash
	}
	return b.e.pub.Publish(outTopic, outgoing(d, uuid.NewString()))
}

func (b *base) crashes(id string) bool {
	p := b.crash.Load()
	return p != nil && *p == id && b.crash.CompareAndSwap(p, nil)
}

func outgoing(d delivery, id string) *message.Message {
	m := message.NewMessage(id, d.payload)
	m.Metadata.Set(mdIndex, strconv.Itoa(d.idx))
	m.Metadata.Set(mdSource, d.id)
	return m
}

// --- 1. floor ----------------------------------------------------------------------------------

// floor is pgbench's single-row INSERT per transaction (prepared, autocommit): the commit limit
// of the database, with no broker and no outgoing message.
type floor struct {
	base
	stmt *sql.Stmt
}

func newFloor(e *env) (contender, error) {
	b, err := newBase(e)
	if err != nil {
		return nil, err
	}
	st, err := b.db.Prepare(businessWrite)
	if err != nil {
		return nil, err
	}
	return &floor{base: b, stmt: st}, nil
}

func (c *floor) name() string       { return "floor" }
func (c *floor) path() string       { return "floor" }
func (c *floor) safe() bool         { return false }
func (c *floor) crashPoint() string { return "" }
func (c *floor) tables() []string   { return nil }
func (c *floor) handle(ctx context.Context, d delivery) (bool, error) {
	_, err := c.stmt.ExecContext(ctx, d.id)
	return false, err
}

// --- 2. bare -----------------------------------------------------------------------------------

// bare runs the handler in a plain transaction and publishes after commit: no deduplication.
//
// With noop set it is the ceiling: bare plus two no-op round trips in its transaction (a prepared
// SELECT 1 before and one after the business write), where a framework that claims the message
// before the handler and writes the effect in the transaction has its two statements. It does no
// claim and stores no effect, so it is the most such a design can reach through database/sql,
// which sends every statement and BEGIN on their own and waits for each.
type bare struct {
	base
	noop *sql.Stmt
}

func newBare(e *env) (contender, error) {
	b, err := newBase(e)
	return &bare{base: b}, err
}

func newCeiling(e *env) (contender, error) {
	b, err := newBase(e)
	if err != nil {
		return nil, err
	}
	noop, err := b.db.Prepare(`SELECT 1`)
	if err != nil {
		b.close()
		return nil, err
	}
	return &bare{base: b, noop: noop}, nil
}

func (c *bare) name() string {
	if c.noop != nil {
		return "ceiling"
	}
	return "bare" + c.suffix
}

func (c *bare) path() string {
	if c.noop != nil {
		return "ceiling"
	}
	return "consumer"
}

func (c *bare) safe() bool { return false }
func (c *bare) crashPoint() string {
	if c.noop != nil {
		return ""
	}
	return "after commit, before publish"
}
func (c *bare) tables() []string { return nil }
func (c *bare) close() {
	if c.noop != nil {
		_ = c.noop.Close()
	}
	c.base.close()
}

// noopRoundTrip is one of the ceiling's no-op round trips; bare makes none.
func (c *bare) noopRoundTrip(ctx context.Context, tx *sql.Tx) error {
	if c.noop == nil {
		return nil
	}
	var one int
	return tx.StmtContext(ctx, c.noop).QueryRowContext(ctx).Scan(&one)
}

func (c *bare) handle(ctx context.Context, d delivery) (bool, error) {
	tx, err := c.db.BeginTx(ctx, nil)
	if err != nil {
		return false, err
	}
	err = c.noopRoundTrip(ctx, tx)
	if err == nil {
		err = businessSQL(ctx, tx, d.id)
	}
	if err == nil {
		err = c.noopRoundTrip(ctx, tx)
	}
	if err != nil {
		_ = tx.Rollback()
		if isUniqueViolation(err) {
			return false, nil // a redelivered copy whose reservation is committed: dropped
		}
		return false, err
	}
	return false, c.commitThenPublish(tx, d)
}

// --- 3. naive ----------------------------------------------------------------------------------

// naive checks a processed table, processes (transaction, then publish) and marks, each in its
// own statement.
type naive struct{ base }

func newNaive(e *env) (contender, error) {
	b, err := newBase(e)
	return &naive{b}, err
}

func (c *naive) name() string       { return "naive" }
func (c *naive) path() string       { return "consumer" }
func (c *naive) safe() bool         { return false }
func (c *naive) crashPoint() string { return "after commit, before publish and mark" }
func (c *naive) tables() []string   { return []string{"naive_processed"} }
func (c *naive) handle(ctx context.Context, d delivery) (bool, error) {
	var seen bool
	if err := c.db.QueryRowContext(ctx, `SELECT EXISTS (SELECT 1 FROM naive_processed WHERE message_id = $1)`, d.id).Scan(&seen); err != nil {
		return false, err
	}
	if seen {
		return false, nil
	}
	tx, err := c.db.BeginTx(ctx, nil)
	if err != nil {
		return false, err
	}
	if _, err := tx.ExecContext(ctx, businessWrite, d.id); err != nil {
		_ = tx.Rollback()
		return false, err
	}
	if err := tx.Commit(); err != nil {
		return false, err
	}
	if c.crashes(d.id) {
		return false, errCrash
	}
	if err := c.e.pub.Publish(outTopic, outgoing(d, uuid.NewString())); err != nil {
		return false, err
	}
	_, err = c.db.ExecContext(ctx, `INSERT INTO naive_processed (message_id) VALUES ($1) ON CONFLICT DO NOTHING`, d.id)
	return false, err
}

// --- 4. watermill-stack ------------------------------------------------------------------------

// wmStack is what Watermill ships: the built-in middleware.Deduplicator (defaults: in-memory,
// Adler-32 of the payload, one-minute window) on the consumer; the business write and a
// watermill-sql publisher on the same transaction, through components/forwarder's publisher
// (an envelope in the forwarder's table); the forwarder relays the envelopes to the broker.
type wmStack struct {
	base
	mu      sync.Mutex
	h       message.HandlerFunc
	fwd     *forwarder.Forwarder
	sub     *wsql.Subscriber
	done    chan struct{}
	pollInt time.Duration
}

type producedKey struct{}

func newWMStack(e *env) (contender, error) {
	b, err := newBase(e)
	if err != nil {
		return nil, err
	}
	c := &wmStack{base: b, pollInt: 100 * time.Millisecond}
	c.restart()
	// Create the forwarder's tables up front (a publisher on a transaction must not).
	sub, err := wsql.NewSubscriber(b.db, wsql.SubscriberConfig{
		ConsumerGroup: "bench", SchemaAdapter: wsql.DefaultPostgreSQLSchema{},
		OffsetsAdapter: wsql.DefaultPostgreSQLOffsetsAdapter{}, InitializeSchema: true,
	}, nil)
	if err != nil {
		return nil, err
	}
	defer sub.Close()
	if err := sub.SubscribeInitialize(fwdTopic); err != nil {
		return nil, err
	}
	return c, nil
}

func (c *wmStack) name() string       { return "watermill-stack" }
func (c *wmStack) path() string       { return "consumer" }
func (c *wmStack) safe() bool         { return false }
func (c *wmStack) crashPoint() string { return "after commit (envelope stored), before ack" }
func (c *wmStack) tables() []string {
	return []string{`"watermill_` + fwdTopic + `"`, `"watermill_offsets_` + fwdTopic + `"`}
}

// restart builds a new handler: the Deduplicator's in-memory window is lost, as in a new process.
func (c *wmStack) restart() {
	dedup := &wmw.Deduplicator{}
	h := dedup.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		ctx := msg.Context()
		d := ctx.Value(deliveryKey{}).(delivery)
		tx, err := c.db.BeginTx(ctx, nil)
		if err != nil {
			return nil, err
		}
		if _, err := tx.ExecContext(ctx, businessWrite, d.id); err != nil {
			_ = tx.Rollback()
			return nil, err
		}
		pub, err := wsql.NewPublisher(tx, wsql.PublisherConfig{SchemaAdapter: wsql.DefaultPostgreSQLSchema{}}, nil)
		if err != nil {
			_ = tx.Rollback()
			return nil, err
		}
		fp := forwarder.NewPublisher(pub, forwarder.PublisherConfig{ForwarderTopic: fwdTopic})
		if err := fp.Publish(outTopic, outgoing(d, uuid.NewString())); err != nil {
			_ = tx.Rollback()
			return nil, err
		}
		if err := tx.Commit(); err != nil {
			return nil, err
		}
		*ctx.Value(producedKey{}).(*bool) = true
		if c.crashes(d.id) {
			return nil, errCrash
		}
		return nil, nil
	})
	c.mu.Lock()
	c.h = h
	c.mu.Unlock()
}

func (c *wmStack) start(ctx context.Context) error {
	sub, err := wsql.NewSubscriber(c.db, wsql.SubscriberConfig{
		ConsumerGroup:    "bench",
		SchemaAdapter:    wsql.DefaultPostgreSQLSchema{},
		OffsetsAdapter:   wsql.DefaultPostgreSQLOffsetsAdapter{},
		InitializeSchema: true,
		PollInterval:     c.pollInt,
	}, nil)
	if err != nil {
		return err
	}
	fwd, err := forwarder.NewForwarder(sub, c.e.pub, watermill.NopLogger{}, forwarder.Config{ForwarderTopic: fwdTopic})
	if err != nil {
		return err
	}
	c.sub, c.fwd, c.done = sub, fwd, make(chan struct{})
	go func() { defer close(c.done); _ = fwd.Run(context.WithoutCancel(ctx)) }()
	select {
	case <-fwd.Running():
		return nil
	case <-time.After(30 * time.Second):
		return errors.New("forwarder did not start")
	}
}

func (c *wmStack) stop() error {
	err := c.fwd.Close()
	<-c.done
	return errors.Join(err, c.sub.Close())
}

func (c *wmStack) handle(ctx context.Context, d delivery) (bool, error) {
	var produced bool
	msg := message.NewMessage(d.id, d.payload)
	msg.SetContext(context.WithValue(context.WithValue(ctx, deliveryKey{}, d), producedKey{}, &produced))
	c.mu.Lock()
	h := c.h
	c.mu.Unlock()
	_, err := h(msg)
	return produced, err
}

type deliveryKey struct{}

// --- 5. River ----------------------------------------------------------------------------------

// publishArgs is the River job that publishes one outgoing message.
type publishArgs struct {
	Index   int    `json:"i"`
	Src     string `json:"src"`
	UUID    string `json:"uuid"`
	Payload []byte `json:"payload"`
}

func (publishArgs) Kind() string { return "bench_publish" }

type publishWorker struct {
	river.WorkerDefaults[publishArgs]
	c *riverOutbox
}

func (w *publishWorker) Work(ctx context.Context, job *river.Job[publishArgs]) error {
	a := job.Args
	if w.c.crashes(a.Src) {
		return errCrash // the job is committed but not worked: River retries it
	}
	d := delivery{idx: a.Index, id: a.Src, payload: a.Payload}
	return w.c.e.pub.Publish(outTopic, outgoing(d, a.UUID))
}

// riverOutbox uses River as a transactional outbox on the boundary path: the business write and
// InsertTx of a job in one transaction; River's workers publish (100 workers, FetchCooldown
// 100 ms as by default, FetchPollInterval 100 ms instead of 1 s).
type riverOutbox struct {
	base
	client *river.Client[*sql.Tx]
}

func newRiver(e *env) (contender, error) {
	b, err := newBase(e)
	if err != nil {
		return nil, err
	}
	m, err := rivermigrate.New(riverdatabasesql.New(b.db), nil)
	if err != nil {
		return nil, err
	}
	if _, err := m.Migrate(context.Background(), rivermigrate.DirectionUp, nil); err != nil {
		return nil, fmt.Errorf("river migrate: %w", err)
	}
	return &riverOutbox{base: b}, nil
}

func (c *riverOutbox) name() string { return "river" }
func (c *riverOutbox) path() string { return "boundary" }
func (c *riverOutbox) safe() bool   { return true }
func (c *riverOutbox) crashPoint() string {
	return "after commit, before publish (the worker fails once)"
}
func (c *riverOutbox) tables() []string { return []string{"river_job"} }

func (c *riverOutbox) start(ctx context.Context) error {
	workers := river.NewWorkers()
	river.AddWorker(workers, &publishWorker{c: c})
	client, err := river.NewClient(riverdatabasesql.New(c.db), &river.Config{
		Logger:  slog.New(slog.NewTextHandler(io.Discard, nil)),
		Queues:  map[string]river.QueueConfig{river.QueueDefault: {MaxWorkers: 100}},
		Workers: workers,
		// The database/sql driver cannot LISTEN, and an insert inside a transaction does not wake
		// the producer: River polls. 100 ms instead of the default 1 s, like the forwarder's poll.
		FetchPollInterval: 100 * time.Millisecond,
	})
	if err != nil {
		return err
	}
	c.client = client
	return client.Start(context.WithoutCancel(ctx))
}

func (c *riverOutbox) stop() error {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	return c.client.Stop(ctx)
}

func (c *riverOutbox) handle(ctx context.Context, d delivery) (bool, error) {
	tx, err := c.db.BeginTx(ctx, nil)
	if err != nil {
		return false, err
	}
	if _, err := tx.ExecContext(ctx, businessWrite, d.id); err != nil {
		_ = tx.Rollback()
		return false, err
	}
	if _, err := c.client.InsertTx(ctx, tx, publishArgs{Index: d.idx, Src: d.id, UUID: uuid.NewString(), Payload: d.payload}, nil); err != nil {
		_ = tx.Rollback()
		return false, err
	}
	return true, tx.Commit()
}

// --- 6. rbaliyan/event -------------------------------------------------------------------------

// eventIdem is rbaliyan/event/v3's PostgresStore used as its docs show for exactly-once
// processing: IsDuplicateTx, the business write and MarkProcessedTx in one transaction; the
// outgoing message is published after commit.
type eventIdem struct {
	base
	store *idempotency.PostgresStore
}

func newEventIdem(e *env) (contender, error) {
	b, err := newBase(e)
	if err != nil {
		return nil, err
	}
	st, err := idempotency.NewPostgresStore(b.db, idempotency.WithPostgresTTL(7*24*time.Hour))
	if err != nil {
		return nil, err
	}
	if err := st.CreateTable(context.Background()); err != nil {
		return nil, err
	}
	return &eventIdem{base: b, store: st}, nil
}

func (c *eventIdem) name() string       { return "rbaliyan-event" }
func (c *eventIdem) path() string       { return "consumer" }
func (c *eventIdem) safe() bool         { return false }
func (c *eventIdem) crashPoint() string { return "after commit, before publish" }
func (c *eventIdem) tables() []string   { return []string{"event_idempotency"} }
func (c *eventIdem) close()             { _ = c.store.Close(); c.base.close() }

func (c *eventIdem) handle(ctx context.Context, d delivery) (bool, error) {
	tx, err := c.db.BeginTx(ctx, nil)
	if err != nil {
		return false, err
	}
	dup, err := c.store.IsDuplicateTx(ctx, tx, d.id)
	if err != nil || dup {
		_ = tx.Rollback()
		return false, err
	}
	if _, err := tx.ExecContext(ctx, businessWrite, d.id); err != nil {
		_ = tx.Rollback()
		return false, err
	}
	if err := c.store.MarkProcessedTx(ctx, tx, d.id); err != nil {
		_ = tx.Rollback()
		return false, err
	}
	return false, c.commitThenPublish(tx, d)
}

// --- 7. this framework -------------------------------------------------------------------------

// framework is this module, on the consumer path (middleware.New around the handler) or on the
// boundary path (Outbox.InTx). Run (relay, cleanup) runs during every run. The configuration is
// the default except RelayGrace (2 s instead of 10 s), so that the crash check of the boundary
// path does not wait ten seconds for the relay.
type framework struct {
	base
	boundary bool
	prefix   string
	noRun    bool // do not run Outbox.Run (relay, cleanup) during runs: the cleanup scale run drives cleanup itself
	ob       *outbox.Outbox
	h        message.HandlerFunc
	cancel   context.CancelFunc
	done     chan struct{}
	pool     *pgxpool.Pool // the pgx form's pool (outbox-pgx), else nil
	// pessimistic: the pgx form in its claim-first mode
	pessimistic bool
}

type crashIDKey struct{}

func newFramework(e *env, boundary bool, prefix string) (*framework, error) {
	return newFrameworkDSN(e, boundary, prefix, e.dsn, "")
}

// newFrameworkDSN is newFramework on dsn (the pooler's) with suffix after its name.
func newFrameworkDSN(e *env, boundary bool, prefix, dsn, suffix string) (*framework, error) {
	b, err := newBaseDSN(e, dsn, suffix)
	if err != nil {
		return nil, err
	}
	c := &framework{base: b, boundary: boundary, prefix: prefix}
	cfg := outbox.Config{
		DB:          b.db,
		Driver:      postgres.Driver{},
		Publisher:   e.pub,
		TablePrefix: prefix,
		RelayGrace:  e.relayGrace(),
		Failpoint:   c.failpoint,
	}
	if e.tune != nil {
		e.tune(&cfg)
	}
	c.ob, err = outbox.New(cfg)
	if err != nil {
		return nil, err
	}
	if err := c.ob.Migrate(context.Background()); err != nil {
		return nil, err
	}
	c.h = middleware.New(c.ob, middleware.WithConsumer("bench"))(func(msg *message.Message) ([]*message.Message, error) {
		ctx := msg.Context()
		if err := businessSQL(ctx, outbox.Tx(ctx), msg.UUID); err != nil {
			return nil, err
		}
		d := ctx.Value(deliveryKey{}).(delivery)
		return nil, outbox.Publish(ctx, outTopic, outgoing(d, uuid.NewString()))
	})
	return c, nil
}

// failpoint crashes the unit of work of the delivery armed to crash, right after its commit.
func (c *framework) failpoint(ctx context.Context, point string) error {
	if point != outbox.FailpointAfterCommit {
		return nil
	}
	if id, _ := ctx.Value(crashIDKey{}).(string); id != "" && c.crashes(id) {
		return errCrash
	}
	return nil
}

func (c *framework) close() {
	_ = c.ob.Close()
	c.base.close()
	if c.pool != nil {
		c.pool.Close()
	}
}

func (c *framework) name() string {
	switch {
	case c.pool != nil && c.pessimistic:
		return "outbox-pgx-pessimistic" + c.suffix
	case c.pool != nil:
		return "outbox-pgx" + c.suffix
	case c.boundary:
		return "outbox-intx" + c.suffix
	}
	return "outbox-middleware" + c.suffix
}

func (c *framework) path() string {
	if c.boundary {
		return "boundary"
	}
	return "consumer"
}
func (c *framework) safe() bool { return true }
func (c *framework) crashPoint() string {
	return "after commit, before publish and mark (Failpoint after-commit)"
}
func (c *framework) tables() []string {
	return []string{c.prefix + "processed", c.prefix + "effects", c.prefix + "attempts"}
}

func (c *framework) start(ctx context.Context) error {
	if c.noRun {
		return nil
	}
	ctx, c.cancel = context.WithCancel(context.WithoutCancel(ctx))
	c.done = make(chan struct{})
	go func() { defer close(c.done); _ = c.ob.Run(ctx) }()
	return nil
}

func (c *framework) stop() error {
	if c.noRun {
		return nil
	}
	c.cancel()
	<-c.done
	return nil
}

func (c *framework) handle(ctx context.Context, d delivery) (bool, error) {
	ctx = context.WithValue(context.WithValue(ctx, deliveryKey{}, d), crashIDKey{}, d.id)
	if c.boundary {
		return false, c.ob.InTx(ctx, func(ctx context.Context, tx *sql.Tx) error {
			if err := businessSQL(ctx, tx, d.id); err != nil {
				return err
			}
			return outbox.Publish(ctx, outTopic, outgoing(d, uuid.NewString()))
		})
	}
	msg := message.NewMessage(d.id, d.payload)
	msg.SetContext(ctx)
	_, err := c.h(msg)
	return false, err
}
