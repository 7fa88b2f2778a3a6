package postgres

import (
	"context"
	"database/sql"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	_ "github.com/lib/pq"

	"github.com/watermill-outbox/outbox/internal/pgtest"
	"github.com/watermill-outbox/outbox/outboxdriver"
	"github.com/watermill-outbox/outbox/store"
)

// TestInlineStatementsFindClaimsByKey: the statements that mark, clear, take and set aside the
// inline effects of a list of claims find them through the primary key on a table of 1,500
// claims and more, with a custom and with a generic plan (pgx prepares them). Written as a join
// with the claims, the planner took the list for 100 claims and read the whole table (a sequential
// scan and a hash join) for every batch of marks until the table held some ten thousand claims;
// written with the pairs in JSON, its generic plan still read the whole table up to some 5,000.
func TestInlineStatementsFindClaimsByKey(t *testing.T) {
	db, st, n, exec := planTables(t, "plan_")
	ctx := context.Background()
	q := newInlineQueries(n)
	for _, claims := range []int{1500, 8000} {
		exec(`TRUNCATE ` + n.Processed)
		exec(`INSERT INTO ` + n.Processed + ` (consumer, message_id, processed_at, dispatched_at, effects, inline_xid)
			SELECT 'c', gen_random_uuid()::text, now(), now(), CASE WHEN g % 10 = 0 THEN '\x01'::bytea END, g
			FROM generate_series(1, ` + strconv.Itoa(claims) + `) g`)
		exec(`ANALYZE ` + n.Processed)
		explainClaimStatements(t, db, q, exec, claims)
	}

	// The pairs count, not the consumers and IDs apart: (x, a) and (y, b) marked leave (x, b) and
	// (y, a) alone.
	exec(`INSERT INTO ` + n.Processed + ` (consumer, message_id, effects) VALUES
		('x', 'a', '\x01'), ('x', 'b', '\x01'), ('y', 'a', '\x01'), ('y', 'b', '\x01')`)
	marks := []outboxdriver.DispatchMark{
		{Source: outboxdriver.Source{Consumer: "x", ID: "a"}, Inline: true},
		{Source: outboxdriver.Source{Consumer: "y", ID: "b"}, Inline: true},
	}
	if err := st.(*inline).EffectMarkDispatched(ctx, marks...); err != nil {
		t.Fatal(err)
	}
	var left string
	if err := db.QueryRowContext(ctx, `SELECT string_agg(consumer || '/' || message_id, ',' ORDER BY consumer, message_id)
		FROM `+n.Processed+` WHERE consumer IN ('x', 'y') AND effects IS NOT NULL`).Scan(&left); err != nil {
		t.Fatal(err)
	}
	if left != "x/b,y/a" {
		t.Errorf("claims with effects left after marking x/a and y/b: %s, want x/b,y/a", left)
	}
}

// planTables migrates the tables of prefix on a pool of one connection (PREPARE and
// plan_cache_mode are the session's), closed when the test ends, and returns exec, which fails
// the test on an error.
func planTables(t testing.TB, prefix string) (*sql.DB, outboxdriver.Store, store.Names, func(string)) {
	t.Helper()
	db, err := sql.Open("postgres", pgtest.DSN(t))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { db.Close() })
	db.SetMaxOpenConns(1)
	ctx := context.Background()
	st, err := Driver{}.Open(db, outboxdriver.StoreOptions{TablePrefix: prefix})
	if err != nil {
		t.Fatal(err)
	}
	if err := st.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	n, err := namesOf("", prefix)
	if err != nil {
		t.Fatal(err)
	}
	return db, st, n, func(q string) {
		t.Helper()
		if _, err := db.ExecContext(ctx, q); err != nil {
			t.Fatalf("%s: %v", q, err)
		}
	}
}

// queryLines runs q and returns the one text column of its rows (EXPLAIN's lines).
func queryLines(t *testing.T, db interface {
	QueryContext(context.Context, string, ...any) (*sql.Rows, error)
}, q string) []string {
	t.Helper()
	rows, err := db.QueryContext(context.Background(), q)
	if err != nil {
		t.Fatalf("%s: %v", q, err)
	}
	defer rows.Close()
	var lines []string
	for rows.Next() {
		var line string
		if err := rows.Scan(&line); err != nil {
			t.Fatal(err)
		}
		lines = append(lines, line)
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	return lines
}

// buffersRe reads the buffers of the top node of EXPLAIN (ANALYZE, BUFFERS): shared hit, and read.
var buffersRe = regexp.MustCompile(`Buffers: shared hit=(\d+)(?: read=(\d+))?`)

func atoi(s string) int {
	n, _ := strconv.Atoi(s)
	return n
}

// explainClaimStatements checks the plans of the statements on a list of claims.
func explainClaimStatements(t *testing.T, db *sql.DB, q inlineQueries, exec func(string), claims int) {
	t.Helper()
	for name, stmt := range map[string]string{"mark": q.mark, "markLate": q.markLate, "sentLate": q.sentLate, "clear": q.clear, "take": q.take, "setAside": q.setAside,
		"markSkipping": q.markSkipping, "markLateSkipping": q.markLateSkipping} {
		for _, mode := range []string{"force_custom_plan", "force_generic_plan"} {
			exec(`SET plan_cache_mode = ` + mode)
			exec(`PREPARE plan_stmt(text, text) AS ` + stmt)
			plan := queryLines(t, db, `EXPLAIN EXECUTE plan_stmt('c', '{"a","b","c"}')`)
			exec(`DEALLOCATE plan_stmt`)
			text := strings.Join(plan, "\n")
			if strings.Contains(text, "Seq Scan on plan_processed") || !strings.Contains(text, "plan_processed_pkey") {
				t.Errorf("%s (%s, %d claims) does not find the claims by their key:\n%s", name, mode, claims, text)
			}
		}
	}
	// The claim that carries marks: its lock of the carried claims and their updates too.
	for _, mode := range []string{"force_custom_plan", "force_generic_plan"} {
		exec(`SET plan_cache_mode = ` + mode)
		exec(`PREPARE plan_stmt(text, text, text, text) AS ` + q.claimMarking)
		plan := queryLines(t, db, `EXPLAIN EXECUTE plan_stmt('c', 'new', '{"a","b","c"}', '{"d"}')`)
		exec(`DEALLOCATE plan_stmt`)
		text := strings.Join(plan, "\n")
		if strings.Contains(text, "Seq Scan on plan_processed") || strings.Count(text, "plan_processed_pkey") < 3 {
			t.Errorf("the claim carrying marks (%s, %d claims) does not find the claims by their key:\n%s", mode, claims, text)
		}
	}
	exec(`RESET plan_cache_mode`)
}

// markingStore returns a store of the default layout (sent effects deleted), migrated on a
// database of the test's own.
func markingStore(t *testing.T) (*sql.DB, outboxdriver.Store) {
	t.Helper()
	db, err := sql.Open("postgres", pgtest.DSN(t))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { db.Close() })
	st, err := Driver{}.Open(db, outboxdriver.StoreOptions{TablePrefix: "outbox_", DeleteDispatched: true})
	if err != nil {
		t.Fatal(err)
	}
	if err := st.Migrate(context.Background()); err != nil {
		t.Fatal(err)
	}
	return db, st
}

// TestClaimMarkingSkipsLockedClaims: the claim that carries the marks of other claims skips
// those another transaction holds locked, without waiting, and returns the IDs it marked; it
// marks the others, in time or late (dispatched_at moved).
func TestClaimMarkingSkipsLockedClaims(t *testing.T) {
	db, st := markingStore(t)
	ctx := context.Background()
	if _, err := db.ExecContext(ctx, `INSERT INTO outbox_processed (consumer, message_id, effects, dispatched_at) VALUES
		('c', 'a', '\x01', now() - interval '1 hour'), ('c', 'b', '\x01', now() - interval '1 hour'),
		('c', 'late', '\x01', now() - interval '1 hour'), ('c', 'held', '\x01', now() - interval '1 hour')`); err != nil {
		t.Fatal(err)
	}
	lock, err := db.BeginTx(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer lock.Rollback()
	if _, err := lock.ExecContext(ctx, `SELECT 1 FROM outbox_processed WHERE consumer = 'c' AND message_id = 'held' FOR UPDATE`); err != nil {
		t.Fatal(err)
	}
	tx, err := db.BeginTx(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback()
	// A statement that waited for the lock would wait out this.
	if _, err := tx.ExecContext(ctx, `SET LOCAL lock_timeout = '5s'`); err != nil {
		t.Fatal(err)
	}
	c, err := st.(outboxdriver.ClaimMarker).MessageClaimMarking(ctx, tx, outboxdriver.Source{Consumer: "c", ID: "new"}, []string{"a", "held", "b", "gone"}, []string{"late"})
	if err != nil {
		t.Fatal(err)
	}
	if !c.Claimed {
		t.Error("the claim of c/new was not made")
	}
	slices.Sort(c.Marked)
	if got := strings.Join(c.Marked, ","); got != "a,b,late" {
		t.Errorf("marked %q, want a,b,late (held is locked, gone has no claim)", got)
	}
	if err := tx.Commit(); err != nil {
		t.Fatal(err)
	}
	if err := lock.Rollback(); err != nil {
		t.Fatal(err)
	}
	got := strings.Join(queryLines(t, db, `SELECT message_id || ':' || (effects IS NULL)::text || ':' || (dispatched_at > now() - interval '1 minute')::text
		FROM outbox_processed WHERE consumer = 'c' AND message_id <> 'new' ORDER BY message_id`), " ")
	if want := "a:true:false b:true:false held:false:false late:true:true"; got != want {
		t.Errorf("claims (id:cleared:dispatch time moved) %s, want %s", got, want)
	}
}

// TestMarkSkippingLockedClaims: the mark of the marks whose ride failed skips the claims another
// transaction holds locked, without waiting, and returns them; it marks the others, in time or
// late (dispatched_at moved). A claim without effects left (locked or not) or no claim at all is
// not returned: there is nothing to write again.
func TestMarkSkippingLockedClaims(t *testing.T) {
	db, st := markingStore(t)
	ctx := context.Background()
	if _, err := db.ExecContext(ctx, `INSERT INTO outbox_processed (consumer, message_id, effects, dispatched_at) VALUES
		('c', 'a', '\x01', now() - interval '1 hour'), ('c', 'held', '\x01', now() - interval '1 hour'),
		('c', 'late', '\x01', now() - interval '1 hour'), ('d', 'a', '\x01', now() - interval '1 hour'),
		('d', 'held-late', '\x01', now() - interval '1 hour'), ('c', 'done', NULL, now() - interval '1 hour')`); err != nil {
		t.Fatal(err)
	}
	lock, err := db.BeginTx(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer lock.Rollback()
	// done, whose effects were cleared, is locked too: nothing to mark is not a skip.
	if _, err := lock.ExecContext(ctx, `SELECT 1 FROM outbox_processed WHERE (consumer, message_id) IN (('c', 'held'), ('d', 'held-late'), ('c', 'done')) FOR UPDATE`); err != nil {
		t.Fatal(err)
	}
	mark := func(consumer, id string, late bool) outboxdriver.DispatchMark {
		return outboxdriver.DispatchMark{Source: outboxdriver.Source{Consumer: consumer, ID: id}, Inline: true, MoveClaim: late}
	}
	ctx5, cancel := context.WithTimeout(ctx, 5*time.Second) // a statement that waited for the lock would wait out this
	defer cancel()
	skipped, err := st.(outboxdriver.LockSkippingMarker).EffectMarkSkippingLocked(ctx5,
		mark("c", "a", false), mark("c", "held", false), mark("c", "late", true), mark("d", "a", false),
		mark("d", "held-late", true), mark("c", "done", false), mark("c", "gone", false))
	if err != nil {
		t.Fatal(err)
	}
	var got []string
	for _, mk := range skipped {
		got = append(got, mk.Source.Consumer+"/"+mk.Source.ID)
	}
	slices.Sort(got)
	if g := strings.Join(got, ","); g != "c/held,d/held-late" {
		t.Errorf("skipped %q, want c/held,d/held-late", g)
	}
	if err := lock.Rollback(); err != nil {
		t.Fatal(err)
	}
	lines := strings.Join(queryLines(t, db, `SELECT consumer || '/' || message_id || ':' || (effects IS NULL)::text || ':' || (dispatched_at > now() - interval '1 minute')::text
		FROM outbox_processed ORDER BY consumer, message_id`), " ")
	if want := "c/a:true:false c/done:true:false c/held:false:false c/late:true:true d/a:true:false d/held-late:false:false"; lines != want {
		t.Errorf("claims (id:cleared:dispatch time moved) %s, want %s", lines, want)
	}
	if _, err := st.(outboxdriver.LockSkippingMarker).EffectMarkSkippingLocked(ctx, outboxdriver.DispatchMark{
		Source: outboxdriver.Source{Consumer: "c", ID: "a"}, Inline: true, StoreIDs: []int64{1}}); err == nil {
		t.Error("a mark with effect rows was taken by the mark of inline effects only")
	}
}

// TestSweepReadsFromItsWatermark: the relay's sweep of inline effects left behind reads the
// claims at or above its watermark through the BRIN index on inline_xid, whatever the planner's
// statistics say. On a table whose claims mostly hold no inline_xid (the pgx form's claims of
// messages that recorded no effect, claims written before inline_xid existed, claims set aside)
// the column's statistics are all NULL and carry no correlation, and the planner read the whole
// table, twice per sweep, every quarter of RelayGrace: a second or more of a CPU for every ten
// million claims retained.
func TestSweepReadsFromItsWatermark(t *testing.T) {
	db, _, n, exec := planTables(t, "sweepplan_")
	ctx := context.Background()
	q := newInlineQueries(n)
	const claims = 100_000
	layouts := []struct{ name, xid string }{
		{"no claim with an inline_xid", `NULL`},
		{"one claim in a hundred with an inline_xid", `CASE WHEN g % 100 = 0 THEN g END`},
		{"every claim with an inline_xid", `g`},
	}
	for _, l := range layouts {
		exec(`TRUNCATE ` + n.Processed)
		exec(`INSERT INTO ` + n.Processed + ` (consumer, message_id, processed_at, dispatched_at, inline_xid)
			SELECT 'c', gen_random_uuid()::text, now(), now(), ` + l.xid + ` FROM generate_series(1, ` + strconv.Itoa(claims) + `) g`)
		// Summarizes the BRIN ranges, as autosummarize does once they are full. The statistics
		// stay as they are until a tenth of the table has changed (autovacuum_analyze_scale_factor).
		exec(`VACUUM ANALYZE ` + n.Processed)
		var pages int
		if err := db.QueryRowContext(ctx, `SELECT relpages FROM pg_class WHERE oid = '`+n.Processed+`'::regclass`).Scan(&pages); err != nil {
			t.Fatal(err)
		}
		// The newest claims hold effects, as those of a relay that fell behind would.
		exec(`INSERT INTO ` + n.Processed + ` (consumer, message_id, processed_at, dispatched_at, effects, inline_xid)
			SELECT 'c', gen_random_uuid()::text, now(), now(), '\x01', g FROM generate_series(` + strconv.Itoa(claims+1) + `, ` + strconv.Itoa(claims+10) + `) g`)
		for _, from := range []int{1, claims - 50} {
			if l.xid == `g` && from == 1 {
				continue // every claim is at or above the watermark: reading them all is the sweep's job
			}
			for name, stmt := range map[string]string{"sweep": q.sweep, "sweepLeft": q.sweepLeft} {
				tx, err := db.BeginTx(ctx, nil)
				if err != nil {
					t.Fatal(err)
				}
				var may bool
				var xmin, xmax int64
				var watermark sql.NullInt64
				if err := tx.QueryRowContext(ctx, q.sweepBegin).Scan(&may, &xmin, &xmax, &watermark); err != nil {
					t.Fatal(err)
				}
				args := strconv.Itoa(from)
				if name == "sweep" {
					args += ", 10000, 1000, 100"
				}
				var plan []string
				for _, s := range []string{`PREPARE sweep_stmt AS ` + stmt, `EXPLAIN (ANALYZE, BUFFERS) EXECUTE sweep_stmt(` + args + `)`, `DEALLOCATE sweep_stmt`} {
					plan = append(plan, queryLines(t, tx, s)...)
				}
				if err := tx.Rollback(); err != nil {
					t.Fatal(err)
				}
				text := strings.Join(plan, "\n")
				if strings.Contains(text, "Seq Scan on sweepplan_processed") || !strings.Contains(text, "sweepplan_processed_inline_xid") {
					t.Errorf("%s from %d, %s: reads the claims below its watermark:\n%s", name, from, l.name, text)
				}
				// What it read: the BRIN index, the ranges at or above the watermark and the
				// unsummarized newest pages, a few dozen pages of the table's thousand and more.
				// (From the first transaction on, every range holding an inline_xid is read.)
				if m := buffersRe.FindStringSubmatch(text); m == nil {
					t.Errorf("%s: no buffer counts in\n%s", name, text)
				} else if hit, _ := strconv.Atoi(m[1]); (from > 1 || l.xid == `NULL`) && hit+atoi(m[2]) > pages/10 {
					t.Errorf("%s from %d, %s: read %s+%s buffers of a table of %d pages:\n%s", name, from, l.name, m[1], m[2], pages, text)
				}
			}
		}
	}
}

// TestDuplicateClaimFindsPendingBySource: the claim's statement and the pgx form's look-up, for a
// duplicate, tell whether anything of the claim found is pending (settled), and the duplicate's
// read of what is pending (PendingQuery, EffectListPending) reads it, through the index of
// pending effects by source, with a custom and with a generic plan, on an empty effects table and
// behind a backlog (a broker down: 50,000 effects pending), analyzed or not: never by reading the
// pending effects of every source. Planned on an empty table (a new service), the settled check
// written as an EXISTS and PendingQuery read them through the index by ordering key, and a
// prepared statement keeps its plan while a backlog grows.
func TestDuplicateClaimFindsPendingBySource(t *testing.T) {
	db, _, n, exec := planTables(t, "dupplan_")
	q := queries(n, true, new(Generation))
	exec(`INSERT INTO ` + n.Processed + ` (consumer, message_id, processed_at, dispatched_at) VALUES ('c', 'dup', now(), now())`)
	backlog := `INSERT INTO ` + n.Effects + ` (source_consumer, source_id, seq, kind, topic, uuid, payload, metadata, ordering_key, created_at)
		SELECT 'c', 'm' || (g / 5), g % 5, 'publish', 't', gen_random_uuid()::text, '\x00', '\x00', 'k' || (g % 7), now()
		FROM generate_series(1, 50000) g`
	for _, state := range []struct{ name, setup string }{
		{"empty", ``},
		{"a backlog, not analyzed", backlog},
		{"a backlog, analyzed", `ANALYZE ` + n.Effects},
	} {
		if state.setup != "" {
			exec(state.setup)
		}
		for name, stmt := range map[string]string{
			"claim": q.MessageClaim, "look-up": ClaimLookup(n), "pending": PendingQuery(n), "listPending": q.EffectListPending,
		} {
			for _, mode := range []string{"force_custom_plan", "force_generic_plan"} {
				exec(`SET plan_cache_mode = ` + mode)
				exec(`PREPARE dup_stmt(text, text) AS ` + stmt)
				tx, err := db.Begin()
				if err != nil {
					t.Fatal(err)
				}
				plan := queryLines(t, tx, `EXPLAIN (ANALYZE, BUFFERS, COSTS OFF) EXECUTE dup_stmt('c', 'dup')`)
				_ = tx.Rollback()
				exec(`DEALLOCATE dup_stmt`)
				text := strings.Join(plan, "\n")
				// The rows are in partition 0; the others are empty. Analyzed empty (the third
				// state), a partition costs nothing to read whole and may be: the rotation
				// truncates a partition before it becomes the current one, which resets its
				// statistics and drops the plans made with them.
				emptyScanned := state.name == "a backlog, analyzed" &&
					!strings.Contains(strings.NewReplacer("Seq Scan on dupplan_effects_1", "", "Seq Scan on dupplan_effects_2", "").Replace(text), "Seq Scan on dupplan_effects")
				if !strings.Contains(text, "dupplan_effects_pending_source") || strings.Contains(text, "Seq Scan on dupplan_effects") && !emptyScanned {
					t.Errorf("%s (%s, %s): the duplicate's pending effects are not read by their source:\n%s", name, mode, state.name, text)
				}
				if top := buffersRe.FindStringSubmatch(text); top != nil && atoi(top[1])+atoi(top[2]) > 50 {
					t.Errorf("%s (%s, %s): %s buffers read for one duplicate:\n%s", name, mode, state.name, top[0], text)
				}
			}
		}
	}
}
