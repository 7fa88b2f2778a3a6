package store

import (
	"context"
	"database/sql"
	"fmt"
	"io/fs"
	"regexp"
	"sort"
	"strconv"
	"strings"

	"github.com/watermill-outbox/outbox/outboxdriver"
)

// Migration is one numbered schema change.
type Migration struct {
	Version int
	Name    string
	SQL     string
}

var migrationFileRe = regexp.MustCompile(`^(\d{3})_([a-z0-9_]+)\.up\.sql$`)

// LoadMigrations reads the files NNN_name.up.sql of fsys, in version order. In their text,
// {{schema}} stands for the quoted schema, {{prefix}} for the table prefix inside quoted names, so
// "{{schema}}"."{{prefix}}effects" becomes the effects table.
func LoadMigrations(fsys fs.FS, names Names) ([]Migration, error) {
	entries, err := fs.ReadDir(fsys, ".")
	if err != nil {
		return nil, fmt.Errorf("read migrations: %w", err)
	}
	var out []Migration
	for _, e := range entries {
		m := migrationFileRe.FindStringSubmatch(e.Name())
		if m == nil {
			continue
		}
		b, err := fs.ReadFile(fsys, e.Name())
		if err != nil {
			return nil, fmt.Errorf("read migration %s: %w", e.Name(), err)
		}
		v, _ := strconv.Atoi(m[1])
		text := strings.NewReplacer("{{schema}}", names.Schema, "{{prefix}}", names.Prefix).Replace(string(b))
		out = append(out, Migration{Version: v, Name: m[2], SQL: text})
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Version < out[j].Version })
	for i, m := range out {
		if m.Version != i+1 {
			return nil, fmt.Errorf("migrations must be numbered 001, 002, ... without gaps; found %03d at position %d", m.Version, i+1)
		}
	}
	return out, nil
}

// MigrateQueries are the dialect's statements the migrator needs.
type MigrateQueries struct {
	// Lock serializes migrators (run inside the migration transaction); empty if not needed.
	Lock string
	// Bootstrap creates the schema and the migrations table if they do not exist.
	Bootstrap []string
	// Applied selects the applied versions.
	Applied string
	// Insert records a version (arg: version).
	Insert string
	// AlreadyApplied, when set, tells an error of a migration that means its change is there
	// already (SQLite has no ADD COLUMN IF NOT EXISTS; such a migration holds one statement).
	AlreadyApplied func(error) bool
	// Stale, when set, tells an error of a migrator that may have acted on the catalog as it
	// was before it got the lock: Migrate runs again, in a new transaction, which sees what the
	// migrator it waited for did. (A PostgreSQL session caches that a schema or table does not
	// exist, from a look-up before the lock, such as Migrate's first SchemaCheck, and reads other
	// sessions' catalog changes at a transaction's start or when it locks a table; an advisory
	// lock is neither. CREATE SCHEMA IF NOT EXISTS then took a schema created meanwhile for
	// missing, and failed on the catalog's unique index.)
	Stale func(error) bool
}

// migrateAttempts bounds Migrate's runs when an error is Stale: the second run's transaction
// begins after the migrator the first waited for committed.
const migrateAttempts = 3

// Migrate applies the missing migrations in one transaction, under the dialect's lock, so that
// several processes can run it at once.
func Migrate(ctx context.Context, db *sql.DB, q MigrateQueries, migrations []Migration) error {
	for attempt := 1; ; attempt++ {
		err := migrateOnce(ctx, db, q, migrations)
		if err == nil || q.Stale == nil || !q.Stale(err) || attempt == migrateAttempts || ctx.Err() != nil {
			return err
		}
	}
}

func migrateOnce(ctx context.Context, db *sql.DB, q MigrateQueries, migrations []Migration) error {
	tx, err := db.BeginTx(ctx, nil)
	if err != nil {
		return fmt.Errorf("begin: %w", err)
	}
	defer func() { _ = tx.Rollback() }()
	if q.Lock != "" {
		if _, err := tx.ExecContext(ctx, q.Lock); err != nil {
			return fmt.Errorf("take migration lock: %w", err)
		}
	}
	for _, s := range q.Bootstrap {
		if _, err := tx.ExecContext(ctx, s); err != nil {
			return fmt.Errorf("create migrations table: %w", err)
		}
	}
	applied := map[int]bool{}
	rows, err := tx.QueryContext(ctx, q.Applied)
	if err != nil {
		return fmt.Errorf("read applied migrations: %w", err)
	}
	for rows.Next() {
		var v int
		if err := rows.Scan(&v); err != nil {
			rows.Close()
			return fmt.Errorf("read applied migrations: %w", err)
		}
		applied[v] = true
	}
	rows.Close()
	if err := rows.Err(); err != nil {
		return fmt.Errorf("read applied migrations: %w", err)
	}
	for _, m := range migrations {
		if applied[m.Version] {
			continue
		}
		if _, err := tx.ExecContext(ctx, m.SQL); err != nil && (q.AlreadyApplied == nil || !q.AlreadyApplied(err)) {
			return fmt.Errorf("migration %03d_%s: %w", m.Version, m.Name, err)
		}
		if _, err := tx.ExecContext(ctx, q.Insert, m.Version); err != nil {
			return fmt.Errorf("record migration %03d: %w", m.Version, err)
		}
	}
	if err := tx.Commit(); err != nil {
		return fmt.Errorf("commit migrations: %w", err)
	}
	return nil
}

// SchemaCheck compares the latest applied version with want.
func SchemaCheck(ctx context.Context, db *sql.DB, latestQuery string, want int, isUndefinedTable func(error) bool, names Names) error {
	var v sql.NullInt64
	err := db.QueryRowContext(ctx, latestQuery).Scan(&v)
	if err != nil {
		if isUndefinedTable(err) {
			return fmt.Errorf("%w (schema %q, prefix %q): %w", outboxdriver.ErrSchemaMissing, names.Schema, names.Prefix, err)
		}
		return fmt.Errorf("check schema: %w", err)
	}
	if int(v.Int64) < want {
		return fmt.Errorf("%w: version %d, this build needs %d", outboxdriver.ErrSchemaOutdated, v.Int64, want)
	}
	return nil
}
