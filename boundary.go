package outbox

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/google/uuid"
)

// InTx runs fn in a new transaction for code that has no incoming message (an HTTP handler, a job):
// outbox.Publish and outbox.Record work in ctx as they do in a wrapped handler. If fn returns nil
// the transaction commits and the side effects are dispatched at once, in the caller's goroutine;
// if that dispatch fails (or panics), the relay retries them (the commit stands and InTx returns
// nil). If fn returns an error, the transaction rolls back, nothing is sent, and the error is
// returned; if fn panics, the transaction rolls back, nothing is sent, and the panic goes on.
// The transaction is not bound to ctx (a cancelled request cannot roll back a commit half way);
// fn's statements run with ctx as the caller passes it. Config.HandlerTimeout bounds the
// transaction (the wait for a connection included), as it bounds a handler's.
func (o *Outbox) InTx(ctx context.Context, fn func(ctx context.Context, tx *sql.Tx) error) (err error) {
	ctx, span := o.tel.tracer.Start(ctx, "outbox InTx")
	defer func() { endSpan(span, err) }()
	txCtx, cancel := context.WithTimeout(context.WithoutCancel(ctx), o.cfg.HandlerTimeout)
	defer cancel()
	tx, err := o.db.BeginTx(txCtx, nil)
	if err != nil {
		return fmt.Errorf("outbox: begin transaction (waiting for a database connection, at most HandlerTimeout): %w", err)
	}
	u := newUnit(o, tx, Source{ID: uuid.NewString()}, nil)
	if err := callInTx(withUnit(ctx, u), tx, fn); err != nil {
		u.finish()
		if rbErr := tx.Rollback(); rbErr != nil && !errors.Is(rbErr, sql.ErrTxDone) {
			return fmt.Errorf("%w (rollback: %w)", err, rbErr)
		}
		return err
	}
	effects, err := u.committedEffects(txCtx)
	if err != nil {
		_ = tx.Rollback()
		return err
	}
	if err := tx.Commit(); err != nil {
		switch {
		case txCtx.Err() != nil && (errors.Is(err, sql.ErrTxDone) || errors.Is(err, context.DeadlineExceeded)):
			return timedOut(err, o.cfg.HandlerTimeout)
		case errors.Is(err, sql.ErrTxDone):
			return ErrTxFinishedByHandler
		}
		return fmt.Errorf("outbox: commit: %w", err)
	}
	if err := o.failpoint(ctx, FailpointAfterCommit); err != nil {
		return err
	}
	// This transaction is known to have committed: its effects are sent from memory.
	committed := time.Now()
	for i := range effects {
		effects[i].PendingFor = committed.Sub(u.begun)
		effects[i].StoredAt = committed
	}
	o.dispatchBoundary(context.WithoutCancel(ctx), u.src, effects, true)
	return nil
}

// callInTx calls fn; if fn panics, the transaction is rolled back before the panic goes on.
func callInTx(ctx context.Context, tx *sql.Tx, fn func(ctx context.Context, tx *sql.Tx) error) (err error) {
	panicked := true
	defer func() {
		if panicked {
			_ = tx.Rollback()
		}
	}()
	err = fn(ctx, tx)
	panicked = false
	return err
}

// JoinTx attaches a unit of work to a transaction the caller owns: side effects recorded with the
// returned context are stored in tx. After committing tx, call dispatch to send them at once; if
// the caller never calls it (or crashes first), the relay sends them after Config.RelayGrace. If tx
// rolled back, dispatch sends nothing. Because the outcome of a transaction the caller owns cannot
// be seen from here, dispatch reads back what was committed: one query more than InTx.
func (o *Outbox) JoinTx(ctx context.Context, tx *sql.Tx) (context.Context, func(context.Context)) {
	u := newUnit(o, tx, Source{ID: uuid.NewString()}, nil)
	return withUnit(ctx, u), func(ctx context.Context) {
		if len(u.finish()) == 0 {
			return
		}
		committed, _, err := o.listPending(ctx, u.src)
		if err != nil {
			o.logger.Error("Reading back committed side effects failed; the relay sends them after the grace period", err,
				watermill.LogFields{"boundary_id": u.src.ID})
			return
		}
		o.dispatchBoundary(ctx, u.src, committed, false)
	}
}

// dispatchBoundary is the fast path at the boundary (inTx: the span in ctx is InTx's). On failure the effects are handed to the
// relay as due for a retry, so that they do not wait for the grace period.
func (o *Outbox) dispatchBoundary(ctx context.Context, src Source, effects []Effect, inTx bool) {
	if len(effects) == 0 {
		return
	}
	fields := watermill.LogFields{"boundary_id": src.ID, "effects": len(effects)}
	if blocked, err := o.keyBlocked(ctx, src, effects); err != nil || blocked {
		if err != nil {
			o.logger.Error("Checking ordering keys failed; the relay sends the effects", err, fields)
		}
		if err := o.handToRelay(ctx, src); err != nil {
			o.logger.Error("Handing effects to the relay failed; it sends them after the grace period", err, fields)
		}
		return
	}
	ctx, traced := o.tel.startDispatch(ctx, PathCommit, effects, inTx)
	sent, failed, err := o.dispatch(ctx, PathCommit, effects)
	traced(err)
	o.marks.add(src, effects[:sent], false) // a boundary transaction has no claim
	if err != nil {
		o.logger.Error("Dispatch after commit failed; the relay will retry", err, fields)
		if failed > 0 {
			o.dispatchFailed(ctx, src, effects, sent, failed, err)
		}
	}
}
