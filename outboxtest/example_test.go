package outboxtest_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/watermill-outbox/outbox"
	"github.com/watermill-outbox/outbox/outboxtest"
)

// reserveStock is the handler under test, as the service registers it behind middleware.New:
// it writes through the message's transaction and records the message it sends.
func reserveStock(msg *message.Message) ([]*message.Message, error) {
	ctx := msg.Context()
	if _, err := outbox.Tx(ctx).ExecContext(ctx, `INSERT INTO reservations VALUES ($1)`, msg.UUID); err != nil {
		return nil, err
	}
	return nil, outbox.Publish(ctx, "stock.reserved", message.NewMessage("", msg.Payload))
}

func createReservations(ctx context.Context, db *sql.DB) error {
	_, err := db.ExecContext(ctx, `CREATE TABLE reservations (order_id text PRIMARY KEY)`)
	return err
}

// A Recorder is the Publisher of a test: it keeps what it was given, and Fail stands for a
// broker that is down.
func ExampleRecorder() {
	rec := &outboxtest.Recorder{}
	_ = rec.Publish("stock.reserved", message.NewMessage("m-1", []byte("o-42")))
	rec.Fail(errors.New("broker unavailable"))
	err := rec.Publish("stock.reserved", message.NewMessage("m-2", []byte("o-43")))
	fmt.Println("while down:", err)
	rec.Fail(nil)
	for _, s := range rec.All() {
		fmt.Println(s.Topic, s.Message.UUID, string(s.Message.Payload))
	}
	// Output:
	// while down: broker unavailable
	// stock.reserved m-1 o-42
}

// In a test (the package's TestMain calls outboxtest.Main, which starts PostgreSQL): run one
// message through a unit of work and check what it committed and sent.
func ExampleHarness_Run() {
	testReserveStock := func(t *testing.T) {
		h := outboxtest.New(t, outbox.Config{}, createReservations)
		res := h.Run("reserve-stock", message.NewMessage("order-42", []byte("o-42")), reserveStock)
		if res.Err != nil || !res.Committed {
			t.Fatalf("not committed: %v", res.Err)
		}
		if len(res.Effects) != 1 || res.Effects[0].Topic != "stock.reserved" {
			t.Errorf("effects: %+v, want one on stock.reserved", res.Effects)
		}
		if got := h.Pub.Messages("stock.reserved"); len(got) != 1 {
			t.Errorf("sent %d messages to stock.reserved, want 1", len(got))
		}
	}
	_ = testReserveStock // func TestReserveStock(t *testing.T) { ... } in a _test.go file
}

// In a test: the handler on its messages, with a crash at every step of the unit of work and
// concurrent and later copies; the test fails if a reservation happened twice or a message was
// lost or sent under a second ID.
func ExampleCrashMatrix() {
	testReserveStockSurvivesCrashes := func(t *testing.T) {
		outboxtest.CrashMatrix{
			Consumer: "reserve-stock",
			Handler:  func(*sql.DB) message.HandlerFunc { return reserveStock },
			Messages: []*message.Message{message.NewMessage("order-42", []byte("o-42"))},
			Setup:    createReservations,
			Applied: func(ctx context.Context, db *sql.DB, msg *message.Message) (int, error) {
				var n int
				err := db.QueryRowContext(ctx, `SELECT count(*) FROM reservations WHERE order_id = $1`, msg.UUID).Scan(&n)
				return n, err
			},
		}.Run(t)
	}
	_ = testReserveStockSurvivesCrashes // func TestReserveStockSurvivesCrashes(t *testing.T) { ... }
}
