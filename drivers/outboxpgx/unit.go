package outboxpgx

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/watermill-outbox/outbox"
	"github.com/watermill-outbox/outbox/drivers/postgres"
	"github.com/watermill-outbox/outbox/outboxdriver"
	"github.com/watermill-outbox/outbox/store"
)

// cleanupTimeout bounds the ROLLBACK sent after a failed step, whose own context may be over.
const cleanupTimeout = 5 * time.Second

// BeginUnit acquires a connection and sends BEGIN and the claim (pessimistic) or its look-up
// (optimistic) in one round trip.
func (s *pgxStore) BeginUnit(ctx context.Context, claim *outboxdriver.Source) (outboxdriver.UnitTx, outboxdriver.Claim, error) {
	var end func()
	if s.watchDial != nil && s.pool.Stat().IdleConns() == 0 {
		end = s.watchDial() // Acquire opens a connection (or waits for the full pool's)
	}
	conn, err := s.pool.Acquire(ctx)
	if end != nil {
		end()
	}
	if err != nil {
		return nil, outboxdriver.Claim{}, fmt.Errorf("acquire a connection from the pool (at most HandlerTimeout): %w", err)
	}
	b := &pgx.Batch{}
	b.BeginTx(pgx.TxOptions{})
	if claim != nil {
		q := s.q.claim
		if s.optimistic {
			q = s.q.lookup
		}
		b.Queue(q, claim.Consumer, claim.ID)
	}
	// A unit whose transaction gets no ID at BEGIN marks it, for its COMMIT to tell it from one
	// user SQL began after a ROLLBACK (see unit.Commit); pipelined, no round trip more.
	marked := claim == nil || s.optimistic
	if marked {
		b.Queue(s.q.mark)
	}
	br := conn.SendBatch(ctx, b)
	_, err = br.Exec()
	if err != nil && postgres.IsReadOnlyAtBegin(err) {
		// BEGIN's own refusal: only there does 0A000 mean a server in recovery.
		err = fmt.Errorf("%w (a standby? the connection must reach the primary): %w", outboxdriver.ErrReadOnly, err)
	}
	c := outboxdriver.Claim{Claimed: true}
	var xid *int64
	if err == nil && claim != nil {
		c, xid, err = s.readClaim(br.QueryRow())
	}
	if err == nil && marked {
		_, err = br.Exec()
	}
	if cerr := br.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		abort(conn)
		return nil, outboxdriver.Claim{}, fmt.Errorf("begin and claim: %w", wrap(err))
	}
	u := &unit{s: s, conn: conn, inner: br.Tx(), marked: marked}
	u.tx = &tx{u: u}
	if claim != nil {
		u.src, u.tentative = *claim, c.Tentative
		if xid != nil {
			u.claimXID = *xid
		}
	}
	u.mu.Lock()
	u.stopWatch = context.AfterFunc(ctx, u.expire)
	u.mu.Unlock()
	return u, c, nil
}

// readClaim reads the outcome of the claim (pessimistic), with the transaction ID the claim
// inserted carries (nil when none was inserted), or of its look-up (optimistic).
func (s *pgxStore) readClaim(row pgx.Row) (outboxdriver.Claim, *int64, error) {
	var ms, xid *int64
	var settled *bool
	if s.optimistic {
		switch err := row.Scan(&ms, &settled); {
		case errors.Is(err, pgx.ErrNoRows):
			return outboxdriver.Claim{Claimed: true, Tentative: true}, nil, nil
		case err != nil:
			return outboxdriver.Claim{}, nil, err
		}
		return outboxdriver.Claim{Age: time.Duration(*ms) * time.Millisecond, Settled: settled != nil && *settled}, nil, nil
	}
	var claimed bool
	if err := row.Scan(&claimed, &ms, &settled, &xid); err != nil {
		return outboxdriver.Claim{}, nil, err
	}
	c := outboxdriver.Claim{Claimed: claimed, Concurrent: !claimed && ms == nil}
	if ms != nil {
		c.Age = time.Duration(*ms) * time.Millisecond
		c.Settled = !claimed && settled != nil && *settled
	}
	return c, xid, nil
}

// JoinUnit wraps a pgx.Tx the caller owns.
func (s *pgxStore) JoinUnit(t any) (outboxdriver.UnitTx, error) {
	joined, ok := t.(pgx.Tx)
	if !ok || joined == nil {
		return nil, fmt.Errorf("%w: JoinTx needs a pgx.Tx with the pgx driver, got %T", outbox.ErrNoUnitOfWork, t)
	}
	return &unit{s: s, joined: joined}, nil
}

// abort rolls back whatever is open on conn and gives it back to the pool (which closes a
// connection that is still in a transaction, or broken).
func abort(conn *pgxpool.Conn) {
	if c := conn.Conn(); !c.IsClosed() && c.PgConn().TxStatus() != 'I' && !c.PgConn().IsBusy() {
		ctx, cancel := context.WithTimeout(context.Background(), cleanupTimeout)
		_, _ = c.Exec(ctx, "ROLLBACK")
		cancel()
	}
	conn.Release()
}

// wrap adds the fix to errors caused by missing tables, and names a server that takes no writes.
func wrap(err error) error {
	if err != nil && postgres.IsUndefinedTable(err) {
		return fmt.Errorf("%w: %w", outboxdriver.ErrSchemaMissing, err)
	}
	if err != nil && postgres.IsReadOnly(err) && !errors.Is(err, outboxdriver.ErrReadOnly) {
		return fmt.Errorf("%w (a standby? the connection must reach the primary): %w", outboxdriver.ErrReadOnly, err)
	}
	return err
}

// unit is the transaction of one unit of work on a connection of the pool, or (joined) a pgx.Tx
// the caller owns.
type unit struct {
	s         *pgxStore
	conn      *pgxpool.Conn // nil when joined
	joined    pgx.Tx
	inner     pgx.Tx              // pgx's own transaction object of conn, for LargeObjects only
	tx        *tx                 // what user code gets, when not joined
	src       outboxdriver.Source // zero at the boundary (no claim)
	tentative bool                // the claim of src is INSERTed at commit (optimistic)
	claimXID  int64               // the inline_xid of the claim BeginUnit inserted (pessimistic)
	marked    bool                // BeginUnit marked the transaction (queries.mark): it has no claimXID

	mu        sync.Mutex
	recorded  []outboxdriver.Effect // the effects recorded, in order, for a rollback to store (finishedBySQL)
	alive     []bool                // per recorded effect: false once a savepoint it was recorded in rolled back
	open      []savepoint           // the open savepoints, outermost first
	lastSP    int                   // the ID of the last savepoint begun
	done      bool                  // committed, rolled back, refused, or expired
	stopWatch func() bool           // stops the watch of BeginUnit's context (expire); nil when joined
	expired   bool                  // BeginUnit's context ended first: the connection's socket was closed
	released  bool                  // the connection left the pool (after expired)
	// endedBySQL: expired, but user code had ended the transaction with SQL before.
	endedBySQL bool
}

// expire ends the transaction when the unit of work's context (bounded by HandlerTimeout) ends
// before the framework committed or rolled it back, even while the handler is stuck in code that
// ignores its context, as database/sql rolls back a *sql.Tx whose context ends: closing the
// connection's socket (net.Conn's Close is safe while another goroutine uses it) makes the
// server roll back and release the locks at once. The handler's statements fail from then on
// (ErrTxClosed); Commit and Rollback, once the handler returned, report ErrTxDone and take the
// connection out of the pool for good.
func (u *unit) expire() {
	u.mu.Lock()
	defer u.mu.Unlock()
	if u.done {
		return
	}
	u.done, u.expired = true, true
	_ = u.conn.Conn().PgConn().Conn().Close()
}

func (u *unit) Tx() any {
	if u.joined != nil {
		return u.joined
	}
	return u.tx
}

// Record keeps effects in memory until Commit; a joined unit stores them at once, since the
// caller commits.
func (u *unit) Record(ctx context.Context, effects []outboxdriver.Effect) error {
	if u.joined != nil {
		return insert(ctx, u.joined, u.s.q.insert, effects)
	}
	u.mu.Lock()
	defer u.mu.Unlock()
	if u.done {
		return fmt.Errorf("record side effects: %w", pgx.ErrTxClosed)
	}
	for range effects {
		u.alive = append(u.alive, true)
	}
	if u.claimXID != 0 {
		u.recorded = append(u.recorded, effects...)
	}
	return nil
}

// survivors returns the recorded effects that no rolled-back savepoint took back.
func (u *unit) survivors() []outboxdriver.Effect {
	u.mu.Lock()
	defer u.mu.Unlock()
	var out []outboxdriver.Effect
	for i, e := range u.recorded {
		if u.alive[i] {
			out = append(out, e)
		}
	}
	return out
}

func (u *unit) Survivors(_ context.Context, effects []outboxdriver.Effect) ([]outboxdriver.Effect, error) {
	u.mu.Lock()
	defer u.mu.Unlock()
	out := effects[:0:0]
	for i, e := range effects {
		if i < len(u.alive) && u.alive[i] {
			out = append(out, e)
		}
	}
	return out, nil
}

// Commit sends the insert of the effects and COMMIT in one round trip.
func (u *unit) Commit(ctx context.Context, effects []outboxdriver.Effect) error {
	if err := u.end("committed"); err != nil {
		if u.endedBySQL {
			// HandlerTimeout cut off a handler that had ended the transaction with SQL: its
			// connection is gone, so the pool is asked what it committed.
			cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), cleanupTimeout)
			defer cancel()
			return u.finishedBySQL(cctx, u.s.pool, effects)
		}
		return err
	}
	c := u.conn.Conn()
	if c.PgConn().TxStatus() == 'I' && !c.IsClosed() {
		// The handler sent COMMIT or ROLLBACK as SQL: what it wrote is committed, or not, without
		// the effects.
		defer u.conn.Release()
		cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), cleanupTimeout)
		defer cancel()
		return u.finishedBySQL(cctx, u.conn, effects)
	}
	b := &pgx.Batch{}
	// The transaction open may not be the unit's: a handler that sent ROLLBACK and then BEGIN
	// replaced it, and its claim, by one of its own, which this COMMIT would commit without the
	// claim (the message acked, and applied again at its next delivery), or, without a claim yet,
	// with the effects recorded before the ROLLBACK, whose business change is gone. Checked in the
	// same round trip, ahead of the COMMIT it stops.
	checked := true
	switch {
	case u.claimXID != 0:
		b.Queue(u.s.q.ownTx, u.claimXID)
	case u.marked:
		b.Queue(u.s.q.marked)
	default:
		checked = false
	}
	rows := effects
	if u.tentative {
		// The claim, with the effects inline when none has an ordering key of its own (those
		// wait in rows behind the earlier effects of their key).
		var inline []byte
		if len(effects) > 0 && ownKeys(effects, u.src) {
			inline, rows = store.EncodeEffects(effects), nil
		}
		b.Queue(u.s.q.claimInline, u.src.Consumer, u.src.ID, inline)
	}
	queueInsert(b, u.s.q.insert, rows)
	b.Queue("COMMIT")
	br := c.SendBatch(ctx, b)
	var err error
	replaced := false
	if checked {
		_, err = br.Exec()
		switch code := pgErrorCode(err); code {
		case "22012": // the check's own: another transaction
			replaced = true
			err = u.replacedError(err)
		case "25P02":
			// A statement of the handler failed and the handler went on: the check, first in
			// the batch, is refused where the COMMIT would have been answered with ROLLBACK.
			err = fmt.Errorf("%w: %w", errCommitRolledBack, err)
		}
	}
	if err == nil && u.tentative {
		if _, err = br.Exec(); err != nil && u.s.isClaimConflict(err) {
			err = fmt.Errorf("%w: %w", outboxdriver.ErrClaimTaken, err)
		}
	}
	if err == nil {
		err = scanInserted(br, rows)
	}
	if err == nil {
		var tag pgconn.CommandTag
		if tag, err = br.Exec(); err == nil && tag.String() != "COMMIT" {
			err = errCommitRolledBack
		}
	}
	if cerr := br.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		abort(u.conn)
		if replaced && u.claimXID != 0 {
			// The unit's transaction ended by SQL before another began: by ROLLBACK, or by
			// COMMIT, which committed the claim with the business writes but not the effects,
			// waiting here. They are stored if the unit's claim committed, for the redelivery to
			// send (reported as nothing committed, they were never sent).
			cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), cleanupTimeout)
			defer cancel()
			return u.finishedBySQL(cctx, u.s.pool, effects)
		}
		if pgconn.SafeToRetry(err) {
			// pgx wrote nothing (a Rows the handler left open keeps the connection busy): the
			// transaction rolled back for sure, which is a failed attempt, not an unknown outcome.
			err = fmt.Errorf("%w: %w", outboxdriver.ErrNotSent, err)
		} else if ctx.Err() != nil && pgErrorCode(err) == "" && !errors.Is(err, errCommitRolledBack) {
			// HandlerTimeout ended after the batch, COMMIT included, went out and before its
			// answer came back: the server may well have committed. Not a timed-out rollback,
			// which a caller would take as leave to run the unit again.
			err = fmt.Errorf("%w: the unit's context (HandlerTimeout) ended while COMMIT was in flight: %w", outbox.ErrCommitOutcomeUnknown, err)
		}
		return wrap(err)
	}
	u.conn.Release()
	return nil
}

// finishedBySQL handles a transaction that user code finished with SQL of its own. If the claim
// committed (pessimistic mode), the effects are stored now (in a statement of their own: a crash
// right before it loses them), so that a redelivery sends them; either way the unit of work
// reports ErrTxFinishedByHandler and ErrTxDone. In the optimistic mode the claim was not written
// yet: the message fails and runs again, which applies what the handler committed twice. Never
// end the transaction with SQL. q is the unit's connection, or the pool once that is gone.
//
// The claim looked for is the one the unit inserted (by its transaction ID, claimXID), not any
// claim of the message: after a ROLLBACK a copy may have claimed the message and committed, and
// storing the effects beside its claim would send effects of rolled-back work. The ID is the
// unit's own, so the check holds on the pool as on the connection, where the session setting
// postgres.OwnClaim reads would be gone.
func (u *unit) finishedBySQL(ctx context.Context, q querier, effects []outboxdriver.Effect) error {
	_, err := u.storeIfClaimed(ctx, q, effects)
	return err
}

// storeIfClaimed stores effects when the unit's own claim (claimXID) committed, which only SQL
// sent by user code can have done before the framework's COMMIT. It returns the unit's error
// (endedBySQLError), and whether the claim was found committed.
func (u *unit) storeIfClaimed(ctx context.Context, q querier, effects []outboxdriver.Effect) (committed bool, err error) {
	err = u.endedBySQLError()
	if u.src.Consumer == "" || u.tentative || u.claimXID == 0 || len(effects) == 0 {
		return false, err // no claim in the transaction: nothing tells what it committed
	}
	var one int
	switch qerr := q.QueryRow(ctx, u.s.q.ownClaim, u.src.Consumer, u.src.ID, u.claimXID).Scan(&one); {
	case errors.Is(qerr, pgx.ErrNoRows):
		return false, err
	case qerr != nil:
		return false, fmt.Errorf("%w (and checking whether the claim committed failed: %w)", err, qerr)
	}
	if ierr := insert(ctx, q, u.s.q.insert, effects); ierr != nil {
		return true, fmt.Errorf("%w; storing its side effects after it failed: %w", err, ierr)
	}
	return true, err
}

// querier is what finishedBySQL needs of a connection or of the pool.
type querier interface {
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
	SendBatch(ctx context.Context, b *pgx.Batch) pgx.BatchResults
}

// replacedError is the error of a unit of work whose transaction user code replaced with one of
// its own (COMMIT or ROLLBACK, then BEGIN, sent as SQL). Without a claim (a boundary unit) nothing
// tells which ended it: what fn wrote before may be committed, without the effects.
func (u *unit) replacedError(err error) error {
	return fmt.Errorf("%w: the transaction was ended and another begun by SQL sent through it (COMMIT or ROLLBACK, then BEGIN); what was written before may be committed, without the side effects (%w): %w",
		outbox.ErrTxFinishedByHandler, outboxdriver.ErrTxDone, err)
}

// pgErrorCode is the SQLSTATE of err, empty when the server did not send it.
func pgErrorCode(err error) string {
	var pe *pgconn.PgError
	if errors.As(err, &pe) {
		return pe.Code
	}
	return ""
}

// endedBySQLError is the error of a unit of work whose transaction user code ended with SQL.
func (u *unit) endedBySQLError() error {
	return fmt.Errorf("%w: the transaction was ended by SQL sent through it (COMMIT or ROLLBACK) (%w)", outbox.ErrTxFinishedByHandler, outboxdriver.ErrTxDone)
}

// Rollback rolls the unit's transaction back. A handler that failed (or outlasted HandlerTimeout)
// after it ended the transaction with SQL of its own may have committed it, claim included, in
// the pessimistic mode, without the effects, which wait in memory: Rollback then stores them
// beside the committed claim, as Commit does, for the redelivery to send, and reports
// ErrTxFinishedByHandler; forgotten, the redelivery found the message processed with nothing
// pending. The transaction open may also be one the handler began after its COMMIT; whether the
// unit's claim committed is asked once that is rolled back, when effects were recorded.
func (u *unit) Rollback(ctx context.Context) error {
	cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), cleanupTimeout)
	defer cancel()
	if err := u.end("rolled back"); err != nil {
		if u.endedBySQL {
			// HandlerTimeout cut it off: the connection is gone, the pool is asked.
			return u.finishedBySQL(cctx, u.s.pool, u.survivors())
		}
		return err
	}
	c := u.conn.Conn()
	if !c.IsClosed() && !c.PgConn().IsBusy() {
		if c.PgConn().TxStatus() == 'I' {
			// The handler sent COMMIT or ROLLBACK as SQL.
			defer u.conn.Release()
			return u.finishedBySQL(cctx, u.conn, u.survivors())
		}
		if effects := u.survivors(); u.claimXID != 0 && len(effects) > 0 {
			_, _ = c.Exec(cctx, "ROLLBACK")
			if !c.IsClosed() && c.PgConn().TxStatus() == 'I' {
				defer u.conn.Release()
				if committed, err := u.storeIfClaimed(cctx, u.conn, effects); committed {
					return err // a COMMIT, then BEGIN, of the handler's
				}
				return nil
			}
		}
	}
	abort(u.conn)
	return nil
}

// end marks the transaction over; ErrTxDone if it was already, an error for a joined one (whose
// owner ends it).
func (u *unit) end(how string) error {
	if u.joined != nil {
		return fmt.Errorf("outboxpgx: a joined transaction is %s by its owner", how)
	}
	u.mu.Lock()
	defer u.mu.Unlock()
	if u.expired {
		if !u.released {
			// Out of the pool for good: the pool could take a connection whose socket is gone
			// for a sound one (when the handler ended the transaction with SQL). The handler has
			// returned: its statements no longer touch the connection's state.
			u.released = true
			u.endedBySQL = u.conn.Conn().PgConn().TxStatus() == 'I'
			ctx, cancel := context.WithTimeout(context.Background(), cleanupTimeout)
			_ = u.conn.Hijack().Close(ctx)
			cancel()
		}
		if u.endedBySQL {
			return u.endedBySQLError()
		}
		return fmt.Errorf("the unit of work's context ended first (HandlerTimeout), its connection was closed and the transaction rolled back: %w", outboxdriver.ErrTxDone)
	}
	if u.done {
		return outboxdriver.ErrTxDone
	}
	u.done = true
	if u.stopWatch != nil {
		u.stopWatch() // if expire runs already, it finds the unit done
	}
	return nil
}

// ownKeys tells whether every effect has the default ordering key of src, its source.
func ownKeys(effects []outboxdriver.Effect, src outboxdriver.Source) bool {
	key := outboxdriver.DefaultOrderingKey(src)
	for _, e := range effects {
		if e.OrderingKey != key {
			return false
		}
	}
	return true
}

// isClaimConflict tells a unique violation of the claims' primary key: a copy committed first.
func (s *pgxStore) isClaimConflict(err error) bool {
	var pe *pgconn.PgError
	return errors.As(err, &pe) && pe.Code == "23505" && pe.SchemaName == s.names.Schema && pe.TableName == s.names.Prefix+"processed"
}

// errCommitRolledBack is a COMMIT that PostgreSQL answered with ROLLBACK: the transaction had
// failed (a statement of the handler failed and the handler went on).
var errCommitRolledBack = &rolledBackError{}

type rolledBackError struct{}

func (*rolledBackError) Error() string {
	return "commit rolled back: a statement in the transaction had failed (" + pgx.ErrTxCommitRollback.Error() + ")"
}
func (*rolledBackError) SQLState() string { return "40000" } // transaction_rollback
func (*rolledBackError) Unwrap() error    { return pgx.ErrTxCommitRollback }

// insert stores effects with the postgres driver's insert and sets their StoreIDs.
func insert(ctx context.Context, q interface {
	SendBatch(context.Context, *pgx.Batch) pgx.BatchResults
}, insertSQL func([]outboxdriver.Effect) string, effects []outboxdriver.Effect) error {
	b := &pgx.Batch{}
	queueInsert(b, insertSQL, effects)
	br := q.SendBatch(ctx, b)
	err := scanInserted(br, effects)
	if cerr := br.Close(); err == nil {
		err = cerr
	}
	return wrap(err)
}

// queueInsert queues the inserts of effects, store.EffectInsertMaxRows to a statement (one
// statement's bind parameters hold about 9,000), for scanInserted to read.
func queueInsert(b *pgx.Batch, insertSQL func([]outboxdriver.Effect) string, effects []outboxdriver.Effect) {
	for chunk := range slices.Chunk(effects, store.EffectInsertMaxRows) {
		b.Queue(insertSQL(chunk), store.EffectInsertArgs(chunk[0].Source, chunk)...)
	}
}

// scanInserted reads the results of the inserts queueInsert queued into effects.
func scanInserted(br pgx.BatchResults, effects []outboxdriver.Effect) error {
	for chunk := range slices.Chunk(effects, store.EffectInsertMaxRows) {
		if err := scanIDs(br, chunk); err != nil {
			return err
		}
	}
	return nil
}

// scanIDs reads the StoreIDs the insert returned (id, seq, in savepoint) into effects.
func scanIDs(br pgx.BatchResults, effects []outboxdriver.Effect) error {
	rows, err := br.Query()
	if err != nil {
		return err
	}
	defer rows.Close()
	bySeq := make(map[int]int, len(effects))
	for i, e := range effects {
		bySeq[e.Seq] = i
	}
	n := 0
	for rows.Next() {
		var id int64
		var seq int
		var nested bool
		if err := rows.Scan(&id, &seq, &nested); err != nil {
			return err
		}
		i, ok := bySeq[seq]
		if !ok {
			return fmt.Errorf("insert returned seq %d, which was not inserted", seq)
		}
		effects[i].StoreID = id
		n++
	}
	if err := rows.Err(); err != nil {
		return err
	}
	if n != len(effects) {
		return fmt.Errorf("insert of %d effects returned %d rows", len(effects), n)
	}
	return nil
}

// savepoint is an open savepoint: its ID (unique in the unit of work, so that the handle of a
// savepoint that ended cannot act on a later one at the same depth) and how many effects were
// recorded when it began.
type savepoint struct{ id, recorded int }

// tx is the pgx.Tx user code gets: depth 0 is the unit of work's transaction, which the framework
// commits; depth n is the n-th open savepoint (pgx's nested transactions), whose rollback drops
// the effects recorded inside it.
type tx struct {
	u     *unit
	depth int
	id    int // the savepoint's ID; 0 at depth 0
}

var _ pgx.Tx = (*tx)(nil)

// conn returns the connection, or ErrTxClosed once the transaction (or this savepoint) is over.
func (t *tx) conn() (*pgx.Conn, error) {
	t.u.mu.Lock()
	defer t.u.mu.Unlock()
	if t.u.done || t.depth > len(t.u.open) || (t.depth > 0 && t.u.open[t.depth-1].id != t.id) {
		return nil, pgx.ErrTxClosed
	}
	return t.u.conn.Conn(), nil
}

func savepointName(n int) string { return "outbox_sp_" + strconv.Itoa(n) }

// Begin starts a savepoint.
func (t *tx) Begin(ctx context.Context) (pgx.Tx, error) {
	c, err := t.conn()
	if err != nil {
		return nil, err
	}
	t.u.mu.Lock()
	n := len(t.u.open) + 1
	t.u.mu.Unlock()
	if _, err := c.Exec(ctx, "SAVEPOINT "+savepointName(n)); err != nil {
		return nil, err
	}
	t.u.mu.Lock()
	defer t.u.mu.Unlock()
	t.u.lastSP++
	t.u.open = append(t.u.open, savepoint{id: t.u.lastSP, recorded: len(t.u.alive)})
	return &tx{u: t.u, depth: n, id: t.u.lastSP}, nil
}

// Commit releases a savepoint. The unit of work's transaction itself is the framework's to commit:
// Commit rolls it back and returns an error wrapping outbox.ErrTxFinishedByHandler, so that the
// message fails rather than commit without its side effects.
func (t *tx) Commit(ctx context.Context) error {
	c, err := t.conn()
	if err != nil {
		return err
	}
	if t.depth == 0 {
		_ = t.u.Rollback(ctx)
		return fmt.Errorf("outboxpgx: Commit of the unit of work's transaction refused (rolled back): %w", outbox.ErrTxFinishedByHandler)
	}
	if _, err := c.Exec(ctx, "RELEASE SAVEPOINT "+savepointName(t.depth)); err != nil {
		return err
	}
	t.u.mu.Lock()
	defer t.u.mu.Unlock()
	t.u.open = t.u.open[:t.depth-1]
	return nil
}

// Rollback rolls a savepoint back (with the effects recorded since it began), or the unit of
// work's transaction (the message then fails).
func (t *tx) Rollback(ctx context.Context) error {
	c, err := t.conn()
	if err != nil {
		return err
	}
	if t.depth == 0 {
		return t.u.Rollback(ctx)
	}
	if _, err := c.Exec(ctx, "ROLLBACK TO SAVEPOINT "+savepointName(t.depth)); err != nil {
		return err
	}
	t.u.mu.Lock()
	defer t.u.mu.Unlock()
	for i := t.u.open[t.depth-1].recorded; i < len(t.u.alive); i++ {
		t.u.alive[i] = false
	}
	t.u.open = t.u.open[:t.depth-1]
	return nil
}

func (t *tx) CopyFrom(ctx context.Context, table pgx.Identifier, columns []string, src pgx.CopyFromSource) (int64, error) {
	c, err := t.conn()
	if err != nil {
		return 0, err
	}
	return c.CopyFrom(ctx, table, columns, src)
}

func (t *tx) SendBatch(ctx context.Context, b *pgx.Batch) pgx.BatchResults {
	c, err := t.conn()
	if err != nil {
		return errBatch{err}
	}
	return c.SendBatch(ctx, b)
}

// LargeObjects works through pgx's own transaction object of the connection; use it only while
// the unit of work runs.
func (t *tx) LargeObjects() pgx.LargeObjects { return t.u.inner.LargeObjects() }

func (t *tx) Prepare(ctx context.Context, name, sql string) (*pgconn.StatementDescription, error) {
	c, err := t.conn()
	if err != nil {
		return nil, err
	}
	return c.Prepare(ctx, name, sql)
}

func (t *tx) Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error) {
	c, err := t.conn()
	if err != nil {
		return pgconn.CommandTag{}, err
	}
	return c.Exec(ctx, sql, args...)
}

func (t *tx) Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error) {
	c, err := t.conn()
	if err != nil {
		return nil, err
	}
	return c.Query(ctx, sql, args...)
}

func (t *tx) QueryRow(ctx context.Context, sql string, args ...any) pgx.Row {
	c, err := t.conn()
	if err != nil {
		return errRow{err}
	}
	return c.QueryRow(ctx, sql, args...)
}

// Conn returns the connection of the transaction (nil once it is over).
func (t *tx) Conn() *pgx.Conn {
	c, _ := t.conn()
	return c
}

type errRow struct{ err error }

func (r errRow) Scan(...any) error { return r.err }

type errBatch struct{ err error }

func (b errBatch) Exec() (pgconn.CommandTag, error) { return pgconn.CommandTag{}, b.err }
func (b errBatch) Query() (pgx.Rows, error)         { return nil, b.err }
func (b errBatch) QueryRow() pgx.Row                { return errRow(b) }
func (b errBatch) Close() error                     { return b.err }
func (b errBatch) Tx() pgx.Tx                       { return nil }

var _ outboxdriver.KeyedUnitTx = (*unit)(nil)

// KeyClaim implements outboxdriver.KeyedUnitTx with the postgres driver's statements, on the
// unit's connection.
func (u *unit) KeyClaim(ctx context.Context, p outboxdriver.KeyClaimParams) (outboxdriver.KeyClaim, error) {
	c, err := u.keyConn()
	if err != nil {
		return outboxdriver.KeyClaim{}, err
	}
	return store.ClaimKey(ctx, u.s.q.keys, u.s.names, func(ctx context.Context, query string, args []any, dest ...any) (bool, error) {
		switch err := c.QueryRow(ctx, query, args...).Scan(dest...); {
		case errors.Is(err, pgx.ErrNoRows):
			return false, nil
		case err != nil:
			return false, wrap(err)
		}
		return true, nil
	}, p)
}

// KeySave implements outboxdriver.KeyedUnitTx.
func (u *unit) KeySave(ctx context.Context, scope, key string, result []byte) error {
	c, err := u.keyConn()
	if err != nil {
		return err
	}
	if _, err := c.Exec(ctx, u.s.q.keys.KeySave, scope, key, result); err != nil {
		return fmt.Errorf("store the result of idempotency key %q: %w", key, wrap(err))
	}
	return nil
}

// keyConn is the connection of a unit that may hold a key: one the framework began.
func (u *unit) keyConn() (*pgx.Conn, error) {
	if u.joined != nil {
		return nil, fmt.Errorf("outboxpgx: a joined transaction: %w", outboxdriver.ErrKeysUnsupported)
	}
	return (&tx{u: u}).conn()
}
