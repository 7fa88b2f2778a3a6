package outbox_test

import (
	"context"
	"database/sql"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"

	"github.com/watermill-outbox/outbox"
)

// Two Outboxes on two databases run their background services on one engine that runs one call
// at a time: the relay of each sends its own delayed effects when they fall due. RelayInterval is
// an hour, so each is sent by its member's relay woken by its own commit's due time, not by a
// poll. A member removed from the engine relays nothing more, while the other goes on.
func TestTwoOutboxesShareOneEngine(t *testing.T) {
	slow := func(c *outbox.Config) { c.RelayInterval = time.Hour }
	envs := []*env{newEnv(t, slow), newEnv(t, slow)}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	shared, err := outbox.StartSharedEngine(ctx, 1, envs[0].ob, envs[1].ob)
	if err != nil {
		t.Fatal(err)
	}
	stopped := false
	stop := func() {
		if stopped {
			return
		}
		stopped = true
		cancel()
		sctx, scancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer scancel()
		if err := shared.Stop(sctx); err != nil {
			t.Error(err)
		}
	}
	defer stop()

	publishDelayed := func(e *env) string {
		t.Helper()
		id := uuid.NewString()
		if err := e.ob.InTx(context.Background(), func(ctx context.Context, _ *sql.Tx) error {
			return outbox.Publish(outbox.WithDelay(ctx, 300*time.Millisecond), "out_a", message.NewMessage(id, nil))
		}); err != nil {
			t.Fatal(err)
		}
		return id
	}
	sent := func(e *env, id string) bool { return e.wire("out_a")[id] == 1 }

	first := []string{publishDelayed(envs[0]), publishDelayed(envs[1])}
	waitFor(t, "both members' delayed effects sent", func() bool { return sent(envs[0], first[0]) && sent(envs[1], first[1]) })
	for i, e := range envs {
		if n := len(e.wire("out_a")); n != 1 {
			t.Fatalf("database %d: %d messages on out_a, want its own one", i, n)
		}
	}

	rctx, rcancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer rcancel()
	if err := shared.Remove(rctx, 0); err != nil {
		t.Fatal(err)
	}
	gone, kept := publishDelayed(envs[0]), publishDelayed(envs[1])
	waitFor(t, "the remaining member's effect sent", func() bool { return sent(envs[1], kept) })
	time.Sleep(500 * time.Millisecond) // past the removed member's due time, and more
	if sent(envs[0], gone) {
		t.Fatal("the member removed from the engine still relays")
	}
	stop()
}
