package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"regexp"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
)

// TestMetrics starts the service, has one order paid, and reads GET /metrics: the outbox's
// metrics are there under the names the Prometheus exporter gives them (the ones the dashboard and
// the alerts in deploy/ use), and the progress line counted the order.
func TestMetrics(t *testing.T) {
	out := &syncBuffer{}
	base, client := startService(t, testConfig(t), out)

	id, err := postKeyed(context.Background(), client, base,
		placeOrderRequest{Customer: "ada@example.com", SKU: "espresso-beans", Quantity: 1}, uuid.NewString())
	if err != nil {
		t.Fatal(err)
	}
	waitUntil(t, "the order is paid", func() (bool, string) {
		resp, err := client.Get(base + "/orders/" + id)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		var o Order
		if err := json.NewDecoder(resp.Body).Decode(&o); err != nil || resp.StatusCode != http.StatusOK {
			t.Fatalf("GET /orders/%s: %s, %v", id, resp.Status, err)
		}
		return o.Status == "paid", "status " + o.Status
	})

	// Every consumer on the way to "paid" handled the order's event once; its unit of work
	// ended (and was counted) right after it committed, so give the last one a moment.
	var families map[string]*dto.MetricFamily
	waitUntil(t, "/metrics counts the order", func() (bool, string) {
		families = scrape(t, client, base+"/metrics")
		for _, c := range []string{"inventory", "payment", "order-status-reserved", "order-status-paid"} {
			if n := counterValue(families["outbox_messages_handled_total"], map[string]string{
				"messaging_consumer_group_name": c, "outbox_outcome": "processed",
			}); n < 1 {
				return false, fmt.Sprintf("outbox_messages_handled_total{messaging_consumer_group_name=%q,outbox_outcome=\"processed\"} is %v, want 1", c, n)
			}
		}
		return true, ""
	})
	for name, typ := range map[string]dto.MetricType{
		"messaging_process_duration_seconds":  dto.MetricType_HISTOGRAM,
		"outbox_effects_dispatched_total":     dto.MetricType_COUNTER,
		"outbox_effects_dispatch_lag_seconds": dto.MetricType_HISTOGRAM,
	} {
		if f := families[name]; f == nil || f.GetType() != typ {
			t.Errorf("/metrics has no %s %s: %v", typ, name, f)
		}
	}

	// The progress line: one a second while something changes.
	progress := regexp.MustCompile(`(?m)^\d\d:\d\d:\d\d  orders placed 1  paid 1  rejected 0  cancelled 0  side effects pending \d+  failing messages 0$`)
	waitUntil(t, "a progress line counts the order", func() (bool, string) {
		return progress.MatchString(out.String()), "printed:\n" + out.String()
	})
}

// waitUntil calls cond until it returns true, for at most 30 seconds.
func waitUntil(t *testing.T, what string, cond func() (bool, string)) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for {
		ok, state := cond()
		if ok {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("waited 30s for %s: %s", what, state)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// scrape reads url in the Prometheus text format.
func scrape(t *testing.T, client *http.Client, url string) map[string]*dto.MetricFamily {
	t.Helper()
	resp, err := client.Get(url)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("GET %s: %s", url, resp.Status)
	}
	parser := expfmt.NewTextParser(model.UTF8Validation)
	families, err := parser.TextToMetricFamilies(resp.Body)
	if err != nil {
		t.Fatalf("GET %s: %v", url, err)
	}
	return families
}

// counterValue sums the counters of f whose labels include labels.
func counterValue(f *dto.MetricFamily, labels map[string]string) float64 {
	var sum float64
	for _, m := range f.GetMetric() {
		matched := 0
		for _, l := range m.GetLabel() {
			if v, ok := labels[l.GetName()]; ok && v == l.GetValue() {
				matched++
			}
		}
		if matched == len(labels) {
			sum += m.GetCounter().GetValue()
		}
	}
	return sum
}

// syncBuffer is a bytes.Buffer that serve's goroutines may write while the test reads it.
type syncBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (b *syncBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

func (b *syncBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}
