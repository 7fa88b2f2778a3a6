package outboxpgx_test

import (
	"context"
	"database/sql"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	_ "github.com/jackc/pgx/v5/stdlib"

	"github.com/watermill-outbox/outbox"
	"github.com/watermill-outbox/outbox/drivers/postgres"
	"github.com/watermill-outbox/outbox/internal/pgproxy"
	"github.com/watermill-outbox/outbox/outboxtest"
)

// TestStalledDatabaseOnPgxStdlib: the database/sql form on pgx's stdlib, a driver that honours its
// context while it connects, watches only the connections being opened (no goroutine per unit).
// The database accepts connections and answers none for 3 s while eight consumers redeliver a
// message each at once on every nack: each delivery returns by its HandlerTimeout, and after
// the first burst the database meets only the gate's probes, not a connection per unit and
// HandlerTimeout (8 a second here).
func TestStalledDatabaseOnPgxStdlib(t *testing.T) {
	proxy, dsn, err := pgproxy.StartFor(outboxtest.DSN(t))
	if err != nil {
		t.Skipf("no proxy: %v", err)
	}
	t.Cleanup(func() { _ = proxy.Close() })
	db, err := sql.Open("pgx", dsn)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = db.Close() })
	const timeout = time.Second
	ob, err := outbox.New(outbox.Config{DB: db, Driver: postgres.Driver{}, Publisher: &outboxtest.Recorder{}, HandlerTimeout: timeout})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = ob.Close() })
	if err := ob.Migrate(context.Background()); err != nil {
		t.Fatal(err)
	}
	deliver := func(id string) error {
		return ob.Handle(message.NewMessage(id, nil), outbox.HandleParams{Consumer: "c1", MessageID: id}, consume(func(*message.Message) error { return nil }))
	}
	if err := deliver(uuid.NewString()); err != nil {
		t.Fatal(err)
	}

	const outage = 3 * time.Second
	var slowest atomic.Int64
	var acked atomic.Int32 // during the stall
	var down atomic.Bool
	stop := make(chan struct{})
	var consumers sync.WaitGroup
	proxy.SetHang(true)
	down.Store(true)
	proxy.SetDown(true)
	for range 8 {
		consumers.Add(1)
		go func() {
			defer consumers.Done()
			id := uuid.NewString()
			for {
				select {
				case <-stop:
					return
				default:
				}
				began := time.Now()
				err := deliver(id)
				if d := int64(time.Since(began)); d > slowest.Load() {
					slowest.Store(d)
				}
				if err == nil {
					if down.Load() {
						acked.Add(1)
					}
					return
				}
			}
		}()
	}
	time.Sleep(outage)
	attempts := proxy.Attempts()
	close(stop)
	down.Store(false)
	proxy.SetDown(false)
	proxy.SetHang(false)
	consumers.Wait()
	t.Logf("%s stall: %d connection attempts; slowest delivery %s; %d acked", outage, attempts, time.Duration(slowest.Load()).Round(time.Millisecond), acked.Load())
	if attempts > 16 {
		t.Errorf("%d connection attempts in a %s stall; want the first burst (8) and the probes", attempts, outage)
	}
	if d := time.Duration(slowest.Load()); d > timeout+time.Second {
		t.Errorf("a delivery took %s; want at most HandlerTimeout (%s) and a little", d, timeout)
	}
	if acked.Load() != 0 {
		t.Errorf("%d deliveries acked during the stall", acked.Load())
	}
}
