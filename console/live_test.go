package console_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strings"
	"sync"
	"testing"
	"time"

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
	return serveHandler(t, h, err)
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

// serveFunc serves NewMembersFunc(members) under /outbox/.
func serveFunc(t *testing.T, members func(context.Context) ([]console.Member, error), opt console.Options) *httptest.Server {
	t.Helper()
	h, err := console.NewMembersFunc(members, opt)
	return serveHandler(t, h, err)
}

// TestMembersFuncBadLists: what the function returns is checked at every request. Its error is
// a 503 that says the list could not be read, and so is a call that outlives Timeout (its ctx
// ends there); a list with an invalid name, a member without Ops or a name twice is a 500 that
// names the member; an empty list is a page of members without any; a request that is not
// authenticated does not call the function.
func TestMembersFuncBadLists(t *testing.T) {
	o := opsAt(t, "postgres://u@127.0.0.1:1/x?sslmode=disable") // never reached
	var (
		mu    sync.Mutex
		list  []console.Member
		fail  error
		calls int
	)
	const timeout = 300 * time.Millisecond
	srv := serveFunc(t, func(ctx context.Context) ([]console.Member, error) {
		mu.Lock()
		defer mu.Unlock()
		calls++
		if fail == errBlock {
			<-ctx.Done()
			return nil, fmt.Errorf("the tenants' registry: %w", ctx.Err())
		}
		return list, fail
	}, console.Options{
		Authenticate: func(r *http.Request) (string, bool) { return "alice", r.Header.Get("X-User") == "" },
		Timeout:      timeout,
	})
	for _, tc := range []struct {
		list       []console.Member
		fail       error
		path       string
		code       int
		body, also string
	}{
		{fail: errors.New("the tenants' registry is down"), path: "/outbox/", code: http.StatusServiceUnavailable,
			body: "the list of members could not be read: the tenants' registry is down"},
		{fail: errBlock, path: "/outbox/?member=a", code: http.StatusServiceUnavailable,
			body: "the list of members could not be read: the tenants' registry: context deadline exceeded"},
		{list: []console.Member{{Name: "a", Ops: o}, {Name: "b", Ops: o}, {Name: "a", Ops: o}}, path: "/outbox/?member=b",
			code: http.StatusInternalServerError, body: `the list of members is invalid: console: member "a" is named twice`},
		{list: []console.Member{{Name: "a", Ops: o}, {Name: "x/y", Ops: o}}, path: "/outbox/",
			code: http.StatusInternalServerError, body: `the list of members is invalid: console: invalid member name "x/y"`},
		{list: []console.Member{{Name: "", Ops: o}}, path: "/outbox/",
			code: http.StatusInternalServerError, body: `the list of members is invalid: console: invalid member name ""`},
		{list: []console.Member{{Name: "a", Ops: o}, {Name: "n"}}, path: "/outbox/retry?member=a",
			code: http.StatusInternalServerError, body: `the list of members is invalid: console: member "n" has no Ops`},
		{path: "/outbox/", code: http.StatusOK, body: `id="no-members">No members.<`, also: "<h2>Members</h2>"},
		{path: "/outbox/?member=a", code: http.StatusNotFound, body: `not found: no member "a"`},
	} {
		mu.Lock()
		list, fail = tc.list, tc.fail
		mu.Unlock()
		start := time.Now()
		var code int
		var body string
		if strings.Contains(tc.path, "/retry") {
			resp, b := postForm(t, srv.Client(), srv.URL+tc.path, url.Values{"ids": {"1"}})
			code, body = resp.StatusCode, b
		} else {
			code, body = get(t, srv.Client(), srv.URL+tc.path)
		}
		if took := time.Since(start); code != tc.code || !strings.Contains(body, tc.body) || !strings.Contains(body, tc.also) || took > 10*timeout {
			t.Errorf("%s with %d member(s), error %v: %d in %v\n%s\nwant %d and %q", tc.path, len(tc.list), tc.fail, code, took, body, tc.code, tc.body)
		}
	}
	mu.Lock()
	before := calls
	mu.Unlock()
	req, _ := http.NewRequest(http.MethodGet, srv.URL+"/outbox/", nil)
	req.Header.Set("X-User", "nobody")
	resp, err := srv.Client().Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	mu.Lock()
	defer mu.Unlock()
	if resp.StatusCode != http.StatusUnauthorized || calls != before {
		t.Errorf("an unauthenticated request: %d, %d call(s) of the function; want 401 and none", resp.StatusCode, calls-before)
	}
	if _, err := console.NewMembersFunc(nil, console.Options{AllowUnauthenticated: true}); err == nil {
		t.Error("NewMembersFunc(nil): want an error")
	}
}

// errBlock makes TestMembersFuncBadLists's function wait for its ctx to end.
var errBlock = errors.New("block")

// TestMembersFollowTheSetUnderChurn: requests while a member is removed and added again, with
// one Outbox and then another, and another member stays: the member that stays is always served,
// the one that comes and goes is served or 404 (never an error of a closed Ops), and the page of
// members always answers.
func TestMembersFollowTheSetUnderChurn(t *testing.T) {
	obA, _, _ := parkedOutbox(t, "billing")
	obC1, _, _ := parkedOutbox(t)
	obC2, _, _ := parkedOutbox(t)
	set, add := newSet(t)
	add("a", obA)
	add("c", obC1)
	srv := serveSet(t, set, console.Options{AllowUnauthenticated: true})
	c := srv.Client()

	ctx, stop := context.WithCancel(context.Background())
	var churn sync.WaitGroup
	churn.Add(1)
	go func() {
		defer churn.Done()
		for i := 0; ctx.Err() == nil; i++ {
			if err := set.Remove(ctx, "c"); err != nil {
				t.Error(err)
				return
			}
			time.Sleep(time.Millisecond)
			ob := obC1
			if i%2 == 1 {
				ob = obC2
			}
			if err := set.Add("c", ob); err != nil {
				t.Error(err)
				return
			}
			time.Sleep(time.Millisecond)
		}
	}()
	var reqs sync.WaitGroup
	var mu sync.Mutex
	seen := map[string]int{}
	for g := range 4 {
		reqs.Add(1)
		go func() {
			defer reqs.Done()
			for i := range 15 {
				path := []string{"/outbox/?member=c", "/outbox/", "/outbox/?member=a", "/outbox/?member=c"}[(g+i)%4]
				resp, err := c.Get(srv.URL + path)
				if err != nil {
					t.Error(err)
					return
				}
				b, _ := io.ReadAll(resp.Body)
				resp.Body.Close()
				ok := resp.StatusCode == http.StatusOK ||
					(path == "/outbox/?member=c" && resp.StatusCode == http.StatusNotFound)
				if !ok || strings.Contains(string(b), `class="error"`) {
					t.Errorf("GET %s while c comes and goes: %d\n%s", path, resp.StatusCode, b)
				}
				mu.Lock()
				seen[fmt.Sprint(path, " ", resp.StatusCode)]++
				mu.Unlock()
			}
		}()
	}
	reqs.Wait()
	stop()
	churn.Wait()
	t.Logf("answers: %v", seen)
}
