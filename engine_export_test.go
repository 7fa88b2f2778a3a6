package outbox

import (
	"context"
	"fmt"

	"github.com/watermill-outbox/outbox/internal/engine"
)

// SharedEngine runs the periodic services of several Outboxes on one engine, as a set of
// Outboxes does (their listeners aside), for the tests of package outbox_test.
type SharedEngine struct {
	eng     *engine.Engine
	obs     []*Outbox
	members []*engine.Handle
}

// StartSharedEngine starts one engine of at most maxConcurrent calls running the services of obs.
func StartSharedEngine(ctx context.Context, maxConcurrent int, obs ...*Outbox) (*SharedEngine, error) {
	s := &SharedEngine{eng: engine.New(engine.Config{MaxConcurrent: maxConcurrent}), obs: obs}
	for i, o := range obs {
		m := o.engineMember(fmt.Sprint("member", i), 0)
		h, err := s.eng.Add(m)
		if err != nil {
			return nil, err
		}
		s.members = append(s.members, h)
	}
	return s, s.eng.Start(ctx)
}

// Remove takes the services of obs[i] off the engine, as a Set removing a member.
func (s *SharedEngine) Remove(ctx context.Context, i int) error { return s.members[i].Remove(ctx) }

// Stop stops the engine and, as Run does when it returns, the Outboxes' due timers and marks.
func (s *SharedEngine) Stop(ctx context.Context) error {
	err := s.eng.Stop(ctx)
	for _, o := range s.obs {
		o.due.stop()
		o.marks.wait()
	}
	return err
}
