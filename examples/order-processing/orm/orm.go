// Package orm shows consumers that write through sqlx, GORM, bun and ent instead of plain database/sql
// (docs/orm.md). Each write goes through the unit of work's *sql.Tx (outbox.Tx): a write
// through the ORM's own pool would commit on its own, stay when the unit rolls back, and be
// made again when the message is redelivered.
package orm

import (
	"context"
	"database/sql"
	"fmt"
	"strings"

	"entgo.io/ent/dialect"
	entsql "entgo.io/ent/dialect/sql"
	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jmoiron/sqlx"
	"github.com/jmoiron/sqlx/reflectx"
	"github.com/uptrace/bun"
	"gorm.io/gorm"

	"github.com/watermill-outbox/outbox"
	"github.com/watermill-outbox/outbox/examples/order-processing/orm/ent"
)

// Reservation is a row of the reservations table, for sqlx and GORM.
type Reservation struct {
	OrderID string `db:"order_id" gorm:"column:order_id"`
	SKU     string `db:"sku" gorm:"column:sku"`
}

// TableName names the table for GORM.
func (Reservation) TableName() string { return "reservations" }

// Schema creates the table the handlers write.
const Schema = `CREATE TABLE IF NOT EXISTS reservations (order_id text NOT NULL, sku text NOT NULL)`

// ReservedTopic is where the handlers publish.
const ReservedTopic = "stock.reserved"

// SqlxTx returns the unit of work's *sql.Tx as an sqlx.ExtContext, for sqlx's package functions
// (sqlx.NamedExecContext, sqlx.GetContext, sqlx.SelectContext). sqlx has no constructor of an
// *sqlx.Tx from a *sql.Tx: one built as a literal has no driver name, so its bind type is
// unknown and its named queries come out with placeholders PostgreSQL rejects; this adapter
// names the bind type ($1, $2) that sqlx.Open("postgres", ...) would pick.
func SqlxTx(ctx context.Context) sqlx.ExtContext {
	return sqlxTx{&sqlx.Tx{Tx: outbox.Tx(ctx), Mapper: sqlxMapper}}
}

// sqlxMapper is sqlx's default: the db tag, else the field name in lower case.
var sqlxMapper = reflectx.NewMapperFunc("db", strings.ToLower)

type sqlxTx struct{ tx *sqlx.Tx }

func (sqlxTx) DriverName() string         { return "postgres" }
func (sqlxTx) Rebind(query string) string { return sqlx.Rebind(sqlx.DOLLAR, query) }
func (sqlxTx) BindNamed(query string, arg any) (string, []any, error) {
	return sqlx.BindNamed(sqlx.DOLLAR, query, arg)
}
func (t sqlxTx) QueryContext(ctx context.Context, query string, args ...any) (*sql.Rows, error) {
	return t.tx.QueryContext(ctx, query, args...)
}
func (t sqlxTx) QueryxContext(ctx context.Context, query string, args ...any) (*sqlx.Rows, error) {
	return t.tx.QueryxContext(ctx, query, args...)
}
func (t sqlxTx) QueryRowxContext(ctx context.Context, query string, args ...any) *sqlx.Row {
	return t.tx.QueryRowxContext(ctx, query, args...)
}
func (t sqlxTx) ExecContext(ctx context.Context, query string, args ...any) (sql.Result, error) {
	return t.tx.ExecContext(ctx, query, args...)
}

// SqlxReserve is a consumer (middleware.WrapConsumer) that writes through sqlx.
func SqlxReserve(msg *message.Message) error {
	ctx := msg.Context()
	tx := SqlxTx(ctx)
	r := Reservation{OrderID: msg.UUID, SKU: string(msg.Payload)}
	if _, err := sqlx.NamedExecContext(ctx, tx, `INSERT INTO reservations (order_id, sku) VALUES (:order_id, :sku)`, r); err != nil {
		return fmt.Errorf("reserve %s: %w", r.SKU, err)
	}
	return outbox.Publish(ctx, ReservedTopic, message.NewMessage(watermill.NewUUID(), msg.Payload))
}

// Gorm holds the *gorm.DB the service opens once, on the same *sql.DB as the Outbox:
//
//	gdb, err := gorm.Open(postgres.New(postgres.Config{Conn: db}), &gorm.Config{})
type Gorm struct{ DB *gorm.DB }

// InUnit returns a session of db whose statements run in the unit of work of ctx. It is what
// GORM's own Begin does with the *sql.Tx it opens: a new session whose Statement.ConnPool is the
// transaction. GORM then skips its default transaction around a Create or Save (a *sql.Tx cannot
// begin another), and db.Transaction inside it uses a savepoint.
func InUnit(ctx context.Context, db *gorm.DB) *gorm.DB {
	s := db.Session(&gorm.Session{Context: ctx, NewDB: true})
	s.Statement.ConnPool = outbox.Tx(ctx)
	return s
}

// Reserve is a consumer (middleware.WrapConsumer) that writes through GORM.
func (g Gorm) Reserve(msg *message.Message) error {
	ctx := msg.Context()
	r := Reservation{OrderID: msg.UUID, SKU: string(msg.Payload)}
	if err := InUnit(ctx, g.DB).Create(&r).Error; err != nil {
		return fmt.Errorf("reserve %s: %w", r.SKU, err)
	}
	return outbox.Publish(ctx, ReservedTopic, message.NewMessage(watermill.NewUUID(), msg.Payload))
}

// BunReservation is Reservation for bun, which names the table in a field tag.
type BunReservation struct {
	bun.BaseModel `bun:"table:reservations"`
	OrderID       string `bun:"order_id"`
	SKU           string `bun:"sku"`
}

// Bun holds the *bun.DB the service opens once, on the same *sql.DB as the Outbox:
//
//	bdb := bun.NewDB(db, pgdialect.New())
type Bun struct{ DB *bun.DB }

// Reserve is a consumer (middleware.WrapConsumer) that writes through bun. Every query of bun
// takes the connection it runs on (Conn: a *sql.DB, *sql.Conn or *sql.Tx); without Conn it runs
// on the pool, outside the unit.
func (b Bun) Reserve(msg *message.Message) error {
	ctx := msg.Context()
	r := BunReservation{OrderID: msg.UUID, SKU: string(msg.Payload)}
	if _, err := b.DB.NewInsert().Conn(outbox.Tx(ctx)).Model(&r).Exec(ctx); err != nil {
		return fmt.Errorf("reserve %s: %w", r.SKU, err)
	}
	return outbox.Publish(ctx, ReservedTopic, message.NewMessage(watermill.NewUUID(), msg.Payload))
}

// EntClient returns an ent client whose statements run in the unit of work of ctx: its driver's
// connection is the unit's *sql.Tx. A client is cheap to make per message. Its Tx method cannot
// be used in it (the unit is the transaction), and a client opened on the pool (ent.Open, or
// entsql.OpenDB) would commit each write on its own, outside the unit.
func EntClient(ctx context.Context) *ent.Client {
	return ent.NewClient(ent.Driver(entsql.NewDriver(dialect.Postgres, entsql.Conn{ExecQuerier: outbox.Tx(ctx)})))
}

// EntReserve is a consumer (middleware.WrapConsumer) that writes through ent.
func EntReserve(msg *message.Message) error {
	ctx := msg.Context()
	sku := string(msg.Payload)
	if _, err := EntClient(ctx).Reservation.Create().SetID(msg.UUID).SetSku(sku).Save(ctx); err != nil {
		return fmt.Errorf("reserve %s: %w", sku, err)
	}
	return outbox.Publish(ctx, ReservedTopic, message.NewMessage(watermill.NewUUID(), msg.Payload))
}
