package console_test

import (
	"context"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strings"
	"testing"

	"github.com/watermill-outbox/outbox"
	"github.com/watermill-outbox/outbox/console"
	"github.com/watermill-outbox/outbox/tenant"
)

// newSet returns an empty tenant.Set, and a function that adds ob to it under name.
func newSet(t *testing.T) (*tenant.Set, func(name string, ob *outbox.Outbox)) {
	t.Helper()
	set, err := tenant.New(tenant.Config{Metadata: "tenant", NackUnresolved: true})
	if err != nil {
		t.Fatal(err)
	}
	return set, func(name string, ob *outbox.Outbox) {
		t.Helper()
		if err := set.Add(name, ob); err != nil {
			t.Fatal(err)
		}
	}
}

// serveSet serves the console of set's members under /outbox/.
func serveSet(t *testing.T, set *tenant.Set, opt console.Options) *httptest.Server {
	t.Helper()
	h, err := console.NewMembersFunc(console.MembersOf(set), opt)
	if err != nil {
		t.Fatal(err)
	}
	mux := http.NewServeMux()
	mux.Handle("/outbox/", http.StripPrefix("/outbox", h))
	srv := httptest.NewServer(mux)
	t.Cleanup(srv.Close)
	return srv
}

// TestMembersFollowTheSet: a member added to the Set after the console was built is on the page
// of members and serves its page and a retry of its parked effect; a member removed is on no
// page, and its pages and actions are 404 (its tables unchanged); a member removed and added
// again under its name with another Outbox is served from the new one's tables.
func TestMembersFollowTheSet(t *testing.T) {
	obA, dbA, _ := parkedOutbox(t, "billing")
	obB, dbB, uuidsB := parkedOutbox(t, "billing")
	set, add := newSet(t)
	add("a", obA)
	srv := serveSet(t, set, console.Options{
		Authenticate: func(*http.Request) (string, bool) { return "alice", true },
		Authorize:    func(*http.Request, string, console.Action) bool { return true },
	})
	c := noRedirect()
	_, body := get(t, c, srv.URL+"/outbox/?member=a")
	tokenA, idA := tokenOf.FindStringSubmatch(body)[1], idRe.FindStringSubmatch(body)[1]

	add("b", obB)
	code, body := get(t, c, srv.URL+"/outbox/")
	if code != http.StatusOK || !strings.Contains(memberLine(body, "b"), `class="n parked bad">1<`) {
		t.Fatalf("page of members after b was added: %d, want b with its parked effect:\n%s", code, body)
	}
	code, body = get(t, c, srv.URL+"/outbox/?member=b")
	if code != http.StatusOK || !strings.Contains(body, uuidsB[0]) {
		t.Fatalf("b's page: %d, want its parked effect %s:\n%s", code, uuidsB[0], body)
	}
	resp, _ := postForm(t, c, srv.URL+"/outbox/retry?member=b", url.Values{
		"ids": {idRe.FindStringSubmatch(body)[1]}, "token": {tokenOf.FindStringSubmatch(body)[1]}})
	if resp.StatusCode != http.StatusSeeOther || parkedCount(t, dbB) != 0 {
		t.Fatalf("b's retry: %d, %d parked in b; want 303 and none", resp.StatusCode, parkedCount(t, dbB))
	}
	var actor string
	if err := dbB.QueryRow(`SELECT actor FROM outbox_audit WHERE action = 'retry-parked'`).Scan(&actor); err != nil || actor != "alice (console, member b)" {
		t.Errorf("b's audit entry: %q %v, want alice (console, member b)", actor, err)
	}

	if err := set.Remove(context.Background(), "a"); err != nil {
		t.Fatal(err)
	}
	if _, body := get(t, c, srv.URL+"/outbox/"); memberLine(body, "a") != "" || memberLine(body, "b") == "" {
		t.Errorf("page of members after a was removed: want b only:\n%s", body)
	}
	for _, path := range []string{"/outbox/?member=a", "/outbox/discard?member=a&ids=" + idA} {
		if code, body := get(t, c, srv.URL+path); code != http.StatusNotFound || !strings.Contains(body, `no member "a"`) {
			t.Errorf("GET %s of a removed member: %d %q, want 404", path, code, body)
		}
	}
	resp, body = postForm(t, c, srv.URL+"/outbox/discard?member=a", url.Values{"ids": {idA}, "token": {tokenA}, "confirm": {"yes"}})
	if resp.StatusCode != http.StatusNotFound || parkedCount(t, dbA) != 1 {
		t.Errorf("discard on a removed member: %d %q, %d parked in its tables; want 404 and 1", resp.StatusCode, body, parkedCount(t, dbA))
	}

	// The same name, another Outbox: its page reads the new tables, and the token of the old
	// member's page is taken (the name is the tenant).
	obA2, dbA2, uuidsA2 := parkedOutbox(t, "billing", "billing")
	add("a", obA2)
	code, body = get(t, c, srv.URL+"/outbox/?member=a")
	if code != http.StatusOK || !strings.Contains(body, uuidsA2[1]) {
		t.Fatalf("a's page after a was added again: %d, want the new tables' effect %s:\n%s", code, uuidsA2[1], body)
	}
	resp, _ = postForm(t, c, srv.URL+"/outbox/discard?member=a", url.Values{"ids": {idA}, "token": {tokenA}, "confirm": {"yes"}})
	if resp.StatusCode != http.StatusSeeOther || parkedCount(t, dbA2) != 1 || parkedCount(t, dbA) != 1 {
		t.Errorf("discard of effect %s with the old a's token on the new a: %d, %d parked in the new tables, %d in the old; want 303, 1 and 1",
			idA, resp.StatusCode, parkedCount(t, dbA2), parkedCount(t, dbA))
	}
}
