package store

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/watermill-outbox/outbox/outboxdriver"
)

var _ outboxdriver.DelayedStore = (*SQL)(nil)

// errNoDelayed is returned by the delayed-effect methods of a dialect that keeps none.
var errNoDelayed = outboxdriver.ErrDelayedUnsupported

// DelayedInsert implements outboxdriver.DelayedStore.
func (s *SQL) DelayedInsert(ctx context.Context, tx *sql.Tx, src outboxdriver.Source, effects []outboxdriver.Effect) error {
	if s.d.Queries.DelayedInsert == nil && s.d.Hooks.DelayedInsert == nil {
		return errNoDelayed
	}
	for chunk := range slices.Chunk(effects, DelayedInsertMaxRows) {
		var err error
		if s.d.Hooks.DelayedInsert != nil {
			err = s.d.Hooks.DelayedInsert(ctx, tx, src, chunk)
		} else {
			_, err = tx.ExecContext(ctx, s.d.Queries.DelayedInsert(len(chunk)), DelayedInsertArgs(src, chunk, time.Now())...)
		}
		if err != nil {
			return fmt.Errorf("store delayed effects: %w", s.wrap(err))
		}
	}
	return nil
}

var _ outboxdriver.ClaimedDelayedStore = (*SQL)(nil)

// DelayedInsertClaimed implements outboxdriver.ClaimedDelayedStore: with
// Queries.DelayedInsertClaimed, an insert that finds no claim of src writes nothing and returns
// an error wrapping ErrClaimGone. A dialect without it inserts as DelayedInsert does.
func (s *SQL) DelayedInsertClaimed(ctx context.Context, tx *sql.Tx, src outboxdriver.Source, effects []outboxdriver.Effect) error {
	q := s.d.Queries.DelayedInsertClaimed
	if q == nil || s.d.Hooks.DelayedInsert != nil {
		return s.DelayedInsert(ctx, tx, src, effects)
	}
	for chunk := range slices.Chunk(effects, DelayedInsertMaxRows) {
		r, err := tx.ExecContext(ctx, q(len(chunk)), append(DelayedInsertArgs(src, chunk, time.Now()), src.Consumer, src.ID)...)
		if err != nil {
			return fmt.Errorf("store delayed effects: %w", s.wrap(err))
		}
		if n, err := r.RowsAffected(); err != nil {
			return fmt.Errorf("store delayed effects: %w", err)
		} else if n == 0 {
			return fmt.Errorf("store delayed effects: %w", ErrClaimGone)
		}
	}
	return nil
}

// DelayedCancelClaimed implements outboxdriver.ClaimedDelayedStore: with
// Queries.DelayedCancelClaimed, a cancel that finds no claim of src deletes nothing and returns
// an error wrapping ErrClaimGone. A dialect without it cancels as DelayedCancel does.
func (s *SQL) DelayedCancelClaimed(ctx context.Context, tx *sql.Tx, src outboxdriver.Source, key string) (int, error) {
	q := s.d.Queries.DelayedCancelClaimed
	if q == "" && s.d.Queries.DelayedClaimExists != "" {
		var claimed bool
		if err := tx.QueryRowContext(ctx, s.d.Queries.DelayedClaimExists, src.Consumer, src.ID).Scan(&claimed); err != nil {
			return 0, fmt.Errorf("cancel delayed effects: %w", s.wrap(err))
		}
		if !claimed {
			return 0, fmt.Errorf("cancel delayed effects: %w", ErrClaimGone)
		}
	}
	if q == "" {
		return s.DelayedCancel(ctx, tx, key)
	}
	var claimed bool
	var n int
	if err := tx.QueryRowContext(ctx, q, key, src.Consumer, src.ID).Scan(&claimed, &n); err != nil {
		return 0, fmt.Errorf("cancel delayed effects: %w", s.wrap(err))
	}
	if !claimed {
		return 0, fmt.Errorf("cancel delayed effects: %w", ErrClaimGone)
	}
	return n, nil
}

// DelayedInsertMaxRows bounds the delayed effects one insert statement stores (9 parameters each).
const DelayedInsertMaxRows = 500

// DelayedInsertArgs returns the arguments of Queries.DelayedInsert(len(effects)) for effects of
// src, their delays counted from now.
func DelayedInsertArgs(src outboxdriver.Source, effects []outboxdriver.Effect, now time.Time) []any {
	args := EffectInsertArgs(src, effects)
	for _, e := range effects {
		var key any
		if e.CancelKey != "" {
			key = e.CancelKey
		}
		args = append(args, max(e.DueAt.Sub(now), 0).Milliseconds(), key)
	}
	return args
}

// DelayedCancel implements outboxdriver.DelayedStore.
func (s *SQL) DelayedCancel(ctx context.Context, tx *sql.Tx, key string) (int, error) {
	if s.d.Queries.DelayedCancel == "" {
		return 0, errNoDelayed
	}
	r, err := tx.ExecContext(ctx, s.d.Queries.DelayedCancel, key)
	if err != nil {
		return 0, fmt.Errorf("cancel delayed effects: %w", s.wrap(err))
	}
	n, err := r.RowsAffected()
	return int(n), err
}

// DelayedPromote implements outboxdriver.DelayedStore.
func (s *SQL) DelayedPromote(ctx context.Context, limit int) (int, time.Duration, bool, error) {
	q := s.d.Queries
	var moved int64
	switch {
	case s.d.Hooks.DelayedPromote != nil:
		n, err := s.d.Hooks.DelayedPromote(ctx, s.db, limit)
		if err != nil {
			return 0, 0, false, fmt.Errorf("move due delayed effects: %w", s.wrap(err))
		}
		moved = int64(n)
	case q.DelayedPromote != "":
		var ms sql.NullInt64
		err := s.db.QueryRowContext(ctx, q.DelayedPromote, limit).Scan(&moved, &ms)
		if serializationFailure(err) && s.d.Isolation != sql.LevelDefault {
			// The sessions default to an isolation above the dialect's (REPEATABLE READ), where
			// two relays moving at once meet as a serialization failure: moved again at the
			// dialect's, where the second skips what the first moves.
			err = s.inTx(ctx, func(tx *sql.Tx) error {
				return tx.QueryRowContext(ctx, q.DelayedPromote, limit).Scan(&moved, &ms)
			})
		}
		if err != nil {
			return 0, 0, false, fmt.Errorf("move due delayed effects: %w", s.wrap(err))
		}
		return int(moved), time.Duration(ms.Int64) * time.Millisecond, ms.Valid, nil
	case q.DelayedDue != "":
		n, err := s.promoteInSteps(ctx, limit)
		if err != nil {
			return 0, 0, false, fmt.Errorf("move due delayed effects: %w", err)
		}
		moved = int64(n)
	default:
		return 0, 0, false, nil
	}
	var ms sql.NullInt64
	if err := s.db.QueryRowContext(ctx, s.d.Queries.DelayedNextDue).Scan(&ms); err != nil {
		return int(moved), 0, false, fmt.Errorf("next due delayed effect: %w", s.wrap(err))
	}
	return int(moved), time.Duration(ms.Int64) * time.Millisecond, ms.Valid, nil
}

// promoteInSteps is DelayedPromote with Queries.DelayedDue, DelayedMove and DelayedDelete. It
// looks for due effects before it begins a transaction: there (SQLite) a transaction takes the
// write lock, which an idle relay pass must not take.
func (s *SQL) promoteInSteps(ctx context.Context, limit int) (int, error) {
	if due, err := s.delayedDue(ctx, s.db, limit); err != nil || len(due) == 0 {
		return 0, err
	}
	tx, err := s.db.BeginTx(ctx, nil)
	if err != nil {
		return 0, fmt.Errorf("begin: %w", err)
	}
	defer func() { _ = tx.Rollback() }()
	due, err := s.delayedDue(ctx, tx, limit) // again, under the lock: a cancel may have taken some
	if err != nil || len(due) == 0 {
		return 0, err
	}
	list := idList(due)
	if _, err := tx.ExecContext(ctx, s.d.Queries.DelayedMove, list); err != nil {
		return 0, s.wrap(err)
	}
	if _, err := tx.ExecContext(ctx, s.d.Queries.DelayedDelete, list); err != nil {
		return 0, s.wrap(err)
	}
	return len(due), tx.Commit()
}

// delayedDue returns the ids of up to limit due delayed effects, in due order.
func (s *SQL) delayedDue(ctx context.Context, q execer, limit int) ([]int64, error) {
	return s.delayedIDs(ctx, q, s.d.Queries.DelayedDue, limit)
}

// delayedIDs returns the ids query returns.
func (s *SQL) delayedIDs(ctx context.Context, q execer, query string, args ...any) ([]int64, error) {
	rows, err := q.QueryContext(ctx, query, args...)
	if err != nil {
		return nil, s.wrap(err)
	}
	var due []int64
	for rows.Next() {
		var id int64
		if err := rows.Scan(&id); err != nil {
			_ = rows.Close()
			return nil, err
		}
		due = append(due, id)
	}
	if err := errors.Join(rows.Err(), rows.Close()); err != nil {
		return nil, s.wrap(err)
	}
	return due, nil
}

// serializationFailure tells a serialization failure (SQLSTATE 40001).
func serializationFailure(err error) bool {
	var s interface{ SQLState() string }
	return errors.As(err, &s) && s.SQLState() == "40001"
}

// inTx runs fn in a transaction of the Store's own (BeginTx: at the dialect's Isolation) and
// commits it.
func (s *SQL) inTx(ctx context.Context, fn func(tx *sql.Tx) error) error {
	tx, err := s.BeginTx(ctx, nil)
	if err != nil {
		return err
	}
	defer func() { _ = tx.Rollback() }()
	if err := fn(tx); err != nil {
		return err
	}
	return tx.Commit()
}
