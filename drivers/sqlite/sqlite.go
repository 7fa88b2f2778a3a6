package sqlite

import (
	"database/sql"
	"embed"
	"fmt"
	"io/fs"
	"strings"

	"github.com/watermill-outbox/outbox/outboxdriver"
	"github.com/watermill-outbox/outbox/store"
)

//go:embed migrations/*.sql
var migrationFiles embed.FS

// Schema is the only schema SQLite offers: the tables are told apart by Config.TablePrefix.
const Schema = "main"

// DSNParams are the connection parameters the outbox needs, in the form that both
// modernc.org/sqlite and github.com/mattn/go-sqlite3 understand:
//
//   - _txlock=immediate: every transaction takes the database's write lock when it begins. A
//     deferred transaction that reads and then writes cannot wait for the lock: it fails at once
//     with SQLITE_BUSY ("database is locked") when another connection wrote in between. The relay
//     (select, dispatch, mark) and any handler that reads before it writes need this.
//   - _busy_timeout=10000: a transaction waits up to 10 s for the write lock. It must exceed the
//     longest write transaction: a handler with its business writes, and a relay round, which
//     holds the lock while it publishes (see the package documentation).
//   - _journal_mode=WAL: readers do not block the writer, nor the writer readers.
//   - _synchronous=FULL: a commit is on disk before it returns. With NORMAL a power loss can
//     undo a commit whose message was already acked.
const DSNParams = "_txlock=immediate&_busy_timeout=10000&_journal_mode=WAL&_synchronous=FULL"

// DSN returns the connection string of the database file at path with DSNParams, for
// sql.Open("sqlite", ...) (modernc.org/sqlite) or sql.Open("sqlite3", ...) (mattn/go-sqlite3).
// path must not contain '?'. Use a file: an in-memory database exists once per connection.
func DSN(path string) string { return path + "?" + DSNParams }

// Driver is the SQLite dialect. The zero value is ready to use.
//
// The database/sql driver must be registered by the program (for example with
// import _ "modernc.org/sqlite") and the DB opened with DSN or DSNParams.
type Driver struct{}

var _ outboxdriver.Driver = Driver{}

// Open implements outboxdriver.Driver. opts.Schema must be empty or "main".
func (Driver) Open(db *sql.DB, opts outboxdriver.StoreOptions) (outboxdriver.Store, error) {
	if opts.Schema != "" && opts.Schema != Schema {
		return nil, fmt.Errorf("sqlite: Schema %q is not supported: SQLite has no schemas; leave Schema empty (or %q) and tell table sets apart with TablePrefix", opts.Schema, Schema)
	}
	names, err := store.NewNames(Schema, opts.TablePrefix)
	if err != nil {
		return nil, err
	}
	migrations, err := fs.Sub(migrationFiles, "migrations")
	if err != nil {
		return nil, fmt.Errorf("sqlite migrations: %w", err)
	}
	return store.New(db, names, store.Dialect{
		Queries:          queries(names),
		Migrate:          migrateQueries(names),
		Migrations:       migrations,
		IsUndefinedTable: IsUndefinedTable,
		// Statements are parsed in-process, so preparing saves little; and store.SQL prepares on
		// the DB while a transaction may hold its only connection (SetMaxOpenConns(1) is common
		// with SQLite), which would wait forever.
		Prepare: false,
		// No NOTIFY: relays of other processes poll every RelayInterval. The relay of the process
		// that handed an effect over is still woken at once by the outbox itself.
		Notify:      "",
		Listen:      nil,
		DeadLetters: deadLetterQueries(names),
	})
}

// IsUndefinedTable tells whether err is SQLite's "no such table" error, from any database/sql
// driver (they all carry SQLite's message).
func IsUndefinedTable(err error) bool {
	return err != nil && strings.Contains(err.Error(), "no such table")
}

func migrateQueries(n store.Names) store.MigrateQueries {
	return store.MigrateQueries{
		// No lock statement: with _txlock=immediate the migration transaction holds the write
		// lock from BEGIN, so migrators take turns.
		Bootstrap: []string{
			`CREATE TABLE IF NOT EXISTS ` + n.Migrations + ` (
				version    INTEGER   PRIMARY KEY,
				applied_at TIMESTAMP NOT NULL DEFAULT (` + now + `)
			)`,
		},
		Applied: `SELECT version FROM ` + n.Migrations,
		Insert:  `INSERT INTO ` + n.Migrations + ` (version) VALUES (?1)`,
		AlreadyApplied: func(err error) bool {
			return strings.Contains(err.Error(), "duplicate column name")
		},
	}
}

// now is the current time in the format of the timestamp columns. SQLite keeps 'now' fixed during
// one statement, and computes date arithmetic in whole milliseconds.
const now = `strftime('%Y-%m-%d %H:%M:%f', 'now')`

// fromNow returns the time ms milliseconds (a SQL expression) from now, in the format of the
// timestamp columns; ms may be negative.
func fromNow(ms string) string {
	return `strftime('%Y-%m-%d %H:%M:%f', 'now', printf('%+.3f seconds', (` + ms + `) / 1000.0))`
}

// ago returns the time ms milliseconds before now.
func ago(ms string) string { return fromNow("-(" + ms + ")") }

const effectColumns = `id, source_consumer, source_id, seq, kind, topic, uuid, payload, metadata, ordering_key, attempts,
	CAST(round((julianday('now') - julianday(created_at)) * 86400000.0) AS INTEGER), failures,
	coalesce(CAST(round((julianday('now') - julianday(failed_at)) * 86400000.0) AS INTEGER), 0), parked_at IS NOT NULL`

// ids is the list of store IDs passed as the text argument arg ("1,2,3").
func ids(arg string) string { return `(SELECT value FROM json_each('[' || ` + arg + ` || ']'))` }

func queries(n store.Names) store.Queries {
	backedOff := `dispatched_at IS NULL AND parked_at IS NULL AND next_attempt_at = backoff_until AND next_attempt_at > ` + now
	// What cleanup deletes (retention ms as ?1), shared by its batches and its dry run.
	cleanupClaims := `SELECT consumer, message_id FROM ` + n.Processed + ` p
			WHERE processed_at < ` + ago("?1") + ` AND dispatched_at < ` + ago("?1") + `
			  AND NOT EXISTS (SELECT 1 FROM ` + n.Effects + ` e
				WHERE e.source_consumer = p.consumer AND e.source_id = p.message_id AND e.dispatched_at IS NULL)`
	cleanupEffects := `SELECT id FROM ` + n.Effects + ` WHERE dispatched_at < ` + ago("?1")
	cleanupAttempts := `SELECT consumer, message_id FROM ` + n.Attempts + ` WHERE last_failed_at < ` + ago("?1")
	cleanupKeys := `SELECT scope, key FROM ` + n.Idempotency + ` WHERE expires_at < ` + ago("?1")
	return store.Queries{
		MessageClaim: `INSERT INTO ` + n.Processed + ` (consumer, message_id, dispatched_at) VALUES (?1, ?2, ` + now + `)
			ON CONFLICT (consumer, message_id) DO NOTHING RETURNING 1`,
		MessageAge:         `SELECT ` + msSince("processed_at") + ` FROM ` + n.Processed + ` WHERE consumer = ?1 AND message_id = ?2`,
		MessageIsProcessed: `SELECT 1 FROM ` + n.Processed + ` WHERE consumer = ?1 AND message_id = ?2`,
		MessagePoison: `INSERT INTO ` + n.Processed + ` (consumer, message_id, dispatched_at, poisoned) VALUES (?1, ?2, ` + now + `, 1)
			ON CONFLICT (consumer, message_id) DO NOTHING`,
		MessagePoisonedRead: `SELECT poisoned FROM ` + n.Processed + ` WHERE consumer = ?1 AND message_id = ?2`,
		MessageReplay:       `DELETE FROM ` + n.Processed + ` WHERE consumer = ?1 AND message_id = ?2 AND poisoned`,
		AttemptRecord: `INSERT INTO ` + n.Attempts + ` (consumer, message_id, attempts, last_error) VALUES (?1, ?2, 1, ?3)
			ON CONFLICT (consumer, message_id) DO UPDATE
			SET attempts = attempts + 1, last_error = excluded.last_error, last_failed_at = ` + now + `
			RETURNING attempts`,
		AttemptDelete: `DELETE FROM ` + n.Attempts + ` WHERE consumer = ?1 AND message_id = ?2`,
		// SQLite cannot tell whether a row was written inside a savepoint: every insert says it
		// may have been, and the framework checks before it commits (in process, so cheap).
		EffectInsert: func(count int) string {
			var b strings.Builder
			b.WriteString(`INSERT INTO ` + n.Effects + ` (source_consumer, source_id, seq, kind, topic, uuid, payload, metadata, ordering_key) VALUES `)
			// A bare ? takes the number after the largest one used so far, so each row binds
			// the next seven arguments: drivers look up numbered parameters by number, one by
			// one, which costs quadratic time on a large insert. A driver may bind an empty
			// []byte as NULL: coalesce keeps it an empty BLOB.
			for i := 0; i < count; i++ {
				if i > 0 {
					b.WriteString(", ")
				}
				b.WriteString("(?1, ?2, ?, ?, ?, ?, coalesce(?, x''), coalesce(?, x''), ?)")
			}
			b.WriteString(` RETURNING id, seq, 1`)
			return b.String()
		},
		// Only while the claim exists: after a ROLLBACK sent as SQL the connection runs in
		// autocommit, and an unguarded insert committed on its own, sent by the relay for work
		// that was rolled back.
		EffectInsertClaimed: func(count int) string {
			var b strings.Builder
			b.WriteString(`INSERT INTO ` + n.Effects + ` (source_consumer, source_id, seq, kind, topic, uuid, payload, metadata, ordering_key)
				SELECT * FROM (VALUES `)
			for i := 0; i < count; i++ {
				if i > 0 {
					b.WriteString(", ")
				}
				b.WriteString("(?1, ?2, ?, ?, ?, ?, coalesce(?, x''), coalesce(?, x''), ?)")
			}
			b.WriteString(`) WHERE ` + claimExists(n, "?1", "?2") + ` RETURNING id, seq, 1`)
			return b.String()
		},
		EffectExisting: `SELECT id FROM ` + n.Effects + ` WHERE id IN ` + ids("?1"),
		EffectListPending: `SELECT ` + effectColumns + ` FROM ` + n.Effects + `
			WHERE source_consumer = ?1 AND source_id = ?2 AND dispatched_at IS NULL ORDER BY seq`,
		// The trigger effects_dispatched moves the claim's dispatch time along (see the migration),
		// whatever moveClaims says.
		EffectMarkDispatched: func(bool) string {
			return `UPDATE ` + n.Effects + ` SET dispatched_at = ` + now + `
				WHERE id IN ` + ids("?1") + ` AND dispatched_at IS NULL`
		},
		EffectRecordFailure: `UPDATE ` + n.Effects + ` SET failures = failures + 1, failed_at = ` + now + `, last_error = ?2,
			attempts = attempts + CASE WHEN ?3 THEN 1 ELSE 0 END,
			next_attempt_at = ` + fromNow("?5") + `, backoff_until = ` + fromNow("?5") + `,
			parked_at = CASE WHEN ?4 THEN coalesce(parked_at, ` + now + `) ELSE parked_at END
			WHERE id = ?1 AND dispatched_at IS NULL`,
		EffectRelease: `UPDATE ` + n.Effects + ` SET next_attempt_at = ` + fromNow("?2") + `
			WHERE id IN ` + ids("?1") + ` AND dispatched_at IS NULL AND parked_at IS NULL`,
		// As on PostgreSQL: backing off while the retry time of the last failure is still the
		// effect's own and ahead.
		EffectBackedOff: `SELECT id FROM ` + n.Effects + ` WHERE kind = ?1 AND (kind <> '' OR topic = ?2) AND ` + backedOff + ` LIMIT ?3`,
		EffectRetryNow:  `UPDATE ` + n.Effects + ` SET next_attempt_at = ` + now + ` WHERE id IN ` + ids("?1") + ` AND ` + backedOff,
		EffectKeyBlocked: `SELECT EXISTS (SELECT 1 FROM ` + n.Effects + ` b
			WHERE b.ordering_key = ?3 AND b.dispatched_at IS NULL AND NOT (b.source_consumer = ?1 AND b.source_id = ?2)
			  AND b.id < (SELECT min(id) FROM ` + n.Effects + `
				WHERE source_consumer = ?1 AND source_id = ?2 AND ordering_key = ?3 AND dispatched_at IS NULL))`,
		EffectHandToRelay: `UPDATE ` + n.Effects + ` SET next_attempt_at = coalesce(next_attempt_at, ` + now + `)
			WHERE source_consumer = ?1 AND source_id = ?2 AND dispatched_at IS NULL`,
		// parked_at and created_at are plain columns so that the driver sees their declared type
		// TIMESTAMP and returns time.Time.
		EffectListParked: `SELECT ` + effectColumns + `, last_error, parked_at, created_at FROM ` + n.Effects + `
			WHERE parked_at IS NOT NULL AND dispatched_at IS NULL ORDER BY id LIMIT ?1`,
		EffectUnpark: `UPDATE ` + n.Effects + ` SET parked_at = NULL, next_attempt_at = ` + now + `, attempts = 0, failures = 0
			WHERE id = ?1 AND parked_at IS NOT NULL AND dispatched_at IS NULL`,
		EffectDiscard: `UPDATE ` + n.Effects + ` SET dispatched_at = ` + now + `, last_error = coalesce(last_error, '') || ' (discarded)'
			WHERE id = ?1 AND parked_at IS NOT NULL AND dispatched_at IS NULL RETURNING 1`,

		// SQLite has one writer: the claim is one statement, so relays of several processes take
		// turns, and no row can be locked by another statement while it looks. An effect is due
		// when it is past the grace period or was handed over, and its retry time has come; it
		// waits while an earlier undispatched effect with its key is not due itself (parked,
		// backing off, leased, or still in its grace period on the fast path of another
		// transaction), so that later effects never overtake an earlier one. The lease keeps the
		// later effects of a key waiting until the claimed ones are marked.
		EffectClaimDue: `UPDATE ` + n.Effects + ` SET next_attempt_at = ` + fromNow("?4") + `
			WHERE id IN (SELECT id FROM (
				SELECT e.id, sum(length(e.payload) + length(e.metadata)) OVER (ORDER BY e.id) AS running,
				       row_number() OVER (ORDER BY e.id) AS n
				FROM ` + n.Effects + ` e
				WHERE e.dispatched_at IS NULL AND e.parked_at IS NULL
				  AND (e.created_at < ` + ago("?1") + ` OR e.next_attempt_at IS NOT NULL)
				  AND (e.next_attempt_at IS NULL OR e.next_attempt_at <= ` + now + `)
				  AND NOT EXISTS (SELECT 1 FROM ` + n.Effects + ` b
					WHERE b.ordering_key = e.ordering_key AND b.id < e.id AND b.dispatched_at IS NULL
					  AND (b.parked_at IS NOT NULL OR b.next_attempt_at > ` + now + `
					       OR (b.next_attempt_at IS NULL AND b.created_at >= ` + ago("?1") + `)))
				ORDER BY e.id LIMIT ?2) WHERE running <= ?3 OR n = 1)
			RETURNING ` + effectColumns,

		// Numbered parameters: the delays and cancel keys follow all the effects' arguments.
		DelayedInsert: func(count int) string {
			var b strings.Builder
			b.WriteString(`INSERT INTO ` + n.Delayed + ` (source_consumer, source_id, seq, kind, topic, uuid, payload, metadata, ordering_key, due_at, cancel_key) VALUES `)
			for i := 0; i < count; i++ {
				if i > 0 {
					b.WriteString(", ")
				}
				a := 3 + 7*i
				d := 3 + 7*count + 2*i
				fmt.Fprintf(&b, "(?1, ?2, ?%d, ?%d, ?%d, ?%d, coalesce(?%d, x''), coalesce(?%d, x''), ?%d, %s, ?%d)",
					a, a+1, a+2, a+3, a+4, a+5, a+6, fromNow(fmt.Sprintf("?%d", d)), d+1)
			}
			return b.String()
		},
		// As EffectInsertClaimed: the arguments of DelayedInsert, then consumer and id.
		DelayedInsertClaimed: func(count int) string {
			var b strings.Builder
			b.WriteString(`INSERT INTO ` + n.Delayed + ` (source_consumer, source_id, seq, kind, topic, uuid, payload, metadata, ordering_key, due_at, cancel_key)
				SELECT * FROM (VALUES `)
			for i := 0; i < count; i++ {
				if i > 0 {
					b.WriteString(", ")
				}
				a := 3 + 7*i
				d := 3 + 7*count + 2*i
				fmt.Fprintf(&b, "(?1, ?2, ?%d, ?%d, ?%d, ?%d, coalesce(?%d, x''), coalesce(?%d, x''), ?%d, %s, ?%d)",
					a, a+1, a+2, a+3, a+4, a+5, a+6, fromNow(fmt.Sprintf("?%d", d)), d+1)
			}
			b.WriteString(`) WHERE ` + claimExists(n, fmt.Sprintf("?%d", 3+9*count), fmt.Sprintf("?%d", 4+9*count)))
			return b.String()
		},
		DelayedCancel: `DELETE FROM ` + n.Delayed + ` WHERE cancel_key = ?1`,
		// The single writer keeps the claim as the check found it until the cancel.
		DelayedClaimExists: `SELECT ` + claimExists(n, "?1", "?2"),
		// One statement changes one table in SQLite: the move takes three, in one transaction
		// (the write lock, taken at BEGIN, keeps the rows as the first one found them).
		DelayedDue: `SELECT id FROM ` + n.Delayed + ` WHERE due_at <= ` + now + ` ORDER BY due_at, id LIMIT ?1`,
		DelayedMove: `INSERT INTO ` + n.Effects + ` (source_consumer, source_id, seq, kind, topic, uuid, payload, metadata, ordering_key,
				created_at, next_attempt_at)
			SELECT source_consumer, source_id, seq, kind, topic, uuid, payload, metadata, ordering_key, due_at, ` + now + `
			FROM ` + n.Delayed + ` WHERE id IN ` + ids("?1") + ` ORDER BY due_at, id`,
		DelayedDelete: `DELETE FROM ` + n.Delayed + ` WHERE id IN ` + ids("?1"),
		DelayedDueOfKeys: `SELECT id FROM ` + n.Delayed + ` WHERE ordering_key IN (SELECT value FROM json_each(?3))
			AND due_at <= ` + now + ` AND NOT (source_consumer = ?1 AND source_id = ?2) ORDER BY due_at, id`,
		DelayedNextDue: `SELECT -` + msSince("min(due_at)") + ` FROM ` + n.Delayed,
		DelayedStats: `WITH later AS (SELECT 1 FROM ` + n.Delayed + ` WHERE due_at > ` + now + ` LIMIT ?1),
			overdue AS (SELECT due_at FROM ` + n.Delayed + ` WHERE due_at <= ` + now + ` ORDER BY due_at LIMIT ?1)
			SELECT (SELECT count(*) FROM later), (SELECT count(*) FROM overdue),
				coalesce((SELECT ` + msSince("min(due_at)") + ` FROM overdue), 0)`,

		// No lock: each batch's transaction holds the write lock, so cleaners take turns.
		CleanupClaims: `DELETE FROM ` + n.Processed + ` WHERE (consumer, message_id) IN (` + cleanupClaims + ` LIMIT ?2)`,
		// In the order of the index on dispatched_at (migration 012): by id it scanned the table.
		CleanupEffects: `DELETE FROM ` + n.Effects + ` WHERE id IN (` + cleanupEffects + ` ORDER BY dispatched_at LIMIT ?2)`,
		// The counts and keys repeat their condition on the row deleted, as on PostgreSQL, where a
		// row updated while the DELETE waited for it must be judged by its new version. Here no
		// writer comes in between; the statements keep the shape that stays right if one could.
		CleanupAttempts: `DELETE FROM ` + n.Attempts + ` WHERE (consumer, message_id) IN (` + cleanupAttempts + ` LIMIT ?2)
			AND last_failed_at < ` + ago("?1"),
		CleanupClaimsCount:   `SELECT count(*) FROM (` + cleanupClaims + `)`,
		CleanupEffectsCount:  `SELECT count(*) FROM (` + cleanupEffects + `)`,
		CleanupAttemptsCount: `SELECT count(*) FROM (` + cleanupAttempts + `)`,
		CleanupKeys: `DELETE FROM ` + n.Idempotency + ` WHERE (scope, key) IN (` + cleanupKeys + ` LIMIT ?2)
			AND expires_at < ` + ago("?1"),
		CleanupKeysCount: `SELECT count(*) FROM (` + cleanupKeys + `)`,

		// Every write transaction begins IMMEDIATE (DSNParams), holding the database's one write
		// lock: a unit with a key the first request still holds waits at its BEGIN for that
		// outcome, within busy_timeout, whether it asked to wait or not, and its key's lock is
		// already held when it asks.
		KeyLock: `SELECT coalesce(?1, ?2, 1) IS NOT NULL`,
		KeyClaim: `INSERT INTO ` + n.Idempotency + ` (scope, key, fingerprint, expires_at) VALUES (?1, ?2, ?3, ` + fromNow("?4") + `)
			ON CONFLICT (scope, key) DO UPDATE SET fingerprint = excluded.fingerprint, result = x'',
				created_at = ` + now + `, expires_at = excluded.expires_at
			WHERE expires_at <= ` + now + `
			RETURNING 1`,
		KeyRead: `SELECT fingerprint, result FROM ` + n.Idempotency + ` WHERE scope = ?1 AND key = ?2`,
		KeySave: `UPDATE ` + n.Idempotency + ` SET result = ?3 WHERE scope = ?1 AND key = ?2`,

		SchemaLatest: `SELECT max(version) FROM ` + n.Migrations,

		// Each count reads at most ?1 rows; SQLite keeps no row estimates, so a larger count
		// reports ?1 and says it is estimated.
		StatsSample: `WITH pending AS (SELECT id, created_at FROM ` + n.Effects + `
				WHERE dispatched_at IS NULL AND parked_at IS NULL ORDER BY id LIMIT ?1),
			parked AS (SELECT id, created_at FROM ` + n.Effects + `
				WHERE parked_at IS NOT NULL AND dispatched_at IS NULL ORDER BY id LIMIT ?1),
			failing AS (SELECT 1 FROM ` + n.Attempts + ` a WHERE NOT EXISTS (SELECT 1 FROM ` + n.Processed + ` p
				WHERE p.consumer = a.consumer AND p.message_id = a.message_id) LIMIT ?1),
			retained AS (SELECT 1 FROM ` + n.Processed + ` LIMIT ?1),
			expired AS (SELECT p.dispatched_at FROM ` + n.Processed + ` p
				WHERE p.processed_at < ` + ago("?2") + ` AND p.dispatched_at < ` + ago("?2") + `
				  AND NOT EXISTS (SELECT 1 FROM ` + n.Effects + ` e
					WHERE e.source_consumer = p.consumer AND e.source_id = p.message_id AND e.dispatched_at IS NULL)
				LIMIT 1000)
			SELECT (SELECT count(*) FROM pending), coalesce((SELECT ` + msSince("min(created_at)") + ` FROM pending), 0),
				(SELECT count(*) FROM parked), coalesce((SELECT ` + msSince("min(created_at)") + ` FROM parked), 0),
				(SELECT count(*) FROM failing), (SELECT count(*) FROM retained),
				(SELECT count(*) FROM pending) >= ?1 OR (SELECT count(*) FROM parked) >= ?1 OR (SELECT count(*) FROM retained) >= ?1,
				coalesce((SELECT ` + msSince("min(dispatched_at)") + ` - ?2 FROM expired), 0)`,
		StatsLease: `UPDATE ` + n.Stats + ` SET leased_at = ` + now + ` WHERE id = 1 AND (leased_at < ` + ago("?1") + ` OR leased_at > ` + fromNow("60000") + `)`,
		StatsWrite: `UPDATE ` + n.Stats + ` SET sampled_at = ` + now + `, sample = ?1 WHERE id = 1`,
		StatsRead:  `SELECT sample, ` + msSince("sampled_at") + ` FROM ` + n.Stats + ` WHERE id = 1 AND sample IS NOT NULL`,
	}
}

// msSince returns the milliseconds from the timestamp expression t to now, as an integer.
func msSince(t string) string {
	return `CAST(round((julianday('now') - julianday(` + t + `)) * 86400000.0) AS INTEGER)`
}

// deadLetterQueries are the statements of the dead letters (migration 007) and of the requests to
// dead-letter a failing message at once (migration 009).
func deadLetterQueries(n store.Names) store.DeadLetterQueries {
	cleanupDead := `SELECT consumer, message_id FROM ` + n.DeadLetters + ` WHERE state <> 'dead' AND changed_at < ` + ago("?1")
	return store.DeadLetterQueries{
		Attempt: `INSERT INTO ` + n.Attempts + ` (consumer, message_id, attempts, last_error) VALUES (?1, ?2, 1, ?3)
			ON CONFLICT (consumer, message_id) DO UPDATE
			SET attempts = attempts + 1, last_error = excluded.last_error, last_failed_at = ` + now + `
			RETURNING attempts`,
		Upsert: `INSERT INTO ` + n.DeadLetters + ` (consumer, message_id, source_topic, payload, metadata, reason, attempts, permanent, message_uuid)
			VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, nullif(?9, ''))
			ON CONFLICT (consumer, message_id) DO UPDATE
			SET source_topic = CASE WHEN excluded.source_topic = '' THEN source_topic ELSE excluded.source_topic END,
				message_uuid = coalesce(excluded.message_uuid, message_uuid),
				payload = excluded.payload, metadata = excluded.metadata, reason = excluded.reason,
				attempts = excluded.attempts, permanent = excluded.permanent, dead_at = ` + now + `,
				state = 'dead', changed_at = NULL, changed_by = ''`,
		List: `SELECT consumer, message_id, source_topic, CASE WHEN ?3 THEN payload END, CASE WHEN ?3 THEN metadata END, reason, attempts, permanent,
				` + msSince("dead_at") + `, state, ` + msSince("changed_at") + `, changed_by, retries, coalesce(message_uuid, '')
			FROM ` + n.DeadLetters + `
			WHERE (?1 = '' OR consumer = ?1) AND (?2 = '' OR state = ?2)
			ORDER BY dead_at, consumer, message_id LIMIT ?4`,
		Mark: `UPDATE ` + n.DeadLetters + ` SET state = ?1, changed_at = ` + now + `, changed_by = ?2,
				retries = retries + CASE WHEN ?1 = 'retried' THEN 1 ELSE 0 END
			WHERE consumer = ?3 AND message_id = ?4 AND state = 'dead' AND retries < ?5`,
		Read:   `SELECT source_topic, payload, metadata, coalesce(message_uuid, '') FROM ` + n.DeadLetters + ` WHERE consumer = ?1 AND message_id = ?2`,
		Count:  `SELECT count(*) FROM (SELECT 1 FROM ` + n.DeadLetters + ` WHERE state = 'dead' LIMIT ?1)`,
		IsDead: `SELECT count(*) FROM ` + n.DeadLetters + ` WHERE consumer = ?1 AND message_id = ?2 AND state = 'dead'`,
		Redrivable: `SELECT consumer, message_id FROM ` + n.DeadLetters + `
			WHERE state = 'dead' AND permanent = 0 AND retries < ?1 AND source_topic <> ''
			  AND dead_at <= ` + ago("?2") + `
			ORDER BY dead_at, consumer, message_id LIMIT ?3`,
		Cleanup: `DELETE FROM ` + n.DeadLetters + ` WHERE (consumer, message_id) IN (` + cleanupDead + ` LIMIT ?2)
			AND changed_at < ` + ago("?1"),
		CleanupCount: `SELECT count(*) FROM (` + cleanupDead + `)`,
		Now: `UPDATE ` + n.Attempts + ` SET dead_letter_by = ?1 WHERE consumer = ?2 AND message_id = ?3
			AND NOT EXISTS (SELECT 1 FROM ` + n.Processed + ` p WHERE p.consumer = ?2 AND p.message_id = ?3)`,
		Requested: `SELECT attempts, last_error, coalesce(dead_letter_by, '') FROM ` + n.Attempts + ` WHERE consumer = ?1 AND message_id = ?2
			AND NOT EXISTS (SELECT 1 FROM ` + n.Processed + ` p WHERE p.consumer = ?1 AND p.message_id = ?2)`,
	}
}

// claimExists is the condition that the claim of (consumer, id) exists.
func claimExists(n store.Names, consumer, id string) string {
	return `EXISTS (SELECT 1 FROM ` + n.Processed + ` WHERE consumer = ` + consumer + ` AND message_id = ` + id + `)`
}
