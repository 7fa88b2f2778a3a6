package sqlite_test

import (
	"context"
	"database/sql"
	"path/filepath"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/watermill-outbox/outbox"
	"github.com/watermill-outbox/outbox/drivers/sqlite"
	"github.com/watermill-outbox/outbox/outboxtest"
)

// database is SQLite for outboxtest's harness: a fresh database file per scenario.
var database = &outboxtest.Database{
	Open: func(t testing.TB) (*sql.DB, string) {
		dsn := sqlite.DSN(filepath.Join(t.TempDir(), "outbox.db"))
		db, err := sql.Open("sqlite", dsn)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = db.Close() })
		return db, dsn
	},
	Driver: sqlite.Driver{},
	Effects: func(_, prefix string) string {
		return `SELECT seq, kind, topic, uuid, payload, ordering_key FROM "main"."` + prefix + `effects" WHERE source_consumer = ? AND source_id = ?`
	},
	Delayed: func(_, prefix string) string {
		return `SELECT seq, kind, topic, uuid, payload, ordering_key FROM "main"."` + prefix + `delayed" WHERE source_consumer = ? AND source_id = ?`
	},
}

func setupReservations(ctx context.Context, db *sql.DB) error {
	_, err := db.ExecContext(ctx, `CREATE TABLE reservations (order_id TEXT NOT NULL)`)
	return err
}

func reservations(ctx context.Context, db *sql.DB, msg *message.Message) (int, error) {
	var n int
	err := db.QueryRowContext(ctx, `SELECT count(*) FROM reservations WHERE order_id = ?`, string(msg.Payload)).Scan(&n)
	return n, err
}

// reserveOrder writes and records two messages, one with an ordering key of its own, and with
// delayed a delayed one (the reservation's expiry), all through the unit of work.
func reserveOrder(delayed bool) func(*sql.DB) message.HandlerFunc {
	return func(*sql.DB) message.HandlerFunc {
		return func(msg *message.Message) ([]*message.Message, error) {
			ctx := msg.Context()
			if _, err := outbox.Tx(ctx).ExecContext(ctx, `INSERT INTO reservations VALUES (?)`, string(msg.Payload)); err != nil {
				return nil, err
			}
			if delayed {
				expiry := outbox.WithCancelKey(outbox.WithDelay(ctx, 300*time.Millisecond), "expiry/"+string(msg.Payload))
				if err := outbox.Publish(expiry, "reservation.expired", message.NewMessage("", msg.Payload)); err != nil {
					return nil, err
				}
			}
			if err := outbox.Publish(outbox.WithOrderingKey(ctx, "stock"), "stock.reserved", message.NewMessage("", msg.Payload)); err != nil {
				return nil, err
			}
			return nil, outbox.Publish(ctx, "audit", message.NewMessage("", msg.Payload))
		}
	}
}

// TestCrashMatrix: a crash at every step of the unit of work, then concurrent copies and a later
// one, leave the business change done once and every committed effect sent, on SQLite as on
// PostgreSQL and MySQL; with a delayed effect, sent once when due, never early.
func TestCrashMatrix(t *testing.T) {
	orders := []*message.Message{message.NewMessage("order-1", []byte("o-1"))}
	t.Run("immediate", func(t *testing.T) {
		outboxtest.CrashMatrix{Consumer: "reserve", Handler: reserveOrder(false), Messages: orders, Setup: setupReservations,
			Applied: reservations, Database: database}.Run(t)
	})
	t.Run("delayed", func(t *testing.T) {
		outboxtest.CrashMatrix{Consumer: "reserve", Handler: reserveOrder(true), Messages: orders, Setup: setupReservations,
			Applied: reservations, Database: database, Config: outbox.Config{RelayInterval: 20 * time.Millisecond}}.Run(t)
	})
}
