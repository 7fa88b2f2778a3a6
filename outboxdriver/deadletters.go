package outboxdriver

import (
	"context"
	"errors"
	"time"
)

// DeadLetterState is the state of a dead letter.
type DeadLetterState string

// The states of a dead letter: dead until an operator retries or discards it.
const (
	DeadLetterDead      DeadLetterState = "dead"
	DeadLetterRetried   DeadLetterState = "retried"
	DeadLetterDiscarded DeadLetterState = "discarded"
)

// MetadataRetryFor addresses a retried dead letter to its consumer: a retry publishes the
// message to its source topic, which every consumer group of the topic reads, with this key set
// to the consumer of the dead letter. The outbox's other consumers ack it without running their
// handlers (past Retention, they no longer know it was processed); its own consumer takes the
// key off before its handler sees the message.
const MetadataRetryFor = "outbox_retry_for"

// DeadLetter is a message a consumer gave up on, as it is stored.
type DeadLetter struct {
	// Consumer and MessageID key it: one dead letter per message and consumer.
	Consumer  string
	MessageID string
	// UUID is the message's UUID, which a retry publishes it with again: it differs from
	// MessageID when the consumer reads its ID from elsewhere (middleware.WithMessageID). Empty
	// when unknown (a dead letter stored by a version before it was kept): a retry then uses
	// MessageID.
	UUID string
	// SourceTopic is the topic the message was received from (empty when unknown); a retry
	// publishes the message there again.
	SourceTopic string
	Payload     []byte
	Metadata    map[string]string
	// Reason is the last error, storable (StorableText).
	Reason string
	// Attempts counts the failed attempts, this one included.
	Attempts int
	// Permanent is true when the handler marked the error permanent, or the message could not be
	// identified: no attempt could succeed.
	Permanent bool
	// DeadAt is when it was stored (the last time, after a retry failed again).
	DeadAt time.Time
	// State, ChangedAt and ChangedBy: what an operator did with it, when, and who.
	State     DeadLetterState
	ChangedAt time.Time
	ChangedBy string
	// Retries counts the times it was retried.
	Retries int
}

// DeadLetterFilter selects dead letters for DeadLetterStore.DeadLetterList.
type DeadLetterFilter struct {
	// Consumer, when not empty, keeps those of one consumer.
	Consumer string
	// State, when not empty, keeps those in one state.
	State DeadLetterState
	// Limit bounds how many are returned, oldest first; 0: 100.
	Limit int
	// Brief leaves each one's Payload and Metadata out (empty): for a count or a grouping of many,
	// which would otherwise read every payload.
	Brief bool
}

// DeadLetterChange is an operator's change of dead letters (a retry or a discard).
type DeadLetterChange struct {
	// Keys are the dead letters, as Source{Consumer, ID: message ID}.
	Keys []Source
	// Actor is who changed them; it is stored with each.
	Actor string
	// MaxRetries, when above 0, leaves alone a retried dead letter that was retried that many
	// times already. The count is checked by the statement that moves the dead letter, so that
	// two processes retrying on a count each read before the other's retry (the redrive policy
	// of two instances) cannot retry it more often in all. 0: no limit (an operator's retry).
	MaxRetries int
}

// DeadLetterRedriver is implemented by a DeadLetterStore that finds the dead letters a redrive
// policy may retry without reading the others.
type DeadLetterRedriver interface {
	// DeadLetterRedrivable returns the keys of up to limit dead letters in state dead, oldest
	// first, dead for deadFor at least, not permanent, retried fewer than maxRetries times, and
	// with a source topic. A dialect without the query returns an error wrapping
	// errors.ErrUnsupported.
	DeadLetterRedrivable(ctx context.Context, maxRetries int, deadFor time.Duration, limit int) ([]Source, error)
}

// DeadLetterStore is implemented by a Store that keeps dead letters.
type DeadLetterStore interface {
	// DeadLetterInsert, in one transaction: counts a failed attempt of the message (when count is
	// true, as AttemptRecord does, the count then going into dl.Attempts), stores dl as a dead
	// letter in state dead (replacing one retried or discarded before), and writes the message's
	// claim as poisoned (MessagePoison), so that copies delivered later are acked as processed.
	// poison, when not nil, is stored as an effect of the message in the same transaction (a copy
	// for the poison topic): it is sent by whoever dispatches the message's pending effects, and
	// its StoreID is set. It returns the attempts stored.
	DeadLetterInsert(ctx context.Context, dl DeadLetter, count bool, poison *Effect) (int, error)
	// DeadLetterList returns dead letters, oldest first.
	DeadLetterList(ctx context.Context, f DeadLetterFilter) ([]DeadLetter, error)
	// DeadLetterRetry hands dead letters back to their consumers, each in one transaction: the
	// dead letter (in state dead) becomes retried, the poisoned claim of the message and its
	// failed attempts are deleted, and the stored message is written as an effect (kind publish,
	// to its source topic, with its UUID (its message ID when the UUID is unknown), its payload
	// and metadata) of source src
	// (a source of its own per retry, given by newSource), due for the relay at once (as after
	// EffectHandToRelay), so that the relay sends it. It returns
	// how many it retried; those not found dead, or retried c.MaxRetries times already, are
	// left alone.
	DeadLetterRetry(ctx context.Context, c DeadLetterChange, newSource func() Source) (int, error)
	// DeadLetterDiscard marks dead letters (in state dead) discarded, each in one transaction
	// with its audit; it returns how many it changed. They are kept, and the message's claim
	// stays poisoned.
	DeadLetterDiscard(ctx context.Context, c DeadLetterChange) (int, error)
	// DeadLetterCount counts the dead letters in state dead (at most StatsCountCap are counted).
	DeadLetterCount(ctx context.Context) (int, error)
}

// DeadLetterRequest is what the attempt counter of a failing message says of an operator's request
// to dead-letter it at once.
type DeadLetterRequest struct {
	// By is who asked; empty when nobody did.
	By string
	// Attempts and LastError are the counter's.
	Attempts  int
	LastError string
}

// DeadLetterNowStore is implemented by a DeadLetterStore whose attempt counters carry operators'
// requests to dead-letter a failing message at once.
type DeadLetterNowStore interface {
	// DeadLetterNow marks the attempt counter of src, a message that failed and is not processed
	// (nor dead-lettered), so that its next delivery stores it as a dead letter and acks it
	// without running the handler; it reports whether there was such a counter.
	DeadLetterNow(ctx context.Context, src Source, actor string) (bool, error)
	// DeadLetterRequested reads the request on the attempt counter of src, a message not
	// processed; By is empty when there is none (or no counter).
	DeadLetterRequested(ctx context.Context, src Source) (DeadLetterRequest, error)
}

// ErrDeadLetterNowUnsupported is returned by DeadLetterNow of a Store whose dialect cannot mark
// attempt counters.
var ErrDeadLetterNowUnsupported = errors.New("outbox: the driver cannot dead-letter a failing message at once")

// ErrDeadLettersUnsupported is returned by the dead-letter operations of a Store that keeps
// none.
var ErrDeadLettersUnsupported = errors.New("outbox: the driver keeps no dead letters")

// PoisonStore is implemented by a Store that moves a message to the poison topic in one
// transaction, as DeadLetterInsert does with a dead letter (used with dead letters off).
type PoisonStore interface {
	// MessagePoisonWith writes the claim of src as poisoned (MessagePoison) and stores poison
	// as an effect of src in the same transaction, setting its StoreID: it is sent by whoever
	// dispatches the message's pending effects. When a claim of src is there already (a copy
	// processed while this delivery failed, or moved to the poison topic before), it stores
	// nothing and returns ErrProcessedMeanwhile.
	MessagePoisonWith(ctx context.Context, src Source, poison *Effect) error
}

// ErrProcessedMeanwhile is returned by DeadLetterInsert and MessagePoisonWith, which then store
// nothing, when the message's claim was written by a copy that was processed while this delivery
// failed: the message is not dead, and the failed delivery is a duplicate of the one that
// succeeded.
var ErrProcessedMeanwhile = errors.New("outbox: a copy of the message was processed meanwhile")
