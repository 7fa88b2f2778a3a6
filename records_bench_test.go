package outbox_test

import (
	"crypto/rand"
	"fmt"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"

	"github.com/watermill-outbox/outbox"
	"github.com/watermill-outbox/outbox/drivers/postgres"
)

// BenchmarkOneAtATimeRecords: a handler of the database/sql form that records n messages of 300
// random bytes, one Publish call each, with the default MaxInlineBytes (the effects kept in the
// claim while that is cheaper, then moved to rows) and with every effect a row from the first.
// The two take turns message by message (the machine's drift hits both alike); per message: the
// unit's time (the handler, the commit and the dispatch; the mark is written in the background)
// and the WAL written (the mark's too), and the inline variant's time over the rows'.
//
//	go test -run '^$' -bench OneAtATimeRecords -benchtime 100x .
func BenchmarkOneAtATimeRecords(b *testing.B) {

	variants := []struct {
		name     string
		maxBytes int
	}{{"rows", -1}, {"inline", 0}}
	for _, n := range []int{1, 2, 3, 4, 6, 8, 16, 64, 256} {
		b.Run(fmt.Sprintf("records=%d", n), func(b *testing.B) {
			e := newEnv(b)
			// Without the WAL flush of each commit, which would be most of the time measured
			// on a disk of the tests (fsync) and the same in each variant.
			if _, err := e.db.Exec(`DO $$ BEGIN EXECUTE format('ALTER DATABASE %I SET synchronous_commit = off', current_database()); END $$`); err != nil {
				b.Fatal(err)
			}
			e.db.SetMaxIdleConns(-1) // connections opened from now on take the setting
			e.db.SetMaxIdleConns(2)
			pub := newNullPublisher()
			obs := make([]*outbox.Outbox, len(variants))
			for i, v := range variants {
				obs[i] = e.newOutbox(func(c *outbox.Config) {
					c.Driver, c.Publisher, c.EffectRetention = postgres.Driver{MaxInlineBytes: v.maxBytes}, pub, 0
				})
			}
			h := func(msg *message.Message) ([]*message.Message, error) {
				ctx := msg.Context()
				if err := businessWrite(ctx, outbox.Tx(ctx), msg.UUID); err != nil {
					return nil, err
				}
				for range n {
					// Random bytes, different in each: PostgreSQL compresses a large claim
					// (TOAST), and would make little of repeated or regular payloads.
					payload := make([]byte, 300)
					_, _ = rand.Read(payload)
					if err := outbox.Publish(ctx, "out_a", message.NewMessage(uuid.NewString(), payload)); err != nil {
						return nil, err
					}
				}
				return nil, nil
			}
			walLSN := func() int64 {
				var lsn int64
				if err := e.db.QueryRow(`SELECT pg_current_wal_lsn() - '0/0'`).Scan(&lsn); err != nil {
					b.Fatal(err)
				}
				return lsn
			}
			took := make([]time.Duration, len(variants))
			wal := make([]int64, len(variants))
			b.ResetTimer()
			for i := 0; i < b.N; i++ {
				for v, ob := range obs {
					lsn := walLSN()
					start := time.Now()
					if err := handle(ob, message.NewMessage(uuid.NewString(), nil), h); err != nil {
						b.Fatal(err)
					}
					took[v] += time.Since(start)
					ob.FlushMarks() // its WAL counts; its wait for a batch does not
					wal[v] += walLSN() - lsn
				}
			}
			b.StopTimer()
			for v, x := range variants {
				b.ReportMetric(float64(took[v].Microseconds())/float64(b.N), x.name+"-µs/msg")
				b.ReportMetric(float64(wal[v])/float64(b.N), x.name+"-WAL-B/msg")
				if v > 0 {
					b.ReportMetric(float64(took[v])/float64(took[0]), x.name+"/rows-time")
				}
			}
		})
	}
}
