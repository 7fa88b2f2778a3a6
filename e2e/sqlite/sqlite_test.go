package sqlite_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	wnats "github.com/ThreeDotsLabs/watermill-nats/v2/pkg/nats"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/nats-io/nats.go"
	"go.uber.org/goleak"
	_ "modernc.org/sqlite"

	"github.com/watermill-outbox/outbox"
	"github.com/watermill-outbox/outbox/drivers/sqlite"
	"github.com/watermill-outbox/outbox/e2e/internal/natstest"
	"github.com/watermill-outbox/outbox/outboxdriver"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// The unit of work of the root package, once over SQLite, with an in-process NATS JetStream
// server as the broker.

const (
	consumer = "reserve-stock"
	topic    = "stock_reserved" // JetStream stream names cannot contain '.'
	waitMax  = 30 * time.Second
)

// openDB opens a new database file with sqlite.DSN and closes it at the end of the test.
func openDB(t testing.TB) *sql.DB {
	t.Helper()
	db, err := sql.Open("sqlite", sqlite.DSN(filepath.Join(t.TempDir(), "outbox.db")))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := db.Close(); err != nil {
			t.Errorf("close db: %v", err)
		}
	})
	return db
}

// env is one test's SQLite database and JetStream broker.
type env struct {
	t     *testing.T
	db    *sql.DB
	js    nats.JetStreamContext
	pub   message.Publisher
	calls atomic.Int32
}

func newEnv(t *testing.T) *env {
	t.Helper()
	e := &env{t: t, db: openDB(t)}
	if _, err := e.db.Exec(`CREATE TABLE reserved (message_id TEXT NOT NULL)`); err != nil {
		t.Fatal(err)
	}
	ns := natstest.Start(t)
	var err error
	if e.js, err = natstest.Conn(t, ns, "admin").JetStream(); err != nil {
		t.Fatal(err)
	}
	natstest.AddStreams(t, e.js, topic)
	// Every copy the outbox sends is on the wire to be counted (no JetStream duplicate window).
	pub := natstest.Publisher(t, ns, "outbox", nil)
	e.pub = pub
	return e
}

// newOutbox returns an Outbox over the test's database, as one process would have it.
func (e *env) newOutbox(mutate ...func(*outbox.Config)) *outbox.Outbox {
	e.t.Helper()
	cfg := outbox.Config{DB: e.db, Driver: sqlite.Driver{}, Publisher: e.pub, DuplicateWait: time.Millisecond}
	for _, m := range mutate {
		m(&cfg)
	}
	ob, err := outbox.New(cfg)
	if err != nil {
		e.t.Fatal(err)
	}
	if err := ob.Migrate(context.Background()); err != nil {
		e.t.Fatal(err)
	}
	return ob
}

// reserve is the handler: it reads before it writes (the pattern that needs immediate
// transactions), records the reservation and publishes two messages.
func (e *env) reserve(msg *message.Message) ([]*message.Message, error) {
	e.calls.Add(1)
	ctx := msg.Context()
	tx := outbox.Tx(ctx)
	var seen int
	if err := tx.QueryRowContext(ctx, `SELECT count(*) FROM reserved WHERE message_id = ?`, msg.UUID).Scan(&seen); err != nil {
		return nil, err
	}
	if seen != 0 {
		return nil, fmt.Errorf("message %s reserved twice", msg.UUID)
	}
	if _, err := tx.ExecContext(ctx, `INSERT INTO reserved (message_id) VALUES (?)`, msg.UUID); err != nil {
		return nil, err
	}
	return nil, outbox.Publish(ctx, topic,
		message.NewMessage(uuid.NewString(), []byte("reserved\x00"+msg.UUID)),
		message.NewMessage(uuid.NewString(), []byte("confirmed "+msg.UUID)))
}

func (e *env) handle(ob *outbox.Outbox, msg *message.Message) error {
	c := msg.Copy() // as a broker hands over every delivery
	ctx, cancel := context.WithTimeout(context.Background(), waitMax)
	defer cancel()
	c.SetContext(ctx)
	return ob.Handle(c, outbox.HandleParams{Consumer: consumer, MessageID: msg.UUID}, e.reserve)
}

// settled waits until no effect is pending: the outbox writes the dispatched marks in the
// background after a delivery returns.
func (e *env) settled() {
	e.t.Helper()
	deadline := time.Now().Add(waitMax)
	for e.count(`SELECT count(*) FROM outbox_effects WHERE dispatched_at IS NULL`) > 0 {
		if time.Now().After(deadline) {
			e.t.Fatal("effects still pending after their dispatch")
		}
		time.Sleep(5 * time.Millisecond)
	}
}

func (e *env) count(query string) int {
	e.t.Helper()
	var n int
	if err := e.db.QueryRow(query).Scan(&n); err != nil {
		e.t.Fatalf("%s: %v", query, err)
	}
	return n
}

// wire counts the copies of each message UUID in the broker's stream.
func (e *env) wire() map[string]int {
	e.t.Helper()
	info, err := e.js.StreamInfo(topic)
	if err != nil {
		e.t.Fatal(err)
	}
	out := map[string]int{}
	for seq := info.State.FirstSeq; info.State.Msgs > 0 && seq <= info.State.LastSeq; seq++ {
		raw, err := e.js.GetMsg(topic, seq)
		if err != nil {
			e.t.Fatal(err)
		}
		m, err := (&wnats.NATSMarshaler{}).Unmarshal(&nats.Msg{Subject: raw.Subject, Header: raw.Header, Data: raw.Data})
		if err != nil {
			e.t.Fatal(err)
		}
		out[m.UUID]++
	}
	return out
}

// stored returns the UUIDs of the effects stored for a message.
func (e *env) stored(id string) []string {
	e.t.Helper()
	rows, err := e.db.Query(`SELECT uuid FROM outbox_effects WHERE source_id = ? ORDER BY id`, id)
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

// wantOnWireOnce checks that exactly the effects of the messages ids are on the wire, once each.
func (e *env) wantOnWireOnce(ids ...string) {
	e.t.Helper()
	wire := e.wire()
	want := 0
	for _, id := range ids {
		effects := e.stored(id)
		if len(effects) != 2 {
			e.t.Fatalf("message %s: %d effects stored, want 2", id, len(effects))
		}
		for _, u := range effects {
			if wire[u] != 1 {
				e.t.Errorf("effect %s of message %s: %d copies on the wire, want 1", u, id, wire[u])
			}
		}
		want += len(effects)
	}
	if len(wire) != want {
		e.t.Errorf("%d distinct messages on the wire, want %d", len(wire), want)
	}
}

func TestHandlerRunsOnceAndRedeliverySkipsIt(t *testing.T) {
	e := newEnv(t)
	ob := e.newOutbox()
	msg := message.NewMessage(uuid.NewString(), []byte("order"))
	for i := 0; i < 3; i++ {
		if err := e.handle(ob, msg); err != nil {
			t.Fatalf("delivery %d: %v", i+1, err)
		}
		e.settled()
	}
	if n := e.calls.Load(); n != 1 {
		t.Fatalf("handler calls: %d, want 1", n)
	}
	if n := e.count(`SELECT count(*) FROM reserved`); n != 1 {
		t.Fatalf("business rows: %d, want 1", n)
	}
	e.wantOnWireOnce(msg.UUID)
}

// TestCrashAfterCommitThenRedelivery: the process dies between commit and dispatch; the
// redelivered message, in a new process, sends the committed effects once, with their UUIDs, and
// does not run the handler again.
func TestCrashAfterCommitThenRedelivery(t *testing.T) {
	e := newEnv(t)
	crashing := e.newOutbox(func(c *outbox.Config) {
		c.Failpoint = func(_ context.Context, point string) error {
			if point == outbox.FailpointAfterCommit {
				return errors.New("crash")
			}
			return nil
		}
	})
	msg := message.NewMessage(uuid.NewString(), nil)
	if err := e.handle(crashing, msg); !errors.Is(err, outbox.ErrFailpoint) {
		t.Fatalf("want the failpoint's error, got %v", err)
	}
	if n := len(e.wire()); n != 0 {
		t.Fatalf("%d messages on the wire after a crash before dispatch", n)
	}
	restarted := e.newOutbox()
	for i := 0; i < 2; i++ {
		if err := e.handle(restarted, msg); err != nil {
			t.Fatalf("redelivery %d: %v", i+1, err)
		}
		e.settled()
	}
	if n := e.calls.Load(); n != 1 {
		t.Fatalf("handler calls: %d, want 1", n)
	}
	if n := e.count(`SELECT count(*) FROM reserved`); n != 1 {
		t.Fatalf("business rows: %d, want 1", n)
	}
	e.wantOnWireOnce(msg.UUID)
}

// TestConcurrentCopiesWaitForEachOther: copies of the same messages delivered at the same time
// to handlers that read before they write. With immediate transactions every copy waits for the
// write lock instead of failing with "database is locked", and each message is handled once.
func TestConcurrentCopiesWaitForEachOther(t *testing.T) {
	e := newEnv(t)
	obs := []*outbox.Outbox{e.newOutbox(), e.newOutbox(), e.newOutbox()} // three processes
	const messages, copies = 20, 3
	var ids []string
	var wg sync.WaitGroup
	errs := make(chan error, messages*copies)
	for i := 0; i < messages; i++ {
		msg := message.NewMessage(uuid.NewString(), nil)
		ids = append(ids, msg.UUID)
		for c := 0; c < copies; c++ {
			wg.Add(1)
			go func() {
				defer wg.Done()
				if err := e.handle(obs[c], msg); err != nil {
					errs <- err
				}
			}()
		}
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Errorf("a delivery failed: %v", err)
	}
	if n := e.calls.Load(); n != messages {
		t.Fatalf("handler calls: %d, want %d", n, messages)
	}
	if n := e.count(`SELECT count(*) FROM reserved`); n != messages {
		t.Fatalf("business rows: %d, want %d", n, messages)
	}
	// A copy that found effects still pending may send them too (downstream deduplicates); none
	// is lost.
	wire := e.wire()
	for _, id := range ids {
		for _, u := range e.stored(id) {
			if wire[u] == 0 {
				t.Errorf("effect %s of message %s never sent", u, id)
			}
		}
	}
}

// TestBoundary: InTx commits the business write with its effects and sends them at once; an
// error sends nothing; a crash after commit leaves them to the relay, which sends them once.
func TestBoundary(t *testing.T) {
	e := newEnv(t)
	ob := e.newOutbox(func(c *outbox.Config) {
		c.RelayGrace = time.Millisecond
		c.RelayInterval = 10 * time.Millisecond
	})
	ctx := context.Background()
	reserve := func(id string) func(context.Context, *sql.Tx) error {
		return func(ctx context.Context, tx *sql.Tx) error {
			if _, err := tx.ExecContext(ctx, `INSERT INTO reserved (message_id) VALUES (?)`, id); err != nil {
				return err
			}
			return outbox.Publish(ctx, topic, message.NewMessage(id+"-a", nil), message.NewMessage(id+"-b", nil))
		}
	}
	if err := ob.InTx(ctx, reserve("ok")); err != nil {
		t.Fatal(err)
	}
	if w := e.wire(); len(w) != 2 || w["ok-a"] != 1 || w["ok-b"] != 1 {
		t.Fatalf("on the wire after InTx: %v", w)
	}
	e.settled()

	failed := errors.New("out of stock")
	err := ob.InTx(ctx, func(ctx context.Context, tx *sql.Tx) error {
		if err := reserve("failed")(ctx, tx); err != nil {
			return err
		}
		return failed
	})
	if !errors.Is(err, failed) {
		t.Fatalf("InTx: want the function's error, got %v", err)
	}

	crashing := e.newOutbox(func(c *outbox.Config) {
		c.Failpoint = func(_ context.Context, point string) error {
			if point == outbox.FailpointAfterCommit {
				return errors.New("crash")
			}
			return nil
		}
	})
	if err := crashing.InTx(ctx, reserve("crashed")); !errors.Is(err, outbox.ErrFailpoint) {
		t.Fatalf("want the failpoint's error, got %v", err)
	}
	if n := e.count(`SELECT count(*) FROM reserved`); n != 2 {
		t.Fatalf("business rows: %d, want 2 (the failed InTx rolled back)", n)
	}

	runCtx, stop := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- ob.Run(runCtx) }()
	deadline := time.Now().Add(waitMax)
	for e.count(`SELECT count(*) FROM outbox_effects WHERE dispatched_at IS NULL`) > 0 {
		if time.Now().After(deadline) {
			stop()
			t.Fatal("the relay did not send the effects left by the crash")
		}
		time.Sleep(10 * time.Millisecond)
	}
	stop()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	w := e.wire()
	if len(w) != 4 || w["crashed-a"] != 1 || w["crashed-b"] != 1 || w["failed-a"] != 0 {
		t.Fatalf("on the wire: %v, want ok-a, ok-b, crashed-a, crashed-b once each", w)
	}
}

// TestSingleConnection: a DB limited to one connection, common with SQLite, works: the store
// never needs a second connection while a transaction holds the first.
func TestSingleConnection(t *testing.T) {
	e := newEnv(t)
	e.db.SetMaxOpenConns(1)
	ob := e.newOutbox()
	msg := message.NewMessage(uuid.NewString(), nil)
	for i := 0; i < 2; i++ {
		if err := e.handle(ob, msg); err != nil {
			t.Fatalf("delivery %d: %v", i+1, err)
		}
		e.settled()
	}
	if err := ob.InTx(context.Background(), func(ctx context.Context, tx *sql.Tx) error {
		return outbox.Publish(ctx, topic, message.NewMessage("boundary", nil))
	}); err != nil {
		t.Fatal(err)
	}
	if w := e.wire(); len(w) != 3 || w["boundary"] != 1 {
		t.Fatalf("on the wire: %v", w)
	}
}

// TestImmediateTransactionsAreNeeded shows why sqlite.DSN sets _txlock=immediate: a deferred
// transaction that read before another connection wrote cannot write any more, while an
// immediate one holds the write lock from BEGIN and the other writer waits for it.
func TestImmediateTransactionsAreNeeded(t *testing.T) {
	path := filepath.Join(t.TempDir(), "locks.db")
	open := func(dsn string) *sql.DB {
		db, err := sql.Open("sqlite", dsn)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = db.Close() })
		return db
	}
	immediate := open(sqlite.DSN(path))
	deferred := open(strings.Replace(sqlite.DSN(path), "_txlock=immediate", "_txlock=deferred", 1))
	if _, err := immediate.Exec(`CREATE TABLE t (v INTEGER)`); err != nil {
		t.Fatal(err)
	}
	readThenWrite := func(db *sql.DB, otherWriter func()) error {
		tx, err := db.Begin()
		if err != nil {
			return err
		}
		defer func() { _ = tx.Rollback() }()
		var n int
		if err := tx.QueryRow(`SELECT count(*) FROM t`).Scan(&n); err != nil {
			return err
		}
		otherWriter()
		if _, err := tx.Exec(`INSERT INTO t (v) VALUES (1)`); err != nil {
			return err
		}
		return tx.Commit()
	}

	err := readThenWrite(deferred, func() {
		if _, err := immediate.Exec(`INSERT INTO t (v) VALUES (2)`); err != nil {
			t.Fatal(err)
		}
	})
	if err == nil || !strings.Contains(err.Error(), "locked") {
		t.Fatalf("deferred transaction writing after another connection wrote: want \"database is locked\", got %v", err)
	}

	otherDone := make(chan error, 1)
	err = readThenWrite(immediate, func() {
		go func() { _, err := deferred.Exec(`INSERT INTO t (v) VALUES (3)`); otherDone <- err }()
	})
	if err != nil {
		t.Fatalf("immediate transaction: %v", err)
	}
	if err := <-otherDone; err != nil {
		t.Fatalf("the other writer, which waited for the lock: %v", err)
	}
	var n int
	if err := immediate.QueryRow(`SELECT count(*) FROM t`).Scan(&n); err != nil || n != 3 {
		t.Fatalf("rows: %d, %v; want 3", n, err)
	}
}

func TestSchemaOtherThanMainIsRejected(t *testing.T) {
	db := openDB(t)
	for _, schema := range []string{"", "main"} {
		if _, err := (sqlite.Driver{}).Open(db, outboxdriver.StoreOptions{Schema: schema, TablePrefix: "x_"}); err != nil {
			t.Fatalf("schema %q: %v", schema, err)
		}
	}
	for _, schema := range []string{"public", "temp", "billing"} {
		_, err := outbox.New(outbox.Config{DB: db, Driver: sqlite.Driver{}, Publisher: nopPublisher{}, Schema: schema})
		if err == nil || !strings.Contains(err.Error(), "TablePrefix") {
			t.Fatalf("schema %q: want an error pointing to TablePrefix, got %v", schema, err)
		}
	}
	if _, err := (sqlite.Driver{}).Open(db, outboxdriver.StoreOptions{TablePrefix: `x"; DROP TABLE y; --`}); err == nil {
		t.Fatal("an unsafe table prefix was accepted")
	}
}

type nopPublisher struct{}

func (nopPublisher) Publish(string, ...*message.Message) error { return nil }
func (nopPublisher) Close() error                              { return nil }

// A keyed InTx on SQLite: a retry gets the stored result without running, another request
// with the key is refused, and clients retrying at once wait for the first (writes serialize).
func TestKeyedInTx(t *testing.T) {
	e := newEnv(t)
	ob := e.newOutbox()
	var runs atomic.Int32
	place := func(ctx context.Context, tx *sql.Tx) error {
		runs.Add(1)
		if _, err := tx.ExecContext(ctx, `INSERT INTO reserved (message_id) VALUES (?)`, "order-1"); err != nil {
			return err
		}
		if err := outbox.Publish(ctx, topic, outbox.NewMessage(ctx, []byte("placed"))); err != nil {
			return err
		}
		return outbox.SetResult(ctx, []byte("order-1 placed"))
	}
	var wg sync.WaitGroup
	for range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			ctx := outbox.WithIdempotencyKey(context.Background(), "orders", "k", outbox.Fingerprint([]byte("a")))
			if err := ob.InTx(ctx, place); err != nil {
				t.Errorf("keyed InTx: %v", err)
				return
			}
			if res, _ := outbox.IdempotencyResult(ctx); string(res) != "order-1 placed" {
				t.Errorf("result %q", res)
			}
		}()
	}
	wg.Wait()
	if runs.Load() != 1 || e.count(`SELECT count(*) FROM reserved`) != 1 {
		t.Fatalf("fn ran %d times, %d rows; want once", runs.Load(), e.count(`SELECT count(*) FROM reserved`))
	}
	other := outbox.WithIdempotencyKey(context.Background(), "orders", "k", outbox.Fingerprint([]byte("b")))
	if err := ob.InTx(other, place); !errors.Is(err, outbox.ErrIdempotencyMismatch) {
		t.Fatalf("key reused with another request: %v", err)
	}
}

// A unit whose transaction the application ended with SQL sent through it: SQLite then refuses
// the framework's COMMIT ("cannot commit - no transaction is active"), which is the handler's
// doing, known, and must be reported as ErrTxFinishedByHandler, never as a COMMIT lost in flight
// (ErrCommitOutcomeUnknown), for InTx as for a consumer's unit.
func TestTxEndedBySQLIsTheHandlersDoing(t *testing.T) {
	for _, stmt := range []string{"ROLLBACK", "COMMIT"} {
		t.Run(stmt, func(t *testing.T) {
			e := newEnv(t)
			ob := e.newOutbox()
			ctx := context.Background()
			end := func(ctx context.Context, tx *sql.Tx, id string) error {
				if _, err := tx.ExecContext(ctx, `INSERT INTO reserved (message_id) VALUES (?)`, id); err != nil {
					return err
				}
				_, err := tx.ExecContext(ctx, stmt)
				return err
			}
			err := ob.InTx(ctx, func(ctx context.Context, tx *sql.Tx) error { return end(ctx, tx, "intx") })
			if !errors.Is(err, outbox.ErrTxFinishedByHandler) || errors.Is(err, outbox.ErrCommitOutcomeUnknown) {
				t.Errorf("InTx whose fn sent %s: %v; want ErrTxFinishedByHandler, not ErrCommitOutcomeUnknown", stmt, err)
			}
			msg := message.NewMessage(uuid.NewString(), nil)
			hctx, cancel := context.WithTimeout(ctx, waitMax)
			defer cancel()
			msg.SetContext(hctx)
			err = ob.Handle(msg, outbox.HandleParams{Consumer: consumer, MessageID: msg.UUID}, func(m *message.Message) ([]*message.Message, error) {
				return nil, end(m.Context(), outbox.Tx(m.Context()), m.UUID)
			})
			if !errors.Is(err, outbox.ErrTxFinishedByHandler) || errors.Is(err, outbox.ErrCommitOutcomeUnknown) {
				t.Errorf("Handle whose handler sent %s: %v; want ErrTxFinishedByHandler, not ErrCommitOutcomeUnknown", stmt, err)
			}
			want := 0
			if stmt == "COMMIT" {
				want = 2 // what the application committed stays committed
			}
			if n := e.count(`SELECT count(*) FROM reserved`); n != want {
				t.Errorf("business rows after %s: %d, want %d", stmt, n, want)
			}
		})
	}
}
