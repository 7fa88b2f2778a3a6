package main

import (
	"context"
	"database/sql"
	"fmt"
	"os"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"

	"github.com/watermill-outbox/outbox"
	"github.com/watermill-outbox/outbox/drivers/outboxpgx"
	"github.com/watermill-outbox/outbox/drivers/postgres"
	"github.com/watermill-outbox/outbox/outboxdriver"
)

// The micro-benchmarks time one step of the framework's hot path at a time, on one connection,
// against the same PostgreSQL and broker as the benchmark program, and report the round trips
// and statements each step puts on the wire and the WAL it writes (the WAL of a step that only
// queues work for the background, such as a mark, may land in the next step's window):
//
//	cd bench && go test -run '^$' -bench . -benchtime 2s
//
// claim, store and mark are the store's statements; dispatch is the framework publishing stored
// effects (the path of a redelivered message: read them back, publish, mark); publish is the broker
// alone; handle is the whole unit of work through the middleware, bare the same workload without
// the framework.

var benchEnv *env

func TestMain(m *testing.M) {
	os.Exit(testMain(m))
}

func testMain(m *testing.M) int {
	dsn := os.Getenv("OUTBOX_BENCH_DSN")
	if dsn == "" {
		srv, err := startPG()
		if err != nil {
			fmt.Fprintln(os.Stderr, "cannot start PostgreSQL:", err)
			return 1
		}
		defer srv.stop()
		dsn = srv.dsn("postgres")
	}
	benchDSN, err := createDatabase(context.Background(), dsn, "outbox_microbench")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	admin, err := sql.Open("postgres", benchDSN)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	defer admin.Close()
	if _, err := admin.Exec(`CREATE TABLE applied (message_id text NOT NULL)`); err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	b, err := startBroker()
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	defer b.close()
	benchEnv = &env{dsn: benchDSN, admin: admin, broker: b, pub: b.publisher()}
	return m.Run()
}

type hot struct {
	db *sql.DB
	wc *wireCounters
	ob *outbox.Outbox
}

func newHot(b *testing.B, mutate func(*outbox.Config)) *hot {
	b.Helper()
	wc := &wireCounters{}
	db, err := openCounted(benchEnv.dsn, wc, 4)
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { _ = db.Close() })
	cfg := outbox.Config{DB: db, Driver: postgres.Driver{}, Publisher: benchEnv.pub}
	if mutate != nil {
		mutate(&cfg)
	}
	ob, err := outbox.New(cfg)
	if err != nil {
		b.Fatal(err)
	}
	if err := ob.Migrate(context.Background()); err != nil {
		b.Fatal(err)
	}
	return &hot{db: db, wc: wc, ob: ob}
}

// measure runs step b.N times with per-iteration setup outside the timer, and reports the round
// trips and statements of step alone.
func (h *hot) measure(b *testing.B, setup func(i int) any, step func(i int, state any), teardown func(state any)) {
	b.Helper()
	var wire wireSnapshot
	var wal int64
	lsn := func() int64 {
		var v int64
		if err := benchEnv.admin.QueryRow(`SELECT pg_wal_lsn_diff(pg_current_wal_insert_lsn(), '0/0')::bigint`).Scan(&v); err != nil {
			b.Fatal(err)
		}
		return v
	}
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		b.StopTimer()
		var st any
		if setup != nil {
			st = setup(i)
		}
		w0 := h.wc.snapshot()
		l0 := lsn()
		b.StartTimer()
		step(i, st)
		b.StopTimer()
		wire = wire.add(h.wc.snapshot().sub(w0))
		wal += lsn() - l0
		if teardown != nil {
			teardown(st)
		}
		b.StartTimer()
	}
	b.StopTimer()
	b.ReportMetric(float64(wire.RoundTrips)/float64(b.N), "roundtrips/op")
	b.ReportMetric(float64(wire.Statements)/float64(b.N), "stmts/op")
	b.ReportMetric(float64(wal)/float64(b.N), "WALbytes/op")
}

func (h *hot) begin(b *testing.B) *sql.Tx {
	tx, err := h.db.BeginTx(context.Background(), nil)
	if err != nil {
		b.Fatal(err)
	}
	return tx
}

func effect(src outbox.Source) []outbox.Effect {
	return []outbox.Effect{{Kind: outbox.KindPublish, Topic: outTopic, UUID: uuid.NewString(), Payload: []byte(`{"order":"x"}`),
		Metadata: map[string]string{"causation_id": src.ID}, OrderingKey: src.Consumer + "/" + src.ID, Source: src}}
}

func must(b *testing.B, err error) {
	if err != nil {
		b.Fatal(err)
	}
}

func BenchmarkHotPath(b *testing.B) {
	ctx := context.Background()
	b.Run("claim", func(b *testing.B) {
		h := newHot(b, nil)
		h.measure(b, func(int) any { return h.begin(b) }, func(_ int, st any) {
			_, err := h.ob.Store().MessageClaim(ctx, st.(*sql.Tx), outbox.Source{Consumer: "c", ID: uuid.NewString()})
			must(b, err)
		}, func(st any) { must(b, st.(*sql.Tx).Commit()) })
	})
	b.Run("store", func(b *testing.B) {
		h := newHot(b, nil)
		h.measure(b, func(int) any { return h.begin(b) }, func(_ int, st any) {
			src := outbox.Source{Consumer: "c", ID: uuid.NewString()}
			_, err := h.ob.Store().EffectInsert(ctx, st.(*sql.Tx), src, effect(src))
			must(b, err)
		}, func(st any) { must(b, st.(*sql.Tx).Commit()) })
	})
	b.Run("commit", func(b *testing.B) {
		// The durable commit of a unit of work holding a claim and one effect.
		h := newHot(b, nil)
		h.measure(b, func(int) any {
			tx := h.begin(b)
			src := outbox.Source{Consumer: "c", ID: uuid.NewString()}
			_, err := h.ob.Store().MessageClaim(ctx, tx, src)
			must(b, err)
			_, err = h.ob.Store().EffectInsert(ctx, tx, src, effect(src))
			must(b, err)
			return tx
		}, func(_ int, st any) { must(b, st.(*sql.Tx).Commit()) }, nil)
	})
	b.Run("dispatch", func(b *testing.B) {
		// A redelivered message whose effect is still pending: claim (conflict), read the effect
		// back, publish it, mark it. DuplicateWait is minimal so that it does not sleep.
		h := newHot(b, func(c *outbox.Config) { c.DuplicateWait = time.Nanosecond })
		noop := func(*message.Message) ([]*message.Message, error) { return nil, nil }
		h.measure(b, func(int) any {
			tx := h.begin(b)
			src := outbox.Source{Consumer: "c", ID: uuid.NewString()}
			_, err := h.ob.Store().MessageClaim(ctx, tx, src)
			must(b, err)
			_, err = h.ob.Store().EffectInsert(ctx, tx, src, effect(src))
			must(b, err)
			must(b, tx.Commit())
			return src
		}, func(_ int, st any) {
			src := st.(outbox.Source)
			must(b, h.ob.Handle(message.NewMessage(src.ID, nil), outbox.HandleParams{Consumer: src.Consumer, MessageID: src.ID}, noop))
		}, nil)
	})
	b.Run("publish", func(b *testing.B) {
		h := newHot(b, nil)
		h.measure(b, nil, func(int, any) {
			must(b, benchEnv.pub.Publish(outTopic, message.NewMessage(uuid.NewString(), []byte(`{"order":"x"}`))))
		}, nil)
	})
	b.Run("mark", func(b *testing.B) {
		h := newHot(b, nil)
		h.measure(b, func(int) any {
			tx := h.begin(b)
			src := outbox.Source{Consumer: "c", ID: uuid.NewString()}
			_, err := h.ob.Store().MessageClaim(ctx, tx, src)
			must(b, err)
			es := effect(src)
			_, err = h.ob.Store().EffectInsert(ctx, tx, src, es)
			must(b, err)
			must(b, tx.Commit())
			return outboxdriver.DispatchMark{Source: src, StoreIDs: []int64{es[0].StoreID}}
		}, func(_ int, st any) {
			must(b, h.ob.Store().EffectMarkDispatched(ctx, st.(outboxdriver.DispatchMark)))
		}, nil)
	})
	b.Run("handle", func(b *testing.B) {
		h := newHot(b, nil)
		handler := func(msg *message.Message) ([]*message.Message, error) {
			ctx := msg.Context()
			if _, err := outbox.Tx(ctx).ExecContext(ctx, businessWrite, msg.UUID); err != nil {
				return nil, err
			}
			return nil, outbox.Publish(ctx, outTopic, message.NewMessage(uuid.NewString(), msg.Payload))
		}
		h.measure(b, nil, func(int, any) {
			id := uuid.NewString()
			must(b, h.ob.Handle(message.NewMessage(id, []byte(`{"order":"x"}`)), outbox.HandleParams{Consumer: "c", MessageID: id}, handler))
		}, nil)
	})
	b.Run("bare", func(b *testing.B) {
		h := newHot(b, nil)
		h.measure(b, nil, func(int, any) {
			tx := h.begin(b)
			_, err := tx.ExecContext(ctx, businessWrite, uuid.NewString())
			must(b, err)
			must(b, tx.Commit())
			must(b, benchEnv.pub.Publish(outTopic, message.NewMessage(uuid.NewString(), []byte(`{"order":"x"}`))))
		}, nil)
	})
}

// BenchmarkPgx times one delivery at a time through the benchmark's own pgx contenders (the same
// code, pools and counted connections as the timed runs), alternating.
func BenchmarkPgx(b *testing.B) {
	ctx := context.Background()
	bare, err := newBarePgx(benchEnv)
	if err != nil {
		b.Fatal(err)
	}
	defer bare.close()
	fw, err := newFrameworkPgx(benchEnv, "hotpgx_", outboxpgx.Optimistic)
	if err != nil {
		b.Fatal(err)
	}
	defer fw.close()
	must(b, fw.start(ctx))
	defer func() { must(b, fw.stop()) }()
	for _, c := range []contender{bare, fw} {
		b.Run(c.name(), func(b *testing.B) {
			for i := range b.N {
				d := delivery{idx: i, id: uuid.NewString(), payload: []byte(`{"order":"x"}`), orig: -1}
				if _, err := c.handle(ctx, d); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}
