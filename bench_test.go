package outbox_test

import (
	"context"
	"database/sql"
	"fmt"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"

	"github.com/watermill-outbox/outbox"
)

// The micro-benchmarks of the hot path run against the real database and broker of the tests.
// Compare BenchmarkHandle with BenchmarkBareHandler: the same business write and publish, without
// deduplication or outbox.

func businessWrite(ctx context.Context, tx *sql.Tx, id string) error {
	_, err := tx.ExecContext(ctx, `INSERT INTO applied (message_id) VALUES ($1)`, id)
	return err
}

func BenchmarkBareHandler(b *testing.B) {
	e := newEnv(b)
	ctx := context.Background()
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		tx, err := e.db.BeginTx(ctx, nil)
		if err != nil {
			b.Fatal(err)
		}
		if err := businessWrite(ctx, tx, uuid.NewString()); err != nil {
			b.Fatal(err)
		}
		if err := tx.Commit(); err != nil {
			b.Fatal(err)
		}
		if err := e.pub.Publish("out_a", message.NewMessage(uuid.NewString(), []byte(`{}`))); err != nil {
			b.Fatal(err)
		}
	}
}

func BenchmarkHandle(b *testing.B) {
	e := newEnv(b)
	h := func(msg *message.Message) ([]*message.Message, error) {
		ctx := msg.Context()
		if err := businessWrite(ctx, outbox.Tx(ctx), msg.UUID); err != nil {
			return nil, err
		}
		return nil, outbox.Publish(ctx, "out_a", message.NewMessage(uuid.NewString(), []byte(`{}`)))
	}
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		if err := handle(e.ob, message.NewMessage(uuid.NewString(), nil), h); err != nil {
			b.Fatal(err)
		}
	}
}

func BenchmarkHandleDuplicate(b *testing.B) {
	e := newEnv(b)
	msg := message.NewMessage(uuid.NewString(), nil)
	if err := handle(e.ob, msg, applyAndPublish(nil)); err != nil {
		b.Fatal(err)
	}
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		if err := handle(e.ob, copyOf(msg), applyAndPublish(nil)); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkMark compares the asynchronous-commit mark with the same statement committed durably,
// both prepared and both marking a claim and an effect that exist.
func BenchmarkMark(b *testing.B) {
	const durable = `WITH e AS (UPDATE outbox_effects SET dispatched_at = now()
			WHERE source_consumer = $1 AND source_id = $2 AND dispatched_at IS NULL)
		UPDATE outbox_processed SET dispatched_at = now() WHERE consumer = $1 AND message_id = $2`
	for _, async := range []bool{true, false} {
		b.Run(fmt.Sprintf("async=%v", async), func(b *testing.B) {
			e := newEnv(b)
			ctx := context.Background()
			st := e.ob.Store()
			srcs := make([]outbox.Source, b.N)
			for i := range srcs {
				srcs[i] = outbox.Source{Consumer: "c1", ID: uuid.NewString()}
				tx, err := e.db.BeginTx(ctx, nil)
				if err != nil {
					b.Fatal(err)
				}
				if _, err := st.MessageClaim(ctx, tx, srcs[i]); err != nil {
					b.Fatal(err)
				}
				if err := st.EffectInsert(ctx, tx, srcs[i], []outbox.Effect{{Topic: "t", UUID: uuid.NewString(), OrderingKey: "k"}}); err != nil {
					b.Fatal(err)
				}
				if err := tx.Commit(); err != nil {
					b.Fatal(err)
				}
			}
			stmt, err := e.db.PrepareContext(ctx, durable)
			if err != nil {
				b.Fatal(err)
			}
			defer stmt.Close()
			b.ResetTimer()
			for i := 0; i < b.N; i++ {
				if async {
					err = st.EffectMarkDispatched(ctx, outbox.DispatchMark{Source: srcs[i], MoveClaim: true})
				} else {
					_, err = stmt.ExecContext(ctx, srcs[i].Consumer, srcs[i].ID)
				}
				if err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

func BenchmarkClaim(b *testing.B) {
	e := newEnv(b)
	ctx := context.Background()
	st := e.ob.Store()
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		tx, err := e.db.BeginTx(ctx, nil)
		if err != nil {
			b.Fatal(err)
		}
		if _, err := st.MessageClaim(ctx, tx, outbox.Source{Consumer: "c1", ID: uuid.NewString()}); err != nil {
			b.Fatal(err)
		}
		if err := tx.Commit(); err != nil {
			b.Fatal(err)
		}
	}
}
