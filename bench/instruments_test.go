package main

import (
	"bytes"
	"context"
	"strings"
	"testing"
	"time"
)

// TestRouterTwoStatement runs the broker-free path with the two-statement workload: every
// delivery through a Router, each message's reservation and stock decrement applied once, the
// redelivered copies dropped (by the claim, or by bare's duplicate key), one outgoing message per
// message.
func TestRouterTwoStatement(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	old := workload
	workload = workloadTwoStatement
	defer func() { workload = old }()
	if _, err := benchEnv.admin.ExecContext(ctx, `DROP TABLE IF EXISTS stock, reservation`); err != nil {
		t.Fatal(err)
	}
	if err := setupWorkload(ctx, benchEnv.admin); err != nil {
		t.Fatal(err)
	}
	b := newNullBroker()
	e := &env{dsn: benchEnv.dsn, admin: benchEnv.admin, broker: b, pub: b.publisher(), router: true}
	if _, err := e.newContender("river"); err == nil {
		t.Error("river was built for the two-statement workload, which it does not implement")
	}
	for i, name := range []string{"bare", "bare-pgx", "outbox-middleware", "outbox-pgx"} {
		t.Run(name, func(t *testing.T) {
			c, err := e.newContender(name)
			if err != nil {
				t.Fatal(err)
			}
			defer c.close()
			if _, ok := c.(*routed); !ok {
				t.Fatalf("%s is a %T, not behind a Router", name, c)
			}
			ds := makeDeliveries(300, 0.1, redeliveryGap(4), 16, 42+uint64(i))
			unique := map[string]bool{}
			for _, d := range ds {
				unique[d.id] = true
			}
			stock0, err := stockSum(ctx, e.admin)
			if err != nil {
				t.Fatal(err)
			}
			published0 := b.nullPublishedCount()
			res, err := e.run(ctx, c, ds, runOpts{conc: 4, redelivered: true, drainWait: 10 * time.Second})
			if err != nil {
				t.Fatal(err)
			}
			if res.Messages != len(ds) || res.Errors != 0 || res.Undelivered != 0 {
				t.Errorf("handled %d of %d deliveries, %d errors, %d undelivered", res.Messages, len(ds), res.Errors, res.Undelivered)
			}
			applied, extra, err := appliedCounts(ctx, e.admin, stock0)
			if err != nil {
				t.Fatal(err)
			}
			if len(applied) != len(unique) || extra != 0 {
				t.Errorf("%d reservations and %d stock decrements beyond them for %d messages", len(applied), extra, len(unique))
			}
			if n := b.nullPublishedCount() - published0; n != int64(len(unique)) {
				t.Errorf("%d outgoing messages for %d messages", n, len(unique))
			}
			if res.WALBytes <= 0 {
				t.Errorf("WAL bytes %d", res.WALBytes)
			}
		})
	}
}

// TestRatios checks the framework/bare rows and their stdout table.
func TestRatios(t *testing.T) {
	r := &report{Config: config{Concs: []int{1, 4}, Broker: "none", Workload: workloadTwoStatement}}
	r.Cells = []cell{
		{Contender: "bare-pgx", Conc: 1, Throughput: 1000, WALBytes: 500, ServerCPUus: 120, ClientCPUus: 90, Allocs: 53},
		{Contender: "outbox-pgx", Conc: 1, Throughput: 800, WALBytes: 1200, ServerCPUus: 230, ClientCPUus: 150, Allocs: 198},
		{Contender: "bare-pgx", Conc: 4, Throughput: 2000},
		{Contender: "outbox-pgx", Conc: 4, Throughput: 1000},
		{Contender: "outbox-middleware", Conc: 4, Throughput: 700}, // no bare: no row
	}
	rows := ratios(r)
	if len(rows) != 2 || rows[0].Ratio != 0.8 || rows[1].Ratio != 0.5 || rows[0].FrameworkWAL != 1200 || rows[0].BareWAL != 500 {
		t.Fatalf("ratios: %+v", rows)
	}
	var out bytes.Buffer
	printRatios(&out, r)
	for _, want := range []string{"broker none, workload two-statement", "outbox-pgx / bare-pgx", "0.80", "0.50", "800 | 1200"} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("stdout table lacks %q:\n%s", want, out.String())
		}
	}
	if strings.Contains(out.String(), "outbox-middleware / bare") {
		t.Errorf("a pair without its bare side printed:\n%s", out.String())
	}
	md := ratiosMarkdown(r)
	if !strings.Contains(md, "| outbox-pgx / bare-pgx | 4 | **0.50** |") {
		t.Errorf("markdown lacks the c=4 row:\n%s", md)
	}
	if !strings.Contains(md, "| 230 / 120 | 150 / 90 | 198 / 53 |") || !strings.Contains(md, "| ? / ? | ? / ? | ? / ? |") {
		t.Errorf("markdown lacks the CPU and allocations of the c=1 row, or the unmeasured ones of the c=4 row:\n%s", md)
	}
	if !strings.Contains(out.String(), "230+150 | 198") {
		t.Errorf("stdout lacks the CPU and allocations table:\n%s", out.String())
	}
}
