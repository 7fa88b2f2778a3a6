package store

import (
	"cmp"
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"math"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/watermill-outbox/outbox/outboxdriver"
)

// Queries are the statements of one dialect. Durations are passed in milliseconds; a list of
// store IDs is passed as one text argument, the IDs separated by commas ("1,2,3").
type Queries struct {
	// MessageClaim (consumer, id) claims a message. With MessageClaimReportsConcurrent it returns
	// one row (claimed, seen age): seen age is the age in ms of the claim it ran into if that
	// claim was already committed when the statement began, and NULL otherwise. Without it, it
	// returns a row when it claimed and none otherwise (MessageAge then tells the age).
	MessageClaim                  string
	MessageClaimReportsConcurrent bool
	// MessageClaimReportsSettled: MessageClaim (with MessageClaimReportsConcurrent) returns a
	// third column, settled: whether the committed claim it ran into has nothing pending
	// (outboxdriver.Claim.Settled), NULL when it claimed or saw no claim.
	MessageClaimReportsSettled bool
	MessageAge                 string // (consumer, id) -> age of the claim in ms
	MessageIsProcessed         string // (consumer, id) -> a row when processed
	MessagePoison              string // (consumer, id)
	// MessagePoisonedRead: (consumer, id) -> whether the claim is poisoned, a locking read (which
	// sees the latest committed row whatever the isolation level), for DeadLetterInsert when
	// MessagePoison wrote nothing. Empty: not read (a claim found is taken for a poisoned one).
	MessagePoisonedRead string
	MessageReplay       string // (consumer, id): delete the claim if it is poisoned
	AttemptRecord       string // (consumer, id, reason) -> attempts
	AttemptDelete       string // (consumer, id)
	// EffectInsert returns the insert of n effects: (consumer, id) then per effect
	// (seq, kind, topic, uuid, payload, metadata, ordering_key); it returns (id, seq, in
	// savepoint) per effect.
	EffectInsert func(n int) string
	// EffectInsertClaimed is EffectInsert for a unit of work that claimed (consumer, id): it
	// inserts nothing (returns no row) when the claim does not exist, so that nothing is written
	// in autocommit once user SQL rolled the transaction back
	// (outboxdriver.ClaimedEffectInserter). Nil when the dialect has none (EffectInsert is used).
	// With BoundaryMark, it (and every claimed variant below) also guards a boundary unit (consumer
	// empty): nothing is written once the transaction that BoundaryMark marked has ended.
	EffectInsertClaimed func(n int) string
	// BoundaryMark marks the transaction of a boundary unit of work, at its begin, for the
	// claimed variants of the writes (outboxdriver.BoundaryGuard): a mark that ends with its
	// transaction. Empty when the dialect has none (a boundary unit's writes are not guarded).
	BoundaryMark string
	// EffectInsertKeyed, when set, is EffectInsert for effects of which one has an ordering key
	// of its own (HasOwnKey): it also moves the due delayed effects of other sources with those
	// keys ahead of the new rows (see outboxdriver.Store.EffectInsert). claimed: guarded as
	// EffectInsertClaimed is, nothing moved or inserted without the claim.
	EffectInsertKeyed func(n int, claimed bool) string
	EffectExisting    string // (ids) -> id of the rows that exist
	EffectListPending string // (consumer, id) -> effect columns, in seq order
	// EffectMarkDispatched marks effects dispatched: (ids); with moveClaims it moves their
	// claims' dispatch time too. It locks the effect rows before the claim rows.
	EffectMarkDispatched func(moveClaims bool) string
	EffectRecordFailure  string // (id, reason, counted bool, park bool, retry delay ms)
	EffectRelease        string // (ids, retry delay ms): due again after the delay, nothing counted
	EffectKeyBlocked     string // (consumer, id, key) -> bool
	EffectHandToRelay    string // (consumer, id)
	EffectListParked     string // (limit) -> effect columns, last_error, parked_at, created_at
	EffectUnpark         string // (store id)
	// EffectBackedOff (kind, topic, limit) -> ids of up to limit effects of kind (for the publish
	// kind "", to topic) that back off after a recorded failure: pending, not parked, their
	// retry time the one EffectRecordFailure set and still ahead. A plain read that locks
	// nothing. EffectRetryNow (ids) makes those of ids that still back off due now, and reports
	// them as rows affected. Empty when the dialect has none (outboxdriver.EffectRetrier).
	EffectBackedOff string
	EffectRetryNow  string
	// EffectDiscard (store id) marks a parked effect dispatched and moves its claim's dispatch
	// time; it returns a row per effect it discarded.
	EffectDiscard string
	// EffectClaimDue (grace ms, limit, max bytes, lease ms, after, window) -> effect columns of the
	// leased effects, in any order. With EffectClaimDueWindowed it takes a seventh argument, the
	// ordering keys to leave alone (a JSON array of strings), and looks only at the window
	// (lo, lo+window] of ids, lo the greater of after and the first pending id less one, and every
	// row starts with (next, more): more tells whether pending effects lie beyond next; a row whose
	// effect id is 0 carries them when nothing was claimed.
	EffectClaimDue         string
	EffectClaimDueWindowed bool
	// EffectClaimDueDelayed: (windowed) every row ends with the ms until the earliest due time of
	// the delayed effects (negative when past, NULL when none): EffectClaim.Delayed.
	EffectClaimDueDelayed bool
	// EffectClaimDuePending: (windowed) every row ends, after the delayed column when there is
	// one, with the ms until the earliest effect of the window that is not due yet falls due
	// (NULL when none; read only on the row of a claim that took nothing): EffectClaim.Pending.
	EffectClaimDuePending bool
	// EffectClaimDueFloor: (windowed) the claim takes an eighth argument, the floor: it looks
	// for pending effects above it only (no unparked pending effect lies at or below it), and
	// every row ends, after the columns above, with (found, snapshot xmin, candidate xmax, last
	// id): whether an unparked pending effect lies above the floor (the window then starts
	// just before the first), the xmin of the statement's snapshot (pg_snapshot_xmin), a
	// transaction ID above that of every transaction that may hold an id the claim could not
	// see, at or below its finding (the first pending id less one, or, none found, the last
	// id), and the last id the effects' sequence handed out, read after the snapshot (0 when
	// none). The store keeps the floor (claimFloor).
	EffectClaimDueFloor bool

	// DelayedInsert returns the insert of n delayed effects: the arguments of EffectInsert, then
	// per effect (delay ms from now, cancel key or NULL). Empty when the dialect keeps none.
	DelayedInsert func(n int) string
	DelayedCancel string // (cancel key) -> deletes the delayed effects with the key; rows affected
	// DelayedInsertClaimed and DelayedCancelClaimed are DelayedInsert and DelayedCancel for a
	// unit of work that claimed (consumer, id), as EffectInsertClaimed: the insert (its
	// arguments, then consumer and id) inserts nothing when the claim does not exist; the cancel
	// (cancel key, consumer, id) returns one row, whether the claim exists and how many it
	// deleted. Nil or empty when the dialect has none.
	DelayedInsertClaimed func(n int) string
	DelayedCancelClaimed string
	// DelayedClaimExists (consumer, id) -> whether the claim exists: for a dialect without
	// DelayedCancelClaimed whose transactions are serialized (SQLite's single writer), the
	// cancel of a unit that claimed asks it first in the transaction, and deletes nothing when
	// the claim is gone.
	DelayedClaimExists string
	// DelayedPromote (limit) moves up to limit due delayed effects into the effects table, due
	// for the relay at once, and returns one row: how many it moved, and the ms until the
	// earliest due time of those it left (negative when past, NULL when none), so that an idle
	// relay pass spends one statement on delayed effects (DelayedNextDue is then unused).
	DelayedPromote string
	// DelayedDue, DelayedMove and DelayedDelete are DelayedPromote in three statements of one
	// transaction, for a dialect whose statements change one table: (limit) -> ids of the due
	// ones; (ids) moves them; (ids) deletes them.
	DelayedDue, DelayedMove, DelayedDelete string
	// DelayedDueOfKeys (consumer, id, keys as a JSON array) -> ids of the due delayed effects of
	// other sources with one of the keys, in due order: an effect insert with a key of its own
	// first moves them (DelayedMove, DelayedDelete) ahead of its rows, in its transaction. For a
	// dialect whose insert cannot do it in its own statement; there a writer holds the database,
	// so no relay moves them meanwhile.
	DelayedDueOfKeys string
	DelayedNextDue   string // -> ms until the earliest due time (negative when past), NULL when none
	// DelayedStats (count cap) -> delayed not due, overdue, age of the oldest overdue ms; each
	// count reads at most cap rows.
	DelayedStats string

	CleanupLock   string // -> bool, or no row when another process holds it
	CleanupBegin  string // run first in every cleanup transaction (e.g. to relax durability); may be empty
	CleanupClaims string // (retention ms, limit)
	// CleanupClaimsFrom, when set, is used instead of CleanupClaims: (retention ms, limit, from)
	// -> claims deleted, the newest processed_at among them (NULL when none). from is what the
	// batch before it returned (NULL for the first): a batch looks at claims from there on.
	CleanupClaimsFrom string
	CleanupEffects    string // (retention ms, limit)
	// CleanupEffectsFrom is to CleanupEffects what CleanupClaimsFrom is to CleanupClaims, with
	// the newest dispatched_at deleted.
	CleanupEffectsFrom string
	// CleanupFromBegin runs instead of CleanupBegin in the transaction of a batch of
	// CleanupClaimsFrom or CleanupEffectsFrom (what CleanupBegin sets, and e.g. planner settings
	// of that statement alone, in one round trip); may be empty.
	CleanupFromBegin string
	CleanupAttempts  string // (retention ms, limit)
	// The rows the three statements above would delete without their limit, counted: the dry
	// run of a cleanup (retention ms) -> count. Dialects build each pair from one selection, so
	// that a dry run cannot drift from what a cleanup deletes. Empty: no dry run.
	CleanupClaimsCount, CleanupEffectsCount, CleanupAttemptsCount string
	// CleanupKeys (0, limit) deletes idempotency keys past their expiry, and CleanupKeysCount (0)
	// counts them for the dry run; empty when the dialect keeps none.
	CleanupKeys, CleanupKeysCount string

	// KeyLock (lock name, wait bool) -> bool takes the transaction's lock of an idempotency key:
	// with wait, waits for it (true); without, tells whether it got it. Empty when the dialect
	// keeps no keys.
	KeyLock string
	// KeyClaim (scope, key, fingerprint, retention ms) claims a key that is absent or expired: a
	// row when it did, none when a claim that has not expired is committed.
	KeyClaim string
	KeyRead  string // (scope, key) -> fingerprint, result
	KeySave  string // (scope, key, result)

	SchemaLatest string // -> latest applied version
	// Writable -> in recovery (a standby), read-only; empty when the dialect cannot tell.
	Writable string

	// StatsSample (count cap, retention ms) -> pending, oldest pending ms, parked, oldest parked
	// ms, failing, retained, estimated, cleanup lag ms. Each count reads at most cap rows.
	StatsSample string
	StatsLease  string // (interval ms): takes the right to sample; affects one row if it was free
	StatsWrite  string // (sample): stores a sample taken now
	StatsRead   string // -> sample, its age in ms (no row before the first)
	// StatsLeaseRead (interval ms), when set, is StatsLease and StatsRead in one statement ->
	// whether the lease was taken, the sample stored (NULL before the first), its age in ms.
	StatsLeaseRead string
	// StatsSampleFull (count cap, retention ms, cleanup from: StatsParams.CleanupFrom, NULL when
	// zero), when set, is the sample in one statement ->
	// StatsSample's columns, then DelayedStats's, the dead letters (as DeadLetters.Count), and
	// the outbox tables' dead tuples as a JSON array of {table, dead, vacuumed_ms} (vacuumed_ms
	// NULL: never), read from the server's statistics, never from the tables. Empty: the
	// statements of their own, and no dead tuples.
	StatsSampleFull string
	// XminSample -> the oldest holder of the database's xmin horizon, no row when none: kind, xid
	// as text, age in transactions, ms since its transaction began (NULL when unknown), pid,
	// application name, state, name. It reads the server's activity only, and names no outbox
	// table: the stores on one pool share one sample (xminShare). Empty when the dialect has no
	// such horizon.
	XminSample string

	// AuditInsert (actor, action, target, detail, remote address) writes an entry of the audit table; empty when
	// the dialect has none (then no audited change can be made).
	AuditInsert string
	// RecordServiceConfig (retention ms, effect retention ms, redelivery horizon ms) records the
	// service's configuration for the operators' tools; empty when the dialect does not.
	RecordServiceConfig string
}

// Dialect is what a driver supplies to build a Store.
type Dialect struct {
	Queries Queries
	Migrate MigrateQueries
	// Migrations are the NNN_name.up.sql files.
	Migrations fs.FS
	// IsUndefinedTable tells whether err means a missing table or schema.
	IsUndefinedTable func(error) bool
	// IsReadOnly tells whether err means the server refused a write because it takes none (a
	// standby); nil when the dialect cannot tell.
	IsReadOnly func(error) bool
	// IsReadOnlyAtBegin tells whether an error of BEGIN means the server takes no writes: database/sql
	// drivers begin with BEGIN READ WRITE, which a PostgreSQL standby refuses with
	// feature_not_supported (0A000), a code too broad to mean read-only after any other statement.
	// Nil when the dialect cannot tell.
	IsReadOnlyAtBegin func(error) bool
	// Prepare enables prepared statements reused per connection on the hot path.
	Prepare bool
	// Isolation, when not sql.LevelDefault, is the isolation of the store's own transactions
	// (BeginTx without options), whatever the sessions' default: PostgreSQL's rotation and
	// cleanup count on each statement seeing what committed before it (READ COMMITTED), and a
	// database or role set to REPEATABLE READ would fix their snapshot before the locks they
	// wait for.
	Isolation sql.IsolationLevel
	// Notify wakes listening relays (no arguments); empty when the dialect has no notifications.
	Notify string
	// Listen blocks until ctx is done, calling wake on every notification; nil when the dialect
	// cannot listen.
	Listen func(ctx context.Context, wake func()) error
	// Pooler, when set, tells whether db reaches the database through a pooler in transaction
	// mode (statements are then never prepared), and returns an error wrapping
	// outboxdriver.ErrUnsafeBehindPooler when the client driver is unsafe there. Migrate and
	// SchemaCheck run it, and the first statement starts it: until it has answered, statements
	// run unprepared; once it refused, every statement fails with its error.
	Pooler func(ctx context.Context, db *sql.DB) (transactionPooled bool, err error)
	// Hooks run the steps that the dialect's SQL cannot do in one statement of Queries.
	Hooks Hooks
	// Ops are the statements of the operators' tools; empty when the dialect has none.
	Ops OpsQueries
	// DeadLetters are the statements of the dead letters; empty when the dialect keeps none.
	DeadLetters DeadLetterQueries
}

// Hooks are steps a dialect runs as several statements of its own, where one statement of Queries
// would need what its database lacks: RETURNING of an UPDATE, ON CONFLICT, a CTE that writes, a
// transaction around DDL (MySQL and MariaDB). Each is nil for a dialect whose Queries do the step;
// when set, the store calls it instead of the query, with its arguments unchanged.
type Hooks struct {
	// MessageClaim claims src in tx (Queries.MessageClaim is then unused).
	MessageClaim func(ctx context.Context, tx *sql.Tx, src outboxdriver.Source) (outboxdriver.Claim, error)
	// EffectInsert stores at most EffectInsertMaxRows effects of src in tx and sets their StoreID.
	// The store reports them as possibly written inside a savepoint: a dialect that needs this
	// hook cannot tell.
	EffectInsert func(ctx context.Context, tx *sql.Tx, src outboxdriver.Source, effects []outboxdriver.Effect) error
	// EffectInsertClaimed is EffectInsert for a unit of work that claimed src: it writes nothing
	// when the claim does not exist and returns an error wrapping ErrClaimGone
	// (outboxdriver.ClaimedEffectInserter). Nil: EffectInsert.
	EffectInsertClaimed func(ctx context.Context, tx *sql.Tx, src outboxdriver.Source, effects []outboxdriver.Effect) error
	// AttemptRecord counts a failed attempt of src (reason already storable) and returns the count.
	AttemptRecord func(ctx context.Context, db *sql.DB, src outboxdriver.Source, reason string) (int, error)
	// EffectMarkDispatched marks the effects ids (ascending, at most a batch) dispatched, moving
	// their claims' dispatch time with moveClaims; effect rows are locked before claim rows.
	EffectMarkDispatched func(ctx context.Context, db *sql.DB, ids []int64, moveClaims bool) error
	// EffectDiscard discards the parked effect id in tx as Queries.EffectDiscard does, and
	// returns how many effects it discarded.
	EffectDiscard func(ctx context.Context, tx *sql.Tx, id int64) (int, error)
	// EffectClaimDue claims due effects as Queries.EffectClaimDue does (not windowed).
	EffectClaimDue func(ctx context.Context, db *sql.DB, p outboxdriver.EffectClaimParams) ([]outboxdriver.Effect, error)
	// Migrate applies the missing migrations, safe from several processes at once, where DDL
	// cannot run inside a transaction (Migrate and MigrateQueries are then unused).
	Migrate func(ctx context.Context, db *sql.DB, migrations []Migration) error
	// KeyClaim claims an idempotency key in tx as ClaimKey does with Queries.KeyLock, KeyClaim
	// and KeyRead, which are then unused.
	KeyClaim func(ctx context.Context, tx *sql.Tx, p outboxdriver.KeyClaimParams) (outboxdriver.KeyClaim, error)
	// DelayedInsert stores at most DelayedInsertMaxRows delayed effects of src in tx
	// (Queries.DelayedInsert is then unused).
	DelayedInsert func(ctx context.Context, tx *sql.Tx, src outboxdriver.Source, effects []outboxdriver.Effect) error
	// DelayedPromote moves up to limit due delayed effects into the effects table as
	// Queries.DelayedPromote does, and returns how many it moved.
	DelayedPromote func(ctx context.Context, db *sql.DB, limit int) (int, error)
}

// SQL is an outboxdriver.Store over database/sql.
type SQL struct {
	db         *sql.DB
	d          Dialect
	names      Names
	migrations []Migration

	mu        sync.Mutex
	stmts     map[string]*sql.Stmt
	preparing map[string]bool
	closed    bool

	pool poolerState
	xmin *xminShare // the pool's xmin horizon sample; nil when the dialect has none

	floor claimFloor // where the relay's claims from the front start (Queries.EffectClaimDueFloor)

	cleanupTurn atomic.Uint64 // the runs of Cleanup so far: the step the next begins with
}

// poolerState is what Dialect.Pooler found; the check runs once, again after it could not ask.
type poolerState struct {
	mu      sync.Mutex
	known   bool
	pooled  bool
	err     error // wraps outboxdriver.ErrUnsafeBehindPooler; sticky
	running bool
	started time.Time  // of the last background check: one a second at most while it cannot ask
	check   sync.Mutex // serializes the checks
}

var (
	_ outboxdriver.Store         = (*SQL)(nil)
	_ outboxdriver.EffectRetrier = (*SQL)(nil)
)

// New returns a Store. It reads the embedded migrations and does no database I/O.
func New(db *sql.DB, names Names, d Dialect) (*SQL, error) {
	ms, err := LoadMigrations(d.Migrations, names)
	if err != nil {
		return nil, err
	}
	s := &SQL{db: db, d: d, names: names, migrations: ms, stmts: map[string]*sql.Stmt{}, preparing: map[string]bool{}}
	if d.Queries.XminSample != "" {
		s.xmin = shareXmin(db)
	}
	return s, nil
}

// Names returns the table names.
func (s *SQL) Names() Names { return s.names }

// TablesIdentity implements outboxdriver.TablesIdentifier: the claims table's qualified name.
func (s *SQL) TablesIdentity() string { return s.names.Processed }

// Close closes the prepared statements.
func (s *SQL) Close() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if !s.closed && s.xmin != nil {
		unshareXmin(s.db)
	}
	s.closed = true
	s.pool.mu.Lock()
	s.pool.running = true // no background check starts after Close
	s.pool.mu.Unlock()
	var errs []error
	for q, st := range s.stmts {
		errs = append(errs, st.Close())
		delete(s.stmts, q)
	}
	return errors.Join(errs...)
}

// Migrate implements outboxdriver.Store.
func (s *SQL) Migrate(ctx context.Context) error {
	if err := s.checkPooler(ctx); err != nil {
		return err
	}
	// Up to date: nothing to do, and nothing that needs more than the right to read the
	// migrations table (an application role with DML rights only can start).
	if err := s.SchemaCheck(ctx); err == nil {
		return nil
	}
	if s.d.Hooks.Migrate != nil {
		return s.d.Hooks.Migrate(ctx, s.db, s.migrations)
	}
	return Migrate(ctx, s.db, s.d.Migrate, s.migrations)
}

// SchemaCheck implements outboxdriver.Store.
func (s *SQL) SchemaCheck(ctx context.Context) error {
	if err := s.checkPooler(ctx); err != nil {
		return err
	}
	return SchemaCheck(ctx, s.db, s.d.Queries.SchemaLatest, len(s.migrations), s.d.IsUndefinedTable, s.names)
}

// CheckWritable implements outboxdriver.WritableChecker.
func (s *SQL) CheckWritable(ctx context.Context) error {
	if s.d.Queries.Writable == "" {
		return nil
	}
	var inRecovery, readOnly bool
	if err := s.db.QueryRowContext(ctx, s.d.Queries.Writable).Scan(&inRecovery, &readOnly); err != nil {
		return fmt.Errorf("check that the database takes writes: %w", err)
	}
	switch {
	case inRecovery:
		return fmt.Errorf("%w: the server is a standby in recovery (pg_is_in_recovery()); connect to the primary", outboxdriver.ErrReadOnly)
	case readOnly:
		return fmt.Errorf("%w: transactions are read-only (transaction_read_only = on)", outboxdriver.ErrReadOnly)
	}
	return nil
}

// wrap adds the fix to errors caused by missing tables, and names a server that takes no writes.
// An error it (or BeginTx) wrapped already is returned as it is.
func (s *SQL) wrap(err error) error {
	if err == nil || errors.Is(err, outboxdriver.ErrSchemaMissing) || errors.Is(err, outboxdriver.ErrReadOnly) {
		return err
	}
	if s.d.IsUndefinedTable(err) {
		return fmt.Errorf("%w (schema %q, prefix %q): %w", outboxdriver.ErrSchemaMissing, s.names.Schema, s.names.Prefix, err)
	}
	if s.d.IsReadOnly != nil && s.d.IsReadOnly(err) {
		// After a failover a connection may still reach the old primary, now a standby: the
		// bare refusal does not say that the fix is in the connection string or the DNS.
		return fmt.Errorf("%w (a standby? the connection must reach the primary): %w", outboxdriver.ErrReadOnly, err)
	}
	return err
}

// BeginTx begins a transaction on the Store's database, at the dialect's Isolation when opts is
// nil. A server that refuses to begin one
// because it takes no writes (a standby: see Dialect.IsReadOnlyAtBegin) is named as such, with
// an error that wraps outboxdriver.ErrReadOnly.
func (s *SQL) BeginTx(ctx context.Context, opts *sql.TxOptions) (*sql.Tx, error) {
	if opts == nil && s.d.Isolation != sql.LevelDefault {
		opts = &sql.TxOptions{Isolation: s.d.Isolation}
	}
	tx, err := s.db.BeginTx(ctx, opts)
	if err != nil {
		if s.d.IsReadOnlyAtBegin != nil && s.d.IsReadOnlyAtBegin(err) {
			return nil, fmt.Errorf("%w (a standby? the connection must reach the primary): %w", outboxdriver.ErrReadOnly, err)
		}
		return nil, err
	}
	return tx, nil
}

// prepareTimeout bounds the background preparation of one statement.
const prepareTimeout = 30 * time.Second

// stmt returns query prepared for tx (or the DB when tx is nil), reusing the statement already
// prepared on that connection; it returns nil when the caller must run query directly: without
// Prepare, and inside a transaction while the statement is not prepared yet.
//
// Preparing a statement for the DB takes a connection of its own from the pool. Waiting for one
// while tx holds another deadlocks a pool that every transaction in flight has exhausted (a pool
// of N connections with N messages in flight): inside a transaction, a statement that is not
// prepared yet runs unprepared, and is prepared in the background, where waiting for a
// connection holds none.
func (s *SQL) stmt(ctx context.Context, tx *sql.Tx, query string) (*sql.Stmt, error) {
	// Behind a pooler in transaction mode a statement prepared on one server connection is missing,
	// or is another client's, on the server connection of the next transaction.
	pooled, known, err := s.poolerState()
	if err != nil {
		return nil, err
	}
	if !known {
		s.checkPoolerInBackground()
		return nil, nil
	}
	if pooled || !s.d.Prepare {
		return nil, nil
	}
	s.mu.Lock()
	st, ok := s.stmts[query]
	if !ok && tx != nil {
		if !s.preparing[query] && !s.closed {
			s.preparing[query] = true
			go s.prepareInBackground(query)
		}
		s.mu.Unlock()
		return nil, nil
	}
	s.mu.Unlock()
	if !ok {
		var err error
		if st, err = s.prepare(ctx, query); err != nil {
			return nil, err
		}
	}
	if tx != nil {
		return tx.StmtContext(ctx, st), nil
	}
	return st, nil
}

// poolerCheckTimeout bounds a check of the pooler started by the first statement.
const poolerCheckTimeout = 30 * time.Second

// poolerState returns what the pooler check found, known false while it has not answered.
func (s *SQL) poolerState() (pooled, known bool, err error) {
	if s.d.Pooler == nil {
		return false, true, nil
	}
	s.pool.mu.Lock()
	defer s.pool.mu.Unlock()
	return s.pool.pooled, s.pool.known, s.pool.err
}

// checkPooler runs the dialect's pooler check unless it has answered already, and returns its
// refusal, if any.
func (s *SQL) checkPooler(ctx context.Context) error {
	if s.d.Pooler == nil {
		return nil
	}
	s.pool.check.Lock()
	defer s.pool.check.Unlock()
	if _, known, err := s.poolerState(); known {
		return err
	}
	pooled, err := s.d.Pooler(ctx, s.db)
	if err != nil && !errors.Is(err, outboxdriver.ErrUnsafeBehindPooler) {
		return s.wrap(err) // could not ask: ask again next time
	}
	s.pool.mu.Lock()
	defer s.pool.mu.Unlock()
	s.pool.known, s.pool.pooled, s.pool.err = true, pooled, err
	return err
}

func (s *SQL) checkPoolerInBackground() {
	s.pool.mu.Lock()
	if s.pool.running || time.Since(s.pool.started) < time.Second {
		s.pool.mu.Unlock()
		return
	}
	s.pool.running, s.pool.started = true, time.Now()
	s.pool.mu.Unlock()
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), poolerCheckTimeout)
		defer cancel()
		_ = s.checkPooler(ctx) // a statement that follows reports a refusal
		s.mu.Lock()
		closed := s.closed
		s.mu.Unlock()
		if !closed {
			s.pool.mu.Lock()
			s.pool.running = false
			s.pool.mu.Unlock()
		}
	}()
}

func (s *SQL) prepare(ctx context.Context, query string) (*sql.Stmt, error) {
	st, err := s.db.PrepareContext(ctx, query)
	if err != nil {
		return nil, s.wrap(err)
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if prev, ok := s.stmts[query]; ok || s.closed {
		_ = st.Close()
		if s.closed {
			return nil, errors.New("store closed")
		}
		return prev, nil
	}
	s.stmts[query] = st
	return st, nil
}

func (s *SQL) prepareInBackground(query string) {
	ctx, cancel := context.WithTimeout(context.Background(), prepareTimeout)
	defer cancel()
	_, _ = s.prepare(ctx, query) // on failure the next use in a transaction tries again
	s.mu.Lock()
	delete(s.preparing, query)
	s.mu.Unlock()
}

type execer interface {
	ExecContext(ctx context.Context, query string, args ...any) (sql.Result, error)
	QueryContext(ctx context.Context, query string, args ...any) (*sql.Rows, error)
	QueryRowContext(ctx context.Context, query string, args ...any) *sql.Row
}

func (s *SQL) on(tx *sql.Tx) execer {
	if tx != nil {
		return tx
	}
	return s.db
}

func (s *SQL) exec(ctx context.Context, tx *sql.Tx, query string, args ...any) (sql.Result, error) {
	st, err := s.stmt(ctx, tx, query)
	if err != nil {
		return nil, err
	}
	var res sql.Result
	if st != nil {
		res, err = st.ExecContext(ctx, args...)
	} else {
		res, err = s.on(tx).ExecContext(ctx, query, args...)
	}
	return res, s.wrap(err)
}

func (s *SQL) query(ctx context.Context, tx *sql.Tx, query string, args ...any) (*sql.Rows, error) {
	st, err := s.stmt(ctx, tx, query)
	if err != nil {
		return nil, err
	}
	var rows *sql.Rows
	if st != nil {
		rows, err = st.QueryContext(ctx, args...)
	} else {
		rows, err = s.on(tx).QueryContext(ctx, query, args...)
	}
	return rows, s.wrap(err)
}

func (s *SQL) queryRow(ctx context.Context, tx *sql.Tx, query string, args []any, dest ...any) error {
	st, err := s.stmt(ctx, tx, query)
	if err != nil {
		return err
	}
	var row *sql.Row
	if st != nil {
		row = st.QueryRowContext(ctx, args...)
	} else {
		row = s.on(tx).QueryRowContext(ctx, query, args...)
	}
	return s.wrap(row.Scan(dest...))
}

// IDList encodes store IDs as the one text argument the dialects' queries take, for a driver's
// statements of its own on a list of effect ids.
func IDList(ids []int64) string { return idList(ids) }

// idList encodes store IDs as the one text argument the dialects' queries take.
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

// MessageClaim implements outboxdriver.Store.
func (s *SQL) MessageClaim(ctx context.Context, tx *sql.Tx, src outboxdriver.Source) (outboxdriver.Claim, error) {
	if s.d.Hooks.MessageClaim != nil {
		c, err := s.d.Hooks.MessageClaim(ctx, tx, src)
		return c, s.wrap(err)
	}
	if s.d.Queries.MessageClaimReportsConcurrent {
		return s.MessageClaimWith(ctx, tx, src, s.d.Queries.MessageClaim)
	}
	var one int
	err := s.queryRow(ctx, tx, s.d.Queries.MessageClaim, []any{src.Consumer, src.ID}, &one)
	if errors.Is(err, sql.ErrNoRows) {
		var ms int64
		if err := s.queryRow(ctx, tx, s.d.Queries.MessageAge, []any{src.Consumer, src.ID}, &ms); err != nil && !errors.Is(err, sql.ErrNoRows) {
			return outboxdriver.Claim{}, fmt.Errorf("age of the claim: %w", err)
		}
		return outboxdriver.Claim{Age: time.Duration(ms) * time.Millisecond}, nil
	}
	return outboxdriver.Claim{Claimed: err == nil}, err
}

// MessageClaimWith runs query, a claim statement that reports as Queries.MessageClaim does with
// MessageClaimReportsConcurrent (and, if set, MessageClaimReportsSettled), with the consumer and
// the message ID of src and then extra as its arguments, prepared per connection.
func (s *SQL) MessageClaimWith(ctx context.Context, tx *sql.Tx, src outboxdriver.Source, query string, extra ...any) (outboxdriver.Claim, error) {
	return s.MessageClaimInto(ctx, tx, src, query, extra)
}

// MessageClaimInto is MessageClaimWith whose query returns columns more, scanned into more.
func (s *SQL) MessageClaimInto(ctx context.Context, tx *sql.Tx, src outboxdriver.Source, query string, extra []any, more ...any) (outboxdriver.Claim, error) {
	var claimed bool
	var seen sql.NullInt64
	var settled sql.NullBool
	dest := []any{&claimed, &seen}
	if s.d.Queries.MessageClaimReportsSettled {
		dest = append(dest, &settled)
	}
	dest = append(dest, more...)
	if err := s.queryRow(ctx, tx, query, append([]any{src.Consumer, src.ID}, extra...), dest...); err != nil {
		return outboxdriver.Claim{}, err
	}
	return outboxdriver.Claim{Claimed: claimed, Concurrent: !claimed && !seen.Valid, Age: time.Duration(seen.Int64) * time.Millisecond,
		Settled: !claimed && seen.Valid && settled.Valid && settled.Bool}, nil
}

// MessageIsProcessed implements outboxdriver.Store.
func (s *SQL) MessageIsProcessed(ctx context.Context, src outboxdriver.Source) (bool, error) {
	var one int
	err := s.queryRow(ctx, nil, s.d.Queries.MessageIsProcessed, []any{src.Consumer, src.ID}, &one)
	if errors.Is(err, sql.ErrNoRows) {
		return false, nil
	}
	return err == nil, err
}

// MessagePoison implements outboxdriver.Store.
func (s *SQL) MessagePoison(ctx context.Context, src outboxdriver.Source) error {
	_, err := s.exec(ctx, nil, s.d.Queries.MessagePoison, src.Consumer, src.ID)
	return err
}

// MessageReplay implements outboxdriver.Store.
func (s *SQL) MessageReplay(ctx context.Context, src outboxdriver.Source) (bool, error) {
	return s.MessageReplayAudited(ctx, src, nil)
}

// MessageReplayAudited is MessageReplay that writes audit (when not nil) in the transaction of
// the change: the change is made only if its audit entry is written.
func (s *SQL) MessageReplayAudited(ctx context.Context, src outboxdriver.Source, audit *Audit) (bool, error) {
	tx, err := s.BeginTx(ctx, nil)
	if err != nil {
		return false, fmt.Errorf("begin: %w", err)
	}
	defer func() { _ = tx.Rollback() }()
	// A dead-lettered message replayed is handed back by hand: its dead letter (if still dead)
	// is settled as retried with the claim, or it would still be listed as dead and a retry from
	// it would hand the message over a second time. The dead letter is locked before the claim,
	// as a retry does; when no poisoned claim is found the rollback undoes the mark.
	if q := s.d.DeadLetters.Mark; q != "" {
		actor := ""
		if audit != nil {
			actor = audit.Actor
		}
		if _, err := tx.ExecContext(ctx, q, string(outboxdriver.DeadLetterRetried), outboxdriver.StorableText(actor), src.Consumer, src.ID, noRetryLimit); err != nil {
			return false, fmt.Errorf("mark the dead letter retried: %w", s.wrap(err))
		}
	}
	r, err := tx.ExecContext(ctx, s.d.Queries.MessageReplay, src.Consumer, src.ID)
	if err != nil {
		return false, s.wrap(err)
	}
	n, err := r.RowsAffected()
	if err != nil {
		return false, err
	}
	if n == 0 {
		return false, nil
	}
	if _, err := tx.ExecContext(ctx, s.d.Queries.AttemptDelete, src.Consumer, src.ID); err != nil {
		return false, s.wrap(err)
	}
	if err := s.writeAudit(ctx, tx, audit); err != nil {
		return false, err
	}
	return true, tx.Commit()
}

// AttemptRecord implements outboxdriver.Store.
func (s *SQL) AttemptRecord(ctx context.Context, src outboxdriver.Source, reason string) (int, error) {
	if s.d.Hooks.AttemptRecord != nil {
		n, err := s.d.Hooks.AttemptRecord(ctx, s.db, src, outboxdriver.StorableText(reason))
		return n, s.wrap(err)
	}
	var n int
	err := s.queryRow(ctx, nil, s.d.Queries.AttemptRecord, []any{src.Consumer, src.ID, outboxdriver.StorableText(reason)}, &n)
	return n, err
}

// maxPreparedInsertRows bounds the number of prepared multi-row inserts kept per store.
const maxPreparedInsertRows = 8

// EffectInsertMaxRows bounds the effects one insert statement stores (Queries.EffectInsert(n)
// with n at most this): 7 parameters each, well under PostgreSQL's 65,535 parameters per
// statement (and SQLite's 32,766). More effects are stored by several statements in the same
// transaction.
const EffectInsertMaxRows = 1000

// EffectInsert implements outboxdriver.Store.
func (s *SQL) EffectInsert(ctx context.Context, tx *sql.Tx, src outboxdriver.Source, effects []outboxdriver.Effect) (bool, error) {
	return s.effectInsertAll(ctx, tx, src, effects, false)
}

// EffectInsertClaimed implements outboxdriver.ClaimedEffectInserter: with
// Queries.EffectInsertClaimed (or Hooks.EffectInsertClaimed), an insert that finds no claim of
// src writes nothing and returns an error wrapping outboxdriver.ErrTxDone. A dialect with
// neither inserts as EffectInsert does.
func (s *SQL) EffectInsertClaimed(ctx context.Context, tx *sql.Tx, src outboxdriver.Source, effects []outboxdriver.Effect) (bool, error) {
	return s.effectInsertAll(ctx, tx, src, effects, true)
}

func (s *SQL) effectInsertAll(ctx context.Context, tx *sql.Tx, src outboxdriver.Source, effects []outboxdriver.Effect, claimed bool) (bool, error) {
	inSavepoint := false
	for chunk := range slices.Chunk(effects, EffectInsertMaxRows) {
		nested, err := s.effectInsert(ctx, tx, src, chunk, claimed)
		if err != nil {
			return false, err
		}
		inSavepoint = inSavepoint || nested
	}
	return inSavepoint, nil
}

// GuardBoundary implements outboxdriver.BoundaryGuard with Queries.BoundaryMark; a dialect
// without one sends nothing and reports the unit unguarded.
func (s *SQL) GuardBoundary(ctx context.Context, tx *sql.Tx) (bool, error) {
	if s.d.Queries.BoundaryMark == "" {
		return false, nil
	}
	if _, err := tx.ExecContext(ctx, s.d.Queries.BoundaryMark); err != nil {
		return false, s.wrap(err)
	}
	return true, nil
}

// ErrClaimGone is wrapped by a guarded insert (Queries.EffectInsertClaimed,
// Hooks.EffectInsertClaimed) that found no claim and wrote nothing.
var ErrClaimGone = outboxdriver.ErrClaimGone

// effectInsert stores at most EffectInsertMaxRows effects in one statement; claimed: only while
// the claim of src exists, where the dialect can tell.
func (s *SQL) effectInsert(ctx context.Context, tx *sql.Tx, src outboxdriver.Source, effects []outboxdriver.Effect, claimed bool) (bool, error) {
	if len(effects) == 0 {
		return false, nil
	}
	if claimed && s.d.Hooks.EffectInsertClaimed != nil {
		return true, s.wrap(s.d.Hooks.EffectInsertClaimed(ctx, tx, src, effects))
	}
	if s.d.Hooks.EffectInsert != nil {
		return true, s.wrap(s.d.Hooks.EffectInsert(ctx, tx, src, effects))
	}
	guarded := claimed && s.d.Queries.EffectInsertClaimed != nil
	if err := s.moveDueOfKeys(ctx, tx, src, effects); err != nil {
		return false, fmt.Errorf("move the due delayed effects of the keys: %w", err)
	}
	args := EffectInsertArgs(src, effects)
	bySeq := make(map[int]int, len(effects))
	for i, e := range effects {
		bySeq[e.Seq] = i
	}
	query := s.d.Queries.EffectInsert(len(effects))
	switch {
	case s.d.Queries.EffectInsertKeyed != nil && HasOwnKey(effects):
		query = s.d.Queries.EffectInsertKeyed(len(effects), guarded)
	case guarded:
		query = s.d.Queries.EffectInsertClaimed(len(effects))
	}
	var rows *sql.Rows
	var err error
	if len(effects) > maxPreparedInsertRows {
		rows, err = tx.QueryContext(ctx, query, args...)
		err = s.wrap(err)
	} else {
		rows, err = s.query(ctx, tx, query, args...)
	}
	if err != nil {
		return false, err
	}
	defer rows.Close()
	inSavepoint, n := false, 0
	for rows.Next() {
		var id int64
		var seq int
		var nested bool
		if err := rows.Scan(&id, &seq, &nested); err != nil {
			return false, err
		}
		i, ok := bySeq[seq]
		if !ok {
			return false, fmt.Errorf("insert returned seq %d, which was not inserted", seq)
		}
		effects[i].StoreID = id
		inSavepoint = inSavepoint || nested
		n++
	}
	if err := rows.Err(); err != nil {
		return false, s.wrap(err)
	}
	if n == 0 && guarded {
		return false, ErrClaimGone
	}
	if n != len(effects) {
		return false, fmt.Errorf("insert of %d effects returned %d rows", len(effects), n)
	}
	return inSavepoint, nil
}

// HasOwnKey tells whether one of effects has an ordering key other than its source's default: a
// key other sources may record with, delayed effects included.
func HasOwnKey(effects []outboxdriver.Effect) bool {
	for _, e := range effects {
		if e.OrderingKey != outboxdriver.DefaultOrderingKey(e.Source) {
			return true
		}
	}
	return false
}

// moveDueOfKeys moves the due delayed effects of other sources with the ordering keys of effects
// ahead of them, with Queries.DelayedDueOfKeys. Effects of the source's default key only need
// not look: no other source records with it.
func (s *SQL) moveDueOfKeys(ctx context.Context, tx *sql.Tx, src outboxdriver.Source, effects []outboxdriver.Effect) error {
	if s.d.Queries.DelayedDueOfKeys == "" {
		return nil
	}
	def := outboxdriver.DefaultOrderingKey(src)
	var keys []string
	for _, e := range effects {
		if e.OrderingKey != def && !slices.Contains(keys, e.OrderingKey) {
			keys = append(keys, e.OrderingKey)
		}
	}
	if len(keys) == 0 {
		return nil
	}
	list, err := json.Marshal(keys)
	if err != nil {
		return err
	}
	due, err := s.delayedIDs(ctx, tx, s.d.Queries.DelayedDueOfKeys, src.Consumer, src.ID, string(list))
	if err != nil || len(due) == 0 {
		return err
	}
	in := idList(due)
	if _, err := tx.ExecContext(ctx, s.d.Queries.DelayedMove, in); err != nil {
		return s.wrap(err)
	}
	_, err = tx.ExecContext(ctx, s.d.Queries.DelayedDelete, in)
	return s.wrap(err)
}

// EffectInsertArgs returns the arguments of Queries.EffectInsert(len(effects)) for effects of src.
func EffectInsertArgs(src outboxdriver.Source, effects []outboxdriver.Effect) []any {
	args := make([]any, 0, 2+7*len(effects))
	args = append(args, src.Consumer, src.ID)
	for _, e := range effects {
		payload := e.Payload
		if payload == nil {
			payload = []byte{}
		}
		args = append(args, e.Seq, e.Kind, e.Topic, e.UUID, payload, EncodeMetadata(e.Metadata), e.OrderingKey)
	}
	return args
}

// EffectExisting implements outboxdriver.Store.
func (s *SQL) EffectExisting(ctx context.Context, tx *sql.Tx, storeIDs []int64) ([]int64, error) {
	if len(storeIDs) == 0 {
		return nil, nil
	}
	rows, err := tx.QueryContext(ctx, s.d.Queries.EffectExisting, idList(storeIDs))
	if err != nil {
		return nil, s.wrap(err)
	}
	defer rows.Close()
	var out []int64
	for rows.Next() {
		var id int64
		if err := rows.Scan(&id); err != nil {
			return nil, err
		}
		out = append(out, id)
	}
	return out, rows.Err()
}

// ScanEffect scans one row of a dialect's effect columns (and extra after them) into e, for a
// driver that runs the dialect's effect queries on a connection type of its own.
func ScanEffect(sc interface{ Scan(...any) error }, e *outboxdriver.Effect, extra ...any) error {
	var md []byte
	var pendingMS, failedMS int64
	dest := append([]any{&e.StoreID, &e.Source.Consumer, &e.Source.ID, &e.Seq, &e.Kind, &e.Topic, &e.UUID,
		&e.Payload, &md, &e.OrderingKey, &e.Attempts, &pendingMS, &e.Failures, &failedMS, &e.Parked}, extra...)
	if err := sc.Scan(dest...); err != nil {
		return err
	}
	e.PendingFor = time.Duration(pendingMS) * time.Millisecond
	e.StoredAt = time.Now().Add(-e.PendingFor)
	e.SinceFailure = time.Duration(failedMS) * time.Millisecond
	var err error
	if e.Metadata, err = DecodeMetadata(md); err != nil {
		return fmt.Errorf("effect %d: %w", e.StoreID, err)
	}
	return nil
}

func scanEffects(rows *sql.Rows) ([]outboxdriver.Effect, error) {
	defer rows.Close()
	var out []outboxdriver.Effect
	for rows.Next() {
		var e outboxdriver.Effect
		if err := ScanEffect(rows, &e); err != nil {
			return nil, err
		}
		out = append(out, e)
	}
	return out, rows.Err()
}

// EffectListPending implements outboxdriver.Store.
func (s *SQL) EffectListPending(ctx context.Context, src outboxdriver.Source) ([]outboxdriver.Effect, error) {
	rows, err := s.db.QueryContext(ctx, s.d.Queries.EffectListPending, src.Consumer, src.ID)
	if err != nil {
		return nil, s.wrap(err)
	}
	return scanEffects(rows)
}

// maxMarkBatch bounds the effects marked in one statement.
const maxMarkBatch = 1024

// EffectMarkDispatched implements outboxdriver.Store.
//
// The marks are not prepared statements: a prepared statement's cached generic plan, made while
// the tables were small, would keep scanning them whole as they grow; planned on every use, the
// statement looks its rows up by index once there are enough of them.
func (s *SQL) EffectMarkDispatched(ctx context.Context, marks ...outboxdriver.DispatchMark) error {
	var move, keep []int64
	for _, m := range marks {
		if m.MoveClaim {
			move = append(move, m.StoreIDs...)
		} else {
			keep = append(keep, m.StoreIDs...)
		}
	}
	for _, group := range []struct {
		ids        []int64
		moveClaims bool
	}{{move, true}, {keep, false}} {
		// Ascending IDs: every statement that locks several effect rows locks them in one order.
		slices.Sort(group.ids)
		for ids := slices.Compact(group.ids); len(ids) > 0; {
			n := min(len(ids), maxMarkBatch)
			if s.d.Hooks.EffectMarkDispatched != nil {
				if err := s.d.Hooks.EffectMarkDispatched(ctx, s.db, ids[:n], group.moveClaims); err != nil {
					return s.wrap(err)
				}
				ids = ids[n:]
				continue
			}
			if _, err := s.db.ExecContext(ctx, s.d.Queries.EffectMarkDispatched(group.moveClaims), idList(ids[:n])); err != nil {
				return s.wrap(err)
			}
			ids = ids[n:]
		}
	}
	return nil
}

// EffectRecordFailures implements outboxdriver.Store.
func (s *SQL) EffectRecordFailures(ctx context.Context, failures ...outboxdriver.EffectFailure) error {
	slices.SortFunc(failures, func(a, b outboxdriver.EffectFailure) int { return cmp.Compare(a.StoreID, b.StoreID) })
	released := map[time.Duration][]int64{}
	var delays []time.Duration
	for _, f := range failures {
		if f.Reason == "" {
			if _, ok := released[f.RetryAfter]; !ok {
				delays = append(delays, f.RetryAfter)
			}
			released[f.RetryAfter] = append(released[f.RetryAfter], f.StoreID)
			continue
		}
		if _, err := s.db.ExecContext(ctx, s.d.Queries.EffectRecordFailure,
			f.StoreID, outboxdriver.StorableText(f.Reason), f.Counted, f.Park, f.RetryAfter.Milliseconds()); err != nil {
			return fmt.Errorf("record failure of effect %d: %w", f.StoreID, s.wrap(err))
		}
	}
	for _, d := range delays {
		if _, err := s.db.ExecContext(ctx, s.d.Queries.EffectRelease, idList(released[d]), d.Milliseconds()); err != nil {
			return fmt.Errorf("release %d effects: %w", len(released[d]), s.wrap(err))
		}
	}
	return nil
}

// claimWindow is how many store IDs a windowed claim looks at, per effect it may claim.
const claimWindow = 4

// EffectClaimDue implements outboxdriver.Store.
func (s *SQL) EffectClaimDue(ctx context.Context, p outboxdriver.EffectClaimParams) (outboxdriver.EffectClaim, error) {
	claim, _, err := s.effectClaimDue(ctx, p, s.d.Queries.EffectClaimDue)
	return claim, err
}

// EffectClaimDueWith claims as EffectClaimDue does with query, the statement of
// Queries.EffectClaimDue (windowed) with more columns at the end of every row, which extra scans:
// what a driver reads besides in the claim's round trip, so that an idle relay pass stays one
// statement (the postgres driver's look at its partitions and at the claims table's writes).
// seen tells whether the claim returned a row, and so whether extra was scanned.
func (s *SQL) EffectClaimDueWith(ctx context.Context, p outboxdriver.EffectClaimParams, query string, extra ...any) (outboxdriver.EffectClaim, bool, error) {
	if !s.d.Queries.EffectClaimDueWindowed || s.d.Hooks.EffectClaimDue != nil {
		return outboxdriver.EffectClaim{}, false, errors.New("claim due effects: the dialect's claim takes no columns more")
	}
	return s.effectClaimDue(ctx, p, query, extra...)
}

func (s *SQL) effectClaimDue(ctx context.Context, p outboxdriver.EffectClaimParams, query string, trailing ...any) (outboxdriver.EffectClaim, bool, error) {
	claim, seen, err := s.effectClaimDueOn(ctx, s.db, p, query, trailing...)
	if serializationFailure(err) && s.d.Isolation != sql.LevelDefault && s.d.Hooks.EffectClaimDue == nil {
		// The sessions default to an isolation above the dialect's (REPEATABLE READ), where two
		// relays claiming at once meet as a serialization failure (an effect leased by the other
		// since the statement's snapshot): claimed again at the dialect's, where it is skipped.
		err = s.inTx(ctx, func(tx *sql.Tx) error {
			var err error
			claim, seen, err = s.effectClaimDueOn(ctx, tx, p, query, trailing...)
			return err
		})
	}
	return claim, seen, err
}

// querier runs a query on a pool or in a transaction.
type querier interface {
	QueryContext(ctx context.Context, query string, args ...any) (*sql.Rows, error)
}

func (s *SQL) effectClaimDueOn(ctx context.Context, db querier, p outboxdriver.EffectClaimParams, query string, trailing ...any) (outboxdriver.EffectClaim, bool, error) {
	maxBytes := int64(p.MaxBytes)
	if maxBytes <= 0 {
		maxBytes = math.MaxInt64
	}
	if s.d.Hooks.EffectClaimDue != nil {
		effects, err := s.d.Hooks.EffectClaimDue(ctx, s.db, p)
		if err != nil {
			return outboxdriver.EffectClaim{}, false, fmt.Errorf("claim due effects: %w", s.wrap(err))
		}
		slices.SortFunc(effects, func(a, b outboxdriver.Effect) int { return cmp.Compare(a.StoreID, b.StoreID) })
		return outboxdriver.EffectClaim{Effects: effects}, len(effects) > 0, nil
	}
	window := int64(max(p.Limit, 1)) * claimWindow
	args := []any{p.Grace.Milliseconds(), p.Limit, maxBytes, p.Lease.Milliseconds(), p.After, window}
	if s.d.Queries.EffectClaimDueWindowed {
		skip, err := json.Marshal(append([]string{}, p.Skip...)) // [], not null, for none
		if err != nil {
			return outboxdriver.EffectClaim{}, false, fmt.Errorf("claim due effects: %w", err)
		}
		args = append(args, string(skip))
	}
	var look floorLook
	floored := s.d.Queries.EffectClaimDueWindowed && s.d.Queries.EffectClaimDueFloor
	if floored {
		look = s.floor.start(time.Now(), p.After == 0)
		args = append(args, look.floor)
	}
	rows, err := db.QueryContext(ctx, query, args...)
	if err != nil {
		return outboxdriver.EffectClaim{}, false, fmt.Errorf("claim due effects: %w", s.wrap(err))
	}
	var claim outboxdriver.EffectClaim
	if !s.d.Queries.EffectClaimDueWindowed {
		claim.Effects, err = scanEffects(rows)
	} else {
		defer rows.Close()
		for rows.Next() {
			var next int64
			var more bool
			var e outboxdriver.Effect
			extra := []any{&next, &more}
			var dueMS, pendingMS sql.NullInt64
			if s.d.Queries.EffectClaimDueDelayed {
				extra = append(extra, &dueMS)
			}
			if s.d.Queries.EffectClaimDuePending {
				extra = append(extra, &pendingMS)
			}
			if floored {
				extra = append(extra, &look.found, &look.xmin, &look.xmax, &look.seqLast)
			}
			extra = append(extra, trailing...)
			if err = ScanEffect(rows, &e, extra...); err != nil {
				break
			}
			look.seen, look.lo = true, next-window
			if more {
				claim.Next = next
			}
			if s.d.Queries.EffectClaimDueDelayed {
				claim.Delayed = &outboxdriver.DelayedDue{Waiting: dueMS.Valid, In: time.Duration(dueMS.Int64) * time.Millisecond}
			}
			if e.StoreID != 0 {
				claim.Effects = append(claim.Effects, e)
			} else if s.d.Queries.EffectClaimDuePending {
				claim.Pending = &outboxdriver.PendingDue{Waiting: pendingMS.Valid, In: time.Duration(pendingMS.Int64) * time.Millisecond}
			}
		}
		if err == nil {
			err = rows.Err()
		}
	}
	if err != nil {
		return outboxdriver.EffectClaim{}, false, fmt.Errorf("claim due effects: %w", s.wrap(err))
	}
	if floored && p.After == 0 && look.seen {
		s.floor.end(look)
	}
	slices.SortFunc(claim.Effects, func(a, b outboxdriver.Effect) int { return cmp.Compare(a.StoreID, b.StoreID) })
	return claim, look.seen, nil
}

// Cleanup implements outboxdriver.Store.
func (s *SQL) Cleanup(ctx context.Context, p outboxdriver.CleanupParams) (outboxdriver.CleanupResult, error) {
	var res outboxdriver.CleanupResult
	if p.BatchSize <= 0 {
		// A batch that deletes fewer than BatchSize rows ends a step: never, with 0 or less
		// (and on SQLite a LIMIT below 0 is no limit).
		return res, fmt.Errorf("cleanup: BatchSize %d, want at least 1", p.BatchSize)
	}
	q := s.d.Queries
	step := func(query, from string) cleanupStep {
		if from != "" {
			return cleanupStep{query: from, from: true}
		}
		return cleanupStep{query: query}
	}
	var resumeClaims, resumeEffects *time.Time
	if p.Resume != nil {
		resumeClaims, resumeEffects = &p.Resume.Claims, &p.Resume.Effects
	}
	steps := []struct {
		cleanupStep
		retention time.Duration
		count     *int64
		resume    *time.Time // where the step of the run before got to, and this one gets to
	}{
		{step(q.CleanupClaims, q.CleanupClaimsFrom), p.Retention, &res.Claims, resumeClaims},
		{step(q.CleanupEffects, q.CleanupEffectsFrom), p.EffectRetention, &res.Effects, resumeEffects},
		{step(q.CleanupAttempts, ""), p.Retention, &res.Attempts, nil},
		// A key carries its own expiry, written at its claim: nothing to pass.
		{step(q.CleanupKeys, ""), 0, &res.Keys, nil},
		// Kept as long as the claims: what an operator did with a message stays readable while
		// its ID is remembered.
		{step(s.d.DeadLetters.Cleanup, ""), p.Retention, &res.DeadLetters, nil},
	}
	// Each run begins one step further: a run cut short by its deadline in a long step (a
	// backlog of claims) left the steps after it undone for as long as the backlog lasted, the
	// dispatched archive, the attempt counters and the expired keys kept past their retention.
	turn := int(s.cleanupTurn.Add(1)-1) % len(steps)
	for _, st := range slices.Concat(steps[turn:], steps[:turn]) {
		if st.query == "" {
			continue
		}
		var from sql.NullTime // where the step's batch before got to
		if st.from && st.resume != nil && !st.resume.IsZero() {
			from = sql.NullTime{Time: *st.resume, Valid: true}
		}
		for {
			began := time.Now()
			n, locked, err := s.cleanupBatch(ctx, st.cleanupStep, st.retention, p.BatchSize, &from)
			took := time.Since(began)
			if err != nil {
				return res, err
			}
			if !locked {
				res.Skipped = true
				return res, nil
			}
			*st.count += n
			res.Batches++
			if p.Progress != nil {
				p.Progress(res)
			}
			if st.from && st.resume != nil && from.Valid {
				*st.resume = from.Time
			}
			if n < int64(p.BatchSize) {
				break
			}
			if pause := max(p.PauseBetweenBatches, time.Duration(p.PauseFactor*float64(took))); pause > 0 {
				select {
				case <-ctx.Done():
					return res, ctx.Err()
				case <-time.After(pause):
				}
			}
		}
	}
	return res, nil
}

// CleanupCount counts what Cleanup would delete with p's retentions, deleting nothing (a dry
// run): the dialect's cleanup conditions without their batch limit.
func (s *SQL) CleanupCount(ctx context.Context, p outboxdriver.CleanupParams) (outboxdriver.CleanupResult, error) {
	var res outboxdriver.CleanupResult
	q := s.d.Queries
	if q.CleanupClaimsCount == "" || q.CleanupEffectsCount == "" || q.CleanupAttemptsCount == "" {
		return res, errors.New("cleanup dry run: not supported by this dialect")
	}
	for _, st := range []struct {
		query     string
		retention time.Duration
		count     *int64
	}{
		{q.CleanupClaimsCount, p.Retention, &res.Claims},
		{q.CleanupEffectsCount, p.EffectRetention, &res.Effects},
		{q.CleanupAttemptsCount, p.Retention, &res.Attempts},
		{q.CleanupKeysCount, 0, &res.Keys},
		{s.d.DeadLetters.CleanupCount, p.Retention, &res.DeadLetters},
	} {
		if st.query == "" {
			continue // a dialect that keeps no idempotency keys
		}
		if err := s.db.QueryRowContext(ctx, st.query, st.retention.Milliseconds()).Scan(st.count); err != nil {
			return res, fmt.Errorf("cleanup dry run: %w", s.wrap(err))
		}
	}
	return res, nil
}

// cleanupStep is how Cleanup deletes the expired rows of one table.
type cleanupStep struct {
	query string
	// from: query takes where the batch before got to and returns where it gets to; its batches
	// begin with CleanupFromBegin instead of CleanupBegin.
	from bool
}

// cleanupBatch deletes one batch in its own short transaction, so that it never holds locks long.
// For a step with from, from is where the batch before got to, and is set to where this one got.
func (s *SQL) cleanupBatch(ctx context.Context, st cleanupStep, retention time.Duration, limit int, from *sql.NullTime) (int64, bool, error) {
	// The transaction's context ends with ctx until COMMIT is sent, not after: a driver that
	// watches the transaction's context during COMMIT (pgx's stdlib) returned the caller's
	// cancellation for a batch the server had committed, and the batch went uncounted. The
	// commit is bounded by the caller's deadline and cleanupCommitGrace after it.
	txCtx, cancelTx := context.WithCancel(context.WithoutCancel(ctx))
	if d, ok := ctx.Deadline(); ok {
		txCtx, cancelTx = context.WithDeadline(context.WithoutCancel(ctx), d.Add(cleanupCommitGrace))
	}
	defer cancelTx()
	watching := context.AfterFunc(ctx, cancelTx)
	defer watching()
	caller := ctx
	// failed names the step; when the caller's context ended during it, the error is the
	// caller's own (a deadline stays context.DeadlineExceeded, not the Canceled of txCtx that
	// its end cancelled) and says what was not answered in time.
	failed := func(step string, err error) error {
		if cerr := caller.Err(); cerr != nil {
			return fmt.Errorf("%s: no answer before the context ended: %w (%v)", step, cerr, err)
		}
		return fmt.Errorf("%s: %w", step, s.wrap(err))
	}
	tx, err := s.BeginTx(txCtx, nil)
	if err != nil {
		return 0, false, failed("begin", err)
	}
	defer func() { _ = tx.Rollback() }()
	ctx = txCtx
	if s.d.Queries.CleanupLock != "" {
		// No row is the lock taken, as a row of false is (MySQL's SKIP LOCKED leaves the row out).
		var ok bool
		if err := tx.QueryRowContext(ctx, s.d.Queries.CleanupLock).Scan(&ok); err != nil && !errors.Is(err, sql.ErrNoRows) {
			return 0, false, failed("cleanup lock", err)
		}
		if !ok {
			return 0, false, nil
		}
	}
	begin := s.d.Queries.CleanupBegin
	if st.from {
		begin = s.d.Queries.CleanupFromBegin
	}
	if begin != "" {
		if _, err := tx.ExecContext(ctx, begin); err != nil {
			return 0, true, failed("cleanup", err)
		}
	}
	var n int64
	if st.from {
		var next sql.NullTime
		if err := tx.QueryRowContext(ctx, st.query, retention.Milliseconds(), limit, *from).Scan(&n, &next); err != nil {
			return 0, true, failed("cleanup: a batch", err)
		}
		if next.Valid {
			*from = next
		}
	} else {
		r, err := tx.ExecContext(ctx, st.query, retention.Milliseconds(), limit)
		if err != nil {
			return 0, true, failed("cleanup: a batch", err)
		}
		if n, err = r.RowsAffected(); err != nil {
			return 0, true, fmt.Errorf("cleanup: %w", err)
		}
	}
	if !watching() {
		return 0, true, fmt.Errorf("cleanup: %w", caller.Err())
	}
	// Once sent, the COMMIT outlives the caller's end by cleanupCommitGrace at most, deadline or
	// not: a caller without one (an operator's Ctrl-C) waited for a stalled COMMIT for as long as
	// the server took, or the kernel's TCP timeout.
	grace := context.AfterFunc(caller, func() { time.AfterFunc(cleanupCommitGrace, cancelTx) })
	defer grace()
	return n, true, tx.Commit()
}

// cleanupCommitGrace is how long after the caller's deadline, or its end, a cleanup batch's
// COMMIT, once sent, may still take (see cleanupBatch); its statements before COMMIT end with the caller's
// context.
const cleanupCommitGrace = 10 * time.Second

// EffectKeyBlocked implements outboxdriver.Store.
func (s *SQL) EffectKeyBlocked(ctx context.Context, src outboxdriver.Source, key string) (bool, error) {
	var blocked bool
	err := s.queryRow(ctx, nil, s.d.Queries.EffectKeyBlocked, []any{src.Consumer, src.ID, key}, &blocked)
	return blocked, err
}

// EffectRetryNow implements outboxdriver.EffectRetrier. The effects are found first and made due
// by their primary key after, the condition checked again on each row as it is written: a relay
// that leased one meanwhile has set another retry time, and the row is left alone. The look-up
// scans the pending effects (no index serves a topic): it runs once per destination that
// recovers, not per effect.
func (s *SQL) EffectRetryNow(ctx context.Context, kind, topic string, limit int) (int, error) {
	if s.d.Queries.EffectBackedOff == "" {
		return 0, nil
	}
	if kind != outboxdriver.KindPublish {
		topic = ""
	}
	rows, err := s.db.QueryContext(ctx, s.d.Queries.EffectBackedOff, kind, topic, limit)
	if err != nil {
		return 0, fmt.Errorf("find effects backing off: %w", s.wrap(err))
	}
	var ids []int64
	for rows.Next() {
		var id int64
		if err := rows.Scan(&id); err != nil {
			rows.Close()
			return 0, fmt.Errorf("find effects backing off: %w", err)
		}
		ids = append(ids, id)
	}
	if err := errors.Join(rows.Err(), rows.Close()); err != nil {
		return 0, fmt.Errorf("find effects backing off: %w", s.wrap(err))
	}
	if len(ids) == 0 {
		return 0, nil
	}
	slices.Sort(ids) // the one lock order: effect rows in ascending id order
	res, err := s.db.ExecContext(ctx, s.d.Queries.EffectRetryNow, idList(ids))
	if err != nil {
		return 0, fmt.Errorf("retry %d effects now: %w", len(ids), s.wrap(err))
	}
	n, err := res.RowsAffected()
	if err != nil {
		return 0, fmt.Errorf("retry %d effects now: %w", len(ids), err)
	}
	return int(n), nil
}

// EffectHandToRelay implements outboxdriver.Store.
func (s *SQL) EffectHandToRelay(ctx context.Context, src outboxdriver.Source) error {
	_, err := s.db.ExecContext(ctx, s.d.Queries.EffectHandToRelay, src.Consumer, src.ID)
	return s.wrap(err)
}

// EffectNotify implements outboxdriver.Store.
func (s *SQL) EffectNotify(ctx context.Context) error {
	if s.d.Notify == "" {
		return nil
	}
	_, err := s.db.ExecContext(ctx, s.d.Notify)
	return s.wrap(err)
}

// EffectListen implements outboxdriver.Store.
func (s *SQL) EffectListen(ctx context.Context, wake func()) error {
	if s.d.Listen == nil {
		return outboxdriver.ErrListenUnsupported
	}
	return s.d.Listen(ctx, wake)
}

// EffectListParked implements outboxdriver.Store.
func (s *SQL) EffectListParked(ctx context.Context, limit int) ([]outboxdriver.ParkedEffect, error) {
	rows, err := s.db.QueryContext(ctx, s.d.Queries.EffectListParked, limit)
	if err != nil {
		return nil, s.wrap(err)
	}
	defer rows.Close()
	var out []outboxdriver.ParkedEffect
	for rows.Next() {
		var p outboxdriver.ParkedEffect
		var lastErr sql.NullString
		if err := ScanEffect(rows, &p.Effect, &lastErr, &p.ParkedAt, &p.CreatedAt); err != nil {
			return nil, err
		}
		p.LastError = lastErr.String
		out = append(out, p)
	}
	return out, rows.Err()
}

// EffectUnpark implements outboxdriver.Store.
func (s *SQL) EffectUnpark(ctx context.Context, ids []int64) (int, error) {
	return s.EffectUnparkAudited(ctx, ids, nil)
}

// EffectDiscard implements outboxdriver.Store.
func (s *SQL) EffectDiscard(ctx context.Context, ids []int64) (int, error) {
	return s.EffectDiscardAudited(ctx, ids, nil)
}

// Audit is an entry of the audit table: who changed what.
type Audit struct {
	Actor, Action, Target, Detail string
	// Remote is the address of the client the change came from (the console's HTTP client); the
	// database records its own role and the connection's address itself.
	Remote string
}

// EffectUnparkAudited is EffectUnpark that writes the entry audit returns (when audit is not
// nil; it is told how many effects changed) in the transaction of the change, so that no change
// is made without its entry.
func (s *SQL) EffectUnparkAudited(ctx context.Context, ids []int64, audit func(changed int) Audit) (int, error) {
	n, err := s.eachID(ctx, ids, audit, func(tx *sql.Tx, id int64) (int, error) {
		r, err := tx.ExecContext(ctx, s.d.Queries.EffectUnpark, id)
		if err != nil {
			return 0, s.wrap(err)
		}
		n, err := r.RowsAffected()
		return int(n), err
	})
	// Pending again, and perhaps below where the relay's claims now look: once the change has
	// committed (a claim whose snapshot predates it must not move the floor past them), even
	// after an error, which may hide a commit.
	if len(ids) > 0 {
		s.floor.lower(slices.Min(ids))
	}
	return n, err
}

// EffectDiscardAudited is EffectDiscard with its audit entry written as EffectUnparkAudited's.
func (s *SQL) EffectDiscardAudited(ctx context.Context, ids []int64, audit func(changed int) Audit) (int, error) {
	return s.eachID(ctx, ids, audit, func(tx *sql.Tx, id int64) (int, error) {
		if s.d.Hooks.EffectDiscard != nil {
			n, err := s.d.Hooks.EffectDiscard(ctx, tx, id)
			return n, s.wrap(err)
		}
		rows, err := tx.QueryContext(ctx, s.d.Queries.EffectDiscard, id)
		if err != nil {
			return 0, s.wrap(err)
		}
		n := 0
		for rows.Next() {
			n++
		}
		return n, errors.Join(s.wrap(rows.Err()), rows.Close())
	})
}

// eachID runs one for every id, in ascending order, in one transaction, then writes the audit
// entry, and returns the rows it changed.
func (s *SQL) eachID(ctx context.Context, ids []int64, audit func(changed int) Audit, one func(*sql.Tx, int64) (int, error)) (int, error) {
	ids = slices.Clone(ids)
	slices.Sort(ids)
	tx, err := s.BeginTx(ctx, nil)
	if err != nil {
		return 0, fmt.Errorf("begin: %w", err)
	}
	defer func() { _ = tx.Rollback() }()
	total := 0
	for _, id := range slices.Compact(ids) {
		n, err := one(tx, id)
		if err != nil {
			return 0, err
		}
		total += n
	}
	if audit != nil {
		a := audit(total)
		if err := s.writeAudit(ctx, tx, &a); err != nil {
			return 0, err
		}
	}
	return total, tx.Commit()
}

// writeAudit inserts a (when not nil) in tx.
func (s *SQL) writeAudit(ctx context.Context, tx *sql.Tx, a *Audit) error {
	if a == nil {
		return nil
	}
	if s.d.Queries.AuditInsert == "" {
		return errors.New("this store has no audit table (nothing was changed)")
	}
	if _, err := tx.ExecContext(ctx, s.d.Queries.AuditInsert, a.Actor, a.Action, a.Target, a.Detail, a.Remote); err != nil {
		return fmt.Errorf("write the audit entry (nothing was changed): %w", s.wrap(err))
	}
	return nil
}

// RecordServiceConfig implements outboxdriver.ConfigRecorder: it stores c in the stats row.
func (s *SQL) RecordServiceConfig(ctx context.Context, c outboxdriver.ServiceConfig) error {
	if s.d.Queries.RecordServiceConfig == "" {
		return nil
	}
	_, err := s.db.ExecContext(ctx, s.d.Queries.RecordServiceConfig,
		c.Retention.Milliseconds(), c.EffectRetention.Milliseconds(), c.RedeliveryHorizon.Milliseconds())
	if err != nil {
		return fmt.Errorf("record the service's retention: %w", s.wrap(err))
	}
	return nil
}

// statsSample is a Stats as it is stored between processes.
type statsSample struct {
	Pending, Parked, Failing, Retained            int64
	OldestPendingMS, OldestParkedMS, CleanupLagMS int64
	Estimated                                     bool
	Delayed                                       int64
	DeadLetters                                   int64
	Xmin                                          *xminSample                `json:",omitempty"`
	Tables                                        []outboxdriver.TableVacuum `json:",omitempty"`
}

// xminSample is an outboxdriver.XminHold as it is stored: its ages as of the sample.
type xminSample struct {
	outboxdriver.XminHold
	// StartedMS is since the holder's transaction began (-1: unknown); SeenMS since the samples
	// first found this xmin held.
	StartedMS, SeenMS int64
}

// Stats implements outboxdriver.Store.
func (s *SQL) Stats(ctx context.Context, p outboxdriver.StatsParams) (outboxdriver.Stats, error) {
	q := s.d.Queries
	var prev *storedSample // the sample stored before this one, when the lease read it
	if p.Interval > 0 {
		leased, stored, err := s.statsLease(ctx, p.Interval)
		if err != nil {
			return outboxdriver.Stats{}, err
		}
		if !leased {
			// Another process samples: what it stored last.
			if stored == nil {
				return outboxdriver.Stats{}, nil // none taken yet
			}
			return stored.smp.stats(time.Now().Add(-stored.age)), nil
		}
		prev = stored
	}
	var smp statsSample
	if err := s.sampleCounts(ctx, p, &smp); err != nil {
		return outboxdriver.Stats{}, err
	}
	if q.XminSample != "" {
		if err := s.sampleXmin(ctx, p.Interval, &smp, prev); err != nil {
			return outboxdriver.Stats{}, err
		}
	}
	if p.Interval > 0 {
		text, err := json.Marshal(smp)
		if err != nil {
			return outboxdriver.Stats{}, err
		}
		if _, err := s.db.ExecContext(ctx, q.StatsWrite, string(text)); err != nil {
			return outboxdriver.Stats{}, fmt.Errorf("store stats: %w", s.wrap(err))
		}
	}
	return smp.stats(time.Now()), nil
}

// errStoredSample: the sample stored cannot be parsed.
var errStoredSample = errors.New("the stored sample cannot be parsed")

// storedSample is a sample as read from the stats row, with its age.
type storedSample struct {
	smp statsSample
	age time.Duration
}

// statsLease takes the right to sample for interval, and returns the sample stored when it read
// it: always when it was not taken (nil before the first sample), and when the dialect reads it
// in the same statement (StatsLeaseRead) otherwise.
func (s *SQL) statsLease(ctx context.Context, interval time.Duration) (leased bool, stored *storedSample, err error) {
	q := s.d.Queries
	if q.StatsLeaseRead != "" {
		var text sql.NullString
		var ageMS sql.NullInt64
		err := s.db.QueryRowContext(ctx, q.StatsLeaseRead, interval.Milliseconds()).Scan(&leased, &text, &ageMS)
		if errors.Is(err, sql.ErrNoRows) {
			return false, nil, nil // no stats row: nothing to lease, as StatsLease finds
		}
		if err != nil {
			return false, nil, fmt.Errorf("stats lease: %w", s.wrap(err))
		}
		stored, err = parseStored(text, ageMS)
		if err != nil && !leased {
			return false, nil, err
		}
		return leased, stored, nil // a sample it could not parse is only carried on from
	}
	r, err := s.db.ExecContext(ctx, q.StatsLease, interval.Milliseconds())
	if err != nil {
		return false, nil, fmt.Errorf("stats lease: %w", s.wrap(err))
	}
	if n, err := r.RowsAffected(); err != nil {
		return false, nil, fmt.Errorf("stats lease: %w", err)
	} else if n > 0 {
		return true, nil, nil
	}
	stored, err = s.readStored(ctx)
	return false, stored, err
}

// readStored reads the sample stored (nil before the first).
func (s *SQL) readStored(ctx context.Context) (*storedSample, error) {
	var text sql.NullString
	var ageMS sql.NullInt64
	if err := s.db.QueryRowContext(ctx, s.d.Queries.StatsRead).Scan(&text, &ageMS); err != nil && !errors.Is(err, sql.ErrNoRows) {
		return nil, fmt.Errorf("read stats: %w", s.wrap(err))
	}
	return parseStored(text, ageMS)
}

func parseStored(text sql.NullString, ageMS sql.NullInt64) (*storedSample, error) {
	if !text.Valid || text.String == "" {
		return nil, nil
	}
	var smp statsSample
	if err := json.Unmarshal([]byte(text.String), &smp); err != nil {
		return nil, fmt.Errorf("read stats: %w: %w", errStoredSample, err)
	}
	return &storedSample{smp: smp, age: time.Duration(max(ageMS.Int64, 0)) * time.Millisecond}, nil
}

// sampleCounts takes the counts of a sample into smp: in one statement where the dialect has
// one (StatsSampleFull), in one for each part otherwise.
func (s *SQL) sampleCounts(ctx context.Context, p outboxdriver.StatsParams, smp *statsSample) error {
	q := s.d.Queries
	var overdue, overdueMS int64
	if q.StatsSampleFull != "" {
		var tables sql.NullString
		from := sql.NullTime{Time: p.CleanupFrom, Valid: !p.CleanupFrom.IsZero()}
		err := s.db.QueryRowContext(ctx, q.StatsSampleFull, outboxdriver.StatsCountCap, p.Retention.Milliseconds(), from).Scan(
			&smp.Pending, &smp.OldestPendingMS, &smp.Parked, &smp.OldestParkedMS, &smp.Failing,
			&smp.Retained, &smp.Estimated, &smp.CleanupLagMS, &smp.Delayed, &overdue, &overdueMS, &smp.DeadLetters, &tables)
		if err != nil {
			return fmt.Errorf("sample stats: %w", s.wrap(err))
		}
		var tv []struct {
			Table      string
			Dead       int64
			VacuumedMS *int64 `json:"vacuumed_ms"`
		}
		if tables.Valid {
			if err := json.Unmarshal([]byte(tables.String), &tv); err != nil {
				return fmt.Errorf("sample dead tuples: %w", err)
			}
		}
		smp.Tables = make([]outboxdriver.TableVacuum, 0, len(tv))
		for _, t := range tv {
			v := outboxdriver.TableVacuum{Table: t.Table, DeadTuples: t.Dead}
			if t.VacuumedMS != nil {
				v.LastAutovacuum = time.UnixMilli(*t.VacuumedMS)
			}
			smp.Tables = append(smp.Tables, v)
		}
		smp.addOverdue(overdue, overdueMS)
		return nil
	}
	err := s.db.QueryRowContext(ctx, q.StatsSample, outboxdriver.StatsCountCap, p.Retention.Milliseconds()).Scan(
		&smp.Pending, &smp.OldestPendingMS, &smp.Parked, &smp.OldestParkedMS, &smp.Failing,
		&smp.Retained, &smp.Estimated, &smp.CleanupLagMS)
	if err != nil {
		return fmt.Errorf("sample stats: %w", s.wrap(err))
	}
	if q.DelayedStats != "" {
		if err := s.db.QueryRowContext(ctx, q.DelayedStats, outboxdriver.StatsCountCap).Scan(&smp.Delayed, &overdue, &overdueMS); err != nil {
			return fmt.Errorf("sample delayed effects: %w", s.wrap(err))
		}
		smp.addOverdue(overdue, overdueMS)
	}
	if s.d.DeadLetters.Count != "" {
		if err := s.db.QueryRowContext(ctx, s.d.DeadLetters.Count, outboxdriver.StatsCountCap).Scan(&smp.DeadLetters); err != nil {
			return fmt.Errorf("count dead letters: %w", s.wrap(err))
		}
	}
	return nil
}

// addOverdue counts the delayed effects past their due time, which no relay has moved: late like
// pending ones.
func (smp *statsSample) addOverdue(overdue, overdueMS int64) {
	if overdue > 0 {
		smp.Pending += overdue
		smp.OldestPendingMS = max(smp.OldestPendingMS, overdueMS)
	}
	smp.Estimated = smp.Estimated || smp.Delayed >= outboxdriver.StatsCountCap
}

func (smp statsSample) stats(at time.Time) outboxdriver.Stats {
	ms := func(n int64) time.Duration { return time.Duration(max(n, 0)) * time.Millisecond }
	st := outboxdriver.Stats{
		Pending: smp.Pending, OldestPending: ms(smp.OldestPendingMS),
		Parked: smp.Parked, OldestParked: ms(smp.OldestParkedMS),
		Failing: smp.Failing, Retained: smp.Retained, Estimated: smp.Estimated,
		CleanupLag: ms(smp.CleanupLagMS), SampledAt: at, Delayed: smp.Delayed, DeadLetters: smp.DeadLetters,
		Tables: smp.Tables,
	}
	if x := smp.Xmin; x != nil {
		h := x.XminHold
		h.Age = ms(max(x.StartedMS, x.SeenMS))
		st.XminHold = &h
	}
	return st
}

// xminShare is the newest sample of the xmin horizon of one pool's database, which every store
// on the pool reads (XminSample names no table): a process with the Outboxes of 200 tenants on
// one pool asks the server once per StatsInterval, not 200 times.
type xminShare struct {
	sem  chan struct{} // held by the store that samples, so that the others wait for its sample
	refs int           // stores open on the pool (xminShares.mu)
	at   time.Time     // when hold was sampled; zero: never
	hold *xminSample   // nil: nothing held
}

var xminShares = struct {
	mu sync.Mutex
	m  map[*sql.DB]*xminShare
}{m: map[*sql.DB]*xminShare{}}

// shareXmin returns the xmin share of db, counting one more store on it.
func shareXmin(db *sql.DB) *xminShare {
	xminShares.mu.Lock()
	defer xminShares.mu.Unlock()
	sh := xminShares.m[db]
	if sh == nil {
		sh = &xminShare{sem: make(chan struct{}, 1)}
		xminShares.m[db] = sh
	}
	sh.refs++
	return sh
}

// unshareXmin counts one store less on db, forgetting its share with the last.
func unshareXmin(db *sql.DB) {
	xminShares.mu.Lock()
	defer xminShares.mu.Unlock()
	if sh := xminShares.m[db]; sh != nil {
		if sh.refs--; sh.refs <= 0 {
			delete(xminShares.m, db)
		}
	}
}

// sampleXmin reads what holds back the xmin horizon into smp: the pool's shared sample when
// another store took it within interval, a new one otherwise (always when interval is 0: a
// sample asked for now). A slot's xmin, or a backend of another role whose transaction start
// the role may not read, has no time of its own: how long it has been held is carried from the
// stored sample (prev, or read now) while the same xmin stays held, so that an alert on the age
// sees it too.
func (s *SQL) sampleXmin(ctx context.Context, interval time.Duration, smp *statsSample, prev *storedSample) error {
	sh := s.xmin
	select {
	case sh.sem <- struct{}{}:
	case <-ctx.Done():
		return fmt.Errorf("sample the xmin horizon: waiting for the pool's sample: %w", ctx.Err())
	}
	hold, at := sh.hold, sh.at
	if interval <= 0 || at.IsZero() || time.Since(at) >= interval {
		var err error
		if hold, err = s.queryXmin(ctx); err != nil {
			<-sh.sem
			return err
		}
		at = time.Now()
		sh.hold, sh.at = hold, at
	}
	<-sh.sem
	if hold == nil {
		return nil
	}
	h := *hold // the share's is not changed: other stores read it
	if h.StartedMS >= 0 {
		h.StartedMS += time.Since(at).Milliseconds()
	}
	smp.Xmin = &h
	if prev == nil {
		var err error
		if prev, err = s.readStored(ctx); err != nil && !errors.Is(err, errStoredSample) {
			return err
		} // a sample it cannot parse is not carried on from
	}
	if prev != nil && prev.smp.Xmin != nil && prev.smp.Xmin.Xmin == h.Xmin {
		h.SeenMS = prev.smp.Xmin.SeenMS + prev.age.Milliseconds()
	}
	return nil
}

// queryXmin reads the oldest holder of the database's xmin horizon (nil: none).
func (s *SQL) queryXmin(ctx context.Context) (*xminSample, error) {
	var kind, xid, app, state, name sql.NullString
	var xacts, startedMS, pid sql.NullInt64
	// Prepared: planning the views it reads costs several times its execution.
	err := s.queryRow(ctx, nil, s.d.Queries.XminSample, nil, &kind, &xid, &xacts, &startedMS, &pid, &app, &state, &name)
	if errors.Is(err, sql.ErrNoRows) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("sample the xmin horizon: %w", s.wrap(err))
	}
	h := &xminSample{XminHold: outboxdriver.XminHold{
		Holder: kind.String, Xmin: xid.String, Transactions: xacts.Int64, PID: int(pid.Int64),
		ApplicationName: app.String, State: state.String, Name: name.String,
	}, StartedMS: -1}
	if startedMS.Valid {
		h.StartedMS = startedMS.Int64
	}
	return h, nil
}

// QueryPrepared runs query in tx as a statement prepared per connection (as the store's hot
// statements are); the caller closes the rows.
func (s *SQL) QueryPrepared(ctx context.Context, tx *sql.Tx, query string, args ...any) (*sql.Rows, error) {
	return s.query(ctx, tx, query, args...)
}

// ExecPrepared runs query in tx (on the pool when tx is nil) as a statement prepared per
// connection, as the store's hot statements are.
func (s *SQL) ExecPrepared(ctx context.Context, tx *sql.Tx, query string, args ...any) (sql.Result, error) {
	return s.exec(ctx, tx, query, args...)
}

// QueryRowPrepared runs query in tx as a statement prepared per connection (as the store's hot
// statements are) and scans its one row into dest.
func (s *SQL) QueryRowPrepared(ctx context.Context, tx *sql.Tx, query string, args []any, dest ...any) error {
	return s.queryRow(ctx, tx, query, args, dest...)
}
