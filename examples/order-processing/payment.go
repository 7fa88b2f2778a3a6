package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/watermill-outbox/outbox"
)

// capturePayment is the payment consumer: for each StockReserved it charges the order (a row in
// the payments ledger), announces PaymentCaptured and e-mails a receipt.
//
// The receipt is not sent from here: the handler may run again after a rollback, and an e-mail
// cannot be rolled back. It is recorded as a custom side effect (outbox.Record) that commits with
// the payment, and the receipt applier sends it after the commit.
func capturePayment(msg *message.Message) error {
	var ev StockReserved
	if err := decode(msg, &ev); err != nil {
		return err
	}
	ctx := outbox.WithOrderingKey(msg.Context(), ev.OrderID)
	tx := txOf(ctx)
	if ev.AmountCents > confirmAboveCents {
		return nil // waits for a confirmation that never comes: the payment timeout cancels the order
	}
	// The payment stops the order's timeout, in the transaction that records it. Nothing to
	// cancel: the timeout is on its way (the order is being cancelled), and nothing is charged.
	if ev.PaymentTimeout {
		if stopped, err := outbox.CancelDelayed(ctx, timeoutKey(ev.OrderID)); err != nil || stopped == 0 {
			return err
		}
	}

	// Derived from the message, as the UUIDs of the events are: a run of it again (after a
	// commit lost to a failover) charges the same payment ID that its events, which downstream
	// already deduplicated, carry.
	paymentID := outbox.NewUUID(ctx)
	if _, err := tx.ExecContext(ctx, `INSERT INTO payments (id, order_id, amount_cents, captured_at) VALUES ($1, $2, $3, $4)`,
		paymentID, ev.OrderID, ev.AmountCents, time.Now().UTC()); err != nil {
		return err
	}
	if err := publishEvent(ctx, topicPaymentCaptured, PaymentCaptured{
		OrderID: ev.OrderID, PaymentID: paymentID, AmountCents: ev.AmountCents,
	}); err != nil {
		return err
	}
	receipt, err := json.Marshal(Receipt{OrderID: ev.OrderID, PaymentID: paymentID, To: ev.Customer, AmountCents: ev.AmountCents})
	if err != nil {
		return err
	}
	return outbox.Record(ctx, applierReceipt, receipt)
}

// applierReceipt is the name under which the receipt applier is registered (Outbox.RegisterApplier).
const applierReceipt = "receipt-email"

// Receipt is the input of the receipt applier, stored with the payment.
type Receipt struct {
	OrderID     string `json:"order_id"`
	PaymentID   string `json:"payment_id"`
	To          string `json:"to"`
	AmountCents int64  `json:"amount_cents"`
}

// mailer stands in for an e-mail service: it "sends" a receipt by writing it into a spool
// directory, one file per receipt.
type mailer struct {
	dir     string
	repeats atomic.Int64 // receipts asked for again and skipped (the chaos mode reports them)
}

// sendReceipt is the receipt applier. The outbox calls it after the payment committed, at least
// once: again after a crash before the send was marked done. e.UUID is the same on every call, so
// it is the idempotency key: a receipt whose file exists was sent already. (A real e-mail API takes
// such a key as a header; SMTP has Message-ID.)
//
// It writes a file, not a table row, on purpose: an applier that writes to the same SQLite
// database would wait for the write lock that the relay holds while it runs appliers.
func (m *mailer) sendReceipt(_ context.Context, e outbox.Effect) error {
	var r Receipt
	if err := json.Unmarshal(e.Payload, &r); err != nil {
		return fmt.Errorf("decode receipt: %w", err)
	}
	path := filepath.Join(m.dir, r.OrderID+"."+e.UUID+".eml")
	if _, err := os.Stat(path); err == nil {
		m.repeats.Add(1)
		return nil
	} else if !errors.Is(err, fs.ErrNotExist) {
		return err
	}
	body := fmt.Sprintf("To: %s\r\nSubject: Receipt for order %s\r\nMessage-ID: <%s@order-processing.example>\r\n\r\n"+
		"We received your payment of %d.%02d EUR for order %s (payment %s).\r\n",
		r.To, r.OrderID, e.UUID, r.AmountCents/100, r.AmountCents%100, r.OrderID, r.PaymentID)
	// Write, then rename: a crash half way never leaves a partial receipt under the final name.
	tmp, err := os.CreateTemp(m.dir, ".receipt-*")
	if err != nil {
		return err
	}
	defer func() { _ = os.Remove(tmp.Name()) }() // a no-op once renamed
	if _, err := tmp.WriteString(body); err != nil {
		_ = tmp.Close()
		return err
	}
	if err := tmp.Close(); err != nil {
		return err
	}
	return os.Rename(tmp.Name(), path)
}
