package engine

import (
	"context"
	"fmt"
	"testing"
	"time"
)

// BenchmarkWakeBurst is the scheduler's cost of starting runs among many members: 200 members of
// four tasks each (as a Set's members have: relay, cleanup, sampling, redrive), none due by its
// interval; each iteration wakes the relays of 8 members at once, as commits of 8 messages in
// flight over 200 tenants do, and waits for their runs to return.
func BenchmarkWakeBurst(b *testing.B) {
	for _, members := range []int{1, 200} {
		b.Run(fmt.Sprint(members, " members"), func(b *testing.B) {
			e := New(Config{})
			if err := e.Start(context.Background()); err != nil {
				b.Fatal(err)
			}
			defer func() {
				ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
				defer cancel()
				_ = e.Stop(ctx)
			}()
			done := make(chan struct{}, 2*members)
			wakes := make([]*Wakeup, members)
			idle := func(context.Context) (Outcome, error) { return Idle, nil }
			for i := range members {
				wakes[i] = &Wakeup{}
				relay := func(context.Context) (Outcome, error) { done <- struct{}{}; return Idle, nil }
				m := Member{Name: fmt.Sprint("m", i), Tasks: []Task{
					{Name: "relay", Every: time.Hour, Wake: wakes[i], Run: relay},
					{Name: "cleanup", Every: time.Hour, Run: idle},
					{Name: "sampling", Every: time.Hour, Run: idle},
					{Name: "redrive", Every: time.Hour, Run: idle},
				}}
				if _, err := e.Add(m); err != nil {
					b.Fatal(err)
				}
			}
			// The first runs of every task, all due at Add, out of the way.
			time.Sleep(100 * time.Millisecond)
			for len(done) > 0 {
				<-done
			}
			burst := min(8, members)
			b.ResetTimer()
			for i := range b.N {
				for k := range burst {
					wakes[(i*burst+k)%members].Wake()
				}
				for range burst {
					<-done
				}
			}
		})
	}
}
