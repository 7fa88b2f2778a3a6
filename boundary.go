package outbox

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill"

	"github.com/watermill-outbox/outbox/outboxdriver"
)

// InTx runs fn in a new transaction for code that has no incoming message (an HTTP handler, a job):
// outbox.Publish and outbox.Record work in ctx as they do in a wrapped handler. If fn returns nil
// the transaction commits and the side effects are dispatched at once, in the caller's goroutine;
// if that dispatch fails (or panics), the relay retries them (the commit stands and InTx returns
// nil). If fn returns an error, the transaction rolls back, nothing is sent, and the error is
// returned; if fn panics, the transaction rolls back, nothing is sent, and the panic goes on.
// The transaction is not bound to ctx (a cancelled request cannot roll back a commit half way);
// fn's statements run with ctx as the caller passes it. Config.HandlerTimeout bounds the
// transaction (the wait for a connection included), as it bounds a handler's. The wait for a
// connection also ends when ctx does: InTx then returns an error wrapping ctx's, and fn does not
// run.
func (o *Outbox) InTx(ctx context.Context, fn func(ctx context.Context, tx *sql.Tx) error) error {
	return o.InUnit(ctx, func(ctx context.Context) error {
		tx, ok := TxOK(ctx)
		if !ok {
			t, _ := TxOf(ctx)
			return fmt.Errorf("outbox.InTx: %w: the driver runs units of work on a %T (use its InTx)", ErrNoUnitOfWork, t)
		}
		return fn(ctx, tx)
	})
}

// InUnit is InTx for any driver: fn finds the transaction in its context, with Tx for
// database/sql or with the driver package's accessor (the pgx driver's InTx builds on it).
// Inside a handler's unit of work it returns an error wrapping ErrNestedUnitOfWork: the
// handler's own transaction is the one to write through. So does a keyed call (WithIdempotencyKey)
// inside any unit of work, keyed or not: its key would commit without the outer unit.
func (o *Outbox) InUnit(ctx context.Context, fn func(ctx context.Context) error) (err error) {
	growStack() // see Handle
	if outer := unitFrom(ctx); outer != nil && outer.incoming != nil {
		// A transaction of its own would commit even when the message's rolls back, and again,
		// with new effect UUIDs, on every retry of the message.
		return fmt.Errorf("%w: InTx called inside the unit of work of consumer %q (message %q) would open an independent transaction; "+
			"write through outbox.Tx (outboxpgx.Tx with pgx) and record with outbox.Publish instead", ErrNestedUnitOfWork, outer.src.Consumer, outer.src.ID)
	}
	if outer, k := unitFrom(ctx), keyedFrom(ctx); outer != nil && k != nil {
		if outer.key != nil && k.scope == outer.key.scope && k.key == outer.key.key {
			// It would claim the key the outer unit holds: refused at once, or waited for until
			// HandlerTimeout with WaitInFlight.
			return fmt.Errorf("%w: InTx called inside the keyed unit of work of idempotency key %q would claim its key again; "+
				"write through the outer unit's transaction", ErrNestedUnitOfWork, outer.key.key)
		}
		// Its key would commit with its own transaction, not with the outer one: when the outer
		// unit rolls back, a retry of the request replays the inner result and the outer work is
		// never done.
		return fmt.Errorf("%w: InTx with idempotency key %q called inside another unit of work would commit its key on its own; "+
			"write through the outer unit's transaction", ErrNestedUnitOfWork, k.key)
	}
	ctx, span := o.tel.tracer.Start(ctx, "outbox InTx")
	defer func() {
		if r := recover(); r != nil {
			// The span says the unit failed (its error was nil), and the panic goes on.
			endSpan(span, fmt.Errorf("outbox: InTx: fn panicked: %v", r))
			panic(r)
		}
		endSpan(span, err)
	}()
	// Every unit counts by its outcome; a panic in fn (re-panicking) counts as rolled back.
	outcome := OutcomeRolledBack
	// Either way the member is in use: its statistics sampling keeps its pace (see busy).
	defer func() {
		o.tel.boundaryUnits.Add(ctx, 1, o.tel.attrs(AttrOutcome, outcome, "", ""))
		o.busy.Wake()
	}()
	// While the database is unreachable the unit waits for it without a connection, on a
	// HandlerTimeout of its own and while ctx lasts (see dbGate).
	if err := o.waitForDatabase(ctx); err != nil {
		outcome = OutcomeFailed
		return err
	}
	after := context.WithoutCancel(ctx)
	txCtx, cancel := context.WithTimeout(after, o.cfg.HandlerTimeout)
	defer cancel()
	key := keyedFrom(ctx)
	if key != nil {
		key.reset()
		if err := key.validate(); err != nil {
			outcome = OutcomeFailed
			return err
		}
	}
	var tx outboxdriver.UnitTx
	var endTx context.CancelFunc // ends the context tx is bound to, once tx has ended
	var release func()           // wakes the retries of this process waiting for the key this unit holds
	var u *unit                  // the unit fn runs in, once it does
	// A panic on the way (in fn, or in a store or driver step) rolls the transaction back before it
	// goes on, so that the connection goes back to the pool, and with it, on MySQL, the session
	// lock of a claimed key. On every other path the unit has ended by then: a no-op.
	defer func() {
		if u != nil {
			// A goroutine of fn that records after a panic gets ErrUnitOfWorkFinished, as after
			// any other end, not a store error on a rolled-back transaction.
			u.finish()
		}
		if tx != nil {
			_ = tx.Rollback(after)
		}
		if endTx != nil {
			endTx()
		}
		if release != nil {
			release()
		}
	}()
	// A retry that waits for the unit holding its key (WaitInFlight) waits without a connection:
	// it rolls back, waits, and begins again. Waiting in the store held a pooled connection per
	// waiter for up to HandlerTimeout, so that a few retries of one key starved a small pool.
	waited := false // a retry has found its key held and waited for it
	for wait := keyPollFirst; ; wait = min(2*wait, keyPollMax) {
		if endTx != nil {
			endTx() // the previous try's transaction has rolled back
		}
		tx, endTx, err = o.beginBoundary(ctx, txCtx)
		if err != nil {
			tx = nil
			outcome = OutcomeFailed
			if waited {
				// The wait ended during a look, not between two: still the wait's end.
				err = key.waitEnded(ctx, txCtx, o.cfg.HandlerTimeout, err)
				outcome = keyOutcome(err)
			}
			return err
		}
		if key == nil {
			break
		}
		run, err := o.runKeyed(ctx, txCtx, tx, key)
		if err == nil && run {
			release = o.keysHeld.hold(key.scope, key.key)
			break
		}
		_ = tx.Rollback(after)
		if key.wait && errors.Is(err, ErrIdempotencyInFlight) {
			waited = true
			if err = o.waitKey(ctx, txCtx, key, wait); err == nil {
				continue
			}
		} else if waited && err != nil {
			err = key.waitEnded(ctx, txCtx, o.cfg.HandlerTimeout, err)
		}
		outcome = OutcomeReplayed
		if err != nil {
			outcome = keyOutcome(err)
		}
		return err
	}
	u = newUnit(o, tx, Source{ID: newID()}, nil)
	if key != nil {
		u.key = key
	}
	// fn's context ends with the unit (HandlerTimeout), as a consumer handler's does: past it
	// the transaction is rolled back and a held key free again, and an fn that went on (a call
	// out) would run beside a retry with its key.
	deadline, _ := txCtx.Deadline()
	fnCtx, cancelFn := context.WithDeadline(ctx, deadline)
	err = fn(withUnit(fnCtx, u))
	cancelFn()
	if err != nil {
		u.finish()
		// A unit whose context ended (the caller gave up, or HandlerTimeout) or whose effects the
		// store did not take could not finish: the database, not the application, said no. A
		// stalled database shows this way first, since fn's statements wait on it.
		if ctx.Err() != nil || txCtx.Err() != nil || u.storeRefused() {
			outcome = OutcomeFailed
		}
		if txCtx.Err() != nil && ctx.Err() == nil {
			err = timedOut(err, o.cfg.HandlerTimeout)
		}
		switch rbErr := tx.Rollback(after); {
		case rbErr == nil:
		case errors.Is(rbErr, sql.ErrTxDone) && txCtx.Err() == nil && !errors.Is(err, ErrTxFinishedByHandler):
			// fn ended the transaction itself: a COMMIT of its own committed what it wrote, which
			// fn's error alone would deny (a caller that retries would do it twice).
			return fmt.Errorf("%w (fn returned: %w)", ErrTxFinishedByHandler, err)
		case errors.Is(rbErr, sql.ErrTxDone):
		default:
			return fmt.Errorf("%w (rollback: %w)", err, rbErr)
		}
		return err
	}
	outcome = OutcomeFailed
	effects, err := u.committedEffects(txCtx)
	if err == nil && key != nil {
		err = o.saveKeyed(txCtx, tx, u)
	}
	if err != nil {
		_ = tx.Rollback(after)
		return err
	}
	if err := tx.Commit(txCtx, effects); err != nil {
		switch {
		case errors.Is(err, ErrCommitOutcomeUnknown):
			// The driver sent COMMIT and lost its answer to HandlerTimeout (pgx): it may have
			// taken effect, so it is no timed-out rollback, though its error is the deadline's.
			return err
		case txCtx.Err() != nil && (errors.Is(err, sql.ErrTxDone) || errors.Is(err, context.DeadlineExceeded)):
			return timedOut(err, o.cfg.HandlerTimeout)
		case errors.Is(err, sql.ErrTxDone):
			return ErrTxFinishedByHandler
		case errors.Is(err, outboxdriver.ErrNotSent):
			// The client sent nothing (pgx: a Rows fn left open): rolled back for sure.
			return fmt.Errorf("outbox: commit: %w", err)
		case !rolledBack(err):
			// The connection broke during COMMIT: it may have taken effect. A keyed retry finds
			// out (it replays the result, or runs); an unkeyed caller must be told it cannot know.
			return fmt.Errorf("%w: %w", ErrCommitOutcomeUnknown, err)
		}
		return fmt.Errorf("outbox: commit: %w", err)
	}
	if key != nil {
		key.outcome(u.result, false)
	}
	u.dueCommitted()
	if err := o.failpoint(ctx, FailpointAfterCommit); err != nil {
		return err
	}
	// This transaction is known to have committed: its effects are sent from memory.
	committed := time.Now()
	for i := range effects {
		effects[i].PendingFor = committed.Sub(u.begun)
		effects[i].StoredAt = committed
	}
	outcome = OutcomeCommitted
	if !o.dispatchBoundary(after, u.src, effects, true) {
		outcome = OutcomeDispatchFailed
	}
	return nil
}

// beginBoundary begins the transaction of a boundary unit. The transaction is bound to txCtx
// (HandlerTimeout), never to the caller's ctx: database/sql rolls back a transaction whose context
// ends, and a caller that goes away must not roll back a commit half way. But the wait for a
// pooled connection, and BEGIN, end with ctx too: a caller that gave up (an HTTP client gone)
// waited up to HandlerTimeout for a connection it would only give back. So BEGIN runs on a child
// of txCtx that ctx cancels until BEGIN has returned; if ctx ended by then, the transaction
// begun (if any) is rolled back and the caller's error returned. end cancels the child once the
// transaction has ended.
func (o *Outbox) beginBoundary(ctx, txCtx context.Context) (tx outboxdriver.UnitTx, end context.CancelFunc, err error) {
	bound, end := context.WithCancel(txCtx)
	stop := context.AfterFunc(ctx, end)
	tx, _, err = o.beginUnit(bound, nil)
	unreachable := o.gate.observe(err)
	if !stop() {
		if errors.Is(ctx.Err(), context.DeadlineExceeded) && err != nil {
			// The caller's deadline, shorter than beginStall, ended BEGIN (cancelling bound):
			// as telling as the stall itself.
			o.gate.suspect(fmt.Errorf("BEGIN had no answer within the caller's deadline: %w", ctx.Err()))
		}
		// ctx ended before BEGIN returned: bound is cancelled, and a transaction begun on it is
		// being rolled back (or will be, by the driver's watch).
		if err == nil {
			_ = tx.Rollback(context.WithoutCancel(ctx))
		}
		end()
		cause := ctx.Err()
		if c := context.Cause(ctx); c != nil && !errors.Is(c, cause) {
			cause = fmt.Errorf("%w (%w)", cause, c)
		}
		if o.gate.holding() {
			// It waited for a database that does not answer: what the caller can tell apart.
			cause = fmt.Errorf("%w: %w", ErrDatabaseUnreachable, cause)
		}
		return nil, nil, fmt.Errorf("outbox: InTx: the caller's context ended before the transaction began (waiting for a database connection, or BEGIN): %w", cause)
	}
	if err != nil {
		end()
		if unreachable || (errors.Is(err, context.DeadlineExceeded) && o.gate.holding()) {
			return nil, nil, fmt.Errorf("%w: %w", ErrDatabaseUnreachable, err)
		}
		return nil, nil, fmt.Errorf("outbox: %w", err)
	}
	return tx, end, nil
}

// JoinTx attaches a unit of work to a transaction the caller owns: side effects recorded with the
// returned context are stored in tx. After committing tx, call dispatch to send them at once; if
// the caller never calls it (or crashes first), the relay sends them after Config.RelayGrace. If tx
// rolled back, dispatch sends nothing. Because the outcome of a transaction the caller owns cannot
// be seen from here, dispatch reads back what was committed: one query more than InTx. dispatch
// runs once (later calls do nothing) and does not stop when its context ends.
//
// Inside a handler's unit of work it panics with an error wrapping ErrNestedUnitOfWork (which
// the unit of work turns into a failed attempt): effects in another transaction would commit
// even when the message's rolls back, and again, with new UUIDs, on every retry.
func (o *Outbox) JoinTx(ctx context.Context, tx *sql.Tx) (context.Context, func(context.Context)) {
	ctx, dispatch, err := o.JoinUnit(ctx, tx)
	if err != nil {
		// A driver whose units of work are not *sql.Tx refuses one (its package's JoinTx is the
		// one to call), and so does a handler's unit of work. Failing loudly beats storing
		// effects nowhere, or where they escape the message's rollback.
		panic(err)
	}
	return ctx, dispatch
}

// JoinUnit is JoinTx for any driver: tx is the driver's transaction type (a *sql.Tx, or a pgx.Tx
// with the pgx driver, whose JoinTx builds on it). It returns an error for a tx of another type,
// and one wrapping ErrNestedUnitOfWork inside a handler's unit of work.
func (o *Outbox) JoinUnit(ctx context.Context, tx any) (context.Context, func(context.Context), error) {
	if outer := unitFrom(ctx); outer != nil && outer.incoming != nil {
		return ctx, nil, fmt.Errorf("%w: JoinTx called inside the unit of work of consumer %q (message %q) would record effects in another transaction; "+
			"write through outbox.Tx (outboxpgx.Tx with pgx) and record with outbox.Publish instead", ErrNestedUnitOfWork, outer.src.Consumer, outer.src.ID)
	}
	if k := keyedFrom(ctx); k != nil {
		// The caller's transaction was begun before the key could be claimed in it, and its
		// commit cannot be kept from happening twice from here.
		return ctx, nil, fmt.Errorf("outbox: JoinTx with idempotency key %q: %w: a keyed unit of work runs with InTx", k.key, ErrIdempotencyUnsupported)
	}
	ut, err := o.units.JoinUnit(tx)
	if err != nil {
		return ctx, nil, fmt.Errorf("outbox: JoinTx: %w", err)
	}
	u := newUnit(o, ut, Source{ID: newID()}, nil)
	var dispatched atomic.Bool
	return withUnit(ctx, u), func(ctx context.Context) {
		// Once: a second call would read the effects back as still pending (their marks are
		// written asynchronously) and send them again. And past the caller's context, as InTx's
		// dispatch: the commit stands, and a request whose client went away between its commit
		// and this call failed the read-back and left its effects to the relay (RelayGrace).
		if !dispatched.CompareAndSwap(false, true) || len(u.finish()) == 0 {
			return
		}
		ctx = context.WithoutCancel(ctx)
		committed, _, err := o.listPending(ctx, u.src)
		if err != nil {
			o.logger.Error("Reading back committed side effects failed; the relay sends them after the grace period", err,
				watermill.LogFields{"boundary_id": u.src.ID})
			return
		}
		_ = o.dispatchBoundary(ctx, u.src, committed, false)
	}, nil
}

// dispatchBoundary is the fast path at the boundary (inTx: the span in ctx is InTx's). On failure the effects are handed to the
// relay as due for a retry, so that they do not wait for the grace period. It tells whether every
// effect went out here (false: some are left to the relay).
func (o *Outbox) dispatchBoundary(ctx context.Context, src Source, effects []Effect, inTx bool) bool {
	if len(effects) == 0 {
		return true
	}
	fields := watermill.LogFields{"boundary_id": src.ID, "effects": len(effects)}
	if blocked, err := o.keyBlocked(ctx, src, effects); err != nil || blocked {
		if err != nil && o.outage(ctx, err) {
			// The database went since the commit: handing the effects over would be one more
			// connection attempt; the relay's claims after the outage find them (RelayGrace).
			o.relayNeeded(fields)
			return false
		}
		if err != nil {
			o.logger.Error("Checking ordering keys failed; the relay sends the effects", err, fields)
		}
		// Effects that wait behind an earlier one with their key go with it: that is ordering,
		// not a failure.
		herr := o.handToRelay(ctx, src)
		if herr != nil {
			o.logger.Error("Handing effects to the relay failed; it sends them after the grace period", herr, fields)
		}
		return err == nil && herr == nil
	}
	ctx, traced := o.tel.startDispatch(ctx, PathCommit, effects, inTx)
	sent, failed, err := o.dispatch(ctx, PathCommit, effects)
	failedAt := time.Now()
	traced(err)
	o.marks.add(src, effects[:sent], false, time.Time{}) // a boundary transaction has no claim
	if err != nil {
		o.logger.Error("Dispatch after commit failed; the relay will retry", err, fields)
		if failed > 0 {
			o.dispatchFailed(ctx, src, effects, sent, failed, err, failedAt)
		}
		return false
	}
	return true
}

// runKeyed claims the key of a keyed unit of work (waiting, with WaitInFlight, as long as ctx
// and txCtx allow) and tells whether fn is to run: false when the key was committed before.
func (o *Outbox) runKeyed(ctx, txCtx context.Context, tx outboxdriver.UnitTx, key *keyed) (bool, error) {
	claimCtx, cancel := context.WithCancel(txCtx)
	defer cancel()
	// The caller's request may end while it waits behind the first one: it stops waiting.
	stop := context.AfterFunc(ctx, cancel)
	defer stop()
	run, err := o.claimKey(claimCtx, tx, key)
	if err != nil || !run {
		return false, err
	}
	if err := o.failpoint(ctx, FailpointAfterClaim); err != nil {
		return false, err
	}
	return true, nil
}

// saveKeyed stores the result of a keyed unit of work with its key, before the commit.
func (o *Outbox) saveKeyed(ctx context.Context, tx outboxdriver.UnitTx, u *unit) error {
	if err := o.failpoint(ctx, FailpointAfterHandler); err != nil {
		return err
	}
	u.mu.Lock()
	result := u.result
	u.mu.Unlock()
	if len(result) == 0 {
		return nil // the claim stored an empty result
	}
	if err := tx.(outboxdriver.KeyedUnitTx).KeySave(ctx, u.key.scope, u.key.key, result); err != nil {
		return fmt.Errorf("outbox: %w", err)
	}
	return nil
}
