package postgres

import (
	"context"
	"strconv"
	"testing"
	"time"

	"github.com/watermill-outbox/outbox/outboxdriver"
)

// BenchmarkCleanupThroughRetention times a cleanup pass on a claim table that has been through
// its retention (new claims fill the pages cleanup freed): 200,000 claims retained, each
// iteration 10,000 new claims and a pass that deletes the 10,000 oldest, in batches of 1,000.
// "brin-join" is cleanup before migration 016 (a BRIN index on processed_at, a batch deleted by a
// join on the key), "btree-ordered" today's (Store.Cleanup); run with -count to alternate them:
//
//	cd drivers/postgres && go test -run '^$' -bench CleanupThroughRetention -benchtime 5x -count 3
func BenchmarkCleanupThroughRetention(b *testing.B) {
	const live, step, batch = 200_000, 10_000, 1000
	ctx := context.Background()
	for _, variant := range []string{"brin-join", "btree-ordered"} {
		b.Run(variant, func(b *testing.B) {
			prefix := "cleanbench_" + variant[:4] + "_"
			db, st, n, exec := planTables(b, prefix)
			exec(`TRUNCATE ` + n.Processed)
			if variant == "brin-join" {
				exec(`DROP INDEX IF EXISTS ` + prefix + `processed_time`)
				exec(`CREATE INDEX IF NOT EXISTS ` + prefix + `processed_processed_at ON ` + n.Processed + ` USING brin (processed_at)`)
			}
			q := queries(n, false, new(Generation))
			// Claim g was processed and dispatched at base + g seconds.
			base := time.Date(2025, 1, 1, 0, 0, 0, 0, time.UTC)
			total := 0
			add := func(k int) {
				exec(`INSERT INTO ` + n.Processed + ` (consumer, message_id, processed_at, dispatched_at)
					SELECT 'c', gen_random_uuid()::text, t, t FROM (SELECT '` + base.Format(time.RFC3339) + `'::timestamptz + g * interval '1 s' AS t
					FROM generate_series(` + strconv.Itoa(total+1) + `, ` + strconv.Itoa(total+k) + `) g) s`)
				total += k
			}
			// The retention that leaves the newest live claims.
			retention := func() time.Duration {
				return time.Since(base.Add(time.Duration(total-live)*time.Second + 500*time.Millisecond))
			}
			clean := func() int64 {
				if variant == "btree-ordered" {
					res, err := st.Cleanup(ctx, outboxdriver.CleanupParams{Retention: retention(), BatchSize: batch})
					if err != nil {
						b.Fatal(err)
					}
					return res.Claims
				}
				old := `DELETE FROM ` + n.Processed + ` WHERE (consumer, message_id) IN (SELECT consumer, message_id FROM ` + n.Processed + ` p
					WHERE p.processed_at < now() - $1 * interval '1 ms' AND p.dispatched_at < now() - $1 * interval '1 ms' AND p.effects IS NULL
					  AND NOT EXISTS (SELECT 1 FROM ` + n.Effects + ` e
						WHERE e.source_consumer = p.consumer AND e.source_id = p.message_id AND e.dispatched_at IS NULL) LIMIT $2)`
				var deleted int64
				for {
					tx, err := db.BeginTx(ctx, nil)
					if err != nil {
						b.Fatal(err)
					}
					if _, err := tx.ExecContext(ctx, q.CleanupBegin); err != nil {
						b.Fatal(err)
					}
					r, err := tx.ExecContext(ctx, old, retention().Milliseconds(), batch)
					if err != nil {
						b.Fatal(err)
					}
					k, _ := r.RowsAffected()
					if err := tx.Commit(); err != nil {
						b.Fatal(err)
					}
					deleted += k
					if k < batch {
						return deleted
					}
				}
			}
			add(live)
			exec(`VACUUM ANALYZE ` + n.Processed)
			// Once through the retention: every page freed once and filled again.
			for range live / step {
				add(step)
				clean()
				exec(`VACUUM ` + n.Processed) // as autovacuum would between passes
			}
			b.ResetTimer()
			for range b.N {
				b.StopTimer()
				add(step)
				exec(`VACUUM ` + n.Processed)
				b.StartTimer()
				if d := clean(); d != step {
					b.Fatalf("a pass deleted %d claims, want %d", d, step)
				}
			}
		})
	}
}
