package tenant_test

import (
	"context"
	"database/sql"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"go.uber.org/goleak"

	"github.com/watermill-outbox/outbox"
	"github.com/watermill-outbox/outbox/drivers/postgres"
	"github.com/watermill-outbox/outbox/internal/logtest"
	"github.com/watermill-outbox/outbox/internal/pgproxy"
	"github.com/watermill-outbox/outbox/internal/pgtest"
	"github.com/watermill-outbox/outbox/tenant"
)

// A member whose database accepts connections and never answers (a proxy in hang mode; lib/pq
// without connect_timeout blocks in its startup handshake whatever its context says) blocks no
// one: its background runs hold the engine's two slots until their bound (BackgroundTimeout, 1 s
// here) and the grace passed, then are abandoned, and the other member's relay sends its effects
// on time again; Health names the stalled member. Once the database answers again, the stalled
// member relays again, and when the Set stops no goroutine is left.
func TestSetStalledMemberBlocksNoOne(t *testing.T) {
	stalledMemberBlocksNoOne(t, time.Second)
}

// TestSetStalledMemberBlocksNoOneWithTheDefaultBound is TestSetStalledMemberBlocksNoOne with the
// default BackgroundTimeout (4.5 minutes): a run without an answer for 5 s has the member's
// database pinged, and once the ping got no answer either (5 s), the run is abandoned. Before,
// b's runs held both slots for the whole bound: a's effects waited 4.5 minutes.
func TestSetStalledMemberBlocksNoOneWithTheDefaultBound(t *testing.T) {
	stalledMemberBlocksNoOne(t, 0)
}

func stalledMemberBlocksNoOne(t *testing.T, bound time.Duration) {
	w := newWire()
	healthy := newMember(t, pgtest.DB(t), "a_", w)
	proxy, viaProxy, err := pgproxy.StartFor(pgtest.DSN(t))
	if err != nil {
		t.Skipf("the test server is not reachable by a postgres:// URL with a host (%v): the proxy needs one", err)
	}
	pdb, err := sql.Open("postgres", viaProxy)
	if err != nil {
		t.Fatal(err)
	}
	logs := &logtest.Errors{}
	stalled, err := outbox.New(outbox.Config{DB: pdb, Driver: postgres.Driver{}, Publisher: w, TablePrefix: "b_",
		RelayInterval: 50 * time.Millisecond, BackgroundTimeout: bound, ShutdownTimeout: 2 * time.Second, Logger: logs})
	if err != nil {
		t.Fatal(err)
	}
	if err := stalled.Migrate(context.Background()); err != nil {
		t.Fatal(err)
	}
	set := newSet(t, tenant.Config{MaxConcurrent: 2}, map[string]*outbox.Outbox{"a": healthy, "b": stalled})
	leaks := goleak.IgnoreCurrent()

	proxy.SetHang(true)
	proxy.SetDown(true)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- set.Run(ctx) }()
	runReturned := false
	t.Cleanup(func() {
		// On a failure too: the stalled calls end with the proxy, and Run with them.
		if runReturned {
			return // closed below
		}
		cancel()
		_ = proxy.Close()
		select {
		case <-done:
		case <-time.After(30 * time.Second):
			t.Error("Run did not return within 30 s of its end and the proxy's")
		}
		_ = stalled.Close()
		_ = pdb.Close()
	})
	began := time.Now()

	// Both slots are soon held by calls of b that never return.
	time.Sleep(200 * time.Millisecond)
	first := publishDelayed(t, set, "a")
	eventually(t, "a's effect sent while b stalls", func() bool { return w.count(first) == 1 })
	t.Logf("a's first effect (due in 200 ms) went out %s after the Set started", time.Since(began).Round(time.Millisecond))
	// The slots are free again once b's runs were abandoned: at their bound (1 s) and its grace
	// (5 s), or once a ping made after 5 s without an answer got none either (5 s).
	limit := bound + 10*time.Second
	if bound == 0 {
		limit = 20 * time.Second
	}
	if took := time.Since(began); took > limit {
		t.Errorf("a's effect went out %s after the start, want within %s (b's runs abandoned)", took, limit)
	}
	// From then on b costs a nothing: its tasks wait for its gate, which probes without a slot.
	for i := range 3 {
		start := time.Now()
		id := publishDelayed(t, set, "a")
		eventually(t, "a's later effect sent", func() bool { return w.count(id) == 1 })
		if took := time.Since(start); took > 2*time.Second {
			t.Errorf("a's effect %d (due in 200 ms) went out after %s beside a stalled member", i, took.Round(time.Millisecond))
		}
	}
	if !logs.Contains(`of member "b" has not returned`) {
		t.Errorf("no log line names b's abandoned run: %q", logs.Lines())
	}

	hctx, hcancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer hcancel()
	health := make(chan outbox.HealthReport, 1)
	go func() { health <- set.Health(hctx) }()
	select {
	case r := <-health:
		var aOK, bNamed bool
		for _, c := range r.Checks {
			switch c.Name {
			case "a/" + outbox.CheckDatabase:
				aOK = c.OK
			case "b/" + outbox.CheckDatabase:
				bNamed = !c.OK && strings.Contains(c.Reason, "did not answer")
				t.Logf("b's database check: %s", c.Reason)
			}
		}
		if r.Healthy || !aOK || !bNamed {
			t.Errorf("Health beside a stalled b: healthy %v, a's database ok %v, b's named as not answering %v: %v", r.Healthy, aOK, bNamed, r.Err())
		}
	case <-time.After(15 * time.Second):
		t.Fatal("Health did not return within 15 s while b stalls")
	}

	// The database answers again: the calls held return, b's gate closes, its relay runs.
	proxy.SetDown(false)
	var later string
	eventually(t, "a unit of work on b once its database answers", func() bool {
		id := fmt.Sprintf("b-after-%d", time.Now().UnixNano())
		ictx, icancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer icancel()
		err := set.InTx(ictx, "b", func(ctx context.Context, _ *sql.Tx) error {
			return outbox.Publish(outbox.WithDelay(ctx, 200*time.Millisecond), "events", message.NewMessage(id, nil))
		})
		if err == nil {
			later = id
		}
		return err == nil
	})
	eventually(t, "b's effect sent by its relay", func() bool { return w.count(later) == 1 })

	cancel()
	select {
	case err := <-done:
		runReturned = true
		if err != nil {
			t.Errorf("Run once b answers again: %v", err)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("Run did not return within 30 s of its end")
	}
	// The Outbox and the pool first: closing them writes to their connections, which the proxy
	// carries.
	if err := stalled.Close(); err != nil {
		t.Error(err)
	}
	if err := pdb.Close(); err != nil {
		t.Error(err)
	}
	if err := proxy.Close(); err != nil {
		t.Error(err)
	}
	goleak.VerifyNone(t, leaks)
}
