// Command outbox-mysql is the operators' command `outbox` (see cmd/outbox) for the outbox tables
// of a MySQL or MariaDB database: status, parked effects and their repairs, failing and poisoned
// messages, look-ups, migrations and cleanup, each change guarded, dry-runnable and written to the
// audit table. It lives in the drivers/mysql module because the library's module does not depend
// on MySQL's database/sql driver.
//
// -dsn (default $OUTBOX_DSN, then $DATABASE_URL) is a DSN of github.com/go-sql-driver/mysql,
// optionally written with a mysql:// prefix: user:password@tcp(host:3306)/database. The
// parameters the outbox needs (mysql.DSNParams) are set whatever the DSN says. -schema is the
// database of the tables (empty: the DSN's).
//
// Install it with: go install github.com/watermill-outbox/outbox/drivers/mysql/cmd/outbox-mysql@latest
package main

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"io"
	"os"
	"strings"
	"time"

	gomysql "github.com/go-sql-driver/mysql"

	"github.com/watermill-outbox/outbox/drivers/mysql"
	"github.com/watermill-outbox/outbox/internal/outboxcli"
)

func main() {
	os.Exit(run(context.Background(), os.Args[1:], os.Stdout, os.Stderr, os.Getenv))
}

func run(ctx context.Context, args []string, stdout, stderr io.Writer, getenv func(string) string) int {
	return outboxcli.Run(ctx, database(), args, stdout, stderr, getenv)
}

// database is MySQL and MariaDB for the command.
func database() outboxcli.Database {
	return outboxcli.Database{
		Title:            "MySQL/MariaDB",
		DSNFormat:        "go-sql-driver/mysql format, user:password@tcp(host:3306)/database, mysql:// prefix allowed",
		DefaultSchema:    "the DSN's database",
		Open:             open,
		Driver:           mysql.Driver{},
		RedactDSN:        redact,
		IsUndefinedTable: mysql.IsUndefinedTable,
		Migrations:       mysql.Migrations,
		MigrationScript:  mysql.MigrationScript,
		MigrationsTable: func(schema, prefix string) (string, error) {
			n, err := mysql.NewNames(schema, prefix)
			return n.Migrations, err
		},
		// The grants of an application account are the team's: MySQL has no grant statements
		// of the driver's yet.
		Grants: nil,
	}
}

// config parses dsn (with or without the mysql:// prefix) and sets what the outbox needs: times
// read as time.Time in UTC, arguments interpolated, utf8mb4.
func config(dsn string) (*gomysql.Config, error) {
	cfg, err := gomysql.ParseDSN(strings.TrimPrefix(dsn, "mysql://"))
	if err != nil {
		// The parser's errors name no part of the DSN; the wrapper says which format it wants.
		return nil, fmt.Errorf("the DSN is not one of go-sql-driver/mysql (user:password@tcp(host:3306)/database): %w", err)
	}
	cfg.ParseTime, cfg.InterpolateParams = true, true
	if !strings.Contains(dsn, "charset=") {
		if err := cfg.Apply(gomysql.Charset("utf8mb4", "")); err != nil {
			return nil, err
		}
	}
	return cfg, nil
}

// open opens the database; go-sql-driver/mysql watches the context while it connects and
// queries, so the command's deadline needs nothing of the connections.
func open(dsn string, _ time.Time) (*sql.DB, error) {
	cfg, err := config(dsn)
	if err != nil {
		return nil, err
	}
	c, err := gomysql.NewConnector(cfg)
	if err != nil {
		return nil, errors.New("the DSN's parameters are not usable: " + redact(err.Error(), dsn))
	}
	return sql.OpenDB(c), nil
}

// redact takes the password of dsn out of text.
func redact(text, dsn string) string {
	if cfg, err := gomysql.ParseDSN(strings.TrimPrefix(dsn, "mysql://")); err == nil && cfg.Passwd != "" {
		return strings.ReplaceAll(text, cfg.Passwd, "xxxxx")
	}
	return text
}
