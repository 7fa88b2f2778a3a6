// Package mysqltest provides a throwaway MariaDB or MySQL server for the driver's tests: call Run
// from TestMain, then DSN or DB in each test for a fresh database of its own, dropped on cleanup.
// Set OUTBOX_TEST_MYSQL_DSN (go-sql-driver format, a user that may CREATE DATABASE) to use an
// existing server instead of starting one. Without either, the tests fail: they never skip.
package mysqltest

import (
	"context"
	"crypto/rand"
	"database/sql"
	"encoding/hex"
	"fmt"
	"os"
	"strings"
	"testing"
	"time"

	gomysql "github.com/go-sql-driver/mysql"

	"github.com/watermill-outbox/outbox/drivers/mysql"
	"github.com/watermill-outbox/outbox/internal/mysqlserver"
)

// EnvDSN names an existing server to use instead of starting one.
const EnvDSN = "OUTBOX_TEST_MYSQL_DSN"

var (
	base   *gomysql.Config
	server *mysqlserver.Server
)

// Run starts the server (unless EnvDSN is set), runs the tests and stops it. It fails loudly when
// it cannot start one.
func Run(m *testing.M) int {
	if dsn := os.Getenv(EnvDSN); dsn != "" {
		cfg, err := gomysql.ParseDSN(dsn)
		if err != nil {
			fmt.Fprintf(os.Stderr, "mysqltest: %s: %v\n", EnvDSN, err)
			return 1
		}
		base = cfg
		return m.Run()
	}
	s, err := mysqlserver.Start()
	if err != nil {
		fmt.Fprintf(os.Stderr, "mysqltest: cannot start a MariaDB/MySQL server for the tests (set %s to use one): %v\n", EnvDSN, err)
		return 1
	}
	server = s
	defer func() {
		if err := s.Stop(); err != nil {
			fmt.Fprintf(os.Stderr, "mysqltest: stop server: %v\n", err)
		}
	}()
	cfg := gomysql.NewConfig()
	cfg.User, cfg.Net, cfg.Addr = "root", "tcp", s.Addr
	base = cfg
	return m.Run()
}

// Private tells whether the server is the tests' own (started by Run), whose global settings a
// test may change.
func Private() bool { return server != nil }

// Version is the server's version.
func Version(t testing.TB) string {
	var v string
	if err := DB(t).QueryRow(`SELECT version()`).Scan(&v); err != nil {
		t.Fatal(err)
	}
	return v
}

// DSN creates a fresh database and returns a DSN of it with mysql.DSNParams; the database is
// dropped when the test ends.
func DSN(t testing.TB) string {
	t.Helper()
	if base == nil {
		t.Fatal("mysqltest: Run was not called from TestMain")
	}
	b := make([]byte, 6)
	_, _ = rand.Read(b)
	name := "t_" + hex.EncodeToString(b)
	admin, err := sql.Open("mysql", base.FormatDSN())
	if err != nil {
		t.Fatal(err)
	}
	defer admin.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if _, err := admin.ExecContext(ctx, "CREATE DATABASE `"+name+"` CHARACTER SET utf8mb4 COLLATE utf8mb4_bin"); err != nil {
		t.Fatalf("create database: %v", err)
	}
	t.Cleanup(func() {
		admin, err := sql.Open("mysql", base.FormatDSN())
		if err != nil {
			t.Error(err)
			return
		}
		defer admin.Close()
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		if _, err := admin.ExecContext(ctx, "DROP DATABASE IF EXISTS `"+name+"`"); err != nil {
			t.Errorf("drop database %s: %v", name, err)
		}
	})
	cfg := base.Clone()
	cfg.DBName = name
	dsn := cfg.FormatDSN()
	if strings.Contains(dsn, "?") {
		return dsn + "&" + mysql.DSNParams
	}
	return dsn + "?" + mysql.DSNParams
}

// DB opens a fresh database (see DSN), closed when the test ends.
func DB(t testing.TB) *sql.DB {
	t.Helper()
	db, err := sql.Open("mysql", DSN(t))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = db.Close() })
	return db
}
