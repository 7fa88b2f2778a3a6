package outboxpgx

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
)

// listen LISTENs on channel on a connection taken out of the pool (it does not count against the
// pool's size while it listens), calls wake once connected and on every notification, and returns
// when ctx is done or the connection is lost.
func (d Driver) listen(ctx context.Context, channel string, wake func()) error {
	pc, err := d.Pool.Acquire(ctx)
	if err != nil {
		if ctx.Err() != nil {
			return nil
		}
		return fmt.Errorf("acquire a connection to listen on %q: %w", channel, err)
	}
	conn := pc.Hijack()
	defer func() {
		cctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_ = conn.Close(cctx)
	}()
	if _, err := conn.Exec(ctx, "LISTEN "+pgx.Identifier{channel}.Sanitize()); err != nil {
		if ctx.Err() != nil {
			return nil
		}
		return fmt.Errorf("listen on %q: %w", channel, err)
	}
	// Connected: notifications sent before now were missed, so the relay looks once.
	wake()
	for {
		if _, err := conn.WaitForNotification(ctx); err != nil {
			if ctx.Err() != nil {
				return nil
			}
			return fmt.Errorf("listener connection on %q lost: %w", channel, err)
		}
		wake()
	}
}
