package postgres

import (
	"context"
	"fmt"
	"time"

	"github.com/lib/pq"
)

// notifyChannel is the channel of the relay wake-ups of one set of tables.
func notifyChannel(schema, prefix string) string { return schema + "_" + prefix + "relay" }

// listen holds a dedicated connection (lib/pq's Listener, which reconnects by itself) that LISTENs
// on channel and calls wake for every notification, and after every reconnect, since
// notifications sent while it was away are lost.
func listen(dsn, channel string) func(ctx context.Context, wake func()) error {
	return func(ctx context.Context, wake func()) error {
		l := pq.NewListener(dsn, 100*time.Millisecond, 10*time.Second, nil)
		defer func() { _ = l.Close() }()
		if err := l.Listen(channel); err != nil {
			return fmt.Errorf("listen on %q: %w", channel, err)
		}
		for {
			select {
			case <-ctx.Done():
				return nil
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
