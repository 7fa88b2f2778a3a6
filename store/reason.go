package store

import "strings"

// maxReasonBytes bounds a failure reason stored as text.
const maxReasonBytes = 4096

// storableReason makes an error text storable in a text column of any dialect: valid UTF-8, no
// NUL (PostgreSQL rejects both in text), at most maxReasonBytes. Every reason the store writes
// goes through it, whoever the caller: errors come from handlers, brokers and appliers and may
// carry anything, and one that cannot be stored must not fail the write it belongs to (a relay
// round would otherwise roll back and re-send its successes every round).
func storableReason(s string) string {
	s = strings.ToValidUTF8(s, "\uFFFD")
	s = strings.ReplaceAll(s, "\x00", `\x00`)
	if len(s) > maxReasonBytes {
		s = strings.ToValidUTF8(s[:maxReasonBytes], "") + "..."
	}
	return s
}
