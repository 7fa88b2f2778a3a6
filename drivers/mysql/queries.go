package mysql

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"strings"
	"sync/atomic"
	"time"

	"github.com/watermill-outbox/outbox/outboxdriver"
	"github.com/watermill-outbox/outbox/store"
)

// now is the current time in the timestamp columns' terms (UTC, microseconds). It is fixed for
// the duration of one statement.
const now = `UTC_TIMESTAMP(6)`

// ago returns the time ms (an SQL expression of milliseconds) before now.
func ago(ms string) string { return now + ` - INTERVAL (` + ms + `) * 1000 MICROSECOND` }

// fromNow returns the time ms milliseconds after now.
func fromNow(ms string) string { return now + ` + INTERVAL (` + ms + `) * 1000 MICROSECOND` }

// msSince returns the whole milliseconds from the timestamp expression t to now.
func msSince(t string) string { return `(TIMESTAMPDIFF(MICROSECOND, ` + t + `, ` + now + `) DIV 1000)` }

// ids is the list of store IDs passed as the text argument arg ("1,2,3"), as a table v(id) to
// join: a primary key lookup per ID.
func ids(arg string) string {
	return `JSON_TABLE(CONCAT('[', ` + arg + `, ']'), '$[*]' COLUMNS (id BIGINT PATH '$')) AS v`
}

// text is a text argument in the collation of the tables' text columns (last_error): a derived
// column of a bare argument would carry the connection's collation, and comparing the two is an
// error ("illegal mix").
const text = `CONVERT(? USING utf8mb4) COLLATE utf8mb4_bin`

// binary is an identifier argument as a binary string, as the identifier columns are (migration
// 004): compared byte for byte, without the padding of a text collation.
const binary = `CAST(? AS BINARY)`

// effectColumns are the columns of an effect (table alias e) as the store scans them.
var effectColumns = `e.id, e.source_consumer, e.source_id, e.seq, e.kind, e.topic, e.uuid, e.payload, e.metadata,
	e.ordering_key, e.attempts, ` + msSince("e.created_at") + `, e.failures, coalesce(` + msSince("e.failed_at") + `, 0),
	e.parked_at IS NOT NULL`

// queries are the statements of the tables named by n.
type queries struct{ n store.Names }

func newQueries(n store.Names) queries { return queries{n: n} }

func (q queries) store() store.Queries {
	n := q.n
	// What cleanup deletes, each built once for the deleting statement and its dry run's count.
	cleanupClaims := `SELECT c.consumer, c.message_id FROM ` + n.Processed + ` c, (SELECT ` + ago("?") + ` AS cutoff) t
				WHERE c.dispatched_at < t.cutoff AND c.processed_at < t.cutoff
				  AND NOT EXISTS (SELECT 1 FROM ` + n.Effects + ` e
					WHERE e.source_consumer = c.consumer AND e.source_id = c.message_id AND e.dispatched_at IS NULL)`
	cleanupEffects := `dispatched_at < ` + ago("?")
	cleanupAttempts := `last_failed_at < ` + ago("?")
	cleanupKeys := `expires_at < ` + ago("?")
	backedOff := `e.dispatched_at IS NULL AND e.parked_at IS NULL AND e.next_attempt_at = e.backoff_until AND e.next_attempt_at > ` + now
	return store.Queries{
		// The claim is a hook (messageClaim); Queries.MessageClaim is not used.
		MessageClaimReportsConcurrent: true,
		MessageIsProcessed:            `SELECT 1 FROM ` + n.Processed + ` WHERE consumer = ? AND message_id = ?`,
		MessagePoison: `INSERT IGNORE INTO ` + n.Processed + ` (consumer, message_id, processed_at, dispatched_at, poisoned)
			VALUES (?, ?, ` + now + `, ` + now + `, TRUE)`,
		MessagePoisonedRead: `SELECT poisoned FROM ` + n.Processed + ` WHERE consumer = ? AND message_id = ? LOCK IN SHARE MODE`,
		MessageReplay:       `DELETE FROM ` + n.Processed + ` WHERE consumer = ? AND message_id = ? AND poisoned`,
		AttemptDelete:       `DELETE FROM ` + n.Attempts + ` WHERE consumer = ? AND message_id = ?`,
		EffectExisting:      `SELECT e.id FROM ` + ids("?") + ` JOIN ` + n.Effects + ` e ON e.id = v.id`,
		EffectListPending: `SELECT ` + effectColumns + ` FROM ` + n.Effects + ` e
			WHERE e.source_consumer = ? AND e.source_id = ? AND e.dispatched_at IS NULL ORDER BY e.seq`,
		// The arguments (id, reason, counted, park, delay) are used out of order: a derived row
		// names them.
		EffectRecordFailure: `UPDATE ` + n.Effects + ` e JOIN (SELECT ? AS id, ? AS reason, ? AS counted, ? AS park, ? AS delay_ms) a ON e.id = a.id
			SET e.failures = e.failures + 1, e.failed_at = ` + now + `, e.last_error = a.reason,
			e.attempts = e.attempts + CASE WHEN a.counted THEN 1 ELSE 0 END,
			e.next_attempt_at = ` + fromNow("a.delay_ms") + `, e.backoff_until = ` + fromNow("a.delay_ms") + `,
			e.parked_at = CASE WHEN a.park THEN coalesce(e.parked_at, ` + now + `) ELSE e.parked_at END
			WHERE e.dispatched_at IS NULL`,
		// FORCE INDEX: a primary key lookup per ID even in a small table, where a scan would lock
		// every row it reads.
		EffectRelease: `UPDATE ` + ids("?") + ` JOIN ` + n.Effects + ` e FORCE INDEX (PRIMARY) ON e.id = v.id
			SET e.next_attempt_at = ` + fromNow("?") + `
			WHERE e.dispatched_at IS NULL AND e.parked_at IS NULL`,
		// As on PostgreSQL: backing off while the retry time of the last failure is still the
		// effect's own and ahead. The look-up is a consistent read, which locks nothing; the update
		// goes by primary key (FORCE INDEX: a scan would lock every row it reads) and checks each
		// row again on its newest version.
		// The kind (an applier's name) compares byte for byte: the column's collation ignores
		// trailing spaces, and "refund" made "refund "'s effects due too.
		EffectBackedOff: `SELECT e.id FROM ` + n.Effects + ` e WHERE CAST(e.kind AS BINARY) = ` + binary + ` AND (CAST(e.kind AS BINARY) <> '' OR e.topic = ` + binary + `)
			AND ` + backedOff + ` LIMIT ?`,
		EffectRetryNow: `UPDATE ` + ids("?") + ` JOIN ` + n.Effects + ` e FORCE INDEX (PRIMARY) ON e.id = v.id
			SET e.next_attempt_at = ` + now + ` WHERE ` + backedOff,
		EffectKeyBlocked: `SELECT EXISTS (SELECT 1 FROM (SELECT ` + binary + ` AS c, ` + binary + ` AS i, ` + binary + ` AS k) a
			JOIN ` + n.Effects + ` b ON b.ordering_key = a.k
			WHERE b.dispatched_at IS NULL AND NOT (b.source_consumer = a.c AND b.source_id = a.i)
			  AND b.id < (SELECT min(s.id) FROM ` + n.Effects + ` s
				WHERE s.source_consumer = a.c AND s.source_id = a.i AND s.ordering_key = a.k AND s.dispatched_at IS NULL))`,
		EffectHandToRelay: `UPDATE ` + n.Effects + ` SET next_attempt_at = coalesce(next_attempt_at, ` + now + `)
			WHERE source_consumer = ? AND source_id = ? AND dispatched_at IS NULL`,
		EffectListParked: `SELECT ` + effectColumns + `, e.last_error, e.parked_at, e.created_at FROM ` + n.Effects + ` e
			WHERE e.parked_at IS NOT NULL AND e.dispatched_at IS NULL ORDER BY e.id LIMIT ?`,
		EffectUnpark: `UPDATE ` + n.Effects + ` SET parked_at = NULL, next_attempt_at = ` + now + `, attempts = 0, failures = 0
			WHERE id = ? AND parked_at IS NOT NULL AND dispatched_at IS NULL`,

		// The lock is a row, taken FOR UPDATE SKIP LOCKED: no row while another process cleans.
		CleanupLock: `SELECT TRUE FROM ` + q.locks() + ` WHERE name = 'cleanup' FOR UPDATE SKIP LOCKED`,
		// A claim's dispatch time is never before its processing time, so the index on
		// dispatched_at finds the candidates; the batch is a derived table (MySQL allows no
		// LIMIT in a DELETE that joins, nor a subquery of the table it deletes from unless it is
		// materialized, which the LIMIT makes it).
		CleanupClaims: `DELETE p FROM ` + n.Processed + ` p JOIN (` + cleanupClaims + ` ORDER BY c.dispatched_at LIMIT ?) d
			ON p.consumer = d.consumer AND p.message_id = d.message_id`,
		CleanupEffects:       `DELETE FROM ` + n.Effects + ` WHERE ` + cleanupEffects + ` ORDER BY dispatched_at LIMIT ?`,
		CleanupAttempts:      `DELETE FROM ` + n.Attempts + ` WHERE ` + cleanupAttempts + ` ORDER BY last_failed_at LIMIT ?`,
		CleanupClaimsCount:   `SELECT count(*) FROM (` + cleanupClaims + `) d`,
		CleanupEffectsCount:  `SELECT count(*) FROM ` + n.Effects + ` WHERE ` + cleanupEffects,
		CleanupAttemptsCount: `SELECT count(*) FROM ` + n.Attempts + ` WHERE ` + cleanupAttempts,

		// Expired keys only: each carries its expiry, written at its claim; the first argument is
		// the cleanup's retention, zero for keys.
		CleanupKeys:      `DELETE FROM ` + n.Idempotency + ` WHERE ` + cleanupKeys + ` ORDER BY expires_at LIMIT ?`,
		CleanupKeysCount: `SELECT count(*) FROM ` + n.Idempotency + ` WHERE ` + cleanupKeys,

		// The claim is a hook (keyClaim), under the key's session lock. The arguments (scope, key,
		// result) are used out of order: a derived row names them.
		KeySave: `UPDATE ` + n.Idempotency + ` k JOIN (SELECT ` + binary + ` AS s, ` + binary + ` AS k, ? AS r) a
			ON k.scope = a.s AND k.` + "`key`" + ` = a.k SET k.result = a.r`,

		// Inserted and moved by hooks (delayedInsert, delayedPromote). The cancel's DELETE locks
		// the rows it deletes; the move skips them, and finds nothing once the cancel commits.
		DelayedCancel:  `DELETE FROM ` + n.Delayed + ` WHERE cancel_key = ?`,
		DelayedNextDue: `SELECT TIMESTAMPDIFF(MICROSECOND, ` + now + `, min(due_at)) DIV 1000 FROM ` + n.Delayed,
		// The argument is the count cap (StatsCountCap), a LIMIT; the overdue count's is the same
		// constant as a literal, as a statement's arguments are used once each.
		DelayedStats: `SELECT (SELECT count(*) FROM (SELECT 1 FROM ` + n.Delayed + ` WHERE due_at > ` + now + ` LIMIT ?) x),
				(SELECT count(*) FROM (SELECT 1 FROM ` + n.Delayed + ` WHERE due_at <= ` + now + ` ORDER BY due_at LIMIT ` + fmt.Sprint(outboxdriver.StatsCountCap) + `) y),
				coalesce((SELECT ` + msSince("min(due_at)") + ` FROM ` + n.Delayed + ` WHERE due_at <= ` + now + `), 0)`,

		SchemaLatest: `SELECT max(version) FROM ` + n.Migrations,

		// Each count reads at most the cap (a literal: LIMIT takes no expression) of rows
		// through an index; a count that reaches it is reported as estimated.
		StatsSample: q.statsSample(),
		StatsLease:  `UPDATE ` + n.Stats + ` SET leased_at = ` + now + ` WHERE id = 1 AND (leased_at < ` + ago("?") + ` OR leased_at > ` + now + ` + INTERVAL 1 MINUTE)`,
		StatsWrite:  `UPDATE ` + n.Stats + ` SET sampled_at = ` + now + `, sample = ? WHERE id = 1`,
		StatsRead:   `SELECT sample, ` + msSince("sampled_at") + ` FROM ` + n.Stats + ` WHERE id = 1 AND sample IS NOT NULL`,

		AuditInsert: `INSERT INTO ` + n.Audit + ` (at, actor, action, target, detail, remote_addr, db_user)
			VALUES (` + now + `, ?, ?, ?, ?, ?, CURRENT_USER())`,
		RecordServiceConfig: `UPDATE ` + n.Stats + ` SET retention_ms = ?, effect_retention_ms = ?,
			redelivery_horizon_ms = ?, config_at = ` + now + ` WHERE id = 1`,
	}
}

// locks is the table of the cleanup lock's row.
func (q queries) locks() string { return strings.TrimSuffix(q.n.Stats, "stats`") + "locks`" }

func (q queries) statsSample() string {
	n := q.n
	limit := fmt.Sprint(outboxdriver.StatsCountCap)
	pending := `SELECT e.created_at FROM ` + n.Effects + ` e WHERE e.dispatched_at IS NULL AND e.parked_at IS NULL ORDER BY e.id LIMIT ` + limit
	parked := `SELECT e.created_at FROM ` + n.Effects + ` e WHERE e.parked_at IS NOT NULL AND e.dispatched_at IS NULL ORDER BY e.id LIMIT ` + limit
	retained := `SELECT 1 FROM ` + n.Processed + ` LIMIT ` + limit
	return `SELECT
			(SELECT count(*) FROM (` + pending + `) x),
			coalesce((SELECT ` + msSince("min(x.created_at)") + ` FROM (` + pending + `) x), 0),
			(SELECT count(*) FROM (` + parked + `) x),
			coalesce((SELECT ` + msSince("min(x.created_at)") + ` FROM (` + parked + `) x), 0),
			(SELECT count(*) FROM (SELECT 1 FROM ` + n.Attempts + ` t WHERE NOT EXISTS (SELECT 1 FROM ` + n.Processed + ` p
				WHERE p.consumer = t.consumer AND p.message_id = t.message_id) LIMIT ` + limit + `) x),
			(SELECT count(*) FROM (` + retained + `) x),
			(SELECT count(*) FROM (` + pending + `) x) >= a.cap OR (SELECT count(*) FROM (` + parked + `) x) >= a.cap
				OR (SELECT count(*) FROM (` + retained + `) x) >= a.cap,
			coalesce((SELECT ` + msSince("c.dispatched_at") + ` - a.ret FROM ` + n.Processed + ` c
				WHERE c.dispatched_at < ` + ago("a.ret") + ` AND c.processed_at < ` + ago("a.ret") + `
				  AND NOT EXISTS (SELECT 1 FROM ` + n.Effects + ` e
					WHERE e.source_consumer = c.consumer AND e.source_id = c.message_id AND e.dispatched_at IS NULL)
				ORDER BY c.dispatched_at LIMIT 1), 0)
		FROM (SELECT ? AS cap, ? AS ret) a`
}

// messageClaim claims src in tx. A plain read first: a claim committed before this transaction
// looked is a duplicate of that age. Then INSERT IGNORE, which waits for a copy's uncommitted
// claim of the same key and inserts nothing if that one commits: a claim committed while this
// one waited is a concurrent copy's. No gap is locked on the way: the read takes no lock, and the
// insert locks only its own key (or the duplicate's record).
func (q queries) messageClaim(ctx context.Context, tx *sql.Tx, src outboxdriver.Source) (outboxdriver.Claim, error) {
	var ageMS int64
	err := tx.QueryRowContext(ctx, `SELECT `+msSince("processed_at")+` FROM `+q.n.Processed+` WHERE consumer = ? AND message_id = ?`,
		src.Consumer, src.ID).Scan(&ageMS)
	switch {
	case err == nil:
		return outboxdriver.Claim{Age: time.Duration(max(ageMS, 0)) * time.Millisecond}, nil
	case !errors.Is(err, sql.ErrNoRows):
		return outboxdriver.Claim{}, err
	}
	r, err := tx.ExecContext(ctx, `INSERT IGNORE INTO `+q.n.Processed+` (consumer, message_id, processed_at, dispatched_at)
		VALUES (?, ?, `+now+`, `+now+`)`, src.Consumer, src.ID)
	if err != nil {
		return outboxdriver.Claim{}, err
	}
	inserted, err := r.RowsAffected()
	if err != nil {
		return outboxdriver.Claim{}, err
	}
	if inserted == 1 {
		return outboxdriver.Claim{Claimed: true}, nil
	}
	return outboxdriver.Claim{Concurrent: true}, nil
}

// effectInsert stores effects of src in tx. MySQL returns no rows from an INSERT: the IDs are
// read back, from the first one the insert generated (LAST_INSERT_ID, the least of its IDs) on,
// among the rows of src, which no other transaction writes while tx holds the claim.
func (q queries) effectInsert(ctx context.Context, tx *sql.Tx, src outboxdriver.Source, effects []outboxdriver.Effect) error {
	return q.insertMoving(ctx, tx, src, effects, false)
}

// effectInsertClaimed is effectInsert for a unit of work that claimed src: the insert writes
// nothing unless the claim exists, in the same statement. A handler's ROLLBACK sent as SQL, or a
// deadlock in its own statements, ends the transaction and leaves the session in autocommit,
// where an insert would commit on its own, an effect without its business change.
func (q queries) effectInsertClaimed(ctx context.Context, tx *sql.Tx, src outboxdriver.Source, effects []outboxdriver.Effect) error {
	return q.insertMoving(ctx, tx, src, effects, true)
}

// insertMoving inserts effects of src (claimed: only while its claim exists) behind the due
// delayed effects of their keys.
func (q queries) insertMoving(ctx context.Context, tx *sql.Tx, src outboxdriver.Source, effects []outboxdriver.Effect, claimed bool) error {
	// A due delayed effect of another source with one of the keys must not be overtaken by these
	// effects. The read-back of the ids asks whether one is there (no round trip of its own);
	// when one is, it is moved, and these rows, which took their ids before it, are inserted
	// again behind it (and look again: one may have become due since, before their new time).
	probe := store.HasOwnKey(effects) // the message's own key: no other source records with it
	for try := 0; ; try++ {
		due, err := q.insertEffects(ctx, tx, src, effects, claimed, probe)
		if err != nil || !due {
			return err
		}
		moved, err := q.moveDueOfKeys(ctx, tx, src, effects)
		if err != nil {
			return fmt.Errorf("move the due delayed effects of the keys: %w", err)
		}
		if _, err := tx.ExecContext(ctx, `DELETE FROM `+q.n.Effects+` WHERE id IN (`+idList(storeIDsOf(effects))+`)`); err != nil {
			return fmt.Errorf("delete the effects to insert them again: %w", err)
		}
		for i := range effects {
			effects[i].StoreID = 0
		}
		// Look again only after a move, once: the transaction's snapshot may still show what a
		// relay moved meanwhile, which the move found gone.
		probe = moved > 0 && try == 0
	}
}

// lockingDueRead is the insert's look at due delayed effects (insertEffects): always on, but
// for the benchmark that weighs it (BenchmarkKeyedEffectInsert).
var lockingDueRead = func() *atomic.Bool { var b atomic.Bool; b.Store(true); return &b }()

// storeIDsOf returns the StoreIDs of effects.
func storeIDsOf(effects []outboxdriver.Effect) []int64 {
	out := make([]int64, len(effects))
	for i, e := range effects {
		out[i] = e.StoreID
	}
	return out
}

// keysOf returns the distinct ordering keys of effects, and the placeholders of a list of them.
func keysOf(effects []outboxdriver.Effect) ([]any, string) {
	var keys []any
	seen := make(map[string]bool, 1)
	for _, e := range effects {
		if !seen[e.OrderingKey] {
			seen[e.OrderingKey] = true
			keys = append(keys, e.OrderingKey)
		}
	}
	return keys, strings.TrimSuffix(strings.Repeat(binary+", ", len(keys)), ", ")
}

// dueOfKeys selects the delayed effects of other sources than the first two arguments' with one
// of the keys listed after them that are due.
func (q queries) dueOfKeys(list string) string {
	return `SELECT id FROM ` + q.n.Delayed + ` WHERE ordering_key IN (` + list + `) AND due_at <= ` + now + `
		AND NOT (source_consumer = ` + binary + ` AND source_id = ` + binary + `)`
}

// insertEffects inserts effects, sets their StoreIDs and, when probe is set, tells whether a due
// delayed effect of another source with one of their keys waits to be moved.
func (q queries) insertEffects(ctx context.Context, tx *sql.Tx, src outboxdriver.Source, effects []outboxdriver.Effect, claimed, probe bool) (bool, error) {
	// With probe, each row's failures column (0 for every effect stored) is 1 when a due delayed
	// effect of the keys waits, read by the INSERT itself: its subqueries are locking reads, which
	// see what committed since the transaction's snapshot. The plain read after it does not under
	// REPEATABLE READ (MySQL's default: the snapshot is then the claim's), and an effect recorded
	// after a delayed one fell due, and committed after the claim, overtook it. A row that says
	// so is deleted and inserted again behind the moved ones (insertMoving): none is stored.
	dueFlag, dueArgs := "0", []any(nil)
	if probe && lockingDueRead.Load() {
		keys, list := keysOf(effects)
		dueFlag = `EXISTS (` + q.dueOfKeys(list) + `)`
		dueArgs = append(append(dueArgs, keys...), src.Consumer, src.ID)
	}
	var b strings.Builder
	b.WriteString(`INSERT INTO ` + q.n.Effects + ` (source_consumer, source_id, seq, kind, topic, uuid, payload, metadata, ordering_key, created_at, failures) `)
	args := make([]any, 0, 9*len(effects)+len(dueArgs)*len(effects)+2)
	bySeq := make(map[int]int, len(effects))
	// Claimed: INSERT ... SELECT, one row from DUAL (no derived table for the common record of
	// one effect), or a union of rows in seq order (the order of their ids).
	switch {
	case !claimed:
		b.WriteString(`VALUES `)
	case len(effects) == 1:
		b.WriteString(`SELECT ?, ?, ?, ?, ?, ?, ?, ?, ?, ` + now + `, ` + dueFlag + ` FROM DUAL`)
	default:
		b.WriteString(`SELECT v.c, v.i, v.s, v.k, v.t, v.u, v.pl, v.md, v.ok, ` + now + `, ` + dueFlag + ` FROM (`)
		args = append(args, dueArgs...) // the flag's, before the union's rows
	}
	for i, e := range effects {
		switch {
		case !claimed && i > 0:
			b.WriteString(", ")
			fallthrough
		case !claimed:
			b.WriteString(`(?, ?, ?, ?, ?, ?, ?, ?, ?, ` + now + `, ` + dueFlag + `)`)
		case len(effects) == 1:
		case i == 0:
			b.WriteString(`SELECT ? AS c, ? AS i, ? AS s, ? AS k, ? AS t, ? AS u, ? AS pl, ? AS md, ? AS ok`)
		default:
			b.WriteString(` UNION ALL SELECT ?, ?, ?, ?, ?, ?, ?, ?, ?`)
		}
		payload := e.Payload
		if payload == nil {
			payload = []byte{}
		}
		args = append(args, src.Consumer, src.ID, e.Seq, string(e.Kind), e.Topic, e.UUID, payload, store.EncodeMetadata(e.Metadata), e.OrderingKey)
		if !claimed || len(effects) == 1 {
			args = append(args, dueArgs...) // the row's own flag, or the one row's
		}
		bySeq[e.Seq] = i
	}
	if claimed {
		if len(effects) > 1 {
			b.WriteString(`) v`)
		}
		b.WriteString(` WHERE EXISTS (SELECT 1 FROM ` + q.n.Processed + ` p WHERE p.consumer = ? AND p.message_id = ?)`)
		if len(effects) > 1 {
			b.WriteString(` ORDER BY v.s`)
		}
		args = append(args, src.Consumer, src.ID)
	}
	r, err := tx.ExecContext(ctx, b.String(), args...)
	if err != nil {
		return false, err
	}
	if claimed {
		if n, err := r.RowsAffected(); err != nil {
			return false, fmt.Errorf("rows of the inserted effects: %w", err)
		} else if n == 0 {
			return false, store.ErrClaimGone
		}
	}
	first, err := r.LastInsertId()
	if err != nil {
		return false, fmt.Errorf("id of the first inserted effect: %w", err)
	}
	// The probe also finds a due one that a relay moved since the insert (its snapshot may be
	// taken after that): an effect of the keys from another source stored after these rows
	// took their ids, and with a time no later than theirs, a moved one's due time.
	dueCol, readArgs := "false", []any{}
	if probe {
		keys, list := keysOf(effects)
		dueCol = `e.failures > 0 OR EXISTS (` + q.dueOfKeys(list) + `) OR EXISTS (SELECT 1 FROM ` + q.n.Effects + ` b
			WHERE b.ordering_key IN (` + list + `) AND b.dispatched_at IS NULL AND b.id > e.id AND b.created_at <= e.created_at
			  AND NOT (b.source_consumer = ` + binary + ` AND b.source_id = ` + binary + `))`
		readArgs = append(append(readArgs, keys...), src.Consumer, src.ID)
		readArgs = append(append(readArgs, keys...), src.Consumer, src.ID)
	}
	readArgs = append(readArgs, src.Consumer, src.ID, first, len(effects))
	rows, err := tx.QueryContext(ctx, `SELECT e.id, e.seq, `+dueCol+` FROM `+q.n.Effects+` e
		WHERE e.source_consumer = ? AND e.source_id = ? AND e.dispatched_at IS NULL AND e.id >= ? ORDER BY e.id LIMIT ?`,
		readArgs...)
	if err != nil {
		return false, fmt.Errorf("read the ids of the inserted effects: %w", err)
	}
	defer rows.Close()
	got, due := 0, false
	for rows.Next() {
		var id int64
		var seq int
		var d bool
		if err := rows.Scan(&id, &seq, &d); err != nil {
			return false, err
		}
		i, ok := bySeq[seq]
		if !ok || effects[i].StoreID != 0 {
			return false, fmt.Errorf("effect %d of seq %d read back after an insert of other seqs", id, seq)
		}
		effects[i].StoreID = id
		due = due || d
		got++
	}
	if err := rows.Err(); err != nil {
		return false, err
	}
	if got != len(effects) {
		return false, fmt.Errorf("insert of %d effects: %d read back", len(effects), got)
	}
	return due, nil
}

// moveDueOfKeys moves, in tx, and counts the due delayed effects of other sources with the keys of effects
// into pending effects, as delayedPromote does. It waits for a transaction that holds one (a
// relay's move, a cancel): skipped, it would be moved later, behind the effects to insert.
func (q queries) moveDueOfKeys(ctx context.Context, tx *sql.Tx, src outboxdriver.Source, effects []outboxdriver.Effect) (int, error) {
	keys, list := keysOf(effects)
	rows, err := tx.QueryContext(ctx, q.dueOfKeys(list)+` ORDER BY due_at, id FOR UPDATE`, append(keys, src.Consumer, src.ID)...)
	if err != nil {
		return 0, err
	}
	var due []int64
	for rows.Next() {
		var id int64
		if err := rows.Scan(&id); err != nil {
			rows.Close()
			return 0, err
		}
		due = append(due, id)
	}
	if err := errors.Join(rows.Err(), rows.Close()); err != nil {
		return 0, err
	}
	if len(due) == 0 {
		return 0, nil // a relay moved them meanwhile: its ids are before the effects' next ones
	}
	return len(due), q.moveDelayed(ctx, tx, idList(due))
}

// attemptRecord counts a failed attempt and reads the count back, in one short transaction.
func (q queries) attemptRecord(ctx context.Context, db *sql.DB, src outboxdriver.Source, reason string) (int, error) {
	tx, err := db.BeginTx(ctx, nil)
	if err != nil {
		return 0, fmt.Errorf("begin: %w", err)
	}
	defer func() { _ = tx.Rollback() }()
	if _, err := tx.ExecContext(ctx, `INSERT INTO `+q.n.Attempts+` (consumer, message_id, attempts, last_error, first_failed_at, last_failed_at)
		VALUES (?, ?, 1, ?, `+now+`, `+now+`)
		ON DUPLICATE KEY UPDATE attempts = attempts + 1, last_error = VALUES(last_error), last_failed_at = VALUES(last_failed_at)`,
		src.Consumer, src.ID, reason); err != nil {
		return 0, err
	}
	var n int
	if err := tx.QueryRowContext(ctx, `SELECT attempts FROM `+q.n.Attempts+` WHERE consumer = ? AND message_id = ?`, src.Consumer, src.ID).Scan(&n); err != nil {
		return 0, err
	}
	return n, tx.Commit()
}

// readCommitted is the isolation of the store's own transactions: locking reads and writes
// lock the rows they find, not the gaps between them.
var readCommitted = &sql.TxOptions{Isolation: sql.LevelReadCommitted}

// effectMarkDispatched marks effects dispatched and moves their claims, in one transaction:
// the effect rows first (in ID order, as ids are sorted), the claim rows after.
func (q queries) effectMarkDispatched(ctx context.Context, db *sql.DB, list []int64, moveClaims bool) error {
	tx, err := db.BeginTx(ctx, readCommitted)
	if err != nil {
		return fmt.Errorf("begin: %w", err)
	}
	defer func() { _ = tx.Rollback() }()
	// The IDs are integers: in the statement's text, they are primary key lookups whatever the
	// table's size (FORCE INDEX: a scan would lock every row it reads).
	in := idList(list)
	if _, err := tx.ExecContext(ctx, `UPDATE `+q.n.Effects+` FORCE INDEX (PRIMARY) SET dispatched_at = `+now+`
		WHERE id IN (`+in+`) AND dispatched_at IS NULL`); err != nil {
		return err
	}
	if moveClaims {
		if _, err := tx.ExecContext(ctx, `UPDATE `+q.n.Processed+` p JOIN (SELECT DISTINCT e.source_consumer, e.source_id
				FROM `+q.n.Effects+` e FORCE INDEX (PRIMARY) WHERE e.id IN (`+in+`)) s ON p.consumer = s.source_consumer AND p.message_id = s.source_id
			SET p.dispatched_at = `+now); err != nil {
			return err
		}
	}
	return tx.Commit()
}

// effectDiscard discards a parked effect and moves its claim's dispatch time, in tx.
func (q queries) effectDiscard(ctx context.Context, tx *sql.Tx, id int64) (int, error) {
	r, err := tx.ExecContext(ctx, `UPDATE `+q.n.Effects+` SET dispatched_at = `+now+`, last_error = CONCAT(coalesce(last_error, ''), ' (discarded)')
		WHERE id = ? AND parked_at IS NOT NULL AND dispatched_at IS NULL`, id)
	if err != nil {
		return 0, err
	}
	n, err := r.RowsAffected()
	if err != nil || n == 0 {
		return 0, err
	}
	if _, err := tx.ExecContext(ctx, `UPDATE `+q.n.Processed+` p JOIN `+q.n.Effects+` e ON p.consumer = e.source_consumer AND p.message_id = e.source_id
		SET p.dispatched_at = `+now+` WHERE e.id = ?`, id); err != nil {
		return 0, err
	}
	return int(n), nil
}

// selfDue is the condition under which effect e is due by itself: undispatched, not parked, past
// the grace period (the argument, ms) or handed over, and past its retry time (or lease).
var selfDue = `e.dispatched_at IS NULL AND e.parked_at IS NULL
	AND (e.created_at < ` + ago("?") + ` OR e.next_attempt_at IS NOT NULL)
	AND (e.next_attempt_at IS NULL OR e.next_attempt_at <= ` + now + `)`

// effectClaimDue leases due effects in one transaction. The candidates are the first p.Limit
// effects due by themselves whose key no earlier effect holds that is not due (parked, backing
// off, leased, in its grace period); they are locked by primary key FOR UPDATE SKIP LOCKED and
// checked again on their newest version (relays claiming at the same time leave each other's
// effects alone); of each key, those after its first undispatched effect that is not locked here
// are let go (held by another relay, or not a candidate: a later effect never overtakes an
// earlier one); the rest is cut to the byte budget in ID order, and the first effect of each key
// is leased, which holds the key's later effects for every other claim until it is marked.
func (q queries) effectClaimDue(ctx context.Context, db *sql.DB, p outboxdriver.EffectClaimParams) ([]outboxdriver.Effect, error) {
	grace := p.Grace.Milliseconds()
	tx, err := db.BeginTx(ctx, readCommitted)
	if err != nil {
		return nil, fmt.Errorf("begin: %w", err)
	}
	defer func() { _ = tx.Rollback() }()
	rows, err := tx.QueryContext(ctx, `SELECT e.id FROM `+q.n.Effects+` e
		WHERE `+selfDue+`
		  AND NOT EXISTS (SELECT 1 FROM `+q.n.Effects+` b
			WHERE b.ordering_key = e.ordering_key AND b.dispatched_at IS NULL AND b.id < e.id
			  AND (b.parked_at IS NOT NULL OR b.next_attempt_at > `+now+`
			       OR (b.next_attempt_at IS NULL AND b.created_at >= `+ago("?")+`)))
		ORDER BY e.id LIMIT ?`, grace, grace, max(p.Limit, 1))
	if err != nil {
		return nil, err
	}
	var cand []int64
	for rows.Next() {
		var id int64
		if err := rows.Scan(&id); err != nil {
			rows.Close()
			return nil, err
		}
		cand = append(cand, id)
	}
	if err := errors.Join(rows.Err(), rows.Close()); err != nil {
		return nil, err
	}
	if len(cand) == 0 {
		return nil, nil
	}
	rows, err = tx.QueryContext(ctx, `SELECT `+effectColumns+`, octet_length(e.payload) + octet_length(e.metadata)
		FROM `+q.n.Effects+` e FORCE INDEX (PRIMARY) WHERE e.id IN (`+idList(cand)+`) AND `+selfDue+`
		ORDER BY e.id FOR UPDATE SKIP LOCKED`, grace)
	if err != nil {
		return nil, err
	}
	var locked []outboxdriver.Effect
	var sizes []int64
	for rows.Next() {
		var e outboxdriver.Effect
		var size int64
		if err := store.ScanEffect(rows, &e, &size); err != nil {
			rows.Close()
			return nil, err
		}
		locked = append(locked, e)
		sizes = append(sizes, size)
	}
	if err := errors.Join(rows.Err(), rows.Close()); err != nil {
		return nil, err
	}
	if len(locked) == 0 {
		return nil, nil
	}
	// The first undispatched effect of each key that is not locked here stops the key.
	keys := map[string]bool{}
	var keyArgs []any
	lockedIDs := make([]int64, len(locked))
	for i, e := range locked {
		lockedIDs[i] = e.StoreID
		if !keys[e.OrderingKey] {
			keys[e.OrderingKey] = true
			keyArgs = append(keyArgs, e.OrderingKey)
		}
	}
	stops := map[string]int64{}
	rows, err = tx.QueryContext(ctx, `SELECT ordering_key, min(id) FROM `+q.n.Effects+`
		WHERE ordering_key IN (?`+strings.Repeat(", ?", len(keyArgs)-1)+`) AND dispatched_at IS NULL AND id NOT IN (`+idList(lockedIDs)+`)
		GROUP BY ordering_key`, keyArgs...)
	if err != nil {
		return nil, err
	}
	for rows.Next() {
		var key string
		var stop int64
		if err := rows.Scan(&key, &stop); err != nil {
			rows.Close()
			return nil, err
		}
		stops[key] = stop
	}
	if err := errors.Join(rows.Err(), rows.Close()); err != nil {
		return nil, err
	}
	maxBytes := int64(p.MaxBytes)
	var claimed []outboxdriver.Effect
	var running int64
	heads := map[string]int64{}
	for i, e := range locked {
		if stop, ok := stops[e.OrderingKey]; ok && e.StoreID > stop {
			continue
		}
		running += sizes[i]
		if len(claimed) > 0 && maxBytes > 0 && running > maxBytes {
			break
		}
		claimed = append(claimed, e)
		if _, ok := heads[e.OrderingKey]; !ok {
			heads[e.OrderingKey] = e.StoreID
		}
	}
	if len(claimed) == 0 {
		return nil, nil
	}
	headIDs := make([]int64, 0, len(heads))
	for _, e := range claimed {
		if heads[e.OrderingKey] == e.StoreID {
			headIDs = append(headIDs, e.StoreID)
		}
	}
	if _, err := tx.ExecContext(ctx, `UPDATE `+q.n.Effects+` FORCE INDEX (PRIMARY) SET next_attempt_at = `+fromNow("?")+` WHERE id IN (`+idList(headIDs)+`)`,
		p.Lease.Milliseconds()); err != nil {
		return nil, err
	}
	if err := tx.Commit(); err != nil {
		return nil, fmt.Errorf("commit: %w", err)
	}
	return claimed, nil
}
