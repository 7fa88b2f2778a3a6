// Package middleware adapts the outbox unit of work to Watermill: middleware.New(ob) is a
// message.HandlerMiddleware that gives each wrapped handler exactly-once effects. Add it per
// handler; the Router handler name is the consumer identity.
package middleware
