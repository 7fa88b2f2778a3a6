package outbox

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/watermill-outbox/outbox/outboxdriver"
)

type dueKey struct{}
type cancelKeyKey struct{}

// WithDelay returns a context in which the side effects recorded with Publish and Record are
// delayed by d, counted from the call: they commit with the unit of work like any other, are
// not sent after its commit, and are sent by the relay once due, with their UUIDs unchanged.
// Until then they hold back no other effect, and a later unit of work can cancel them (see
// WithCancelKey). Once due, an effect takes its place behind the effects pending with its
// ordering key at that moment: delayed effects are ordered by their due time, not by the time
// they were recorded. A delay of zero or less makes them due at once (still sent by the relay).
func WithDelay(ctx context.Context, d time.Duration) context.Context {
	return WithDelayUntil(ctx, time.Now().Add(d))
}

// WithDelayUntil is WithDelay with the due time given as a point in time, by this process's
// clock. The store keeps it as the delay from the insert, by the database's clock (the one the
// relay compares with), so that a skew between the two clocks does not move it.
func WithDelayUntil(ctx context.Context, t time.Time) context.Context {
	return context.WithValue(ctx, dueKey{}, t)
}

// WithCancelKey returns a context in which the delayed side effects recorded with Publish and
// Record (in a context with WithDelay or WithDelayUntil; without, they fail with
// ErrCancelKeyWithoutDelay) can be cancelled by key with CancelDelayed. The key is the
// application's to choose ("payment-timeout/" + order ID); several effects may share it.
func WithCancelKey(ctx context.Context, key string) context.Context {
	return context.WithValue(ctx, cancelKeyKey{}, key)
}

// CancelDelayed cancels, in the unit of work of ctx, the delayed side effects recorded with
// cancel key key that are not due yet, or due but not yet taken by a relay, and returns how many
// it cancelled. The cancel commits (or rolls back) with the unit of work's other changes: a
// cancelled effect is never sent. Zero means that no such effect was waiting: it was never
// recorded, was cancelled before, or is already on its way (taken by a relay once due, then sent
// at least once); the handler decides what that means for its business (a refund, say). The
// effects it cancels stay locked until the unit of work ends, and the relay leaves them alone
// meanwhile.
func CancelDelayed(ctx context.Context, key string) (int, error) {
	u := unitFrom(ctx)
	if u == nil {
		return 0, ErrNoUnitOfWork
	}
	if err := validateName(key); err != nil {
		return 0, fmt.Errorf("outbox: cancel key: %w", err)
	}
	dt, ok := u.tx.(outboxdriver.DelayedUnitTx)
	if !ok {
		return 0, ErrDelayUnsupported
	}
	u.mu.Lock()
	defer u.mu.Unlock()
	if u.finished {
		return 0, ErrUnitOfWorkFinished
	}
	n, err := dt.CancelDelayed(ctx, key)
	if err != nil {
		return 0, fmt.Errorf("outbox: cancel delayed side effects %q: %w", key, err)
	}
	return n, nil
}

// promoteBatch bounds the delayed effects one statement moves; the relay moves more in turns.
const promoteBatch = 1000

// overdueRetry is how soon the relay looks again at a due delayed effect it could not move (a
// unit of work that cancels it holds it): the cancel most likely commits and takes it away.
const overdueRetry = time.Second

// promoteDelayed moves the due delayed effects into pending ones, before the relay claims (or
// when a claim found one due), arms the wake-up for the next due time, and returns how many it
// moved. A failure is logged: it holds up the delayed effects only, not the relay's round. One
// that says the database cannot be reached is returned, and ends the relay's pass: its claim
// would only try to connect again.
func (o *Outbox) promoteDelayed(ctx context.Context) (int, error) {
	ds, ok := o.store.(outboxdriver.DelayedStore)
	if !ok {
		return 0, nil
	}
	parent := ctx
	ctx, cancel := context.WithTimeout(ctx, storeTimeout)
	defer cancel()
	total := 0
	for ctx.Err() == nil {
		moved, next, waiting, err := ds.DelayedPromote(ctx, promoteBatch)
		if err != nil {
			// A shutdown is no failure, however the driver reports the statement it cancelled
			// (lib/pq: the server's 57014, not the context's error).
			if parent.Err() == nil {
				if o.unreachable(err) {
					// The relay's pass stops here, and the gate reports the outage.
					return total, err
				}
				o.relayErrored(ctx, err)
				o.logger.Error("Moving due delayed side effects failed; the relay tries again at its next pass", err, nil)
			}
			return total, nil
		}
		total += moved
		if moved > 0 {
			o.tel.delayedPromoted.Add(ctx, int64(moved), o.tel.own())
		}
		if moved == promoteBatch {
			continue
		}
		if waiting {
			if next <= 0 && moved == 0 {
				next = overdueRetry
			}
			o.due.arm(time.Now().Add(max(next, 0)))
		}
		return total, nil
	}
	return total, nil
}

// dueTimer wakes the relay when the earliest delayed effect this process knows of is due, so
// that it is sent on time whatever RelayInterval is.
type dueTimer struct {
	kick func()

	mu sync.Mutex
	t  *time.Timer
	at time.Time // when t fires; zero when it is not armed

	fired atomic.Bool // t fired since the relay last asked (takeFired)
}

// takeFired tells whether the timer fired since the last call: a delayed effect fell due during
// a relay pass, which moves it then rather than after the pass (a backlog may take minutes).
func (d *dueTimer) takeFired() bool { return d.fired.Swap(false) }

// dueSlack is added to a due time: the database's clock decides, in milliseconds.
const dueSlack = 5 * time.Millisecond

// arm makes the timer fire at at, unless it fires earlier already.
func (d *dueTimer) arm(at time.Time) {
	at = at.Add(dueSlack)
	d.mu.Lock()
	defer d.mu.Unlock()
	if !d.at.IsZero() && !d.at.After(at) && d.at.After(time.Now()) {
		return
	}
	d.at = at
	if d.t == nil {
		d.t = time.AfterFunc(time.Until(at), d.fire)
		return
	}
	d.t.Reset(time.Until(at))
}

func (d *dueTimer) fire() {
	d.mu.Lock()
	d.at = time.Time{}
	d.mu.Unlock()
	d.fired.Store(true)
	d.kick()
}

// stop stops the timer (Run returned: no relay to wake).
func (d *dueTimer) stop() {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.t != nil {
		d.t.Stop()
	}
	d.at = time.Time{}
}
