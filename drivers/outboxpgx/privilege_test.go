package outboxpgx_test

import (
	"context"
	"errors"
	"net/url"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"

	"github.com/watermill-outbox/outbox"
	"github.com/watermill-outbox/outbox/drivers/outboxpgx"
	"github.com/watermill-outbox/outbox/drivers/postgres"
	"github.com/watermill-outbox/outbox/internal/logtest"
	"github.com/watermill-outbox/outbox/ops"
	"github.com/watermill-outbox/outbox/outboxtest"
)

// The pgx form runs as the application's role with exactly the grants postgres.Grants gives it,
// on a database whose functions PUBLIC may not run:
// the relay moves the inline effects a crash left behind and sends them, stats are sampled, and
// a repair (a replay) is applied and audited.
func TestLeastPrivilegedRole(t *testing.T) {
	ownerDSN := outboxtest.DSN(t)
	ctx := context.Background()
	owner := openPool(t, ownerDSN, 2, nil)
	ready(t, owner, outbox.Config{Publisher: &outboxtest.Recorder{}}) // migrated by the owner
	grants, err := postgres.Grants("", "outbox_", "pgx_app", false)
	if err != nil {
		t.Fatal(err)
	}
	// A hardened database: its functions are not everyone's to run (the effects table's
	// generation default is one); the grants give the role what it runs.
	if _, err := owner.Exec(ctx, `REVOKE EXECUTE ON ALL FUNCTIONS IN SCHEMA public FROM PUBLIC; CREATE ROLE pgx_app LOGIN PASSWORD 'pw'; GRANT SELECT, INSERT ON applied TO pgx_app; `+strings.Join(grants, "; ")); err != nil {
		t.Fatal(err)
	}
	u, err := url.Parse(ownerDSN)
	if err != nil {
		t.Fatal(err)
	}
	u.User = url.UserPassword("pgx_app", "pw")
	rec := &outboxtest.Recorder{}
	logs := &logtest.Errors{}
	crash := errors.New("crash")
	var armed atomic.Bool
	ob, err := newOutbox(t, openPool(t, u.String(), 8, nil), outbox.Config{Publisher: rec, Logger: logs,
		RelayGrace: 300 * time.Millisecond, RelayInterval: 50 * time.Millisecond, StatsInterval: 50 * time.Millisecond,
		RetryDelay: -1, MaxAttempts: 1, PoisonTopic: "poison",
		Failpoint: func(_ context.Context, point string) error {
			if point == outbox.FailpointAfterCommit && armed.CompareAndSwap(true, false) {
				return crash
			}
			return nil
		}})
	if err != nil {
		t.Fatal(err)
	}
	if err := ob.Migrate(ctx); err != nil {
		t.Fatalf("Migrate as the application role (nothing to do): %v", err)
	}
	armed.Store(true)
	if err := ob.Handle(message.NewMessage("crashed", nil), outbox.HandleParams{Consumer: "c", MessageID: "crashed"}, consume(handler)); !errors.Is(err, crash) {
		t.Fatalf("crash after commit: %v", err)
	}
	bad := func(*message.Message) ([]*message.Message, error) { return nil, errors.New("bad input") }
	if err := ob.Handle(message.NewMessage("poisoned", nil), outbox.HandleParams{Consumer: "c", MessageID: "poisoned"}, bad); err != nil {
		t.Fatalf("poisoning: %v", err)
	}
	before := len(logs.Lines())

	runCtx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- ob.Run(runCtx) }()
	var once sync.Once
	stop := func() { once.Do(func() { cancel(); <-done }) }
	t.Cleanup(stop)
	deadline := time.Now().Add(20 * time.Second)
	for {
		var inline int
		var sampled bool
		if err := owner.QueryRow(ctx, `SELECT (SELECT count(*) FROM outbox_processed WHERE effects IS NOT NULL),
			(SELECT sampled_at IS NOT NULL FROM outbox_stats)`).Scan(&inline, &sampled); err != nil {
			t.Fatal(err)
		}
		if len(rec.Messages("out")) == 1 && inline == 0 && sampled {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("as the application role: sent %d of the crashed message's effect, %d claims with inline effects left, stats sampled %v; errors: %v",
				len(rec.Messages("out")), inline, sampled, logs.Lines()[before:])
		}
		time.Sleep(20 * time.Millisecond)
	}
	stop()
	if errs := logs.Lines()[before:]; len(errs) > 0 {
		t.Errorf("errors as the application role: %v", errs)
	}

	o, err := ops.ForOutbox(ob)
	if err != nil {
		t.Fatal(err)
	}
	if ok, err := o.ReplayPoisoned(ctx, "c", "poisoned", ops.RepairOptions{Actor: "alice"}); err != nil || !ok {
		t.Fatalf("replay as the application role: %v %v", ok, err)
	}
	var audited int
	if err := owner.QueryRow(ctx, `SELECT count(*) FROM outbox_audit WHERE action = 'replay-poisoned' AND actor = 'alice'`).Scan(&audited); err != nil || audited != 1 {
		t.Errorf("the replay's audit entry: %d (%v), want 1", audited, err)
	}

	// A keyed unit of work claims its key, stores its result and replays it with the
	// application's grants; the cleanup deletes expired keys with them.
	keyed := outbox.WithIdempotencyKey(ctx, "orders", "k1")
	for range 2 {
		if err := outboxpgx.InTx(keyed, ob, func(ctx context.Context, tx pgx.Tx) error {
			return outbox.SetResult(ctx, []byte("done"))
		}); err != nil {
			t.Fatalf("keyed InTx as the application role: %v", err)
		}
	}
	if res, rep := outbox.IdempotencyResult(keyed); !rep || string(res) != "done" {
		t.Errorf("keyed retry as the application role: %q replayed %v", res, rep)
	}
	if _, err := owner.Exec(ctx, `UPDATE outbox_idempotency SET expires_at = now() - interval '1 second'`); err != nil {
		t.Fatal(err)
	}
	if res, err := ob.Cleanup(ctx); err != nil || res.Keys != 1 {
		t.Errorf("cleanup of an expired key as the application role: %+v, %v", res, err)
	}
}
