package outbox_test

import (
	"context"
	"database/sql"
	"errors"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"

	"github.com/watermill-outbox/outbox"
	"github.com/watermill-outbox/outbox/drivers/postgres"
)

// stamps records when each effect's commit happened and when its Publish call was made.
type stamps struct {
	mu        sync.Mutex
	committed map[string]time.Time // by the effect UUID recorded in the transaction
	published map[string]time.Time
	current   string
}

func newStamps() *stamps {
	return &stamps{committed: map[string]time.Time{}, published: map[string]time.Time{}}
}

// stampingPublisher notes the time of the first Publish of each UUID, then forwards (or fails).
type stampingPublisher struct {
	s    *stamps
	next message.Publisher
	fail bool
}

func (p *stampingPublisher) Publish(topic string, msgs ...*message.Message) error {
	if p.fail {
		return errors.New("broker unavailable")
	}
	now := time.Now()
	p.s.mu.Lock()
	for _, m := range msgs {
		if _, ok := p.s.published[m.UUID]; !ok {
			p.s.published[m.UUID] = now
		}
	}
	p.s.mu.Unlock()
	return p.next.Publish(topic, msgs...)
}

func (p *stampingPublisher) Close() error { return nil }

func (s *stamps) failpoint(_ context.Context, point string) error {
	if point == outbox.FailpointAfterCommit {
		s.mu.Lock()
		s.committed[s.current] = time.Now()
		s.mu.Unlock()
	}
	return nil
}

func (s *stamps) report(b *testing.B) {
	s.mu.Lock()
	defer s.mu.Unlock()
	var d []time.Duration
	for id, c := range s.committed {
		p, ok := s.published[id]
		if !ok {
			b.Fatalf("effect %s was never published", id)
		}
		d = append(d, p.Sub(c))
	}
	slices.Sort(d)
	if len(d) == 0 {
		return
	}
	b.ReportMetric(float64(d[len(d)/2].Microseconds()), "p50-µs")
	b.ReportMetric(float64(d[len(d)*99/100].Microseconds()), "p99-µs")
}

func oneEffect(b *testing.B, ob *outbox.Outbox, s *stamps) {
	id := uuid.NewString()
	s.mu.Lock()
	s.current = id
	s.mu.Unlock()
	err := ob.InTx(context.Background(), func(ctx context.Context, tx *sql.Tx) error {
		return outbox.Publish(ctx, "out_a", message.NewMessage(id, []byte(`{}`)))
	})
	if err != nil {
		b.Fatal(err)
	}
}

// BenchmarkCommitToPublish measures the time from a boundary commit to the Publish call that sends
// its effect: on the fast path, and through another instance's relay woken by NOTIFY after the
// fast path failed.
func BenchmarkCommitToPublish(b *testing.B) {
	b.Run("fast-path", func(b *testing.B) {
		e := newEnv(b)
		s := newStamps()
		ob := e.newOutbox(func(c *outbox.Config) {
			c.Publisher = &stampingPublisher{s: s, next: e.pub.next}
			c.Failpoint = s.failpoint
		})
		b.ResetTimer()
		for i := 0; i < b.N; i++ {
			oneEffect(b, ob, s)
		}
		b.StopTimer()
		s.report(b)
	})
	b.Run("relay-notify", func(b *testing.B) {
		e := newEnv(b)
		s := newStamps()
		writer := e.newOutbox(func(c *outbox.Config) {
			c.Publisher = &stampingPublisher{s: s, fail: true}
			c.Failpoint = s.failpoint
		})
		relay := e.newOutbox(func(c *outbox.Config) {
			c.Publisher = &stampingPublisher{s: s, next: e.pub.next}
			c.Driver = postgres.Driver{ListenDSN: e.dsn}
			c.RelayInterval = time.Hour // only NOTIFY wakes it
		})
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan error)
		go func() { done <- relay.Run(ctx) }()
		defer func() { cancel(); <-done }()
		waitFor(b, "the relay to listen", func() bool {
			return e.count(`SELECT count(*) FROM pg_stat_activity WHERE query LIKE 'LISTEN %'`) > 0
		})
		b.ResetTimer()
		for i := 0; i < b.N; i++ {
			oneEffect(b, writer, s)
			// One at a time, so that each measurement is one wake-up, not a batch.
			id := s.current
			waitFor(b, "the relay", func() bool {
				s.mu.Lock()
				defer s.mu.Unlock()
				_, ok := s.published[id]
				return ok
			})
		}
		b.StopTimer()
		s.report(b)
	})
}
