package postgres

import (
	"context"
	"crypto/rand"
	"database/sql"
	"fmt"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/watermill-outbox/outbox/internal/pgtest"
	"github.com/watermill-outbox/outbox/outboxdriver"
	"github.com/watermill-outbox/outbox/store"
)

// rotationStore opens the postgres Store of prefix "rot_" on db with RotateEvery every, migrated.
func rotationStore(t *testing.T, db *sql.DB, every time.Duration) *inline {
	t.Helper()
	st, err := Driver{RotateEvery: every}.Open(db, outboxdriver.StoreOptions{TablePrefix: "rot_"})
	if err != nil {
		t.Fatal(err)
	}
	if err := st.Migrate(context.Background()); err != nil {
		t.Fatal(err)
	}
	return st.(*inline)
}

// record inserts count effects of one unit of work at the boundary (no incoming message) in a
// transaction of its own, on ordering key key, and returns their ids.
func record(t *testing.T, st *inline, db *sql.DB, unit, key string, count int) []int64 {
	t.Helper()
	ids, err := recordUnit(st, db, unit, key, count)
	if err != nil {
		t.Fatal(err)
	}
	return ids
}

// recordUnit is record, returning its error.
func recordUnit(st *inline, db *sql.DB, unit, key string, count int) ([]int64, error) {
	ctx := context.Background()
	src := outboxdriver.Source{Consumer: "unit", ID: unit}
	effects := make([]outboxdriver.Effect, count)
	for i := range effects {
		effects[i] = outboxdriver.Effect{Source: src, Seq: i, Kind: outboxdriver.KindPublish, Topic: "t",
			UUID: fmt.Sprintf("%s-%d", unit, i), Payload: []byte("p"), OrderingKey: key}
	}
	tx, err := db.BeginTx(ctx, nil)
	if err != nil {
		return nil, err
	}
	defer func() { _ = tx.Rollback() }()
	if _, err := st.EffectInsert(ctx, tx, src, effects); err != nil {
		return nil, err
	}
	if err := tx.Commit(); err != nil {
		return nil, err
	}
	ids := make([]int64, count)
	for i, e := range effects {
		ids[i] = e.StoreID
	}
	return ids, nil
}

// sendAll claims and marks every due effect, as the relay does, and returns how many it sent.
func sendAll(t *testing.T, st *inline) int {
	t.Helper()
	ctx := context.Background()
	sent := 0
	var after int64
	for {
		c, err := st.EffectClaimDue(ctx, outboxdriver.EffectClaimParams{Limit: 500, MaxBytes: 1 << 20, Lease: time.Minute, After: after})
		if err != nil {
			t.Fatal(err)
		}
		marks := map[outboxdriver.Source][]int64{}
		for _, e := range c.Effects {
			marks[e.Source] = append(marks[e.Source], e.StoreID)
		}
		for src, ids := range marks {
			if err := st.EffectMarkDispatched(ctx, outboxdriver.DispatchMark{Source: src, StoreIDs: ids}); err != nil {
				t.Fatal(err)
			}
		}
		sent += len(c.Effects)
		if len(c.Effects) == 0 && c.Next == 0 {
			return sent
		}
		after = c.Next
	}
}

// partitionSizes returns pg_relation_size of the three partitions of the effects table of "rot_".
func partitionSizes(t *testing.T, db *sql.DB) [3]int64 {
	t.Helper()
	var s [3]int64
	if err := db.QueryRow(`SELECT pg_relation_size('rot_effects'), pg_relation_size('rot_effects_1'),
		pg_relation_size('rot_effects_2')`).Scan(&s[0], &s[1], &s[2]); err != nil {
		t.Fatal(err)
	}
	return s
}

// firstPendingBuffers returns the buffers that the claim's look-up of the first pending effect
// reads (EXPLAIN (ANALYZE, BUFFERS)).
func firstPendingBuffers(t *testing.T, db *sql.DB) int {
	t.Helper()
	plan := strings.Join(queryLines(t, db, `EXPLAIN (ANALYZE, BUFFERS, COSTS OFF)
		SELECT min(id) FROM rot_effects_all WHERE dispatched_at IS NULL AND parked_at IS NULL`), "\n")
	top := buffersRe.FindStringSubmatch(plan)
	if top == nil {
		t.Fatalf("no buffers in the plan:\n%s", plan)
	}
	return atoi(top[1]) + atoi(top[2])
}

// TestRotationFreesSentEffectsBehindAHeldHorizon: a session idle in a REPEATABLE READ
// transaction holds the xmin horizon back, so that the rows of sent effects can be neither
// vacuumed nor their index entries killed. Units of work at the boundary record effects and the
// relay sends them, round after round. Rotated, the partitions that held the sent rows of all but
// the two latest rounds are truncated despite the hold, and the claim's look-up of the first
// pending effect reads the dead entries of those two rounds only; not rotated (the single table
// as it was before migration 023), it reads every round's.
func TestRotationFreesSentEffectsBehindAHeldHorizon(t *testing.T) {
	const rounds, perRound = 8, 400
	ctx := context.Background()
	measure := func(every time.Duration) int {
		db := pgtest.DB(t)
		st := rotationStore(t, db, every)
		if _, err := db.Exec(`CREATE TABLE unrelated (x int); INSERT INTO unrelated VALUES (1)`); err != nil {
			t.Fatal(err)
		}
		holder, err := db.Conn(ctx)
		if err != nil {
			t.Fatal(err)
		}
		defer holder.Close()
		hold, err := holder.BeginTx(ctx, &sql.TxOptions{Isolation: sql.LevelRepeatableRead})
		if err != nil {
			t.Fatal(err)
		}
		defer func() { _ = hold.Rollback() }()
		var x int
		if err := hold.QueryRowContext(ctx, `SELECT x FROM unrelated`).Scan(&x); err != nil {
			t.Fatal(err)
		}
		for r := range rounds {
			for u := range perRound / 4 {
				record(t, st, db, fmt.Sprintf("r%d-u%d", r, u), fmt.Sprintf("k%d", u%16), 4)
			}
			// The rotation is due at the first claim after RotateEvery.
			time.Sleep(max(every, 0) + 10*time.Millisecond)
			if sent := sendAll(t, st); sent != perRound {
				t.Fatalf("round %d: %d effects sent, want %d", r, sent, perRound)
			}
		}
		if _, err := db.Exec(`VACUUM rot_effects_all`); err != nil {
			t.Fatal(err)
		}
		buffers := firstPendingBuffers(t, db)
		sizes := partitionSizes(t, db)
		t.Logf("RotateEvery %s: generation %d, partition sizes %v, the first pending effect read %d buffers", every, st.gen.Load(), sizes, buffers)
		if every > 0 {
			if cur := st.gen.Load(); sizes[cur] != 0 {
				t.Errorf("the current partition %d holds %d bytes after the rotation of the last round: want it truncated", cur, sizes[cur])
			}
			var rotations int
			if err := db.QueryRow(`SELECT gen FROM rot_effects_rotation`).Scan(&rotations); err != nil {
				t.Fatal(err)
			}
			if rotations != st.gen.Load() {
				t.Errorf("the store's generation %d is not the table's %d", st.gen.Load(), rotations)
			}
		}
		return buffers
	}
	rotated := measure(20 * time.Millisecond)
	single := measure(-1)
	// Not rotated, the look-up reads the dead rows of every round (VACUUM frees none of them
	// behind the hold: without it, it would read a page or two). Rotated, of the two latest
	// rounds at most: behind an eight-minute hold, two RotateEvery of traffic instead of eight
	// minutes of it. Measured: 27 buffers rotated, 98 not (85 and 309 before the effects' pages
	// were half filled, migration 022, which made the relay's leases HOT: fewer dead entries).
	if single < rounds*perRound/50 {
		t.Fatalf("not rotated: the first pending effect read %d buffers, want the dead rows of every round: the test holds no horizon", single)
	}
	if bound := 2*single/rounds + 20; rotated > bound {
		t.Errorf("rotated: the first pending effect read %d buffers, want at most %d (the dead rows of two rounds; not rotated, of %d rounds: %d)", rotated, bound, rounds, single)
	}
}

// rotateNow makes st look at the rotation now, as if RotateEvery had passed, and fails the test
// on an error.
func rotateNow(t *testing.T, st *inline) {
	t.Helper()
	time.Sleep(5 * time.Millisecond) // past RotateEvery (1 ms) since the last rotation
	st.lastRotate.Store(0)
	if err := st.rotate(context.Background()); err != nil {
		t.Fatal(err)
	}
}

// effectRows returns every effect row of "rot_" but its partition, as JSON, in id order, and the
// partition each is in.
func effectRows(t *testing.T, db *sql.DB) ([]string, []int) {
	t.Helper()
	rows, err := db.Query(`SELECT (to_jsonb(e) - 'gen')::text, gen FROM rot_effects_all e ORDER BY id`)
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	var out []string
	var gens []int
	for rows.Next() {
		var s string
		var g int
		if err := rows.Scan(&s, &g); err != nil {
			t.Fatal(err)
		}
		out, gens = append(out, s), append(gens, g)
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	return out, gens
}

// TestRotationMovesPendingEffectsWithTheirState: the effects still pending in the partition that
// is emptied (parked, backing off after failures, leased by a claim, waiting behind those on
// their key) are moved into the current one with their ids and every column as it was; the
// relay then sends them in the order it would have.
func TestRotationMovesPendingEffectsWithTheirState(t *testing.T) {
	db := pgtest.DB(t)
	ctx := context.Background()
	st := rotationStore(t, db, time.Millisecond)
	parked := record(t, st, db, "parked", "p", 1)[0]
	backoff := record(t, st, db, "backoff", "b", 2)
	leased := record(t, st, db, "leased", "l", 3)
	if _, err := db.Exec(`UPDATE rot_effects_all SET parked_at = now(), attempts = 5, failures = 5, last_error = 'refused', failed_at = now()
		WHERE id = $1`, parked); err != nil {
		t.Fatal(err)
	}
	if err := st.EffectRecordFailures(ctx, outboxdriver.EffectFailure{StoreID: backoff[0], Reason: "down", Counted: true, RetryAfter: time.Hour}); err != nil {
		t.Fatal(err)
	}
	c, err := st.EffectClaimDue(ctx, outboxdriver.EffectClaimParams{Limit: 100, MaxBytes: 1 << 20, Lease: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	if len(c.Effects) != len(leased) || c.Effects[0].StoreID != leased[0] {
		t.Fatalf("claimed %+v, want the leased unit's (%v)", c.Effects, leased)
	}
	// The move names the columns: one added to the table must be added to it.
	var columns string
	if err := db.QueryRow(`SELECT string_agg(column_name, ', ' ORDER BY ordinal_position) FROM information_schema.columns
		WHERE table_name = 'rot_effects_all' AND column_name <> 'gen'`).Scan(&columns); err != nil {
		t.Fatal(err)
	}
	if want := strings.Join(strings.Fields(effectColumnList), " "); columns != want {
		t.Fatalf("the effects table's columns are %s; the rotation moves %s", columns, want)
	}
	before, gens := effectRows(t, db)
	for i, g := range gens {
		if g != 0 {
			t.Fatalf("row %d in partition %d before any rotation", i, g)
		}
	}
	// Rotations until partition 0 is emptied (into 2, the current one then), each with an effect
	// written in the current partition (an idle one is not rotated).
	for i := 0; ; i++ {
		if i == 4 {
			t.Fatal("partition 0 not emptied after 4 rotations")
		}
		record(t, st, db, fmt.Sprint("later", i), "later", 1)
		prev := st.gen.Load()
		rotateNow(t, st)
		if prev == 2 && st.gen.Load() == 0 {
			break
		}
	}
	after, gens := effectRows(t, db)
	if sizes := partitionSizes(t, db); sizes[0] != 0 {
		t.Errorf("partition 0 holds %d bytes after it was emptied", sizes[0])
	}
	if len(after) < len(before) {
		t.Fatalf("%d rows after the rotations, want the %d before and the later ones:\n%s", len(after), len(before), strings.Join(after, "\n"))
	}
	for i, row := range before {
		if after[i] != row {
			t.Errorf("moved row changed:\nbefore %s\nafter  %s", row, after[i])
		}
		if gens[i] != 2 {
			t.Errorf("row %s in partition %d, want 2 (the current one when 0 was emptied)", row, gens[i])
		}
	}
	// The relay sends them as before: the lease and the backoff end, the parked effect stays.
	if _, err := db.Exec(`UPDATE rot_effects_all SET next_attempt_at = now() WHERE next_attempt_at IS NOT NULL`); err != nil {
		t.Fatal(err)
	}
	c, err = st.EffectClaimDue(ctx, outboxdriver.EffectClaimParams{Limit: 100, MaxBytes: 1 << 20, Lease: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	byKey := map[string][]int64{}
	for _, e := range c.Effects {
		byKey[e.OrderingKey] = append(byKey[e.OrderingKey], e.StoreID)
	}
	if fmt.Sprint(byKey["l"]) != fmt.Sprint(leased) || fmt.Sprint(byKey["b"]) != fmt.Sprint(backoff) || len(byKey["p"]) != 0 {
		t.Errorf("claimed after the move: %v, want l %v, b %v in id order and nothing of the parked key", byKey, leased, backoff)
	}
}

// TestRotationKeepsTheRowsOfAWriterWithAnOldGeneration: a process whose generation is out of
// date inserts into the partition being emptied. The emptying waits for its transaction (the
// partition's exclusive lock) and moves its row, or, after its lock timeout, gives up and leaves
// the partition as it is; no row is lost either way, and none is moved twice. Then many such
// writers insert while the partitions rotate around them.
func TestRotationKeepsTheRowsOfAWriterWithAnOldGeneration(t *testing.T) {
	db := pgtest.DB(t)
	ctx := context.Background()
	st := rotationStore(t, db, time.Millisecond)
	stale := rotationStore(t, db, -1) // never reads the generation: it writes into partition 0
	record(t, st, db, "first", "f", 1)
	rotateNow(t, st) // 0 -> 1
	record(t, st, db, "second", "s", 1)
	rotateNow(t, st) // 1 -> 2; next to empty: 0
	record(t, st, db, "third", "t", 1)

	// The writer's transaction is open while the rotation locks partition 0: with the usual
	// lock timeout it gives up; with a longer one it waits, and moves the row once committed.
	for _, wait := range []bool{false, true} {
		src := outboxdriver.Source{Consumer: "unit", ID: fmt.Sprint("stale ", wait)}
		tx, err := db.BeginTx(ctx, nil)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := stale.EffectInsert(ctx, tx, src, []outboxdriver.Effect{{Source: src, Kind: outboxdriver.KindPublish,
			Topic: "t", UUID: src.ID, Payload: []byte("p"), OrderingKey: "stale"}}); err != nil {
			t.Fatal(err)
		}
		if !wait {
			rotateNow(t, st)
			if got := st.gen.Load(); got != 2 {
				t.Fatalf("rotated to %d while a writer held partition 0", got)
			}
			if err := tx.Commit(); err != nil {
				t.Fatal(err)
			}
			continue
		}
		done := rotationWaitingForALock(t, db, st)
		if err := tx.Commit(); err != nil {
			t.Fatal(err)
		}
		if err := <-done; err != nil {
			t.Fatal(err)
		}
		st.rotateLock = rotateLockTimeout
	}
	if got := st.gen.Load(); got != 0 {
		t.Fatalf("generation %d after the writer committed, want 0", got)
	}
	rows, gens := effectRows(t, db)
	if len(rows) != 5 {
		t.Fatalf("%d rows, want the three recorded and the two of the writer:\n%s", len(rows), strings.Join(rows, "\n"))
	}
	for i, row := range rows {
		if strings.Contains(row, "stale") && gens[i] != 2 {
			t.Errorf("the writer's row %s is in partition %d, want 2 (moved)", row, gens[i])
		}
	}

	// Writers that never learn the generation insert while the partitions rotate around them:
	// each writes at least `each` rows and goes on until three rotations happened while it wrote
	// (a loaded machine may run few rotations in the time of 40 rows), or a minute passed.
	const writers, each = 4, 40
	var rotated atomic.Int32
	var written atomic.Int64
	until := time.Now().Add(time.Minute)
	errs := make(chan error, writers)
	for w := range writers {
		go func() {
			for i := 0; i < each || rotated.Load() < 3 && time.Now().Before(until); i++ {
				src := outboxdriver.Source{Consumer: "unit", ID: fmt.Sprintf("w%d-%d", w, i)}
				err := func() error {
					tx, err := db.BeginTx(ctx, nil)
					if err != nil {
						return err
					}
					defer func() { _ = tx.Rollback() }()
					if _, err := stale.EffectInsert(ctx, tx, src, []outboxdriver.Effect{{Source: src, Kind: outboxdriver.KindPublish,
						Topic: "t", UUID: src.ID, Payload: []byte("p"), OrderingKey: src.ID}}); err != nil {
						return err
					}
					return tx.Commit()
				}()
				if err != nil {
					errs <- err
					return
				}
				written.Add(1)
			}
			errs <- nil
		}()
	}
	rotations := 0
	for range writers {
		for done := false; !done; {
			select {
			case err := <-errs:
				if err != nil {
					t.Fatal(err)
				}
				done = true
			default:
				before := st.gen.Load()
				record(t, st, db, fmt.Sprint("r", rotations), "r", 1)
				rotateNow(t, st)
				if st.gen.Load() != before {
					rotations++
					rotated.Add(1)
				}
			}
		}
	}
	var count, distinct int
	if err := db.QueryRow(`SELECT count(*), count(DISTINCT id) FROM rot_effects_all WHERE source_id LIKE 'w%'`).Scan(&count, &distinct); err != nil {
		t.Fatal(err)
	}
	t.Logf("%d rotations while the writers wrote", rotations)
	if n := written.Load(); int64(count) != n || distinct != count || n < writers*each {
		t.Errorf("%d rows of the writers (%d distinct ids), want the %d they committed (at least %d)", count, distinct, n, writers*each)
	}
	if rotations < 3 {
		t.Errorf("%d rotations while the writers wrote, want at least 3 (partition 0 emptied once)", rotations)
	}
}

// TestMigrationToRotatedEffectsKeepsPendingEffects: tables at migration 019 with effects pending
// (due, parked, and a key's effects behind a failed one) are upgraded by 020: the effects stay,
// with their ids, in partition 0, new ones get later ids, and the relay sends them all in order.
func TestMigrationToRotatedEffectsKeepsPendingEffects(t *testing.T) {
	db := pgtest.DB(t)
	ctx := context.Background()
	ms, err := Migrations("", "rot_")
	if err != nil {
		t.Fatal(err)
	}
	n, err := namesOf("", "rot_")
	if err != nil {
		t.Fatal(err)
	}
	if err := store.Migrate(ctx, db, migrateQueries(n), beforeRotation(t, ms)); err != nil {
		t.Fatal(err)
	}
	var ids []int64
	for i := range 6 {
		var id int64
		if err := db.QueryRow(`INSERT INTO rot_effects (source_consumer, source_id, seq, kind, topic, uuid, payload, metadata, ordering_key, created_at)
			VALUES ('unit', 'old', $1::int, 'publish', 't', 'old-' || $1::int, '\x00', '', CASE WHEN $1::int < 4 THEN 'k' ELSE 'p' END, now() - interval '1 minute')
			RETURNING id`, i).Scan(&id); err != nil {
			t.Fatal(err)
		}
		ids = append(ids, id)
	}
	if _, err := db.Exec(`UPDATE rot_effects SET parked_at = now(), attempts = 3, last_error = 'refused' WHERE id = $1`, ids[5]); err != nil {
		t.Fatal(err)
	}
	var kind string
	if err := db.QueryRow(`SELECT relkind::text FROM pg_class WHERE relname = 'rot_effects'`).Scan(&kind); err != nil || kind != "r" {
		t.Fatalf("at 022 the effects table is of relkind %q (%v), want a plain table", kind, err)
	}

	st := rotationStore(t, db, time.Millisecond) // Migrate applies 023
	rows, gens := effectRows(t, db)
	if len(rows) != len(ids) {
		t.Fatalf("%d effects after the migration, want %d", len(rows), len(ids))
	}
	for i, g := range gens {
		if g != 0 || !strings.Contains(rows[i], fmt.Sprintf(`"id": %d,`, ids[i])) {
			t.Errorf("effect %d after the migration: %s in partition %d, want id %d in 0", i, rows[i], g, ids[i])
		}
	}
	newer := record(t, st, db, "new", "k", 1)
	if newer[0] <= ids[len(ids)-1] {
		t.Errorf("an effect recorded after the migration has id %d, not after the old ones' (%d)", newer[0], ids[len(ids)-1])
	}
	var sent []int64
	for after := int64(0); ; {
		c, err := st.EffectClaimDue(ctx, outboxdriver.EffectClaimParams{Limit: 100, MaxBytes: 1 << 20, Lease: time.Minute, After: after})
		if err != nil {
			t.Fatal(err)
		}
		for _, e := range c.Effects {
			sent = append(sent, e.StoreID)
			if err := st.EffectMarkDispatched(ctx, outboxdriver.DispatchMark{Source: e.Source, StoreIDs: []int64{e.StoreID}}); err != nil {
				t.Fatal(err)
			}
		}
		if len(c.Effects) == 0 && c.Next == 0 {
			break
		}
		after = c.Next
	}
	if want := fmt.Sprint(append(append([]int64(nil), ids[:5]...), newer[0])); fmt.Sprint(sent) != want {
		t.Errorf("sent %v, want %v (the parked one stays)", sent, want)
	}
	rows, _ = effectRows(t, db)
	if len(rows) != 1 || !strings.Contains(rows[0], `"parked_at": "`) {
		t.Errorf("left after sending: %v, want the parked effect", rows)
	}
}

// TestRotatedEffectsNamesFitTheLongestPrefix: with the longest prefix allowed (40 bytes) every
// name migration 023 creates fits PostgreSQL's 63 bytes (a longer one would be cut, and two cut
// names could collide), and the rotation runs.
func TestRotatedEffectsNamesFitTheLongestPrefix(t *testing.T) {
	db := pgtest.DB(t)
	prefix := strings.Repeat("p", 40)
	st, err := Driver{RotateEvery: time.Millisecond}.Open(db, outboxdriver.StoreOptions{TablePrefix: prefix})
	if err != nil {
		t.Fatal(err)
	}
	if err := st.Migrate(context.Background()); err != nil {
		t.Fatal(err)
	}
	for _, name := range []string{"effects", "effects_all", "effects_1", "effects_2", "effects_rotation", "effects_rotation_one",
		"effects_pending_source", "effects_pending_key", "effects_parked", "effects_due", "effects_gen", "effects_pkey",
		"effects_all_source", "effects_all_key", "effects_all_parked", "effects_all_due",
		"effects_2_pkey", "effects_2_source", "effects_2_key", "effects_2_parked", "effects_2_due"} {
		var found bool
		if err := db.QueryRow(`SELECT EXISTS (SELECT 1 FROM pg_class WHERE relname = $1)
			OR EXISTS (SELECT 1 FROM pg_proc WHERE proname = $1) OR EXISTS (SELECT 1 FROM pg_constraint WHERE conname = $1)`,
			prefix+name).Scan(&found); err != nil {
			t.Fatal(err)
		}
		if !found {
			t.Errorf("%s%s (%d bytes) not found under its full name", prefix, name, len(prefix+name))
		}
	}
	in := st.(*inline)
	src := outboxdriver.Source{Consumer: "unit", ID: "long"}
	for range 2 {
		tx, err := db.Begin()
		if err != nil {
			t.Fatal(err)
		}
		if _, err := in.EffectInsert(context.Background(), tx, src, []outboxdriver.Effect{{Source: src, Kind: outboxdriver.KindPublish,
			Topic: "t", UUID: "u", Payload: []byte("p"), OrderingKey: "k"}}); err != nil {
			t.Fatal(err)
		}
		if err := tx.Commit(); err != nil {
			t.Fatal(err)
		}
		rotateNow(t, in)
	}
	if got := in.gen.Load(); got != 2 {
		t.Errorf("generation %d after two rotations, want 2", got)
	}
}

// rotationWaitingForALock starts a rotation of st that waits for a lock on partition 0 (a
// writer's), and returns once it waits; its error comes on the channel once it ends.
func rotationWaitingForALock(t *testing.T, db *sql.DB, st *inline) <-chan error {
	t.Helper()
	st.rotateLock = 10 * time.Second
	done := make(chan error, 1)
	go func() {
		time.Sleep(5 * time.Millisecond)
		st.lastRotate.Store(0)
		done <- st.rotate(context.Background())
	}()
	deadline := time.Now().Add(10 * time.Second)
	for {
		var waiting bool
		if err := db.QueryRow(`SELECT EXISTS (SELECT 1 FROM pg_locks l JOIN pg_class c ON c.oid = l.relation
			WHERE c.relname = 'rot_effects' AND NOT l.granted)`).Scan(&waiting); err != nil {
			t.Fatal(err)
		}
		if waiting {
			return done
		}
		if time.Now().After(deadline) {
			t.Fatal("the rotation did not wait for the writer's lock")
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// A database whose sessions default to REPEATABLE READ (ALTER DATABASE ... SET
// default_transaction_isolation) had the rotation's snapshot taken by its first statement,
// before the lock it waits for: the row of a writer that committed meanwhile was not in it, was
// not moved, and was truncated with the partition: never sent. The store's own transactions
// are READ COMMITTED whatever the default.
func TestRotationUnderRepeatableReadKeepsAWritersRow(t *testing.T) {
	db := repeatableReadDB(t)
	ctx := context.Background()
	st := rotationStore(t, db, time.Millisecond)
	stale := rotationStore(t, db, -1) // never reads the generation: it writes into partition 0
	record(t, st, db, "first", "f", 1)
	rotateNow(t, st) // 0 -> 1
	record(t, st, db, "second", "s", 1)
	rotateNow(t, st) // 1 -> 2; next to empty: 0
	record(t, st, db, "third", "t", 1)
	src := outboxdriver.Source{Consumer: "unit", ID: "stale"}
	tx, err := db.BeginTx(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := stale.EffectInsert(ctx, tx, src, []outboxdriver.Effect{{Source: src, Kind: outboxdriver.KindPublish,
		Topic: "t", UUID: src.ID, Payload: []byte("p"), OrderingKey: "stale"}}); err != nil {
		t.Fatal(err)
	}
	done := rotationWaitingForALock(t, db, st)
	if err := tx.Commit(); err != nil {
		t.Fatal(err)
	}
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	rows, gens := effectRows(t, db)
	for i, row := range rows {
		if strings.Contains(row, "stale") {
			if gens[i] != 2 {
				t.Errorf("the writer's row %s is in partition %d, want 2 (moved)", row, gens[i])
			}
			return
		}
	}
	t.Fatalf("the writer's committed row is gone (truncated with its partition):\n%s", strings.Join(rows, "\n"))
}

// The sweep's and the rotation's turns survive a wall clock stepped back: the last turn then
// lies in the future, and they stopped until the clock caught up with it (an hour back, an hour
// without a sweep of inline effects left behind by a crash, and without rotations).
func TestTurnAfterTheClockSteppedBack(t *testing.T) {
	var last atomic.Int64
	last.Store(time.Now().Add(time.Hour).UnixNano())
	if !turn(&last, time.Millisecond) {
		t.Fatal("no turn with the last one an hour ahead of the clock")
	}
	if turn(&last, time.Hour) {
		t.Fatal("a turn again at once")
	}
}

// Processes that record effects and run no relay (an API's) never read the generation: they
// write into partition 0 for good. The relay, in a worker that writes none, rotated once, then
// found the current partition empty and took the database for idle: partition 0 was never
// emptied again, and behind a held horizon the claims walked every dead row written to it.
// Now a rotation is due while any partition holds pages; an idle database still stops once
// all three are emptied.
func TestRotationGoesOnWhileOnlyStaleWritersWrite(t *testing.T) {
	db := pgtest.DB(t)
	st := rotationStore(t, db, time.Millisecond) // the worker: the relay, no effects of its own
	stale := rotationStore(t, db, -1)            // the API: writes into partition 0
	record(t, st, db, "first", "f", 1)
	rotateNow(t, st) // 0 -> 1
	// The API writes, the relay sends (its claims rotate too, when due) and rotates: partition 0
	// is emptied after the API wrote into it, in one turn or another.
	emptied := false
	for i := range 4 {
		record(t, stale, db, fmt.Sprint("api-", i), "a", 50)
		sendAll(t, st)
		rotateNow(t, st)
		emptied = emptied || partitionSizes(t, db)[0] == 0
	}
	if !emptied {
		t.Errorf("partition 0, where the API writes, was never emptied (sizes %v, partition %d current)", partitionSizes(t, db), st.gen.Load())
	}
	// Idle: nothing written; at most two more rotations, and then none.
	for range 3 {
		sendAll(t, st)
		rotateNow(t, st)
	}
	gen := st.gen.Load()
	rotateNow(t, st)
	if got := st.gen.Load(); got != gen {
		t.Errorf("an idle database rotated again (%d -> %d) with every partition empty (%v)", gen, got, partitionSizes(t, db))
	}
}

// The pending rows of the partition to empty are copied under its exclusive lock, with every
// statement on the effects table waiting: bounded by their bytes too, not their number alone
// (10,000 rows of 64 KB were 640 MB copied under the lock, and past rotateTimeout rolled back and
// tried again at every turn). Over the bound the rotation is put off, said once, and done once
// the rows are sent.
func TestRotationPutOffByThePendingBytes(t *testing.T) {
	db := pgtest.DB(t)
	st := rotationStore(t, db, time.Millisecond)
	st.moveBytes = 64 << 10 // 64 KB here
	big := make([]byte, 8<<10)
	_, _ = rand.Read(big) // stored as they are: zeros would compress to nothing
	for i := range 10 {   // 80 KB pending in partition 0
		src := outboxdriver.Source{Consumer: "unit", ID: fmt.Sprint("big-", i)}
		tx, err := db.Begin()
		if err != nil {
			t.Fatal(err)
		}
		if _, err := st.EffectInsert(context.Background(), tx, src, []outboxdriver.Effect{{Source: src, Kind: outboxdriver.KindPublish,
			Topic: "t", UUID: src.ID, Payload: big, OrderingKey: src.ID}}); err != nil {
			t.Fatal(err)
		}
		if err := tx.Commit(); err != nil {
			t.Fatal(err)
		}
	}
	rotateNow(t, st) // 0 -> 1
	record(t, st, db, "second", "s", 1)
	rotateNow(t, st) // 1 -> 2; next to empty: 0, with the 80 KB
	record(t, st, db, "third", "t", 1)
	time.Sleep(5 * time.Millisecond)
	st.lastRotate.Store(0)
	err := st.rotate(context.Background())
	if err == nil || !strings.Contains(err.Error(), "MB of them") {
		t.Errorf("rotation over 80 KB of pending rows (bound 64 KB): %v; want it put off, said", err)
	}
	if got := st.gen.Load(); got != 2 {
		t.Fatalf("rotated to %d with 80 KB pending in the partition to empty", got)
	}
	sendAll(t, st) // its claims rotate too, when due
	rotateNow(t, st)
	if got := st.gen.Load(); got == 2 {
		t.Error("no rotation once the rows were sent")
	}
}
