package ops_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	_ "github.com/lib/pq"

	"github.com/watermill-outbox/outbox"
	"github.com/watermill-outbox/outbox/drivers/postgres"
	"github.com/watermill-outbox/outbox/internal/pgtest"
	"github.com/watermill-outbox/outbox/ops"
)

// exampleDB stands for the service's database; here a fresh one on the PostgreSQL the tests start.
func exampleDB() (*sql.DB, func()) {
	dsn, drop, err := pgtest.Database()
	if err != nil {
		panic(err)
	}
	db, err := sql.Open("postgres", dsn)
	if err != nil {
		panic(err)
	}
	return db, func() { _ = db.Close(); drop() }
}

// broker stands for a broker that refuses the messages of one topic (a schema check, say) until
// that is fixed, and takes the others.
type broker struct {
	down atomic.Bool
	sent atomic.Int32
}

func (b *broker) Publish(topic string, msgs ...*message.Message) error {
	if topic == "invoices" && b.down.Load() {
		return errors.New("broker refused message: schema v2 required for order 4711")
	}
	b.sent.Add(int32(len(msgs)))
	return nil
}
func (b *broker) Close() error { return nil }

// An effect the broker refused, while it took others, is parked after RelayMaxAttempts; once the cause is fixed, an
// operator lists the parked effects by failure and retries them, and the change is audited.
func ExampleOps_RetryParked() {
	db, closeDB := exampleDB()
	defer closeDB()
	ctx := context.Background()
	b := &broker{}
	b.down.Store(true)
	ob, err := outbox.New(outbox.Config{DB: db, Driver: postgres.Driver{}, Publisher: b, RelayMaxAttempts: 1, RelayInterval: 50 * time.Millisecond})
	if err != nil {
		panic(err)
	}
	if err := ob.Migrate(ctx); err != nil {
		panic(err)
	}
	for _, order := range []string{"o-1", "o-2"} {
		_ = ob.InTx(ctx, func(ctx context.Context, tx *sql.Tx) error {
			if err := outbox.Publish(ctx, "receipts", message.NewMessage("", []byte(order))); err != nil {
				return err
			}
			return outbox.Publish(ctx, "invoices", message.NewMessage("", []byte(order)))
		})
	}
	runCtx, stopRun := context.WithCancel(ctx)
	ran := make(chan error)
	go func() { ran <- ob.Run(runCtx) }() // the relay tries again, and parks what still fails
	defer func() { stopRun(); <-ran }()

	o, err := ops.ForOutbox(ob) // the tables this Outbox works on; ops.Open for another process
	if err != nil {
		panic(err)
	}
	var parked []ops.Parked
	for deadline := time.Now().Add(30 * time.Second); len(parked) < 2 && time.Now().Before(deadline); time.Sleep(20 * time.Millisecond) {
		if parked, err = o.ParkedEffects(ctx, ops.ParkedFilter{Topic: "invoices"}); err != nil {
			panic(err)
		}
	}
	for _, g := range ops.GroupByFingerprint(parked) {
		fmt.Printf("%d parked on %v: %s\n", g.Count, g.Topics, g.Example)
	}

	b.down.Store(false) // the cause is fixed
	ch, err := o.RetryParked(ctx, ops.ParkedFilter{Topic: "invoices"}, ops.RepairOptions{Actor: "alice"})
	if err != nil {
		panic(err)
	}
	fmt.Printf("%s: %d of %d\n", ch.Action, ch.Changed, ch.Matched)
	for deadline := time.Now().Add(30 * time.Second); b.sent.Load() < 4 && time.Now().Before(deadline); {
		time.Sleep(20 * time.Millisecond) // the relay sends them on its next round
	}
	fmt.Println("messages the broker took:", b.sent.Load())
	log, err := o.AuditLog(ctx, 1)
	if err != nil {
		panic(err)
	}
	for _, a := range log {
		fmt.Println("audited:", a.Actor, a.Action)
	}
	// Output:
	// 2 parked on [invoices]: outbox: publish 1 message(s) to "invoices": broker refused message: schema v2 required for order 4711
	// retry: 2 of 2
	// messages the broker took: 4
	// audited: alice retry-parked
}
