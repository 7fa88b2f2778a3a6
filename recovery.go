package outbox

import (
	"context"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill"

	"github.com/watermill-outbox/outbox/outboxdriver"
)

// recovery remembers the destinations that were down (a call failed while nothing reached them
// since the effect's previous failure: an uncounted failure, see health.counts), so that the
// first call one takes again makes the effects that back off for it due at once, rather than
// when their retry time comes: up to five minutes after an outage ended (the backoff's cap). It
// is per destination: the effects of one that is still down keep backing off. A poison effect's
// counted failures do not mark its destination down, so that the successes of the other effects
// to it do not retry it at once each time.
//
// A call that succeeds for an effect that had failed while its target was down (Failures >
// Attempts; the failure may have been recorded by another instance, or before a restart) counts
// too, at most once per retriedRecall for each destination: when the backed-off effects go out,
// each of them would otherwise cost a look-up.
type recovery struct {
	failing atomic.Int32 // len(failed): a successful call reads nothing else while nothing fails
	mu      sync.Mutex
	failed  map[string]destination // failed since their last successful call
	due     map[string]destination // took a call since: their backed-off effects are to be made due
	last    map[string]time.Time   // when each was last made due
}

// destination is where an effect goes: a topic (Kind is KindPublish) or an applier.
type destination struct{ kind, topic string }

const (
	// retriedRecall bounds how often a call of an effect that had failed before makes the effects
	// of its destination due.
	retriedRecall = 10 * time.Second
	// maxRecoveryDestinations bounds what recovery remembers; beyond it, effects wait for their
	// retry time, as before.
	maxRecoveryDestinations = 4096
	// retryNowBatch is how many backed-off effects one statement makes due; the relay makes more
	// due at its next turn.
	retryNowBatch = 1000
)

func destinationKey(e Effect) (string, destination) {
	if e.Kind == KindPublish {
		return destinationOf(e), destination{kind: KindPublish, topic: e.Topic}
	}
	return destinationOf(e), destination{kind: e.Kind}
}

// failedCall notes that a call to e's destination failed while nothing reached it.
func (r *recovery) failedCall(e Effect) {
	key, d := destinationKey(e)
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.failed == nil {
		r.failed = map[string]destination{}
	}
	if len(r.failed) < maxRecoveryDestinations {
		r.failed[key] = d
	}
	r.failing.Store(int32(len(r.failed)))
}

// succeededCall notes that a call to e's destination succeeded; retried tells whether an effect
// of the call had failed while its target was down. It reports whether the destination's backed-off effects are to
// be made due (take returns it then).
func (r *recovery) succeededCall(e Effect, retried bool) bool {
	if !retried && r.failing.Load() == 0 {
		return false
	}
	key, d := destinationKey(e)
	now := time.Now()
	r.mu.Lock()
	defer r.mu.Unlock()
	_, failed := r.failed[key]
	if !failed && (!retried || now.Sub(r.last[key]) < retriedRecall) {
		return false
	}
	delete(r.failed, key)
	r.failing.Store(int32(len(r.failed)))
	if r.due == nil {
		r.due = map[string]destination{}
	}
	if r.last == nil || len(r.last) >= maxRecoveryDestinations {
		r.last = map[string]time.Time{} // only the rate limit of retried calls is lost
	}
	r.due[key] = d
	r.last[key] = now
	return true
}

// take returns the destinations whose backed-off effects are to be made due, and forgets them.
func (r *recovery) take() map[string]destination {
	r.mu.Lock()
	defer r.mu.Unlock()
	due := r.due
	r.due = nil
	return due
}

// again makes d due for the next take, unless it failed since.
func (r *recovery) again(key string, d destination) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if _, failed := r.failed[key]; failed {
		return
	}
	if r.due == nil {
		r.due = map[string]destination{}
	}
	r.due[key] = d
}

// retryRecovered makes the effects that back off for the destinations that took a call again due
// now, so that the relay's next claim takes them. A store that cannot (not an
// outboxdriver.EffectRetrier) leaves them to their retry time. An error is logged: the effects go
// out at their retry time, as they would have. An error that says the database cannot be reached
// is returned instead, unlogged (the gate reports the outage), and every destination not yet
// made due is kept for the turn after it: one connection attempt, not one per destination, and
// the effects of each go out as soon as the database is back rather than at their retry time.
func (o *Outbox) retryRecovered(ctx context.Context) error {
	due := o.recovery.take()
	if len(due) == 0 {
		return nil
	}
	r, ok := o.store.(outboxdriver.EffectRetrier)
	if !ok {
		return nil
	}
	ctx, cancel := context.WithTimeout(ctx, storeTimeout)
	defer cancel()
	var gone error
	for key, d := range due {
		if gone != nil {
			o.recovery.again(key, d)
			continue
		}
		n, err := r.EffectRetryNow(ctx, d.kind, d.topic, retryNowBatch)
		if err != nil {
			if o.unreachable(err) { // the gate is told by the relay's caller, which gets it
				gone = err
				o.recovery.again(key, d)
				continue
			}
			if ctx.Err() == nil {
				o.logger.Error("Relay could not make the effects that back off for a destination that recovered due; they go out at their retry time", err,
					watermill.LogFields{"destination": key})
			}
			continue
		}
		if n >= retryNowBatch {
			o.recovery.again(key, d)
		}
		if n > 0 {
			o.logger.Info("Destination takes calls again: the side effects that backed off for it are due now",
				watermill.LogFields{"destination": key, "effects": n})
		}
	}
	return gone
}
