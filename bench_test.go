package outbox_test

import (
	"context"
	"database/sql"
	"os"
	"strconv"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"

	"github.com/watermill-outbox/outbox"
	"github.com/watermill-outbox/outbox/outboxdriver"
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

// BenchmarkHandleInSavepoint records the effect inside a savepoint the handler releases: the unit
// of work then asks the database which effects survived before it commits (one statement more),
// which BenchmarkHandle never does.
func BenchmarkHandleInSavepoint(b *testing.B) {
	e := newEnv(b)
	h := func(msg *message.Message) ([]*message.Message, error) {
		ctx := msg.Context()
		tx := outbox.Tx(ctx)
		if err := businessWrite(ctx, tx, msg.UUID); err != nil {
			return nil, err
		}
		if _, err := tx.ExecContext(ctx, `SAVEPOINT s`); err != nil {
			return nil, err
		}
		if err := outbox.Publish(ctx, "out_a", message.NewMessage(uuid.NewString(), []byte(`{}`))); err != nil {
			return nil, err
		}
		_, err := tx.ExecContext(ctx, `RELEASE SAVEPOINT s`)
		return nil, err
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

// BenchmarkMark times the store's mark per source (what the background marker writes, in
// batches of 1 and 16, leaving the claim alone as on the fast path, and moving it as after a late
// dispatch) against one prepared statement that marks a source and commits durably.
func BenchmarkMark(b *testing.B) {
	const durable = `WITH e AS (DELETE FROM outbox_effects_all
			WHERE source_consumer = $1 AND source_id = $2 AND dispatched_at IS NULL)
		UPDATE outbox_processed SET dispatched_at = now() WHERE consumer = $1 AND message_id = $2`
	for _, v := range []struct {
		name  string
		batch int
		move  bool
	}{{"store/batch=1", 1, false}, {"store/batch=16", 16, false}, {"store/batch=16/move-claims", 16, true}, {"durable-prepared", 1, true}} {
		b.Run(v.name, func(b *testing.B) {
			e := newEnv(b)
			ctx := context.Background()
			st := e.ob.Store()
			srcs := make([]outbox.Source, b.N)
			ids := make([]int64, b.N)
			for i := range srcs {
				srcs[i] = outbox.Source{Consumer: "c1", ID: uuid.NewString()}
				tx, err := e.db.BeginTx(ctx, nil)
				if err != nil {
					b.Fatal(err)
				}
				if _, err := st.MessageClaim(ctx, tx, srcs[i]); err != nil {
					b.Fatal(err)
				}
				effects := []outbox.Effect{{Topic: "t", UUID: uuid.NewString(), OrderingKey: "k"}}
				if _, err := st.EffectInsert(ctx, tx, srcs[i], effects); err != nil {
					b.Fatal(err)
				}
				ids[i] = effects[0].StoreID
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
			for i := 0; i < b.N; i += v.batch {
				if v.name == "durable-prepared" {
					_, err = stmt.ExecContext(ctx, srcs[i].Consumer, srcs[i].ID)
				} else {
					marks := make([]outboxdriver.DispatchMark, 0, v.batch)
					for k := i; k < min(i+v.batch, len(srcs)); k++ {
						marks = append(marks, outboxdriver.DispatchMark{Source: srcs[k], StoreIDs: ids[k : k+1], MoveClaim: v.move})
					}
					err = st.EffectMarkDispatched(ctx, marks...)
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

// BenchmarkStats takes the sample of the database gauges (Outbox.Stats) with
// OUTBOX_BENCH_RETAINED processed IDs retained (default 10,000; docs/benchmarks.md reports 10M),
// a thousand pending effects, and the cleanup keeping up: its cost must not grow with the table.
func BenchmarkStats(b *testing.B) {
	e := newEnv(b)
	retained := 10_000
	if n, err := strconv.Atoi(os.Getenv("OUTBOX_BENCH_RETAINED")); err == nil && n > 0 {
		retained = n
	}
	if _, err := e.db.Exec(`INSERT INTO outbox_processed (consumer, message_id, processed_at, dispatched_at)
		SELECT 'bench', 'm' || i, now() - interval '1 hour', now() - interval '1 hour' FROM generate_series(1, $1) i`, retained); err != nil {
		b.Fatal(err)
	}
	for i := 0; i < 1000; i++ {
		if _, err := e.db.Exec(`INSERT INTO outbox_effects_all (source_consumer, source_id, seq, kind, topic, uuid, payload, metadata, ordering_key)
			VALUES ('bench', 'p' || $1::text, 0, '', 't', $1::text, '', '', 'k' || $1::text)`, i); err != nil {
			b.Fatal(err)
		}
	}
	for _, table := range []string{"outbox_processed", "outbox_effects_all"} {
		if _, err := e.db.Exec(`VACUUM ANALYZE ` + table); err != nil {
			b.Fatal(err)
		}
	}
	ctx := context.Background()
	b.ResetTimer()
	for b.Loop() {
		s, err := e.ob.Stats(ctx)
		if err != nil {
			b.Fatal(err)
		}
		if s.Pending != 1000 || float64(s.Retained) < 0.8*float64(retained) || float64(s.Retained) > 1.2*float64(retained) ||
			s.Estimated != (retained >= outbox.StatsCountCap) {
			b.Fatalf("stats: %+v, want 1000 pending and about %d retained", s, retained)
		}
	}
}

// BenchmarkInTx is the boundary's hot path: a business write and one effect through InTx, sent
// after the commit to the broker (publish) or to a publisher that drops it (discard: the
// database's part alone).
func BenchmarkInTx(b *testing.B) {
	for _, name := range []string{"publish", "discard"} {
		b.Run(name, func(b *testing.B) {
			e := newEnv(b)
			ob := e.ob
			if name == "discard" {
				ob = e.newOutbox(func(c *outbox.Config) { c.Publisher = nopPublisher{} })
			}
			ctx := context.Background()
			b.ResetTimer()
			for i := 0; i < b.N; i++ {
				if err := ob.InTx(ctx, func(ctx context.Context, tx *sql.Tx) error {
					if err := businessWrite(ctx, tx, uuid.NewString()); err != nil {
						return err
					}
					return outbox.Publish(ctx, "out_a", message.NewMessage(uuid.NewString(), []byte(`{}`)))
				}); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}
