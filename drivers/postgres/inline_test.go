package postgres_test

import (
	"bytes"
	"context"
	"database/sql"
	"errors"
	"fmt"
	"maps"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/watermill-outbox/outbox/drivers/postgres"
	"github.com/watermill-outbox/outbox/internal/pgtest"
	"github.com/watermill-outbox/outbox/outboxdriver"
	"github.com/watermill-outbox/outbox/store"
)

// inlineEffects are two effects of src as the pgx driver's optimistic mode keeps them in the
// claim: bytes that are no valid UTF-8, NUL, empty payload and metadata.
func inlineEffects(src outboxdriver.Source) []outboxdriver.Effect {
	key := src.Consumer + "/" + src.ID
	return []outboxdriver.Effect{
		{Seq: 1, Topic: "out", UUID: src.ID + "-1", Payload: []byte{0, 0xff, 'x', 0}, Metadata: map[string]string{"k": "v\x00w"}, OrderingKey: key, Source: src},
		{Seq: 2, Topic: "out", UUID: src.ID + "-2", Payload: []byte{}, Metadata: map[string]string{}, OrderingKey: key, Source: src},
	}
}

// claimInline writes the claim of src with its effects inline, age old, as the pgx driver's
// optimistic mode does (with the ID of its transaction unless legacy, as before version 9).
func claimInline(t *testing.T, db *sql.DB, src outboxdriver.Source, age time.Duration, legacy bool) {
	t.Helper()
	q := `INSERT INTO outbox_processed (consumer, message_id, processed_at, dispatched_at, effects, inline_xid)
		VALUES ($1, $2, now() - $3 * interval '1 millisecond', now() - $3 * interval '1 millisecond', $4, pg_current_xact_id()::text::bigint)`
	if legacy {
		q = `INSERT INTO outbox_processed (consumer, message_id, processed_at, dispatched_at, effects)
			VALUES ($1, $2, now() - $3 * interval '1 millisecond', now() - $3 * interval '1 millisecond', $4)`
	}
	if _, err := db.Exec(q, src.Consumer, src.ID, age.Milliseconds(), store.EncodeEffects(inlineEffects(src))); err != nil {
		t.Fatal(err)
	}
}

// sameEffects fails unless got holds the effects of inlineEffects(src), in order.
func sameEffects(t *testing.T, what string, got []outboxdriver.Effect, src outboxdriver.Source, rows bool) {
	t.Helper()
	want := inlineEffects(src)
	if len(got) != len(want) {
		t.Fatalf("%s: %d effects, want %d", what, len(got), len(want))
	}
	for i, g := range got {
		w := want[i]
		if g.Seq != w.Seq || g.UUID != w.UUID || g.Topic != w.Topic || g.OrderingKey != w.OrderingKey || g.Source != src ||
			!bytes.Equal(g.Payload, w.Payload) || !maps.Equal(g.Metadata, w.Metadata) || (g.StoreID != 0) != rows {
			t.Errorf("%s: effect %d is %+v, want %+v (a row: %v)", what, i, g, w, rows)
		}
	}
}

func openInline(t *testing.T, db *sql.DB, deleteDispatched bool) (outboxdriver.Store, outboxdriver.InlineStore) {
	t.Helper()
	st, err := postgres.Driver{}.Open(db, outboxdriver.StoreOptions{TablePrefix: "outbox_", DeleteDispatched: deleteDispatched})
	if err != nil {
		t.Fatal(err)
	}
	is, ok := st.(outboxdriver.InlineStore)
	if !ok {
		t.Fatalf("the postgres driver's Store (%T) does not handle inline effects", st)
	}
	return st, is
}

// TestInlineEffectsThroughDatabaseSQL: the database/sql form (lib/pq) reads inline effects with
// the effect rows, moves them to rows, marks them (cleared, or kept in the dispatched table for
// EffectRetention), and its relay moves those left behind; every byte survives.
func TestInlineEffectsThroughDatabaseSQL(t *testing.T) {
	for _, deleteDispatched := range []bool{true, false} {
		t.Run(fmt.Sprint("delete dispatched ", deleteDispatched), func(t *testing.T) {
			db := pgtest.DB(t)
			ctx := context.Background()
			st, is := openInline(t, db, deleteDispatched)
			if err := st.Migrate(ctx); err != nil {
				t.Fatal(err)
			}
			a, b, c := outboxdriver.Source{Consumer: "c", ID: "a"}, outboxdriver.Source{Consumer: "c", ID: "b"}, outboxdriver.Source{Consumer: "c", ID: "c"}
			for _, src := range []outboxdriver.Source{a, b} {
				claimInline(t, db, src, 0, false)
			}
			claimInline(t, db, c, time.Hour, false)

			pending, err := st.EffectListPending(ctx, a)
			if err != nil {
				t.Fatal(err)
			}
			sameEffects(t, "listed", pending, a, false)
			rows, err := is.EffectMaterialize(ctx, a, time.Minute)
			if err != nil {
				t.Fatal(err)
			}
			sameEffects(t, "moved", rows, a, true)
			if pending, err = st.EffectListPending(ctx, a); err != nil {
				t.Fatal(err)
			}
			sameEffects(t, "listed after the move", pending, a, true)

			if err := st.EffectMarkDispatched(ctx, outboxdriver.DispatchMark{Source: b, Inline: true}); err != nil {
				t.Fatal(err)
			}
			if pending, err = st.EffectListPending(ctx, b); err != nil || len(pending) != 0 {
				t.Fatalf("after the mark: %d pending (%v), want none", len(pending), err)
			}
			var archived int
			if err := db.QueryRow(`SELECT count(*) FROM outbox_dispatched WHERE source_id = 'b'`).Scan(&archived); err != nil {
				t.Fatal(err)
			}
			if want := map[bool]int{true: 0, false: 2}[deleteDispatched]; archived != want {
				t.Errorf("%d sent inline effects kept in the dispatched table, want %d", archived, want)
			}

			claim, err := st.EffectClaimDue(ctx, outboxdriver.EffectClaimParams{Grace: time.Second, Limit: 10, Lease: time.Minute})
			if err != nil {
				t.Fatal(err)
			}
			sameEffects(t, "claimed by the relay", claim.Effects, c, true)
		})
	}
}

// TestInlineEffectsFromBeforeTheTransactionIDs: a claim written with inline effects before
// version 9 (no transaction ID), left behind, is swept once the tables are migrated, even when
// the time the sweep got to was written by a clock ahead of the database's.
func TestInlineEffectsFromBeforeTheTransactionIDs(t *testing.T) {
	db := pgtest.DB(t)
	ctx := context.Background()
	ms, err := postgres.Migrations("", "outbox_")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := db.Exec(`CREATE TABLE outbox_migrations (version integer PRIMARY KEY, applied_at timestamptz NOT NULL DEFAULT now())`); err != nil {
		t.Fatal(err)
	}
	for _, m := range ms {
		if m.Version > 8 {
			break
		}
		if _, err := db.Exec(m.SQL); err != nil {
			t.Fatalf("migration %d: %v", m.Version, err)
		}
		if _, err := db.Exec(`INSERT INTO outbox_migrations (version) VALUES ($1)`, m.Version); err != nil {
			t.Fatal(err)
		}
	}
	old := outboxdriver.Source{Consumer: "c", ID: "old"}
	claimInline(t, db, old, 10*time.Second, true)
	if _, err := db.Exec(`UPDATE outbox_stats SET swept_to = now() + interval '1 hour'`); err != nil {
		t.Fatal(err)
	}
	st, _ := openInline(t, db, true)
	if err := st.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	claim, err := st.EffectClaimDue(ctx, outboxdriver.EffectClaimParams{Grace: time.Second, Limit: 10, Lease: time.Minute})
	if err != nil {
		t.Fatal(err)
	}
	sameEffects(t, "claimed by the relay", claim.Effects, old, true)
}

// TestInlineMarkHostileIDs: one batch of marks over several consumers clears exactly the claims
// it names, whatever their IDs hold (the quotes, backslashes, braces, commas and spaces of a
// text[] literal, the word NULL, non-ASCII, the longest allowed ID), cleared or kept in the
// dispatched table for EffectRetention; claims of the same IDs under another consumer keep theirs.
func TestInlineMarkHostileIDs(t *testing.T) {
	ids := []string{`a"b`, `a\b`, `\"`, `{x,y}`, `a,b`, ` lead and trail `, `NULL`, `null`, `"NULL"`, `ü€😀`, `''`,
		strings.Repeat(`\`, 255), strings.Repeat(`"`, 255), strings.Repeat("é", 127)}
	for _, deleteDispatched := range []bool{true, false} {
		t.Run(fmt.Sprint("delete dispatched ", deleteDispatched), func(t *testing.T) {
			db := pgtest.DB(t)
			ctx := context.Background()
			st, _ := openInline(t, db, deleteDispatched)
			if err := st.Migrate(ctx); err != nil {
				t.Fatal(err)
			}
			var marks []outboxdriver.DispatchMark
			for _, consumer := range []string{`c"1`, `c\2`, "untouched"} {
				for _, id := range ids {
					src := outboxdriver.Source{Consumer: consumer, ID: id}
					claimInline(t, db, src, 0, false)
					if consumer != "untouched" {
						marks = append(marks, outboxdriver.DispatchMark{Source: src, Inline: true})
					}
				}
			}
			if err := st.EffectMarkDispatched(ctx, marks...); err != nil {
				t.Fatal(err)
			}
			rows, err := db.QueryContext(ctx, `SELECT consumer, message_id FROM outbox_processed WHERE effects IS NOT NULL`)
			if err != nil {
				t.Fatal(err)
			}
			left := map[outboxdriver.Source]bool{}
			for rows.Next() {
				var src outboxdriver.Source
				if err := rows.Scan(&src.Consumer, &src.ID); err != nil {
					t.Fatal(err)
				}
				left[src] = true
			}
			if err := rows.Close(); err != nil {
				t.Fatal(err)
			}
			for _, id := range ids {
				if !left[outboxdriver.Source{Consumer: "untouched", ID: id}] {
					t.Errorf("the claim %q of a consumer that was not marked lost its effects", id)
				}
			}
			if len(left) != len(ids) {
				t.Errorf("%d claims hold effects after the marks, want the %d unmarked ones: %v", len(left), len(ids), left)
			}
			var archived int
			if err := db.QueryRow(`SELECT count(DISTINCT (source_consumer, source_id)) FROM outbox_dispatched`).Scan(&archived); err != nil {
				t.Fatal(err)
			}
			if want := map[bool]int{true: 0, false: len(marks)}[deleteDispatched]; archived != want {
				t.Errorf("%d claims' sent effects kept in the dispatched table, want %d", archived, want)
			}
		})
	}
}

// tableUpdates returns the updates counted so far on table, summed over its partitions (a
// partitioned table counts none itself); db has one connection, on which the statements counted
// ran (a backend reports its counts when asked to, at its next idle).
func tableUpdates(t *testing.T, db *sql.DB, table string) int64 {
	t.Helper()
	if _, err := db.Exec(`SELECT pg_stat_force_next_flush()`); err != nil {
		t.Fatal(err)
	}
	var n int64
	if err := db.QueryRow(`SELECT coalesce(sum(n_tup_upd), 0) FROM pg_stat_user_tables
		WHERE relid = $1::regclass OR relid IN (SELECT relid FROM pg_partition_tree($1::regclass))`, table).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

// TestHandToRelayWritesOnlyWhatItChanges: effects handed to the relay once are not written again
// when they are handed over again (a redelivered copy of a unit whose ordering key is held up):
// the update would change nothing but leave a dead version of each row.
func TestHandToRelayWritesOnlyWhatItChanges(t *testing.T) {
	db := pgtest.DB(t)
	db.SetMaxOpenConns(1)
	ctx := context.Background()
	st, _ := openInline(t, db, true)
	if err := st.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	if _, err := db.Exec(`INSERT INTO outbox_effects_all (source_consumer, source_id, seq, kind, topic, uuid, payload, metadata, ordering_key)
		VALUES ('c', 'held', 1, 'message', 'out', 'held-1', '', '', 'k'), ('c', 'held', 2, 'message', 'out', 'held-2', '', '', 'k')`); err != nil {
		t.Fatal(err)
	}
	src := outboxdriver.Source{Consumer: "c", ID: "held"}
	for i, want := range []int64{2, 0} {
		before := tableUpdates(t, db, "outbox_effects_all")
		if err := st.EffectHandToRelay(ctx, src); err != nil {
			t.Fatal(err)
		}
		if n := tableUpdates(t, db, "outbox_effects_all") - before; n != want {
			t.Errorf("hand-over %d updated %d effect rows, want %d", i+1, n, want)
		}
	}
	var due int
	if err := db.QueryRow(`SELECT count(*) FROM outbox_effects_all WHERE next_attempt_at <= now()`).Scan(&due); err != nil || due != 2 {
		t.Fatalf("%d effects due after the hand-overs (%v), want 2", due, err)
	}
}

// TestLateMarkWritesTheClaimOnce: the late mark (MoveClaim) of a unit that kept effects in its
// claim and had others as rows (an ordering key of their own) moves the claim's dispatch time
// and clears its effects in one update of the claim, not one for each kind.
func TestLateMarkWritesTheClaimOnce(t *testing.T) {
	db := pgtest.DB(t)
	db.SetMaxOpenConns(1) // the store's statements and the counts on one backend, which reports them when asked
	ctx := context.Background()
	st, _ := openInline(t, db, true)
	if err := st.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	src := outboxdriver.Source{Consumer: "c", ID: "late"}
	claimInline(t, db, src, time.Hour, false)
	var id int64
	if err := db.QueryRow(`INSERT INTO outbox_effects_all (source_consumer, source_id, seq, kind, topic, uuid, payload, metadata, ordering_key)
		VALUES ('c', 'late', 3, 'message', 'out', 'late-3', '', '', 'own key') RETURNING id`).Scan(&id); err != nil {
		t.Fatal(err)
	}
	updates := func() int64 { return tableUpdates(t, db, "outbox_processed") }
	before := updates()
	if err := st.EffectMarkDispatched(ctx, outboxdriver.DispatchMark{Source: src, StoreIDs: []int64{id}, Inline: true, MoveClaim: true}); err != nil {
		t.Fatal(err)
	}
	if n := updates() - before; n != 1 {
		t.Errorf("the late mark updated the claim %d times, want once", n)
	}
	var moved, cleared bool
	if err := db.QueryRow(`SELECT dispatched_at > now() - interval '1 minute', effects IS NULL FROM outbox_processed
		WHERE consumer = 'c' AND message_id = 'late'`).Scan(&moved, &cleared); err != nil {
		t.Fatal(err)
	}
	if !moved || !cleared {
		t.Errorf("after the late mark: dispatch time moved %v, effects cleared %v; want both", moved, cleared)
	}
	var left int
	if err := db.QueryRow(`SELECT count(*) FROM outbox_effects_all`).Scan(&left); err != nil || left != 0 {
		t.Fatalf("%d effect rows left after the mark (%v), want none", left, err)
	}
}

// TestSweepMovesABigClaimLeftBehind: a claim holding the effects of a big unit (9,400, as the
// fault campaign's) left behind by a crash is moved to effect rows by the relay's sweep, which
// reports no error. The sweep turns sequential scans off for its look-up of the claims, and the
// rows it inserts through the effects table's parent take their partition from a function per row
// (migration 023): on a server with JIT, each call was compiled, some 11 ms a row, so that the
// sweep of this claim outlasted its 30 s bound at every try, and with it every claim behind it
// stayed in its claim (the campaign's drain ended with it pending).
func TestSweepMovesABigClaimLeftBehind(t *testing.T) {
	db := pgtest.DB(t)
	ctx := context.Background()
	var errs []error
	var mu sync.Mutex
	st, err := postgres.Driver{}.Open(db, outboxdriver.StoreOptions{TablePrefix: "outbox_", DeleteDispatched: true,
		OnError: func(what string, err error) {
			mu.Lock()
			defer mu.Unlock()
			errs = append(errs, fmt.Errorf("%s: %w", what, err))
		}})
	if err != nil {
		t.Fatal(err)
	}
	if err := st.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	var jit bool
	if err := db.QueryRow(`SELECT pg_jit_available()`).Scan(&jit); err != nil {
		t.Fatal(err)
	}
	t.Logf("JIT available on this server: %v", jit)
	src := outboxdriver.Source{Consumer: "c", ID: "big"}
	const n = 9400
	effects := make([]outboxdriver.Effect, n)
	for i := range effects {
		effects[i] = outboxdriver.Effect{Seq: i + 1, Topic: "out", UUID: fmt.Sprintf("big-%d", i), Payload: bytes.Repeat([]byte{'p'}, 100),
			Metadata: map[string]string{"k": "v"}, OrderingKey: "c/big", Source: src}
	}
	if _, err := db.Exec(`INSERT INTO outbox_processed (consumer, message_id, processed_at, dispatched_at, effects, inline_xid)
		VALUES ($1, $2, now() - interval '1 hour', now() - interval '1 hour', $3, pg_current_xact_id()::text::bigint)`,
		src.Consumer, src.ID, store.EncodeEffects(effects)); err != nil {
		t.Fatal(err)
	}
	claim, err := st.EffectClaimDue(ctx, outboxdriver.EffectClaimParams{Grace: time.Second, Limit: 10, Lease: time.Minute})
	if err != nil {
		t.Fatal(err)
	}
	mu.Lock()
	defer mu.Unlock()
	if len(errs) > 0 {
		t.Errorf("the sweep reported: %v", errors.Join(errs...))
	}
	var rows, inline int
	if err := db.QueryRow(`SELECT (SELECT count(*) FROM outbox_effects_all WHERE source_id = 'big'),
		(SELECT count(*) FROM outbox_processed WHERE effects IS NOT NULL)`).Scan(&rows, &inline); err != nil {
		t.Fatal(err)
	}
	if rows != n || inline != 0 || len(claim.Effects) == 0 {
		t.Fatalf("after the sweep: %d effect rows (want %d), %d claims still holding effects (want 0), %d claimed", rows, n, inline, len(claim.Effects))
	}
}
