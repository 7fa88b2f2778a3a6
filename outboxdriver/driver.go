// Package outboxdriver is the contract between the outbox framework and a database: the Store a
// driver implements and the types it exchanges with the framework. Users of the framework do not
// need it (they pick a driver, for example postgres.Driver{}); driver authors implement Driver and
// Store and run the conformance suite (store/storetest) against them. The drivers in this
// repository build on store, which implements Store over database/sql for any dialect.
package outboxdriver

import (
	"context"
	"crypto/sha256"
	"database/sql"
	"encoding/hex"
	"errors"
	"fmt"
	"strings"
	"time"
	"unicode/utf8"
)

// Source identifies what caused a group of side effects: an incoming message handled by a consumer
// (Consumer is the consumer name, ID the message ID), or a boundary transaction (Consumer is empty,
// ID is the boundary ID).
type Source struct {
	Consumer string
	ID       string
}

// Effect is one side effect as it is stored: a message to publish (Kind == KindPublish) or a call
// of a registered applier (Kind is the applier's name).
type Effect struct {
	// StoreID is the row ID in the store; zero until the effect is stored.
	StoreID int64
	// Seq is the position of the effect among the effects of its source, from 0.
	Seq int
	// Kind is KindPublish for messages, otherwise the name of a registered applier.
	Kind string
	// Topic is the topic a message is published to; empty for appliers.
	Topic string
	// UUID is the stable ID of the effect: the message UUID, or the idempotency key given to an applier.
	UUID string
	// Payload is the message payload or the applier's input.
	Payload []byte
	// Metadata is the message metadata, stored byte for byte.
	Metadata map[string]string
	// OrderingKey groups effects that must be dispatched in order.
	OrderingKey string
	// Attempts counts the failed dispatches that count toward parking (see EffectFailure.Counted).
	Attempts int
	// Failures counts every failed dispatch, counted or not; the retry backoff grows with it.
	Failures int
	// SinceFailure is how long ago the last failed dispatch was recorded, by the database's clock;
	// meaningful when Failures > 0.
	SinceFailure time.Duration
	// Parked is true when the relay gave up on the effect; only an operator sends it now.
	Parked bool
	// Source is what caused the effect.
	Source Source
	// PendingFor is how long the effect had been stored when it was read, by the database's clock.
	PendingFor time.Duration
	// StoredAt is when the effect was stored, by this process's clock: the time it was read less
	// PendingFor (a store sets it with PendingFor), or the commit of the unit of work that
	// dispatches it from memory. Zero if unknown.
	StoredAt time.Time
	// DueAt, when not zero, makes the effect delayed: it is stored apart from the pending effects
	// (see DelayedStore) and becomes an ordinary pending effect, due for the relay, once DueAt
	// has passed. It is set only while the effect is recorded.
	DueAt time.Time
	// CancelKey, on a delayed effect, is the key a later unit of work cancels it by (empty: it
	// cannot be cancelled).
	CancelKey string
}

// KindPublish is the Kind of effects that publish a message.
const KindPublish = ""

// Driver opens a Store for one database dialect. See the drivers/ packages.
type Driver interface {
	// Open returns the Store of db. It must not do I/O.
	Open(db *sql.DB, opts StoreOptions) (Store, error)
}

// StoreOptions are the settings of a Store that come from Config.
type StoreOptions struct {
	// Schema is the database schema of the tables; empty means the driver's default.
	Schema string
	// TablePrefix is prepended to every table name.
	TablePrefix string
	// DeleteDispatched asks the store to delete side effects when they are marked dispatched
	// instead of keeping them until cleanup (a store may keep them anyway, e.g. SQLite).
	DeleteDispatched bool
	// OnError, when set, is told of the failures of work a store does on its own beside what it
	// was asked (the postgres driver's move of inline effects left behind, before a relay claim),
	// which must not fail the call it rides on.
	OnError func(what string, err error)
	// Unreachable, when set, tells a failure that means the database cannot be reached now (a
	// refused or failed dial, a server that takes no connections). A method that makes several
	// statements of its own, the later ones not needing the earlier ones' success (the postgres
	// driver's look, sweep and claim of a relay pass, its marks in statements of 200 claims), returns at such a failure: each statement
	// after it would be one more connection attempt on a database that is gone.
	Unreachable func(err error) bool
	// Failpoint, when set, is Config.Failpoint: a store calls it at the named steps of the work
	// it does on its own (the sweep of inline effects), and stops there with its error.
	Failpoint func(ctx context.Context, point string) error
}

// Store is the storage contract the framework needs from a database. The drivers/ packages
// implement it; users do not call it directly. Methods that take a *sql.Tx run inside the caller's
// transaction; the others run on their own.
//
// Every method that writes both effect rows and claim rows locks the effect rows first, in
// ascending StoreID order, and the claim rows after them, so that no two of them can deadlock.
type Store interface {
	// Migrate creates or upgrades the tables. It is idempotent and safe to run from several
	// processes at once. When every migration is applied already it changes nothing and needs no
	// right beyond reading the migrations table.
	Migrate(ctx context.Context) error
	// SchemaCheck returns an error wrapping ErrSchemaMissing or ErrSchemaOutdated when Migrate is needed.
	SchemaCheck(ctx context.Context) error

	// MessageClaim records in tx that src is being processed. When another transaction holds an
	// uncommitted claim of src, it waits for its outcome (as long as ctx allows).
	MessageClaim(ctx context.Context, tx *sql.Tx, src Source) (Claim, error)
	// MessageIsProcessed tells whether a committed claim of src exists.
	MessageIsProcessed(ctx context.Context, src Source) (bool, error)
	// MessagePoison records src as processed without effects because it was moved to the poison topic.
	MessagePoison(ctx context.Context, src Source) error
	// MessageReplay forgets that src was poisoned: it deletes its claim, if the claim is one that
	// MessagePoison wrote, and its failed attempts, so that the next delivery runs the handler
	// again. It tells whether a poisoned claim was found. A DeadLetterStore marks the dead letter
	// of src, if in state dead, retried in the same transaction, counting the retry.
	MessageReplay(ctx context.Context, src Source) (bool, error)
	// AttemptRecord durably counts a failed attempt of src and returns the count so far.
	AttemptRecord(ctx context.Context, src Source, reason string) (int, error)

	// EffectInsert stores effects of src in tx and sets their StoreID, any number of them (split
	// over statements as the database's limit of parameters requires). It returns true when some
	// of them may have been written inside a savepoint (a subtransaction) that can still be rolled
	// back on its own: the caller then asks EffectExisting before it commits. A store that cannot
	// tell returns true. A DelayedStore moves, in tx and ahead of the new rows, the delayed
	// effects of other sources with their ordering keys that are due and not moved yet (as
	// DelayedPromote would, waiting for a transaction that holds one): a due delayed effect is
	// never overtaken by an effect of its key recorded after it, which EffectKeyBlocked then holds
	// back behind it.
	EffectInsert(ctx context.Context, tx *sql.Tx, src Source, effects []Effect) (inSavepoint bool, err error)
	// EffectExisting returns those of storeIDs whose rows exist in tx.
	EffectExisting(ctx context.Context, tx *sql.Tx, storeIDs []int64) ([]int64, error)
	// EffectListPending returns the undispatched effects of src in order, parked ones included.
	EffectListPending(ctx context.Context, src Source) ([]Effect, error)
	// EffectMarkDispatched marks the effects of each mark dispatched, by StoreID (never "whatever
	// is pending for the source") and, for the marks with MoveClaim, moves the claim's dispatch
	// time (from which retention counts) to now (a store may move every claim). The write may be
	// asynchronous (not flushed at commit): losing it only causes a re-send.
	EffectMarkDispatched(ctx context.Context, marks ...DispatchMark) error
	// EffectRecordFailures records failed (or untried) dispatches: see EffectFailure.
	EffectRecordFailures(ctx context.Context, failures ...EffectFailure) error
	// EffectKeyBlocked tells whether an effect of another source with ordering key key, stored before
	// the effects of src, is still undispatched.
	EffectKeyBlocked(ctx context.Context, src Source, key string) (bool, error)
	// EffectHandToRelay makes the pending effects of src due for the relay now (or at the retry
	// time already set on them), without counting an attempt.
	EffectHandToRelay(ctx context.Context, src Source) error
	// EffectListParked returns up to limit parked effects, oldest first.
	EffectListParked(ctx context.Context, limit int) ([]ParkedEffect, error)
	// EffectUnpark makes parked effects due again with fresh counts (attempts and failures); it
	// returns how many it changed.
	EffectUnpark(ctx context.Context, storeIDs []int64) (int, error)
	// EffectDiscard marks parked effects dispatched without sending them, and moves the dispatch
	// time of their claims to now (retention counts from the last dispatch or discard); it
	// returns how many it changed.
	EffectDiscard(ctx context.Context, storeIDs []int64) (int, error)
	// EffectNotify wakes the relays of every instance that listens (PostgreSQL NOTIFY). A dialect
	// without notifications does nothing.
	EffectNotify(ctx context.Context) error
	// EffectListen calls wake once it listens (notifications sent before were missed) and then
	// whenever EffectNotify is called anywhere, until ctx is done; it returns
	// ErrListenUnsupported at once when the store cannot listen (the relay then polls). The
	// first call of each EffectListen is the one that says it listens.
	EffectListen(ctx context.Context, wake func()) error
	// EffectClaimDue leases up to p.Limit due effects (and at most p.MaxBytes of payload and
	// metadata, but always one) for p.Lease, in StoreID order, after p.After, and returns them:
	// until the lease runs out they are not due, and neither is any later effect with their
	// ordering key. An effect is due when it is undispatched and not parked, past p.Grace or
	// handed over, past its retry time, and every earlier undispatched effect with its ordering
	// key is claimed in the same call. Instances that claim at the same time get different
	// effects. A store may look at a window of the pending effects only, so that the cost of a
	// claim does not grow with the backlog: it then sets Next, and the caller claims again with
	// After: Next to look further. The caller records what it did not send (EffectRecordFailures)
	// and then marks what it sent (EffectMarkDispatched): until the marks land, a key's effects
	// wait behind its leased first one whatever retry time the failures gave them, so that no
	// other claim takes an effect the caller is still writing the outcome of. It runs as one
	// short statement, or transaction, of its own: nothing is held while the caller dispatches.
	EffectClaimDue(ctx context.Context, p EffectClaimParams) (EffectClaim, error)

	// Stats returns a sample of the tables: the newest one stored, or a new one, taken and
	// stored, when the stored one is older than p.Interval and no other process is taking one at
	// the moment (a zero Interval: always a new one, not stored). A sample's cost is bounded
	// whatever the size of the tables: counts beyond StatsCountCap are estimated.
	Stats(ctx context.Context, p StatsParams) (Stats, error)

	// Cleanup deletes, in batches, claims whose effects were all dispatched more than retention ago
	// (never a claim with an undispatched effect), dispatched effects older than their retention,
	// old attempt counters, idempotency keys past their expiry (a KeyStore's), and dead letters
	// retried or discarded more than retention ago (a DeadLetterStore's). Only one process cleans at a time; the others
	// return at once with zero.
	Cleanup(ctx context.Context, p CleanupParams) (CleanupResult, error)
}

// Claim is the outcome of Store.MessageClaim.
type Claim struct {
	// Claimed is true when this transaction claimed the message; false when it was processed.
	Claimed bool
	// Concurrent is true when the claim this one ran into was committed while this one waited for
	// it: a copy processed the message at the same moment, and is most likely dispatching its
	// effects right now. A store that cannot tell leaves it false.
	Concurrent bool
	// Age is how long ago the claim found was written, when Claimed and Concurrent are false.
	Age time.Duration
	// Settled is true, when Claimed and Concurrent are false, if the claim found had nothing
	// pending as the statement that found it saw it: no inline effects, no undispatched effect
	// rows (parked ones are undispatched). The duplicate path then has nothing to send and reads
	// nothing more. A store that cannot tell leaves it false. What it saw stays true: a committed
	// claim's effects committed with it, and moving inline effects to rows moves them in one
	// transaction; only a delayed effect becomes pending later (once due), and sending it is the
	// relay's, as when a duplicate comes before it is due.
	Settled bool
	// Tentative is true when the claim is not written yet (the optimistic mode): it is INSERTed
	// at commit, without ON CONFLICT, so that a copy that commits first wins and this unit of
	// work's Commit returns an error wrapping ErrClaimTaken.
	Tentative bool
	// Marked is, from ClaimMarker.MessageClaimMarking, the message IDs of sent and sentLate
	// whose marks the claim wrote (in the unit's transaction); the others' claims were locked by
	// another transaction, and their marks are the caller's to write otherwise.
	Marked []string
}

// ErrClaimTaken is wrapped by UnitTx.Commit (and reported by a handler's failure) when a
// tentative claim lost to a copy that committed first: the unit of work rolled back, and the
// message is a duplicate.
var ErrClaimTaken = errors.New("outbox: a copy of the message committed first")

// ErrNotSent is wrapped by UnitTx.Commit when the client refused the COMMIT before writing
// anything to the server (pgx's "conn busy" while a Rows is left open, a statement it cannot
// encode): nothing was committed, and the transaction is rolled back. Unlike a connection lost
// while COMMIT was in flight, the outcome is known: the unit of work failed.
var ErrNotSent = errors.New("outbox: COMMIT not sent (refused by the client before anything was written), rolled back")

// StatsCountCap bounds the rows a Store counts for one Stats sample: larger counts are estimated.
const StatsCountCap = 100_000

// StatsParams are the parameters of Store.Stats.
type StatsParams struct {
	// Interval is how old the stored sample may be before a new one is taken; zero: take a new
	// one and do not store it.
	Interval time.Duration
	// Retention is Config.Retention, for the cleanup lag.
	Retention time.Duration
	// CleanupFrom, when not zero, is where the cleanup service's runs got to in the claims
	// (CleanupResume.Claims): a store that can looks for the cleanup lag from there, not through
	// the claims cleanup deleted before it.
	CleanupFrom time.Time
}

// Stats is a sample of the outbox tables (Outbox.Stats).
type Stats struct {
	// Pending counts the undispatched side effects that are not parked; OldestPending is the age
	// of the oldest of them.
	Pending       int64
	OldestPending time.Duration
	// Parked counts the side effects the relay gave up on; OldestParked is the age of the oldest.
	Parked       int64
	OldestParked time.Duration
	// Failing counts the messages with failed attempts that were neither processed nor poisoned.
	Failing int64
	// Retained counts the processed message IDs remembered for deduplication; Estimated is true
	// when it (or Pending or Parked) exceeded StatsCountCap and was estimated.
	Retained  int64
	Estimated bool
	// CleanupLag is how long the oldest claim past retention (found among the first
	// thousand) has waited for cleanup; zero when cleanup keeps up.
	CleanupLag time.Duration
	// SampledAt is when the sample was taken, by this process's clock.
	SampledAt time.Time
	// Delayed counts the delayed effects that are not due yet (estimated beyond StatsCountCap);
	// they are no backlog. A delayed effect past its due time that the relay has not moved yet
	// counts in Pending, and its due time in OldestPending.
	Delayed int64
	// DeadLetters counts the dead letters still dead (see DeadLetterStore), up to StatsCountCap.
	DeadLetters int64
	// XminHold is what holds back the database's xmin horizon, the oldest transaction whose
	// snapshot keeps VACUUM from removing the rows deleted after it (PostgreSQL only): nil when
	// nothing the service's role can see holds it, and on other databases.
	XminHold *XminHold
	// Tables are the dead row versions of the outbox tables, from the database's statistics
	// (PostgreSQL only; nil on other databases).
	Tables []TableVacuum
}

// Holders of the xmin horizon (XminHold.Holder).
const (
	XminBackend             = "backend"              // a session: a long or idle-in-transaction one, or a standby's walsender
	XminReplicationSlot     = "replication_slot"     // a replication slot's xmin (a standby's hot_standby_feedback)
	XminPreparedTransaction = "prepared_transaction" // a prepared transaction never committed nor rolled back
)

// XminHold is the oldest holder of the xmin horizon that a Stats sample found.
type XminHold struct {
	// Holder is XminBackend, XminReplicationSlot or XminPreparedTransaction.
	Holder string
	// Xmin is the transaction ID held, as PostgreSQL prints it.
	Xmin string
	// Transactions is age(xmin): how many transactions began since. Always known.
	Transactions int64
	// Age is how long the horizon has been held: since the holder's transaction began (a
	// backend whose row the role may read, a prepared transaction), or since the samples first
	// found this xmin held (a slot, another role's backend), whichever is longer.
	Age time.Duration
	// PID is the backend's process (a slot's active walsender; 0 when none or prepared).
	PID int
	// ApplicationName and State are the backend's (State is empty when the role may not read
	// it: another role's session without pg_read_all_stats); for a slot, State is active or
	// inactive.
	ApplicationName string
	State           string
	// Name is the slot's name, the prepared transaction's GID, or the backend's type.
	Name string
}

// Who says who holds the horizon, with what an operator needs to end it: the backend's pid,
// application and state, the slot's name, the prepared transaction's GID.
func (h XminHold) Who() string {
	switch h.Holder {
	case XminReplicationSlot:
		return fmt.Sprintf("replication slot %s (%s)", h.Name, h.State)
	case XminPreparedTransaction:
		return "prepared transaction " + h.Name
	}
	who := fmt.Sprintf("backend pid %d", h.PID)
	var what []string
	for _, s := range []string{h.ApplicationName, h.State} {
		if s != "" {
			what = append(what, s)
		}
	}
	if len(what) > 0 {
		who += " (" + strings.Join(what, ", ") + ")"
	}
	return who
}

// TableVacuum is one outbox table's dead row versions, as the database's statistics count them.
type TableVacuum struct {
	// Table is the table's name without prefix: effects, processed, dispatched, delayed,
	// attempts, idempotency, dead_letters.
	Table string
	// DeadTuples are the row versions deleted or updated and not yet vacuumed.
	DeadTuples int64
	// LastAutovacuum is when autovacuum last finished on the table (zero: never).
	LastAutovacuum time.Time
}

// DispatchMark is one source's effects that Store.EffectMarkDispatched marks dispatched.
type DispatchMark struct {
	Source Source
	// StoreIDs are the effects that were sent.
	StoreIDs []int64
	// Inline: the source's inline effects (kept in its claim, see InlineStore) were all sent.
	Inline bool
	// MoveClaim asks the store to move the claim's dispatch time, from which retention counts, to
	// now. The framework leaves it unset when the effects were sent within ClaimClockSlack of the
	// claim, whose time, written with it, then stands for the dispatch; moving it would be one
	// more row written per message for a difference retention cannot tell.
	MoveClaim bool
}

// EffectFailure is one effect that was not dispatched, for Store.EffectRecordFailures.
type EffectFailure struct {
	StoreID int64
	// Reason is why the dispatch failed. Empty means the effect was not tried (it waited behind a
	// failed one, or the round ran out of time): only its retry time is set.
	Reason string
	// Counted: the failure counts toward parking (Attempts+1). A failure while nothing else reached
	// the same target (a broker outage) is recorded (Failures+1) but not counted.
	Counted bool
	// Park: the relay gives up on the effect.
	Park bool
	// RetryAfter is how long until the effect is due again.
	RetryAfter time.Duration
}

// ClaimClockSlack is how much earlier than the dispatch of its effects a claim's dispatch time may
// be: retention counts from dispatch, give or take this much.
const ClaimClockSlack = time.Second

// ParkedEffect is an effect the relay gave up on after its maximum attempts.
type ParkedEffect struct {
	Effect
	LastError string
	ParkedAt  time.Time
	CreatedAt time.Time
}

// EffectClaimParams are the parameters of Store.EffectClaimDue.
type EffectClaimParams struct {
	// Grace is how old an effect that was never handed over must be to be due.
	Grace time.Duration
	// Limit bounds the number of effects.
	Limit int
	// MaxBytes bounds the payload and metadata bytes of the effects, beyond the first.
	MaxBytes int
	// Lease is how long the claimed effects stay reserved for the caller.
	Lease time.Duration
	// After: only effects with a greater StoreID are claimed (0: from the first).
	After int64
	// Skip are ordering keys whose effects are not claimed, nor looked at: the keys of a round
	// the caller is sending, whose later effects wait behind its lease anyway. A store may
	// ignore it (it only saves the claim's limit for effects it can take).
	Skip []string
}

// EffectClaim is what Store.EffectClaimDue leased.
type EffectClaim struct {
	Effects []Effect
	// Next, when not zero, is where the window the store looked at ended, with undispatched
	// effects beyond it: claim again with After: Next to look at them.
	Next int64
	// Delayed, when not nil, is when the earliest delayed effect is due, read with the claim: the
	// relay then moves delayed effects (DelayedStore.DelayedPromote) only when one is due.
	Delayed *DelayedDue
	// Pending, when not nil, is when the earliest effect of the claim's window that is not due
	// yet falls due by itself (its lease or backoff ends, or its grace period), read with a claim
	// that took nothing: an idle relay, which may be backed off, then looks again no later than
	// that. Effects due already but not taken (they wait behind an earlier effect of their key)
	// and parked ones do not count. Nil: the store cannot tell (a relay backs off as it would).
	Pending *PendingDue
}

// PendingDue is when the earliest pending effect that is not due yet falls due, as a store read it.
type PendingDue struct {
	Waiting bool          // some pending effect is not due yet
	In      time.Duration // until the earliest falls due
}

// DelayedDue is when the earliest delayed effect is due, as a store read it.
type DelayedDue struct {
	Waiting bool          // there are delayed effects
	In      time.Duration // until the earliest is due; zero or negative: due now
}

// CleanupParams are the parameters of Store.Cleanup.
type CleanupParams struct {
	Retention           time.Duration
	EffectRetention     time.Duration
	BatchSize           int
	PauseBetweenBatches time.Duration
	// PauseFactor, when positive, makes each pause at least this many times as long as the batch
	// before it took, so that cleanup keeps to a share of the database's time whatever a batch costs.
	PauseFactor float64
	// Progress, if set, is called after each batch with the totals so far.
	Progress func(CleanupResult)
	// Resume, when not nil, is where a run of a store that walks a table in order (PostgreSQL's
	// claims and dispatched archive, by their times) begins, and where it leaves off: a run that
	// begins where the last one ended does not walk again the rows that one deleted, which stay
	// as dead index entries while a long transaction holds the xmin horizon back. It misses the
	// rows behind its start that expired since (a claim whose effects were sent late): a run
	// without Resume, from the start, takes those.
	Resume *CleanupResume
}

// CleanupResume is where the runs of a cleanup got to (CleanupParams.Resume). Its zero value
// begins at the start.
type CleanupResume struct {
	Claims  time.Time // the newest processed_at of the claims deleted
	Effects time.Time // the newest dispatched_at of the archived effects deleted
}

// CleanupResult counts what Store.Cleanup deleted.
type CleanupResult struct {
	// Batches counts the delete statements run.
	Batches  int
	Claims   int64
	Effects  int64
	Attempts int64
	// Keys counts the idempotency keys deleted past their expiry.
	Keys int64
	// DeadLetters counts the dead letters deleted Retention after they were retried or
	// discarded (a dead one is kept until an operator acts).
	DeadLetters int64
	// Skipped is true when another process held the cleanup lock: at the first batch (nothing
	// deleted), or at a later one (the counts say what the batches before it deleted).
	Skipped bool
}

// Errors a Store reports; test them with errors.Is.
var (
	// ErrSchemaMissing means the outbox tables do not exist: run Outbox.Migrate.
	ErrSchemaMissing = errors.New("outbox: tables missing, run Outbox.Migrate(ctx) first")
	// ErrSchemaOutdated means the outbox tables are older than this version: run Outbox.Migrate.
	ErrSchemaOutdated = errors.New("outbox: tables outdated, run Outbox.Migrate(ctx)")
)

// ErrReadOnly is wrapped by WritableChecker.CheckWritable for a server that takes no writes.
var ErrReadOnly = errors.New("outbox: the database is read-only")

// RetryClassifier is implemented by a Store whose database's errors carry no SQLSTATE (MySQL's
// driver reports an error number instead): it tells the errors after which the unit of work runs
// again at once, as after PostgreSQL's serialization failures and deadlocks, without counting a
// failed attempt.
type RetryClassifier interface {
	// Retryable tells whether err, from any statement of a unit of work or from its claim, rolled
	// back the statement or the transaction for a conflict that running again usually gets past.
	Retryable(err error) bool
}

// ReachabilityClassifier is implemented by a Store whose database says with errors of its own
// (MySQL's error numbers) that it takes no connections now. The framework already tells a failed
// dial and PostgreSQL's SQLSTATEs for it; while the database is unreachable, work on it waits for
// one probe at a time instead of each connecting.
type ReachabilityClassifier interface {
	// Unreachable tells whether err means the database takes no connections now: too many
	// connections, a server shutting down.
	Unreachable(err error) bool
}

// PoolReporter is implemented by a Store whose units of work take their connections from a pool
// of its own, not from Config.DB's (the pgx form's pgxpool). A unit slow to begin has the
// framework probe the database, suspecting a server that stalls; while every connection of the
// pool is taken, the unit waits for the pool, not the database, and no probe is made.
type PoolReporter interface {
	// PoolFull tells whether every connection the pool may hold is taken or being opened.
	PoolFull() bool
}

// PoolIdentifier is implemented by a Store whose connections come from a pool that Outboxes may
// share without sharing Config.DB (the pgx form: each Outbox wraps the pgxpool in a *sql.DB of its
// own). The Outboxes of one pool share the gate that holds their work back while the database is
// unreachable, and its probe.
type PoolIdentifier interface {
	// PoolIdentity returns a comparable value naming the pool (nil: Config.DB names it).
	PoolIdentity() any
}

// TablesIdentifier is implemented by a Store that can name its tables as resolved (the
// driver's default schema applied): two Stores on one pool with one identity share their claims.
type TablesIdentifier interface {
	// TablesIdentity returns a name of the Store's claims table, the same for every Store that
	// uses that table through the same connections.
	TablesIdentity() string
}

// DialWatcher is implemented by a UnitStore whose BeginUnit returns at its context's end whatever
// the database does (while it connects, too: the pgx form), and that can tell when a unit has to
// open a connection. A server that takes connections and answers none fails nothing: the
// framework watches each connection being opened, and one without an answer for a while has it
// probe the database while the units after it wait, without a connection. A unit on a pooled
// connection is not watched (a stall meets it at its deadline), nor is its claim, which may wait
// for a copy being handled elsewhere.
type DialWatcher interface {
	// WatchDials hands the store watch, called before BeginUnit waits for a connection that the
	// pool has to open (none idle), and whose returned end is called once it has one or failed.
	// It is called once, before any unit begins.
	WatchDials(watch func() (end func()))
}

// WritableChecker is implemented by a Store that can tell whether the server it reaches takes
// writes. After a failover a connection can land on a standby (a stale address, a DNS name not
// yet moved): every unit of work then fails, and a readiness probe must say why.
type WritableChecker interface {
	// CheckWritable returns an error wrapping ErrReadOnly, with the reason, when the server takes
	// no writes.
	CheckWritable(ctx context.Context) error
}

// ErrUnsafeBehindPooler is wrapped by the error of Migrate, SchemaCheck and every statement of a
// Store that reaches PostgreSQL through a pooler in transaction mode (PgBouncer's pool_mode =
// transaction) with a client driver that could bind a statement's parameters to a statement of
// another client of the same server connection. The error names the setting that fixes it.
var ErrUnsafeBehindPooler = errors.New("outbox: the database driver is unsafe behind a pooler in transaction mode")

// ErrListenerDeaf is wrapped by the error of Store.EffectListen when LISTEN succeeded but a
// notification the listener sent itself did not arrive: its connection goes through a pooler in
// transaction mode, or something else drops notifications. The relay polls meanwhile.
var ErrListenerDeaf = errors.New("outbox: the listener receives no notifications")

// ErrListenUnsupported is returned by Store.EffectListen when the store cannot listen for wake-ups.
var ErrListenUnsupported = errors.New("outbox: the store cannot listen for notifications")

// ErrTxDone is returned by UnitTx.Commit and UnitTx.Rollback for a transaction that was finished
// already (by user code, or when its context ended). It is database/sql's sql.ErrTxDone, so that
// both forms test alike with errors.Is.
var ErrTxDone = sql.ErrTxDone

// UnitTx is the transaction of one unit of work (a handled message, InTx, JoinTx) as a driver runs
// it. The framework calls its methods from one goroutine at a time.
type UnitTx interface {
	// Tx is the transaction user code writes through: a *sql.Tx, or the driver's own type (a
	// pgx.Tx for the pgx driver).
	Tx() any
	// Record is told of effects as they are recorded, in order, with their Seq, Source and
	// OrderingKey set. A driver that stores effects at once (because user code could commit the
	// transaction behind the framework's back) stores them here and sets their StoreID; one
	// that stores them at commit only takes note.
	Record(ctx context.Context, effects []Effect) error
	// Survivors returns those of the recorded effects that commit with the transaction: those
	// recorded inside a savepoint that was rolled back are left out. It runs before Commit; an
	// error rolls the unit of work back like a failed handler.
	Survivors(ctx context.Context, effects []Effect) ([]Effect, error)
	// Commit stores what Record left in memory and commits, in as few round trips as the driver
	// can (the pgx driver: one). It sets the StoreIDs of the effects it stored. An error that
	// wraps ErrTxDone means the transaction had ended before (COMMIT was never sent); one that
	// wraps ErrNotSent means the client refused to send it (the transaction rolled back).
	Commit(ctx context.Context, effects []Effect) error
	// Rollback rolls the transaction back; ErrTxDone if it was finished already.
	Rollback(ctx context.Context) error
}

// EffectRetrier is implemented by a Store that can end the backoff of one destination's effects
// early. The relay backs a failed effect off for up to five minutes; once the destination takes a
// message again, its effects that back off go out at the next relay round rather than when their
// retry time comes.
type EffectRetrier interface {
	// EffectRetryNow makes due now up to limit undispatched, unparked effects of kind (and, for
	// KindPublish, to topic) whose retry time was set by a recorded failure (an EffectFailure with
	// a Reason) and has not come yet. An effect whose retry time was set since by a lease
	// (EffectClaimDue) or a release (an EffectFailure without a Reason) is left alone: a leased
	// effect may be in another relay's call, and making it due would let a second relay send it
	// beside that call. It returns how many it made due.
	EffectRetryNow(ctx context.Context, kind, topic string, limit int) (int, error)
}

// InlineStore is implemented by a Store whose tables may hold the effects of a unit of work
// inline in its claim row until they are sent (written by the pgx driver's optimistic mode; read,
// moved and marked by every PostgreSQL form): one row written per message instead of a claim and
// an effect row. Such effects have StoreID 0. Its EffectListPending returns them (after the
// effect rows of the source), a DispatchMark with Inline clears them, and its relay moves the ones
// left behind into effect rows after the grace period.
type InlineStore interface {
	// EffectMaterialize moves the inline effects of src, if any, into effect rows, and returns the
	// pending effects of src as EffectListPending does (none inline). The rows are leased for
	// lease (not due for the relay before, as after EffectClaimDue) when it is positive: the
	// caller is about to send them itself.
	EffectMaterialize(ctx context.Context, src Source, lease time.Duration) ([]Effect, error)
}

// InlineRecorder is implemented by an InlineStore that keeps the effects of a claimed unit of work
// on database/sql in its claim as they are recorded, as the pgx driver's optimistic mode does at
// COMMIT: the effects with the source's default ordering key (those with a key of their own are
// stored as effect rows, behind the earlier effects of their key). Each record writes every
// effect the unit keeps inline so far, guarded by a token of the write before it: a savepoint
// the handler rolled back undoes the writes made since it began, which the unit, blind to user
// SQL, learns from the guard. Once rewriting costs more than rows would have, or the writes
// would pass InlineBudget, the unit moves them to rows (EffectSpillInline), and its later
// records are rows.
type InlineRecorder interface {
	InlineStore
	// EffectRecordInline writes effects (every effect the unit keeps inline, in the order they
	// were recorded, all of src) as the inline effects of src's claim in tx, if the claim holds
	// those of the write that returned prev (0: none). It returns the token of this write, or ok
	// false when the claim holds other effects (a savepoint was rolled back) or there is no claim
	// (nothing was written), and whether the write was made inside a savepoint.
	EffectRecordInline(ctx context.Context, tx *sql.Tx, src Source, effects []Effect, prev int) (token int, ok, nested bool, err error)
	// EffectReadInline returns the inline effects of src's claim as tx sees them (Seq, UUID and
	// the other stored fields), the token of the write that put them there (0: none), and claimed
	// false when there is no claim (user SQL rolled the transaction back: the unit stores nothing
	// more).
	EffectReadInline(ctx context.Context, tx *sql.Tx, src Source) (effects []Effect, token int, claimed bool, err error)
	// InlineBudget is how many bytes a unit may write into its claim in all (every write counts
	// whole: each rewrites what the claim keeps); a record that would go beyond is a row, and so
	// is every later one (EffectSpillInline). 0: none, every effect is a row.
	InlineBudget() int
	// EffectSpillInline moves the unit's effects from the claim into effect rows, in one
	// statement: if the claim holds those of the write that returned prev, it clears them and
	// inserts effects (what it held, in order, then those being recorded) as rows, setting their
	// StoreIDs. ok false when the claim holds other effects (a savepoint was rolled back) or
	// there is no claim (nothing was written); nested: written inside a savepoint.
	EffectSpillInline(ctx context.Context, tx *sql.Tx, src Source, effects []Effect, prev int) (ok, nested bool, err error)
	// EffectUnspillInline writes effects (all of src's default ordering key, in order) into the
	// claim if it holds those of the write that returned prev, and then deletes the effect rows
	// rows (some of effects, written by this unit), in one statement; ok false when the claim
	// holds other effects (nothing was written). It makes one kind of storage of what a spill
	// left in both, when a savepoint rolled back gave the claim back effects moved to rows.
	EffectUnspillInline(ctx context.Context, tx *sql.Tx, src Source, effects []Effect, prev int, rows []int64) (ok bool, err error)
}

// ErrClaimGone is wrapped by the writes of ClaimedEffectInserter and ClaimedDelayedStore that
// found no claim and wrote nothing. It wraps ErrTxDone.
var ErrClaimGone = fmt.Errorf("the claim is gone (the transaction was rolled back by SQL sent through it): nothing stored (%w)", ErrTxDone)

// ClaimMarker is implemented by an InlineStore whose claim of a message can also write the marks
// of other claims of its consumer whose inline effects were sent (DispatchMark with Inline and no
// StoreIDs), in the same statement: a mark then costs no statement and no transaction of its own.
// A database that sees a message now and then (one of many tenant databases) cannot batch its
// marks, and each was a transaction; riding on the next unit of work's claim, it is none. The
// marks take effect only if the unit's transaction commits; they are written as
// EffectMarkDispatched would, except that they commit with the unit (not asynchronously).
type ClaimMarker interface {
	// ClaimMarks tells whether MessageClaimMarking may be used: not when the store keeps sent
	// effects (StoreOptions.DeleteDispatched false), which a claim does not move.
	ClaimMarks() bool
	// MessageClaimMarking is MessageClaim that also clears the inline effects of the claims of
	// src.Consumer with the message IDs sent (sent in time) and sentLate (their dispatch time
	// moves to now, as with MoveClaim). src.ID is in neither. A claim that another transaction
	// holds locked is skipped, never waited for (the unit's message must not wait for another
	// message's); Claim.Marked lists the IDs whose marks it wrote.
	MessageClaimMarking(ctx context.Context, tx *sql.Tx, src Source, sent, sentLate []string) (Claim, error)
}

// LockSkippingMarker is implemented by a ClaimMarker whose marks written outside a unit of work
// can skip the claims another transaction holds locked: the marks whose ride on a unit failed
// (the unit rolled back, or its claim skipped them for such a lock). Written as
// EffectMarkDispatched writes, a mark waited for the lock (a copy of its message being handled,
// its publish hanging), and so did every mark written with it in the statement: they were
// dropped with it when the wait outlasted the write's timeout.
type LockSkippingMarker interface {
	// EffectMarkSkippingLocked writes marks (each with Inline and no StoreIDs) as
	// EffectMarkDispatched does, except that a claim another transaction holds locked is
	// skipped, never waited for. It returns the marks it skipped, for the caller to write later;
	// on an error it returns none and may have written some.
	EffectMarkSkippingLocked(ctx context.Context, marks ...DispatchMark) (skipped []DispatchMark, err error)
}

// ClaimedEffectInserter is implemented by a Store that stores the effect rows of a unit of work
// that claimed a message only while the claim exists, in the same statement (PostgreSQL). User
// SQL that rolled the transaction back (ROLLBACK sent through it) took the claim with it and left
// the connection in autocommit, where a plain insert would commit on its own: an effect without
// its business change, again at every delivery. The framework uses it instead of EffectInsert for
// a unit that claimed a message; when there is no claim, it writes nothing and returns an error
// wrapping ErrTxDone. (After a COMMIT sent through it the claim exists, committed, and so do the
// handler's later writes: its effects are stored with them, as the business writes are.)
type ClaimedEffectInserter interface {
	EffectInsertClaimed(ctx context.Context, tx *sql.Tx, src Source, effects []Effect) (inSavepoint bool, err error)
}

// BoundaryGuard is implemented by a Store whose guarded writes (ClaimedEffectInserter,
// ClaimedDelayedStore) can also guard a unit of work without a claim (a boundary unit: InTx, its
// Source without Consumer). A ROLLBACK or COMMIT sent through such a unit's *sql.Tx leaves the
// connection in autocommit, where an unguarded write commits on its own: an effect sent although
// its business change was rolled back. GuardBoundary marks tx, right after its BEGIN, with a mark
// that ends with the transaction; the guarded writes of a source without Consumer then write
// nothing once it is gone and return an error wrapping ErrClaimGone. guarded false: the Store
// cannot (nothing was sent), and the unit's writes are the plain ones.
type BoundaryGuard interface {
	GuardBoundary(ctx context.Context, tx *sql.Tx) (guarded bool, err error)
}

// ClaimedDelayedStore is to DelayedStore what ClaimedEffectInserter is to EffectInsert: the
// insert and the cancel of delayed effects of a unit of work that claimed a message, which do
// nothing when the claim does not exist (user SQL rolled the transaction back) and return an
// error wrapping ErrClaimGone.
type ClaimedDelayedStore interface {
	DelayedInsertClaimed(ctx context.Context, tx *sql.Tx, src Source, effects []Effect) error
	DelayedCancelClaimed(ctx context.Context, tx *sql.Tx, src Source, key string) (int, error)
}

// DelayedStore is implemented by a Store that keeps delayed effects (Effect.DueAt) apart from
// the pending ones until they are due, so that they hold nothing back and cost a relay pass
// nothing until then. The relay moves the due ones into ordinary pending effects (each behind
// what is pending with its ordering key at that moment) with DelayedPromote; a unit of work
// cancels those not moved yet with DelayedCancel.
type DelayedStore interface {
	// DelayedInsert stores delayed effects of src in tx (their DueAt and CancelKey set). The due
	// time is kept as a delay from the insert, by the database's clock: DueAt less this process's
	// time of the call.
	DelayedInsert(ctx context.Context, tx *sql.Tx, src Source, effects []Effect) error
	// DelayedCancel deletes in tx the delayed effects with cancel key key that were not moved
	// into pending effects yet, and returns how many. It waits for a DelayedPromote that is
	// moving one of them: what it deleted is never sent, and what it did not find was moved
	// before (or never existed).
	DelayedCancel(ctx context.Context, tx *sql.Tx, key string) (int, error)
	// DelayedPromote moves up to limit due delayed effects, in the order of their due times,
	// into pending effects that are due for the relay at once, in a short transaction of its
	// own that skips the rows a DelayedCancel holds. It returns how many it moved, and how long
	// until the next delayed effect is due (false when there is none).
	DelayedPromote(ctx context.Context, limit int) (moved int, next time.Duration, any bool, err error)
}

// ErrDelayedUnsupported is returned by the methods of a DelayedStore (and a DelayedUnitTx) whose
// database keeps no delayed effects (a dialect without the table).
var ErrDelayedUnsupported = errors.New("outbox: the driver keeps no delayed side effects")

// DelayedUnitTx is implemented by a UnitTx that stores delayed effects: in the transaction, at
// once (never inline in a claim), whatever the driver does with the others.
type DelayedUnitTx interface {
	// RecordDelayed stores delayed effects (DueAt set), with their Seq, Source and OrderingKey
	// set, in the transaction.
	RecordDelayed(ctx context.Context, effects []Effect) error
	// CancelDelayed is DelayedStore.DelayedCancel in the transaction.
	CancelDelayed(ctx context.Context, key string) (int, error)
}

// UnitStore is implemented by a Store that runs units of work on a transaction type of its own
// (the pgx driver). Without it, the framework runs them on database/sql with the Store's
// MessageClaim, EffectInsert and EffectExisting.
type UnitStore interface {
	// BeginUnit begins a transaction bounded by ctx and, when claim is not nil, claims the message
	// as MessageClaim does, in one round trip where the driver can. On error nothing is left open.
	BeginUnit(ctx context.Context, claim *Source) (UnitTx, Claim, error)
	// JoinUnit wraps tx, a transaction the caller owns and commits (JoinTx): effects are stored
	// as they are recorded, and Commit only checks. It returns an error for a tx of another type.
	JoinUnit(tx any) (UnitTx, error)
}

// MaxOrderingKeyBytes is the longest ordering key a store keeps.
const MaxOrderingKeyBytes = 255

// DefaultOrderingKey is the ordering key of the side effects of src that set none of their own:
// consumer, "/", ID. A consumer name and a message ID may each be 255 bytes, so a key longer than a
// store keeps is shortened: its first bytes (cut at a character boundary), "#", and the SHA-256 of
// the whole key in hex, the same on every attempt. Every form derives it here, so that a store
// recognizes the default key whichever form wrote it.
func DefaultOrderingKey(src Source) string {
	key := src.Consumer + "/" + src.ID
	if len(key) <= MaxOrderingKeyBytes {
		return key
	}
	sum := sha256.Sum256([]byte(key))
	n := MaxOrderingKeyBytes - 1 - 2*len(sum)
	for n > 0 && !utf8.RuneStart(key[n]) {
		n--
	}
	return key[:n] + "#" + hex.EncodeToString(sum[:])
}
