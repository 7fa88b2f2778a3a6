package main

import (
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
)

// The order status consumers move an order along pending -> reserved -> paid, or pending ->
// rejected, and keep its history. The events of one order come on different topics, through
// different consumers, so they may arrive in any order: PaymentCaptured can overtake
// StockReserved. Each update therefore only moves an order forward (its WHERE clause), and an
// event that arrives late changes nothing but the history.

func markReserved(msg *message.Message) error {
	var ev StockReserved
	if err := decode(msg, &ev); err != nil {
		return err
	}
	return advance(msg, ev.OrderID, `UPDATE orders SET status = 'reserved', updated_at = $2
		WHERE id = $1 AND status = 'pending'`)
}

func markRejected(msg *message.Message) error {
	var ev StockRejected
	if err := decode(msg, &ev); err != nil {
		return err
	}
	return advance(msg, ev.OrderID, `UPDATE orders SET status = 'rejected', reason = $3, updated_at = $2
		WHERE id = $1 AND status = 'pending'`, ev.Reason)
}

func markPaid(msg *message.Message) error {
	var ev PaymentCaptured
	if err := decode(msg, &ev); err != nil {
		return err
	}
	return advance(msg, ev.OrderID, `UPDATE orders SET status = 'paid', updated_at = $2
		WHERE id = $1 AND status IN ('pending', 'reserved')`)
}

// advance runs update with the order ID ($1), the time ($2) and extra ($3...), and records the
// event in the order's history.
func advance(msg *message.Message, orderID, update string, extra ...any) error {
	ctx := msg.Context()
	tx := txOf(ctx)
	now := time.Now().UTC()
	if _, err := tx.ExecContext(ctx, update, append([]any{orderID, now}, extra...)...); err != nil {
		return err
	}
	// The history is a plain insert, not idempotent on its own: the middleware is what keeps a
	// redelivered event from adding a second row.
	_, err := tx.ExecContext(ctx, `INSERT INTO order_history (order_id, event, message_id, at) VALUES ($1, $2, $3, $4)`,
		orderID, message.SubscribeTopicFromCtx(ctx), msg.UUID, now)
	return err
}
