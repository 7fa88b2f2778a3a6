package outbox

import (
	"context"
	"errors"
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
