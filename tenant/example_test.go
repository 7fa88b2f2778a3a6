package tenant_test

import (
	"context"
	"database/sql"
	"fmt"
	"slices"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"

	"github.com/watermill-outbox/outbox"
	"github.com/watermill-outbox/outbox/drivers/postgres"
	"github.com/watermill-outbox/outbox/internal/pgtest"
	"github.com/watermill-outbox/outbox/tenant"
)

// exampleTenantDB stands for a tenant's own database, opened as usual:
//
//	db, err := sql.Open("postgres", tenantDSN)
//
// Here it is a fresh database on the PostgreSQL the tests start, with the tenant's orders table.
func exampleTenantDB() (*sql.DB, func()) {
	dsn, drop, err := pgtest.Database()
	if err != nil {
		panic(err)
	}
	db, err := sql.Open("postgres", dsn)
	if err != nil {
		panic(err)
	}
	if _, err := db.Exec(`CREATE TABLE orders (id text)`); err != nil {
		panic(err)
	}
	return db, func() { _ = db.Close(); drop() }
}

// A database per tenant: one Outbox per tenant database in a Set, whose middleware runs each
// message in the database of the tenant its metadata names, and a member of its own where the
// messages that name no tenant of the Set are dead-lettered. A tenant that signs up later is added
// while the service runs.
func Example() {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	orders := gochannel.NewGoChannel(gochannel.Config{BlockPublishUntilSubscriberAck: true}, watermill.NopLogger{})
	defer orders.Close()
	events := gochannel.NewGoChannel(gochannel.Config{Persistent: true}, watermill.NopLogger{})
	defer events.Close()

	set, err := tenant.New(tenant.Config{Metadata: "tenant", Unresolved: "unrouted"})
	if err != nil {
		panic(err)
	}
	dbs := map[string]*sql.DB{}
	var closers []func()
	defer func() {
		for _, c := range slices.Backward(closers) {
			c()
		}
	}()
	addTenant := func(name string) {
		db, closeDB := exampleTenantDB()
		closers = append(closers, closeDB)
		ob, err := outbox.New(outbox.Config{DB: db, Driver: postgres.Driver{}, Publisher: events})
		if err != nil {
			panic(err)
		}
		closers = append(closers, func() { _ = ob.Close() })
		if err := ob.Migrate(ctx); err != nil {
			panic(err)
		}
		if err := set.Add(name, ob); err != nil {
			panic(err)
		}
		dbs[name] = db
	}
	addTenant("unrouted") // Run refuses to start without it
	addTenant("acme")

	router, err := message.NewRouter(message.RouterConfig{}, watermill.NopLogger{})
	if err != nil {
		panic(err)
	}
	router.AddConsumerHandler("place-order", "orders", orders, set.WrapConsumer(func(msg *message.Message) error {
		ctx := msg.Context()
		// The transaction of the tenant's database: the order, the claim of the message and
		// the event commit together there.
		if _, err := outbox.Tx(ctx).ExecContext(ctx, `INSERT INTO orders VALUES ($1)`, msg.UUID); err != nil {
			return err
		}
		return outbox.Publish(ctx, "orders.placed", message.NewMessage("placed-"+msg.UUID, msg.Payload))
	}))
	setDone := make(chan error, 1)
	go func() { setDone <- set.Run(ctx) }() // the background work of every member, and of those added later
	go func() { _ = router.Run(ctx) }()
	<-router.Running()

	addTenant("globex") // signs up while the service runs
	for i, name := range []string{"acme", "globex", "acme"} {
		msg := message.NewMessage(fmt.Sprintf("order-%d", i), nil)
		msg.Metadata.Set("tenant", name)
		if err := orders.Publish("orders", msg); err != nil {
			panic(err)
		}
	}
	for _, name := range []string{"acme", "globex"} {
		var n int
		if err := dbs[name].QueryRow(`SELECT count(*) FROM orders`).Scan(&n); err != nil {
			panic(err)
		}
		fmt.Printf("%s: %d orders\n", name, n)
	}
	_ = router.Close()
	cancel()
	<-setDone
	// Output:
	// acme: 2 orders
	// globex: 1 orders
}
