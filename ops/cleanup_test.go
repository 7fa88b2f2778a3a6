package ops_test

import (
	"context"
	"database/sql"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/watermill-outbox/outbox"
	"github.com/watermill-outbox/outbox/drivers/postgres"
	"github.com/watermill-outbox/outbox/ops"
)

// A cleanup that was given a retention for the claims and no EffectRetention deleted every
// dispatched effect the service keeps, however young (its zero meant "all"): a library caller
// expiring claims wiped the audit trail a service keeps for a day. Zero now keeps them as long as
// the claims; deleting them all is asked for (DeleteDispatched).
func TestCleanupKeepsDispatchedEffectsByDefault(t *testing.T) {
	db, closeDB := exampleDB()
	defer closeDB()
	ctx := context.Background()
	ob, err := outbox.New(outbox.Config{DB: db, Driver: postgres.Driver{}, Publisher: &broker{}, EffectRetention: 24 * time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	defer ob.Close()
	if err := ob.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	if err := ob.InTx(ctx, func(ctx context.Context, _ *sql.Tx) error {
		return outbox.Publish(ctx, "orders", message.NewMessage("kept-1", nil))
	}); err != nil {
		t.Fatal(err)
	}
	ob.FlushMarks()
	kept := func() int {
		var n int
		if err := db.QueryRow(`SELECT count(*) FROM outbox_dispatched WHERE uuid = 'kept-1'`).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}
	if kept() != 1 {
		t.Fatal("the dispatched effect is not kept by a service with EffectRetention 24h")
	}
	o, err := ops.Open(db, "", "")
	if err != nil {
		t.Fatal(err)
	}
	rep, err := o.Cleanup(ctx, ops.CleanupOptions{Actor: "alice", Retention: 7 * 24 * time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	if rep.Effects != 0 || kept() != 1 {
		t.Errorf("a cleanup with a retention of 7 days and no EffectRetention deleted %d dispatched effects (the one a minute old among them), want none", rep.Effects)
	}
	if rep, err = o.Cleanup(ctx, ops.CleanupOptions{Actor: "alice", Retention: 7 * 24 * time.Hour, DeleteDispatched: true}); err != nil || rep.Effects != 1 || kept() != 0 {
		t.Errorf("a cleanup with DeleteDispatched: deleted %d, %v; want the dispatched effect deleted", rep.Effects, err)
	}
}
