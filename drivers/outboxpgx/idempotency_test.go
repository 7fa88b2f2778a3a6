package outboxpgx_test

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/watermill-outbox/outbox"
	"github.com/watermill-outbox/outbox/drivers/outboxpgx"
	"github.com/watermill-outbox/outbox/outboxtest"
)

// placeOrder is a keyed unit of work on pgx: one business row, two effects with derived UUIDs,
// the response as the result.
func placeOrder(runs *atomic.Int32, order string) func(ctx context.Context, tx pgx.Tx) error {
	return func(ctx context.Context, tx pgx.Tx) error {
		runs.Add(1)
		if _, err := tx.Exec(ctx, `INSERT INTO applied (message_id, note) VALUES ($1, 'order')`, order); err != nil {
			return err
		}
		if err := outbox.Publish(ctx, "out", outbox.NewMessage(ctx, []byte("placed "+order)), outbox.NewMessage(ctx, []byte("charge "+order))); err != nil {
			return err
		}
		return outbox.SetResult(ctx, []byte("order "+order+" placed"))
	}
}

// Many clients retry one key at once, in both modes: fn runs once, and every caller that waited
// gets the first one's result; without waiting, the others are told the key is in flight.
func TestKeyedInTxConcurrentRetriesRunOnce(t *testing.T) {
	for name, mode := range modes {
		for _, wait := range []bool{true, false} {
			t.Run(fmt.Sprintf("%s/wait=%v", name, wait), func(t *testing.T) {
				pool := openPool(t, outboxtest.DSN(t), 32, nil)
				rec := &outboxtest.Recorder{}
				ob := ready(t, pool, outbox.Config{Publisher: rec}, outboxpgx.WithConcurrency(mode))
				const callers = 20
				var runs, ran, replayed, inFlight atomic.Int32
				var opts []outbox.KeyOption
				if wait {
					opts = append(opts, outbox.WaitInFlight())
				}
				start := make(chan struct{})
				var wg sync.WaitGroup
				for range callers {
					wg.Add(1)
					go func() {
						defer wg.Done()
						<-start
						ctx := outbox.WithIdempotencyKey(context.Background(), "orders", "k", opts...)
						err := outboxpgx.InTx(ctx, ob, func(ctx context.Context, tx pgx.Tx) error {
							time.Sleep(200 * time.Millisecond)
							return placeOrder(&runs, "o1")(ctx, tx)
						})
						switch {
						case errors.Is(err, outbox.ErrIdempotencyInFlight):
							inFlight.Add(1)
							return
						case err != nil:
							t.Errorf("InTx: %v", err)
							return
						}
						res, rep := outbox.IdempotencyResult(ctx)
						if string(res) != "order o1 placed" {
							t.Errorf("result %q", res)
						}
						if rep {
							replayed.Add(1)
						} else {
							ran.Add(1)
						}
					}()
				}
				close(start)
				wg.Wait()
				t.Logf("%d callers: %d ran, %d replayed, %d told in flight", callers, ran.Load(), replayed.Load(), inFlight.Load())
				if runs.Load() != 1 || ran.Load() != 1 {
					t.Fatalf("fn ran %d times (%d callers saw it run), want once", runs.Load(), ran.Load())
				}
				if wait && replayed.Load() != callers-1 {
					t.Errorf("replayed %d, want %d", replayed.Load(), callers-1)
				}
				if !wait && inFlight.Load() == 0 {
					t.Errorf("no caller told the key was in flight")
				}
				var rows int
				if err := pool.QueryRow(context.Background(), `SELECT count(*) FROM applied`).Scan(&rows); err != nil {
					t.Fatal(err)
				}
				if sent := len(rec.All()); rows != 1 || sent != 2 {
					t.Errorf("business rows %d, effects sent %d; want 1 and 2", rows, sent)
				}
				ob.FlushMarks()
				if n := pool.Stat().AcquiredConns(); n != 0 {
					t.Errorf("%d connection(s) still acquired", n)
				}
			})
		}
	}
}

// A crash at every step of a keyed unit, in both modes, then a retry by a restarted process:
// one business change, each effect sent under one UUID, the stored response to the retry when the
// first run committed; a key reused with another request is refused.
func TestKeyedInTxCrashThenRetry(t *testing.T) {
	points := []string{outbox.FailpointAfterClaim, outbox.FailpointAfterHandler, outbox.FailpointAfterCommit, outbox.FailpointAfterPublish}
	for name, mode := range modes {
		for _, point := range points {
			t.Run(name+"/"+point, func(t *testing.T) {
				dsn := outboxtest.DSN(t)
				ctx := context.Background()
				crash := errors.New("crash")
				first := &outboxtest.Recorder{}
				crashing := ready(t, openPool(t, dsn, 4, nil), outbox.Config{Publisher: first,
					Failpoint: func(_ context.Context, p string) error {
						if p == point {
							return crash
						}
						return nil
					}}, outboxpgx.WithConcurrency(mode))
				var runs atomic.Int32
				key := outbox.WithIdempotencyKey(ctx, "orders", "k", outbox.Fingerprint([]byte("order o1")))
				err := outboxpgx.InTx(key, crashing, placeOrder(&runs, "o1"))
				if point != outbox.FailpointAfterPublish && !errors.Is(err, crash) || point == outbox.FailpointAfterPublish && err != nil {
					t.Fatalf("InTx crashing at %s: %v", point, err)
				}
				committed := point == outbox.FailpointAfterCommit || point == outbox.FailpointAfterPublish

				second := &outboxtest.Recorder{}
				pool := openPool(t, dsn, 4, nil)
				restarted := ready(t, pool, outbox.Config{Publisher: second, RelayGrace: 100 * time.Millisecond,
					RelayInterval: 50 * time.Millisecond}, outboxpgx.WithConcurrency(mode))
				retry := outbox.WithIdempotencyKey(ctx, "orders", "k", outbox.Fingerprint([]byte("order o1")))
				if err := outboxpgx.InTx(retry, restarted, placeOrder(&runs, "o1")); err != nil {
					t.Fatalf("retry: %v", err)
				}
				res, rep := outbox.IdempotencyResult(retry)
				if rep != committed || string(res) != "order o1 placed" {
					t.Fatalf("retry: result %q replayed %v; want the stored response, replayed %v", res, rep, committed)
				}
				other := outbox.WithIdempotencyKey(ctx, "orders", "k", outbox.Fingerprint([]byte("order o2")))
				if err := outboxpgx.InTx(other, restarted, placeOrder(&runs, "o2")); !errors.Is(err, outbox.ErrIdempotencyMismatch) {
					t.Fatalf("key reused with another request: %v", err)
				}
				wantRuns := int32(1)
				if point == outbox.FailpointAfterHandler {
					wantRuns = 2
				}
				if runs.Load() != wantRuns {
					t.Errorf("fn ran %d times, want %d", runs.Load(), wantRuns)
				}
				runRelay(t, restarted)
				waitUntil(t, 20*time.Second, "every effect sent", func() bool {
					var pending int
					if err := pool.QueryRow(ctx, `SELECT (SELECT count(*) FROM outbox_effects_all) + (SELECT count(*) FROM outbox_processed WHERE effects IS NOT NULL)`).Scan(&pending); err != nil {
						t.Fatal(err)
					}
					return pending == 0
				})
				var rows int
				if err := pool.QueryRow(ctx, `SELECT count(*) FROM applied`).Scan(&rows); err != nil || rows != 1 {
					t.Errorf("business rows %d (%v), want 1", rows, err)
				}
				var uuids []string
				for _, s := range append(first.All(), second.All()...) {
					if !slices.Contains(uuids, s.Message.UUID) {
						uuids = append(uuids, s.Message.UUID)
					}
				}
				if len(uuids) != 2 {
					t.Errorf("UUIDs sent %v, want the two effects' once each", uuids)
				}
			})
		}
	}
}

// The UUIDs derived from the key are the same when the request runs again after its commit was
// lost (the rows deleted, as a restore to before the commit would).
func TestDerivedUUIDsEqualAcrossRerun(t *testing.T) {
	for name, mode := range modes {
		t.Run(name, func(t *testing.T) {
			pool := openPool(t, outboxtest.DSN(t), 4, nil)
			rec := &outboxtest.Recorder{}
			ob := ready(t, pool, outbox.Config{Publisher: rec}, outboxpgx.WithConcurrency(mode))
			var runs atomic.Int32
			run := func() []string {
				before := len(rec.All())
				if err := outboxpgx.InTx(outbox.WithIdempotencyKey(context.Background(), "orders", "k"), ob, placeOrder(&runs, "o1")); err != nil {
					t.Fatal(err)
				}
				var ids []string
				for _, s := range rec.All()[before:] {
					ids = append(ids, s.Message.UUID)
				}
				return ids
			}
			first := run()
			if _, err := pool.Exec(context.Background(), `DELETE FROM applied; DELETE FROM outbox_idempotency`); err != nil {
				t.Fatal(err)
			}
			second := run()
			if runs.Load() != 2 || len(first) != 2 || !slices.Equal(first, second) || first[0] == first[1] {
				t.Fatalf("UUIDs %v, then %v after the lost commit (%d runs); want two distinct, equal across runs", first, second, runs.Load())
			}
		})
	}
}
