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
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/trace"

	"github.com/watermill-outbox/outbox/outboxdriver"
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
	// Topic is the topic the message came from, for spans, and for its dead letter, which a
	// retry publishes there again; empty if unknown (a Router's own topic is then used).
	Topic string
	// Refuse, when set, refuses the message for that reason before its unit of work: it is
	// rejected like one whose ID cannot be read (dead letter, poison topic, or nack), with Refuse
	// as the reason, and the handler does not run. A router of messages over several Outboxes
	// (tenant.Set) refuses so, in a designated Outbox, those it cannot route.
	Refuse error
}

// delivery is what one call of Handle observed, for its metrics and span.
type delivery struct {
	outcome string // empty: processed or failed, by the error
	topic   string // HandleParams.Topic
}

type deliveryKey struct{}

// sourceTopic returns the topic msg, handled in ctx, came from: HandleParams.Topic, or the
// Router's subscribe topic.
func sourceTopic(ctx context.Context, msg *message.Message) string {
	if d, ok := ctx.Value(deliveryKey{}).(*delivery); ok && d.topic != "" {
		return d.topic
	}
	return message.SubscribeTopicFromCtx(msg.Context())
}

// setOutcome records the outcome of the delivery being handled in ctx.
func setOutcome(ctx context.Context, outcome string) {
	if d, ok := ctx.Value(deliveryKey{}).(*delivery); ok {
		d.outcome = outcome
	}
}

// Handle runs next for msg as one unit of work: it claims (Consumer, MessageID), runs next with the
// transaction in msg.Context() (see Tx), stores the side effects it records and the messages it
// returns, commits, dispatches the side effects and marks them dispatched. A message that was
// already processed skips next and only dispatches what is still pending. Handle returns nil when
// msg may be acked, and an error when it must be nacked. The middleware package calls it.
func (o *Outbox) Handle(msg *message.Message, p HandleParams, next message.HandlerFunc) error {
	// The Router runs every message on a new goroutine, whose small stack the unit of work's
	// calls (the driver, the handler, the broker client) would grow deep down, copying a deep
	// stack, once or more per message: 8% of the consumer path's CPU in the benchmark (database/sql
	// form, 16 in flight), 3% once grown here, where the stack is still shallow.
	growStack()
	began := time.Now()
	parent := msg.Context()
	d := &delivery{topic: p.Topic}
	name := "process"
	attrs := []attribute.KeyValue{AttrConsumer.String(p.Consumer), attribute.String("messaging.operation.name", "process"),
		attribute.String("messaging.message.id", p.MessageID)}
	if p.Topic != "" {
		name += " " + p.Topic
		attrs = append(attrs, AttrTopic.String(p.Topic))
	}
	ctx, span := o.tel.tracer.Start(context.WithValue(o.tel.remoteParent(parent, msg.Metadata), deliveryKey{}, d), name,
		trace.WithSpanKind(trace.SpanKindConsumer), trace.WithAttributes(attrs...))
	msg.SetContext(ctx)
	err := o.handle(msg, p, next)
	msg.SetContext(parent)
	outcome := d.outcome
	switch {
	case outcome == OutcomeDuplicate && errors.Is(err, ErrDispatchFailed):
		outcome = OutcomeDispatchFailed // a redelivery whose re-send failed: nacked
	case outcome == OutcomeDuplicate && err != nil:
		outcome = OutcomeFailed
	case outcome != "":
	case err == nil:
		outcome = OutcomeProcessed
	default:
		outcome = OutcomeFailed
	}
	o.tel.startConsumer(ctx, p.Consumer)
	set := o.tel.attrs(AttrConsumer, p.Consumer, AttrOutcome, outcome)
	o.tel.handled.Add(ctx, 1, set)
	o.busy.Wake() // the member is in use: its statistics sampling keeps its pace
	o.tel.processDuration.Record(ctx, time.Since(began).Seconds(), set)
	span.SetAttributes(AttrOutcome.String(outcome))
	endSpan(span, err)
	return err
}

func (o *Outbox) handle(msg *message.Message, p HandleParams, next message.HandlerFunc) error {
	parent := msg.Context()
	fields := watermill.LogFields{"consumer": p.Consumer, "message_uuid": msg.UUID}
	if err := validateName(p.Consumer); err != nil {
		return fmt.Errorf("%w: %w", ErrNoConsumerName, err)
	}
	if outer := unitFrom(parent); outer != nil {
		return fmt.Errorf("%w: the outbox middleware is applied twice to this handler (on the Router and on the handler?); apply it once (consumer %q inside the unit of work of %q)",
			ErrNestedUnitOfWork, p.Consumer, outer.src.Consumer)
	}
	if to, ok := msg.Metadata[MetadataRetryFor]; ok {
		if to != p.Consumer {
			// A dead letter of another consumer, retried: it is for that consumer only. Logged:
			// were that consumer renamed since, no consumer would run it.
			setOutcome(parent, OutcomeNotAddressed)
			o.logger.Info("Another consumer's retried dead letter acked without running the handler",
				fields.Add(watermill.LogFields{"addressed_to": to}))
			return nil
		}
		delete(msg.Metadata, MetadataRetryFor) // not passed on by a handler that copies metadata
	}
	src := Source{Consumer: p.Consumer, ID: p.MessageID}
	if p.Refuse != nil {
		return o.rejectWhenReachable(parent, msg, src, p.Refuse, fields)
	}
	if p.MessageIDErr != nil {
		return o.rejectWhenReachable(parent, msg, src, fmt.Errorf("%w: %w", ErrInvalidMessageID, p.MessageIDErr), fields)
	}
	if err := validateName(p.MessageID); err != nil {
		return o.rejectWhenReachable(parent, msg, src, fmt.Errorf("%w: %w", ErrInvalidMessageID, err), fields)
	}
	for try, retries := 1, 0; ; {
		setOutcome(parent, "")
		err := o.handleOnce(msg, src, p, next, try == maxImmediateRetries, fields)
		switch {
		case err == nil:
			return nil
		case isFailedAttempt(err):
			// The handler failed: it backs off and retries below, whatever framework errors its
			// own error wraps (ErrDispatchFailed from another Outbox's Handle was acked here after
			// the rollback with DispatchFailureAck: lost; ErrDatabaseUnreachable skipped the
			// backoff and used MaxAttempts up in a burst).
		case errors.Is(err, ErrDispatchFailed) && o.cfg.AfterDispatchFailure == DispatchFailureAck:
			// Committed, the failure recorded: the relay sends the effects, and the consumer goes on.
			setOutcome(parent, OutcomeDispatchFailed)
			return nil
		case errors.Is(err, errWaitForDatabase):
			if parent.Err() != nil {
				return fmt.Errorf("%w: %w", ErrDatabaseUnreachable, err)
			}
			// Not a try: the next one begins once the database answers (waitForDatabase).
			continue
		case errors.Is(err, errRetryAtOnce):
			o.logger.Debug("Serialization failure or deadlock; running the unit of work again at once", fields.Add(watermill.LogFields{"try": try, "error": err.Error()}))
			try++
			continue
		case errors.Is(err, ErrDatabaseUnreachable):
			// It waited for the database up to HandlerTimeout already: nacked at once, and its
			// redelivery waits for the same probe.
			return err
		case parent.Err() != nil || errors.Is(err, ErrFailpoint):
			// A shutdown: waiting helps nothing. A failpoint stands for a crash, which does not
			// wait either (a killed consumer's in-flight messages would otherwise each wait
			// RetryDelay, one after another, before it let go of them).
			return err
		case errors.Is(err, ErrNestedUnitOfWork), errors.Is(err, ErrUnsafeMiddlewareOrder):
			// A wiring error: running again cannot help, but it fails every message, and the
			// Router redelivers at once; without the wait that is thousands of failures a second.
			o.backoff(parent, err)
			return err
		}
		if !o.backoff(parent, err) {
			return err
		}
		if retries >= o.cfg.HandlerRetries {
			return err
		}
		retries++
		try = 1
		o.logger.Debug("Running the unit of work again", fields.Add(watermill.LogFields{"retry": retries, "error": err.Error()}))
	}
}

// rejectWhenReachable rejects msg (reject) once the database answers: its dead letter is a
// statement, which during an outage would be one more connection attempt for every redelivery
// of the message. A rejection that meets the outage waits for the gate and is made again.
func (o *Outbox) rejectWhenReachable(ctx context.Context, msg *message.Message, src Source, cause error, fields watermill.LogFields) error {
	for {
		if err := o.waitForDatabase(ctx); err != nil {
			setOutcome(ctx, OutcomeFailed)
			return fmt.Errorf("%w (rejecting it: %w)", cause, err)
		}
		err := o.reject(ctx, msg, src, cause, fields)
		if !errors.Is(err, errWaitForDatabase) {
			if err != nil && ctx.Err() == nil {
				// Nacked (nowhere to set it aside, or setting it aside failed): the broker
				// redelivers at once, and without the wait of a failed handler that is thousands
				// of failures a second.
				o.backoff(ctx, err)
			}
			return err
		}
		if ctx.Err() != nil {
			setOutcome(ctx, OutcomeFailed)
			return fmt.Errorf("%w: %w", ErrDatabaseUnreachable, err)
		}
	}
}

// maxImmediateRetries bounds how often a unit of work that hit a serialization failure or a
// deadlock runs in a row within one delivery; the last failure then counts as a failed attempt.
const maxImmediateRetries = 3

// errRetryAtOnce asks Handle to run the unit of work again at once.
var errRetryAtOnce = errors.New("retry at once")

// errWaitForDatabase asks Handle to run the unit of work again once the database answers.
var errWaitForDatabase = errors.New("the database is unreachable")

// waitForDatabase waits while the database is unreachable (see dbGate), without a connection,
// at most HandlerTimeout and while ctx lasts. The wait has a budget of its own, so that a unit
// that begins when the database answers again has the whole HandlerTimeout for its work:
// sharing one, units woken late in theirs timed out in their handlers and were counted failed.
func (o *Outbox) waitForDatabase(ctx context.Context) error {
	if !o.gate.holding() {
		return nil
	}
	ctx, cancel := context.WithTimeout(ctx, o.cfg.HandlerTimeout)
	defer cancel()
	return o.gate.wait(ctx)
}

// beginUnit begins a unit of work. The opening of a connection and BEGIN are watched for the gate
// where they run (beginWatch; a UnitStore's dials through outboxdriver.DialWatcher): their stall
// has the gate probe the database while the units after them wait. A DialWatcher's BeginUnit
// that its context's deadline ended is suspected too: on a pooled connection, which no watch
// covers, a server that stalls is told by that deadline (the pgx form honours it). Its BEGIN and
// claim are one round trip, so a claim that waited the whole HandlerTimeout for a copy's costs a
// ping as well.
func (o *Outbox) beginUnit(ctx context.Context, src *Source) (outboxdriver.UnitTx, outboxdriver.Claim, error) {
	tx, claim, err := o.units.BeginUnit(ctx, src)
	if _, dials := o.units.(outboxdriver.DialWatcher); dials && err != nil && errors.Is(err, context.DeadlineExceeded) {
		o.gate.suspect(err)
	}
	return tx, claim, err
}

func (o *Outbox) handleOnce(msg *message.Message, src Source, p HandleParams, next message.HandlerFunc, lastTry bool, fields watermill.LogFields) error {
	parent := msg.Context()
	if err := o.waitForDatabase(parent); err != nil {
		return fmt.Errorf("outbox: claim message %q for %q (not counted as a failed attempt): %w", src.ID, src.Consumer, err)
	}
	// The transaction lives in a context that neither the ack nor the subscriber's ack deadline can
	// cancel, so that they cannot roll back a commit half way. HandlerTimeout bounds everything up
	// to the commit: the wait for a connection, for a concurrent copy's claim, the handler (whose
	// context carries the deadline, and is also cancelled with the message's) and the commit. What
	// comes after (counting a failure, the duplicate path, dispatching committed effects) runs on
	// after, which neither can cut short; each of its waits is bounded on its own.
	after := context.WithoutCancel(parent)
	txCtx, cancel := context.WithTimeout(after, o.cfg.HandlerTimeout)
	defer cancel()
	deadline, _ := txCtx.Deadline()
	handlerCtx, cancelHandler := context.WithDeadline(parent, deadline)
	defer cancelHandler()

	// The steps of the unit of work are events of its span (a span each would cost a tenth of the
	// consumer path's throughput with an SDK installed); only the dispatch, which calls the broker,
	// has a span of its own.
	span := trace.SpanFromContext(parent)
	if o.failingHere.contains(src) {
		if done, err := o.deadLetterIfAsked(after, msg, src, fields); done {
			return err
		}
	}
	// The claim's time is taken by the database before the claim waits for a copy's (the
	// transaction's start on PostgreSQL, the INSERT's on MySQL): from here, not from the end of
	// the wait, tells whether the effects went out close enough to it (dispatchAndMark).
	claimAt := time.Now()
	tx, claim, err := o.beginUnit(txCtx, &src)
	if o.gate.observe(err) {
		// The database is unreachable: Handle waits for it and runs the unit again.
		return fmt.Errorf("%w: %w", errWaitForDatabase, err)
	}
	if _, down := o.gate.outage(); err != nil && txCtx.Err() != nil && down {
		// BEGIN had no answer until HandlerTimeout, and the database is found unreachable:
		// nacked at once, as after a wait in the gate. A suspicion is not enough: a pooled
		// connection that was only slow is suspected too, until the probe answers.
		return fmt.Errorf("outbox: claim message %q for %q (not counted as a failed attempt): %w: %w", src.ID, src.Consumer, ErrDatabaseUnreachable, err)
	}
	if err != nil {
		if o.isRetryable(err) && !lastTry {
			// Copies of the message met at their claims (MySQL: a deadlock between the waiters
			// of a claim that rolled back): the next claim finds the winner's, or wins.
			return fmt.Errorf("%w: %w", errRetryAtOnce, err)
		}
		if txCtx.Err() != nil {
			return fmt.Errorf("outbox: claim message %q for %q: waited HandlerTimeout (%s) for a database connection, a copy being processed elsewhere, or the database: %w",
				src.ID, src.Consumer, o.cfg.HandlerTimeout, err)
		}
		return fmt.Errorf("outbox: claim message %q for %q: %w", src.ID, src.Consumer, err)
	}
	span.AddEvent("outbox.claim", trace.WithAttributes(attribute.Bool("outbox.claimed", claim.Claimed)))
	if err := o.failpoint(txCtx, FailpointAfterClaim); err != nil {
		_ = tx.Rollback(after)
		return err
	}
	if !claim.Claimed {
		_ = tx.Rollback(after)
		o.duplicateSeen(after, src, claim)
		return o.redeliver(after, src, claim, fields)
	}

	u := newUnit(o, tx, src, msg)
	msg.SetContext(withUnit(handlerCtx, u))
	produced, err := callHandler(next, msg)
	if err == nil && len(produced) > 0 {
		err = o.storeProduced(msg.Context(), p.ReplyTopic, produced)
	}
	msg.SetContext(parent)
	var effects []Effect
	if err == nil {
		err = o.failpoint(txCtx, FailpointAfterHandler)
	}
	if err == nil {
		effects, err = u.committedEffects(txCtx)
	} else {
		u.finish()
	}
	if err != nil {
		rbErr := tx.Rollback(after)
		switch {
		case errors.Is(err, ErrFailpoint):
			// A simulated crash: a dead process records nothing, so this is not a failed attempt
			// (a killed consumer's messages in flight would otherwise be counted, and at
			// MaxAttempts kills dead-lettered, though they never failed).
			return err
		case errors.Is(err, ErrUnsafeMiddlewareOrder), errors.Is(err, ErrNestedUnitOfWork):
			// A wiring error found while the handler ran (a middleware in the wrong place, the
			// outbox middleware applied twice): nothing it wrote may commit, and the message is
			// not to blame. Counted, every message of the stream would be dead-lettered.
			return err
		case o.isRetryable(err) && !lastTry:
			return fmt.Errorf("%w: %w", errRetryAtOnce, err)
		case parent.Err() != nil && txCtx.Err() == nil && errors.Is(parent.Err(), context.DeadlineExceeded):
			// The message's own deadline passed (Watermill's Timeout middleware outside this one):
			// a unit of work that outlasts it is a failed attempt, as one that outlasts
			// HandlerTimeout is. Not counted, a message that always takes longer was rolled back
			// and redelivered for ever, never dead-lettered, and no metric said so.
			return o.handlerFailed(after, msg, src, fmt.Errorf("outbox: the message's context deadline passed during the unit of work (rolled back): %w", err), fields)
		case parent.Err() != nil && txCtx.Err() == nil:
			// The Router is shutting down, or the broker's ack deadline passed (a cancel): not the
			// message's fault.
			return fmt.Errorf("outbox: message context cancelled during the unit of work (rolled back, not counted as a failed attempt): %w", err)
		case txCtx.Err() != nil:
			// The transaction was rolled back when HandlerTimeout expired, unless the handler had
			// ended it itself (the rollback says so).
			if errors.Is(rbErr, ErrTxFinishedByHandler) {
				err = fmt.Errorf("%w (%w)", err, rbErr)
			}
			return o.finishedEarly(after, msg, src, timedOut(err, o.cfg.HandlerTimeout), fields)
		case errors.Is(rbErr, sql.ErrTxDone):
			return o.finishedEarly(after, msg, src, fmt.Errorf("%w; the handler also failed: %w", ErrTxFinishedByHandler, err), fields)
		}
		if claim.Tentative && o.copyWon(after, src) {
			// Optimistic mode: a copy committed while this one ran (its failure is likely the
			// copy's doing: a unique key, a lock): the message is processed, not failed.
			return o.lostToCopy(after, src, fields)
		}
		return o.handlerFailed(after, msg, src, err, fields)
	}

	err = tx.Commit(txCtx, effects)
	span.AddEvent("outbox.commit", trace.WithAttributes(attribute.Bool("outbox.commit.failed", err != nil)))
	if err != nil {
		switch {
		case errors.Is(err, outboxdriver.ErrClaimTaken):
			return o.lostToCopy(after, src, fields)
		case errors.Is(err, ErrCommitOutcomeUnknown):
			// The driver sent COMMIT and lost its answer to HandlerTimeout (pgx): it may have
			// taken effect. Its error wraps the deadline's, but COMMIT was sent: not counted.
			return o.commitUnknown(after, src, err, fields)
		case errors.Is(err, sql.ErrTxDone) || errors.Is(err, context.DeadlineExceeded) || errors.Is(err, context.Canceled):
			// COMMIT was never sent: the transaction had been finished already, by the handler
			// or by database/sql when HandlerTimeout expired.
			cause := error(ErrTxFinishedByHandler)
			if errors.Is(err, ErrTxFinishedByHandler) {
				cause = err // says how it was found
			}
			if txCtx.Err() != nil {
				cause = timedOut(err, o.cfg.HandlerTimeout)
			}
			return o.finishedEarly(after, msg, src, cause, fields)
		case o.isRetryable(err) && !lastTry:
			return fmt.Errorf("%w: %w", errRetryAtOnce, err)
		case rolledBack(err) || errors.Is(err, outboxdriver.ErrNotSent):
			// The server answered (a deferred constraint, a serialization failure at commit), or
			// the client refused to send COMMIT at all: the transaction rolled back.
			if claim.Tentative && o.copyWon(after, src) {
				// Optimistic mode: a copy committed while this one ran, and a statement the
				// handler went on after failed on what the copy wrote (its unique key).
				return o.lostToCopy(after, src, fields)
			}
			// A failed attempt like any other.
			return o.handlerFailed(after, msg, src, fmt.Errorf("outbox: commit failed, rolled back: %w", err), fields)
		}
		return o.commitUnknown(after, src, err, fields)
	}
	u.dueCommitted()
	if err := o.failpoint(after, FailpointAfterCommit); err != nil {
		return err
	}
	committed := time.Now()
	for i := range effects {
		effects[i].PendingFor = committed.Sub(u.begun)
		effects[i].StoredAt = committed
	}
	err = o.dispatchAndMark(after, PathCommit, src, effects, claimAt, fields)
	if errors.Is(err, ErrDispatchFailed) {
		setOutcome(after, OutcomeDispatchFailed)
	}
	return err
}

// sqlState returns the SQLSTATE code of a database error (lib/pq and pgx both provide it), or "".
func sqlState(err error) string {
	var s interface{ SQLState() string }
	if errors.As(err, &s) {
		return s.SQLState()
	}
	return ""
}

// isRetryable tells a serialization failure or a deadlock, which a new transaction usually gets
// past: by its SQLSTATE, or as the store tells for a database whose errors carry none.
func (o *Outbox) isRetryable(err error) bool {
	if code := sqlState(err); code == "40001" || code == "40P01" {
		return true
	}
	c, ok := o.store.(outboxdriver.RetryClassifier)
	return ok && c.Retryable(err)
}

// rolledBack tells whether a failed COMMIT is known to have rolled back: the server answered with
// an error of the transaction itself. An error without SQLSTATE (the connection broke) or of a
// connection, operator intervention, resource or internal class leaves the outcome unknown.
func rolledBack(err error) bool {
	code := sqlState(err)
	if len(code) != 5 {
		return false
	}
	switch code[:2] {
	case "08", "53", "57", "58", "XX":
		return false
	}
	return true
}

// commitUnknown handles a COMMIT that failed in flight. Whether it took effect is asked of the
// database: if the claim is there, the message was processed (by this commit, or by a copy), and
// what committed is dispatched from the database, as for a redelivery; if not, the message is
// nacked without counting an attempt.
func (o *Outbox) commitUnknown(ctx context.Context, src Source, cerr error, fields watermill.LogFields) error {
	bctx, cancel := context.WithTimeout(ctx, storeTimeout)
	defer cancel()
	processed, err := o.store.MessageIsProcessed(bctx, src)
	if err != nil {
		if o.outage(ctx, err) {
			// The database went with the COMMIT: the unit runs again once a probe answers,
			// and finds its claim if the COMMIT took effect (the duplicate path sends).
			o.failedHere.add(src)
			return fmt.Errorf("%w: %w: %w (checking the outcome: %w)", errWaitForDatabase, ErrCommitOutcomeUnknown, cerr, err)
		}
		return fmt.Errorf("%w: %w (and checking the outcome failed: %w)", ErrCommitOutcomeUnknown, cerr, err)
	}
	if !processed {
		if errors.Is(cerr, ErrCommitOutcomeUnknown) {
			return cerr // the driver's says so already
		}
		return fmt.Errorf("%w: %w", ErrCommitOutcomeUnknown, cerr)
	}
	o.logger.Info("COMMIT failed in flight but took effect; dispatching what committed", fields.Add(watermill.LogFields{"error": cerr.Error()}))
	// This process is the one to send them (no copy is sending them): at once, not after a
	// wait of up to DuplicateWait for a copy's dispatch.
	o.failedHere.add(src)
	return o.redeliver(ctx, src, outboxdriver.Claim{}, fields)
}

// timedOut reports a unit of work that HandlerTimeout cut short (its transaction rolled back).
func timedOut(err error, d time.Duration) error {
	return fmt.Errorf("outbox: unit of work exceeded HandlerTimeout (%s), rolled back: %w (%w)", d, context.DeadlineExceeded, err)
}

func callHandler(next message.HandlerFunc, msg *message.Message) (produced []*message.Message, err error) {
	defer func() {
		if r := recover(); r != nil {
			if perr, ok := r.(error); ok { // kept for errors.Is: a refused JoinTx panics with ErrNestedUnitOfWork
				err = fmt.Errorf("%w: %w\n%s", ErrHandlerPanicked, perr, debug.Stack())
				return
			}
			err = fmt.Errorf("%w: %v\n%s", ErrHandlerPanicked, r, debug.Stack())
		}
	}()
	return next(msg)
}

// finishedEarly handles a transaction that ended before the framework committed it: the handler
// committed or rolled it back itself, or HandlerTimeout expired and the transaction was rolled
// back (by database/sql, or by the pgx driver closing its connection). If the claim committed
// (the handler committed), whatever it stored is kept and dispatched on redelivery; if it did
// after a timeout, a copy committed it and this is a duplicate; otherwise nothing happened and
// cause is counted as a failed attempt.
func (o *Outbox) finishedEarly(ctx context.Context, msg *message.Message, src Source, cause error, fields watermill.LogFields) error {
	bctx, cancel := context.WithTimeout(ctx, storeTimeout)
	defer cancel()
	committed, err := o.store.MessageIsProcessed(bctx, src)
	if err != nil {
		if o.outage(ctx, err) {
			return fmt.Errorf("%w: %w (checking its outcome: %w)", errWaitForDatabase, cause, err)
		}
		return fmt.Errorf("%w (and checking its outcome failed: %w)", cause, err)
	}
	if committed && !errors.Is(cause, ErrTxFinishedByHandler) {
		// HandlerTimeout rolled this unit of work back: the claim is a copy's, which committed
		// meanwhile (an optimistic copy, waiting on this one's claim until the rollback).
		return o.lostToCopy(ctx, src, fields)
	}
	if committed {
		err := cause
		if !errors.Is(err, ErrTxFinishedByHandler) {
			err = fmt.Errorf("%w (%w)", ErrTxFinishedByHandler, cause)
		}
		o.logger.Error("Handler committed the transaction itself; its effects are dispatched on redelivery", err, fields)
		return err
	}
	return o.handlerFailed(ctx, msg, src, cause, fields)
}
