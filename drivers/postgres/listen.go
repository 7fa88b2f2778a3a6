package postgres

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"time"

	"github.com/lib/pq"
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

// listen holds a dedicated connection (lib/pq's Listener, which reconnects by itself) that LISTENs
// on channel and calls wake for every notification, and after every reconnect, since
// notifications sent while it was away are lost.
func listen(dsn, channel string) func(ctx context.Context, wake func()) error {
	return func(ctx context.Context, wake func()) error {
		lost := make(chan error, 1)
		l := pq.NewListener(dsn, 100*time.Millisecond, 10*time.Second, func(ev pq.ListenerEventType, err error) {
			if ev == pq.ListenerEventDisconnected {
				select {
				case lost <- err:
				default:
				}
			}
		})
		defer func() { _ = l.Close() }()
		if err := l.Listen(channel); err != nil {
			return fmt.Errorf("listen on %q: %w", channel, err)
		}
		// Connected: notifications sent before now were missed, so the relay looks once (which
		// also tells the caller that the listener is up).
		wake()
		for {
			select {
			case <-ctx.Done():
				return nil
			case err := <-lost:
				// The caller reconnects (and reports the listener down meanwhile).
				return fmt.Errorf("listener connection on %q lost: %w", channel, err)
			case _, ok := <-l.NotificationChannel():
				if !ok {
					return nil
				}
				// A nil notification means the connection was re-established.
				wake()
			case <-time.After(90 * time.Second):
				// Check the connection now and then, so that a dead one is noticed and replaced.
				_ = l.Ping()
			}
		}
	}
}
