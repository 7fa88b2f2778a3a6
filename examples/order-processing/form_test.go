package main

import (
	"encoding/json"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/watermill-outbox/outbox/internal/pgtest"
)

// The demo runs on the pgx form as on the database/sql one (TestAPI): an order placed through the
// API (outboxpgx's unit of work at the boundary) goes through every consumer (the middleware on
// the pgx form) and ends paid, and an unknown SKU is refused (sql.ErrNoRows from a pgx row).
func TestDemoOnThePgxForm(t *testing.T) {
	cfg := testConfig(t)
	cfg.postgres, cfg.form = pgtest.DSN(t), formPgx
	var out syncBuffer
	base, client := startService(t, cfg, &out)
	if !strings.Contains(out.String(), "pgx form") {
		t.Errorf("the start-up banner does not name the pgx form:\n%s", out.String())
	}

	resp, err := client.Post(base+"/orders", "application/json", strings.NewReader(`{"customer":"ada@example.com","sku":"espresso-beans","quantity":2}`))
	if err != nil {
		t.Fatal(err)
	}
	location := resp.Header.Get("Location")
	_, _ = io.Copy(io.Discard, resp.Body)
	_ = resp.Body.Close()
	if resp.StatusCode != http.StatusCreated || location == "" {
		t.Fatalf("POST /orders: %s, Location %q", resp.Status, location)
	}
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
		if o.Status == "paid" {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("order %s is %q after 30 s, want paid", o.ID, o.Status)
		}
		time.Sleep(20 * time.Millisecond)
	}

	// A retry with the same Idempotency-Key gets the first order back (the key is claimed in the
	// pgx form's unit of work as in the database/sql one).
	keyed := func() (int, string, string) {
		req, err := http.NewRequest(http.MethodPost, base+"/orders", strings.NewReader(`{"customer":"bob@example.com","sku":"espresso-beans","quantity":1}`))
		if err != nil {
			t.Fatal(err)
		}
		req.Header.Set("Idempotency-Key", "pgx-form-retry")
		resp, err := client.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		_, _ = io.Copy(io.Discard, resp.Body)
		_ = resp.Body.Close()
		return resp.StatusCode, resp.Header.Get("Location"), resp.Header.Get("Idempotent-Replayed")
	}
	code1, loc1, _ := keyed()
	code2, loc2, replayed := keyed()
	if code1 != http.StatusCreated || code2 != http.StatusCreated || loc1 == "" || loc1 != loc2 || replayed != "true" {
		t.Errorf("POST /orders twice with one Idempotency-Key: %d %q, then %d %q (Idempotent-Replayed %q); want the same order, replayed",
			code1, loc1, code2, loc2, replayed)
	}

	resp, err = client.Post(base+"/orders", "application/json", strings.NewReader(`{"customer":"ada@example.com","sku":"no-such-sku","quantity":1}`))
	if err != nil {
		t.Fatal(err)
	}
	_, _ = io.Copy(io.Discard, resp.Body)
	_ = resp.Body.Close()
	if resp.StatusCode != http.StatusUnprocessableEntity {
		t.Errorf("POST /orders with an unknown SKU: %s, want 422", resp.Status)
	}
}
