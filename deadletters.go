package outbox

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/ThreeDotsLabs/watermill"

	"github.com/watermill-outbox/outbox/outboxdriver"
)

// PermanentError marks a handler's error that no retry can fix (a message that cannot be parsed,
// a reference to something that will never exist): the message is dead-lettered at once instead
// of after MaxAttempts. Return Permanent(err), or an error of your own with a method
// Permanent() bool that returns true.
type PermanentError struct {
	Err error
}

func (e *PermanentError) Error() string { return "permanent: " + e.Err.Error() }

func (e *PermanentError) Unwrap() error { return e.Err }

// Permanent marks err permanent (see PermanentError); nil stays nil.
func Permanent(err error) error {
	if err == nil {
		return nil
	}
	return &PermanentError{Err: err}
}

// IsPermanent tells whether err, or an error it wraps, is permanent: a *PermanentError, or an
// error whose Permanent() method returns true.
func IsPermanent(err error) bool {
	var p *PermanentError
	if errors.As(err, &p) {
		return true
	}
	var marked interface{ Permanent() bool }
	return errors.As(err, &marked) && marked.Permanent()
}

// ErrDeadLettersUnsupported is returned by the dead-letter operations of an Outbox whose driver
// keeps no dead letters.
var ErrDeadLettersUnsupported = outboxdriver.ErrDeadLettersUnsupported

func (o *Outbox) deadLetterOps() (outboxdriver.DeadLetterStore, error) {
	dl, ok := o.store.(outboxdriver.DeadLetterStore)
	if !ok {
		return nil, ErrDeadLettersUnsupported
	}
	return dl, nil
}

// DeadLetters lists dead letters, oldest first: messages a consumer gave up on (see
// Config.DeadLetters), and what an operator did with them.
func (o *Outbox) DeadLetters(ctx context.Context, f DeadLetterFilter) ([]DeadLetter, error) {
	dl, err := o.deadLetterOps()
	if err != nil {
		return nil, err
	}
	out, err := dl.DeadLetterList(ctx, f)
	if err != nil {
		return nil, fmt.Errorf("outbox: list dead letters: %w", err)
	}
	return out, nil
}

// RetryDeadLetters hands dead letters (keyed by consumer and message ID) back to their
// consumers, once the cause is fixed. Each is retried in one transaction: its state becomes
// retried (by actor), the message's poisoned claim and failed attempts are deleted, and the
// stored message is recorded as a side effect to the topic it came from, with its own UUID,
// payload and metadata, which the relay sends, addressed to its consumer (MetadataRetryFor). The
// consumer then runs it once, as a new message; the other consumers of the topic (those behind
// the outbox middleware) ack it without running their handlers, whether or not they still keep
// its ID. It returns how many it retried: those not dead (retried or discarded already) are left
// alone.
func (o *Outbox) RetryDeadLetters(ctx context.Context, actor string, keys ...Source) (int, error) {
	return o.retryDeadLetters(ctx, outboxdriver.DeadLetterChange{Keys: keys, Actor: actor})
}

func (o *Outbox) retryDeadLetters(ctx context.Context, c outboxdriver.DeadLetterChange) (int, error) {
	dl, err := o.deadLetterOps()
	if err != nil {
		return 0, err
	}
	// Two operators (or instances) retrying at once may deadlock on MySQL: the call runs again,
	// which skips what the first run retried (a dead letter is retried once).
	var n int
	for try := 1; ; try++ {
		var m int
		m, err = dl.DeadLetterRetry(ctx, c,
			func() Source { return Source{ID: newID()} })
		n += m
		if err == nil || try == 3 || !o.isRetryable(err) || ctx.Err() != nil {
			break
		}
	}
	if n > 0 {
		o.wakeRelays(ctx)
	}
	if err != nil {
		return n, fmt.Errorf("outbox: retry dead letters: %w", err)
	}
	return n, nil
}

// DiscardDeadLetters gives dead letters up for good: their state becomes discarded (by actor);
// they are kept, and copies of the message are still acked. It returns how many it changed.
func (o *Outbox) DiscardDeadLetters(ctx context.Context, actor string, keys ...Source) (int, error) {
	dl, err := o.deadLetterOps()
	if err != nil {
		return 0, err
	}
	n, err := dl.DeadLetterDiscard(ctx, outboxdriver.DeadLetterChange{Keys: keys, Actor: actor})
	if err != nil {
		return n, fmt.Errorf("outbox: discard dead letters: %w", err)
	}
	return n, nil
}

// The states of a dead letter (DeadLetter.State, DeadLetterFilter.State).
const (
	DeadLetterDead      = outboxdriver.DeadLetterDead
	DeadLetterRetried   = outboxdriver.DeadLetterRetried
	DeadLetterDiscarded = outboxdriver.DeadLetterDiscarded
)

// redriveKeys returns the dead letters the redrive policy is due to retry, oldest first, up to
// redriveWindow. The store lists only those it may retry where it can: the oldest window of all
// dead letters, once it held redriveWindow that the policy may not retry (permanent, retried
// MaxRetries times, kept for inspection), held none it may, and no younger one was retried again.
func (o *Outbox) redriveKeys(ctx context.Context) ([]Source, error) {
	if r, ok := o.store.(outboxdriver.DeadLetterRedriver); ok {
		keys, err := r.DeadLetterRedrivable(ctx, o.cfg.Redrive.MaxRetries, o.cfg.Redrive.After, redriveWindow)
		if !errors.Is(err, errors.ErrUnsupported) {
			if err != nil {
				return nil, fmt.Errorf("outbox: redrive: %w", err)
			}
			return keys, nil
		}
	}
	dead, err := o.DeadLetters(ctx, DeadLetterFilter{State: DeadLetterDead, Limit: redriveWindow})
	if err != nil {
		return nil, err
	}
	var keys []Source
	for _, d := range dead {
		if time.Since(d.DeadAt) < o.cfg.Redrive.After {
			break // oldest first: the rest are younger still
		}
		if d.Retries < o.cfg.Redrive.MaxRetries && !d.Permanent && d.SourceTopic != "" {
			keys = append(keys, Source{Consumer: d.Consumer, ID: d.MessageID})
		}
	}
	return keys, nil
}

// redriveWindow is how many of the oldest dead letters a pass of the redrive policy looks at.
const redriveWindow = 1000

// redriveOnce retries the dead letters the redrive policy (Config.Redrive) is due to retry.
func (o *Outbox) redriveOnce(ctx context.Context) error {
	keys, err := o.redriveKeys(ctx)
	if err != nil {
		return err
	}
	if len(keys) == 0 {
		return nil
	}
	// The limit goes to the store too: the count read above may be stale by the time of the
	// retry (another instance retried it, and it died again since).
	n, err := o.retryDeadLetters(ctx, outboxdriver.DeadLetterChange{Keys: keys, Actor: RedriveActor, MaxRetries: o.cfg.Redrive.MaxRetries})
	if n > 0 {
		o.logger.Info("Dead letters retried by the redrive policy", watermill.LogFields{"retried": n, "max_retries": o.cfg.Redrive.MaxRetries})
	}
	return err
}
