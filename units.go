package outbox

import (
	"context"
	"database/sql"
	"database/sql/driver"
	"fmt"
	"time"

	"github.com/watermill-outbox/outbox/outboxdriver"
)

// sqlUnits runs units of work on database/sql for a Store that does not run them itself: BEGIN,
// the claim and each record are round trips of their own, since database/sql cannot pipeline.
// Effects are stored as they are recorded: the handler holds the *sql.Tx and could commit it.
type sqlUnits struct {
	db    *sql.DB
	store outboxdriver.Store
}

var _ outboxdriver.UnitStore = sqlUnits{}

// txBeginner is implemented by a Store that begins transactions on its database itself, to name
// the errors of BEGIN (store.SQL: a standby that refuses BEGIN READ WRITE is reported as
// read-only).
type txBeginner interface {
	BeginTx(ctx context.Context, opts *sql.TxOptions) (*sql.Tx, error)
}

// beginTries bounds the BEGINs of a unit on a reserved connection (see BeginUnit).
const beginTries = 3

func (s sqlUnits) BeginUnit(ctx context.Context, claim *Source) (outboxdriver.UnitTx, outboxdriver.Claim, error) {
	if _, ok := s.store.(outboxdriver.KeySessionLocker); ok && claim == nil {
		// A boundary unit may claim an idempotency key, whose lock outlives the transaction:
		// its connection is the unit's until the lock is released.
		// database/sql's BeginTx takes another connection when the first turns out dead; a
		// reserved one does not, so BEGIN, which changes nothing, is sent again on a fresh
		// connection (the dead one is discarded with the driver's error).
		var err error
		for try := 1; try <= beginTries; try++ {
			var conn *sql.Conn
			conn, err = s.db.Conn(ctx)
			if err != nil {
				return nil, outboxdriver.Claim{}, fmt.Errorf("begin transaction (waiting for a database connection, at most HandlerTimeout): %w", err)
			}
			var tx *sql.Tx
			if tx, err = conn.BeginTx(ctx, nil); err == nil {
				return &sqlUnit{store: s.store, tx: tx, conn: conn}, outboxdriver.Claim{Claimed: true}, nil
			}
			_ = conn.Close()
			if ctx.Err() != nil {
				break
			}
		}
		return nil, outboxdriver.Claim{}, fmt.Errorf("begin transaction: %w", err)
	}
	begin := s.db.BeginTx
	if b, ok := s.store.(txBeginner); ok {
		begin = b.BeginTx
	}
	tx, err := begin(ctx, nil)
	if err != nil {
		return nil, outboxdriver.Claim{}, fmt.Errorf("begin transaction (waiting for a database connection, at most HandlerTimeout): %w", err)
	}
	u := &sqlUnit{store: s.store, tx: tx}
	if claim == nil {
		return u, outboxdriver.Claim{Claimed: true}, nil
	}
	c, err := s.store.MessageClaim(ctx, tx, *claim)
	if err != nil {
		_ = tx.Rollback()
		return nil, outboxdriver.Claim{}, err
	}
	return u, c, nil
}

func (s sqlUnits) JoinUnit(tx any) (outboxdriver.UnitTx, error) {
	t, ok := tx.(*sql.Tx)
	if !ok || t == nil {
		return nil, fmt.Errorf("%w: JoinTx needs a *sql.Tx with this driver, got %T", ErrNoUnitOfWork, tx)
	}
	return &sqlUnit{store: s.store, tx: t}, nil
}

type sqlUnit struct {
	store       outboxdriver.Store
	tx          *sql.Tx
	inSavepoint bool // some effect may have been written inside a savepoint
	// conn is the connection of tx when the store locks keys per session; keyed is the key
	// claimed on it, whose lock is released once tx has ended.
	conn  *sql.Conn
	keyed *outboxdriver.KeyClaimParams
}

func (u *sqlUnit) Tx() any { return u.tx }

func (u *sqlUnit) Record(ctx context.Context, effects []Effect) error {
	inSavepoint, err := u.store.EffectInsert(ctx, u.tx, effects[0].Source, effects)
	u.inSavepoint = u.inSavepoint || inSavepoint
	return err
}

// Survivors asks the database only when an effect may have been written inside a savepoint.
func (u *sqlUnit) Survivors(ctx context.Context, effects []Effect) ([]Effect, error) {
	if !u.inSavepoint || len(effects) == 0 {
		return effects, nil
	}
	ids := make([]int64, len(effects))
	for i, e := range effects {
		ids[i] = e.StoreID
	}
	existing, err := u.store.EffectExisting(ctx, u.tx, ids)
	if err != nil {
		return nil, fmt.Errorf("outbox: check which side effects survived savepoints: %w", err)
	}
	keep := make(map[int64]bool, len(existing))
	for _, id := range existing {
		keep[id] = true
	}
	out := effects[:0:0]
	for _, e := range effects {
		if keep[e.StoreID] {
			out = append(out, e)
		}
	}
	return out, nil
}

func (u *sqlUnit) Commit(ctx context.Context, _ []Effect) error {
	err := u.tx.Commit()
	u.endSession(ctx)
	return err
}

func (u *sqlUnit) Rollback(ctx context.Context) error {
	err := u.tx.Rollback()
	u.endSession(ctx)
	return err
}

// keyUnlockTimeout bounds the release of a key's session lock after the unit's transaction.
const keyUnlockTimeout = 10 * time.Second

// endSession releases the lock of the claimed key, after the transaction so that a claim waiting
// for it finds the key committed, and gives the connection back. A connection whose lock may
// outlive the release is closed: the lock ends with its session.
func (u *sqlUnit) endSession(ctx context.Context) {
	if u.conn == nil {
		return
	}
	conn, keyed := u.conn, u.keyed
	u.conn, u.keyed = nil, nil
	if keyed != nil {
		rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), keyUnlockTimeout)
		defer cancel()
		if err := u.store.(outboxdriver.KeySessionLocker).KeyUnlock(rctx, conn, keyed.Scope, keyed.Key); err != nil {
			_ = conn.Raw(func(any) error { return driver.ErrBadConn })
		}
	}
	_ = conn.Close()
}

// KeyClaim implements outboxdriver.KeyedUnitTx through the Store, when it keeps keys.
func (u *sqlUnit) KeyClaim(ctx context.Context, p outboxdriver.KeyClaimParams) (outboxdriver.KeyClaim, error) {
	ks, ok := u.store.(outboxdriver.KeyStore)
	if !ok {
		return outboxdriver.KeyClaim{}, outboxdriver.ErrKeysUnsupported
	}
	if u.conn != nil {
		// Set before the claim: it may take the lock and then fail.
		u.keyed = &p
	}
	return ks.KeyClaim(ctx, u.tx, p)
}

// KeySave implements outboxdriver.KeyedUnitTx through the Store.
func (u *sqlUnit) KeySave(ctx context.Context, scope, key string, result []byte) error {
	ks, ok := u.store.(outboxdriver.KeyStore)
	if !ok {
		return outboxdriver.ErrKeysUnsupported
	}
	return ks.KeySave(ctx, u.tx, scope, key, result)
}

var _ outboxdriver.DelayedUnitTx = (*sqlUnit)(nil)

// RecordDelayed stores delayed effects in the transaction, through the store's DelayedStore.
func (u *sqlUnit) RecordDelayed(ctx context.Context, effects []Effect) error {
	ds, ok := u.store.(outboxdriver.DelayedStore)
	if !ok {
		return ErrDelayUnsupported
	}
	return ds.DelayedInsert(ctx, u.tx, effects[0].Source, effects)
}

// CancelDelayed cancels delayed effects in the transaction, through the store's DelayedStore.
func (u *sqlUnit) CancelDelayed(ctx context.Context, key string) (int, error) {
	ds, ok := u.store.(outboxdriver.DelayedStore)
	if !ok {
		return 0, ErrDelayUnsupported
	}
	return ds.DelayedCancel(ctx, u.tx, key)
}
