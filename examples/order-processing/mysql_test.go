package main

import (
	"bytes"
	"context"
	"crypto/rand"
	"database/sql"
	"encoding/hex"
	"encoding/json"
	"io"
	"net/http"
	"os"
	"slices"
	"strings"
	"testing"
	"time"

	gomysql "github.com/go-sql-driver/mysql"

	"github.com/watermill-outbox/outbox/internal/mysqlserver"
)

// envMySQLDSN names an existing MySQL or MariaDB server (go-sql-driver/mysql's DSN, a user that may
// CREATE DATABASE) for the tests instead of a private one; the driver's tests read it too.
const envMySQLDSN = "OUTBOX_TEST_MYSQL_DSN"

// mysqlDSN returns the DSN of a fresh database, dropped when the test ends, on a private MariaDB
// (or MySQL) server started for the test from the installed binaries (internal/mysqlserver), or
// on the server of OUTBOX_TEST_MYSQL_DSN. Without either the test fails: it never skips.
func mysqlDSN(t *testing.T) string {
	t.Helper()
	base := os.Getenv(envMySQLDSN)
	if base == "" {
		srv, err := mysqlserver.Start()
		if err != nil {
			t.Fatalf("start a MariaDB/MySQL server (or set %s): %v", envMySQLDSN, err)
		}
		t.Cleanup(func() {
			if err := srv.Stop(); err != nil {
				t.Errorf("stop the MariaDB/MySQL server: %v", err)
			}
		})
		base = "root@tcp(" + srv.Addr + ")/"
	}
	cfg, err := gomysql.ParseDSN(base)
	if err != nil {
		t.Fatalf("%s: %v", envMySQLDSN, err)
	}
	b := make([]byte, 6)
	_, _ = rand.Read(b)
	name := "orders_" + hex.EncodeToString(b)
	cfg.DBName = ""
	admin, err := sql.Open("mysql", cfg.FormatDSN())
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if _, err := admin.ExecContext(ctx, "CREATE DATABASE "+name); err != nil {
		_ = admin.Close()
		t.Fatalf("create database %s: %v", name, err)
	}
	t.Cleanup(func() {
		defer admin.Close()
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		if _, err := admin.ExecContext(ctx, "DROP DATABASE IF EXISTS "+name); err != nil {
			t.Errorf("drop database %s: %v", name, err)
		}
	})
	cfg.DBName = name
	return cfg.FormatDSN()
}

// The demo on MySQL/MariaDB (-mysql): the business tables in MySQL's DDL, the SQL of the handlers
// with its $N placeholders rewritten, an order placed through the API going through every
// consumer to paid, an unknown SKU refused, a keyed retry replayed, an unpaid order cancelled by its
// payment timeout. (Were the driver to keep no keys or delayed effects, the service would announce
// it at start and leave them out: a keyed request would get 501, an order that waits for a
// confirmation would stay reserved.)
func TestDemoOnMySQL(t *testing.T) {
	cfg := testConfig(t)
	cfg.mysql = mysqlDSN(t)
	cfg.paymentTimeout = time.Second
	var out syncBuffer
	base, client := startService(t, cfg, &out)
	banner := out.String()
	if !strings.Contains(banner, "database: MySQL") {
		t.Errorf("the start-up banner does not name MySQL:\n%s", banner)
	}
	keys := !strings.Contains(banner, "Idempotency-Key: not supported")
	delays := !strings.Contains(banner, "Payment timeouts: off")
	t.Logf("idempotency keys %v, delayed effects %v:\n%s", keys, delays, banner)
	if !keys || !delays {
		// drivers/mysql keeps both: the service must find them (the paths without them stay for
		// a driver that does not).
		t.Errorf("on MySQL the service runs without idempotency keys (%v) or delayed effects (%v); drivers/mysql keeps both", !keys, !delays)
	}

	post := func(body, key string) (int, string, http.Header) {
		t.Helper()
		req, err := http.NewRequest(http.MethodPost, base+"/orders", strings.NewReader(body))
		if err != nil {
			t.Fatal(err)
		}
		if key != "" {
			req.Header.Set("Idempotency-Key", key)
		}
		resp, err := client.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(b), resp.Header
	}
	waitStatus := func(location string, want ...string) Order {
		t.Helper()
		deadline := time.Now().Add(30 * time.Second)
		for {
			resp, err := client.Get(base + location)
			if err != nil {
				t.Fatal(err)
			}
			var o Order
			err = json.NewDecoder(resp.Body).Decode(&o)
			_ = resp.Body.Close()
			if err != nil {
				t.Fatalf("GET %s: %v", location, err)
			}
			if slices.Contains(want, o.Status) {
				return o
			}
			if time.Now().After(deadline) {
				t.Fatalf("order %s is %q after 30 s, want %q", o.ID, o.Status, want)
			}
			time.Sleep(20 * time.Millisecond)
		}
	}

	code, body, h := post(`{"customer":"ada@example.com","sku":"espresso-beans","quantity":2}`, "")
	if code != http.StatusCreated || h.Get("Location") == "" {
		t.Fatalf("POST /orders: %d %s", code, body)
	}
	paid := waitStatus(h.Get("Location"), "paid")
	if paid.AmountCents != 2*1890 || len(paid.History) < 2 || paid.CreatedAt.IsZero() {
		t.Errorf("the paid order as the API shows it: %+v; want 37.80 EUR, with its history (reserved, paid)", paid)
	}

	code1, _, h1 := post(`{"customer":"bob@example.com","sku":"espresso-beans","quantity":1}`, "mysql-retry")
	code2, body2, h2 := post(`{"customer":"bob@example.com","sku":"espresso-beans","quantity":1}`, "mysql-retry")
	switch {
	case keys && (code1 != http.StatusCreated || code2 != http.StatusCreated || h1.Get("Location") == "" ||
		h1.Get("Location") != h2.Get("Location") || h2.Get("Idempotent-Replayed") != "true"):
		t.Errorf("POST /orders twice with one Idempotency-Key: %d %q, then %d %q (Idempotent-Replayed %q); want the same order, replayed",
			code1, h1.Get("Location"), code2, h2.Get("Location"), h2.Get("Idempotent-Replayed"))
	case !keys && (code1 != http.StatusNotImplemented || code2 != http.StatusNotImplemented || !strings.Contains(body2, "Idempotency-Key")):
		t.Errorf("POST /orders with an Idempotency-Key the database cannot keep: %d, then %d %s; want 501 twice", code1, code2, body2)
	}

	if code, body, _ := post(`{"customer":"ada@example.com","sku":"no-such-sku","quantity":1}`, ""); code != http.StatusUnprocessableEntity {
		t.Errorf("POST /orders with an unknown SKU: %d %s, want 422", code, body)
	}

	// A burr grinder (129 EUR) waits for a confirmation that never comes: its payment timeout
	// (1 s here) cancels it, or, without delayed effects, it stays reserved.
	code, body, h = post(`{"customer":"cy@example.com","sku":"burr-grinder","quantity":1}`, "")
	if code != http.StatusCreated {
		t.Fatalf("POST /orders for a burr grinder: %d %s", code, body)
	}
	if delays {
		if o := waitStatus(h.Get("Location"), "cancelled"); !strings.Contains(o.Reason, "not paid within 1s") {
			t.Errorf("the cancelled order's reason: %q", o.Reason)
		}
	} else {
		waitStatus(h.Get("Location"), "reserved")
		time.Sleep(2 * time.Second) // twice the payment window
		if o := waitStatus(h.Get("Location"), "reserved", "cancelled", "paid"); o.Status != "reserved" {
			t.Errorf("without payment timeouts the burr grinder's order is %q, want reserved", o.Status)
		}
	}
}

// TestChaosOnMySQL is TestChaos on MySQL/MariaDB with the embedded NATS server: every order final,
// no business effect twice. Without idempotency keys the clients send none and retry nothing;
// without delayed effects no order waits for a confirmation (the chaos run says so at start).
func TestChaosOnMySQL(t *testing.T) {
	cfg := testConfig(t)
	cfg.mysql = mysqlDSN(t)
	cfg.orders = 100
	cfg.restartEvery = time.Second
	cfg.seed = 11
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
	if rep.Lost != 0 || rep.AppliedTwice != 0 || !rep.ok() {
		t.Errorf("lost %d, applied twice %d: want 0 and 0; the numbers reconcile: %v", rep.Lost, rep.AppliedTwice, rep.ok())
	}
	keys := !strings.Contains(out.String(), "Idempotency-Key: not supported")
	if keys && rep.Retries == 0 {
		t.Errorf("no order was retried with its Idempotency-Key")
	}
	if rep.Duplicates == 0 || rep.Failures == 0 {
		t.Errorf("no chaos: %d duplicates suppressed, %d injected failures", rep.Duplicates, rep.Failures)
	}
}

// TestRebind: the $N of the example's SQL become MySQL's ?, with the arguments in their order,
// and nothing within quotes changes.
func TestRebind(t *testing.T) {
	cases := []struct {
		in, want string
		order    []int
	}{
		{`SELECT 1`, `SELECT 1`, nil},
		{`UPDATE stock SET available = available - $2 WHERE sku = $1 AND available >= $2`,
			`UPDATE stock SET available = available - ? WHERE sku = ? AND available >= ?`, []int{1, 0, 1}},
		{`SELECT '$1', "$2", ` + "`$3`" + `, 'it\'s $1' FROM t WHERE a = $10`,
			`SELECT '$1', "$2", ` + "`$3`" + `, 'it\'s $1' FROM t WHERE a = ?`, []int{9}},
		{`SELECT JSON_EXTRACT(x, '$.a') FROM t WHERE price > $1`, `SELECT JSON_EXTRACT(x, '$.a') FROM t WHERE price > ?`, []int{0}},
	}
	for _, tc := range cases {
		got, order, err := rebind(tc.in)
		if err != nil || got != tc.want || !slices.Equal(order, tc.order) {
			t.Errorf("rebind(%q) = %q, %v, %v; want %q, %v", tc.in, got, order, err, tc.want, tc.order)
		}
	}
	if _, _, err := rebind(`SELECT $0`); err == nil {
		t.Error("rebind accepted $0")
	}
}
