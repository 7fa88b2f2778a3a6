package outboxpgx_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"

	"github.com/watermill-outbox/outbox"
	"github.com/watermill-outbox/outbox/drivers/outboxpgx"
	"github.com/watermill-outbox/outbox/outboxtest"
)

// sqlReopens are the ways a handler can replace the unit's transaction with one of its own.
var sqlReopens = map[string][]string{"in one statement": {"ROLLBACK; BEGIN"}, "in two": {"ROLLBACK", "BEGIN"}}

// A handler that sends ROLLBACK and then BEGIN through the unit's pgx.Tx replaces the unit's
// transaction, and its claim with it, by one of its own. The framework's COMMIT must not commit
// that transaction: the business writes made in it and the effects recorded before the ROLLBACK
// would be committed, and the message acked, without the claim, which the next delivery of the
// message would not find (applied twice), and with effects of rolled-back work.
//
// In the optimistic mode the claim is inserted at the COMMIT, into the handler's transaction: the
// message is processed once, but the effects recorded before the ROLLBACK are sent without their
// business change.
func TestSQLRollbackBeginThenReturn(t *testing.T) {
	for mname, mode := range modes {
		for rname, reopen := range sqlReopens {
			t.Run(mname+"/"+rname, func(t *testing.T) {
				h := outboxtest.NewWith(t, form(mode), outbox.Config{RelayInterval: time.Hour}, setup)
				res := h.Run("c", message.NewMessage("m1", nil), consume(func(msg *message.Message) error {
					ctx := msg.Context()
					if err := handler(msg); err != nil { // a business row and an effect, rolled back
						return err
					}
					for _, stmt := range reopen {
						if _, err := outboxpgx.Tx(ctx).Exec(ctx, stmt); err != nil {
							return err
						}
					}
					_, err := outboxpgx.Tx(ctx).Exec(ctx, `INSERT INTO applied (message_id, note) VALUES ($1, 'after BEGIN')`, msg.UUID)
					return err
				}))
				if !errors.Is(res.Err, outbox.ErrTxFinishedByHandler) || res.Committed || len(res.Sent) != 0 {
					t.Errorf("Handle %v, committed %v, sent %d; want ErrTxFinishedByHandler, not processed, nothing sent", res.Err, res.Committed, len(res.Sent))
				}
				var applied, effects, claims int
				if err := h.DB.QueryRow(`SELECT (SELECT count(*) FROM applied), (SELECT count(*) FROM outbox_effects_all),
				(SELECT count(*) FROM outbox_processed)`).Scan(&applied, &effects, &claims); err != nil {
					t.Fatal(err)
				}
				if applied != 0 || effects != 0 || claims != 0 {
					t.Errorf("committed by the handler's transaction: %d business rows, %d effect rows, %d claims; want 0, 0, 0", applied, effects, claims)
				}
				// The message runs again, as after a ROLLBACK, and commits once.
				if res := h.Run("c", message.NewMessage("m1", nil), consume(handler)); res.Err != nil || !res.Committed {
					t.Fatalf("the redelivery: %v, committed %v", res.Err, res.Committed)
				}
				if n := count(t, h.DB, "m1"); n != 1 {
					t.Errorf("%d business rows after the redelivery, want 1", n)
				}
			})
		}
	}
}

// The same in InTx: the unit's COMMIT committed fn's transaction, with the effect recorded before
// the ROLLBACK, sent although its business write was rolled back, and InTx reported success.
func TestInTxRollbackBeginThenReturn(t *testing.T) {
	for rname, reopen := range sqlReopens {
		t.Run(rname, func(t *testing.T) {
			pool := openPool(t, outboxtest.DSN(t), 4, nil)
			ctx := context.Background()
			sent := &outboxtest.Recorder{}
			ob := ready(t, pool, outbox.Config{Publisher: sent, RelayInterval: time.Hour})
			err := outboxpgx.InTx(ctx, ob, func(ctx context.Context, tx pgx.Tx) error {
				if _, err := tx.Exec(ctx, `INSERT INTO applied (message_id) VALUES ('business')`); err != nil {
					return err
				}
				if err := outbox.Publish(ctx, "out_a", message.NewMessage("before", nil)); err != nil {
					return err
				}
				for _, stmt := range reopen {
					if _, err := tx.Exec(ctx, stmt); err != nil {
						return err
					}
				}
				_, err := tx.Exec(ctx, `INSERT INTO applied (message_id, note) VALUES ('business', 'after BEGIN')`)
				return err
			})
			if !errors.Is(err, outbox.ErrTxFinishedByHandler) {
				t.Errorf("InTx returned %v, want ErrTxFinishedByHandler", err)
			}
			var applied, effects int
			if err := pool.QueryRow(ctx, `SELECT (SELECT count(*) FROM applied), (SELECT count(*) FROM outbox_effects_all)`).Scan(&applied, &effects); err != nil {
				t.Fatal(err)
			}
			if applied != 0 || effects != 0 || len(sent.Messages("out_a")) != 0 {
				t.Errorf("%d business rows, %d effect rows, %d sent; want 0, 0, 0", applied, effects, len(sent.Messages("out_a")))
			}
		})
	}
}

// A statement of the handler failed and the handler went on: the transaction is aborted, and the
// unit's COMMIT is answered with ROLLBACK, reported as pgx.ErrTxCommitRollback, also now that a
// check of the transaction runs ahead of it (which the aborted transaction refuses first).
func TestFailedStatementThenReturnIsCommitRollback(t *testing.T) {
	for mname, mode := range modes {
		t.Run(mname, func(t *testing.T) {
			h := outboxtest.NewWith(t, form(mode), outbox.Config{RelayInterval: time.Hour}, setup)
			res := h.Run("c", message.NewMessage("m1", nil), consume(func(msg *message.Message) error {
				ctx := msg.Context()
				_, _ = outboxpgx.Tx(ctx).Exec(ctx, `INSERT INTO no_such_table VALUES (1)`)
				return nil
			}))
			if !errors.Is(res.Err, pgx.ErrTxCommitRollback) || res.Committed {
				t.Errorf("Handle %v, committed %v; want pgx.ErrTxCommitRollback, not processed", res.Err, res.Committed)
			}
		})
	}
}

// A handler that sends COMMIT and then BEGIN commits the unit's transaction, claim and business
// writes with it, in the pessimistic mode (the claim is inserted at the start), but not the
// effects, which wait in memory for the framework's COMMIT. That COMMIT found another
// transaction open and reported that nothing was committed: the redelivery found the message
// processed with nothing pending, and the effects were never sent. Now they are stored once the
// unit's claim is found committed, and the redelivery sends them.
func TestSQLCommitBeginThenReturn(t *testing.T) {
	for rname, reopen := range map[string][]string{"in one statement": {"COMMIT; BEGIN"}, "in two": {"COMMIT", "BEGIN"}} {
		t.Run(rname, func(t *testing.T) {
			h := outboxtest.NewWith(t, form(outboxpgx.Pessimistic), outbox.Config{RelayInterval: time.Hour}, setup)
			res := h.Run("c", message.NewMessage("m1", nil), consume(func(msg *message.Message) error {
				ctx := msg.Context()
				if err := handler(msg); err != nil { // a business row and an effect, committed by the handler
					return err
				}
				for _, stmt := range reopen {
					if _, err := outboxpgx.Tx(ctx).Exec(ctx, stmt); err != nil {
						return err
					}
				}
				_, err := outboxpgx.Tx(ctx).Exec(ctx, `INSERT INTO applied (message_id, note) VALUES ($1, 'after BEGIN')`, msg.UUID)
				return err
			}))
			if !errors.Is(res.Err, outbox.ErrTxFinishedByHandler) {
				t.Errorf("Handle %v; want ErrTxFinishedByHandler", res.Err)
			}
			sent := len(res.Sent)
			// The broker redelivers: the message is processed, and its effect goes out.
			again := h.Run("c", message.NewMessage("m1", nil), consume(handler))
			if again.Err != nil {
				t.Fatalf("the redelivery: %v", again.Err)
			}
			sent += len(again.Sent)
			if sent != 1 {
				t.Errorf("the effect committed with its claim was sent %d times; want once", sent)
			}
			if n := count(t, h.DB, "m1"); n != 1 {
				t.Errorf("%d business rows, want the one committed by the handler", n)
			}
		})
	}
}

// A fn that leaves a Rows open keeps the connection busy: pgx sends nothing, COMMIT included, and
// the transaction rolls back for sure. InTx reported ErrCommitOutcomeUnknown, which tells the
// caller it cannot know and invites a look or a retry it does not need.
func TestInTxCommitNotSentIsNoUnknownOutcome(t *testing.T) {
	pool := openPool(t, outboxtest.DSN(t), 4, nil)
	ctx := context.Background()
	ob := ready(t, pool, outbox.Config{Publisher: &outboxtest.Recorder{}, RelayInterval: time.Hour})
	err := outboxpgx.InTx(ctx, ob, func(ctx context.Context, tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, `INSERT INTO applied (message_id) VALUES ('business')`); err != nil {
			return err
		}
		_, err := tx.Query(ctx, `SELECT generate_series(1, 10)`) // left open
		return err
	})
	if err == nil || errors.Is(err, outbox.ErrCommitOutcomeUnknown) {
		t.Errorf("InTx: %v; want a rollback, not an unknown outcome", err)
	}
	var applied int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM applied`).Scan(&applied); err != nil || applied != 0 {
		t.Errorf("%d business rows (%v); want none", applied, err)
	}
}

// A handler that sends COMMIT (and, in one case, BEGIN after it) and then fails, or outlasts
// HandlerTimeout, committed the unit's claim and its business writes in the pessimistic mode, but
// not the effects, which waited in memory for the framework's COMMIT. The framework rolled back
// what was left and forgot them: the redelivery found the message processed with nothing
// pending, and the effect of the committed write was never sent. Now the rollback, too, stores
// them once the unit's claim is found committed, and the redelivery sends them.
func TestSQLCommitThenFail(t *testing.T) {
	cases := map[string]struct {
		stmts []string
		slow  bool // outlasts HandlerTimeout instead of failing
	}{
		"COMMIT then an error":        {stmts: []string{"COMMIT"}},
		"COMMIT; BEGIN then an error": {stmts: []string{"COMMIT; BEGIN"}},
		"COMMIT then HandlerTimeout":  {stmts: []string{"COMMIT"}, slow: true},
	}
	for name, c := range cases {
		t.Run(name, func(t *testing.T) {
			h := outboxtest.NewWith(t, form(outboxpgx.Pessimistic), outbox.Config{RelayInterval: time.Hour, HandlerTimeout: time.Second}, setup)
			res := h.Run("c", message.NewMessage("m1", nil), consume(func(msg *message.Message) error {
				ctx := msg.Context()
				if err := handler(msg); err != nil { // a business row and an effect, committed by the handler
					return err
				}
				for _, stmt := range c.stmts {
					if _, err := outboxpgx.Tx(ctx).Exec(ctx, stmt); err != nil {
						return err
					}
				}
				if c.slow {
					<-ctx.Done()
					time.Sleep(100 * time.Millisecond)
					return ctx.Err()
				}
				return errors.New("the handler failed after its COMMIT")
			}))
			if !errors.Is(res.Err, outbox.ErrTxFinishedByHandler) {
				t.Errorf("Handle %v; want ErrTxFinishedByHandler", res.Err)
			}
			sent := len(res.Sent)
			again := h.Run("c", message.NewMessage("m1", nil), consume(handler))
			if again.Err != nil {
				t.Fatalf("the redelivery: %v", again.Err)
			}
			sent += len(again.Sent)
			if sent != 1 {
				t.Errorf("the effect committed with its claim was sent %d times; want once", sent)
			}
			if n := count(t, h.DB, "m1"); n != 1 {
				t.Errorf("%d business rows, want the one committed by the handler", n)
			}
		})
	}
}

// In InTx a fn that sends COMMIT and then fails committed what it wrote: InTx says so
// (ErrTxFinishedByHandler), as on database/sql, rather than return fn's error alone, which a
// caller retries, doing the work twice.
func TestInTxSQLCommitThenFail(t *testing.T) {
	pool := openPool(t, outboxtest.DSN(t), 4, nil)
	ctx := context.Background()
	ob := ready(t, pool, outbox.Config{Publisher: &outboxtest.Recorder{}, RelayInterval: time.Hour})
	failed := errors.New("fn failed after its COMMIT")
	err := outboxpgx.InTx(ctx, ob, func(ctx context.Context, tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, `INSERT INTO applied (message_id) VALUES ('business')`); err != nil {
			return err
		}
		if _, err := tx.Exec(ctx, `COMMIT`); err != nil {
			return err
		}
		return failed
	})
	if !errors.Is(err, outbox.ErrTxFinishedByHandler) || !errors.Is(err, failed) {
		t.Errorf("InTx returned %v, want ErrTxFinishedByHandler and fn's error", err)
	}
}

// After a handler's own COMMIT, Commit stores the effects beside the committed claim. It did so
// on what was left of HandlerTimeout: an insert that waited on a lock past it failed, the
// redelivery found the message processed with nothing pending, and the effect was lost. It now
// has the cleanup bound of its own, as the other stores after a handler's SQL have.
func TestSQLCommitThenReturnStoresPastHandlerTimeout(t *testing.T) {
	h := outboxtest.NewWith(t, form(outboxpgx.Pessimistic), outbox.Config{RelayInterval: time.Hour, HandlerTimeout: time.Second}, setup)
	ctx := context.Background()
	locker, err := h.DB.Conn(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer locker.Close()
	release := make(chan struct{})
	res := h.Run("c", message.NewMessage("m1", nil), consume(func(msg *message.Message) error {
		ctx := msg.Context()
		if err := handler(msg); err != nil {
			return err
		}
		if _, err := outboxpgx.Tx(ctx).Exec(ctx, "COMMIT"); err != nil {
			return err
		}
		// The effects table is held past HandlerTimeout (by 0.8 s) from now on.
		if _, err := locker.ExecContext(context.Background(), `BEGIN; LOCK TABLE outbox_effects_all IN ACCESS EXCLUSIVE MODE`); err != nil {
			return err
		}
		go func() {
			time.Sleep(1800 * time.Millisecond)
			_, _ = locker.ExecContext(context.Background(), `COMMIT`)
			close(release)
		}()
		return nil
	}))
	<-release
	if !errors.Is(res.Err, outbox.ErrTxFinishedByHandler) {
		t.Errorf("Handle %v; want ErrTxFinishedByHandler", res.Err)
	}
	sent := len(res.Sent)
	again := h.Run("c", message.NewMessage("m1", nil), consume(handler))
	if again.Err != nil {
		t.Fatalf("the redelivery: %v", again.Err)
	}
	if sent += len(again.Sent); sent != 1 {
		t.Errorf("the effect committed with its claim was sent %d times; want once (%v)", sent, res.Err)
	}
}
