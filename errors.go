package outbox

import (
	"errors"

	"github.com/watermill-outbox/outbox/outboxdriver"
)

// Errors returned by the framework; test them with errors.Is.
var (
	// ErrNoUnitOfWork is returned by Publish and Record outside a handler wrapped by the middleware
	// and outside InTx.
	ErrNoUnitOfWork = errors.New("outbox: no unit of work in context (wrap the handler with middleware.WrapConsumer, or run the code in Outbox.InTx)")
	// ErrInvalidMessageID means an incoming or outgoing message ID is empty, too long, not UTF-8 or contains NUL.
	ErrInvalidMessageID = errors.New("outbox: invalid message ID")
	// ErrInvalidTopic means a topic is empty, too long, not UTF-8 or contains NUL.
	ErrInvalidTopic = errors.New("outbox: invalid topic")
	// ErrPayloadTooLarge means a payload and its metadata exceed Config.MaxPayloadBytes.
	ErrPayloadTooLarge = errors.New("outbox: payload too large")
	// ErrUnknownApplier means Record named an applier that was not registered.
	ErrUnknownApplier = errors.New("outbox: unknown applier")
	// ErrHandlerPanicked wraps a panic of the wrapped handler; the transaction was rolled back.
	ErrHandlerPanicked = errors.New("outbox: handler panicked")
	// ErrTxFinishedByHandler means the handler committed or rolled back the transaction itself.
	// Whatever it committed is kept and its effects are dispatched on redelivery; the message is nacked.
	ErrTxFinishedByHandler = errors.New("outbox: handler committed or rolled back the transaction itself; leave that to the framework")
	// ErrNoConsumerName means the consumer name could not be found (no Router handler name in the
	// message context and no name configured).
	ErrNoConsumerName = errors.New("outbox: no consumer name")
	// ErrPublishTimeout means the Publisher did not return within Config.PublishTimeout.
	ErrPublishTimeout = errors.New("outbox: publish timed out")
	// ErrFailpoint is returned by failpoints set up to simulate a crash.
	ErrFailpoint = errors.New("outbox: failpoint")
	// ErrDispatchFailed means the unit of work committed but its side effects could not all be
	// dispatched: they are kept, with the failure recorded, and sent again by a redelivery of the
	// message or by the relay. The message is nacked, but it must not be moved to a dead-letter
	// or poison queue for this: its business change is done (test for it in a
	// PoisonQueueWithFilter that sits outside the outbox middleware).
	ErrDispatchFailed = errors.New("outbox: side effects committed but not all dispatched (kept, will be retried)")
	// ErrDatabaseUnreachable means a unit of work waited for the database, unreachable since the
	// time the error names, until its context or HandlerTimeout ended: nothing of it ran, and the
	// message is nacked without counting a failed attempt. InTx also returns it at once when its
	// BEGIN finds the database unreachable (the first failure of an outage).
	ErrDatabaseUnreachable = errors.New("outbox: the database is unreachable")
	// ErrEffectPanicked wraps a panic of the Publisher or of an applier; it counts as a failed dispatch.
	ErrEffectPanicked = errors.New("outbox: publisher or applier panicked")
	// ErrNestedUnitOfWork means a unit of work was started inside a message's unit of work: the
	// outbox middleware is applied twice to one handler (for example on the Router and on the
	// handler; the inner one would wait forever for the claim the outer one holds), or the
	// handler called InTx or JoinTx (whose transaction would commit even when the message's rolls
	// back). It is also returned by InTx with an idempotency key inside any unit of work, keyed or
	// not (the key would commit even when the outer unit rolls back).
	ErrNestedUnitOfWork = errors.New("outbox: unit of work started inside a message's unit of work")
	// ErrUnsafeMiddlewareOrder means Watermill middleware that retries, poisons or acks messages
	// runs inside the outbox middleware, where it breaks the guarantee: Retry would apply a failed
	// attempt's business change again in the same transaction, PoisonQueue would commit what a
	// failed attempt wrote, InstantAck would ack before the commit. The message is not handled (its
	// unit of work rolls back, no failed attempt is counted, the delivery waits RetryDelay) until
	// the wiring is fixed: wrap the handler with middleware.Wrap, or add the outbox middleware last.
	ErrUnsafeMiddlewareOrder = errors.New("outbox: unsafe middleware order")
	// ErrUnitOfWorkFinished is returned by Publish and Record when the unit of work of ctx has
	// already committed or rolled back (a goroutine that outlived the handler).
	ErrUnitOfWorkFinished = errors.New("outbox: the unit of work of this context has finished")
	// ErrUnsafePublisher is logged when New recognises a Publisher that may return before the
	// broker has the message (see docs/brokers.md).
	ErrUnsafePublisher = errors.New("outbox: the Publisher may lose messages")
	// ErrRelayNotRunning is logged when side effects are left to the relay and Outbox.Run is not
	// running in the process.
	ErrRelayNotRunning = errors.New("outbox: no relay is running in this process")
	// ErrRetentionTooShort means Config.Retention is shorter than Config.RedeliveryHorizon; it is
	// also logged when a duplicate arrives whose claim is older than half of Retention.
	ErrRetentionTooShort = errors.New("outbox: dedup retention too short for the broker's redelivery horizon")
	// ErrIdempotencyInFlight is returned by InTx for a keyed unit of work (WithIdempotencyKey)
	// while another unit of work holds the same key uncommitted: the first request is still
	// running (HTTP 409). Nothing ran; retry later, or ask to wait with WaitInFlight.
	ErrIdempotencyInFlight = outboxdriver.ErrKeyInFlight
	// ErrIdempotencyMismatch is returned by InTx when the key was committed with another request
	// fingerprint (HTTP 422): the client reused a key for a different request. Nothing ran.
	ErrIdempotencyMismatch = errors.New("outbox: idempotency key reused with a different request")
	// ErrInvalidIdempotencyKey means an idempotency key or scope is too long, not UTF-8 or
	// contains NUL, or the key is empty.
	ErrInvalidIdempotencyKey = errors.New("outbox: invalid idempotency key")
	// ErrIdempotencyUnsupported is returned by InTx for a keyed unit of work when the driver
	// keeps no idempotency keys (a Store that implements neither outboxdriver.KeyStore nor
	// KeyedUnitTx), and by JoinUnit for a context with a key (a joined transaction was begun
	// before the key could be claimed in it).
	ErrIdempotencyUnsupported = outboxdriver.ErrKeysUnsupported
	// ErrCommitOutcomeUnknown means the COMMIT failed in flight (the connection was lost, or on
	// pgx HandlerTimeout ended before its answer came back): the message may or may not have
	// been processed. It is nacked without counting an attempt; the
	// redelivery finds out. InTx returns it too: the unit may or may not have committed, and only
	// a keyed unit's retry can find out (it gets the stored result, or runs).
	ErrCommitOutcomeUnknown = errors.New("outbox: commit outcome unknown (connection lost during COMMIT)")
	// ErrDelayUnsupported is returned by Publish, Record and CancelDelayed for a delayed effect
	// (WithDelay, WithDelayUntil) when the driver keeps no delayed effects.
	ErrDelayUnsupported = outboxdriver.ErrDelayedUnsupported
	// ErrCancelKeyWithoutDelay is returned by Publish and Record in a context with a cancel key
	// (WithCancelKey) but no delay: only a delayed effect can be cancelled.
	ErrCancelKeyWithoutDelay = errors.New("outbox: a cancel key needs a delay (WithDelay or WithDelayUntil)")
)
