package postgres

import "github.com/watermill-outbox/outbox/store"

// deadLetterQueries are the statements of the dead letters (migrations 018 and 024) and of the
// requests to dead-letter a failing message at once (migration 020).
func deadLetterQueries(n store.Names) store.DeadLetterQueries {
	since := func(t string) string { return `(extract(epoch FROM now() - ` + t + `) * 1000)::bigint` }
	expired := `state <> 'dead' AND changed_at < now() - ($1 * interval '1 millisecond')`
	cleanup := `SELECT consumer, message_id FROM ` + n.DeadLetters + ` WHERE ` + expired
	return store.DeadLetterQueries{
		Attempt: `INSERT INTO ` + n.Attempts + ` AS a (consumer, message_id, attempts, last_error) VALUES ($1, $2, 1, $3)
			ON CONFLICT (consumer, message_id) DO UPDATE
			SET attempts = a.attempts + 1, last_error = EXCLUDED.last_error, last_failed_at = now()
			RETURNING attempts`,
		// A message dead again after a retry keeps its count of retries, and the topic it was
		// first received from (and its UUID) when this delivery cannot tell its own.
		Upsert: `INSERT INTO ` + n.DeadLetters + ` AS d (consumer, message_id, source_topic, payload, metadata, reason, attempts, permanent, message_uuid)
			VALUES ($1, $2, $3, $4, $5, $6, $7, $8, nullif($9, ''))
			ON CONFLICT (consumer, message_id) DO UPDATE
			SET source_topic = CASE WHEN EXCLUDED.source_topic = '' THEN d.source_topic ELSE EXCLUDED.source_topic END,
				message_uuid = coalesce(EXCLUDED.message_uuid, d.message_uuid),
				payload = EXCLUDED.payload, metadata = EXCLUDED.metadata, reason = EXCLUDED.reason,
				attempts = EXCLUDED.attempts, permanent = EXCLUDED.permanent, dead_at = now(),
				state = 'dead', changed_at = NULL, changed_by = ''`,
		List: `SELECT consumer, message_id, source_topic, CASE WHEN $3 THEN payload END, CASE WHEN $3 THEN metadata END, reason, attempts, permanent,
				` + since("dead_at") + `, state, ` + since("changed_at") + `, changed_by, retries, coalesce(message_uuid, '')
			FROM ` + n.DeadLetters + `
			WHERE ($1 = '' OR consumer = $1) AND ($2 = '' OR state = $2)
			ORDER BY dead_at, consumer, message_id LIMIT $4`,
		Mark: `UPDATE ` + n.DeadLetters + ` SET state = $1, changed_at = now(), changed_by = $2,
				retries = retries + CASE WHEN $1 = 'retried' THEN 1 ELSE 0 END
			WHERE consumer = $3 AND message_id = $4 AND state = 'dead' AND retries < $5`,
		Read:   `SELECT source_topic, payload, metadata, coalesce(message_uuid, '') FROM ` + n.DeadLetters + ` WHERE consumer = $1 AND message_id = $2`,
		Count:  `SELECT count(*) FROM (SELECT 1 FROM ` + n.DeadLetters + ` WHERE state = 'dead' LIMIT $1) d`,
		IsDead: `SELECT count(*) FROM ` + n.DeadLetters + ` WHERE consumer = $1 AND message_id = $2 AND state = 'dead'`,
		Redrivable: `SELECT consumer, message_id FROM ` + n.DeadLetters + `
			WHERE state = 'dead' AND NOT permanent AND retries < $1 AND source_topic <> ''
			  AND dead_at <= now() - ($2 * interval '1 millisecond')
			ORDER BY dead_at, consumer, message_id LIMIT $3`,
		// The DELETE repeats its subquery's condition on its own row: a dead letter dead again
		// (or changed) while the DELETE waited for it is judged by the version it then finds,
		// where a match by its key alone would delete the message's new dead letter.
		Cleanup:      `DELETE FROM ` + n.DeadLetters + ` WHERE (consumer, message_id) IN (` + cleanup + ` LIMIT $2) AND ` + expired,
		CleanupCount: `SELECT count(*) FROM (` + cleanup + `) d`,
		Now: `UPDATE ` + n.Attempts + ` SET dead_letter_by = $1 WHERE consumer = $2 AND message_id = $3
			AND NOT EXISTS (SELECT 1 FROM ` + n.Processed + ` p WHERE p.consumer = $2 AND p.message_id = $3)`,
		Requested: `SELECT attempts, last_error, coalesce(dead_letter_by, '') FROM ` + n.Attempts + ` WHERE consumer = $1 AND message_id = $2
			AND NOT EXISTS (SELECT 1 FROM ` + n.Processed + ` p WHERE p.consumer = $1 AND p.message_id = $2)`,
	}
}
