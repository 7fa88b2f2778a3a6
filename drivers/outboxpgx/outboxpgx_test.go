package outboxpgx_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"net"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"

	"github.com/watermill-outbox/outbox"
	"github.com/watermill-outbox/outbox/drivers/outboxpgx"
	"github.com/watermill-outbox/outbox/drivers/postgres"
	"github.com/watermill-outbox/outbox/internal/logtest"
	"github.com/watermill-outbox/outbox/internal/pgtest"
	"github.com/watermill-outbox/outbox/outboxdriver"
	"github.com/watermill-outbox/outbox/outboxtest"
	"github.com/watermill-outbox/outbox/store/storetest"
)

func TestMain(m *testing.M) { os.Exit(outboxtest.Main(m)) }

// wire counts the round trips of a pool: client writes that follow a read.
type wire struct{ roundTrips atomic.Int64 }

type countingConn struct {
	net.Conn
	w         *wire
	mu        sync.Mutex
	lastWrite bool
}

func (c *countingConn) Read(p []byte) (int, error) {
	n, err := c.Conn.Read(p)
	if n > 0 {
		c.mu.Lock()
		c.lastWrite = false
		c.mu.Unlock()
	}
	return n, err
}

func (c *countingConn) Write(p []byte) (int, error) {
	c.mu.Lock()
	if !c.lastWrite {
		c.w.roundTrips.Add(1)
		c.lastWrite = true
	}
	c.mu.Unlock()
	return c.Conn.Write(p)
}

// openPool opens a pool on dsn of at most maxConns connections, counted in w when w is set,
// closed in t.Cleanup.
func openPool(t testing.TB, dsn string, maxConns int32, w *wire) *pgxpool.Pool {
	t.Helper()
	cfg, err := pgxpool.ParseConfig(dsn)
	if err != nil {
		t.Fatal(err)
	}
	cfg.MaxConns = maxConns
	if w != nil {
		cfg.ConnConfig.DialFunc = func(ctx context.Context, network, addr string) (net.Conn, error) {
			var d net.Dialer
			c, err := d.DialContext(ctx, network, addr)
			if err != nil {
				return nil, err
			}
			return &countingConn{Conn: c, w: w}, nil
		}
		cfg.ShouldPing = func(context.Context, pgxpool.ShouldPingParams) bool { return false }
	}
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	return pool
}

// pgxForm is the outboxtest.Opener of the pgx form (optimistic, the default).
func pgxForm(t testing.TB, dsn string, cfg outbox.Config) (*outbox.Outbox, error) {
	return newOutbox(t, openPool(t, dsn, 8, nil), cfg)
}

// form returns the outboxtest.Opener of the pgx form in mode.
func form(mode outboxpgx.Concurrency) outboxtest.Opener {
	return func(t testing.TB, dsn string, cfg outbox.Config) (*outbox.Outbox, error) {
		return newOutbox(t, openPool(t, dsn, 8, nil), cfg, outboxpgx.WithConcurrency(mode))
	}
}

var modes = map[string]outboxpgx.Concurrency{"optimistic": outboxpgx.Optimistic, "pessimistic": outboxpgx.Pessimistic}

// ready returns a migrated Outbox on pool (closed in t.Cleanup), whose database has the
// business table applied.
func ready(t testing.TB, pool *pgxpool.Pool, cfg outbox.Config, opts ...outboxpgx.Option) *outbox.Outbox {
	t.Helper()
	ctx := context.Background()
	if _, err := pool.Exec(ctx, `CREATE TABLE IF NOT EXISTS applied (message_id text NOT NULL, note text NOT NULL DEFAULT '')`); err != nil {
		t.Fatal(err)
	}
	ob, err := newOutbox(t, pool, cfg, opts...)
	if err != nil {
		t.Fatal(err)
	}
	if err := ob.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	return ob
}

// newOutbox is outboxpgx.New, the Outbox closed in t.Cleanup.
func newOutbox(t testing.TB, pool *pgxpool.Pool, cfg outbox.Config, opts ...outboxpgx.Option) (*outbox.Outbox, error) {
	ob, err := outboxpgx.New(pool, cfg, opts...)
	if err == nil {
		t.Cleanup(func() {
			if err := ob.Close(); err != nil {
				t.Errorf("close: %v", err)
			}
		})
	}
	return ob, err
}

func setup(ctx context.Context, db *sql.DB) error {
	_, err := db.ExecContext(ctx, `CREATE TABLE applied (message_id text NOT NULL, note text NOT NULL DEFAULT '')`)
	return err
}

func count(t testing.TB, db *sql.DB, id string) int {
	t.Helper()
	var n int
	if err := db.QueryRow(`SELECT count(*) FROM applied WHERE message_id = $1`, id).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

// handler is a consumer as users of pgx write one: the business write through the unit of work's
// pgx.Tx, one message published.
func handler(msg *message.Message) error {
	ctx := msg.Context()
	if _, err := outboxpgx.Tx(ctx).Exec(ctx, `INSERT INTO applied (message_id) VALUES ($1)`, msg.UUID); err != nil {
		return err
	}
	return outbox.Publish(ctx, "out", message.NewMessage("out-"+msg.UUID, msg.Payload))
}

func TestCrashMatrix(t *testing.T) {
	for name, mode := range modes {
		t.Run(name, func(t *testing.T) { crashMatrix(t, form(mode)) })
	}
}

func crashMatrix(t *testing.T, open outboxtest.Opener) { crashMatrixOf(t, open, handler) }

// The matrix with PostgreSQL's effects table rotating every 50 ms (10 s by default, longer than
// a scenario), in each mode: the relay moves what is pending and truncates partitions while
// copies, crashes and the later delivery run. At least one scenario must have rotated (a trigger
// counts the rotations). The relay runs only from the end of the deliveries until nothing is
// pending, which may be too short for a rotation in every scenario of a run on a loaded machine
// (CI's once had none in 6): the matrix runs again, up to 5 times, until one rotated.
func TestCrashMatrixRotatingEffects(t *testing.T) {
	for name, mode := range modes {
		t.Run(name, func(t *testing.T) {
			var rotated atomic.Int32
			open := func(t testing.TB, dsn string, cfg outbox.Config) (*outbox.Outbox, error) {
				pool := openPool(t, dsn, 8, nil)
				ob, err := newOutbox(t, pool, cfg, outboxpgx.WithConcurrency(mode), outboxpgx.WithRotateEvery(50*time.Millisecond))
				if err != nil {
					return nil, err
				}
				ctx := context.Background()
				if err := ob.Migrate(ctx); err != nil {
					return nil, err
				}
				for _, stmt := range []string{
					`CREATE TABLE rotations_seen (gen int NOT NULL)`,
					`CREATE FUNCTION rotation_seen() RETURNS trigger LANGUAGE plpgsql AS $$
						BEGIN INSERT INTO rotations_seen VALUES (NEW.gen); RETURN NULL; END $$`,
					`CREATE TRIGGER rotation_seen AFTER UPDATE OF gen ON outbox_effects_rotation FOR EACH ROW
						WHEN (NEW.gen IS DISTINCT FROM OLD.gen) EXECUTE FUNCTION rotation_seen()`,
				} {
					if _, err := pool.Exec(ctx, stmt); err != nil {
						return nil, err
					}
				}
				t.Cleanup(func() {
					var n int
					if err := pool.QueryRow(context.Background(), `SELECT count(*) FROM rotations_seen`).Scan(&n); err != nil {
						t.Errorf("count the rotations: %v", err)
					}
					if n > 0 {
						rotated.Add(1)
					}
				})
				return ob, nil
			}
			for try := 1; rotated.Load() == 0; try++ {
				if try > 5 {
					t.Fatal("no scenario rotated the effects table in 5 runs of the matrix: the matrix did not cover a rotation")
				}
				t.Run(fmt.Sprint("run-", try), func(t *testing.T) { crashMatrix(t, open) })
			}
			t.Logf("%d scenarios rotated the effects table", rotated.Load())
		})
	}
}

// TestCrashMatrixOneMessageTwoTopics: a handler that publishes one message (one UUID) to two
// topics. A crash after the first topic's publish must not leave the second topic's copy
// marked sent and never sent.
func TestCrashMatrixOneMessageTwoTopics(t *testing.T) {
	for name, mode := range modes {
		t.Run(name, func(t *testing.T) { crashMatrixOf(t, form(mode), twoTopics) })
	}
}

// twoTopics is handler with the same message published to "out" and to "audit", in either
// form (a *sql.Tx or a pgx.Tx).
func twoTopics(msg *message.Message) error {
	ctx := msg.Context()
	if tx, ok := outbox.TxOK(ctx); ok {
		if _, err := tx.ExecContext(ctx, `INSERT INTO applied (message_id) VALUES ($1)`, msg.UUID); err != nil {
			return err
		}
		if err := outbox.Publish(ctx, "out", message.NewMessage("out-"+msg.UUID, msg.Payload)); err != nil {
			return err
		}
	} else if err := handler(msg); err != nil {
		return err
	}
	return outbox.Publish(ctx, "audit", message.NewMessage("out-"+msg.UUID, msg.Payload))
}

// The matrix with EffectRetention 0, the default (sent effects deleted when marked; the harness
// audits them), in each mode, with a carrier message delivered before each scenario's and the
// relay running from the start.
func TestCrashMatrixDeleteSent(t *testing.T) {
	for name, mode := range modes {
		t.Run(name, func(t *testing.T) {
			c := crashMatrixConfig(form(mode), handler)
			c.Messages = append(c.Messages, message.NewMessage("order-2", []byte(`{}`)))
			c.DeleteSent = true
			c.Run(t)
		})
	}
}

func crashMatrixOf(t *testing.T, open outboxtest.Opener, h func(*message.Message) error) {
	crashMatrixConfig(open, h).Run(t)
}

func crashMatrixConfig(open outboxtest.Opener, h func(*message.Message) error) outboxtest.CrashMatrix {
	return outboxtest.CrashMatrix{
		Consumer: "inventory",
		Open:     open,
		Handler: func(*sql.DB) message.HandlerFunc {
			return func(m *message.Message) ([]*message.Message, error) { return nil, h(m) }
		},
		Messages: []*message.Message{message.NewMessage("order-1", []byte(`{}`))},
		Setup:    setup,
		Applied: func(ctx context.Context, db *sql.DB, msg *message.Message) (int, error) {
			var n int
			err := db.QueryRowContext(ctx, `SELECT count(*) FROM applied WHERE message_id = $1`, msg.UUID).Scan(&n)
			return n, err
		},
		Config: outbox.Config{RelayGrace: 50 * time.Millisecond, RelayInterval: 20 * time.Millisecond},
	}
}

func consume(h func(*message.Message) error) message.HandlerFunc {
	return func(m *message.Message) ([]*message.Message, error) { return nil, h(m) }
}

// TestRoundTrips: a first delivery waits for as many round trips as a bare pgx transaction
// (BEGIN, the write, COMMIT): BEGIN goes with the claim and the effects with COMMIT.
func TestRoundTrips(t *testing.T) {
	for name, mode := range modes {
		t.Run(name, func(t *testing.T) { roundTrips(t, mode) })
	}
}

func roundTrips(t *testing.T, mode outboxpgx.Concurrency) {
	var w wire
	dsn := outboxtest.DSN(t)
	pool := openPool(t, dsn, 1, &w)
	ctx := context.Background()
	var atCommit atomic.Int64
	ob := ready(t, pool, outbox.Config{Publisher: &outboxtest.Recorder{}, Failpoint: func(_ context.Context, point string) error {
		if point == outbox.FailpointAfterCommit {
			atCommit.Store(w.roundTrips.Load())
		}
		return nil
	}}, outboxpgx.WithConcurrency(mode))
	deliver := func(id string) int64 {
		ob.FlushMarks()
		before := w.roundTrips.Load()
		if err := ob.Handle(message.NewMessage(id, nil), outbox.HandleParams{Consumer: "c", MessageID: id}, consume(handler)); err != nil {
			t.Fatal(err)
		}
		return atCommit.Load() - before
	}
	bare := func(id string) int64 {
		ob.FlushMarks() // the last delivery's mark, written in the background, is not the bare transaction's
		before := w.roundTrips.Load()
		tx, err := pool.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := tx.Exec(ctx, `INSERT INTO applied (message_id) VALUES ($1)`, id); err != nil {
			t.Fatal(err)
		}
		if err := tx.Commit(ctx); err != nil {
			t.Fatal(err)
		}
		return w.roundTrips.Load() - before
	}
	for i := range 3 { // statements are prepared once per connection
		deliver(fmt.Sprint("warm-", i))
		bare(fmt.Sprint("bare-warm-", i))
	}
	got, want := deliver("m1"), bare("b1")
	if want != 3 {
		t.Fatalf("a bare pgx transaction took %d round trips, want 3 (BEGIN, INSERT, COMMIT)", want)
	}
	if got != want {
		t.Errorf("a first delivery waited for %d round trips up to its commit, a bare pgx transaction %d", got, want)
	}
	// A duplicate whose effects were sent: BEGIN with the claim or its look-up, which tells that
	// nothing of it is pending, and ROLLBACK; nothing more is read.
	ob.FlushMarks()
	dupOf := func(id string) int64 {
		before := w.roundTrips.Load()
		if err := ob.Handle(message.NewMessage(id, nil), outbox.HandleParams{Consumer: "c", MessageID: id}, consume(handler)); err != nil {
			t.Fatal(err)
		}
		return w.roundTrips.Load() - before
	}
	dupOf("warm-0") // its statements are prepared once per connection too
	if dup := dupOf("m1"); dup != 2 {
		t.Errorf("a duplicate whose effects were sent waited for %d round trips, want 2", dup)
	}
}

func TestDuplicateAndConcurrentCopies(t *testing.T) {
	for name, mode := range modes {
		t.Run(name, func(t *testing.T) { duplicates(t, form(mode)) })
	}
}

func duplicates(t *testing.T, open outboxtest.Opener) {
	h := outboxtest.NewWith(t, open, outbox.Config{}, setup)
	res := h.Run("c", message.NewMessage("m1", []byte("p")), consume(handler))
	if res.Err != nil || !res.Committed || len(res.Effects) != 1 || len(res.Sent) != 1 {
		t.Fatalf("first delivery: %+v", res)
	}
	if res.Sent[0].Message.UUID != "out-m1" {
		t.Errorf("sent %q", res.Sent[0].Message.UUID)
	}
	dup := h.Run("c", message.NewMessage("m1", []byte("p")), consume(handler))
	if dup.Err != nil || len(dup.Sent) != 0 {
		t.Fatalf("duplicate: %+v", dup)
	}
	if err := concurrently(8, func(int) error {
		return h.Ob.Handle(message.NewMessage("m2", nil), outbox.HandleParams{Consumer: "c", MessageID: "m2"}, consume(handler))
	}); err != nil {
		t.Fatal(err)
	}
	if n := count(t, h.DB, "m2"); n != 1 {
		t.Errorf("8 concurrent copies applied the change %d times", n)
	}
	ids := map[string]bool{}
	for _, s := range h.Pub.All() {
		ids[s.Message.UUID] = true
	}
	if len(ids) != 2 || !ids["out-m2"] {
		t.Errorf("sent UUIDs %v, want out-m1 and out-m2", ids)
	}
}

// TestSavepoints: effects recorded inside a savepoint (pgx's nested transaction) that rolls back
// are dropped with it; those of a released one stay.
func TestSavepoints(t *testing.T) {
	for name, mode := range modes {
		t.Run(name, func(t *testing.T) { savepoints(t, form(mode)) })
	}
}

func savepoints(t *testing.T, open outboxtest.Opener) {
	h := outboxtest.NewWith(t, open, outbox.Config{}, setup)
	pub := func(ctx context.Context, id string) error {
		return outbox.Publish(ctx, "out", message.NewMessage(id, nil))
	}
	res := h.Run("c", message.NewMessage("m1", nil), consume(func(msg *message.Message) error {
		ctx := msg.Context()
		tx := outboxpgx.Tx(ctx)
		if err := pub(ctx, "a"); err != nil {
			return err
		}
		sp, err := tx.Begin(ctx)
		if err != nil {
			return err
		}
		if _, err := sp.Exec(ctx, `INSERT INTO applied (message_id) VALUES ('rolled-back')`); err != nil {
			return err
		}
		if err := pub(ctx, "b-rolled-back"); err != nil {
			return err
		}
		inner, err := sp.Begin(ctx)
		if err != nil {
			return err
		}
		if err := pub(ctx, "c-rolled-back"); err != nil {
			return err
		}
		if err := inner.Commit(ctx); err != nil {
			return err
		}
		if err := sp.Rollback(ctx); err != nil {
			return err
		}
		if err := sp.Rollback(ctx); !errors.Is(err, pgx.ErrTxClosed) {
			return fmt.Errorf("second rollback of a savepoint: %v, want ErrTxClosed", err)
		}
		sp2, err := tx.Begin(ctx)
		if err != nil {
			return err
		}
		// The handle of the savepoint that ended must not act on the new one at its depth.
		if err := sp.Commit(ctx); !errors.Is(err, pgx.ErrTxClosed) {
			return fmt.Errorf("commit through the handle of a savepoint rolled back: %v, want ErrTxClosed", err)
		}
		if err := pub(ctx, "d"); err != nil {
			return err
		}
		if err := sp2.Commit(ctx); err != nil {
			return err
		}
		if _, err := tx.Exec(ctx, `INSERT INTO applied (message_id) VALUES ($1)`, msg.UUID); err != nil {
			return err
		}
		return pub(ctx, "e")
	}))
	if res.Err != nil {
		t.Fatal(res.Err)
	}
	var got []string
	for _, e := range res.Effects {
		got = append(got, e.UUID)
	}
	var sent []string
	for _, s := range res.Sent {
		sent = append(sent, s.Message.UUID)
	}
	if strings.Join(got, ",") != "a,d,e" || strings.Join(sent, ",") != "a,d,e" {
		t.Errorf("committed %v, sent %v; want a,d,e for both", got, sent)
	}
	if count(t, h.DB, "rolled-back") != 0 || count(t, h.DB, "m1") != 1 {
		t.Error("the savepoint's write survived, or the unit's did not")
	}
}

// TestHandlerCannotFinishTheTransaction: Commit is refused, Rollback and SQL that ends the
// transaction fail the message; effects of a transaction the handler committed with SQL are kept
// and sent on redelivery.
func TestHandlerCannotFinishTheTransaction(t *testing.T) {
	for name, mode := range modes {
		t.Run(name, func(t *testing.T) { cannotFinish(t, mode) })
	}
}

func cannotFinish(t *testing.T, mode outboxpgx.Concurrency) {
	h := outboxtest.NewWith(t, form(mode), outbox.Config{MaxAttempts: 100}, setup)
	write := func(msg *message.Message) error {
		ctx := msg.Context()
		if _, err := outboxpgx.Tx(ctx).Exec(ctx, `INSERT INTO applied (message_id) VALUES ($1)`, msg.UUID); err != nil {
			return err
		}
		return outbox.Publish(ctx, "out", message.NewMessage("out-"+msg.UUID, nil))
	}
	res := h.Run("c", message.NewMessage("commit", nil), consume(func(msg *message.Message) error {
		if err := write(msg); err != nil {
			return err
		}
		return outboxpgx.Tx(msg.Context()).Commit(msg.Context())
	}))
	if !errors.Is(res.Err, outbox.ErrTxFinishedByHandler) || res.Committed || count(t, h.DB, "commit") != 0 || len(res.Sent) != 0 {
		t.Errorf("handler Commit: err %v, committed %v, applied %d, sent %d", res.Err, res.Committed, count(t, h.DB, "commit"), len(res.Sent))
	}
	res = h.Run("c", message.NewMessage("rollback", nil), consume(func(msg *message.Message) error {
		if err := write(msg); err != nil {
			return err
		}
		return outboxpgx.Tx(msg.Context()).Rollback(msg.Context())
	}))
	if res.Err == nil || res.Committed || count(t, h.DB, "rollback") != 0 || len(res.Sent) != 0 {
		t.Errorf("handler Rollback: err %v, committed %v, sent %d", res.Err, res.Committed, len(res.Sent))
	}
	res = h.Run("c", message.NewMessage("sql-commit", nil), consume(func(msg *message.Message) error {
		if err := write(msg); err != nil {
			return err
		}
		_, err := outboxpgx.Tx(msg.Context()).Exec(msg.Context(), "COMMIT")
		return err
	}))
	if mode == outboxpgx.Pessimistic {
		// The claim committed with the handler's writes: the effects are kept, and sent on redelivery.
		if !errors.Is(res.Err, outbox.ErrTxFinishedByHandler) || !res.Committed || len(res.Effects) != 1 {
			t.Fatalf("COMMIT as SQL: err %v, committed %v, effects %d", res.Err, res.Committed, len(res.Effects))
		}
		res = h.Run("c", message.NewMessage("sql-commit", nil), consume(write))
		if res.Err != nil || len(res.Sent) != 1 || count(t, h.DB, "sql-commit") != 1 {
			t.Errorf("redelivery after COMMIT as SQL: err %v, sent %d, applied %d", res.Err, len(res.Sent), count(t, h.DB, "sql-commit"))
		}
	} else if !errors.Is(res.Err, outbox.ErrTxFinishedByHandler) || res.Committed || len(res.Sent) != 0 {
		// The claim is written at commit: the message fails (and the docs warn that it runs again).
		t.Errorf("COMMIT as SQL: err %v, committed %v, sent %d", res.Err, res.Committed, len(res.Sent))
	}
	res = h.Run("c", message.NewMessage("failed-statement", nil), consume(func(msg *message.Message) error {
		ctx := msg.Context()
		_, _ = outboxpgx.Tx(ctx).Exec(ctx, `INSERT INTO no_such_table VALUES (1)`) // error ignored
		return write(msg)
	}))
	if res.Err == nil || res.Committed || len(res.Sent) != 0 {
		t.Errorf("statement failed, error ignored: err %v, committed %v, sent %d", res.Err, res.Committed, len(res.Sent))
	}
	res = h.Run("c", message.NewMessage("panic", nil), consume(func(msg *message.Message) error {
		if err := write(msg); err != nil {
			return err
		}
		panic("boom")
	}))
	if !errors.Is(res.Err, outbox.ErrHandlerPanicked) || res.Committed || len(res.Sent) != 0 {
		t.Errorf("panic: err %v, committed %v", res.Err, res.Committed)
	}
	res = h.Run("c", message.NewMessage("wrong-accessor", nil), consume(func(msg *message.Message) error {
		_ = outbox.Tx(msg.Context()) // a *sql.Tx is asked of a pgx unit of work
		return nil
	}))
	if !errors.Is(res.Err, outbox.ErrHandlerPanicked) || !strings.Contains(res.Err.Error(), "driver's Tx") {
		t.Errorf("outbox.Tx in a pgx unit of work: %v", res.Err)
	}
}

// TestNoConnectionLeak: whatever the unit of work's end, its connection goes back to a pool of
// one, and a HandlerTimeout that expires in the handler rolls it back.
func TestNoConnectionLeak(t *testing.T) {
	dsn := outboxtest.DSN(t)
	pool := openPool(t, dsn, 1, nil)
	ctx := context.Background()
	ob := ready(t, pool, outbox.Config{Publisher: &outboxtest.Recorder{}, HandlerTimeout: time.Second, RetryDelay: -1})
	handlers := map[string]func(*message.Message) error{
		"ok":     handler,
		"fails":  func(*message.Message) error { return errors.New("no") },
		"panics": func(*message.Message) error { panic("no") },
		"slow": func(msg *message.Message) error {
			if err := handler(msg); err != nil {
				return err
			}
			_, err := outboxpgx.Tx(msg.Context()).Exec(msg.Context(), `SELECT pg_sleep(5)`)
			return err
		},
	}
	msgCtx, cancelMsg := context.WithCancel(ctx)
	handlers["cancelled"] = func(msg *message.Message) error {
		if err := handler(msg); err != nil {
			return err
		}
		cancelMsg() // the Router shuts down, or the ack deadline passed, mid-handler
		_, err := outboxpgx.Tx(msg.Context()).Exec(msg.Context(), `SELECT 1`)
		return err
	}
	for name, h := range handlers {
		msg := message.NewMessage(name, nil)
		if name == "cancelled" {
			msg.SetContext(msgCtx)
		}
		err := ob.Handle(msg, outbox.HandleParams{Consumer: "c", MessageID: name}, consume(h))
		if (err == nil) != (name == "ok") {
			t.Errorf("%s: %v", name, err)
		}
		if name == "slow" && !errors.Is(err, context.DeadlineExceeded) {
			t.Errorf("slow: %v, want a HandlerTimeout", err)
		}
		ob.FlushMarks()
		if n := pool.Stat().AcquiredConns(); n != 0 {
			t.Errorf("%s: %d connection(s) still acquired", name, n)
		}
	}
	var n int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM applied`).Scan(&n); err != nil || n != 1 {
		t.Errorf("applied %d rows (%v), want the one of ok", n, err)
	}
}

func TestInTxAndJoinTx(t *testing.T) {
	dsn := outboxtest.DSN(t)
	pool := openPool(t, dsn, 4, nil)
	ctx := context.Background()
	rec := &outboxtest.Recorder{}
	ob := ready(t, pool, outbox.Config{Publisher: rec})
	write := func(ctx context.Context, tx pgx.Tx, id string) error {
		if _, err := tx.Exec(ctx, `INSERT INTO applied (message_id) VALUES ($1)`, id); err != nil {
			return err
		}
		return outbox.Publish(ctx, "out", message.NewMessage(id, nil))
	}
	if err := outboxpgx.InTx(ctx, ob, func(ctx context.Context, tx pgx.Tx) error { return write(ctx, tx, "intx") }); err != nil {
		t.Fatal(err)
	}
	boom := errors.New("boom")
	if err := outboxpgx.InTx(ctx, ob, func(ctx context.Context, tx pgx.Tx) error {
		if err := write(ctx, tx, "intx-fails"); err != nil {
			return err
		}
		return boom
	}); !errors.Is(err, boom) {
		t.Errorf("InTx whose fn fails: %v", err)
	}
	func() {
		defer func() {
			if r := recover(); r != "boom" {
				t.Errorf("InTx whose fn panics: recovered %v", r)
			}
		}()
		_ = outboxpgx.InTx(ctx, ob, func(ctx context.Context, tx pgx.Tx) error {
			_ = write(ctx, tx, "intx-panics")
			panic("boom")
		})
	}()
	if err := ob.InTx(ctx, func(context.Context, *sql.Tx) error { return nil }); !errors.Is(err, outbox.ErrNoUnitOfWork) {
		t.Errorf("database/sql InTx on a pgx Outbox: %v", err)
	}

	for _, commit := range []bool{true, false} {
		id := fmt.Sprint("join-", commit)
		tx, err := pool.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		jctx, dispatch, err := outboxpgx.JoinTx(ctx, ob, tx)
		if err != nil {
			t.Fatal(err)
		}
		if err := write(jctx, tx, id); err != nil {
			t.Fatal(err)
		}
		if commit {
			err = tx.Commit(ctx)
		} else {
			err = tx.Rollback(ctx)
		}
		if err != nil {
			t.Fatal(err)
		}
		dispatch(ctx)
	}
	if _, _, err := outboxpgx.JoinTx(ctx, ob, nil); !errors.Is(err, outbox.ErrNoUnitOfWork) {
		t.Errorf("JoinTx with a nil tx: %v", err)
	}
	var sent []string
	for _, s := range rec.All() {
		sent = append(sent, s.Message.UUID)
	}
	if strings.Join(sent, ",") != "intx,join-true" {
		t.Errorf("sent %v, want intx and join-true", sent)
	}
	var applied int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM applied`).Scan(&applied); err != nil || applied != 2 {
		t.Errorf("applied %d (%v), want 2", applied, err)
	}
	ob.FlushMarks()
	if n := pool.Stat().AcquiredConns(); n != 0 {
		t.Errorf("%d connection(s) still acquired", n)
	}
}

// TestRelayListens: the relay of a pgx Outbox listens on a connection of the pool, and a
// notification from another instance wakes it.
func TestRelayListens(t *testing.T) {
	dsn := outboxtest.DSN(t)
	pool := openPool(t, dsn, 4, nil)
	ob, err := newOutbox(t, pool, outbox.Config{Publisher: &outboxtest.Recorder{}})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	if err := ob.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- ob.Run(ctx) }()
	deadline := time.Now().Add(10 * time.Second)
	for {
		rep := ob.Health(ctx)
		listening := false
		for _, c := range rep.Checks {
			listening = listening || (c.Name == outbox.CheckListener && c.OK)
		}
		if listening {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the listener never connected: %+v", rep)
		}
		time.Sleep(20 * time.Millisecond)
	}
	cancel()
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		t.Fatal("Run did not return")
	}
}

// TestConformance runs the shared Store suite on the pgx driver's Store (database/sql through
// pgx's stdlib on the pool, LISTEN on a connection of the pool).
func TestConformance(t *testing.T) {
	const schema, prefix = "conformance", "ob_"
	storetest.Run(t, func(t *testing.T) storetest.Harness {
		dsn := outboxtest.DSN(t)
		pool := openPool(t, dsn, 8, nil)
		db, err := sql.Open("postgres", dsn)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = db.Close() })
		return pgtest.ConformanceHarness(db, schema, prefix, func(t testing.TB) outboxdriver.Store {
			pdb := stdlib.OpenDBFromPool(pool)
			t.Cleanup(func() { _ = pdb.Close() })
			st, err := outboxpgx.Driver{Pool: pool}.Open(pdb, outboxdriver.StoreOptions{Schema: schema, TablePrefix: prefix})
			if err != nil {
				t.Fatal(err)
			}
			return st
		})
	})
}

// TestInlineEffectsLeftBehind: with the effects inline in the claim (optimistic, EffectRetention
// 0), a crash after the commit leaves them there; cleanup keeps the claim, and the relay moves
// them to rows after RelayGrace and sends them. A failed dispatch moves them at once, records the
// failure on the rows, and the relay sends them when the broker is back.
func TestInlineEffectsLeftBehind(t *testing.T) {
	dsn := outboxtest.DSN(t)
	pool := openPool(t, dsn, 8, nil)
	ctx := context.Background()
	rec := &outboxtest.Recorder{}
	crash := errors.New("crash")
	var armed atomic.Bool
	ob := ready(t, pool, outbox.Config{Publisher: rec, RelayGrace: 300 * time.Millisecond, RelayInterval: 50 * time.Millisecond,
		RetryDelay: -1, Retention: time.Hour,
		Failpoint: func(_ context.Context, point string) error {
			if point == outbox.FailpointAfterCommit && armed.CompareAndSwap(true, false) {
				return crash
			}
			return nil
		}})
	handle := func(id string) error {
		return ob.Handle(message.NewMessage(id, nil), outbox.HandleParams{Consumer: "c", MessageID: id}, consume(handler))
	}
	pending := func() (inline, rows int) {
		if err := pool.QueryRow(ctx, `SELECT (SELECT count(*) FROM outbox_processed WHERE effects IS NOT NULL),
			(SELECT count(*) FROM outbox_effects_all)`).Scan(&inline, &rows); err != nil {
			t.Fatal(err)
		}
		return inline, rows
	}

	if err := handle("sent"); err != nil {
		t.Fatal(err)
	}
	ob.FlushMarks()
	if i, r := pending(); i != 0 || r != 0 {
		t.Fatalf("after a delivery: %d claims with inline effects, %d effect rows; want none (one row per message, cleared)", i, r)
	}

	armed.Store(true)
	if err := handle("crashed"); !errors.Is(err, crash) {
		t.Fatalf("crash after commit: %v", err)
	}
	if i, r := pending(); i != 1 || r != 0 {
		t.Fatalf("after the crash: %d claims with inline effects, %d effect rows; want 1, 0", i, r)
	}
	// Cleanup, with the claim past retention, must not delete it while its effects are inline.
	if _, err := pool.Exec(ctx, `UPDATE outbox_processed SET processed_at = processed_at - interval '2 hours',
		dispatched_at = dispatched_at - interval '2 hours' WHERE message_id = 'crashed'`); err != nil {
		t.Fatal(err)
	}
	if res, err := ob.Cleanup(ctx); err != nil || res.Claims != 0 {
		t.Fatalf("cleanup deleted %d claims (%v); the one with inline effects must stay", res.Claims, err)
	}

	rec.Fail(errors.New("broker down"))
	if err := handle("failed"); !errors.Is(err, outbox.ErrDispatchFailed) {
		t.Fatalf("dispatch with the broker down: %v", err)
	}
	if i, r := pending(); i != 1 || r != 1 {
		t.Fatalf("after the failed dispatch: %d claims with inline effects, %d effect rows; want 1 (crashed), 1 (failed, moved)", i, r)
	}
	var failures int
	if err := pool.QueryRow(ctx, `SELECT failures FROM outbox_effects_all WHERE source_id = 'failed'`).Scan(&failures); err != nil || failures != 1 {
		t.Fatalf("the failure recorded on the moved row: %d (%v)", failures, err)
	}
	rec.Fail(nil)

	runCtx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- ob.Run(runCtx) }()
	waitCtx, wcancel := context.WithTimeout(ctx, 20*time.Second)
	defer wcancel()
	for {
		sent := map[string]bool{}
		for _, m := range rec.All() {
			sent[m.Message.UUID] = true
		}
		i, r := pending()
		if sent["out-crashed"] && sent["out-failed"] && i == 0 && r == 0 {
			break
		}
		if waitCtx.Err() != nil {
			t.Fatalf("the relay did not send what was left behind: sent %v, %d inline, %d rows", sent, i, r)
		}
		time.Sleep(20 * time.Millisecond)
	}
	cancel()
	<-done
	counts := map[string]int{}
	for _, m := range rec.All() {
		counts[m.Message.UUID]++
	}
	for id, n := range counts {
		if n != 1 {
			t.Errorf("%s sent %d times", id, n)
		}
	}
}

// TestOptimisticLoserIsADuplicate: copies of one message run their handlers at the same moment;
// those that lose to the first commit (on the claim, or on a unique key of the business table
// while the winner held it) are duplicates, not failures: no attempt is counted.
func TestOptimisticLoserIsADuplicate(t *testing.T) {
	h := outboxtest.NewWith(t, pgxForm, outbox.Config{RetryDelay: -1}, func(ctx context.Context, db *sql.DB) error {
		_, err := db.ExecContext(ctx, `CREATE TABLE orders (id text PRIMARY KEY)`)
		return err
	})
	start := make(chan struct{})
	var ran atomic.Int32
	unique := consume(func(msg *message.Message) error {
		ctx := msg.Context()
		ran.Add(1)
		<-start
		if _, err := outboxpgx.Tx(ctx).Exec(ctx, `INSERT INTO orders (id) VALUES ($1)`, msg.UUID); err != nil {
			return err
		}
		return outbox.Publish(ctx, "out", message.NewMessage("out-"+msg.UUID, nil))
	})
	var wg sync.WaitGroup
	errs := make([]error, 6)
	for i := range errs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			errs[i] = h.Ob.Handle(message.NewMessage("o1", nil), outbox.HandleParams{Consumer: "c", MessageID: "o1"}, unique)
		}()
	}
	deadline := time.Now().Add(10 * time.Second)
	for ran.Load() < int32(len(errs)) && time.Now().Before(deadline) {
		time.Sleep(5 * time.Millisecond)
	}
	close(start)
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		t.Fatal(err)
	}
	if ran.Load() < 2 {
		t.Fatalf("only %d handler(s) ran: the copies did not overlap", ran.Load())
	}
	var orders, attempts int
	if err := h.DB.QueryRow(`SELECT (SELECT count(*) FROM orders), (SELECT count(*) FROM outbox_attempts)`).Scan(&orders, &attempts); err != nil {
		t.Fatal(err)
	}
	if orders != 1 || attempts != 0 {
		t.Errorf("%d orders, %d failed attempts recorded; want 1 and 0", orders, attempts)
	}
	if n := len(h.Pub.Messages("out")); n < 1 {
		t.Errorf("sent %d messages", n)
	}
}

// TestSweepSkipsLockedClaims: a claim with inline effects left behind that another transaction
// holds locked neither blocks the relay nor is skipped for good: the others are moved and sent,
// and it is moved once the lock is gone (the sweep's watermark waits for it).
func TestSweepSkipsLockedClaims(t *testing.T) {
	dsn := outboxtest.DSN(t)
	pool := openPool(t, dsn, 8, nil)
	ctx := context.Background()
	rec := &outboxtest.Recorder{}
	ob := ready(t, pool, outbox.Config{Publisher: rec, RelayGrace: 200 * time.Millisecond, RelayInterval: 50 * time.Millisecond,
		Failpoint: func(_ context.Context, point string) error {
			if point == outbox.FailpointAfterCommit {
				return errors.New("crash")
			}
			return nil
		}})
	for _, id := range []string{"locked", "free"} {
		if err := ob.Handle(message.NewMessage(id, nil), outbox.HandleParams{Consumer: "c", MessageID: id}, consume(handler)); err == nil {
			t.Fatal("no crash")
		}
	}
	if _, err := pool.Exec(ctx, `UPDATE outbox_processed SET processed_at = processed_at - interval '2 hours', dispatched_at = dispatched_at - interval '2 hours'`); err != nil {
		t.Fatal(err)
	}
	lock, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = lock.Rollback(ctx) }()
	if _, err := lock.Exec(ctx, `SELECT 1 FROM outbox_processed WHERE message_id = 'locked' FOR UPDATE`); err != nil {
		t.Fatal(err)
	}
	runCtx, cancel := context.WithCancel(ctx)
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- ob.Run(runCtx) }()
	sent := func(id string) bool {
		for _, m := range rec.All() {
			if m.Message.UUID == id {
				return true
			}
		}
		return false
	}
	waitFor := func(what string, cond func() bool) {
		t.Helper()
		deadline := time.Now().Add(15 * time.Second)
		for !cond() {
			if time.Now().After(deadline) {
				t.Fatalf("waited 15 s for %s", what)
			}
			time.Sleep(20 * time.Millisecond)
		}
	}
	waitFor("the free claim's effect", func() bool { return sent("out-free") })
	time.Sleep(500 * time.Millisecond) // a few more sweeps while the lock is held
	if sent("out-locked") {
		t.Fatal("the locked claim's effect was sent while the claim was locked")
	}
	if err := lock.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	waitFor("the locked claim's effect after the lock went", func() bool { return sent("out-locked") })
	cancel()
	<-done
}

// TestCorruptInlineEffectsDoNotStopTheRelay: inline effects that cannot be decoded are left in
// their claim and reported; the other claims' effects are moved and sent.
func TestCorruptInlineEffectsDoNotStopTheRelay(t *testing.T) {
	pool := openPool(t, outboxtest.DSN(t), 8, nil)
	ctx := context.Background()
	rec := &outboxtest.Recorder{}
	logs := &logtest.Errors{}
	ob := ready(t, pool, outbox.Config{Publisher: rec, Logger: logs, RelayGrace: 200 * time.Millisecond, RelayInterval: 50 * time.Millisecond,
		Failpoint: func(_ context.Context, point string) error {
			if point == outbox.FailpointAfterCommit {
				return errors.New("crash")
			}
			return nil
		}})
	for _, id := range []string{"corrupt", "fine"} {
		if err := ob.Handle(message.NewMessage(id, nil), outbox.HandleParams{Consumer: "c", MessageID: id}, consume(handler)); err == nil {
			t.Fatal("no crash")
		}
	}
	if _, err := pool.Exec(ctx, `UPDATE outbox_processed SET effects = '\x02'::bytea WHERE message_id = 'corrupt'`); err != nil {
		t.Fatal(err)
	}
	runCtx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- ob.Run(runCtx) }()
	deadline := time.Now().Add(15 * time.Second)
	for len(rec.Messages("out")) == 0 || !logs.Contains("corrupt") {
		if time.Now().After(deadline) {
			t.Fatalf("sent %d, logged %v", len(rec.Messages("out")), logs.Lines())
		}
		time.Sleep(20 * time.Millisecond)
	}
	cancel()
	<-done
	if got := rec.Messages("out"); len(got) != 1 || got[0].UUID != "out-fine" {
		t.Errorf("sent %v, want out-fine only", got)
	}
	var left int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM outbox_processed WHERE effects IS NOT NULL`).Scan(&left); err != nil || left != 1 {
		t.Errorf("%d claims still hold inline effects (%v), want the corrupt one", left, err)
	}
}

// TestEdges: the longest schema and prefix, a pool of one connection, copies of one message at
// once in both modes, and a handler that publishes from many goroutines at once.
func TestEdges(t *testing.T) {
	for name, mode := range modes {
		for _, conns := range []int32{1, 8} {
			t.Run(fmt.Sprintf("%s/pool-of-%d", name, conns), func(t *testing.T) { edges(t, mode, conns) })
		}
	}
}

func edges(t *testing.T, mode outboxpgx.Concurrency, conns int32) {
	long := strings.Repeat("s", 40)
	pool := openPool(t, outboxtest.DSN(t), conns, nil)
	rec := &outboxtest.Recorder{}
	ob := ready(t, pool, outbox.Config{Publisher: rec, Schema: long, TablePrefix: strings.Repeat("p", 40), RetryDelay: -1,
		DuplicateWait: 50 * time.Millisecond}, outboxpgx.WithConcurrency(mode))
	fanOut := consume(func(msg *message.Message) error {
		ctx := msg.Context()
		if _, err := outboxpgx.Tx(ctx).Exec(ctx, `INSERT INTO applied (message_id) VALUES ($1)`, msg.UUID); err != nil {
			return err
		}
		return concurrently(8, func(i int) error {
			return outbox.Publish(ctx, "out", message.NewMessage(fmt.Sprintf("%s-%d", msg.UUID, i), nil))
		})
	})
	if err := concurrently(4, func(int) error {
		return ob.Handle(message.NewMessage("m", nil), outbox.HandleParams{Consumer: "c", MessageID: "m"}, fanOut)
	}); err != nil {
		t.Fatal(err)
	}
	ob.FlushMarks()
	var applied int
	if err := pool.QueryRow(context.Background(), `SELECT count(*) FROM applied`).Scan(&applied); err != nil || applied != 1 {
		t.Errorf("applied %d times (%v)", applied, err)
	}
	ids := map[string]bool{}
	for _, m := range rec.Messages("out") {
		ids[m.UUID] = true
	}
	if len(ids) != 8 {
		t.Errorf("%d distinct messages sent, want 8", len(ids))
	}
	// InTx from several goroutines at once on the same pool: each commits and sends its own.
	if err := concurrently(4, func(i int) error {
		return outboxpgx.InTx(context.Background(), ob, func(ctx context.Context, tx pgx.Tx) error {
			if _, err := tx.Exec(ctx, `INSERT INTO applied (message_id) VALUES ($1)`, fmt.Sprint("intx-", i)); err != nil {
				return err
			}
			return outbox.Publish(ctx, "intx", message.NewMessage(fmt.Sprint("intx-", i), nil))
		})
	}); err != nil {
		t.Fatal(err)
	}
	if n := len(rec.Messages("intx")); n != 4 {
		t.Errorf("InTx sent %d, want 4", n)
	}
}

// TestDispatchFailsAndTheMoveFailsToo: the broker refuses the effects and moving them to rows
// fails as well (their claim is locked by someone else): the message fails, the effects stay
// inline, and the redelivery sends them once.
func TestDispatchFailsAndTheMoveFailsToo(t *testing.T) {
	dsn := outboxtest.DSN(t)
	cfg, err := pgxpool.ParseConfig(dsn)
	if err != nil {
		t.Fatal(err)
	}
	cfg.ConnConfig.RuntimeParams["lock_timeout"] = "200ms" // the move gives up on the lock soon
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	locker := openPool(t, dsn, 1, nil)
	ctx := context.Background()
	rec := &outboxtest.Recorder{}
	var lock pgx.Tx
	ob := ready(t, pool, outbox.Config{Publisher: rec, RetryDelay: -1,
		Failpoint: func(ctx context.Context, point string) error {
			if point != outbox.FailpointAfterCommit || lock != nil {
				return nil
			}
			var err error
			if lock, err = locker.Begin(ctx); err == nil {
				_, err = lock.Exec(ctx, `SELECT 1 FROM outbox_processed WHERE message_id = 'm' FOR UPDATE`)
			}
			return err
		}})
	state := func() (inline, rows int) {
		if err := pool.QueryRow(ctx, `SELECT (SELECT count(*) FROM outbox_processed WHERE effects IS NOT NULL),
			(SELECT count(*) FROM outbox_effects_all)`).Scan(&inline, &rows); err != nil {
			t.Fatal(err)
		}
		return inline, rows
	}
	handle := func() error {
		return ob.Handle(message.NewMessage("m", nil), outbox.HandleParams{Consumer: "c", MessageID: "m"}, consume(handler))
	}

	rec.Fail(errors.New("broker down"))
	err = handle()
	if !errors.Is(err, outbox.ErrDispatchFailed) || !strings.Contains(err.Error(), "stay with the claim") {
		t.Fatalf("dispatch and move failed: %v", err)
	}
	if i, r := state(); i != 1 || r != 0 {
		t.Fatalf("%d claims with inline effects, %d effect rows; want 1, 0", i, r)
	}
	if err := lock.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	rec.Fail(nil)
	if err := handle(); err != nil {
		t.Fatalf("redelivery: %v", err)
	}
	ob.FlushMarks()
	if got := rec.Messages("out"); len(got) != 1 || got[0].UUID != "out-m" {
		t.Errorf("sent %v, want out-m once", got)
	}
	if i, r := state(); i != 0 || r != 0 {
		t.Errorf("after the redelivery: %d claims with inline effects, %d effect rows; want none", i, r)
	}
	var applied int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM applied`).Scan(&applied); err != nil || applied != 1 {
		t.Errorf("applied %d times (%v)", applied, err)
	}
}

// TestJoinTxConcurrentPublish: Publish from several goroutines into a transaction the caller owns
// (the records take turns on the caller's pgx.Tx); all of them commit and are sent.
func TestJoinTxConcurrentPublish(t *testing.T) {
	pool := openPool(t, outboxtest.DSN(t), 2, nil)
	ctx := context.Background()
	rec := &outboxtest.Recorder{}
	ob := ready(t, pool, outbox.Config{Publisher: rec})
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	jctx, dispatch, err := outboxpgx.JoinTx(ctx, ob, tx)
	if err != nil {
		t.Fatal(err)
	}
	if err := concurrently(8, func(i int) error {
		return outbox.Publish(jctx, "out", message.NewMessage(fmt.Sprint("j-", i), nil))
	}); err != nil {
		t.Fatal(err)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	dispatch(ctx)
	if n := len(rec.Messages("out")); n != 8 {
		t.Errorf("sent %d, want 8", n)
	}
}

// concurrently runs fn(0), ..., fn(n-1) in n goroutines at once and returns their errors joined.
func concurrently(n int, fn func(i int) error) error {
	var wg sync.WaitGroup
	errs := make([]error, n)
	for i := range errs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			errs[i] = fn(i)
		}()
	}
	wg.Wait()
	return errors.Join(errs...)
}

// refusingTopic is a Publisher that refuses every message to one topic while refuse is set, and
// hands the rest to rec.
type refusingTopic struct {
	rec    *outboxtest.Recorder
	topic  string
	refuse atomic.Bool
}

func (p *refusingTopic) Publish(topic string, msgs ...*message.Message) error {
	if topic == p.topic && p.refuse.Load() {
		return fmt.Errorf("topic %q refuses messages", topic)
	}
	return p.rec.Publish(topic, msgs...)
}

func (p *refusingTopic) Close() error { return nil }

// sqlForm is the outboxtest.Opener of the database/sql form (lib/pq), its DB closed in t.Cleanup.
func sqlForm(t testing.TB, dsn string, cfg outbox.Config) (*outbox.Outbox, error) {
	db, err := sql.Open("postgres", dsn)
	if err != nil {
		return nil, err
	}
	t.Cleanup(func() { _ = db.Close() })
	cfg.DB, cfg.Driver = db, postgres.Driver{}
	return outbox.New(cfg)
}

// TestOneMessageToTwoTopics: a handler publishes one message (one UUID) to two topics, and one
// topic refuses it: at the commit's dispatch, or at the redelivery's after a crash between
// commit and dispatch. Once the topic takes messages again, the redelivery and the relay get
// each topic its copy exactly once, under the same UUID, in every form.
func TestOneMessageToTwoTopics(t *testing.T) {
	forms := map[string]outboxtest.Opener{"database-sql": sqlForm, "optimistic": form(outboxpgx.Optimistic),
		"pessimistic": form(outboxpgx.Pessimistic)}
	for name, open := range forms {
		for _, crash := range []bool{false, true} {
			for _, refused := range []string{"out", "audit"} {
				sub := name + "/refused-at-commit/" + refused
				if crash {
					sub = name + "/crash-then-refused-at-redelivery/" + refused
				}
				t.Run(sub, func(t *testing.T) { oneMessageTwoTopics(t, open, crash, refused) })
			}
		}
	}
}

func oneMessageTwoTopics(t *testing.T, open outboxtest.Opener, crashAfterCommit bool, refused string) {
	ctx := context.Background()
	dsn := outboxtest.DSN(t)
	db, err := sql.Open("postgres", dsn)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = db.Close() })
	if err := setup(ctx, db); err != nil {
		t.Fatal(err)
	}
	rec := &outboxtest.Recorder{}
	pub := &refusingTopic{rec: rec, topic: refused}
	crash := errors.New("crash")
	var armed atomic.Bool
	armed.Store(crashAfterCommit)
	ob, err := open(t, dsn, outbox.Config{Publisher: pub, RetryDelay: -1, DuplicateWait: 20 * time.Millisecond,
		RelayGrace: 50 * time.Millisecond, RelayInterval: 20 * time.Millisecond, RelayMaxAttempts: 100,
		Failpoint: func(_ context.Context, point string) error {
			if point == outbox.FailpointAfterCommit && armed.CompareAndSwap(true, false) {
				return crash
			}
			return nil
		}})
	if err != nil {
		t.Fatal(err)
	}
	if err := ob.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	handle := func() error {
		return ob.Handle(message.NewMessage("m", nil), outbox.HandleParams{Consumer: "c", MessageID: "m"}, consume(twoTopics))
	}

	pub.refuse.Store(true)
	if crashAfterCommit {
		if err := handle(); !errors.Is(err, crash) {
			t.Fatalf("crash after commit: %v", err)
		}
	}
	if err := handle(); !errors.Is(err, outbox.ErrDispatchFailed) {
		t.Fatalf("dispatch with %q refusing: %v", pub.topic, err)
	}
	// Redelivered at once: the mark of what went out may still be on its way.
	pub.refuse.Store(false)
	if err := handle(); err != nil {
		t.Fatalf("redelivery: %v", err)
	}
	runCtx, stop := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- ob.Run(runCtx) }()
	waitCtx, cancel := context.WithTimeout(ctx, 20*time.Second)
	idleErr := ob.WaitIdle(waitCtx)
	cancel()
	stop()
	if err := <-done; err != nil && !errors.Is(err, context.Canceled) {
		t.Errorf("run: %v", err)
	}
	if idleErr != nil {
		t.Error(idleErr)
	}
	var inline int
	if err := db.QueryRow(`SELECT count(*) FROM outbox_processed WHERE effects IS NOT NULL`).Scan(&inline); err != nil || inline != 0 {
		t.Errorf("%d claims still hold inline effects (%v)", inline, err)
	}
	for _, topic := range []string{"out", "audit"} {
		got := rec.Messages(topic)
		if len(got) != 1 || got[0].UUID != "out-m" {
			var ids []string
			for _, m := range got {
				ids = append(ids, m.UUID)
			}
			t.Errorf("%q received %v, want out-m exactly once", topic, ids)
		}
	}
	if n := count(t, db, "m"); n != 1 {
		t.Errorf("applied %d times, want once", n)
	}
}
