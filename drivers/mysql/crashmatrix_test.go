package mysql_test

import (
	"context"
	"database/sql"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/watermill-outbox/outbox"
	"github.com/watermill-outbox/outbox/drivers/mysql"
	"github.com/watermill-outbox/outbox/drivers/mysql/internal/mysqltest"
	"github.com/watermill-outbox/outbox/outboxtest"
)

// database is the test server for outboxtest's harness: a fresh database per scenario, the
// tables in the connection's own (Schema empty).
var database = &outboxtest.Database{
	Open: func(t testing.TB) (*sql.DB, string) {
		dsn := mysqltest.DSN(t)
		db, err := sql.Open("mysql", dsn)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = db.Close() })
		return db, dsn
	},
	Driver: mysql.Driver{},
	Effects: func(schema, prefix string) string {
		n, err := mysql.NewNames(schema, prefix)
		if err != nil {
			panic(err)
		}
		return `SELECT seq, kind, topic, uuid, payload, ordering_key FROM ` + n.Effects + ` WHERE source_consumer = ? AND source_id = ?`
	},
	Delayed: func(schema, prefix string) string {
		n, err := mysql.NewNames(schema, prefix)
		if err != nil {
			panic(err)
		}
		return `SELECT seq, kind, topic, uuid, payload, ordering_key FROM ` + n.Delayed + ` WHERE source_consumer = ? AND source_id = ?`
	},
}

func setupOrders(ctx context.Context, db *sql.DB) error {
	_, err := db.ExecContext(ctx, `CREATE TABLE reservations (order_id VARCHAR(64) NOT NULL) ENGINE = InnoDB`)
	return err
}

func applied(ctx context.Context, db *sql.DB, msg *message.Message) (int, error) {
	var n int
	err := db.QueryRowContext(ctx, `SELECT count(*) FROM reservations WHERE order_id = ?`, string(msg.Payload)).Scan(&n)
	return n, err
}

// reserve is a correct handler: its write and its two messages go through the unit of work.
func reserve(*sql.DB) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		ctx := msg.Context()
		if _, err := outbox.Tx(ctx).ExecContext(ctx, `INSERT INTO reservations VALUES (?)`, string(msg.Payload)); err != nil {
			return nil, err
		}
		if err := outbox.Publish(outbox.WithOrderingKey(ctx, "stock"), "stock.reserved", message.NewMessage("", msg.Payload)); err != nil {
			return nil, err
		}
		return nil, outbox.Publish(ctx, "audit", message.NewMessage("", msg.Payload))
	}
}

// reserveWithTimeout also records a delayed effect (the reservation's expiry), which must be
// sent once, with its committed UUID, whatever crashed before it was due.
func reserveWithTimeout(*sql.DB) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		ctx := msg.Context()
		if _, err := outbox.Tx(ctx).ExecContext(ctx, `INSERT INTO reservations VALUES (?)`, string(msg.Payload)); err != nil {
			return nil, err
		}
		expiry := outbox.WithCancelKey(outbox.WithDelay(ctx, 300*time.Millisecond), "expiry/"+string(msg.Payload))
		if err := outbox.Publish(expiry, "reservation.expired", message.NewMessage("", msg.Payload)); err != nil {
			return nil, err
		}
		return nil, outbox.Publish(ctx, "stock.reserved", message.NewMessage("", msg.Payload))
	}
}

func orders() []*message.Message {
	return []*message.Message{message.NewMessage("order-1", []byte("o-1"))}
}

// TestCrashMatrix: a crash at every step of the unit of work, then concurrent copies and a later
// one, leave the business change done once and every committed effect sent, on MySQL as on
// PostgreSQL.
func TestCrashMatrix(t *testing.T) {
	outboxtest.CrashMatrix{Consumer: "reserve", Handler: reserve, Messages: orders(), Setup: setupOrders, Applied: applied,
		Database: database}.Run(t)
}

// TestCrashMatrixDelayedEffects: a crash at any step of the unit of work comes before the due
// time of its delayed effect; the copies and the later delivery must not send it early or twice,
// and the relay sends it once when due.
func TestCrashMatrixDelayedEffects(t *testing.T) {
	outboxtest.CrashMatrix{Consumer: "reserve", Handler: reserveWithTimeout, Messages: orders(), Setup: setupOrders, Applied: applied,
		Database: database, Config: outbox.Config{RelayInterval: 20 * time.Millisecond}}.Run(t)
}
