// Package middleware adapts the outbox unit of work to Watermill: Wrap(ob, h) and
// WrapConsumer(ob, h) give a handler function exactly-once effects, innermost by construction,
// inside whatever middleware the Router adds; New(ob) is the same as a
// message.HandlerMiddleware, to add last. The Router handler name is the consumer identity.
package middleware
