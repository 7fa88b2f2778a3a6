package main

import (
	"context"
	"database/sql"
	"database/sql/driver"
	"errors"
	"fmt"
	"strings"

	gomysql "github.com/go-sql-driver/mysql"

	"github.com/watermill-outbox/outbox/drivers/mysql"
)

// On MySQL and MariaDB (-mysql) the service runs the database/sql form with go-sql-driver/mysql
// and the framework's drivers/mysql. A service on MySQL alone opens its database with
//
//	db, err := sql.Open("mysql", dsn+"?"+mysql.DSNParams)
//	ob, err := outbox.New(outbox.Config{DB: db, Driver: mysql.Driver{}, Publisher: pub})
//
// and writes its SQL with MySQL's ? placeholders. This example writes its SQL once, with
// PostgreSQL's $1, $2 (which SQLite reads too): openMySQL wraps go-sql-driver/mysql's connector so
// that a statement's $N become ? with the arguments in their order. Statements without $N, such as
// every statement of drivers/mysql, go through unchanged.

// openMySQL opens the MySQL or MariaDB database of dsn (go-sql-driver/mysql's form:
// user:password@tcp(host:3306)/database) with the connection parameters the outbox needs.
func openMySQL(dsn string) (*sql.DB, error) {
	sep := "?"
	if strings.Contains(dsn, "?") {
		sep = "&"
	}
	// DSNParams last: they win over the same parameters in dsn (parseTime, interpolateParams
	// and charset are what the outbox relies on).
	cfg, err := gomysql.ParseDSN(dsn + sep + mysql.DSNParams)
	if err != nil {
		return nil, fmt.Errorf("mysql DSN: %w", err)
	}
	if cfg.DBName == "" {
		return nil, errors.New("mysql DSN: no database (user:password@tcp(host:3306)/database)")
	}
	c, err := gomysql.NewConnector(cfg)
	if err != nil {
		return nil, fmt.Errorf("mysql DSN: %w", err)
	}
	return sql.OpenDB(dollarConnector{c}), nil
}

// redactMySQLDSN hides the password of dsn in text.
func redactMySQLDSN(text, dsn string) string {
	if cfg, err := gomysql.ParseDSN(dsn); err == nil && cfg.Passwd != "" {
		return strings.ReplaceAll(text, cfg.Passwd, "xxxxx")
	}
	return text
}

// mysqlSchema is the business tables (schema, store.go) in MySQL's DDL: a key column must have a
// length (VARCHAR, not TEXT), indexes are declared with their table (MySQL has no CREATE INDEX IF
// NOT EXISTS), a TEXT column has no default, and timestamps are DATETIME(6), written in UTC. The
// binary collation tells case and accents apart, as PostgreSQL does, but pads with spaces
// ('w-1' = 'w-1 '): a SKU that differs from a product's by trailing spaces finds the product here
// and not on PostgreSQL. (The outbox's own tables keep their identifiers as binary strings, which
// compare byte for byte.)
var mysqlSchema = []string{
	`CREATE TABLE IF NOT EXISTS products (
		sku         VARCHAR(100) NOT NULL PRIMARY KEY,
		name        TEXT         NOT NULL,
		price_cents BIGINT       NOT NULL
	) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COLLATE = utf8mb4_bin`,
	`CREATE TABLE IF NOT EXISTS stock (
		sku       VARCHAR(100) NOT NULL PRIMARY KEY,
		available BIGINT       NOT NULL CHECK (available >= 0)
	) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COLLATE = utf8mb4_bin`,
	`CREATE TABLE IF NOT EXISTS orders (
		id           VARCHAR(64)  NOT NULL PRIMARY KEY,
		customer     VARCHAR(200) NOT NULL,
		sku          VARCHAR(100) NOT NULL,
		quantity     BIGINT       NOT NULL,
		amount_cents BIGINT       NOT NULL,
		status       VARCHAR(32)  NOT NULL,
		reason       VARCHAR(500) NOT NULL DEFAULT '',
		created_at   DATETIME(6)  NOT NULL,
		updated_at   DATETIME(6)  NOT NULL,
		INDEX orders_customer (customer)
	) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COLLATE = utf8mb4_bin`,
	`CREATE TABLE IF NOT EXISTS reservations (
		order_id   VARCHAR(64)  NOT NULL,
		sku        VARCHAR(100) NOT NULL,
		quantity   BIGINT       NOT NULL,
		outcome    VARCHAR(32)  NOT NULL,
		decided_at DATETIME(6)  NOT NULL,
		INDEX reservations_order (order_id)
	) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COLLATE = utf8mb4_bin`,
	`CREATE TABLE IF NOT EXISTS payments (
		id           VARCHAR(64) NOT NULL PRIMARY KEY,
		order_id     VARCHAR(64) NOT NULL,
		amount_cents BIGINT      NOT NULL,
		captured_at  DATETIME(6) NOT NULL,
		INDEX payments_order (order_id)
	) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COLLATE = utf8mb4_bin`,
	`CREATE TABLE IF NOT EXISTS order_history (
		order_id   VARCHAR(64)  NOT NULL,
		event      VARCHAR(100) NOT NULL,
		message_id VARCHAR(255) NOT NULL,
		at         DATETIME(6)  NOT NULL,
		INDEX order_history_order (order_id)
	) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COLLATE = utf8mb4_bin`,
}

// rebind turns the $N placeholders of query into ?, outside quotes. order[i] is the index of the
// caller's argument for the i-th ?; a query without $N comes back as it is, with order nil.
func rebind(query string) (_ string, order []int, err error) {
	if !strings.Contains(query, "$") {
		return query, nil, nil
	}
	var b strings.Builder
	var quote byte // the quote character of the literal or identifier being read; 0: none
	for i := 0; i < len(query); i++ {
		c := query[i]
		switch {
		case quote != 0:
			if c == '\\' && quote != '`' && i+1 < len(query) {
				b.WriteByte(c)
				i++
				c = query[i]
			} else if c == quote {
				quote = 0
			}
		case c == '\'' || c == '"' || c == '`':
			quote = c
		case c == '$' && i+1 < len(query) && isDigit(query[i+1]):
			j := i + 1
			n := 0
			for j < len(query) && isDigit(query[j]) {
				n = n*10 + int(query[j]-'0')
				j++
			}
			if n < 1 {
				return "", nil, fmt.Errorf("placeholder $%d in %q", n, query)
			}
			order = append(order, n-1)
			b.WriteByte('?')
			i = j - 1
			continue
		}
		b.WriteByte(c)
	}
	if order == nil {
		return query, nil, nil
	}
	return b.String(), order, nil
}

func isDigit(c byte) bool { return '0' <= c && c <= '9' }

// reorder returns the arguments of the ?s of a rebound statement: args[order[i]] for each.
func reorder(args []driver.NamedValue, order []int) ([]driver.NamedValue, error) {
	if order == nil {
		return args, nil
	}
	out := make([]driver.NamedValue, len(order))
	for i, k := range order {
		if k >= len(args) {
			return nil, fmt.Errorf("placeholder $%d with %d arguments", k+1, len(args))
		}
		out[i] = driver.NamedValue{Ordinal: i + 1, Value: args[k].Value}
	}
	return out, nil
}

// dollarConnector is go-sql-driver/mysql's connector with rebind on every statement.
type dollarConnector struct{ driver.Connector }

func (c dollarConnector) Connect(ctx context.Context) (driver.Conn, error) {
	conn, err := c.Connector.Connect(ctx)
	if err != nil {
		return nil, err
	}
	return dollarConn{conn}, nil
}

// dollarConn passes on every optional interface of go-sql-driver/mysql's connection: without
// ExecerContext and QueryerContext database/sql would prepare every statement (three round trips
// instead of one with interpolateParams), without SessionResetter and Validator it would keep
// broken connections.
type dollarConn struct{ driver.Conn }

var (
	_ driver.ExecerContext      = dollarConn{}
	_ driver.QueryerContext     = dollarConn{}
	_ driver.ConnPrepareContext = dollarConn{}
	_ driver.ConnBeginTx        = dollarConn{}
	_ driver.Pinger             = dollarConn{}
	_ driver.SessionResetter    = dollarConn{}
	_ driver.Validator          = dollarConn{}
	_ driver.NamedValueChecker  = dollarConn{}
)

func (c dollarConn) Prepare(query string) (driver.Stmt, error) {
	return c.PrepareContext(context.Background(), query)
}

func (c dollarConn) PrepareContext(ctx context.Context, query string) (driver.Stmt, error) {
	q, order, err := rebind(query)
	if err != nil {
		return nil, err
	}
	st, err := c.Conn.(driver.ConnPrepareContext).PrepareContext(ctx, q)
	if err != nil {
		return nil, err
	}
	return &dollarStmt{Stmt: st, order: order}, nil
}

func (c dollarConn) ExecContext(ctx context.Context, query string, args []driver.NamedValue) (driver.Result, error) {
	q, order, err := rebind(query)
	if err != nil {
		return nil, err
	}
	if args, err = reorder(args, order); err != nil {
		return nil, err
	}
	return c.Conn.(driver.ExecerContext).ExecContext(ctx, q, args)
}

func (c dollarConn) QueryContext(ctx context.Context, query string, args []driver.NamedValue) (driver.Rows, error) {
	q, order, err := rebind(query)
	if err != nil {
		return nil, err
	}
	if args, err = reorder(args, order); err != nil {
		return nil, err
	}
	return c.Conn.(driver.QueryerContext).QueryContext(ctx, q, args)
}

func (c dollarConn) BeginTx(ctx context.Context, opts driver.TxOptions) (driver.Tx, error) {
	return c.Conn.(driver.ConnBeginTx).BeginTx(ctx, opts)
}

func (c dollarConn) Ping(ctx context.Context) error { return c.Conn.(driver.Pinger).Ping(ctx) }

func (c dollarConn) ResetSession(ctx context.Context) error {
	return c.Conn.(driver.SessionResetter).ResetSession(ctx)
}

func (c dollarConn) IsValid() bool { return c.Conn.(driver.Validator).IsValid() }

func (c dollarConn) CheckNamedValue(v *driver.NamedValue) error {
	return c.Conn.(driver.NamedValueChecker).CheckNamedValue(v)
}

// dollarStmt is a prepared statement whose ?s take the caller's $N arguments.
type dollarStmt struct {
	driver.Stmt
	order []int
}

func (s *dollarStmt) NumInput() int {
	if s.order == nil {
		return s.Stmt.NumInput()
	}
	n := 0
	for _, k := range s.order {
		n = max(n, k+1)
	}
	return n
}

func (s *dollarStmt) ExecContext(ctx context.Context, args []driver.NamedValue) (driver.Result, error) {
	args, err := reorder(args, s.order)
	if err != nil {
		return nil, err
	}
	return s.Stmt.(driver.StmtExecContext).ExecContext(ctx, args)
}

func (s *dollarStmt) QueryContext(ctx context.Context, args []driver.NamedValue) (driver.Rows, error) {
	args, err := reorder(args, s.order)
	if err != nil {
		return nil, err
	}
	return s.Stmt.(driver.StmtQueryContext).QueryContext(ctx, args)
}

func (s *dollarStmt) CheckNamedValue(v *driver.NamedValue) error {
	if c, ok := s.Stmt.(driver.NamedValueChecker); ok {
		return c.CheckNamedValue(v)
	}
	return driver.ErrSkip
}
