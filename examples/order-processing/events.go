package main

import (
	"context"
	"encoding/json"
	"fmt"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/watermill-outbox/outbox"
)

// Topics. No dots: NATS JetStream names a stream after its topic, and stream names cannot contain '.'.
const (
	topicOrderPlaced     = "orders_placed"
	topicStockReserved   = "stock_reserved"
	topicStockRejected   = "stock_rejected"
	topicPaymentCaptured = "payment_captured"
)

var topics = []string{topicOrderPlaced, topicStockReserved, topicStockRejected, topicPaymentCaptured, topicPaymentTimedOut}

// The events. Each carries what its consumers need, so that no consumer reads another one's tables.

type OrderPlaced struct {
	OrderID     string `json:"order_id"`
	Customer    string `json:"customer"`
	SKU         string `json:"sku"`
	Quantity    int    `json:"quantity"`
	AmountCents int64  `json:"amount_cents"`
}

type StockReserved struct {
	OrderID     string `json:"order_id"`
	Customer    string `json:"customer"`
	AmountCents int64  `json:"amount_cents"`
	// PaymentTimeout: a payment timeout was recorded with the reservation (timeout.go); the
	// payment must cancel it, and not charge once it is on its way.
	PaymentTimeout bool `json:"payment_timeout,omitempty"`
}

type StockRejected struct {
	OrderID string `json:"order_id"`
	Reason  string `json:"reason"`
}

type PaymentCaptured struct {
	OrderID     string `json:"order_id"`
	PaymentID   string `json:"payment_id"`
	AmountCents int64  `json:"amount_cents"`
}

// publishEvent records event as a message to topic in the unit of work of ctx (an InTx call or a
// wrapped handler). Nothing is sent yet: the message is stored in the transaction and sent after
// the commit, with the same UUID on every re-send, so consumers can drop copies.
func publishEvent(ctx context.Context, topic string, event any) error {
	payload, err := json.Marshal(event)
	if err != nil {
		return err
	}
	// The event's UUID is derived from what caused it (the incoming message, or the request's
	// Idempotency-Key) and its position: a re-run after a lost commit sends the UUID the
	// consumers' deduplication already knows.
	return outbox.Publish(ctx, topic, outbox.NewMessage(ctx, payload))
}

// decode reads an event. A payload that does not decode never will: the error is permanent, so
// the message is dead-lettered at once (kept with its payload, acked, listed by `outbox dead`)
// rather than retried MaxAttempts times or acked and forgotten.
func decode(msg *message.Message, event any) error {
	if err := json.Unmarshal(msg.Payload, event); err != nil {
		return outbox.Permanent(fmt.Errorf("decode %T from message %s: %w", event, msg.UUID, err))
	}
	return nil
}
