package outbox

import (
	"context"
	"database/sql"
	"errors"
	"time"
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
	// Attempts counts failed dispatch attempts made by the relay.
	Attempts int
	// Source is what caused the effect.
	Source Source
	// PendingFor is how long the effect had been stored when it was read, by the database's clock.
	PendingFor time.Duration
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
}

// Store is the storage contract the framework needs from a database. The drivers/ packages
// implement it; users do not call it directly. Methods that take a *sql.Tx run inside the caller's
// transaction; the others run on their own.
type Store interface {
	// Migrate creates or upgrades the tables. It is idempotent and safe to run from several
	// processes at once.
	Migrate(ctx context.Context) error
	// SchemaCheck returns an error wrapping ErrSchemaMissing or ErrSchemaOutdated when Migrate is needed.
	SchemaCheck(ctx context.Context) error

	// MessageClaim records that src is being processed. It returns false when src was already
	// processed; when another transaction holds an uncommitted claim, it waits for its outcome.
	MessageClaim(ctx context.Context, tx *sql.Tx, src Source) (bool, error)
	// MessageIsProcessed tells whether a committed claim of src exists.
	MessageIsProcessed(ctx context.Context, src Source) (bool, error)
	// MessagePoison records src as processed without effects because it was moved to the poison topic.
	MessagePoison(ctx context.Context, src Source) error
	// AttemptRecord durably counts a failed attempt of src and returns the count so far.
	AttemptRecord(ctx context.Context, src Source, reason string) (int, error)

	// EffectInsert stores effects of src in tx.
	EffectInsert(ctx context.Context, tx *sql.Tx, src Source, effects []Effect) error
	// EffectListPending returns the undispatched effects of src in order.
	EffectListPending(ctx context.Context, src Source) ([]Effect, error)
	// EffectMarkDispatched marks every pending effect of each mark's source dispatched and, for the
	// marks with MoveClaim, moves the claim's dispatch time (from which retention counts) to now
	// (a store may move every claim). The write may be asynchronous (not flushed at commit):
	// losing it only causes a re-send.
	EffectMarkDispatched(ctx context.Context, marks ...DispatchMark) error
	// EffectRetryLater records a failed dispatch of the pending effects of src (the reason, not an
	// attempt: only the relay counts attempts, per effect): they become due for the relay after
	// delay, without waiting for the grace period.
	EffectRetryLater(ctx context.Context, src Source, reason string, delay time.Duration) error
	// EffectKeyBlocked tells whether an effect of another source with ordering key key, stored before
	// the effects of src, is still undispatched.
	EffectKeyBlocked(ctx context.Context, src Source, key string) (bool, error)
	// EffectHandToRelay makes the pending effects of src due for the relay now (or at the retry
	// time already set on them), without counting an attempt.
	EffectHandToRelay(ctx context.Context, src Source) error
	// EffectListParked returns up to limit parked effects, oldest first.
	EffectListParked(ctx context.Context, limit int) ([]ParkedEffect, error)
	// EffectUnpark makes parked effects due again with a fresh attempt count; it returns how many it changed.
	EffectUnpark(ctx context.Context, storeIDs []int64) (int, error)
	// EffectDiscard marks parked effects dispatched without sending them; it returns how many it changed.
	EffectDiscard(ctx context.Context, storeIDs []int64) (int, error)
	// EffectNotify wakes the relays of every instance that listens (PostgreSQL NOTIFY). A dialect
	// without notifications does nothing.
	EffectNotify(ctx context.Context) error
	// EffectListen calls wake whenever EffectNotify is called anywhere, until ctx is done; it returns
	// ErrListenUnsupported at once when the store cannot listen (the relay then polls).
	EffectListen(ctx context.Context, wake func()) error
	// EffectRelay runs one relay round: it claims up to limit due effects (see the drivers for
	// "due"), in id order, and calls dispatch with them; dispatch returns, for each effect, nil or its
	// error. The store marks the successful ones dispatched and records the failures (parking an
	// effect after maxAttempts) before it releases the claim. A round may cover only part of what is
	// due (a dialect that shares work between instances claims some key partitions per round): the
	// caller runs rounds until one returns zero.
	EffectRelay(ctx context.Context, p EffectRelayParams, dispatch func([]Effect) []error) (int, error)

	// Cleanup deletes, in batches, claims whose effects were all dispatched more than retention ago
	// (never a claim with an undispatched effect), dispatched effects older than their retention,
	// and old attempt counters. Only one process cleans at a time; the others
	// return at once with zero.
	Cleanup(ctx context.Context, p CleanupParams) (CleanupResult, error)
}

// DispatchMark is one source whose pending effects Store.EffectMarkDispatched marks dispatched.
type DispatchMark struct {
	Source Source
	// MoveClaim asks the store to move the claim's dispatch time, from which retention counts, to
	// now. The framework leaves it unset when the effects were sent within ClaimClockSlack of the
	// claim, whose time, written with it, then stands for the dispatch; moving it would be one
	// more row written per message for a difference retention cannot tell.
	MoveClaim bool
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

// EffectRelayParams are the parameters of Store.EffectRelay.
type EffectRelayParams struct {
	Grace       time.Duration
	Limit       int
	MaxAttempts int
	Backoff     func(attempts int) time.Duration
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
}

// CleanupResult counts what Store.Cleanup deleted.
type CleanupResult struct {
	Claims   int64
	Effects  int64
	Attempts int64
	// Skipped is true when another process held the cleanup lock.
	Skipped bool
}

// Errors a Store reports; test them with errors.Is.
var (
	// ErrSchemaMissing means the outbox tables do not exist: run Outbox.Migrate.
	ErrSchemaMissing = errors.New("outbox: tables missing, run Outbox.Migrate(ctx) first")
	// ErrSchemaOutdated means the outbox tables are older than this version: run Outbox.Migrate.
	ErrSchemaOutdated = errors.New("outbox: tables outdated, run Outbox.Migrate(ctx)")
)

// ErrListenUnsupported is returned by Store.EffectListen when the store cannot listen for wake-ups.
var ErrListenUnsupported = errors.New("outbox: the store cannot listen for notifications")

// ErrEffectBlocked is what a relay dispatch function returns for an effect it did not try because
// an earlier effect with the same ordering key failed; the store neither marks nor counts it.
var ErrEffectBlocked = errors.New("outbox: blocked behind an earlier effect with the same ordering key")
