package postgres

import (
	"context"
	"database/sql"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/watermill-outbox/outbox/internal/pgtest"
	"github.com/watermill-outbox/outbox/outboxdriver"
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
	ctx := context.Background()
	src := outboxdriver.Source{Consumer: "unit", ID: unit}
	effects := make([]outboxdriver.Effect, count)
	for i := range effects {
		effects[i] = outboxdriver.Effect{Source: src, Seq: i, Kind: outboxdriver.KindPublish, Topic: "t",
			UUID: fmt.Sprintf("%s-%d", unit, i), Payload: []byte("p"), OrderingKey: key}
	}
	tx, err := db.BeginTx(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback() }()
	if _, err := st.EffectInsert(ctx, tx, src, effects); err != nil {
		t.Fatal(err)
	}
	if err := tx.Commit(); err != nil {
		t.Fatal(err)
	}
	ids := make([]int64, count)
	for i, e := range effects {
		ids[i] = e.StoreID
	}
	return ids
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
	if err := db.QueryRow(`SELECT pg_relation_size('rot_effects_0'), pg_relation_size('rot_effects_1'),
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
		SELECT min(id) FROM rot_effects WHERE dispatched_at IS NULL AND parked_at IS NULL`), "\n")
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
// as it was before migration 020), it reads every round's.
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
		if _, err := db.Exec(`VACUUM rot_effects`); err != nil {
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
	// minutes of it. Measured: 85 buffers rotated, 309 not.
	if single < rounds*perRound/20 {
		t.Fatalf("not rotated: the first pending effect read %d buffers, want the dead rows of every round: the test holds no horizon", single)
	}
	if bound := 2*single/rounds + 20; rotated > bound {
		t.Errorf("rotated: the first pending effect read %d buffers, want at most %d (the dead rows of two rounds; not rotated, of %d rounds: %d)", rotated, bound, rounds, single)
	}
}
