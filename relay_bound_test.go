package outbox_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/watermill-outbox/outbox"
	"github.com/watermill-outbox/outbox/drivers/postgres"
	"github.com/watermill-outbox/outbox/internal/logtest"
	"github.com/watermill-outbox/outbox/internal/pgtest"
)

// slowWire takes each call in delay and counts the messages it took.
type slowWire struct {
	delay time.Duration
	mu    sync.Mutex
	sent  map[string]int
}

func (w *slowWire) Publish(_ string, msgs ...*message.Message) error {
	time.Sleep(w.delay)
	w.mu.Lock()
	defer w.mu.Unlock()
	for _, m := range msgs {
		w.sent[m.UUID]++
	}
	return nil
}

func (w *slowWire) Close() error { return nil }

func (w *slowWire) counts(ids []string) (missing, doubled int) {
	w.mu.Lock()
	defer w.mu.Unlock()
	for _, id := range ids {
		switch n := w.sent[id]; {
		case n == 0:
			missing++
		case n > 1:
			doubled++
		}
	}
	return missing, doubled
}

// A relay pass is bounded by BackgroundTimeout, and a backlog that takes several times as long to
// send is drained all the same, each effect once and soon: a pass starts no round after half its
// bound and the next pass goes on at once, so that no pass meets its deadline (which would cut
// its calls short and leave their effects leased for a minute and a half) nor is abandoned.
func TestRelayPassStaysWithinItsBound(t *testing.T) {
	db := pgtest.DB(t)
	w := &slowWire{delay: 20 * time.Millisecond, sent: map[string]int{}}
	logs := &logtest.Errors{}
	const bound = 400 * time.Millisecond
	ob, err := outbox.New(outbox.Config{DB: db, Driver: postgres.Driver{}, Publisher: w, Logger: logs,
		RelayInterval: 50 * time.Millisecond, RelayGrace: time.Millisecond, RelayConcurrency: 1, RelayBatchSize: 5,
		RelayPauseFactor: -1, BackgroundTimeout: bound})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = ob.Close() })
	if err := ob.Migrate(context.Background()); err != nil {
		t.Fatal(err)
	}
	// Another process committed the effects and crashed before sending them: the relay's work.
	crashing, err := outbox.New(outbox.Config{DB: db, Driver: postgres.Driver{}, Publisher: w,
		Failpoint: func(_ context.Context, point string) error {
			if point == outbox.FailpointAfterCommit {
				return errors.New("crash")
			}
			return nil
		}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = crashing.Close() })
	var ids []string
	for i := range 80 { // 80 calls of 20 ms, one at a time: 1.6 s, four bounds
		id := fmt.Sprintf("backlog-%d-%d", i, time.Now().UnixNano())
		ids = append(ids, id)
		if err := crashing.InTx(context.Background(), func(ctx context.Context, _ *sql.Tx) error {
			return outbox.Publish(ctx, "events", message.NewMessage(id, nil))
		}); !errors.Is(err, outbox.ErrFailpoint) {
			t.Fatalf("InTx with a crash after its commit: %v", err)
		}
	}

	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	began := time.Now()
	go func() { done <- ob.Run(ctx) }()
	t.Cleanup(func() { cancel(); <-done }) // on a failure; Run returns within its ShutdownTimeout
	deadline := time.Now().Add(15 * time.Second)
	for {
		missing, doubled := w.counts(ids)
		if doubled > 0 {
			t.Fatalf("%d effects sent twice", doubled)
		}
		if missing == 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d of %d effects not sent after 15 s (BackgroundTimeout %s): a pass met its bound", missing, len(ids), bound)
		}
		time.Sleep(10 * time.Millisecond)
	}
	t.Logf("80 effects of 20 ms each sent in %s, passes bounded by %s", time.Since(began).Round(time.Millisecond), bound)
	cancel()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	done <- nil // for the cleanup
	if lines := logs.Lines(); len(lines) > 0 {
		t.Errorf("errors logged while draining: %q", lines)
	}
}
