package outbox

import (
	"github.com/watermill-outbox/outbox/outboxdriver"
)

// The types a user of the framework meets, defined with the storage contract in outboxdriver
// (which driver authors implement; users need not read it).
type (
	// Source identifies what caused a group of side effects: an incoming message handled by a
	// consumer (Consumer is the consumer name, ID the message ID), or a boundary transaction
	// (Consumer is empty, ID is the boundary ID).
	Source = outboxdriver.Source
	// Effect is one side effect as it is stored: a message to publish (Kind == KindPublish) or a
	// call of a registered applier (Kind is the applier's name). An Applier receives it.
	Effect = outboxdriver.Effect
	// ParkedEffect is an effect the relay gave up on after its maximum attempts (ParkedEffects).
	ParkedEffect = outboxdriver.ParkedEffect
	// DeadLetter is a message a consumer gave up on (Outbox.DeadLetters).
	DeadLetter = outboxdriver.DeadLetter
	// DeadLetterFilter selects dead letters (Outbox.DeadLetters).
	DeadLetterFilter = outboxdriver.DeadLetterFilter
	// Stats is a sample of the outbox tables (Outbox.Stats).
	Stats = outboxdriver.Stats
	// XminHold is what holds back PostgreSQL's xmin horizon (Stats.XminHold).
	XminHold = outboxdriver.XminHold
	// TableVacuum is one outbox table's dead row versions (Stats.Tables).
	TableVacuum = outboxdriver.TableVacuum
	// CleanupResult counts what a cleanup pass deleted (Outbox.Cleanup).
	CleanupResult = outboxdriver.CleanupResult
)

// KindPublish is the Kind of effects that publish a message.
const KindPublish = outboxdriver.KindPublish

// StatsCountCap bounds the rows one Stats sample counts: larger counts are estimated.
const StatsCountCap = outboxdriver.StatsCountCap

// ClaimClockSlack is how much earlier than the dispatch of its effects a claim's dispatch time may
// be: retention counts from dispatch, give or take this much.
const ClaimClockSlack = outboxdriver.ClaimClockSlack

// Errors of the schema; test them with errors.Is.
var (
	// ErrSchemaMissing means the outbox tables do not exist: run Outbox.Migrate.
	ErrSchemaMissing = outboxdriver.ErrSchemaMissing
	// ErrSchemaOutdated means the outbox tables are older than this version: run Outbox.Migrate.
	ErrSchemaOutdated = outboxdriver.ErrSchemaOutdated
)
