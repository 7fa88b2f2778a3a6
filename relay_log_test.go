package outbox_test

import (
	"context"
	"errors"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"

	"github.com/watermill-outbox/outbox"
)

// TestRelayLogLinesCarryTheCause: the relay's log lines for a failed and a parked effect carry
// the broker's error as their error (a logger prints it as err=...; not err=<nil> with the cause
// in another field), name a message's kind ("publish", not an empty string), and tell the
// operator the command that lists parked effects.
func TestRelayLogLinesCarryTheCause(t *testing.T) {
	e := newEnv(t)
	commitPending(t, e, "out_a", "fine", 1, 1)
	commitPending(t, e, "out_b", "refused", 1, 1)
	pub := &refusingTopic{next: e.pub, topic: "out_b"}
	pub.refuse.Store(true)
	logs := watermill.NewCaptureLogger()
	relay := e.newOutbox(func(c *outbox.Config) {
		c.Publisher, c.Logger = pub, logs
		c.RelayGrace, c.RelayInterval, c.RelayMaxAttempts = time.Millisecond, 20*time.Millisecond, 1
	})
	ctx, stop := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- relay.Run(ctx) }()
	var once sync.Once
	halt := func() { once.Do(func() { stop(); <-done }) }
	defer halt()
	deadline := time.Now().Add(20 * time.Second)
	for {
		var parked bool
		if err := e.db.QueryRow(`SELECT EXISTS (SELECT 1 FROM outbox_effects_all WHERE topic = 'out_b' AND parked_at IS NOT NULL)`).Scan(&parked); err != nil {
			t.Fatal(err)
		}
		if parked {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the refused effect was not parked within 20s")
		}
		// A failure counts toward parking only while something else reaches the broker: send
		// another effect, and make the refused one due again rather than wait out its backoff.
		commitPending(t, e, "out_a", "more", 1, 1)
		mustExec(t, e, `UPDATE outbox_effects_all SET next_attempt_at = now() WHERE topic = 'out_b'`)
		time.Sleep(100 * time.Millisecond)
	}
	halt() // the captured lines are read once nothing logs any more
	var failed, parked int
	for _, m := range logs.Captured()[watermill.ErrorLogLevel] {
		switch {
		case strings.HasPrefix(m.Msg, "Relay could not dispatch"):
			failed++
			if m.Err == nil || !strings.Contains(m.Err.Error(), "refuses messages") || m.Fields["kind"] != "publish" {
				t.Errorf("failed dispatch logged as %q, err %v, kind %q: want the broker's error and kind publish", m.Msg, m.Err, m.Fields["kind"])
			}
		case strings.Contains(m.Msg, "parked"):
			parked++
			if m.Err == nil || !strings.Contains(m.Err.Error(), "refuses messages") {
				t.Errorf("parked effect logged as %q, err %v, fields %v: want the broker's error as the error", m.Msg, m.Err, m.Fields)
			}
			if _, ok := m.Fields["reason"]; ok {
				t.Errorf("parked effect logged with the cause in a field of its own: %v", m.Fields)
			}
			if !strings.Contains(m.Msg, "outbox parked") {
				t.Errorf("parked effect logged as %q: want it to name the command that lists them (outbox parked list)", m.Msg)
			}
		}
	}
	if failed == 0 || parked == 0 {
		t.Fatalf("%d failed dispatches and %d parked effects logged, want both", failed, parked)
	}
}

// TestDeadLetterLogLineNamesTheCommand: the log line of a dead-lettered message carries the
// handler's error as its error and tells the operator what to run (outbox dead list, or the
// console), not a Go method of the service's code.
func TestDeadLetterLogLineNamesTheCommand(t *testing.T) {
	e := newEnv(t)
	logs := watermill.NewCaptureLogger()
	ob := e.newOutbox(func(c *outbox.Config) { c.Logger = logs })
	msg := message.NewMessage(uuid.NewString(), []byte("{"))
	err := ob.Handle(msg, outbox.HandleParams{Consumer: "c1", MessageID: msg.UUID, Topic: "orders.in"}, func(*message.Message) ([]*message.Message, error) {
		return nil, outbox.Permanent(errors.New("cannot parse the order"))
	})
	if err != nil {
		t.Fatalf("a permanent failure: want the message dead-lettered and acked, got %v", err)
	}
	var lines int
	for _, m := range logs.Captured()[watermill.ErrorLogLevel] {
		if !strings.Contains(m.Msg, "dead-lettered") {
			continue
		}
		lines++
		if m.Err == nil || !strings.Contains(m.Err.Error(), "cannot parse the order") {
			t.Errorf("dead letter logged with err %v, want the handler's error", m.Err)
		}
		if !strings.Contains(m.Msg, "outbox dead list") || strings.Contains(m.Msg, "Outbox.") {
			t.Errorf("dead letter logged as %q: want it to name the command that lists them (outbox dead list), not a Go method", m.Msg)
		}
	}
	if lines != 1 {
		t.Fatalf("%d log lines of a dead-lettered message, want 1", lines)
	}
}
