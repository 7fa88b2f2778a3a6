package outboxpgx

import (
	"github.com/watermill-outbox/outbox/drivers/postgres"
	"github.com/watermill-outbox/outbox/outboxdriver"
	"github.com/watermill-outbox/outbox/store"
)

// queries are the statements the pgx driver runs itself; the others are the postgres driver's,
// run through database/sql on the same pool.
type queries struct {
	claim     string                             // pessimistic: (consumer, id) -> claimed, age of a committed claim found, whether it is settled, the claim's inline_xid
	insert    func([]outboxdriver.Effect) string // the effect rows (at most store.EffectInsertMaxRows): see store.EffectInsertArgs
	processed string                             // (consumer, id) -> a row when processed
	ownClaim  string                             // (consumer, id, the claim's inline_xid) -> a row when the unit's own claim committed
	ownTx     string                             // (the claim's inline_xid) -> division_by_zero unless the transaction is the claim's
	mark      string                             // marks the transaction of a unit without a claim at BEGIN (optimistic, boundary)
	marked    string                             // -> division_by_zero unless the transaction is the one mark marked
	pending   string                             // (consumer, id) -> the effect rows and inline effects of the source: see postgres.PendingQuery

	delayedInsert func(int) string // the delayed effects: see store.DelayedInsertArgs
	delayedCancel string           // (cancel key)
	// The same, which write only while the unit's own claim exists (pessimistic, after user SQL
	// ended the transaction): + (consumer, id, the claim's inline_xid); the cancel returns
	// (claimed, count).
	delayedInsertClaimed func(int) string
	delayedCancelClaimed string

	lookup      string // optimistic: (consumer, id) -> age of the claim and whether it is settled, no row when there is none
	claimInline string // optimistic: (consumer, id, inline effects or NULL): no ON CONFLICT

	keys store.Queries // the postgres driver's statements of idempotency keys (KeyLock, KeyClaim, KeyRead, KeySave)
}

func newQueries(n store.Names, deleteDispatched bool, gen *postgres.Generation) queries {
	pq := postgres.Queries(n, deleteDispatched, gen)
	return queries{
		claim: postgres.MessageClaimWithXID(n),
		insert: func(effects []outboxdriver.Effect) string {
			if store.HasOwnKey(effects) {
				return pq.EffectInsertKeyed(len(effects), false) // the pgx unit refuses a transaction ended under it itself
			}
			return pq.EffectInsert(len(effects))
		},
		processed: pq.MessageIsProcessed,
		ownClaim:  pq.MessageIsProcessed + ` AND inline_xid = $3`,
		// An error, not a row, so that the COMMIT queued behind it is not run (the batch stops at
		// the first error): pg_current_xact_id() is volatile, never folded at planning.
		ownTx: `SELECT 1 / (pg_current_xact_id()::text::bigint = $1::bigint)::int`,
		// A unit without a claim at BEGIN has no transaction ID to compare: its transaction
		// carries a transaction-local setting instead (current_setting is stable, never folded).
		mark:    pq.BoundaryMark,
		marked:  `SELECT 1 / (` + postgres.Marked + `)::int`,
		pending: postgres.PendingQuery(n),
		keys:    store.Queries{KeyLock: pq.KeyLock, KeyClaim: pq.KeyClaim, KeyRead: pq.KeyRead, KeySave: pq.KeySave},

		delayedInsert: pq.DelayedInsert,
		delayedCancel: pq.DelayedCancel,

		delayedInsertClaimed: func(count int) string { return postgres.DelayedInsertOwnClaim(n, count) },
		delayedCancelClaimed: postgres.DelayedCancelOwnClaim(n),

		// A claim found also tells whether anything of it is still pending: a duplicate whose
		// effects went out then reads nothing more.
		lookup: postgres.ClaimLookup(n),
		// clock_timestamp(): the time of the commit's round trip, not of BEGIN, from which the
		// relay's grace counts. Whether the relay's sweep finds the claim does not depend on it:
		// a claim with inline effects records the ID of its transaction (see the postgres
		// driver's sweep), which orders it against the sweeps whenever it commits.
		claimInline: `INSERT INTO ` + n.Processed + ` (consumer, message_id, processed_at, dispatched_at, effects, inline_xid)
			VALUES ($1, $2, clock_timestamp(), clock_timestamp(), $3::bytea,
				CASE WHEN $3::bytea IS NOT NULL THEN pg_current_xact_id()::text::bigint END)`,
	}
}
