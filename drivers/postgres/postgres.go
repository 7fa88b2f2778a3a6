package postgres

import (
	"context"
	"database/sql"
	"embed"
	"errors"
	"fmt"
	"io/fs"
	"strings"
	"sync/atomic"
	"time"

	"github.com/watermill-outbox/outbox/outboxdriver"
	"github.com/watermill-outbox/outbox/store"
)

//go:embed migrations/*.sql
var migrationFiles embed.FS

// DefaultSchema is the schema used when Config.Schema is empty.
const DefaultSchema = "public"

// lockClass is the first key of every advisory lock the framework takes ("outb").
const lockClass = 0x6f757462

// Driver is the PostgreSQL dialect. The zero value is ready to use.
type Driver struct {
	// DisablePreparedStatements stops reusing prepared statements per connection. Behind a
	// pooler in transaction mode the store notices the pooler and never prepares them, whatever
	// this says (and refuses lib/pq without binary_parameters=yes there, see docs/operations.md).
	// Default: false (prepared statements save lib/pq a round trip per statement).
	DisablePreparedStatements bool

	// ListenDSN, when set, is the connection string (lib/pq format) of a dedicated connection on
	// which the relay LISTENs for wake-ups: an effect whose dispatch failed in any instance is
	// retried by the relays at once instead of at their next poll. Default: "" (the relay polls
	// every RelayInterval; a failure in this process still wakes this process's relay). Behind a
	// pooler in transaction mode it must reach PostgreSQL directly (or a pooler in session
	// mode): the listener counts as connected only once a notification of its own arrived.
	ListenDSN string

	// Listener, when set and ListenDSN is not, is how the relay LISTENs for wake-ups: it LISTENs
	// on channel, calls wake once connected (notifications sent before were missed) and on every
	// notification, and returns when ctx is done (nil) or the connection is lost (an error; the
	// caller listens again). The pgx driver sets it to listen on a connection of its pool.
	Listener func(ctx context.Context, channel string, wake func()) error

	// MaxInlineBytes bounds what the database/sql form writes into a message's claim. It keeps
	// the effects of the message's own ordering key there, written as they are recorded, and
	// each record rewrites all of them: a handler that records one effect per Publish call would
	// write n(n+1)/2 effects for n. So a unit keeps them there only while that costs less than
	// rows would have (its rewrites so far under about 512 bytes per effect, what a row costs
	// beyond its bytes), and while its writes in all stay within MaxInlineBytes; then the
	// record moves the claim's effects to effect rows, in order, in one statement, and it and
	// every later record of the unit are rows. Default 0: DefaultMaxInlineBytes. Negative:
	// every effect is a row. The pgx driver writes a claim once, at COMMIT, and does not use it.
	MaxInlineBytes int

	// RotateEvery is how long a partition of the effects table stays the one new effects go to
	// before the relay empties the oldest and makes it the current one (docs/operations.md,
	// "Rotation of the effects table"): the sent rows of a partition are freed by TRUNCATE, not
	// by VACUUM, so that a transaction or a replication slot that holds the xmin horizon back
	// does not leave the relay's claims walking every row sent since. The relay looks at most
	// every RotateEvery/2. Default 0: DefaultRotateEvery. Negative: never rotates (the current
	// partition keeps every effect, as the single table did).
	RotateEvery time.Duration
}

// DefaultRotateEvery is the default of Driver.RotateEvery. Behind a held xmin horizon the claims
// walk the dead rows of the three partitions: the oldest is emptied when it is RotateEvery from
// becoming current again, so they hold some 3*RotateEvery of traffic. At 10 s a 2-minute hold at
// 400 messages/s took the claim from 866 to 84,726 blocks a call and still growing (a slow claim
// holds the lock the emptying waits 20 ms for, so fewer rotations got through, and the partitions
// grew); at 2 s, 724 to 12,258 and level, the outbox tables' size unchanged (docs/benchmarks.md,
// "Held xmin horizon").
const DefaultRotateEvery = 2 * time.Second

// DefaultMaxInlineBytes is the default of Driver.MaxInlineBytes. The cost rule decides where
// records one at a time move to rows (after three of 300-byte messages, six of 50-byte ones);
// this bounds what a move writes twice (a large effect followed by another: in the claim, then
// as a row) and what one Publish call puts in the claim (some thirty messages of 300 bytes).
// docs/benchmarks.md, "One message per Publish call", has the measurements.
const DefaultMaxInlineBytes = 16 << 10

var _ outboxdriver.Driver = Driver{}

// Open implements outboxdriver.Driver.
func (d Driver) Open(db *sql.DB, opts outboxdriver.StoreOptions) (outboxdriver.Store, error) {
	schema := opts.Schema
	if schema == "" {
		schema = DefaultSchema
	}
	names, err := NewNames(schema, opts.TablePrefix)
	if err != nil {
		return nil, err
	}
	migrations, err := fs.Sub(migrationFiles, "migrations")
	if err != nil {
		return nil, fmt.Errorf("postgres migrations: %w", err)
	}
	gen := new(Generation)
	dialect := store.Dialect{
		Queries:           queries(names, opts.DeleteDispatched, gen),
		Migrate:           migrateQueries(names),
		Migrations:        migrations,
		IsUndefinedTable:  IsUndefinedTable,
		IsReadOnly:        IsReadOnly,
		IsReadOnlyAtBegin: IsReadOnlyAtBegin,
		Prepare:           !d.DisablePreparedStatements,
		// The rotation and cleanup see each statement's own snapshot, taken after the locks
		// they wait for, whatever default_transaction_isolation the database or role sets.
		Isolation:   sql.LevelReadCommitted,
		Pooler:      checkPooler,
		Ops:         opsQueries(names),
		DeadLetters: deadLetterQueries(names),
		// The channel is built from validated identifiers, so the literal is safe.
		Notify: fmt.Sprintf("SELECT pg_notify('%s', '')", notifyChannel(names.Schema, names.Prefix)),
	}
	switch channel := notifyChannel(names.Schema, names.Prefix); {
	case d.ListenDSN != "":
		dialect.Listen = listen(db, d.ListenDSN, channel)
	case d.Listener != nil:
		dialect.Listen = func(ctx context.Context, wake func()) error { return d.Listener(ctx, channel, wake) }
	}
	st, err := store.New(db, names, dialect)
	if err != nil {
		return nil, err
	}
	rotateEvery := d.RotateEvery
	if rotateEvery == 0 {
		rotateEvery = DefaultRotateEvery
	}
	return &inline{SQL: st, db: db, q: newInlineQueries(names), deleteDispatched: opts.DeleteDispatched, onError: opts.OnError, unreachable: opts.Unreachable,
		failpoint: opts.Failpoint, budget: inlineBudget(d.MaxInlineBytes), rq: newRotationQueries(names, rotateEvery), gen: gen, rotateEvery: rotateEvery,
		rotateLock: rotateLockTimeout, moveBytes: rotateMoveBytes}, nil
}

// inlineBudget is InlineBudget for Driver.MaxInlineBytes.
func inlineBudget(maxBytes int) int {
	switch {
	case maxBytes == 0:
		return DefaultMaxInlineBytes
	case maxBytes < 0:
		return 0
	}
	return maxBytes
}

// Migrations returns the migrations of the outbox tables for schema (empty: DefaultSchema) and
// prefix, as SQL, in order: for teams that apply the DDL with their own migration tool.
func Migrations(schema, prefix string) ([]store.Migration, error) {
	if schema == "" {
		schema = DefaultSchema
	}
	names, err := store.NewNames(schema, prefix)
	if err != nil {
		return nil, err
	}
	migrations, err := fs.Sub(migrationFiles, "migrations")
	if err != nil {
		return nil, err
	}
	return store.LoadMigrations(migrations, names)
}

// Queries returns the statements of the tables named by names (see NewNames), for a driver
// that runs some of them on a connection type of its own (the pgx driver runs the claim and the
// effect insert in its pipelines). deleteDispatched is StoreOptions.DeleteDispatched. The
// effect inserts go to the partition gen names (see Generation): pass the Generation of the
// Store these statements run beside (EffectsGeneration), so that both follow the rotations its
// relay makes; nil: partition 0 until such a Store's relay reads the current one.
func Queries(names store.Names, deleteDispatched bool, gen *Generation) store.Queries {
	if gen == nil {
		gen = new(Generation)
	}
	return queries(names, deleteDispatched, gen)
}

// Generation is the partition of the effects table that new effects go to, as this process last
// read it (migration 023): the relay reads it at most every RotateEvery/2, and switches it when
// it rotates. The inserts that return xmin (PostgreSQL allows no system column in the RETURNING
// of a partitioned table) name that partition. One that is out of date costs nothing but time:
// a row in any partition is a pending effect, read through the parent, and the partition is
// emptied later, its pending rows moved (see rotate). Safe for concurrent use.
type Generation struct{ v atomic.Int32 }

// Load returns the partition number, 0 to 2.
func (g *Generation) Load() int { return int(g.v.Load()) }

func (g *Generation) store(v int) { g.v.Store(int32(v)) }

// effectsPartition is the quoted name of partition gen of the effects table: 0 is the table of
// the versions before migration 023, under its name, so that their statements keep working.
func effectsPartition(n store.Names, gen int) string {
	if gen == 0 {
		return `"` + n.Schema + `"."` + n.Prefix + `effects"`
	}
	return `"` + n.Schema + `"."` + n.Prefix + `effects_` + fmt.Sprint(gen) + `"`
}

// NewNames returns the names of the PostgreSQL tables of schema and prefix (see store.NewNames):
// Effects is the partitioned parent of the effects table (migration 023), through which every
// statement but the inserts that return xmin reads, updates and deletes.
func NewNames(schema, prefix string) (store.Names, error) {
	n, err := store.NewNames(schema, prefix)
	if err != nil {
		return n, err
	}
	n.Effects = `"` + schema + `"."` + prefix + `effects_all"`
	return n, nil
}

// IsUndefinedTable tells whether err is PostgreSQL's undefined_table or invalid_schema_name, from
// lib/pq or pgx.
func IsUndefinedTable(err error) bool {
	var s interface{ SQLState() string }
	if errors.As(err, &s) {
		return s.SQLState() == "42P01" || s.SQLState() == "3F000"
	}
	return false
}

// IsReadOnly tells whether err is PostgreSQL's read_only_sql_transaction: a write sent to a
// standby, or to a session or database set read-only.
func IsReadOnly(err error) bool {
	var s interface{ SQLState() string }
	return errors.As(err, &s) && s.SQLState() == "25006"
}

// IsReadOnlyAtBegin tells whether err, the error of a BEGIN statement itself,
// means that the server takes no writes: read_only_sql_transaction (25006), or the
// feature_not_supported (0A000) with which a server in recovery refuses BEGIN READ WRITE ("cannot
// set transaction read-write mode during recovery"; lib/pq begins so) or BEGIN ISOLATION LEVEL
// SERIALIZABLE. After any other statement 0A000 means something else (a cached plan whose result
// type changed): only BEGIN may be classified with it.
func IsReadOnlyAtBegin(err error) bool {
	var s interface{ SQLState() string }
	return errors.As(err, &s) && (s.SQLState() == "25006" || s.SQLState() == "0A000")
}

// lockKey returns the SQL of the second key of a named advisory lock of these tables. The names
// are validated identifiers, so the literal is safe.
func lockKey(n store.Names, name string) string {
	return fmt.Sprintf("hashtext('%s.%s%s')", n.Schema, n.Prefix, name)
}

func migrateQueries(n store.Names) store.MigrateQueries {
	return store.MigrateQueries{
		Lock: fmt.Sprintf("SELECT pg_advisory_xact_lock(%d, %s)", lockClass, lockKey(n, "migrate")),
		Bootstrap: []string{
			"CREATE SCHEMA IF NOT EXISTS " + n.QuotedSchema,
			"CREATE TABLE IF NOT EXISTS " + n.Migrations + ` (
				version    integer     PRIMARY KEY,
				applied_at timestamptz NOT NULL DEFAULT now()
			)`,
		},
		Applied: "SELECT version FROM " + n.Migrations,
		Insert:  "INSERT INTO " + n.Migrations + " (version) VALUES ($1)",
		Stale:   staleCatalog,
	}
}

// staleCatalog tells the errors of a statement that acted on what the session's catalog cache
// said before the migration lock it waited for (see store.MigrateQueries.Stale): an object
// created meanwhile taken for missing (unique_violation in a catalog's index, duplicate_schema,
// duplicate_table, duplicate_object) or one that is there taken for absent (undefined_table,
// invalid_schema_name).
func staleCatalog(err error) bool {
	var s interface{ SQLState() string }
	if !errors.As(err, &s) {
		return false
	}
	switch s.SQLState() {
	case "23505", "42P06", "42P07", "42710", "42P01", "3F000":
		return true
	}
	return false
}

// effectColumns are the columns of an effect (table alias e) as the store scans them.
const effectColumns = `e.id, e.source_consumer, e.source_id, e.seq, e.kind, e.topic, e.uuid,
	e.payload, e.metadata, e.ordering_key, e.attempts, (extract(epoch FROM now() - e.created_at) * 1000)::bigint,
	e.failures, coalesce((extract(epoch FROM now() - e.failed_at) * 1000)::bigint, 0), e.parked_at IS NOT NULL`

// asyncCommit makes the implicit transaction of a single statement commit without waiting for
// the WAL flush: the marks it guards are safe to lose (a lost mark only causes a re-send).
const asyncCommit = asyncCommitSetting + ` IS NOT NULL`

// asyncCommitSetting is the call that asyncCommit makes.
const asyncCommitSetting = `set_config('synchronous_commit', 'off', true)`

// claimAge is the age in milliseconds of the claim p, as the statements that find one report it.
const claimAge = `(extract(epoch FROM now() - p.processed_at) * 1000)::bigint`

// settledColumn tells, for the claim p of (consumer $1, id $2), that nothing of it is pending:
// no inline effects and no undispatched effect row (outboxdriver.Claim.Settled). In the select
// list of a statement that finds a claim, it is evaluated only when one is found (a duplicate): a
// first delivery pays nothing for it. The row is looked for in the order of the index of pending
// effects by source, so that the plan reads that index whatever the statistics: as an EXISTS,
// planned on an empty table (a new service), it read the pending effects of every source through
// the index by ordering key, and a prepared statement kept that plan while a backlog grew
// (TestDuplicateClaimFindsPendingBySource).
func settledColumn(n store.Names) string {
	return `p.effects IS NULL AND (SELECT 1 FROM ` + n.Effects + ` e
				WHERE e.source_consumer = $1 AND e.source_id = $2 AND e.dispatched_at IS NULL
				ORDER BY e.source_consumer, e.source_id, e.seq LIMIT 1) IS NULL`
}

// ClaimLookup returns the look-up of a claim (consumer $1, id $2) for drivers that claim with
// statements of their own (the pgx form's optimistic mode): the claim's age in milliseconds and
// whether it is settled (outboxdriver.Claim.Settled), or no row when there is none.
func ClaimLookup(n store.Names) string {
	return `SELECT ` + claimAge + `, ` + settledColumn(n) + ` FROM ` + n.Processed + ` p
			WHERE p.consumer = $1 AND p.message_id = $2`
}

// ids is the list of store IDs passed as the text argument arg, as a table v(id) to join: a join
// with the primary key is the plan whatever the statistics (id = ANY (...) was once planned as a
// scan of every pending row per statement).
func ids(arg string) string { return `unnest(string_to_array(` + arg + `, ',')::bigint[]) AS v(id)` }

// selfDue is the condition under which effect e is due for the relay by itself: undispatched,
// not parked, past the grace period ($1 ms) or handed over by a failed dispatch, and past its
// retry time (or lease). It is due when, besides, every earlier undispatched effect with its
// ordering key is due and claimed with it (see EffectClaimDue).
func selfDue(ms func(string) string) string {
	return `e.dispatched_at IS NULL AND e.parked_at IS NULL
			  AND (e.created_at < now() - ` + ms("$1") + ` OR e.next_attempt_at IS NOT NULL)
			  AND (e.next_attempt_at IS NULL OR e.next_attempt_at <= now())`
}

// messageClaim is Queries.MessageClaim; withXID: each row also carries the transaction ID the
// insert gave the claim (NULL when it inserted none), for MessageClaimWithXID.
func messageClaim(n store.Names, withXID bool) string {
	xid := ""
	if withXID {
		xid = `, (SELECT inline_xid FROM ins)`
	}
	return `WITH ins AS (INSERT INTO ` + n.Processed + ` (consumer, message_id, dispatched_at, inline_xid) VALUES ($1, $2, now(), pg_current_xact_id()::text::bigint)
				ON CONFLICT (consumer, message_id) DO NOTHING RETURNING inline_xid),
			seen AS (SELECT ` + claimAge + ` AS age, ` + settledColumn(n) + ` AS settled FROM ` + n.Processed + ` p
				WHERE p.consumer = $1 AND p.message_id = $2 AND NOT EXISTS (SELECT 1 FROM ins))
			SELECT c.claimed, s.age, s.settled` + xid + `
			FROM (SELECT EXISTS (SELECT 1 FROM ins) AS claimed) c LEFT JOIN seen s ON true
			WHERE set_config('` + ownClaimSetting + `', coalesce((SELECT inline_xid::text FROM ins), ''), false) IS NOT NULL`
}

// messageClaimMarking is the claim statement of Queries (same columns, and one more: the IDs
// whose marks it wrote, a JSON array) that also clears the inline effects of the claims of
// consumer $1 whose IDs are in $3 (a text[] literal: textArray), and of those in $4 with their
// dispatch time moved to now: the marks of inline.mark and markLate riding on a claim
// (outboxdriver.ClaimMarker). Without the asynchronous commit: the unit's transaction is the
// marks'. A carried claim that another transaction holds locked (a copy of its message on the
// duplicate path, a relay's claim, the marker) is skipped, not waited for: the unit's message
// must not wait for another's, with its connection, and the units behind it on theirs. Its ID
// is missing from the last column, and the caller writes that mark otherwise.
func messageClaimMarking(n store.Names) string {
	mark := func(ids, set string) string {
		return `UPDATE ` + n.Processed + ` p SET effects = NULL` + set + `
				WHERE p.consumer = $1 AND p.message_id IN (SELECT message_id FROM lk)
				AND p.message_id = ANY (ARRAY(SELECT unnest(` + ids + `::text[]))) AND p.effects IS NOT NULL`
	}
	claim := strings.Replace(messageClaim(n, false), `WITH ins AS (`, `WITH lk AS (SELECT p.message_id FROM `+n.Processed+` p
				WHERE p.consumer = $1 AND p.message_id = ANY (ARRAY(SELECT unnest($3::text[])) || ARRAY(SELECT unnest($4::text[])))
				FOR UPDATE SKIP LOCKED),
			mk AS (`+mark("$3", "")+`),
			mkl AS (`+mark("$4", ", dispatched_at = now()")+`),
			ins AS (`, 1)
	return strings.Replace(claim, `SELECT c.claimed, s.age, s.settled`,
		`SELECT c.claimed, s.age, s.settled, (SELECT coalesce(json_agg(message_id), '[]') FROM lk)::text`, 1)
}

// MessageClaimWithXID is the claim statement of Queries (same parameters and columns) with one
// column more: the transaction ID its insert gave the claim, NULL when it inserted none. A unit
// whose handler ended the transaction with SQL tells its own claim from a copy's by it (the claim
// with that inline_xid), also once its connection is gone and the session setting OwnClaim reads
// with it.
func MessageClaimWithXID(n store.Names) string { return messageClaim(n, true) }

// MessageClaimMarking is the claim statement that also clears the inline effects of the claims
// of the consumer's messages that were sent ($3) and sent late ($4), those not locked by another
// transaction, and returns their IDs in a column more: a thin mark riding on the next claim (see
// outboxdriver.ClaimMarker).
func MessageClaimMarking(n store.Names) string { return messageClaimMarking(n) }

// delayedInsertGuarded is DelayedInsert that inserts nothing unless guard holds (read once per
// statement); the arguments of guard follow those of DelayedInsert.
func delayedInsertGuarded(n store.Names, count int, guard string) string {
	var b strings.Builder
	b.WriteString(`INSERT INTO ` + n.Delayed + ` (source_consumer, source_id, seq, kind, topic, uuid, payload, metadata, ordering_key, due_at, cancel_key)
				SELECT $1::text, $2::text, v.s, v.k, v.t, v.u, v.pl, v.md, v.ok, clock_timestamp() + (v.d * interval '1 millisecond'), v.ck FROM (VALUES `)
	for i := 0; i < count; i++ {
		if i > 0 {
			b.WriteString(", ")
		}
		a := 3 + 7*i
		d := 3 + 7*count + 2*i
		fmt.Fprintf(&b, "($%d::integer, $%d::text, $%d::text, $%d::text, $%d::bytea, $%d::bytea, $%d::text, $%d::bigint, $%d::text)",
			a, a+1, a+2, a+3, a+4, a+5, a+6, d, d+1)
	}
	b.WriteString(`) v (s, k, t, u, pl, md, ok, d, ck)
				WHERE ` + guard)
	return b.String()
}

// delayedCancelGuarded is DelayedCancel that deletes nothing unless guard holds, and returns
// whether it held and how many it deleted.
func delayedCancelGuarded(n store.Names, guard string) string {
	return `WITH c AS (SELECT ` + guard + ` AS claimed),
			d AS (DELETE FROM ` + n.Delayed + ` WHERE cancel_key = $1 AND (SELECT claimed FROM c) RETURNING 1)
			SELECT (SELECT claimed FROM c), (SELECT count(*) FROM d)::int`
}

// claimOf is the condition that the claim of (consumer, id) with inline_xid xid exists: the
// claim a unit inserted, named by the transaction ID MessageClaimWithXID returned.
func claimOf(n store.Names, consumer, id, xid string) string {
	return `EXISTS (SELECT FROM ` + n.Processed + ` WHERE consumer = ` + consumer + `::text AND message_id = ` + id + `::text AND inline_xid = ` + xid + `::bigint)`
}

// DelayedInsertOwnClaim is the DelayedInsertClaimed of Queries for a unit that knows the
// transaction ID of its claim (MessageClaimWithXID): the arguments of DelayedInsert, then
// consumer, id and that ID. It finds the claim by the ID, not by the session setting OwnClaim
// reads, which a session may have lost (RESET ALL; another server connection behind a pooler in
// transaction mode; a closed connection, when the unit asks the pool).
func DelayedInsertOwnClaim(n store.Names, count int) string {
	return delayedInsertGuarded(n, count, claimOf(n, fmt.Sprintf("$%d", 3+9*count), fmt.Sprintf("$%d", 4+9*count), fmt.Sprintf("$%d", 5+9*count)))
}

// DelayedCancelOwnClaim is DelayedCancelClaimed of Queries as DelayedInsertOwnClaim is
// DelayedInsertClaimed: (cancel key, consumer, id, the claim's transaction ID) -> whether the
// claim exists, how many it deleted.
func DelayedCancelOwnClaim(n store.Names) string {
	return delayedCancelGuarded(n, claimOf(n, "$2", "$3", "$4"))
}

func queries(n store.Names, deleteDispatched bool, gen *Generation) store.Queries {
	// The inserts that return xmin name the current partition (see Generation).
	current := func() string { return effectsPartition(n, gen.Load()) }
	ms := millis
	// Marked effects leave the effects table, which holds only what is pending: deleted (the
	// default), or moved to the dispatched table for EffectRetention. Every statement that takes
	// effects out does it in a CTE named m (locking the effect rows first, as everywhere) and reads
	// the source of what it took from it.
	takeEffects := func(where string) string {
		if deleteDispatched {
			return `m AS (DELETE FROM ` + n.Effects + ` e ` + where + ` RETURNING e.source_consumer, e.source_id)`
		}
		return `t AS (DELETE FROM ` + n.Effects + ` e ` + where + ` RETURNING e.*),
			m AS (INSERT INTO ` + n.Dispatched + ` (id, source_consumer, source_id, seq, kind, topic, uuid, payload, metadata, ordering_key,
					created_at, dispatched_at, attempts, failures, last_error)
				SELECT id, source_consumer, source_id, seq, kind, topic, uuid, payload, metadata, ordering_key,
					created_at, now(), attempts, failures, last_error FROM t
				ON CONFLICT (id) DO NOTHING
				RETURNING source_consumer, source_id)`
	}
	// What cleanup deletes (retention ms as $1), shared by its batches and its dry run.
	cleanupClaimsWhere := `p.processed_at < now() - ` + ms("$1") + ` AND p.dispatched_at < now() - ` + ms("$1") + ` AND p.effects IS NULL
			  AND NOT EXISTS (SELECT 1 FROM ` + n.Effects + ` e
				WHERE e.source_consumer = p.consumer AND e.source_id = p.message_id AND e.dispatched_at IS NULL)`
	cleanupClaims := `SELECT consumer, message_id FROM ` + n.Processed + ` p WHERE ` + cleanupClaimsWhere
	cleanupEffects := `SELECT id FROM ` + n.Dispatched + ` WHERE dispatched_at < now() - ` + ms("$1")
	cleanupAttempts := `SELECT consumer, message_id FROM ` + n.Attempts + ` WHERE last_failed_at < now() - ` + ms("$1")
	cleanupKeys := `SELECT scope, key FROM ` + n.Idempotency + ` WHERE expires_at < now() - ` + ms("$1")
	moveClaims := `UPDATE ` + n.Processed + ` p SET dispatched_at = now()
				FROM (SELECT DISTINCT source_consumer, source_id FROM m) s
				WHERE p.consumer = s.source_consumer AND p.message_id = s.source_id`
	markWhere := `USING ` + ids("$1") + ` WHERE e.id = v.id AND ` + asyncCommit
	backedOff := unparked + ` AND next_attempt_at = backoff_until AND next_attempt_at > now()`
	q := store.Queries{
		// The claim's CTE and the SELECT see one snapshot, taken when the statement began: a
		// conflicting claim the SELECT cannot see was committed while the INSERT waited for it, by
		// a copy processed at the same moment. The look-up runs only when the INSERT claimed
		// nothing (it could not see the new claim anyway). The claim carries its transaction's ID
		// at once, for the effects the unit may write into it (EffectRecordInline): the sweep
		// finds them by it, and writing them then leaves every indexed column as it is. The claim
		// it ran into also tells whether anything of it is still pending (settled): a duplicate
		// whose effects went out then reads nothing more.
		// The session remembers the claim's transaction ID (OwnClaim).
		MessageClaim:                  messageClaim(n, false),
		MessageClaimReportsConcurrent: true,
		MessageClaimReportsSettled:    true,
		MessageIsProcessed:            `SELECT 1 FROM ` + n.Processed + ` WHERE consumer = $1 AND message_id = $2`,
		MessagePoison: `INSERT INTO ` + n.Processed + ` (consumer, message_id, dispatched_at, poisoned) VALUES ($1, $2, now(), true)
			ON CONFLICT (consumer, message_id) DO NOTHING`,
		MessagePoisonedRead: `SELECT poisoned FROM ` + n.Processed + ` WHERE consumer = $1 AND message_id = $2 FOR SHARE`,
		MessageReplay:       `DELETE FROM ` + n.Processed + ` WHERE consumer = $1 AND message_id = $2 AND poisoned`,
		AttemptRecord: `INSERT INTO ` + n.Attempts + ` AS a (consumer, message_id, attempts, last_error) VALUES ($1, $2, 1, $3)
			ON CONFLICT (consumer, message_id) DO UPDATE
			SET attempts = a.attempts + 1, last_error = EXCLUDED.last_error, last_failed_at = now()
			RETURNING attempts`,
		AttemptDelete: `DELETE FROM ` + n.Attempts + ` WHERE consumer = $1 AND message_id = $2`,
		// created_at is the time of the insert, not of the transaction's start: a duplicate judges
		// by it whether the effects are young enough to be in their own dispatch right now. A row
		// written inside a savepoint has the subtransaction's xid, not the transaction's own.
		EffectInsert: func(count int) string {
			var b strings.Builder
			b.WriteString(`INSERT INTO ` + current() + ` (source_consumer, source_id, seq, kind, topic, uuid, payload, metadata, ordering_key, created_at) VALUES `)
			for i := 0; i < count; i++ {
				if i > 0 {
					b.WriteString(", ")
				}
				a := 3 + 7*i
				fmt.Fprintf(&b, "($1, $2, $%d, $%d, $%d, $%d, $%d, $%d, $%d, clock_timestamp())", a, a+1, a+2, a+3, a+4, a+5, a+6)
			}
			b.WriteString(` RETURNING id, seq, xmin::text <> (txid_current() % 4294967296)::text`)
			return b.String()
		},
		// Only while the unit's own claim exists (outboxdriver.ClaimedEffectInserter, OwnClaim), or
		// for a boundary unit its transaction's mark (BoundaryMark): an uncorrelated sub-select,
		// read once per statement, a look-up of the primary key or of a setting (ownUnit). The
		// casts give the parameters the types the columns give them in EffectInsert.
		EffectInsertClaimed: func(count int) string {
			var b strings.Builder
			b.WriteString(`INSERT INTO ` + current() + ` (source_consumer, source_id, seq, kind, topic, uuid, payload, metadata, ordering_key, created_at)
				SELECT $1::text, $2::text, v.s, v.k, v.t, v.u, v.pl, v.md, v.ok, clock_timestamp() FROM (VALUES `)
			for i := 0; i < count; i++ {
				if i > 0 {
					b.WriteString(", ")
				}
				a := 3 + 7*i
				fmt.Fprintf(&b, "($%d::integer, $%d::text, $%d::text, $%d::text, $%d::bytea, $%d::bytea, $%d::text)", a, a+1, a+2, a+3, a+4, a+5, a+6)
			}
			b.WriteString(`) v (s, k, t, u, pl, md, ok)
				WHERE ` + ownUnit(n, "$1", "$2") + `
				RETURNING id, seq, xmin::text <> (txid_current() % 4294967296)::text`)
			return b.String()
		},
		// A boundary unit of work marks the transaction it began, for its guarded writes (ownUnit):
		// a command without a result (measured: 37 us where set_config's SELECT took 52 us).
		BoundaryMark: `SET LOCAL ` + boundarySetting + ` = on`,
		// EffectInsertKeyed is EffectInsert for effects with keys of their own (other sources
		// record with them): the delayed effects of other sources with the inserted keys that are
		// due and not moved yet are moved in the same statement, ahead of the new rows (handed
		// over, as the relay's move does), so that a due delayed effect is never overtaken by an
		// effect of its key recorded after it, even while no relay has moved it; the new rows then
		// wait behind it. The move waits for a relay or a cancel that holds one (no SKIP LOCKED):
		// skipped, it would be moved later and take an id behind the new rows. The delete runs,
		// its waits included, before the sort returns a row, so every id is drawn after it, in
		// the sorted order. What is due is judged by the time the new rows are stored with (one
		// clock reading). The probe is one look-up of the delayed_key index per key, empty unless
		// one is due, but the statement costs more than the plain insert (measured, records of one
		// effect each: the same time for one, 10-18% more for eight, on a loaded machine), which
		// the effects of the message's own key keep. As in the
		// relay's move, a delayed effect on its source's key (the default, or a hashed one, which
		// SQL cannot tell from it) waits while its claim holds effects inline: those are on the
		// same key, recorded before it. A key of its own shares nothing with them.
		EffectInsertKeyed: func(count int, claimed bool) string {
			var values, keys strings.Builder
			for i := 0; i < count; i++ {
				if i > 0 {
					values.WriteString(", ")
					keys.WriteString(", ")
				}
				a := 3 + 7*i
				fmt.Fprintf(&values, "(%d, $%d::integer, $%d::text, $%d::text, $%d::text, $%d::bytea, $%d::bytea, $%d::text)", i, a, a+1, a+2, a+3, a+4, a+5, a+6)
				fmt.Fprintf(&keys, "$%d::text", a+6)
			}
			// Claimed: nothing moved or inserted unless the unit's own claim, or its boundary
			// transaction's mark, exists (ownUnit).
			guard := ""
			if claimed {
				guard = ` AND ` + ownUnit(n, "$1", "$2")
			}
			return `WITH t AS MATERIALIZED (SELECT clock_timestamp() AS at),
			moved AS (DELETE FROM ` + n.Delayed + ` d WHERE d.id IN (SELECT w.id FROM ` + n.Delayed + ` w
					WHERE w.ordering_key IN (` + keys.String() + `) AND w.due_at <= (SELECT at FROM t)
					  AND NOT (w.source_consumer = $1 AND w.source_id = $2)
					  AND (NOT (w.ordering_key = w.source_consumer || '/' || w.source_id
							OR octet_length(w.source_consumer) + octet_length(w.source_id) >= ` + fmt.Sprint(outboxdriver.MaxOrderingKeyBytes) + `)
						OR NOT EXISTS (SELECT 1 FROM ` + n.Processed + ` p
						WHERE p.consumer = w.source_consumer AND p.message_id = w.source_id AND p.effects IS NOT NULL))
					` + guard + `
					ORDER BY w.due_at, w.id FOR UPDATE OF w)
				RETURNING d.*),
			ins AS (INSERT INTO ` + current() + ` (source_consumer, source_id, seq, kind, topic, uuid, payload, metadata, ordering_key,
				created_at, next_attempt_at)
			SELECT source_consumer, source_id, seq, kind, topic, uuid, payload, metadata, ordering_key, created_at, next_attempt_at
			FROM (SELECT 0 AS o, due_at AS at, id AS i, source_consumer, source_id, seq, kind, topic, uuid, payload, metadata,
					ordering_key, due_at AS created_at, now() AS next_attempt_at FROM moved
				UNION ALL
				SELECT 1, NULL, v.i, $1::text, $2::text, v.seq, v.kind, v.topic, v.uuid, v.payload, v.metadata, v.ordering_key,
					(SELECT at FROM t), NULL
				FROM (VALUES ` + values.String() + `) v (i, seq, kind, topic, uuid, payload, metadata, ordering_key) WHERE true` + guard + `) r
			ORDER BY o, at, i
			RETURNING id, seq, source_consumer, source_id, xmin::text <> (txid_current() % 4294967296)::text AS nested)
			SELECT id, seq, nested FROM ins WHERE source_consumer = $1 AND source_id = $2`
		},
		EffectExisting: `SELECT e.id FROM ` + ids("$1") + ` JOIN ` + n.Effects + ` e ON e.id = v.id`,
		EffectListPending: `SELECT ` + effectColumns + ` FROM ` + n.Effects + ` e
			WHERE source_consumer = $1 AND source_id = $2 AND dispatched_at IS NULL ORDER BY seq`,
		// The CTE runs first (the main statement reads it): effect rows are locked before claim
		// rows, as everywhere.
		EffectMarkDispatched: func(move bool) string {
			if !move {
				return `WITH ` + takeEffects(markWhere) + ` SELECT count(*) FROM m`
			}
			return `WITH ` + takeEffects(markWhere) + ` ` + moveClaims + ` AND ` + asyncCommit
		},
		// A failure recorded without parking (by a path that tried the effect as the relay parked
		// it) leaves a parked effect parked, since it was first parked.
		EffectRecordFailure: `UPDATE ` + n.Effects + ` SET failures = failures + 1, failed_at = now(), last_error = $2,
			attempts = attempts + CASE WHEN $3::boolean THEN 1 ELSE 0 END,
			next_attempt_at = now() + ` + ms("$5") + `, backoff_until = now() + ` + ms("$5") + `,
			parked_at = CASE WHEN $4::boolean THEN coalesce(parked_at, now()) ELSE parked_at END
			WHERE id = $1 AND dispatched_at IS NULL`,
		EffectRelease: `UPDATE ` + n.Effects + ` e SET next_attempt_at = now() + ` + ms("$2") + ` FROM ` + ids("$1") + `
			WHERE e.id = v.id AND e.dispatched_at IS NULL AND e.parked_at IS NULL`,
		// An effect backs off while the retry time its last failure set is still its own: a lease
		// is taken only once that time has passed, and ends after it; a release sets a time of
		// its own too. The look-up scans the pending effects (no index on topic or kind): it runs
		// once per destination that recovers.
		EffectBackedOff: `SELECT id FROM ` + n.Effects + ` WHERE kind = $1 AND (kind <> '' OR topic = $2) AND ` + backedOff + ` LIMIT $3`,
		EffectRetryNow: `UPDATE ` + n.Effects + ` e SET next_attempt_at = now() FROM ` + ids("$1") + `
			WHERE e.id = v.id AND ` + backedOff,
		EffectKeyBlocked: `SELECT EXISTS (SELECT 1 FROM ` + n.Effects + ` b
			WHERE b.ordering_key = $3 AND b.dispatched_at IS NULL AND NOT (b.source_consumer = $1 AND b.source_id = $2)
			  AND b.id < (SELECT min(id) FROM ` + n.Effects + `
				WHERE source_consumer = $1 AND source_id = $2 AND ordering_key = $3 AND dispatched_at IS NULL))`,
		// Rows that have a retry time already keep it, and are not written again: an update that
		// changes nothing still leaves a dead version of the row.
		EffectHandToRelay: `UPDATE ` + n.Effects + ` SET next_attempt_at = now()
			WHERE source_consumer = $1 AND source_id = $2 AND dispatched_at IS NULL AND next_attempt_at IS NULL`,
		EffectListParked: `SELECT ` + effectColumns + `, last_error, parked_at, created_at FROM ` + n.Effects + ` e
			WHERE parked_at IS NOT NULL AND dispatched_at IS NULL ORDER BY id LIMIT $1`,
		EffectUnpark: `UPDATE ` + n.Effects + ` SET parked_at = NULL, next_attempt_at = now(), attempts = 0, failures = 0
			WHERE id = $1 AND parked_at IS NOT NULL AND dispatched_at IS NULL`,
		// A discarded effect leaves as a dispatched one does (noted as discarded when kept), and
		// moves its claim's dispatch time: retention counts from the discard.
		EffectDiscard: `WITH ` + strings.Replace(takeEffects(`WHERE e.id = $1 AND e.parked_at IS NOT NULL`), `last_error FROM t`,
			`coalesce(last_error, '') || ' (discarded)' FROM t`, 1) + `,
			p AS (` + moveClaims + `)
			SELECT 1 FROM m`,

		// A claim looks at a window of ids from the first pending effect that is not parked (or
		// after $5), looked for above the floor $8 that the store keeps (store.claimFloor): behind
		// a held xmin horizon the index entries of sent effects stay, and a look-up from the start
		// walked every one of them. The last pending effect is looked for above the floor too, and
		// only when some effect is pending there; whether one lies beyond the window follows from
		// it. None pending there: the window is empty (its rows would be the dead ones). Each look-up runs once (OFFSET 0: pulled up, the subquery ran once per use of lo).
		// Every row ends with what the store moves the floor by: the snapshot's xmin; the
		// sequence's last id, read after the snapshot; and an xid above every transaction that
		// may hold an id the claim did not see below its finding: its own transaction ID, taken
		// after its snapshot and after the sequence was read, when it is a claim from the front
		// that found a pending effect or saw ids handed out above the floor. Not the snapshot's
		// xmax, which is the last completed ID plus one: a transaction that took its ID after
		// that one completed runs above it, and the floor passed the id it held. Otherwise the
		// xmax, unused (a claim after an id, or nothing to propose). The window keeps the claim's cost that of the window whatever the
		// backlog (parked effects included), and whatever the planner believes of a table whose statistics predate the
		// backlog; and at a second window of the same width that ends at the last pending effect
		// that is not parked, for the keys that have nothing pending before it,
		// so that what was committed behind a backlog (of another topic, another key) waits one
		// round for it, not until the claims have crawled through the backlog. The candidates are
		// the first $2 effects of the first window that are due by themselves, in id order, and
		// the last $2/4 of the second (of those keys only); of those, $2 are taken round-robin
		// across topics and, within a topic, across ordering keys (a topic's or a key's backlog
		// takes its share of a round, not the round). Of each ordering key, the first candidate
		// taken is locked, by its primary key (SKIP LOCKED: instances claiming at the same time
		// leave each other's keys alone), and checked again on its newest version (another claim
		// may have leased it meanwhile); a key's candidates go only up to its first undispatched
		// effect that is not taken (not due, held by another statement, outside the windows, or
		// not taken in this round): a later effect never overtakes an earlier one. The claimed
		// effects are cut to the byte budget in id order (which keeps each key's a prefix), and
		// the first of each key is leased (next_attempt_at in the future): until the lease ends or
		// the effects are marked, every later effect of the key waits behind it for every other
		// claim. One row is locked and written per key, not per effect. A lost lease (the claim
		// commits asynchronously) only lets an effect be sent again. Every row also carries the
		// ms until the earliest delayed effect is due (by the index on due_at), so that a relay
		// pass moves delayed effects only when one is due: an idle pass is this one statement.
		// The row of a claim that took nothing carries, besides, the ms until the earliest effect
		// of the first window that is not due yet falls due by itself (a lease or a backoff that
		// ends, a grace period), so that an idle relay that backs off looks again then rather
		// than up to its cap later. It reads the rows of the window again (by effects_due, the
		// rows the candidates were looked for in), only when nothing was claimed: in an idle
		// member's window, none or a few.
		EffectClaimDue:         effectClaimDue(n, "", ""),
		EffectClaimDueWindowed: true,
		EffectClaimDueDelayed:  true,
		EffectClaimDuePending:  true,
		EffectClaimDueFloor:    true,

		// A delayed effect's due time is its delay from the insert by the database's clock, the
		// clock the relay compares it with.
		DelayedInsert: func(count int) string {
			var b strings.Builder
			b.WriteString(`INSERT INTO ` + n.Delayed + ` (source_consumer, source_id, seq, kind, topic, uuid, payload, metadata, ordering_key, due_at, cancel_key) VALUES `)
			for i := 0; i < count; i++ {
				if i > 0 {
					b.WriteString(", ")
				}
				a := 3 + 7*i
				d := 3 + 7*count + 2*i
				fmt.Fprintf(&b, "($1, $2, $%d, $%d, $%d, $%d, $%d, $%d, $%d, clock_timestamp() + ($%d::bigint * interval '1 millisecond'), $%d::text)",
					a, a+1, a+2, a+3, a+4, a+5, a+6, d, d+1)
			}
			return b.String()
		},
		DelayedCancel: `DELETE FROM ` + n.Delayed + ` WHERE cancel_key = $1`,
		// As EffectInsertClaimed: nothing without the claim (or the boundary's mark), which is
		// read once per statement.
		DelayedInsertClaimed: func(count int) string {
			return delayedInsertGuarded(n, count, ownUnit(n, fmt.Sprintf("$%d", 3+9*count), fmt.Sprintf("$%d", 4+9*count)))
		},
		DelayedCancelClaimed: delayedCancelGuarded(n, ownUnit(n, "$2", "$3")),
		// The moved effects are handed over (next_attempt_at set: no grace period) and count as
		// stored at their due time, from which their backlog age and dispatch lag count. A row a
		// cancel holds is skipped (it is gone, or due again at the next pass). Ids are drawn in
		// due order, so that effects of one key due together keep their recorded order. An
		// effect whose claim still holds its unit's other effects inline (the pgx driver's
		// optimistic mode, after a crash) waits until they are sent or moved to rows: it would
		// take an id before them and overtake them on its key, the source's. The next due time
		// is read in the same statement, from the snapshot before the move (the moved ones left
		// out), by the index on due_at: an idle relay pass is then one statement here. A due
		// one left (a cancel holds it, its claim holds inline effects) holds back the later ones
		// of its key, which would otherwise take ids before it: the cancel may roll back.
		DelayedPromote: `WITH cand AS (SELECT d.id, d.ordering_key, d.due_at FROM ` + n.Delayed + ` d WHERE d.due_at <= now()
				  AND NOT EXISTS (SELECT 1 FROM ` + n.Processed + ` p
					WHERE p.consumer = d.source_consumer AND p.message_id = d.source_id AND p.effects IS NOT NULL)
				ORDER BY d.due_at, d.id LIMIT $1 FOR UPDATE OF d SKIP LOCKED),
			due AS (SELECT c.id FROM cand c WHERE NOT EXISTS (SELECT 1 FROM ` + n.Delayed + ` e
				WHERE e.ordering_key = c.ordering_key AND e.due_at <= c.due_at AND (e.due_at, e.id) < (c.due_at, c.id)
				  AND e.id NOT IN (SELECT id FROM cand))),
			moved AS (DELETE FROM ` + n.Delayed + ` d USING due WHERE d.id = due.id RETURNING d.*),
			ins AS (INSERT INTO ` + n.Effects + ` (source_consumer, source_id, seq, kind, topic, uuid, payload, metadata, ordering_key,
				created_at, next_attempt_at)
			SELECT source_consumer, source_id, seq, kind, topic, uuid, payload, metadata, ordering_key, due_at, now()
			FROM moved ORDER BY due_at, id RETURNING 1)
			SELECT (SELECT count(*) FROM ins),
				(SELECT (extract(epoch FROM d.due_at - now()) * 1000)::bigint FROM ` + n.Delayed + ` d
				WHERE d.id NOT IN (SELECT id FROM moved) ORDER BY d.due_at, d.id LIMIT 1)`,
		DelayedNextDue: `SELECT (extract(epoch FROM min(due_at) - now()) * 1000)::bigint FROM ` + n.Delayed,
		DelayedStats: `WITH later AS (SELECT 1 FROM ` + n.Delayed + ` WHERE due_at > now() LIMIT $1),
			overdue AS MATERIALIZED (SELECT due_at FROM ` + n.Delayed + ` WHERE due_at <= now() ORDER BY due_at LIMIT $1)
			SELECT (SELECT count(*) FROM later), (SELECT count(*) FROM overdue),
				coalesce((SELECT (extract(epoch FROM now() - min(due_at)) * 1000)::bigint FROM overdue), 0)`,

		CleanupLock: fmt.Sprintf("SELECT pg_try_advisory_xact_lock(%d, %s)", lockClass, lockKey(n, "cleanup")),
		// Cleanup batches commit asynchronously: a batch lost in a crash is simply deleted again.
		CleanupBegin: `SET LOCAL synchronous_commit = off`,
		// A batch takes the oldest expired claims from where the batch before it got to, walking
		// the B-tree on processed_at in order, and deletes them by their row addresses: it reads
		// what it deletes and not the table, whatever the planner's statistics say (its batches
		// are planned without the alternatives that read every expired claim, a bitmap then a
		// sort, or the table). A claim updated since the batch read it has another address and
		// is left to the next cleanup. Found through a BRIN index (before migration 016), each
		// batch read the page ranges earlier batches had emptied, and the whole table once new
		// claims had filled freed pages; deleted by a join on the key, each read the table again.
		// JIT off too: with sequential scans off every plan costs above jit_above_cost, and
		// compiling a batch's statements costs more than running them.
		CleanupFromBegin: `SELECT ` + asyncCommitSetting + `, set_config('enable_seqscan', 'off', true), set_config('enable_bitmapscan', 'off', true), set_config('jit', 'off', true)`,
		CleanupClaimsFrom: `WITH d AS (DELETE FROM ` + n.Processed + ` WHERE ctid = ANY (ARRAY(SELECT p.ctid FROM ` + n.Processed + ` p
				WHERE ` + cleanupClaimsWhere + ` AND p.processed_at >= coalesce($3::timestamptz, '-infinity')
				ORDER BY p.processed_at LIMIT $2)) RETURNING processed_at)
			SELECT count(*), max(processed_at) FROM d`,
		// The dispatched effects' archive, the same way (migration 017).
		CleanupEffectsFrom: `WITH d AS (DELETE FROM ` + n.Dispatched + ` WHERE ctid = ANY (ARRAY(SELECT ctid FROM ` + n.Dispatched + `
				WHERE dispatched_at < now() - ` + ms("$1") + ` AND dispatched_at >= coalesce($3::timestamptz, '-infinity')
				ORDER BY dispatched_at LIMIT $2)) RETURNING dispatched_at)
			SELECT count(*), max(dispatched_at) FROM d`,
		// The DELETE repeats its subquery's condition on its own row: one that was updated while
		// the DELETE waited for it (a failure counted again, a key taken over by a retry) is
		// judged again by the version it then finds, where a match by its primary key alone would
		// delete the new count or claim.
		CleanupAttempts: `DELETE FROM ` + n.Attempts + ` WHERE (consumer, message_id) IN (` + cleanupAttempts + ` LIMIT $2)
			AND last_failed_at < now() - ` + ms("$1"),
		CleanupClaimsCount:   `SELECT count(*) FROM (` + cleanupClaims + `) s`,
		CleanupEffectsCount:  `SELECT count(*) FROM (` + cleanupEffects + `) s`,
		CleanupAttemptsCount: `SELECT count(*) FROM (` + cleanupAttempts + `) s`,

		// Expired keys only: each carries its expiry, written at its claim. $1 is the cleanup's
		// retention argument, zero for keys. The expiry is checked again on the row deleted (see
		// CleanupAttempts).
		CleanupKeys: `DELETE FROM ` + n.Idempotency + ` WHERE (scope, key) IN (` + cleanupKeys + ` LIMIT $2)
			AND expires_at < now() - ` + ms("$1"),
		CleanupKeysCount: `SELECT count(*) FROM (` + cleanupKeys + `) s`,

		// A key's lock is a transaction-level advisory lock on the 64-bit hash of its name
		// (seeded with the class of the framework's locks): held from the claim to the end of the
		// unit of work, so that a retry learns at once that the first request is still running,
		// where the insert alone would wait for it. Two keys in flight at once share a lock with
		// a chance of about one in 10^13 per pair even at a thousand keys in flight.
		KeyLock: fmt.Sprintf(`SELECT CASE WHEN $2::boolean THEN (SELECT true FROM pg_advisory_xact_lock(hashtextextended($1, %d)))
			ELSE pg_try_advisory_xact_lock(hashtextextended($1, %d)) END`, lockClass, lockClass),
		// An expired key is taken over in place; one that has not expired is left as it is (and
		// locked: ON CONFLICT DO UPDATE locks the row even when its WHERE is false).
		KeyClaim: `INSERT INTO ` + n.Idempotency + ` AS k (scope, key, fingerprint, expires_at)
			VALUES ($1, $2, $3, now() + ` + ms("$4") + `)
			ON CONFLICT (scope, key) DO UPDATE SET fingerprint = EXCLUDED.fingerprint, result = '',
				created_at = now(), expires_at = EXCLUDED.expires_at
			WHERE k.expires_at <= now()
			RETURNING 1`,
		KeyRead: `SELECT fingerprint, result FROM ` + n.Idempotency + ` WHERE scope = $1 AND key = $2`,
		KeySave: `UPDATE ` + n.Idempotency + ` SET result = $3 WHERE scope = $1 AND key = $2`,

		SchemaLatest: `SELECT max(version) FROM ` + n.Migrations,
		Writable:     `SELECT pg_is_in_recovery(), current_setting('transaction_read_only') = 'on'`,

		// A count the planner's statistics put at $1 rows or more is taken from them; a smaller
		// one is counted, reading at most $1 rows through an index (and estimated if it reaches
		// $1 after all). So a sample costs the same at 10M retained IDs as at 100,000. The
		// cleanup lag looks at the oldest thousand expired claims that cleanup may delete (found
		// through the index on processed_at; none when it keeps up), from where the cleanup
		// service's runs got to (StatsSampleFull's $3; NULL: the start): below it are the claims
		// cleanup deleted, which stay as dead index entries while the xmin horizon is held back,
		// and the sample walked them all (57,498 blocks a sample after a 3-minute hold).
		StatsSample: `WITH est AS MATERIALIZED (
				SELECT greatest((SELECT reltuples FROM pg_class WHERE oid = '` + n.Processed + `'::regclass), 0)::bigint AS processed,
					(SELECT coalesce(sum(greatest(c.reltuples, 0)), 0) FROM pg_partition_tree('` + n.Effects + `'::regclass) t
						JOIN pg_class c ON c.oid = t.relid WHERE t.isleaf)::bigint AS effects),
			pending AS MATERIALIZED (SELECT e.id, e.created_at FROM ` + n.Effects + ` e
				WHERE e.dispatched_at IS NULL AND e.parked_at IS NULL ORDER BY e.id LIMIT $1),
			parked AS MATERIALIZED (SELECT e.id, e.created_at FROM ` + n.Effects + ` e
				WHERE e.parked_at IS NOT NULL AND e.dispatched_at IS NULL ORDER BY e.id LIMIT $1),
			failing AS (SELECT 1 FROM ` + n.Attempts + ` a WHERE NOT EXISTS (SELECT 1 FROM ` + n.Processed + ` p
				WHERE p.consumer = a.consumer AND p.message_id = a.message_id) LIMIT $1),
			retained AS MATERIALIZED (SELECT CASE WHEN est.processed >= $1 THEN est.processed
				ELSE (SELECT count(*) FROM (SELECT 1 FROM ` + n.Processed + ` LIMIT $1) r) END AS n,
				est.processed >= $1 AS estimated FROM est),
			expired AS (SELECT p.dispatched_at FROM ` + n.Processed + ` p
				WHERE p.processed_at < now() - ` + ms("$2") + ` AND p.dispatched_at < now() - ` + ms("$2") + ` AND p.effects IS NULL
				  AND p.processed_at >= coalesce(` + statsCleanupFrom + `, '-infinity')
				  AND NOT EXISTS (SELECT 1 FROM ` + n.Effects + ` e
					WHERE e.source_consumer = p.consumer AND e.source_id = p.message_id AND e.dispatched_at IS NULL)
				ORDER BY p.processed_at LIMIT 1000),
			counts AS (SELECT (SELECT count(*) FROM pending) AS pending, (SELECT count(*) FROM parked) AS parked)
			SELECT CASE WHEN counts.pending >= $1 THEN greatest($1, est.effects) ELSE counts.pending END,
				coalesce((SELECT (extract(epoch FROM now() - min(created_at)) * 1000)::bigint FROM pending), 0),
				CASE WHEN counts.parked >= $1 THEN greatest($1, est.effects) ELSE counts.parked END,
				coalesce((SELECT (extract(epoch FROM now() - min(created_at)) * 1000)::bigint FROM parked), 0),
				(SELECT count(*) FROM failing),
				CASE WHEN NOT retained.estimated AND retained.n >= $1 THEN greatest($1, est.processed) ELSE retained.n END,
				counts.pending >= $1 OR counts.parked >= $1 OR retained.estimated OR retained.n >= $1,
				coalesce((SELECT (extract(epoch FROM now() - ` + ms("$2") + ` - min(dispatched_at)) * 1000)::bigint FROM expired), 0)
			FROM est, counts, retained`,
		// A lease more than a minute in the future is the clock stepped back since: taken, or
		// nobody sampled until the clock caught up, while the stored sample looked fresh (its age
		// clamped to 0). Not any lease in the future: one a concurrent statement took after this
		// one's now() would be taken again.
		StatsLease: `UPDATE ` + n.Stats + ` SET leased_at = now() WHERE id = 1
			AND (leased_at < now() - ` + ms("$1") + ` OR leased_at > now() + interval '1 minute')`,
		StatsWrite: `UPDATE ` + n.Stats + ` SET sampled_at = now(), sample = $1 WHERE id = 1`,
		StatsRead: `SELECT sample, (extract(epoch FROM now() - sampled_at) * 1000)::bigint FROM ` + n.Stats + `
			WHERE id = 1 AND sample IS NOT NULL`,

		// What holds back the xmin horizon of this database: a backend of this database (on
		// PostgreSQL 14 and later those of other databases do not hold back its tables; a
		// walsender carrying a standby's hot_standby_feedback has no database), a backend's own
		// xid counting as its xmin (a session idle in transaction after a write has no snapshot
		// but holds its xid), a slot's xmin (a logical slot's catalog_xmin holds back the catalogs
		// only), a prepared transaction. backend_xmin, backend_xid, pid and application_name are
		// readable for every session; xact_start and state only for the role's own sessions, or
		// with pg_read_all_stats. A VACUUM shows an xmin that holds nothing back (the server
		// leaves vacuums out of the horizon): its pid, which pg_stat_progress_vacuum shows to
		// every role, is left out. It names no outbox table: the Outboxes of one pool share it.
		XminSample: `SELECT 'backend' AS kind,
					CASE WHEN backend_xid IS NOT NULL AND age(backend_xid) >= coalesce(age(backend_xmin), 0)
						THEN backend_xid ELSE backend_xmin END::text AS xid,
					greatest(age(backend_xid), age(backend_xmin))::bigint AS xacts,
					(extract(epoch FROM now() - xact_start) * 1000)::bigint AS started_ms,
					pid, application_name AS app, state, backend_type AS name
				FROM pg_stat_activity
				WHERE pid <> pg_backend_pid() AND (backend_xmin IS NOT NULL OR backend_xid IS NOT NULL)
				  AND pid NOT IN (SELECT pid FROM pg_stat_progress_vacuum)
				  AND (datid IS NULL OR datid = (SELECT oid FROM pg_database WHERE datname = current_database()))
				UNION ALL
				SELECT 'replication_slot', xmin::text, age(xmin)::bigint, NULL, active_pid, NULL,
					CASE WHEN active THEN 'active' ELSE 'inactive' END, slot_name::text
				FROM pg_replication_slots WHERE xmin IS NOT NULL
				UNION ALL
				SELECT 'prepared_transaction', transaction::text, age(transaction)::bigint,
					(extract(epoch FROM now() - prepared) * 1000)::bigint, NULL, NULL, NULL, gid
				FROM pg_prepared_xacts WHERE database = current_database()
				ORDER BY 3 DESC LIMIT 1`,
		// The lease and the sample stored, in one statement: the sample is the one before the
		// lease (a lease changes leased_at only), which the xmin horizon's age carries on from.
		StatsLeaseRead: `WITH l AS (UPDATE ` + n.Stats + ` SET leased_at = now() WHERE id = 1
				AND (leased_at < now() - ` + ms("$1") + ` OR leased_at > now() + interval '1 minute') RETURNING 1)
			SELECT EXISTS (SELECT 1 FROM l), sample, (extract(epoch FROM now() - sampled_at) * 1000)::bigint
			FROM ` + n.Stats + ` WHERE id = 1`,

		AuditInsert: `INSERT INTO ` + n.Audit + ` (actor, action, target, detail, remote_addr) VALUES ($1, $2, $3, $4, $5)`,
		RecordServiceConfig: `UPDATE ` + n.Stats + ` SET retention_ms = $1, effect_retention_ms = $2,
			redelivery_horizon_ms = $3, config_at = now() WHERE id = 1`,
	}
	// A sample in one statement (each round trip of an idle member's sample is a transaction
	// of the server's, two with lib/pq's parameters): StatsSample, DelayedStats, the dead
	// letters counted as DeadLetters.Count does, and the outbox tables' dead tuples and last
	// autovacuums as JSON, from the statistics functions, by oid (no table is read).
	q.StatsSampleFull = `SELECT s.*, d.*, (SELECT count(*) FROM (SELECT 1 FROM ` + n.DeadLetters + ` WHERE state = 'dead' LIMIT $1) dl),
			(SELECT json_agg(json_build_object('table', t.name, 'dead', coalesce(p.dead, pg_stat_get_dead_tuples(t.oid), 0),
				'vacuumed_ms', (extract(epoch FROM coalesce(p.vacuumed, pg_stat_get_last_autovacuum_time(t.oid))) * 1000)::bigint) ORDER BY t.name)
			FROM (VALUES ('effects', '` + n.Effects + `'::regclass), ('processed', '` + n.Processed + `'::regclass),
				('dispatched', '` + n.Dispatched + `'::regclass), ('delayed', '` + n.Delayed + `'::regclass),
				('attempts', '` + n.Attempts + `'::regclass), ('idempotency', '` + n.Idempotency + `'::regclass),
				('dead_letters', '` + n.DeadLetters + `'::regclass)) t(name, oid)
			-- A partitioned table (effects, migration 023) counts nothing itself: its partitions'
			-- dead tuples are summed, and the latest of their autovacuums taken.
			LEFT JOIN LATERAL (SELECT sum(pg_stat_get_dead_tuples(l.relid)) AS dead,
					max(pg_stat_get_last_autovacuum_time(l.relid)) AS vacuumed
				FROM pg_partition_tree(t.oid) l WHERE l.isleaf HAVING count(*) > 0) p ON true)
		FROM (` + strings.ReplaceAll(q.StatsSample, statsCleanupFrom, "$3::timestamptz") + `) s, (` + q.DelayedStats + `) d`
	q.StatsSample = strings.ReplaceAll(q.StatsSample, statsCleanupFrom, "NULL::timestamptz")
	return q
}

// statsCleanupFrom stands in StatsSample for where the cleanup lag's look-up begins: the third
// parameter of StatsSampleFull, NULL in StatsSample (which takes two).
const statsCleanupFrom = "{{cleanup_from}}"

// namesOf returns the validated names of schema (empty: DefaultSchema) and prefix.
func namesOf(schema, prefix string) (store.Names, error) {
	if schema == "" {
		schema = DefaultSchema
	}
	return NewNames(schema, prefix)
}

// MigrationScript returns every migration for schema (empty: DefaultSchema) and prefix as one SQL
// script: it creates the schema and the migrations table if missing, and records each migration
// after its DDL, so that applying it (psql -f, or a migration tool) to an empty database or to
// tables of an older version leaves them as Migrate would, and Migrate then finds nothing to do.
//
// Each migration runs with its record in a transaction of its own, as in Migrate (which runs them
// all in one): psql runs each statement of a script on its own otherwise, where the SET LOCAL
// lock_timeout of a migration is ignored with a warning, and a migration behind a long
// transaction would wait for it while holding back every writer of its table. No migration may
// need to run outside a transaction (CREATE INDEX CONCURRENTLY): Migrate could not apply it.
func MigrationScript(schema, prefix string) (string, error) {
	n, err := namesOf(schema, prefix)
	if err != nil {
		return "", err
	}
	all, err := Migrations(schema, prefix)
	if err != nil {
		return "", err
	}
	var b strings.Builder
	b.WriteString("-- The outbox tables, schema " + n.Schema + ", prefix " + n.Prefix + ".\n")
	for _, s := range migrateQueries(n).Bootstrap {
		b.WriteString(s + ";\n")
	}
	b.WriteString("\n")
	for _, m := range all {
		fmt.Fprintf(&b, "-- %03d_%s\nBEGIN;\n%s\n", m.Version, m.Name, strings.TrimSpace(m.SQL))
		fmt.Fprintf(&b, "INSERT INTO %s (version) VALUES (%d) ON CONFLICT DO NOTHING;\nCOMMIT;\n\n", n.Migrations, m.Version)
	}
	return b.String(), nil
}

// Grants returns the statements that give role what a service needs on the tables of schema
// (empty: DefaultSchema) and prefix: data, not DDL (run Migrate, or MigrationScript, with a role
// that may create tables), and INSERT alone on the audit table. With operator, role may also read
// the audit table, as the operators' CLI does for its status.
func Grants(schema, prefix, role string, operator bool) ([]string, error) {
	n, err := namesOf(schema, prefix)
	if err != nil {
		return nil, err
	}
	out, err := store.Grants(n, role, operator)
	if err != nil {
		return nil, err
	}
	r, _ := store.QuoteRole(role) // checked by store.Grants
	// The partitions of the effects table (migration 023): the inserts that return xmin name
	// them, and the relay's rotation moves what is pending in the oldest and truncates it, then
	// switches the current one.
	for gen := range 3 {
		out = append(out, "GRANT SELECT, INSERT, UPDATE, DELETE, TRUNCATE ON TABLE "+effectsPartition(n, gen)+" TO "+r)
	}
	// And the function that is the partitioned table's default generation: a database that
	// revokes EXECUTE from PUBLIC (ALTER DEFAULT PRIVILEGES) refused every insert through the
	// parent (the move of inline effects left behind, of delayed effects that fell due).
	return append(out, "GRANT SELECT, UPDATE ON TABLE "+rotationTable(n)+" TO "+r,
		`GRANT EXECUTE ON FUNCTION "`+n.Schema+`"."`+n.Prefix+`effects_gen"() TO `+r), nil
}

// rotationTable is the quoted name of the table of the current partition of the effects table.
func rotationTable(n store.Names) string {
	return `"` + n.Schema + `"."` + n.Prefix + `effects_rotation"`
}

// ownClaimSetting is the session setting in which MessageClaim leaves the transaction ID of the
// claim it inserted (empty when it inserted none).
const ownClaimSetting = "outbox.claim_xid"

// boundarySetting is the transaction-local setting BoundaryMark sets in the transaction a
// boundary unit of work began (InTx: no claim). Set LOCAL, it is gone once that transaction
// ends, by COMMIT or ROLLBACK sent as SQL too.
const boundarySetting = "outbox.boundary_tx"

// Marked is the condition that the transaction open is the one BoundaryMark marked (of Queries):
// false once user SQL ended it, also in a transaction user SQL began after it.
const Marked = `coalesce(current_setting('` + boundarySetting + `', true), '') = 'on'`

// ownUnit is the guard of the writes of a unit of work beside or into what it owns (consumer and
// id: the SQL of its source's two columns). A unit that claimed a message finds its own claim
// (OwnClaim). A boundary unit (no consumer) has none: it finds the mark BoundaryMark left in
// its transaction. Either is gone once user SQL ended the transaction (COMMIT or ROLLBACK sent
// through it, or "ROLLBACK; BEGIN"), and a write in autocommit, or in a transaction of the
// handler's own, would commit an effect apart from its business change. The CASE reads the claim
// only for a consumer's unit and the setting only for a boundary's.
func ownUnit(n store.Names, consumer, id string) string {
	return `CASE WHEN ` + consumer + `::text = '' THEN ` + Marked + `
		ELSE EXISTS (SELECT FROM ` + n.Processed + ` WHERE consumer = ` + consumer + ` AND message_id = ` + id + ` AND ` + OwnClaim + `) END`
}

// OwnClaim is the condition, on a claim row of the processed table, that it is the one the
// session's unit of work inserted: the claim takes its transaction's ID (inline_xid) at its
// insert, and MessageClaim leaves that ID in a session setting. The unit's writes of effects into
// or beside its claim are guarded by it. A handler that ends the transaction with a ROLLBACK of
// its own leaves the session in autocommit, and the setting, set in the rolled-back transaction,
// goes back to what it was: a copy of the message that claimed after the rollback and committed
// has a claim with the message's key, and without this a write would find it and commit on its
// own, an effect of rolled-back work. After a COMMIT of its own the setting stays, and the unit's
// later writes still find its committed claim (kept, as the handler's later business writes are).
// Behind a transaction pooler such a write may reach a server connection whose setting is another
// session's: it finds no claim and writes nothing (ErrTxFinishedByHandler).
const OwnClaim = `inline_xid = nullif(current_setting('` + ownClaimSetting + `', true), '')::bigint`

// millis is the interval of arg milliseconds.
func millis(arg string) string { return "(" + arg + " * interval '1 millisecond')" }

// notSkipped leaves out the ordering keys the relay asked the claim to skip ($7): those of the
// round it is sending, whose later effects wait behind that round's lease. Without it a claim
// made while a round sends spends its limit on them and takes nothing from them.
const notSkipped = `e.ordering_key NOT IN (SELECT jsonb_array_elements_text($7::jsonb))`

// headLetsGo holds a candidate e back when the first undispatched effect of its key is another
// one that is not due (parked, backing off, leased, in its grace period): e waits behind it, and
// spent on such effects, a claim's limit left the other keys of its window unclaimed for as long
// as the key was blocked (the backlog behind a parked effect: until an operator acted). One probe
// of effects_pending_key per candidate looked at.
func headLetsGo(n store.Names, ms func(string) string) string {
	return `coalesce((SELECT h.id = e.id OR (h.parked_at IS NULL
				  AND (h.created_at < now() - ` + ms("$1") + ` OR h.next_attempt_at IS NOT NULL)
				  AND (h.next_attempt_at IS NULL OR h.next_attempt_at <= now()))
			FROM ` + n.Effects + ` h WHERE h.ordering_key = e.ordering_key AND h.dispatched_at IS NULL
			ORDER BY h.ordering_key, h.id LIMIT 1), true)`
}

// unparked are the effects the relay may send, found through the index effects_due: the windows
// of a claim are placed among them, so that the parked effects in front are not walked by every
// pass (a window's effects are still checked against all pending effects of their keys, parked
// ones included, which hold them back).
const unparked = `dispatched_at IS NULL AND parked_at IS NULL`

// floorColumns are what the store keeps its claims' floor by (store.Queries.EffectClaimDueFloor).
const floorColumns = `bounds.found, bounds.snap_xmin, bounds.cand_xmax, bounds.seq_last`

// effectClaimDue is Queries.EffectClaimDue (see the comment there), with, when with is not
// empty, the CTEs with (each followed by a comma) first and the columns columns (each preceded
// by a comma) at the end of every row: what a Store reads in the claim's round trip besides
// (store.SQL.EffectClaimDueWith; the look at the rotation, lookQueries).
func effectClaimDue(n store.Names, with, columns string) string {
	ms := millis
	return `WITH ` + with + `bounds AS MATERIALIZED (
				SELECT hi, last > hi AS more, lo, greatest(hi, last - $6) AS tail_lo, last, found,
					pg_snapshot_xmin(pg_current_snapshot())::text::bigint AS snap_xmin,
					CASE WHEN $5 > 0 OR (NOT found AND s.seq_last <= $8) THEN pg_snapshot_xmax(pg_current_snapshot())::text::bigint
						ELSE pg_current_xact_id()::text::bigint END AS cand_xmax,
					s.seq_last
				FROM (SELECT CASE WHEN $5 > 0 THEN $5 ELSE coalesce(f.first, $8) END AS lo, f.first IS NOT NULL AS found,
					CASE WHEN $5 = 0 AND f.first IS NULL THEN 0
						ELSE coalesce((SELECT max(id) FROM ` + n.Effects + ` WHERE ` + unparked + ` AND id > $8), 0) END AS last
					FROM (SELECT CASE WHEN $5 > 0 THEN NULL
						ELSE (SELECT min(id) - 1 FROM ` + n.Effects + ` WHERE ` + unparked + ` AND id > $8) END AS first
						OFFSET 0) f
					OFFSET 0) l, LATERAL (SELECT CASE WHEN $5 = 0 AND NOT found THEN lo ELSE lo + $6 END AS hi) h,
					(SELECT coalesce(pg_sequence_last_value(pg_get_serial_sequence('` + effectsPartition(n, 0) + `', 'id')::regclass), 0) AS seq_last
					OFFSET 0) s
				WHERE ` + asyncCommit + `),
			tail AS MATERIALIZED (
				SELECT e.id, e.ordering_key, e.topic, octet_length(e.payload) + octet_length(e.metadata) AS size
				FROM ` + n.Effects + ` e, bounds
				WHERE e.id > (SELECT tail_lo FROM bounds) AND e.id <= (SELECT last FROM bounds) AND ` + selfDue(ms) + ` AND ` + notSkipped + `
				ORDER BY e.id DESC LIMIT ($2 + 3) / 4),
			fresh AS MATERIALIZED (SELECT t.ordering_key FROM (SELECT DISTINCT ordering_key FROM tail) t, bounds
				WHERE (SELECT b.id FROM ` + n.Effects + ` b WHERE b.ordering_key = t.ordering_key AND b.dispatched_at IS NULL
					ORDER BY b.ordering_key, b.id LIMIT 1) > bounds.tail_lo),
			cand AS MATERIALIZED (
				(SELECT e.id, e.ordering_key, e.topic, octet_length(e.payload) + octet_length(e.metadata) AS size
				FROM ` + n.Effects + ` e, bounds
				WHERE e.id > (SELECT lo FROM bounds) AND e.id <= (SELECT hi FROM bounds) AND ` + selfDue(ms) + ` AND ` + notSkipped + `
				  AND ` + headLetsGo(n, ms) + `
				ORDER BY e.id LIMIT $2)
				UNION ALL
				SELECT tail.* FROM tail JOIN fresh USING (ordering_key)),
			c AS MATERIALIZED (
				SELECT id, ordering_key, size FROM (
					SELECT id, ordering_key, size, kr, row_number() OVER (PARTITION BY topic ORDER BY kr, id) AS tr
					FROM (SELECT cand.*, row_number() OVER (PARTITION BY ordering_key ORDER BY id) AS kr FROM cand) k) r
				ORDER BY tr, kr, id LIMIT $2),
			keys AS MATERIALIZED (SELECT ordering_key, min(id) AS first, array_agg(id) AS ids FROM c GROUP BY ordering_key),
			heads AS MATERIALIZED (
				SELECT h.id FROM keys k, LATERAL (SELECT e.id FROM ` + n.Effects + ` e
					WHERE e.id = k.first AND e.dispatched_at IS NULL AND e.parked_at IS NULL
					  AND (e.next_attempt_at IS NULL OR e.next_attempt_at <= now())
					FOR UPDATE OF e SKIP LOCKED) h),
			stops AS MATERIALIZED (SELECT k.ordering_key, (SELECT b.id FROM ` + n.Effects + ` b
					WHERE b.ordering_key = k.ordering_key AND b.dispatched_at IS NULL AND b.id <> ALL (k.ids)
					ORDER BY b.ordering_key, b.id LIMIT 1) AS stop
				FROM keys k JOIN heads h ON h.id = k.first),
			w AS (SELECT c.id, c.ordering_key, sum(c.size) OVER (ORDER BY c.id) AS running, row_number() OVER (ORDER BY c.id) AS n
				FROM c JOIN stops USING (ordering_key) WHERE stops.stop IS NULL OR c.id < stops.stop),
			claimed AS MATERIALIZED (SELECT id, ordering_key FROM w WHERE running <= $3 OR n = 1),
			due AS MATERIALIZED (SELECT (extract(epoch FROM d.due_at - now()) * 1000)::bigint AS ms FROM ` + n.Delayed + ` d
				ORDER BY d.due_at, d.id LIMIT 1),
			lease AS (UPDATE ` + n.Effects + ` e SET next_attempt_at = now() + ` + ms("$4") + `
				FROM (SELECT min(id) AS id FROM claimed GROUP BY ordering_key) f WHERE e.id = f.id)
			SELECT ` + effectColumns + `, bounds.hi, bounds.more, (SELECT ms FROM due), NULL::bigint, ` + floorColumns + columns + `
			FROM claimed JOIN ` + n.Effects + ` e USING (id), bounds
			UNION ALL
			SELECT 0, '', '', 0, '', '', '', ''::bytea, ''::bytea, '', 0, 0::bigint, 0, 0::bigint, false, bounds.hi, bounds.more, (SELECT ms FROM due),
				(SELECT (extract(epoch FROM min(p.at) - now()) * 1000)::bigint
				FROM (SELECT coalesce(e.next_attempt_at, e.created_at + ` + ms("$1") + `) AS at FROM ` + n.Effects + ` e
					WHERE e.id > bounds.lo AND e.id <= bounds.hi AND e.dispatched_at IS NULL AND e.parked_at IS NULL) p
				WHERE p.at > now()), ` + floorColumns + columns + `
			FROM bounds WHERE NOT EXISTS (SELECT 1 FROM claimed)`
}
