package outbox

import (
	"context"
	"database/sql"
	"runtime"
	"slices"
	"sync"
	"time"
	"weak"

	"github.com/watermill-outbox/outbox/outboxdriver"
)

// The Outboxes of one database share its gate: the members of a tenant.Set with a schema (or a
// table prefix) each on one pool, or the Outboxes a service builds itself on one *sql.DB. With a
// gate each, an outage of that one database met a probe of every Outbox at every backoff step,
// and the work of all came back at once (200 schemas: 200 connection attempts per step). One
// gate probes once for all, and its first success lets the work of all go on.
//
// A gate is shared by the Outboxes of one pool with the same ReconnectDelay and
// ReconnectDelayMax: Config.DB, or the pool the store names (outboxdriver.PoolIdentifier: the pgx
// form's pgxpool, which each Outbox wraps in a *sql.DB of its own). It holds its Outboxes weakly: one the service dropped (a tenant removed)
// stops hearing of outages, and a gate no Outbox holds is collected.

// gateKey identifies a shared gate.
type gateKey struct {
	pool     any // Config.DB, or what the store names
	min, max time.Duration
}

var sharedGates = struct {
	sync.Mutex
	m map[gateKey]weak.Pointer[dbGate]
}{m: map[gateKey]weak.Pointer[dbGate]{}}

// gateUsers are the Outboxes that share a gate, held weakly.
type gateUsers struct {
	mu    sync.Mutex
	users []weak.Pointer[Outbox]
}

// live returns the Outboxes still held by the service, dropping the others.
func (u *gateUsers) live() []*Outbox {
	u.mu.Lock()
	defer u.mu.Unlock()
	out := make([]*Outbox, 0, len(u.users))
	kept := u.users[:0]
	for _, w := range u.users {
		if o := w.Value(); o != nil {
			out = append(out, o)
			kept = append(kept, w)
		}
	}
	clear(u.users[len(kept):])
	u.users = kept
	return out
}

func (u *gateUsers) add(o *Outbox) {
	u.mu.Lock()
	defer u.mu.Unlock()
	u.users = append(u.users, weak.Make(o))
}

// remove takes o off: it is closed.
func (u *gateUsers) remove(o *Outbox) {
	u.mu.Lock()
	defer u.mu.Unlock()
	w := weak.Make(o)
	u.users = slices.DeleteFunc(u.users, func(x weak.Pointer[Outbox]) bool { return x == w })
}

// first returns the first Outbox still held by the service (nil when none is), without the
// allocation of live: the stores of one pool classify errors alike, and the classification runs
// for every failed call of every member.
func (u *gateUsers) first() *Outbox {
	u.mu.Lock()
	defer u.mu.Unlock()
	for _, w := range u.users {
		if o := w.Value(); o != nil {
			return o
		}
	}
	return nil
}

// ping probes the database through a user's handle (each may have its own on one pool, closed
// with it: a handle closed as the probe took it is passed over for the next), or through db when
// none is left.
func (u *gateUsers) ping(ctx context.Context, db *sql.DB) error {
	us := u.live()
	for i, o := range us {
		err := o.db.PingContext(ctx)
		if err == nil || i == len(us)-1 || err.Error() != errDBClosed {
			return err
		}
	}
	return db.PingContext(ctx)
}

// errDBClosed is what database/sql returns for a handle that was closed.
const errDBClosed = "sql: database is closed"

// joinGate gives o the gate of its database, shared with the other Outboxes of cfg.DB (nil when
// ReconnectDelay is negative: no gate). The gate asks o (how to classify an error, whether its
// pool is full) and tells it of outages once o is a user of it (gateUsers.add), when o is ready
// to be called from the work of the others.
func (o *Outbox) joinGate() {
	cfg := o.cfg
	if cfg.ReconnectDelay < 0 || cfg.DB == nil {
		return
	}
	key := gateKey{pool: cfg.DB, min: cfg.ReconnectDelay, max: cfg.ReconnectDelayMax}
	if pi, ok := o.store.(outboxdriver.PoolIdentifier); ok && pi.PoolIdentity() != nil {
		key.pool = pi.PoolIdentity()
	}
	sharedGates.Lock()
	defer sharedGates.Unlock()
	if w, ok := sharedGates.m[key]; ok {
		if g := w.Value(); g != nil {
			o.gate = g
			return
		}
	}
	users := &gateUsers{}
	db := cfg.DB
	g := &dbGate{minDelay: cfg.ReconnectDelay, maxDelay: cfg.ReconnectDelayMax, users: users,
		probe: func(ctx context.Context) error { return users.ping(ctx, db) }}
	g.unreachable = func(err error) bool {
		if unreachable(err) {
			return true
		}
		u := users.first()
		return u != nil && u.unreachable(err)
	}
	g.onAttempt = func() {
		// Once per member name: the Outboxes of a pool without one (several sets of tables)
		// share one series, which counted every attempt once per Outbox.
		var counted []string
		for _, u := range users.live() {
			if m := u.tel.memberName(); !slices.Contains(counted, m) {
				counted = append(counted, m)
				u.gateAttempt()
			}
		}
	}
	g.onChange = func(since time.Time, attempts int64, err error) {
		for _, u := range users.live() {
			u.reachabilityChanged(since, attempts, err)
		}
	}
	g.poolFull = func() bool {
		for _, u := range users.live() {
			if u.poolFull() {
				return true
			}
		}
		return false
	}
	o.gate = g
	sharedGates.m[key] = weak.Make(g)
	runtime.AddCleanup(g, func(key gateKey) {
		sharedGates.Lock()
		defer sharedGates.Unlock()
		if w, ok := sharedGates.m[key]; ok && w.Value() == nil {
			delete(sharedGates.m, key)
		}
	}, key)
}
