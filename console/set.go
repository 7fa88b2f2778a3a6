package console

import (
	"context"
	"fmt"
	"io"
	"sync"
	"sync/atomic"

	"github.com/watermill-outbox/outbox"
	"github.com/watermill-outbox/outbox/ops"
	"github.com/watermill-outbox/outbox/tenant"
)

// MembersOf returns the members of set for NewMembersFunc, as set holds them at each call: each
// one's Ops (ops.ForOutbox of its Outbox) and Health, the Unresolved member's too.
//
// The Ops of a member is built once per name and Outbox, and kept while the Set holds that
// Outbox under that name: an Ops prepares its statements on the pool as it runs them, so that
// one per request would pile them up. A member removed, or added again with another Outbox, gets
// a new one, and the old one's statements are closed once every call that returned it has seen
// its ctx end (the console's requests end theirs when they are served): pass a ctx that ends.
func MembersOf(set *tenant.Set) func(ctx context.Context) ([]Member, error) {
	s := &setMembers{set: set, held: map[string]*heldOps{}}
	return s.members
}

type setMembers struct {
	set *tenant.Set

	mu   sync.Mutex
	held map[string]*heldOps // by member name
}

// heldOps is the Ops of a member's Outbox.
type heldOps struct {
	ob    *outbox.Outbox
	ops   *ops.Ops
	users int  // calls whose ctx has not ended
	gone  bool // no longer the member's: closed when users is 0
	// closed: its statements were closed (exactly once: users reaches 0 after gone once).
	closed atomic.Bool
}

func (s *setMembers) members(ctx context.Context) ([]Member, error) {
	names := s.set.Members()
	list := make([]Member, 0, len(names))
	used := make([]*heldOps, 0, len(names))
	var closing []*heldOps
	s.mu.Lock()
	now := make(map[string]bool, len(names))
	for _, name := range names {
		ob, ok := s.set.Member(name)
		if !ok {
			continue // removed since Members
		}
		h := s.held[name]
		if h == nil || h.ob != ob {
			o, err := ops.ForOutbox(ob)
			if err != nil {
				closing = append(closing, s.release(used)...)
				s.mu.Unlock()
				closeOps(closing)
				return nil, fmt.Errorf("console: member %q: %w", name, err)
			}
			if h != nil {
				closing = s.retire(closing, h)
			}
			h = &heldOps{ob: ob, ops: o}
			s.held[name] = h
		}
		now[name] = true
		h.users++
		used = append(used, h)
		list = append(list, Member{Name: name, Ops: h.ops, Health: ob.Health})
	}
	for name, h := range s.held {
		if !now[name] {
			delete(s.held, name)
			closing = s.retire(closing, h)
		}
	}
	s.mu.Unlock()
	closeOps(closing)
	context.AfterFunc(ctx, func() {
		s.mu.Lock()
		closing := s.release(used)
		s.mu.Unlock()
		closeOps(closing)
	})
	return list, nil
}

// retire marks h as no longer its member's, and adds it to closing if no call uses it. Called
// with s.mu held.
func (s *setMembers) retire(closing []*heldOps, h *heldOps) []*heldOps {
	h.gone = true
	if h.users == 0 {
		closing = append(closing, h)
	}
	return closing
}

// release ends one use of each of used, and returns those to close. Called with s.mu held.
func (s *setMembers) release(used []*heldOps) (closing []*heldOps) {
	for _, h := range used {
		if h.users--; h.users == 0 && h.gone {
			closing = append(closing, h)
		}
	}
	return closing
}

// closeOps closes the statements of each Ops, outside s.mu: closing one may reach the database.
func closeOps(hs []*heldOps) {
	for _, h := range hs {
		h.closed.Store(true)
		if c, ok := h.ops.Store().(io.Closer); ok {
			_ = c.Close() // the statements' connections are the Outbox's pool's, which outlives them
		}
	}
}
