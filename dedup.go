package outbox

import (
	"context"
	"fmt"
	"slices"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill"

	"github.com/watermill-outbox/outbox/outboxdriver"
)

// copyWon tells whether a claim of src committed (by a copy of the message).
func (o *Outbox) copyWon(ctx context.Context, src Source) bool {
	bctx, cancel := context.WithTimeout(ctx, storeTimeout)
	defer cancel()
	done, err := o.store.MessageIsProcessed(bctx, src)
	return err == nil && done
}

// lostToCopy handles a unit of work of the optimistic mode that a copy of the message beat to
// its commit: it rolled back, and the message is a duplicate of the copy's.
func (o *Outbox) lostToCopy(ctx context.Context, src Source, fields watermill.LogFields) error {
	claim := outboxdriver.Claim{Concurrent: true}
	o.duplicateSeen(ctx, src, claim)
	return o.redeliver(ctx, src, claim, fields)
}

// duplicateSeen counts a duplicate delivery by the age of the claim it found, and reports one
// that comes late in the dedup window: one a little later would have run the handler again.
func (o *Outbox) duplicateSeen(ctx context.Context, src Source, claim outboxdriver.Claim) {
	setOutcome(ctx, OutcomeDuplicate)
	consumer := o.tel.attrs(AttrConsumer, src.Consumer, "", "")
	o.tel.duplicateAge.Record(ctx, claim.Age.Seconds(), consumer)
	if claim.Age <= o.cfg.Retention/2 {
		return
	}
	o.tel.duplicatesLate.Add(ctx, 1, consumer)
	if !o.tel.lateWarned.allow(time.Minute) {
		return
	}
	o.logger.Error("A duplicate came late in the dedup window: its claim was older than half of Retention. "+
		"A copy redelivered after Retention runs the handler again; raise Retention above the broker's redelivery horizon "+
		"(see docs/operations.md)", ErrRetentionTooShort, watermill.LogFields{
		"consumer": src.Consumer, "message_id": src.ID, "claim_age": claim.Age.String(), "retention": o.cfg.Retention.String(),
	})
}

// redeliver is the duplicate path: the message was processed before, so only side effects still
// pending are dispatched, with their original UUIDs and order. Parked effects are the operator's:
// they are not sent, nor is anything behind them with their ordering key, and they do not keep
// the message from being acked.
func (o *Outbox) redeliver(ctx context.Context, src Source, claim outboxdriver.Claim, fields watermill.LogFields) error {
	if claim.Settled {
		// The claim's statement saw nothing of it pending, which stays so (a delayed effect due
		// later is the relay's to send): no second read.
		o.logger.Debug("Duplicate message skipped", fields.Add(watermill.LogFields{"pending_effects": 0, "parked_effects": 0}))
		return nil
	}
	pending, parked, err := o.listPending(ctx, src)
	if err != nil {
		return err
	}
	o.logger.Debug("Duplicate message skipped", fields.Add(watermill.LogFields{"pending_effects": len(pending), "parked_effects": parked}))
	if parked > 0 && len(pending) == 0 {
		o.logger.Info("Duplicate message acked; its undispatched side effects are parked (`outbox parked list`, or the web console)", fields)
	}
	// What this process sent and whose mark is still being written is not pending: a
	// redelivery right after a partial failure must send only what did not go out.
	if pending = o.marks.unsent(pending); len(pending) == 0 {
		return nil
	}
	if wait := o.duplicateWait(src, claim, pending); wait > 0 {
		// The original is most likely sending these effects right now (this copy waited on its
		// claim, or they are this young and no failure of theirs is known): let it, rather than
		// put a second copy on the wire, and send only what is still pending once it is done, has
		// failed, or the wait is over.
		if pending, err = o.awaitDispatch(ctx, src, wait); err != nil {
			return err
		}
		if len(pending) == 0 {
			return nil
		}
	}
	if hasInline(pending) {
		// The original did not send them (it failed, or crashed): from now on they are rows,
		// which the relay also sees, so that each is marked, retried or parked on its own.
		// Leased as a relay round would lease them: the relays leave them to this dispatch.
		// Unless an earlier effect of one of their keys holds them back: then the dispatch
		// leaves them to the relay at once, which sends them in order (leased, they waited
		// the lease out, those of the message's own key too).
		lease := o.relayLease()
		if blocked, err := o.keyBlocked(ctx, src, pending); err != nil {
			return err
		} else if blocked {
			lease = 0
		}
		if pending, err = o.materialize(ctx, src, pending, lease); err != nil {
			return err
		}
		if pending, _ = sendable(pending); len(pending) == 0 {
			return nil
		}
	}
	// A re-send after the claim's own dispatch failed or was lost: retention counts from now.
	return o.dispatchAndMark(ctx, PathRedelivery, src, pending, time.Time{}, fields)
}

// duplicateWait is how long a duplicate waits for the original to dispatch pending: never when
// the original is known to have failed (here, or as recorded in the database); DuplicateWait when
// the copy waited on the original's claim; otherwise what is left of DuplicateWait since the
// effects were stored, never more (a database clock that stepped back makes them look younger
// than they are).
func (o *Outbox) duplicateWait(src Source, claim outboxdriver.Claim, pending []Effect) time.Duration {
	if o.failedHere.contains(src) {
		return 0
	}
	for _, e := range pending {
		if e.Failures > 0 {
			return 0
		}
	}
	if claim.Concurrent {
		return o.cfg.DuplicateWait
	}
	return min(max(o.cfg.DuplicateWait-pending[0].PendingFor, 0), o.cfg.DuplicateWait)
}

// listPending returns the pending effects of src that may be sent now (parked effects, and those
// behind them with their ordering key, left out), and how many are parked.
func (o *Outbox) listPending(ctx context.Context, src Source) ([]Effect, int, error) {
	bctx, cancel := context.WithTimeout(ctx, storeTimeout)
	defer cancel()
	all, err := o.store.EffectListPending(bctx, src)
	if err != nil {
		return nil, 0, fmt.Errorf("outbox: list pending side effects of %q for %q: %w", src.ID, src.Consumer, err)
	}
	out, parked := sendable(all)
	return out, parked, nil
}

// sendable returns those of the pending effects all that may be sent now (parked effects, and
// those behind them with their ordering key, left out), and how many are parked.
func sendable(all []Effect) ([]Effect, int) {
	blocked := map[string]bool{}
	parked := 0
	out := all[:0]
	for _, e := range all {
		if e.Parked {
			parked++
			blocked[e.OrderingKey] = true
		}
		if !blocked[e.OrderingKey] {
			out = append(out, e)
		}
	}
	return out, parked
}

// hasInline tells whether some of effects are kept inline in their claim (StoreID 0).
func hasInline(effects []Effect) bool {
	return slices.ContainsFunc(effects, func(e Effect) bool { return e.StoreID == 0 })
}

// materialize moves the inline effects of src into effect rows (so that they can be marked one
// by one, fail, be retried and parked like any other) and returns effects with each replaced by
// its row.
func (o *Outbox) materialize(ctx context.Context, src Source, effects []Effect, lease time.Duration) ([]Effect, error) {
	is, ok := o.store.(outboxdriver.InlineStore)
	if !ok {
		return nil, fmt.Errorf("outbox: effects of %q for %q are inline, but the store cannot move them", src.ID, src.Consumer)
	}
	bctx, cancel := context.WithTimeout(ctx, storeTimeout)
	defer cancel()
	rows, err := is.EffectMaterialize(bctx, src, lease)
	if err != nil {
		return nil, fmt.Errorf("outbox: move the inline side effects of %q for %q to the relay: %w", src.ID, src.Consumer, err)
	}
	if err := o.failpoint(ctx, FailpointAfterMaterialize); err != nil {
		return nil, err
	}
	// An effect is its source's seq-th record: one message (one UUID) may go to several topics.
	byPos := make(map[effectPos]Effect, len(rows))
	for _, r := range rows {
		byPos[posOf(r)] = r
	}
	out := make([]Effect, 0, len(effects))
	for _, e := range effects {
		if r, ok := byPos[posOf(e)]; ok {
			// How long they are pending, for what a failure counts: as the caller saw them (a unit
			// of work: since it began), not as the row's new timestamp says.
			r.StoredAt, r.PendingFor = e.StoredAt, max(r.PendingFor, e.PendingFor)
			out = append(out, r)
		}
	}
	return out, nil
}

// effectPos identifies an effect wherever it is kept (inline in its claim, or as a row): its
// source and its position among the source's records. The UUID does not: one message may be
// published to several topics.
type effectPos struct {
	src Source
	seq int
}

func posOf(e Effect) effectPos { return effectPos{e.Source, e.Seq} }

// awaitDispatch polls the pending effects of src until none are left, a failed dispatch of them
// is recorded, or wait has passed, and returns what is still pending.
func (o *Outbox) awaitDispatch(ctx context.Context, src Source, wait time.Duration) ([]Effect, error) {
	deadline := time.Now().Add(wait)
	for {
		step := min(25*time.Millisecond, time.Until(deadline))
		select {
		case <-ctx.Done():
			return nil, fmt.Errorf("outbox: waiting for an in-flight dispatch: %w", ctx.Err())
		case <-time.After(step):
		}
		pending, _, err := o.listPending(ctx, src)
		if err != nil {
			return nil, err
		}
		if pending = o.marks.unsent(pending); len(pending) == 0 {
			return nil, nil
		}
		if !time.Now().Before(deadline) || o.failedHere.contains(src) || slices.ContainsFunc(pending, func(e Effect) bool { return e.Failures > 0 }) {
			return pending, nil
		}
	}
}

// Cleanup runs one retention cleanup pass with the configured retention, batch size and pause, as
// Run does every CleanupInterval: for deployments that schedule cleanup themselves. It returns
// at once, with Skipped set, while another instance is cleaning, and stops with Skipped set (its
// counts saying what it deleted) when another instance takes the cleanup lock between two of its
// batches.
func (o *Outbox) Cleanup(ctx context.Context) (CleanupResult, error) {
	return o.cleanup(ctx, nil)
}

// cleanupFullEvery is how often the cleanup service runs from the start of the tables it walks in
// order, rather than from where its run before ended: every tenth run. In between, a run does not
// walk again what the runs before it deleted, which stays in the indexes as dead entries while a
// long transaction holds the xmin horizon back (measured, a 3-minute hold at 400 msg/s: a batch of
// the claims' cleanup went from 4,085 to 19,608 blocks); the run from the start takes what expired
// behind the others (a claim whose effects went out late), at most ten CleanupIntervals late.
const cleanupFullEvery = 10

// cleanupResume is where the cleanup service's runs got to (outboxdriver.CleanupParams.Resume).
type cleanupResume struct {
	mu   sync.Mutex
	at   outboxdriver.CleanupResume
	runs int
}

// next returns where the next run begins: nil (from the start) every cleanupFullEvery runs.
func (r *cleanupResume) next() *outboxdriver.CleanupResume {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.runs++
	if r.runs%cleanupFullEvery == 1 {
		r.at = outboxdriver.CleanupResume{}
	}
	at := r.at
	return &at
}

// claims is where the runs got to in the claims (zero: nowhere yet).
func (r *cleanupResume) claims() time.Time {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.at.Claims
}

// done records where a run got to.
func (r *cleanupResume) done(at *outboxdriver.CleanupResume) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.at = *at
}

func (o *Outbox) cleanup(ctx context.Context, resume *outboxdriver.CleanupResume) (CleanupResult, error) {
	// By default each pause lasts at least twice the batch before it (CleanupPauseFactor):
	// cleanup takes at most a third of one connection's time, and heavier batches (a larger
	// table, a busier server) space themselves out, while an idle database is cleaned at full
	// speed. With a fixed 20 ms pause the benchmark's 1M-row cleanup raised the consumers' p99 by
	// half; twice and three times the batch both measured +28%, at ~3,400 and ~2,500 rows/s under
	// full load on 2 CPUs (the consumers wrote ~1,500/s).
	res, err := o.store.Cleanup(ctx, outboxdriver.CleanupParams{
		Retention:           o.cfg.Retention,
		EffectRetention:     o.cfg.EffectRetention,
		BatchSize:           o.cfg.CleanupBatchSize,
		PauseBetweenBatches: o.cfg.CleanupPause,
		PauseFactor:         max(0, o.cfg.CleanupPauseFactor),
		Resume:              resume,
	})
	if err != nil {
		return res, fmt.Errorf("outbox: cleanup: %w", err)
	}
	return res, nil
}

func (o *Outbox) cleanupOnce(ctx context.Context) (idle bool, err error) {
	// The operators' cleanup (cmd/outbox) refuses to forget IDs sooner than this service would;
	// it reads what is recorded here. Not recorded, it asks for -retention: nothing is lost.
	if r, ok := o.store.(outboxdriver.ConfigRecorder); ok {
		if err := r.RecordServiceConfig(ctx, outboxdriver.ServiceConfig{Retention: o.cfg.Retention,
			EffectRetention: o.cfg.EffectRetention, RedeliveryHorizon: o.cfg.RedeliveryHorizon}); err != nil && ctx.Err() == nil {
			if o.unreachable(err) {
				// The cleanup's statements would each try to connect again; the gate
				// reports the outage.
				o.tel.cleanupErrors.Add(ctx, 1, o.tel.own())
				return false, err
			}
			o.logger.Error("Recording the retention for the operators' tools failed", err, nil)
		}
	}
	resume := o.cleanupAt.next()
	res, err := o.cleanup(ctx, resume)
	o.cleanupAt.done(resume) // as far as it got, whatever stopped it
	if err != nil {
		if ctx.Err() == nil {
			o.tel.cleanupErrors.Add(ctx, 1, o.tel.own())
		}
		return false, err
	}
	if res.Batches > 0 {
		o.tel.cleanupBatches.Add(ctx, int64(res.Batches), o.tel.own())
		for table, n := range map[string]int64{"processed": res.Claims, "dispatched": res.Effects, "attempts": res.Attempts, "idempotency": res.Keys, "dead_letters": res.DeadLetters} {
			if n > 0 {
				o.tel.cleanupDeleted.Add(ctx, n, o.tel.attrs(AttrTable, table, "", ""))
			}
		}
	}
	if res.Claims+res.Effects+res.Attempts+res.Keys > 0 {
		o.logger.Info("Cleanup deleted expired rows", watermill.LogFields{
			"claims": res.Claims, "effects": res.Effects, "attempts": res.Attempts, "idempotency_keys": res.Keys,
		})
	}
	// Deleting nothing: an idle member's cleanup may wait longer, as nothing expires there.
	return res.Claims+res.Effects+res.Attempts+res.Keys+res.DeadLetters == 0 && !res.Skipped, nil
}
