package postgres

import (
	"net/url"
	"regexp"
	"strconv"
	"strings"
)

// kvPasswordRe finds the password of a key=value connection string, quoted or not.
var kvPasswordRe = regexp.MustCompile(`(?i)\bpassword\s*=\s*('((?:[^'\\]|\\.)*)'|\S+)`)

// dsnSecrets returns the password of dsn in the forms an error message may show it: as written,
// unescaped, and quoted as %q quotes it. A URL that does not parse is looked at by hand: its
// user information ends at the last '@'.
func dsnSecrets(dsn string) []string {
	var raw []string
	if i := strings.Index(dsn, "://"); i >= 0 {
		rest := dsn[i+3:]
		if at := strings.LastIndex(rest, "@"); at >= 0 {
			if c := strings.Index(rest[:at], ":"); c >= 0 {
				raw = append(raw, rest[c+1:at])
			}
		}
		if q := strings.Index(rest, "?"); q >= 0 {
			for _, kv := range strings.Split(rest[q+1:], "&") {
				if k, v, ok := strings.Cut(kv, "="); ok && strings.EqualFold(k, "password") {
					raw = append(raw, v)
				}
			}
		}
	}
	for _, m := range kvPasswordRe.FindAllStringSubmatch(dsn, -1) {
		if m[2] != "" {
			raw = append(raw, m[2])
		} else {
			raw = append(raw, strings.Trim(m[1], "'"))
		}
	}
	var out []string
	for _, s := range raw {
		if s == "" {
			continue
		}
		out = append(out, s, strings.Trim(strconv.Quote(s), `"`))
		if u, err := url.PathUnescape(s); err == nil && u != s {
			out = append(out, u, strings.Trim(strconv.Quote(u), `"`))
		}
		if u, err := url.QueryUnescape(s); err == nil && u != s {
			out = append(out, u)
		}
	}
	return out
}

// RedactDSN replaces the password of dsn in text (an error message, a log line) with "xxxxx",
// in whatever form the text shows it. Use it on anything printed that a connection error may
// have reached: lib/pq puts the whole URL in the error when it does not parse.
func RedactDSN(text, dsn string) string {
	for _, s := range dsnSecrets(dsn) {
		text = strings.ReplaceAll(text, s, "xxxxx")
	}
	// net/url quotes the malformed escape, which may be a piece of the password.
	return urlEscapeRe.ReplaceAllString(text, "invalid URL escape")
}

var urlEscapeRe = regexp.MustCompile(`invalid URL escape "[^"]*"`)

// redactedError is err with the password of a DSN taken out of its message.
type redactedError struct {
	err error
	msg string
}

func (e redactedError) Error() string { return e.msg }
func (e redactedError) Unwrap() error { return e.err }

// redactErr returns err with the password of dsn taken out of its message (nil for nil).
func redactErr(err error, dsn string) error {
	if err == nil {
		return nil
	}
	if msg := RedactDSN(err.Error(), dsn); msg != err.Error() {
		return redactedError{err, msg}
	}
	return err
}
