package mysql

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"math"
	"time"

	"github.com/watermill-outbox/outbox/outboxdriver"
	"github.com/watermill-outbox/outbox/store"
)

var (
	_ outboxdriver.KeyStore         = (*mysqlStore)(nil)
	_ outboxdriver.KeySessionLocker = (*mysqlStore)(nil)
)

// keyLock is the SQL of the GET_LOCK name of an idempotency key of the tables named by n, whose
// argument is keyLockArg. The server's locks are one namespace of names of at most 64
// characters: the name is a hash of the tables' database, their prefix, the scope and the key.
// The database is the session's when n names none, so that processes that name it and processes
// that leave it to the connection lock one key by one name.
func keyLock(n store.Names) string {
	database := `DATABASE()`
	if n.Schema != "" {
		database = `'` + n.Schema + `'` // a validated identifier
	}
	// Joined as bytes: DATABASE() is utf8mb3, which cannot hold a key's character outside the
	// Basic Multilingual Plane (error 1267); the bytes, and so the name, of every other key
	// are what they were.
	return `CONCAT('outbox_key_', SHA1(CONCAT(CAST(` + database + ` AS BINARY), CAST(? AS BINARY))))`
}

// keyLockArg is the argument of keyLock: the lock's name without the database.
func keyLockArg(n store.Names, scope, key string) string {
	return store.KeyLockName(store.Names{Prefix: n.Prefix}, scope, key)
}

// keyWaitForever is GET_LOCK's timeout, in seconds, of a waiting claim without a deadline: the
// context bounds the wait (InTx's always has one, HandlerTimeout).
const keyWaitForever = 365 * 24 * 3600

// keyClaim claims an idempotency key in tx. InnoDB can neither try an insert nor lock a key that
// is not stored without locking the gap around it (which, under REPEATABLE READ, deadlocks two
// claims of new keys that fall into one gap), so the key's lock is GET_LOCK of its name, taken
// first: without waiting (a claim that does not get it is told ErrKeyInFlight at once), or until
// the context's deadline. It belongs to the session and is released by KeyUnlock once the
// transaction has ended, after the commit: a claim let in then reads the key committed. While it
// is held no other claim of the key touches its row, so claims of one key never wait on each
// other's row locks: no deadlock or lock wait timeout between them.
//
// Under the lock a plain read finds the key as its last claim committed it (the read's snapshot
// is taken after the lock, so under REPEATABLE READ too). A key not found is inserted; an expired
// one is taken over in place. INSERT IGNORE and the UPDATE lock only the key's own row.
func (q queries) keyClaim(ctx context.Context, tx *sql.Tx, p outboxdriver.KeyClaimParams) (outboxdriver.KeyClaim, error) {
	wait := 0
	if p.Wait {
		wait = keyWaitForever
		if dl, ok := ctx.Deadline(); ok {
			// A second more than the context: its end, not GET_LOCK's timeout, ends the wait.
			wait = int(math.Ceil(time.Until(dl).Seconds())) + 1
		}
	}
	var got sql.NullInt64
	if err := tx.QueryRowContext(ctx, `SELECT GET_LOCK(`+keyLock(q.n)+`, ?)`, keyLockArg(q.n, p.Scope, p.Key), max(wait, 0)).Scan(&got); err != nil {
		return outboxdriver.KeyClaim{}, fmt.Errorf("lock idempotency key: %w", err)
	}
	if !got.Valid || got.Int64 != 1 {
		if p.Wait {
			return outboxdriver.KeyClaim{}, fmt.Errorf("%w (scope %q, key %q): waited %d s for its lock (GET_LOCK)", outboxdriver.ErrKeyInFlight, p.Scope, p.Key, wait)
		}
		return outboxdriver.KeyClaim{}, fmt.Errorf("%w (scope %q, key %q)", outboxdriver.ErrKeyInFlight, p.Scope, p.Key)
	}
	fp := p.Fingerprint
	if fp == nil {
		fp = []byte{}
	}
	var c outboxdriver.KeyClaim
	var expired bool
	err := tx.QueryRowContext(ctx, `SELECT fingerprint, result, expires_at <= `+now+` FROM `+q.n.Idempotency+` WHERE scope = ? AND `+"`key`"+` = ?`,
		p.Scope, p.Key).Scan(&c.Fingerprint, &c.Result, &expired)
	switch {
	case err == nil && !expired:
		return c, nil
	case err == nil:
		r, err := tx.ExecContext(ctx, `UPDATE `+q.n.Idempotency+` SET fingerprint = ?, result = '', created_at = `+now+`, expires_at = `+fromNow("?")+`
			WHERE scope = ? AND `+"`key`"+` = ? AND expires_at <= `+now, fp, p.Retention.Milliseconds(), p.Scope, p.Key)
		if err != nil {
			return outboxdriver.KeyClaim{}, fmt.Errorf("take over expired idempotency key: %w", err)
		}
		if n, err := r.RowsAffected(); err != nil || n == 1 {
			return outboxdriver.KeyClaim{Claimed: err == nil}, err
		}
		// Deleted by a cleanup since the read: inserted anew below.
	case !errors.Is(err, sql.ErrNoRows):
		return outboxdriver.KeyClaim{}, fmt.Errorf("read idempotency key: %w", err)
	}
	r, err := tx.ExecContext(ctx, `INSERT IGNORE INTO `+q.n.Idempotency+` (scope, `+"`key`"+`, fingerprint, result, created_at, expires_at)
		VALUES (?, ?, ?, '', `+now+`, `+fromNow("?")+`)`, p.Scope, p.Key, fp, p.Retention.Milliseconds())
	if err != nil {
		return outboxdriver.KeyClaim{}, fmt.Errorf("claim idempotency key: %w", err)
	}
	n, err := r.RowsAffected()
	if err != nil {
		return outboxdriver.KeyClaim{}, err
	}
	if n != 1 {
		// Only a statement outside the framework's claims writes a key while its lock is held.
		return outboxdriver.KeyClaim{}, fmt.Errorf("idempotency key %q (scope %q) was stored by another session while its lock was held", p.Key, p.Scope)
	}
	return outboxdriver.KeyClaim{Claimed: true}, nil
}

// KeyUnlock implements outboxdriver.KeySessionLocker. It releases every lock of the unit's
// session, not the key's by name: the name is made of DATABASE() when no schema is configured,
// which a handler's USE changes, and a lock released by a name it no longer has would stay with
// the connection in the pool (every later claim of the key in flight). The session is the unit's
// alone, so what else it holds (a GET_LOCK of the handler's) would leak the same way.
func (s *mysqlStore) KeyUnlock(ctx context.Context, conn *sql.Conn, scope, key string) error {
	if _, err := conn.ExecContext(ctx, `DO RELEASE_ALL_LOCKS()`); err != nil {
		return fmt.Errorf("release the lock of idempotency key %q: %w", key, err)
	}
	return nil
}
