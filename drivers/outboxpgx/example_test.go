package outboxpgx_test

import (
	"context"
	"fmt"
	"slices"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/watermill-outbox/outbox"
	"github.com/watermill-outbox/outbox/drivers/outboxpgx"
	"github.com/watermill-outbox/outbox/internal/pgtest"
	"github.com/watermill-outbox/outbox/middleware"
)

// examplePool stands for the application's own pool, opened as usual:
//
//	pool, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
//
// Here it is a fresh database on the PostgreSQL the tests start.
func examplePool(ctx context.Context) (*pgxpool.Pool, func()) {
	dsn, drop, err := pgtest.Database()
	if err != nil {
		panic(err)
	}
	pool, err := pgxpool.New(ctx, dsn)
	if err != nil {
		panic(err)
	}
	return pool, func() { pool.Close(); drop() }
}

// A consumer on pgx: the handler writes through the unit of work's pgx.Tx (sqlc's New(tx) takes
// it), and a second delivery of the same message changes nothing.
func Example() {
	ctx := context.Background()
	pool, closePool := examplePool(ctx)
	defer closePool()
	if _, err := pool.Exec(ctx, `CREATE TABLE reservations (order_id text)`); err != nil {
		panic(err)
	}
	events := gochannel.NewGoChannel(gochannel.Config{Persistent: true}, watermill.NopLogger{})
	defer events.Close()

	ob, err := outboxpgx.New(pool, outbox.Config{Publisher: events})
	if err != nil {
		panic(err)
	}
	defer ob.Close()
	if err := ob.Migrate(ctx); err != nil {
		panic(err)
	}
	handler := middleware.New(ob, middleware.WithConsumer("reserve-stock"))(func(msg *message.Message) ([]*message.Message, error) {
		ctx := msg.Context()
		if _, err := outboxpgx.Tx(ctx).Exec(ctx, `INSERT INTO reservations VALUES ($1)`, string(msg.Payload)); err != nil {
			return nil, err
		}
		return nil, outbox.Publish(ctx, "stock.reserved", message.NewMessage("", msg.Payload))
	})
	for range 2 { // the same message, delivered twice
		msg := message.NewMessage("order-1-placed", []byte("order-1"))
		if _, err := handler(msg); err != nil {
			panic(err)
		}
	}
	var n int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM reservations`).Scan(&n); err != nil {
		panic(err)
	}
	fmt.Println("reservations:", n)

	// At the boundary: an HTTP handler's transaction, its message sent after commit.
	err = outboxpgx.InTx(ctx, ob, func(ctx context.Context, tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, `INSERT INTO reservations VALUES ('order-2')`); err != nil {
			return err
		}
		return outbox.Publish(ctx, "stock.reserved", message.NewMessage("", []byte("order-2")))
	})
	if err != nil {
		panic(err)
	}
	sent, err := events.Subscribe(ctx, "stock.reserved")
	if err != nil {
		panic(err)
	}
	var payloads []string
	for range 2 {
		m := <-sent
		payloads = append(payloads, string(m.Payload))
		m.Ack()
	}
	slices.Sort(payloads)
	fmt.Println("sent:", payloads)
	// Output:
	// reservations: 1
	// sent: [order-1 order-2]
}
