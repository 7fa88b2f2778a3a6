package main

import (
	"context"
	"database/sql"
	"fmt"
	"io"
	"net/http"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"go.opentelemetry.io/otel/attribute"
	otelprom "go.opentelemetry.io/otel/exporters/prometheus"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/resource"

	"github.com/watermill-outbox/outbox"
)

// newMetrics returns the MeterProvider that every Outbox of the service reports to
// (outbox.Config.MeterProvider) and the handler that serves its metrics, with the Go runtime's and
// the process's, in the Prometheus text format (GET /metrics). The OpenTelemetry Prometheus
// exporter names them as docs/observability.md lists them: outbox_messages_handled_total,
// outbox_effects_pending, messaging_process_duration_seconds_bucket and so on. The registry is the
// service's own, not prometheus.DefaultRegisterer, so that two services in one process (the
// tests) do not collide. Shut the provider down after the last Outbox stopped.
func newMetrics() (*sdkmetric.MeterProvider, http.Handler, error) {
	reg := prometheus.NewRegistry()
	if err := reg.Register(collectors.NewGoCollector()); err != nil {
		return nil, nil, err
	}
	if err := reg.Register(collectors.NewProcessCollector(collectors.ProcessCollectorOpts{})); err != nil {
		return nil, nil, err
	}
	exporter, err := otelprom.New(otelprom.WithRegisterer(reg))
	if err != nil {
		return nil, nil, fmt.Errorf("prometheus exporter: %w", err)
	}
	res, err := resource.Merge(resource.Default(), resource.NewSchemaless(attribute.String("service.name", "order-processing")))
	if err != nil {
		return nil, nil, err
	}
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(exporter), sdkmetric.WithResource(res))
	return mp, promhttp.HandlerFor(reg, promhttp.HandlerOpts{}), nil
}

// printProgress prints one line a second to out while the service works, until ctx ends: the
// orders in the database, how many are paid, rejected and cancelled (not paid in time), and, as
// ob.Stats samples them, the side effects waiting to be sent (and parked ones, if any) and the
// incoming messages whose handler keeps failing. A second in which nothing changed prints
// nothing, so that an idle service stays quiet.
func printProgress(ctx context.Context, out io.Writer, db *sql.DB, ob *outbox.Outbox) {
	t := time.NewTicker(time.Second)
	defer t.Stop()
	var last string
	for {
		line := progressLine(ctx, db, ob)
		if ctx.Err() != nil {
			return
		}
		if line != last {
			fmt.Fprintf(out, "%s  %s\n", time.Now().Format(time.TimeOnly), line)
			last = line
		}
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

func progressLine(ctx context.Context, db *sql.DB, ob *outbox.Outbox) string {
	var placed, paid, rejected, cancelled int64
	if err := db.QueryRowContext(ctx, `SELECT count(*),
			coalesce(sum(CASE WHEN status = 'paid' THEN 1 ELSE 0 END), 0),
			coalesce(sum(CASE WHEN status = 'rejected' THEN 1 ELSE 0 END), 0),
			coalesce(sum(CASE WHEN status = 'cancelled' THEN 1 ELSE 0 END), 0)
		FROM orders`).Scan(&placed, &paid, &rejected, &cancelled); err != nil {
		return "progress: counting orders: " + err.Error()
	}
	line := fmt.Sprintf("orders placed %d  paid %d  rejected %d  cancelled %d", placed, paid, rejected, cancelled)
	st, err := ob.Stats(ctx)
	if err != nil {
		return line + "  side effects: " + err.Error()
	}
	line += fmt.Sprintf("  side effects pending %d", st.Pending)
	if st.Parked > 0 {
		line += fmt.Sprintf("  PARKED %d (the web console, or outbox parked list)", st.Parked)
	}
	// Messages whose handler failed and that were neither processed nor poisoned since: they
	// are redelivered; a count that does not fall is a handler that cannot succeed.
	line += fmt.Sprintf("  failing messages %d", st.Failing)
	return line
}
