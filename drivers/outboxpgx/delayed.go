package outboxpgx

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/watermill-outbox/outbox"
	"github.com/watermill-outbox/outbox/outboxdriver"
	"github.com/watermill-outbox/outbox/store"
)

var (
	_ outboxdriver.DelayedStore  = (*pgxStore)(nil)
	_ outboxdriver.DelayedUnitTx = (*unit)(nil)
)

// errNoDelayed: the postgres driver's Store keeps no delayed effects (it always does).
var errNoDelayed = errors.New("outboxpgx: the postgres driver's Store keeps no delayed effects")

func (s *pgxStore) delayed() (outboxdriver.DelayedStore, error) {
	ds, ok := s.postgresStore.(outboxdriver.DelayedStore)
	if !ok {
		return nil, errNoDelayed
	}
	return ds, nil
}

// DelayedInsert implements outboxdriver.DelayedStore through the postgres driver's store (for
// a *sql.Tx; the pgx units of work store theirs with RecordDelayed).
func (s *pgxStore) DelayedInsert(ctx context.Context, tx *sql.Tx, src outboxdriver.Source, effects []outboxdriver.Effect) error {
	ds, err := s.delayed()
	if err != nil {
		return err
	}
	return ds.DelayedInsert(ctx, tx, src, effects)
}

// DelayedCancel implements outboxdriver.DelayedStore through the postgres driver's store.
func (s *pgxStore) DelayedCancel(ctx context.Context, tx *sql.Tx, key string) (int, error) {
	ds, err := s.delayed()
	if err != nil {
		return 0, err
	}
	return ds.DelayedCancel(ctx, tx, key)
}

// DelayedPromote implements outboxdriver.DelayedStore through the postgres driver's store.
func (s *pgxStore) DelayedPromote(ctx context.Context, limit int) (int, time.Duration, bool, error) {
	ds, err := s.delayed()
	if err != nil {
		return 0, 0, false, err
	}
	return ds.DelayedPromote(ctx, limit)
}

// execer is what the delayed statements run on: the unit's connection, or the joined pgx.Tx.
type execer interface {
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
}

func (u *unit) execer() execer {
	if u.joined != nil {
		return u.joined
	}
	return u.tx
}

// txEndedBySQL tells a unit the framework began whose transaction user code ended with COMMIT or
// ROLLBACK sent through its pgx.Tx: the connection is in no transaction, and a delayed insert or
// a cancel would run in autocommit, committed on its own, whether the business change was rolled
// back or not (and after a ROLLBACK once more at every delivery). The connection's status, from
// the server's last ReadyForQuery, costs nothing to read. (Effects wait in memory for the COMMIT,
// which looks itself.) q is what a guarded write then runs on: the unit's connection, or the pool
// once HandlerTimeout closed the connection of a transaction the handler had ended (a COMMIT it
// sent committed the claim, and what it records after it belongs beside the claim, as its
// ordinary effects are stored at the unit's COMMIT).
func (u *unit) txEndedBySQL() (q guardedQuerier, ended bool) {
	if u.joined != nil {
		return nil, false
	}
	if c, err := u.tx.conn(); err == nil {
		return c, c.PgConn().TxStatus() == 'I'
	}
	u.mu.Lock()
	defer u.mu.Unlock()
	// The handler's own statements read the status: expire closed the socket only.
	if u.expired && !u.released && u.conn.Conn().PgConn().TxStatus() == 'I' {
		// The dead connection leaves the pool first, as end does: still counted as taken, it
		// held the pool's last connection (a pool of one) from the write that waits for one.
		u.released, u.endedBySQL = true, true
		ctx, cancel := context.WithTimeout(context.Background(), cleanupTimeout)
		_ = u.conn.Hijack().Close(ctx)
		cancel()
	}
	if u.expired && u.released && u.endedBySQL {
		return u.s.pool, true
	}
	return nil, false
}

// guardedQuerier is what the guarded delayed writes run on: a connection or the pool.
type guardedQuerier interface {
	execer
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

// guardedContext is the context of a guarded write: on the pool, once HandlerTimeout ended the
// handler's context, a bounded one of its own, as the unit's COMMIT stores its effects then.
func (u *unit) guardedContext(ctx context.Context, q guardedQuerier) (context.Context, context.CancelFunc) {
	if q == guardedQuerier(u.s.pool) {
		return context.WithTimeout(context.WithoutCancel(ctx), cleanupTimeout)
	}
	return ctx, func() {}
}

// claimedOnly tells whether a unit whose transaction was ended by SQL (txEndedBySQL) may still
// write, guarded by its claim: only a pessimistic consumer's unit has one in the database, which
// a COMMIT sent as SQL committed with the handler's writes, as database/sql's form keeps it. A
// boundary unit cannot tell that COMMIT from a ROLLBACK, and an optimistic unit's claim would be
// written at the framework's commit, which never comes (the message runs again): both refuse.
func (u *unit) claimedOnly() bool {
	return u.src.Consumer != "" && !u.tentative
}

// claimGoneError is the error of a write that found no claim of its unit: user SQL rolled the
// transaction back (as the database/sql form reports it).
func (u *unit) claimGoneError(what string) error {
	return fmt.Errorf("%s: %w: the transaction was rolled back by SQL sent through it (its claim is gone): nothing more is stored (%w)",
		what, outbox.ErrTxFinishedByHandler, outboxdriver.ErrClaimGone)
}

// RecordDelayed stores delayed effects in the transaction at once, in rows of their own in both
// modes: the optimistic mode's inline effects are the ones sent after commit, and a delayed
// effect must wait in the delayed table, where a later unit of work can cancel it, until due.
// A savepoint rolled back takes its rows with it.
func (u *unit) RecordDelayed(ctx context.Context, effects []outboxdriver.Effect) error {
	q, guarded := u.txEndedBySQL()
	if guarded && !u.claimedOnly() {
		return u.endedBySQLError()
	}
	if guarded {
		var cancel context.CancelFunc
		ctx, cancel = u.guardedContext(ctx, q)
		defer cancel()
	}
	now := time.Now()
	for chunk := range slices.Chunk(effects, store.DelayedInsertMaxRows) {
		if guarded {
			// Finds the claim the unit inserted (by its transaction ID) in the statement that
			// writes: gone after a ROLLBACK, even when a copy claimed the message since.
			args := append(store.DelayedInsertArgs(chunk[0].Source, chunk, now), u.src.Consumer, u.src.ID, u.claimXID)
			tag, err := q.Exec(ctx, u.s.q.delayedInsertClaimed(len(chunk)), args...)
			if err != nil {
				return fmt.Errorf("store delayed effects: %w", wrap(err))
			}
			if tag.RowsAffected() == 0 {
				return u.claimGoneError("store delayed effects")
			}
			continue
		}
		if _, err := u.execer().Exec(ctx, u.s.q.delayedInsert(len(chunk)), store.DelayedInsertArgs(chunk[0].Source, chunk, now)...); err != nil {
			return fmt.Errorf("store delayed effects: %w", wrap(err))
		}
	}
	return nil
}

// CancelDelayed deletes the delayed effects with cancel key key in the transaction. Once user SQL
// ended it, only a unit whose own claim is committed cancels (claimedOnly): in autocommit the
// cancel would delete, on its own, delayed effects that other units committed.
func (u *unit) CancelDelayed(ctx context.Context, key string) (int, error) {
	if q, ended := u.txEndedBySQL(); ended {
		if !u.claimedOnly() {
			return 0, u.endedBySQLError()
		}
		ctx, cancel := u.guardedContext(ctx, q)
		defer cancel()
		var claimed bool
		var n int
		if err := q.QueryRow(ctx, u.s.q.delayedCancelClaimed, key, u.src.Consumer, u.src.ID, u.claimXID).Scan(&claimed, &n); err != nil {
			return 0, fmt.Errorf("cancel delayed effects: %w", wrap(err))
		}
		if !claimed {
			return 0, u.claimGoneError("cancel delayed effects")
		}
		return n, nil
	}
	tag, err := u.execer().Exec(ctx, u.s.q.delayedCancel, key)
	if err != nil {
		return 0, fmt.Errorf("cancel delayed effects: %w", wrap(err))
	}
	return int(tag.RowsAffected()), nil
}
