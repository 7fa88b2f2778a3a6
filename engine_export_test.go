package outbox

import (
	"context"
	"errors"
	"fmt"

	"github.com/watermill-outbox/outbox/internal/engine"
)

// SharedEngine runs the periodic services of several Outboxes on one engine through JoinEngine,
// as a set of Outboxes does, for the tests of package outbox_test.
type SharedEngine struct {
	eng    *engine.Engine
	leaves []func() error
	left   []bool
}

// StartSharedEngine starts one engine of at most maxConcurrent calls running the services of obs.
func StartSharedEngine(ctx context.Context, maxConcurrent int, obs ...*Outbox) (*SharedEngine, error) {
	s := &SharedEngine{eng: engine.New(engine.Config{MaxConcurrent: maxConcurrent}), left: make([]bool, len(obs))}
	if err := s.eng.Start(ctx); err != nil {
		return nil, err
	}
	for i, o := range obs {
		leave, err := o.JoinEngine(ctx, s.eng, fmt.Sprint("member", i), 0, nil, nil)
		if err != nil {
			return nil, errors.Join(err, s.Stop(context.WithoutCancel(ctx)))
		}
		s.leaves = append(s.leaves, leave)
	}
	return s, nil
}

// Remove takes the services of obs[i] off the engine, as a Set removing a member.
func (s *SharedEngine) Remove(_ context.Context, i int) error {
	s.left[i] = true
	return s.leaves[i]()
}

// Stop takes the members still on the engine off it, as a Set's Run does when it returns, and
// stops the engine.
func (s *SharedEngine) Stop(ctx context.Context) error {
	var errs []error
	for i, leave := range s.leaves {
		if !s.left[i] {
			s.left[i] = true
			errs = append(errs, leave())
		}
	}
	return errors.Join(append(errs, s.eng.Stop(ctx))...)
}
