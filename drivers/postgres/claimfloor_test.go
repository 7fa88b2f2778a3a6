package postgres

import (
	"context"
	"database/sql"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/watermill-outbox/outbox/internal/pgtest"
	"github.com/watermill-outbox/outbox/outboxdriver"
)

// claimFront makes one claim from the front (After 0, no grace), as a relay pass begins, marks
// what it took dispatched, and returns the ids it took.
func claimFront(t *testing.T, st *inline) []int64 {
	t.Helper()
	ctx := context.Background()
	c, err := st.EffectClaimDue(ctx, outboxdriver.EffectClaimParams{Limit: 500, MaxBytes: 1 << 20, Lease: time.Minute})
	if err != nil {
		t.Fatal(err)
	}
	var ids []int64
	marks := map[outboxdriver.Source][]int64{}
	for _, e := range c.Effects {
		ids = append(ids, e.StoreID)
		marks[e.Source] = append(marks[e.Source], e.StoreID)
	}
	for src, ids := range marks {
		if err := st.EffectMarkDispatched(ctx, outboxdriver.DispatchMark{Source: src, StoreIDs: ids}); err != nil {
			t.Fatal(err)
		}
	}
	return ids
}

// beginLate inserts one effect of unit at the boundary in a transaction it leaves open, and
// returns the effect's id and the transaction.
func beginLate(t *testing.T, st *inline, db *sql.DB, unit string) (int64, *sql.Tx) {
	t.Helper()
	ctx := context.Background()
	tx, err := db.BeginTx(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = tx.Rollback() })
	src := outboxdriver.Source{Consumer: "unit", ID: unit}
	e := []outboxdriver.Effect{{Source: src, Kind: outboxdriver.KindPublish, Topic: "t", UUID: unit, Payload: []byte("p"), OrderingKey: unit}}
	if _, err := st.EffectInsert(ctx, tx, src, e); err != nil {
		t.Fatal(err)
	}
	return e[0].StoreID, tx
}

// TestClaimFloorWaitsForALateCommit: a transaction takes an effect id, then units with greater
// ids commit and are sent, claim after claim, while it stays open. The claims' floor moves past
// what they sent but not past the open transaction's id: once it commits, below ids already
// sent, the next claim from the front takes its effect.
func TestClaimFloorWaitsForALateCommit(t *testing.T) {
	db := pgtest.DB(t)
	st := rotationStore(t, db, -1)
	first := record(t, st, db, "u0", "k", 1)[0]
	for range 3 {
		claimFront(t, st)
	}
	if f := st.EffectClaimFloor(); f < first {
		t.Fatalf("floor %d after the effect %d was sent and two claims more: want it past it (the floor does not move)", f, first)
	}
	late, tx := beginLate(t, st, db, "late")
	var sent []int64
	for u := range 4 {
		ids := record(t, st, db, fmt.Sprint("u", u+1), "k", 2)
		sent = append(sent, claimFront(t, st)...)
		if !slices.Contains(sent, ids[1]) {
			t.Fatalf("unit u%d's effects %v not sent: sent %v", u+1, ids, sent)
		}
		if f := st.EffectClaimFloor(); f >= late {
			t.Fatalf("floor %d while the transaction of effect %d is open: the effect would not be claimed once it commits", f, late)
		}
	}
	if err := tx.Commit(); err != nil {
		t.Fatal(err)
	}
	if got := claimFront(t, st); !slices.Contains(got, late) {
		t.Fatalf("the claim after the late commit took %v, want the late effect %d (floor %d)", got, late, st.EffectClaimFloor())
	}
	claimFront(t, st)
	claimFront(t, st)
	if f := st.EffectClaimFloor(); f < late {
		t.Errorf("floor %d once everything was sent and the late transaction ended: want it past %d", f, late)
	}
}

// TestClaimFloorUnparked: an effect parked below the floor (the claims pass parked effects) and
// then unparked through the Store is pending again below where the claims look: the unpark
// lowers the floor and the next claim from the front takes it.
func TestClaimFloorUnparked(t *testing.T) {
	ctx := context.Background()
	db := pgtest.DB(t)
	st := rotationStore(t, db, -1)
	parked := record(t, st, db, "p", "kp", 1)[0]
	c, err := st.EffectClaimDue(ctx, outboxdriver.EffectClaimParams{Limit: 10, MaxBytes: 1 << 20, Lease: time.Minute})
	if err != nil || len(c.Effects) != 1 || c.Effects[0].StoreID != parked {
		t.Fatalf("claim %+v, %v: want the effect %d", c.Effects, err, parked)
	}
	if err := st.EffectRecordFailures(ctx, outboxdriver.EffectFailure{StoreID: parked, Reason: "poison", Counted: true, Park: true}); err != nil {
		t.Fatal(err)
	}
	for u := range 3 {
		record(t, st, db, fmt.Sprint("u", u), "k", 2)
		if got := claimFront(t, st); slices.Contains(got, parked) {
			t.Fatalf("the parked effect %d claimed", parked)
		}
	}
	if f := st.EffectClaimFloor(); f <= parked {
		t.Fatalf("floor %d: want it past the parked effect %d (the test would not tell)", f, parked)
	}
	if n, err := st.EffectUnpark(ctx, []int64{parked}); err != nil || n != 1 {
		t.Fatalf("unpark: %d, %v", n, err)
	}
	if f := st.EffectClaimFloor(); f >= parked {
		t.Errorf("floor %d after the effect %d was unparked: want it below", f, parked)
	}
	if got := claimFront(t, st); !slices.Contains(got, parked) {
		t.Fatalf("the claim after the unpark took %v, want the unparked effect %d", got, parked)
	}
}

// TestClaimFloorAcrossRotations: an effect that backs off after a failure stays pending while
// the partitions rotate (it is moved with its id) and units after it are sent: the floor never
// passes it, and once its retry time has come a claim from the front takes it.
func TestClaimFloorAcrossRotations(t *testing.T) {
	ctx := context.Background()
	db := pgtest.DB(t)
	st := rotationStore(t, db, time.Millisecond)
	back := record(t, st, db, "b", "kb", 1)[0]
	c, err := st.EffectClaimDue(ctx, outboxdriver.EffectClaimParams{Limit: 10, MaxBytes: 1 << 20, Lease: time.Minute})
	if err != nil || len(c.Effects) != 1 {
		t.Fatalf("claim %+v, %v: want the effect %d", c.Effects, err, back)
	}
	retry := 1500 * time.Millisecond
	failed := time.Now()
	if err := st.EffectRecordFailures(ctx, outboxdriver.EffectFailure{StoreID: back, Reason: "down", Counted: true, RetryAfter: retry}); err != nil {
		t.Fatal(err)
	}
	startGen, gens := st.gen.Load(), map[int]bool{}
	for u := 0; ; u++ {
		ids := record(t, st, db, fmt.Sprint("u", u), "k", 1)
		time.Sleep(5 * time.Millisecond) // past RotateEvery: the claim from the front rotates
		got := claimFront(t, st)
		gens[st.gen.Load()] = true
		if f := st.EffectClaimFloor(); f >= back {
			t.Fatalf("floor %d passed the effect %d, which backs off", f, back)
		}
		if slices.Contains(got, back) {
			if time.Since(failed) < retry {
				t.Fatalf("the effect %d claimed before its retry time", back)
			}
			break
		}
		if !slices.Contains(got, ids[0]) {
			t.Fatalf("unit u%d's effect %d not sent: %v", u, ids[0], got)
		}
		if time.Since(failed) > retry+5*time.Second {
			t.Fatalf("the effect %d that backed off not claimed %s after its retry time", back, time.Since(failed)-retry)
		}
	}
	if len(gens) < 3 {
		t.Errorf("the claims saw partitions %v (from %d): want rotations through all three", gens, startGen)
	}
	claimFront(t, st)
	claimFront(t, st)
	if f := st.EffectClaimFloor(); f < back {
		t.Errorf("floor %d once the effect %d was sent: want it past it", f, back)
	}
}

// TestClaimFloorTwoRelays: two instances claim from the same tables, each with its own floor,
// while units commit in order and out of order: every effect is taken once, none is left.
func TestClaimFloorTwoRelays(t *testing.T) {
	db := pgtest.DB(t)
	a := rotationStore(t, db, 2*time.Millisecond)
	b := rotationStore(t, db, 2*time.Millisecond)
	taken := map[int64]int{}
	var want []int64
	var open []*sql.Tx
	for u := range 40 {
		if u%7 == 3 {
			id, tx := beginLate(t, a, db, fmt.Sprint("late", u))
			want = append(want, id)
			open = append(open, tx)
		}
		if u%7 == 6 && len(open) > 0 {
			if err := open[0].Commit(); err != nil {
				t.Fatal(err)
			}
			open = open[1:]
		}
		want = append(want, record(t, a, db, fmt.Sprint("u", u), fmt.Sprint("k", u%3), 2)...)
		st := a
		if u%2 == 1 {
			st = b
		}
		for _, id := range claimFront(t, st) {
			taken[id]++
		}
	}
	for _, tx := range open {
		if err := tx.Commit(); err != nil {
			t.Fatal(err)
		}
	}
	for range 3 {
		for _, st := range []*inline{a, b} {
			for _, id := range claimFront(t, st) {
				taken[id]++
			}
		}
	}
	for _, id := range want {
		if taken[id] != 1 {
			t.Errorf("effect %d taken %d times, want once", id, taken[id])
		}
	}
	if len(taken) != len(want) {
		t.Errorf("%d effects taken, want the %d recorded", len(taken), len(want))
	}
	var left int
	if err := db.QueryRow(`SELECT count(*) FROM rot_effects_all`).Scan(&left); err != nil || left != 0 {
		t.Errorf("%d effects left pending (%v)", left, err)
	}
}

// TestClaimFloorBoundsTheClaimBehindAHeldHorizon: behind a held xmin horizon, the entries of the
// effects sent and deleted stay in the indexes. A claim from the start walks all of them (from
// the front to the first pending effect, and from the back to the last); from the floor, the
// claims of a relay walk what was sent since the claim before. Not rotated, so that every round
// stays in the table.
func TestClaimFloorBoundsTheClaimBehindAHeldHorizon(t *testing.T) {
	const rounds, perRound = 8, 400
	ctx := context.Background()
	db := pgtest.DB(t)
	st := rotationStore(t, db, -1)
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
	var last int64
	for r := range rounds {
		for u := range perRound / 4 {
			last = record(t, st, db, fmt.Sprintf("r%d-u%d", r, u), fmt.Sprintf("k%d", u%16), 4)[3]
		}
		if sent := sendAll(t, st); sent != perRound {
			t.Fatalf("round %d: %d effects sent, want %d", r, sent, perRound)
		}
	}
	sendAll(t, st)
	pending := record(t, st, db, "pending", "kp", 1)[0]
	floor := st.EffectClaimFloor()
	if floor < last-perRound {
		t.Fatalf("floor %d, last effect sent %d: want it within the last round", floor, last)
	}
	names, err := NewNames(DefaultSchema, "rot_")
	if err != nil {
		t.Fatal(err)
	}
	q := queries(names, true, st.gen).EffectClaimDue
	var planOf func(int64) string
	buffers := func(floor int64) int {
		plan := planOf(floor)
		top := buffersRe.FindStringSubmatch(plan)
		if top == nil {
			t.Fatalf("no buffers in the plan:\n%s", plan)
		}
		return atoi(top[1]) + atoi(top[2])
	}
	planOf = func(floor int64) string {
		tx, err := db.BeginTx(ctx, nil)
		if err != nil {
			t.Fatal(err)
		}
		defer func() { _ = tx.Rollback() }()
		// A grace of an hour: the pending effect is not due, the claim takes nothing (an idle
		// relay's claim, the common one).
		rows, err := tx.QueryContext(ctx, `EXPLAIN (ANALYZE, BUFFERS, COSTS OFF) `+q,
			int64(time.Hour/time.Millisecond), 500, int64(1<<20), int64(60000), int64(0), int64(2000), "[]", floor)
		if err != nil {
			t.Fatal(err)
		}
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
		return strings.Join(lines, "\n")
	}
	fromStart, fromFloor := buffers(0), buffers(floor)
	t.Logf("%d effects sent behind the hold, floor %d, pending %d: the claim read %d buffers from the start, %d from the floor",
		rounds*perRound, floor, pending, fromStart, fromFloor)
	if fromStart < rounds*perRound/50 {
		t.Fatalf("from the start the claim read %d buffers: want the dead entries of every round, the test holds no horizon", fromStart)
	}
	if fromFloor > fromStart/3 {
		t.Errorf("from the floor the claim read %d buffers, from the start %d: want at most a third\n%s", fromFloor, fromStart, planOf(floor))
	}
}

// TestClaimFloorWaitsForAnXidAboveTheSnapshotsXmax: a snapshot's xmax is the last completed
// transaction ID plus one, not the next one to be handed out, so a transaction that took its ID
// after the last one that completed is running and above it. Here one (early) takes its ID, a
// second (late) takes the next and an effect id, and early takes a greater effect id and commits:
// late's ID is the xmax of the next claim's snapshot. That claim sends early's effect and proposes
// the floor below it, bounded by that xmax; the claim after it, whose xmin is late's ID, took the
// bound as passed and moved the floor past late's effect, which the claims from the front then
// did not see once late committed (until a rescan, 10 s later).
func TestClaimFloorWaitsForAnXidAboveTheSnapshotsXmax(t *testing.T) {
	ctx := context.Background()
	db := pgtest.DB(t)
	st := rotationStore(t, db, -1)
	var last int64
	for range 3 {
		last = record(t, st, db, "u0", "k0", 1)[0]
		claimFront(t, st)
	}
	// Claims until the floor is at the last effect: no candidate is left waiting.
	for i := 0; st.EffectClaimFloor() < last; i++ {
		if i == 5 {
			t.Fatalf("floor %d after 5 claims with nothing pending, want %d", st.EffectClaimFloor(), last)
		}
		claimFront(t, st)
	}
	early, err := db.BeginTx(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = early.Rollback() }()
	var earlyXid int64
	if err := early.QueryRow(`SELECT pg_current_xact_id()::text::bigint`).Scan(&earlyXid); err != nil {
		t.Fatal(err)
	}
	late, tx := beginLate(t, st, db, "late")
	src := outboxdriver.Source{Consumer: "unit", ID: "early"}
	e := []outboxdriver.Effect{{Source: src, Kind: outboxdriver.KindPublish, Topic: "t", UUID: "early", Payload: []byte("p"), OrderingKey: "early"}}
	if _, err := st.EffectInsert(ctx, early, src, e); err != nil {
		t.Fatal(err)
	}
	if err := early.Commit(); err != nil {
		t.Fatal(err)
	}
	var xmax, lateXid int64
	if err := db.QueryRow(`SELECT pg_snapshot_xmax(pg_current_snapshot())::text::bigint`).Scan(&xmax); err != nil {
		t.Fatal(err)
	}
	if err := tx.QueryRow(`SELECT pg_current_xact_id()::text::bigint`).Scan(&lateXid); err != nil {
		t.Fatal(err)
	}
	if xmax != lateXid {
		t.Fatalf("precondition: the snapshot's xmax %d is not the open transaction's ID %d (early's %d): another transaction completed meanwhile", xmax, lateXid, earlyXid)
	}
	if got := claimFront(t, st); !slices.Contains(got, e[0].StoreID) {
		t.Fatalf("the claim took %v, want early's effect %d", got, e[0].StoreID)
	}
	claimFront(t, st)
	if f := st.EffectClaimFloor(); f >= late {
		t.Fatalf("floor %d while the transaction of effect %d is open (its ID was the claim's snapshot's xmax)", f, late)
	}
	if err := tx.Commit(); err != nil {
		t.Fatal(err)
	}
	if got := claimFront(t, st); !slices.Contains(got, late) {
		t.Fatalf("the claim after the late commit took %v, want the late effect %d (floor %d)", got, late, st.EffectClaimFloor())
	}
}
