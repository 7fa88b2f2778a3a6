// Package settest runs the crash matrix over a tenant.Set: two tenants, their messages
// interleaved on one consumer, one of them crashing at every step of its units of work. The
// forms of the library (database/sql, pgx in both modes) run it from their own tests.
package settest

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/watermill-outbox/outbox"
	"github.com/watermill-outbox/outbox/middleware"
	"github.com/watermill-outbox/outbox/tenant"
)

// Member is one tenant of the matrix, made by a form.
type Member struct {
	Ob *outbox.Outbox
	// Insert stores order id of tenant in the unit of work of ctx (the form's transaction).
	Insert func(ctx context.Context, id, tenant string) error
	// Orders reads the member's orders table: order id -> the tenants it was stored for.
	Orders func(ctx context.Context) (map[string][]string, error)
}

// NewMember makes tenant name ("a" or "b") of one scenario, with pub as its Config.Publisher and
// failpoint as its Config.Failpoint, in a fresh database or schema (the layout's choice), with an
// empty orders table (id text, tenant text). It cleans up after itself (t.Cleanup).
type NewMember func(t *testing.T, name string, pub message.Publisher, failpoint func(context.Context, string) error) Member

// points are the steps of a unit of work the matrix crashes at ("": none).
var points = []string{"", outbox.FailpointAfterClaim, outbox.FailpointAfterHandler, outbox.FailpointAfterCommit,
	outbox.FailpointAfterPublish, outbox.FailpointAfterMark}

// CrashMatrix runs, for each layout and each step, a scenario in which every first delivery of
// tenant b crashes at the step; then four copies of every message arrive at the same moment, then
// one more, and the Set's engine runs until every event is out. Each order must be stored once,
// in its tenant's table only; every event must go out under its one UUID and nothing else may;
// with once (a pessimistic form: a copy waits for the claim) tenant a's handler must run once per
// message, as if b had never crashed (an optimistic form runs it for copies at the same moment).
func CrashMatrix(t *testing.T, layouts map[string]NewMember, once bool) {
	for layout, newMember := range layouts {
		for _, point := range points {
			name := layout + "/crash-" + point
			if point == "" {
				name = layout + "/no-crash"
			}
			t.Run(name, func(t *testing.T) {
				t.Parallel()
				scenario(t, newMember, point, once)
			})
		}
	}
}

// wire records what the members publish.
type wire struct {
	mu   sync.Mutex
	sent map[string]int // UUID -> times published
}

func (w *wire) Publish(_ string, msgs ...*message.Message) error {
	w.mu.Lock()
	defer w.mu.Unlock()
	for _, m := range msgs {
		w.sent[m.UUID]++
	}
	return nil
}

func (w *wire) Close() error { return nil }

func (w *wire) count(uuid string) int {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.sent[uuid]
}

func scenario(t *testing.T, newMember NewMember, point string, once bool) {
	ctx := context.Background()
	w := &wire{sent: map[string]int{}}
	var armed atomic.Bool
	var hits atomic.Int32
	a := newMember(t, "a", w, nil)
	b := newMember(t, "b", w, func(_ context.Context, p string) error {
		if p == point && armed.CompareAndSwap(true, false) {
			hits.Add(1)
			return errors.New("crash")
		}
		return nil
	})
	members := map[string]Member{"a": a, "b": b}
	set, err := tenant.New(tenant.Config{Resolver: tenant.FromMetadata("tenant"), NackUnresolved: true}) // every message names its member
	if err != nil {
		t.Fatal(err)
	}
	for name, m := range members {
		if err := set.Add(name, m.Ob); err != nil {
			t.Fatal(err)
		}
	}
	var mu sync.Mutex
	runs := map[string]int{}
	h := set.WrapConsumer(func(msg *message.Message) error {
		mu.Lock()
		runs[msg.UUID]++
		mu.Unlock()
		ctx := msg.Context()
		tn := msg.Metadata.Get("tenant")
		if err := members[tn].Insert(ctx, msg.UUID, tn); err != nil {
			return err
		}
		return outbox.Publish(ctx, "events", message.NewMessage("event-"+msg.UUID, nil))
	}, middleware.WithConsumer("shop"))

	var ids []string
	msgs := map[string]*message.Message{}
	for i := range 6 {
		tn := []string{"a", "b"}[i%2]
		id := fmt.Sprintf("%s-%d", tn, i)
		ids = append(ids, id)
		m := message.NewMessage(id, []byte(id))
		m.Metadata.Set("tenant", tn)
		msgs[id] = m
	}
	// The first deliveries, one after another as one subscriber hands them over: b's crash.
	crashes := 0
	for _, id := range ids {
		if strings.HasPrefix(id, "b-") && point != "" {
			armed.Store(true)
		}
		before := hits.Load()
		err := h(msgs[id].Copy())
		armed.Store(false)
		if hits.Load() != before {
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
	// The redeliveries: four copies of every message at the same moment, then one more each. A
	// copy may be nacked while another is processed; the later one must find it processed.
	var wg sync.WaitGroup
	for _, id := range ids {
		for range 4 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				if err := h(msgs[id].Copy()); err != nil {
					t.Logf("a copy of %s: %v", id, err)
				}
			}()
		}
	}
	wg.Wait()
	for _, id := range ids {
		if err := h(msgs[id].Copy()); err != nil {
			t.Errorf("the later copy of %s: %v", id, err)
		}
	}

	// The engine sends what the crashes left behind.
	rctx, cancel := context.WithCancel(ctx)
	ran := make(chan error, 1)
	go func() { ran <- set.Run(rctx) }()
	deadline := time.Now().Add(30 * time.Second)
	for _, id := range ids {
		for w.count("event-"+id) == 0 {
			if time.Now().After(deadline) {
				cancel()
				<-ran
				t.Fatalf("the event of %s did not go out within 30 s", id)
			}
			time.Sleep(10 * time.Millisecond)
		}
	}
	cancel()
	if err := <-ran; err != nil && !errors.Is(err, context.Canceled) {
		t.Errorf("set.Run: %v", err)
	}

	for tn, m := range members {
		got, err := m.Orders(ctx)
		if err != nil {
			t.Fatal(err)
		}
		want := 0
		for _, id := range ids {
			if !strings.HasPrefix(id, tn+"-") {
				if _, ok := got[id]; ok {
					t.Errorf("tenant %s holds %s, an order of another tenant", tn, id)
				}
				continue
			}
			want++
			if g := got[id]; len(g) != 1 || g[0] != tn {
				t.Errorf("tenant %s: order %s stored %v, want once for %s", tn, id, g, tn)
			}
		}
		if len(got) != want {
			t.Errorf("tenant %s holds %d orders, want %d: %v", tn, len(got), want, got)
		}
	}
	w.mu.Lock()
	for uuid := range w.sent {
		if id, ok := strings.CutPrefix(uuid, "event-"); !ok || msgs[id] == nil {
			t.Errorf("%s went out, which no unit of work committed", uuid)
		}
	}
	w.mu.Unlock()
	mu.Lock()
	defer mu.Unlock()
	for _, id := range ids {
		if !strings.HasPrefix(id, "a-") {
			continue
		}
		if n := runs[id]; n < 1 || once && n != 1 {
			t.Errorf("the handler ran %d times for %s of the tenant that never crashed, want once", n, id)
		}
	}
}
