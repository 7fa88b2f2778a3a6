package outboxpgx

import (
	"github.com/watermill-outbox/outbox/drivers/postgres"
	"github.com/watermill-outbox/outbox/store"
)

// queries are the statements the pgx driver runs itself; the others are the postgres driver's,
// run through database/sql on the same pool.
type queries struct {
	claim     string           // pessimistic: (consumer, id) -> claimed, age of a committed claim found
	insert    func(int) string // the effect rows: see store.EffectInsertArgs
	processed string           // (consumer, id) -> a row when processed
	pending   string           // (consumer, id) -> the effect rows of the source, pending, in seq order

	lookup      string // optimistic: (consumer, id) -> age of the claim, no row when there is none
	claimInline string // optimistic: (consumer, id, inline effects or NULL): no ON CONFLICT
	listInline  string // (consumer, id) -> inline effects, their age in ms
	markInline  string // (consumers, ids): clear the inline effects, sent
	lockInline  string // (consumer, id) -> consumer, id, effects, age in ms: locked
	sweep       string // (grace ms, limit) -> consumer, id, effects, age in ms: locked, skipping locked ones
	sweepLeft   string // (grace ms) -> whether claims in the sweep's range still hold inline effects
	sweptTo     string // (grace ms): the sweep got to now - grace
	materialize string // arrays of the effect columns, and the age in ms of each
	clearInline string // (consumers, ids)
	leaseSource string // (consumer, id, lease ms): the pending rows of the source are not due before
	takeInline  string // (consumers, ids) -> consumer, id, effects, age in ms of the claims it cleared
	archive     string // arrays of the dispatched columns: the inline effects sent, kept for EffectRetention
}

// sweepHorizon is how late, after its processed_at, a claim with inline effects may become
// visible (the commit of the statement that wrote it, in the same round trip, took that long)
// and still be found by the sweep of the relay.
const sweepHorizon = "interval '1 minute'"

func newQueries(n store.Names, deleteDispatched bool) queries {
	// The sweep's range: from where it got to, less the horizon, to now - grace ($1 ms).
	sweepBounds := `WITH b AS (SELECT least(coalesce(s.swept_to, '-infinity'), now() - $1 * interval '1 millisecond') - ` + sweepHorizon + ` AS lo,
			now() - $1 * interval '1 millisecond' AS hi FROM ` + n.Stats + ` s WHERE s.id = 1)`
	pq := postgres.Queries(n, deleteDispatched)
	age := `(extract(epoch FROM now() - p.processed_at) * 1000)::bigint`
	return queries{
		claim:     pq.MessageClaim,
		insert:    pq.EffectInsert,
		processed: pq.MessageIsProcessed,
		pending:   pq.EffectListPending,

		lookup: `SELECT ` + age + ` FROM ` + n.Processed + ` p WHERE p.consumer = $1 AND p.message_id = $2`,
		// clock_timestamp(): the time of the commit's round trip, not of BEGIN, so that the sweep
		// may look only a little behind the claims it sees.
		claimInline: `INSERT INTO ` + n.Processed + ` (consumer, message_id, processed_at, dispatched_at, effects)
			VALUES ($1, $2, clock_timestamp(), clock_timestamp(), $3)`,
		listInline: `SELECT p.effects, ` + age + ` FROM ` + n.Processed + ` p
			WHERE p.consumer = $1 AND p.message_id = $2 AND p.effects IS NOT NULL`,
		markInline: `UPDATE ` + n.Processed + ` p SET effects = NULL FROM unnest($1::text[], $2::text[]) AS v(consumer, id)
			WHERE p.consumer = v.consumer AND p.message_id = v.id AND p.effects IS NOT NULL
			  AND set_config('synchronous_commit', 'off', true) IS NOT NULL`,
		lockInline: `SELECT p.consumer, p.message_id, p.effects, ` + age + ` FROM ` + n.Processed + ` p
			WHERE p.consumer = $1 AND p.message_id = $2 AND p.effects IS NOT NULL FOR UPDATE`,
		sweep: sweepBounds + `
			SELECT p.consumer, p.message_id, p.effects, ` + age + ` FROM ` + n.Processed + ` p, b
			WHERE p.processed_at >= b.lo AND p.processed_at < b.hi AND p.effects IS NOT NULL
			ORDER BY p.processed_at LIMIT $2 FOR UPDATE OF p SKIP LOCKED`,
		sweepLeft: sweepBounds + `
			SELECT EXISTS (SELECT 1 FROM ` + n.Processed + ` p, b
				WHERE p.processed_at >= b.lo AND p.processed_at < b.hi AND p.effects IS NOT NULL)`,
		sweptTo: `UPDATE ` + n.Stats + ` SET swept_to = greatest(coalesce(swept_to, '-infinity'), now() - $1 * interval '1 millisecond') WHERE id = 1`,
		// Moved effects are due as they would have been as rows: created when their claim was.
		materialize: `INSERT INTO ` + n.Effects + ` (source_consumer, source_id, seq, kind, topic, uuid, payload, metadata, ordering_key, created_at)
			SELECT c, i, s, k, t, u, pl, md, ok, now() - a * interval '1 millisecond'
			FROM unnest($1::text[], $2::text[], $3::int[], $4::text[], $5::text[], $6::text[], $7::bytea[], $8::bytea[], $9::text[], $10::bigint[])
				AS v(c, i, s, k, t, u, pl, md, ok, a)`,
		takeInline: `WITH old AS (SELECT p.consumer, p.message_id, p.effects, ` + age + ` AS age FROM ` + n.Processed + ` p
				JOIN unnest($1::text[], $2::text[]) AS v(consumer, id) ON p.consumer = v.consumer AND p.message_id = v.id
				WHERE p.effects IS NOT NULL FOR UPDATE OF p),
			clr AS (UPDATE ` + n.Processed + ` p SET effects = NULL FROM old WHERE p.consumer = old.consumer AND p.message_id = old.message_id)
			SELECT consumer, message_id, effects, age FROM old`,
		archive: `INSERT INTO ` + n.Dispatched + ` (id, source_consumer, source_id, seq, kind, topic, uuid, payload, metadata, ordering_key,
				created_at, dispatched_at, attempts, failures)
			SELECT nextval(pg_get_serial_sequence('` + n.Effects + `', 'id')), c, i, s, k, t, u, pl, md, ok, now() - a * interval '1 millisecond', now(), 0, 0
			FROM unnest($1::text[], $2::text[], $3::int[], $4::text[], $5::text[], $6::text[], $7::bytea[], $8::bytea[], $9::text[], $10::bigint[])
				AS v(c, i, s, k, t, u, pl, md, ok, a)`,
		leaseSource: `UPDATE ` + n.Effects + ` SET next_attempt_at = now() + $3 * interval '1 millisecond'
			WHERE source_consumer = $1 AND source_id = $2 AND dispatched_at IS NULL AND parked_at IS NULL`,
		clearInline: `UPDATE ` + n.Processed + ` p SET effects = NULL FROM unnest($1::text[], $2::text[]) AS v(consumer, id)
			WHERE p.consumer = v.consumer AND p.message_id = v.id`,
	}
}
