package main

import (
	"context"
	"database/sql"
	"encoding/json"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/watermill-outbox/outbox"
	"github.com/watermill-outbox/outbox/drivers/outboxpgx"
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
	return addProduct(ctx, db, postgres.Driver{}, "sku-1", "Widget", 250, 3)
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

// openPgxForm is the pgx form for outboxtest: a pool on the scenario's database and outboxpgx.New.
func openPgxForm(t testing.TB, dsn string, cfg outbox.Config) (*outbox.Outbox, error) {
	pool, err := pgxpool.New(context.Background(), dsn)
	if err != nil {
		return nil, err
	}
	ob, err := outboxpgx.New(pool, cfg)
	if err != nil {
		pool.Close()
		return nil, err
	}
	t.Cleanup(func() { _ = ob.Close(); pool.Close() })
	return ob, nil
}

func TestConsumersUnderTheCrashMatrix(t *testing.T) {
	// The payment timeout the inventory records is due within the matrix's wait for it (an
	// earlier test's service may have left the 2-minute default).
	paymentWindow.Store(int64(300 * time.Millisecond))
	for _, form := range []struct {
		name string
		open outboxtest.Opener
	}{{formSQL, nil}, {formPgx, openPgxForm}} {
		t.Run(form.name, func(t *testing.T) { crashMatrix(t, form.open) })
	}
}

func crashMatrix(t *testing.T, open outboxtest.Opener) {
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
			Open:    open,
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
			Open: open,
		}.Run(t)
	})
}
