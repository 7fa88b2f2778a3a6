package outbox

import (
	"context"
	"crypto/sha256"
	"encoding/binary"
	"errors"
	"fmt"
	"maps"
	"math/rand/v2"
	"strconv"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"

	"github.com/watermill-outbox/outbox/outboxdriver"
)

// health remembers when this process last dispatched something successfully to each target: the
// Publisher (for every message), each topic, and each applier. It tells a poison effect (the
// target refuses it and takes everything else) from an outage (the target takes nothing), so that
// an outage of any length parks nothing.
type health struct {
	mu        sync.Mutex
	publishOK time.Time
	topicOK   map[string]time.Time
	applierOK map[string]time.Time
}

func (h *health) succeeded(e Effect) {
	now := time.Now()
	h.mu.Lock()
	defer h.mu.Unlock()
	if e.Kind == KindPublish {
		h.publishOK = now
		if h.topicOK == nil {
			h.topicOK = map[string]time.Time{}
		}
		h.topicOK[e.Topic] = now
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
// been pending for longer than outageTolerance. For a call that did not return in time (timedOut)
// the target of a message is its topic, not the Publisher: a broker that hangs on one topic (a
// partition without a leader, a queue that blocks) times out whatever it is given while the
// other topics flow, and its probes must not park the effects that wait for it.
func (h *health) counts(e Effect, timedOut bool, at time.Time) bool {
	if e.PendingFor >= outageTolerance {
		return true
	}
	since := e.PendingFor
	if e.Failures > 0 {
		since = e.SinceFailure
	}
	last := h.lastOK(e, timedOut)
	return !last.IsZero() && last.After(at.Add(-max(since, 0)))
}

// lastOK returns when e's target last took a call: the Publisher (for a call that timed out, e's
// topic), or e's applier.
func (h *health) lastOK(e Effect, timedOut bool) time.Time {
	h.mu.Lock()
	defer h.mu.Unlock()
	switch {
	case e.Kind != KindPublish:
		return h.applierOK[e.Kind]
	case timedOut:
		return h.topicOK[e.Topic]
	}
	return h.publishOK
}

// down tells whether a failed dispatch of e at at found its target down: nothing reached it since
// e's previous failure (or since e was stored). Unlike counts, it places that failure by the time
// the effect was read (StoredAt + PendingFor, when the store set them) rather than by at: counts
// leans toward an outage, which parks nothing, and would take a success just before the call for
// one before the previous failure; down must not, or a poison effect retried at its topic's
// recovery would mark the topic down again and be retried at its next success.
func (h *health) down(e Effect, timedOut bool, at time.Time) bool {
	since := e.PendingFor
	if e.Failures > 0 {
		since = e.SinceFailure
	}
	prev := at.Add(-max(since, 0))
	if !e.StoredAt.IsZero() {
		prev = e.StoredAt.Add(e.PendingFor - max(since, 0))
	}
	last := h.lastOK(e, timedOut)
	return last.IsZero() || !last.After(prev)
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
func (o *Outbox) failures(effects []Effect, sent, failed int, err error, at time.Time) []outboxdriver.EffectFailure {
	out := make([]outboxdriver.EffectFailure, 0, len(effects)-sent)
	for i, e := range effects[sent:] {
		if i >= failed {
			out = append(out, outboxdriver.EffectFailure{StoreID: e.StoreID})
			continue
		}
		counted := o.health.counts(e, hung(err), at)
		if !counted && o.health.down(e, hung(err), at) {
			// Nothing reached the target since: it is down, and its effects back off until it
			// takes a call again. A failure while the target takes other calls is the effect's
			// own (a poison one), which the target's next success must not retry at once.
			o.recovery.failedCall(e)
		}
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

// logParked is the log line of a parked effect: it names what the on-call engineer runs next.
const logParked = "Side effect parked after repeated failures; nothing sends it until an operator retries or discards it: `outbox parked list` (or the web console) shows it, `outbox parked retry -id N` sends it again"

// dispatchFailed records a failed dispatch of the committed effects of src at once, so that a
// redelivered copy knows not to wait for it and the relay retries them (after their backoff)
// even if the message never comes back.
func (o *Outbox) dispatchFailed(ctx context.Context, src Source, effects []Effect, sent, failed int, err error, at time.Time) {
	o.failedHere.add(src)
	fields := watermill.LogFields{"consumer": src.Consumer, "source_id": src.ID, "effects": len(effects) - sent}
	fs := o.failures(effects, sent, failed, err, at)
	bctx, cancel := context.WithTimeout(ctx, storeTimeout)
	defer cancel()
	// A failure that says the database went meanwhile is the gate's to report (and the
	// relays are then woken in this process only: see wakeRelays).
	if rerr := o.store.EffectRecordFailures(bctx, fs...); rerr != nil {
		if !o.outage(ctx, rerr) {
			o.logger.Error("Recording a failed dispatch failed; the relay retries the effects after RelayGrace", rerr, fields)
		}
	} else {
		for _, f := range fs {
			if f.Park { // parked only once recorded
				o.logger.Error(logParked, err, fields.Add(watermill.LogFields{"store_id": f.StoreID}))
			}
		}
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

// failureCount marks an error with how many times in a row the message failed, from which
// backoff computes the wait.
type failureCount struct {
	err     error
	n       int
	attempt bool // a failed attempt of the handler (countedAttempt): whatever err wraps is the handler's
}

func (f *failureCount) Error() string { return f.err.Error() }

func (f *failureCount) Unwrap() error { return f.err }

func counted(err error, n int) error { return &failureCount{err: err, n: n} }

// countedAttempt is counted for a failed attempt of the handler: Handle backs off and retries it
// whatever the handler's error wraps (ErrDispatchFailed or ErrDatabaseUnreachable of its own
// calls to another Outbox), where the framework's own errors of that kind decide otherwise.
func countedAttempt(err error, n int) error { return &failureCount{err: err, n: n, attempt: true} }

// isFailedAttempt tells an error of countedAttempt.
func isFailedAttempt(err error) bool {
	var fc *failureCount
	return errors.As(err, &fc) && fc.attempt
}

// backoff waits RetryDelay, doubled for each further failure of the message up to RetryDelayMax,
// unless ctx ends first; it reports whether it waited the whole time.
func (o *Outbox) backoff(ctx context.Context, err error) bool {
	if o.cfg.RetryDelay < 0 {
		return true
	}
	n := 1
	var fc *failureCount
	if errors.As(err, &fc) {
		n = max(fc.n, 1)
	}
	d := min(o.cfg.RetryDelay<<min(n-1, 30), o.cfg.RetryDelayMax)
	if d <= 0 {
		d = o.cfg.RetryDelayMax
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return false
	case <-t.C:
		return true
	}
}

// Metadata keys of a message moved to the poison topic.
const (
	MetadataPoisonReason   = "outbox_poison_reason"
	MetadataPoisonConsumer = "outbox_poison_consumer"
	MetadataPoisonAttempts = "outbox_poison_attempts"
	// MetadataPoisonPermanent is "true" on the copy of a message dead-lettered at once, for a
	// permanent error or an unusable ID; its attempts are then not counted in the copy.
	MetadataPoisonPermanent = "outbox_poison_permanent"
)

// handlerFailed counts a failed attempt durably (outside the rolled-back transaction) and, after
// MaxAttempts or at once for a permanent error, dead-letters the message (see Config.DeadLetters).
func (o *Outbox) handlerFailed(ctx context.Context, msg *message.Message, src Source, herr error, fields watermill.LogFields) error {
	reason := outboxdriver.StorableText(herr.Error())
	bctx, cancel := context.WithTimeout(ctx, storeTimeout)
	defer cancel()
	if acked(msg) {
		return o.ackedFailed(bctx, ctx, msg, src, herr, fields)
	}
	permanent := IsPermanent(herr)
	if dl := o.deadLetterStore(); dl != nil && permanent {
		// One transaction counts the attempt and stores the dead letter: no attempt is left
		// counted without its dead letter.
		if err := o.deadLetter(bctx, ctx, dl, msg, src, herr, 0, true, true, fields); !errors.Is(err, errNoDeadLetters) {
			return err
		}
	}
	attempts, err := o.store.AttemptRecord(bctx, src, reason)
	if err != nil {
		if o.outage(ctx, err) {
			// The database went while the unit ran (likely what failed it): not counted, and
			// run again once a probe of the gate answers, not after RetryDelay.
			return fmt.Errorf("%w: %w (counting the attempt: %w)", errWaitForDatabase, herr, err)
		}
		o.logger.Error("Counting a failed attempt failed", err, fields)
		return fmt.Errorf("%w (and counting the attempt failed: %w)", herr, err)
	}
	fields = fields.Add(watermill.LogFields{"attempts": attempts, "max_attempts": o.cfg.MaxAttempts})
	if attempts < o.cfg.MaxAttempts && !permanent {
		o.failingHere.add(src)
		// An operator may have asked while this attempt ran, or while the message was delivered
		// to a process that had not seen it fail.
		if done, err := o.deadLetterIfAsked(ctx, msg, src, fields); done {
			return err
		}
		return countedAttempt(fmt.Errorf("attempt %d of %d: %w", attempts, o.cfg.MaxAttempts, herr), attempts)
	}
	if dl := o.deadLetterStore(); dl != nil {
		if err := o.deadLetter(bctx, ctx, dl, msg, src, herr, attempts, false, permanent, fields); !errors.Is(err, errNoDeadLetters) {
			return err
		}
	}
	if o.cfg.PoisonTopic == "" {
		o.logger.Error("Message keeps failing; dead letters are off and no PoisonTopic is set, so it is nacked again", herr, fields)
		return countedAttempt(fmt.Errorf("attempt %d (max %d, no dead letters, no poison topic): %w", attempts, o.cfg.MaxAttempts, herr), attempts)
	}
	if dup, err := o.poison(bctx, ctx, msg, src, reason, attempts, fields); err != nil || dup {
		if dup {
			return err
		}
		return fmt.Errorf("%w (and moving it to the poison topic failed: %w)", herr, err)
	}
	setOutcome(ctx, OutcomePoisoned)
	o.logger.Error("Message moved to the poison topic after repeated failures", herr,
		fields.Add(watermill.LogFields{"poison_topic": o.cfg.PoisonTopic}))
	return nil
}

// acked reports whether msg was acked already.
func acked(msg *message.Message) bool {
	select {
	case <-msg.Acked():
		return true
	default:
		return false
	}
}

// ackedFailed handles the failure of a message acked before its unit of work ended (InstantAck
// outside the outbox middleware, or a handler that acked it): the broker has forgotten it, and a
// nack brings no redelivery. It is dead-lettered at once (an operator's retry or the redrive
// policy hands it back), or moved to PoisonTopic; with neither, it is lost, and said so.
func (o *Outbox) ackedFailed(bctx, ctx context.Context, msg *message.Message, src Source, herr error, fields watermill.LogFields) error {
	herr = fmt.Errorf("%w (the message was acked before its unit of work ended: the broker will not deliver it again)", herr)
	if dl := o.deadLetterStore(); dl != nil {
		if err := o.deadLetter(bctx, ctx, dl, msg, src, herr, 0, true, false, fields); !errors.Is(err, errNoDeadLetters) {
			return err
		}
	}
	if o.cfg.PoisonTopic != "" {
		if dup, err := o.poison(bctx, ctx, msg, src, outboxdriver.StorableText(herr.Error()), 1, fields); err != nil || dup {
			if dup {
				return err
			}
			return fmt.Errorf("%w (and moving it to the poison topic failed: %w)", herr, err)
		}
		setOutcome(ctx, OutcomePoisoned)
		o.logger.Error("Message acked before its unit of work failed: moved to the poison topic", herr,
			fields.Add(watermill.LogFields{"poison_topic": o.cfg.PoisonTopic}))
		return nil
	}
	o.logger.Error("Message acked before its unit of work failed, with dead letters off and no PoisonTopic: it is lost", herr, fields)
	return herr
}

// deadLetterIfAsked stores msg as a dead letter and acks it, instead of running its handler
// (again), when an operator asked for it (outbox dead now: a mark on its attempt counter). done
// tells whether it did, or failed to (err, a nack); otherwise the message goes on as usual, also
// when the request cannot be read: the handler's attempt reads the database as well.
func (o *Outbox) deadLetterIfAsked(ctx context.Context, msg *message.Message, src Source, fields watermill.LogFields) (done bool, err error) {
	dl := o.deadLetterStore()
	ds, ok := o.store.(outboxdriver.DeadLetterNowStore)
	if dl == nil || !ok {
		return false, nil
	}
	bctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), storeTimeout)
	defer cancel()
	req, err := ds.DeadLetterRequested(bctx, src)
	if err != nil {
		o.logger.Error("Reading whether an operator asked to dead-letter a failing message failed", err, fields)
		return false, nil
	}
	if req.By == "" {
		return false, nil
	}
	cause := fmt.Errorf("dead-lettered at once at the request of %s; its last error: %s", req.By, req.LastError)
	err = o.deadLetter(bctx, ctx, dl, msg, src, cause, req.Attempts, false, false, fields.Add(watermill.LogFields{"requested_by": req.By}))
	if errors.Is(err, errNoDeadLetters) {
		return false, nil
	}
	return true, err
}

// errNoDeadLetters: the store keeps no dead letters after all; the message is handled as with
// DeadLettersOff.
var errNoDeadLetters = errors.New("outbox: no dead letters")

// deadLetterStore returns the store's dead letters, or nil when they are off or the store keeps
// none.
func (o *Outbox) deadLetterStore() outboxdriver.DeadLetterStore {
	if o.cfg.DeadLetters == DeadLettersOff {
		return nil
	}
	dl, _ := o.store.(outboxdriver.DeadLetterStore)
	return dl
}

// deadLetter stores msg as a dead letter of src (counting this attempt with count, otherwise
// attempts failed), with its claim as poisoned so that redelivered copies are acked, and a copy
// for PoisonTopic, when set, as a side effect in the same transaction; the copy is then sent
// from memory, or by the relay if that fails. It returns nil (ack) once the dead letter is
// committed, and the failure (nack) otherwise.
func (o *Outbox) deadLetter(ctx, outcomeCtx context.Context, dl outboxdriver.DeadLetterStore, msg *message.Message, src Source,
	cause error, attempts int, count, permanent bool, fields watermill.LogFields) error {
	reason := outboxdriver.StorableText(cause.Error())
	var poison *Effect
	if o.cfg.PoisonTopic != "" {
		m := poisonMessage(msg, src.Consumer, reason, attempts)
		if permanent {
			m.Metadata.Set(MetadataPoisonPermanent, "true")
		}
		if m.UUID == "" || validateName(m.UUID) != nil {
			m.UUID = src.ID
		}
		e := messageEffect(m)
		e.Topic = o.cfg.PoisonTopic
		e.Source = src
		e.OrderingKey = outboxdriver.DefaultOrderingKey(src)
		poison = &e
	}
	n, err := dl.DeadLetterInsert(ctx, outboxdriver.DeadLetter{
		Consumer: src.Consumer, MessageID: src.ID, UUID: storableUUID(msg.UUID), SourceTopic: sourceTopic(outcomeCtx, msg),
		Payload: msg.Payload, Metadata: msg.Metadata, Reason: reason, Attempts: attempts, Permanent: permanent,
	}, count, poison)
	if errors.Is(err, outboxdriver.ErrDeadLettersUnsupported) {
		// A store of another dialect that keeps none: as with DeadLettersOff.
		return errNoDeadLetters
	}
	if errors.Is(err, outboxdriver.ErrProcessedMeanwhile) {
		// A copy of the message (the claim waited for it, or the message came on two topics)
		// was processed while this delivery failed: the message is not dead, and this
		// delivery is a duplicate of the one that succeeded. Dead-lettered, it was listed as
		// dead (with a copy on the poison topic) although it had been processed.
		setOutcome(outcomeCtx, OutcomeDuplicate)
		o.logger.Info("Failed delivery acked as a duplicate: a copy of the message was processed meanwhile", fields.Add(watermill.LogFields{"error": cause.Error()}))
		// As any duplicate, it sends what the copy left pending (its process may have crashed
		// after its commit), with their UUIDs: acked without, they waited for the relay's sweep.
		return o.redeliver(ctx, src, outboxdriver.Claim{Concurrent: true}, fields)
	}
	if err != nil && o.outage(ctx, err) {
		// As when counting an attempt meets the outage (handlerFailed).
		return fmt.Errorf("%w: %w (storing it as a dead letter: %w)", errWaitForDatabase, cause, err)
	}
	if err != nil {
		o.logger.Error("Storing a dead letter failed; the message is nacked", err, fields)
		return countedAttempt(fmt.Errorf("%w (and storing it as a dead letter failed: %w)", cause, err), max(attempts, 1))
	}
	setOutcome(outcomeCtx, OutcomeDeadLettered)
	fields = fields.Add(watermill.LogFields{"attempts": n, "permanent": permanent})
	o.logger.Error("Message dead-lettered and acked; nothing processes it until an operator retries it: `outbox dead list` (or the web console) shows it, `outbox dead retry CONSUMER MESSAGE_ID` hands it back", cause, fields)
	if poison != nil {
		poison.StoredAt = time.Now()
		if err := o.dispatchAndMark(ctx, PathCommit, src, []Effect{*poison}, time.Time{}, fields); err != nil {
			o.logger.Error("Sending the copy of a dead letter to the poison topic failed; the relay sends it", err, fields)
		}
	}
	return nil
}

// reject handles a message that cannot be processed at all (for example one without a usable ID):
// it is dead-lettered at once under an ID derived from what every copy carries, or with dead
// letters off goes to the poison topic, or is nacked with a clear error when none is set.
func (o *Outbox) reject(ctx context.Context, msg *message.Message, src Source, cause error, fields watermill.LogFields) error {
	setOutcome(ctx, OutcomeRejected)
	if dl := o.deadLetterStore(); dl != nil {
		if src.ID == "" || validateName(src.ID) != nil {
			src.ID = rejectedID(msg, src.Consumer)
		}
		bctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), storeTimeout)
		defer cancel()
		// Every copy of the message is rejected before a claim could ack it: the first one's
		// dead letter acks the others, so that a discarded one stays discarded.
		if done, err := o.store.MessageIsProcessed(bctx, src); err != nil {
			if o.outage(ctx, err) {
				return fmt.Errorf("%w: %w (looking for its dead letter: %w)", errWaitForDatabase, cause, err)
			}
			return fmt.Errorf("%w (and looking for its dead letter failed: %w)", cause, err)
		} else if done {
			o.logger.Info("Copy of a rejected message acked: it is dead-lettered already", fields.Add(watermill.LogFields{"dead_letter_id": src.ID}))
			return nil
		}
		err := o.deadLetter(bctx, ctx, dl, msg, src, cause, 0, false, true, fields.Add(watermill.LogFields{"dead_letter_id": src.ID}))
		if !errors.Is(err, errNoDeadLetters) {
			return err
		}
	}
	if o.cfg.PoisonTopic == "" {
		o.logger.Error("Message cannot be processed, dead letters are off and no PoisonTopic is set; it is nacked", cause, fields)
		return cause
	}
	m := poisonMessage(msg, src.Consumer, outboxdriver.StorableText(cause.Error()), 0)
	if m.UUID == "" || validateName(m.UUID) != nil {
		m.UUID = rejectedID(msg, src.Consumer)
	}
	if err := o.publish(context.WithoutCancel(ctx), o.cfg.PoisonTopic, []Effect{messageEffect(m)}); err != nil {
		return fmt.Errorf("%w (and moving it to the poison topic failed: %w)", cause, err)
	}
	o.logger.Error("Message moved to the poison topic", cause, fields)
	return nil
}

// rejectedNamespace is the namespace of the IDs given to rejected messages.
var rejectedNamespace = uuid.MustParse("0b8f8f8e-5a3c-4d6e-9a43-6f75746278a1")

// rejectedID derives the ID of the poison message of a message whose own ID is unusable from what
// every redelivery of it carries (the consumer, its raw UUID and its payload), so that the copies
// on the poison topic share one ID, and consumers of the poison topic can deduplicate them.
func rejectedID(msg *message.Message, consumer string) string {
	h := sha256.New()
	for _, part := range [][]byte{[]byte(consumer), []byte(msg.UUID), msg.Payload} {
		var n [8]byte
		binary.BigEndian.PutUint64(n[:], uint64(len(part)))
		h.Write(n[:])
		h.Write(part)
	}
	return uuid.NewSHA1(rejectedNamespace, h.Sum(nil)).String()
}

// poison moves msg to PoisonTopic (dead letters off): its claim written as poisoned, so that
// copies still in the broker do not run the handler again, and the copy for the topic stored as
// its effect in the same transaction, then sent from memory (or by the relay). duplicate tells
// that a copy of the message was processed (or poisoned) while this delivery failed: nothing is
// moved, what the copy left pending is sent, and the delivery is acked as a duplicate.
func (o *Outbox) poison(ctx, outcomeCtx context.Context, msg *message.Message, src Source, reason string, attempts int, fields watermill.LogFields) (duplicate bool, err error) {
	m := poisonMessage(msg, src.Consumer, reason, attempts)
	ps, ok := o.store.(outboxdriver.PoisonStore)
	if !ok {
		// A driver that cannot do both in one transaction: published first, recorded after
		// (a copy processed meanwhile may then be on the poison topic as well).
		if err := o.publish(ctx, o.cfg.PoisonTopic, []Effect{messageEffect(m)}); err != nil {
			return false, err
		}
		if err := o.store.MessagePoison(ctx, src); err != nil {
			o.logger.Error("Recording a poisoned message failed; a redelivered copy may be poisoned again", err, nil)
		}
		return false, nil
	}
	if m.UUID == "" || validateName(m.UUID) != nil {
		m.UUID = src.ID
	}
	e := messageEffect(m)
	e.Topic = o.cfg.PoisonTopic
	e.Source = src
	e.OrderingKey = outboxdriver.DefaultOrderingKey(src)
	err = ps.MessagePoisonWith(ctx, src, &e)
	if errors.Is(err, outboxdriver.ErrProcessedMeanwhile) {
		// As in deadLetter: the message is not poison, and this delivery is a duplicate.
		setOutcome(outcomeCtx, OutcomeDuplicate)
		o.logger.Info("Failed delivery acked as a duplicate: a copy of the message was processed meanwhile", fields)
		return true, o.redeliver(ctx, src, outboxdriver.Claim{Concurrent: true}, fields)
	}
	if err != nil {
		return false, err
	}
	e.StoredAt = time.Now()
	if err := o.dispatchAndMark(ctx, PathCommit, src, []Effect{e}, time.Time{}, fields); err != nil {
		o.logger.Error("Sending a message to the poison topic failed; the relay sends it", err, fields)
	}
	return false, nil
}

func poisonMessage(msg *message.Message, consumer, reason string, attempts int) *message.Message {
	m := message.NewMessage(msg.UUID, msg.Payload)
	m.Metadata = maps.Clone(msg.Metadata)
	if m.Metadata == nil {
		m.Metadata = message.Metadata{}
	}
	m.Metadata.Set(MetadataPoisonReason, reason)
	m.Metadata.Set(MetadataPoisonConsumer, consumer)
	m.Metadata.Set(MetadataPoisonAttempts, strconv.Itoa(attempts))
	return m
}

func messageEffect(m *message.Message) Effect {
	return Effect{Kind: KindPublish, UUID: m.UUID, Payload: m.Payload, Metadata: m.Metadata}
}

// storableUUID is the UUID a dead letter keeps for its retry: "" for one that cannot be stored
// nor published as an ID (a NUL byte, not UTF-8, too long: a message rejected for it, stored
// under an ID derived from it), whose retry then uses the message ID, as before UUIDs were kept.
func storableUUID(uuid string) string {
	if validateName(uuid) != nil {
		return ""
	}
	return uuid
}
