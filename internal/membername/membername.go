// Package membername is the rule for the names of a tenant.Set's members, which the console and
// the metrics, logs and health reports carry.
package membername

import (
	"unicode"
	"unicode/utf8"
)

// MaxLen is the longest name, in bytes.
const MaxLen = 200

// Check returns why name is not a member name, or "" when it is: 1 to MaxLen bytes of UTF-8,
// without control characters, bidirectional controls (an override makes a name read as another
// in a log, a terminal or a page), line or paragraph separators, or '/'.
func Check(name string) string {
	if name == "" || len(name) > MaxLen || !utf8.ValidString(name) {
		return "1 to 200 bytes of UTF-8"
	}
	for _, r := range name {
		if unicode.IsControl(r) || unicode.Is(unicode.Bidi_Control, r) || r == '\u2028' || r == '\u2029' || r == '/' {
			return "no control characters, bidirectional controls, line separators or '/'"
		}
	}
	return ""
}
