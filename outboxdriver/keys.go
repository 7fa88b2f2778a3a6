package outboxdriver

import (
	"context"
	"database/sql"
	"errors"
	"time"
)

// KeyClaimParams are the parameters of a claim of an idempotency key (KeyedUnitTx.KeyClaim).
type KeyClaimParams struct {
	// Scope and Key name the key: a key is unique within its scope (an API, an endpoint).
	Scope string
	Key   string
	// Fingerprint identifies the request the key was sent with; a claim found with another
	// fingerprint is a misuse of the key (KeyClaim.Fingerprint tells it).
	Fingerprint []byte
	// Retention is how long the key is kept from this claim on: a claim found older than its
	// retention is expired and taken over as if there were none.
	Retention time.Duration
	// Wait: when another transaction holds an uncommitted claim of the key, wait for its outcome
	// (as long as ctx allows) instead of returning ErrKeyInFlight at once.
	Wait bool
}

// KeyClaim is the outcome of KeyedUnitTx.KeyClaim.
type KeyClaim struct {
	// Claimed is true when this transaction claimed the key: the unit of work runs, and its
	// result is stored with the key when it commits.
	Claimed bool
	// Fingerprint and Result are those of the committed claim found when Claimed is false.
	Fingerprint []byte
	Result      []byte
}

// KeyedUnitTx is implemented by a UnitTx that can claim idempotency keys in its transaction.
type KeyedUnitTx interface {
	// KeyClaim claims p's key in the transaction, or finds the committed claim of an earlier unit
	// of work. While another transaction holds an uncommitted claim of it, it returns an error
	// wrapping ErrKeyInFlight at once, or with p.Wait waits for that transaction's outcome. It
	// runs before any statement of user code.
	KeyClaim(ctx context.Context, p KeyClaimParams) (KeyClaim, error)
	// KeySave stores result with the key this transaction claimed; it is written at commit at the
	// latest (a driver may send it with the commit).
	KeySave(ctx context.Context, scope, key string, result []byte) error
}

// KeyStore is implemented by a Store over database/sql that keeps idempotency keys: the units of
// work the framework runs on database/sql claim keys through it.
type KeyStore interface {
	// KeyClaim is KeyedUnitTx.KeyClaim in tx.
	KeyClaim(ctx context.Context, tx *sql.Tx, p KeyClaimParams) (KeyClaim, error)
	// KeySave is KeyedUnitTx.KeySave in tx.
	KeySave(ctx context.Context, tx *sql.Tx, scope, key string, result []byte) error
}

// KeySessionLocker is implemented by a KeyStore whose lock of a key belongs to the session, not
// to the transaction (MySQL's GET_LOCK): the transaction of a keyed unit of work then runs on a
// connection reserved for the unit, and KeyUnlock releases the lock on it once the transaction
// has ended (committed, rolled back, or ended by its context), before the connection goes back to
// the pool. A waiting claim of the key is let in only after the commit: it finds the key stored.
type KeySessionLocker interface {
	// KeyUnlock releases conn's lock of the key, taken by a KeyClaim in a transaction on conn;
	// it does nothing when conn holds none. An error means conn may still hold it: the caller
	// closes conn rather than putting it back into the pool.
	KeyUnlock(ctx context.Context, conn *sql.Conn, scope, key string) error
}

// Errors of keyed units of work; the outbox package exports them under its own names.
var (
	// ErrKeyInFlight means another transaction holds an uncommitted claim of the key: the first
	// request with the key is still running.
	ErrKeyInFlight = errors.New("outbox: a request with this idempotency key is still in flight")
	// ErrKeysUnsupported means the store keeps no idempotency keys (its dialect has no statements
	// for them).
	ErrKeysUnsupported = errors.New("outbox: the driver keeps no idempotency keys")
)
