package console_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/cookiejar"
	"net/http/httptest"
	"net/url"
	"os"
	"regexp"
	"strings"
	"testing"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/watermill-outbox/outbox"
	"github.com/watermill-outbox/outbox/console"
	"github.com/watermill-outbox/outbox/drivers/postgres"
	"github.com/watermill-outbox/outbox/internal/pgtest"
	"github.com/watermill-outbox/outbox/ops"
)

func TestMain(m *testing.M) { os.Exit(pgtest.Run(m)) }

type refusing struct{}

func (refusing) Publish(_ string, msgs ...*message.Message) error {
	for _, m := range msgs {
		if string(m.Payload) == "poison" {
			return errors.New("refused: bad schema")
		}
	}
	return nil
}
func (refusing) Close() error { return nil }

// parkedEnv returns the Ops of a database with one parked effect (and its UUID).
func parkedEnv(t *testing.T) (*ops.Ops, *sql.DB, string) {
	o, db, uuids := parkedBy(t, "billing")
	return o, db, uuids[0]
}

// parkedBy returns the Ops of a database with one parked effect (to topic invoices) of each
// consumer given (one may appear more than once), and their UUIDs, in order.
func parkedBy(t *testing.T, consumers ...string) (*ops.Ops, *sql.DB, []string) {
	t.Helper()
	ob, db, uuids := parkedOutbox(t, consumers...)
	o, err := ops.ForOutbox(ob)
	if err != nil {
		t.Fatal(err)
	}
	return o, db, uuids
}

// parkedOutbox is parkedBy's Outbox, for a tenant.Set.
func parkedOutbox(t *testing.T, consumers ...string) (*outbox.Outbox, *sql.DB, []string) {
	t.Helper()
	db := pgtest.DB(t)
	ob, err := outbox.New(outbox.Config{DB: db, Driver: postgres.Driver{}, Publisher: refusing{}, RelayMaxAttempts: 1, RetryDelay: -1})
	if err != nil {
		t.Fatal(err)
	}
	if err := ob.Migrate(context.Background()); err != nil {
		t.Fatal(err)
	}
	var uuids []string
	for i, consumer := range consumers {
		id := fmt.Sprint("m-", i+1)
		err = ob.Handle(message.NewMessage(id, nil), outbox.HandleParams{Consumer: consumer, MessageID: id},
			func(msg *message.Message) ([]*message.Message, error) {
				ctx := msg.Context()
				if err := outbox.Publish(ctx, "ok", message.NewMessage("", []byte("fine"))); err != nil {
					return nil, err
				}
				bad := message.NewMessage(watermill.NewUUID(), []byte("poison"))
				uuids = append(uuids, bad.UUID)
				return nil, outbox.Publish(ctx, "invoices", bad)
			})
		if !errors.Is(err, outbox.ErrDispatchFailed) {
			t.Fatalf("parking: %v", err)
		}
	}
	ob.FlushMarks()
	return ob, db, uuids
}

func serve(t *testing.T, o *ops.Ops, opt console.Options) *httptest.Server {
	t.Helper()
	h, err := console.New(o, opt)
	return serveHandler(t, h, err)
}

// serveHandler serves a console's handler, built with err, under /outbox/.
func serveHandler(t *testing.T, h http.Handler, err error) *httptest.Server {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
	mux := http.NewServeMux()
	mux.Handle("/outbox/", http.StripPrefix("/outbox", h))
	srv := httptest.NewServer(mux)
	t.Cleanup(srv.Close)
	return srv
}

func get(t *testing.T, c *http.Client, u string) (int, string) {
	t.Helper()
	resp, err := c.Get(u)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}

func TestNothingIsServedWithoutAuthentication(t *testing.T) {
	o, _, _ := parkedEnv(t)
	if _, err := console.New(o, console.Options{}); err == nil {
		t.Fatal("New without Authenticate or AllowUnauthenticated: want an error")
	}
	srv := serve(t, o, console.Options{Authenticate: func(r *http.Request) (string, bool) {
		return "alice", r.Header.Get("X-User") == "alice"
	}})
	if code, _ := get(t, srv.Client(), srv.URL+"/outbox/"); code != http.StatusUnauthorized {
		t.Errorf("GET without the user: %d, want 401", code)
	}
}

func TestReadOnlyWithoutAuthorize(t *testing.T) {
	o, _, parkedUUID := parkedEnv(t)
	if parkedUUID == "" {
		t.Fatal("no parked UUID")
	}
	srv := serve(t, o, console.Options{AllowUnauthenticated: true})
	code, body := get(t, srv.Client(), srv.URL+"/outbox/")
	if code != http.StatusOK || !strings.Contains(body, parkedUUID) || !strings.Contains(body, "read-only") || strings.Contains(body, `method="post"`) || strings.Contains(body, `class="discard"`) {
		t.Fatalf("read-only page: %d, want the parked effect listed and no buttons:\n%s", code, body)
	}
	resp, err := srv.Client().PostForm(srv.URL+"/outbox/retry", url.Values{"ids": {"1"}})
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusForbidden {
		t.Errorf("POST retry on a read-only console: %d, want 403", resp.StatusCode)
	}
}

var tokenRe = regexp.MustCompile(`name="token" value="([^"]+)"`)
var idRe = regexp.MustCompile(`name="ids" value="(\d+)"><button class="retry"`)

func TestActionsNeedTheTokenAndAreAudited(t *testing.T) {
	o, db, parkedUUID := parkedEnv(t)
	srv := serve(t, o, console.Options{
		Authenticate: func(*http.Request) (string, bool) { return "alice", true },
		Authorize: func(_ *http.Request, user string, a console.Action) bool {
			return user == "alice" && a.Name != console.ActionDiscard
		},
	})
	jar, _ := cookiejar.New(nil)
	c := &http.Client{Jar: jar, CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }}
	_, body := get(t, c, srv.URL+"/outbox/")
	if !strings.Contains(body, parkedUUID) || strings.Contains(body, `class="discard"`) {
		t.Fatalf("page: want the parked effect with retry and without discard:\n%s", body)
	}
	token, id := tokenRe.FindStringSubmatch(body)[1], idRe.FindStringSubmatch(body)[1]
	post := func(path string, form url.Values, header map[string]string) int {
		t.Helper()
		req, _ := http.NewRequest(http.MethodPost, srv.URL+"/outbox/"+path, strings.NewReader(form.Encode()))
		req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
		for k, v := range header {
			req.Header.Set(k, v)
		}
		resp, err := c.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		return resp.StatusCode
	}
	if code := post("retry", url.Values{"ids": {id}}, nil); code != http.StatusForbidden {
		t.Errorf("retry without the token: %d, want 403", code)
	}
	if code := post("retry", url.Values{"ids": {id}, "token": {token + "x"}}, nil); code != http.StatusForbidden {
		t.Errorf("retry with a wrong token: %d, want 403", code)
	}
	if code := post("retry", url.Values{"ids": {id}, "token": {token}}, map[string]string{"Sec-Fetch-Site": "cross-site"}); code != http.StatusForbidden {
		t.Errorf("retry from another site: %d, want 403", code)
	}
	if code := post("discard", url.Values{"ids": {id}, "token": {token}}, nil); code != http.StatusForbidden {
		t.Errorf("discard, not authorized: %d, want 403", code)
	}
	var parked int
	if err := db.QueryRow(`SELECT count(*) FROM outbox_effects_all WHERE parked_at IS NOT NULL`).Scan(&parked); err != nil || parked != 1 {
		t.Fatalf("after refused actions: %d parked (%v), want 1", parked, err)
	}
	if code := post("retry", url.Values{"ids": {id}, "token": {token}}, map[string]string{"Sec-Fetch-Site": "same-origin"}); code != http.StatusSeeOther {
		t.Fatalf("retry: %d, want 303", code)
	}
	if err := db.QueryRow(`SELECT count(*) FROM outbox_effects_all WHERE parked_at IS NOT NULL`).Scan(&parked); err != nil || parked != 0 {
		t.Fatalf("after retry: %d parked (%v), want 0", parked, err)
	}
	var actor string
	if err := db.QueryRow(`SELECT actor FROM outbox_audit WHERE action = 'retry-parked'`).Scan(&actor); err != nil || actor != "alice (console)" {
		t.Errorf("audit: %q %v", actor, err)
	}
}

// Whatever a broker or a handler put in an error (stored as the effect's last error) is shown as
// text, never as markup.
func TestErrorTextIsEscaped(t *testing.T) {
	o, db, _ := parkedEnv(t)
	if _, err := db.Exec(`UPDATE outbox_effects_all SET last_error = '<script>alert(1)</script><img src=x onerror=alert(2)>' WHERE parked_at IS NOT NULL`); err != nil {
		t.Fatal(err)
	}
	srv := serve(t, o, console.Options{AllowUnauthenticated: true})
	code, body := get(t, srv.Client(), srv.URL+"/outbox/")
	if code != http.StatusOK || strings.Contains(body, "<script>") || strings.Contains(body, "<img") ||
		!strings.Contains(body, "&lt;script&gt;alert(1)&lt;/script&gt;") {
		t.Fatalf("the error text was not escaped:\n%s", body)
	}
}
