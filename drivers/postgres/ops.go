package postgres

import (
	"errors"

	"github.com/watermill-outbox/outbox/store"
)

// opsQueries are the operators' statements (package ops) on the tables named by n.
func opsQueries(n store.Names) store.OpsQueries {
	groups := `SELECT source_consumer, topic,
			count(*) FILTER (WHERE parked_at IS NULL),
			coalesce((extract(epoch FROM now() - min(created_at) FILTER (WHERE parked_at IS NULL)) * 1000)::bigint, 0),
			count(*) FILTER (WHERE parked_at IS NOT NULL)`
	return store.OpsQueries{
		Groups: groups + `
		FROM ` + n.Effects + ` WHERE dispatched_at IS NULL GROUP BY 1, 2 ORDER BY 1, 2`,
		GroupsWindow: groups + `
		FROM (SELECT source_consumer, topic, parked_at, created_at FROM ` + n.Effects + `
			WHERE dispatched_at IS NULL ORDER BY id LIMIT $1) e
		GROUP BY 1, 2 ORDER BY 1, 2`,
		WindowFull: `SELECT EXISTS (SELECT 1 FROM ` + n.Effects + `
		WHERE dispatched_at IS NULL ORDER BY id OFFSET $1 LIMIT 1)`,
		FailingCounts: `SELECT a.consumer, count(*), sum(a.attempts) FROM ` + n.Attempts + ` a
		WHERE NOT EXISTS (SELECT 1 FROM ` + n.Processed + ` p WHERE p.consumer = a.consumer AND p.message_id = a.message_id)
		GROUP BY 1 ORDER BY 1`,
		// The consumers are found by skipping through the primary key (a loose index scan), and
		// each one's IDs counted up to the cap: the cost does not grow with millions of retained IDs.
		Retained: `WITH RECURSIVE c AS (
			(SELECT consumer FROM ` + n.Processed + ` ORDER BY consumer LIMIT 1)
			UNION ALL
			SELECT (SELECT p.consumer FROM ` + n.Processed + ` p WHERE p.consumer > c.consumer ORDER BY p.consumer LIMIT 1)
			FROM c WHERE c.consumer IS NOT NULL)
		SELECT c.consumer, (SELECT count(*) FROM (SELECT 1 FROM ` + n.Processed + ` p
			WHERE p.consumer = c.consumer LIMIT $1) x)
		FROM c WHERE c.consumer IS NOT NULL`,
		// Claims of the last hour only, found through the index on processed_at.
		LastDispatch: `SELECT max(dispatched_at) FROM ` + n.Processed + `
		WHERE processed_at > now() - interval '1 hour'`,
		Parked: `SELECT id, source_consumer, source_id, kind, topic, uuid, ordering_key, attempts, failures,
			coalesce(last_error, ''), parked_at, created_at
		FROM ` + n.Effects + ` e
		WHERE parked_at IS NOT NULL AND dispatched_at IS NULL
		  AND ($1::text IS NULL OR id = ANY (string_to_array($1::text, ',')::bigint[]))
		  AND ($2 = '' OR topic = $2) AND ($3 = '' OR source_consumer = $3)
		  AND parked_at < now() - ($4 * interval '1 millisecond')
		  AND ($5 = '' OR strpos(coalesce(last_error, ''), $5) > 0)
		  AND id > $6
		ORDER BY id LIMIT $7`,
		Failing: `SELECT a.consumer, a.message_id, a.attempts, a.last_error, a.first_failed_at, a.last_failed_at
		FROM ` + n.Attempts + ` a
		WHERE ($1 = '' OR a.consumer = $1)
		  AND NOT EXISTS (SELECT 1 FROM ` + n.Processed + ` p WHERE p.consumer = a.consumer AND p.message_id = a.message_id)
		ORDER BY a.attempts DESC, a.last_failed_at DESC LIMIT $2`,
		IsPoisoned: `SELECT poisoned FROM ` + n.Processed + ` WHERE consumer = $1 AND message_id = $2`,
		Poisoned: `SELECT p.consumer, p.message_id, p.processed_at, coalesce(a.attempts, 0), coalesce(a.last_error, '')
		FROM ` + n.Processed + ` p LEFT JOIN ` + n.Attempts + ` a ON a.consumer = p.consumer AND a.message_id = p.message_id
		WHERE p.poisoned AND ($1 = '' OR p.consumer = $1) ORDER BY p.processed_at DESC LIMIT $2`,
		LookupClaim: `SELECT processed_at, dispatched_at, poisoned FROM ` + n.Processed + `
		WHERE consumer = $1 AND message_id = $2`,
		LookupEffects: `SELECT id, kind, topic, uuid,
			CASE WHEN parked_at IS NOT NULL THEN 'parked' ELSE 'pending' END, created_at, NULL::timestamptz, coalesce(last_error, '')
		FROM ` + n.Effects + ` WHERE source_consumer = $1 AND source_id = $2 AND dispatched_at IS NULL
		UNION ALL
		SELECT id, kind, topic, uuid, 'dispatched', created_at, dispatched_at, coalesce(last_error, '')
		FROM ` + n.Dispatched + ` WHERE source_consumer = $1 AND source_id = $2
		ORDER BY 1`,
		LookupAttempts: `SELECT attempts, last_error FROM ` + n.Attempts + ` WHERE consumer = $1 AND message_id = $2`,
		AuditLog: `SELECT at, actor, action, target, detail, coalesce(db_role, ''),
			coalesce(host(client_addr), ''), remote_addr
		FROM ` + n.Audit + ` ORDER BY id DESC LIMIT $1`,
		SampleAge: `SELECT (extract(epoch FROM now() - sampled_at) * 1000)::bigint FROM ` + n.Stats + ` WHERE id = 1`,
		ServiceConfig: `SELECT retention_ms, effect_retention_ms, redelivery_horizon_ms, config_at
		FROM ` + n.Stats + ` WHERE id = 1`,
		IsInsufficientPrivilege: IsInsufficientPrivilege,
	}
}

// IsInsufficientPrivilege tells whether err is PostgreSQL's insufficient_privilege (42501), from
// lib/pq or pgx.
func IsInsufficientPrivilege(err error) bool {
	var s interface{ SQLState() string }
	return errors.As(err, &s) && s.SQLState() == "42501"
}
