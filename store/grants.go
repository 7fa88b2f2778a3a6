package store

import (
	"fmt"
	"strings"
)

// Table is one table the migrations create, with what each role may do with it.
type Table struct {
	// Name is the quoted, schema-qualified name.
	Name string
	// Sequence is the quoted, schema-qualified sequence of its serial column ("" if none).
	Sequence string
	// App are the privileges of the application role (the services, the CLI's reads and
	// repairs): data only, no DDL.
	App []string
	// Operator are the privileges an operator's role holds on top of App.
	Operator []string
}

var dml = []string{"SELECT", "INSERT", "UPDATE", "DELETE"}

// Tables lists every table the migrations create. Grants are generated from it, and a test
// checks that every table in a migrated schema is listed: a migration that adds a table adds it
// here, or the test fails.
func (n Names) Tables() []Table {
	seq := func(table string) string { return `"` + n.Schema + `"."` + n.Prefix + table + `_id_seq"` }
	return []Table{
		{Name: n.Processed, App: dml},
		{Name: n.Effects, Sequence: seq("effects"), App: dml},
		{Name: n.Dispatched, App: dml},
		{Name: n.Delayed, Sequence: seq("delayed"), App: dml},
		{Name: n.Attempts, App: dml},
		// One row, written by the migration; the services lease and update it.
		{Name: n.Stats, App: []string{"SELECT", "UPDATE"}},
		// Append-only for the application: a repair writes its entry in its own transaction, and
		// nothing the application runs can rewrite or read back who did what.
		{Name: n.Audit, Sequence: seq("audit"), App: []string{"INSERT"}, Operator: []string{"SELECT"}},
		// Keys are claimed and their results written by the units of work, and deleted by the
		// cleanup once expired.
		{Name: n.Idempotency, App: dml},
		// Written by the units of work that give up on a message; retried and discarded by the
		// operators' tools, which run with the application's role.
		{Name: n.DeadLetters, App: dml},
		// Migrate reads it to find that nothing is to be done; applying migrations takes a role
		// that may create tables.
		{Name: n.Migrations, App: []string{"SELECT"}},
	}
}

// QuoteRole quotes a role name as a PostgreSQL identifier.
func QuoteRole(role string) (string, error) {
	if role == "" || strings.ContainsRune(role, 0) || len(role) > 63 {
		return "", fmt.Errorf("role %q: want a PostgreSQL role name of 1 to 63 bytes", role)
	}
	return `"` + strings.ReplaceAll(role, `"`, `""`) + `"`, nil
}

// Grants returns the statements that give role what it needs on the tables of n: the
// application's privileges, and with operator also those of an operator (reading the audit
// table). Neither may change the schema.
func Grants(n Names, role string, operator bool) ([]string, error) {
	r, err := QuoteRole(role)
	if err != nil {
		return nil, err
	}
	out := []string{"GRANT USAGE ON SCHEMA " + n.QuotedSchema + " TO " + r}
	for _, t := range n.Tables() {
		privs := t.App
		if operator {
			privs = append(append([]string(nil), t.App...), t.Operator...)
		}
		out = append(out, "GRANT "+strings.Join(privs, ", ")+" ON TABLE "+t.Name+" TO "+r)
		if t.Sequence != "" {
			// nextval for the serial id of an INSERT.
			out = append(out, "GRANT USAGE ON SEQUENCE "+t.Sequence+" TO "+r)
		}
	}
	return out, nil
}
