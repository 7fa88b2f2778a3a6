package middleware

import (
	"fmt"
	"reflect"
	"strings"
	"sync"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/watermill-outbox/outbox"
)

// Option changes how New identifies consumers and messages.
type Option func(*options)

type options struct {
	consumer  string
	messageID func(*message.Message) (string, error)
	refuse    func(*message.Message) error
}

// WithConsumer sets the consumer identity under which messages are deduplicated. Default: the
// Router handler name. Two handlers with the same consumer identity share their processed IDs.
func WithConsumer(name string) Option {
	return func(o *options) { o.consumer = name }
}

// WithMessageID sets how the deduplication ID is read from a message. Default: msg.UUID, which
// every Watermill pub/sub keeps across redeliveries. Use it when producers put a business key in
// the metadata.
func WithMessageID(fn func(*message.Message) (string, error)) Option {
	return func(o *options) { o.messageID = fn }
}

// WithRefusal sets a check that runs before each message's unit of work: a message for which fn
// returns an error is refused with that error as the reason, like one whose ID cannot be read
// (dead letter, PoisonTopic, or nack; see outbox.HandleParams.Refuse), and the handler does not
// run. tenant.Set uses it for the messages it cannot route to a member.
func WithRefusal(fn func(*message.Message) error) Option {
	return func(o *options) { o.refuse = fn }
}

// New returns the middleware that runs each message of the wrapped handler as one outbox unit of
// work (see outbox.Outbox.Handle). The handler writes through outbox.Tx(msg.Context()) and records
// side effects with outbox.Publish; the messages it returns are stored and dispatched by the
// middleware, which returns none to the Router.
//
// It must be the innermost middleware of the handler (Wrap makes it so by construction). What it
// can see of the wiring it checks as it runs: Watermill's Retry, PoisonQueue or InstantAck
// directly inside it, and a PoisonQueue anywhere inside it that poisons a message, make every
// message fail with ErrUnsafeMiddlewareOrder (rolled back, not counted as a failed attempt); a
// message acked before it reaches the middleware (InstantAck outside it) is logged at ERROR
// once, and handled. CheckRouter sees the whole chain before the Router runs.
func New(ob *outbox.Outbox, opts ...Option) message.HandlerMiddleware {
	var cfg options
	for _, opt := range opts {
		opt(&cfg)
	}
	return func(next message.HandlerFunc) message.HandlerFunc {
		inner := innerMiddleware(funcName(reflect.ValueOf(next)))
		guarded := guard(next, inner)
		var ackedOnce sync.Once
		return func(msg *message.Message) ([]*message.Message, error) {
			ctx := msg.Context()
			p := outbox.HandleParams{
				Consumer:   cfg.consumer,
				MessageID:  msg.UUID,
				ReplyTopic: message.PublishTopicFromCtx(ctx),
				Topic:      message.SubscribeTopicFromCtx(ctx),
			}
			if p.Consumer == "" {
				p.Consumer = message.HandlerNameFromCtx(ctx)
			}
			if p.Consumer == "" {
				return nil, fmt.Errorf("%w: the message context has no Router handler name; use middleware.WithConsumer", outbox.ErrNoConsumerName)
			}
			if cfg.messageID != nil {
				id, err := readID(cfg.messageID, msg)
				if err != nil {
					p.MessageIDErr = fmt.Errorf("reading the message ID: %w", err)
				}
				p.MessageID = id
			}
			if cfg.refuse != nil {
				p.Refuse = refusal(cfg.refuse, msg)
			}
			if acked(msg) {
				// Refusing it would lose it: the broker already forgot it. Handle it, and say why a
				// crash now would lose such messages.
				ackedOnce.Do(func() {
					ob.Config().Logger.Error("Message acked before its unit of work: InstantAck (or another middleware that acks) runs outside the outbox middleware; a crash loses such messages",
						outbox.ErrUnsafeMiddlewareOrder, watermill.LogFields{"consumer": p.Consumer, "message_uuid": msg.UUID})
				})
			}
			return nil, ob.Handle(msg, p, guarded)
		}
	}
}

// Wrap returns h run as one outbox unit of work per message: the outbox middleware applied to
// the handler function itself, and so inside whatever middleware the Router and the handler add
// (Retry, PoisonQueue, Timeout), which then see the outcome of whole units of work. It is the
// wiring to prefer over AddMiddleware(New(ob)), whose place in the chain depends on the order of
// the AddMiddleware calls:
//
//	router.AddHandler("orders", "orders", sub, "events", pub, middleware.Wrap(ob, handle))
func Wrap(ob *outbox.Outbox, h message.HandlerFunc, opts ...Option) message.HandlerFunc {
	return New(ob, opts...)(h)
}

// WrapConsumer is Wrap for a handler that returns no messages (Router.AddConsumerHandler).
func WrapConsumer(ob *outbox.Outbox, h message.NoPublishHandlerFunc, opts ...Option) message.NoPublishHandlerFunc {
	wrapped := New(ob, opts...)(func(msg *message.Message) ([]*message.Message, error) {
		return nil, h(msg)
	})
	return func(msg *message.Message) error {
		_, err := wrapped(msg)
		return err
	}
}

// guard returns next with the wiring errors it can see turned into ErrUnsafeMiddlewareOrder:
// inner names the Watermill middleware next belongs to ("" for anything else).
func guard(next message.HandlerFunc, inner string) message.HandlerFunc {
	switch inner {
	case "Retry", "PoisonQueue", "InstantAck", "Duplicator", "IgnoreErrors":
		err := fmt.Errorf("%w: Watermill's %s runs inside the outbox middleware (%s); wrap the handler with middleware.Wrap, or add the outbox middleware after %s",
			outbox.ErrUnsafeMiddlewareOrder, inner, innerHarm[inner], inner)
		return func(*message.Message) ([]*message.Message, error) { return nil, err }
	}
	return func(msg *message.Message) ([]*message.Message, error) {
		before, had := msg.Metadata[reasonPoisonedKey]
		out, err := next(msg)
		if after, has := msg.Metadata[reasonPoisonedKey]; err == nil && has && (!had || after != before) {
			// A PoisonQueue inside turned the handler's failure into a success: committing would
			// keep what the failed attempt wrote.
			return nil, fmt.Errorf("%w: a PoisonQueue inside the outbox middleware poisoned the message (%s) and reported success; the unit of work is rolled back; wrap the handler with middleware.Wrap, or add the outbox middleware after PoisonQueue",
				outbox.ErrUnsafeMiddlewareOrder, after)
		}
		return out, err
	}
}

// reasonPoisonedKey is the metadata key Watermill's PoisonQueue sets on the message it poisons
// (middleware.ReasonForPoisonedKey; not imported, so that this package pulls in none of
// Watermill's middleware dependencies).
const reasonPoisonedKey = "reason_poisoned"

var innerHarm = map[string]string{
	"Retry":        "it would apply a failed attempt's business change again in the same transaction",
	"PoisonQueue":  "it would commit what a failed attempt wrote",
	"InstantAck":   "it acks before the commit",
	"Duplicator":   "it would run the handler twice in one transaction, committing its writes and side effects twice",
	"IgnoreErrors": "it would commit what a failed attempt wrote when it ignores the error",
}

// innerMiddleware names the Watermill middleware that the handler function named name belongs
// to: a closure of Watermill's middleware package, or one the compiler inlined into its caller
// (wmw.InstantAck(handle) passed as the handler is named after the calling function).
func innerMiddleware(name string) string {
	if kind := watermillMiddleware(name); kind != "" {
		return kind
	}
	for kind, inlined := range map[string]string{"Retry": ".Retry.Middleware.func", "InstantAck": ".InstantAck.func", "Duplicator": ".Duplicator.func",
		"IgnoreErrors": ".IgnoreErrors.Middleware.func"} {
		if strings.Contains(name, inlined) {
			return kind
		}
	}
	return ""
}

// acked reports whether msg was acked already.
func acked(msg *message.Message) bool {
	select {
	case <-msg.Acked():
		return true
	default:
		return false
	}
}

// refusal runs the WithRefusal check; a panic in it refuses the message, as the check's error
// would: unrecovered, it crashed the process, or (under a Recoverer) nacked the message for ever.
func refusal(fn func(*message.Message) error, msg *message.Message) (err error) {
	defer func() {
		if r := recover(); r != nil {
			err = fmt.Errorf("the WithRefusal check panicked: %v", r)
		}
	}()
	return fn(msg)
}

// readID calls the WithMessageID function, turning a panic into an error: the message is then
// rejected like one without a usable ID.
func readID(fn func(*message.Message) (string, error), msg *message.Message) (id string, err error) {
	defer func() {
		if r := recover(); r != nil {
			id, err = "", fmt.Errorf("the WithMessageID function panicked: %v", r)
		}
	}()
	return fn(msg)
}
