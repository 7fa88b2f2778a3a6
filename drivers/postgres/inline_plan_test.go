package postgres

import (
	"context"
	"database/sql"
	"strconv"
	"strings"
	"testing"

	_ "github.com/lib/pq"

	"github.com/watermill-outbox/outbox/internal/pgtest"
	"github.com/watermill-outbox/outbox/outboxdriver"
)

// TestInlineStatementsFindClaimsByKey: the statements that mark, clear, take and set aside the
// inline effects of a list of claims find them through the primary key on a table of 1,500
// claims and more, with a custom and with a generic plan (pgx prepares them). Written as a join
// with the claims, the planner took the list for 100 claims and read the whole table (a sequential
// scan and a hash join) for every batch of marks until the table held some ten thousand claims;
// written with the pairs in JSON, its generic plan still read the whole table up to some 5,000.
func TestInlineStatementsFindClaimsByKey(t *testing.T) {
	db, err := sql.Open("postgres", pgtest.DSN(t))
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	db.SetMaxOpenConns(1) // PREPARE and plan_cache_mode are the session's
	ctx := context.Background()
	st, err := Driver{}.Open(db, outboxdriver.StoreOptions{TablePrefix: "plan_"})
	if err != nil {
		t.Fatal(err)
	}
	if err := st.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	n, err := namesOf("", "plan_")
	if err != nil {
		t.Fatal(err)
	}
	exec := func(q string) {
		t.Helper()
		if _, err := db.ExecContext(ctx, q); err != nil {
			t.Fatalf("%s: %v", q, err)
		}
	}
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

// explainClaimStatements checks the plans of the statements on a list of claims.
func explainClaimStatements(t *testing.T, db *sql.DB, q inlineQueries, exec func(string), claims int) {
	t.Helper()
	ctx := context.Background()
	for name, stmt := range map[string]string{"mark": q.mark, "markLate": q.markLate, "sentLate": q.sentLate, "clear": q.clear, "take": q.take, "setAside": q.setAside} {
		for _, mode := range []string{"force_custom_plan", "force_generic_plan"} {
			exec(`SET plan_cache_mode = ` + mode)
			exec(`PREPARE plan_stmt(text, text) AS ` + stmt)
			rows, err := db.QueryContext(ctx, `EXPLAIN EXECUTE plan_stmt('c', '{"a","b","c"}')`)
			if err != nil {
				t.Fatal(err)
			}
			var plan []string
			for rows.Next() {
				var line string
				if err := rows.Scan(&line); err != nil {
					t.Fatal(err)
				}
				plan = append(plan, line)
			}
			if err := rows.Close(); err != nil {
				t.Fatal(err)
			}
			exec(`DEALLOCATE plan_stmt`)
			text := strings.Join(plan, "\n")
			if strings.Contains(text, "Seq Scan on plan_processed") || !strings.Contains(text, "plan_processed_pkey") {
				t.Errorf("%s (%s, %d claims) does not find the claims by their key:\n%s", name, mode, claims, text)
			}
		}
	}
}
