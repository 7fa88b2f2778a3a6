package e2e

import (
	"context"
	"os"
	"runtime"
	"strconv"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"

	"github.com/watermill-outbox/outbox"
	"github.com/watermill-outbox/outbox/drivers/postgres"
	"github.com/watermill-outbox/outbox/internal/brokertest"
	"github.com/watermill-outbox/outbox/internal/pgtest"
)

// nullPublisher takes every message and sends nothing: only the consumer path's own cost counts.
type nullPublisher struct{}

func (nullPublisher) Publish(string, ...*message.Message) error { return nil }
func (nullPublisher) Close() error                              { return nil }

// BenchmarkInstrumentation measures the consumer path (a unit of work with one business INSERT
// and one published message, 16 in flight) with the default no-op providers ("noop") and with a
// real SDK installed ("sdk": a metric reader, every span sampled and batched to an exporter that
// drops them). Run it with -count: the two alternate, so that their ratio within one run is
// meaningful on a shared machine; OUTBOX_BENCH_ROUNDS=n runs n rounds in one process, the
// order of the two alternating.
func BenchmarkInstrumentation(b *testing.B) {
	db := pgtest.DB(b)
	db.SetMaxOpenConns(24)
	if _, err := db.Exec(`CREATE TABLE IF NOT EXISTS bench_applied (id text)`); err != nil {
		b.Fatal(err)
	}
	// OUTBOX_BENCH_BROKER=redis publishes to a real Redis Streams server instead of dropping the
	// messages: the consumer path as a service has it.
	var pub message.Publisher = nullPublisher{}
	if os.Getenv("OUTBOX_BENCH_BROKER") == "redis" {
		srv, err := brokertest.Start(brokertest.Redis)
		if err != nil {
			b.Fatal(err)
		}
		b.Cleanup(srv.Close)
		p, closePub, err := broker{kind: brokertest.Redis, addr: srv.Addr()}.publisher()
		if err != nil {
			b.Fatal(err)
		}
		b.Cleanup(closePub)
		pub = p
	}
	newOutbox := func(b *testing.B, sdk bool) *outbox.Outbox {
		cfg := outbox.Config{DB: db, Driver: postgres.Driver{}, Publisher: pub, StatsInterval: -1}
		if sdk {
			mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(sdkmetric.NewManualReader()))
			tp := sdktrace.NewTracerProvider(sdktrace.WithSampler(sdktrace.AlwaysSample()),
				sdktrace.WithBatcher(tracetest.NewNoopExporter()))
			b.Cleanup(func() { _ = mp.Shutdown(context.Background()); _ = tp.Shutdown(context.Background()) })
			cfg.MeterProvider, cfg.TracerProvider = mp, tp
		}
		ob, err := outbox.New(cfg)
		if err != nil {
			b.Fatal(err)
		}
		if err := ob.Migrate(context.Background()); err != nil {
			b.Fatal(err)
		}
		return ob
	}
	handler := func(msg *message.Message) ([]*message.Message, error) {
		ctx := msg.Context()
		if _, err := outbox.Tx(ctx).ExecContext(ctx, `INSERT INTO bench_applied (id) VALUES ($1)`, msg.UUID); err != nil {
			return nil, err
		}
		return nil, outbox.Publish(ctx, "bench_out", message.NewMessage(uuid.NewString(), []byte(`{}`)))
	}
	variants := []struct {
		name string
		sdk  bool
	}{{"noop", false}, {"sdk", true}}
	rounds := 1
	if n, err := strconv.Atoi(os.Getenv("OUTBOX_BENCH_ROUNDS")); err == nil && n > 0 {
		rounds = n
	}
	for r := 0; r < rounds; r++ {
		for i := range variants {
			variant := variants[(i+r)%len(variants)] // the order alternates from round to round
			runVariant(b, variant.name, variant.sdk, newOutbox, handler)
		}
	}
}

func runVariant(b *testing.B, name string, sdk bool, newOutbox func(*testing.B, bool) *outbox.Outbox, handler message.HandlerFunc) {
	{
		b.Run(name, func(b *testing.B) {
			ob := newOutbox(b, sdk)
			b.SetParallelism(max(1, 16/runtime.GOMAXPROCS(0)))
			b.ResetTimer()
			b.RunParallel(func(pb *testing.PB) {
				for pb.Next() {
					id := uuid.NewString()
					err := ob.Handle(message.NewMessage(id, nil), outbox.HandleParams{Consumer: "bench", MessageID: id, Topic: "bench_in"}, handler)
					if err != nil {
						b.Error(err)
						return
					}
				}
			})
			b.StopTimer()
			ob.FlushMarks()
		})
	}
}
