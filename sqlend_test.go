package outbox_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"

	"github.com/watermill-outbox/outbox"
)

// endWithSQL is a handler that writes a business row, records an effect, ends the unit's
// transaction with stmt (ROLLBACK or COMMIT) sent through it, and then records another effect,
// with the default ordering key or, when key is set, one of its own (an effect row). What the
// second record returned goes to after; the handler returns it when told to, and nil otherwise.
func endWithSQL(stmt, key string, after *error, returnIt bool) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		ctx := msg.Context()
		tx := outbox.Tx(ctx)
		if _, err := tx.ExecContext(ctx, `INSERT INTO applied (message_id) VALUES ($1)`, msg.UUID); err != nil {
			return nil, err
		}
		if err := outbox.Publish(ctx, "out_a", message.NewMessage(uuid.NewString(), []byte(`before`))); err != nil {
			return nil, err
		}
		if _, err := tx.ExecContext(ctx, stmt); err != nil {
			return nil, err
		}
		if key != "" {
			ctx = outbox.WithOrderingKey(ctx, key)
		}
		*after = outbox.Publish(ctx, "out_b", message.NewMessage(uuid.NewString(), []byte(`after`)))
		if returnIt {
			return nil, *after
		}
		return nil, nil // the handler does not look: the framework must not commit what it cannot
	}
}

// Issue 45, item 4: a handler that sent ROLLBACK as SQL and then published. The record found no
// claim and wrote the effect as a row in autocommit, which committed; lib/pq then refused the
// framework's COMMIT ("unexpected transaction status idle"), which was taken for a lost
// connection: every delivery committed one more escaped effect, and none counted, so the message
// never reached MaxAttempts.
func TestRollbackSentAsSQLThenPublishWritesNothingAndCounts(t *testing.T) {
	for _, v := range []struct {
		key      string
		returnIt bool
	}{{"", false}, {"own-key", false}, {"", true}} {
		key := v.key
		t.Run(fmt.Sprintf("key=%s,returns=%v", key, v.returnIt), func(t *testing.T) {
			e := newEnv(t, func(c *outbox.Config) { c.MaxAttempts = 3; c.PoisonTopic = "poison"; c.RetryDelay = 1 })
			msg := message.NewMessage(uuid.NewString(), nil)
			for i := 1; i <= 3; i++ {
				var after error
				err := handle(e.ob, copyOf(msg), endWithSQL("ROLLBACK", key, &after, v.returnIt))
				if !errors.Is(after, outbox.ErrTxFinishedByHandler) {
					t.Fatalf("delivery %d: Publish after ROLLBACK returned %v, want ErrTxFinishedByHandler", i, after)
				}
				if i < 3 && !errors.Is(err, outbox.ErrTxFinishedByHandler) {
					t.Fatalf("delivery %d: want ErrTxFinishedByHandler, got %v", i, err)
				}
				if i == 3 && err != nil {
					t.Fatalf("delivery %d: want the message poisoned and acked, got %v", i, err)
				}
			}
			// The copy for the poison topic is an effect row of the dead letter's transaction.
			mustEqual(t, "effect rows written", e.count(`SELECT count(*) FROM all_effects WHERE topic <> 'poison'`), 0)
			mustEqual(t, "claims holding effects", e.count(`SELECT count(*) FROM outbox_processed WHERE effects IS NOT NULL`), 0)
			mustEqual(t, "business rows", e.count(`SELECT count(*) FROM applied`), 0)
			mustEqual(t, "poisoned", len(e.wire("poison")), 1)
			mustEqual(t, "effects sent", len(e.wire("out_a"))+len(e.wire("out_b")), 0)
		})
	}
}

// A handler that sent ROLLBACK as SQL and nothing after: lib/pq refuses the framework's COMMIT
// before sending it. That is the handler's doing, counted, not an unknown outcome.
func TestRollbackSentAsSQLIsCountedNotUnknown(t *testing.T) {
	e := newEnv(t)
	msg := message.NewMessage(uuid.NewString(), nil)
	h := func(msg *message.Message) ([]*message.Message, error) {
		ctx := msg.Context()
		if _, err := outbox.Tx(ctx).ExecContext(ctx, `INSERT INTO applied (message_id) VALUES ($1)`, msg.UUID); err != nil {
			return nil, err
		}
		_, err := outbox.Tx(ctx).ExecContext(ctx, "ROLLBACK")
		return nil, err
	}
	err := handle(e.ob, copyOf(msg), h)
	if !errors.Is(err, outbox.ErrTxFinishedByHandler) || errors.Is(err, outbox.ErrCommitOutcomeUnknown) {
		t.Fatalf("want ErrTxFinishedByHandler, got %v", err)
	}
	mustEqual(t, "attempts counted", e.count(`SELECT coalesce(sum(attempts), 0) FROM outbox_attempts`), 1)
	mustEqual(t, "business rows", e.count(`SELECT count(*) FROM applied`), 0)
}

// A handler that sent COMMIT as SQL and then published: its claim and business change committed,
// and what it records after the COMMIT is stored with the claim, as its later business writes
// are, and sent on redelivery. lib/pq refuses the framework's COMMIT: that is the handler's doing,
// reported as ErrTxFinishedByHandler, not a commit lost in flight ("connection lost during COMMIT").
func TestCommitSentAsSQLThenPublishIsTheHandlersDoing(t *testing.T) {
	for _, key := range []string{"", "own-key"} {
		t.Run("key="+key, func(t *testing.T) {
			e := newEnv(t)
			msg := message.NewMessage(uuid.NewString(), nil)
			var after error
			err := handle(e.ob, copyOf(msg), endWithSQL("COMMIT", key, &after, false))
			if after != nil {
				t.Fatalf("Publish after COMMIT: %v", after)
			}
			if !errors.Is(err, outbox.ErrTxFinishedByHandler) || errors.Is(err, outbox.ErrCommitOutcomeUnknown) {
				t.Fatalf("want ErrTxFinishedByHandler, got %v", err)
			}
			mustEqual(t, "attempts counted", e.count(`SELECT coalesce(sum(attempts), 0) FROM outbox_attempts`), 0)
			if err := handle(e.ob, copyOf(msg), endWithSQL("COMMIT", key, &after, false)); err != nil {
				t.Fatalf("redelivery: %v", err)
			}
			mustEqual(t, "business rows", e.count(`SELECT count(*) FROM applied`), 1)
			mustEqual(t, "sent before the COMMIT", len(e.wire("out_a")), 1)
			mustEqual(t, "sent after the COMMIT", len(e.wire("out_b")), 1)
		})
	}
}

// Delayed effects after a ROLLBACK sent as SQL: the insert of a delayed effect and the cancel of
// delayed effects by key would run in autocommit, on their own: a delayed effect without its
// business change, once more at every delivery, and a cancel of effects that another unit
// committed. Both find the claim gone and do nothing.
func TestRollbackSentAsSQLThenDelayedEffects(t *testing.T) {
	e := newEnv(t)
	if err := e.ob.InTx(context.Background(), func(ctx context.Context, _ *sql.Tx) error {
		return outbox.Publish(outbox.WithCancelKey(outbox.WithDelay(ctx, time.Hour), "reminder-1"), "out_a", message.NewMessage(uuid.NewString(), nil))
	}); err != nil {
		t.Fatal(err)
	}
	msg := message.NewMessage(uuid.NewString(), nil)
	var delayed, cancel error
	h := func(msg *message.Message) ([]*message.Message, error) {
		ctx := msg.Context()
		if _, err := outbox.Tx(ctx).ExecContext(ctx, "ROLLBACK"); err != nil {
			return nil, err
		}
		delayed = outbox.Publish(outbox.WithDelay(ctx, time.Hour), "out_a", message.NewMessage(uuid.NewString(), nil))
		_, cancel = outbox.CancelDelayed(ctx, "reminder-1")
		return nil, nil
	}
	err := handle(e.ob, copyOf(msg), h)
	if !errors.Is(delayed, outbox.ErrTxFinishedByHandler) || !errors.Is(cancel, outbox.ErrTxFinishedByHandler) {
		t.Errorf("after ROLLBACK: delayed Publish returned %v, CancelDelayed %v; want ErrTxFinishedByHandler", delayed, cancel)
	}
	if !errors.Is(err, outbox.ErrTxFinishedByHandler) {
		t.Errorf("want ErrTxFinishedByHandler, got %v", err)
	}
	mustEqual(t, "delayed effects", e.count(`SELECT count(*) FROM outbox_delayed`), 1) // the other unit's, not cancelled
	mustEqual(t, "attempts counted", e.count(`SELECT coalesce(sum(attempts), 0) FROM outbox_attempts`), 1)
}

// A copy of the message that claims and commits between the handler's ROLLBACK (sent as SQL) and
// its next record: the record, in autocommit, must not find the copy's claim, or it writes an
// effect of rolled-back work beside (or into) it, committed on its own. The claim it looks for is
// the one its own transaction inserted (postgres.OwnClaim), not any claim of the message.
func TestRollbackSentAsSQLThenACopyClaims(t *testing.T) {
	for _, key := range []string{"", "own-key"} { // into the claim, or as a row
		t.Run("key="+key, func(t *testing.T) {
			e := newEnv(t)
			msg := message.NewMessage(uuid.NewString(), nil)
			var after error
			err := handle(e.ob, copyOf(msg), func(m *message.Message) ([]*message.Message, error) {
				ctx := m.Context()
				if _, err := outbox.Tx(ctx).ExecContext(ctx, `ROLLBACK`); err != nil {
					return nil, err
				}
				// A copy is delivered meanwhile and processed from start to finish.
				if err := handle(e.ob, copyOf(msg), func(c *message.Message) ([]*message.Message, error) {
					cctx := c.Context()
					if _, err := outbox.Tx(cctx).ExecContext(cctx, `INSERT INTO applied (message_id) VALUES ($1)`, c.UUID); err != nil {
						return nil, err
					}
					return nil, outbox.Publish(cctx, "out_a", message.NewMessage(uuid.NewString(), []byte("copy")))
				}); err != nil {
					return nil, err
				}
				e.ob.FlushMarks()
				if key != "" {
					ctx = outbox.WithOrderingKey(ctx, key)
				}
				after = outbox.Publish(ctx, "out_b", message.NewMessage(uuid.NewString(), []byte("after the rollback")))
				return nil, after
			})
			if !errors.Is(after, outbox.ErrTxFinishedByHandler) || !errors.Is(err, outbox.ErrTxFinishedByHandler) {
				t.Errorf("record after the ROLLBACK, with the copy's claim committed: %v (Handle: %v), want ErrTxFinishedByHandler", after, err)
			}
			mustEqual(t, "effects of the rolled-back delivery stored", e.count(`SELECT count(*) FROM all_effects WHERE topic = 'out_b'`)+
				e.count(`SELECT count(*) FROM outbox_processed WHERE effects IS NOT NULL`), 0)
			mustEqual(t, "business rows", e.count(`SELECT count(*) FROM applied`), 1)
			mustEqual(t, "the copy's effect sent", len(e.wire("out_a")), 1)
		})
	}
}
