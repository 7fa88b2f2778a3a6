// Package console is an embeddable web console for the outbox: the status, the parked effects
// grouped by failure, the failing and the poisoned messages, and buttons to retry, discard and
// replay that go through package ops (the CLI's code), audited with the user's name.
//
//	o, err := ops.ForOutbox(ob) // the tables the Outbox works on
//	h, err := console.New(o, console.Options{
//		Authenticate: func(r *http.Request) (string, bool) { return userFrom(r) },
//		Authorize:    func(r *http.Request, user, action string) bool { return isOperator(user) },
//	})
//	mux.Handle("/outbox/", http.StripPrefix("/outbox", h))
//
// It is server-rendered with html/template (no JavaScript build step). It is read-only unless
// Authorize allows an action; actions are POSTs that carry a per-user token (CSRF) and must come
// from the same site. It serves nothing without Authenticate unless the application opts in with
// AllowUnauthenticated (because its own authentication sits in front of it).
package console

import (
	"context"
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"crypto/subtle"
	"embed"
	"encoding/base64"
	"errors"
	"fmt"
	"html/template"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"time"

	"github.com/watermill-outbox/outbox/ops"
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
)

// Options configure the console.
type Options struct {
	// Authenticate returns the user a request comes from, or false to refuse it (401). Required,
	// unless AllowUnauthenticated.
	Authenticate func(r *http.Request) (user string, ok bool)
	// AllowUnauthenticated serves the console without Authenticate, as user "anonymous": only
	// for an application whose own authentication sits in front of the handler.
	AllowUnauthenticated bool
	// Authorize tells whether user may perform action (ActionRetry, ActionDiscard, ActionReplay).
	// Nil: the console is read-only.
	Authorize func(r *http.Request, user, action string) bool
	// Retention is the service's Config.Retention, for the cleanup lag. Default: 7 days.
	Retention time.Duration
	// Timeout bounds each request's queries. Default: 10 seconds.
	Timeout time.Duration
}

type console struct {
	ops *ops.Ops
	opt Options
	key []byte // signs the CSRF tokens
}

// New returns the console's handler. It serves "/" (the page) and the POSTs "/retry",
// "/discard" and "/replay"; mount it under a prefix with http.StripPrefix.
func New(o *ops.Ops, opt Options) (http.Handler, error) {
	if opt.Authenticate == nil && !opt.AllowUnauthenticated {
		return nil, errors.New("console: Options.Authenticate is required (or set AllowUnauthenticated when the application authenticates in front of the console)")
	}
	if opt.Retention == 0 {
		opt.Retention = 7 * 24 * time.Hour
	}
	if opt.Timeout == 0 {
		opt.Timeout = 10 * time.Second
	}
	c := &console{ops: o, opt: opt, key: make([]byte, 32)}
	if _, err := rand.Read(c.key); err != nil {
		return nil, err
	}
	mux := http.NewServeMux()
	mux.HandleFunc("GET /{$}", c.show)
	mux.HandleFunc("POST /retry", c.action(ActionRetry))
	mux.HandleFunc("POST /discard", c.action(ActionDiscard))
	mux.HandleFunc("POST /replay", c.action(ActionReplay))
	return c.secure(mux), nil
}

type userKey struct{}

// secure authenticates every request and sets headers that keep the page out of frames and caches.
func (c *console) secure(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		user := "anonymous"
		if c.opt.Authenticate != nil {
			u, ok := c.opt.Authenticate(r)
			if !ok {
				http.Error(w, "unauthorized", http.StatusUnauthorized)
				return
			}
			user = u
		}
		h := w.Header()
		h.Set("Content-Security-Policy", "default-src 'none'; style-src 'unsafe-inline'; form-action 'self'; frame-ancestors 'none'")
		h.Set("X-Frame-Options", "DENY")
		h.Set("Cache-Control", "no-store")
		h.Set("Referrer-Policy", "same-origin")
		next.ServeHTTP(w, r.WithContext(context.WithValue(r.Context(), userKey{}, user)))
	})
}

func userOf(r *http.Request) string { return r.Context().Value(userKey{}).(string) }

// token is the CSRF token of user: an HMAC under the process's random key.
func (c *console) token(user string) string {
	m := hmac.New(sha256.New, c.key)
	m.Write([]byte("outbox-console\x00" + user))
	return base64.RawURLEncoding.EncodeToString(m.Sum(nil))
}

func (c *console) may(r *http.Request, action string) bool {
	return c.opt.Authorize != nil && c.opt.Authorize(r, userOf(r), action)
}

type view struct {
	User                 string
	Token                string
	CanRetry, CanDiscard bool
	CanReplay            bool
	Flash, Error         string
	Status               ops.Status
	Groups               []ops.FailureGroup
	Parked               []ops.Parked
	Failing              []ops.Failing
	Poisoned             []ops.Poisoned
}

func (c *console) show(w http.ResponseWriter, r *http.Request) {
	ctx, cancel := context.WithTimeout(r.Context(), c.opt.Timeout)
	defer cancel()
	v := view{User: userOf(r), Token: c.token(userOf(r)), Flash: r.URL.Query().Get("flash"),
		CanRetry: c.may(r, ActionRetry), CanDiscard: c.may(r, ActionDiscard), CanReplay: c.may(r, ActionReplay)}
	var err error
	if v.Status, err = c.ops.Status(ctx, c.opt.Retention); err == nil {
		if v.Parked, err = c.ops.ParkedEffects(ctx, ops.ParkedFilter{Limit: 200}); err == nil {
			v.Groups = ops.GroupByFingerprint(v.Parked)
			if v.Failing, err = c.ops.FailingMessages(ctx, "", 100); err == nil {
				v.Poisoned, err = c.ops.PoisonedMessages(ctx, 100)
			}
		}
	}
	if err != nil {
		w.WriteHeader(http.StatusServiceUnavailable)
		v.Error = err.Error()
	}
	w.Header().Set("Content-Type", "text/html; charset=utf-8")
	_ = page.Execute(w, v)
}

// action handles a POST: the user must be authorized, the token must match, the request must not
// come from another site; then the change goes through ops, audited with the user's name.
func (c *console) action(action string) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		if !c.may(r, action) {
			http.Error(w, "forbidden: not authorized to "+action, http.StatusForbidden)
			return
		}
		if site := r.Header.Get("Sec-Fetch-Site"); site != "" && site != "same-origin" {
			http.Error(w, "forbidden: cross-site request", http.StatusForbidden)
			return
		}
		if err := r.ParseForm(); err != nil {
			http.Error(w, "bad request: "+err.Error(), http.StatusBadRequest)
			return
		}
		if subtle.ConstantTimeCompare([]byte(r.PostForm.Get("token")), []byte(c.token(userOf(r)))) != 1 {
			http.Error(w, "forbidden: missing or wrong CSRF token (reload the page)", http.StatusForbidden)
			return
		}
		ctx, cancel := context.WithTimeout(r.Context(), c.opt.Timeout)
		defer cancel()
		opt := ops.RepairOptions{Actor: userOf(r) + " (console)"}
		var flash string
		var err error
		switch action {
		case ActionReplay:
			var ok bool
			ok, err = c.ops.ReplayPoisoned(ctx, r.PostForm.Get("consumer"), r.PostForm.Get("message_id"), opt)
			flash = fmt.Sprintf("replay %s/%s: %v", r.PostForm.Get("consumer"), r.PostForm.Get("message_id"), map[bool]string{
				true: "its next delivery runs the handler", false: "not a poisoned message"}[ok])
		default:
			var ids []int64
			for _, s := range strings.Split(r.PostForm.Get("ids"), ",") {
				id, perr := strconv.ParseInt(strings.TrimSpace(s), 10, 64)
				if perr != nil || id <= 0 {
					http.Error(w, fmt.Sprintf("bad request: store ID %q", s), http.StatusBadRequest)
					return
				}
				ids = append(ids, id)
			}
			repair := c.ops.RetryParked
			if action == ActionDiscard {
				repair = c.ops.DiscardParked
			}
			var ch ops.Change
			ch, err = repair(ctx, ops.ParkedFilter{IDs: ids}, opt)
			past := map[string]string{ActionRetry: "retried", ActionDiscard: "discarded"}[action]
			flash = fmt.Sprintf("%d parked effect(s) %s", ch.Changed, past)
		}
		if err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		// A relative Location: the browser resolves it against the prefix the console is mounted under.
		w.Header().Set("Location", "./?flash="+url.QueryEscape(flash))
		w.WriteHeader(http.StatusSeeOther)
	}
}
