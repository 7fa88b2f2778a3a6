// Package fanout reads many members side by side, a few at a time, for the pages and commands
// that must answer whatever some of the members do (the console's page of members, the CLI's
// status of -members), and shares a call under way among the callers that come while it is out
// (Shared: the console's reads of a member, Health's ping).
package fanout

import (
	"context"
	"sync"
	"time"
)

// State is what became of one call of Each.
type State int

const (
	// NotBegun: its turn had not come when the context ended.
	NotBegun State = iota
	// Pending: it began and had not returned when the context ended.
	Pending
	// Done: it returned, and its result is among Each's results.
	Done
)

// Each calls read(ctx, i) for i from 0 to n-1, in order, at most at of them at once, until ctx
// ends, and returns each one's result and state. A call holds its turn for at most hold: past
// it, the next call begins beside it, and its result still counts if it returns before ctx ends.
// Held until it returned, a turn went to the members that do not answer, and the others were
// never read, during exactly the incidents these reads are for.
//
// Each returns once every call returned or ctx ended. A call still under way then is left to end
// on its own, its result dropped: a driver may not watch the context while it connects (lib/pq,
// to a server that accepts and never answers, without connect_timeout). The caller bounds what
// such calls cost (one at a time per member, say).
func Each[T any](ctx context.Context, n, at int, hold time.Duration, read func(ctx context.Context, i int) T) ([]T, []State) {
	results := make([]T, n)
	states := make([]State, n)
	type done struct {
		i int
		v T
	}
	dones := make(chan done, n) // buffered for all: a call that outlives Each ends without a reader
	turns := make(chan struct{}, max(at, 1))
	take := func(d done) { results[d.i], states[d.i] = d.v, Done }
	started, got := 0, 0
	for i := range n {
		if ctx.Err() != nil { // a free turn and an ended context: select would pick either
			return drain(dones, take, results, states)
		}
	turn:
		for {
			select {
			case turns <- struct{}{}:
				break turn
			case d := <-dones:
				take(d)
				got++
			case <-ctx.Done():
				return drain(dones, take, results, states)
			}
		}
		if ctx.Err() != nil { // the turn came as the context ended
			<-turns
			return drain(dones, take, results, states)
		}
		states[i] = Pending
		started++
		go func() {
			var once sync.Once
			free := func() { once.Do(func() { <-turns }) }
			t := time.AfterFunc(hold, free)
			v := read(ctx, i)
			t.Stop()
			free()
			dones <- done{i, v}
		}()
	}
	for got < started {
		select {
		case d := <-dones:
			take(d)
			got++
		case <-ctx.Done():
			return drain(dones, take, results, states)
		}
	}
	return results, states
}

// drain takes what arrived by the deadline (the last calls ran into it) and returns.
func drain[T any, D any](dones chan D, take func(D), results []T, states []State) ([]T, []State) {
	for {
		select {
		case d := <-dones:
			take(d)
		default:
			return results, states
		}
	}
}
