package postgres

import (
	"context"
	"database/sql"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/watermill-outbox/outbox/internal/pgtest"
	"github.com/watermill-outbox/outbox/outboxdriver"
)

// repeatableReadDB returns a fresh database whose sessions default to REPEATABLE READ, every
// session of the pool a new one (with the database's default), checked.
func repeatableReadDB(t *testing.T) *sql.DB {
	t.Helper()
	db := pgtest.DB(t)
	if _, err := db.Exec(`DO $$ BEGIN EXECUTE format('ALTER DATABASE %I SET default_transaction_isolation = %L',
		current_database(), 'repeatable read'); END $$`); err != nil {
		t.Fatal(err)
	}
	db.SetMaxIdleConns(0)
	var iso string
	if err := db.QueryRow(`SHOW transaction_isolation`).Scan(&iso); err != nil || iso != "repeatable read" {
		t.Fatalf("the sessions' isolation: %q, %v", iso, err)
	}
	return db
}

// TestDelayedMovesUnderRepeatableRead: on a database whose sessions default to REPEATABLE READ,
// the move of due delayed effects ran at that level (one statement, outside a transaction), and
// two relays moving at once (every instance arms its timer for the same due time) failed with a
// serialization error ("could not serialize access due to concurrent update"), logged as an
// error, the effects waiting for the next pass. The move runs at READ COMMITTED.
func TestDelayedMovesUnderRepeatableRead(t *testing.T) {
	db := repeatableReadDB(t)
	ctx := context.Background()
	st, err := Driver{}.Open(db, outboxdriver.StoreOptions{TablePrefix: "rr_"})
	if err != nil {
		t.Fatal(err)
	}
	if err := st.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	ds := st.(outboxdriver.DelayedStore)
	for round := range 10 {
		if _, err := db.Exec(`INSERT INTO rr_delayed (source_consumer, source_id, seq, kind, topic, uuid, payload, metadata, ordering_key, due_at)
			SELECT 'c', 'm' || g, 0, 'publish', 't', gen_random_uuid()::text, '', '', 'k' || g, now() - interval '1 second'
			FROM generate_series(1, 3000) g`); err != nil {
			t.Fatal(err)
		}
		var wg sync.WaitGroup
		errs := make([]error, 2)
		for i := range errs {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for {
					n, _, _, err := ds.DelayedPromote(ctx, 1000)
					if err != nil || n == 0 {
						errs[i] = err
						return
					}
				}
			}()
		}
		wg.Wait()
		if err := errors.Join(errs...); err != nil {
			t.Fatalf("round %d: two relays moving at once: %v", round, err)
		}
		var left int
		if err := db.QueryRow(`SELECT count(*) FROM rr_delayed`).Scan(&left); err != nil || left != 0 {
			t.Fatalf("round %d: %d delayed effects left (%v)", round, left, err)
		}
	}
}

// TestRelayClaimsUnderRepeatableRead: two relays claiming at once on a database whose sessions
// default to REPEATABLE READ met as a serialization failure (an effect the other leased since
// the statement's snapshot): the pass ended with an error, counted in relay errors, at every
// meeting. The claim is made again at READ COMMITTED, where the leased effect is skipped.
func TestRelayClaimsUnderRepeatableRead(t *testing.T) {
	db := repeatableReadDB(t)
	ctx := context.Background()
	st, err := Driver{}.Open(db, outboxdriver.StoreOptions{TablePrefix: "rc_"})
	if err != nil {
		t.Fatal(err)
	}
	if err := st.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	for round := range 10 {
		if _, err := db.Exec(`INSERT INTO rc_effects (source_consumer, source_id, seq, kind, topic, uuid, payload, metadata, ordering_key, created_at, next_attempt_at)
			SELECT 'c', 'm' || g || '-' || $1, 0, 'publish', 't', gen_random_uuid()::text, '', '', 'k' || g, now() - interval '1 minute', now() - interval '1 minute'
			FROM generate_series(1, 2000) g`, round); err != nil {
			t.Fatal(err)
		}
		var wg sync.WaitGroup
		errs := make([]error, 2)
		for i := range errs {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for {
					c, err := st.EffectClaimDue(ctx, outboxdriver.EffectClaimParams{Limit: 100, Lease: time.Hour})
					if err != nil || len(c.Effects) == 0 {
						errs[i] = err
						return
					}
				}
			}()
		}
		wg.Wait()
		if err := errors.Join(errs...); err != nil {
			t.Fatalf("round %d: two relays claiming at once: %v", round, err)
		}
	}
}
