package middleware

import (
	"fmt"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/watermill-outbox/outbox"
)

// Option changes how New identifies consumers and messages.
type Option func(*options)

type options struct {
	consumer  string
	messageID func(*message.Message) (string, error)
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

// New returns the middleware that runs each message of the wrapped handler as one outbox unit of
// work (see outbox.Outbox.Handle). The handler writes through outbox.Tx(msg.Context()) and records
// side effects with outbox.Publish; the messages it returns are stored and dispatched by the
// middleware, which returns none to the Router.
func New(ob *outbox.Outbox, opts ...Option) message.HandlerMiddleware {
	var cfg options
	for _, opt := range opts {
		opt(&cfg)
	}
	return func(next message.HandlerFunc) message.HandlerFunc {
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
			return nil, ob.Handle(msg, p, next)
		}
	}
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
