package mysql_test

import (
	"context"
	"strings"
	"testing"

	"github.com/watermill-outbox/outbox/drivers/mysql"
	"github.com/watermill-outbox/outbox/drivers/mysql/internal/mysqltest"
	"github.com/watermill-outbox/outbox/outboxdriver"
)

// TestNames: names are quoted with backticks, qualified only when a schema is given, and only
// identifiers that stay within MySQL's 64 characters (and carry no SQL) are accepted.
func TestNames(t *testing.T) {
	n, err := mysql.NewNames("", "ob_")
	if err != nil || n.Effects != "`ob_effects`" || n.Processed != "`ob_processed`" {
		t.Fatalf("NewNames(\"\", ob_) = %+v, %v", n, err)
	}
	n, err = mysql.NewNames("shop", "")
	if err != nil || n.Effects != "`shop`.`effects`" || n.Migrations != "`shop`.`migrations`" {
		t.Fatalf("NewNames(shop, \"\") = %+v, %v", n, err)
	}
	longest := strings.Repeat("p", 40)
	n, err = mysql.NewNames(strings.Repeat("s", 40), longest)
	if err != nil || len(strings.Trim(strings.Split(n.Migrations, ".")[1], "`")) > 64 {
		t.Fatalf("NewNames(40 characters each) = %+v, %v; want names within 64 characters", n, err)
	}
	for _, bad := range [][2]string{{"shop`; DROP TABLE x", ""}, {"", "p`x"}, {"Shop", ""}, {"", strings.Repeat("p", 41)}} {
		if _, err := mysql.NewNames(bad[0], bad[1]); err == nil {
			t.Errorf("NewNames(%q, %q): want an error", bad[0], bad[1])
		}
	}
	if _, err := (mysql.Driver{}).Open(nil, outboxdriver.StoreOptions{Schema: "a-b"}); err == nil {
		t.Error("Open with schema a-b: want an error")
	}
}

// TestMigrationsAreIdempotentStatements: MySQL commits DDL implicitly, so a migration stopped
// half way is run again whole: each of its statements must be one that can run twice.
func TestMigrationsAreIdempotentStatements(t *testing.T) {
	ms, err := mysql.Migrations("", "ob_")
	if err != nil {
		t.Fatal(err)
	}
	for _, m := range ms {
		// An ALTER TABLE may only restate columns (MODIFY): adding one, or an index, fails the
		// second time.
		alter := false
		for _, line := range strings.Split(m.SQL, "\n") {
			l := strings.TrimSpace(line)
			switch {
			case strings.HasPrefix(l, "--") || l == "":
				continue
			case strings.HasPrefix(l, "CREATE TABLE") && !strings.HasPrefix(l, "CREATE TABLE IF NOT EXISTS"),
				strings.HasPrefix(l, "CREATE INDEX"), strings.HasPrefix(l, "INSERT INTO"):
				t.Errorf("migration %03d: %q cannot run twice", m.Version, l)
			case strings.HasPrefix(l, "ALTER TABLE"):
				alter = !strings.HasSuffix(l, ";")
				if !alter {
					t.Errorf("migration %03d: %q: one clause a line, each a MODIFY", m.Version, l)
				}
				continue
			case alter && !strings.HasPrefix(l, "MODIFY "):
				t.Errorf("migration %03d: %q cannot run twice", m.Version, l)
			}
			if strings.HasSuffix(l, ";") {
				alter = false
			}
		}
		if strings.Contains(m.SQL, "``.") || strings.Contains(m.SQL, "{{") {
			t.Errorf("migration %03d: unresolved names in %s", m.Version, m.SQL)
		}
	}
}

// TestMigrateAfterAnInterruptedMigration: a migration that stopped after some of its statements
// (its DDL committed, its version not recorded) is completed by the next Migrate.
func TestMigrateAfterAnInterruptedMigration(t *testing.T) {
	db := mysqltest.DB(t)
	ms, err := mysql.Migrations("", "")
	if err != nil {
		t.Fatal(err)
	}
	// The first two statements: the claims table and the effects table.
	for _, stmt := range strings.SplitN(ms[0].SQL, ";\n", 3)[:2] {
		if _, err := db.Exec(stmt); err != nil {
			t.Fatalf("%s: %v", stmt, err)
		}
	}
	st, err := mysql.Driver{}.Open(db, outboxdriver.StoreOptions{})
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	if err := st.SchemaCheck(ctx); err == nil {
		t.Fatal("SchemaCheck after an interrupted migration: want an error")
	}
	if err := st.Migrate(ctx); err != nil {
		t.Fatalf("Migrate after an interrupted migration: %v", err)
	}
	if err := st.SchemaCheck(ctx); err != nil {
		t.Fatalf("SchemaCheck: %v", err)
	}
	if _, err := st.Stats(ctx, outboxdriver.StatsParams{}); err != nil {
		t.Fatalf("Stats on the completed tables: %v", err)
	}
}
