package outboxpgx_test

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/watermill-outbox/outbox"
	"github.com/watermill-outbox/outbox/drivers/outboxpgx"
	"github.com/watermill-outbox/outbox/outboxtest"
)

// InTx waited for a connection of the pool until HandlerTimeout even when the caller's context
// had ended (an HTTP client that went away): with a pool of one held by another unit, a caller
// that gave up after 100 ms still waited the whole HandlerTimeout.
func TestInTxWaitForAConnectionEndsWithTheCallersContext(t *testing.T) {
	pool := openPool(t, outboxtest.DSN(t), 1, nil)
	ob := ready(t, pool, outbox.Config{Publisher: &outboxtest.Recorder{}, HandlerTimeout: 10 * time.Second, RelayInterval: time.Hour})

	holding, release := make(chan struct{}), make(chan struct{})
	errHeld := errors.New("done holding the connection")
	held := make(chan error, 1)
	go func() {
		held <- outboxpgx.InTx(context.Background(), ob, func(context.Context, pgx.Tx) error {
			close(holding)
			<-release
			return errHeld
		})
	}()
	<-holding

	ctx, cancel := context.WithCancel(context.Background())
	stop := time.AfterFunc(100*time.Millisecond, cancel)
	defer stop.Stop()
	ran := false
	begun := time.Now()
	err := outboxpgx.InTx(ctx, ob, func(context.Context, pgx.Tx) error { ran = true; return nil })
	took := time.Since(begun)
	if !errors.Is(err, context.Canceled) || !strings.Contains(err.Error(), "database connection") || ran {
		t.Errorf("InTx with the caller's context cancelled while waiting: %v (fn ran: %v); want an error wrapping context.Canceled that names the wait for a database connection", err, ran)
	}
	if took > 2*time.Second {
		t.Errorf("InTx returned %s after it was called, %s after its context was cancelled; want at once", took, took-100*time.Millisecond)
	}

	close(release)
	if err := <-held; !errors.Is(err, errHeld) {
		t.Fatalf("the unit holding the connection: %v", err)
	}
	next, cancelNext := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancelNext()
	if err := outboxpgx.InTx(next, ob, func(ctx context.Context, tx pgx.Tx) error {
		_, err := tx.Exec(ctx, `INSERT INTO applied (message_id) VALUES ('next')`)
		return err
	}); err != nil {
		t.Errorf("the next unit: %v", err)
	}
	if s := pool.Stat(); s.AcquiredConns() != 0 || s.TotalConns() > 1 {
		t.Errorf("pool: %d acquired, %d open; want 0 and at most 1", s.AcquiredConns(), s.TotalConns())
	}
}
