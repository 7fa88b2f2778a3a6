package postgres

import (
	"context"
	"database/sql"
	"testing"
	"time"

	"github.com/watermill-outbox/outbox/internal/pgtest"
)

// TestListenReturnsNilWhenCancelled: a listener whose context ends returns nil, whatever it meets
// on its way out. Its connection is closed as the context ends, and the Listener reports that as
// a lost connection: when listen looked at both at once it could return the loss (the
// conformance suite's EffectNotifyListen saw "listener connection ... lost: use of closed network
// connection" after cancel, once in a CI run). Here the context ends inside the wake-up, which
// lasts until the loss is surely reported, so that listen finds both ready every time.
func TestListenReturnsNilWhenCancelled(t *testing.T) {
	dsn := pgtest.DSN(t)
	db, err := sql.Open("postgres", dsn)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = db.Close() })
	for i := 0; i < 10; i++ {
		ctx, cancel := context.WithCancel(context.Background())
		woken := 0
		err := listen(db, dsn, "cancel_test_relay")(ctx, func() {
			woken++
			if woken == 1 {
				cancel()
				time.Sleep(100 * time.Millisecond) // the closed connection is reported meanwhile
			}
		})
		cancel()
		if err != nil {
			t.Fatalf("run %d: listen returned %v after its context ended; want nil", i, err)
		}
		if woken == 0 {
			t.Fatalf("run %d: listen returned before it listened", i)
		}
	}
}
