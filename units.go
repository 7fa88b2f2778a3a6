package outbox

import (
	"context"
	"database/sql"
	"database/sql/driver"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/watermill-outbox/outbox/outboxdriver"
)

// sqlUnits runs units of work on database/sql for a Store that does not run them itself: BEGIN,
// the claim and each record are round trips of their own, since database/sql cannot pipeline.
// Effects are stored as they are recorded: the handler holds the *sql.Tx and could commit it.
type sqlUnits struct {
	db      *sql.DB
	store   outboxdriver.Store
	spilled func(ctx context.Context) // counts a unit that moved its claim's effects to rows
	// watch watches the connection and BEGIN of each unit for the gate (nil without one); the
	// claim after them is not watched (see beginStall).
	watch *beginWatch
	// marks, when not nil, hands each claim the marks that may ride on it (marker.take).
	marks *marker
}

var _ outboxdriver.UnitStore = sqlUnits{}

// txBeginner is implemented by a Store that begins transactions on its database itself, to name
// the errors of BEGIN (store.SQL: a standby that refuses BEGIN READ WRITE is reported as
// read-only).
type txBeginner interface {
	BeginTx(ctx context.Context, opts *sql.TxOptions) (*sql.Tx, error)
}

// beginTries bounds the BEGINs of a unit on a reserved connection (see BeginUnit).
const beginTries = 3

func (s sqlUnits) BeginUnit(ctx context.Context, claim *Source) (outboxdriver.UnitTx, outboxdriver.Claim, error) {
	if _, ok := s.store.(outboxdriver.KeySessionLocker); ok && claim == nil {
		// A boundary unit may claim an idempotency key, whose lock outlives the transaction:
		// its connection is the unit's until the lock is released.
		// database/sql's BeginTx takes another connection when the first turns out dead; a
		// reserved one does not, so BEGIN, which changes nothing, is sent again on a fresh
		// connection (the dead one is discarded with the driver's error).
		u, err := watchBegin(ctx, s.watch, func(ctx context.Context) (*sqlUnit, error) {
			var err error
			for try := 1; try <= beginTries; try++ {
				var conn *sql.Conn
				conn, err = s.db.Conn(ctx)
				if err != nil {
					return nil, fmt.Errorf("begin transaction (waiting for a database connection, at most HandlerTimeout): %w", err)
				}
				var tx *sql.Tx
				if tx, err = conn.BeginTx(ctx, nil); err == nil {
					u := &sqlUnit{store: s.store, tx: tx, conn: conn}
					u.stopExpiry = context.AfterFunc(ctx, u.expireKey)
					return u, nil
				}
				_ = conn.Close()
				if ctx.Err() != nil {
					break
				}
			}
			return nil, fmt.Errorf("begin transaction: %w", err)
		}, func(u *sqlUnit) {
			_ = u.tx.Rollback()
			_ = u.conn.Close()
		})
		if err != nil {
			return nil, outboxdriver.Claim{}, err
		}
		if err := u.guardBoundary(ctx); err != nil {
			_ = u.tx.Rollback()
			_ = u.conn.Close()
			return nil, outboxdriver.Claim{}, err
		}
		return u, outboxdriver.Claim{Claimed: true}, nil
	}
	begin := s.db.BeginTx
	if b, ok := s.store.(txBeginner); ok {
		begin = b.BeginTx
	}
	tx, err := watchBegin(ctx, s.watch, func(ctx context.Context) (*sql.Tx, error) {
		tx, err := begin(ctx, nil)
		if err != nil {
			return nil, fmt.Errorf("begin transaction (waiting for a database connection, at most HandlerTimeout): %w", err)
		}
		return tx, nil
	}, func(tx *sql.Tx) { _ = tx.Rollback() })
	if err != nil {
		return nil, outboxdriver.Claim{}, err
	}
	u := &sqlUnit{store: s.store, tx: tx}
	if claim == nil {
		if err := u.guardBoundary(ctx); err != nil {
			_ = tx.Rollback()
			return nil, outboxdriver.Claim{}, err
		}
		return u, outboxdriver.Claim{Claimed: true}, nil
	}
	c, err := s.claim(ctx, u, *claim)
	if err != nil {
		_ = tx.Rollback()
		u.settle(false)
		return nil, outboxdriver.Claim{}, err
	}
	u.guarded, u.src = c.Claimed, *claim
	if r, ok := s.store.(outboxdriver.InlineRecorder); ok && c.Claimed {
		u.inline = &inlineRecord{store: r, src: *claim, budget: r.InlineBudget()}
		u.spilled = s.spilled
	}
	return u, c, nil
}

// claim claims src in u's transaction, with the marks that may ride on it (outboxdriver.ClaimMarker),
// which u settles when it ends.
func (s sqlUnits) claim(ctx context.Context, u *sqlUnit, src Source) (outboxdriver.Claim, error) {
	if cm, ok := s.store.(outboxdriver.ClaimMarker); ok && s.marks != nil {
		if sent, late, batch := s.marks.take(src); len(batch) > 0 {
			u.riding, u.marks = batch, s.marks
			c, err := cm.MessageClaimMarking(ctx, u.tx, src, sent, late)
			if err == nil && len(c.Marked) < len(sent)+len(late) {
				// Claims locked by another transaction were skipped: the worker of failed rides
				// writes their marks (workFailed).
				u.riding = s.marks.handBack(batch, c.Marked)
			}
			return c, err
		}
	}
	return s.store.MessageClaim(ctx, u.tx, src)
}

// settle ends the ride of the marks on u's claim: written if u committed.
func (u *sqlUnit) settle(committed bool) {
	if u.marks != nil {
		u.marks.settle(u.riding, committed)
		u.riding, u.marks = nil, nil
	}
}

// guardBoundary marks the transaction of a boundary unit (no claim), when the store can, so that
// its writes are guarded as a claimed unit's are: after a COMMIT or ROLLBACK sent through the
// *sql.Tx, a write would commit on its own, in autocommit. One statement more per unit.
func (u *sqlUnit) guardBoundary(ctx context.Context) error {
	g, ok := u.store.(outboxdriver.BoundaryGuard)
	if !ok {
		return nil
	}
	guarded, err := g.GuardBoundary(ctx, u.tx)
	if err != nil {
		return fmt.Errorf("begin transaction: %w", err)
	}
	u.guarded = guarded
	return nil
}

func (s sqlUnits) JoinUnit(tx any) (outboxdriver.UnitTx, error) {
	t, ok := tx.(*sql.Tx)
	if !ok || t == nil {
		return nil, fmt.Errorf("%w: JoinTx needs a *sql.Tx with this driver, got %T", ErrNoUnitOfWork, tx)
	}
	return &sqlUnit{store: s.store, tx: t}, nil
}

type sqlUnit struct {
	store       outboxdriver.Store
	tx          *sql.Tx
	inSavepoint bool          // some effect row may have been written inside a savepoint
	inline      *inlineRecord // the effects kept in the claim; nil when there is no claim or the store keeps none
	moved       map[int]int64 // Seq -> row of the effects kept in the claim and then moved to rows (spilled)
	spilled     func(ctx context.Context)
	// guarded: the store's writes can check that the unit's transaction is still open
	// (outboxdriver.ClaimedEffectInserter): the unit claimed a message, whose claim they find, or
	// it is a boundary unit whose transaction the store marked (outboxdriver.BoundaryGuard).
	// ended: a record found the claim or the mark gone, ended by user SQL; nothing more is sent
	// through the transaction.
	guarded, ended bool
	src            Source // of the claim, when it claimed one
	// conn is the connection of tx when the store locks keys per session; keyed is the key
	// claimed on it, whose lock is released once tx has ended, or once the context tx is bound
	// to ends (expireKey), whichever comes first. sessionMu guards both from expireKey on.
	sessionMu  sync.Mutex
	conn       *sql.Conn
	keyed      *outboxdriver.KeyClaimParams
	stopExpiry func() bool
	// riding are the marks written by the claim (sqlUnits.claim), to settle with marks once the
	// transaction has ended.
	riding []outboxdriver.DispatchMark
	marks  *marker
}

func (u *sqlUnit) Tx() any { return u.tx }

// Record stores effects at once: in the claim when the store keeps them there, they have the
// default ordering key of their source and the claim's writes stay within the store's budget, as
// effect rows otherwise.
//
// A record never writes for a claim that user SQL rolled back (ROLLBACK sent through the
// *sql.Tx): the connection is then in autocommit, and a write would commit on its own, an effect
// without its business change, once more at every delivery. Each write finds the claim in the
// statement that writes (no round trip of its own); one that finds none reports
// ErrTxFinishedByHandler, and the unit stores nothing more. After a COMMIT sent through it the
// claim exists, committed, as do the business writes the handler makes after it: their effects
// are stored with them, each in autocommit, and sent when the message is redelivered. A boundary
// unit has no claim and no redelivery: its writes find the mark of its transaction
// (outboxdriver.BoundaryGuard), which a COMMIT sent as SQL ends too.
func (u *sqlUnit) Record(ctx context.Context, effects []Effect) error {
	if u.ended {
		return u.endedError()
	}
	if r := u.inline; r != nil && !r.spilled && r.takes(effects) {
		if r.fits(effects) {
			ok, err := r.record(ctx, u.tx, effects)
			if ok || err != nil {
				return err
			}
			u.ended = true // no claim: the handler rolled the transaction back
			return u.endedError()
		} else if done, err := u.spill(ctx, effects); done || err != nil {
			return err
		}
	}
	insert := u.store.EffectInsert
	if ci, ok := u.store.(outboxdriver.ClaimedEffectInserter); ok && u.guarded {
		insert = ci.EffectInsertClaimed
	}
	inSavepoint, err := insert(ctx, u.tx, effects[0].Source, effects)
	if errors.Is(err, outboxdriver.ErrClaimGone) {
		u.ended = true
		return u.endedError()
	}
	u.inSavepoint = u.inSavepoint || inSavepoint
	return err
}

// endedError reports a unit whose transaction user SQL ended.
func (u *sqlUnit) endedError() error {
	if u.src.Consumer == "" {
		return fmt.Errorf("%w: the transaction was ended by SQL sent through it (COMMIT or ROLLBACK): nothing more is stored, nothing is sent (%w)",
			ErrTxFinishedByHandler, outboxdriver.ErrTxDone)
	}
	return fmt.Errorf("%w: the transaction was rolled back by SQL sent through it (its claim is gone): nothing more is stored (%w)",
		ErrTxFinishedByHandler, outboxdriver.ErrTxDone)
}

// spill moves the effects the claim keeps into effect rows, followed by effects, in one statement:
// from then on the effects of the unit are rows, so that each record writes only its own. done
// false: effects are still to be inserted (the claim kept none, or there is no claim).
func (u *sqlUnit) spill(ctx context.Context, effects []Effect) (bool, error) {
	r := u.inline
	for try := 0; try < 2; try++ {
		if len(r.effects) == 0 {
			r.spilled = true
			return false, nil
		}
		kept := len(r.effects)
		all := append(slices.Clone(r.effects), effects...)
		ok, nested, err := r.store.EffectSpillInline(ctx, u.tx, r.src, all, r.token)
		if err != nil {
			return false, err
		}
		if ok {
			if u.moved == nil {
				u.moved = make(map[int]int64, kept)
			}
			for _, e := range all[:kept] {
				u.moved[e.Seq] = e.StoreID
			}
			for i := range effects {
				effects[i].StoreID = all[kept+i].StoreID
			}
			// Inside a savepoint, its rollback gives the claim its effects back and takes the
			// rows: both are read at the end.
			u.inSavepoint = u.inSavepoint || nested
			r.effects, r.token, r.spilled, r.unsure = nil, 0, true, r.unsure || nested
			if u.spilled != nil {
				u.spilled(ctx)
			}
			return true, nil
		}
		held, token, claimed, err := r.store.EffectReadInline(ctx, u.tx, r.src)
		if err != nil {
			return false, err
		}
		if !claimed {
			u.ended = true // no claim: the handler rolled the transaction back
			return false, u.endedError()
		}
		r.effects, r.token, r.unsure = r.held(held), token, true
	}
	return false, fmt.Errorf("outbox: the side effects in the claim of %q for %q changed while they were moved to rows", r.src.ID, r.src.Consumer)
}

// Survivors asks the database only when an effect may have been written inside a savepoint.
func (u *sqlUnit) Survivors(ctx context.Context, effects []Effect) ([]Effect, error) {
	if len(u.moved) > 0 {
		effects = slices.Clone(effects)
		for i, e := range effects {
			if id, ok := u.moved[e.Seq]; ok && e.StoreID == 0 {
				effects[i].StoreID = id
			}
		}
	}
	var keepRow map[int64]bool
	if u.inSavepoint && len(effects) > 0 {
		var ids []int64
		for _, e := range effects {
			if e.StoreID != 0 {
				ids = append(ids, e.StoreID)
			}
		}
		existing, err := u.store.EffectExisting(ctx, u.tx, ids)
		if err != nil {
			return nil, fmt.Errorf("outbox: check which side effects survived savepoints: %w", err)
		}
		keepRow = make(map[int64]bool, len(existing))
		for _, id := range existing {
			keepRow[id] = true
		}
	}
	var keepInline map[int]bool
	if u.inline != nil && u.inline.unsure {
		var err error
		if keepInline, err = u.inline.survivors(ctx, u.tx); err != nil {
			return nil, fmt.Errorf("outbox: check which side effects survived savepoints: %w", err)
		}
	}
	if keepRow == nil && keepInline == nil {
		return effects, nil
	}
	out := effects[:0:0]
	for _, e := range effects {
		switch {
		case e.StoreID != 0 && (keepRow == nil || keepRow[e.StoreID]):
		case keepInline == nil && e.StoreID == 0, keepInline[e.Seq]:
			e.StoreID = 0 // moved to a row by a spill that a savepoint rolled back, or kept in the claim
		default:
			continue
		}
		out = append(out, e)
	}
	if r := u.inline; r != nil && r.spilled && len(keepInline) > 0 {
		return u.unspill(ctx, out)
	}
	return out, nil
}

// unspill stores the effects of the unit's own key in one place when a spill left them in two: a
// savepoint rolled back gave the claim back effects that the spill had moved to rows, and later
// records are rows. Rows are sent by id, the claim's effects after them (ScanPending) or moved
// to rows after them: the claim takes them all, in order, and their rows go.
func (u *sqlUnit) unspill(ctx context.Context, effects []Effect) ([]Effect, error) {
	r := u.inline
	var own []Effect
	var rows []int64
	for _, e := range effects {
		if r.takes([]Effect{e}) {
			own = append(own, e)
			if e.StoreID != 0 {
				rows = append(rows, e.StoreID)
			}
		}
	}
	if len(rows) == 0 {
		return effects, nil // all in the claim
	}
	ok, err := r.store.EffectUnspillInline(ctx, u.tx, r.src, own, r.token, rows)
	if err != nil {
		return nil, fmt.Errorf("outbox: keep the side effects of %q for %q in one place: %w", r.src.ID, r.src.Consumer, err)
	}
	if !ok {
		return nil, fmt.Errorf("outbox: the side effects in the claim of %q for %q changed while they were written", r.src.ID, r.src.Consumer)
	}
	for i := range effects {
		if r.takes(effects[i : i+1]) {
			effects[i].StoreID = 0
		}
	}
	return effects, nil
}

// inlineRecord keeps the effects of a claimed unit of work in its claim (InlineRecorder).
type inlineRecord struct {
	store   outboxdriver.InlineRecorder
	src     Source
	effects []Effect // what the claim holds, as far as the unit knows
	token   int      // of the write that put them there
	// unsure: a write was made inside a savepoint, or one found the claim holding other effects
	// than the unit wrote (a savepoint was rolled back): which ones commit is read at the end.
	unsure bool
	// budget is InlineBudget, written what the unit's writes into the claim wrote in all;
	// spilled: the effects went to rows (the claim should hold none), and so do later ones.
	budget, written int
	spilled         bool
}

// fits tells whether the claim may take effects: the write of what it keeps and effects stays
// within the budget (each write counts whole), and what the unit rewrote so far is less than
// what rows would have cost it beyond their bytes. Rows from the start would have cost the
// effects' bytes (about the next write) and rowCost each; the claim has cost what was written
// and the next write. Past that the effects are moved to rows, once: whatever the number of
// records, a unit writes at most about twice what rows alone would have (rent until the rent paid
// would have bought the rows).
func (r *inlineRecord) fits(effects []Effect) bool {
	return r.written+r.token+encodedSize(effects) <= r.budget && r.written <= (len(r.effects)+len(effects))*rowCost
}

// rowCost is about what an effect row costs beyond its bytes, in bytes of WAL: its tuple header
// and four index entries when it is inserted, and its delete once it is sent
// (BenchmarkOneAtATimeRecords: 980 bytes per row of a 440-byte effect).
const rowCost = 512

// encodedSize is about the size of effects in the claim (store.EncodeEffects): their bytes and a
// few for each length.
func encodedSize(effects []Effect) int {
	n := 0
	for _, e := range effects {
		n += 8 + len(e.Kind) + len(e.Topic) + len(e.UUID) + len(e.Payload) + len(e.OrderingKey)
		for k, v := range e.Metadata {
			n += 2 + len(k) + len(v)
		}
	}
	return n
}

// takes tells whether effects are to be kept in the claim: those with the default ordering key
// of the source. The others are rows, which wait behind the earlier effects of their key (the
// order is per key: these and the claim's are of different keys).
func (r *inlineRecord) takes(effects []Effect) bool {
	key := outboxdriver.DefaultOrderingKey(r.src)
	for _, e := range effects {
		if e.OrderingKey != key {
			return false
		}
	}
	return true
}

// record writes effects into the claim, after those it holds; ok false when there is no claim.
func (r *inlineRecord) record(ctx context.Context, tx *sql.Tx, effects []Effect) (bool, error) {
	for try := 0; try < 2; try++ {
		next := append(slices.Clip(r.effects), effects...)
		token, ok, nested, err := r.store.EffectRecordInline(ctx, tx, r.src, next, r.token)
		if err != nil {
			return false, err
		}
		if ok {
			r.effects, r.token, r.unsure = next, token, r.unsure || nested
			r.written += token
			return true, nil
		}
		// The claim holds less than this unit wrote (a savepoint the handler rolled back undid
		// the writes since it began), or is gone: start again from what it holds.
		held, token, claimed, err := r.store.EffectReadInline(ctx, tx, r.src)
		if err != nil || !claimed {
			return false, err
		}
		r.effects, r.token, r.unsure = r.held(held), token, true
	}
	return false, fmt.Errorf("outbox: the side effects in the claim of %q for %q changed while they were written", r.src.ID, r.src.Consumer)
}

// held returns the effects this unit recorded that are among held (read from the claim).
func (r *inlineRecord) held(held []Effect) []Effect {
	seqs := seqsOf(held)
	var out []Effect
	for _, e := range r.effects {
		if seqs[e.Seq] {
			out = append(out, e)
		}
	}
	return out
}

// survivors returns the Seqs of the effects the claim holds, as the transaction will commit it.
// It takes the token of what the claim holds.
func (r *inlineRecord) survivors(ctx context.Context, tx *sql.Tx) (map[int]bool, error) {
	held, token, _, err := r.store.EffectReadInline(ctx, tx, r.src)
	if err != nil {
		return nil, err
	}
	r.token = token
	return seqsOf(held), nil
}

// seqsOf returns the positions (Seq) of effects.
func seqsOf(effects []Effect) map[int]bool {
	seqs := make(map[int]bool, len(effects))
	for _, e := range effects {
		seqs[e.Seq] = true
	}
	return seqs
}

// Commit sends COMMIT unless a record found the claim rolled back by user SQL: a client that sends
// COMMIT outside a transaction, which the server accepts with a warning, would report success for
// effects that never committed.
func (u *sqlUnit) Commit(ctx context.Context, _ []Effect) error {
	if u.ended {
		_ = u.tx.Rollback()
		u.settle(false)
		u.endSession(ctx)
		return u.endedError()
	}
	err := commitRolledBack(endedBySQL(u.tx.Commit()))
	// An unknown outcome counts as not committed: written again, a mark changes nothing.
	u.settle(err == nil)
	u.endSession(ctx)
	return err
}

func (u *sqlUnit) Rollback(ctx context.Context) error {
	if u.ended {
		_ = u.tx.Rollback()
		u.settle(false)
		u.endSession(ctx)
		return u.endedError()
	}
	err := endedBySQL(u.tx.Rollback())
	u.settle(false)
	u.endSession(ctx)
	return err
}

// commitRolledBack marks the refusal of a COMMIT in a transaction a failed statement aborted (a
// handler that swallowed the statement's error) as a known rollback: lib/pq sends ROLLBACK and
// returns ErrInFailedTransaction, pgx's stdlib answers "commit unexpectedly resulted in
// rollback", neither with a SQLSTATE. Taken for an unknown outcome, such a message was nacked,
// uncounted, on every delivery for ever.
func commitRolledBack(err error) error {
	// By their text: this package imports neither driver (lib/pq's import registers it).
	if err != nil && (strings.Contains(err.Error(), "pq: could not complete operation in a failed transaction") ||
		strings.Contains(err.Error(), "commit unexpectedly resulted in rollback")) {
		return rolledBackCommit{err}
	}
	return err
}

// rolledBackCommit is a COMMIT the server or the client turned into a ROLLBACK: SQLSTATE 40000
// (transaction_rollback), which rolledBack reads as known.
type rolledBackCommit struct{ err error }

func (e rolledBackCommit) Error() string {
	return "outbox: commit rolled back (a statement had failed): " + e.err.Error()
}
func (e rolledBackCommit) Unwrap() error    { return e.err }
func (e rolledBackCommit) SQLState() string { return "40000" }

// endedBySQL tells a COMMIT or ROLLBACK refused because the transaction had been ended by SQL
// sent through it from one lost in flight: by the client before sending it (lib/pq: "pq:
// unexpected transaction status idle", from the server's last ReadyForQuery), or by SQLite, in
// process, which never loses one ("cannot commit - no transaction is active"). It wraps
// ErrTxDone, as database/sql's own refusal of a finished *sql.Tx, so that it counts as the
// handler's doing rather than an unknown outcome.
func endedBySQL(err error) error {
	if err == nil {
		return nil
	}
	if msg := err.Error(); strings.HasPrefix(msg, "pq: unexpected transaction status") ||
		strings.Contains(msg, "cannot commit - no transaction is active") ||
		strings.Contains(msg, "cannot rollback - no transaction is active") {
		return fmt.Errorf("%w: the transaction was ended by SQL sent through it (COMMIT or ROLLBACK); the client refused to end it again: %w",
			ErrTxFinishedByHandler, errors.Join(outboxdriver.ErrTxDone, err))
	}
	return err
}

// keyUnlockTimeout bounds the release of a key's session lock after the unit's transaction.
const keyUnlockTimeout = 10 * time.Second

// endSession releases the lock of the claimed key, after the transaction so that a claim waiting
// for it finds the key committed, and gives the connection back. A connection whose lock may
// outlive the release is closed: the lock ends with its session.
func (u *sqlUnit) endSession(ctx context.Context) {
	u.sessionMu.Lock()
	defer u.sessionMu.Unlock()
	if u.stopExpiry != nil {
		u.stopExpiry()
	}
	if u.conn == nil {
		return
	}
	conn, keyed := u.conn, u.keyed
	u.conn, u.keyed = nil, nil
	if keyed != nil {
		rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), keyUnlockTimeout)
		defer cancel()
		if err := u.store.(outboxdriver.KeySessionLocker).KeyUnlock(rctx, conn, keyed.Scope, keyed.Key); err != nil {
			_ = conn.Raw(func(any) error { return driver.ErrBadConn })
		}
	}
	_ = conn.Close()
}

// expireKey releases the lock of the claimed key once the context of the unit's transaction has
// ended (HandlerTimeout): database/sql rolls the transaction back then, and it can never commit,
// but the lock, the session's, outlived it for as long as fn ran on (a call that ignores its
// context), every retry with the key told it was in flight. The connection stays the unit's
// until it ends.
func (u *sqlUnit) expireKey() {
	u.sessionMu.Lock()
	defer u.sessionMu.Unlock()
	if u.conn == nil || u.keyed == nil {
		return
	}
	keyed := u.keyed
	u.keyed = nil
	ctx, cancel := context.WithTimeout(context.Background(), keyUnlockTimeout)
	defer cancel()
	if err := u.store.(outboxdriver.KeySessionLocker).KeyUnlock(ctx, u.conn, keyed.Scope, keyed.Key); err != nil {
		_ = u.conn.Raw(func(any) error { return driver.ErrBadConn }) // the lock ends with its session
	}
}

// KeyClaim implements outboxdriver.KeyedUnitTx through the Store, when it keeps keys.
func (u *sqlUnit) KeyClaim(ctx context.Context, p outboxdriver.KeyClaimParams) (outboxdriver.KeyClaim, error) {
	ks, ok := u.store.(outboxdriver.KeyStore)
	if !ok {
		return outboxdriver.KeyClaim{}, outboxdriver.ErrKeysUnsupported
	}
	u.sessionMu.Lock()
	if u.conn != nil {
		// Set before the claim: it may take the lock and then fail.
		u.keyed = &p
	}
	u.sessionMu.Unlock()
	return ks.KeyClaim(ctx, u.tx, p)
}

// KeySave implements outboxdriver.KeyedUnitTx through the Store.
func (u *sqlUnit) KeySave(ctx context.Context, scope, key string, result []byte) error {
	ks, ok := u.store.(outboxdriver.KeyStore)
	if !ok {
		return outboxdriver.ErrKeysUnsupported
	}
	return ks.KeySave(ctx, u.tx, scope, key, result)
}

var _ outboxdriver.DelayedUnitTx = (*sqlUnit)(nil)

// RecordDelayed stores delayed effects in the transaction, through the store's DelayedStore; for
// a guarded unit only while its claim (or boundary mark) exists, as Record.
func (u *sqlUnit) RecordDelayed(ctx context.Context, effects []Effect) error {
	ds, ok := u.store.(outboxdriver.DelayedStore)
	if !ok {
		return ErrDelayUnsupported
	}
	if u.ended {
		return u.endedError()
	}
	if cs, ok := u.store.(outboxdriver.ClaimedDelayedStore); ok && u.guarded {
		err := cs.DelayedInsertClaimed(ctx, u.tx, effects[0].Source, effects)
		if errors.Is(err, outboxdriver.ErrClaimGone) {
			u.ended = true
			return u.endedError()
		}
		return err
	}
	return ds.DelayedInsert(ctx, u.tx, effects[0].Source, effects)
}

// CancelDelayed cancels delayed effects in the transaction, through the store's DelayedStore; for
// a guarded unit only while its claim (or boundary mark) exists: in autocommit the cancel would delete effects that
// other units committed, on its own.
func (u *sqlUnit) CancelDelayed(ctx context.Context, key string) (int, error) {
	ds, ok := u.store.(outboxdriver.DelayedStore)
	if !ok {
		return 0, ErrDelayUnsupported
	}
	if u.ended {
		return 0, u.endedError()
	}
	if cs, ok := u.store.(outboxdriver.ClaimedDelayedStore); ok && u.guarded {
		n, err := cs.DelayedCancelClaimed(ctx, u.tx, u.src, key)
		if errors.Is(err, outboxdriver.ErrClaimGone) {
			u.ended = true
			return 0, u.endedError()
		}
		return n, err
	}
	return ds.DelayedCancel(ctx, u.tx, key)
}
