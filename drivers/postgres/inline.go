package postgres

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/watermill-outbox/outbox/outboxdriver"
	"github.com/watermill-outbox/outbox/store"
)

// Inline effects are side effects kept in their claim row (the effects column) until they are
// sent: the pgx driver's optimistic mode writes them, one row per message. Every PostgreSQL
// form, whatever it writes itself, reads them on the duplicate path, moves them to effect rows
// when they have to be retried, marks them, and sweeps those left behind into rows for the
// relay, so that any instance on the tables finishes what any other left.

// sweepBatch bounds the claims one sweep transaction moves to effect rows.
const sweepBatch = 500

// sweepTimeout bounds one sweep: it waits for no lock (claims locked by others are left for the
// next one), but the pool and the database may be slow.
const sweepTimeout = 30 * time.Second

// futureSlack is how far in the future, by the sweeping server's clock, a claim's time may be
// and still count as young: further, it was written by another server's clock (before a
// failover) or before the clock stepped back, and the sweep takes it as old rather than wait.
const futureSlack = time.Second

// inline is a PostgreSQL Store with the handling of inline effects (outboxdriver.InlineStore).
type inline struct {
	*store.SQL
	db               *sql.DB
	q                inlineQueries
	deleteDispatched bool
	onError          func(what string, err error)
	unreachable      func(error) bool                              // StoreOptions.Unreachable; nil: none is
	failpoint        func(ctx context.Context, point string) error // StoreOptions.Failpoint, or nil
	budget           int                                           // InlineBudget (Driver.MaxInlineBytes)

	lastSweep atomic.Int64 // UnixNano of the last turn of the sweep of inline effects left behind

	sweepMu     sync.Mutex
	sweptWrites int64     // claimWrites read before the last sweep that ran
	sweptClean  bool      // that sweep read claimWrites first and left no claim holding inline effects at or above its watermark
	sweptAt     time.Time // when it began

	rq           rotationQueries
	gen          *Generation   // the current partition of the effects table, shared with the inserts
	rotateEvery  time.Duration // Driver.RotateEvery, defaulted
	rotateLock   time.Duration // rotateLockTimeout
	moveBytes    int64         // rotateMoveBytes
	lastRotate   atomic.Int64  // UnixNano of the last look at the rotation
	backlogNoted atomic.Bool   // a rotation was put off for a backlog, and reported
}

var _ outboxdriver.InlineRecorder = (*inline)(nil)

// inlineQueries are the statements on inline effects. A list of effects is one JSON argument
// (json_to_recordset): one statement text whatever the count, and the same arguments through
// lib/pq and pgx. A list of claims is one consumer and its message IDs (claimsOf).
type inlineQueries struct {
	pending     string // (consumer, id) -> effect columns and the inline effects (see PendingQuery)
	lock        string // (consumer, id) -> consumer, id, effects, age in ms: locked
	materialize string // (effects as JSON): effect rows
	archive     string // (effects as JSON): dispatched rows, for EffectRetention
	clear       string // (consumer, IDs): their inline effects moved
	mark        string // (consumer, IDs): their inline effects sent; committed asynchronously
	markLate    string // mark, and the claims' dispatch time moved to now (DispatchMark.MoveClaim)
	sentLate    string // (consumer, IDs): the claims' dispatch time moved to now
	take        string // (consumer, IDs) -> consumer, id, effects, age in ms of the claims it cleared
	leaseSource string // (consumer, id, lease ms): the pending rows of the source are not due before
	sweepBegin  string // -> whether this sweep may run, snapshot xmin, snapshot xmax, watermark
	sweep       string // (watermark, grace ms, slack ms, limit) -> consumer, id, effects, age in ms: locked
	setAside    string // (consumer, IDs): undecodable, no longer swept
	sweepLeft   string // (watermark) -> the smallest inline_xid of the claims still holding effects
	sweptTo     string // (watermark)

	claimMarking string // the claim (consumer, id), and the marks of (consumer, IDs sent, IDs sent late): messageClaimMarking
	// markSkipping and markLateSkipping are mark and markLate skipping the claims another
	// transaction holds locked: (consumer, IDs) -> the IDs of the claims skipped that hold
	// effects to clear (markSkipping).
	markSkipping     string
	markLateSkipping string

	record  string    // (consumer, id, inline effects, length of the inline effects now) -> written in a savepoint; no row: not written
	read    string    // (consumer, id) -> the inline effects, NULL when none; no row: no claim
	spill   [3]string // by partition: (effects as JSON, consumer, id, length of the inline effects now) -> id, seq, written in a savepoint; no row: not written
	unspill string    // (consumer, id, inline effects, length of the inline effects now, row ids) -> id of each row deleted; no row: not written
}

// storedAt is when the inline effects of claim p were written: dispatched_at, which their write
// sets (the pgx form's claim at COMMIT; the database/sql form's record, into a claim made at
// BEGIN, whose processed_at is the transaction's start), or processed_at for a claim without it.
// As with effect rows (created_at), the grace period and a duplicate's wait count from it.
const storedAt = `coalesce(p.dispatched_at, p.processed_at)`

// age is the age in ms of the inline effects of claim p.
const age = `(extract(epoch FROM now() - ` + storedAt + `) * 1000)::bigint`

// effectsRecordset reads the effects of $1 (inlineRow in JSON) in the order they were given.
const effectsRecordset = `ROWS FROM (json_to_recordset($1::json) AS (c text, i text, s int, k text, t text, u text, pl text, md text, ok text, a bigint))
	WITH ORDINALITY AS v(c, i, s, k, t, u, pl, md, ok, a, n)`

// claimsOf is the condition that claim p is one of the claims of consumer $1 whose IDs are in $2
// (a text[] literal: textArray), the whole condition an index condition of the primary key. A
// list of claims of several consumers is one statement per consumer (byConsumer). The IDs are
// read in an init plan, so that the planner's estimate does not depend on their number: its
// custom plans then cost what the generic plan does, which pgx's prepared statements settle on
// after five runs, instead of being planned again at every run (as they were with the array
// itself in the index condition, whenever a batch held fewer claims than the planner's guess of
// ten). It replaces a JSON list of pairs, whose parsing and pair check cost a mark about as much
// again as its HOT updates; counted with callgrind, server instructions per claim in batches of
// 1, 3 and 16 claims: 208,000, 113,000 and 84,000 with the pairs in JSON, 122,000, 61,000 and
// 46,000 now. The generic plan uses the key from about 1,500 claims on (the pairs in JSON: some
// 5,000; TestInlineStatementsFindClaimsByKey).
const claimsOf = `p.consumer = $1 AND p.message_id = ANY (ARRAY(SELECT unnest($2::text[])))`

// markChunk bounds the claims of one statement that marks or clears inline effects.
const markChunk = 200

func newInlineQueries(n store.Names) inlineQueries {
	return inlineQueries{
		claimMarking:     messageClaimMarking(n),
		markSkipping:     markSkipping(n, ""),
		markLateSkipping: markSkipping(n, ", dispatched_at = now()"),
		pending:          PendingQuery(n),
		lock: `SELECT p.consumer, p.message_id, p.effects, ` + age + ` FROM ` + n.Processed + ` p
			WHERE p.consumer = $1 AND p.message_id = $2 AND p.effects IS NOT NULL FOR UPDATE`,
		// Moved effects are due as they would have been as rows: created when their claim was.
		materialize: `INSERT INTO ` + n.Effects + ` (source_consumer, source_id, seq, kind, topic, uuid, payload, metadata, ordering_key, created_at)
			SELECT c, i, s, k, t, u, decode(pl, 'base64'), decode(md, 'base64'), ok, now() - a * interval '1 millisecond'
			FROM ` + effectsRecordset + ` ORDER BY n`,
		archive: `INSERT INTO ` + n.Dispatched + ` (id, source_consumer, source_id, seq, kind, topic, uuid, payload, metadata, ordering_key,
				created_at, dispatched_at, attempts, failures)
			SELECT nextval(pg_get_serial_sequence('` + effectsPartition(n, 0) + `', 'id')), c, i, s, k, t, u, decode(pl, 'base64'), decode(md, 'base64'), ok,
				now() - a * interval '1 millisecond', now(), 0, 0
			FROM ` + effectsRecordset + ` ORDER BY n`,
		clear: `UPDATE ` + n.Processed + ` p SET effects = NULL WHERE ` + claimsOf,
		// effects is in no index, and inline_xid stays: a HOT update. The setting is made once per
		// statement (an init plan), not once per row.
		mark: `UPDATE ` + n.Processed + ` p SET effects = NULL
			WHERE ` + claimsOf + ` AND p.effects IS NOT NULL AND (SELECT ` + asyncCommitSetting + `) IS NOT NULL`,
		markLate: `UPDATE ` + n.Processed + ` p SET effects = NULL, dispatched_at = now()
			WHERE ` + claimsOf + ` AND p.effects IS NOT NULL AND (SELECT ` + asyncCommitSetting + `) IS NOT NULL`,
		sentLate: `UPDATE ` + n.Processed + ` p SET dispatched_at = now() WHERE ` + claimsOf,
		take: `WITH old AS (SELECT p.consumer, p.message_id, p.effects, ` + age + ` AS age FROM ` + n.Processed + ` p
				WHERE ` + claimsOf + ` AND p.effects IS NOT NULL FOR UPDATE OF p),
			clr AS (UPDATE ` + n.Processed + ` p SET effects = NULL FROM old WHERE p.consumer = old.consumer AND p.message_id = old.message_id)
			SELECT consumer, message_id, effects, age FROM old`,
		// The rows may back off (a failure's retry time, not yet come): the lease replaces it, and
		// backoff_until goes with it, so that a recovery never takes the lease for a backoff.
		leaseSource: `UPDATE ` + n.Effects + ` SET next_attempt_at = now() + $3 * interval '1 millisecond', backoff_until = NULL
			WHERE source_consumer = $1 AND source_id = $2 AND dispatched_at IS NULL AND parked_at IS NULL`,
		// The first statement of the sweep's transaction: its snapshot is taken before the one
		// that reads the claims, so that every transaction below its xmin has ended by then (a
		// snapshot's xmin never decreases). One instance sweeps at a time; the others skip. The
		// statements after it are planned for their watermark every time: a generic plan (pgx
		// caches statements) would read the whole table for "inline_xid >= $1". The transaction
		// commits asynchronously: lost in a crash, it is done again (the watermark stays lower,
		// the claims keep their effects). They read the claims through the BRIN index on
		// inline_xid, never the whole table: where the column's statistics hold no value (claims
		// of messages that recorded no effect, claims from before inline_xid, statistics taken
		// before the claims with effects came: a large table is analyzed again only once a tenth
		// of it has changed) the planner has no correlation to cost the index with and chose to
		// read every claim, twice per sweep. JIT is off in it: with sequential scans off every
		// plan costs above jit_above_cost, and the effects the sweep inserts through the
		// partitioned parent take their partition from a function (effects_gen, migration 023)
		// whose query was then compiled at every row, some 11 ms each: a claim of 9,400 effects
		// outlasted the sweep's bound at every try, and the claims behind it with it.
		sweepBegin: `SELECT pg_try_advisory_xact_lock(` + fmt.Sprint(lockClass) + `, ` + lockKey(n, "sweep") + `),
				pg_snapshot_xmin(s)::text::bigint, pg_snapshot_xmax(s)::text::bigint, st.swept_xid
			FROM pg_current_snapshot() s, ` + n.Stats + ` st
			WHERE st.id = 1 AND set_config('plan_cache_mode', 'force_custom_plan', true) IS NOT NULL
			  AND set_config('enable_seqscan', 'off', true) IS NOT NULL AND set_config('jit', 'off', true) IS NOT NULL AND ` + asyncCommit,
		// Grace decides when a claim's effects are taken from it, never whether: a claim whose
		// time is in the future (another server's clock) counts as old. Moved effects count as at
		// least grace old, so that the relay takes them at once.
		sweep: `SELECT p.consumer, p.message_id, p.effects, greatest(` + age + `, $2::bigint) FROM ` + n.Processed + ` p
			WHERE p.inline_xid >= $1::bigint AND p.effects IS NOT NULL
			  AND (` + storedAt + ` < now() - $2::bigint * interval '1 millisecond'
			       OR ` + storedAt + ` > clock_timestamp() + $3::bigint * interval '1 millisecond')
			ORDER BY p.inline_xid LIMIT $4 FOR UPDATE OF p SKIP LOCKED`,
		setAside:  `UPDATE ` + n.Processed + ` p SET inline_xid = NULL WHERE ` + claimsOf,
		sweepLeft: `SELECT min(inline_xid) FROM ` + n.Processed + ` WHERE inline_xid >= $1 AND effects IS NOT NULL`,
		sweptTo:   `UPDATE ` + n.Stats + ` SET swept_xid = $1 WHERE id = 1`,
		// The claim carries its transaction's ID from its insert (MessageClaim), so that writing
		// its effects changes no indexed column: a HOT update. Their time is the write's
		// (storedAt). The updated row's xmin is the subtransaction's when the write is made inside
		// a savepoint.
		record: `UPDATE ` + n.Processed + ` SET effects = $3, dispatched_at = clock_timestamp()
			WHERE consumer = $1 AND message_id = $2 AND coalesce(length(effects), 0) = $4 AND ` + OwnClaim + `
			RETURNING xmin::text <> (txid_current() % 4294967296)::text`,
		read: `SELECT effects FROM ` + n.Processed + ` WHERE consumer = $1 AND message_id = $2 AND ` + OwnClaim,
		// The rows are inserted in the order given (ids ascending: the relay's order within a
		// key), and only if the claim was cleared, in the same statement: a handler that ended
		// the transaction itself runs it alone, and it must not lose or double what the claim held.
		// It names the current partition: it returns xmin (see Generation).
		spill: [3]string{spill(n, 0), spill(n, 1), spill(n, 2)},
		unspill: `WITH upd AS (UPDATE ` + n.Processed + ` SET effects = $3, dispatched_at = clock_timestamp()
				WHERE consumer = $1 AND message_id = $2 AND coalesce(length(effects), 0) = $4 AND ` + OwnClaim + ` RETURNING 1)
			DELETE FROM ` + n.Effects + ` e USING ` + ids("$5") + `
			WHERE e.id = v.id AND EXISTS (SELECT FROM upd) RETURNING e.id`,
	}
}

// spill is inlineQueries.spill into partition gen of the effects table.
func spill(n store.Names, gen int) string {
	return `WITH clr AS (UPDATE ` + n.Processed + ` SET effects = NULL
				WHERE consumer = $2 AND message_id = $3 AND coalesce(length(effects), 0) = $4 AND ` + OwnClaim + ` RETURNING 1)
			INSERT INTO ` + effectsPartition(n, gen) + ` (source_consumer, source_id, seq, kind, topic, uuid, payload, metadata, ordering_key, created_at)
			SELECT c, i, s, k, t, u, decode(pl, 'base64'), decode(md, 'base64'), ok, clock_timestamp()
			FROM ` + effectsRecordset + ` WHERE EXISTS (SELECT FROM clr) ORDER BY n
			RETURNING id, seq, xmin::text <> (txid_current() % 4294967296)::text`
}

// InlineRecord returns the statement (consumer $1, id $2, the encoded effects $3, the length of
// what the write before put there $4) that writes a unit's inline effects into its claim on
// database/sql (EffectRecordInline), returning whether it ran inside a savepoint; no row when the
// claim holds other effects or there is none. For a client that sends the form's statements
// itself (the benchmark's protocol contenders).
func InlineRecord(n store.Names) string { return newInlineQueries(n).record }

// InlineMark returns the statement (consumer $1, a text[] of IDs $2) that clears the inline
// effects of sent claims, every PostgreSQL form's mark, with asynchronous commit.
func InlineMark(n store.Names) string { return newInlineQueries(n).mark }

// PendingQuery returns the statement (consumer, id) that reads the pending effects of a source
// in one round trip: its effect rows, in seq order, and then, in a row of its own, the inline
// effects of its claim. Read its rows with ScanPending. The rows are read in the order of the
// index of pending effects by source, so that the plan reads that index whatever the statistics
// (planned on an empty table, it read every source's pending effects through the index by
// ordering key, and a prepared statement kept that plan: TestDuplicateClaimFindsPendingBySource).
func PendingQuery(n store.Names) string {
	return `SELECT * FROM (
			(SELECT ` + effectColumns + `, NULL::bytea AS inline FROM ` + n.Effects + ` e
			WHERE e.source_consumer = $1 AND e.source_id = $2 AND e.dispatched_at IS NULL
			ORDER BY e.source_consumer, e.source_id, e.seq)
			UNION ALL
			SELECT 0::bigint, p.consumer, p.message_id, 0, '', '', '', ''::bytea, ''::bytea, '', 0, ` + age + `, 0, 0::bigint, false, p.effects
			FROM ` + n.Processed + ` p
			WHERE p.consumer = $1 AND p.message_id = $2 AND p.effects IS NOT NULL) u
		ORDER BY u.id = 0, u.seq`
}

// Rows is what ScanPending reads: *sql.Rows, pgx.Rows.
type Rows interface {
	Next() bool
	Scan(dest ...any) error
	Err() error
}

// ScanPending reads the rows of PendingQuery for src: the effect rows, then the inline effects
// (StoreID 0), which count as old as their claim. The caller closes rows.
func ScanPending(rows Rows, src outboxdriver.Source) ([]outboxdriver.Effect, error) {
	var out []outboxdriver.Effect
	for rows.Next() {
		var e outboxdriver.Effect
		var blob []byte
		if err := store.ScanEffect(rows, &e, &blob); err != nil {
			return nil, err
		}
		if e.StoreID != 0 {
			out = append(out, e)
			continue
		}
		effects, err := store.DecodeEffects(blob, src)
		if err != nil {
			return nil, fmt.Errorf("inline effects of %q for %q: %w", src.ID, src.Consumer, err)
		}
		for i := range effects {
			effects[i].PendingFor, effects[i].StoredAt = e.PendingFor, e.StoredAt
		}
		out = append(out, effects...)
	}
	return out, rows.Err()
}

// EffectListPending returns the effect rows of src and then its inline effects, in one statement.
func (s *inline) EffectListPending(ctx context.Context, src outboxdriver.Source) ([]outboxdriver.Effect, error) {
	rows, err := s.db.QueryContext(ctx, s.q.pending, src.Consumer, src.ID)
	if err != nil {
		return nil, wrapErr(s.SQL, err)
	}
	defer rows.Close()
	effects, err := ScanPending(rows, src)
	return effects, wrapErr(s.SQL, err)
}

// EffectMaterialize implements outboxdriver.InlineStore.
func (s *inline) EffectMaterialize(ctx context.Context, src outboxdriver.Source, lease time.Duration) ([]outboxdriver.Effect, error) {
	err := s.inTx(ctx, func(tx *sql.Tx) error {
		moved, undecodable, err := s.move(ctx, tx, s.q.materialize, func() (*sql.Rows, error) {
			return tx.QueryContext(ctx, s.q.lock, src.Consumer, src.ID)
		})
		if err != nil {
			return err
		}
		if len(undecodable) > 0 {
			return undecodable[0].err
		}
		if moved > 0 && lease > 0 {
			_, err = tx.ExecContext(ctx, s.q.leaseSource, src.Consumer, src.ID, lease.Milliseconds())
		}
		return err
	})
	if err != nil {
		return nil, err
	}
	return s.SQL.EffectListPending(ctx, src)
}

// EffectRecordInline implements outboxdriver.InlineRecorder; the token of a write is the length
// of what it wrote. Through the unit's prepared statements, as its other writes.
func (s *inline) EffectRecordInline(ctx context.Context, tx *sql.Tx, src outboxdriver.Source, effects []outboxdriver.Effect, prev int) (int, bool, bool, error) {
	blob := store.EncodeEffects(effects)
	var nested bool
	switch err := s.SQL.QueryRowPrepared(ctx, tx, s.q.record, []any{src.Consumer, src.ID, blob, prev}, &nested); {
	case errors.Is(err, sql.ErrNoRows):
		return 0, false, false, nil
	case err != nil:
		return 0, false, false, fmt.Errorf("store side effects in the claim: %w", wrapErr(s.SQL, err))
	}
	return len(blob), true, nested, nil
}

// InlineBudget implements outboxdriver.InlineRecorder.
func (s *inline) InlineBudget() int { return s.budget }

// EffectSpillInline implements outboxdriver.InlineRecorder.
func (s *inline) EffectSpillInline(ctx context.Context, tx *sql.Tx, src outboxdriver.Source, effects []outboxdriver.Effect, prev int) (bool, bool, error) {
	in := make([]inlineRow, len(effects))
	bySeq := make(map[int]int, len(effects))
	for i, e := range effects {
		in[i] = inlineRowOf(src, e, 0)
		bySeq[e.Seq] = i
	}
	arg, err := jsonArg(in)
	if err != nil {
		return false, false, err
	}
	rows, err := s.SQL.QueryPrepared(ctx, tx, s.q.spill[s.gen.Load()], arg, src.Consumer, src.ID, prev)
	if err != nil {
		return false, false, fmt.Errorf("move side effects from the claim to rows: %w", wrapErr(s.SQL, err))
	}
	defer rows.Close()
	n, nested := 0, false
	for rows.Next() {
		var id int64
		var seq int
		var sub bool
		if err := rows.Scan(&id, &seq, &sub); err != nil {
			return false, false, err
		}
		i, ok := bySeq[seq]
		if !ok {
			return false, false, fmt.Errorf("move side effects from the claim to rows: seq %d returned, which was not given", seq)
		}
		effects[i].StoreID = id
		nested = nested || sub
		n++
	}
	if err := rows.Err(); err != nil {
		return false, false, fmt.Errorf("move side effects from the claim to rows: %w", wrapErr(s.SQL, err))
	}
	if n == 0 {
		return false, false, nil
	}
	if n != len(effects) {
		return false, false, fmt.Errorf("move side effects from the claim to rows: %d of %d inserted", n, len(effects))
	}
	return true, nested, nil
}

// EffectUnspillInline implements outboxdriver.InlineRecorder.
func (s *inline) EffectUnspillInline(ctx context.Context, tx *sql.Tx, src outboxdriver.Source, effects []outboxdriver.Effect, prev int, rows []int64) (bool, error) {
	res, err := tx.ExecContext(ctx, s.q.unspill, src.Consumer, src.ID, store.EncodeEffects(effects), prev, store.IDList(rows))
	if err != nil {
		return false, fmt.Errorf("move side effects from rows back to the claim: %w", wrapErr(s.SQL, err))
	}
	n, err := res.RowsAffected()
	if err != nil {
		return false, fmt.Errorf("move side effects from rows back to the claim: %w", err)
	}
	if n != int64(len(rows)) {
		if n == 0 {
			return false, nil
		}
		return false, fmt.Errorf("move side effects from rows back to the claim: %d of %d rows deleted", n, len(rows))
	}
	return true, nil
}

// EffectReadInline implements outboxdriver.InlineRecorder.
func (s *inline) EffectReadInline(ctx context.Context, tx *sql.Tx, src outboxdriver.Source) ([]outboxdriver.Effect, int, bool, error) {
	var blob []byte
	switch err := s.SQL.QueryRowPrepared(ctx, tx, s.q.read, []any{src.Consumer, src.ID}, &blob); {
	case errors.Is(err, sql.ErrNoRows):
		return nil, 0, false, nil
	case err != nil:
		return nil, 0, false, fmt.Errorf("read the side effects in the claim: %w", wrapErr(s.SQL, err))
	}
	if blob == nil {
		return nil, 0, true, nil
	}
	effects, err := store.DecodeEffects(blob, src)
	if err != nil {
		return nil, 0, true, fmt.Errorf("inline effects of %q for %q: %w", src.ID, src.Consumer, err)
	}
	return effects, len(blob), true, nil
}

// EffectMarkDispatched clears the inline effects of the marks with Inline (one HOT update per
// claim, one statement per consumer) and marks the effect rows of the others. Claims whose
// effects went out late (MoveClaim) get the time of the mark as their dispatch time, in the same
// update (the claim of a mark with rows as well as inline effects is written once).
func (s *inline) EffectMarkDispatched(ctx context.Context, marks ...outboxdriver.DispatchMark) error {
	var rows []outboxdriver.DispatchMark
	var claims [2][]claimKey // sent in time, sent late
	for _, m := range marks {
		if m.Inline {
			late := 0
			if m.MoveClaim {
				late = 1
			}
			claims[late] = append(claims[late], claimKey{m.Source.Consumer, m.Source.ID})
		}
		if len(m.StoreIDs) > 0 {
			if m.Inline {
				// The claim's own update below moves its dispatch time: the rows' mark moving it
				// as well wrote the claim twice. Should the claim hold no effects any more (the
				// sweep took them), its time stays, and the relay's mark of those moves it later.
				m.MoveClaim = false
			}
			rows = append(rows, m)
		}
	}
	// A statement that fails leaves the others to be written, but one that says the database
	// cannot be reached ends the call (see gone): each would be an attempt to connect.
	var errs []error
	if len(rows) > 0 {
		err := s.SQL.EffectMarkDispatched(ctx, rows...)
		if s.gone(err) {
			return err
		}
		errs = append(errs, err)
	}
	for late, claims := range claims {
		for chunk := range slices.Chunk(claims, markChunk) {
			if err := s.markInline(ctx, chunk, late == 1); err != nil {
				if s.gone(err) {
					return errors.Join(append(errs, err)...)
				}
				errs = append(errs, err)
			}
		}
	}
	return errors.Join(errs...)
}

// ClaimMarks implements outboxdriver.ClaimMarker: the claim clears sent effects, and cannot move
// them to the dispatched table.
func (s *inline) ClaimMarks() bool { return s.deleteDispatched }

// MessageClaimMarking implements outboxdriver.ClaimMarker.
func (s *inline) MessageClaimMarking(ctx context.Context, tx *sql.Tx, src outboxdriver.Source, sent, sentLate []string) (outboxdriver.Claim, error) {
	if !s.deleteDispatched {
		return outboxdriver.Claim{}, errors.New("postgres: a claim cannot mark effects that the store keeps (EffectRetention)")
	}
	var marked string
	c, err := s.SQL.MessageClaimInto(ctx, tx, src, s.q.claimMarking, []any{textArray(sent), textArray(sentLate)}, &marked)
	if err != nil {
		return c, err
	}
	if err := json.Unmarshal([]byte(marked), &c.Marked); err != nil {
		return outboxdriver.Claim{}, fmt.Errorf("postgres: read the marks a claim wrote: %w", err)
	}
	return c, nil
}

var _ outboxdriver.ClaimMarker = (*inline)(nil)

// markSkipping is the mark of the claims of consumer $1 whose IDs are in $2 (claimsOf), with set
// added to what it sets, that skips a claim another transaction holds locked (as the marks riding
// on a claim do: messageClaimMarking) and returns the IDs of the claims it skipped that hold
// effects to clear: a claim without them (none, or cleared already) is nothing to write again.
// Committed asynchronously, as mark is. Both the update and the last read name the claims by
// claimsOf, for their plans to find them by their key.
func markSkipping(n store.Names, set string) string {
	return `WITH lk AS (SELECT p.message_id FROM ` + n.Processed + ` p WHERE ` + claimsOf + ` FOR UPDATE SKIP LOCKED),
			mk AS (UPDATE ` + n.Processed + ` p SET effects = NULL` + set + `
				WHERE ` + claimsOf + ` AND p.message_id IN (SELECT message_id FROM lk) AND p.effects IS NOT NULL
				AND (SELECT ` + asyncCommitSetting + `) IS NOT NULL)
			SELECT p.message_id FROM ` + n.Processed + ` p
			WHERE ` + claimsOf + ` AND p.effects IS NOT NULL AND p.message_id NOT IN (SELECT message_id FROM lk)`
}

// EffectMarkSkippingLocked implements outboxdriver.LockSkippingMarker.
func (s *inline) EffectMarkSkippingLocked(ctx context.Context, marks ...outboxdriver.DispatchMark) ([]outboxdriver.DispatchMark, error) {
	if !s.deleteDispatched {
		return nil, errors.New("postgres: a mark that skips locked claims cannot keep sent effects (EffectRetention)")
	}
	var claims [2][]claimKey // sent in time, sent late
	for _, m := range marks {
		if !m.Inline || len(m.StoreIDs) > 0 {
			return nil, fmt.Errorf("postgres: a mark that skips locked claims is of inline effects only, and the mark of %q for %q has effect rows", m.Source.ID, m.Source.Consumer)
		}
		late := 0
		if m.MoveClaim {
			late = 1
		}
		claims[late] = append(claims[late], claimKey{m.Source.Consumer, m.Source.ID})
	}
	skipped := map[claimKey]bool{}
	for late, claims := range claims {
		q := s.q.markSkipping
		if late == 1 {
			q = s.q.markLateSkipping
		}
		for chunk := range slices.Chunk(claims, markChunk) {
			for _, g := range byConsumer(chunk) {
				if err := s.markSkippingOf(ctx, q, g, skipped); err != nil {
					return nil, err
				}
			}
		}
	}
	var out []outboxdriver.DispatchMark
	for _, m := range marks {
		if skipped[claimKey{m.Source.Consumer, m.Source.ID}] {
			out = append(out, m)
		}
	}
	return out, nil
}

// markSkippingOf runs q (markSkipping) on the claims of g, and adds those it skipped to skipped.
func (s *inline) markSkippingOf(ctx context.Context, q string, g consumerClaims, skipped map[claimKey]bool) error {
	rows, err := s.SQL.QueryPrepared(ctx, nil, q, g.consumer, g.ids)
	if err != nil {
		return fmt.Errorf("clear inline effects: %w", wrapErr(s.SQL, err))
	}
	defer rows.Close()
	for rows.Next() {
		var id string
		if err := rows.Scan(&id); err != nil {
			return fmt.Errorf("clear inline effects: %w", err)
		}
		skipped[claimKey{g.consumer, id}] = true
	}
	if err := rows.Err(); err != nil {
		return fmt.Errorf("clear inline effects: %w", wrapErr(s.SQL, err))
	}
	return nil
}

var _ outboxdriver.LockSkippingMarker = (*inline)(nil)

// markInline marks the inline effects of claims sent: cleared, or moved to the dispatched table;
// late: their dispatch time moves to now.
func (s *inline) markInline(ctx context.Context, claims []claimKey, late bool) error {
	if s.deleteDispatched {
		mark := s.q.mark
		if late {
			mark = s.q.markLate
		}
		// Prepared per connection, as the framework's other frequent statements: sent unprepared,
		// each mark was parsed and planned again (lib/pq), which cost more than its updates in
		// the small batches of a service at low concurrency.
		for _, g := range byConsumer(claims) {
			if _, err := s.SQL.ExecPrepared(ctx, nil, mark, g.consumer, g.ids); err != nil {
				return fmt.Errorf("clear inline effects: %w", err)
			}
		}
		return nil
	}
	// Kept for EffectRetention: they move to the dispatched table as rows would. They were sent,
	// so undecodable ones are cleared all the same (nothing could be kept of them anyway).
	if err := s.inTx(ctx, func(tx *sql.Tx) error {
		for _, g := range byConsumer(claims) {
			if _, _, err := s.move(ctx, tx, s.q.archive, func() (*sql.Rows, error) { return tx.QueryContext(ctx, s.q.take, g.consumer, g.ids) }); err != nil {
				return err
			}
			if late {
				if _, err := tx.ExecContext(ctx, s.q.sentLate, g.consumer, g.ids); err != nil {
					return fmt.Errorf("move the dispatch time of claims: %w", wrapErr(s.SQL, err))
				}
			}
		}
		return nil
	}); err != nil {
		return fmt.Errorf("archive inline effects: %w", err)
	}
	return nil
}

// EffectClaimDue claims due effects. A claim from the front (After 0) also moves the inline
// effects left behind (a crash between commit and mark, a dispatch that failed before they could
// be moved) into effect rows, at most every quarter of the grace period, and rotates the
// partitions of the effects table when due, at most every RotateEvery/2 (rotateWith). What both
// need, the rotation's row and whether the claims table was written since the last sweep, is
// read by the claim itself (claimLooking), so that the pass of an idle relay, whose sweep is then
// skipped, is one statement; the sweep and the rotation come after the claim (unless the sweep
// runs whatever the look reads: then they come first, as the look does). What the sweep
// moved is claimed at once when the claim took nothing and looked at every window (the relay
// would look no further before its next pass, up to IdleMax away for a member backed off);
// otherwise the relay claims again anyway, from the front once it has been through the windows.
// A failed sweep or rotation must not stop the relay from sending the effect rows: it is
// reported, and the next turn tries again (the sweep from where the last one got to; without
// rotations the partitions grow as the single table did). A database that cannot be reached
// (StoreOptions.Unreachable) ends the call at the first statement that meets it, with its error.
func (s *inline) EffectClaimDue(ctx context.Context, p outboxdriver.EffectClaimParams) (outboxdriver.EffectClaim, error) {
	if p.After != 0 {
		return s.SQL.EffectClaimDue(ctx, p)
	}
	sweepDue := turn(&s.lastSweep, max(p.Grace/4, 100*time.Millisecond))
	rotateDue := s.rotateEvery >= 0 && turn(&s.lastRotate, s.rotateEvery/2)
	if !sweepDue && !rotateDue {
		return s.SQL.EffectClaimDue(ctx, p)
	}
	const sweeping, rotating = "moving inline effects left behind to the relay", "rotating the partitions of the effects table"
	report := func(what string, err error) {
		if err != nil && ctx.Err() == nil && s.onError != nil {
			s.onError(what, err)
		}
	}
	lookFailed := func(err error) {
		if rotateDue {
			report(rotating, err)
		} else {
			report(sweeping, err)
		}
	}
	if sweepDue && !s.sweepMaySkip(p.Grace) {
		// The sweep runs whatever the claims table's count says (a Store's first pass, a grace
		// too short to trust the count): the pass is no idle one, and the look, the sweep and the
		// rotation go first, so that this claim takes what they move (and a restarted instance's
		// first claim comes after the rotation that was due while it was down).
		p0, err := s.probe(ctx)
		if s.gone(err) {
			return outboxdriver.EffectClaim{}, err
		}
		if err != nil {
			lookFailed(err)
			_, err := s.sweep(ctx, p.Grace, nil)
			if s.gone(err) {
				return outboxdriver.EffectClaim{}, err
			}
			report(sweeping, err)
			return s.SQL.EffectClaimDue(ctx, p)
		}
		_, err = s.sweep(ctx, p.Grace, &p0.writes)
		if s.gone(err) {
			return outboxdriver.EffectClaim{}, err
		}
		report(sweeping, err)
		report(rotating, s.rotateWith(ctx, p0))
		return s.SQL.EffectClaimDue(ctx, p)
	}
	claim, look, lookErr, err := s.claimLooking(ctx, p)
	if s.gone(err) {
		return outboxdriver.EffectClaim{}, err
	}
	if err != nil {
		// The look may be what failed (the rotation's row unreadable): the claim alone is tried
		// again, after a sweep that cannot know whether it may be skipped, as before the look
		// joined the claim. The look's failure is reported when the claim alone goes through.
		if sweepDue {
			_, serr := s.sweep(ctx, p.Grace, nil)
			if s.gone(serr) {
				return outboxdriver.EffectClaim{}, serr
			}
			report(sweeping, serr)
		}
		claim, cerr := s.SQL.EffectClaimDue(ctx, p)
		if cerr == nil {
			lookFailed(err)
		}
		return claim, cerr
	}
	moved := 0
	if lookErr != nil {
		lookFailed(lookErr)
		if sweepDue {
			var serr error
			moved, serr = s.sweep(ctx, p.Grace, nil)
			report(sweeping, serr)
		}
	} else {
		if sweepDue {
			var serr error
			moved, serr = s.sweep(ctx, p.Grace, &look.writes)
			report(sweeping, serr)
		}
		// Also when only the sweep was due: the rotation's row was read all the same.
		report(rotating, s.rotateWith(ctx, look))
	}
	if moved > 0 && len(claim.Effects) == 0 && claim.Next == 0 {
		return s.SQL.EffectClaimDue(ctx, p)
	}
	return claim, nil
}

// gone tells whether err says that the database cannot be reached (StoreOptions.Unreachable):
// the statements after the one that failed would each try to connect again, and the caller
// reports the outage.
func (s *inline) gone(err error) bool {
	return err != nil && s.unreachable != nil && s.unreachable(err)
}

// sweepMaySkip tells whether a sweep with grace may be skipped, if the claims table's count of
// writes is what the last sweep read (see sweep).
func (s *inline) sweepMaySkip(grace time.Duration) bool {
	s.sweepMu.Lock()
	defer s.sweepMu.Unlock()
	return grace >= statsLag && s.sweptClean && time.Since(s.sweptAt) < idleSweepMax
}

// idleSweepMax bounds how long the sweep trusts the server's statistics (claimWrites) that the
// claims table was not written: a statistics message of PostgreSQL 13 and 14 may be lost, and
// track_counts may be off.
const idleSweepMax = 5 * time.Minute

// statsLag is how long after a commit the server's statistics may not count its writes yet: a
// session flushes its counts when it goes idle, at most once a second, else 10 s later
// (PGSTAT_IDLE_INTERVAL), and at its exit. A claim younger than that is not taken by a sweep
// whose grace is at least that long anyway.
const statsLag = 10 * time.Second

// sweep moves the inline effects of claims older than grace into effect rows, in batches, each
// in a transaction of its own, and returns how many claims it took (committed or not: a batch
// that failed may have taken some).
//
// Where it got to is a transaction ID, the watermark: every claim with inline effects records
// the ID of the transaction that wrote it (inline_xid), and every claim below the watermark that
// held effects was moved, sent or set aside. A sweep reads the claims at or above the watermark
// that still hold effects, moves those older than grace, and sets the watermark to the oldest
// transaction still running when it began (pg_snapshot_xmin: every claim below it that will ever
// commit has committed, and was visible to the sweep), or lower, to the smallest inline_xid of
// the claims that still hold effects (too young, locked by another transaction, beyond the
// batch). No clock decides whether a claim is seen: a claim whose commit waited on a lock for
// minutes, or whose time was written by another server's clock, is found all the same.
//
// writes, when known, is claimWrites read just before: when the last sweep read as many, before
// it found no claim holding inline effects at or above its watermark, no claim older than
// statsLag was written since (a writer's counts reach the statistics after its commit, so a
// claim that the last sweep did not see counts after that sweep's read, within statsLag), and
// with a grace of statsLag or more this sweep is skipped: it would take nothing. An idle
// database's sweep was four statements and a transaction on every relay pass. The statistics
// are trusted for idleSweepMax at most; with a shorter grace every sweep runs.
func (s *inline) sweep(ctx context.Context, grace time.Duration, writes *int64) (int, error) {
	s.sweepMu.Lock()
	defer s.sweepMu.Unlock()
	if writes != nil && grace >= statsLag && s.sweptClean && s.sweptWrites == *writes && time.Since(s.sweptAt) < idleSweepMax {
		return 0, nil
	}
	s.sweptClean, s.sweptAt = false, time.Now()
	ctx, cancel := context.WithTimeout(ctx, sweepTimeout)
	defer cancel()
	taken := 0
	for {
		n, clean, err := s.sweepBatch(ctx, grace)
		taken += n
		if err != nil {
			if ctx.Err() != nil {
				return taken, fmt.Errorf("sweep of the claims with inline effects left behind (at most %s): %w", sweepTimeout, err)
			}
			return taken, err
		}
		if n < sweepBatch {
			if writes != nil {
				s.sweptWrites, s.sweptClean = *writes, clean
			}
			return taken, nil
		}
	}
}

// sweepBatch runs one transaction of the sweep and returns how many claims it took, and whether
// it left no claim holding inline effects at or above the watermark it began from (clean).
func (s *inline) sweepBatch(ctx context.Context, grace time.Duration) (int, bool, error) {
	var taken int
	var clean bool
	var undecodable []undecodableClaim
	err := s.inTx(ctx, func(tx *sql.Tx) error {
		var may bool
		var xmin, xmax int64
		var watermark sql.NullInt64
		if err := tx.QueryRowContext(ctx, s.q.sweepBegin).Scan(&may, &xmin, &xmax, &watermark); err != nil {
			return wrapErr(s.SQL, err)
		}
		if !may {
			return nil // another instance sweeps
		}
		from := watermark.Int64
		if from > xmax {
			// Written by another cluster (the database was restored from a dump): its IDs
			// mean nothing here; start over.
			from = 0
		}
		var err error
		taken, undecodable, err = s.move(ctx, tx, s.q.materialize, func() (*sql.Rows, error) {
			return tx.QueryContext(ctx, s.q.sweep, from, grace.Milliseconds(), futureSlack.Milliseconds(), sweepBatch)
		})
		if err != nil {
			return err
		}
		taken += len(undecodable)
		if err := s.fail(ctx, "after-sweep-move"); err != nil { // outbox.FailpointAfterSweepMove
			return err
		}
		if len(undecodable) > 0 {
			// Set aside, so that they neither hold the watermark back nor fill every batch.
			keys := make([]claimKey, len(undecodable))
			for i, u := range undecodable {
				keys[i] = u.key
			}
			for _, g := range byConsumer(keys) {
				if _, err := tx.ExecContext(ctx, s.q.setAside, g.consumer, g.ids); err != nil {
					return fmt.Errorf("set aside undecodable inline effects: %w", wrapErr(s.SQL, err))
				}
			}
		}
		var left sql.NullInt64
		if err := tx.QueryRowContext(ctx, s.q.sweepLeft, from).Scan(&left); err != nil {
			return wrapErr(s.SQL, err)
		}
		clean = !left.Valid
		to := xmin
		if left.Valid && left.Int64 < to {
			to = left.Int64
		}
		if err := s.fail(ctx, "before-sweep-watermark"); err != nil { // outbox.FailpointBeforeSweepWatermark
			return err
		}
		_, err = tx.ExecContext(ctx, s.q.sweptTo, to)
		return wrapErr(s.SQL, err)
	})
	if err == nil && len(undecodable) > 0 && s.onError != nil {
		s.onError("moving inline effects left behind to the relay", setAsideError(undecodable))
	}
	return taken, clean && err == nil, err
}

// fail calls Config.Failpoint at a step of the sweep; the names are outbox.Failpoint*, which this
// package cannot import.
func (s *inline) fail(ctx context.Context, point string) error {
	if s.failpoint == nil {
		return nil
	}
	return s.failpoint(ctx, point)
}

// setAsideError reports claims whose inline effects could not be decoded and were set aside.
func setAsideError(claims []undecodableClaim) error {
	errs := make([]error, len(claims))
	for i, c := range claims {
		errs[i] = c.err
	}
	return fmt.Errorf("%d claim(s) with inline effects that cannot be decoded set aside: kept as they are, no longer swept "+
		"(find them with: SELECT consumer, message_id FROM <processed table> WHERE effects IS NOT NULL AND inline_xid IS NULL): %w",
		len(claims), errors.Join(errs...))
}

// claimKey is a claim.
type claimKey struct {
	Consumer string
	ID       string
}

// consumerClaims are the claims of one consumer in a list: their IDs as a text[] literal, the
// second argument of the statements on a list of claims (claimsOf).
type consumerClaims struct {
	consumer string
	ids      string
}

// byConsumer groups claims by consumer, the consumers in ascending order: the order of their
// rows in the primary key, so that the statements of one transaction lock the claims in the
// order one statement on all of them would.
func byConsumer(claims []claimKey) []consumerClaims {
	ids := map[string][]string{}
	var consumers []string
	for _, c := range claims {
		if _, ok := ids[c.Consumer]; !ok {
			consumers = append(consumers, c.Consumer)
		}
		ids[c.Consumer] = append(ids[c.Consumer], c.ID)
	}
	slices.Sort(consumers)
	out := make([]consumerClaims, len(consumers))
	for i, c := range consumers {
		out[i] = consumerClaims{consumer: c, ids: textArray(ids[c])}
	}
	return out
}

// textArray is a PostgreSQL text[] literal of values, each quoted (so that NULL, braces, commas
// and spaces are text) with its backslashes and double quotes escaped. Passed as a text argument
// and cast in the statement, it reads the same through lib/pq and pgx.
func textArray(values []string) string {
	var b strings.Builder
	b.Grow(2 + len(values)*40)
	b.WriteByte('{')
	for i, v := range values {
		if i > 0 {
			b.WriteByte(',')
		}
		b.WriteByte('"')
		for j := 0; j < len(v); j++ {
			if v[j] == '"' || v[j] == '\\' {
				b.WriteByte('\\')
			}
			b.WriteByte(v[j])
		}
		b.WriteByte('"')
	}
	b.WriteByte('}')
	return b.String()
}

// inlineRow is an effect in a JSON argument; the bytes go as base64 (how encoding/json writes
// them, and how decode(..., 'base64') reads them).
type inlineRow struct {
	Consumer    string `json:"c"`
	ID          string `json:"i"`
	Seq         int    `json:"s"`
	Kind        string `json:"k"`
	Topic       string `json:"t"`
	UUID        string `json:"u"`
	Payload     []byte `json:"pl"`
	Metadata    []byte `json:"md"`
	OrderingKey string `json:"ok"`
	AgeMS       int64  `json:"a"`
}

// inlineRowOf is effect e of src, ms old, in a JSON argument.
func inlineRowOf(src outboxdriver.Source, e outboxdriver.Effect, ms int64) inlineRow {
	r := inlineRow{Consumer: src.Consumer, ID: src.ID, Seq: e.Seq, Kind: e.Kind, Topic: e.Topic, UUID: e.UUID,
		Payload: e.Payload, Metadata: store.EncodeMetadata(e.Metadata), OrderingKey: e.OrderingKey, AgeMS: ms}
	if r.Payload == nil {
		r.Payload = []byte{} // "" in JSON, not null: the column is NOT NULL
	}
	if r.Metadata == nil {
		r.Metadata = []byte{}
	}
	return r
}

// undecodableClaim is a claim whose inline effects could not be decoded.
type undecodableClaim struct {
	key claimKey
	err error
}

func jsonArg(v any) (string, error) {
	b, err := json.Marshal(v)
	if err != nil {
		return "", fmt.Errorf("encode the argument: %w", err)
	}
	return string(b), nil
}

// move reads the claims that lock returns (consumer, id, inline effects, age in ms; locked, or
// cleared by the statement itself), inserts their effects with insert (effect rows:
// materialize; dispatched rows: archive), and clears them from the claims. It returns how many
// claims it moved, and those whose effects could not be decoded, which it leaves as they are.
func (s *inline) move(ctx context.Context, tx *sql.Tx, insert string, lock func() (*sql.Rows, error)) (int, []undecodableClaim, error) {
	rows, err := lock()
	if err != nil {
		return 0, nil, wrapErr(s.SQL, err)
	}
	var effects []inlineRow
	var moved []claimKey
	var undecodable []undecodableClaim
	for rows.Next() {
		var src outboxdriver.Source
		var blob []byte
		var ms int64
		if err := rows.Scan(&src.Consumer, &src.ID, &blob, &ms); err != nil {
			rows.Close()
			return 0, nil, err
		}
		key := claimKey{src.Consumer, src.ID}
		decoded, err := store.DecodeEffects(blob, src)
		if err != nil {
			undecodable = append(undecodable, undecodableClaim{key, fmt.Errorf("inline effects of %q for %q: %w", src.ID, src.Consumer, err)})
			continue
		}
		moved = append(moved, key)
		for _, e := range decoded {
			effects = append(effects, inlineRowOf(src, e, ms))
		}
	}
	rows.Close()
	if err := rows.Err(); err != nil {
		return 0, nil, wrapErr(s.SQL, err)
	}
	if len(moved) == 0 {
		return 0, undecodable, nil
	}
	if len(effects) > 0 {
		arg, err := jsonArg(effects)
		if err != nil {
			return 0, nil, err
		}
		if _, err := tx.ExecContext(ctx, insert, arg); err != nil {
			return 0, nil, fmt.Errorf("move inline effects to rows: %w", wrapErr(s.SQL, err))
		}
	}
	for _, g := range byConsumer(moved) {
		if _, err := tx.ExecContext(ctx, s.q.clear, g.consumer, g.ids); err != nil {
			return 0, nil, fmt.Errorf("clear moved inline effects: %w", wrapErr(s.SQL, err))
		}
	}
	return len(moved), undecodable, nil
}

// inTx runs fn in a transaction, committed if fn returns nil.
func (s *inline) inTx(ctx context.Context, fn func(tx *sql.Tx) error) error {
	tx, err := s.SQL.BeginTx(ctx, nil)
	if err != nil {
		return fmt.Errorf("begin: %w", err)
	}
	if err := fn(tx); err != nil {
		_ = tx.Rollback()
		return err
	}
	if err := tx.Commit(); err != nil {
		return fmt.Errorf("commit: %w", err)
	}
	return nil
}

// wrapErr adds the fix to errors caused by missing tables.
func wrapErr(st *store.SQL, err error) error {
	if err != nil && IsUndefinedTable(err) {
		n := st.Names()
		return fmt.Errorf("%w (schema %q, prefix %q): %w", outboxdriver.ErrSchemaMissing, n.Schema, n.Prefix, err)
	}
	return err
}
