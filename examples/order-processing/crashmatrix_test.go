package main

import (
	"context"
	"database/sql"
	"encoding/json"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/watermill-outbox/outbox"
	"github.com/watermill-outbox/outbox/drivers/postgres"
	"github.com/watermill-outbox/outbox/outboxtest"
)

// The service's consumers through outboxtest.CrashMatrix: each message with a crash at every step
// of its unit of work, then concurrent and later copies and the relay; the stock is taken, the
// payment captured and the receipt recorded exactly once, and every event goes out with one ID.

func setupShop(ctx context.Context, db *sql.DB) error {
	if err := createSchema(ctx, db, postgres.Driver{}); err != nil {
		return err
	}
	return addProduct(ctx, db, "sku-1", "Widget", 250, 3)
}

func eventMessage(t *testing.T, id string, event any) *message.Message {
	t.Helper()
	payload, err := json.Marshal(event)
	if err != nil {
		t.Fatal(err)
	}
	return message.NewMessage(id, payload)
}

func countRows(query string) func(ctx context.Context, db *sql.DB, msg *message.Message) (int, error) {
	return func(ctx context.Context, db *sql.DB, msg *message.Message) (int, error) {
		var ev struct {
			OrderID string `json:"order_id"`
		}
		if err := json.Unmarshal(msg.Payload, &ev); err != nil {
			return 0, err
		}
		var n int
		err := db.QueryRowContext(ctx, query, ev.OrderID).Scan(&n)
		return n, err
	}
}

func noDB(h message.NoPublishHandlerFunc) func(*sql.DB) message.HandlerFunc {
	return func(*sql.DB) message.HandlerFunc {
		return func(msg *message.Message) ([]*message.Message, error) { return nil, h(msg) }
	}
}

func TestConsumersUnderTheCrashMatrix(t *testing.T) {
	t.Run("inventory", func(t *testing.T) {
		outboxtest.CrashMatrix{
			Consumer: "inventory",
			Handler:  noDB(reserveStock),
			Messages: []*message.Message{
				eventMessage(t, "placed-1", OrderPlaced{OrderID: "o-1", Customer: "ada", SKU: "sku-1", Quantity: 2, AmountCents: 500}),
				eventMessage(t, "placed-2", OrderPlaced{OrderID: "o-2", Customer: "bob", SKU: "sku-1", Quantity: 9, AmountCents: 2250}), // out of stock
			},
			Setup:   setupShop,
			Applied: countRows(`SELECT count(*) FROM reservations WHERE order_id = $1`),
		}.Run(t)
	})
	t.Run("payment", func(t *testing.T) {
		outboxtest.CrashMatrix{
			Consumer: "payment",
			Handler:  noDB(capturePayment),
			Messages: []*message.Message{eventMessage(t, "reserved-1", StockReserved{OrderID: "o-1", Customer: "ada", AmountCents: 500})},
			Setup:    setupShop,
			Applied:  countRows(`SELECT count(*) FROM payments WHERE order_id = $1`),
			Register: func(ob *outbox.Outbox, _ *sql.DB) error {
				m := &mailer{dir: t.TempDir()}
				return ob.RegisterApplier(applierReceipt, m.sendReceipt)
			},
		}.Run(t)
	})
}
