package mysql_test

import (
	"context"
	"database/sql"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/watermill-outbox/outbox"
	"github.com/watermill-outbox/outbox/drivers/mysql"
	"github.com/watermill-outbox/outbox/drivers/mysql/internal/mysqltest"
	"github.com/watermill-outbox/outbox/outboxdriver"
)

// slowPublisher takes each call of topic slow a while, and records what it sent.
type slowPublisher struct {
	slow  string
	delay time.Duration
	mu    sync.Mutex
	sent  map[string][]time.Time
}

func (p *slowPublisher) Publish(topic string, msgs ...*message.Message) error {
	if topic == p.slow {
		time.Sleep(p.delay)
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	for range msgs {
		p.sent[topic] = append(p.sent[topic], time.Now())
	}
	return nil
}

func (p *slowPublisher) Close() error { return nil }

func (p *slowPublisher) count(topic string) (int, time.Time) {
	p.mu.Lock()
	defer p.mu.Unlock()
	s := p.sent[topic]
	if len(s) == 0 {
		return 0, time.Time{}
	}
	return len(s), s[0]
}

// TestDelayedEffectDueDuringALongRelayPass: on a store whose relay claim does not read the
// delayed effects (MySQL, SQLite), they were moved only at the start of a pass: one that fell due
// while the relay drained a backlog (a pass may last half of BackgroundTimeout) waited for the
// pass to end before it even joined the queue. The due timer now has it moved at the next turn of
// the pass; it then waits its turn behind the backlog as any effect committed then would.
func TestDelayedEffectDueDuringALongRelayPass(t *testing.T) {
	db := mysqltest.DB(t)
	pub := &slowPublisher{slow: "bulk", delay: 30 * time.Millisecond, sent: map[string][]time.Time{}}
	ob, err := outbox.New(outbox.Config{DB: db, Driver: mysql.Driver{}, Publisher: pub, RelayBatchSize: 1, RelayConcurrency: 1,
		RelayInterval: time.Hour, RetryDelay: -1})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = ob.Close() })
	ctx := context.Background()
	if err := ob.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	// A backlog for the relay: 150 effects of 30 ms each, handed over.
	st := ob.Store()
	src := outboxdriver.Source{Consumer: "bulk", ID: "backlog"}
	tx, err := db.BeginTx(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	if c, err := st.MessageClaim(ctx, tx, src); err != nil || !c.Claimed {
		t.Fatalf("claim: %+v %v", c, err)
	}
	effects := make([]outboxdriver.Effect, 150)
	for i := range effects {
		effects[i] = outboxdriver.Effect{Seq: i, Kind: outboxdriver.KindPublish, Topic: "bulk", UUID: fmt.Sprintf("bulk-%d", i),
			Payload: []byte("x"), Source: src, OrderingKey: fmt.Sprintf("k%d", i)}
	}
	if _, err := st.EffectInsert(ctx, tx, src, effects); err != nil {
		t.Fatal(err)
	}
	if err := tx.Commit(); err != nil {
		t.Fatal(err)
	}
	if err := st.EffectHandToRelay(ctx, src); err != nil {
		t.Fatal(err)
	}
	runCtx, stop := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- ob.Run(runCtx) }()
	defer func() { stop(); <-done }()
	deadline := time.Now().Add(20 * time.Second)
	for n, _ := pub.count("bulk"); n < 5; n, _ = pub.count("bulk") {
		if time.Now().After(deadline) {
			t.Fatal("the relay did not start on the backlog")
		}
		time.Sleep(10 * time.Millisecond)
	}
	recorded := time.Now()
	if err := ob.InTx(ctx, func(ctx context.Context, tx *sql.Tx) error {
		return outbox.Publish(outbox.WithDelay(ctx, 300*time.Millisecond), "late", message.NewMessage("late-1", nil))
	}); err != nil {
		t.Fatal(err)
	}
	// Moved among the pending effects once due: it then waits its turn behind the backlog, as any
	// effect committed then would, rather than behind the pass.
	var moved time.Duration
	for {
		var waiting int
		if err := db.QueryRow(`SELECT count(*) FROM outbox_delayed`).Scan(&waiting); err != nil {
			t.Fatal(err)
		}
		if waiting == 0 {
			moved = time.Since(recorded)
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the delayed effect was not moved")
		}
		time.Sleep(10 * time.Millisecond)
	}
	bulk, _ := pub.count("bulk")
	t.Logf("moved %s after it was recorded (due after 300 ms), %d of 150 of the backlog sent by then", moved.Round(time.Millisecond), bulk)
	if moved > 2*time.Second || bulk == 150 {
		t.Errorf("the delayed effect was moved %s after it was recorded, due after 300 ms, with %d of 150 of the backlog sent: it waited for the relay's pass over the backlog", moved, bulk)
	}
	for n, _ := pub.count("late"); n == 0; n, _ = pub.count("late") {
		if time.Now().After(deadline) {
			t.Fatal("the delayed effect was not sent")
		}
		time.Sleep(10 * time.Millisecond)
	}
}
