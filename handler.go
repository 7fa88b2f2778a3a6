package outbox

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"runtime/debug"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
)

// HandleParams describe one incoming message for Outbox.Handle.
type HandleParams struct {
	// Consumer is the consumer identity under which the message is deduplicated.
	Consumer string
	// MessageID is the deduplication ID of the message.
	MessageID string
	// MessageIDErr, when set, means the ID could not be read; the message is rejected like one with
	// an invalid ID (poison topic, or nack), and the handler does not run.
	MessageIDErr error
	// ReplyTopic receives the messages the handler returns; empty if it returns none.
	ReplyTopic string
}

// Handle runs next for msg as one unit of work: it claims (Consumer, MessageID), runs next with the
// transaction in msg.Context() (see Tx), stores the side effects it records and the messages it
// returns, commits, dispatches the side effects and marks them dispatched. A message that was
// already processed skips next and only dispatches what is still pending. Handle returns nil when
// msg may be acked, and an error when it must be nacked. The middleware package calls it.
func (o *Outbox) Handle(msg *message.Message, p HandleParams, next message.HandlerFunc) error {
	parent := msg.Context()
	fields := watermill.LogFields{"consumer": p.Consumer, "message_uuid": msg.UUID}
	if err := validateName(p.Consumer); err != nil {
		return fmt.Errorf("%w: %w", ErrNoConsumerName, err)
	}
	src := Source{Consumer: p.Consumer, ID: p.MessageID}
	if p.MessageIDErr != nil {
		return o.reject(parent, msg, src, fmt.Errorf("%w: %w", ErrInvalidMessageID, p.MessageIDErr), fields)
	}
	if err := validateName(p.MessageID); err != nil {
		return o.reject(parent, msg, src, fmt.Errorf("%w: %w", ErrInvalidMessageID, err), fields)
	}

	// The transaction lives in a context that neither the ack nor the subscriber's ack deadline can
	// cancel, so that they cannot roll back a commit half way. HandlerTimeout bounds the handler
	// and the commit only; what comes after (counting a failure, the duplicate path, dispatching
	// committed effects) runs on after, which the timeout cannot cut short.
	after := context.WithoutCancel(parent)
	txCtx, cancel := context.WithCancel(after)
	if o.cfg.HandlerTimeout > 0 {
		txCtx, cancel = context.WithTimeout(after, o.cfg.HandlerTimeout)
	}
	defer cancel()

	begun := time.Now() // no later than the claim's time, which the database takes at BEGIN
	tx, err := o.db.BeginTx(txCtx, nil)
	if err != nil {
		return fmt.Errorf("outbox: begin transaction: %w", err)
	}
	claimed, err := o.store.MessageClaim(parent, tx, src)
	if err != nil {
		_ = tx.Rollback()
		return fmt.Errorf("outbox: claim message %q for %q: %w", src.ID, src.Consumer, err)
	}
	if err := o.failpoint(txCtx, FailpointAfterClaim); err != nil {
		_ = tx.Rollback()
		return err
	}
	if !claimed {
		_ = tx.Rollback()
		return o.redeliver(after, src, fields)
	}

	u := &unit{o: o, tx: tx, src: src, incoming: msg}
	msg.SetContext(withUnit(parent, u))
	produced, err := callHandler(next, msg)
	if err == nil && len(produced) > 0 {
		err = o.storeProduced(msg.Context(), p.ReplyTopic, produced)
	}
	msg.SetContext(parent)
	if err == nil {
		err = o.failpoint(txCtx, FailpointAfterHandler)
	}
	if err != nil {
		rbErr := tx.Rollback()
		switch {
		case txCtx.Err() != nil:
			// database/sql rolled the transaction back when HandlerTimeout expired.
			return o.handlerFailed(after, msg, src, timedOut(err, o.cfg.HandlerTimeout), fields)
		case errors.Is(rbErr, sql.ErrTxDone):
			return o.finishedByHandler(after, msg, src, err, fields)
		}
		return o.handlerFailed(after, msg, src, err, fields)
	}

	if err := tx.Commit(); err != nil {
		switch {
		case txCtx.Err() != nil:
			return o.handlerFailed(after, msg, src, timedOut(err, o.cfg.HandlerTimeout), fields)
		case errors.Is(err, sql.ErrTxDone):
			return o.finishedByHandler(after, msg, src, nil, fields)
		}
		// The outcome of a commit that failed in flight is unknown; redelivery finds out.
		return fmt.Errorf("outbox: commit message %q for %q: %w", src.ID, src.Consumer, err)
	}
	if err := o.failpoint(after, FailpointAfterCommit); err != nil {
		return err
	}
	return o.dispatchAndMark(after, src, u.effects, begun, fields)
}

// timedOut reports a unit of work that HandlerTimeout cut short (its transaction rolled back).
func timedOut(err error, d time.Duration) error {
	return fmt.Errorf("outbox: unit of work exceeded HandlerTimeout (%s), rolled back: %w (%w)", d, context.DeadlineExceeded, err)
}

func callHandler(next message.HandlerFunc, msg *message.Message) (produced []*message.Message, err error) {
	defer func() {
		if r := recover(); r != nil {
			err = fmt.Errorf("%w: %v\n%s", ErrHandlerPanicked, r, debug.Stack())
		}
	}()
	return next(msg)
}

// storeProduced turns the messages an AddHandler handler returns into side effects, so that the
// Router does not publish them a second time outside the transaction.
func (o *Outbox) storeProduced(ctx context.Context, topic string, produced []*message.Message) error {
	if topic == "" {
		return fmt.Errorf("outbox: the handler returned %d message(s) but has no publish topic (use AddConsumerHandler with outbox.Publish, or AddHandler with a topic)", len(produced))
	}
	return Publish(ctx, topic, produced...)
}

// redeliver is the duplicate path: the message was processed before, so only side effects still
// pending are dispatched, with their original UUIDs and order.
func (o *Outbox) redeliver(ctx context.Context, src Source, fields watermill.LogFields) error {
	pending, err := o.store.EffectListPending(ctx, src)
	if err != nil {
		return fmt.Errorf("outbox: list pending side effects of %q for %q: %w", src.ID, src.Consumer, err)
	}
	o.logger.Debug("Duplicate message skipped", fields.Add(watermill.LogFields{"pending_effects": len(pending)}))
	if len(pending) == 0 || o.marks.dispatched(src) {
		// Nothing pending, or this process sent them and their mark is still being written.
		return nil
	}
	if wait := o.cfg.DuplicateWait - pending[0].PendingFor; wait > 0 {
		// Effects this young were most likely committed by a copy that is sending them right now
		// (this copy waited on its claim): let it, rather than put a second copy on the wire, and
		// send only what is still pending once it is done or the wait is over.
		if pending, err = o.awaitDispatch(ctx, src, wait); err != nil {
			return err
		}
		if len(pending) == 0 {
			return nil
		}
	}
	// A re-send after the claim's own dispatch failed or was lost: retention counts from now.
	return o.dispatchAndMark(ctx, src, pending, time.Time{}, fields)
}

// awaitDispatch polls the pending effects of src until none are left or wait has passed, and
// returns what is still pending.
func (o *Outbox) awaitDispatch(ctx context.Context, src Source, wait time.Duration) ([]Effect, error) {
	deadline := time.Now().Add(wait)
	for {
		step := min(25*time.Millisecond, time.Until(deadline))
		select {
		case <-ctx.Done():
			return nil, fmt.Errorf("outbox: waiting for an in-flight dispatch: %w", ctx.Err())
		case <-time.After(step):
		}
		if o.marks.dispatched(src) {
			return nil, nil
		}
		pending, err := o.store.EffectListPending(ctx, src)
		if err != nil {
			return nil, fmt.Errorf("outbox: list pending side effects of %q for %q: %w", src.ID, src.Consumer, err)
		}
		if len(pending) == 0 || !time.Now().Before(deadline) {
			return pending, nil
		}
	}
}

// dispatchAndMark sends effects and queues their mark. claimed is no later than the time the claim
// of src was written with (zero if unknown): when the effects went out within ClaimClockSlack of
// it, that time stands for their dispatch and the mark leaves the claim alone.
func (o *Outbox) dispatchAndMark(ctx context.Context, src Source, effects []Effect, claimed time.Time, fields watermill.LogFields) error {
	if len(effects) == 0 {
		return nil
	}
	if blocked, err := o.keyBlocked(ctx, src, effects); err != nil {
		return fmt.Errorf("outbox: check ordering keys: %w", err)
	} else if blocked {
		// The effects are committed; the relay sends them after the earlier ones, in order.
		return o.handToRelay(ctx, src)
	}
	if err := o.dispatch(ctx, effects); err != nil {
		// Committed effects stay pending: redelivery or the relay sends them with the same UUIDs.
		return fmt.Errorf("outbox: dispatch side effects of %q for %q (kept, will be retried): %w", src.ID, src.Consumer, err)
	}
	o.marks.add(src, claimed.IsZero() || time.Since(claimed) > ClaimClockSlack)
	return o.failpoint(ctx, FailpointAfterMark)
}

// finishedByHandler handles a transaction the handler committed or rolled back itself. If the claim
// committed, whatever the handler stored is kept and dispatched on redelivery; otherwise nothing
// happened and the message is retried like a failure.
func (o *Outbox) finishedByHandler(ctx context.Context, msg *message.Message, src Source, herr error, fields watermill.LogFields) error {
	committed, err := o.store.MessageIsProcessed(ctx, src)
	if err != nil {
		return fmt.Errorf("%w (and checking its outcome failed: %w)", ErrTxFinishedByHandler, err)
	}
	err = ErrTxFinishedByHandler
	if herr != nil {
		err = fmt.Errorf("%w; the handler also failed: %w", ErrTxFinishedByHandler, herr)
	}
	if committed {
		o.logger.Error("Handler committed the transaction itself; its effects are dispatched on redelivery", err, fields)
		return err
	}
	return o.handlerFailed(ctx, msg, src, err, fields)
}
