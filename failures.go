package outbox

import (
	"context"
	"math/rand/v2"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill"

	"github.com/watermill-outbox/outbox/outboxdriver"
)

// health remembers when this process last dispatched something successfully to each target: the
// Publisher (for every message) and each applier. It tells a poison effect (the target refuses it
// and takes everything else) from an outage (the target takes nothing), so that an outage of any
// length parks nothing.
type health struct {
	mu        sync.Mutex
	publishOK time.Time
	applierOK map[string]time.Time
}

func (h *health) succeeded(e Effect) {
	now := time.Now()
	h.mu.Lock()
	defer h.mu.Unlock()
	if e.Kind == KindPublish {
		h.publishOK = now
		return
	}
	if h.applierOK == nil {
		h.applierOK = map[string]time.Time{}
	}
	h.applierOK[e.Kind] = now
}

// outageTolerance is how long an effect may fail without any sign that its target is otherwise
// healthy before its failures count anyway: on a quiet system a poison effect may be the only
// thing dispatched, and no success elsewhere can tell it from an outage.
const outageTolerance = 24 * time.Hour

// counts tells whether a failed dispatch of e counts toward parking it: when the same target took
// something else since e's previous failure (or since e was stored, for its first), or when e has
// been pending for longer than outageTolerance.
func (h *health) counts(e Effect) bool {
	if e.PendingFor >= outageTolerance {
		return true
	}
	since := e.PendingFor
	if e.Failures > 0 {
		since = e.SinceFailure
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	last := h.publishOK
	if e.Kind != KindPublish {
		last = h.applierOK[e.Kind]
	}
	return !last.IsZero() && last.After(time.Now().Add(-max(since, 0)))
}

// relayBackoff is the pause after the failures-th failed dispatch of an effect: none after the
// first (it may have been momentary), then exponential from one second, capped at five minutes,
// with +-20% jitter so that instances do not retry in lockstep. failures counts every failed
// dispatch, counted or not, so that an outage backs off as a poison effect does.
func relayBackoff(failures int) time.Duration {
	if failures <= 1 {
		return 0
	}
	d := time.Second << min(failures-2, 9)
	d = min(d, 5*time.Minute)
	jitter := time.Duration(rand.Int64N(int64(d)/5*2+1)) - d/5
	return d + jitter
}

// failures returns the store records of a dispatch of effects that sent effects[:sent] and failed
// with err on the call that covered effects[sent:sent+failed]: those are charged (counted when
// their target is otherwise healthy, parked at RelayMaxAttempts), and the ones after them,
// which were not tried, become due for the relay at once (behind the failed ones, when they share
// an ordering key).
func (o *Outbox) failures(effects []Effect, sent, failed int, err error) []outboxdriver.EffectFailure {
	out := make([]outboxdriver.EffectFailure, 0, len(effects)-sent)
	for i, e := range effects[sent:] {
		if i >= failed {
			out = append(out, outboxdriver.EffectFailure{StoreID: e.StoreID})
			continue
		}
		counted := o.health.counts(e)
		attempts := e.Attempts
		if counted {
			attempts++
		}
		out = append(out, outboxdriver.EffectFailure{
			StoreID:    e.StoreID,
			Reason:     err.Error(),
			Counted:    counted,
			Park:       counted && attempts >= o.cfg.RelayMaxAttempts,
			RetryAfter: relayBackoff(e.Failures + 1),
		})
	}
	return out
}

// dispatchFailed records a failed dispatch of the committed effects of src at once, so that a
// redelivered copy knows not to wait for it and the relay retries them (after their backoff)
// even if the message never comes back.
func (o *Outbox) dispatchFailed(ctx context.Context, src Source, effects []Effect, sent, failed int, err error) {
	o.failedHere.add(src)
	fields := watermill.LogFields{"consumer": src.Consumer, "source_id": src.ID, "effects": len(effects) - sent}
	fs := o.failures(effects, sent, failed, err)
	for _, f := range fs {
		if f.Park {
			o.logger.Error("Side effect parked after repeated failures; see Outbox.ParkedEffects", err,
				fields.Add(watermill.LogFields{"store_id": f.StoreID}))
		}
	}
	bctx, cancel := context.WithTimeout(ctx, storeTimeout)
	defer cancel()
	if rerr := o.store.EffectRecordFailures(bctx, fs...); rerr != nil {
		o.logger.Error("Recording a failed dispatch failed; the relay retries the effects after RelayGrace", rerr, fields)
	}
	o.relayNeeded(fields)
	o.wakeRelays(bctx)
}

// storeTimeout bounds one statement of the framework's own outside the unit of work's
// transaction (after the commit, in the background).
const storeTimeout = 30 * time.Second

// recentSources is a small set of sources that expires its entries after a while.
type recentSources struct {
	mu   sync.Mutex
	ttl  time.Duration
	seen map[Source]time.Time
}

const maxRecentSources = 4096

func (r *recentSources) add(src Source) {
	now := time.Now()
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.seen == nil {
		r.seen = map[Source]time.Time{}
	}
	if len(r.seen) >= maxRecentSources {
		for s, t := range r.seen {
			if now.Sub(t) > r.ttl {
				delete(r.seen, s)
			}
		}
		if len(r.seen) >= maxRecentSources {
			clear(r.seen) // only an optimization is lost: a copy may wait DuplicateWait
		}
	}
	r.seen[src] = now
}

func (r *recentSources) contains(src Source) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	t, ok := r.seen[src]
	return ok && time.Since(t) < r.ttl
}

// relayNeeded warns, at most once a minute, when effects were left to a relay and no relay runs
// in this process (Run was never started): they are then sent only by another instance's relay
// or by a redelivery.
func (o *Outbox) relayNeeded(fields watermill.LogFields) {
	if o.relaysRunning.Load() > 0 {
		return
	}
	if !o.noRelayWarned.allow(time.Minute) {
		return
	}
	o.logger.Error("Side effects were left to the relay, but Outbox.Run is not running in this process: "+
		"start it (go ob.Run(ctx)) in every instance, or they are sent only by another instance's relay or a redelivery",
		ErrRelayNotRunning, fields)
}
