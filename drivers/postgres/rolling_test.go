package postgres

import (
	"context"
	"database/sql"
	"fmt"
	"io/fs"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/watermill-outbox/outbox/internal/pgtest"
	"github.com/watermill-outbox/outbox/outboxdriver"
	"github.com/watermill-outbox/outbox/store"
)

// migratedBeforeRotation migrates db's tables of prefix up to the migration before the rotation
// (022), as the version before left them.
func migratedBeforeRotation(t *testing.T, db *sql.DB, prefix string) []store.Migration {
	t.Helper()
	ms, err := Migrations("", prefix)
	if err != nil {
		t.Fatal(err)
	}
	n, err := namesOf("", prefix)
	if err != nil {
		t.Fatal(err)
	}
	if err := store.Migrate(context.Background(), db, migrateQueries(n), beforeRotation(t, ms)); err != nil {
		t.Fatal(err)
	}
	return ms
}

// beforeRotation returns the migrations before the rotation (023).
func beforeRotation(t *testing.T, ms []store.Migration) []store.Migration {
	t.Helper()
	for i, m := range ms {
		if m.Version == 23 {
			if m.Name != "effects_rotated" {
				t.Fatalf("migration 23 is %q, want the rotation", m.Name)
			}
			return ms[:i]
		}
	}
	t.Fatal("no migration 23 (the rotation)")
	return nil
}

// previousVersion is a Store of the version before migration 023: its statements name the effects
// table itself, as store.NewNames does; its insert returns xmin.
func previousVersion(t *testing.T, db *sql.DB, prefix string) *store.SQL {
	t.Helper()
	n, err := store.NewNames(DefaultSchema, prefix)
	if err != nil {
		t.Fatal(err)
	}
	migrations, err := fs.Sub(migrationFiles, "migrations")
	if err != nil {
		t.Fatal(err)
	}
	q := queries(n, false, new(Generation))
	if insert := q.EffectInsert(1); !strings.Contains(insert, `INSERT INTO "public"."`+prefix+`effects" (`) || !strings.Contains(insert, "RETURNING id, seq, xmin") {
		t.Fatalf("not the insert of the version before: %s", insert)
	}
	st, err := store.New(db, n, store.Dialect{Queries: q, Migrate: migrateQueries(n), Migrations: migrations,
		IsUndefinedTable: IsUndefinedTable, Ops: opsQueries(n), DeadLetters: deadLetterQueries(n)})
	if err != nil {
		t.Fatal(err)
	}
	return st
}

// insertAs inserts one effect of unit through st's EffectInsert in a transaction of its own.
func insertAs(ctx context.Context, st interface {
	EffectInsert(context.Context, *sql.Tx, outboxdriver.Source, []outboxdriver.Effect) (bool, error)
}, db *sql.DB, unit string) (int64, error) {
	src := outboxdriver.Source{Consumer: "unit", ID: unit}
	effects := []outboxdriver.Effect{{Source: src, Kind: outboxdriver.KindPublish, Topic: "t", UUID: unit, Payload: []byte("p"), OrderingKey: "k-" + unit}}
	tx, err := db.BeginTx(ctx, nil)
	if err != nil {
		return 0, err
	}
	defer func() { _ = tx.Rollback() }()
	if _, err := st.EffectInsert(ctx, tx, src, effects); err != nil {
		return 0, err
	}
	return effects[0].StoreID, tx.Commit()
}

// TestPreviousVersionWorksOnRotatedEffects: after migration 023, an instance of the version
// before (its insert returning xmin, its claim, its mark by id, all on the effects table under
// its old name) keeps working, during a rolling deploy; what it inserts is sent by this version's
// relay, once, across rotations.
func TestPreviousVersionWorksOnRotatedEffects(t *testing.T) {
	db := pgtest.DB(t)
	ctx := context.Background()
	const prefix = "roll_"
	migratedBeforeRotation(t, db, prefix)
	before := previousVersion(t, db, prefix)
	if _, err := insertAs(ctx, before, db, "before-023"); err != nil {
		t.Fatal(err)
	}

	st, err := Driver{RotateEvery: time.Millisecond}.Open(db, outboxdriver.StoreOptions{TablePrefix: prefix})
	if err != nil {
		t.Fatal(err)
	}
	if err := st.Migrate(ctx); err != nil { // 023
		t.Fatal(err)
	}
	now := st.(*inline)

	// The version before: insert (RETURNING xmin), claim and mark (by id) what it claimed: the
	// effect written before the migration and one written after.
	if _, err := insertAs(ctx, before, db, "old-sent-by-old"); err != nil {
		t.Fatalf("the previous version's insert after migration 023: %v", err)
	}
	c, err := before.EffectClaimDue(ctx, outboxdriver.EffectClaimParams{Limit: 100, MaxBytes: 1 << 20, Lease: time.Minute})
	if err != nil {
		t.Fatalf("the previous version's claim after migration 023: %v", err)
	}
	var claimed []string
	for _, e := range c.Effects {
		claimed = append(claimed, e.UUID)
		if err := before.EffectMarkDispatched(ctx, outboxdriver.DispatchMark{Source: e.Source, StoreIDs: []int64{e.StoreID}}); err != nil {
			t.Fatalf("the previous version's mark after migration 023: %v", err)
		}
	}
	if strings.Join(claimed, ",") != "before-023,old-sent-by-old" {
		t.Fatalf("the previous version claimed %v, want its two effects", claimed)
	}
	var left int
	if err := db.QueryRow(`SELECT count(*) FROM ` + prefix + `effects_all`).Scan(&left); err != nil || left != 0 {
		t.Fatalf("%d effects left after the previous version's marks (%v), want none", left, err)
	}

	// Both versions write while this version's relay rotates through every partition; the
	// previous version's rows land in partition 0 whichever is current.
	sent := map[string]int{}
	send := func() {
		for after := int64(0); ; {
			c, err := now.EffectClaimDue(ctx, outboxdriver.EffectClaimParams{Limit: 100, MaxBytes: 1 << 20, Lease: time.Minute, After: after})
			if err != nil {
				t.Fatal(err)
			}
			for _, e := range c.Effects {
				sent[e.UUID]++
				if err := now.EffectMarkDispatched(ctx, outboxdriver.DispatchMark{Source: e.Source, StoreIDs: []int64{e.StoreID}}); err != nil {
					t.Fatal(err)
				}
			}
			if len(c.Effects) == 0 && c.Next == 0 {
				return
			}
			after = c.Next
		}
	}
	var want []string
	for r := range 4 {
		old, cur := fmt.Sprintf("old-%d", r), fmt.Sprintf("new-%d", r)
		if _, err := insertAs(ctx, before, db, old); err != nil {
			t.Fatalf("round %d: the previous version's insert: %v", r, err)
		}
		if _, err := insertAs(ctx, now, db, cur); err != nil {
			t.Fatal(err)
		}
		want = append(want, old, cur)
		rotateNow(t, now)
		if r%2 == 0 {
			send()
		}
	}
	send()
	if g := now.gen.Load(); g != 4%3 {
		t.Errorf("generation %d after four rotations, want %d", g, 4%3)
	}
	for _, u := range want {
		if sent[u] != 1 {
			t.Errorf("effect %s sent %d times, want once", u, sent[u])
		}
	}
	if len(sent) != len(want) {
		t.Errorf("sent %v, want each of %v once", sent, want)
	}
}

// TestMigrationToRotatedEffectsWhileThePreviousVersionInserts: migration 023 applies while an
// instance of the version before keeps inserting effects; its inserts wait for the migration's
// short lock only, and none fails. Behind a transaction that keeps the effects table in use, the
// migration gives up after its lock_timeout instead of stalling every insert, and applies later.
func TestMigrationToRotatedEffectsWhileThePreviousVersionInserts(t *testing.T) {
	db := pgtest.DB(t)
	ctx := context.Background()
	const prefix = "rollmig_"
	ms := migratedBeforeRotation(t, db, prefix)
	before := previousVersion(t, db, prefix)
	n, err := namesOf("", prefix)
	if err != nil {
		t.Fatal(err)
	}

	// Behind a transaction that inserted and stays open, the migration gives up.
	holder, err := db.BeginTx(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := holder.Exec(`INSERT INTO ` + prefix + `effects (source_consumer, source_id, seq, kind, topic, uuid, payload, metadata, ordering_key, created_at)
		VALUES ('unit', 'held', 0, 'publish', 't', 'held', '\x00', '', 'k', now())`); err != nil {
		t.Fatal(err)
	}
	began := time.Now()
	err = store.Migrate(ctx, db, migrateQueries(n), ms)
	waited := time.Since(began)
	if !isLockTimeout(err) {
		t.Fatalf("migration behind an open transaction on the effects table: %v after %s, want lock_timeout", err, waited)
	}
	if waited > 15*time.Second {
		t.Errorf("the migration gave up after %s, want its lock_timeout (10 s)", waited)
	}
	if err := holder.Commit(); err != nil {
		t.Fatal(err)
	}

	// Now with the previous version inserting all along.
	var (
		mu       sync.Mutex
		inserted int
		longest  time.Duration
		failed   error
	)
	stop := make(chan struct{})
	done := make(chan struct{})
	go func() {
		defer close(done)
		for i := 0; ; i++ {
			select {
			case <-stop:
				return
			default:
			}
			ictx, cancel := context.WithTimeout(ctx, 30*time.Second)
			start := time.Now()
			_, err := insertAs(ictx, before, db, fmt.Sprintf("during-%d", i))
			cancel()
			mu.Lock()
			longest = max(longest, time.Since(start))
			if err != nil && failed == nil {
				failed = err
			}
			if err == nil {
				inserted++
			}
			mu.Unlock()
		}
	}()
	time.Sleep(200 * time.Millisecond)
	began = time.Now()
	err = store.Migrate(ctx, db, migrateQueries(n), ms)
	took := time.Since(began)
	mu.Lock()
	atMigration := inserted
	mu.Unlock()
	time.Sleep(200 * time.Millisecond)
	close(stop)
	<-done
	if err != nil {
		t.Fatalf("migration 023 while the previous version inserts: %v", err)
	}
	t.Logf("migration took %s; %d inserts of the previous version, %d before it ended; the longest took %s", took, inserted, atMigration, longest)
	if failed != nil {
		t.Errorf("an insert of the previous version failed during the migration: %v", failed)
	}
	if atMigration == 0 || inserted == atMigration {
		t.Errorf("%d inserts before the migration ended, %d in all: want some before and after", atMigration, inserted)
	}
	if longest > 2*time.Second {
		t.Errorf("an insert of the previous version waited %s behind the migration, want no long lock", longest)
	}
	var kind string
	if err := db.QueryRow(`SELECT relkind::text FROM pg_class WHERE relname = $1`, prefix+"effects_all").Scan(&kind); err != nil || kind != "p" {
		t.Fatalf("after the migration %seffects_all is of relkind %q (%v), want partitioned", prefix, kind, err)
	}
	var rows int
	if err := db.QueryRow(`SELECT count(*) FROM ` + prefix + `effects_all WHERE source_id LIKE 'during-%'`).Scan(&rows); err != nil {
		t.Fatal(err)
	}
	if rows != inserted {
		t.Errorf("%d rows of the previous version's inserts read through the parent, want %d", rows, inserted)
	}
}
