package postgres_test

import (
	"context"
	"database/sql"
	"testing"
	"time"

	"github.com/watermill-outbox/outbox/drivers/postgres"
	"github.com/watermill-outbox/outbox/internal/pgtest"
	"github.com/watermill-outbox/outbox/outboxdriver"
)

// The relay's claim reads, for its floor, the last id of the effects' sequence: the
// application's role, with exactly its grants (store.Grants), may, and claims what it records.
func TestClaimAsTheApplicationRole(t *testing.T) {
	ctx := context.Background()
	ownerDSN := pgtest.DSN(t)
	owner, err := sql.Open("postgres", ownerDSN)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = owner.Close() })
	ob, err := newOutbox(t, owner, "", "")
	if err != nil {
		t.Fatal(err)
	}
	if err := ob.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	app := appRole(t, owner, ownerDSN)
	st, err := postgres.Driver{}.Open(app, outboxdriver.StoreOptions{TablePrefix: "outbox_"})
	if err != nil {
		t.Fatal(err)
	}
	for i := range 3 {
		src := outboxdriver.Source{Consumer: "unit", ID: "u" + string(rune('a'+i))}
		e := []outboxdriver.Effect{{Source: src, Kind: outboxdriver.KindPublish, Topic: "t", UUID: src.ID, Payload: []byte("p"), OrderingKey: src.ID}}
		tx, err := app.BeginTx(ctx, nil)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := st.EffectInsert(ctx, tx, src, e); err != nil {
			t.Fatal(err)
		}
		if err := tx.Commit(); err != nil {
			t.Fatal(err)
		}
		c, err := st.EffectClaimDue(ctx, outboxdriver.EffectClaimParams{Limit: 10, MaxBytes: 1 << 20, Lease: time.Minute})
		if err != nil {
			t.Fatalf("claim as the application's role: %v", err)
		}
		if len(c.Effects) != 1 || c.Effects[0].StoreID != e[0].StoreID {
			t.Fatalf("claim %d took %+v, want the effect %d", i, c.Effects, e[0].StoreID)
		}
		if err := st.EffectMarkDispatched(ctx, outboxdriver.DispatchMark{Source: src, StoreIDs: []int64{e[0].StoreID}}); err != nil {
			t.Fatal(err)
		}
	}
}
