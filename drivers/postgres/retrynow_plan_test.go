package postgres

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/watermill-outbox/outbox/outboxdriver"
)

// TestEffectRetryNowOnABacklog: a destination recovers behind a backlog of 100,000 pending
// effects, 2,000 of which back off for it. The look-up reads the pending effects (no index serves
// a topic: it runs once per destination that recovers, and an index would cost every effect
// insert), and the update goes by primary key, so that it locks only the rows it changes. One
// call makes at most its limit due, and the calls until none is left make each due once.
func TestEffectRetryNowOnABacklog(t *testing.T) {
	db, st, n, exec := planTables(t, "retry_")
	exec(`INSERT INTO ` + n.Effects + ` (source_consumer, source_id, seq, kind, topic, uuid, payload, metadata, ordering_key,
			created_at, failures, failed_at, next_attempt_at, backoff_until)
		SELECT 'c', 'm' || g, 0, '', CASE WHEN g % 50 = 0 THEN 'down' ELSE 't' || (g % 7) END, gen_random_uuid()::text,
			'\x00'::bytea, ''::bytea, 'k' || g, now(), 8, now(), now() + interval '1 minute',
			CASE WHEN g % 50 = 0 THEN now() + interval '1 minute' END
		FROM generate_series(1, 100000) g`)
	exec(`ANALYZE ` + n.Effects)
	q := Queries(n, false, nil)
	plan := strings.Join(queryLines(t, db, `EXPLAIN `+strings.ReplaceAll(q.EffectRetryNow, "$1", "'1,2,3'")), "\n")
	// The rows are in partition 0; partitions 1 and 2, empty and never analyzed, may be read
	// whole (no page).
	others := strings.NewReplacer("Seq Scan on retry_effects_1", "", "Seq Scan on retry_effects_2", "").Replace(plan)
	if !strings.Contains(plan, "Index Cond: (id = v.id)") || strings.Contains(others, "Seq Scan on retry_effects") {
		t.Errorf("EffectRetryNow does not update by primary key:\n%s", plan)
	}
	r := st.(outboxdriver.EffectRetrier)
	total := 0
	for i := 0; ; i++ {
		began := time.Now()
		got, err := r.EffectRetryNow(context.Background(), outboxdriver.KindPublish, "down", 1000)
		if err != nil {
			t.Fatal(err)
		}
		t.Logf("EffectRetryNow %d: %d effects due in %s", i, got, time.Since(began).Round(time.Microsecond))
		if got > 1000 {
			t.Fatalf("EffectRetryNow made %d due, more than its limit", got)
		}
		total += got
		if got == 0 {
			break
		}
	}
	if total != 2000 {
		t.Errorf("EffectRetryNow made %d effects due in all, want the 2,000 that backed off", total)
	}
}
