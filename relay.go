package outbox

import (
	"context"
	"errors"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/trace"

	"github.com/watermill-outbox/outbox/outboxdriver"
)

// relayLease is how long the relay reserves the effects of one round: long enough to publish
// them (a round stops starting new Publish calls after half of it), short enough that the
// effects of an instance that died mid-round are soon taken over by another.
func (o *Outbox) relayLease() time.Duration { return 2*o.cfg.PublishTimeout + 30*time.Second }

// relayOnce dispatches committed side effects that the path that wrote them left undispatched,
// round after round, until a round finds nothing due. A round leases its effects in one short
// statement and holds nothing (no transaction, no lock) while it publishes them.
func (o *Outbox) relayOnce(ctx context.Context) error {
	var after int64
	for ctx.Err() == nil {
		claim, err := o.store.EffectClaimDue(ctx, outboxdriver.EffectClaimParams{
			Grace:    o.cfg.RelayGrace,
			Limit:    o.cfg.RelayBatchSize,
			MaxBytes: o.cfg.RelayBatchBytes,
			Lease:    o.relayLease(),
			After:    after,
		})
		if err != nil {
			o.tel.relayErrors.Add(ctx, 1)
			return err
		}
		o.tel.lastRelayRound.Store(time.Now().UnixNano())
		if n := len(claim.Effects); n > 0 {
			began := time.Now()
			o.tel.relayRounds.Add(ctx, 1)
			o.tel.relayEffects.Record(ctx, int64(n))
			o.relayRound(ctx, claim.Effects)
			if f := o.cfg.RelayPauseFactor; f > 0 {
				select {
				case <-ctx.Done():
				case <-time.After(time.Duration(f * float64(time.Since(began)))):
				}
			}
		}
		switch n := len(claim.Effects); {
		case claim.Next > 0 && n == o.cfg.RelayBatchSize:
			after = claim.Effects[n-1].StoreID // the window may hold more: go on from here
		case claim.Next > 0:
			after = claim.Next // nothing more due in this window: look further
		case n > 0:
			after = 0 // the end: from the front again, where effects behind the sent ones are due now
		default:
			return nil
		}
	}
	return nil
}

// errNotTried is the outcome of an effect that a relay round did not try: it waited behind a
// failed effect with its ordering key, or the round ran out of time.
var errNotTried = errors.New("not tried")

// relayRound dispatches leased effects and records the outcome of each.
func (o *Outbox) relayRound(ctx context.Context, claimed []Effect) {
	// Effects this process sent and whose mark is still being written are not sent again: the
	// mark takes them out. A round that starts right after a dispatch (its mark lingers a few
	// milliseconds, longer on a loaded database) would otherwise put a second copy on the wire.
	effects := o.marks.unsent(claimed)
	if len(effects) == 0 {
		return
	}
	ctx, span := o.tel.tracer.Start(ctx, "outbox relay", trace.WithLinks(o.tel.producerLinks(effects)...),
		trace.WithAttributes(AttrPath.String(PathRelay), attribute.Int("outbox.effects", len(effects))))
	defer span.End()
	errs := o.relayDispatch(ctx, effects, time.Now().Add(o.relayLease()/2))
	// The outcome is written even when ctx was cancelled meanwhile (a shutdown): what was sent
	// must be marked, or it is sent again.
	wctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), markTimeout)
	defer cancel()
	var marks []outboxdriver.DispatchMark
	bySource := map[Source]int{}
	var fails []outboxdriver.EffectFailure
	for i, e := range effects {
		switch {
		case errs[i] == nil:
			k, ok := bySource[e.Source]
			if !ok {
				k = len(marks)
				bySource[e.Source] = k
				marks = append(marks, outboxdriver.DispatchMark{Source: e.Source, MoveClaim: e.Source.Consumer != ""})
			}
			marks[k].StoreIDs = append(marks[k].StoreIDs, e.StoreID)
		case errors.Is(errs[i], errNotTried):
			fails = append(fails, outboxdriver.EffectFailure{StoreID: e.StoreID})
		default:
			fails = append(fails, o.failures(effects[i:i+1], 0, 1, errs[i])...)
		}
	}
	if len(marks) > 0 {
		pause := 20 * time.Millisecond
		for {
			err := o.store.EffectMarkDispatched(wctx, marks...)
			if err == nil {
				break
			}
			if wctx.Err() != nil || permanent(err) {
				o.tel.markFailures.Add(wctx, 1)
				o.logger.Error("Relay could not mark side effects dispatched; they are sent again when their lease ends", err, nil)
				break
			}
			time.Sleep(pause)
			pause = min(2*pause, time.Second)
		}
	}
	if len(fails) > 0 {
		if err := o.store.EffectRecordFailures(wctx, fails...); err != nil {
			o.logger.Error("Relay could not record failed dispatches; the effects are retried when their lease ends", err, nil)
		}
		for _, f := range fails {
			if f.Park {
				o.logger.Error("Side effect parked after repeated failures; see Outbox.ParkedEffects", nil,
					watermill.LogFields{"store_id": f.StoreID, "reason": f.Reason})
			}
		}
	}
}

// relayDispatch sends effects in store order, consecutive messages to one topic in one Publish
// call; once an effect fails, the later effects with its ordering key are not tried, so that they
// never overtake it. After deadline (or once ctx is done) it starts no new call.
func (o *Outbox) relayDispatch(ctx context.Context, effects []Effect, deadline time.Time) []error {
	errs := make([]error, len(effects))
	failed := map[string]bool{}
	for i := 0; i < len(effects); {
		if failed[effects[i].OrderingKey] || ctx.Err() != nil || time.Now().After(deadline) {
			errs[i] = errNotTried
			i++
			continue
		}
		j := i + 1
		if effects[i].Kind == KindPublish {
			for j < len(effects) && effects[j].Kind == KindPublish && effects[j].Topic == effects[i].Topic &&
				!failed[effects[j].OrderingKey] {
				j++
			}
		}
		sent, n, err := o.dispatch(ctx, PathRelay, effects[i:j])
		switch {
		case err == nil:
		case ctx.Err() != nil || n == 0:
			for k := i + sent; k < j; k++ {
				errs[k] = errNotTried // a shutdown (or a failpoint after a call), not a failure of the effect
			}
		case j-i-sent > 1:
			// One Publish call failed for several effects: send them one by one, so that only the
			// culprit is charged and effects of other keys still go out.
			o.relayEach(ctx, effects[i+sent:j], errs[i+sent:j], failed)
		default:
			o.relayFailed(effects[i+sent], err, failed)
			errs[i+sent] = err
		}
		i = j
	}
	return errs
}

func (o *Outbox) relayEach(ctx context.Context, effects []Effect, errs []error, failed map[string]bool) {
	for k, e := range effects {
		if failed[e.OrderingKey] || ctx.Err() != nil {
			errs[k] = errNotTried
			continue
		}
		if _, _, err := o.dispatch(ctx, PathRelay, effects[k:k+1]); err != nil {
			o.relayFailed(e, err, failed)
			errs[k] = err
		}
	}
}

func (o *Outbox) relayFailed(e Effect, err error, failed map[string]bool) {
	failed[e.OrderingKey] = true
	o.logger.Error("Relay could not dispatch a side effect; it will be retried", err, watermill.LogFields{
		"store_id": e.StoreID, "effect_uuid": e.UUID, "topic": e.Topic, "kind": e.Kind, "failures": e.Failures + 1,
	})
}
