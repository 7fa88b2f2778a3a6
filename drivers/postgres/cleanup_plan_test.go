package postgres

import (
	"context"
	"database/sql"
	"encoding/json"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/watermill-outbox/outbox/internal/pgtest"
	"github.com/watermill-outbox/outbox/outboxdriver"
)

// TestCleanupReadsWhatItDeletes: a batch of cleanup reads the expired claims it deletes, not the
// table around them, both on a table whose earlier batches deleted the claims before them and on
// one that has been through its retention once (new claims in the pages the last cleanup freed).
// Found through a BRIN index on processed_at, a batch read every page range whose summary said
// it might hold an expired claim, and a summary never shrinks: the ranges an earlier batch had
// emptied were read again by every later batch of the pass (the fortieth batch read forty times
// the first's pages), and once new claims filled the freed pages every range held "an expired
// claim" (its summary spanned the oldest claim it ever held to now) and a batch read the table from
// its first page until it had found its thousand.
func TestCleanupReadsWhatItDeletes(t *testing.T) {
	db, _, n, exec := planTables(t, "cleanplan_")
	q := queries(n, false, new(Generation))
	const limit = 1000
	retention := strconv.Itoa(24 * 3600 * 1000) // a day, in ms
	claims := func(from, to int, age string) { insertClaims(n.Processed, exec, from, to, age) }
	// pass runs cleanup batches of stmt (on table, from column) as Store.Cleanup does (each its
	// own transaction, each from where the one before got to), each through EXPLAIN ANALYZE,
	// until one deletes fewer than limit, and returns what the scan of the expired rows read in
	// each.
	pass := func(stmt, table, column string) []scanRead {
		var reads []scanRead
		from := "NULL"
		for {
			tx, err := db.Begin()
			if err != nil {
				t.Fatal(err)
			}
			for _, s := range []string{q.CleanupFromBegin, `PREPARE cleanup_stmt AS ` + stmt} {
				if _, err := tx.Exec(s); err != nil {
					t.Fatalf("%s: %v", s, err)
				}
			}
			// EXPLAIN does not return the statement's rows: where the batch gets to is read first.
			var next sql.NullString
			if err := tx.QueryRow(`SELECT max(` + column + `)::text FROM (SELECT ` + column + ` FROM ` + table + `
				WHERE ` + column + ` < now() - interval '1 day' AND ` + column + ` >= coalesce(` + from + `::timestamptz, '-infinity')
				ORDER BY ` + column + ` LIMIT ` + strconv.Itoa(limit) + `) s`).Scan(&next); err != nil {
				t.Fatal(err)
			}
			plan := strings.Join(queryLines(t, tx, `EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) EXECUTE cleanup_stmt(`+retention+`, `+strconv.Itoa(limit)+`, `+from+`)`), "\n")
			if _, err := tx.Exec(`DEALLOCATE cleanup_stmt`); err != nil {
				t.Fatal(err)
			}
			if err := tx.Commit(); err != nil {
				t.Fatal(err)
			}
			if next.Valid {
				from = "'" + next.String + "'"
			}
			r := expiredScan(t, plan, column)
			reads = append(reads, r)
			if r.rows < limit {
				return reads
			}
		}
	}

	t.Run("batch after batch", func(t *testing.T) {
		exec(`TRUNCATE ` + n.Processed)
		claims(1, 40_000, `interval '30 days' + g * interval '1 ms'`)
		claims(1, 5_000, `interval '1 minute'`)
		exec(`VACUUM ANALYZE ` + n.Processed)
		reads := pass(q.CleanupClaimsFrom, n.Processed, "processed_at")
		if len(reads) < 40 {
			t.Fatalf("%d batches, want 41", len(reads))
		}
		first, last := reads[0], reads[len(reads)-2] // the last full batch
		t.Logf("buffers read by the scan: first batch %d, last full batch %d", first.buffers, last.buffers)
		if last.buffers > 3*first.buffers+30 {
			t.Errorf("the last full batch's scan read %d buffers, the first's %d: each batch reads again what the batches before it emptied", last.buffers, first.buffers)
		}
	})

	t.Run("a table through its retention", func(t *testing.T) {
		throughRetention(n.Processed, exec)
		reads := pass(q.CleanupClaimsFrom, n.Processed, "processed_at")
		examined, deleted := totals(reads)
		t.Logf("%d batches examined %d claims to delete %d", len(reads), examined, deleted)
		if deleted != 10_000 {
			t.Errorf("deleted %d claims, want 10000", deleted)
		}
		if examined > 2*deleted {
			t.Errorf("the scans examined %d claims to delete %d: a batch reads the table, not the expired claims", examined, deleted)
		}
	})

	t.Run("the archive through its retention", func(t *testing.T) {
		effects := func(from, to int, age string) {
			exec(`INSERT INTO ` + n.Dispatched + ` (id, source_consumer, source_id, seq, kind, topic, uuid, payload, metadata,
					ordering_key, created_at, dispatched_at, attempts, failures)
				SELECT g, 'c', g::text, 0, 'publish', 't', gen_random_uuid()::text, '\x', '\x', '', now(), now() - ` + age + `, 1, 0
				FROM generate_series(` + strconv.Itoa(from) + `, ` + strconv.Itoa(to) + `) g`)
		}
		exec(`TRUNCATE ` + n.Dispatched)
		effects(1, 40_000, `interval '40 days'`)
		exec(`VACUUM ` + n.Dispatched)
		exec(`DELETE FROM ` + n.Dispatched)
		exec(`VACUUM ` + n.Dispatched)
		effects(40_001, 80_000, `CASE WHEN g % 4 = 0 THEN interval '35 days' ELSE interval '1 minute' END`)
		exec(`VACUUM ANALYZE ` + n.Dispatched)
		reads := pass(q.CleanupEffectsFrom, n.Dispatched, "dispatched_at")
		examined, deleted := totals(reads)
		t.Logf("%d batches examined %d dispatched effects to delete %d", len(reads), examined, deleted)
		if deleted != 10_000 || examined > 2*deleted {
			t.Errorf("the scans examined %d dispatched effects to delete %d, want 10000 deleted", examined, deleted)
		}
	})
}

// TestStatsSampleReadsTheOldestExpired: the stats sample's cleanup lag reads the oldest thousand
// expired claims, not the table, on a table through its retention. It read "the first thousand"
// the BRIN index led to, every StatsInterval: the table from its first page.
func TestStatsSampleReadsTheOldestExpired(t *testing.T) {
	db, _, n, exec := planTables(t, "statsplan_")
	q := queries(n, false, new(Generation))
	throughRetention(n.Processed, exec)
	retention := strconv.Itoa(24 * 3600 * 1000)
	var plan []string
	for _, s := range []string{`PREPARE sample_stmt AS ` + q.StatsSample, `EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) EXECUTE sample_stmt(10000, ` + retention + `)`, `DEALLOCATE sample_stmt`} {
		plan = append(plan, queryLines(t, db, s)...)
	}
	text := strings.Join(plan, "\n")
	var doc []struct{ Plan planNode }
	if err := json.Unmarshal([]byte(text), &doc); err != nil {
		t.Fatalf("plan: %v\n%s", err, text)
	}
	examined := 0
	var walk func(*planNode)
	walk = func(p *planNode) {
		if p.Relation == "statsplan_processed" && strings.Contains(p.Cond+p.Filter+p.Recheck, "processed_at") {
			examined += int((p.Rows + p.Filtered + p.Rechecked) * max(p.Loops, 1))
		}
		for i := range p.Plans {
			walk(&p.Plans[i])
		}
	}
	walk(&doc[0].Plan)
	t.Logf("the sample examined %d claims for its cleanup lag", examined)
	if examined > 2000 {
		t.Errorf("the sample examined %d claims to find the oldest thousand expired", examined)
	}
}

// insertClaims inserts claims from to to of consumer c, processed and dispatched age ago (an SQL
// expression of g, the claim's number).
func insertClaims(processed string, exec func(string), from, to int, age string) {
	exec(`INSERT INTO ` + processed + ` (consumer, message_id, processed_at, dispatched_at)
		SELECT 'c', gen_random_uuid()::text, now() - ` + age + `, now() - ` + age + `
		FROM generate_series(` + strconv.Itoa(from) + `, ` + strconv.Itoa(to) + `) g`)
}

// throughRetention leaves a claim table as one that has been through its retention: 40,000 claims
// expired and deleted, their pages filled again by 40,000 new ones, one in four of them expired.
func throughRetention(processed string, exec func(string)) {
	exec(`TRUNCATE ` + processed)
	insertClaims(processed, exec, 1, 40_000, `interval '40 days'`)
	exec(`VACUUM ` + processed) // summarizes BRIN page ranges, as autovacuum does
	exec(`DELETE FROM ` + processed)
	exec(`VACUUM ` + processed) // the pages are free for new claims
	// New claims fill the freed pages; one in four has expired since.
	insertClaims(processed, exec, 1, 40_000, `CASE WHEN g % 4 = 0 THEN interval '35 days' ELSE interval '1 minute' END`)
	exec(`VACUUM ANALYZE ` + processed)
}

// scanRead is what the scan of the claims in a cleanup batch read: its buffers, the rows it
// returned, and the rows it examined (returned, and removed by its filter or by the recheck of
// a lossy page).
type scanRead struct{ buffers, rows, examined int }

// totals adds up the rows the scans of a pass examined and deleted.
func totals(reads []scanRead) (examined, deleted int) {
	for _, r := range reads {
		examined += r.examined
		deleted += r.rows
	}
	return examined, deleted
}

// expiredScan finds the scan of the expired rows (the one whose conditions name column) in an
// EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON).
func expiredScan(t *testing.T, plan, column string) scanRead {
	t.Helper()
	var doc []struct{ Plan planNode }
	if err := json.Unmarshal([]byte(plan), &doc); err != nil || len(doc) != 1 {
		t.Fatalf("plan: %v\n%s", err, plan)
	}
	var found *planNode
	var walk func(*planNode)
	walk = func(p *planNode) {
		if p.Relation != "" && strings.Contains(p.Cond+p.Filter+p.Recheck, column) && found == nil {
			found = p
		}
		for i := range p.Plans {
			walk(&p.Plans[i])
		}
	}
	walk(&doc[0].Plan)
	if found == nil {
		t.Fatalf("no scan on %s in\n%s", column, plan)
	}
	loops := max(found.Loops, 1)
	return scanRead{
		buffers:  found.Hit + found.Read,
		rows:     int(found.Rows * loops),
		examined: int((found.Rows + found.Filtered + found.Rechecked) * loops),
	}
}

// planNode is a node of EXPLAIN's JSON format (per-loop counts are averages over its loops).
type planNode struct {
	Alias     string     `json:"Alias"`
	Relation  string     `json:"Relation Name"`
	Cond      string     `json:"Index Cond"`
	Filter    string     `json:"Filter"`
	Recheck   string     `json:"Recheck Cond"`
	Hit       int        `json:"Shared Hit Blocks"`
	Read      int        `json:"Shared Read Blocks"`
	Rows      float64    `json:"Actual Rows"`
	Loops     float64    `json:"Actual Loops"`
	Filtered  float64    `json:"Rows Removed by Filter"`
	Rechecked float64    `json:"Rows Removed by Index Recheck"`
	Plans     []planNode `json:"Plans"`
}

// A cleanup whose caller has no deadline (an operator's Ctrl-C on `outbox cleanup`) and ends
// while a batch's COMMIT runs: the COMMIT is given cleanupCommitGrace, not as long as the server
// takes (here a deferred trigger sleeps a minute; a stalled server, the kernel's TCP timeout).
// The grace is store's cleanupCommitGrace, 10 s.
func TestCleanupCommitEndsAfterTheCallerWithoutADeadline(t *testing.T) {
	if testing.Short() {
		t.Skip("waits cleanupCommitGrace (10 s)")
	}
	t.Parallel()
	db := pgtest.DB(t)
	st := rotationStore(t, db, -1)
	exec := func(q string) {
		t.Helper()
		if _, err := db.Exec(q); err != nil {
			t.Fatal(err)
		}
	}
	insertClaims("rot_processed", exec, 1, 3, `interval '30 days'`)
	exec(`CREATE FUNCTION slow_commit() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN PERFORM pg_sleep(60); RETURN NULL; END $$`)
	exec(`CREATE CONSTRAINT TRIGGER slow_commit AFTER DELETE ON rot_processed DEFERRABLE INITIALLY DEFERRED
		FOR EACH ROW EXECUTE FUNCTION slow_commit()`)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	done := make(chan error, 1)
	go func() {
		_, err := st.Cleanup(ctx, outboxdriver.CleanupParams{Retention: time.Hour, EffectRetention: time.Hour, BatchSize: 10})
		done <- err
	}()
	deadline := time.Now().Add(30 * time.Second)
	for {
		var n int
		if err := db.QueryRow(`SELECT count(*) FROM pg_stat_activity WHERE query = 'COMMIT' AND wait_event = 'PgSleep'`).Scan(&n); err != nil {
			t.Fatal(err)
		}
		if n > 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("no COMMIT of a cleanup batch ran the deferred trigger")
		}
		time.Sleep(20 * time.Millisecond)
	}
	cancel()
	began := time.Now()
	select {
	case err := <-done:
		t.Logf("cleanup returned %s after its caller ended: %v", time.Since(began).Round(time.Millisecond), err)
	case <-time.After(20 * time.Second): // the grace is 10 s
		t.Fatalf("the cleanup's COMMIT still ran %s after its caller ended (grace 10 s)", time.Since(began).Round(time.Second))
	}
}
