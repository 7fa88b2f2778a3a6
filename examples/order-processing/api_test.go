package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"
)

// TestAPI starts the service with its defaults (SQLite and an in-process NATS server) and places
// orders through the HTTP API: one ends paid, one that asks for more than is in stock ends
// rejected, and invalid requests are refused.
func TestAPI(t *testing.T) {
	base, client := startService(t, testConfig(t), io.Discard)

	place := func(body string) (int, Order, string) {
		t.Helper()
		resp, err := client.Post(base+"/orders", "application/json", strings.NewReader(body))
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		var o Order
		_ = json.NewDecoder(resp.Body).Decode(&o)
		return resp.StatusCode, o, resp.Header.Get("Location")
	}
	waitFor := func(location, status string) Order {
		t.Helper()
		deadline := time.Now().Add(30 * time.Second)
		for {
			resp, err := client.Get(base + location)
			if err != nil {
				t.Fatal(err)
			}
			var o Order
			err = json.NewDecoder(resp.Body).Decode(&o)
			resp.Body.Close()
			if err != nil || resp.StatusCode != http.StatusOK {
				t.Fatalf("GET %s: %s, %v", location, resp.Status, err)
			}
			if o.Status == status {
				return o
			}
			if time.Now().After(deadline) {
				t.Fatalf("order %s is %q after 30s, want %q", o.ID, o.Status, status)
			}
			time.Sleep(20 * time.Millisecond)
		}
	}

	code, o, location := place(`{"customer":"ada@example.com","sku":"espresso-beans","quantity":2}`)
	if code != http.StatusCreated || o.Status != "pending" || o.AmountCents != 3780 || location != "/orders/"+o.ID {
		t.Fatalf("POST /orders: %d %+v, Location %q", code, o, location)
	}
	paid := waitFor(location, "paid")
	if len(paid.History) != 2 {
		t.Errorf("history of a paid order: %+v, want stock_reserved and payment_captured", paid.History)
	}

	// The kettle has 3 units.
	code, _, location = place(`{"customer":"bob@example.com","sku":"gooseneck-kettle","quantity":4}`)
	if code != http.StatusCreated {
		t.Fatalf("POST /orders: %d", code)
	}
	if rejected := waitFor(location, "rejected"); rejected.Reason != "out of stock" {
		t.Errorf("rejected order: %+v", rejected)
	}

	for body, want := range map[string]int{
		`{"customer":"ada@example.com","sku":"espresso-beans","quantity":0}`: http.StatusUnprocessableEntity,
		`{"customer":"not an address","sku":"espresso-beans","quantity":1}`:  http.StatusUnprocessableEntity,
		`{"customer":"ada@example.com","sku":"no-such-thing","quantity":1}`:  http.StatusUnprocessableEntity,
		`{"customer":"ada@example.com","sku":"espresso-beans","qty":1}`:      http.StatusBadRequest,
		`not json`: http.StatusBadRequest,
	} {
		if code, _, _ := place(body); code != want {
			t.Errorf("POST /orders %s: %d, want %d", body, code, want)
		}
	}
	// A client retries a POST with its Idempotency-Key (the first response was lost): it gets the
	// first response back and places no second order; the key with another order is refused.
	keyed := func(key, body string) (int, Order, http.Header) {
		t.Helper()
		req, err := http.NewRequest(http.MethodPost, base+"/orders", strings.NewReader(body))
		if err != nil {
			t.Fatal(err)
		}
		req.Header.Set("Idempotency-Key", key)
		resp, err := client.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		var o Order
		_ = json.NewDecoder(resp.Body).Decode(&o)
		return resp.StatusCode, o, resp.Header
	}
	order := `{"customer":"cy@example.com","sku":"espresso-beans","quantity":1}`
	code, first, h := keyed("retry-1", order)
	if code != http.StatusCreated || h.Get("Idempotent-Replayed") != "" {
		t.Fatalf("first keyed POST: %d %+v %v", code, first, h)
	}
	waitFor("/orders/"+first.ID, "paid")
	code, again, h := keyed("retry-1", order)
	if code != http.StatusCreated || again.ID != first.ID || again.Status != "pending" || h.Get("Idempotent-Replayed") != "true" ||
		h.Get("Location") != "/orders/"+first.ID {
		t.Fatalf("retried keyed POST: %d %+v %v; want the first response (order %s, pending), replayed", code, again, h, first.ID)
	}
	if code, _, _ := keyed("retry-1", `{"customer":"cy@example.com","sku":"espresso-beans","quantity":2}`); code != http.StatusUnprocessableEntity {
		t.Fatalf("key reused for another order: %d, want 422", code)
	}
	// Keys belong to their caller: another customer who picks the same key places an order of
	// their own, and never gets cy's back.
	code, other, h := keyed("retry-1", `{"customer":"di@example.com","sku":"espresso-beans","quantity":1}`)
	if code != http.StatusCreated || other.ID == first.ID || other.Customer != "di@example.com" || h.Get("Idempotent-Replayed") != "" {
		t.Fatalf("another customer with the same key: %d %+v %v; want an order of their own", code, other, h)
	}

	resp, err := client.Get(base + "/orders/no-such-order")
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusNotFound {
		t.Errorf("GET of an unknown order: %s", resp.Status)
	}
}

// startService runs serve, as main does, until the test ends, and returns the base URL of its
// HTTP server and a client for it. out receives what serve prints.
func startService(t *testing.T, cfg config, out io.Writer) (base string, client *http.Client) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	addrc, done := make(chan string, 1), make(chan error, 1)
	go func() { done <- serve(ctx, cfg, out, func(addr string) { addrc <- addr }) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("serve: %v", err)
		}
	})
	select {
	case addr := <-addrc:
		base = "http://" + addr
	case err := <-done:
		t.Fatalf("serve: %v", err)
	case <-time.After(30 * time.Second):
		t.Fatal("the service did not start in 30s")
	}
	transport := &http.Transport{}
	t.Cleanup(transport.CloseIdleConnections)
	return base, &http.Client{Transport: transport, Timeout: 10 * time.Second}
}

// TestHealthEndpoint: the service serves a readiness probe at GET /healthz, as a deployment's
// load balancer or Kubernetes would call it: 200 and {"healthy":true} while it runs, with no
// detail for whoever can reach it.
func TestHealthEndpoint(t *testing.T) {
	base, client := startService(t, testConfig(t), io.Discard)
	var body map[string]any
	waitUntil(t, "GET /healthz reports healthy", func() (bool, string) {
		resp, err := client.Get(base + "/healthz")
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		body = nil
		_ = json.NewDecoder(resp.Body).Decode(&body)
		return resp.StatusCode == http.StatusOK && body["healthy"] == true, fmt.Sprintf("%s %v", resp.Status, body)
	})
	if len(body) != 1 {
		t.Errorf("GET /healthz shows %v, want the status only", body)
	}
}

// TestConsumersCheck: the readiness probe's check of the consumers fails once their Router has
// stopped, which the outbox's own checks (database, relay) cannot see.
func TestConsumersCheck(t *testing.T) {
	ctx := context.Background()
	s, err := openService(ctx, testConfig(t), 2*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	defer s.close()
	ob, pub, err := s.newOutbox()
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = pub.Close() }()
	if err := ob.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	stop, running, err := startConsumers(ctx, s, ob, nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := running(ctx); err != nil {
		t.Fatalf("consumers running: the check says %v", err)
	}
	if err := stop(); err != nil {
		t.Fatal(err)
	}
	if err := running(ctx); err == nil {
		t.Fatal("consumers stopped: the check passes")
	}
}
