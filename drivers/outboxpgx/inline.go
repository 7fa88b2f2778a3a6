package outboxpgx

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/watermill-outbox/outbox/outboxdriver"
	"github.com/watermill-outbox/outbox/store"
)

// sweepBatch bounds the claims one sweep moves to effect rows.
const sweepBatch = 500

// EffectListPending returns the effect rows of src and then its inline effects (StoreID 0), read
// in one round trip.
func (s *pgxStore) EffectListPending(ctx context.Context, src outboxdriver.Source) ([]outboxdriver.Effect, error) {
	if !s.optimistic {
		return s.Store.EffectListPending(ctx, src)
	}
	b := &pgx.Batch{}
	b.Queue(s.q.pending, src.Consumer, src.ID)
	b.Queue(s.q.listInline, src.Consumer, src.ID)
	br := s.pool.SendBatch(ctx, b)
	effects, err := scanPending(br)
	var blob []byte
	var ms int64
	if err == nil {
		switch err = br.QueryRow().Scan(&blob, &ms); {
		case errors.Is(err, pgx.ErrNoRows):
			err = nil
		case err == nil:
			var inline []outboxdriver.Effect
			if inline, err = decode(blob, src, ms); err == nil {
				effects = append(effects, inline...)
			}
		}
	}
	if cerr := br.Close(); err == nil {
		err = cerr
	}
	return effects, wrap(err)
}

// scanPending reads the effect rows of the batch's next query.
func scanPending(br pgx.BatchResults) ([]outboxdriver.Effect, error) {
	rows, err := br.Query()
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	var out []outboxdriver.Effect
	for rows.Next() {
		var e outboxdriver.Effect
		if err := store.ScanEffect(rows, &e); err != nil {
			return nil, err
		}
		out = append(out, e)
	}
	return out, rows.Err()
}

func decode(blob []byte, src outboxdriver.Source, ageMS int64) ([]outboxdriver.Effect, error) {
	effects, err := store.DecodeEffects(blob, src)
	if err != nil {
		return nil, fmt.Errorf("inline effects of %q for %q: %w", src.ID, src.Consumer, err)
	}
	age := time.Duration(ageMS) * time.Millisecond
	for i := range effects {
		effects[i].PendingFor = age
		effects[i].StoredAt = time.Now().Add(-age)
	}
	return effects, nil
}

// EffectMarkDispatched clears the inline effects of the marks with Inline (one HOT update per
// claim, all in one statement) and marks the effect rows of the others as the postgres driver does.
func (s *pgxStore) EffectMarkDispatched(ctx context.Context, marks ...outboxdriver.DispatchMark) error {
	var rows []outboxdriver.DispatchMark
	var consumers, ids []string
	for _, m := range marks {
		if m.Inline {
			consumers, ids = append(consumers, m.Source.Consumer), append(ids, m.Source.ID)
		}
		if len(m.StoreIDs) > 0 {
			rows = append(rows, m)
		}
	}
	var errs []error
	if len(rows) > 0 {
		errs = append(errs, s.Store.EffectMarkDispatched(ctx, rows...))
	}
	switch {
	case len(consumers) == 0:
	case s.deleteDispatched:
		if _, err := s.pool.Exec(ctx, s.q.markInline, consumers, ids); err != nil {
			errs = append(errs, fmt.Errorf("clear inline effects: %w", wrap(err)))
		}
	default:
		// Kept for EffectRetention: they move to the dispatched table as rows would.
		if err := s.move(ctx, s.q.archive, func(tx pgx.Tx) (pgx.Rows, error) {
			return tx.Query(ctx, s.q.takeInline, consumers, ids)
		}, nil); err != nil {
			errs = append(errs, fmt.Errorf("archive inline effects: %w", err))
		}
	}
	return errors.Join(errs...)
}

// EffectMaterialize implements outboxdriver.InlineStore.
func (s *pgxStore) EffectMaterialize(ctx context.Context, src outboxdriver.Source, lease time.Duration) ([]outboxdriver.Effect, error) {
	if err := s.move(ctx, s.q.materialize, func(tx pgx.Tx) (pgx.Rows, error) {
		return tx.Query(ctx, s.q.lockInline, src.Consumer, src.ID)
	}, func(tx pgx.Tx, n int) error {
		if n == 0 || lease <= 0 {
			return nil
		}
		_, err := tx.Exec(ctx, s.q.leaseSource, src.Consumer, src.ID, lease.Milliseconds())
		return err
	}); err != nil {
		return nil, err
	}
	return s.Store.EffectListPending(ctx, src)
}

// move runs, in one transaction, lock (which returns the claims to move, locked: consumer, id,
// inline effects, age in ms), inserts their effects with insert (as effect rows: materialize;
// as dispatched rows: archive), clears them from the claims, and calls after (if not nil) with
// how many claims it moved.
func (s *pgxStore) move(ctx context.Context, insert string, lock func(pgx.Tx) (pgx.Rows, error), after func(tx pgx.Tx, n int) error) error {
	var undecodable []error
	err := pgx.BeginFunc(ctx, s.pool, func(tx pgx.Tx) error {
		rows, err := lock(tx)
		if err != nil {
			return wrap(err)
		}
		var cols struct {
			c, i, k, t, u, ok []string
			seq               []int32
			pl, md            [][]byte
			age               []int64
		}
		var consumers, ids []string
		for rows.Next() {
			var src outboxdriver.Source
			var blob []byte
			var ms int64
			if err := rows.Scan(&src.Consumer, &src.ID, &blob, &ms); err != nil {
				rows.Close()
				return err
			}
			effects, err := store.DecodeEffects(blob, src)
			if err != nil {
				// Left where it is (and reported), so that the others move.
				undecodable = append(undecodable, fmt.Errorf("inline effects of %q for %q: %w", src.ID, src.Consumer, err))
				continue
			}
			consumers, ids = append(consumers, src.Consumer), append(ids, src.ID)
			for _, e := range effects {
				cols.c, cols.i, cols.seq = append(cols.c, src.Consumer), append(cols.i, src.ID), append(cols.seq, int32(e.Seq))
				cols.k, cols.t, cols.u = append(cols.k, e.Kind), append(cols.t, e.Topic), append(cols.u, e.UUID)
				cols.pl, cols.md = append(cols.pl, e.Payload), append(cols.md, store.EncodeMetadata(e.Metadata))
				cols.ok, cols.age = append(cols.ok, e.OrderingKey), append(cols.age, ms)
			}
		}
		rows.Close()
		if err := rows.Err(); err != nil {
			return wrap(err)
		}
		if len(consumers) > 0 {
			b := &pgx.Batch{}
			if len(cols.c) > 0 {
				b.Queue(insert, cols.c, cols.i, cols.seq, cols.k, cols.t, cols.u, cols.pl, cols.md, cols.ok, cols.age)
			}
			b.Queue(s.q.clearInline, consumers, ids)
			if err := tx.SendBatch(ctx, b).Close(); err != nil {
				return fmt.Errorf("move inline effects to rows: %w", wrap(err))
			}
		}
		if after != nil {
			return after(tx, len(consumers)+len(undecodable))
		}
		return nil
	})
	return errors.Join(append(undecodable, err)...)
}

// EffectClaimDue first moves the inline effects left behind (their claim older than p.Grace and
// still holding them: a crash between commit and mark, a dispatch that failed before they could
// be moved) into effect rows, at most every quarter of the grace period, and then claims as the
// postgres driver does.
func (s *pgxStore) EffectClaimDue(ctx context.Context, p outboxdriver.EffectClaimParams) (outboxdriver.EffectClaim, error) {
	if s.optimistic && p.After == 0 {
		// A failed sweep must not stop the relay from sending the effect rows: it is reported,
		// and the next one tries again (its watermark stays where it was).
		if err := s.sweep(ctx, p.Grace); err != nil && ctx.Err() == nil && s.onError != nil {
			s.onError("moving inline effects left behind to the relay", err)
		}
	}
	return s.Store.EffectClaimDue(ctx, p)
}

// sweepTimeout bounds one sweep: it locks nothing it has to wait for (claims locked by others are
// left for the next one), but the pool and the database may be slow.
var sweepTimeout = 30 * time.Second

// sweep moves the inline effects of claims written between the last sweep (less the horizon
// within which a claim may become visible late) and now - grace into rows. Claims locked by
// another transaction (a mark clearing them, an operator) are skipped, and then the watermark
// stays where it was, so that the next sweep looks at them again.
func (s *pgxStore) sweep(ctx context.Context, grace time.Duration) error {
	every := max(grace/4, 100*time.Millisecond)
	last := s.lastSweep.Load()
	if time.Since(time.Unix(0, last)) < every || !s.lastSweep.CompareAndSwap(last, time.Now().UnixNano()) {
		return nil
	}
	ctx, cancel := context.WithTimeout(ctx, sweepTimeout)
	defer cancel()
	ms := grace.Milliseconds()
	for {
		moved := 0
		err := s.move(ctx, s.q.materialize, func(tx pgx.Tx) (pgx.Rows, error) {
			return tx.Query(ctx, s.q.sweep, ms, sweepBatch)
		}, func(tx pgx.Tx, n int) error {
			moved = n
			var left bool
			if err := tx.QueryRow(ctx, s.q.sweepLeft, ms).Scan(&left); err != nil || left {
				return err // more to move, or some skipped: the watermark stays
			}
			_, err := tx.Exec(ctx, s.q.sweptTo, ms)
			return err
		})
		if err != nil {
			if ctx.Err() != nil {
				return fmt.Errorf("sweep of the claims with inline effects left behind (at most %s): %w", sweepTimeout, err)
			}
			return err
		}
		if moved < sweepBatch {
			return nil
		}
	}
}
