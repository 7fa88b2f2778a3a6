package main

import (
	"context"
	"fmt"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/watermill-outbox/outbox"
)

// An order whose stock is reserved must be paid within the payment window, or it is cancelled
// and its stock released. The inventory consumer records the timeout when it reserves the stock,
// as a delayed event (outbox.WithDelay) in the same transaction: it commits with the reservation
// and is sent by the relay when the window closes, unless the payment consumer cancels it first
// (outbox.CancelDelayed), in the transaction that records the payment. Exactly one of the two
// takes effect: a payment that comes after the relay took the timeout finds nothing to cancel
// and does not charge.

const topicPaymentTimedOut = "payment_timed_out"

// PaymentTimedOut is sent when an order was not paid within the payment window.
type PaymentTimedOut struct {
	OrderID  string `json:"order_id"`
	SKU      string `json:"sku"`
	Quantity int    `json:"quantity"`
	Window   string `json:"window"`
}

// Payments above confirmAboveCents wait for the customer to confirm them (3-D Secure). This demo
// has no confirmation page, so such an order is never paid: it shows the timeout (order one burr
// grinder, 129 EUR).
const confirmAboveCents = 10000

// Default payment windows: the service's, and the chaos mode's, which must see timeouts fire
// within its run.
const (
	defaultPaymentWindow      = 2 * time.Minute
	defaultChaosPaymentWindow = 2 * time.Second
)

// paymentWindow is how long a reserved order waits for its payment (-payment-timeout).
var paymentWindow atomic.Int64

func setPaymentWindow(cfg config) {
	d := cfg.paymentTimeout
	switch {
	case d > 0:
	case cfg.chaos:
		d = defaultChaosPaymentWindow
	default:
		d = defaultPaymentWindow
	}
	paymentWindow.Store(int64(d))
}

// timeoutKey is the cancel key of an order's payment timeout.
func timeoutKey(orderID string) string { return "payment-timeout/" + orderID }

// recordPaymentTimeout records, in the unit of work of ctx, the timeout of an order whose stock
// was just reserved.
func recordPaymentTimeout(ctx context.Context, ev OrderPlaced) error {
	window := time.Duration(paymentWindow.Load())
	ctx = outbox.WithCancelKey(outbox.WithDelay(ctx, window), timeoutKey(ev.OrderID))
	return publishEvent(ctx, topicPaymentTimedOut, PaymentTimedOut{OrderID: ev.OrderID, SKU: ev.SKU, Quantity: ev.Quantity, Window: window.String()})
}

// releaseStock is the inventory consumer of timeouts: it puts the units of a cancelled order
// back in stock, once (the middleware drops a redelivered timeout).
func releaseStock(msg *message.Message) error {
	var ev PaymentTimedOut
	if err := decode(msg, &ev); err != nil {
		return err
	}
	ctx := msg.Context()
	tx := txOf(ctx)
	res, err := tx.ExecContext(ctx, `UPDATE reservations SET outcome = 'released' WHERE order_id = $1 AND outcome = 'reserved'`, ev.OrderID)
	if err != nil {
		return err
	}
	if n, err := res.RowsAffected(); err != nil || n == 0 {
		return err // nothing reserved: nothing to put back
	}
	_, err = tx.ExecContext(ctx, `UPDATE stock SET available = available + $2 WHERE sku = $1`, ev.SKU, ev.Quantity)
	return err
}

// markCancelled is the order status consumer of timeouts.
func markCancelled(msg *message.Message) error {
	var ev PaymentTimedOut
	if err := decode(msg, &ev); err != nil {
		return err
	}
	return advance(msg, ev.OrderID, `UPDATE orders SET status = 'cancelled', reason = $3, updated_at = $2
		WHERE id = $1 AND status IN ('pending', 'reserved')`, fmt.Sprintf("not paid within %s", ev.Window))
}
