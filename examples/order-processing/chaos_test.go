package main

import (
	"bytes"
	"context"
	"io"
	"net/http"
	"os"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/watermill-outbox/outbox/internal/brokertest"
	"github.com/watermill-outbox/outbox/internal/pgtest"
)

// TestMain provides a throwaway PostgreSQL server (or OUTBOX_TEST_DSN) and checks that no
// goroutine outlives the tests.
func TestMain(m *testing.M) { os.Exit(pgtest.Run(m)) }

// testConfig is the default configuration with its data under t.TempDir().
func testConfig(t *testing.T) config {
	t.Helper()
	cfg, err := parseFlags([]string{"-data", t.TempDir(), "-addr", "127.0.0.1:0"})
	if err != nil {
		t.Fatal(err)
	}
	return cfg
}

// TestChaos runs the chaos mode with a small load on the embedded default and on PostgreSQL
// (with the embedded NATS server, watermill-sql, RabbitMQ, Redis Streams and Kafka as the broker),
// in the database/sql form and in the pgx form: every order must end paid or rejected, no
// business effect may happen twice, and each malformed message (3, the default) must be one dead
// letter.
func TestChaos(t *testing.T) {
	cases := []struct {
		name     string
		postgres bool
		broker   string
		form     string
	}{
		{"sqlite+nats", false, "nats", formSQL},
		{"postgres+nats", true, "nats", formSQL},
		{"postgres+watermill-sql", true, "postgres", formSQL},
		{"postgres+rabbitmq", true, "amqp", formSQL},
		{"postgres+redis", true, "redis", formSQL},
		{"postgres+kafka", true, "kafka", formSQL},
		// The pgx form (a pgxpool and drivers/outboxpgx) under the same chaos.
		{"pgx+nats", true, "nats", formPgx},
		{"pgx+watermill-sql", true, "postgres", formPgx},
	}
	for i, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			cfg := testConfig(t)
			if tc.postgres {
				cfg.postgres = pgtest.DSN(t)
			}
			cfg.broker = tc.broker
			cfg.form = tc.form
			switch tc.broker {
			case "amqp", "redis", "kafka":
				kind := map[string]string{"amqp": brokertest.RabbitMQ, "redis": brokertest.Redis, "kafka": brokertest.Kafka}[tc.broker]
				srv, err := brokertest.Start(kind)
				if err != nil {
					t.Fatal(err)
				}
				t.Cleanup(srv.Close)
				cfg.amqpURL, cfg.redis, cfg.kafkaBrokers = srv.Addr(), srv.Addr(), srv.Addr()
			}
			cfg.orders = 100
			cfg.restartEvery = time.Second
			cfg.seed = uint64(i + 1)
			cfg.timeout = 40 * time.Second

			var out bytes.Buffer
			rep, err := runChaos(context.Background(), cfg, &out)
			t.Log("\n" + out.String())
			if err != nil {
				t.Fatal(err)
			}
			if rep.Placed != cfg.orders || rep.Final != cfg.orders {
				t.Errorf("%d orders placed, %d final, want %d and %d", rep.Placed, rep.Final, cfg.orders, cfg.orders)
			}
			if rep.Lost != 0 || rep.AppliedTwice != 0 {
				t.Errorf("lost %d, applied twice %d: want 0 and 0", rep.Lost, rep.AppliedTwice)
			}
			if !rep.ok() {
				t.Error("the numbers do not reconcile")
			}
			if rep.Malformed != cfg.malformed || cfg.malformed == 0 || rep.MalformedDead != rep.Malformed || rep.OtherDead != 0 {
				t.Errorf("%d malformed messages sent (-malformed %d), %d of them dead letters, %d other dead letters: want all of them, and none",
					rep.Malformed, cfg.malformed, rep.MalformedDead, rep.OtherDead)
			}
			if rep.Retries == 0 {
				t.Errorf("no order was retried with its Idempotency-Key")
			}
			if rep.Duplicates == 0 || rep.Failures == 0 {
				t.Errorf("no chaos: %d duplicates suppressed, %d injected failures", rep.Duplicates, rep.Failures)
			}
			var crashes int64
			for _, n := range rep.Crashes {
				crashes += n
			}
			if crashes == 0 || rep.Restarts == 0 {
				t.Errorf("no chaos: %d crashes at a step, %d kills and restarts", crashes, rep.Restarts)
			}
		})
	}
}

// The chaos run prints where its /metrics listens, and with -linger keeps serving it after the
// report, so that a Prometheus scraping the run sees its end; it stops when interrupted.
func TestChaosServesMetricsAfterTheRun(t *testing.T) {
	cfg := testConfig(t)
	cfg.orders, cfg.restartEvery, cfg.timeout = 20, time.Second, 40*time.Second
	cfg.linger = -1
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	out := &syncBuffer{}
	done := make(chan error, 1)
	go func() { _, err := runChaos(ctx, cfg, out); done <- err }()

	addr := regexp.MustCompile(`API and metrics: http://(\S+) `)
	deadline := time.Now().Add(90 * time.Second)
	for !strings.Contains(out.String(), "still serving") {
		select {
		case err := <-done:
			t.Fatalf("the run ended (%v) without lingering:\n%s", err, out.String())
		case <-time.After(100 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			t.Fatalf("no report with \"still serving\" within 90 s:\n%s", out.String())
		}
	}
	m := addr.FindStringSubmatch(out.String())
	if m == nil {
		t.Fatalf("the run did not print its metrics address:\n%s", out.String())
	}
	resp, err := http.Get("http://" + m[1] + "/metrics")
	if err != nil {
		t.Fatalf("GET /metrics after the report: %v", err)
	}
	body, err := io.ReadAll(resp.Body)
	_ = resp.Body.Close()
	if err != nil || resp.StatusCode != http.StatusOK || !strings.Contains(string(body), "outbox_messages_handled_total") {
		t.Fatalf("GET /metrics after the report: %d, %v, want 200 with the outbox metrics:\n%.500s", resp.StatusCode, err, body)
	}
	cancel()
	select {
	case err := <-done:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("the run did not stop within 30 s of its interruption")
	}
}
