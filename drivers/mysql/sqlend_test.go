package mysql_test

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/watermill-outbox/outbox"
	"github.com/watermill-outbox/outbox/drivers/mysql"
	"github.com/watermill-outbox/outbox/outboxtest"
)

// TestRollbackSentAsSQLThenPublish (issue 45, item 4, on MySQL and MariaDB): a handler that sends
// ROLLBACK through the unit's *sql.Tx and then publishes. The session then runs in autocommit:
// nothing may be written outside the unit's transaction, nothing sent for the rolled-back work,
// and the failure is the handler's, counted.
func TestRollbackSentAsSQLThenPublish(t *testing.T) {
	db := openAt(t, isolations[0])
	pub := &outboxtest.Recorder{}
	ob, err := outbox.New(outbox.Config{DB: db, Driver: mysql.Driver{}, Publisher: pub, RetryDelay: -1})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = ob.Close() })
	if err := ob.Migrate(context.Background()); err != nil {
		t.Fatal(err)
	}
	msg := message.NewMessage("order-1", []byte("o-1"))
	var after error
	h := func(msg *message.Message) ([]*message.Message, error) {
		ctx := msg.Context()
		tx := outbox.Tx(ctx)
		if _, err := tx.ExecContext(ctx, `INSERT INTO reservations VALUES (?)`, msg.UUID); err != nil {
			return nil, err
		}
		if err := outbox.Publish(ctx, "stock.reserved", message.NewMessage("before", nil)); err != nil {
			return nil, err
		}
		if _, err := tx.ExecContext(ctx, "ROLLBACK"); err != nil {
			return nil, err
		}
		after = outbox.Publish(ctx, "stock.reserved", message.NewMessage("after-1", nil), message.NewMessage("after-2", nil))
		return nil, nil
	}
	err = ob.Handle(msg.Copy(), outbox.HandleParams{Consumer: "reserve", MessageID: msg.UUID}, h)
	if !errors.Is(after, outbox.ErrTxFinishedByHandler) {
		t.Errorf("Publish after ROLLBACK: %v; want ErrTxFinishedByHandler", after)
	}
	if !errors.Is(err, outbox.ErrTxFinishedByHandler) {
		t.Errorf("Handle: %v; want ErrTxFinishedByHandler", err)
	}
	if n := count(t, db, `SELECT count(*) FROM outbox_effects`); n != 0 {
		t.Errorf("%d effect rows committed, want none", n)
	}
	if n := len(pub.All()); n != 0 {
		t.Errorf("%d messages sent for rolled-back work, want none", n)
	}
	if n := count(t, db, `SELECT coalesce(sum(attempts), 0) FROM outbox_attempts`); n != 1 {
		t.Errorf("%d attempts counted, want 1", n)
	}
}

// TestClaimedInsertKeepsTheOrder: the guarded insert of several effects in one record (a union
// of rows, where one effect is a row from DUAL) stores them with ids in the order recorded.
func TestClaimedInsertKeepsTheOrder(t *testing.T) {
	db := openAt(t, isolations[0])
	ob := newOutbox(t, db)
	msg := message.NewMessage("order-2", []byte("o-2"))
	var want, got []string
	h := func(msg *message.Message) ([]*message.Message, error) {
		ctx := msg.Context()
		var msgs []*message.Message
		for i := range 12 {
			want = append(want, fmt.Sprintf("m-%02d", 11-i)) // not in the order of their UUIDs
			msgs = append(msgs, message.NewMessage(want[i], nil))
		}
		if err := outbox.Publish(ctx, "stock.reserved", msgs[0]); err != nil {
			return nil, err
		}
		if err := outbox.Publish(ctx, "stock.reserved", msgs[1:]...); err != nil {
			return nil, err
		}
		// Read in the transaction: once sent, the rows are gone.
		rows, err := outbox.Tx(ctx).QueryContext(ctx, `SELECT uuid FROM outbox_effects WHERE source_id = ? ORDER BY id`, msg.UUID)
		if err != nil {
			return nil, err
		}
		defer rows.Close()
		for rows.Next() {
			var u string
			if err := rows.Scan(&u); err != nil {
				return nil, err
			}
			got = append(got, u)
		}
		return nil, rows.Err()
	}
	if err := ob.Handle(msg.Copy(), outbox.HandleParams{Consumer: "reserve", MessageID: msg.UUID}, h); err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(got, want) {
		t.Errorf("stored in id order %v, want %v", got, want)
	}
}
