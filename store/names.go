package store

import (
	"fmt"
	"regexp"
)

var identRe = regexp.MustCompile(`^[a-z_][a-z0-9_]*$`)

// maxIdentLength keeps prefix + the longest table name within PostgreSQL's 63-byte identifiers.
const maxIdentLength = 40

// Names are the validated, quoted names of the outbox tables.
type Names struct {
	Schema       string // unquoted
	Prefix       string // unquoted
	Processed    string // quoted, schema-qualified
	Effects      string
	Dispatched   string
	Delayed      string
	Attempts     string
	Stats        string
	Audit        string
	Idempotency  string
	DeadLetters  string
	Migrations   string
	QuotedSchema string
}

// ValidateIdent checks a schema name or table prefix: it must match ^[a-z_][a-z0-9_]*$ and be at
// most 40 bytes, so that it can never carry SQL.
func ValidateIdent(kind, s string) error {
	if len(s) > maxIdentLength || !identRe.MatchString(s) {
		return fmt.Errorf("%s %q is not allowed: use lower-case letters, digits and '_', not starting with a digit, at most %d characters", kind, s, maxIdentLength)
	}
	return nil
}

// NewNames validates schema and prefix and returns the table names. An empty prefix is allowed.
func NewNames(schema, prefix string) (Names, error) {
	if err := ValidateIdent("schema", schema); err != nil {
		return Names{}, err
	}
	if prefix != "" {
		if err := ValidateIdent("table prefix", prefix); err != nil {
			return Names{}, err
		}
	}
	q := func(t string) string { return `"` + schema + `"."` + prefix + t + `"` }
	return Names{
		Schema:       schema,
		Prefix:       prefix,
		QuotedSchema: `"` + schema + `"`,
		Processed:    q("processed"),
		Effects:      q("effects"),
		Dispatched:   q("dispatched"),
		Delayed:      q("delayed"),
		Attempts:     q("attempts"),
		Stats:        q("stats"),
		Audit:        q("audit"),
		Idempotency:  q("idempotency"),
		DeadLetters:  q("dead_letters"),
		Migrations:   q("migrations"),
	}, nil
}
