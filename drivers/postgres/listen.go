package postgres

import (
	"context"
	"crypto/sha256"
	"database/sql"
	"encoding/hex"
	"fmt"
	"net"
	"sync"
	"time"

	"github.com/lib/pq"

	"github.com/watermill-outbox/outbox/internal/listencheck"
	"github.com/watermill-outbox/outbox/outboxdriver"
)

// maxChannelBytes is PostgreSQL's identifier limit (NAMEDATALEN - 1), which channel names obey:
// LISTEN truncates a longer name silently and NOTIFY refuses it.
const maxChannelBytes = 63

// notifyChannel is the channel of the relay wake-ups of one set of tables: schema_prefixrelay, or,
// when that would be longer than a channel name may be (a schema and prefix of 40 characters
// each), a name derived from a hash of both.
func notifyChannel(schema, prefix string) string {
	if name := schema + "_" + prefix + "relay"; len(name) <= maxChannelBytes {
		return name
	}
	sum := sha256.Sum256([]byte(schema + "." + prefix))
	return "outbox_relay_" + hex.EncodeToString(sum[:12])
}

// listenRetry is how long lib/pq's Listener waits after a failed connection attempt; listen
// gives up on the first (the caller tries again), and waits this long at most for the
// Listener's goroutine to end.
const listenRetry = 100 * time.Millisecond

// pingTimeout bounds the check of an idle listener connection: one that does not answer in time
// is closed (and replaced by the caller).
const pingTimeout = 30 * time.Second

// proveListener sends a notification on channel through db, the way the other instances'
// notifications come, and waits for it on notes: a LISTEN that succeeded through a pooler in
// transaction mode receives nothing, and must not pass for connected. The notification carries
// a token of this attempt (see listencheck.Token).
// lost reports the connection's loss meanwhile. It returns nil when ctx ends; an error it returns
// after ctx ended (its statement or connection failed because of that) is the caller's to judge.
func proveListener(ctx context.Context, db *sql.DB, channel string, notes <-chan *pq.Notification, lost <-chan error) error {
	token, err := listencheck.Token()
	if err != nil {
		return err
	}
	// A literal (the channel is a validated identifier, the token hex): no parameters to bind,
	// whatever the driver.
	if _, err := db.ExecContext(ctx, "SELECT pg_notify('"+channel+"', '"+token+"')"); err != nil {
		return fmt.Errorf("send the listener's own notification on %q: %w", channel, err)
	}
	t := time.NewTimer(listencheck.Timeout)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return nil
		case err := <-lost:
			return fmt.Errorf("listener connection on %q lost: %w", channel, err)
		case n := <-notes:
			if n != nil && n.Extra == token {
				return nil
			}
		case <-t.C:
			return fmt.Errorf("%w: LISTEN on %q succeeded, but a notification sent on it through the database connection did not arrive within %s: "+
				"the listener's connection likely goes through a pooler in transaction mode; point ListenDSN at PostgreSQL directly "+
				"(or at a pooler in session mode)", outboxdriver.ErrListenerDeaf, channel, listencheck.Timeout)
		}
	}
}

// listen holds a dedicated connection (lib/pq's Listener) that LISTENs on channel and calls wake
// for every notification, and once connected, since notifications sent before were missed. It
// returns nil when ctx is done, and an error when the connection cannot be made or is lost (the
// caller listens again, and reports the listener down meanwhile). The Listener ignores contexts
// and waits for a connection without end, holding its lock while it dials: the connections it
// dials are closed when ctx ends (which unblocks it), and whatever it started has ended when
// listen returns.
//
// Once LISTEN succeeded, the listener proves that it receives notifications (proveListener); when
// it does not, listen returns an error wrapping outboxdriver.ErrListenerDeaf.
func listen(db *sql.DB, dsn, channel string) func(ctx context.Context, wake func()) error {
	return func(ctx context.Context, wake func()) error {
		err := listenUntil(ctx, db, dsn, channel, wake)
		if ctx.Err() != nil {
			// Whatever failed once ctx ended failed because it ended: its connections are
			// closed then (a dial, LISTEN, the own notification, a ping, a read), and select
			// picks among ready cases at random.
			return nil
		}
		return err
	}
}

// listenUntil is listen's work: it returns when ctx ends or with the error that ended it.
func listenUntil(ctx context.Context, db *sql.DB, dsn, channel string, wake func()) error {
	d := newClosingDialer()
	failed := make(chan error, 1)
	l := pq.NewDialListener(d, dsn, listenRetry, listenRetry, func(ev pq.ListenerEventType, err error) {
		if ev == pq.ListenerEventDisconnected || ev == pq.ListenerEventConnectionAttemptFailed {
			select {
			case failed <- err:
			default:
			}
		}
	})
	stopWatch := context.AfterFunc(ctx, d.close)
	listened := make(chan error, 1)
	go func() { listened <- l.Listen(channel) }()
	defer func() {
		stopWatch()
		d.close() // a dial or a statement in flight fails, so that Close gets the Listener's lock
		_ = l.Close()
		<-listened // Close ends a Listen still waiting for a connection
		drain(l.NotificationChannel())
	}()
	select {
	case <-ctx.Done():
		return nil
	case err := <-failed:
		return fmt.Errorf("connect to listen on %q: %w", channel, redactErr(err, dsn))
	case err := <-listened:
		listened <- err // for the deferred wait
		if err != nil {
			return fmt.Errorf("listen on %q: %w", channel, redactErr(err, dsn))
		}
	}
	if err := proveListener(ctx, db, channel, l.NotificationChannel(), failed); err != nil {
		return redactErr(err, dsn)
	}
	if ctx.Err() != nil {
		return nil // proveListener returns nil when ctx ends: no wake then
	}
	wake()
	for {
		select {
		case <-ctx.Done():
			return nil
		case err := <-failed:
			// Lost: the caller reconnects (and reports the listener down meanwhile).
			return fmt.Errorf("listener connection on %q lost: %w", channel, redactErr(err, dsn))
		case _, ok := <-l.NotificationChannel():
			if !ok {
				return nil
			}
			wake()
		case <-time.After(90 * time.Second):
			// Check the connection now and then, so that a dead one is noticed and replaced.
			t := time.AfterFunc(pingTimeout, d.close)
			err := l.Ping()
			t.Stop()
			if err != nil {
				return fmt.Errorf("listener connection on %q: ping: %w", channel, redactErr(err, dsn))
			}
		}
	}
}

// drain reads notifications until the Listener closes the channel (its goroutine has ended),
// waiting for that at most a few times its retry interval.
func drain(ch <-chan *pq.Notification) {
	timeout := time.After(10 * listenRetry)
	for {
		select {
		case _, ok := <-ch:
			if !ok {
				return
			}
		case <-timeout:
			return
		}
	}
}

// closingDialer dials the Listener's connections and closes all of them, and any dial in
// progress, when close is called: lib/pq's Listener takes no context.
type closingDialer struct {
	ctx    context.Context
	cancel context.CancelFunc
	mu     sync.Mutex
	conns  []net.Conn
}

func newClosingDialer() *closingDialer {
	ctx, cancel := context.WithCancel(context.Background())
	return &closingDialer{ctx: ctx, cancel: cancel}
}

func (d *closingDialer) Dial(network, address string) (net.Conn, error) {
	return d.DialContext(context.Background(), network, address)
}

func (d *closingDialer) DialTimeout(network, address string, timeout time.Duration) (net.Conn, error) {
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	return d.DialContext(ctx, network, address)
}

func (d *closingDialer) DialContext(ctx context.Context, network, address string) (net.Conn, error) {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	stop := context.AfterFunc(d.ctx, cancel)
	defer stop()
	var nd net.Dialer
	c, err := nd.DialContext(ctx, network, address)
	if err != nil {
		return nil, err
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.ctx.Err() != nil {
		_ = c.Close()
		return nil, fmt.Errorf("dial %s: the listener is closing", address)
	}
	d.conns = append(d.conns, c)
	return c, nil
}

// close closes every connection dialed and fails the dials in progress and to come.
func (d *closingDialer) close() {
	d.cancel()
	d.mu.Lock()
	defer d.mu.Unlock()
	for _, c := range d.conns {
		_ = c.Close()
	}
	d.conns = nil
}
