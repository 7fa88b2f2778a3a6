package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"

	"github.com/google/uuid"

	"github.com/watermill-outbox/outbox"
)

// A driver may keep no idempotency keys (outbox.ErrIdempotencyUnsupported) or no delayed effects
// (outbox.ErrDelayUnsupported). The service then runs without what needs them, and says so: a
// request with an Idempotency-Key gets 501, and a reserved order has no payment timeout. Each call
// site tests the error it gets with errors.Is, never the name of the database, so that a driver
// that gains either is simply used.

// features is what the outbox's driver keeps, as the outbox itself answers.
type features struct {
	keys   bool // idempotency keys: the API's Idempotency-Key
	delays bool // delayed effects: the payment timeout
}

// errProbe rolls back the keyed unit of work of probeFeatures.
var errProbe = errors.New("order-processing: probe of the idempotency keys (rolled back)")

// probeFeatures asks ob, with a unit of work that changes nothing, whether its driver keeps
// idempotency keys and delayed effects. Either unit counts in the boundary metrics.
func probeFeatures(ctx context.Context, ob *outbox.Outbox) (features, error) {
	var f features
	// A keyed unit claims its key before fn runs; fn's error rolls the claim back.
	kctx := outbox.WithIdempotencyKey(ctx, "order-processing-probe", uuid.NewString())
	switch err := ob.InUnit(kctx, func(context.Context) error { return errProbe }); {
	case errors.Is(err, errProbe):
		f.keys = true
	case errors.Is(err, outbox.ErrIdempotencyUnsupported):
	default:
		return f, fmt.Errorf("probe the idempotency keys: %w", err)
	}
	// Cancelling a key that was never recorded cancels nothing.
	switch err := ob.InUnit(ctx, func(ctx context.Context) error {
		_, err := outbox.CancelDelayed(ctx, "order-processing-probe")
		return err
	}); {
	case err == nil:
		f.delays = true
	case errors.Is(err, outbox.ErrDelayUnsupported):
	default:
		return f, fmt.Errorf("probe the delayed effects: %w", err)
	}
	return f, nil
}

// notes tells the user what the service runs without, for the start-up banner; empty: nothing.
func (f features) notes() string {
	var s string
	if !f.keys {
		s += "Idempotency-Key: not supported by this database's outbox driver (outbox.ErrIdempotencyUnsupported):\n" +
			"  a request with one gets 501 Not Implemented\n"
	}
	if !f.delays {
		s += "Payment timeouts: off, this database's outbox driver keeps no delayed effects (outbox.ErrDelayUnsupported):\n" +
			"  an order that waits for a confirmation (over 100 EUR) stays reserved\n"
	}
	return s
}

// noDelayOnce logs once per process that payment timeouts are not recorded.
var noDelayOnce sync.Once

func logNoPaymentTimeout(err error) {
	noDelayOnce.Do(func() {
		slog.Warn("payment timeouts are not recorded: the database's outbox driver keeps no delayed effects; "+
			"a reserved order waits for its payment without a deadline", "error", err)
	})
}
