package main

import (
	"bytes"
	"context"
	"os"
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
// (with the embedded NATS server, watermill-sql, RabbitMQ and Redis Streams as the broker): every
// order must end paid or rejected, and no business effect may happen twice.
func TestChaos(t *testing.T) {
	cases := []struct {
		name     string
		postgres bool
		broker   string
	}{
		{"sqlite+nats", false, "nats"},
		{"postgres+nats", true, "nats"},
		{"postgres+watermill-sql", true, "postgres"},
		{"postgres+rabbitmq", true, "amqp"},
		{"postgres+redis", true, "redis"},
	}
	for i, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			cfg := testConfig(t)
			if tc.postgres {
				cfg.postgres = pgtest.DSN(t)
			}
			cfg.broker = tc.broker
			switch tc.broker {
			case "amqp", "redis":
				kind := map[string]string{"amqp": brokertest.RabbitMQ, "redis": brokertest.Redis}[tc.broker]
				srv, err := brokertest.Start(kind)
				if err != nil {
					t.Fatal(err)
				}
				t.Cleanup(srv.Close)
				cfg.amqpURL, cfg.redis = srv.Addr(), srv.Addr()
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
			if rep.Duplicates == 0 || rep.Failures == 0 {
				t.Errorf("no chaos: %d duplicates suppressed, %d injected failures", rep.Duplicates, rep.Failures)
			}
		})
	}
}
