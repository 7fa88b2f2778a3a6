package main

import (
	"context"
	"database/sql"
	"fmt"
	"path/filepath"
	"strings"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	_ "github.com/lib/pq"  // database/sql driver "postgres"
	_ "modernc.org/sqlite" // database/sql driver "sqlite" (pure Go, no cgo)

	"github.com/watermill-outbox/outbox/drivers/mysql"
	"github.com/watermill-outbox/outbox/drivers/outboxpgx"
	"github.com/watermill-outbox/outbox/drivers/postgres"
	"github.com/watermill-outbox/outbox/drivers/sqlite"
	"github.com/watermill-outbox/outbox/outboxdriver"
)

// openDatabase opens the service's database: PostgreSQL when cfg.postgres is set, MySQL or
// MariaDB when cfg.mysql is, otherwise the SQLite file orders.db in cfg.dataDir. The business
// tables and the outbox tables live in it side by side, which is what lets one transaction cover
// a business change and the events it causes. With form pgx (PostgreSQL only) it opens a
// pgxpool.Pool, and db is a database/sql handle on the same pool.
func openDatabase(ctx context.Context, cfg config) (db *sql.DB, pool *pgxpool.Pool, driver outboxdriver.Driver, desc string, err error) {
	dsn, dir, form := cfg.postgres, cfg.dataDir, cfg.form
	switch {
	case cfg.mysql != "":
		db, err = openMySQL(cfg.mysql)
		driver, desc = mysql.Driver{}, "MySQL/MariaDB (database/sql: go-sql-driver/mysql and drivers/mysql)"
		if err == nil {
			// As on PostgreSQL: connections kept for a dozen goroutines using the database.
			db.SetMaxOpenConns(32)
			db.SetMaxIdleConns(32)
		}
	case form == formPgx:
		// The pgx form LISTENs on a connection of the pool: a failed send in any instance wakes
		// every instance's relay at once.
		pool, db, err = openPgx(ctx, dsn)
		driver, desc = outboxpgx.Driver{Pool: pool}, "PostgreSQL (pgx form: pgxpool and drivers/outboxpgx)"
	case dsn != "":
		db, err = sql.Open("postgres", dsn)
		// ListenDSN: a failed send in any instance wakes every instance's relay at once.
		driver, desc = postgres.Driver{ListenDSN: dsn}, "PostgreSQL"
		if err == nil {
			// database/sql keeps 2 idle connections by default: with a dozen goroutines using
			// the database, it would open a connection (and prepare the outbox's statements on
			// it) for almost every transaction.
			db.SetMaxOpenConns(32)
			db.SetMaxIdleConns(32)
		}
	default:
		path := filepath.Join(dir, "orders.db")
		// sqlite.DSN adds the connection parameters the outbox needs (immediate transactions, a
		// busy timeout, WAL, synchronous commits): see the drivers/sqlite package documentation.
		db, err = sql.Open("sqlite", sqlite.DSN(path))
		driver, desc = sqlite.Driver{}, "SQLite "+path
		if err == nil {
			// SQLite has one writer. With one connection, transactions queue in database/sql
			// instead of polling SQLite's busy handler, which sleeps up to 100 ms between tries:
			// several times the throughput. The price: code holding a transaction must not use
			// the *sql.DB (it would wait for itself). Handlers write through outbox.Tx(ctx) anyway.
			db.SetMaxOpenConns(1)
		}
	}
	if err != nil {
		return nil, nil, nil, "", err
	}
	pingCtx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	if err := db.PingContext(pingCtx); err != nil {
		_ = db.Close()
		if pool != nil {
			pool.Close()
		}
		return nil, nil, nil, "", fmt.Errorf("connect to %s: %w", desc, err)
	}
	return db, pool, driver, desc, nil
}

// schema holds the business tables, written for PostgreSQL; createSchema adapts the one type
// SQLite spells differently (MySQL's are mysqlSchema, mysql.go). Statements are idempotent: every start runs them.
//
// reservations, payments and order_history have no UNIQUE constraint on the order on purpose: the
// chaos mode counts rows per order to show that nothing is applied twice without one. A real
// service would add them as a second line of defence.
var schema = []string{
	`CREATE TABLE IF NOT EXISTS products (
		sku         TEXT   PRIMARY KEY,
		name        TEXT   NOT NULL,
		price_cents BIGINT NOT NULL
	)`,
	`CREATE TABLE IF NOT EXISTS stock (
		sku       TEXT   PRIMARY KEY,
		available BIGINT NOT NULL CHECK (available >= 0)
	)`,
	`CREATE TABLE IF NOT EXISTS orders (
		id           TEXT        PRIMARY KEY,
		customer     TEXT        NOT NULL,
		sku          TEXT        NOT NULL,
		quantity     BIGINT      NOT NULL,
		amount_cents BIGINT      NOT NULL,
		status       TEXT        NOT NULL,
		reason       TEXT        NOT NULL DEFAULT '',
		created_at   TIMESTAMPTZ NOT NULL,
		updated_at   TIMESTAMPTZ NOT NULL
	)`,
	`CREATE INDEX IF NOT EXISTS orders_customer ON orders (customer)`,
	`CREATE TABLE IF NOT EXISTS reservations (
		order_id   TEXT        NOT NULL,
		sku        TEXT        NOT NULL,
		quantity   BIGINT      NOT NULL,
		outcome    TEXT        NOT NULL,
		decided_at TIMESTAMPTZ NOT NULL
	)`,
	`CREATE INDEX IF NOT EXISTS reservations_order ON reservations (order_id)`,
	`CREATE TABLE IF NOT EXISTS payments (
		id           TEXT        PRIMARY KEY,
		order_id     TEXT        NOT NULL,
		amount_cents BIGINT      NOT NULL,
		captured_at  TIMESTAMPTZ NOT NULL
	)`,
	`CREATE INDEX IF NOT EXISTS payments_order ON payments (order_id)`,
	`CREATE TABLE IF NOT EXISTS order_history (
		order_id   TEXT        NOT NULL,
		event      TEXT        NOT NULL,
		message_id TEXT        NOT NULL,
		at         TIMESTAMPTZ NOT NULL
	)`,
	`CREATE INDEX IF NOT EXISTS order_history_order ON order_history (order_id)`,
}

// catalogue is the demo's stock: the kettle runs out after a few orders, so some orders are rejected.
var catalogue = []struct {
	sku, name         string
	priceCents, units int64
}{
	{"espresso-beans", "Espresso beans, 1 kg", 1890, 100000},
	{"burr-grinder", "Burr grinder", 12900, 50},
	{"gooseneck-kettle", "Gooseneck kettle", 5900, 3},
}

// createSchema creates the business tables and stocks the catalogue (once: a restart keeps the
// stock levels).
func createSchema(ctx context.Context, db *sql.DB, driver outboxdriver.Driver) error {
	stmts := schema
	if _, isMySQL := driver.(mysql.Driver); isMySQL {
		stmts = mysqlSchema
	}
	for _, stmt := range stmts {
		if _, isSQLite := driver.(sqlite.Driver); isSQLite {
			// SQLite has no TIMESTAMPTZ; with TIMESTAMP the driver returns time.Time.
			stmt = strings.ReplaceAll(stmt, "TIMESTAMPTZ", "TIMESTAMP")
		}
		if _, err := db.ExecContext(ctx, stmt); err != nil {
			return fmt.Errorf("create schema: %w", err)
		}
	}
	for _, p := range catalogue {
		if err := addProduct(ctx, db, driver, p.sku, p.name, p.priceCents, p.units); err != nil {
			return err
		}
	}
	return nil
}

// addProduct adds a product and its stock unless the SKU exists.
func addProduct(ctx context.Context, db *sql.DB, driver outboxdriver.Driver, sku, name string, priceCents, units int64) error {
	tx, err := db.BeginTx(ctx, nil)
	if err != nil {
		return err
	}
	defer func() { _ = tx.Rollback() }()
	ifAbsent := "ON CONFLICT (sku) DO NOTHING"
	if _, isMySQL := driver.(mysql.Driver); isMySQL {
		ifAbsent = "ON DUPLICATE KEY UPDATE sku = sku" // MySQL's way; INSERT IGNORE would hide other errors
	}
	if _, err := tx.ExecContext(ctx, `INSERT INTO products (sku, name, price_cents) VALUES ($1, $2, $3) `+ifAbsent,
		sku, name, priceCents); err != nil {
		return fmt.Errorf("add product %s: %w", sku, err)
	}
	if _, err := tx.ExecContext(ctx, `INSERT INTO stock (sku, available) VALUES ($1, $2) `+ifAbsent, sku, units); err != nil {
		return fmt.Errorf("stock product %s: %w", sku, err)
	}
	return tx.Commit()
}
