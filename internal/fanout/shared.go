package fanout

import (
	"sync"
	"time"
)

// Shared runs one call at a time per key, which the callers that come while it is out share:
// a member whose database does not answer gets one read, not one more per page load or health
// check, each a goroutine and a connection attempt left behind (a driver may not watch the
// context while it connects). A call out past the age the caller gives is given up for a new one,
// since the database may be back. The zero value is ready to use.
type Shared[K comparable, T any] struct {
	mu  sync.Mutex
	out map[K]*Flight[T]
}

// Flight is one call of a Shared.
type Flight[T any] struct {
	// Began is when the call began.
	Began time.Time
	done  chan struct{}
	val   T
}

// Done is closed when the call returned.
func (f *Flight[T]) Done() <-chan struct{} { return f.done }

// Value returns what the call returned, once Done is closed.
func (f *Flight[T]) Value() T {
	<-f.done
	return f.val
}

// Join returns the call of key under way, or begins call on a goroutine of its own when none is,
// or when the one under way began more than giveUp ago (left to end on its own, its result
// dropped). A panic in call is not recovered: it is the program's, as in any goroutine.
func (s *Shared[K, T]) Join(key K, giveUp time.Duration, call func() T) *Flight[T] {
	s.mu.Lock()
	defer s.mu.Unlock()
	if f := s.out[key]; f != nil && time.Since(f.Began) <= giveUp {
		return f
	}
	f := &Flight[T]{Began: time.Now(), done: make(chan struct{})}
	if s.out == nil {
		s.out = map[K]*Flight[T]{}
	}
	s.out[key] = f
	go func() {
		v := call()
		s.mu.Lock()
		defer s.mu.Unlock()
		if s.out[key] == f { // else given up for a newer one
			delete(s.out, key)
		}
		f.val = v
		close(f.done)
	}()
	return f
}

// Began returns when the call of key under way began (zero: none is).
func (s *Shared[K, T]) Began(key K) time.Time {
	s.mu.Lock()
	defer s.mu.Unlock()
	if f := s.out[key]; f != nil {
		return f.Began
	}
	return time.Time{}
}
