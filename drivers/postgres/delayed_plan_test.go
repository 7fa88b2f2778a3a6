package postgres

import (
	"strings"
	"testing"
)

// TestEffectInsertProbesDelayedByKey: the look-up of due delayed effects that every effect insert
// makes goes through the (ordering_key, due_at) index, with a custom and with a generic plan (pgx
// prepares the insert), on a delayed table of 20,000 effects waiting on 2,000 keys, and reads
// the claims (whether one still holds its effects inline) by their key: it costs the consumer
// path an index probe, not a read of what waits or of the claims.
func TestEffectInsertProbesDelayedByKey(t *testing.T) {
	db, _, n, exec := planTables(t, "plan_")
	exec(`INSERT INTO ` + n.Delayed + ` (source_consumer, source_id, seq, kind, topic, uuid, payload, metadata, ordering_key, due_at)
		SELECT 'c', 'm' || g, 0, 'publish', 't', gen_random_uuid()::text, '', '', 'k' || (g % 2000), now() + interval '1 hour'
		FROM generate_series(1, 20000) g`)
	exec(`INSERT INTO ` + n.Processed + ` (consumer, message_id, processed_at, dispatched_at, effects)
		SELECT 'c', 'm' || g, now(), now(), CASE WHEN g % 10 = 0 THEN '\x01'::bytea END FROM generate_series(1, 20000) g`)
	exec(`ANALYZE ` + n.Delayed)
	exec(`ANALYZE ` + n.Processed)
	for _, c := range []struct {
		mode    string
		claimed bool
	}{{"force_custom_plan", false}, {"force_generic_plan", false}, {"force_custom_plan", true}, {"force_generic_plan", true}} {
		mode, insert := c.mode, Queries(n, false, nil).EffectInsertKeyed(2, c.claimed)
		exec(`SET plan_cache_mode = ` + mode)
		exec(`PREPARE plan_stmt(text, text, integer, text, text, text, bytea, bytea, text, integer, text, text, text, bytea, bytea, text) AS ` + insert)
		plan := queryLines(t, db, `EXPLAIN EXECUTE plan_stmt('c', 'x', 0, 'publish', 't', 'u1', '', '', 'k7', 1, 'publish', 't', 'u2', '', '', 'k8')`)
		exec(`DEALLOCATE plan_stmt`)
		text := strings.Join(plan, "\n")
		if strings.Contains(text, "Seq Scan on plan_delayed") || strings.Contains(text, "Seq Scan on plan_processed") ||
			!strings.Contains(text, "plan_delayed_key") {
			t.Errorf("the effect insert (%s) does not look for due delayed effects by key:\n%s", mode, text)
		}
	}
}
