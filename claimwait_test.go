package outbox_test

import (
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"

	"github.com/watermill-outbox/outbox"
)

// Item: a copy that waits in the claim (pessimistic) for another copy being handled is not a
// database that stalls: the gate neither probes nor holds the Outbox's other units meanwhile,
// whether the copy's unit took a pooled connection or opened one.
func TestClaimWaitIsNotTakenForAStall(t *testing.T) {
	for _, tc := range []struct {
		name string
		idle int
	}{{"pooled connection", 2}, {"new connection", 0}} {
		t.Run(tc.name, func(t *testing.T) {
			e := newEnv(t)
			e.db.SetMaxIdleConns(tc.idle)
			stop := outbox.WatchGate(e.ob)
			msg := message.NewMessage(uuid.NewString(), nil)
			entered := make(chan struct{})
			var once sync.Once
			slow := func(m *message.Message) ([]*message.Message, error) {
				once.Do(func() { close(entered) })
				time.Sleep(1500 * time.Millisecond)
				return applyAndPublish(nil)(m)
			}
			first := make(chan error, 1)
			go func() { first <- handle(e.ob, copyOf(msg), slow) }()
			<-entered // the first copy holds the claim
			began := time.Now()
			err := handle(e.ob, copyOf(msg), applyAndPublish(nil))
			waited := time.Since(began)
			if ferr := <-first; ferr != nil {
				t.Fatalf("the first copy: %v", ferr)
			}
			probes, held := stop()
			t.Logf("the copy waited %s (%v)", waited.Round(time.Millisecond), err)
			if waited < time.Second {
				t.Fatalf("the copy waited %s for the first one's claim; want about 1.5s", waited)
			}
			if probes != 0 || held {
				t.Fatalf("a claim that waited for a copy's: the gate probed %d times, held the Outbox's work: %v; want neither", probes, held)
			}
		})
	}
}
