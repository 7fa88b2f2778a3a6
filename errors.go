package outbox

import "errors"

// Errors returned by the framework; test them with errors.Is.
var (
	// ErrNoUnitOfWork is returned by Publish and Record outside a handler wrapped by the middleware
	// and outside InTx.
	ErrNoUnitOfWork = errors.New("outbox: no unit of work in context (wrap the handler with middleware.New, or use Outbox.InTx)")
	// ErrInvalidMessageID means an incoming or outgoing message ID is empty, too long, not UTF-8 or contains NUL.
	ErrInvalidMessageID = errors.New("outbox: invalid message ID")
	// ErrInvalidTopic means a topic is empty, too long, not UTF-8 or contains NUL.
	ErrInvalidTopic = errors.New("outbox: invalid topic")
	// ErrPayloadTooLarge means a payload exceeds Config.MaxPayloadBytes.
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
)
