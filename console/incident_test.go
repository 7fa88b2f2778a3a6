package console_test

import (
	"io"
	"net/http"
	"net/http/cookiejar"
	"net/url"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/watermill-outbox/outbox/console"
)

// noRedirect is a client that shows redirects rather than following them.
func noRedirect() *http.Client {
	jar, _ := cookiejar.New(nil)
	return &http.Client{Jar: jar, CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }}
}

func postForm(t *testing.T, c *http.Client, u string, form url.Values) (*http.Response, string) {
	t.Helper()
	req, _ := http.NewRequest(http.MethodPost, u, strings.NewReader(form.Encode()))
	req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
	resp, err := c.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp, string(b)
}

// TestPageCountsComeFromTheSample: the page shows the counts a service sampled (and when), not a
// count of the tables on every load, which grows with the backlog it is opened for. (A list the
// page shows whole counts its tile itself: more parked effects than a page here.)
func TestPageCountsComeFromTheSample(t *testing.T) {
	o, db, _ := parkedBy(t, "billing", "billing")
	if _, err := db.Exec(`UPDATE outbox_stats SET sampled_at = now() - interval '5 seconds', leased_at = now() - interval '5 seconds',
		sample = '{"Pending": 4242, "Parked": 17, "OldestPendingMS": 1000, "Delayed": 31}' WHERE id = 1`); err != nil {
		t.Fatal(err)
	}
	srv := serve(t, o, console.Options{AllowUnauthenticated: true, PageSize: 1})
	code, body := get(t, srv.Client(), srv.URL+"/outbox/")
	if code != http.StatusOK || !strings.Contains(body, `id="pending">4242<`) || !strings.Contains(body, `id="parked-count">17<`) ||
		!strings.Contains(body, `id="delayed">31<`) || !regexp.MustCompile(`id="sampled">sampled \ds ago`).MatchString(body) {
		t.Fatalf("want the sampled counts (4242 pending, 17 parked, 31 delayed apart) and their age:\n%s", body)
	}
	if !strings.Contains(body, `class="relay ok"`) {
		t.Errorf("a service sampled 5 s ago: want the relays shown as running:\n%s", body)
	}
}

// TestPendingWithoutARelayIsFlagged: effects pending while no service samples the tables (no
// Outbox.Run, so no relay) are shown as such.
func TestPendingWithoutARelayIsFlagged(t *testing.T) {
	o, db, _ := parkedEnv(t)
	if _, err := db.Exec(`UPDATE outbox_effects_all SET parked_at = NULL WHERE parked_at IS NOT NULL`); err != nil {
		t.Fatal(err)
	}
	srv := serve(t, o, console.Options{AllowUnauthenticated: true})
	_, body := get(t, srv.Client(), srv.URL+"/outbox/")
	if !regexp.MustCompile(`class="relay bad" id="relay">1 side effects pending and no relay seems to be running`).MatchString(body) {
		t.Fatalf("want the pending effect flagged as without a relay:\n%s", body)
	}
}

// TestHeadersAndFlash: nosniff is sent, and a notice is shown only when the console signed it:
// a link cannot make the page show text of its choosing.
func TestHeadersAndFlash(t *testing.T) {
	o, _, _ := parkedEnv(t)
	srv := serve(t, o, console.Options{AllowUnauthenticated: true})
	resp, err := srv.Client().Get(srv.URL + "/outbox/?flash=" + url.QueryEscape("Your session expired: sign in at evil.example"))
	if err != nil {
		t.Fatal(err)
	}
	_, body := get(t, srv.Client(), srv.URL+"/outbox/?flash="+url.QueryEscape("Your session expired: sign in at evil.example"))
	resp.Body.Close()
	if resp.Header.Get("X-Content-Type-Options") != "nosniff" {
		t.Errorf("X-Content-Type-Options: %q, want nosniff", resp.Header.Get("X-Content-Type-Options"))
	}
	if strings.Contains(body, "evil.example") {
		t.Errorf("a notice the console did not write is shown:\n%s", body)
	}
}

var tokenOf = regexp.MustCompile(`name="token" value="([^"]+)"`)

// TestDiscardAsksFirst: a discard shows what it would give up and changes nothing until
// confirmed.
func TestDiscardAsksFirst(t *testing.T) {
	o, db, parkedUUID := parkedEnv(t)
	srv := serve(t, o, console.Options{
		Authenticate: func(*http.Request) (string, bool) { return "alice", true },
		Authorize:    func(*http.Request, string, console.Action) bool { return true },
	})
	c := noRedirect()
	_, body := get(t, c, srv.URL+"/outbox/")
	token := tokenOf.FindStringSubmatch(body)[1]
	var id string
	if err := db.QueryRow(`SELECT id::text FROM outbox_effects_all WHERE parked_at IS NOT NULL`).Scan(&id); err != nil {
		t.Fatal(err)
	}
	parked := func() int {
		var n int
		if err := db.QueryRow(`SELECT count(*) FROM outbox_effects_all WHERE parked_at IS NOT NULL AND dispatched_at IS NULL`).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}
	resp, body := postForm(t, c, srv.URL+"/outbox/discard", url.Values{"ids": {id}, "token": {token}})
	if resp.StatusCode != http.StatusOK || parked() != 1 || !strings.Contains(body, parkedUUID) || !strings.Contains(body, `name="confirm" value="yes"`) {
		t.Fatalf("a discard without confirmation: %d, %d parked; want the question (200, 1 parked):\n%s", resp.StatusCode, parked(), body)
	}
	resp, _ = postForm(t, c, srv.URL+"/outbox/discard", url.Values{"ids": {id}, "token": {token}, "confirm": {"yes"}})
	if resp.StatusCode != http.StatusSeeOther || parked() != 0 {
		t.Fatalf("the confirmed discard: %d, %d parked; want 303, 0", resp.StatusCode, parked())
	}
	_, body = get(t, c, srv.URL+"/outbox/"+strings.TrimPrefix(resp.Header.Get("Location"), "./"))
	if !strings.Contains(body, `id="flash">1 parked effect(s) discarded<`) {
		t.Errorf("the notice after the discard:\n%s", body)
	}
}

// TestListsArePagedAndFiltered: the parked effects come a page at a time, and by consumer.
func TestListsArePagedAndFiltered(t *testing.T) {
	o, _, uuids := parkedBy(t, "billing", "billing", "shipping")
	srv := serve(t, o, console.Options{AllowUnauthenticated: true, PageSize: 2})
	_, body := get(t, srv.Client(), srv.URL+"/outbox/")
	next := regexp.MustCompile(`id="next-parked" href="([^"]+)"`).FindStringSubmatch(body)
	if !strings.Contains(body, uuids[0]) || !strings.Contains(body, uuids[1]) || strings.Contains(body, uuids[2]) || next == nil {
		t.Fatalf("first page: want the first two and a link to the next:\n%s", body)
	}
	_, body = get(t, srv.Client(), srv.URL+"/outbox/"+strings.TrimPrefix(strings.ReplaceAll(next[1], "&amp;", "&"), "./"))
	if strings.Contains(body, uuids[0]) || !strings.Contains(body, uuids[2]) {
		t.Fatalf("second page: want the third only:\n%s", body)
	}
	_, body = get(t, srv.Client(), srv.URL+"/outbox/?consumer=shipping")
	if strings.Contains(body, uuids[0]) || !strings.Contains(body, uuids[2]) {
		t.Fatalf("consumer shipping: want its effect only:\n%s", body)
	}
}

// TestAuthorizeSeesTheTarget: Authorize is given the consumers, topics and store IDs of an
// action, so that a user may repair one consumer's effects and not another's.
func TestAuthorizeSeesTheTarget(t *testing.T) {
	o, db, uuids := parkedBy(t, "billing", "shipping")
	var mu sync.Mutex
	var asked []console.Action
	srv := serve(t, o, console.Options{
		Authenticate: func(*http.Request) (string, bool) { return "alice", true },
		Authorize: func(_ *http.Request, _ string, a console.Action) bool {
			mu.Lock()
			defer mu.Unlock()
			asked = append(asked, a)
			return slices.Equal(a.Consumers, []string{"billing"}) && slices.Equal(a.Topics, []string{"invoices"})
		},
	})
	c := noRedirect()
	_, body := get(t, c, srv.URL+"/outbox/")
	rowOf := func(uuid string) string {
		return regexp.MustCompile(`(?s)<tr data-id="\d+" data-uuid="` + uuid + `">.*?</tr>`).FindString(body)
	}
	if !strings.Contains(rowOf(uuids[0]), `class="retry"`) || strings.Contains(rowOf(uuids[1]), `class="retry"`) {
		t.Fatalf("want a retry button for billing's effect only:\n%s", body)
	}
	token := tokenOf.FindStringSubmatch(body)[1]
	ids := map[string]string{}
	rows, err := db.Query(`SELECT source_consumer, id::text FROM outbox_effects_all WHERE parked_at IS NOT NULL`)
	if err != nil {
		t.Fatal(err)
	}
	for rows.Next() {
		var consumer, id string
		if err := rows.Scan(&consumer, &id); err != nil {
			t.Fatal(err)
		}
		ids[consumer] = id
	}
	_ = rows.Close()
	if resp, _ := postForm(t, c, srv.URL+"/outbox/retry", url.Values{"ids": {ids["shipping"]}, "token": {token}}); resp.StatusCode != http.StatusForbidden {
		t.Errorf("retry of shipping's effect: %d, want 403", resp.StatusCode)
	}
	if resp, _ := postForm(t, c, srv.URL+"/outbox/retry", url.Values{"ids": {ids["billing"] + "," + ids["shipping"]}, "token": {token}}); resp.StatusCode != http.StatusForbidden {
		t.Errorf("retry of both: %d, want 403", resp.StatusCode)
	}
	if resp, _ := postForm(t, c, srv.URL+"/outbox/retry", url.Values{"ids": {ids["billing"]}, "token": {token}}); resp.StatusCode != http.StatusSeeOther {
		t.Errorf("retry of billing's effect: %d, want 303", resp.StatusCode)
	}
	mu.Lock()
	defer mu.Unlock()
	last := asked[len(asked)-1]
	if last.Name != console.ActionRetry || len(last.StoreIDs) != 1 || ids["billing"] != strconv.FormatInt(last.StoreIDs[0], 10) {
		t.Errorf("the last question: %+v, want retry of billing's effect %s", last, ids["billing"])
	}
}

// TestTokensExpireAndInstancesShareAKey: with a key shared by two instances, one accepts the
// other's token (behind a load balancer, the page and its POST reach different instances); a
// token past its TTL is refused, saying why.
func TestTokensExpireAndInstancesShareAKey(t *testing.T) {
	o, _, _ := parkedEnv(t)
	key := []byte(strings.Repeat("k", 32))
	opt := console.Options{
		Authenticate: func(*http.Request) (string, bool) { return "alice", true },
		Authorize:    func(*http.Request, string, console.Action) bool { return true },
		Key:          key, TokenTTL: time.Second,
	}
	a, b := serve(t, o, opt), serve(t, o, opt)
	c := noRedirect()
	_, body := get(t, c, a.URL+"/outbox/")
	token := tokenOf.FindStringSubmatch(body)[1]
	if resp, body := postForm(t, c, b.URL+"/outbox/replay", url.Values{"consumer": {"billing"}, "message_id": {"none"}, "token": {token}}); resp.StatusCode != http.StatusSeeOther {
		t.Fatalf("instance b, with a's token: %d %s, want 303", resp.StatusCode, body)
	}
	time.Sleep(2100 * time.Millisecond)
	resp, body := postForm(t, c, b.URL+"/outbox/replay", url.Values{"consumer": {"billing"}, "message_id": {"none"}, "token": {token}})
	if resp.StatusCode != http.StatusForbidden || !strings.Contains(body, "expired") {
		t.Fatalf("an expired token: %d %s, want 403 saying it expired", resp.StatusCode, body)
	}
	if _, err := console.New(o, console.Options{AllowUnauthenticated: true, Key: []byte("short")}); err == nil {
		t.Error("a key of 5 bytes: want an error")
	}
}

// TestBasicAuthChallenges: with BasicAuth, a request without credentials is answered with a
// challenge, so that a browser asks for them.
func TestBasicAuthChallenges(t *testing.T) {
	o, _, _ := parkedEnv(t)
	srv := serve(t, o, console.Options{BasicAuth: func(u, p string) bool { return u == "operator" && p == "s3cret" }})
	resp, err := http.Get(srv.URL + "/outbox/")
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusUnauthorized || !strings.HasPrefix(resp.Header.Get("WWW-Authenticate"), `Basic realm="outbox console"`) {
		t.Fatalf("without credentials: %d, WWW-Authenticate %q; want 401 with a Basic challenge", resp.StatusCode, resp.Header.Get("WWW-Authenticate"))
	}
	req, _ := http.NewRequest(http.MethodGet, srv.URL+"/outbox/", nil)
	req.SetBasicAuth("operator", "s3cret")
	resp, err = http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK || !strings.Contains(string(body), "signed in as operator") {
		t.Fatalf("with credentials: %d\n%s", resp.StatusCode, body)
	}
}

// TestPageAfterAnActionSamplesAfresh: the page an action leads to counts the tables again rather
// than show the sample a service stored before the change.
func TestPageAfterAnActionSamplesAfresh(t *testing.T) {
	o, db, _ := parkedBy(t, "billing", "billing")
	srv := serve(t, o, console.Options{AllowUnauthenticated: true, PageSize: 1,
		Authorize: func(*http.Request, string, console.Action) bool { return true }})
	_, body := get(t, srv.Client(), srv.URL+"/outbox/")
	token, id := tokenRe.FindStringSubmatch(body)[1], idRe.FindStringSubmatch(body)[1]
	// A service's sample from just before the retry: 2 parked, none pending.
	if _, err := db.Exec(`UPDATE outbox_stats SET sampled_at = now() - interval '5 seconds', leased_at = now() - interval '5 seconds',
		sample = '{"Pending": 0, "Parked": 2}' WHERE id = 1`); err != nil {
		t.Fatal(err)
	}
	resp, _ := postForm(t, noRedirect(), srv.URL+"/outbox/retry", url.Values{"ids": {id}, "token": {token}})
	if resp.StatusCode != http.StatusSeeOther {
		t.Fatalf("retry: %d, want 303", resp.StatusCode)
	}
	_, body = get(t, srv.Client(), srv.URL+"/outbox/"+strings.TrimPrefix(resp.Header.Get("Location"), "./"))
	if !strings.Contains(body, `id="flash"`) || !strings.Contains(body, `id="pending">1<`) || !strings.Contains(body, `id="parked-count">1<`) {
		t.Fatalf("after retrying 1 of 2 parked effects: want a fresh sample (1 pending, 1 parked):\n%s", body)
	}
}
