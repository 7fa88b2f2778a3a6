package store

import (
	"cmp"
	"context"
	"database/sql"
	"errors"
	"fmt"
	"math"
	"slices"
	"strings"
	"time"

	"github.com/watermill-outbox/outbox/outboxdriver"
)

var _ outboxdriver.DeadLetterStore = (*SQL)(nil)

// DeadLetterQueries are the statements of the dead letters; empty when the dialect keeps none.
type DeadLetterQueries struct {
	// Attempt (consumer, id, reason) counts a failed attempt as Queries.AttemptRecord does, in the
	// dead letter's transaction: it returns the count, or with AttemptRead set returns nothing and
	// AttemptRead (consumer, id) reads it.
	Attempt, AttemptRead string
	// Upsert (consumer, id, source topic, payload, metadata, reason, attempts, permanent, UUID or
	// "") stores a dead letter in state dead, replacing the one before (retried or discarded) if
	// any; an empty UUID keeps the one stored before.
	Upsert string
	// List (consumer or "", state or "", whole, limit) -> consumer, id, source topic, payload
	// and metadata (NULL unless whole),
	// reason, attempts, permanent, ms since dead, state, ms since changed (NULL allowed), changed
	// by, retries, UUID ("" when unknown); oldest first.
	List string
	// Mark (state, actor, consumer, id, retry limit) moves a dead letter in state dead that was
	// retried fewer times than the limit to state, counting a retry when state is retried; rows
	// affected.
	Mark string
	// Read (consumer, id) -> source topic, payload, metadata, UUID ("" when unknown).
	Read string
	// Count (count cap) -> dead letters in state dead, counted up to the cap.
	Count string
	// IsDead (consumer, id) -> 1 when that dead letter is in state dead, else 0.
	IsDead string
	// Redrivable (retry limit, ms dead at least, limit) -> consumer, id of the dead letters in
	// state dead that a redrive policy may retry (not permanent, retried fewer times than the
	// limit, with a source topic), oldest first; empty when the dialect has none.
	Redrivable string
	// Cleanup (retention ms, limit) deletes up to limit dead letters retried or discarded more
	// than retention ago; CleanupCount (retention ms) counts them for the dry run.
	Cleanup, CleanupCount string
	// Now (actor, consumer, id) marks the attempt counter of a message that is not processed
	// (nor dead-lettered, whose claim is poisoned) as to be dead-lettered at once, by actor; rows
	// affected. Requested (consumer, id) -> attempts, last error, who asked ('' when nobody) of
	// such a counter. Empty when the dialect cannot (outboxdriver.ErrDeadLetterNowUnsupported).
	Now, Requested string
}

func (s *SQL) deadLetters() (DeadLetterQueries, error) {
	q := s.d.DeadLetters
	if q.Upsert == "" {
		return q, outboxdriver.ErrDeadLettersUnsupported
	}
	return q, nil
}

// DeadLetterInsert implements outboxdriver.DeadLetterStore.
func (s *SQL) DeadLetterInsert(ctx context.Context, dl outboxdriver.DeadLetter, count bool, poison *outboxdriver.Effect) (int, error) {
	q, err := s.deadLetters()
	if err != nil {
		return 0, err
	}
	src := outboxdriver.Source{Consumer: dl.Consumer, ID: dl.MessageID}
	reason := outboxdriver.StorableText(dl.Reason)
	tx, err := s.BeginTx(ctx, nil)
	if err != nil {
		return 0, fmt.Errorf("begin: %w", err)
	}
	defer func() { _ = tx.Rollback() }()
	attempts := dl.Attempts
	if count {
		if attempts, err = s.deadLetterAttempt(ctx, tx, q, src, reason); err != nil {
			return 0, fmt.Errorf("count the failed attempt: %w", err)
		}
	}
	if _, err := tx.ExecContext(ctx, q.Upsert, dl.Consumer, dl.MessageID, outboxdriver.StorableText(dl.SourceTopic),
		nonNil(dl.Payload), EncodeMetadata(dl.Metadata), reason, attempts, dl.Permanent, dl.UUID); err != nil {
		return 0, fmt.Errorf("store the dead letter: %w", s.wrap(err))
	}
	res, err := tx.ExecContext(ctx, s.d.Queries.MessagePoison, dl.Consumer, dl.MessageID)
	if err != nil {
		return 0, fmt.Errorf("mark the claim poisoned: %w", s.wrap(err))
	}
	if n, err := res.RowsAffected(); err == nil && n == 0 && s.d.Queries.MessagePoisonedRead != "" {
		// A claim is there already: a poisoned one (the message dead-lettered before), or the
		// claim of a copy that was processed while this delivery failed (a copy the claim
		// waited for, one message read from two topics).
		var poisoned bool
		if err := tx.QueryRowContext(ctx, s.d.Queries.MessagePoisonedRead, dl.Consumer, dl.MessageID).Scan(&poisoned); err != nil {
			return 0, fmt.Errorf("read the claim found: %w", s.wrap(err))
		}
		if !poisoned {
			return 0, outboxdriver.ErrProcessedMeanwhile
		}
	}
	if poison != nil {
		effects := []outboxdriver.Effect{*poison}
		if _, err := s.effectInsert(ctx, tx, src, effects, false); err != nil {
			return 0, fmt.Errorf("store the copy for the poison topic: %w", err)
		}
		poison.StoreID = effects[0].StoreID
	}
	if err := tx.Commit(); err != nil {
		return 0, fmt.Errorf("commit the dead letter: %w", s.wrap(err))
	}
	return attempts, nil
}

var _ outboxdriver.PoisonStore = (*SQL)(nil)

// MessagePoisonWith implements outboxdriver.PoisonStore.
func (s *SQL) MessagePoisonWith(ctx context.Context, src outboxdriver.Source, poison *outboxdriver.Effect) error {
	tx, err := s.BeginTx(ctx, nil)
	if err != nil {
		return fmt.Errorf("begin: %w", err)
	}
	defer func() { _ = tx.Rollback() }()
	res, err := tx.ExecContext(ctx, s.d.Queries.MessagePoison, src.Consumer, src.ID)
	if err != nil {
		return fmt.Errorf("mark the claim poisoned: %w", s.wrap(err))
	}
	if n, err := res.RowsAffected(); err != nil {
		return fmt.Errorf("mark the claim poisoned: %w", s.wrap(err))
	} else if n == 0 {
		// A claim is there already: a copy's, processed while this delivery failed, or one
		// poisoned by a copy that failed too and sent its own copy to the poison topic.
		return outboxdriver.ErrProcessedMeanwhile
	}
	effects := []outboxdriver.Effect{*poison}
	if _, err := s.effectInsert(ctx, tx, src, effects, false); err != nil {
		return fmt.Errorf("store the copy for the poison topic: %w", err)
	}
	poison.StoreID = effects[0].StoreID
	if err := tx.Commit(); err != nil {
		return fmt.Errorf("commit the poisoned claim: %w", s.wrap(err))
	}
	return nil
}

func (s *SQL) deadLetterAttempt(ctx context.Context, tx *sql.Tx, q DeadLetterQueries, src outboxdriver.Source, reason string) (int, error) {
	var n int
	if q.AttemptRead == "" {
		if err := tx.QueryRowContext(ctx, q.Attempt, src.Consumer, src.ID, reason).Scan(&n); err != nil {
			return 0, s.wrap(err)
		}
		return n, nil
	}
	if _, err := tx.ExecContext(ctx, q.Attempt, src.Consumer, src.ID, reason); err != nil {
		return 0, s.wrap(err)
	}
	if err := tx.QueryRowContext(ctx, q.AttemptRead, src.Consumer, src.ID).Scan(&n); err != nil {
		return 0, s.wrap(err)
	}
	return n, nil
}

func nonNil(b []byte) []byte {
	if b == nil {
		return []byte{}
	}
	return b
}

// DeadLetterList implements outboxdriver.DeadLetterStore.
func (s *SQL) DeadLetterList(ctx context.Context, f outboxdriver.DeadLetterFilter) ([]outboxdriver.DeadLetter, error) {
	q, err := s.deadLetters()
	if err != nil {
		return nil, err
	}
	limit := f.Limit
	if limit <= 0 {
		limit = 100
	}
	rows, err := s.db.QueryContext(ctx, q.List, f.Consumer, string(f.State), !f.Brief, limit)
	if err != nil {
		return nil, fmt.Errorf("list dead letters: %w", s.wrap(err))
	}
	defer rows.Close()
	now := time.Now()
	var out []outboxdriver.DeadLetter
	for rows.Next() {
		var (
			d         outboxdriver.DeadLetter
			topic     []byte
			md        []byte
			permanent bool
			deadMs    int64
			state     string
			changedMs sql.NullInt64
		)
		if err := rows.Scan(&d.Consumer, &d.MessageID, &topic, &d.Payload, &md, &d.Reason, &d.Attempts, &permanent,
			&deadMs, &state, &changedMs, &d.ChangedBy, &d.Retries, &d.UUID); err != nil {
			return nil, fmt.Errorf("list dead letters: %w", s.wrap(err))
		}
		d.SourceTopic = string(topic)
		if d.Metadata, err = DecodeMetadata(md); err != nil {
			return nil, fmt.Errorf("dead letter %q of %q: metadata: %w", d.MessageID, d.Consumer, err)
		}
		d.Permanent = permanent
		d.DeadAt = now.Add(-time.Duration(deadMs) * time.Millisecond)
		d.State = outboxdriver.DeadLetterState(state)
		if changedMs.Valid {
			d.ChangedAt = now.Add(-time.Duration(changedMs.Int64) * time.Millisecond)
		}
		out = append(out, d)
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("list dead letters: %w", s.wrap(err))
	}
	return out, nil
}

// DeadLetterRetry implements outboxdriver.DeadLetterStore.
func (s *SQL) DeadLetterRetry(ctx context.Context, c outboxdriver.DeadLetterChange, newSource func() outboxdriver.Source) (int, error) {
	return s.DeadLetterRetryAudited(ctx, c, newSource, nil)
}

// DeadLetterDiscard implements outboxdriver.DeadLetterStore.
func (s *SQL) DeadLetterDiscard(ctx context.Context, c outboxdriver.DeadLetterChange) (int, error) {
	return s.DeadLetterDiscardAudited(ctx, c, nil)
}

// DeadLetterRetryAudited is DeadLetterRetry that writes the entry audit returns (when audit is
// not nil) in the transaction of each retry, so that none is made without its entry.
func (s *SQL) DeadLetterRetryAudited(ctx context.Context, c outboxdriver.DeadLetterChange, newSource func() outboxdriver.Source, audit func(key outboxdriver.Source) Audit) (int, error) {
	q, err := s.deadLetters()
	if err != nil {
		return 0, err
	}
	return s.eachDeadLetter(ctx, c, outboxdriver.DeadLetterRetried, audit, func(tx *sql.Tx, key outboxdriver.Source) error {
		var (
			topic, payload, md []byte
			uuid               string
		)
		if err := tx.QueryRowContext(ctx, q.Read, key.Consumer, key.ID).Scan(&topic, &payload, &md, &uuid); err != nil {
			return fmt.Errorf("read the dead letter: %w", s.wrap(err))
		}
		if len(topic) == 0 {
			return errors.New("its source topic is unknown, it cannot be retried (discard it)")
		}
		metadata, err := DecodeMetadata(md)
		if err != nil {
			return fmt.Errorf("metadata: %w", err)
		}
		if _, err := tx.ExecContext(ctx, s.d.Queries.MessageReplay, key.Consumer, key.ID); err != nil {
			return fmt.Errorf("delete the poisoned claim: %w", s.wrap(err))
		}
		if _, err := tx.ExecContext(ctx, s.d.Queries.AttemptDelete, key.Consumer, key.ID); err != nil {
			return fmt.Errorf("reset the attempts: %w", s.wrap(err))
		}
		if uuid == "" {
			uuid = key.ID // stored before its UUID was kept: by default the message's ID is its UUID
		}
		// Every consumer group of the topic receives the copy: addressed, it runs in this
		// consumer only (past Retention, the others no longer know they processed it).
		if metadata == nil {
			metadata = map[string]string{}
		}
		metadata[outboxdriver.MetadataRetryFor] = key.Consumer
		src := newSource()
		e := []outboxdriver.Effect{{
			Kind: outboxdriver.KindPublish, Topic: string(topic), UUID: uuid, Payload: nonNil(payload), Metadata: metadata,
			Source: src, OrderingKey: outboxdriver.DefaultOrderingKey(src),
		}}
		if _, err := s.effectInsert(ctx, tx, src, e, false); err != nil {
			return fmt.Errorf("store the message for its topic: %w", err)
		}
		// Due for the relay at once, not after the grace period a unit of work's effects get
		// for their own dispatch: nothing else sends it.
		if _, err := tx.ExecContext(ctx, s.d.Queries.EffectHandToRelay, src.Consumer, src.ID); err != nil {
			return fmt.Errorf("hand the message to the relay: %w", s.wrap(err))
		}
		return nil
	})
}

// DeadLetterDiscardAudited is DeadLetterDiscard with its audit entries written as
// DeadLetterRetryAudited's.
func (s *SQL) DeadLetterDiscardAudited(ctx context.Context, c outboxdriver.DeadLetterChange, audit func(key outboxdriver.Source) Audit) (int, error) {
	if _, err := s.deadLetters(); err != nil {
		return 0, err
	}
	return s.eachDeadLetter(ctx, c, outboxdriver.DeadLetterDiscarded, audit, nil)
}

// eachDeadLetter moves each dead letter of c in state dead to state, in a transaction of its
// own with then (when not nil) and its audit entry, and returns how many it moved. Those not in
// state dead are skipped: a retry or discard that ran twice changes nothing the second time.
func (s *SQL) eachDeadLetter(ctx context.Context, c outboxdriver.DeadLetterChange, state outboxdriver.DeadLetterState,
	audit func(outboxdriver.Source) Audit, then func(*sql.Tx, outboxdriver.Source) error) (int, error) {
	keys := slices.Clone(c.Keys)
	slices.SortFunc(keys, func(a, b outboxdriver.Source) int {
		return cmp.Or(strings.Compare(a.Consumer, b.Consumer), strings.Compare(a.ID, b.ID))
	})
	keys = slices.Compact(keys)
	limit := noRetryLimit
	if c.MaxRetries > 0 && state == outboxdriver.DeadLetterRetried {
		limit = c.MaxRetries
	}
	changed := 0
	for _, key := range keys {
		ok, err := s.oneDeadLetter(ctx, c.Actor, state, limit, key, audit, then)
		if err != nil {
			return changed, fmt.Errorf("dead letter %q of %q: %w", key.ID, key.Consumer, err)
		}
		if ok {
			changed++
		}
	}
	return changed, nil
}

// noRetryLimit is the retry limit of Mark when there is none (an operator's retry, a discard).
const noRetryLimit = math.MaxInt32

func (s *SQL) oneDeadLetter(ctx context.Context, actor string, state outboxdriver.DeadLetterState, limit int, key outboxdriver.Source,
	audit func(outboxdriver.Source) Audit, then func(*sql.Tx, outboxdriver.Source) error) (bool, error) {
	tx, err := s.BeginTx(ctx, nil)
	if err != nil {
		return false, fmt.Errorf("begin: %w", err)
	}
	defer func() { _ = tx.Rollback() }()
	// The mark comes first: it locks the row, so that two operators retrying the same dead letter
	// at once hand it back once. It checks the retry limit on the row it moves: a redriver that
	// read the count before another's retry (and the message's death since) retries nothing.
	r, err := tx.ExecContext(ctx, s.d.DeadLetters.Mark, string(state), outboxdriver.StorableText(actor), key.Consumer, key.ID, limit)
	if err != nil {
		return false, fmt.Errorf("mark %s: %w", state, s.wrap(err))
	}
	n, err := r.RowsAffected()
	if err != nil {
		return false, err
	}
	if n == 0 {
		return false, nil
	}
	if then != nil {
		if err := then(tx, key); err != nil {
			return false, err
		}
	}
	if audit != nil {
		a := audit(key)
		if err := s.writeAudit(ctx, tx, &a); err != nil {
			return false, err
		}
	}
	if err := tx.Commit(); err != nil {
		return false, fmt.Errorf("commit: %w", s.wrap(err))
	}
	return true, nil
}

var _ outboxdriver.DeadLetterNowStore = (*SQL)(nil)

// DeadLetterNow implements outboxdriver.DeadLetterNowStore.
func (s *SQL) DeadLetterNow(ctx context.Context, src outboxdriver.Source, actor string) (bool, error) {
	return s.DeadLetterNowAudited(ctx, src, actor, nil)
}

// DeadLetterNowAudited is DeadLetterNow that writes the entry audit returns (when audit is not
// nil) in the transaction of the request.
func (s *SQL) DeadLetterNowAudited(ctx context.Context, src outboxdriver.Source, actor string, audit func() Audit) (bool, error) {
	q := s.d.DeadLetters
	if q.Now == "" {
		return false, outboxdriver.ErrDeadLetterNowUnsupported
	}
	tx, err := s.BeginTx(ctx, nil)
	if err != nil {
		return false, fmt.Errorf("begin: %w", err)
	}
	defer func() { _ = tx.Rollback() }()
	r, err := tx.ExecContext(ctx, q.Now, outboxdriver.StorableText(actor), src.Consumer, src.ID)
	if err != nil {
		return false, fmt.Errorf("mark the attempts of %q of %q: %w", src.ID, src.Consumer, s.wrap(err))
	}
	n, err := r.RowsAffected()
	if err != nil || n == 0 {
		return false, err
	}
	if audit != nil {
		a := audit()
		if err := s.writeAudit(ctx, tx, &a); err != nil {
			return false, err
		}
	}
	if err := tx.Commit(); err != nil {
		return false, fmt.Errorf("commit: %w", s.wrap(err))
	}
	return true, nil
}

// DeadLetterRequested implements outboxdriver.DeadLetterNowStore.
func (s *SQL) DeadLetterRequested(ctx context.Context, src outboxdriver.Source) (outboxdriver.DeadLetterRequest, error) {
	var r outboxdriver.DeadLetterRequest
	q := s.d.DeadLetters
	if q.Requested == "" {
		return r, nil // nobody can have asked
	}
	err := s.db.QueryRowContext(ctx, q.Requested, src.Consumer, src.ID).Scan(&r.Attempts, &r.LastError, &r.By)
	if errors.Is(err, sql.ErrNoRows) {
		return r, nil
	}
	if err != nil {
		return r, fmt.Errorf("read the attempts of %q of %q: %w", src.ID, src.Consumer, s.wrap(err))
	}
	return r, nil
}

// DeadLetterIsDead tells whether the dead letter of key is in state dead (what a retry or a
// discard of it would change), by its key: a dry run of either is then right however many dead
// letters its consumer has.
func (s *SQL) DeadLetterIsDead(ctx context.Context, key outboxdriver.Source) (bool, error) {
	q, err := s.deadLetters()
	if err != nil {
		return false, err
	}
	if q.IsDead == "" {
		return false, fmt.Errorf("look up a dead letter: %w", errors.ErrUnsupported)
	}
	var n int
	if err := s.db.QueryRowContext(ctx, q.IsDead, key.Consumer, key.ID).Scan(&n); err != nil {
		return false, fmt.Errorf("look up the dead letter %q of %q: %w", key.ID, key.Consumer, s.wrap(err))
	}
	return n > 0, nil
}

// DeadLetterRedrivable implements outboxdriver.DeadLetterRedriver.
func (s *SQL) DeadLetterRedrivable(ctx context.Context, maxRetries int, deadFor time.Duration, limit int) ([]outboxdriver.Source, error) {
	q, err := s.deadLetters()
	if err != nil {
		return nil, err
	}
	if q.Redrivable == "" {
		return nil, fmt.Errorf("list the dead letters to redrive: %w", errors.ErrUnsupported)
	}
	rows, err := s.db.QueryContext(ctx, q.Redrivable, maxRetries, deadFor.Milliseconds(), limit)
	if err != nil {
		return nil, fmt.Errorf("list the dead letters to redrive: %w", s.wrap(err))
	}
	defer rows.Close()
	var keys []outboxdriver.Source
	for rows.Next() {
		var k outboxdriver.Source
		if err := rows.Scan(&k.Consumer, &k.ID); err != nil {
			return nil, fmt.Errorf("list the dead letters to redrive: %w", err)
		}
		keys = append(keys, k)
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("list the dead letters to redrive: %w", s.wrap(err))
	}
	return keys, nil
}

// DeadLetterCount implements outboxdriver.DeadLetterStore.
func (s *SQL) DeadLetterCount(ctx context.Context) (int, error) {
	q, err := s.deadLetters()
	if err != nil {
		return 0, err
	}
	var n int
	if err := s.db.QueryRowContext(ctx, q.Count, outboxdriver.StatsCountCap).Scan(&n); err != nil {
		if errors.Is(err, sql.ErrNoRows) {
			return 0, nil
		}
		return 0, fmt.Errorf("count dead letters: %w", s.wrap(err))
	}
	return n, nil
}
