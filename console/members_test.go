package console_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"html"
	"net"
	"net/http"
	"net/http/httptest"
	"net/url"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/watermill-outbox/outbox"
	"github.com/watermill-outbox/outbox/console"
	"github.com/watermill-outbox/outbox/internal/silent"
	"github.com/watermill-outbox/outbox/ops"
	"github.com/watermill-outbox/outbox/outboxdriver"
)

// serveMembers serves a console of members under /outbox/.
func serveMembers(t *testing.T, members []console.Member, opt console.Options) *httptest.Server {
	t.Helper()
	h, err := console.NewMembers(members, opt)
	return serveHandler(t, h, err)
}

// opsAt is an ops.Ops on a pool of its own at dsn, closed when t ends.
func opsAt(t *testing.T, dsn string) *ops.Ops {
	t.Helper()
	db, err := sql.Open("postgres", dsn)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = db.Close() })
	o, err := ops.Open(db, "", "")
	if err != nil {
		t.Fatal(err)
	}
	return o
}

// memberLine is the line of member name on the page of members.
func memberLine(body, name string) string {
	return regexp.MustCompile(`(?s)<tr data-member="` + regexp.QuoteMeta(html.EscapeString(name)) + `">.*?</tr>`).FindString(body)
}

func parkedCount(t *testing.T, db *sql.DB) int {
	t.Helper()
	var n int
	if err := db.QueryRow(`SELECT count(*) FROM outbox_effects_all WHERE parked_at IS NOT NULL`).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

// TestMembersPage: two members in two databases, a parked effect in one. The page of members
// shows it under that member only, with each member's health; a member's name is escaped in the
// page and in its link, which leads to that member's page; a name that is not a member is 404 on
// every address; New's console knows no member names.
func TestMembersPage(t *testing.T) {
	// A name with what HTML and a query string give meaning to: the console must escape it.
	const odd = `a&b <i>"x"`
	withParked, _, uuids := parkedBy(t, "billing")
	empty, _, _ := parkedBy(t)
	srv := serveMembers(t, []console.Member{
		{Name: odd, Ops: withParked},
		{Name: "globex", Ops: empty, Health: func(context.Context) outbox.HealthReport {
			return outbox.HealthReport{Checks: []outbox.HealthCheck{{Name: "database", Reason: "unreachable since 12:00"}}}
		}},
	}, console.Options{AllowUnauthenticated: true})
	c := srv.Client()
	code, body := get(t, c, srv.URL+"/outbox/")
	if code != http.StatusOK || strings.Contains(body, "<i>") {
		t.Fatalf("page of members: %d, want 200 and the name escaped:\n%s", code, body)
	}
	a, g := memberLine(body, odd), memberLine(body, "globex")
	if !strings.Contains(a, `class="n parked bad">1<`) || !strings.Contains(g, `class="n parked ">0<`) {
		t.Errorf("the parked effect, want it under %q only:\n%s\n%s", odd, a, g)
	}
	if !strings.Contains(a, `class="health ok">the tables were read<`) || !strings.Contains(g, `class="health bad">outbox: unhealthy: database: unreachable since 12:00<`) {
		t.Errorf("health, want the first read and the second's own report:\n%s\n%s", a, g)
	}
	if strings.Contains(body, uuids[0]) {
		t.Errorf("the page of members lists effects:\n%s", body)
	}
	link := regexp.MustCompile(`<a href="([^"]+)">`).FindStringSubmatch(a)
	if link == nil {
		t.Fatalf("no link to the member:\n%s", a)
	}
	u, err := url.Parse(srv.URL + "/outbox/")
	if err != nil {
		t.Fatal(err)
	}
	ref, err := url.Parse(html.UnescapeString(link[1]))
	if err != nil {
		t.Fatal(err)
	}
	code, body = get(t, c, u.ResolveReference(ref).String())
	if code != http.StatusOK || !strings.Contains(body, uuids[0]) || !strings.Contains(body, `<span id="member">a&amp;b &lt;i&gt;&#34;x&#34;</span>`) {
		t.Fatalf("the member's page through its link %s: %d, want its parked effect and its name, escaped:\n%s", link[1], code, body)
	}

	for _, path := range []string{"/outbox/?member=initech", "/outbox/?member=", "/outbox/discard?ids=1&member=%3Cscript%3E", "/outbox/discard?ids=1"} {
		if code, body := get(t, c, srv.URL+path); code != http.StatusNotFound || !strings.Contains(body, "no member") {
			t.Errorf("GET %s: %d %q, want 404", path, code, body)
		}
	}
	resp, _ := postForm(t, c, srv.URL+"/outbox/retry?member=initech", url.Values{"ids": {"1"}})
	if resp.StatusCode != http.StatusNotFound {
		t.Errorf("POST retry of no member: %d, want 404", resp.StatusCode)
	}
	one := serve(t, withParked, console.Options{AllowUnauthenticated: true})
	if code, _ := get(t, c, one.URL+"/outbox/?member=globex"); code != http.StatusNotFound {
		t.Errorf("New's console, a member named: %d, want 404", code)
	}

	// A bidirectional override or a line separator makes a name read as another on the page and
	// in the audit entries; the Set refuses them too.
	for _, bad := range []string{"", "a/b", "a\nb", string([]byte{0xff}), "acme\u202egro", "a\u2066b", "a\u2028b", strings.Repeat("x", 201)} {
		if _, err := console.NewMembers([]console.Member{{Name: bad, Ops: empty}}, console.Options{AllowUnauthenticated: true}); err == nil {
			t.Errorf("NewMembers with member %q: want an error", bad)
		}
	}
	if _, err := console.NewMembers([]console.Member{{Name: "x", Ops: empty}, {Name: "x", Ops: withParked}}, console.Options{AllowUnauthenticated: true}); err == nil {
		t.Error("NewMembers with a name twice: want an error")
	}
}

// twoParked returns two members, a and b, in two databases with a parked effect each (the same
// store ID in both), and their databases.
func twoParked(t *testing.T) (a, b *ops.Ops, dbA, dbB *sql.DB) {
	a, dbA, _ = parkedBy(t, "billing")
	b, dbB, _ = parkedBy(t, "billing")
	return a, b, dbA, dbB
}

// TestMemberActionsActOnTheirMember: a discard with ?member=a changes a's database only (the
// other holds an effect with the same store ID), is asked of Authorize for member a, and is
// audited in a's database with the member's name; every form and link of a's page carries the
// member, and so does the redirect after the action.
func TestMemberActionsActOnTheirMember(t *testing.T) {
	a, b, dbA, dbB := twoParked(t)
	var mu sync.Mutex
	var asked []console.Action
	srv := serveMembers(t, []console.Member{{Name: "a", Ops: a}, {Name: "b", Ops: b}}, console.Options{
		Authenticate: func(*http.Request) (string, bool) { return "alice", true },
		Authorize: func(_ *http.Request, _ string, act console.Action) bool {
			mu.Lock()
			defer mu.Unlock()
			asked = append(asked, act)
			return true
		},
	})
	c := noRedirect()
	_, body := get(t, c, srv.URL+"/outbox/?member=a")
	posts := regexp.MustCompile(`method="post" action="([^"]*)"`).FindAllStringSubmatch(body, -1)
	if len(posts) == 0 {
		t.Fatalf("a's page: no forms:\n%s", body)
	}
	for _, p := range posts {
		if !strings.HasSuffix(p[1], "?member=a") {
			t.Errorf("a form of a's page posts to %q, without the member", p[1])
		}
	}
	if n := strings.Count(body, `method="get" action="discard">`); n == 0 || n != strings.Count(body, `method="get" action="discard"><input type="hidden" name="member" value="a">`) {
		t.Errorf("a's discard questions: %d, want each with the member:\n%s", n, body)
	}
	if !strings.Contains(body, `<a href="./?member=a">all</a>`) || !strings.Contains(body, `<a href="./" id="all-members">`) {
		t.Errorf("a's page: want its links to carry the member, and one to the page of members:\n%s", body)
	}
	token, id := tokenOf.FindStringSubmatch(body)[1], idRe.FindStringSubmatch(body)[1]
	if _, bodyB := get(t, c, srv.URL+"/outbox/?member=b"); idRe.FindStringSubmatch(bodyB)[1] != id {
		t.Fatalf("b's parked effect has another store ID than a's %s: the test needs the same", id)
	}
	mu.Lock()
	asked = nil // b's page asked about b's buttons
	mu.Unlock()

	resp, _ := postForm(t, c, srv.URL+"/outbox/discard?member=a", url.Values{"ids": {id}, "token": {token}, "confirm": {"yes"}})
	if resp.StatusCode != http.StatusSeeOther || !strings.HasPrefix(resp.Header.Get("Location"), "./?") ||
		!strings.Contains(resp.Header.Get("Location"), "member=a") {
		t.Fatalf("discard of a: %d to %q, want 303 to a's page", resp.StatusCode, resp.Header.Get("Location"))
	}
	if pa, pb := parkedCount(t, dbA), parkedCount(t, dbB); pa != 0 || pb != 1 {
		t.Fatalf("after a discard of a's effect %s: %d parked in a, %d in b; want 0 and 1", id, pa, pb)
	}
	var actor string
	if err := dbA.QueryRow(`SELECT actor FROM outbox_audit WHERE action = 'discard-parked'`).Scan(&actor); err != nil || actor != "alice (console, member a)" {
		t.Errorf("a's audit entry: %q %v, want alice (console, member a)", actor, err)
	}
	if err := dbB.QueryRow(`SELECT actor FROM outbox_audit`).Scan(&actor); !errors.Is(err, sql.ErrNoRows) {
		t.Errorf("b's audit table: %q %v, want no entry", actor, err)
	}
	mu.Lock()
	defer mu.Unlock()
	if len(asked) == 0 {
		t.Error("Authorize was not asked about the discard")
	}
	for _, act := range asked {
		if act.Member != "a" {
			t.Errorf("Authorize was asked about %+v, want member a only", act)
		}
	}
}

// TestMemberTokenDoesNotCrossMembers: the token of a's confirmation of a discard does not
// authorize the same discard on b (the same store ID names another effect there), and the notice
// a's action led to is not shown on b's page.
func TestMemberTokenDoesNotCrossMembers(t *testing.T) {
	a, b, dbA, dbB := twoParked(t)
	srv := serveMembers(t, []console.Member{{Name: "a", Ops: a}, {Name: "b", Ops: b}}, console.Options{
		Authenticate: func(*http.Request) (string, bool) { return "alice", true },
		Authorize:    func(*http.Request, string, console.Action) bool { return true },
	})
	c := noRedirect()
	_, body := get(t, c, srv.URL+"/outbox/?member=a")
	id := idRe.FindStringSubmatch(body)[1]
	code, body := get(t, c, srv.URL+"/outbox/discard?member=a&ids="+id)
	if code != http.StatusOK || !strings.Contains(body, `id="confirm-discard"`) {
		t.Fatalf("a's question before the discard: %d\n%s", code, body)
	}
	token := tokenOf.FindStringSubmatch(body)[1]
	resp, _ := postForm(t, c, srv.URL+"/outbox/discard?member=b", url.Values{"ids": {id}, "token": {token}, "confirm": {"yes"}})
	if resp.StatusCode != http.StatusForbidden {
		t.Errorf("b's discard with the token of a's question: %d, want 403", resp.StatusCode)
	}
	if pa, pb := parkedCount(t, dbA), parkedCount(t, dbB); pa != 1 || pb != 1 {
		t.Fatalf("after a discard on b with a's token: %d parked in a, %d in b; want 1 and 1", pa, pb)
	}

	resp, _ = postForm(t, c, srv.URL+"/outbox/discard?member=a", url.Values{"ids": {id}, "token": {token}, "confirm": {"yes"}})
	loc, err := url.Parse(resp.Header.Get("Location"))
	if resp.StatusCode != http.StatusSeeOther || err != nil || loc.Query().Get("flash") == "" {
		t.Fatalf("a's discard with a's token: %d to %q, want 303 with a notice", resp.StatusCode, resp.Header.Get("Location"))
	}
	if pa, pb := parkedCount(t, dbA), parkedCount(t, dbB); pa != 0 || pb != 1 {
		t.Fatalf("after a's discard: %d parked in a, %d in b; want 0 and 1", pa, pb)
	}
	notice := url.Values{"flash": {loc.Query().Get("flash")}}
	if _, body := get(t, c, srv.URL+"/outbox/?member=a&"+notice.Encode()); !strings.Contains(body, `id="flash">1 parked effect(s) discarded<`) {
		t.Errorf("a's page after a's discard: want the notice:\n%s", body)
	}
	if _, body := get(t, c, srv.URL+"/outbox/?member=b&"+notice.Encode()); strings.Contains(body, `id="flash"`) {
		t.Errorf("b's page with the notice of a's discard: want none:\n%s", body)
	}
}

// TestMembersPageWithAMemberDown: one member's server refuses connections, another's accepts
// them and never answers (lib/pq does not give up on it when the context ends, without
// connect_timeout). The page of members answers within about Timeout, shows the member that is up
// with its counts and each of the others with why it could not be read.
func TestMembersPageWithAMemberDown(t *testing.T) {
	up, _, _ := parkedBy(t, "billing")
	refused, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	refusedAddr := refused.Addr().String()
	refused.Close() // nothing listens there any more: connections are refused
	silent, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	var held sync.WaitGroup
	accepted := make(chan net.Conn, 16)
	held.Add(1)
	go func() {
		defer held.Done()
		for {
			conn, err := silent.Accept()
			if err != nil {
				return
			}
			accepted <- conn // held open, never answered
		}
	}()
	t.Cleanup(func() {
		silent.Close()
		held.Wait()
		close(accepted)
		for conn := range accepted {
			conn.Close()
		}
	})
	openAt := func(addr string) *ops.Ops { return opsAt(t, "postgres://u@"+addr+"/x?sslmode=disable") }
	const timeout = time.Second
	srv := serveMembers(t, []console.Member{
		{Name: "refused", Ops: openAt(refusedAddr)}, {Name: "silent", Ops: openAt(silent.Addr().String())}, {Name: "up", Ops: up},
	}, console.Options{AllowUnauthenticated: true, Timeout: timeout})
	start := time.Now()
	code, body := get(t, &http.Client{Timeout: 20 * timeout}, srv.URL+"/outbox/")
	if took := time.Since(start); took > 5*timeout {
		t.Errorf("the page of members took %v with Timeout %v", took, timeout)
	}
	if code != http.StatusOK || !strings.Contains(memberLine(body, "up"), `class="n parked bad">1<`) {
		t.Fatalf("page of members: %d, want 200 and the member that is up with its parked effect:\n%s", code, body)
	}
	for _, name := range []string{"refused", "silent"} {
		if line := memberLine(body, name); !strings.Contains(line, `class="health bad">`) ||
			!strings.Contains(line, `class="error" colspan="7">The tables could not be read: `) {
			t.Errorf("member %s: want why its tables could not be read:\n%s", name, line)
		}
	}
}

// TestMembersPageWithManySilentMembers: five members whose database accepts connections and never
// answers, listed before one that is up. Each keeps its turn for a second at most, so the member
// that is up is read and shown (the page reads four members at a time: when a read held its turn
// until it returned, the four silent members that got the first turns took every turn until the
// page's Timeout, and the others were "not read", the member that is up among them whenever the
// scheduler gave it no early turn). A second load begins no second read of a silent member whose
// first has not returned: it says so, and the server sees no new connection (each load left one
// more goroutine and connection attempt per silent member behind: 4 more here).
func TestMembersPageWithManySilentMembers(t *testing.T) {
	up, _, _ := parkedBy(t, "billing")
	srv, err := silent.Start()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = srv.Close() })
	var members []console.Member
	for i := range 5 {
		members = append(members, console.Member{Name: fmt.Sprint("silent", i), Ops: opsAt(t, srv.DSN())})
	}
	members = append(members, console.Member{Name: "up", Ops: up})
	const timeout = 3 * time.Second
	page := serveMembers(t, members, console.Options{AllowUnauthenticated: true, Timeout: timeout})
	load := func() string {
		start := time.Now()
		code, body := get(t, &http.Client{Timeout: 20 * timeout}, page.URL+"/outbox/")
		if took := time.Since(start); took > 2*timeout {
			t.Errorf("the page of members took %v with Timeout %v", took, timeout)
		}
		if code != http.StatusOK || !strings.Contains(memberLine(body, "up"), `class="n parked bad">1<`) {
			t.Fatalf("page of members: %d, want 200 and the member that is up with its parked effect:\n%s", code, body)
		}
		return body
	}
	body := load()
	for i := range 5 {
		if line := memberLine(body, fmt.Sprint("silent", i)); !strings.Contains(line, "no answer within the console&#39;s Timeout (3s)") {
			t.Errorf("silent%d: want no answer within the Timeout:\n%s", i, line)
		}
	}
	before := srv.Conns()
	if before != 5 {
		t.Errorf("%d connections to the silent server after the first load, want 5", before)
	}
	body = load()
	for i := range 5 {
		if line := memberLine(body, fmt.Sprint("silent", i)); !strings.Contains(line, "a read of it began") || !strings.Contains(line, "has not returned") {
			t.Errorf("silent%d on the second load: want the read still under way named:\n%s\n%s", i, line, body)
		}
	}
	if n := srv.Conns(); n != before {
		t.Errorf("the second load opened %d more connections to the silent server", n-before)
	}
}

// TestMembersPageReloadTakesTheReadUnderWay: a load of the page that comes while another's read
// of a member is under way takes that read's line. The read is not the first load's to end: a
// reload cancels the load it replaces, and the reload showed the member failed with the first
// load's "context canceled".
func TestMembersPageReloadTakesTheReadUnderWay(t *testing.T) {
	up, _, _ := parkedBy(t, "billing")
	slow := func(ctx context.Context) outbox.HealthReport {
		select {
		case <-time.After(1500 * time.Millisecond):
			return outbox.HealthReport{Healthy: true}
		case <-ctx.Done():
			return outbox.HealthReport{Checks: []outbox.HealthCheck{{Name: outbox.CheckDatabase, Reason: ctx.Err().Error()}}}
		}
	}
	srv := serveMembers(t, []console.Member{{Name: "slow", Ops: up, Health: slow}}, console.Options{AllowUnauthenticated: true, Timeout: 5 * time.Second})
	first := make(chan struct{})
	go func() {
		defer close(first)
		c := &http.Client{Timeout: 300 * time.Millisecond} // the user reloads: this load is cancelled
		if resp, err := c.Get(srv.URL + "/outbox/"); err == nil {
			resp.Body.Close()
		}
	}()
	time.Sleep(100 * time.Millisecond)
	code, body := get(t, &http.Client{Timeout: 20 * time.Second}, srv.URL+"/outbox/")
	<-first
	line := memberLine(body, "slow")
	if code != http.StatusOK || strings.Contains(line, "canceled") || !strings.Contains(line, `class="health ok"`) {
		t.Errorf("the reload: %d, want the member read and healthy:\n%s", code, line)
	}
}

// TestMemberDeadLetterDiscardAsksOnItsMember: the question before a discard of a member's dead
// letter names the member, posts to that member, and its confirmation discards the dead letter
// of that member's database only (the other holds one of the same consumer and message ID).
func TestMemberDeadLetterDiscardAsksOnItsMember(t *testing.T) {
	key := outboxdriver.Source{Consumer: "billing", ID: "m1"}
	a, _, dbA := deadEnv(t, key)
	b, _, dbB := deadEnv(t, key)
	srv := serveMembers(t, []console.Member{{Name: "a", Ops: a}, {Name: "b", Ops: b}}, console.Options{
		Authenticate: func(*http.Request) (string, bool) { return "alice", true },
		Authorize:    func(*http.Request, string, console.Action) bool { return true },
	})
	c := noRedirect()
	_, body := get(t, c, srv.URL+"/outbox/?member=b")
	resp, body := postForm(t, c, srv.URL+"/outbox/discard-dead?member=b", url.Values{"consumer": {"billing"}, "message_id": {"m1"}, "token": {tokenOf.FindStringSubmatch(body)[1]}})
	if resp.StatusCode != http.StatusOK || !strings.Contains(body, `<span id="member">b</span>`) ||
		!strings.Contains(body, `<form method="post" action="discard-dead?member=b">`) || !strings.Contains(body, `<a href="./?member=b">cancel</a>`) {
		t.Fatalf("the question before b's discard: %d, want it to name b, post to b and go back to b:\n%s", resp.StatusCode, body)
	}
	resp, _ = postForm(t, c, srv.URL+"/outbox/discard-dead?member=b", url.Values{"consumer": {"billing"}, "message_id": {"m1"}, "confirm": {"yes"}, "token": {tokenOf.FindStringSubmatch(body)[1]}})
	if resp.StatusCode != http.StatusSeeOther {
		t.Fatalf("b's confirmed discard: %d, want 303", resp.StatusCode)
	}
	state := func(db *sql.DB) string {
		var s string
		if err := db.QueryRow(`SELECT state FROM outbox_dead_letters WHERE consumer = 'billing' AND message_id = 'm1'`).Scan(&s); err != nil {
			t.Fatal(err)
		}
		return s
	}
	if sa, sb := state(dbA), state(dbB); sa != "dead" || sb == "dead" {
		t.Errorf("after b's discard: a's dead letter %s, b's %s; want a's still dead, b's discarded", sa, sb)
	}
}
