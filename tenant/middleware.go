package tenant

import (
	"context"
	"errors"
	"fmt"
	"runtime"
	"weak"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/watermill-outbox/outbox/middleware"
)

// wrapper is one handler wrapped by the Set's middleware: each member keeps the handler wrapped
// with its own outbox middleware for it, built on the member's first message.
type wrapper struct {
	next message.HandlerFunc
	opts []middleware.Option
	// refuse is next wrapped by the outbox middleware of the Unresolved member, refusing every
	// message with the reason the delivery carries in its context.
	refuse []middleware.Option
	key    weak.Pointer[wrapper] // the members' caches key their handlers for w by it
}

type refusalKey struct{}

// Middleware returns the outbox middleware of the Set (see middleware.New, whose options it
// takes): each message runs as one unit of work of the member the Resolver names, in that
// member's database. A message the Set cannot route (the Resolver fails or names no member) is
// refused as Config.Unresolved says, never acked without a trace, and counted (Refused). Like
// middleware.New, it must be the innermost middleware; Wrap and WrapConsumer make it so, and
// middleware.CheckRouter recognises it.
func (s *Set) Middleware(opts ...middleware.Option) message.HandlerMiddleware {
	// A method value, not a closure: its name (tenant.(*setMiddleware).wrap-fm) is what
	// middleware.CheckRouter recognises, and unlike a closure's it does not change when the
	// compiler inlines Middleware into its caller.
	return (&setMiddleware{set: s, opts: opts}).wrap
}

// setMiddleware is the Set's middleware with its options.
type setMiddleware struct {
	set  *Set
	opts []middleware.Option
}

func (sm *setMiddleware) wrap(next message.HandlerFunc) message.HandlerFunc {
	s := sm.set
	w := &wrapper{next: next, opts: sm.opts}
	w.key = weak.Make(w)
	// The members' handlers built for w go with w: a wrap per message (a handler wrapped where
	// it is called) kept one per member it reached, for good.
	runtime.AddCleanup(w, s.forgetWrapper, w.key)
	w.refuse = append(append([]middleware.Option(nil), sm.opts...), middleware.WithRefusal(func(msg *message.Message) error {
		err, _ := msg.Context().Value(refusalKey{}).(error)
		return err
	}), middleware.WithMessageID(refusedID))
	return func(msg *message.Message) ([]*message.Message, error) {
		name, err := s.resolve(msg)
		var m *member
		switch {
		case err != nil:
		case name == s.cfg.Unresolved:
			// Not a tenant: it keeps what the Set refuses, and a message naming it is refused too.
			err = fmt.Errorf("%w: the message names the Unresolved member %q", ErrUnresolved, name)
		default:
			if m = s.enter(name); m == nil {
				err = fmt.Errorf("%w: member %q is not in the Set", ErrUnresolved, name)
			}
		}
		if err != nil {
			return nil, s.refuseMessage(w, msg, err)
		}
		defer m.leave()
		parent := msg.Context()
		msg.SetContext(s.stamp(parent, name))
		defer msg.SetContext(parent)
		return m.handler(w)(msg)
	}
}

// refusedID is the ID under which the Unresolved member keeps a message the Set refused: the UUID
// that every redelivery of it carries, not the ID the options read (middleware.WithMessageID).
// That one may be a key of its tenant's (an order number), which messages of two tenants share:
// the Unresolved member holds the refusals of every tenant, and the second message refused under
// a shared key was taken for a copy of the first and acked without a dead letter of its own. A
// message without a UUID is kept under an ID derived from what each of its copies carries
// (outbox.HandleParams.MessageIDErr).
func refusedID(msg *message.Message) (string, error) {
	if msg.UUID == "" {
		return "", errors.New("the message has no UUID")
	}
	return msg.UUID, nil
}

// Wrap returns h run as one unit of work per message on the member the message resolves to
// (middleware.Wrap on the Set).
func (s *Set) Wrap(h message.HandlerFunc, opts ...middleware.Option) message.HandlerFunc {
	return s.Middleware(opts...)(h)
}

// WrapConsumer is Wrap for a handler that returns no messages (Router.AddConsumerHandler).
func (s *Set) WrapConsumer(h message.NoPublishHandlerFunc, opts ...middleware.Option) message.NoPublishHandlerFunc {
	wrapped := s.Middleware(opts...)(func(msg *message.Message) ([]*message.Message, error) {
		return nil, h(msg)
	})
	return func(msg *message.Message) error {
		_, err := wrapped(msg)
		return err
	}
}

// handler returns w's handler wrapped with m's outbox middleware.
func (m *member) handler(w *wrapper) message.HandlerFunc {
	m.mu.Lock()
	defer m.mu.Unlock()
	h, ok := m.wrapped[w.key]
	if !ok {
		h = middleware.New(m.ob, w.opts...)(w.next) // holds w.next and w.opts, not w
		m.wrapped[w.key] = h
	}
	return h
}

// forgetWrapper drops the members' handlers for a wrapper that is gone.
func (s *Set) forgetWrapper(key weak.Pointer[wrapper]) {
	s.mu.Lock()
	ms := s.everyMember()
	s.mu.Unlock()
	for _, m := range ms {
		m.mu.Lock()
		delete(m.wrapped, key)
		m.mu.Unlock()
	}
}

// resolve names msg's member, with a panicking or empty Resolver turned into a refusal.
func (s *Set) resolve(msg *message.Message) (name string, err error) {
	defer func() {
		if r := recover(); r != nil {
			name, err = "", fmt.Errorf("%w: the Resolver panicked: %v", ErrUnresolved, r)
		}
	}()
	name, err = s.cfg.Resolver(msg)
	switch {
	case err != nil:
		return "", fmt.Errorf("%w: %w", ErrUnresolved, err)
	case name == "":
		return "", fmt.Errorf("%w: the Resolver named no member", ErrUnresolved)
	}
	return name, nil
}

// refuseMessage refuses msg for reason: rejected in the Unresolved member when there is one
// (its dead letters, or its PoisonTopic), nacked otherwise.
func (s *Set) refuseMessage(w *wrapper, msg *message.Message, reason error) error {
	s.refused.Add(1)
	fields := watermill.LogFields{"message_uuid": msg.UUID, "consumer": message.HandlerNameFromCtx(msg.Context())}
	if s.cfg.Unresolved != "" {
		if m := s.enter(s.cfg.Unresolved); m != nil {
			defer m.leave()
			// Not cached per wrapper like the members' handlers: refusals are rare, and the
			// middleware built here only carries the reason to the member's reject path.
			parent := msg.Context()
			msg.SetContext(context.WithValue(parent, refusalKey{}, reason))
			defer msg.SetContext(parent)
			_, err := middleware.New(m.ob, w.refuse...)(w.next)(msg)
			if err != nil {
				return fmt.Errorf("tenant: refusing the message in member %q: %w", m.name, err)
			}
			s.cfg.Logger.Info("tenant: message refused in the Unresolved member", fields.Add(watermill.LogFields{"member": m.name, "reason": reason.Error()}))
			return nil
		}
	}
	s.cfg.Logger.Error("tenant: message refused and nacked (no Unresolved member)", reason, fields)
	return reason
}
