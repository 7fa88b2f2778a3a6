package outbox

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/watermill-outbox/outbox/outboxdriver"
)

// releasingStore takes the releases of a relay round (EffectRecordFailures) and nothing else.
type releasingStore struct {
	outboxdriver.Store
	mu       sync.Mutex
	released []int64
}

func (s *releasingStore) EffectRecordFailures(_ context.Context, fs ...outboxdriver.EffectFailure) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, f := range fs {
		s.released = append(s.released, f.StoreID)
	}
	return nil
}

// uuidRecorder records the UUIDs it is given.
type uuidRecorder struct {
	mu   sync.Mutex
	sent []string
}

func (p *uuidRecorder) Publish(_ string, msgs ...*message.Message) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, m := range msgs {
		p.sent = append(p.sent, m.UUID)
	}
	return nil
}

func (*uuidRecorder) Close() error { return nil }

// A claim leases the first effect of each ordering key it takes; the later ones wait behind that
// lease. When that first effect is one this process sent lately (its mark queued or just written),
// the round does not send it again, and its mark, once it lands, ends the lease: the key's later
// effects, which the round was sending, were then due for any other instance, which sent them
// beside this round's calls (or before them, out of order). Now the round sends nothing of a key
// behind an effect it holds back: those wait, unleased, behind it, for the next claim.
func TestRelayRoundSendsNothingBehindAHeldEffect(t *testing.T) {
	pub := &uuidRecorder{}
	st := &releasingStore{}
	o := &Outbox{cfg: Config{PublishTimeout: 5 * time.Second, RelayConcurrency: 4, ShutdownTimeout: time.Second}, pub: pub, store: st, logger: watermill.NopLogger{}}
	var err error
	if o.tel, err = newTelemetry(o); err != nil {
		t.Fatal(err)
	}
	o.marks = newMarker(o)
	o.marks.mu.Lock()
	o.marks.remember([]outboxdriver.DispatchMark{{StoreIDs: []int64{1, 5}}}, time.Now()) // a1 and b2 sent lately
	o.marks.mu.Unlock()
	claimed := []Effect{
		{StoreID: 1, Topic: "t", UUID: "a1", OrderingKey: "a"},
		{StoreID: 2, Topic: "t", UUID: "a2", OrderingKey: "a"},
		{StoreID: 3, Topic: "t", UUID: "a3", OrderingKey: "a"},
		{StoreID: 4, Topic: "t", UUID: "b1", OrderingKey: "b"},
		{StoreID: 5, Topic: "t", UUID: "b2", OrderingKey: "b"},
		{StoreID: 6, Topic: "t", UUID: "b3", OrderingKey: "b"},
		{StoreID: 7, Topic: "t", UUID: "c1", OrderingKey: "c"},
	}
	f := o.relayLaunch(context.Background(), claimed, time.Now().Add(time.Minute))
	if f == nil {
		t.Fatal("the round sends nothing")
	}
	f.wait()
	f.cancel()
	f.span.End()
	pub.mu.Lock()
	sent := append([]string(nil), pub.sent...)
	pub.mu.Unlock()
	want := map[string]bool{"b1": true, "c1": true}
	if len(sent) != len(want) {
		t.Errorf("the round sent %v, want b1 and c1 only (a2, a3 and b3 wait behind a1 and b2, which this process sent lately)", sent)
	}
	for _, id := range sent {
		if !want[id] {
			t.Errorf("the round sent %s, which waits behind an effect of its key this process sent lately", id)
		}
	}
	if len(st.released) != 2 {
		t.Errorf("released %v, want the two effects sent lately (1 and 5)", st.released)
	}
}
