package postgres

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"sync/atomic"
	"time"

	"github.com/watermill-outbox/outbox/outboxdriver"
	"github.com/watermill-outbox/outbox/store"
)

// The effects table is partitioned by generation (migration 023), one partition current: new
// effects go to it. The relay rotates: it empties the oldest partition (the one after the
// current, modulo 3), moving what is still pending there into the current one, and makes it the
// current one. TRUNCATE frees the rows and index entries of the sent effects whatever holds the
// xmin horizon back, where DELETE and VACUUM could not: behind a held horizon the claims walk the
// dead entries of the three partitions (some 3*RotateEvery of traffic), not every one since the
// hold began.

// rotateMoveLimit bounds the pending rows an emptying moves (parked, backing off, a backlog):
// more, and it puts the rotation off, since the move would hold the partition's exclusive lock,
// and with it every statement on the effects table, while it copies them.
const rotateMoveLimit = 10000

// rotateMoveBytes bounds the bytes the pending rows of an emptying hold (their payloads and
// metadata as stored): 10,000 rows of 64 KB would be 640 MB copied under the exclusive lock,
// with every statement on the effects table waiting, and past rotateTimeout rolled back and
// tried again at every turn.
const rotateMoveBytes = 32 << 20

// rotateLockTimeout bounds the wait for the exclusive lock of the partition to empty (and for the
// rotation row). Statements on the effects table queue behind the lock request while it waits,
// so it is kept short; on a timeout the rotation is tried again at the next turn.
const rotateLockTimeout = 20 * time.Millisecond

// rotateTimeout bounds one look at the rotation, its emptying included.
const rotateTimeout = 10 * time.Second

// effectColumnList are the columns of an effect row but gen, which the partition a moved row
// lands in sets (its default).
const effectColumnList = `id, source_consumer, source_id, seq, kind, topic, uuid, payload, metadata, ordering_key,
	created_at, dispatched_at, attempts, last_error, next_attempt_at, parked_at, failures, failed_at, backoff_until`

// rotationQueries are the statements of the rotation.
type rotationQueries struct {
	probe   string // -> current gen, whether the rotation is due, whether a partition holds pages, claimWrites
	writes  string // -> claimWrites, for a Store that never rotates
	claim   string // store.Queries.EffectClaimDue, every row ending with what probe reads (writes for a Store that never rotates)
	advance string // (next, current): no row changed when another instance rotated
	lock    [3]string
	count   [3]string    // (limit + 1) -> the rows in the partition, up to the limit + 1, and their bytes
	move    [3][3]string // [from][to]: the rows of from into to, with their ids and state
	empty   [3]string
}

// claimWrites is how many rows the server's statistics count inserted and updated in the claims
// table: the sweep's hint that nothing was written there since it last looked (see sweep).
func claimWrites(n store.Names) string {
	return fmt.Sprintf(`pg_stat_get_tuples_inserted('%[1]s'::regclass) + pg_stat_get_tuples_updated('%[1]s'::regclass)`, n.Processed)
}

// newRotationQueries returns the rotation's statements for a Store that rotates every every.
// The probe takes no argument: lib/pq sends a statement with arguments as two server
// transactions, and an idle relay sends little else.
func newRotationQueries(n store.Names, every time.Duration) rotationQueries {
	var q rotationQueries
	// Used: any partition holds pages, not only the current one. Processes that record effects
	// and run no relay never read the generation and write into partition 0 for good: with the
	// current partition's size alone, a relay that writes none rotated once and then took the
	// database for idle, and partition 0 was never emptied again. An idle database still stops
	// once all three are emptied (two rotations at most).
	sizes := ``
	for g := range 3 {
		p := effectsPartition(n, g)
		if g > 0 {
			sizes += ` + `
		}
		sizes += fmt.Sprintf(`pg_relation_size('%s'::regclass)`, p)
		q.lock[g] = `LOCK TABLE ` + p + ` IN ACCESS EXCLUSIVE MODE`
		q.count[g] = `SELECT count(*), coalesce(sum(pg_column_size(s.payload) + pg_column_size(s.metadata)), 0)::bigint
			FROM (SELECT payload, metadata FROM ` + p + ` LIMIT $1) s`
		q.empty[g] = `TRUNCATE ` + p
		for to := range 3 {
			q.move[g][to] = `WITH m AS (DELETE FROM ` + p + ` RETURNING ` + effectColumnList + `)
				INSERT INTO ` + effectsPartition(n, to) + ` (` + effectColumnList + `) SELECT ` + effectColumnList + ` FROM m`
		}
	}
	q.probe = fmt.Sprintf(`SELECT r.gen, r.rotated_at < now() - interval '%d milliseconds' AS due, `, every.Milliseconds()) + sizes + ` > 0 AS used,
		` + claimWrites(n) + ` AS writes FROM ` + rotationTable(n) + ` r`
	q.writes = `SELECT ` + claimWrites(n) + ` AS writes`
	// The look is read once (materialized) and repeated on every row of the claim; sub-selects,
	// so that a missing rotation row fails the look (NULL), not the claim.
	if every < 0 {
		q.claim = effectClaimDue(n, `look AS MATERIALIZED (`+q.writes+`), `, `, (SELECT writes FROM look)`)
	} else {
		q.claim = effectClaimDue(n, `look AS MATERIALIZED (`+q.probe+`), `,
			`, (SELECT gen FROM look), (SELECT due FROM look), (SELECT used FROM look), (SELECT writes FROM look)`)
	}
	q.advance = `UPDATE ` + rotationTable(n) + ` SET gen = $1, rotated_at = now() WHERE gen = $2`
	return q
}

// EffectsGeneration returns the current partition of the effects table as this Store last read
// it, for statements run beside the Store that insert effects (Queries).
func (s *inline) EffectsGeneration() *Generation { return s.gen }

// look is what one look at the partitions and at the claims table tells (probe).
type look struct {
	cur, writes int64
	due, used   bool
	rotates     bool // cur, due and used were read: the Store rotates
}

// probe reads the current partition, whether the rotation is due and whether the current
// partition holds pages (unless the Store never rotates), and claimWrites, in one statement.
func (s *inline) probe(ctx context.Context) (look, error) {
	ctx, cancel := context.WithTimeout(ctx, rotateTimeout)
	defer cancel()
	var p look
	if s.rotateEvery < 0 {
		if err := s.db.QueryRowContext(ctx, s.rq.writes).Scan(&p.writes); err != nil {
			return p, fmt.Errorf("read the writes of the claims table: %w", wrapErr(s.SQL, err))
		}
		return p, nil
	}
	if err := s.db.QueryRowContext(ctx, s.rq.probe).Scan(&p.cur, &p.due, &p.used, &p.writes); err != nil {
		return p, fmt.Errorf("read the current partition: %w", wrapErr(s.SQL, err))
	}
	if p.cur < 0 || p.cur > 2 {
		return p, fmt.Errorf("current partition of the effects table: %d, want 0 to 2", p.cur)
	}
	p.rotates = true
	s.gen.store(int(p.cur))
	return p, nil
}

// claimLooking claims as store.SQL.EffectClaimDue does and reads what probe reads in the same
// statement: an idle relay pass, which needs both, is one statement. lookErr tells that the claim
// went well and the look did not: the claim stands (its effects are leased).
func (s *inline) claimLooking(ctx context.Context, cp outboxdriver.EffectClaimParams) (claim outboxdriver.EffectClaim, p look, lookErr, err error) {
	var cur, writes sql.NullInt64
	var due, used sql.NullBool
	extra := []any{&writes}
	if s.rotateEvery >= 0 {
		extra = []any{&cur, &due, &used, &writes}
	}
	claim, seen, err := s.SQL.EffectClaimDueWith(ctx, cp, s.rq.claim, extra...)
	if err != nil {
		return claim, p, nil, err
	}
	p.writes = writes.Int64
	switch {
	case !seen || !writes.Valid:
		return claim, p, errLookUnread, nil
	case s.rotateEvery < 0:
		return claim, p, nil, nil
	case !cur.Valid || !due.Valid || !used.Valid:
		return claim, p, fmt.Errorf("read the current partition: %w", errLookUnread), nil
	case cur.Int64 < 0 || cur.Int64 > 2:
		return claim, p, fmt.Errorf("current partition of the effects table: %d, want 0 to 2", cur.Int64), nil
	}
	p.cur, p.due, p.used, p.rotates = cur.Int64, due.Bool, used.Bool, true
	s.gen.store(int(p.cur))
	return claim, p, nil, nil
}

// errLookUnread: the claim returned without what its look reads (no rotation row, no row at all).
var errLookUnread = errors.New("the claim returned no look at the partitions and the claims table")

// turn tells whether every has passed since *last, and if so makes now the last time; of
// concurrent callers, one gets the turn. A last time in the future is the wall clock stepped
// back since (the times are the wall clock's): a turn, or the sweep and the rotation stopped
// for as long as the clock went back.
func turn(last *atomic.Int64, every time.Duration) bool {
	l := last.Load()
	since := time.Since(time.Unix(0, l))
	return (since >= every || since < 0) && last.CompareAndSwap(l, time.Now().UnixNano())
}

// rotate looks at the partitions, at most every RotateEvery/2, and rotates them if due
// (rotateWith).
func (s *inline) rotate(ctx context.Context) error {
	if s.rotateEvery < 0 || !turn(&s.lastRotate, s.rotateEvery/2) {
		return nil
	}
	p, err := s.probe(ctx)
	if err != nil {
		return err
	}
	return s.rotateWith(ctx, p)
}

// rotateWith empties the next partition and makes it current when the current one, as probe p
// read it (p), has been current for RotateEvery and a partition holds pages. An idle database
// (every partition emptied) rotates nothing and writes nothing, whoever wrote the effects: the
// probe reads the partitions, not what this process did.
func (s *inline) rotateWith(ctx context.Context, p look) error {
	if !p.rotates || !p.due || !p.used {
		return nil
	}
	ctx, cancel := context.WithTimeout(ctx, rotateTimeout)
	defer cancel()
	cur := int(p.cur)
	next := (cur + 1) % 3
	switched := false
	err := s.inTx(ctx, func(tx *sql.Tx) error {
		if _, err := tx.ExecContext(ctx, fmt.Sprintf(`SET LOCAL lock_timeout = '%dms'`, s.rotateLock.Milliseconds())); err != nil {
			return err
		}
		// The switch first: its row lock makes the instances that rotate at once take turns, and
		// the one that finds the generation changed does nothing.
		res, err := tx.ExecContext(ctx, s.rq.advance, next, cur)
		if err != nil {
			return err
		}
		if n, err := res.RowsAffected(); err != nil || n == 0 {
			return err
		}
		// Under the exclusive lock every transaction that wrote into the partition has ended
		// (a writer whose generation is out of date): the move sees its rows. A writer that
		// comes after waits for the commit, and its row lands in the partition that is then
		// the current one.
		if _, err := tx.ExecContext(ctx, s.rq.lock[next]); err != nil {
			return err
		}
		var rows int
		var size int64
		if err := tx.QueryRowContext(ctx, s.rq.count[next], rotateMoveLimit+1).Scan(&rows, &size); err != nil {
			return err
		}
		if rows > rotateMoveLimit || size > s.moveBytes {
			return errRotationBacklog
		}
		if rows > 0 {
			// The ids stay: the relay sends each ordering key's effects in id order.
			if _, err := tx.ExecContext(ctx, s.rq.move[next][cur]); err != nil {
				return err
			}
		}
		// Even when the partition is empty: TRUNCATE also resets its statistics (never
		// analyzed: the planner takes it for ten pages, not for none) and drops the cached
		// plans that use it, so that no plan made while it was analyzed empty scans it whole
		// once it is the current one and fills.
		if _, err := tx.ExecContext(ctx, s.rq.empty[next]); err != nil {
			return err
		}
		switched = true
		return nil
	})
	switch {
	case errors.Is(err, errRotationBacklog):
		if !s.backlogNoted.Swap(true) {
			return fmt.Errorf("partition %d of the effects table holds more than %d pending effects, or more than %d MB of them: not rotated until they are sent", next, rotateMoveLimit, s.moveBytes>>20)
		}
		return nil
	case isLockTimeout(err):
		return nil // tried again at the next turn
	case err != nil:
		return fmt.Errorf("rotate to partition %d: %w", next, wrapErr(s.SQL, err))
	}
	if switched {
		s.backlogNoted.Store(false)
		s.gen.store(next)
	}
	return nil
}

var errRotationBacklog = errors.New("rotation put off: backlog")

// isLockTimeout tells whether err is PostgreSQL's lock_not_available (lock_timeout).
func isLockTimeout(err error) bool {
	var e interface{ SQLState() string }
	return errors.As(err, &e) && e.SQLState() == "55P03"
}
