package outboxpgx_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"net"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"

	"github.com/watermill-outbox/outbox"
	"github.com/watermill-outbox/outbox/drivers/outboxpgx"
	"github.com/watermill-outbox/outbox/drivers/postgres"
	"github.com/watermill-outbox/outbox/outboxtest"
)

// manyEffects is more effects than one INSERT's 65,535 bind parameters hold (7 per effect).
const manyEffects = 10_000

// TestTenThousandEffectsInOneUnit: a unit of work that records more effects than one statement's
// parameters hold stores and sends every one of them, once, in order: inline (optimistic, the
// default key), as rows (optimistic with a key of their own, pessimistic).
func TestTenThousandEffectsInOneUnit(t *testing.T) {
	cases := []struct {
		name string
		mode outboxpgx.Concurrency
		key  string
	}{
		{"optimistic", outboxpgx.Optimistic, ""},
		{"optimistic-own-key", outboxpgx.Optimistic, "aggregate-1"},
		{"pessimistic", outboxpgx.Pessimistic, ""},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			h := outboxtest.NewWith(t, form(c.mode), outbox.Config{}, setup)
			// Handle rather than h.Run: reading back 10,000 effects with their metadata is slow.
			handle := func(h1 message.HandlerFunc) error {
				err := h.Ob.Handle(message.NewMessage("m1", nil), outbox.HandleParams{Consumer: "c", MessageID: "m1"}, h1)
				h.Ob.FlushMarks()
				return err
			}
			if err := handle(consume(func(msg *message.Message) error {
				ctx := msg.Context()
				if c.key != "" {
					ctx = outbox.WithOrderingKey(ctx, c.key)
				}
				out := make([]*message.Message, manyEffects)
				for i := range out {
					out[i] = message.NewMessage(fmt.Sprint("e-", i), nil)
				}
				return outbox.Publish(ctx, "out", out...)
			})); err != nil {
				t.Fatal(err)
			}
			var stored int
			if err := h.DB.QueryRow(`SELECT (SELECT count(*) FROM outbox_effects_all WHERE source_id = 'm1')
				+ (SELECT count(*) FROM outbox_dispatched WHERE source_id = 'm1')`).Scan(&stored); err != nil {
				t.Fatal(err)
			}
			sent := h.Pub.All()
			if stored != manyEffects || len(sent) != manyEffects {
				t.Fatalf("stored %d effects, sent %d, want %d", stored, len(sent), manyEffects)
			}
			for i, s := range sent {
				if want := fmt.Sprint("e-", i); s.Message.UUID != want {
					t.Fatalf("sent #%d is %s, want %s", i, s.Message.UUID, want)
				}
			}
			// Nothing is left pending (a second copy of anything would be sent later).
			if err := handle(consume(func(*message.Message) error { return nil })); err != nil || len(h.Pub.All()) != manyEffects {
				t.Errorf("redelivery: err %v, sent %d more", err, len(h.Pub.All())-manyEffects)
			}
			var pending int
			if err := h.DB.QueryRow(`SELECT (SELECT count(*) FROM outbox_effects_all WHERE dispatched_at IS NULL)
				+ (SELECT count(*) FROM outbox_processed WHERE effects IS NOT NULL)`).Scan(&pending); err != nil || pending != 0 {
				t.Errorf("%d effects pending (%v)", pending, err)
			}
		})
	}
}

// TestClientSideRefusalIsAFailedAttempt: an error raised by pgx before anything was sent (here
// "conn busy": the handler left a Rows open, so COMMIT could not be sent) is a failed attempt,
// counted and poisoned at MaxAttempts, not a commit of unknown outcome.
func TestClientSideRefusalIsAFailedAttempt(t *testing.T) {
	for name, mode := range modes {
		t.Run(name, func(t *testing.T) {
			h := outboxtest.NewWith(t, form(mode), outbox.Config{MaxAttempts: 3, PoisonTopic: "poison"}, setup)
			leaveRowsOpen := consume(func(msg *message.Message) error {
				ctx := msg.Context()
				if err := handler(msg); err != nil {
					return err
				}
				_, err := outboxpgx.Tx(ctx).Query(ctx, `SELECT generate_series(1, 10)`) // never closed
				return err
			})
			for i := 1; i <= 3; i++ {
				res := h.Run("c", message.NewMessage("m1", nil), leaveRowsOpen)
				if errors.Is(res.Err, outbox.ErrCommitOutcomeUnknown) {
					t.Fatalf("attempt %d: %v; want a failed attempt", i, res.Err)
				}
				if (res.Err == nil) != (i == 3) {
					t.Fatalf("attempt %d: %v; want poisoned (acked) at the third", i, res.Err)
				}
				if res.Committed != (i == 3) || len(res.Sent) != map[bool]int{true: 1}[i == 3] {
					t.Fatalf("attempt %d: committed %v, sent %d", i, res.Committed, len(res.Sent))
				}
			}
			if n := len(h.Pub.Messages("poison")); n != 1 {
				t.Errorf("%d messages on the poison topic, want 1", n)
			}
			if n := count(t, h.DB, "m1"); n != 0 {
				t.Errorf("applied %d times, want 0", n)
			}
		})
	}
}

// TestHandlerTimeoutEndsTheTransaction: a handler that ignores its context keeps neither its
// transaction nor its locks past HandlerTimeout: another transaction gets the row lock it took
// within about HandlerTimeout, nothing commits, and the message counts as timed out.
func TestHandlerTimeoutEndsTheTransaction(t *testing.T) {
	for name, mode := range modes {
		t.Run(name, func(t *testing.T) {
			const timeout = 300 * time.Millisecond
			h := outboxtest.NewWith(t, form(mode), outbox.Config{HandlerTimeout: timeout}, func(ctx context.Context, db *sql.DB) error {
				if err := setup(ctx, db); err != nil {
					return err
				}
				_, err := db.ExecContext(ctx, `CREATE TABLE locked (id int PRIMARY KEY); INSERT INTO locked VALUES (1)`)
				return err
			})
			locked := make(chan time.Time, 1)
			release := make(chan struct{})
			stuck := consume(func(msg *message.Message) error {
				ctx := msg.Context()
				if err := handler(msg); err != nil {
					return err
				}
				if _, err := outboxpgx.Tx(ctx).Exec(ctx, `SELECT id FROM locked WHERE id = 1 FOR UPDATE`); err != nil {
					return err
				}
				locked <- time.Now()
				select { // ignores ctx
				case <-release:
				case <-time.After(10 * time.Second):
				}
				return nil
			})
			done := make(chan outboxtest.Result, 1)
			go func() { done <- h.Run("c", message.NewMessage("m1", nil), stuck) }()
			var at time.Time
			select {
			case at = <-locked:
			case <-time.After(10 * time.Second):
				t.Fatal("the handler never took the lock")
			}
			ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			defer cancel()
			tx, err := h.DB.BeginTx(ctx, nil)
			if err != nil {
				t.Fatal(err)
			}
			_, err = tx.ExecContext(ctx, `SELECT id FROM locked WHERE id = 1 FOR UPDATE`)
			waited := time.Since(at)
			_ = tx.Rollback()
			close(release)
			res := <-done
			if err != nil {
				t.Fatalf("the row lock was still held %s after the handler took it (HandlerTimeout %s): %v", waited, timeout, err)
			}
			if waited > timeout+time.Second {
				t.Errorf("the row lock was released %s after the handler took it, HandlerTimeout is %s", waited, timeout)
			}
			if !errors.Is(res.Err, context.DeadlineExceeded) || errors.Is(res.Err, outbox.ErrTxFinishedByHandler) {
				t.Errorf("Handle: %v; want a HandlerTimeout", res.Err)
			}
			if res.Committed || len(res.Sent) != 0 || count(t, h.DB, "m1") != 0 {
				t.Errorf("committed %v, sent %d, applied %d; want nothing", res.Committed, len(res.Sent), count(t, h.DB, "m1"))
			}
			var attempts int
			if err := h.DB.QueryRow(`SELECT coalesce(sum(attempts), 0) FROM outbox_attempts`).Scan(&attempts); err != nil || attempts != 1 {
				t.Errorf("%d attempts counted (%v), want 1", attempts, err)
			}
		})
	}
}

// TestSQLCommitThenHandlerTimeout: a pessimistic handler that ended the transaction with COMMIT
// as SQL (its claim and writes committed) and then ran past HandlerTimeout still has its effects
// stored, and sent on redelivery, as when it returns in time.
func TestSQLCommitThenHandlerTimeout(t *testing.T) {
	h := outboxtest.NewWith(t, form(outboxpgx.Pessimistic), outbox.Config{HandlerTimeout: time.Second}, setup)
	res := h.Run("c", message.NewMessage("m1", nil), consume(func(msg *message.Message) error {
		if err := handler(msg); err != nil {
			return err
		}
		if _, err := outboxpgx.Tx(msg.Context()).Exec(msg.Context(), "COMMIT"); err != nil {
			return err
		}
		<-msg.Context().Done() // ignores that its context ended: returns past HandlerTimeout
		time.Sleep(100 * time.Millisecond)
		return nil
	}))
	if !errors.Is(res.Err, outbox.ErrTxFinishedByHandler) || !res.Committed || len(res.Effects) != 1 {
		t.Fatalf("COMMIT as SQL, then HandlerTimeout: err %v, committed %v, effects stored %d; want ErrTxFinishedByHandler, the claim and 1 effect",
			res.Err, res.Committed, len(res.Effects))
	}
	res = h.Run("c", message.NewMessage("m1", nil), consume(handler))
	if res.Err != nil || len(res.Sent) != 1 || count(t, h.DB, "m1") != 1 {
		t.Errorf("redelivery: err %v, sent %d, applied %d", res.Err, len(res.Sent), count(t, h.DB, "m1"))
	}
}

// TestInTxInsideAHandlerIsRefused: outboxpgx.InTx within a message's unit of work would open an
// independent transaction, committed even when the message's rolls back: it is refused.
func TestInTxInsideAHandlerIsRefused(t *testing.T) {
	h := outboxtest.NewWith(t, pgxForm, outbox.Config{}, setup)
	var inner error
	res := h.Run("c", message.NewMessage("m1", nil), consume(func(msg *message.Message) error {
		inner = outboxpgx.InTx(msg.Context(), h.Ob, func(ctx context.Context, tx pgx.Tx) error {
			_, err := tx.Exec(ctx, `INSERT INTO applied (message_id) VALUES ('escaped')`)
			return err
		})
		return errors.New("the message's unit rolls back")
	}))
	if res.Err == nil {
		t.Fatal("the handler's failure was acked")
	}
	if !errors.Is(inner, outbox.ErrNestedUnitOfWork) || !strings.Contains(inner.Error(), `"c"`) || !strings.Contains(inner.Error(), "outboxpgx.Tx") {
		t.Errorf("InTx inside a handler: %v; want ErrNestedUnitOfWork naming consumer \"c\" and outboxpgx.Tx", inner)
	}
	if n := count(t, h.DB, "escaped"); n != 0 {
		t.Errorf("the inner InTx committed %d row(s)", n)
	}
}

// TestOptimisticCopySwallowingTheWinnersUniqueViolation: a copy whose handler ignores the unique
// violation the winning copy caused fails at COMMIT (the transaction was aborted): it is a
// duplicate of the winner, not a failed attempt.
func TestOptimisticCopySwallowingTheWinnersUniqueViolation(t *testing.T) {
	h := outboxtest.NewWith(t, pgxForm, outbox.Config{}, func(ctx context.Context, db *sql.DB) error {
		_, err := db.ExecContext(ctx, `CREATE TABLE orders (id text PRIMARY KEY)`)
		return err
	})
	inHandler := make(chan struct{}, 2)
	winnerDone := make(chan struct{})
	var calls atomic.Int32
	swallow := consume(func(msg *message.Message) error {
		ctx := msg.Context()
		inHandler <- struct{}{}
		if calls.Add(1) == 2 {
			if err := awaitSignal(winnerDone, "the winning copy's commit"); err != nil {
				return err
			}
		}
		_, _ = outboxpgx.Tx(ctx).Exec(ctx, `INSERT INTO orders (id) VALUES ($1)`, msg.UUID) // error ignored
		return outbox.Publish(ctx, "out", message.NewMessage("out-"+msg.UUID, nil))
	})
	// The loser looks up the claim (none yet) and waits in its handler while the winner commits.
	loser := make(chan error, 1)
	calls.Store(1)
	go func() {
		loser <- h.Ob.Handle(message.NewMessage("o1", nil), outbox.HandleParams{Consumer: "c", MessageID: "o1"}, swallow)
	}()
	if err := awaitSignal(inHandler, "the losing copy's handler"); err != nil {
		t.Fatal(err)
	}
	calls.Store(0)
	if err := h.Ob.Handle(message.NewMessage("o1", nil), outbox.HandleParams{Consumer: "c", MessageID: "o1"}, swallow); err != nil {
		t.Fatal(err)
	}
	close(winnerDone)
	select {
	case err := <-loser:
		if err != nil {
			t.Errorf("the losing copy: %v; want a duplicate (acked)", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the losing copy did not finish")
	}
	var attempts int
	if err := h.DB.QueryRow(`SELECT count(*) FROM outbox_attempts`).Scan(&attempts); err != nil || attempts != 0 {
		t.Errorf("%d failed attempts recorded (%v), want 0", attempts, err)
	}
	if n := len(h.Pub.Messages("out")); n != 1 {
		t.Errorf("sent %d messages, want 1", n)
	}
}

// TestTimedOutCopyThatLostIsADuplicate: a pessimistic copy (pgx, or the database/sql form)
// cut off by HandlerTimeout while an optimistic copy committed is a duplicate of that copy, not
// a handler that committed the transaction itself.
func TestTimedOutCopyThatLostIsADuplicate(t *testing.T) {
	for _, loserForm := range []string{"pgx-pessimistic", "database/sql"} {
		t.Run(loserForm, func(t *testing.T) {
			var dsn string
			h := outboxtest.NewWith(t, func(t testing.TB, d string, cfg outbox.Config) (*outbox.Outbox, error) {
				dsn = d
				return pgxForm(t, d, cfg)
			}, outbox.Config{}, setup)
			var loser *outbox.Outbox
			cfg := outbox.Config{Publisher: h.Pub, HandlerTimeout: time.Second, RetryDelay: -1, DuplicateWait: 20 * time.Millisecond}
			var err error
			if loserForm == "database/sql" {
				cfg.DB, cfg.Driver = h.DB, postgres.Driver{}
				loser, err = outbox.New(cfg)
			} else {
				loser, err = newOutbox(t, openPool(t, dsn, 4, nil), cfg, outboxpgx.WithConcurrency(outboxpgx.Pessimistic))
			}
			if err != nil {
				t.Fatal(err)
			}
			optimisticIn := make(chan struct{})
			pessimisticClaimed := make(chan struct{})
			optimistic := consume(func(msg *message.Message) error {
				close(optimisticIn)
				if err := awaitSignal(pessimisticClaimed, "the pessimistic copy's claim"); err != nil {
					return err
				}
				return handler(msg)
			})
			pessimistic := consume(func(msg *message.Message) error {
				close(pessimisticClaimed)
				<-msg.Context().Done() // then ignores that it ended: returns past HandlerTimeout
				time.Sleep(700 * time.Millisecond)
				return nil
			})
			won := make(chan error, 1)
			go func() {
				won <- h.Ob.Handle(message.NewMessage("m1", nil), outbox.HandleParams{Consumer: "c", MessageID: "m1"}, optimistic)
			}()
			if err := awaitSignal(optimisticIn, "the optimistic copy's handler"); err != nil {
				t.Fatal(err)
			}
			lost := loser.Handle(message.NewMessage("m1", nil), outbox.HandleParams{Consumer: "c", MessageID: "m1"}, pessimistic)
			select {
			case err := <-won:
				if err != nil {
					t.Fatalf("the optimistic copy: %v", err)
				}
			case <-time.After(10 * time.Second):
				t.Fatal("the optimistic copy did not finish")
			}
			if lost != nil {
				t.Errorf("the timed-out copy that lost: %v; want a duplicate (acked)", lost)
			}
			var attempts int
			if err := h.DB.QueryRow(`SELECT count(*) FROM outbox_attempts`).Scan(&attempts); err != nil || attempts != 0 {
				t.Errorf("%d failed attempts recorded (%v), want 0", attempts, err)
			}
			if n := count(t, h.DB, "m1"); n != 1 {
				t.Errorf("applied %d times", n)
			}
		})
	}
}

// awaitSignal waits for ch to be closed or to deliver, at most 10 seconds.
func awaitSignal[T any](ch <-chan T, what string) error {
	select {
	case <-ch:
		return nil
	case <-time.After(10 * time.Second):
		return fmt.Errorf("waited 10s for %s", what)
	}
}

// TestRunReturnsWhileTheDatabaseHangs: the listener of the pgx form (a connection of the pool)
// lets Run return promptly after its context is cancelled while the database accepts connections
// and never answers, and leaves no goroutine behind once the pool is closed.
func TestRunReturnsWhileTheDatabaseHangs(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	var accepted []net.Conn
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			mu.Lock()
			accepted = append(accepted, c)
			mu.Unlock()
		}
	}()
	defer func() {
		_ = ln.Close()
		mu.Lock()
		for _, c := range accepted {
			_ = c.Close()
		}
		mu.Unlock()
	}()
	func() {
		pool := openPool(t, "postgres://u@"+ln.Addr().String()+"/db?sslmode=disable", 2, nil)
		defer pool.Close()
		ob, err := outboxpgx.New(pool, outbox.Config{Publisher: &outboxtest.Recorder{}, RelayInterval: 50 * time.Millisecond})
		if err != nil {
			t.Fatal(err)
		}
		defer func() { _ = ob.Close() }()
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan error, 1)
		go func() { done <- ob.Run(ctx) }()
		time.Sleep(300 * time.Millisecond)
		cancel()
		select {
		case <-done:
		case <-time.After(3 * time.Second):
			t.Fatal("Run did not return within 3s of its context's end while the database hangs")
		}
	}()
}

// TestLongMessageIDsPublishOnEveryForm: a valid 250-byte message ID publishes in both modes, with
// the default ordering key the database/sql form derives; the optimistic mode still keeps the
// effects inline in the claim (they have the default key).
func TestLongMessageIDsPublishOnEveryForm(t *testing.T) {
	for name, mode := range modes {
		t.Run(name, func(t *testing.T) {
			pool := openPool(t, outboxtest.DSN(t), 8, nil)
			rec := &outboxtest.Recorder{}
			ob := ready(t, pool, outbox.Config{Publisher: rec, Failpoint: crashAfterCommit}, outboxpgx.WithConcurrency(mode))
			id := strings.Repeat("x", 250)
			handle := func() error {
				return ob.Handle(message.NewMessage(id, nil), outbox.HandleParams{Consumer: "billing", MessageID: id},
					consume(func(msg *message.Message) error {
						return outbox.Publish(msg.Context(), "out", message.NewMessage("e-1", nil))
					}))
			}
			if err := handle(); !errors.Is(err, errCrash) {
				t.Fatalf("want the crash after commit, got %v", err)
			}
			ctx := context.Background()
			if mode == outboxpgx.Optimistic {
				if c, r := inlineLeft(t, pool); c != 1 || r != 0 {
					t.Fatalf("%d claims with inline effects, %d effect rows; want the effects inline (1, 0)", c, r)
				}
			} else {
				var key string
				if err := pool.QueryRow(ctx, `SELECT ordering_key FROM outbox_effects_all WHERE source_id = $1`, id).Scan(&key); err != nil {
					t.Fatal(err)
				}
				if want := outbox.DefaultOrderingKey(outbox.Source{Consumer: "billing", ID: id}); key != want {
					t.Fatalf("ordering key %q, want %q", key, want)
				}
			}
			if err := handle(); err != nil || len(rec.All()) != 1 {
				t.Fatalf("the redelivery: %v, sent %d, want 1", err, len(rec.All()))
			}
		})
	}
}

// TestSQLRollbackThenPublish (issue 45, item 4, the pgx form): a handler that sends ROLLBACK
// through the unit's pgx.Tx and then publishes. The form keeps effects in memory until COMMIT, so
// nothing is written in autocommit; its COMMIT finds the transaction ended and the message fails
// as the handler's doing, counted towards MaxAttempts, never as an unknown outcome.
func TestSQLRollbackThenPublish(t *testing.T) {
	for name, mode := range modes {
		t.Run(name, func(t *testing.T) {
			h := outboxtest.NewWith(t, form(mode), outbox.Config{}, setup)
			res := h.Run("c", message.NewMessage("m1", nil), consume(func(msg *message.Message) error {
				ctx := msg.Context()
				if err := handler(msg); err != nil {
					return err
				}
				if _, err := outboxpgx.Tx(ctx).Exec(ctx, "ROLLBACK"); err != nil {
					return err
				}
				// Kept in memory: only the COMMIT, which never comes, would store it.
				_ = outbox.Publish(ctx, "out", message.NewMessage("after-rollback", nil))
				return nil
			}))
			if !errors.Is(res.Err, outbox.ErrTxFinishedByHandler) || errors.Is(res.Err, outbox.ErrCommitOutcomeUnknown) {
				t.Fatalf("Handle: %v; want ErrTxFinishedByHandler", res.Err)
			}
			if res.Committed || len(res.Effects) != 0 || len(res.Sent) != 0 || count(t, h.DB, "m1") != 0 {
				t.Errorf("committed %v, effects %d, sent %d, applied %d; want nothing", res.Committed, len(res.Effects), len(res.Sent), count(t, h.DB, "m1"))
			}
			var effects, attempts int
			if err := h.DB.QueryRow(`SELECT (SELECT count(*) FROM outbox_effects_all), (SELECT coalesce(sum(attempts), 0) FROM outbox_attempts)`).Scan(&effects, &attempts); err != nil {
				t.Fatal(err)
			}
			if effects != 0 || attempts != 1 {
				t.Errorf("%d effect rows, %d attempts counted; want 0 and 1", effects, attempts)
			}
		})
	}
}

// TestSQLRollbackThenACopyClaimsThenPublish: after a ROLLBACK sent as SQL a copy of the message
// claims it and commits before the handler records an ordinary effect and returns. The unit's
// COMMIT finds the transaction ended and stores the effects only beside the claim its own
// transaction inserted, which the ROLLBACK took away: the copy's claim, with the same key, must
// not count for it, or the effect of rolled-back work is sent beside the copy's own. The same
// when the handler runs on past HandlerTimeout and the pool is asked instead of the connection.
func TestSQLRollbackThenACopyClaimsThenPublish(t *testing.T) {
	for name, past := range map[string]bool{"in time": false, "past HandlerTimeout": true} {
		t.Run(name, func(t *testing.T) {
			h := outboxtest.NewWith(t, form(outboxpgx.Pessimistic), outbox.Config{HandlerTimeout: time.Second, RelayInterval: time.Hour}, setup)
			var after error
			var copyRes outboxtest.Result
			res := h.Run("c", message.NewMessage("m1", nil), consume(func(msg *message.Message) error {
				ctx := msg.Context()
				if _, err := outboxpgx.Tx(ctx).Exec(ctx, "ROLLBACK"); err != nil {
					return err
				}
				copyRes = h.Run("c", message.NewMessage("m1", nil), consume(handler))
				after = outbox.Publish(ctx, "out_b", message.NewMessage("after", nil))
				if past {
					<-ctx.Done() // then ignores that it ended
					time.Sleep(100 * time.Millisecond)
				}
				return nil
			}))
			if copyRes.Err != nil || !copyRes.Committed {
				t.Fatalf("the copy: %v, committed %v", copyRes.Err, copyRes.Committed)
			}
			if after != nil || !errors.Is(res.Err, outbox.ErrTxFinishedByHandler) {
				t.Errorf("the record after ROLLBACK returned %v, Handle %v; want nil (kept in memory) and ErrTxFinishedByHandler", after, res.Err)
			}
			var escaped, applied int
			if err := h.DB.QueryRow(`SELECT (SELECT count(*) FROM outbox_effects_all WHERE topic = 'out_b'), (SELECT count(*) FROM applied)`).Scan(&escaped, &applied); err != nil {
				t.Fatal(err)
			}
			if escaped != 0 || applied != 1 {
				t.Errorf("%d effect rows of the rolled-back attempt stored beside the copy's claim, %d business rows; want 0 and 1 (the copy's)", escaped, applied)
			}
		})
	}
}
