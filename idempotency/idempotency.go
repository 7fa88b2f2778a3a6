package idempotency

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"unicode/utf8"

	"github.com/watermill-outbox/outbox"
)

// DefaultHeader is the request header that carries the key.
const DefaultHeader = "Idempotency-Key"

// ReplayedHeader is set to "true" on a response replayed from a stored one.
const ReplayedHeader = "Idempotent-Replayed"

// Config configures the middleware.
type Config struct {
	// Outbox runs the units of work. Required.
	Outbox *outbox.Outbox
	// Caller returns who sent a keyed request: the authenticated principal, the API client or
	// the account your authentication middleware put in the request's context. Keys belong to
	// their caller: two callers who send the same key (and the same request) each get their own
	// run and their own response, and a caller can neither read another's stored response nor
	// learn whether another's key is in use. A keyed request whose caller is "" (not identified)
	// gets 401 Unauthorized without running. Required, unless UnsafeSharedKeys is set.
	Caller func(r *http.Request) string
	// UnsafeSharedKeys puts every caller's keys in one key space: a caller who sends another's
	// key and request gets that caller's stored response. Only for a service whose callers all
	// trust each other (one internal client). Default: false (Caller is required).
	UnsafeSharedKeys bool
	// Header is the request header that carries the key. Default: DefaultHeader.
	Header string
	// Scope returns a further scope of a request's key within its caller's (an API, an
	// endpoint): keys are unique per caller and scope. Default: "http" for every request.
	Scope func(r *http.Request) string
	// Methods are the methods whose requests run in a unit of work, keyed when the header is
	// set. Others pass through untouched. Default: POST and PATCH.
	Methods []string
	// Required makes a request of Methods without the header fail with 400 Bad Request.
	// Default: false (it runs in a unit of work without a key).
	Required bool
	// StoredHeaders are the response headers stored with the status and body and returned to a
	// retry. Default: Content-Type, Content-Language, Location, ETag, Last-Modified.
	// Content-Encoding is stored whatever the list says: the body is stored as it was encoded.
	// Set-Cookie, Date, Content-Length and the hop-by-hop headers are refused: they belong to
	// one response (a session, a moment, a connection), not to its replays.
	StoredHeaders []string
	// MaxResponseBytes bounds the response body stored with a key (and buffered until the commit).
	// A handler that writes more is rolled back and the client gets 500 Internal Server Error
	// saying so. Default: 1 MiB; it must leave 8 KiB of the Outbox's MaxPayloadBytes for the
	// stored status and headers (New refuses more), since the response is stored as one result.
	MaxResponseBytes int
	// MaxRequestBytes bounds the request body read to fingerprint a keyed request; a larger one
	// gets 413 Content Too Large without running. Default: 1 MiB.
	MaxRequestBytes int64
	// Fingerprint returns the fingerprint of a keyed request, body its body. A key sent again
	// with another fingerprint gets 422 Unprocessable Content. Default: SHA-256 of the method,
	// the path and query, and the body.
	Fingerprint func(r *http.Request, body []byte) []byte
	// Wait makes a retry that comes while the first request with its key still runs wait for
	// its outcome (up to the Outbox's HandlerTimeout, or until the client goes) and get its
	// response. Default: false (409 Conflict at once, as the draft specifies).
	Wait bool
	// Commit tells whether a response with status commits the unit of work (and is stored with
	// the key). Default: DefaultCommit (below 500, except 401, 403 and 429): a server error
	// rolls back, and a retry runs again; so does a refusal that the client can mend (renewed
	// credentials, a rate limit waited out), which would otherwise be replayed for the key's
	// whole retention.
	Commit func(status int) bool
	// OnError, when set, is told of the errors that end a request with 500 (a failed commit, a
	// response too large to store).
	OnError func(r *http.Request, err error)
}

func (c *Config) setDefaults() {
	if c.Header == "" {
		c.Header = DefaultHeader
	}
	if c.Scope == nil {
		c.Scope = func(*http.Request) string { return "http" }
	}
	if len(c.Methods) == 0 {
		c.Methods = []string{http.MethodPost, http.MethodPatch}
	}
	if c.StoredHeaders == nil {
		c.StoredHeaders = []string{"Content-Type", "Content-Language", "Location", "ETag", "Last-Modified"}
	}
	if c.MaxResponseBytes == 0 {
		c.MaxResponseBytes = defaultMaxResponseBytes
	}
	if c.MaxRequestBytes == 0 {
		c.MaxRequestBytes = 1 << 20
	}
	if c.Fingerprint == nil {
		c.Fingerprint = DefaultFingerprint
	}
	if c.Commit == nil {
		c.Commit = DefaultCommit
	}
}

// Validate returns an error for a configuration the middleware cannot run with.
func (c Config) Validate() error {
	var errs []error
	if c.Outbox == nil {
		errs = append(errs, errors.New("Outbox is required"))
	}
	switch {
	case c.Caller == nil && !c.UnsafeSharedKeys:
		errs = append(errs, errors.New("Caller is required: keys belong to their caller (the authenticated principal or API client), "+
			"or another caller who sends the same key gets the first caller's stored response; "+
			"set UnsafeSharedKeys instead only when every caller of the service trusts every other"))
	case c.Caller != nil && c.UnsafeSharedKeys:
		errs = append(errs, errors.New("Caller and UnsafeSharedKeys exclude each other"))
	}
	if c.MaxResponseBytes < 0 || c.MaxRequestBytes < 0 {
		errs = append(errs, errors.New("MaxResponseBytes and MaxRequestBytes must not be negative"))
	}
	for _, h := range c.StoredHeaders {
		switch http.CanonicalHeaderKey(h) {
		case "Set-Cookie", "Date", "Content-Length", "Transfer-Encoding", "Connection", "Keep-Alive", "Trailer",
			"Upgrade", "Te", "Proxy-Authenticate", "Proxy-Connection":
			errs = append(errs, fmt.Errorf("StoredHeaders must not name %s: it belongs to one response, not to its replays", h))
		}
	}
	errs = append(errs, c.checkStoredRoom())
	return errors.Join(errs...)
}

// DefaultCommit commits a response with a status below 500, except 401 Unauthorized, 403
// Forbidden and 429 Too Many Requests: a refusal the client can mend (new credentials, a rate
// limit waited out) rolls back and is not stored, so that the retry runs.
func DefaultCommit(status int) bool {
	switch status {
	case http.StatusUnauthorized, http.StatusForbidden, http.StatusTooManyRequests:
		return false
	}
	return status < 500
}

// DefaultFingerprint is the SHA-256 of the request's method, path and query, and body, each
// prefixed with its length.
func DefaultFingerprint(r *http.Request, body []byte) []byte {
	h := sha256.New()
	for _, part := range [][]byte{[]byte(r.Method), []byte(r.URL.RequestURI()), body} {
		var n [8]byte
		binary.BigEndian.PutUint64(n[:], uint64(len(part)))
		h.Write(n[:])
		h.Write(part)
	}
	return h.Sum(nil)
}

// New returns the middleware. The wrapped handler of a request of Config.Methods runs inside a
// unit of work of Config.Outbox: it writes through outbox.Tx(r.Context()) (outboxpgx.Tx with the
// pgx form) and records side effects with outbox.Publish, and must not call InTx itself. Its
// response is buffered and sent once the unit committed (a response of a unit that could not
// commit is never sent: the client gets 500).
func New(cfg Config) (func(http.Handler) http.Handler, error) {
	cfg.setDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, fmt.Errorf("idempotency: %w", err)
	}
	return func(next http.Handler) http.Handler {
		return &middleware{cfg: cfg, next: next}
	}, nil
}

type middleware struct {
	cfg  Config
	next http.Handler
}

// stored is a response as it is stored with its key.
type stored struct {
	Status int         `json:"status"`
	Header http.Header `json:"header,omitempty"`
	Body   []byte      `json:"body,omitempty"`
}

// errTooLarge is returned by the unit of work whose response exceeded MaxResponseBytes.
var errTooLarge = errors.New("idempotency: response too large to store")

// notCommitted carries a response that Config.Commit refused: the unit rolled back.
type notCommitted struct{ status int }

func (e *notCommitted) Error() string {
	return "idempotency: response status " + strconv.Itoa(e.status) + " rolls the unit of work back"
}

func (m *middleware) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if !slices.Contains(m.cfg.Methods, r.Method) {
		m.next.ServeHTTP(w, r)
		return
	}
	ctx := r.Context()
	values, keyed := r.Header[http.CanonicalHeaderKey(m.cfg.Header)]
	var key, caller string
	if keyed && len(values) == 1 {
		key = parseKey(values[0])
	}
	if keyed && key != "" && m.cfg.Caller != nil {
		caller = m.cfg.Caller(r)
	}
	switch {
	case !keyed && m.cfg.Required:
		problem(w, http.StatusBadRequest, "Idempotency key required", "This request needs an "+m.cfg.Header+" header.")
		return
	case keyed && key == "":
		problem(w, http.StatusBadRequest, "Invalid idempotency key",
			"The "+m.cfg.Header+" header must appear once, with 1 to 255 printable characters, as they are or as a quoted string.")
		return
	case keyed && caller == "" && !m.cfg.UnsafeSharedKeys:
		// Keys belong to their caller: without one the key would be nobody's, or everybody's.
		problem(w, http.StatusUnauthorized, "Caller not identified",
			"A request with an "+m.cfg.Header+" header must come from an identified caller.")
		return
	case keyed:
		body, err := io.ReadAll(io.LimitReader(r.Body, m.cfg.MaxRequestBytes+1))
		if err != nil {
			problem(w, http.StatusBadRequest, "Unreadable request body", err.Error())
			return
		}
		if int64(len(body)) > m.cfg.MaxRequestBytes {
			problem(w, http.StatusRequestEntityTooLarge, "Request too large",
				fmt.Sprintf("A request with an idempotency key may carry at most %d bytes.", m.cfg.MaxRequestBytes))
			return
		}
		r.Body = io.NopCloser(bytes.NewReader(body))
		opts := []outbox.KeyOption{outbox.Fingerprint(m.cfg.Fingerprint(r, body))}
		if m.cfg.Wait {
			opts = append(opts, outbox.WaitInFlight())
		}
		scope := m.cfg.Scope(r)
		if !m.cfg.UnsafeSharedKeys {
			scope = outbox.CallerScope(caller, scope)
		}
		ctx = outbox.WithIdempotencyKey(ctx, scope, key, opts...)
	}

	// The handler sees (and may change or delete) the headers set outside this middleware: a
	// CORS middleware's Vary, a default Cache-Control.
	rec := &recorder{header: w.Header().Clone(), limit: m.cfg.MaxResponseBytes}
	err := m.cfg.Outbox.InUnit(ctx, func(ctx context.Context) error {
		m.next.ServeHTTP(rec, r.WithContext(ctx))
		if rec.overflow {
			return fmt.Errorf("%w: the handler wrote more than %d bytes (Config.MaxResponseBytes)", errTooLarge, m.cfg.MaxResponseBytes)
		}
		if !m.cfg.Commit(rec.code()) {
			return &notCommitted{status: rec.code()}
		}
		if !keyed {
			return nil
		}
		resp, err := encodeStored(stored{Status: rec.code(), Header: pick(rec.header, m.cfg.StoredHeaders, "Content-Encoding"), Body: rec.body.Bytes()})
		if err != nil {
			return err
		}
		return outbox.SetResult(ctx, resp)
	})
	var nc *notCommitted
	switch {
	case err == nil:
	case errors.As(err, &nc):
		rec.send(w, false) // the handler's own error response, not stored
		return
	case rec.written && rec.code() >= 400 && rec.code() < 500 && abortedByAStatement(err):
		// The handler answered a statement that failed (a unique violation answered 409,
		// without a savepoint): on PostgreSQL that aborted the transaction, so nothing commits,
		// the key included. Its answer is still the request's, not 500: sent, not stored (a
		// retry runs again). Not a success: a handler that swallowed the failure and answered
		// 2xx gets 500, since nothing it did committed.
		rec.send(w, false)
		return
	case errors.Is(err, outbox.ErrIdempotencyInFlight):
		w.Header().Set("Retry-After", "1")
		problem(w, http.StatusConflict, "Request in progress",
			"A request with this idempotency key is still being processed; retry later.")
		return
	case errors.Is(err, outbox.ErrIdempotencyMismatch):
		problem(w, http.StatusUnprocessableEntity, "Idempotency key reused",
			"This idempotency key was used for a different request.")
		return
	case errors.Is(err, outbox.ErrInvalidIdempotencyKey):
		problem(w, http.StatusBadRequest, "Invalid idempotency key", err.Error())
		return
	case errors.Is(err, outbox.ErrCommitOutcomeUnknown):
		m.failed(r, err)
		detail := "The connection to the database was lost while the request was committed: it may or may not have taken effect."
		if keyed {
			detail += " Retry with the same " + m.cfg.Header + " to find out: it gets this request's response if it took effect, and runs once if it did not."
		}
		problem(w, http.StatusInternalServerError, "Request outcome unknown", detail)
		return
	case errors.Is(err, errTooLarge):
		m.failed(r, err)
		problem(w, http.StatusInternalServerError, "Response too large to store",
			fmt.Sprintf("The response exceeded the %d bytes stored with an idempotency key; nothing was done.", m.cfg.MaxResponseBytes))
		return
	default:
		m.failed(r, err)
		problem(w, http.StatusInternalServerError, "Request failed", "The request could not be completed; nothing was done.")
		return
	}
	if !keyed {
		rec.send(w, false)
		return
	}
	res, replayed := outbox.IdempotencyResult(ctx)
	if !replayed {
		rec.send(w, false)
		return
	}
	s, err := decodeStored(res)
	if err != nil {
		m.failed(r, fmt.Errorf("idempotency: the stored response of key %q is unreadable: %w", key, err))
		problem(w, http.StatusInternalServerError, "Stored response unreadable", "The response stored with this idempotency key cannot be read.")
		return
	}
	(&recorder{header: s.Header, status: s.Status, body: *bytes.NewBuffer(s.Body)}).send(w, true)
}

// abortedByAStatement tells an error of a unit whose transaction a failed statement had aborted
// (PostgreSQL: 25P02 at the next statement, or a COMMIT turned into a ROLLBACK, 40000), by the
// SQLSTATE lib/pq's and pgx's errors carry.
func abortedByAStatement(err error) bool {
	var st interface{ SQLState() string }
	if !errors.As(err, &st) {
		return false
	}
	switch st.SQLState() {
	case "25P02", "40000":
		return true
	}
	return false
}

func (m *middleware) failed(r *http.Request, err error) {
	if m.cfg.OnError != nil {
		m.cfg.OnError(r, err)
	}
}

// parseKey returns the key a header value carries, or "" for a value that carries none. The
// draft defines the value as a structured-field string (RFC 8941: "...", with \" and \\ the only
// escapes, parameters after it ignored); clients that send the key bare are as common, so both
// forms name the same key: `"k-1"` is k-1.
func parseKey(v string) string {
	if !strings.HasPrefix(v, `"`) {
		if validKey(v) {
			return v
		}
		return ""
	}
	var b strings.Builder
	for i := 1; i < len(v); i++ {
		switch c := v[i]; {
		case c == '\\':
			if i+1 == len(v) || v[i+1] != '"' && v[i+1] != '\\' {
				return ""
			}
			i++
			b.WriteByte(v[i])
		case c == '"':
			if rest := v[i+1:]; rest != "" && rest[0] != ';' {
				return ""
			}
			if k := b.String(); validKey(k) {
				return k
			}
			return ""
		default:
			b.WriteByte(c)
		}
	}
	return "" // no closing quote
}

// validKey accepts 1 to 255 bytes of printable ASCII, as the draft's sf-string allows.
func validKey(k string) bool {
	if k == "" || len(k) > 255 || !utf8.ValidString(k) {
		return false
	}
	for i := 0; i < len(k); i++ {
		if k[i] < 0x20 || k[i] > 0x7e {
			return false
		}
	}
	return true
}

func pick(h http.Header, names []string, always ...string) http.Header {
	out := http.Header{}
	for _, n := range slices.Concat(names, always) {
		if v := h.Values(n); len(v) > 0 {
			out[http.CanonicalHeaderKey(n)] = slices.Clone(v)
		}
	}
	return out
}

// problem writes an RFC 9457 problem details response.
func problem(w http.ResponseWriter, status int, title, detail string) {
	body, _ := json.Marshal(map[string]any{"type": "about:blank", "title": title, "status": status, "detail": detail})
	w.Header().Set("Content-Type", "application/problem+json")
	w.WriteHeader(status)
	_, _ = w.Write(body)
}

// recorder buffers a response until the unit of work's outcome is known.
type recorder struct {
	header  http.Header
	status  int
	body    bytes.Buffer
	limit   int
	written bool
	// overflow: the handler wrote more than limit bytes; what it wrote past it was dropped.
	overflow bool
}

func (r *recorder) Header() http.Header { return r.header }

// WriteHeader records the response's status. An informational one (1xx: 103 Early Hints, say)
// is not the response's: taken for it, a handler that then failed with 500 had its unit
// committed and its response stored (and replayed) as a success.
func (r *recorder) WriteHeader(status int) {
	if status < 100 || status > 999 {
		// As net/http's ResponseWriter does, in the handler: the unit rolls back. Recorded, it
		// committed, and net/http panicked as the response (and every replay of it) was sent.
		panic(fmt.Sprintf("invalid WriteHeader code %v", status))
	}
	if status >= 100 && status < 200 {
		return
	}
	if !r.written {
		r.status, r.written = status, true
	}
}

func (r *recorder) Write(p []byte) (int, error) {
	r.WriteHeader(http.StatusOK)
	if r.body.Len()+len(p) > r.limit {
		r.overflow = true
		return 0, errTooLarge
	}
	return r.body.Write(p)
}

func (r *recorder) code() int {
	if r.status == 0 {
		return http.StatusOK
	}
	return r.status
}

// send writes the response: the handler's headers are the response's (they began as the outer
// ones), a replay's stored ones are added to those set outside the middleware.
func (r *recorder) send(w http.ResponseWriter, replayed bool) {
	if !replayed {
		clear(w.Header())
	}
	for k, v := range r.header {
		w.Header()[k] = v
	}
	if replayed {
		w.Header().Set(ReplayedHeader, "true")
	}
	w.WriteHeader(r.code())
	_, _ = w.Write(r.body.Bytes())
}
