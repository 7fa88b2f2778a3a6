package outbox

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"reflect"
	"sync"
	"time"

	"github.com/watermill-outbox/outbox/outboxdriver"
)

// beginStall is how long a unit's connection and BEGIN go unanswered before the gate suspects
// that the database stalls (see dbGate.suspect). Longer than opening a connection and BEGIN take
// on a database that answers; short enough that the units beginning meanwhile, each with a
// connection that hangs, are few. The claim after BEGIN is never watched: in the pessimistic
// mode it waits, by design, for a copy being handled elsewhere, and every such wait taken for a
// stall held all the Outbox's units for a ping.
const beginStall = 500 * time.Millisecond

// beginWatch watches the beginning of the units of work that run on database/sql (sqlUnits): a
// connection and BEGIN unanswered for beginStall have the gate probe the database while the units
// after them wait. A server that stalls fails nothing: without the watch every unit and InTx call
// meanwhile opened one more connection that hung.
type beginWatch struct {
	gate *dbGate
	db   *sql.DB
	// blind: the driver may hold a unit past its context while it connects or sends BEGIN, or is
	// not known not to. lib/pq reads the answer to its startup message, and to BEGIN, without
	// looking at the context: on a server that stalls (or a link that drops what it carries) it
	// returns when the network gives up. Such a BEGIN runs in a goroutine of its own, which the
	// unit leaves at its context's end; otherwise its consumer would be held for the whole outage,
	// with the other members' messages behind it. Asked at the first unit, not in New: a
	// database/sql DB that New is given need not be usable yet (a zero sql.DB in an example, a
	// DB that a test replaces), and asking its driver then would panic. Nil: not blind.
	blind func() bool
}

// newBeginWatch returns the watch of gate's units on db; nil without a gate.
func newBeginWatch(gate *dbGate, db *sql.DB) *beginWatch {
	if gate == nil {
		return nil
	}
	return &beginWatch{gate: gate, db: db, blind: sync.OnceValue(func() bool { return !honoursContext(db) })}
}

// honoursContext tells a database/sql driver known to return at its context's end while it
// connects and begins a transaction, whatever the server does: pgx's stdlib, go-sql-driver/mysql
// (both close or time out the socket when the context ends) and the SQLite drivers (no network).
// Told by the driver's type, package path and name, since the library imports none of them; a
// driver wrapped by another (tracing) is not known, and is watched as a blind one.
func honoursContext(db *sql.DB) bool {
	t := reflect.TypeOf(db.Driver())
	if t == nil || t.Kind() != reflect.Pointer {
		return false
	}
	t = t.Elem()
	return contextHonouringDrivers[t.PkgPath()+"."+t.Name()]
}

// contextHonouringDrivers are the drivers honoursContext knows, by package path and type name.
var contextHonouringDrivers = map[string]bool{
	"github.com/jackc/pgx/v5/stdlib.Driver":      true,
	"github.com/go-sql-driver/mysql.MySQLDriver": true,
	"modernc.org/sqlite.Driver":                  true,
	"github.com/mattn/go-sqlite3.SQLiteDriver":   true,
}

func (w *beginWatch) stalled() {
	w.gate.suspect(fmt.Errorf("a connection and BEGIN had no answer within %s", beginStall))
}

// watchBegin runs begin (taking a connection and sending BEGIN) for a unit of work under w, and
// returns what it returns; nothing more runs under the watch. With a driver that honours the
// context, only the opening of a connection is watched (the pool has no idle one: a unit on a
// pooled connection pays a look at the pool's counters), without a goroutine: the unit returns at
// its context's end whatever the server does, and a pooled connection that hangs is told by that
// deadline (see Outbox.beginUnit). With a blind driver, begin runs in a goroutine of its own that
// the unit leaves when ctx ends; discard then undoes what begin returns after all.
func watchBegin[T any](ctx context.Context, w *beginWatch, begin func(context.Context) (T, error), discard func(T)) (T, error) {
	if w == nil {
		return begin(ctx)
	}
	if w.blind == nil || !w.blind() {
		if w.db.Stats().Idle == 0 {
			watch := time.AfterFunc(beginStall, w.stalled)
			defer watch.Stop()
		}
		v, err := begin(ctx)
		if err != nil && errors.Is(err, context.DeadlineExceeded) {
			// A pooled connection to a server that stalls answers at the deadline only.
			w.gate.suspect(err)
		}
		return v, err
	}
	watch := time.AfterFunc(beginStall, w.stalled)
	defer watch.Stop()
	type begun struct {
		v   T
		err error
	}
	res := make(chan begun, 1)
	var mu sync.Mutex
	gaveUp := false
	go func() {
		v, err := begin(ctx)
		mu.Lock()
		left := gaveUp
		if !left {
			res <- begun{v, err}
		}
		mu.Unlock()
		if left && err == nil {
			discard(v)
		}
	}()
	var r begun
	select {
	case r = <-res:
	case <-ctx.Done():
		mu.Lock()
		select {
		case r = <-res: // it returned meanwhile
		default:
			gaveUp = true
			r.err = fmt.Errorf("begin transaction: no answer (a connection, BEGIN) before the context ended: %w", ctx.Err())
		}
		mu.Unlock()
	}
	if r.err != nil && errors.Is(r.err, context.DeadlineExceeded) {
		w.gate.suspect(r.err)
	}
	return r.v, r.err
}

// watchedUnits is a UnitStore that does not tell its dials (outboxdriver.DialWatcher), watched as
// a blind driver is: the whole of its BeginUnit, the claim included, since it runs in one call.
type watchedUnits struct {
	outboxdriver.UnitStore
	watch *beginWatch
}

type unitBegun struct {
	tx    outboxdriver.UnitTx
	claim outboxdriver.Claim
}

func (u watchedUnits) BeginUnit(ctx context.Context, src *Source) (outboxdriver.UnitTx, outboxdriver.Claim, error) {
	b, err := watchBegin(ctx, u.watch, func(ctx context.Context) (unitBegun, error) {
		tx, claim, err := u.UnitStore.BeginUnit(ctx, src)
		return unitBegun{tx, claim}, err
	}, func(b unitBegun) { _ = b.tx.Rollback(context.Background()) })
	return b.tx, b.claim, err
}
