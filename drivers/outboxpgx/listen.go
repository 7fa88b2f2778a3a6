package outboxpgx

import (
	"context"
	"errors"
	"fmt"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/watermill-outbox/outbox/internal/listencheck"
	"github.com/watermill-outbox/outbox/outboxdriver"
)

// listen LISTENs on channel on a connection of its own: one dialed with ListenDSN when set, else
// one taken out of the pool (it does not count against the pool's size while it listens). Once
// LISTEN succeeded it proves that it receives notifications: it sends one through the pool, the
// way the other instances' notifications come, and waits for it; a LISTEN through a pooler in
// transaction mode receives nothing, and returns an error wrapping outboxdriver.ErrListenerDeaf.
// It calls wake once proven and on every notification, and returns when ctx is done or the
// connection is lost.
func (d Driver) listen(ctx context.Context, channel string, wake func()) error {
	// The set-up (the connection, LISTEN, the notification sent through the pool) is bounded as
	// the ping is: on a server that accepts connections and never answers it waited for as long
	// as Run ran, neither failing (to be tried again) nor reaching the ping.
	setup := time.Duration(listenPingTimeout.Load())
	sctx, cancel := context.WithTimeout(ctx, setup)
	conn, err := d.listenConn(sctx)
	cancel()
	if err != nil {
		if ctx.Err() != nil {
			return nil
		}
		return fmt.Errorf("connect to listen on %q (waited up to %s): %w", channel, setup, err)
	}
	defer func() {
		cctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_ = conn.Close(cctx)
	}()
	sctx, cancel = context.WithTimeout(ctx, setup)
	_, err = conn.Exec(sctx, "LISTEN "+pgx.Identifier{channel}.Sanitize(), pgx.QueryExecModeSimpleProtocol)
	cancel()
	if err != nil {
		if ctx.Err() != nil {
			return nil
		}
		return fmt.Errorf("listen on %q (waited up to %s): %w", channel, setup, err)
	}
	if err := d.proveListener(ctx, conn, channel); err != nil || ctx.Err() != nil {
		return err
	}
	// Connected: notifications sent before now were missed, so the relay looks once.
	wake()
	for {
		// Quiet for listenIdle, the connection is pinged, as the database/sql listener does: a
		// connection whose peer is gone without a word (a half-open TCP connection) was waited
		// on until the kernel's keepalive gave up, reported connected all the while.
		wctx, cancel := context.WithTimeout(ctx, time.Duration(listenIdle.Load()))
		_, err := conn.WaitForNotification(wctx)
		quiet := errors.Is(wctx.Err(), context.DeadlineExceeded)
		cancel()
		switch {
		case ctx.Err() != nil:
			return nil
		case err != nil && quiet:
			pctx, cancel := context.WithTimeout(ctx, time.Duration(listenPingTimeout.Load()))
			err = conn.Ping(pctx)
			cancel()
			if ctx.Err() != nil {
				return nil
			}
			if err != nil {
				return fmt.Errorf("listener connection on %q: ping: %w", channel, err)
			}
		case err != nil:
			return fmt.Errorf("listener connection on %q lost: %w", channel, err)
		default:
			wake()
		}
	}
}

// listenIdle is how long the listener waits for a notification before it pings its connection,
// and listenPingTimeout how long the ping may take (the tests shorten them).
var listenIdle, listenPingTimeout atomic.Int64

func init() {
	listenIdle.Store(int64(90 * time.Second))
	listenPingTimeout.Store(int64(30 * time.Second))
}

// proveListener sends a notification on channel through the pool and waits for it on conn (see
// listencheck.Token: a token of this attempt, so that a notification that reached conn by
// another way proves nothing).
func (d Driver) proveListener(ctx context.Context, conn *pgx.Conn, channel string) error {
	token, err := listencheck.Token()
	if err != nil {
		return err
	}
	// The channel is a validated identifier and the token hex: a literal has no parameters to
	// bind, in any mode.
	nctx, cancel := context.WithTimeout(ctx, time.Duration(listenPingTimeout.Load()))
	_, err = d.Pool.Exec(nctx, "SELECT pg_notify('"+channel+"', '"+token+"')", pgx.QueryExecModeSimpleProtocol)
	cancel()
	if err != nil {
		if ctx.Err() != nil {
			return nil
		}
		return fmt.Errorf("send the listener's own notification on %q (waited up to %s): %w", channel, time.Duration(listenPingTimeout.Load()), err)
	}
	pctx, cancel := context.WithTimeout(ctx, listencheck.Timeout)
	defer cancel()
	for {
		n, err := conn.WaitForNotification(pctx)
		switch {
		case ctx.Err() != nil:
			return nil
		case err != nil && errors.Is(pctx.Err(), context.DeadlineExceeded):
			return fmt.Errorf("%w: LISTEN on %q succeeded, but a notification sent on it through the pool did not arrive within %s: "+
				"the listener's connection likely goes through a pooler in transaction mode; give it a connection to PostgreSQL "+
				"directly (WithListenDSN), or to a pooler in session mode", outboxdriver.ErrListenerDeaf, channel, listencheck.Timeout)
		case err != nil:
			return fmt.Errorf("listener connection on %q lost: %w", channel, err)
		case n.Payload == token:
			return nil
		}
	}
}

// listenConn returns the listener's connection: dialed with ListenDSN, or taken out of the pool.
func (d Driver) listenConn(ctx context.Context) (*pgx.Conn, error) {
	if d.ListenDSN != "" {
		return pgx.Connect(ctx, d.ListenDSN)
	}
	pc, err := d.Pool.Acquire(ctx)
	if err != nil {
		return nil, fmt.Errorf("acquire a connection: %w", err)
	}
	return pc.Hijack(), nil
}
