package mysql

import "github.com/watermill-outbox/outbox/store"

// deadLetters are the statements of the dead letters (migrations 005 and 009) and of the requests to
// dead-letter a failing message at once (migration 007). A parameter used twice is
// named once in a derived row, as the arguments are positional.
func (q queries) deadLetters() store.DeadLetterQueries {
	n := q.n
	cleanup := `state <> 'dead' AND changed_at < ` + ago("?")
	return store.DeadLetterQueries{
		Attempt: `INSERT INTO ` + n.Attempts + ` (consumer, message_id, attempts, last_error, first_failed_at, last_failed_at)
			VALUES (?, ?, 1, ?, ` + now + `, ` + now + `)
			ON DUPLICATE KEY UPDATE attempts = attempts + 1, last_error = VALUES(last_error), last_failed_at = VALUES(last_failed_at)`,
		AttemptRead: `SELECT attempts FROM ` + n.Attempts + ` WHERE consumer = ? AND message_id = ?`,
		// A message dead again after a retry keeps its count of retries, and the topic it was
		// first received from (and its UUID) when this delivery cannot tell its own.
		Upsert: `INSERT INTO ` + n.DeadLetters + ` (consumer, message_id, source_topic, payload, metadata, reason, attempts, permanent, message_uuid, dead_at, changed_by)
			VALUES (?, ?, ?, ?, ?, ?, ?, ?, nullif(?, ''), ` + now + `, '')
			ON DUPLICATE KEY UPDATE
				source_topic = IF(VALUES(source_topic) = '', source_topic, VALUES(source_topic)),
				message_uuid = coalesce(VALUES(message_uuid), message_uuid),
				payload = VALUES(payload), metadata = VALUES(metadata), reason = VALUES(reason),
				attempts = VALUES(attempts), permanent = VALUES(permanent), dead_at = VALUES(dead_at),
				state = 'dead', changed_at = NULL, changed_by = ''`,
		List: `SELECT d.consumer, d.message_id, d.source_topic, IF(f.whole, d.payload, NULL), IF(f.whole, d.metadata, NULL), d.reason, d.attempts, d.permanent,
				` + msSince("d.dead_at") + `, d.state, ` + msSince("d.changed_at") + `, d.changed_by, d.retries, coalesce(d.message_uuid, '')
			FROM ` + n.DeadLetters + ` d JOIN (SELECT CAST(? AS BINARY) AS consumer, ? AS state, ? AS whole) f
				ON (f.consumer = '' OR d.consumer = f.consumer) AND (f.state = '' OR d.state = f.state)
			ORDER BY d.dead_at, d.consumer, d.message_id LIMIT ?`,
		// MySQL assigns left to right: the retry is counted before the state changes.
		Mark: `UPDATE ` + n.DeadLetters + ` d JOIN (SELECT ? AS state, ? AS actor, ? AS consumer, ? AS message_id, ? AS max_retries) a
				ON d.consumer = a.consumer AND d.message_id = a.message_id
			SET d.retries = d.retries + CASE WHEN a.state = 'retried' THEN 1 ELSE 0 END,
				d.state = a.state, d.changed_at = ` + now + `, d.changed_by = a.actor
			WHERE d.state = 'dead' AND d.retries < a.max_retries`,
		Read:   `SELECT source_topic, payload, metadata, coalesce(message_uuid, '') FROM ` + n.DeadLetters + ` WHERE consumer = ? AND message_id = ?`,
		Count:  `SELECT count(*) FROM (SELECT 1 FROM ` + n.DeadLetters + ` WHERE state = 'dead' LIMIT ?) d`,
		IsDead: `SELECT count(*) FROM ` + n.DeadLetters + ` WHERE consumer = ? AND message_id = ? AND state = 'dead'`,
		Redrivable: `SELECT consumer, message_id FROM ` + n.DeadLetters + `
			WHERE state = 'dead' AND NOT permanent AND retries < ? AND source_topic <> ''
			  AND dead_at <= ` + ago("?") + `
			ORDER BY dead_at, consumer, message_id LIMIT ?`,
		Cleanup:      `DELETE FROM ` + n.DeadLetters + ` WHERE ` + cleanup + ` LIMIT ?`,
		CleanupCount: `SELECT count(*) FROM ` + n.DeadLetters + ` WHERE ` + cleanup,
		Now: `UPDATE ` + n.Attempts + ` a JOIN (SELECT ? AS actor, ? AS consumer, ? AS message_id) r
				ON a.consumer = r.consumer AND a.message_id = r.message_id
			SET a.dead_letter_by = r.actor
			WHERE NOT EXISTS (SELECT 1 FROM ` + n.Processed + ` p WHERE p.consumer = r.consumer AND p.message_id = r.message_id)`,
		Requested: `SELECT a.attempts, a.last_error, coalesce(a.dead_letter_by, '')
			FROM ` + n.Attempts + ` a JOIN (SELECT ? AS consumer, ? AS message_id) r
				ON a.consumer = r.consumer AND a.message_id = r.message_id
			WHERE NOT EXISTS (SELECT 1 FROM ` + n.Processed + ` p WHERE p.consumer = r.consumer AND p.message_id = r.message_id)`,
	}
}
