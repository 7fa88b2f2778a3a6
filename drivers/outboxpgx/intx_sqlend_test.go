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

// A boundary unit (InTx) whose fn ends the transaction with COMMIT or ROLLBACK sent through its
// pgx.Tx and then records. Effects wait in memory for the unit's COMMIT, which finds the
// transaction ended; but delayed effects and cancels are written at once, and ran in autocommit:
// a delayed effect committed although the business write was rolled back, and a cancel deleted
// another unit's delayed effect on its own.
func TestInTxEndedBySQLThenRecordWritesNothing(t *testing.T) {
	publish := func(ctx context.Context) error {
		return outbox.Publish(ctx, "out_b", message.NewMessage("after", nil))
	}
	records := map[string]func(ctx context.Context) error{
		"publish": publish,
		"own-key": func(ctx context.Context) error { return publish(outbox.WithOrderingKey(ctx, "own-key")) },
		"delayed": func(ctx context.Context) error { return publish(outbox.WithDelay(ctx, time.Hour)) },
		"cancel": func(ctx context.Context) error {
			_, err := outbox.CancelDelayed(ctx, "reminder-1")
			return err
		},
	}
	for _, stmt := range []string{"ROLLBACK", "COMMIT"} {
		for name, rec := range records {
			t.Run(stmt+"/"+name, func(t *testing.T) {
				pool := openPool(t, outboxtest.DSN(t), 4, nil)
				ctx := context.Background()
				sent := &outboxtest.Recorder{}
				ob := ready(t, pool, outbox.Config{Publisher: sent, RelayInterval: time.Hour})
				// Another unit's delayed effect, which a cancel in autocommit would delete.
				if err := outboxpgx.InTx(ctx, ob, func(ctx context.Context, _ pgx.Tx) error {
					return outbox.Publish(outbox.WithCancelKey(outbox.WithDelay(ctx, time.Hour), "reminder-1"), "out_a", message.NewMessage("other", nil))
				}); err != nil {
					t.Fatal(err)
				}
				var after error
				err := outboxpgx.InTx(ctx, ob, func(ctx context.Context, tx pgx.Tx) error {
					if _, err := tx.Exec(ctx, `INSERT INTO applied (message_id) VALUES ('business')`); err != nil {
						return err
					}
					if _, err := tx.Exec(ctx, stmt); err != nil {
						return err
					}
					after = rec(ctx)
					return nil // fn does not look: the unit must not commit what it cannot
				})
				// An effect waits in memory (the unit's COMMIT refuses it); what is written at once
				// must be refused at once.
				if atOnce := name == "delayed" || name == "cancel"; atOnce && !errors.Is(after, outbox.ErrTxFinishedByHandler) {
					t.Errorf("the record after %s returned %v, want ErrTxFinishedByHandler", stmt, after)
				}
				if !errors.Is(err, outbox.ErrTxFinishedByHandler) {
					t.Errorf("InTx returned %v, want ErrTxFinishedByHandler", err)
				}
				var effects, delayed, other int
				if err := pool.QueryRow(ctx, `SELECT (SELECT count(*) FROM outbox_effects_all WHERE topic = 'out_b'),
					(SELECT count(*) FROM outbox_delayed WHERE topic = 'out_b'),
					(SELECT count(*) FROM outbox_delayed WHERE cancel_key = 'reminder-1')`).Scan(&effects, &delayed, &other); err != nil {
					t.Fatal(err)
				}
				if effects != 0 || delayed != 0 || other != 1 || len(sent.Messages("out_b")) != 0 {
					t.Errorf("after %s: %d effect rows, %d delayed, %d sent; the other unit's delayed effect %d; want 0, 0, 0 and 1",
						stmt, effects, delayed, len(sent.Messages("out_b")), other)
				}
			})
		}
	}
}
