package outboxdriver

import "strings"

// MaxTextBytes bounds the free text the framework stores or sends about a failure or a change:
// a failure reason, a poison message's reason, an audit entry's fields.
const MaxTextBytes = 4096

// StorableText makes text from anywhere (an error of a handler, a broker or an applier, an
// operator's input) storable in a text column of any dialect and readable in logs and metadata:
// valid UTF-8, NUL escaped (PostgreSQL rejects both in text), at most MaxTextBytes, "..." marking
// a cut. A reason that could not be stored must not fail the write it belongs to (a relay round
// would otherwise roll back and re-send its successes every round).
func StorableText(s string) string {
	s = strings.ToValidUTF8(s, "\uFFFD")
	s = strings.ReplaceAll(s, "\x00", `\x00`)
	if len(s) > MaxTextBytes {
		s = strings.ToValidUTF8(s[:MaxTextBytes], "") + "..."
	}
	return s
}
