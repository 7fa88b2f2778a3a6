package idempotency_test

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/watermill-outbox/outbox"
	"github.com/watermill-outbox/outbox/drivers/postgres"
	"github.com/watermill-outbox/outbox/idempotency"
	"github.com/watermill-outbox/outbox/internal/pgtest"
	"github.com/watermill-outbox/outbox/outboxtest"
)

// storedServer serves POST /echo through the middleware with the limits given: the handler
// answers 201 with as many bytes 0xff as the request body has, and a Location of 9 KiB when the
// body begins with "long-location".
func storedServer(t *testing.T, maxPayload, maxResponse int) (*outbox.Outbox, *httptest.Server, *atomic.Int32) {
	t.Helper()
	ob, err := outbox.New(outbox.Config{DB: pgtest.DB(t), Driver: postgres.Driver{}, Publisher: &outboxtest.Recorder{}, MaxPayloadBytes: maxPayload})
	if err != nil {
		t.Fatal(err)
	}
	if err := ob.Migrate(context.Background()); err != nil {
		t.Fatal(err)
	}
	mw, err := idempotency.New(idempotency.Config{Outbox: ob, UnsafeSharedKeys: true, MaxResponseBytes: maxResponse,
		OnError: func(_ *http.Request, err error) { t.Logf("500: %v", err) }})
	if err != nil {
		t.Fatal(err)
	}
	var runs atomic.Int32
	srv := httptest.NewServer(mw(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		runs.Add(1)
		body, _ := io.ReadAll(r.Body)
		location := "/echo/" + strconv.Itoa(len(body))
		if strings.HasPrefix(string(body), "long-location") {
			location = "/echo/" + strings.Repeat("l", 9<<10)
		}
		w.Header().Set("Location", location)
		w.WriteHeader(http.StatusCreated)
		_, _ = w.Write(bytes.Repeat([]byte{0xff}, len(body)))
	})))
	t.Cleanup(srv.Close)
	return ob, srv, &runs
}

func postKeyed(t *testing.T, srv *httptest.Server, key, body string) response {
	t.Helper()
	req, err := http.NewRequest(http.MethodPost, srv.URL+"/echo", strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set(idempotency.DefaultHeader, key)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return response{status: resp.StatusCode, header: resp.Header, body: string(b)}
}

// A response under MaxResponseBytes is stored and replayed when the limits leave the room New
// asks for: its body counts once against MaxPayloadBytes (in base64 it took 4/3 of its bytes,
// and 52 KiB under 64 KiB failed with 500).
func TestStoredBodyCountsOnce(t *testing.T) {
	_, srv, runs := storedServer(t, 64<<10, 56<<10)
	body := strings.Repeat("b", 52<<10)
	first := postKeyed(t, srv, "big", body)
	if first.status != http.StatusCreated || first.body != strings.Repeat("\xff", len(body)) {
		t.Fatalf("first request: %d, %d bytes; want 201 with the %d bytes written", first.status, len(first.body), len(body))
	}
	again := postKeyed(t, srv, "big", body)
	if again.status != http.StatusCreated || again.body != first.body || again.header.Get(idempotency.ReplayedHeader) != "true" ||
		again.header.Get("Location") != first.header.Get("Location") {
		t.Fatalf("retry: %d, %d bytes, replayed %q, Location of %d bytes; want the first response replayed",
			again.status, len(again.body), again.header.Get(idempotency.ReplayedHeader), len(again.header.Get("Location")))
	}
	if n := runs.Load(); n != 1 {
		t.Fatalf("the handler ran %d times, want once", n)
	}
}

// Stored headers beyond the room kept for them roll the unit back with the 500 of a response too
// large to store, and nothing is stored: the retry runs again.
func TestStoredHeadersBeyondTheirRoom(t *testing.T) {
	_, srv, runs := storedServer(t, 64<<10, 56<<10)
	body := "long-location"
	if r := postKeyed(t, srv, "long-location", body); r.status != http.StatusInternalServerError || !strings.Contains(r.body, "too large to store") {
		t.Fatalf("response with 9 KiB of stored headers: %d with %d bytes; want 500, too large to store", r.status, len(r.body))
	}
	if r := postKeyed(t, srv, "long-location", body); r.status != http.StatusInternalServerError || runs.Load() != 2 {
		t.Fatalf("retry: %d after %d runs; want it to run again (nothing stored)", r.status, runs.Load())
	}
}

// New refuses a MaxResponseBytes that leaves no room for the stored status and headers within
// the Outbox's MaxPayloadBytes: such a response would fail only when it is stored.
func TestNewRefusesResponsesThatCannotBeStored(t *testing.T) {
	db := pgtest.DB(t)
	for _, tc := range []struct {
		payload, response int
		ok                bool
	}{
		{64 << 10, 64 << 10, false},
		{64 << 10, 56<<10 + 1, false},
		{64 << 10, 56 << 10, true},
		{1 << 20, 0, false}, // the default MaxResponseBytes, 1 MiB
		{0, 0, true},        // the defaults: 16 MiB and 1 MiB
	} {
		ob, err := outbox.New(outbox.Config{DB: db, Driver: postgres.Driver{}, Publisher: &outboxtest.Recorder{}, MaxPayloadBytes: tc.payload})
		if err != nil {
			t.Fatal(err)
		}
		_, err = idempotency.New(idempotency.Config{Outbox: ob, UnsafeSharedKeys: true, MaxResponseBytes: tc.response})
		if (err == nil) != tc.ok {
			t.Errorf("MaxPayloadBytes %d, MaxResponseBytes %d: New returned %v; want accepted %v", tc.payload, tc.response, err, tc.ok)
		}
	}
}

// A response stored in the JSON form of earlier versions (the body in base64) is still replayed.
func TestStoredJSONResponseReplayed(t *testing.T) {
	ob, srv, runs := storedServer(t, 0, 0)
	body := "order"
	req := httptest.NewRequest(http.MethodPost, "/echo", strings.NewReader(body))
	legacy, err := json.Marshal(map[string]any{"status": 201, "header": http.Header{"Location": {"/orders/7"}}, "body": []byte("stored \xff")})
	if err != nil {
		t.Fatal(err)
	}
	ctx := outbox.WithIdempotencyKey(context.Background(), "http", "legacy", outbox.Fingerprint(idempotency.DefaultFingerprint(req, []byte(body))))
	if err := ob.InUnit(ctx, func(ctx context.Context) error { return outbox.SetResult(ctx, legacy) }); err != nil {
		t.Fatal(err)
	}
	r := postKeyed(t, srv, "legacy", body)
	if r.status != http.StatusCreated || r.body != "stored \xff" || r.header.Get("Location") != "/orders/7" || r.header.Get(idempotency.ReplayedHeader) != "true" {
		t.Fatalf("request with a key stored in JSON: %d %q, Location %q, replayed %q; want the stored response",
			r.status, r.body, r.header.Get("Location"), r.header.Get(idempotency.ReplayedHeader))
	}
	if n := runs.Load(); n != 0 {
		t.Fatalf("the handler ran %d times, want none", n)
	}
}
