package middleware_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	wmw "github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	_ "github.com/lib/pq"

	"github.com/watermill-outbox/outbox"
	"github.com/watermill-outbox/outbox/drivers/postgres"
	"github.com/watermill-outbox/outbox/internal/pgtest"
	"github.com/watermill-outbox/outbox/middleware"
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

// exampleService stands for the service's set-up: its database with a reservations table, an
// Outbox on it that publishes to events, and a Router.
func exampleService(events message.Publisher) (*sql.DB, *outbox.Outbox, *message.Router, func()) {
	db, closeDB := exampleDB()
	if _, err := db.Exec(`CREATE TABLE reservations (order_id text)`); err != nil {
		panic(err)
	}
	ob, err := outbox.New(outbox.Config{DB: db, Driver: postgres.Driver{}, Publisher: events})
	if err != nil {
		panic(err)
	}
	if err := ob.Migrate(context.Background()); err != nil {
		panic(err)
	}
	router, err := message.NewRouter(message.RouterConfig{}, watermill.NopLogger{})
	if err != nil {
		panic(err)
	}
	return db, ob, router, closeDB
}

// The middleware on one handler: the handler's write and the message it publishes commit with
// the claim of the incoming message's ID, so a second copy of the message changes nothing. Here
// producers put a business key in the metadata, and WithMessageID deduplicates on it: two
// messages with different UUIDs but the same order are one.
func ExampleNew() {
	ctx := context.Background()
	orders := gochannel.NewGoChannel(gochannel.Config{BlockPublishUntilSubscriberAck: true}, watermill.NopLogger{})
	defer orders.Close()
	events := gochannel.NewGoChannel(gochannel.Config{Persistent: true}, watermill.NopLogger{})
	defer events.Close()
	db, ob, router, closeDB := exampleService(events)
	defer closeDB()

	router.AddConsumerHandler("reserve-stock", "orders", orders, func(msg *message.Message) error {
		ctx := msg.Context()
		if _, err := outbox.Tx(ctx).ExecContext(ctx, `INSERT INTO reservations VALUES ($1)`, msg.Metadata.Get("order_id")); err != nil {
			return err
		}
		return outbox.Publish(ctx, "stock.reserved", message.NewMessage("", msg.Payload))
	}).AddMiddleware(middleware.New(ob, middleware.WithMessageID(func(msg *message.Message) (string, error) {
		if id := msg.Metadata.Get("order_id"); id != "" {
			return id, nil
		}
		return "", errors.New("no order_id")
	})))
	if err := middleware.CheckRouter(router); err != nil {
		panic(err)
	}
	reserved, err := events.Subscribe(ctx, "stock.reserved")
	if err != nil {
		panic(err)
	}
	routed := make(chan error)
	go func() { routed <- router.Run(ctx) }()
	<-router.Running()

	for range 2 { // the producer sent the order twice, under two UUIDs
		m := message.NewMessage(watermill.NewUUID(), []byte("2 x espresso-beans"))
		m.Metadata.Set("order_id", "o-42")
		_ = orders.Publish("orders", m)
	}
	m := <-reserved
	m.Ack()
	var n int
	_ = db.QueryRow(`SELECT count(*) FROM reservations`).Scan(&n)
	fmt.Println("stock.reserved:", string(m.Payload))
	fmt.Println("reservations:", n)
	_ = router.Close()
	<-routed
	// Output:
	// stock.reserved: 2 x espresso-beans
	// reservations: 1
}

// CheckRouter names middleware that sits inside the outbox middleware and so breaks its
// guarantee: here Watermill's Retry, added to the Router after the handler got the outbox
// middleware, would run the handler again inside the same transaction.
func ExampleCheckRouter() {
	pubSub := gochannel.NewGoChannel(gochannel.Config{}, watermill.NopLogger{})
	defer pubSub.Close()
	ob, err := outbox.New(outbox.Config{DB: &sql.DB{}, Driver: postgres.Driver{}, Publisher: pubSub})
	if err != nil {
		panic(err)
	}
	router, err := message.NewRouter(message.RouterConfig{}, watermill.NopLogger{})
	if err != nil {
		panic(err)
	}
	router.AddConsumerHandler("reserve-stock", "orders", pubSub, func(*message.Message) error { return nil }).
		AddMiddleware(middleware.New(ob))
	router.AddMiddleware(wmw.Retry{MaxRetries: 3, InitialInterval: 100 * time.Millisecond}.Middleware)

	err = middleware.CheckRouter(router)
	fmt.Println(errors.Is(err, middleware.ErrUnsafeMiddlewareOrder))
	// Output: true
}

// WrapConsumer puts the unit of work around the handler function itself, so a Retry on the
// Router runs whole units of work again: the first try's write is rolled back before the second,
// and the order is reserved once.
func ExampleWrapConsumer() {
	ctx := context.Background()
	orders := gochannel.NewGoChannel(gochannel.Config{BlockPublishUntilSubscriberAck: true}, watermill.NopLogger{})
	defer orders.Close()
	db, ob, router, closeDB := exampleService(orders)
	defer closeDB()

	router.AddMiddleware(wmw.Retry{MaxRetries: 3, InitialInterval: time.Millisecond}.Middleware)
	tries := 0
	router.AddConsumerHandler("reserve-stock", "orders", orders, middleware.WrapConsumer(ob, func(msg *message.Message) error {
		ctx := msg.Context()
		if _, err := outbox.Tx(ctx).ExecContext(ctx, `INSERT INTO reservations VALUES ($1)`, string(msg.Payload)); err != nil {
			return err
		}
		if tries++; tries == 1 {
			return errors.New("the first try fails after its write")
		}
		return nil
	}))
	go func() { _ = router.Run(ctx) }()
	<-router.Running()
	defer router.Close()

	if err := orders.Publish("orders", message.NewMessage(watermill.NewUUID(), []byte("order-1"))); err != nil {
		panic(err)
	}
	var n int
	if err := db.QueryRow(`SELECT count(*) FROM reservations`).Scan(&n); err != nil {
		panic(err)
	}
	fmt.Println("tries:", tries, "reservations:", n)
	// Output: tries: 2 reservations: 1
}
