package mysql

import (
	"context"
	"crypto/sha1"
	"database/sql"
	"database/sql/driver"
	"embed"
	"encoding/hex"
	"errors"
	"fmt"
	"io/fs"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	gomysql "github.com/go-sql-driver/mysql"

	"github.com/watermill-outbox/outbox/outboxdriver"
	"github.com/watermill-outbox/outbox/store"
)

//go:embed migrations/*.sql
var migrationFiles embed.FS

// DSNParams are the connection parameters the outbox needs, for github.com/go-sql-driver/mysql:
//
//   - parseTime=true: DATETIME columns are read as time.Time (the parked effects' times).
//   - interpolateParams=true: arguments are put into the statement by the client, so that a
//     statement with arguments is one round trip, not three (prepare, execute, close).
//   - charset=utf8mb4: every text is UTF-8 of any length per character.
//
// The time zone (loc) is left at the default, UTC: the tables keep UTC.
const DSNParams = "parseTime=true&interpolateParams=true&charset=utf8mb4"

// maxIdentifier is MySQL's limit on a database or table name.
const maxIdentifier = 64

// longestTable is the longest table name suffix the migrations create.
const longestTable = "dead_letters"

// Driver is the MySQL and MariaDB dialect (MySQL 8.0+, MariaDB 10.6+: both have SKIP LOCKED and
// JSON_TABLE). The zero value is ready to use. The program registers the database/sql driver
// (import _ "github.com/go-sql-driver/mysql") and opens the DB with DSNParams in its DSN.
type Driver struct {
	// MigrateLockTimeout bounds the wait of Migrate for another process's migration
	// (GET_LOCK). Default: one minute.
	MigrateLockTimeout time.Duration
}

var _ outboxdriver.Driver = Driver{}

// Open implements outboxdriver.Driver. opts.Schema is the database of the tables; empty means
// the database the connection uses (the DSN's).
func (d Driver) Open(db *sql.DB, opts outboxdriver.StoreOptions) (outboxdriver.Store, error) {
	names, err := NewNames(opts.Schema, opts.TablePrefix)
	if err != nil {
		return nil, err
	}
	migrations, err := fs.Sub(migrationFiles, "migrations")
	if err != nil {
		return nil, fmt.Errorf("mysql migrations: %w", err)
	}
	lockTimeout := d.MigrateLockTimeout
	if lockTimeout <= 0 {
		lockTimeout = time.Minute
	}
	q := newQueries(names)
	st, err := store.New(db, names, store.Dialect{
		Queries:          q.store(),
		Migrations:       migrations,
		IsUndefinedTable: IsUndefinedTable,
		IsReadOnly:       IsReadOnly,
		// Statements are not prepared: with interpolateParams a statement is one round trip
		// already, and a prepared one would be tied to a connection.
		Prepare: false,
		// No notifications: the relays of other processes poll every RelayInterval; the relay of
		// the process that handed an effect over is woken at once by the outbox itself.
		Listen: nil,
		Hooks: store.Hooks{
			MessageClaim:         q.messageClaim,
			EffectInsert:         q.effectInsert,
			EffectInsertClaimed:  q.effectInsertClaimed,
			AttemptRecord:        q.attemptRecord,
			EffectMarkDispatched: q.effectMarkDispatched,
			EffectDiscard:        q.effectDiscard,
			EffectClaimDue:       q.effectClaimDue,
			KeyClaim:             q.keyClaim,
			DelayedInsert:        q.delayedInsert,
			DelayedPromote:       q.delayedPromote,
			Migrate: func(ctx context.Context, db *sql.DB, ms []store.Migration) error {
				return migrate(ctx, db, names, ms, lockTimeout)
			},
		},
		Ops:         q.ops(),
		DeadLetters: q.deadLetters(),
	})
	if err != nil {
		return nil, err
	}
	return &mysqlStore{SQL: st, db: db, q: q}, nil
}

// mysqlStore is the store with what the framework asks of MySQL's errors, its session locks of
// idempotency keys, and its check that the server takes writes.
type mysqlStore struct {
	*store.SQL
	db *sql.DB
	q  queries
	// oldReadOnlyName: the server knows the session's read-only setting as tx_read_only only.
	oldReadOnlyName atomic.Bool

	// database is the connection's database, read once (TablesIdentity), for tables named
	// without one.
	databaseMu sync.Mutex
	database   string
}

var _ outboxdriver.TablesIdentifier = (*mysqlStore)(nil)

// TablesIdentity implements outboxdriver.TablesIdentifier: the claims table named with its
// database, the connection's (read once, within a few seconds at most) when the Schema is "", so
// that a Store named by its database and one that leaves it to the connection are one. Should
// the database not answer, the name as configured.
func (s *mysqlStore) TablesIdentity() string {
	if s.q.n.Schema != "" {
		return s.q.n.Processed
	}
	s.databaseMu.Lock()
	defer s.databaseMu.Unlock()
	if s.database == "" {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		var current sql.NullString
		if err := s.db.QueryRowContext(ctx, `SELECT DATABASE()`).Scan(&current); err != nil || current.String == "" {
			return s.q.n.Processed
		}
		s.database = current.String
	}
	n, err := NewNames(s.database, s.q.n.Prefix)
	if err != nil {
		return s.q.n.Processed
	}
	return n.Processed
}

var _ outboxdriver.RetryClassifier = (*mysqlStore)(nil)

// Retryable implements outboxdriver.RetryClassifier.
func (*mysqlStore) Retryable(err error) bool { return IsRetryable(err) }

var _ outboxdriver.ReachabilityClassifier = (*mysqlStore)(nil)

// Unreachable implements outboxdriver.ReachabilityClassifier.
func (*mysqlStore) Unreachable(err error) bool { return IsUnreachable(err) }

var _ outboxdriver.WritableChecker = (*mysqlStore)(nil)

// CheckWritable implements outboxdriver.WritableChecker: a server started --read-only (a replica;
// MySQL's --super-read-only sets it too) or a session whose transactions are read-only takes no
// unit of work. MariaDB before 11.1 names the session's setting tx_read_only only, MySQL 8
// transaction_read_only only.
func (s *mysqlStore) CheckWritable(ctx context.Context) error {
	var server, session bool
	read := func() error {
		name := "transaction_read_only"
		if s.oldReadOnlyName.Load() {
			name = "tx_read_only"
		}
		return s.db.QueryRowContext(ctx, `SELECT @@global.read_only, @@`+name).Scan(&server, &session)
	}
	err := read()
	var e *gomysql.MySQLError
	if errors.As(err, &e) && e.Number == 1193 && !s.oldReadOnlyName.Load() { // unknown system variable
		s.oldReadOnlyName.Store(true)
		err = read()
	}
	switch {
	case err != nil:
		return fmt.Errorf("check that the database takes writes: %w", err)
	case server:
		return fmt.Errorf("%w: the server is read-only (read_only = ON: a replica?); connect to the primary", outboxdriver.ErrReadOnly)
	case session:
		return fmt.Errorf("%w: transactions are read-only (transaction_read_only = ON)", outboxdriver.ErrReadOnly)
	}
	return nil
}

// IsRetryable tells a deadlock (1213, the transaction rolled back) or a lock wait timeout (1205,
// the statement rolled back): running the unit of work again usually gets past either. Between
// copies of one message both are the copies' claims meeting: the retry then finds the claim.
func IsRetryable(err error) bool {
	var e *gomysql.MySQLError
	return errors.As(err, &e) && (e.Number == 1213 || e.Number == 1205)
}

// IsUnreachable tells whether err means the server takes no connections now: too many
// connections (1040, or for the user: 1203) or a server shutting down (1053).
func IsUnreachable(err error) bool {
	var e *gomysql.MySQLError
	return errors.As(err, &e) && (e.Number == 1040 || e.Number == 1203 || e.Number == 1053)
}

// IsUndefinedTable tells whether err is MySQL's "table doesn't exist" (1146) or "unknown
// database" (1049).
func IsUndefinedTable(err error) bool {
	var e *gomysql.MySQLError
	return errors.As(err, &e) && (e.Number == 1146 || e.Number == 1049)
}

// IsReadOnly tells whether err means the server takes no writes: --read-only or
// --super-read-only (1290, 1836), or a read-only transaction (1792). 1290 is the refusal of a
// statement by any option (--skip-grant-tables, --secure-file-priv): only the read-only ones count.
func IsReadOnly(err error) bool {
	var e *gomysql.MySQLError
	if !errors.As(err, &e) {
		return false
	}
	switch e.Number {
	case 1836, 1792:
		return true
	case 1290:
		return strings.Contains(e.Message, "read-only") || strings.Contains(e.Message, "read_only")
	}
	return false
}

// NewNames validates schema (empty: the connection's database) and prefix, and returns the
// quoted table names. Every name stays within MySQL's 64-character identifiers.
func NewNames(schema, prefix string) (store.Names, error) {
	if schema != "" {
		if err := store.ValidateIdent("schema", schema); err != nil {
			return store.Names{}, err
		}
	}
	if prefix != "" {
		if err := store.ValidateIdent("table prefix", prefix); err != nil {
			return store.Names{}, err
		}
	}
	if len(schema) > maxIdentifier || len(prefix+longestTable) > maxIdentifier {
		return store.Names{}, fmt.Errorf("schema %q or table prefix %q too long for MySQL's %d-character names", schema, prefix, maxIdentifier)
	}
	q := func(t string) string {
		if schema == "" {
			return "`" + prefix + t + "`"
		}
		return "`" + schema + "`.`" + prefix + t + "`"
	}
	quoted := ""
	if schema != "" {
		quoted = "`" + schema + "`"
	}
	return store.Names{
		Schema: schema, Prefix: prefix, QuotedSchema: quoted,
		Processed: q("processed"), Effects: q("effects"), Dispatched: q("effects"), Attempts: q("attempts"),
		Stats: q("stats"), Audit: q("audit"), Migrations: q("migrations"), Delayed: q("delayed"),
		Idempotency: q("idempotency"), DeadLetters: q("dead_letters"),
	}, nil
}

// Migrations returns the migrations of the outbox tables for schema (empty: the connection's
// database) and prefix, as SQL, in order: for teams that apply the DDL with their own tool.
func Migrations(schema, prefix string) ([]store.Migration, error) {
	names, err := NewNames(schema, prefix)
	if err != nil {
		return nil, err
	}
	sub, err := fs.Sub(migrationFiles, "migrations")
	if err != nil {
		return nil, err
	}
	ms, err := store.LoadMigrations(sub, names)
	if err != nil {
		return nil, err
	}
	for i := range ms {
		ms[i].SQL = unqualify(ms[i].SQL)
	}
	return ms, nil
}

// MigrationScript returns every migration for schema (empty: the connection's database) and
// prefix as one script, recorded in the migrations table as Migrate records them: for teams that
// apply the DDL with their own tool or the mysql client. Each statement is idempotent.
func MigrationScript(schema, prefix string) (string, error) {
	n, err := NewNames(schema, prefix)
	if err != nil {
		return "", err
	}
	all, err := Migrations(schema, prefix)
	if err != nil {
		return "", err
	}
	table := unqualify(n.Migrations)
	var b strings.Builder
	fmt.Fprintf(&b, "-- The outbox tables, database %q (empty: the connection's), prefix %s.\n", schema, prefix)
	if schema != "" {
		b.WriteString("CREATE DATABASE IF NOT EXISTS " + n.QuotedSchema + " CHARACTER SET utf8mb4 COLLATE utf8mb4_bin;\n")
	}
	b.WriteString("CREATE TABLE IF NOT EXISTS " + table + ` (
    version    INT         NOT NULL PRIMARY KEY,
    applied_at DATETIME(6) NOT NULL
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COLLATE = utf8mb4_bin;

`)
	for _, m := range all {
		fmt.Fprintf(&b, "-- %03d_%s\n%s\n", m.Version, m.Name, strings.TrimSpace(m.SQL))
		fmt.Fprintf(&b, "INSERT IGNORE INTO %s (version, applied_at) VALUES (%d, UTC_TIMESTAMP(6));\n\n", table, m.Version)
	}
	return b.String(), nil
}

// unqualify drops the empty database of names in a migration for the connection's database.
func unqualify(sql string) string { return strings.ReplaceAll(sql, "``.", "") }

// migrateLockWait bounds a migration's wait for a table's lock (lock_wait_timeout).
const migrateLockWait = 10 * time.Second

// lockName is the GET_LOCK name of these tables' migrations: at most 64 characters whatever
// the names.
func lockName(n store.Names) string {
	sum := sha1.Sum([]byte(n.Schema + "." + n.Prefix))
	return "outbox_migrate_" + hex.EncodeToString(sum[:])
}

// lockNames are the GET_LOCK names a migration of the tables n names takes, in one order for all
// (no two migrators each hold one and wait for the other): the name of n as configured, and, for
// the tables of the connection's database (current), the name of the other way to name them
// (Schema "" and Schema current), so that processes that name the database and processes that
// leave it to the connection take turns, the versions before this one included (they take the
// name as configured).
func lockNames(n store.Names, current string) []string {
	names := []string{lockName(n)}
	switch {
	case current == "":
	case n.Schema == "":
		names = append(names, lockName(store.Names{Schema: current, Prefix: n.Prefix}))
	case n.Schema == current:
		names = append(names, lockName(store.Names{Prefix: n.Prefix}))
	}
	slices.Sort(names)
	return names
}

// migrate applies the missing migrations. MySQL commits DDL implicitly, so a migration runs
// outside a transaction, on one connection holding GET_LOCK (a session lock, released at the end,
// or when the connection dies): migrators take turns, and one that finds a migration applied
// does nothing.
func migrate(ctx context.Context, db *sql.DB, n store.Names, ms []store.Migration, timeout time.Duration) (err error) {
	conn, err := db.Conn(ctx)
	if err != nil {
		return fmt.Errorf("migrate: connect: %w", err)
	}
	defer conn.Close()
	wait := timeout
	if dl, ok := ctx.Deadline(); ok && time.Until(dl) < wait {
		wait = max(time.Until(dl), time.Second)
	}
	var current sql.NullString
	if err := conn.QueryRowContext(ctx, `SELECT DATABASE()`).Scan(&current); err != nil {
		return fmt.Errorf("migrate: read the connection's database: %w", err)
	}
	var held []string
	defer func() {
		rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
		defer cancel()
		for _, name := range held {
			if _, rerr := conn.ExecContext(rctx, `DO RELEASE_LOCK(?)`, name); rerr != nil {
				// The lock lives as long as the session: the connection must not go back to the pool.
				_ = conn.Raw(func(any) error { return driver.ErrBadConn })
				err = errors.Join(err, fmt.Errorf("release migration lock: %w", rerr))
				return
			}
		}
	}()
	for _, name := range lockNames(n, current.String) {
		var got sql.NullInt64
		if err := conn.QueryRowContext(ctx, `SELECT GET_LOCK(?, ?)`, name, int(wait.Seconds())).Scan(&got); err != nil {
			return fmt.Errorf("take migration lock: %w", err)
		}
		if !got.Valid || got.Int64 != 1 {
			return fmt.Errorf("take migration lock: another process held it for %s (GET_LOCK %s)", wait, name)
		}
		held = append(held, name)
	}
	// A migration that alters a table waits for the transactions that use it, and every new
	// statement on the table queues behind it: behind one that does not end it gives up after
	// migrateLockWait (Migrate fails, and runs again at the next start), as on PostgreSQL, not
	// after the server's lock_wait_timeout (a day on MariaDB, a year on MySQL). The session's
	// own setting is put back before the connection returns to the pool.
	var lockWait int64
	if err := conn.QueryRowContext(ctx, `SELECT @@SESSION.lock_wait_timeout`).Scan(&lockWait); err != nil {
		return fmt.Errorf("migrate: read lock_wait_timeout: %w", err)
	}
	if _, err := conn.ExecContext(ctx, fmt.Sprintf(`SET SESSION lock_wait_timeout = %d`, int(migrateLockWait.Seconds()))); err != nil {
		return fmt.Errorf("migrate: set lock_wait_timeout: %w", err)
	}
	defer func() {
		rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
		defer cancel()
		if _, rerr := conn.ExecContext(rctx, fmt.Sprintf(`SET SESSION lock_wait_timeout = %d`, lockWait)); rerr != nil {
			_ = conn.Raw(func(any) error { return driver.ErrBadConn }) // not back to the pool as it is
		}
	}()
	var bootstrap []string
	if n.Schema != "" {
		bootstrap = append(bootstrap, "CREATE DATABASE IF NOT EXISTS "+n.QuotedSchema+" CHARACTER SET utf8mb4 COLLATE utf8mb4_bin")
	}
	bootstrap = append(bootstrap, `CREATE TABLE IF NOT EXISTS `+n.Migrations+` (
		version    INT         NOT NULL PRIMARY KEY,
		applied_at DATETIME(6) NOT NULL
	) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COLLATE = utf8mb4_bin`)
	for _, s := range bootstrap {
		if _, err := conn.ExecContext(ctx, s); err != nil {
			return fmt.Errorf("create migrations table: %w", err)
		}
	}
	applied := map[int]bool{}
	rows, err := conn.QueryContext(ctx, `SELECT version FROM `+n.Migrations)
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
	if err := errors.Join(rows.Err(), rows.Close()); err != nil {
		return fmt.Errorf("read applied migrations: %w", err)
	}
	for _, m := range ms {
		if applied[m.Version] {
			continue
		}
		for _, stmt := range statements(unqualify(m.SQL)) {
			if _, err := conn.ExecContext(ctx, stmt); err != nil {
				if e := (*gomysql.MySQLError)(nil); errors.As(err, &e) && e.Number == 1205 {
					return fmt.Errorf("migration %03d_%s: waited %s for a table's lock behind a transaction that did not end; "+
						"it stops there, and Migrate runs it again at the next start: %w", m.Version, m.Name, migrateLockWait, err)
				}
				return fmt.Errorf("migration %03d_%s: %w", m.Version, m.Name, err)
			}
		}
		if _, err := conn.ExecContext(ctx, `INSERT INTO `+n.Migrations+` (version, applied_at) VALUES (?, UTC_TIMESTAMP(6))`, m.Version); err != nil {
			return fmt.Errorf("record migration %03d: %w", m.Version, err)
		}
	}
	return nil
}

// statements splits a migration into its statements: each ends with ';' at the end of a line;
// comment lines are dropped.
func statements(text string) []string {
	var out []string
	var cur strings.Builder
	for _, line := range strings.Split(text, "\n") {
		if t := strings.TrimSpace(line); t == "" || strings.HasPrefix(t, "--") {
			continue
		}
		cur.WriteString(line)
		cur.WriteByte('\n')
		if strings.HasSuffix(strings.TrimSpace(line), ";") {
			out = append(out, strings.TrimSuffix(strings.TrimSpace(cur.String()), ";"))
			cur.Reset()
		}
	}
	if s := strings.TrimSpace(cur.String()); s != "" {
		out = append(out, s)
	}
	return out
}

// idList formats store IDs for an IN list; they are integers, so the text is safe in SQL.
func idList(ids []int64) string {
	var b strings.Builder
	for i, id := range ids {
		if i > 0 {
			b.WriteByte(',')
		}
		b.WriteString(strconv.FormatInt(id, 10))
	}
	return b.String()
}
