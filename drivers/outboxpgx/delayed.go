package outboxpgx

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/jackc/pgx/v5/pgconn"

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

// boundaryEndedBySQL tells a boundary unit (InTx: no claim) whose transaction fn ended with
// COMMIT or ROLLBACK sent through its pgx.Tx: the connection is in no transaction, and a delayed
// insert or a cancel would run in autocommit, committed on its own, whether the business change
// was rolled back or not. The connection's status, from the server's last ReadyForQuery, costs
// nothing to read. (Effects wait in memory for the COMMIT, which looks itself.)
func (u *unit) boundaryEndedBySQL() bool {
	if u.joined != nil || u.src.Consumer != "" {
		return false
	}
	c, err := u.tx.conn()
	return err == nil && c.PgConn().TxStatus() == 'I'
}

// RecordDelayed stores delayed effects in the transaction at once, in rows of their own in both
// modes: the optimistic mode's inline effects are the ones sent after commit, and a delayed
// effect must wait in the delayed table, where a later unit of work can cancel it, until due.
// A savepoint rolled back takes its rows with it.
func (u *unit) RecordDelayed(ctx context.Context, effects []outboxdriver.Effect) error {
	if u.boundaryEndedBySQL() {
		return u.endedBySQLError()
	}
	now := time.Now()
	for chunk := range slices.Chunk(effects, store.DelayedInsertMaxRows) {
		if _, err := u.execer().Exec(ctx, u.s.q.delayedInsert(len(chunk)), store.DelayedInsertArgs(chunk[0].Source, chunk, now)...); err != nil {
			return fmt.Errorf("store delayed effects: %w", wrap(err))
		}
	}
	return nil
}

// CancelDelayed deletes the delayed effects with cancel key key in the transaction.
func (u *unit) CancelDelayed(ctx context.Context, key string) (int, error) {
	if u.boundaryEndedBySQL() {
		return 0, u.endedBySQLError()
	}
	tag, err := u.execer().Exec(ctx, u.s.q.delayedCancel, key)
	if err != nil {
		return 0, fmt.Errorf("cancel delayed effects: %w", wrap(err))
	}
	return int(tag.RowsAffected()), nil
}
