package postgres

import (
	"context"
	"database/sql"
	"fmt"
	"os"
	"sort"
	"testing"
	"time"

	"github.com/watermill-outbox/outbox/internal/pgtest"
	"github.com/watermill-outbox/outbox/outboxdriver"
)

// TestMeasureClaimBehindAHeldHorizon measures the relay's claim and mark while a session holds
// the xmin horizon, rotated and not: units at the boundary record 400 effects/s and a relay loop
// claims and marks them every 50 ms. Rotated, it also runs with units of work that read the
// effects table (as a consumer's unit does) and stay open 10 or 50 ms, 8 at a time: each holds a
// lock on every partition until it ends, and the rotation's TRUNCATE waits 20 ms at most for its
// exclusive lock; it reports how many rotations happened and the longest time without one. Set
// OUTBOX_MEASURE_HOLD to the length of the hold (say 2m); it is skipped otherwise.
func TestMeasureClaimBehindAHeldHorizon(t *testing.T) {
	hold, err := time.ParseDuration(os.Getenv("OUTBOX_MEASURE_HOLD"))
	if err != nil {
		t.Skip("OUTBOX_MEASURE_HOLD not set")
	}
	type config struct {
		every   time.Duration
		readFor time.Duration // how long each reading unit stays open; 0: none
	}
	for _, c := range []config{{DefaultRotateEvery, 0}, {DefaultRotateEvery, 10 * time.Millisecond}, {DefaultRotateEvery, 50 * time.Millisecond}, {-1, 0}} {
		every := c.every
		db := pgtest.DB(t)
		st := rotationStore(t, db, every)
		ctx, cancel := context.WithTimeout(context.Background(), hold)
		if _, err := db.Exec(`CREATE TABLE unrelated (x int); INSERT INTO unrelated VALUES (1)`); err != nil {
			t.Fatal(err)
		}
		holder, err := db.Conn(context.Background())
		if err != nil {
			t.Fatal(err)
		}
		htx, err := holder.BeginTx(context.Background(), &sql.TxOptions{Isolation: sql.LevelRepeatableRead})
		if err != nil {
			t.Fatal(err)
		}
		if _, err := htx.Exec(`SELECT x FROM unrelated`); err != nil {
			t.Fatal(err)
		}
		done := make(chan error, 1)
		go func() {
			tick := time.NewTicker(10 * time.Millisecond)
			defer tick.Stop()
			for u := 0; ctx.Err() == nil; u++ {
				<-tick.C
				if _, err := recordUnit(st, db, fmt.Sprint("u", u), fmt.Sprint("k", u%32), 4); err != nil {
					done <- err
					return
				}
			}
			done <- nil
		}()
		readers := make(chan error, 8)
		for r := 0; r < 8 && c.readFor > 0; r++ {
			go func() {
				for u := 0; ctx.Err() == nil; u++ {
					tx, err := db.BeginTx(ctx, nil)
					if err == nil {
						var n int
						err = tx.QueryRowContext(ctx, `SELECT count(*) FROM (SELECT 1 FROM rot_effects_all WHERE ordering_key = $1 AND dispatched_at IS NULL LIMIT 1) s`, fmt.Sprint("k", u%32)).Scan(&n)
						time.Sleep(c.readFor)
						_ = tx.Rollback()
					}
					if err != nil && ctx.Err() == nil {
						readers <- err
						return
					}
				}
				readers <- nil
			}()
		}
		rotations, lastGen, lastRotation, longestWithout := 0, 0, time.Now(), time.Duration(0)
		type sample struct{ claim, mark time.Duration }
		var first, last []sample
		start := time.Now()
		for ctx.Err() == nil {
			time.Sleep(50 * time.Millisecond)
			if len(done) > 0 {
				break
			}
			t0 := time.Now()
			c, err := st.EffectClaimDue(context.Background(), outboxdriver.EffectClaimParams{Limit: 500, MaxBytes: 1 << 20, Lease: time.Minute})
			if err != nil {
				t.Fatal(err)
			}
			t1 := time.Now()
			marks := map[outboxdriver.Source][]int64{}
			for _, e := range c.Effects {
				marks[e.Source] = append(marks[e.Source], e.StoreID)
			}
			var ms []outboxdriver.DispatchMark
			for src, ids := range marks {
				ms = append(ms, outboxdriver.DispatchMark{Source: src, StoreIDs: ids})
			}
			if len(ms) > 0 {
				if err := st.EffectMarkDispatched(context.Background(), ms...); err != nil {
					t.Fatal(err)
				}
			}
			s := sample{t1.Sub(t0), time.Since(t1)}
			var gen int
			if err := db.QueryRow(`SELECT gen FROM rot_effects_rotation`).Scan(&gen); err != nil {
				t.Fatal(err)
			}
			if gen != lastGen {
				rotations, lastGen, lastRotation = rotations+1, gen, time.Now()
			}
			longestWithout = max(longestWithout, time.Since(lastRotation))
			switch el := time.Since(start); {
			case el > 5*time.Second && el < 25*time.Second:
				first = append(first, s)
			case el > hold-20*time.Second:
				last = append(last, s)
			}
		}
		if err := <-done; err != nil {
			t.Fatal(err)
		}
		for r := 0; r < 8 && c.readFor > 0; r++ {
			if err := <-readers; err != nil {
				t.Fatal(err)
			}
		}
		cancel()
		_ = htx.Rollback()
		_ = holder.Close()
		med := func(xs []sample, f func(sample) time.Duration) time.Duration {
			ds := make([]time.Duration, len(xs))
			for i, x := range xs {
				ds[i] = f(x)
			}
			sort.Slice(ds, func(i, j int) bool { return ds[i] < ds[j] })
			if len(ds) == 0 {
				return 0
			}
			return ds[len(ds)/2]
		}
		claim := func(s sample) time.Duration { return s.claim }
		mark := func(s sample) time.Duration { return s.mark }
		t.Logf("RotateEvery %s, reading units open %s, hold %s: median claim %s -> %s, mark %s -> %s (first 5-25 s, last 20 s); first pending look-up %d buffers; %d rotations, longest without one %s",
			every, c.readFor, hold, med(first, claim), med(last, claim), med(first, mark), med(last, mark), firstPendingBuffers(t, db), rotations, longestWithout.Round(time.Second))
	}
}
