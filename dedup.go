package outbox

import (
	"context"
	"crypto/sha256"
	"encoding/binary"
	"fmt"
	"maps"
	"strconv"
	"strings"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"

	"github.com/watermill-outbox/outbox/outboxdriver"
)

// Metadata keys of a message moved to the poison topic.
const (
	MetadataPoisonReason   = "outbox_poison_reason"
	MetadataPoisonConsumer = "outbox_poison_consumer"
	MetadataPoisonAttempts = "outbox_poison_attempts"
)

// maxReasonBytes bounds the failure reason stored and sent to the poison topic.
const maxReasonBytes = 4096

// handlerFailed counts a failed attempt durably (outside the rolled-back transaction) and, after
// MaxAttempts, moves the message to the poison topic when one is configured.
func (o *Outbox) handlerFailed(ctx context.Context, msg *message.Message, src Source, herr error, fields watermill.LogFields) error {
	reason := sanitizeReason(herr.Error())
	bctx, cancel := context.WithTimeout(ctx, storeTimeout)
	defer cancel()
	attempts, err := o.store.AttemptRecord(bctx, src, reason)
	if err != nil {
		o.logger.Error("Counting a failed attempt failed", err, fields)
		return fmt.Errorf("%w (and counting the attempt failed: %w)", herr, err)
	}
	fields = fields.Add(watermill.LogFields{"attempts": attempts, "max_attempts": o.cfg.MaxAttempts})
	if attempts < o.cfg.MaxAttempts {
		return counted(fmt.Errorf("attempt %d of %d: %w", attempts, o.cfg.MaxAttempts, herr), attempts)
	}
	if o.cfg.PoisonTopic == "" {
		o.logger.Error("Message keeps failing; no PoisonTopic is set, so it is nacked again", herr, fields)
		return counted(fmt.Errorf("attempt %d (max %d, no poison topic): %w", attempts, o.cfg.MaxAttempts, herr), attempts)
	}
	if err := o.poison(bctx, msg, src, reason, attempts); err != nil {
		return fmt.Errorf("%w (and moving it to the poison topic failed: %w)", herr, err)
	}
	setOutcome(ctx, OutcomePoisoned)
	o.logger.Error("Message moved to the poison topic after repeated failures", herr,
		fields.Add(watermill.LogFields{"poison_topic": o.cfg.PoisonTopic}))
	return nil
}

// reject handles a message that cannot be processed at all (for example one without a usable ID):
// it goes to the poison topic at once, or is nacked with a clear error when none is set.
func (o *Outbox) reject(ctx context.Context, msg *message.Message, src Source, cause error, fields watermill.LogFields) error {
	setOutcome(ctx, OutcomeRejected)
	if o.cfg.PoisonTopic == "" {
		o.logger.Error("Message cannot be processed and no PoisonTopic is set; it is nacked", cause, fields)
		return cause
	}
	m := poisonMessage(msg, src.Consumer, sanitizeReason(cause.Error()), 0)
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

func (o *Outbox) poison(ctx context.Context, msg *message.Message, src Source, reason string, attempts int) error {
	m := poisonMessage(msg, src.Consumer, reason, attempts)
	if err := o.publish(ctx, o.cfg.PoisonTopic, []Effect{messageEffect(m)}); err != nil {
		return err
	}
	// Remember it as processed so that copies still in the broker do not run the handler again.
	if err := o.store.MessagePoison(ctx, src); err != nil {
		o.logger.Error("Recording a poisoned message failed; a redelivered copy may be poisoned again", err, nil)
	}
	return nil
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

// sanitizeReason makes a failure reason readable and bounded for the poison message's metadata
// and the logs: valid UTF-8, NUL escaped, at most maxReasonBytes. (The store makes whatever it
// stores storable itself.)
func sanitizeReason(s string) string {
	s = strings.ToValidUTF8(s, "\uFFFD")
	s = strings.ReplaceAll(s, "\x00", `\x00`)
	if len(s) > maxReasonBytes {
		s = strings.ToValidUTF8(s[:maxReasonBytes], "") + "..."
	}
	return s
}

// Cleanup runs one retention cleanup pass with the configured retention, batch size and pause, as
// Run does every CleanupInterval: for deployments that schedule cleanup themselves. It returns
// at once, with Skipped set, while another instance is cleaning.
func (o *Outbox) Cleanup(ctx context.Context) (CleanupResult, error) {
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
	})
	if err != nil {
		return res, fmt.Errorf("outbox: cleanup: %w", err)
	}
	return res, nil
}

func (o *Outbox) cleanupOnce(ctx context.Context) error {
	// The operators' cleanup (cmd/outbox) refuses to forget IDs sooner than this service would;
	// it reads what is recorded here. Not recorded, it asks for -retention: nothing is lost.
	if r, ok := o.store.(outboxdriver.ConfigRecorder); ok {
		if err := r.RecordServiceConfig(ctx, outboxdriver.ServiceConfig{Retention: o.cfg.Retention,
			EffectRetention: o.cfg.EffectRetention, RedeliveryHorizon: o.cfg.RedeliveryHorizon}); err != nil && ctx.Err() == nil {
			o.logger.Error("Recording the retention for the operators' tools failed", err, nil)
		}
	}
	res, err := o.Cleanup(ctx)
	if err != nil {
		if ctx.Err() == nil {
			o.tel.cleanupErrors.Add(ctx, 1)
		}
		return err
	}
	if res.Batches > 0 {
		o.tel.cleanupBatches.Add(ctx, int64(res.Batches))
		for table, n := range map[string]int64{"processed": res.Claims, "dispatched": res.Effects, "attempts": res.Attempts} {
			if n > 0 {
				o.tel.cleanupDeleted.Add(ctx, n, metric.WithAttributeSet(attribute.NewSet(AttrTable.String(table))))
			}
		}
	}
	if res.Claims+res.Effects+res.Attempts > 0 {
		o.logger.Info("Cleanup deleted expired rows", watermill.LogFields{
			"claims": res.Claims, "effects": res.Effects, "attempts": res.Attempts,
		})
	}
	return nil
}
