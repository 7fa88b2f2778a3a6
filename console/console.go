// Package console is an embeddable web console for the outbox: the status, the parked effects
// grouped by failure, the failing and the poisoned messages, the dead letters grouped by consumer
// and cause, and buttons to retry, discard and replay that go through package ops (the CLI's
// code), audited with the user's name.
//
//	o, err := ops.ForOutbox(ob) // the tables the Outbox works on
//	h, err := console.New(o, console.Options{
//		Authenticate: func(r *http.Request) (string, bool) { return userFrom(r) },
//		Authorize:    func(r *http.Request, user string, a console.Action) bool { return isOperator(user) },
//	})
//	mux.Handle("/outbox/", http.StripPrefix("/outbox", h))
//
// It is server-rendered with html/template (no JavaScript build step). It is read-only unless
// Authorize allows an action on its target; actions are POSTs that carry a per-user token (CSRF)
// that expires, and must come from the same site; a discard asks first. It serves nothing without
// Authenticate (or BasicAuth) unless the application opts in with AllowUnauthenticated (because
// its own authentication sits in front of it). Its counts come from the sampled stats and every
// list is paged, so that a page costs the same whatever the backlog.
//
// NewMembersFunc serves the members of a tenant.Set (a database, schema or table prefix each) as
// the Set holds them at each request: a page lists every member with its relays, counts and
// health, and each member has the pages and the actions above, picked by the query parameter
// member, acting on that member's tables only.
//
//	var set *tenant.Set // members added and removed while the process runs
//	h, err := console.NewMembersFunc(console.MembersOf(set), console.Options{
//		Authenticate: func(r *http.Request) (string, bool) { return userFrom(r) },
//		Authorize:    func(r *http.Request, user string, a console.Action) bool { return isOperator(user) },
//	})
//
// NewMembers serves a fixed list of members.
package console

import (
	"cmp"
	"context"
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"crypto/subtle"
	"embed"
	"encoding/base64"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"html/template"
	"net/http"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/watermill-outbox/outbox"
	"github.com/watermill-outbox/outbox/internal/fanout"
	"github.com/watermill-outbox/outbox/internal/membername"
	"github.com/watermill-outbox/outbox/ops"
	"github.com/watermill-outbox/outbox/outboxdriver"
)

//go:embed console.html
var files embed.FS

var page = template.Must(template.New("console.html").Funcs(template.FuncMap{
	"ago": func(t time.Time) string {
		if t.IsZero() {
			return "never"
		}
		return time.Since(t).Round(time.Second).String() + " ago"
	},
	"dur":      func(d time.Duration) string { return d.Round(time.Millisecond).String() },
	"since":    func(t time.Time) string { return time.Since(t).Round(time.Second).String() + " ago" },
	"boundary": func(c string) string { return map[bool]string{true: "(boundary)", false: c}[c == ""] },
	"ids": func(ids []int64) string {
		parts := make([]string, len(ids))
		for i, id := range ids {
			parts[i] = strconv.FormatInt(id, 10)
		}
		return strings.Join(parts, ",")
	},
}).ParseFS(files, "console.html"))

// Actions a user may be authorized for.
const (
	ActionRetry   = "retry"
	ActionDiscard = "discard"
	ActionReplay  = "replay"
	// ActionRetryDeadLetter and ActionDiscardDeadLetter change dead letters: names of their own,
	// because handing a message back to its handler is not resending an effect.
	ActionRetryDeadLetter   = "retry-dead-letter"
	ActionDiscardDeadLetter = "discard-dead-letter"
	// ActionDeadLetterNow dead-letters a failing message on its next delivery (outbox dead now);
	// its target is in Consumers and MessageID.
	ActionDeadLetterNow = "dead-letter-now"
)

// Action is what Authorize is asked about: an action and its target.
type Action struct {
	// Name is one of the Action constants.
	Name string
	// StoreIDs are the parked effects a retry or a discard changes, and Consumers and Topics
	// theirs (each once); for a replay, Consumers holds the message's consumer.
	StoreIDs  []int64
	Consumers []string
	Topics    []string
	// MessageID is the message a replay, or a dead-letter-now, is for.
	MessageID string
	// Messages are the dead letters (Source{Consumer, ID: message ID}) a dead-letter action
	// changes, and Consumers theirs.
	Messages []outboxdriver.Source
	// Member is the member whose tables the action changes (NewMembers, NewMembersFunc); "" with New.
	Member string
}

// Options configure the console.
type Options struct {
	// Authenticate returns the user a request comes from, or false to refuse it (401, without a
	// challenge: a browser shows the refusal). Required, unless BasicAuth or AllowUnauthenticated.
	Authenticate func(r *http.Request) (user string, ok bool)
	// BasicAuth authenticates with HTTP Basic: it tells whether the user name and password a
	// request carries are valid. A request without valid ones is refused with 401 and a
	// WWW-Authenticate challenge, so that a browser asks for them. Serve the console over TLS.
	BasicAuth func(user, password string) bool
	// Realm names the console in the Basic challenge. Default: "outbox console".
	Realm string
	// AllowUnauthenticated serves the console without Authenticate, as user "anonymous": only
	// for an application whose own authentication sits in front of the handler.
	AllowUnauthenticated bool
	// Authorize tells whether user may perform a.Name on its target (the parked effects, their
	// consumers and topics, or the message to replay, and with members the member), so that
	// permissions may be per consumer or per tenant. It is asked for every row the page shows a button for, and again for the
	// target of every action. Nil: the console is read-only.
	Authorize func(r *http.Request, user string, a Action) bool
	// Key signs the anti-forgery tokens and the notices shown after an action. Instances behind
	// one load balancer must share it (at least 32 random bytes, kept secret), or one refuses the
	// tokens of another. Default: a key drawn at start, for one instance.
	Key []byte
	// TokenTTL is how long an anti-forgery token (the page's buttons) stays valid. Default: 12 hours.
	TokenTTL time.Duration
	// Retention is the service's Config.Retention, for the cleanup lag. Default: 7 days.
	Retention time.Duration
	// Timeout bounds each request's queries, and with NewMembersFunc its call of the members
	// function: one deadline for both. Default: 10 seconds.
	Timeout time.Duration
	// MaxSampleAge is how old the sampled counts may be before the page takes a sample of its
	// own (bounded, not stored). Default: one minute.
	MaxSampleAge time.Duration
	// RelayStaleAfter: when no service stored a sample for this long, no Outbox.Run (and so no
	// relay) is taken to be running, and pending effects are flagged. Keep it above the
	// services' StatsInterval. Default: one minute (four default StatsIntervals).
	RelayStaleAfter time.Duration
	// PageSize bounds each list of the page. Default: 50.
	PageSize int
}

// Member is a member of a tenant.Set for NewMembers and NewMembersFunc: the Ops of its tables
// under its name.
type Member struct {
	// Name names the member in the pages, in their addresses (?member=NAME) and in the audit
	// entries of its changes: 1 to 200 bytes of UTF-8 without control characters,
	// bidirectional controls, line separators or '/', as a tenant.Set accepts.
	Name string
	// Ops reads and repairs the member's tables (ops.ForOutbox of its Outbox).
	Ops *ops.Ops
	// Health, if set, is the member's health on the page of members (the Health method of its
	// Outbox). Nil: that page says whether the member's tables could be read.
	Health func(ctx context.Context) outbox.HealthReport
}

type console struct {
	// list returns the members, once per request: its page, its member and its action all use
	// that one list, so that a member removed meanwhile is not half served. New's one member is
	// named "": its page is the console's root, and its addresses carry no member.
	list func(ctx context.Context) ([]Member, error)
	// several: the console serves named members (NewMembers, NewMembersFunc), its root lists them.
	several bool
	opt     Options
	key     []byte // signs the CSRF tokens and the flash notices

	// reading holds, by member name, the read of the page of members under way: a load of the
	// page while it is takes its line rather than read the member again, so that a member whose
	// database does not answer gets no second read, and every load of the page does not leave
	// one more goroutine and connection attempt behind.
	reading fanout.Shared[string, memberRow]
}

// members is the list of members a request is served with: by name, and their names in order.
type members struct {
	byName map[string]*Member
	names  []string
}

// New returns the console's handler. It serves "/" (the page), "/discard" (GET: the question
// before a discard) and the POSTs "/retry", "/discard", "/replay", "/retry-dead",
// "/discard-dead" (dead letters) and "/dead-letter-now" (a failing message); mount it under a prefix with http.StripPrefix.
func New(o *ops.Ops, opt Options) (http.Handler, error) {
	if o == nil {
		return nil, errors.New("console: New with nil Ops")
	}
	one := []Member{{Ops: o}}
	return newConsole(func(context.Context) ([]Member, error) { return one, nil }, false, opt)
}

// NewMembers returns the handler of a console of several members: "/" lists them, and every
// page and action of New's is served for the member its query parameter member names
// ("/?member=acme", "/retry?member=acme"), on that member's tables only; a name that is not a
// member is answered with 404. Authorize is told the member (Action.Member), and the audit
// entries of a member's changes name it.
//
// The list is the one given: for the members of a tenant.Set, which change while the process
// runs, use NewMembersFunc.
func NewMembers(list []Member, opt Options) (http.Handler, error) {
	if len(list) == 0 {
		return nil, errors.New("console: NewMembers without members")
	}
	if _, err := named(list, true); err != nil {
		return nil, err
	}
	list = slices.Clone(list) // the caller's slice may change; the console's list does not
	return newConsole(func(context.Context) ([]Member, error) { return list, nil }, true, opt)
}

// NewMembersFunc is NewMembers with the list of members read at every request from members
// (MembersOf: a tenant.Set's), so that a member added since is served and a member removed is
// not: its pages and actions are 404. Each request calls members once, after authentication, and
// its page, its member and its action use that one list. The call is bounded by Options.Timeout,
// with the request's queries, and its ctx ends when the request has been served. An error of
// members is answered with 503, and a list NewMembers would refuse (an invalid name, no Ops, a
// name twice) with 500, naming the member; an empty list is a page of members without any.
func NewMembersFunc(members func(ctx context.Context) ([]Member, error), opt Options) (http.Handler, error) {
	if members == nil {
		return nil, errors.New("console: NewMembersFunc with a nil function")
	}
	return newConsole(members, true, opt)
}

// named returns the members of list by name, or an error naming the first that is invalid or
// named twice. Unless several, list is New's one member, named "".
func named(list []Member, several bool) (*members, error) {
	ms := &members{byName: make(map[string]*Member, len(list)), names: make([]string, 0, len(list))}
	for _, m := range list {
		if several {
			if err := validName(m.Name); err != nil {
				return nil, err
			}
		}
		if m.Ops == nil {
			return nil, fmt.Errorf("console: member %q has no Ops", m.Name)
		}
		if _, twice := ms.byName[m.Name]; twice {
			return nil, fmt.Errorf("console: member %q is named twice", m.Name)
		}
		ms.byName[m.Name] = &m
		ms.names = append(ms.names, m.Name)
	}
	return ms, nil
}

// validName accepts the names a tenant.Set accepts. They reach the pages and their addresses
// (escaped there) and the audit entries, never a statement.
func validName(name string) error {
	if why := membername.Check(name); why != "" {
		return fmt.Errorf("console: invalid member name %q: %s", name, why)
	}
	return nil
}

func newConsole(list func(ctx context.Context) ([]Member, error), several bool, opt Options) (http.Handler, error) {
	if opt.Authenticate == nil && opt.BasicAuth == nil && !opt.AllowUnauthenticated {
		return nil, errors.New("console: Options.Authenticate or BasicAuth is required (or set AllowUnauthenticated when the application authenticates in front of the console)")
	}
	if opt.Authenticate != nil && opt.BasicAuth != nil {
		return nil, errors.New("console: set Options.Authenticate or BasicAuth, not both")
	}
	if opt.Key != nil && len(opt.Key) < 32 {
		return nil, fmt.Errorf("console: Options.Key is %d bytes, want at least 32 random bytes", len(opt.Key))
	}
	if opt.Realm == "" {
		opt.Realm = "outbox console"
	}
	if opt.TokenTTL <= 0 {
		opt.TokenTTL = 12 * time.Hour
	}
	if opt.Retention == 0 {
		opt.Retention = 7 * 24 * time.Hour
	}
	if opt.Timeout == 0 {
		opt.Timeout = 10 * time.Second
	}
	if opt.MaxSampleAge <= 0 {
		opt.MaxSampleAge = time.Minute
	}
	if opt.RelayStaleAfter <= 0 {
		opt.RelayStaleAfter = time.Minute
	}
	if opt.PageSize <= 0 {
		opt.PageSize = 50
	}
	c := &console{list: list, several: several, opt: opt, key: opt.Key}
	if c.key == nil {
		c.key = make([]byte, 32)
		if _, err := rand.Read(c.key); err != nil {
			return nil, err
		}
	}
	mux := http.NewServeMux()
	mux.HandleFunc("GET /{$}", c.show)
	mux.HandleFunc("GET /discard", c.scoped(c.confirmDiscard))
	mux.HandleFunc("POST /retry", c.scoped(c.action(ActionRetry)))
	mux.HandleFunc("POST /discard", c.scoped(c.action(ActionDiscard)))
	mux.HandleFunc("POST /replay", c.scoped(c.action(ActionReplay)))
	mux.HandleFunc("POST /retry-dead", c.scoped(c.action(ActionRetryDeadLetter)))
	mux.HandleFunc("POST /discard-dead", c.scoped(c.action(ActionDiscardDeadLetter)))
	mux.HandleFunc("POST /dead-letter-now", c.scoped(c.action(ActionDeadLetterNow)))
	return c.secure(c.withMembers(mux)), nil
}

type membersKey struct{}

// withMembers reads the list of members once for the request, within its Timeout, which the
// request's queries share.
func (c *console) withMembers(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		ctx, cancel := context.WithTimeout(r.Context(), c.opt.Timeout)
		defer cancel() // ends the ctx members was given: its Ops may be released
		list, err := c.list(ctx)
		if err != nil {
			http.Error(w, fmt.Sprintf("the list of members could not be read: %v", err), http.StatusServiceUnavailable)
			return
		}
		ms, err := named(list, c.several)
		if err != nil {
			http.Error(w, fmt.Sprintf("the list of members is invalid: %v", err), http.StatusInternalServerError)
			return
		}
		next.ServeHTTP(w, r.WithContext(context.WithValue(ctx, membersKey{}, ms)))
	})
}

// membersOf returns the list of members the request is served with.
func membersOf(r *http.Request) *members { return r.Context().Value(membersKey{}).(*members) }

// scoped runs h for the member the request's query names (the URL's, for a POST too: the form
// cannot name another), or answers 404.
func (c *console) scoped(h func(http.ResponseWriter, *http.Request, *Member)) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		name := r.URL.Query().Get("member")
		m, ok := membersOf(r).byName[name]
		if !ok {
			http.Error(w, fmt.Sprintf("not found: no member %q", name), http.StatusNotFound)
			return
		}
		h(w, r, m)
	}
}

// memberQuery is the query of an address of member m's with q: "" when both are empty,
// otherwise "?" and q with member=NAME (New's member carries none).
func memberQuery(m *Member, q url.Values) string {
	if m.Name != "" {
		if q == nil {
			q = url.Values{}
		}
		q.Set("member", m.Name)
	}
	if len(q) == 0 {
		return ""
	}
	return "?" + q.Encode()
}

// actor is who the audit entry of a change names: the user, through the console, and the member.
func actor(user string, m *Member) string {
	if m.Name == "" {
		return user + " (console)"
	}
	return user + " (console, member " + m.Name + ")"
}

type userKey struct{}

// secure authenticates every request and sets headers that keep the page out of frames, caches
// and content sniffing.
func (c *console) secure(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		h := w.Header()
		h.Set("Content-Security-Policy", "default-src 'none'; style-src 'unsafe-inline'; form-action 'self'; frame-ancestors 'none'")
		h.Set("X-Frame-Options", "DENY")
		h.Set("X-Content-Type-Options", "nosniff")
		h.Set("Cache-Control", "no-store")
		h.Set("Referrer-Policy", "same-origin")
		user := "anonymous"
		switch {
		case c.opt.BasicAuth != nil:
			u, p, ok := r.BasicAuth()
			if !ok || !c.opt.BasicAuth(u, p) {
				h.Set("WWW-Authenticate", fmt.Sprintf("Basic realm=%q, charset=\"UTF-8\"", c.opt.Realm))
				http.Error(w, "unauthorized", http.StatusUnauthorized)
				return
			}
			user = u
		case c.opt.Authenticate != nil:
			u, ok := c.opt.Authenticate(r)
			if !ok {
				http.Error(w, "unauthorized", http.StatusUnauthorized)
				return
			}
			user = u
		}
		next.ServeHTTP(w, r.WithContext(context.WithValue(r.Context(), userKey{}, user)))
	})
}

func userOf(r *http.Request) string { return r.Context().Value(userKey{}).(string) }

func (c *console) sign(parts ...string) string {
	m := hmac.New(sha256.New, c.key)
	m.Write([]byte("outbox-console"))
	for _, p := range parts {
		m.Write([]byte{0})
		m.Write([]byte(p))
	}
	return base64.RawURLEncoding.EncodeToString(m.Sum(nil))
}

// signFor signs parts for member m: New's member signs them alone, as before members were
// known (the tokens of running instances stay valid across an upgrade), a named member with its
// name, so that what the console signed for one member is refused on another.
func (c *console) signFor(m *Member, parts ...string) string {
	if m.Name != "" {
		parts = append(parts, "member", m.Name)
	}
	return c.sign(parts...)
}

// token is a CSRF token of user for member m's pages, valid until its expiry: the expiry and an
// HMAC of the three under the key, so that any instance with the key checks it, and no other
// member's actions take it.
func (c *console) token(user string, m *Member) string {
	exp := strconv.FormatInt(time.Now().Add(c.opt.TokenTTL).Unix(), 10)
	return exp + "." + c.signFor(m, "csrf", user, exp)
}

// tokenErr tells why tok is not a valid token of user for member m, or nil.
func (c *console) tokenErr(user string, m *Member, tok string) error {
	exp, sig, ok := strings.Cut(tok, ".")
	if !ok || subtle.ConstantTimeCompare([]byte(sig), []byte(c.signFor(m, "csrf", user, exp))) != 1 {
		return errors.New("forbidden: missing or wrong CSRF token (reload the page)")
	}
	if at, err := strconv.ParseInt(exp, 10, 64); err != nil || time.Now().Unix() > at {
		return errors.New("forbidden: the page is too old, its CSRF token expired (reload the page)")
	}
	return nil
}

// flash is the query parameter that carries a notice for user after an action on member m: its
// text and a signature, so that a link cannot make the console show a notice it did not write,
// nor one member's page the notice of another's change.
func (c *console) flash(user string, m *Member, text string) string {
	return base64.RawURLEncoding.EncodeToString([]byte(text)) + "." + c.signFor(m, "flash", user, text)
}

// flashText returns the notice of a flash parameter for user on member m's page, or "" if it is
// not one the console signed for them there.
func (c *console) flashText(user string, m *Member, param string) string {
	enc, sig, ok := strings.Cut(param, ".")
	if !ok {
		return ""
	}
	b, err := base64.RawURLEncoding.DecodeString(enc)
	if err != nil || subtle.ConstantTimeCompare([]byte(sig), []byte(c.signFor(m, "flash", user, string(b)))) != 1 {
		return ""
	}
	return string(b)
}

func (c *console) may(r *http.Request, m *Member, a Action) bool {
	a.Member = m.Name
	return c.opt.Authorize != nil && c.opt.Authorize(r, userOf(r), a)
}

// row is a parked effect with what the user may do with it.
type row struct {
	ops.Parked
	CanRetry, CanDiscard bool
}

// group is a failure group of the page with whether the user may retry all of it.
type group struct {
	ops.FailureGroup
	CanRetry bool
}

// poisoned is a poisoned message with whether the user may replay it.
type poisoned struct {
	ops.Poisoned
	CanReplay bool
}

// failing is a failing message with whether the user may dead-letter it at once.
type failing struct {
	ops.Failing
	CanDeadLetter bool
}

// deadGroup is a group of dead letters with what the user may do with all of it.
type deadGroup struct {
	ops.DeadLetterGroup
	CanRetry, CanDiscard bool
	// Set names its dead letters as the page counted them (keySet).
	Set string
}

// keySet is a digest of the dead letters keys names, whatever their order: an action on a group
// "as shown" changes it only while the group is still those dead letters.
func keySet(keys []outboxdriver.Source) string {
	sorted := slices.Clone(keys)
	slices.SortFunc(sorted, func(a, b outboxdriver.Source) int {
		return cmp.Or(strings.Compare(a.Consumer, b.Consumer), strings.Compare(a.ID, b.ID))
	})
	h := sha256.New()
	for _, k := range sorted {
		for _, part := range []string{k.Consumer, k.ID} {
			var n [8]byte
			binary.BigEndian.PutUint64(n[:], uint64(len(part)))
			h.Write(n[:])
			h.Write([]byte(part))
		}
	}
	return hex.EncodeToString(h.Sum(nil)[:16])
}

// errGroupChanged: the group of dead letters is no longer the one the page counted.
var errGroupChanged = errors.New("the group changed since the page counted it")

// deadRow is a dead letter with what the user may do with it.
type deadRow struct {
	outboxdriver.DeadLetter
	CanRetry, CanDiscard bool
}

// deadConfirm is the question before a discard of dead letters: which, and the form fields
// that select them again.
type deadConfirm struct {
	Keys                       []outboxdriver.Source
	Consumer, MessageID, Group string
	// Set names the group's dead letters as the question counts them (keySet).
	Set string
	// Changed tells that the group changed since the page the action came from counted it.
	Changed bool
	// Shown are the first PageSize of Keys, which the question lists (a group may count
	// thousands), and More how many it leaves out.
	Shown []outboxdriver.Source
	More  int
}

// relay is the indicator of the relays' state.
type relay struct {
	Level string // ok, warn, bad
	Text  string
}

// filter is the page's selection, kept in its links.
type filter struct {
	Consumer, Topic, Error string
	After                  int64
}

func (f filter) query(m *Member, after int64) template.URL {
	q := url.Values{}
	for k, v := range map[string]string{"consumer": f.Consumer, "topic": f.Topic, "error": f.Error} {
		if v != "" {
			q.Set(k, v)
		}
	}
	if after > 0 {
		q.Set("after", strconv.FormatInt(after, 10))
	}
	return template.URL("./" + memberQuery(m, q))
}

// memberRow is a member on the page of members.
type memberRow struct {
	Name    string
	Link    template.URL
	Error   string // the member's tables could not be read
	Totals  outboxdriver.Stats
	Relay   relay
	Healthy bool
	Health  string
	Sampled time.Duration // age of the stored sample, negative: none
}

type view struct {
	User  string
	Token string
	// Member is the member the page is of ("" with New), Several whether the console has named
	// members (a link back to their list), Home the address of the member's page and Query the
	// query every address of the member's carries ("?member=NAME", or "").
	Member      string
	Several     bool
	Home        template.URL
	Query       template.URL
	MembersPage bool // the page of members, of Members (none: no member)
	Members     []memberRow
	ReadOnly    bool
	Flash       string
	Error       string
	Filter      filter
	Overview    ops.Overview
	Relay       relay
	Groups      []group
	Parked      []row
	NextParked  template.URL
	Failing     []failing
	MoreFailing bool
	Poisoned    []poisoned
	MorePoison  bool
	PageSize    int
	Counted     []string     // the tiles that count the lists below rather than the sample
	Confirm     []ops.Parked // the effects a discard would give up, asked about first
	ConfirmIDs  string
	// The dead letters: their groups (by consumer and cause), the oldest page of them, and
	// whether the driver keeps none.
	DeadGroups     []deadGroup
	MoreDeadGroups bool
	Dead           []deadRow
	MoreDead       bool
	NoDeadLetters  bool
	ConfirmDead    *deadConfirm // the dead letters a discard would give up, asked about first
}

// newView is the view of a page of member m's.
func (c *console) newView(r *http.Request, m *Member) view {
	user := userOf(r)
	return view{User: user, Token: c.token(user, m), Member: m.Name, Several: c.several,
		Home: template.URL("./" + memberQuery(m, nil)), Query: template.URL(memberQuery(m, nil)),
		ReadOnly: c.opt.Authorize == nil, PageSize: c.opt.PageSize}
}

// show serves the root: the page of the member the query names, or with members and no
// member named, the page of members.
func (c *console) show(w http.ResponseWriter, r *http.Request) {
	if c.several && !r.URL.Query().Has("member") {
		c.showMembers(w, r)
		return
	}
	c.scoped(c.showMember)(w, r)
}

func (c *console) showMember(w http.ResponseWriter, r *http.Request, m *Member) {
	ctx, cancel := context.WithTimeout(r.Context(), c.opt.Timeout)
	defer cancel()
	q := r.URL.Query()
	v := c.newView(r, m)
	v.Flash = c.flashText(v.User, m, q.Get("flash"))
	v.Filter = filter{Consumer: q.Get("consumer"), Topic: q.Get("topic"), Error: q.Get("error")}
	v.Filter.After, _ = strconv.ParseInt(q.Get("after"), 10, 64)
	err := c.load(ctx, r, m, &v)
	if err != nil {
		w.WriteHeader(http.StatusServiceUnavailable)
		v.Error = err.Error()
	}
	c.render(w, v)
}

// membersAtOnce bounds the members the page of members reads at once, and memberTurn how long a
// member keeps its turn before the next one begins beside it.
const (
	membersAtOnce = 4
	memberTurn    = time.Second
)

// showMembers serves the page of members: each one's sampled counts, relays and health, read a
// few at a time within the request's Timeout, so that a member that is down or slow costs the
// page no more than the Timeout and the others are shown whatever it does. A member that does
// not answer keeps its turn for memberTurn at most: held until the read returned, four such
// members took every turn, and the others were shown as not read during exactly the incidents
// the page is for.
func (c *console) showMembers(w http.ResponseWriter, r *http.Request) {
	ctx, cancel := context.WithTimeout(r.Context(), c.opt.Timeout)
	defer cancel()
	ms := membersOf(r)
	v := view{User: userOf(r), Several: true, Home: "./", ReadOnly: c.opt.Authorize == nil,
		MembersPage: true}
	rowOf := func(name string) memberRow {
		return memberRow{Name: name, Link: template.URL("./" + memberQuery(ms.byName[name], nil)), Sampled: -1, Health: "unknown"}
	}
	// The line of a member whose read has not returned by the deadline: this page's, or that of
	// an earlier load still under way.
	noAnswer := func(name string) memberRow {
		row := rowOf(name)
		row.Error = fmt.Sprintf("no answer within the console's Timeout (%v)", c.opt.Timeout)
		if began := c.reading.Began(name); !began.IsZero() && time.Since(began) > c.opt.Timeout {
			row.Error += fmt.Sprintf(": a read of it began %v ago and has not returned", time.Since(began).Round(time.Second))
		}
		return row
	}
	rows, states := fanout.Each(ctx, len(ms.names), membersAtOnce, memberTurn, func(ctx context.Context, i int) memberRow {
		name := ms.names[i]
		m := ms.byName[name]
		rd := c.reading.Join(name, max(readGiveUp, c.opt.Timeout), func() memberRow {
			row := rowOf(name)
			// Not the request's context: the loads that take this read's line must not get
			// the error of one that ended first (a reload cancels the page it replaces).
			rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), c.opt.Timeout)
			defer cancel()
			c.readMember(rctx, m, &row)
			return row
		})
		select {
		case <-rd.Done():
			return rd.Value()
		case <-ctx.Done():
			return noAnswer(name)
		}
	})
	for i, name := range ms.names {
		switch states[i] {
		case fanout.Pending:
			rows[i] = noAnswer(name)
		case fanout.NotBegun:
			rows[i] = rowOf(name)
			rows[i].Error = fmt.Sprintf("not read within the console's Timeout (%v): its turn did not come", c.opt.Timeout)
		}
	}
	v.Members = rows
	c.render(w, v)
}

// readGiveUp is when the page of members gives up on a read of a member that has not returned
// and begins another: the member's database may be back, and the page must not report for ever
// on a connection attempt that will never end. A member that never answers costs a goroutine
// and a connection attempt per readGiveUp (or Timeout, when longer), not one per load.
const readGiveUp = 30 * time.Second

// readMember reads a member's line of the page of members.
func (c *console) readMember(ctx context.Context, m *Member, row *memberRow) {
	row.Error = ""
	o, err := m.Ops.Overview(ctx, ops.OverviewParams{Retention: c.opt.Retention, MaxAge: c.opt.MaxSampleAge, CountsOnly: true})
	if err != nil {
		row.Error, row.Health = err.Error(), "the tables could not be read"
	} else {
		row.Totals, row.Sampled, row.Relay = o.Totals, o.ServiceSampled, c.relayState(o)
		row.Healthy, row.Health = true, "the tables were read"
	}
	if m.Health != nil {
		rep := m.Health(ctx)
		row.Healthy, row.Health = rep.Healthy, "healthy"
		if err := rep.Err(); err != nil {
			row.Health = err.Error()
		}
	}
}

func (c *console) render(w http.ResponseWriter, v view) {
	w.Header().Set("Content-Type", "text/html; charset=utf-8")
	_ = page.Execute(w, v)
}

// load reads what the page shows: the sampled counts, and a page of each list.
func (c *console) load(ctx context.Context, r *http.Request, m *Member, v *view) error {
	var err error
	// The page after an action counts afresh: the stored sample predates the change.
	if v.Overview, err = m.Ops.Overview(ctx, ops.OverviewParams{Retention: c.opt.Retention, MaxAge: c.opt.MaxSampleAge,
		Fresh: v.Flash != ""}); err != nil {
		return err
	}
	v.Relay = c.relayState(v.Overview)
	n := c.opt.PageSize
	parked, err := m.Ops.ParkedEffects(ctx, ops.ParkedFilter{Consumer: v.Filter.Consumer, Topic: v.Filter.Topic,
		ErrorContains: v.Filter.Error, AfterID: v.Filter.After, Limit: n + 1})
	if err != nil {
		return err
	}
	if len(parked) > n {
		parked = parked[:n]
		v.NextParked = v.Filter.query(m, parked[n-1].StoreID)
	}
	for _, p := range parked {
		t := target(p)
		v.Parked = append(v.Parked, row{Parked: p,
			CanRetry: c.may(r, m, t.as(ActionRetry)), CanDiscard: c.may(r, m, t.as(ActionDiscard))})
	}
	for _, g := range ops.GroupByFingerprint(parked) {
		var in []ops.Parked
		for _, p := range parked {
			if slices.Contains(g.StoreIDs, p.StoreID) {
				in = append(in, p)
			}
		}
		v.Groups = append(v.Groups, group{FailureGroup: g, CanRetry: c.may(r, m, target(in...).as(ActionRetry))})
	}
	fl, err := m.Ops.FailingMessages(ctx, v.Filter.Consumer, n+1)
	if err != nil {
		return err
	}
	if len(fl) > n {
		fl, v.MoreFailing = fl[:n], true
	}
	for _, f := range fl {
		v.Failing = append(v.Failing, failing{Failing: f,
			CanDeadLetter: c.may(r, m, Action{Name: ActionDeadLetterNow, Consumers: []string{f.Consumer}, MessageID: f.MessageID})})
	}
	if err := c.loadDead(ctx, r, m, v); err != nil {
		return err
	}
	c.countFromLists(v, v.NextParked != "")
	list, err := m.Ops.PoisonedMessages(ctx, v.Filter.Consumer, n+1)
	if err != nil {
		return err
	}
	if len(list) > n {
		list, v.MorePoison = list[:n], true
	}
	for _, p := range list {
		v.Poisoned = append(v.Poisoned, poisoned{Poisoned: p,
			CanReplay: c.may(r, m, Action{Name: ActionReplay, Consumers: []string{p.Consumer}, MessageID: p.MessageID})})
	}
	return nil
}

// loadDead reads the groups of dead letters and the oldest page of them (of the consumer the page
// is filtered by).
func (c *console) loadDead(ctx context.Context, r *http.Request, m *Member, v *view) error {
	groups, more, err := m.Ops.DeadLetterGroups(ctx, v.Filter.Consumer)
	if errors.Is(err, outboxdriver.ErrDeadLettersUnsupported) {
		v.NoDeadLetters = true
		return nil
	}
	if err != nil {
		return err
	}
	v.MoreDeadGroups = more
	for _, g := range groups {
		t := deadTarget(g.Keys...)
		v.DeadGroups = append(v.DeadGroups, deadGroup{DeadLetterGroup: g, Set: keySet(g.Keys),
			CanRetry: c.may(r, m, t.as(ActionRetryDeadLetter)), CanDiscard: c.may(r, m, t.as(ActionDiscardDeadLetter))})
	}
	n := c.opt.PageSize
	dead, err := m.Ops.DeadLetters(ctx, outboxdriver.DeadLetterFilter{Consumer: v.Filter.Consumer, State: outboxdriver.DeadLetterDead, Limit: n + 1})
	if err != nil {
		return err
	}
	if len(dead) > n {
		dead, v.MoreDead = dead[:n], true
	}
	for _, d := range dead {
		t := deadTarget(outboxdriver.Source{Consumer: d.Consumer, ID: d.MessageID})
		v.Dead = append(v.Dead, deadRow{DeadLetter: d,
			CanRetry: c.may(r, m, t.as(ActionRetryDeadLetter)), CanDiscard: c.may(r, m, t.as(ActionDiscardDeadLetter))})
	}
	return nil
}

// deadTarget is the target of an action on dead letters.
func deadTarget(keys ...outboxdriver.Source) Action {
	a := Action{Messages: keys}
	for _, k := range keys {
		if !slices.Contains(a.Consumers, k.Consumer) {
			a.Consumers = append(a.Consumers, k.Consumer)
		}
	}
	return a
}

// deadOf returns the dead letters (in state dead) a form selects: one (consumer and message_id)
// or a group (consumer and group, the fingerprint of its reason), and the selection for a
// question.
func (c *console) deadOf(ctx context.Context, m *Member, form url.Values) ([]outboxdriver.Source, deadConfirm, error) {
	sel := deadConfirm{Consumer: form.Get("consumer"), MessageID: form.Get("message_id"), Group: form.Get("group")}
	if sel.Consumer == "" || (sel.MessageID == "") == (sel.Group == "") {
		return nil, sel, errors.New("bad request: a consumer and a message_id or a group")
	}
	if sel.MessageID != "" {
		// The store's change tells whether it is dead: one that is not is left alone and not counted.
		return []outboxdriver.Source{{Consumer: sel.Consumer, ID: sel.MessageID}}, sel, nil
	}
	shown := form.Get("set")
	if shown == "" {
		return nil, sel, errors.New("bad request: a group without the dead letters the page counted in it (reload the page)")
	}
	groups, _, err := m.Ops.DeadLetterGroups(ctx, sel.Consumer)
	if err != nil {
		return nil, sel, err
	}
	for _, g := range groups {
		if g.Fingerprint == sel.Group {
			// The group as the page counted it, or nothing: dead letters that joined it since (an
			// incident goes on while the operator reads) are not changed by an action on a count
			// that did not include them.
			sel.Set = keySet(g.Keys)
			if sel.Set != shown {
				return g.Keys, sel, errGroupChanged
			}
			return g.Keys, sel, nil
		}
	}
	return nil, sel, nil
}

// countFromLists replaces the sampled parked, failing and dead-letter counts with the lists the
// page read just now, where those lists are whole (unfiltered, one page): a sample up to
// MaxSampleAge old would otherwise still count an effect the list no longer shows (retried a
// moment ago), or a message that has since succeeded, been poisoned or dead-lettered.
func (c *console) countFromLists(v *view, parkedPaged bool) {
	t := &v.Overview.Totals
	f := v.Filter
	if f.Consumer == "" && f.Topic == "" && f.Error == "" && f.After == 0 && !parkedPaged {
		t.Parked, t.OldestParked = int64(len(v.Parked)), 0
		for _, p := range v.Parked {
			t.OldestParked = max(t.OldestParked, time.Since(p.CreatedAt))
		}
		v.Counted = append(v.Counted, "parked")
	}
	if f.Consumer == "" && !v.MoreFailing {
		t.Failing = int64(len(v.Failing))
		v.Counted = append(v.Counted, "failing")
	}
	if f.Consumer == "" && !v.MoreDead && !v.NoDeadLetters {
		t.DeadLetters = int64(len(v.Dead))
		v.Counted = append(v.Counted, "dead letters")
	}
}

// relayState says whether relays run, from the age of the sample the services store.
func (c *console) relayState(o ops.Overview) relay {
	t := o.Totals
	switch {
	case o.ServiceSampled < 0 || o.ServiceSampled > c.opt.RelayStaleAfter:
		since := "ever"
		if o.ServiceSampled >= 0 {
			since = "for " + o.ServiceSampled.Round(time.Second).String()
		}
		if t.Pending > 0 {
			return relay{"bad", fmt.Sprintf("%d side effects pending and no relay seems to be running: no service has sampled the tables %s (Outbox.Run samples every StatsInterval). Start Outbox.Run.", t.Pending, since)}
		}
		return relay{"warn", fmt.Sprintf("No relay seems to be running: no service has sampled the tables %s (Outbox.Run samples every StatsInterval).", since)}
	case t.Pending > 0 && t.OldestPending > c.opt.RelayStaleAfter:
		return relay{"warn", fmt.Sprintf("Relays run (a service sampled %s ago), but the oldest pending side effect is %s old: they are not keeping up, or cannot publish.",
			o.ServiceSampled.Round(time.Second), t.OldestPending.Round(time.Second))}
	}
	return relay{"ok", fmt.Sprintf("Relays run: a service sampled the tables %s ago.", o.ServiceSampled.Round(time.Second))}
}

// target is the target of an action on effects.
func target(effects ...ops.Parked) Action {
	var a Action
	for _, p := range effects {
		a.StoreIDs = append(a.StoreIDs, p.StoreID)
		if !slices.Contains(a.Consumers, p.Source.Consumer) {
			a.Consumers = append(a.Consumers, p.Source.Consumer)
		}
		if !slices.Contains(a.Topics, p.Topic) {
			a.Topics = append(a.Topics, p.Topic)
		}
	}
	return a
}

func (a Action) as(name string) Action { a.Name = name; return a }

// parkedOf returns the parked effects of the store IDs in s ("1,2,3"), or an error for the user.
func (c *console) parkedOf(ctx context.Context, m *Member, s string) ([]ops.Parked, error) {
	var ids []int64
	for _, part := range strings.Split(s, ",") {
		id, err := strconv.ParseInt(strings.TrimSpace(part), 10, 64)
		if err != nil || id <= 0 {
			return nil, fmt.Errorf("bad request: store ID %q", part)
		}
		ids = append(ids, id)
	}
	if len(ids) > ops.DefaultLimit {
		return nil, fmt.Errorf("bad request: %d store IDs, at most %d at once", len(ids), ops.DefaultLimit)
	}
	return m.Ops.ParkedEffects(ctx, ops.ParkedFilter{IDs: ids, Limit: len(ids)})
}

// confirmDiscard asks before a discard: it shows the effects and a button that discards them.
func (c *console) confirmDiscard(w http.ResponseWriter, r *http.Request, m *Member) {
	ctx, cancel := context.WithTimeout(r.Context(), c.opt.Timeout)
	defer cancel()
	c.askDiscard(ctx, w, r, m, r.URL.Query().Get("ids"))
}

func (c *console) askDiscard(ctx context.Context, w http.ResponseWriter, r *http.Request, m *Member, ids string) {
	parked, err := c.parkedOf(ctx, m, ids)
	if err != nil {
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	if len(parked) == 0 {
		http.Error(w, "none of these effects is parked (any more)", http.StatusNotFound)
		return
	}
	if !c.may(r, m, target(parked...).as(ActionDiscard)) {
		http.Error(w, "forbidden: not authorized to discard these effects", http.StatusForbidden)
		return
	}
	v := c.newView(r, m)
	v.Confirm, v.ConfirmIDs = parked, idList(target(parked...).StoreIDs)
	c.render(w, v)
}

// action handles a POST: the request must not come from another site, the token must be valid,
// the user must be authorized for the action on its target; a discard must be confirmed. Then
// the change goes through ops, audited with the user's name and address.
func (c *console) action(action string) func(http.ResponseWriter, *http.Request, *Member) {
	return func(w http.ResponseWriter, r *http.Request, m *Member) {
		if c.opt.Authorize == nil {
			http.Error(w, "forbidden: the console is read-only", http.StatusForbidden)
			return
		}
		if site := r.Header.Get("Sec-Fetch-Site"); site != "" && site != "same-origin" {
			http.Error(w, "forbidden: cross-site request", http.StatusForbidden)
			return
		}
		r.Body = http.MaxBytesReader(w, r.Body, 1<<20)
		if err := r.ParseForm(); err != nil {
			http.Error(w, "bad request: "+err.Error(), http.StatusBadRequest)
			return
		}
		user := userOf(r)
		if err := c.tokenErr(user, m, r.PostForm.Get("token")); err != nil {
			http.Error(w, err.Error(), http.StatusForbidden)
			return
		}
		ctx, cancel := context.WithTimeout(r.Context(), c.opt.Timeout)
		defer cancel()
		opt := ops.RepairOptions{Actor: actor(user, m), Remote: r.RemoteAddr}
		var flash string
		var err error
		switch action {
		case ActionRetryDeadLetter, ActionDiscardDeadLetter:
			keys, sel, derr := c.deadOf(ctx, m, r.PostForm)
			changed := errors.Is(derr, errGroupChanged)
			if changed && action == ActionRetryDeadLetter {
				flash = fmt.Sprintf("nothing retried: the group changed since the page counted it (%d dead letter(s) now); look again", len(keys))
				break
			}
			if derr != nil && !changed {
				http.Error(w, derr.Error(), http.StatusBadRequest)
				return
			}
			if len(keys) == 0 {
				flash = "no such dead letters (any more): nothing changed"
				break
			}
			if !c.may(r, m, deadTarget(keys...).as(action)) {
				http.Error(w, "forbidden: not authorized to "+action+" these dead letters", http.StatusForbidden)
				return
			}
			if action == ActionDiscardDeadLetter && (r.PostForm.Get("confirm") != "yes" || changed) {
				// Asked again when the group changed: the question counts it as it is now.
				sel.Changed = changed && r.PostForm.Get("confirm") == "yes"
				sel.Keys, sel.Shown = keys, keys[:min(len(keys), c.opt.PageSize)]
				sel.More = len(keys) - len(sel.Shown)
				v := c.newView(r, m)
				v.ConfirmDead = &sel
				c.render(w, v)
				return
			}
			var n int
			if action == ActionRetryDeadLetter {
				n, err = m.Ops.RetryDeadLetters(ctx, keys, opt)
				flash = fmt.Sprintf("%d dead letter(s) retried: their consumers run them again", n)
			} else {
				n, err = m.Ops.DiscardDeadLetters(ctx, keys, opt)
				flash = fmt.Sprintf("%d dead letter(s) discarded", n)
			}
		case ActionDeadLetterNow:
			consumer, id := r.PostForm.Get("consumer"), r.PostForm.Get("message_id")
			if !c.may(r, m, Action{Name: ActionDeadLetterNow, Consumers: []string{consumer}, MessageID: id}) {
				http.Error(w, "forbidden: not authorized to dead-letter "+consumer+"/"+id, http.StatusForbidden)
				return
			}
			var ok bool
			ok, err = m.Ops.DeadLetterNow(ctx, outboxdriver.Source{Consumer: consumer, ID: id}, opt)
			flash = fmt.Sprintf("dead-letter %s/%s: %v", consumer, id, map[bool]string{
				true: "its next delivery stores it as a dead letter and acks it", false: "not a failing message"}[ok])
		case ActionReplay:
			consumer, id := r.PostForm.Get("consumer"), r.PostForm.Get("message_id")
			if !c.may(r, m, Action{Name: ActionReplay, Consumers: []string{consumer}, MessageID: id}) {
				http.Error(w, "forbidden: not authorized to replay "+consumer+"/"+id, http.StatusForbidden)
				return
			}
			var ok bool
			ok, err = m.Ops.ReplayPoisoned(ctx, consumer, id, opt)
			flash = fmt.Sprintf("replay %s/%s: %v", consumer, id, map[bool]string{
				true: "its next delivery runs the handler", false: "not a poisoned message"}[ok])
		default:
			parked, perr := c.parkedOf(ctx, m, r.PostForm.Get("ids"))
			if perr != nil {
				http.Error(w, perr.Error(), http.StatusBadRequest)
				return
			}
			t := target(parked...).as(action)
			if len(parked) == 0 {
				flash = "none of these effects is parked (any more): nothing changed"
				break
			}
			if !c.may(r, m, t) {
				http.Error(w, "forbidden: not authorized to "+action+" these effects", http.StatusForbidden)
				return
			}
			if action == ActionDiscard && r.PostForm.Get("confirm") != "yes" {
				c.askDiscard(ctx, w, r, m, idList(t.StoreIDs))
				return
			}
			repair := m.Ops.RetryParked
			if action == ActionDiscard {
				repair = m.Ops.DiscardParked
			}
			var ch ops.Change
			ch, err = repair(ctx, ops.ParkedFilter{IDs: t.StoreIDs, Limit: len(t.StoreIDs)}, opt)
			past := map[string]string{ActionRetry: "retried", ActionDiscard: "discarded"}[action]
			flash = fmt.Sprintf("%d parked effect(s) %s", ch.Changed, past)
		}
		if err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		// A relative Location: the browser resolves it against the prefix the console is mounted under.
		w.Header().Set("Location", "./"+memberQuery(m, url.Values{"flash": {c.flash(user, m, flash)}}))
		w.WriteHeader(http.StatusSeeOther)
	}
}

func idList(ids []int64) string {
	parts := make([]string, len(ids))
	for i, id := range ids {
		parts[i] = strconv.FormatInt(id, 10)
	}
	return strings.Join(parts, ",")
}
