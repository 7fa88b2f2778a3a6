package mysql

import (
	"errors"

	gomysql "github.com/go-sql-driver/mysql"

	"github.com/watermill-outbox/outbox/store"
)

// ops are the operators' statements (package ops) on the tables. Arguments used more than once,
// or compared with the tables' columns, are named once by a derived row (see binary and text).
func (q queries) ops() store.OpsQueries {
	n := q.n
	groups := `SELECT source_consumer, topic,
			SUM(parked_at IS NULL),
			coalesce(` + msSince("MIN(CASE WHEN parked_at IS NULL THEN created_at END)") + `, 0),
			SUM(parked_at IS NOT NULL)`
	return store.OpsQueries{
		Groups: groups + `
		FROM ` + n.Effects + ` WHERE dispatched_at IS NULL GROUP BY source_consumer, topic ORDER BY source_consumer, topic`,
		GroupsWindow: groups + `
		FROM (SELECT source_consumer, topic, parked_at, created_at FROM ` + n.Effects + `
			WHERE dispatched_at IS NULL ORDER BY id LIMIT ?) e
		GROUP BY source_consumer, topic ORDER BY source_consumer, topic`,
		WindowFull: `SELECT EXISTS (SELECT 1 FROM ` + n.Effects + `
		WHERE dispatched_at IS NULL ORDER BY id LIMIT 1 OFFSET ?)`,
		FailingCounts: `SELECT a.consumer, count(*), sum(a.attempts) FROM ` + n.Attempts + ` a
		WHERE NOT EXISTS (SELECT 1 FROM ` + n.Processed + ` p WHERE p.consumer = a.consumer AND p.message_id = a.message_id)
		GROUP BY a.consumer ORDER BY a.consumer`,
		// The consumers are read by a loose index scan of the primary key (DISTINCT of its
		// first column). A consumer with more claims than the cap is told by its (cap+1)-th
		// message ID, found by the primary key, and counted NULL; the others are counted, fewer
		// than the cap: the cost does not grow with the claims. (A derived table with the LIMIT,
		// as on PostgreSQL, cannot name the outer consumer on MariaDB.)
		Retained: `SELECT c.consumer, CASE WHEN (SELECT 1 FROM ` + n.Processed + ` p2 WHERE p2.consumer = c.consumer
					ORDER BY p2.message_id LIMIT 1 OFFSET ?) IS NULL
				THEN (SELECT count(*) FROM ` + n.Processed + ` p WHERE p.consumer = c.consumer) END
		FROM (SELECT DISTINCT consumer FROM ` + n.Processed + `) c ORDER BY c.consumer`,
		// A claim's dispatch time is never before its processing time: the condition on
		// dispatched_at, implied by the other, reads the claims of the last hour by its index.
		LastDispatch: `SELECT max(dispatched_at) FROM ` + n.Processed + `
		WHERE processed_at > ` + now + ` - INTERVAL 1 HOUR AND dispatched_at > ` + now + ` - INTERVAL 1 HOUR`,
		// The error filter's emptiness is its length: utf8mb4_bin pads, and ' ' = '' in it.
		Parked: `SELECT e.id, e.source_consumer, e.source_id, e.kind, e.topic, e.uuid, e.ordering_key, e.attempts, e.failures,
			coalesce(e.last_error, ''), e.parked_at, e.created_at
		FROM ` + n.Effects + ` e,
			(SELECT ? AS ids, ` + binary + ` AS topic, ` + binary + ` AS consumer, ? AS older_ms, ` + text + ` AS err, ? AS after_id) a
		WHERE e.parked_at IS NOT NULL AND e.dispatched_at IS NULL
		  AND (a.ids IS NULL OR FIND_IN_SET(e.id, a.ids) > 0)
		  AND (a.topic = '' OR e.topic = a.topic) AND (a.consumer = '' OR e.source_consumer = a.consumer)
		  AND e.parked_at < ` + ago("a.older_ms") + `
		  AND (CHAR_LENGTH(a.err) = 0 OR LOCATE(a.err, coalesce(e.last_error, '')) > 0)
		  AND e.id > a.after_id
		ORDER BY e.id LIMIT ?`,
		Failing: `SELECT a.consumer, a.message_id, a.attempts, a.last_error, a.first_failed_at, a.last_failed_at
		FROM ` + n.Attempts + ` a, (SELECT ` + binary + ` AS consumer) f
		WHERE (f.consumer = '' OR a.consumer = f.consumer)
		  AND NOT EXISTS (SELECT 1 FROM ` + n.Processed + ` p WHERE p.consumer = a.consumer AND p.message_id = a.message_id)
		ORDER BY a.attempts DESC, a.last_failed_at DESC LIMIT ?`,
		IsPoisoned: `SELECT poisoned FROM ` + n.Processed + ` WHERE consumer = ? AND message_id = ?`,
		Poisoned: `SELECT p.consumer, p.message_id, p.processed_at, coalesce(a.attempts, 0), coalesce(a.last_error, '')
		FROM ` + n.Processed + ` p LEFT JOIN ` + n.Attempts + ` a ON a.consumer = p.consumer AND a.message_id = p.message_id,
			(SELECT ` + binary + ` AS consumer) f
		WHERE p.poisoned AND (f.consumer = '' OR p.consumer = f.consumer) ORDER BY p.processed_at DESC LIMIT ?`,
		LookupClaim: `SELECT processed_at, dispatched_at, poisoned FROM ` + n.Processed + `
		WHERE consumer = ? AND message_id = ?`,
		// Dispatched effects are kept in the effects table itself.
		LookupEffects: `SELECT id, kind, topic, uuid,
			CASE WHEN dispatched_at IS NOT NULL THEN 'dispatched' WHEN parked_at IS NOT NULL THEN 'parked' ELSE 'pending' END,
			created_at, dispatched_at, coalesce(last_error, '')
		FROM ` + n.Effects + ` WHERE source_consumer = ? AND source_id = ? ORDER BY id`,
		LookupAttempts: `SELECT attempts, last_error FROM ` + n.Attempts + ` WHERE consumer = ? AND message_id = ?`,
		// The entry records the account (CURRENT_USER()) that wrote it, not the connection's
		// address.
		AuditLog: `SELECT at, actor, action, target, detail, db_user, '', remote_addr
		FROM ` + n.Audit + ` ORDER BY id DESC LIMIT ?`,
		SampleAge: `SELECT ` + msSince("sampled_at") + ` FROM ` + n.Stats + ` WHERE id = 1`,
		ServiceConfig: `SELECT retention_ms, effect_retention_ms, redelivery_horizon_ms, config_at
		FROM ` + n.Stats + ` WHERE id = 1`,
		IsInsufficientPrivilege: IsInsufficientPrivilege,
	}
}

// IsInsufficientPrivilege tells whether err is MySQL's refusal of a statement for want of a
// privilege: on a database (1044), a table (1142) or a column (1143), or a global one (1227).
func IsInsufficientPrivilege(err error) bool {
	var e *gomysql.MySQLError
	return errors.As(err, &e) && (e.Number == 1044 || e.Number == 1142 || e.Number == 1143 || e.Number == 1227)
}
