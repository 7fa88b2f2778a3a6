package outbox

import (
	"context"
	"math/rand/v2"
	"time"

	"github.com/ThreeDotsLabs/watermill"
)

// relayOnce dispatches committed side effects that the path that wrote them left undispatched,
// round after round, until a round finds nothing due in the partitions it could lock.
func (o *Outbox) relayOnce(ctx context.Context) error {
	for ctx.Err() == nil {
		n, err := o.store.EffectRelay(ctx, EffectRelayParams{
			Grace:       o.cfg.RelayGrace,
			Limit:       o.cfg.RelayBatchSize,
			MaxAttempts: o.cfg.RelayMaxAttempts,
			Backoff:     relayBackoff,
		}, func(effects []Effect) []error { return o.relayDispatch(ctx, effects) })
		if err != nil {
			return err
		}
		if n == 0 {
			return nil
		}
	}
	return nil
}

// relayDispatch sends effects in store order, consecutive messages to one topic in one Publish
// call; once an effect fails, the later effects with its ordering key are not tried, so that they
// never overtake it.
func (o *Outbox) relayDispatch(ctx context.Context, effects []Effect) []error {
	errs := make([]error, len(effects))
	failed := map[string]bool{}
	for i := 0; i < len(effects); {
		if failed[effects[i].OrderingKey] {
			errs[i] = ErrEffectBlocked
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
		if err := o.dispatch(ctx, effects[i:j]); err != nil {
			if j-i > 1 {
				// One Publish call failed for several effects: send them one by one, so that only
				// the culprit is charged and effects of other keys still go out.
				o.relayEach(ctx, effects[i:j], errs[i:j], failed)
			} else {
				o.relayFailed(effects[i], err, failed)
				errs[i] = err
			}
		}
		i = j
	}
	return errs
}

func (o *Outbox) relayEach(ctx context.Context, effects []Effect, errs []error, failed map[string]bool) {
	for k, e := range effects {
		if failed[e.OrderingKey] {
			errs[k] = ErrEffectBlocked
			continue
		}
		if err := o.dispatch(ctx, effects[k:k+1]); err != nil {
			o.relayFailed(e, err, failed)
			errs[k] = err
		}
	}
}

func (o *Outbox) relayFailed(e Effect, err error, failed map[string]bool) {
	failed[e.OrderingKey] = true
	o.logger.Error("Relay could not dispatch a side effect; it will be retried", err, watermill.LogFields{
		"effect_uuid": e.UUID, "topic": e.Topic, "kind": e.Kind, "attempts": e.Attempts + 1,
	})
}

// relayBackoff is exponential from one second, capped at five minutes, with +-20% jitter so that
// instances do not retry in lockstep.
func relayBackoff(attempts int) time.Duration {
	d := time.Second << min(attempts-1, 9)
	d = min(d, 5*time.Minute)
	jitter := time.Duration(rand.Int64N(int64(d)/5*2+1)) - d/5
	return d + jitter
}
