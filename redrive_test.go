package outbox_test

import (
	"context"
	"database/sql"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/watermill-outbox/outbox"
	"github.com/watermill-outbox/outbox/drivers/postgres"
	"github.com/watermill-outbox/outbox/internal/pgtest"
)

// channelBroker hands what the relay publishes to the test, which delivers it to the consumer.
type channelBroker struct {
	mu   sync.Mutex
	sent []*message.Message
}

func (b *channelBroker) Publish(_ string, msgs ...*message.Message) error {
	b.mu.Lock()
	defer b.mu.Unlock()
	for _, m := range msgs {
		b.sent = append(b.sent, m.Copy())
	}
	return nil
}

func (b *channelBroker) Close() error { return nil }

func (b *channelBroker) take() []*message.Message {
	b.mu.Lock()
	defer b.mu.Unlock()
	out := b.sent
	b.sent = nil
	return out
}

// TestRedriveRetriesDeadLettersABoundedNumberOfTimes: with Config.Redrive, a dead letter is
// retried on its own After it was stored, MaxRetries times in all; a message that keeps failing
// then stays dead, and one dead-lettered for a permanent error is left to the operator.
func TestRedriveRetriesDeadLettersABoundedNumberOfTimes(t *testing.T) {
	db := pgtest.DB(t)
	ctx := context.Background()
	b := &channelBroker{}
	ob, err := outbox.New(outbox.Config{DB: db, Driver: postgres.Driver{}, Publisher: b, Logger: watermill.NopLogger{},
		MaxAttempts: 1, RetryDelay: -1, RelayInterval: 50 * time.Millisecond,
		Redrive: outbox.DeadLetterRedrive{After: 300 * time.Millisecond, MaxRetries: 2}})
	if err != nil {
		t.Fatal(err)
	}
	if err := ob.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	runs := map[string]int{}
	deliver := func(msg *message.Message) {
		t.Helper()
		err := ob.Handle(msg, outbox.HandleParams{Consumer: "billing", MessageID: msg.UUID, Topic: "orders"},
			func(m *message.Message) ([]*message.Message, error) {
				runs[m.UUID]++
				if string(m.Payload) == "unparsable" {
					return nil, outbox.Permanent(errors.New("cannot parse"))
				}
				return nil, errors.New("payment provider unavailable")
			})
		if err != nil {
			t.Fatalf("delivering %s: %v, want it dead-lettered and acked", msg.UUID, err)
		}
	}
	deliver(message.NewMessage("m-flaky", []byte("order")))
	deliver(message.NewMessage("m-bad", []byte("unparsable")))

	runCtx, stop := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- ob.Run(runCtx) }()
	defer func() { stop(); <-done }()
	retries := func(id string) (n int, state string) {
		t.Helper()
		if err := db.QueryRow(`SELECT retries, state FROM outbox_dead_letters WHERE message_id = $1`, id).Scan(&n, &state); err != nil && !errors.Is(err, sql.ErrNoRows) {
			t.Fatal(err)
		}
		return n, state
	}
	deadline := time.Now().Add(30 * time.Second)
	for {
		for _, m := range b.take() {
			deliver(m)
		}
		if n, state := retries("m-flaky"); n == 2 && state == "dead" {
			break
		}
		if time.Now().After(deadline) {
			n, state := retries("m-flaky")
			t.Fatalf("m-flaky: %d retries, %s, after 30s; want 2 retries and dead again", n, state)
		}
		time.Sleep(20 * time.Millisecond)
	}
	// Past another After and then some: no third retry, and the permanent one was never retried.
	time.Sleep(time.Second)
	for _, m := range b.take() {
		deliver(m)
	}
	if n, state := retries("m-flaky"); n != 2 || state != "dead" || runs["m-flaky"] != 3 {
		t.Errorf("m-flaky: %d retries, %s, %d runs of its handler; want 2, dead, 3", n, state, runs["m-flaky"])
	}
	if n, state := retries("m-bad"); n != 0 || state != "dead" || runs["m-bad"] != 1 {
		t.Errorf("m-bad (permanent): %d retries, %s, %d runs; want 0, dead, 1", n, state, runs["m-bad"])
	}
	if _, err := outbox.New(outbox.Config{DB: db, Driver: postgres.Driver{}, Publisher: b, DeadLetters: outbox.DeadLettersOff,
		Redrive: outbox.DeadLetterRedrive{After: time.Minute}}); err == nil {
		t.Error("Redrive with DeadLettersOff: want a configuration error")
	}
}

// The redrive policy read the oldest 1,000 dead letters and retried those it may: once they were
// all dead letters it may not retry (permanent ones kept for inspection), it retried nothing,
// ever, however many younger ones it may. It reads only those it may now.
func TestRedriveLooksPastDeadLettersItMayNotRetry(t *testing.T) {
	db := pgtest.DB(t)
	ctx := context.Background()
	ob, err := outbox.New(outbox.Config{DB: db, Driver: postgres.Driver{}, Publisher: &channelBroker{}, Logger: watermill.NopLogger{},
		Redrive: outbox.DeadLetterRedrive{After: time.Millisecond, MaxRetries: 2}})
	if err != nil {
		t.Fatal(err)
	}
	if err := ob.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	if _, err := db.Exec(`INSERT INTO outbox_dead_letters (consumer, message_id, source_topic, payload, metadata, reason, attempts, permanent, dead_at)
		SELECT 'billing', 'permanent-' || g, 'orders', 'p', '', 'cannot parse', 1, true, now() - interval '1 day' + g * interval '1 second'
		FROM generate_series(1, 1000) g;
		INSERT INTO outbox_dead_letters (consumer, message_id, source_topic, payload, metadata, reason, attempts, permanent, dead_at)
		VALUES ('billing', 'flaky', 'orders', 'p', '', 'provider unavailable', 5, false, now() - interval '1 minute')`); err != nil {
		t.Fatal(err)
	}
	if err := outbox.RedrivePass(ctx, ob); err != nil {
		t.Fatal(err)
	}
	var state string
	var retries int
	if err := db.QueryRow(`SELECT state, retries FROM outbox_dead_letters WHERE message_id = 'flaky'`).Scan(&state, &retries); err != nil {
		t.Fatal(err)
	}
	if state != "retried" || retries != 1 {
		t.Errorf("the dead letter behind 1,000 permanent ones: %s, %d retries; want retried once", state, retries)
	}
}
