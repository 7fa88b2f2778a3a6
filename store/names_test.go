package store

import (
	"strings"
	"testing"
)

func TestIdentRules(t *testing.T) {
	for _, ok := range []string{"public", "_x", "a1_", strings.Repeat("a", 40)} {
		if err := ValidateIdent("schema", ok); err != nil {
			t.Errorf("%q: %v", ok, err)
		}
	}
	for _, bad := range []string{"", "1a", "A", "a-b", "a b", `a"b`, strings.Repeat("a", 41)} {
		err := ValidateIdent("table prefix", bad)
		if err == nil {
			t.Errorf("%q accepted", bad)
			continue
		}
		// The message must not read as if '_' could not come first: only a digit cannot.
		if !strings.Contains(err.Error(), "not starting with a digit") {
			t.Errorf("%q: %v", bad, err)
		}
	}
}
