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

// A consumer's unit of work whose handler ends the transaction with SQL sent through its pgx.Tx
// and then records a delayed effect, or cancels another unit's. Ordinary effects wait in memory
// for the unit's COMMIT, which looks at the connection; delayed inserts and cancels are written at
// once, and ran in autocommit: after a ROLLBACK a delayed effect of rolled-back work committed on
// its own, once more at every delivery, and a cancel deleted another unit's delayed effect.
//
// After a COMMIT sent as SQL the pessimistic mode's claim committed with the handler's writes:
// what the handler records after it is stored beside it, as the database/sql form does. The
// optimistic mode's claim is written at the framework's commit, which never comes: the record is
// refused, as the effects are, since the message runs again.
func TestSQLEndedThenDelayedEffects(t *testing.T) {
	records := map[string]func(ctx context.Context) error{
		"delayed": func(ctx context.Context) error {
			return outbox.Publish(outbox.WithDelay(ctx, time.Hour), "out_b", message.NewMessage("after", nil))
		},
		"cancel": func(ctx context.Context) error {
			_, err := outbox.CancelDelayed(ctx, "reminder-1")
			return err
		},
	}
	for _, stmt := range []string{"ROLLBACK", "COMMIT"} {
		for mname, mode := range modes {
			for rname, rec := range records {
				t.Run(stmt+"/"+mname+"/"+rname, func(t *testing.T) {
					h := outboxtest.NewWith(t, form(mode), outbox.Config{RelayInterval: time.Hour}, setup)
					// Another unit's delayed effect, which a cancel in autocommit would delete.
					if err := outboxpgx.InTx(context.Background(), h.Ob, func(ctx context.Context, _ pgx.Tx) error {
						return outbox.Publish(outbox.WithCancelKey(outbox.WithDelay(ctx, time.Hour), "reminder-1"), "out_a", message.NewMessage("other", nil))
					}); err != nil {
						t.Fatal(err)
					}
					// Kept (pessimistic COMMIT): the record after the COMMIT is stored beside the committed claim.
					kept := stmt == "COMMIT" && mode == outboxpgx.Pessimistic
					deliveries := 2
					if kept {
						deliveries = 1 // the second is a duplicate, which runs no handler
					}
					for i := 1; i <= deliveries; i++ {
						var after error
						res := h.Run("c", message.NewMessage("m1", nil), consume(func(msg *message.Message) error {
							ctx := msg.Context()
							if err := handler(msg); err != nil {
								return err
							}
							if _, err := outboxpgx.Tx(ctx).Exec(ctx, stmt); err != nil {
								return err
							}
							after = rec(ctx)
							return nil // the handler does not look: the framework must not ack what it cannot
						}))
						if kept {
							if after != nil || !errors.Is(res.Err, outbox.ErrTxFinishedByHandler) || !res.Committed {
								t.Fatalf("delivery %d: the record after %s returned %v; Handle %v, committed %v; want nil, ErrTxFinishedByHandler, true",
									i, stmt, after, res.Err, res.Committed)
							}
						} else {
							if !errors.Is(after, outbox.ErrTxFinishedByHandler) {
								t.Errorf("delivery %d: the record after %s returned %v, want ErrTxFinishedByHandler", i, stmt, after)
							}
							if !errors.Is(res.Err, outbox.ErrTxFinishedByHandler) || res.Committed || len(res.Sent) != 0 {
								t.Errorf("delivery %d: Handle %v, committed %v, sent %d; want ErrTxFinishedByHandler, not processed, nothing sent",
									i, res.Err, res.Committed, len(res.Sent))
							}
						}
					}
					var delayed, other, attempts int
					if err := h.DB.QueryRow(`SELECT (SELECT count(*) FROM outbox_delayed WHERE topic = 'out_b'),
						(SELECT count(*) FROM outbox_delayed WHERE cancel_key = 'reminder-1'),
						(SELECT coalesce(sum(attempts), 0) FROM outbox_attempts)`).Scan(&delayed, &other, &attempts); err != nil {
						t.Fatal(err)
					}
					wantDelayed, wantOther, wantAttempts := 0, 1, 0
					switch {
					case kept && rname == "delayed":
						wantDelayed = 1
					case kept:
						wantOther = 0
					default:
						wantAttempts = deliveries // failed attempts, counted
					}
					if delayed != wantDelayed || other != wantOther || attempts != wantAttempts {
						t.Errorf("after %s: %d delayed effects recorded after it, the other unit's %d, %d attempts counted; want %d, %d, %d",
							stmt, delayed, other, attempts, wantDelayed, wantOther, wantAttempts)
					}
				})
			}
		}
	}
}

// After a ROLLBACK sent as SQL a copy of the message claims it and commits before the handler
// records a delayed effect: the pessimistic unit's record looks for the claim its own transaction
// inserted, not any claim of the message, and writes nothing beside the copy's.
func TestSQLRollbackThenACopyClaimsThenDelayed(t *testing.T) {
	h := outboxtest.NewWith(t, form(outboxpgx.Pessimistic), outbox.Config{RelayInterval: time.Hour}, setup)
	var after error
	var copyRes outboxtest.Result
	res := h.Run("c", message.NewMessage("m1", nil), consume(func(msg *message.Message) error {
		ctx := msg.Context()
		if _, err := outboxpgx.Tx(ctx).Exec(ctx, "ROLLBACK"); err != nil {
			return err
		}
		copyRes = h.Run("c", message.NewMessage("m1", nil), consume(handler))
		after = outbox.Publish(outbox.WithDelay(ctx, time.Hour), "out_b", message.NewMessage("after", nil))
		return nil
	}))
	if copyRes.Err != nil || !copyRes.Committed {
		t.Fatalf("the copy: %v, committed %v", copyRes.Err, copyRes.Committed)
	}
	if !errors.Is(after, outbox.ErrTxFinishedByHandler) || !errors.Is(res.Err, outbox.ErrTxFinishedByHandler) {
		t.Errorf("the record after ROLLBACK returned %v, Handle %v; want ErrTxFinishedByHandler", after, res.Err)
	}
	var delayed int
	if err := h.DB.QueryRow(`SELECT count(*) FROM outbox_delayed WHERE topic = 'out_b'`).Scan(&delayed); err != nil {
		t.Fatal(err)
	}
	if delayed != 0 {
		t.Errorf("%d delayed effects of the rolled-back attempt stored beside the copy's claim, want 0", delayed)
	}
}

// After a COMMIT sent as SQL the pessimistic unit's claim is committed, and a delayed effect or a
// cancel recorded after it is written beside it (TestSQLEndedThenDelayedEffects). The unit finds
// its claim by the transaction ID the claim statement returned, not by a setting of the session:
// a session whose settings changed since (RESET ALL, or behind a pooler in transaction mode
// another server connection) still finds it. The same when the handler runs on past
// HandlerTimeout, whose connection is closed: the pool is asked, as for the ordinary effects. A
// record refused there would be lost for good: the redelivery is a duplicate, which runs no
// handler.
func TestSQLCommitThenDelayedFindsItsOwnClaim(t *testing.T) {
	records := map[string]func(ctx context.Context) error{
		"delayed": func(ctx context.Context) error {
			return outbox.Publish(outbox.WithDelay(ctx, time.Hour), "out_b", message.NewMessage("after", nil))
		},
		"cancel": func(ctx context.Context) error {
			_, err := outbox.CancelDelayed(ctx, "reminder-1")
			return err
		},
	}
	afterCommit := map[string]func(ctx context.Context) error{
		"RESET ALL": func(ctx context.Context) error {
			_, err := outboxpgx.Tx(ctx).Exec(ctx, "RESET ALL")
			return err
		},
		"past HandlerTimeout": func(ctx context.Context) error {
			<-ctx.Done() // then ignores that it ended
			time.Sleep(100 * time.Millisecond)
			return nil
		},
	}
	for aname, then := range afterCommit {
		for rname, rec := range records {
			t.Run(aname+"/"+rname, func(t *testing.T) {
				h := outboxtest.NewWith(t, form(outboxpgx.Pessimistic), outbox.Config{HandlerTimeout: time.Second, RelayInterval: time.Hour}, setup)
				if err := outboxpgx.InTx(context.Background(), h.Ob, func(ctx context.Context, _ pgx.Tx) error {
					return outbox.Publish(outbox.WithCancelKey(outbox.WithDelay(ctx, time.Hour), "reminder-1"), "out_a", message.NewMessage("other", nil))
				}); err != nil {
					t.Fatal(err)
				}
				var after error
				res := h.Run("c", message.NewMessage("m1", nil), consume(func(msg *message.Message) error {
					ctx := msg.Context()
					if err := handler(msg); err != nil {
						return err
					}
					if _, err := outboxpgx.Tx(ctx).Exec(ctx, "COMMIT"); err != nil {
						return err
					}
					if err := then(ctx); err != nil {
						return err
					}
					after = rec(ctx)
					return nil
				}))
				if after != nil || !errors.Is(res.Err, outbox.ErrTxFinishedByHandler) || !res.Committed {
					t.Fatalf("the record after COMMIT returned %v; Handle %v, committed %v; want nil, ErrTxFinishedByHandler, true", after, res.Err, res.Committed)
				}
				var delayed, other int
				if err := h.DB.QueryRow(`SELECT (SELECT count(*) FROM outbox_delayed WHERE topic = 'out_b'),
					(SELECT count(*) FROM outbox_delayed WHERE cancel_key = 'reminder-1')`).Scan(&delayed, &other); err != nil {
					t.Fatal(err)
				}
				wantDelayed, wantOther := 0, 0
				if rname == "delayed" {
					wantDelayed, wantOther = 1, 1
				}
				if delayed != wantDelayed || other != wantOther {
					t.Errorf("%d delayed effects recorded after the COMMIT, the other unit's %d; want %d, %d", delayed, other, wantDelayed, wantOther)
				}
			})
		}
	}
}

// The same record past HandlerTimeout on a pool of one connection (docs/pgx.md: a pool of one
// works): the record runs on the pool once the unit's connection is closed, and that connection,
// its socket closed, still counted as taken until the unit ended, so the record waited for
// itself for cleanupTimeout and failed: the delayed effect of a committed change was lost.
func TestSQLCommitThenDelayedPastHandlerTimeoutOnAPoolOfOne(t *testing.T) {
	one := func(t testing.TB, dsn string, cfg outbox.Config) (*outbox.Outbox, error) {
		return newOutbox(t, openPool(t, dsn, 1, nil), cfg, outboxpgx.WithConcurrency(outboxpgx.Pessimistic))
	}
	h := outboxtest.NewWith(t, one, outbox.Config{HandlerTimeout: time.Second, RelayInterval: time.Hour}, setup)
	var after error
	res := h.Run("c", message.NewMessage("m1", nil), consume(func(msg *message.Message) error {
		ctx := msg.Context()
		if err := handler(msg); err != nil {
			return err
		}
		if _, err := outboxpgx.Tx(ctx).Exec(ctx, "COMMIT"); err != nil {
			return err
		}
		<-ctx.Done() // then ignores that it ended
		time.Sleep(100 * time.Millisecond)
		after = outbox.Publish(outbox.WithDelay(ctx, time.Hour), "out_b", message.NewMessage("after", nil))
		return nil
	}))
	if after != nil || !errors.Is(res.Err, outbox.ErrTxFinishedByHandler) || !res.Committed {
		t.Fatalf("the delayed record after COMMIT and HandlerTimeout returned %v; Handle %v, committed %v; want nil, ErrTxFinishedByHandler, true", after, res.Err, res.Committed)
	}
	var delayed int
	if err := h.DB.QueryRow(`SELECT count(*) FROM outbox_delayed WHERE topic = 'out_b'`).Scan(&delayed); err != nil {
		t.Fatal(err)
	}
	if delayed != 1 {
		t.Errorf("%d delayed effects recorded after the COMMIT, want 1", delayed)
	}
}
