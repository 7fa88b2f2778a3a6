package idempotency_test

import (
	"bytes"
	"compress/gzip"
	"context"
	"database/sql"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/watermill-outbox/outbox"
	"github.com/watermill-outbox/outbox/drivers/postgres"
	"github.com/watermill-outbox/outbox/idempotency"
	"github.com/watermill-outbox/outbox/internal/pgtest"
	"github.com/watermill-outbox/outbox/outboxtest"
)

func TestMain(m *testing.M) { os.Exit(pgtest.Run(m)) }

type fixture struct {
	t     *testing.T
	db    *sql.DB
	rec   *outboxtest.Recorder
	runs  atomic.Int32
	delay time.Duration
	// hold, when set, is called by the handler after it counted its run and before it works.
	hold func()
	srv  *httptest.Server
}

// newFixture serves POST /orders, which places an order (a row and an event) and answers 201
// with its Location; "fail" in the body answers 503, "big" writes more than the bound.
func newFixture(t *testing.T, mutate func(*idempotency.Config)) *fixture {
	f := &fixture{t: t, db: pgtest.DB(t), rec: &outboxtest.Recorder{}}
	ob, err := outbox.New(outbox.Config{DB: f.db, Driver: postgres.Driver{}, Publisher: f.rec})
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	if err := ob.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	if _, err := f.db.Exec(`CREATE TABLE orders (id serial PRIMARY KEY, body text NOT NULL);
		CREATE TABLE slow_commit (n int);
		CREATE FUNCTION slow_commit() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN PERFORM pg_sleep(2); RETURN NULL; END $$;
		CREATE CONSTRAINT TRIGGER slow_commit AFTER INSERT ON slow_commit DEFERRABLE INITIALLY DEFERRED
			FOR EACH ROW EXECUTE FUNCTION slow_commit()`); err != nil {
		t.Fatal(err)
	}
	cfg := idempotency.Config{Outbox: ob, MaxResponseBytes: 1000, OnError: func(_ *http.Request, err error) { t.Logf("500: %v", err) },
		Caller: func(r *http.Request) string { return r.Header.Get("X-Caller") }}
	if mutate != nil {
		mutate(&cfg)
	}
	mw, err := idempotency.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	mux := http.NewServeMux()
	mux.HandleFunc("POST /orders", func(w http.ResponseWriter, r *http.Request) {
		f.runs.Add(1)
		if f.hold != nil {
			f.hold()
		}
		time.Sleep(f.delay)
		body, _ := io.ReadAll(r.Body)
		ctx := r.Context()
		if strings.Contains(string(body), "fail") {
			http.Error(w, "payment service unavailable", http.StatusServiceUnavailable)
			return
		}
		var id int
		if err := outbox.Tx(ctx).QueryRowContext(ctx, `INSERT INTO orders (body) VALUES ($1) RETURNING id`, string(body)).Scan(&id); err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		if string(body) == "early hints, then 500" {
			w.WriteHeader(http.StatusEarlyHints) // informational: not the response
			http.Error(w, "failed after its early hints", http.StatusInternalServerError)
			return
		}
		if string(body) == "encoded" {
			// A handler that encodes its own body: stored as encoded, it needs its encoding.
			var gz bytes.Buffer
			zw := gzip.NewWriter(&gz)
			_, _ = fmt.Fprintf(zw, `{"id":%d}`, id)
			_ = zw.Close()
			w.Header().Set("Content-Encoding", "gzip")
			w.WriteHeader(http.StatusCreated)
			_, _ = w.Write(gz.Bytes())
			return
		}
		if string(body) == "conflict after a refused statement" {
			// The statement fails (on PostgreSQL the transaction is aborted), and the handler
			// answers for it, without a savepoint.
			if _, err := outbox.Tx(ctx).ExecContext(ctx, `INSERT INTO orders (id, body) VALUES (1, 'x'), (1, 'x')`); err == nil {
				http.Error(w, "the duplicate was taken", http.StatusInternalServerError)
				return
			}
			http.Error(w, "order 1 exists", http.StatusConflict)
			return
		}
		if code, ok := strings.CutPrefix(string(body), "status:"); ok {
			n, _ := strconv.Atoi(code)
			http.Error(w, "refused", n)
			return
		}
		if err := outbox.Publish(ctx, "orders", outbox.NewMessage(ctx, body)); err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		if string(body) == "kill" {
			// The unit's connection dies during its COMMIT (held there by a deferred trigger):
			// the outcome is unknown to the client.
			var pid int
			if err := outbox.Tx(ctx).QueryRowContext(ctx, `SELECT pg_backend_pid()`).Scan(&pid); err != nil {
				http.Error(w, err.Error(), http.StatusInternalServerError)
				return
			}
			if _, err := outbox.Tx(ctx).ExecContext(ctx, `INSERT INTO slow_commit VALUES (1)`); err != nil {
				http.Error(w, err.Error(), http.StatusInternalServerError)
				return
			}
			go func() {
				time.Sleep(300 * time.Millisecond)
				_, _ = f.db.Exec(`SELECT pg_terminate_backend($1)`, pid)
			}()
		}
		w.Header().Set("Location", fmt.Sprintf("/orders/%d", id))
		w.Header().Set("Content-Type", "application/json")
		w.Header().Set("X-Not-Stored", "1")
		w.WriteHeader(http.StatusCreated)
		if strings.Contains(string(body), "big") {
			_, _ = w.Write([]byte(strings.Repeat("x", 2000)))
			return
		}
		_, _ = fmt.Fprintf(w, `{"id":%d}`, id)
	})
	f.srv = httptest.NewServer(mw(mux))
	t.Cleanup(f.srv.Close)
	return f
}

type response struct {
	status int
	header http.Header
	body   string
}

func (f *fixture) post(key, body string) response {
	f.t.Helper()
	return f.postAs("alice", key, body)
}

// postAs posts as caller ("" sends no caller).
func (f *fixture) postAs(caller, key, body string) response {
	f.t.Helper()
	req, err := http.NewRequest(http.MethodPost, f.srv.URL+"/orders", strings.NewReader(body))
	if err != nil {
		f.t.Fatal(err)
	}
	if key != "" {
		req.Header.Set("Idempotency-Key", key)
	}
	if caller != "" {
		req.Header.Set("X-Caller", caller)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		f.t.Error(err)
		return response{}
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return response{status: resp.StatusCode, header: resp.Header, body: string(b)}
}

func (f *fixture) orders() int {
	var n int
	if err := f.db.QueryRow(`SELECT count(*) FROM orders`).Scan(&n); err != nil {
		f.t.Fatal(err)
	}
	return n
}

// A retried POST gets the first response (status, stored headers, body) and places one order; a
// key reused with another body gets 422; a new key places another.
func TestRetryGetsTheFirstResponse(t *testing.T) {
	f := newFixture(t, nil)
	first := f.post("k1", `{"sku":"a"}`)
	if first.status != http.StatusCreated || first.header.Get("Location") != "/orders/1" || first.header.Get(idempotency.ReplayedHeader) != "" {
		t.Fatalf("first: %+v", first)
	}
	retry := f.post("k1", `{"sku":"a"}`)
	if retry.status != http.StatusCreated || retry.body != first.body || retry.header.Get("Location") != "/orders/1" ||
		retry.header.Get("Content-Type") != "application/json" || retry.header.Get(idempotency.ReplayedHeader) != "true" {
		t.Fatalf("retry: %+v, want the first response %+v, replayed", retry, first)
	}
	if retry.header.Get("X-Not-Stored") != "" {
		t.Errorf("a header not in StoredHeaders was replayed")
	}
	if f.runs.Load() != 1 || f.orders() != 1 || len(f.rec.All()) != 1 {
		t.Fatalf("handler ran %d times, %d orders, %d events; want 1 each", f.runs.Load(), f.orders(), len(f.rec.All()))
	}
	if r := f.post("k1", `{"sku":"b"}`); r.status != http.StatusUnprocessableEntity || !strings.Contains(r.header.Get("Content-Type"), "problem+json") {
		t.Fatalf("key reused with another body: %+v", r)
	}
	if r := f.post("k2", `{"sku":"b"}`); r.status != http.StatusCreated || r.header.Get("Location") != "/orders/2" {
		t.Fatalf("another key: %+v", r)
	}
	if f.orders() != 2 {
		t.Fatalf("orders %d, want 2", f.orders())
	}
}

// While the first request with a key runs, a retry gets 409 with Retry-After; with Wait it
// waits and gets the first response. The handler runs once either way.
func TestRetryWhileInFlight(t *testing.T) {
	for _, wait := range []bool{false, true} {
		t.Run(fmt.Sprintf("wait=%v", wait), func(t *testing.T) {
			f := newFixture(t, func(c *idempotency.Config) { c.Wait = wait })
			// The first request's handler runs until the retries were answered (without Wait)
			// or until they had 300 ms to start waiting (with it): every retry is sent while the
			// first is in flight, however slowly the machine runs.
			started, release := make(chan struct{}), make(chan struct{})
			var once sync.Once
			f.hold = func() {
				once.Do(func() { close(started) })
				select {
				case <-release:
				case <-time.After(20 * time.Second):
					t.Error("the first request was held 20 s: the retries never came back")
				}
			}
			results := make([]response, 8)
			first := make(chan struct{})
			go func() {
				defer close(first)
				results[0] = f.post("k", `{"sku":"a"}`)
			}()
			select {
			case <-started:
			case <-time.After(20 * time.Second):
				t.Fatal("the first request's handler did not start within 20 s")
			}
			var wg sync.WaitGroup
			for i := 1; i < len(results); i++ {
				wg.Add(1)
				go func() {
					defer wg.Done()
					results[i] = f.post("k", `{"sku":"a"}`)
				}()
			}
			if wait {
				time.Sleep(300 * time.Millisecond)
				close(release)
				wg.Wait()
			} else {
				wg.Wait()
				close(release)
			}
			<-first
			created, conflicts := 0, 0
			for _, r := range results {
				switch r.status {
				case http.StatusCreated:
					created++
				case http.StatusConflict:
					conflicts++
					if r.header.Get("Retry-After") == "" {
						t.Errorf("409 without Retry-After")
					}
				default:
					t.Errorf("response %+v", r)
				}
			}
			if f.runs.Load() != 1 || f.orders() != 1 {
				t.Fatalf("handler ran %d times, %d orders; want 1", f.runs.Load(), f.orders())
			}
			if wait && created != len(results) || !wait && (created != 1 || conflicts != len(results)-1) {
				t.Fatalf("wait=%v: %d created, %d conflicts of %d", wait, created, conflicts, len(results))
			}
		})
	}
}

// A server error rolls back and is not stored: the retry runs again. A response past the bound
// rolls back and says so. A required key that is missing, or an invalid one, gets 400; GET
// passes through.
func TestFailuresBoundsAndMissingKeys(t *testing.T) {
	f := newFixture(t, func(c *idempotency.Config) { c.Required = true; c.MaxRequestBytes = 100 })
	if r := f.post("k-fail", `fail`); r.status != http.StatusServiceUnavailable || !strings.Contains(r.body, "payment service") {
		t.Fatalf("failing handler: %+v", r)
	}
	if r := f.post("k-fail", `fail`); r.status != http.StatusServiceUnavailable || f.runs.Load() != 2 {
		t.Fatalf("retry of a failed request: %+v after %d runs, want it run again", r, f.runs.Load())
	}
	r := f.post("k-big", `big`)
	if r.status != http.StatusInternalServerError || !strings.Contains(r.body, "1000 bytes") || f.orders() != 0 {
		t.Fatalf("response past the bound: %+v, %d orders (want 500 saying so, nothing committed)", r, f.orders())
	}
	if r := f.post("", `{"sku":"a"}`); r.status != http.StatusBadRequest || !strings.Contains(r.body, "Idempotency-Key") {
		t.Fatalf("missing required key: %+v", r)
	}
	if r := f.post(strings.Repeat("k", 256), `{"sku":"a"}`); r.status != http.StatusBadRequest {
		t.Fatalf("key too long: %+v", r)
	}
	if r := f.post("k-large", strings.Repeat("a", 101)); r.status != http.StatusRequestEntityTooLarge {
		t.Fatalf("request past MaxRequestBytes: %+v", r)
	}
	resp, err := http.Get(f.srv.URL + "/orders")
	if err != nil {
		t.Fatal(err)
	}
	_ = resp.Body.Close()
	if resp.StatusCode != http.StatusMethodNotAllowed {
		t.Fatalf("GET: %d, want the mux's own 405", resp.StatusCode)
	}
	if f.orders() != 0 {
		t.Fatalf("orders %d, want 0", f.orders())
	}
}

// An informational status (103 Early Hints) before the response is not taken for it: a handler
// that then fails has its unit rolled back and its failure answered, and a retry runs it again.
// Before, the 103 was recorded as the response's status: the failed unit committed, and its
// response was stored and replayed as a success.
func TestInformationalStatusIsNotTheResponse(t *testing.T) {
	f := newFixture(t, nil)
	r := f.post("k-hints", "early hints, then 500")
	if r.status != http.StatusInternalServerError || !strings.Contains(r.body, "early hints") {
		t.Fatalf("a handler that sent 103 and then failed: %+v, want its 500", r)
	}
	if f.orders() != 0 {
		t.Errorf("%d orders committed by a unit whose handler failed, want 0", f.orders())
	}
	if r := f.post("k-hints", "early hints, then 500"); r.status != http.StatusInternalServerError || r.header.Get(idempotency.ReplayedHeader) != "" || f.runs.Load() != 2 {
		t.Errorf("retry: %+v after %d runs, want it run again (nothing stored)", r, f.runs.Load())
	}
}

// A response whose body the handler encoded itself (Content-Encoding: gzip) is replayed with
// its encoding, which the default StoredHeaders leave out: replayed without it, the client got
// the gzip bytes as the body.
func TestEncodedResponseIsReplayedWithItsEncoding(t *testing.T) {
	f := newFixture(t, nil)
	first := f.post("k-gzip", "encoded")
	if first.status != http.StatusCreated || !strings.HasPrefix(first.body, `{"id":`) {
		t.Fatalf("first response: %+v, want 201 and the decoded body", first)
	}
	r := f.post("k-gzip", "encoded")
	if r.header.Get(idempotency.ReplayedHeader) != "true" || r.body != first.body {
		t.Fatalf("replay: %+v, want the first response's body %q, replayed", r, first.body)
	}
}

// A status net/http refuses (below 100, above 999) panics in the handler, as net/http's own
// ResponseWriter does there: the unit rolls back and nothing is stored. Recorded, the unit
// committed, and net/http panicked as the response was sent, and again on every retry.
func TestInvalidStatusRollsBack(t *testing.T) {
	f := newFixture(t, nil)
	for range 2 {
		req := httptest.NewRequest(http.MethodPost, "/orders", strings.NewReader("status:99"))
		req.Header.Set("Idempotency-Key", "k-99")
		req.Header.Set("X-Caller", "alice")
		func() {
			defer func() { _ = recover() }()
			f.srv.Config.Handler.ServeHTTP(httptest.NewRecorder(), req)
		}()
	}
	if n := f.orders(); n != 0 {
		t.Errorf("%d orders committed by a handler that wrote status 99, want 0", n)
	}
	if n := f.runs.Load(); n != 2 {
		t.Errorf("the handler ran %d times for two requests, want 2 (nothing stored)", n)
	}
}

// Keys belong to their caller: two callers who send the same key and request each get their own
// run and their own response, and each retry gets its own caller's; a keyed request from no
// identified caller runs nothing.
func TestCallersDoNotShareKeys(t *testing.T) {
	f := newFixture(t, nil)
	alice := f.postAs("alice", "k1", `{"sku":"a"}`)
	bob := f.postAs("bob", "k1", `{"sku":"a"}`)
	if alice.status != http.StatusCreated || bob.status != http.StatusCreated || bob.header.Get(idempotency.ReplayedHeader) != "" {
		t.Fatalf("alice %+v, bob %+v: want each their own 201", alice, bob)
	}
	if alice.header.Get("Location") == bob.header.Get("Location") {
		t.Fatalf("bob got alice's order %s", bob.header.Get("Location"))
	}
	for _, c := range []struct {
		caller string
		first  response
	}{{"alice", alice}, {"bob", bob}} {
		r := f.postAs(c.caller, "k1", `{"sku":"a"}`)
		if r.header.Get(idempotency.ReplayedHeader) != "true" || r.body != c.first.body {
			t.Errorf("%s's retry: %+v, want %s's own first response %q, replayed", c.caller, r, c.caller, c.first.body)
		}
	}
	// A caller whose name is another's scope plus a separator meets nobody's keys.
	if r := f.postAs("alice:http", "k1", `{"sku":"a"}`); r.status != http.StatusCreated || r.header.Get(idempotency.ReplayedHeader) != "" {
		t.Errorf("caller alice:http: %+v, want a run of its own", r)
	}
	if r := f.postAs("", "k1", `{"sku":"a"}`); r.status != http.StatusUnauthorized {
		t.Errorf("keyed request from no caller: %+v, want 401", r)
	}
	if r := f.postAs("", "", `{"sku":"a"}`); r.status != http.StatusCreated {
		t.Errorf("unkeyed request from no caller: %+v, want it run", r)
	}
	if f.runs.Load() != 4 || f.orders() != 4 {
		t.Fatalf("handler ran %d times, %d orders; want 4 (alice, bob, alice:http, unkeyed)", f.runs.Load(), f.orders())
	}
}

// The middleware cannot be built without saying whose keys are whose: Caller, or the loudly named
// opt-out, under which every caller shares one key space.
func TestNewRequiresCaller(t *testing.T) {
	db := pgtest.DB(t)
	ob, err := outbox.New(outbox.Config{DB: db, Driver: postgres.Driver{}, Publisher: &outboxtest.Recorder{}})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := idempotency.New(idempotency.Config{Outbox: ob, Required: true}); err == nil || !strings.Contains(err.Error(), "Caller is required") {
		t.Errorf("New without Caller: %v, want Caller is required", err)
	}
	both := idempotency.Config{Outbox: ob, Caller: func(*http.Request) string { return "a" }, UnsafeSharedKeys: true}
	if _, err := idempotency.New(both); err == nil {
		t.Errorf("New with Caller and UnsafeSharedKeys: no error")
	}
	shared := newFixture(t, func(c *idempotency.Config) { c.Caller, c.UnsafeSharedKeys = nil, true })
	first := shared.postAs("alice", "k1", `{"sku":"a"}`)
	if r := shared.postAs("bob", "k1", `{"sku":"a"}`); r.header.Get(idempotency.ReplayedHeader) != "true" || r.body != first.body {
		t.Errorf("UnsafeSharedKeys: bob got %+v, want alice's response replayed (one key space)", r)
	}
	if r := shared.postAs("", "k2", `{"sku":"a"}`); r.status != http.StatusCreated {
		t.Errorf("UnsafeSharedKeys, no caller: %+v, want 201", r)
	}
}

// 401, 403 and 429 roll back and are not stored by default: the client that renewed its
// credentials or waited out the limit gets a run, not the old refusal.
func TestRefusalsAreNotStored(t *testing.T) {
	f := newFixture(t, nil)
	for _, code := range []int{http.StatusUnauthorized, http.StatusForbidden, http.StatusTooManyRequests} {
		key := "k-" + strconv.Itoa(code)
		body := "status:" + strconv.Itoa(code)
		before := f.runs.Load()
		for range 2 {
			if r := f.post(key, body); r.status != code || r.header.Get(idempotency.ReplayedHeader) != "" {
				t.Errorf("%d: %+v, want the handler's own %d", code, r, code)
			}
		}
		if n := f.runs.Load() - before; n != 2 {
			t.Errorf("%d: the handler ran %d times for a request and its retry, want 2 (not stored)", code, n)
		}
	}
	if f.orders() != 0 {
		t.Errorf("orders %d, want 0: a refusal rolls back", f.orders())
	}
	if r := f.post("k-400", "status:400"); r.status != 400 {
		t.Fatalf("400: %+v", r)
	}
	if r := f.post("k-400", "status:400"); r.header.Get(idempotency.ReplayedHeader) != "true" {
		t.Errorf("a 400 retried: %+v, want it replayed (stored)", r)
	}
}

// The key may come as a structured-field string, as the draft defines it, or bare: both name one
// key. A malformed string is refused.
func TestStructuredFieldKey(t *testing.T) {
	f := newFixture(t, nil)
	first := f.post(`"k-1"`, `{"sku":"a"}`)
	if first.status != http.StatusCreated {
		t.Fatalf("quoted key: %+v", first)
	}
	for _, same := range []string{`k-1`, `"k-1";p=1`} {
		if r := f.post(same, `{"sku":"a"}`); r.header.Get(idempotency.ReplayedHeader) != "true" || r.body != first.body {
			t.Errorf("key %s after \"k-1\": %+v, want the first response replayed", same, r)
		}
	}
	if r := f.post(`"a\"b"`, `{"sku":"a"}`); r.status != http.StatusCreated {
		t.Errorf("escaped quote: %+v", r)
	}
	if r := f.post(`a"b`, `{"sku":"a"}`); r.header.Get(idempotency.ReplayedHeader) != "true" {
		t.Errorf(`bare a"b after "a\"b": %+v, want it replayed (one key)`, r)
	}
	for _, bad := range []string{`"k-1`, `"k\x"`, `"k"x`, `""`} {
		if r := f.post(bad, `{"sku":"a"}`); r.status != http.StatusBadRequest {
			t.Errorf("key %s: %+v, want 400", bad, r)
		}
	}
	if f.runs.Load() != 2 {
		t.Errorf("handler ran %d times, want 2", f.runs.Load())
	}
}

// A COMMIT whose connection broke is answered as an unknown outcome, never as "nothing was done";
// the retry with the key finds out (here the commit did not take effect: it runs).
func TestCommitOutcomeUnknown(t *testing.T) {
	f := newFixture(t, nil)
	r := f.post("k-kill", "kill")
	if r.status != http.StatusInternalServerError || !strings.Contains(r.body, "may or may not") || strings.Contains(r.body, "nothing was done") {
		t.Fatalf("commit on a dead connection: %+v, want 500 saying the outcome is unknown", r)
	}
	f.delay = 0
	if r := f.post("k-kill", "kill"); r.status != http.StatusInternalServerError {
		t.Fatalf("retry: %+v", r)
	}
	if f.runs.Load() != 2 || f.orders() != 0 {
		t.Fatalf("handler ran %d times, %d orders; want 2 runs (the first did not commit) and no order", f.runs.Load(), f.orders())
	}
}

// The handler sees, and may change, the headers that middleware outside this one set (a CORS
// middleware's Vary: Origin, a default Cache-Control): the response buffered for the unit of work
// began with no header, and its headers replaced the outer ones of the same name, so that the
// client got Vary: Accept alone (a cache could serve one origin's response to another), and a
// header the handler deleted stayed.
func TestHandlerSeesTheOuterHeaders(t *testing.T) {
	db := pgtest.DB(t)
	ob, err := outbox.New(outbox.Config{DB: db, Driver: postgres.Driver{}, Publisher: &outboxtest.Recorder{}})
	if err != nil {
		t.Fatal(err)
	}
	defer ob.Close()
	if err := ob.Migrate(context.Background()); err != nil {
		t.Fatal(err)
	}
	mw, err := idempotency.New(idempotency.Config{Outbox: ob, Caller: func(*http.Request) string { return "alice" }})
	if err != nil {
		t.Fatal(err)
	}
	var sawOuter string
	inner := mw(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		sawOuter = w.Header().Get("Vary")
		w.Header().Add("Vary", "Accept")
		w.Header().Del("Cache-Control")
		w.WriteHeader(http.StatusCreated)
	}))
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Vary", "Origin")
		w.Header().Set("Cache-Control", "max-age=60")
		inner.ServeHTTP(w, r)
	}))
	defer srv.Close()
	req, _ := http.NewRequest(http.MethodPost, srv.URL, strings.NewReader("x"))
	req.Header.Set("Idempotency-Key", "k-outer")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if got := resp.Header.Values("Vary"); sawOuter != "Origin" || len(got) != 2 || got[0] != "Origin" || got[1] != "Accept" {
		t.Errorf("the handler saw Vary %q and the client got Vary %q, want Origin, then Origin and Accept", sawOuter, got)
	}
	if cc := resp.Header.Get("Cache-Control"); cc != "" {
		t.Errorf("Cache-Control %q, which the handler deleted, reached the client", cc)
	}
}

// StoredHeaders may not name a header that must never be replayed: a Set-Cookie minted for the
// first request's session went to every retry, and Date, Content-Length and the hop-by-hop
// headers describe one response on one connection, not the stored one.
func TestStoredHeadersRefuseWhatMustNotBeReplayed(t *testing.T) {
	db := pgtest.DB(t)
	ob, err := outbox.New(outbox.Config{DB: db, Driver: postgres.Driver{}, Publisher: &outboxtest.Recorder{}})
	if err != nil {
		t.Fatal(err)
	}
	defer ob.Close()
	for _, h := range []string{"Set-Cookie", "set-cookie", "Date", "Content-Length", "Transfer-Encoding", "Connection", "Trailer", "Keep-Alive", "Upgrade"} {
		cfg := idempotency.Config{Outbox: ob, Caller: func(*http.Request) string { return "a" }, StoredHeaders: []string{"Location", h}}
		if _, err := idempotency.New(cfg); err == nil {
			t.Errorf("StoredHeaders with %s: no error", h)
		}
	}
}

// A handler that answers a failed statement with a 4xx of its own (a unique violation caught and
// answered 409, without a savepoint) gets its answer to the client: on PostgreSQL the failed
// statement aborts the transaction, so nothing commits and nothing is stored, and the client got
// 500 "Request failed" at every try instead, with a key or without.
func TestHandlerAnswerAfterAFailedStatement(t *testing.T) {
	f := newFixture(t, nil)
	for _, key := range []string{"k-conflict", ""} {
		r := f.post(key, "conflict after a refused statement")
		if r.status != http.StatusConflict || !strings.Contains(r.body, "order 1 exists") {
			t.Errorf("key %q: %d %q, want the handler's 409", key, r.status, r.body)
		}
	}
	if r := f.post("k-conflict", "conflict after a refused statement"); r.header.Get(idempotency.ReplayedHeader) != "" || r.status != http.StatusConflict {
		t.Errorf("the retry: %d, replayed %q; want the handler's 409 again, run again (nothing was stored)", r.status, r.header.Get(idempotency.ReplayedHeader))
	}
	if n := f.orders(); n != 0 {
		t.Errorf("%d orders, want none", n)
	}
}
