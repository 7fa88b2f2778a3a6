package outbox_test

import (
	"context"
	"database/sql"
	"errors"
	"strings"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/watermill-outbox/outbox"
)

// errHeld ends the unit that held the only connection.
var errHeld = errors.New("done holding the connection")

// InTx waited for a pooled connection until HandlerTimeout even when the caller's context had
// ended (an HTTP client that went away): with a pool of one held by another unit, a caller that
// gave up after 100 ms still waited the whole HandlerTimeout. The wait ends with the caller's
// context; the transaction, once begun, does not (see InTx).
func TestInTxWaitForAConnectionEndsWithTheCallersContext(t *testing.T) {
	e := newEnv(t)
	db, err := sql.Open("postgres", e.dsn)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = db.Close() })
	db.SetMaxOpenConns(1)
	ob := e.newOutbox(func(c *outbox.Config) { c.DB = db; c.HandlerTimeout = 10 * time.Second })

	holding, release := make(chan struct{}), make(chan struct{})
	held := make(chan error, 1)
	go func() {
		held <- ob.InTx(context.Background(), func(ctx context.Context, tx *sql.Tx) error {
			close(holding)
			<-release
			return errHeld
		})
	}()
	<-holding
	leaks := goleak.IgnoreCurrent()

	ctx, cancel := context.WithCancel(context.Background())
	stop := time.AfterFunc(100*time.Millisecond, cancel)
	defer stop.Stop()
	ran := false
	begun := time.Now()
	err = ob.InTx(ctx, func(context.Context, *sql.Tx) error { ran = true; return nil })
	took := time.Since(begun)
	if !errors.Is(err, context.Canceled) || !strings.Contains(err.Error(), "database connection") || ran {
		t.Errorf("InTx with the caller's context cancelled while waiting: %v (fn ran: %v); want an error wrapping context.Canceled that names the wait for a database connection", err, ran)
	}
	t.Logf("InTx returned %s after its context was cancelled: %v", took-100*time.Millisecond, err)
	if took > 2*time.Second {
		t.Errorf("InTx returned %s after it was called, %s after its context was cancelled; want at once", took, took-100*time.Millisecond)
	}

	close(release)
	if err := <-held; !errors.Is(err, errHeld) {
		t.Fatalf("the unit holding the connection: %v", err)
	}
	// The pool is whole: no connection is held or lost, and the next unit gets one at once.
	waitFor(t, "the connection back in the pool", func() bool { return db.Stats().InUse == 0 })
	if s := db.Stats(); s.OpenConnections > 1 {
		t.Errorf("pool: %d connections open; want at most 1", s.OpenConnections)
	}
	next, cancelNext := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancelNext()
	if err := ob.InTx(next, func(ctx context.Context, tx *sql.Tx) error {
		_, err := tx.ExecContext(ctx, `INSERT INTO applied (message_id) VALUES ('next')`)
		return err
	}); err != nil {
		t.Errorf("the next unit: %v", err)
	}
	goleak.VerifyNone(t, leaks)
}
