package outbox

import (
	"context"
	"errors"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
)

// batchRefusingPublisher refuses every call of several messages and takes every call of one.
type batchRefusingPublisher struct{}

func (batchRefusingPublisher) Publish(_ string, msgs ...*message.Message) error {
	if len(msgs) > 1 {
		return errors.New("batch refused")
	}
	return nil
}

func (batchRefusingPublisher) Close() error { return nil }

// A destination whose breaker is half open (it hung, and its open while is over) is probed by a
// call of two messages, which it refuses as a batch; the round then sends them one by one, and
// both go out. That is the first call that returned since the destination hung: the breaker
// closes, and the next call to it is no probe (a half-open breaker lets one call through at a
// time, and skips the destination on every other lane). Before, only a batch call's success
// closed it, and the destination stayed half open after rounds that delivered everything.
func TestRelayEachClosesAHalfOpenBreaker(t *testing.T) {
	o := &Outbox{cfg: Config{PublishTimeout: 5 * time.Second, RelayConcurrency: 1}, pub: batchRefusingPublisher{}, logger: watermill.NopLogger{}}
	var err error
	if o.tel, err = newTelemetry(o); err != nil {
		t.Fatal(err)
	}
	const topic = "out_a"
	dest := "topic " + topic
	o.breakers.hung(dest, o.logger, errors.New("broker hung"))
	o.breakers.m[dest].openUntil = time.Now().Add(-time.Millisecond) // the open while is over: half open

	effects := []Effect{
		{StoreID: 1, Topic: topic, UUID: "m1", OrderingKey: "k1"},
		{StoreID: 2, Topic: topic, UUID: "m2", OrderingKey: "k2"},
	}
	errs, _ := o.relayDispatch(context.Background(), context.Background(), effects, time.Now().Add(time.Minute))
	for i, err := range errs {
		if err != nil {
			t.Fatalf("effect %d: %v, want sent", i, err)
		}
	}
	if _, ok, probe := o.breakers.allow(dest); !ok || probe {
		t.Errorf("after a round that sent every effect to %s, the next call is allowed: %v, a probe: %v; want allowed and no probe (the breaker closed)", dest, ok, probe)
	}
}

// hangingSinglesPublisher refuses every call of several messages and hangs on every call of one
// until released, counting those calls.
type hangingSinglesPublisher struct {
	release chan struct{}
	singles atomic.Int32
}

func (p *hangingSinglesPublisher) Publish(_ string, msgs ...*message.Message) error {
	if len(msgs) > 1 {
		return errors.New("batch refused")
	}
	p.singles.Add(1)
	<-p.release
	return nil
}

func (*hangingSinglesPublisher) Close() error { return nil }

// A batch call refused by the destination is sent again one effect per call; when the first of
// those calls hangs, the destination's breaker opens, and the round's other effects to it wait
// for it (destinationDown) instead of each hanging a PublishTimeout of their own. Before, the
// one-by-one calls never looked at the breaker: a round of five effects to a destination that
// went down between its batch call and the first single call spent five PublishTimeouts on it.
func TestRelayEachHonoursTheBreaker(t *testing.T) {
	pub := &hangingSinglesPublisher{release: make(chan struct{})}
	t.Cleanup(func() { close(pub.release) })
	o := &Outbox{cfg: Config{PublishTimeout: 100 * time.Millisecond, RelayConcurrency: 1}, pub: pub, logger: watermill.NopLogger{}}
	var err error
	if o.tel, err = newTelemetry(o); err != nil {
		t.Fatal(err)
	}
	const topic = "out_a"
	var effects []Effect
	for i := range 5 {
		effects = append(effects, Effect{StoreID: int64(i + 1), Topic: topic, UUID: fmt.Sprintf("m%d", i), OrderingKey: fmt.Sprintf("k%d", i)})
	}
	errs, _ := o.relayDispatch(context.Background(), context.Background(), effects, time.Now().Add(time.Minute))
	if got := pub.singles.Load(); got != 1 {
		t.Errorf("calls of one effect to a destination that hung on the first of them: %d, want 1 (the breaker opened)", got)
	}
	var down destinationDown
	for i, err := range errs[1:] {
		if !errors.As(err, &down) {
			t.Errorf("effect %d after the hung call: %v, want destination down", i+1, err)
		}
	}
}
