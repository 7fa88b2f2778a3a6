package pgtest

import (
	"regexp"
	"strings"
	"testing"
)

// partition0 matches the effects table under its own name: on PostgreSQL that is partition 0 of
// the partitioned parent outbox_effects_all (migration 023), which holds only what the previous
// version and generation 0 wrote. A count of it looks like a count of the effects and passes with
// effects waiting in partitions 1 and 2.
var partition0 = regexp.MustCompile(`(?i)\boutbox_effects\b`)

// Partition0OptIn is the SQL comment a statement carries when it names partition 0 on purpose
// (the rolling-upgrade tests, a loop over the partitions).
const Partition0OptIn = "/* partition 0 */"

// NamesPartition0 tells whether the PostgreSQL statement query names outbox_effects, partition 0
// of the effects table, without Partition0OptIn.
func NamesPartition0(query string) bool {
	return partition0.MatchString(query) && !strings.Contains(query, Partition0OptIn)
}

// CheckEffectsParent fails tb when the PostgreSQL statement query names partition 0 of the
// effects table where the test means the effects (outbox_effects_all). The test helpers that send
// SQL call it, so that a statement written for the plain table of earlier versions fails at once
// rather than see part of the effects.
func CheckEffectsParent(tb testing.TB, query string) {
	tb.Helper()
	if NamesPartition0(query) {
		// Errorf, not Fatalf: the helpers also run on goroutines of their own.
		tb.Errorf("the statement names outbox_effects, partition 0 of the effects table: read outbox_effects_all, "+
			"or mark it %s when the test means partition 0:\n%s", Partition0OptIn, query)
	}
}
