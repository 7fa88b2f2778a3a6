package store

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"io/fs"
	"sync"
	"time"

	"github.com/watermill-outbox/outbox"
)

// Queries are the statements of one dialect. Durations are passed in milliseconds.
type Queries struct {
	MessageClaim       string // (consumer, id) -> a row when claimed, none when already processed
	MessageIsProcessed string // (consumer, id) -> a row when processed
	MessagePoison      string // (consumer, id)
	AttemptRecord      string // (consumer, id, reason) -> attempts
	// EffectInsert returns the insert of n effects: (consumer, id) then per effect
	// (seq, kind, topic, uuid, payload, metadata, ordering_key).
	EffectInsert         func(n int) string
	EffectListPending    string // (consumer, id) -> effect columns, in seq order
	EffectMarkDispatched string // (consumer, id): marks the effects and moves the claim; used when there is no batch
	// EffectMarkDispatchedBatch, when set, returns the mark of n sources in one statement:
	// (consumer, id) per source; with moveClaims it moves their claims too. Without it, sources are
	// marked one EffectMarkDispatched each.
	EffectMarkDispatchedBatch func(n int, moveClaims bool) string

	EffectRetryLater  string // (consumer, id, reason, delay ms): record a failed fast-path dispatch
	EffectKeyBlocked  string // (consumer, id, key) -> bool
	EffectHandToRelay string // (consumer, id)
	EffectListParked  string // (limit) -> effect columns, last_error, parked_at, created_at
	EffectUnpark      string // (store id)
	EffectDiscard     string // (store id)

	// RelayLock (grace ms) -> text: locks, for the round's transaction, the key partitions this
	// round may relay and returns them comma-separated ("" for none: nothing to do). Empty when the
	// dialect has no partitions: then RelaySelect takes only (grace ms, limit).
	RelayLock           string
	RelaySelect         string // (grace ms, limit[, partitions]) -> effect columns, in id order, claimed
	RelayMarkDispatched string // (store id)
	RelayMarkFailed     string // (store id, reason, retry delay ms, park bool)
	RelayFinishSource   string // (consumer, id): mark the claim dispatched when no effect is pending

	CleanupLock     string // -> bool
	CleanupBegin    string // run first in every cleanup transaction (e.g. to relax durability); may be empty
	CleanupClaims   string // (retention ms, limit)
	CleanupEffects  string // (retention ms, limit)
	CleanupAttempts string // (retention ms, limit)

	SchemaLatest string // -> latest applied version
}

// Dialect is what a driver supplies to build a Store.
type Dialect struct {
	Queries Queries
	Migrate MigrateQueries
	// Migrations are the NNN_name.up.sql files.
	Migrations fs.FS
	// IsUndefinedTable tells whether err means a missing table or schema.
	IsUndefinedTable func(error) bool
	// Prepare enables prepared statements reused per connection on the hot path.
	Prepare bool
	// Notify wakes listening relays (no arguments); empty when the dialect has no notifications.
	Notify string
	// Listen blocks until ctx is done, calling wake on every notification; nil when the dialect
	// cannot listen.
	Listen func(ctx context.Context, wake func()) error
}

// SQL is an outbox.Store over database/sql.
type SQL struct {
	db         *sql.DB
	d          Dialect
	names      Names
	migrations []Migration

	mu    sync.Mutex
	stmts map[string]*sql.Stmt
}

var _ outbox.Store = (*SQL)(nil)

// New returns a Store. It reads the embedded migrations and does no database I/O.
func New(db *sql.DB, names Names, d Dialect) (*SQL, error) {
	ms, err := LoadMigrations(d.Migrations, names)
	if err != nil {
		return nil, err
	}
	return &SQL{db: db, d: d, names: names, migrations: ms, stmts: map[string]*sql.Stmt{}}, nil
}

// Names returns the table names.
func (s *SQL) Names() Names { return s.names }

// Close closes the prepared statements.
func (s *SQL) Close() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	var errs []error
	for q, st := range s.stmts {
		errs = append(errs, st.Close())
		delete(s.stmts, q)
	}
	return errors.Join(errs...)
}

// Migrate implements outbox.Store.
func (s *SQL) Migrate(ctx context.Context) error {
	return Migrate(ctx, s.db, s.d.Migrate, s.migrations)
}

// SchemaCheck implements outbox.Store.
func (s *SQL) SchemaCheck(ctx context.Context) error {
	return SchemaCheck(ctx, s.db, s.d.Queries.SchemaLatest, len(s.migrations), s.d.IsUndefinedTable, s.names)
}

// wrap adds the fix to errors caused by missing tables.
func (s *SQL) wrap(err error) error {
	if err != nil && s.d.IsUndefinedTable(err) {
		return fmt.Errorf("%w (schema %q, prefix %q): %w", outbox.ErrSchemaMissing, s.names.Schema, s.names.Prefix, err)
	}
	return err
}

// stmt returns query prepared for tx (or the DB when tx is nil), reusing the statement already
// prepared on that connection; without Prepare it returns nil and the caller runs query directly.
func (s *SQL) stmt(ctx context.Context, tx *sql.Tx, query string) (*sql.Stmt, error) {
	if !s.d.Prepare {
		return nil, nil
	}
	s.mu.Lock()
	st, ok := s.stmts[query]
	s.mu.Unlock()
	if !ok {
		var err error
		st, err = s.db.PrepareContext(ctx, query)
		if err != nil {
			return nil, s.wrap(err)
		}
		s.mu.Lock()
		if prev, ok := s.stmts[query]; ok {
			_ = st.Close()
			st = prev
		} else {
			s.stmts[query] = st
		}
		s.mu.Unlock()
	}
	if tx != nil {
		return tx.StmtContext(ctx, st), nil
	}
	return st, nil
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

// MessageClaim implements outbox.Store.
func (s *SQL) MessageClaim(ctx context.Context, tx *sql.Tx, src outbox.Source) (bool, error) {
	var one int
	err := s.queryRow(ctx, tx, s.d.Queries.MessageClaim, []any{src.Consumer, src.ID}, &one)
	if errors.Is(err, sql.ErrNoRows) {
		return false, nil
	}
	return err == nil, err
}

// MessageIsProcessed implements outbox.Store.
func (s *SQL) MessageIsProcessed(ctx context.Context, src outbox.Source) (bool, error) {
	var one int
	err := s.queryRow(ctx, nil, s.d.Queries.MessageIsProcessed, []any{src.Consumer, src.ID}, &one)
	if errors.Is(err, sql.ErrNoRows) {
		return false, nil
	}
	return err == nil, err
}

// MessagePoison implements outbox.Store.
func (s *SQL) MessagePoison(ctx context.Context, src outbox.Source) error {
	_, err := s.exec(ctx, nil, s.d.Queries.MessagePoison, src.Consumer, src.ID)
	return err
}

// AttemptRecord implements outbox.Store.
func (s *SQL) AttemptRecord(ctx context.Context, src outbox.Source, reason string) (int, error) {
	var n int
	err := s.queryRow(ctx, nil, s.d.Queries.AttemptRecord, []any{src.Consumer, src.ID, storableReason(reason)}, &n)
	return n, err
}

// maxPreparedInsertRows bounds the number of prepared multi-row inserts kept per store.
const maxPreparedInsertRows = 8

// EffectInsert implements outbox.Store.
func (s *SQL) EffectInsert(ctx context.Context, tx *sql.Tx, src outbox.Source, effects []outbox.Effect) error {
	args := make([]any, 0, 2+7*len(effects))
	args = append(args, src.Consumer, src.ID)
	for _, e := range effects {
		payload := e.Payload
		if payload == nil {
			payload = []byte{}
		}
		args = append(args, e.Seq, e.Kind, e.Topic, e.UUID, payload, EncodeMetadata(e.Metadata), e.OrderingKey)
	}
	query := s.d.Queries.EffectInsert(len(effects))
	if len(effects) > maxPreparedInsertRows {
		_, err := tx.ExecContext(ctx, query, args...)
		return s.wrap(err)
	}
	_, err := s.exec(ctx, tx, query, args...)
	return err
}

func scanEffects(rows *sql.Rows) ([]outbox.Effect, error) {
	defer rows.Close()
	var out []outbox.Effect
	for rows.Next() {
		var e outbox.Effect
		var md []byte
		var pendingMS int64
		if err := rows.Scan(&e.StoreID, &e.Source.Consumer, &e.Source.ID, &e.Seq, &e.Kind, &e.Topic, &e.UUID,
			&e.Payload, &md, &e.OrderingKey, &e.Attempts, &pendingMS); err != nil {
			return nil, err
		}
		e.PendingFor = time.Duration(pendingMS) * time.Millisecond
		var err error
		if e.Metadata, err = DecodeMetadata(md); err != nil {
			return nil, fmt.Errorf("effect %d: %w", e.StoreID, err)
		}
		out = append(out, e)
	}
	return out, rows.Err()
}

// EffectListPending implements outbox.Store.
func (s *SQL) EffectListPending(ctx context.Context, src outbox.Source) ([]outbox.Effect, error) {
	rows, err := s.db.QueryContext(ctx, s.d.Queries.EffectListPending, src.Consumer, src.ID)
	if err != nil {
		return nil, s.wrap(err)
	}
	return scanEffects(rows)
}

// maxMarkBatch bounds the sources marked in one statement.
const maxMarkBatch = 128

// EffectMarkDispatched implements outbox.Store.
//
// The marks are not prepared statements: a prepared statement's cached generic plan, made while
// the tables were small, would keep scanning them whole as they grow; planned on every use, the
// statement looks its rows up by index once there are enough of them.
func (s *SQL) EffectMarkDispatched(ctx context.Context, marks ...outbox.DispatchMark) error {
	if s.d.Queries.EffectMarkDispatchedBatch == nil {
		for _, m := range marks {
			if _, err := s.db.ExecContext(ctx, s.d.Queries.EffectMarkDispatched, m.Source.Consumer, m.Source.ID); err != nil {
				return s.wrap(err)
			}
		}
		return nil
	}
	var move, keep []outbox.Source
	for _, m := range marks {
		if m.MoveClaim {
			move = append(move, m.Source)
		} else {
			keep = append(keep, m.Source)
		}
	}
	for _, group := range []struct {
		srcs       []outbox.Source
		moveClaims bool
	}{{move, true}, {keep, false}} {
		for srcs := group.srcs; len(srcs) > 0; {
			n := min(len(srcs), maxMarkBatch)
			args := make([]any, 0, 2*n)
			for _, src := range srcs[:n] {
				args = append(args, src.Consumer, src.ID)
			}
			if _, err := s.db.ExecContext(ctx, s.d.Queries.EffectMarkDispatchedBatch(n, group.moveClaims), args...); err != nil {
				return s.wrap(err)
			}
			srcs = srcs[n:]
		}
	}
	return nil
}

// EffectRelay implements outbox.Store.
func (s *SQL) EffectRelay(ctx context.Context, p outbox.EffectRelayParams, dispatch func([]outbox.Effect) []error) (int, error) {
	tx, err := s.db.BeginTx(ctx, nil)
	if err != nil {
		return 0, fmt.Errorf("begin: %w", err)
	}
	defer func() { _ = tx.Rollback() }()
	args := []any{p.Grace.Milliseconds(), p.Limit}
	if s.d.Queries.RelayLock != "" {
		var parts string
		if err := tx.QueryRowContext(ctx, s.d.Queries.RelayLock, p.Grace.Milliseconds()).Scan(&parts); err != nil {
			return 0, fmt.Errorf("relay lock: %w", s.wrap(err))
		}
		if parts == "" {
			return 0, nil
		}
		args = append(args, parts)
	}
	rows, err := tx.QueryContext(ctx, s.d.Queries.RelaySelect, args...)
	if err != nil {
		return 0, fmt.Errorf("select pending effects: %w", s.wrap(err))
	}
	effects, err := scanEffects(rows)
	if err != nil {
		return 0, fmt.Errorf("select pending effects: %w", err)
	}
	if len(effects) == 0 {
		return 0, tx.Commit()
	}
	errs := dispatch(effects)
	done := map[outbox.Source]bool{}
	for i, e := range effects {
		switch {
		case errs[i] == nil:
			if _, err := tx.ExecContext(ctx, s.d.Queries.RelayMarkDispatched, e.StoreID); err != nil {
				return 0, fmt.Errorf("mark effect %d dispatched: %w", e.StoreID, err)
			}
			done[e.Source] = true
		case errors.Is(errs[i], outbox.ErrEffectBlocked):
		default:
			attempts := e.Attempts + 1
			delay := time.Duration(0)
			if p.Backoff != nil {
				delay = p.Backoff(attempts)
			}
			park := p.MaxAttempts > 0 && attempts >= p.MaxAttempts
			if _, err := tx.ExecContext(ctx, s.d.Queries.RelayMarkFailed, e.StoreID, storableReason(errs[i].Error()), delay.Milliseconds(), park); err != nil {
				return 0, fmt.Errorf("record failure of effect %d: %w", e.StoreID, err)
			}
		}
	}
	for src := range done {
		if src.Consumer == "" {
			continue
		}
		if _, err := tx.ExecContext(ctx, s.d.Queries.RelayFinishSource, src.Consumer, src.ID); err != nil {
			return 0, fmt.Errorf("mark message %q of %q dispatched: %w", src.ID, src.Consumer, err)
		}
	}
	if err := tx.Commit(); err != nil {
		return 0, fmt.Errorf("commit relay round: %w", err)
	}
	return len(effects), nil
}

// Cleanup implements outbox.Store.
func (s *SQL) Cleanup(ctx context.Context, p outbox.CleanupParams) (outbox.CleanupResult, error) {
	var res outbox.CleanupResult
	steps := []struct {
		query     string
		retention time.Duration
		count     *int64
	}{
		{s.d.Queries.CleanupClaims, p.Retention, &res.Claims},
		{s.d.Queries.CleanupEffects, p.EffectRetention, &res.Effects},
		{s.d.Queries.CleanupAttempts, p.Retention, &res.Attempts},
	}
	for _, st := range steps {
		for {
			began := time.Now()
			n, locked, err := s.cleanupBatch(ctx, st.query, st.retention, p.BatchSize)
			took := time.Since(began)
			if err != nil {
				return res, err
			}
			if !locked {
				res.Skipped = true
				return res, nil
			}
			*st.count += n
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

// cleanupBatch deletes one batch in its own short transaction, so that it never holds locks long.
func (s *SQL) cleanupBatch(ctx context.Context, query string, retention time.Duration, limit int) (int64, bool, error) {
	tx, err := s.db.BeginTx(ctx, nil)
	if err != nil {
		return 0, false, fmt.Errorf("begin: %w", err)
	}
	defer func() { _ = tx.Rollback() }()
	if s.d.Queries.CleanupLock != "" {
		var ok bool
		if err := tx.QueryRowContext(ctx, s.d.Queries.CleanupLock).Scan(&ok); err != nil {
			return 0, false, fmt.Errorf("cleanup lock: %w", s.wrap(err))
		}
		if !ok {
			return 0, false, nil
		}
	}
	if s.d.Queries.CleanupBegin != "" {
		if _, err := tx.ExecContext(ctx, s.d.Queries.CleanupBegin); err != nil {
			return 0, true, fmt.Errorf("cleanup: %w", s.wrap(err))
		}
	}
	r, err := tx.ExecContext(ctx, query, retention.Milliseconds(), limit)
	if err != nil {
		return 0, true, fmt.Errorf("cleanup: %w", s.wrap(err))
	}
	n, err := r.RowsAffected()
	if err != nil {
		return 0, true, fmt.Errorf("cleanup: %w", err)
	}
	return n, true, tx.Commit()
}

// EffectRetryLater implements outbox.Store.
func (s *SQL) EffectRetryLater(ctx context.Context, src outbox.Source, reason string, delay time.Duration) error {
	_, err := s.db.ExecContext(ctx, s.d.Queries.EffectRetryLater, src.Consumer, src.ID, storableReason(reason), delay.Milliseconds())
	return s.wrap(err)
}

// EffectKeyBlocked implements outbox.Store.
func (s *SQL) EffectKeyBlocked(ctx context.Context, src outbox.Source, key string) (bool, error) {
	var blocked bool
	err := s.queryRow(ctx, nil, s.d.Queries.EffectKeyBlocked, []any{src.Consumer, src.ID, key}, &blocked)
	return blocked, err
}

// EffectHandToRelay implements outbox.Store.
func (s *SQL) EffectHandToRelay(ctx context.Context, src outbox.Source) error {
	_, err := s.db.ExecContext(ctx, s.d.Queries.EffectHandToRelay, src.Consumer, src.ID)
	return s.wrap(err)
}

// EffectNotify implements outbox.Store.
func (s *SQL) EffectNotify(ctx context.Context) error {
	if s.d.Notify == "" {
		return nil
	}
	_, err := s.db.ExecContext(ctx, s.d.Notify)
	return s.wrap(err)
}

// EffectListen implements outbox.Store.
func (s *SQL) EffectListen(ctx context.Context, wake func()) error {
	if s.d.Listen == nil {
		return outbox.ErrListenUnsupported
	}
	return s.d.Listen(ctx, wake)
}

// EffectListParked implements outbox.Store.
func (s *SQL) EffectListParked(ctx context.Context, limit int) ([]outbox.ParkedEffect, error) {
	rows, err := s.db.QueryContext(ctx, s.d.Queries.EffectListParked, limit)
	if err != nil {
		return nil, s.wrap(err)
	}
	defer rows.Close()
	var out []outbox.ParkedEffect
	for rows.Next() {
		var p outbox.ParkedEffect
		var md []byte
		var lastErr sql.NullString
		var pendingMS int64
		if err := rows.Scan(&p.StoreID, &p.Source.Consumer, &p.Source.ID, &p.Seq, &p.Kind, &p.Topic, &p.UUID,
			&p.Payload, &md, &p.OrderingKey, &p.Attempts, &pendingMS, &lastErr, &p.ParkedAt, &p.CreatedAt); err != nil {
			return nil, err
		}
		p.PendingFor = time.Duration(pendingMS) * time.Millisecond
		p.LastError = lastErr.String
		if p.Metadata, err = DecodeMetadata(md); err != nil {
			return nil, fmt.Errorf("effect %d: %w", p.StoreID, err)
		}
		out = append(out, p)
	}
	return out, rows.Err()
}

// EffectUnpark implements outbox.Store.
func (s *SQL) EffectUnpark(ctx context.Context, ids []int64) (int, error) {
	return s.eachID(ctx, s.d.Queries.EffectUnpark, ids)
}

// EffectDiscard implements outbox.Store.
func (s *SQL) EffectDiscard(ctx context.Context, ids []int64) (int, error) {
	return s.eachID(ctx, s.d.Queries.EffectDiscard, ids)
}

// eachID runs query for every id in one transaction and returns the rows it changed.
func (s *SQL) eachID(ctx context.Context, query string, ids []int64) (int, error) {
	tx, err := s.db.BeginTx(ctx, nil)
	if err != nil {
		return 0, fmt.Errorf("begin: %w", err)
	}
	defer func() { _ = tx.Rollback() }()
	total := 0
	for _, id := range ids {
		r, err := tx.ExecContext(ctx, query, id)
		if err != nil {
			return 0, s.wrap(err)
		}
		n, err := r.RowsAffected()
		if err != nil {
			return 0, err
		}
		total += int(n)
	}
	return total, tx.Commit()
}
