package outbox_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	_ "github.com/lib/pq"

	"github.com/watermill-outbox/outbox"
	"github.com/watermill-outbox/outbox/drivers/postgres"
	"github.com/watermill-outbox/outbox/internal/pgtest"
	"github.com/watermill-outbox/outbox/middleware"
)

// exampleDB stands for the application's own database, opened as usual:
//
//	db, err := sql.Open("postgres", os.Getenv("DATABASE_URL"))
//
// Here it is a fresh database on the PostgreSQL the tests start.
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

// A consumer wrapped by the middleware: its business write, the processed-ID claim and the
// message it publishes commit in one transaction, and a second delivery of the same message
// changes nothing.
func Example() {
	db, closeDB := exampleDB()
	defer closeDB()
	ctx := context.Background()
	if _, err := db.Exec(`CREATE TABLE reservations (order_id text)`); err != nil {
		panic(err)
	}
	// Any Watermill pub/sub whose Publish returns once the broker has the message (docs/brokers.md).
	// Two in-memory ones here: orders (Publish waits for the consumer's ack) and events.
	orders := gochannel.NewGoChannel(gochannel.Config{BlockPublishUntilSubscriberAck: true}, watermill.NopLogger{})
	defer orders.Close()
	events := gochannel.NewGoChannel(gochannel.Config{Persistent: true}, watermill.NopLogger{})
	defer events.Close()

	ob, err := outbox.New(outbox.Config{DB: db, Driver: postgres.Driver{}, Publisher: events})
	if err != nil {
		panic(err)
	}
	if err := ob.Migrate(ctx); err != nil {
		panic(err)
	}
	runCtx, stopRun := context.WithCancel(ctx)
	ran := make(chan error)
	go func() { ran <- ob.Run(runCtx) }() // the relay and the cleanup, in every instance

	router, err := message.NewRouter(message.RouterConfig{}, watermill.NopLogger{})
	if err != nil {
		panic(err)
	}
	router.AddConsumerHandler("reserve-stock", "orders", orders, middleware.WrapConsumer(ob, func(msg *message.Message) error {
		ctx := msg.Context()
		if _, err := outbox.Tx(ctx).ExecContext(ctx, `INSERT INTO reservations VALUES ($1)`, string(msg.Payload)); err != nil {
			return err
		}
		return outbox.Publish(ctx, "stock.reserved", message.NewMessage("", msg.Payload))
	}))
	reserved, err := events.Subscribe(ctx, "stock.reserved")
	if err != nil {
		panic(err)
	}
	routed := make(chan error)
	go func() { routed <- router.Run(ctx) }()
	<-router.Running()

	order := message.NewMessage("order-42", []byte("o-42"))
	_ = orders.Publish("orders", order)
	_ = orders.Publish("orders", order) // the broker delivers it again

	m := <-reserved
	m.Ack()
	fmt.Println("stock.reserved:", string(m.Payload))
	var n int
	_ = db.QueryRow(`SELECT count(*) FROM reservations`).Scan(&n)
	fmt.Println("reservations:", n)

	_ = router.Close()
	<-routed
	stopRun()
	<-ran
	// Output:
	// stock.reserved: o-42
	// reservations: 1
}

// At the boundary (an HTTP handler, a job), InTx runs the business writes and records the side
// effects in one transaction, and dispatches them once it committed.
func ExampleOutbox_InTx() {
	db, closeDB := exampleDB()
	defer closeDB()
	ctx := context.Background()
	pubSub := gochannel.NewGoChannel(gochannel.Config{Persistent: true}, watermill.NopLogger{})
	defer pubSub.Close()
	ob, err := outbox.New(outbox.Config{DB: db, Driver: postgres.Driver{}, Publisher: pubSub})
	if err != nil {
		panic(err)
	}
	if err := ob.Migrate(ctx); err != nil {
		panic(err)
	}
	if _, err := db.Exec(`CREATE TABLE orders (id text PRIMARY KEY)`); err != nil {
		panic(err)
	}
	placed, err := pubSub.Subscribe(ctx, "order.placed")
	if err != nil {
		panic(err)
	}

	err = ob.InTx(ctx, func(ctx context.Context, tx *sql.Tx) error {
		if _, err := tx.ExecContext(ctx, `INSERT INTO orders VALUES ('o-7')`); err != nil {
			return err // rolled back: nothing is sent
		}
		return outbox.Publish(ctx, "order.placed", message.NewMessage("", []byte("o-7")))
	})
	if err != nil {
		panic(err)
	}
	m := <-placed
	m.Ack()
	ob.FlushMarks()
	fmt.Println("order.placed:", string(m.Payload), "caused by a boundary call:", m.Metadata.Get(outbox.MetadataCausationID) != "")
	// Output: order.placed: o-7 caused by a boundary call: true
}

// Health reports each check with its reason, for a readiness probe (HealthHandler serves it).
func ExampleOutbox_Health() {
	db, closeDB := exampleDB()
	defer closeDB()
	ctx := context.Background()
	ob, err := outbox.New(outbox.Config{DB: db, Driver: postgres.Driver{}, Publisher: nopPublisher{}})
	if err != nil {
		panic(err)
	}
	for _, c := range ob.Health(ctx).Checks {
		fmt.Printf("%s ok=%v\n", c.Name, c.OK)
	}
	if err := ob.Migrate(ctx); err != nil {
		panic(err)
	}
	runCtx, stopRun := context.WithCancel(ctx)
	done := make(chan error)
	go func() { done <- ob.Run(runCtx) }()
	for !ob.Health(ctx).Healthy {
		time.Sleep(10 * time.Millisecond)
	}
	fmt.Println("after Migrate and Run: healthy")
	stopRun()
	<-done
	// Output:
	// database ok=true
	// schema ok=false
	// relay ok=false
	// listener ok=false
	// after Migrate and Run: healthy
}

// Stating the broker's redelivery horizon makes New refuse a dedup retention shorter than it.
func ExampleConfig_redeliveryHorizon() {
	_, err := outbox.New(outbox.Config{
		DB: &sql.DB{}, Driver: postgres.Driver{}, Publisher: nopPublisher{},
		Retention:         3 * 24 * time.Hour,
		RedeliveryHorizon: 7 * 24 * time.Hour, // for example a JetStream stream's MaxAge
	})
	fmt.Println(errors.Is(err, outbox.ErrRetentionTooShort))
	// Output: true
}
