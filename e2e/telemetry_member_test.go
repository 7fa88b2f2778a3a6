package e2e

import (
	"context"
	"database/sql"
	"runtime"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"

	"github.com/watermill-outbox/outbox"
	"github.com/watermill-outbox/outbox/drivers/postgres"
	"github.com/watermill-outbox/outbox/internal/pgtest"
	"github.com/watermill-outbox/outbox/tenant"
)

// Outboxes of two tenant databases with the same tables, on one MeterProvider, report series of
// their own: a tenant.Set names each member's metrics after it (outbox.member), and
// Config.Member names a plain Outbox's. Without the member, both databases' counters and gauges
// were one series ("public.outbox_" for both).
func TestMetricsCarryTheMember(t *testing.T) {
	ctx := context.Background()
	reader, mp, ch := metered(t)
	newOutbox := func(member string) *outbox.Outbox {
		db := pgtest.DB(t)
		t.Cleanup(func() { _ = db.Close() })
		ob, err := outbox.New(outbox.Config{DB: db, Driver: postgres.Driver{}, Publisher: ch, MeterProvider: mp,
			Member: member, StatsInterval: 100 * time.Millisecond})
		if err != nil {
			t.Fatal(err)
		}
		if err := ob.Migrate(ctx); err != nil {
			t.Fatal(err)
		}
		return ob
	}
	set, err := tenant.New(tenant.Config{Resolver: tenant.FromMetadata("tenant"), NackUnresolved: true}) // no message comes in
	if err != nil {
		t.Fatal(err)
	}
	for _, name := range []string{"acme", "globex"} {
		if err := set.Add(name, newOutbox("")); err != nil {
			t.Fatal(err)
		}
	}
	plain := newOutbox("initech")
	runSet(t, set)
	commit := func(name string, n int) {
		for range n {
			err := set.InTx(ctx, name, func(ctx context.Context, tx *sql.Tx) error {
				return outbox.Publish(ctx, "member.events", outbox.NewMessage(ctx, []byte(name)))
			})
			if err != nil {
				t.Fatal(err)
			}
		}
	}
	commit("acme", 2)
	commit("globex", 3)
	if err := plain.InTx(ctx, func(ctx context.Context, tx *sql.Tx) error { return nil }); err != nil {
		t.Fatal(err)
	}

	committed := func(rm metricdata.ResourceMetrics, member string) int64 {
		return sumInt(t, rm, outbox.MetricBoundaryUnits, map[string]string{"outbox.member": member, "outbox.outcome": outbox.OutcomeCommitted})
	}
	deadline := time.Now().Add(30 * time.Second)
	for {
		rm := func() metricdata.ResourceMetrics {
			var rm metricdata.ResourceMetrics
			if err := reader.Collect(ctx, &rm); err != nil {
				t.Fatal(err)
			}
			return rm
		}()
		uptime := map[string]bool{}
		if g, ok := find(rm, outbox.MetricUptime).(metricdata.Gauge[float64]); ok {
			for _, p := range g.DataPoints {
				if v, ok := p.Attributes.Value("outbox.member"); ok {
					uptime[v.AsString()] = true
				}
			}
		}
		a, g, i := committed(rm, "acme"), committed(rm, "globex"), committed(rm, "initech")
		if a == 2 && g == 3 && i == 1 && uptime["acme"] && uptime["globex"] {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("boundary units committed by member: acme %d (want 2), globex %d (want 3), initech %d (want 1); uptime gauges of members %v (want acme and globex)",
				a, g, i, uptime)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// TestRelayRunningGauge: outbox.relay.running says, per Outbox the process holds, whether it runs
// its relay: 1 for the members of a running Set (under their member names only), 0 for an Outbox
// nothing runs; nothing for a member removed from its Set (running or not), an Outbox closed, or
// one the service dropped. The OutboxRelayStalled alert reads it; on the counters it read before, it fired for
// every Set (their counters start under no name) and every removed member.
func TestRelayRunningGauge(t *testing.T) {
	ctx := context.Background()
	reader, mp, ch := metered(t)
	db := pgtest.DB(t)
	newOutbox := func(prefix, member string) *outbox.Outbox {
		ob, err := outbox.New(outbox.Config{DB: db, Driver: postgres.Driver{}, Publisher: ch, MeterProvider: mp,
			TablePrefix: prefix, Member: member})
		if err != nil {
			t.Fatal(err)
		}
		if err := ob.Migrate(ctx); err != nil {
			t.Fatal(err)
		}
		return ob
	}
	running := func() map[string]int64 {
		t.Helper()
		var rm metricdata.ResourceMetrics
		if err := reader.Collect(ctx, &rm); err != nil {
			t.Fatal(err)
		}
		out := map[string]int64{}
		if g, ok := find(rm, outbox.MetricRelayRunning).(metricdata.Gauge[int64]); ok {
			for _, p := range g.DataPoints {
				v, _ := p.Attributes.Value("outbox.member")
				out[v.AsString()] += p.Value
				out["points"]++
			}
		}
		return out
	}
	set, err := tenant.New(tenant.Config{Resolver: tenant.FromMetadata("tenant"), NackUnresolved: true})
	if err != nil {
		t.Fatal(err)
	}
	for _, name := range []string{"acme", "globex", "early"} {
		if err := set.Add(name, newOutbox(name+"_", "")); err != nil {
			t.Fatal(err)
		}
	}
	plain := newOutbox("plain_", "initech")
	func() { newOutbox("dropped_", "dropped") }()
	if got := running(); got["initech"] != 0 || got["points"] != 5 {
		t.Fatalf("before anything runs: %v; want five Outboxes held, none running", got)
	}
	// Removed before the Set runs: no Outbox the process holds to run either.
	if err := set.Remove(ctx, "early"); err != nil {
		t.Fatal(err)
	}
	if got := running(); got["points"] != 4 {
		t.Fatalf("with early removed before the Set runs: %v; want four Outboxes held", got)
	}
	runSet(t, set)
	want := func(what string, cond func(map[string]int64) bool) {
		t.Helper()
		deadline := time.Now().Add(30 * time.Second)
		for {
			runtime.GC()
			got := running()
			if cond(got) {
				return
			}
			if time.Now().After(deadline) {
				t.Fatalf("%s: outbox.relay.running %v", what, got)
			}
			time.Sleep(50 * time.Millisecond)
		}
	}
	// The dropped Outbox goes once collected; the members report under their names only.
	want("with the Set running", func(g map[string]int64) bool {
		return g["acme"] == 1 && g["globex"] == 1 && g["initech"] == 0 && g["points"] == 3
	})
	if err := set.Remove(ctx, "acme"); err != nil {
		t.Fatal(err)
	}
	want("with acme removed", func(g map[string]int64) bool {
		return g["globex"] == 1 && g["initech"] == 0 && g["points"] == 2
	})
	if err := plain.Close(); err != nil {
		t.Fatal(err)
	}
	want("with initech closed", func(g map[string]int64) bool { return g["globex"] == 1 && g["points"] == 1 })
}

// runSet runs set until t ends.
func runSet(t *testing.T, set *tenant.Set) {
	runCtx, stop := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- set.Run(runCtx) }()
	t.Cleanup(func() {
		stop()
		select {
		case <-done:
		case <-time.After(time.Minute):
			t.Error("Set.Run did not return within a minute of its cancellation")
		}
	})
}

// metered returns a MeterProvider read by reader, and a Publisher, until t ends.
func metered(t *testing.T) (*sdkmetric.ManualReader, *sdkmetric.MeterProvider, *gochannel.GoChannel) {
	reader := sdkmetric.NewManualReader()
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
	t.Cleanup(func() { _ = mp.Shutdown(context.Background()) })
	ch := gochannel.NewGoChannel(gochannel.Config{}, watermill.NopLogger{})
	t.Cleanup(func() { _ = ch.Close() })
	return reader, mp, ch
}
