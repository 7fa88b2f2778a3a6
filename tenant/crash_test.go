package tenant_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/watermill-outbox/outbox"
	"github.com/watermill-outbox/outbox/drivers/postgres"
	"github.com/watermill-outbox/outbox/internal/pgtest"
	"github.com/watermill-outbox/outbox/middleware"
	"github.com/watermill-outbox/outbox/tenant"
)

// crashingMember is a member whose units of work crash at one step, once per delivery that is
// armed: the tenant whose process dies while the others' go on.
type crashingMember struct {
	point  string
	armed  atomic.Bool
	hits   atomic.Int32
	ob     *outbox.Outbox
	prefix string
}

func newCrashingMember(t *testing.T, db *sql.DB, prefix string, pub message.Publisher, point string) *crashingMember {
	t.Helper()
	cm := &crashingMember{point: point, prefix: prefix}
	ob, err := outbox.New(outbox.Config{DB: db, Driver: postgres.Driver{}, Publisher: pub, TablePrefix: prefix,
		RelayInterval: 50 * time.Millisecond, RetryDelay: time.Millisecond,
		Failpoint: func(_ context.Context, p string) error {
			if p == cm.point && cm.armed.CompareAndSwap(true, false) {
				cm.hits.Add(1)
				return errors.New("crash")
			}
			return nil
		}})
	if err != nil {
		t.Fatal(err)
	}
	if err := ob.Migrate(context.Background()); err != nil {
		t.Fatal(err)
	}
	if _, err := db.Exec(`CREATE TABLE ` + prefix + `orders (id text, tenant text)`); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = ob.Close() })
	cm.ob = ob
	return cm
}

// The crash matrix over a Set: two tenants (a database each, or a schema each on one pool),
// their messages interleaved on one consumer. Every first delivery of tenant b crashes at one
// step of its unit of work (none, after the claim, the handler, the commit, a publish, the mark);
// then four copies of every message arrive at the same moment, then one more, and the Set's
// engine runs until every event is out. Each order is stored once, in its tenant's tables only;
// every event goes out under its one UUID and nothing else does; tenant a's handler ran once per
// message, as if b had never crashed.
func TestSetCrashMatrix(t *testing.T) {
	points := []string{"", outbox.FailpointAfterClaim, outbox.FailpointAfterHandler, outbox.FailpointAfterCommit,
		outbox.FailpointAfterPublish, outbox.FailpointAfterMark}
	for _, layout := range []string{"databases", "schemas"} {
		for _, point := range points {
			name := layout + "/crash-" + point
			if point == "" {
				name = layout + "/no-crash"
			}
			t.Run(name, func(t *testing.T) {
				t.Parallel()
				setCrashScenario(t, layout, point)
			})
		}
	}
}

func setCrashScenario(t *testing.T, layout, point string) {
	dbA := pgtest.DB(t)
	dbB, prefixA, prefixB := dbA, "a_", "b_"
	if layout == "databases" {
		dbB, prefixA, prefixB = pgtest.DB(t), "", ""
	}
	w := newWire()
	a := newMember(t, dbA, prefixA, w)
	b := newCrashingMember(t, dbB, prefixB, w, point)
	set := newSet(t, tenant.Config{}, map[string]*outbox.Outbox{"a": a, "b": b.ob})
	sh := newShop(func(tn string) string {
		if tn == "a" {
			return prefixA + "orders"
		}
		return prefixB + "orders"
	})
	h := set.WrapConsumer(sh.handle, middleware.WithConsumer("shop"))

	var ids []string
	msgs := map[string]*message.Message{}
	for i := range 6 {
		tn := []string{"a", "b"}[i%2]
		id := fmt.Sprintf("%s-%d", tn, i)
		ids = append(ids, id)
		msgs[id] = tenantMsg(id, tn)
	}
	// The first deliveries, one after another as one subscriber hands them over: b's crash.
	crashes := 0
	for _, id := range ids {
		if strings.HasPrefix(id, "b-") && point != "" {
			b.armed.Store(true)
		}
		before := b.hits.Load()
		err := h(msgs[id].Copy())
		b.armed.Store(false)
		if b.hits.Load() != before {
			crashes++
			if !errors.Is(err, outbox.ErrFailpoint) {
				t.Errorf("%s crashed at %s: Handle = %v, want ErrFailpoint", id, point, err)
			}
		} else if err != nil {
			t.Errorf("%s: %v", id, err)
		}
	}
	if point != "" && crashes != 3 {
		t.Fatalf("%d of b's 3 first deliveries crashed at %s", crashes, point)
	}
	// The redeliveries: four copies of every message at the same moment, then one more each.
	var wg sync.WaitGroup
	errs := make(chan error, 4*len(ids))
	for _, id := range ids {
		for range 4 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				if err := h(msgs[id].Copy()); err != nil {
					errs <- fmt.Errorf("a copy of %s: %w", id, err)
				}
			}()
		}
	}
	wg.Wait()
	close(errs)
	// A copy may be nacked while another is processed (a claim held elsewhere); the later copy
	// below must then find the message processed.
	for err := range errs {
		t.Log(err)
	}
	for _, id := range ids {
		if err := h(msgs[id].Copy()); err != nil {
			t.Errorf("the later copy of %s: %v", id, err)
		}
	}

	// The engine sends what the crashes left behind.
	ctx, cancel := context.WithCancel(context.Background())
	ran := make(chan error, 1)
	go func() { ran <- set.Run(ctx) }()
	eventually(t, "every event went out", func() bool {
		for _, id := range ids {
			if w.count("event-"+id) == 0 {
				return false
			}
		}
		return true
	})
	cancel()
	if err := <-ran; err != nil && !errors.Is(err, context.Canceled) {
		t.Errorf("set.Run: %v", err)
	}

	for tn, table := range map[string]struct {
		db    *sql.DB
		table string
	}{"a": {dbA, prefixA + "orders"}, "b": {dbB, prefixB + "orders"}} {
		got := rows(t, table.db, table.table)
		want := 0
		for _, id := range ids {
			if !strings.HasPrefix(id, tn+"-") {
				if _, ok := got[id]; ok {
					t.Errorf("%s holds %s, an order of another tenant", table.table, id)
				}
				continue
			}
			want++
			if g := got[id]; len(g) != 1 || g[0] != tn {
				t.Errorf("%s: order %s stored %v, want once for %s", table.table, id, g, tn)
			}
		}
		if len(got) != want {
			t.Errorf("%s holds %d orders, want %d: %v", table.table, len(got), want, got)
		}
	}
	w.mu.Lock()
	for uuid := range w.sent {
		if id, ok := strings.CutPrefix(uuid, "event-"); !ok || msgs[id] == nil {
			t.Errorf("%s went out, which no unit of work committed", uuid)
		}
	}
	w.mu.Unlock()
	for _, id := range ids {
		if strings.HasPrefix(id, "a-") {
			if n := sh.runsOf(id); n != 1 {
				t.Errorf("the handler ran %d times for %s of the tenant that never crashed, want once", n, id)
			}
		}
	}
}
