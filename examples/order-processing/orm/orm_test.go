package orm_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"os"
	"testing"
	"time"

	"entgo.io/ent/dialect"
	entsql "entgo.io/ent/dialect/sql"
	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/jmoiron/sqlx"
	_ "github.com/lib/pq"
	"github.com/uptrace/bun"
	"github.com/uptrace/bun/dialect/pgdialect"
	gormpostgres "gorm.io/driver/postgres"
	"gorm.io/gorm"
	"gorm.io/gorm/logger"

	"github.com/watermill-outbox/outbox"
	"github.com/watermill-outbox/outbox/drivers/postgres"
	"github.com/watermill-outbox/outbox/examples/order-processing/orm"
	"github.com/watermill-outbox/outbox/examples/order-processing/orm/ent"
	"github.com/watermill-outbox/outbox/internal/pgtest"
	"github.com/watermill-outbox/outbox/middleware"
)

func TestMain(m *testing.M) { os.Exit(pgtest.Run(m)) }

type env struct {
	db       *sql.DB
	ob       *outbox.Outbox
	gorm     *gorm.DB
	bun      *bun.DB
	reserved <-chan *message.Message
}

func setup(t *testing.T) env {
	t.Helper()
	db, err := sql.Open("postgres", pgtest.DSN(t))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = db.Close() })
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if _, err := db.ExecContext(ctx, orm.Schema); err != nil {
		t.Fatal(err)
	}
	events := gochannel.NewGoChannel(gochannel.Config{Persistent: true}, watermill.NopLogger{})
	t.Cleanup(func() { _ = events.Close() })
	subCtx, stopSub := context.WithCancel(context.Background())
	t.Cleanup(stopSub)
	reserved, err := events.Subscribe(subCtx, orm.ReservedTopic)
	if err != nil {
		t.Fatal(err)
	}
	ob, err := outbox.New(outbox.Config{DB: db, Driver: postgres.Driver{}, Publisher: events})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = ob.Close() })
	if err := ob.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	gdb, err := gorm.Open(gormpostgres.New(gormpostgres.Config{Conn: db}), &gorm.Config{Logger: logger.Discard})
	if err != nil {
		t.Fatal(err)
	}
	// Not closed: closing a *bun.DB closes the *sql.DB under it, which the Cleanup above does.
	bdb := bun.NewDB(db, pgdialect.New())
	return env{db: db, ob: ob, gorm: gdb, bun: bdb, reserved: reserved}
}

func (e env) rows(t *testing.T, orderID string) int {
	t.Helper()
	var n int
	if err := e.db.QueryRow(`SELECT count(*) FROM reservations WHERE order_id = $1`, orderID).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

// deliver hands the handler one delivery of a message with this UUID, as the Router would.
func deliver(t *testing.T, h message.NoPublishHandlerFunc, uuid, sku string) error {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	msg := message.NewMessage(uuid, []byte(sku))
	msg.SetContext(ctx)
	return h(msg)
}

var errAfterWrite = errors.New("the handler fails after its write")

// failAfter runs h, then fails the unit of work as a later step of the handler would.
func failAfter(h message.NoPublishHandlerFunc) message.NoPublishHandlerFunc {
	return func(msg *message.Message) error {
		if err := h(msg); err != nil {
			return err
		}
		return errAfterWrite
	}
}

var handlers = []struct {
	name    string
	handler func(env) message.NoPublishHandlerFunc
}{
	{"sqlx", func(env) message.NoPublishHandlerFunc { return orm.SqlxReserve }},
	{"gorm", func(e env) message.NoPublishHandlerFunc { return orm.Gorm{DB: e.gorm}.Reserve }},
	{"bun", func(e env) message.NoPublishHandlerFunc { return orm.Bun{DB: e.bun}.Reserve }},
	{"ent", func(env) message.NoPublishHandlerFunc { return orm.EntReserve }},
}

// The ORM's write commits with the unit of work and its message is sent; a redelivered copy
// writes nothing more; a handler that fails after the write leaves no row and sends nothing.
func TestORMHandlersWriteInTheUnit(t *testing.T) {
	for _, hc := range handlers {
		t.Run(hc.name, func(t *testing.T) {
			e := setup(t)
			opt := middleware.WithConsumer("reserve-stock-" + hc.name)
			h := middleware.WrapConsumer(e.ob, hc.handler(e), opt)

			id := watermill.NewUUID()
			if err := deliver(t, h, id, "sku-1"); err != nil {
				t.Fatalf("first delivery: %v", err)
			}
			if n := e.rows(t, id); n != 1 {
				t.Fatalf("after the first delivery: %d reservation rows, want 1", n)
			}
			select {
			case m := <-e.reserved:
				if string(m.Payload) != "sku-1" {
					t.Fatalf("sent %q, want sku-1", m.Payload)
				}
				m.Ack()
			case <-time.After(10 * time.Second):
				t.Fatal("the handler's message was not sent after commit")
			}

			if err := deliver(t, h, id, "sku-1"); err != nil {
				t.Fatalf("redelivery: %v", err)
			}
			if n := e.rows(t, id); n != 1 {
				t.Fatalf("after a redelivery: %d reservation rows, want 1", n)
			}

			failing := middleware.WrapConsumer(e.ob, failAfter(hc.handler(e)), opt)
			bad := watermill.NewUUID()
			if err := deliver(t, failing, bad, "sku-2"); !errors.Is(err, errAfterWrite) {
				t.Fatalf("failing delivery returned %v, want %v", err, errAfterWrite)
			}
			if n := e.rows(t, bad); n != 0 {
				t.Fatalf("a handler that failed after its write left %d reservation rows, want 0", n)
			}
			select {
			case m := <-e.reserved:
				t.Fatalf("a rolled-back unit sent %q", m.Payload)
			case <-time.After(200 * time.Millisecond):
			}
		})
	}
}

// What the docs warn of: the same ORMs on the pool, not on outbox.Tx, commit on their own, so a
// failed unit of work keeps the write (and its redelivery would write again).
func TestORMWriteOutsideTheUnitStays(t *testing.T) {
	e := setup(t)
	cases := map[string]message.NoPublishHandlerFunc{
		"sqlx": func(msg *message.Message) error {
			_, err := sqlx.NewDb(e.db, "postgres").NamedExecContext(msg.Context(),
				`INSERT INTO reservations (order_id, sku) VALUES (:order_id, :sku)`,
				orm.Reservation{OrderID: msg.UUID, SKU: string(msg.Payload)})
			return err
		},
		"gorm": func(msg *message.Message) error {
			return e.gorm.WithContext(msg.Context()).Create(&orm.Reservation{OrderID: msg.UUID, SKU: string(msg.Payload)}).Error
		},
		"bun": func(msg *message.Message) error {
			_, err := e.bun.NewInsert().Model(&orm.BunReservation{OrderID: msg.UUID, SKU: string(msg.Payload)}).Exec(msg.Context())
			return err
		},
		"ent": func(msg *message.Message) error {
			_, err := ent.NewClient(ent.Driver(entsql.OpenDB(dialect.Postgres, e.db))).Reservation.Create().
				SetID(msg.UUID).SetSku(string(msg.Payload)).Save(msg.Context())
			return err
		},
	}
	for name, h := range cases {
		t.Run(name, func(t *testing.T) {
			failing := middleware.WrapConsumer(e.ob, failAfter(h), middleware.WithConsumer("outside-"+name))
			id := watermill.NewUUID()
			for i := 0; i < 2; i++ {
				if err := deliver(t, failing, id, "sku-3"); !errors.Is(err, errAfterWrite) {
					t.Fatalf("delivery %d returned %v, want %v", i+1, err, errAfterWrite)
				}
			}
			if n := e.rows(t, id); n != 2 {
				t.Fatalf("two failed deliveries through the pool left %d rows; the test expects 2 (one per delivery)", n)
			}
		})
	}
}

// The sqlx adapter's reads (GetContext, SelectContext) run in the unit too: they see the unit's
// own write before COMMIT, which a read on the pool could not.
func TestSqlxTxReadsInTheUnit(t *testing.T) {
	e := setup(t)
	h := middleware.WrapConsumer(e.ob, func(msg *message.Message) error {
		if err := orm.SqlxReserve(msg); err != nil {
			return err
		}
		ctx := msg.Context()
		var r orm.Reservation
		if err := sqlx.GetContext(ctx, orm.SqlxTx(ctx), &r, `SELECT order_id, sku FROM reservations WHERE order_id = $1`, msg.UUID); err != nil {
			return fmt.Errorf("get: %w", err)
		}
		var all []orm.Reservation
		if err := sqlx.SelectContext(ctx, orm.SqlxTx(ctx), &all, `SELECT order_id, sku FROM reservations WHERE sku = $1`, "sku-4"); err != nil {
			return fmt.Errorf("select: %w", err)
		}
		if r.SKU != "sku-4" || len(all) != 1 || all[0].OrderID != msg.UUID {
			return fmt.Errorf("in the unit: got %+v and %+v, want the unit's own row", r, all)
		}
		var onPool int
		if err := e.db.QueryRowContext(ctx, `SELECT count(*) FROM reservations WHERE order_id = $1`, msg.UUID).Scan(&onPool); err != nil {
			return fmt.Errorf("count on the pool: %w", err)
		}
		if onPool != 0 {
			return fmt.Errorf("the pool sees %d rows before COMMIT, want 0", onPool)
		}
		return nil
	}, middleware.WithConsumer("sqlx-reads"))
	id := watermill.NewUUID()
	if err := deliver(t, h, id, "sku-4"); err != nil {
		t.Fatal(err)
	}
	if n := e.rows(t, id); n != 1 {
		t.Fatalf("after commit: %d rows, want 1", n)
	}
}
