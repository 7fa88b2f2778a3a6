package main

import (
	"errors"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/watermill-outbox/outbox"
)

// reserveStock is the inventory consumer: for each OrderPlaced it takes the ordered units out of
// stock and announces StockReserved, or, when there are not enough, announces StockRejected.
//
// It runs inside the outbox middleware, so the stock update, the reservation row, the event and
// the "inventory has processed this message" claim commit in one transaction. A redelivered
// OrderPlaced finds the claim and never takes the stock a second time.
func reserveStock(msg *message.Message) error {
	var ev OrderPlaced
	if err := decode(msg, &ev); err != nil {
		return err
	}
	// Every event about one order shares its ordering key, so they leave in the order recorded.
	ctx := outbox.WithOrderingKey(msg.Context(), ev.OrderID)
	tx := txOf(ctx) // write through the message's transaction, never through the *sql.DB (form.go)
	now := time.Now().UTC()

	// Check and take in one statement: no other order can take the same units in between.
	res, err := tx.ExecContext(ctx, `UPDATE stock SET available = available - $2 WHERE sku = $1 AND available >= $2`,
		ev.SKU, ev.Quantity)
	if err != nil {
		return err
	}
	taken, err := res.RowsAffected()
	if err != nil {
		return err
	}
	outcome := "reserved"
	if taken == 0 {
		outcome = "rejected"
	}
	if _, err := tx.ExecContext(ctx, `INSERT INTO reservations (order_id, sku, quantity, outcome, decided_at)
		VALUES ($1, $2, $3, $4, $5)`, ev.OrderID, ev.SKU, ev.Quantity, outcome, now); err != nil {
		return err
	}
	if taken == 0 {
		return publishEvent(ctx, topicStockRejected, StockRejected{OrderID: ev.OrderID, Reason: "out of stock"})
	}
	// The timeout is cancelled by the payment (timeout.go). A database whose outbox driver keeps
	// no delayed effects records none: the order then waits for its payment without a deadline.
	timeout := true
	if err := recordPaymentTimeout(ctx, ev); errors.Is(err, outbox.ErrDelayUnsupported) {
		timeout = false
		logNoPaymentTimeout(err)
	} else if err != nil {
		return err
	}
	return publishEvent(ctx, topicStockReserved, StockReserved{
		OrderID: ev.OrderID, Customer: ev.Customer, AmountCents: ev.AmountCents, PaymentTimeout: timeout,
	})
}
