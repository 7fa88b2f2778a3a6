package main

import (
	"testing"

	"github.com/watermill-outbox/outbox/drivers/postgres"
)

// TestXminClassesMatchTheDriversStatements classifies the PostgreSQL driver's own statements as
// the held-xmin run does: a statement whose text changed so that its class no longer matches
// would drop out of the run's table without a word.
func TestXminClassesMatchTheDriversStatements(t *testing.T) {
	n, err := postgres.NewNames("public", "intx_")
	if err != nil {
		t.Fatal(err)
	}
	q := postgres.Queries(n, true, nil)
	for _, c := range []struct{ query, want string }{
		{q.EffectClaimDue, "relay claim"},
		{q.EffectMarkDispatched(false), "mark"},
		{q.CleanupClaimsFrom, "cleanup batch"},
		{q.CleanupEffectsFrom, "cleanup batch"},
		{q.StatsSample, "stats sample"},
		{q.StatsSampleFull, "stats sample"},
		{q.MessageClaim, ""},
		{postgres.MessageClaimMarking(n), "mark"},
		{`TRUNCATE "public"."intx_effects_1"`, "rotation"},
		{`SELECT r.gen, r.rotated_at < now() FROM "public"."intx_effects_rotation" r`, "rotation"},
		{`UPDATE "public"."intx_processed" p SET effects = NULL WHERE (p.consumer, p.message_id) IN (SELECT $1, unnest($2::text[]))`, "mark"},
		{`WITH m AS (DELETE FROM "public"."intx_effects_1" RETURNING id) INSERT INTO "public"."intx_effects_2" SELECT * FROM m`, "rotation"},
		{`SELECT min(inline_xid) FROM "public"."intx_processed" WHERE inline_xid >= $1 AND effects IS NOT NULL`, "sweep"},
	} {
		got := ""
		for _, cl := range xminClasses {
			if cl.re.MatchString(c.query) {
				got = cl.Name
				break
			}
		}
		if got != c.want {
			t.Errorf("class %q, want %q, of %.120s", got, c.want, c.query)
		}
	}
}
