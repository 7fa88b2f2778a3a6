package outbox_test

import (
	"context"
	"database/sql"
	"errors"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"

	"github.com/watermill-outbox/outbox"
)

// A boundary unit (InTx: no incoming message, so no claim to guard its writes) whose fn ends the
// transaction with SQL sent through it and then records. The record ran in autocommit (or, after
// "ROLLBACK; BEGIN", in a transaction of the fn's own): an effect committed on its own, sent
// although the business write before it was rolled back, and after "ROLLBACK; BEGIN" InTx
// reported success. Every write of the unit must find the transaction InTx began, or write nothing.
func TestInTxEndedBySQLThenRecordWritesNothing(t *testing.T) {
	type record func(ctx context.Context) error
	publish := func(ctx context.Context) error {
		return outbox.Publish(ctx, "out_b", message.NewMessage(uuid.NewString(), []byte("after")))
	}
	records := map[string]record{
		"publish": publish,
		"own-key": func(ctx context.Context) error { return publish(outbox.WithOrderingKey(ctx, "own-key")) },
		"delayed": func(ctx context.Context) error { return publish(outbox.WithDelay(ctx, time.Hour)) },
		"cancel": func(ctx context.Context) error {
			_, err := outbox.CancelDelayed(ctx, "reminder-1")
			return err
		},
	}
	for _, stmt := range []string{"ROLLBACK", "COMMIT", "ROLLBACK; BEGIN"} {
		for name, rec := range records {
			t.Run(stmt+"/"+name, func(t *testing.T) {
				e := newEnv(t)
				// Another unit's delayed effect, which a cancel in autocommit would delete.
				if err := e.ob.InTx(context.Background(), func(ctx context.Context, _ *sql.Tx) error {
					return outbox.Publish(outbox.WithCancelKey(outbox.WithDelay(ctx, time.Hour), "reminder-1"), "out_a", message.NewMessage(uuid.NewString(), nil))
				}); err != nil {
					t.Fatal(err)
				}
				var after error
				err := e.ob.InTx(context.Background(), func(ctx context.Context, tx *sql.Tx) error {
					if _, err := tx.ExecContext(ctx, `INSERT INTO applied (message_id) VALUES ('business')`); err != nil {
						return err
					}
					if err := outbox.Publish(ctx, "out_a", message.NewMessage(uuid.NewString(), []byte("before"))); err != nil {
						return err
					}
					if _, err := tx.ExecContext(ctx, stmt); err != nil {
						return err
					}
					after = rec(ctx)
					return nil // fn does not look: the unit must not commit what it cannot
				})
				if !errors.Is(after, outbox.ErrTxFinishedByHandler) {
					t.Errorf("the record after %s returned %v, want ErrTxFinishedByHandler", stmt, after)
				}
				if !errors.Is(err, outbox.ErrTxFinishedByHandler) {
					t.Errorf("InTx returned %v, want ErrTxFinishedByHandler", err)
				}
				mustEqual(t, "effects recorded after "+stmt, e.count(`SELECT count(*) FROM all_effects WHERE topic = 'out_b'`)+
					e.count(`SELECT count(*) FROM outbox_delayed WHERE topic = 'out_b'`), 0)
				mustEqual(t, "the other unit's delayed effect", e.count(`SELECT count(*) FROM outbox_delayed WHERE cancel_key = 'reminder-1'`), 1)
				mustEqual(t, "sent", len(e.wire("out_b")), 0)
				// What fn wrote before a COMMIT of its own committed, its effect with it (the relay
				// sends it); before a ROLLBACK, nothing did.
				committed := 0
				if stmt == "COMMIT" {
					committed = 1
				}
				mustEqual(t, "business rows", e.count(`SELECT count(*) FROM applied`), committed)
				mustEqual(t, "effects recorded before "+stmt, e.count(`SELECT count(*) FROM all_effects WHERE topic = 'out_a'`), committed)
			})
		}
	}
}

// A fn that commits the transaction itself and then returns an error: its writes and effects are
// committed, but InTx returned fn's error alone, which says nothing committed, and a caller that
// retries did the work twice. InTx says the transaction was finished by fn, with fn's error.
func TestInTxFnCommitsThenFails(t *testing.T) {
	e := newEnv(t)
	failed := errors.New("fn failed after its own commit")
	err := e.ob.InTx(context.Background(), func(ctx context.Context, tx *sql.Tx) error {
		if _, err := tx.ExecContext(ctx, `INSERT INTO applied (message_id) VALUES ('business')`); err != nil {
			return err
		}
		if err := tx.Commit(); err != nil {
			return err
		}
		return failed
	})
	if !errors.Is(err, outbox.ErrTxFinishedByHandler) || !errors.Is(err, failed) {
		t.Errorf("InTx: %v; want ErrTxFinishedByHandler with fn's error", err)
	}
	mustEqual(t, "business rows committed by fn", e.count(`SELECT count(*) FROM applied`), 1)
	// A keyed unit whose fn commits and returns nil: the key's result is not stored, and InTx
	// says why.
	err = e.ob.InTx(outbox.WithIdempotencyKey(context.Background(), "orders", "k1"), func(ctx context.Context, tx *sql.Tx) error {
		return tx.Commit()
	})
	if !errors.Is(err, outbox.ErrTxFinishedByHandler) {
		t.Errorf("keyed InTx whose fn committed: %v; want ErrTxFinishedByHandler", err)
	}
}

// fn panics while a goroutine of its own goes on recording: the unit rolled back, but stayed
// open to records, so the goroutine's Publish went to the store on a rolled-back transaction
// (a store error, or on some drivers a write after the unit's end) instead of being told that
// the unit is over.
func TestInTxPanicEndsTheUnit(t *testing.T) {
	e := newEnv(t)
	proceed, recorded := make(chan struct{}), make(chan error, 1)
	func() {
		defer func() {
			if r := recover(); r != "fn panicked" {
				t.Errorf("recovered %v, want fn's panic", r)
			}
		}()
		_ = e.ob.InTx(context.Background(), func(ctx context.Context, tx *sql.Tx) error {
			go func() {
				<-proceed
				recorded <- outbox.Publish(ctx, "out_a", message.NewMessage(uuid.NewString(), nil))
			}()
			panic("fn panicked")
		})
	}()
	close(proceed)
	if err := <-recorded; !errors.Is(err, outbox.ErrUnitOfWorkFinished) {
		t.Errorf("Publish after fn panicked: %v, want ErrUnitOfWorkFinished", err)
	}
	mustEqual(t, "effects stored", e.count(`SELECT count(*) FROM outbox_effects_all`), 0)
}
