package outbox_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"strings"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"

	"github.com/watermill-outbox/outbox"
	"github.com/watermill-outbox/outbox/outboxtest"
)

// manyEffects is more effects than one INSERT's 65,535 bind parameters hold (7 per effect).
const manyEffects = 10_000

// Item: a unit of work that records more effects than one statement's parameters hold stores
// and sends every one of them, once.
func TestTenThousandEffectsInOneUnit(t *testing.T) {
	h := outboxtest.New(t, outbox.Config{}, nil)
	// Handle rather than h.Run: reading back 10,000 effects with their metadata is slow.
	msg := message.NewMessage(uuid.NewString(), nil)
	err := h.Ob.Handle(msg, outbox.HandleParams{Consumer: "c1", MessageID: msg.UUID}, func(m *message.Message) ([]*message.Message, error) {
		out := make([]*message.Message, manyEffects)
		for i := range out {
			out[i] = message.NewMessage(fmt.Sprint("e-", i), nil)
		}
		return nil, outbox.Publish(m.Context(), "out", out...)
	})
	if err != nil {
		t.Fatal(err)
	}
	h.Ob.FlushMarks()
	var stored, pending int
	if err := h.DB.QueryRow(`SELECT (SELECT count(*) FROM outbox_effects_all WHERE source_id = $1) + (SELECT count(*) FROM outbox_dispatched WHERE source_id = $1),
		(SELECT count(*) FROM outbox_effects_all WHERE dispatched_at IS NULL)`, msg.UUID).Scan(&stored, &pending); err != nil {
		t.Fatal(err)
	}
	mustEqual(t, "effects stored", stored, manyEffects)
	mustEqual(t, "effects pending", pending, 0)
	sent := map[string]int{}
	for i, s := range h.Pub.All() {
		sent[s.Message.UUID]++
		if want := fmt.Sprint("e-", i); s.Message.UUID != want {
			t.Fatalf("sent #%d is %s, want %s (out of order)", i, s.Message.UUID, want)
		}
	}
	mustEqual(t, "distinct effects sent", len(sent), manyEffects)
	mustEqual(t, "effects sent", len(h.Pub.All()), manyEffects)
}

// Item: InTx inside a message's unit of work would open an independent transaction that commits
// even when the message's rolls back (and again on every retry): it is refused, naming the
// consumer, and nothing it would have written commits.
func TestInTxInsideAHandlerIsRefused(t *testing.T) {
	e := newEnv(t)
	var inner error
	err := handle(e.ob, message.NewMessage(uuid.NewString(), nil), func(m *message.Message) ([]*message.Message, error) {
		inner = e.ob.InTx(m.Context(), func(ctx context.Context, tx *sql.Tx) error {
			_, err := tx.ExecContext(ctx, `INSERT INTO applied (message_id) VALUES ('escaped')`)
			return err
		})
		return nil, errors.New("the message's unit rolls back")
	})
	if err == nil {
		t.Fatal("the handler's failure was acked")
	}
	if !errors.Is(inner, outbox.ErrNestedUnitOfWork) || !strings.Contains(inner.Error(), `"c1"`) || !strings.Contains(inner.Error(), "outbox.Tx") {
		t.Errorf("InTx inside a handler: %v; want ErrNestedUnitOfWork naming consumer \"c1\" and outbox.Tx", inner)
	}
	mustEqual(t, "rows written by the inner InTx", e.count(`SELECT count(*) FROM applied WHERE message_id = 'escaped'`), 0)

	// InUnit too, and InTx at the boundary still works.
	err = handle(e.ob, message.NewMessage(uuid.NewString(), nil), func(m *message.Message) ([]*message.Message, error) {
		return nil, e.ob.InUnit(m.Context(), func(context.Context) error { return nil })
	})
	if !errors.Is(err, outbox.ErrNestedUnitOfWork) {
		t.Errorf("InUnit inside a handler: %v", err)
	}
	if err := e.ob.InTx(context.Background(), func(ctx context.Context, tx *sql.Tx) error { return nil }); err != nil {
		t.Errorf("InTx at the boundary: %v", err)
	}
}

// Item: JoinTx inside a message's unit of work attaches effects to a transaction apart from the
// message's: they commit even when the message's unit rolls back, and again, under new UUIDs, on
// every retry. It is refused like InTx (JoinUnit returns the error, JoinTx panics with it, which
// the handler's unit turns into a failed attempt), and no effect escapes.
func TestJoinTxInsideAHandlerIsRefused(t *testing.T) {
	e := newEnv(t)
	var inner error
	err := handle(e.ob, message.NewMessage(uuid.NewString(), nil), func(m *message.Message) ([]*message.Message, error) {
		ctx := m.Context()
		tx, err := e.db.BeginTx(ctx, nil)
		if err != nil {
			return nil, err
		}
		defer tx.Rollback()
		jctx, _, jerr := e.ob.JoinUnit(ctx, tx)
		inner = jerr
		if jerr == nil {
			if err := outbox.Publish(jctx, "escaped", message.NewMessage(uuid.NewString(), nil)); err != nil {
				return nil, err
			}
			if err := tx.Commit(); err != nil {
				return nil, err
			}
		}
		return nil, errors.New("the message's unit rolls back")
	})
	if err == nil {
		t.Fatal("the handler's failure was acked")
	}
	if !errors.Is(inner, outbox.ErrNestedUnitOfWork) || !strings.Contains(inner.Error(), `"c1"`) {
		t.Errorf("JoinUnit inside a handler: %v; want ErrNestedUnitOfWork naming consumer \"c1\"", inner)
	}
	mustEqual(t, "effects committed by the joined transaction", e.count(`SELECT count(*) FROM all_effects WHERE topic = 'escaped'`), 0)

	err = handle(e.ob, message.NewMessage(uuid.NewString(), nil), func(m *message.Message) (_ []*message.Message, err error) {
		tx, err := e.db.BeginTx(m.Context(), nil)
		if err != nil {
			return nil, err
		}
		defer tx.Rollback()
		e.ob.JoinTx(m.Context(), tx) // panics
		return nil, nil
	})
	if !errors.Is(err, outbox.ErrNestedUnitOfWork) {
		t.Errorf("JoinTx inside a handler: %v", err)
	}
}
