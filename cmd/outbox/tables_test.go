package main

import (
	"errors"
	"os"
	"strings"
	"testing"

	"github.com/watermill-outbox/outbox/internal/pgtest"
)

// Item: configuration.md's list of the tables the prefix names missed some that the migrations
// create, so a reader granting, backing up or dropping them by that list missed them too. Every
// table the migrations create on PostgreSQL is named in the TablePrefix row.
func TestConfigurationNamesEveryTable(t *testing.T) {
	doc, err := os.ReadFile("../../docs/configuration.md")
	if err != nil {
		t.Fatal(err)
	}
	var row string
	for _, l := range strings.Split(string(doc), "\n") {
		if strings.HasPrefix(l, "| `TablePrefix` |") {
			row = l
		}
	}
	if row == "" {
		t.Fatal("docs/configuration.md has no TablePrefix row")
	}
	dsn := pgtest.DSN(t)
	if code, out, errOut := cliAs(dsn, "migrate", "up"); code != 0 {
		t.Fatalf("migrate up: %s %s", out, errOut)
	}
	rows, err := openDB(t, dsn).Query(`SELECT c.relname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
		WHERE n.nspname = 'public' AND c.relkind IN ('r', 'p') AND c.relname LIKE 'outbox\_%' ORDER BY 1`)
	if err != nil {
		t.Fatal(err)
	}
	var tables int
	for rows.Next() {
		var name string
		if err := rows.Scan(&name); err != nil {
			t.Fatal(err)
		}
		tables++
		if !strings.Contains(row, "`"+name+"`") {
			t.Errorf("docs/configuration.md's TablePrefix row does not name %s", name)
		}
	}
	if err := errors.Join(rows.Err(), rows.Close()); err != nil {
		t.Fatal(err)
	}
	if tables < 10 {
		t.Fatalf("%d tables found, the migrations create more", tables)
	}
}
