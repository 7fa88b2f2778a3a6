package outbox_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
	"unicode/utf8"

	"github.com/google/uuid"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/watermill-outbox/outbox"
	"github.com/watermill-outbox/outbox/ops"
)

// placeOrder is the keyed unit of work of these tests: one business row, two effects with UUIDs
// derived from the key, and the response as the result.
func placeOrder(runs *atomic.Int32, order string) func(ctx context.Context, tx *sql.Tx) error {
	return func(ctx context.Context, tx *sql.Tx) error {
		runs.Add(1)
		if _, err := tx.ExecContext(ctx, `INSERT INTO applied (message_id, note) VALUES ($1, 'order')`, order); err != nil {
			return err
		}
		if err := outbox.Publish(ctx, "out_a", outbox.NewMessage(ctx, []byte("placed "+order))); err != nil {
			return err
		}
		if err := outbox.Publish(ctx, "out_b", outbox.NewMessage(ctx, []byte("charge "+order))); err != nil {
			return err
		}
		return outbox.SetResult(ctx, []byte("order "+order+" placed"))
	}
}

// Many clients retry one key at once: fn runs once, one business row commits, each effect is
// stored once, and every caller gets the first one's result. With WaitInFlight every caller
// waits for it; without, those that came while it ran get ErrIdempotencyInFlight.
func TestKeyedInTxConcurrentRetriesRunOnce(t *testing.T) {
	for _, wait := range []bool{true, false} {
		t.Run(fmt.Sprintf("wait=%v", wait), func(t *testing.T) {
			e := newEnv(t)
			const callers = 24
			var runs atomic.Int32
			order := fmt.Sprintf("o-wait-%v", wait)
			var opts []outbox.KeyOption
			if wait {
				opts = append(opts, outbox.WaitInFlight())
			}
			start := make(chan struct{})
			var wg sync.WaitGroup
			var mu sync.Mutex
			var replayed, ran, inFlight int
			results := map[string]int{}
			for range callers {
				wg.Add(1)
				go func() {
					defer wg.Done()
					<-start
					ctx := outbox.WithIdempotencyKey(context.Background(), "orders", order, opts...)
					err := e.ob.InTx(ctx, func(ctx context.Context, tx *sql.Tx) error {
						// Long enough that the others arrive while it runs.
						time.Sleep(200 * time.Millisecond)
						return placeOrder(&runs, order)(ctx, tx)
					})
					mu.Lock()
					defer mu.Unlock()
					switch {
					case errors.Is(err, outbox.ErrIdempotencyInFlight):
						if strings.Contains(err.Error(), "outbox: outbox:") {
							t.Errorf("the in-flight error repeats its prefix: %v", err)
						}
						inFlight++
						return
					case err != nil:
						t.Errorf("InTx: %v", err)
						return
					}
					res, rep := outbox.IdempotencyResult(ctx)
					results[string(res)]++
					if rep {
						replayed++
					} else {
						ran++
					}
				}()
			}
			close(start)
			wg.Wait()
			t.Logf("%d callers: %d ran, %d replayed, %d told the key was in flight", callers, ran, replayed, inFlight)
			mustEqual(t, "runs of fn", runs.Load(), int32(1))
			mustEqual(t, "callers that ran fn", ran, 1)
			mustEqual(t, "business rows", e.count(`SELECT count(*) FROM applied WHERE message_id = $1`, order), 1)
			mustEqual(t, "stored effects", e.count(`SELECT count(*) FROM all_effects`), 2)
			if wait {
				mustEqual(t, "callers told in flight while waiting", inFlight, 0)
				mustEqual(t, "replays", replayed, callers-1)
			} else if inFlight == 0 {
				t.Errorf("no caller was told the key was in flight, though all came while the first ran")
			}
			for res, n := range results {
				if res != "order "+order+" placed" {
					t.Errorf("%d callers got result %q", n, res)
				}
			}
			// A retry after all of them: the stored result, nothing run.
			ctx := outbox.WithIdempotencyKey(context.Background(), "orders", order)
			if err := e.ob.InTx(ctx, placeOrder(&runs, order)); err != nil {
				t.Fatal(err)
			}
			res, rep := outbox.IdempotencyResult(ctx)
			mustEqual(t, "late retry replayed", rep, true)
			mustEqual(t, "late retry's result", string(res), "order "+order+" placed")
			mustEqual(t, "runs of fn", runs.Load(), int32(1))
		})
	}
}

// A unit that fails stores no key: the retry runs. A key reused with another fingerprint is
// refused without running fn; scopes keep equal keys apart.
func TestKeyedInTxFailureMismatchAndScopes(t *testing.T) {
	e := newEnv(t)
	var runs atomic.Int32
	fp := outbox.Fingerprint([]byte("POST /orders {sku: 1}"))
	failed := errors.New("card declined")
	ctx := outbox.WithIdempotencyKey(context.Background(), "orders", "k1", fp)
	err := e.ob.InTx(ctx, func(ctx context.Context, tx *sql.Tx) error {
		if err := placeOrder(&runs, "o1")(ctx, tx); err != nil {
			return err
		}
		return failed
	})
	if !errors.Is(err, failed) {
		t.Fatalf("failing fn: %v", err)
	}
	if _, rep := outbox.IdempotencyResult(ctx); rep {
		t.Fatal("a failed unit reported as replayed")
	}
	mustEqual(t, "stored keys after a failure", e.count(`SELECT count(*) FROM outbox_idempotency`), 0)
	if err := e.ob.InTx(ctx, placeOrder(&runs, "o1")); err != nil {
		t.Fatalf("retry after a failure: %v", err)
	}
	mustEqual(t, "runs (the failed one and its retry)", runs.Load(), int32(2))
	res, rep := outbox.IdempotencyResult(ctx)
	mustEqual(t, "retry after a failure replayed", rep, false)
	mustEqual(t, "retry's result", string(res), "order o1 placed")

	other := outbox.WithIdempotencyKey(context.Background(), "orders", "k1", outbox.Fingerprint([]byte("POST /orders {sku: 2}")))
	if err := e.ob.InTx(other, placeOrder(&runs, "o2")); !errors.Is(err, outbox.ErrIdempotencyMismatch) {
		t.Fatalf("key reused with another request: %v, want ErrIdempotencyMismatch", err)
	}
	noFP := outbox.WithIdempotencyKey(context.Background(), "orders", "k1")
	if err := e.ob.InTx(noFP, placeOrder(&runs, "o2")); !errors.Is(err, outbox.ErrIdempotencyMismatch) {
		t.Fatalf("key reused without a fingerprint: %v, want ErrIdempotencyMismatch", err)
	}
	mustEqual(t, "runs after the mismatches", runs.Load(), int32(2))
	if err := e.ob.InTx(outbox.WithIdempotencyKey(context.Background(), "payments", "k1", fp), placeOrder(&runs, "o3")); err != nil {
		t.Fatalf("the same key in another scope: %v", err)
	}
	mustEqual(t, "runs after the other scope", runs.Load(), int32(3))

	for _, k := range []struct{ scope, key string }{{"orders", ""}, {"orders", "a\x00b"}, {"s\x00", "k"}, {"orders", string(make([]byte, 256))}} {
		if err := e.ob.InTx(outbox.WithIdempotencyKey(context.Background(), k.scope, k.key), placeOrder(&runs, "o4")); !errors.Is(err, outbox.ErrInvalidIdempotencyKey) {
			t.Errorf("key %q in scope %q: %v, want ErrInvalidIdempotencyKey", k.key, k.scope, err)
		}
	}
	mustEqual(t, "runs after invalid keys", runs.Load(), int32(3))
}

// Misuse is refused: a keyed InTx inside the keyed unit (which would wait for its own key),
// JoinTx with a key, SetResult without one.
func TestKeyedInTxMisuse(t *testing.T) {
	e := newEnv(t)
	ctx := outbox.WithIdempotencyKey(context.Background(), "orders", "nested", outbox.WaitInFlight())
	var inner error
	err := e.ob.InTx(ctx, func(ctx context.Context, tx *sql.Tx) error {
		inner = e.ob.InTx(ctx, func(context.Context, *sql.Tx) error { return nil })
		return nil
	})
	if err != nil || !errors.Is(inner, outbox.ErrNestedUnitOfWork) {
		t.Fatalf("nested keyed InTx: outer %v, inner %v (want ErrNestedUnitOfWork)", err, inner)
	}
	// The same key set again on the inner context is the same key: refused at once, not waited
	// for until HandlerTimeout.
	start, inner, ran := time.Now(), nil, false
	err = e.ob.InTx(outbox.WithIdempotencyKey(context.Background(), "orders", "nested-again"), func(ctx context.Context, tx *sql.Tx) error {
		ran = true
		inner = e.ob.InTx(outbox.WithIdempotencyKey(ctx, "orders", "nested-again", outbox.WaitInFlight()), func(context.Context, *sql.Tx) error { return nil })
		return nil
	})
	if !ran {
		t.Fatal("the outer keyed unit did not run")
	}
	if err != nil || !errors.Is(inner, outbox.ErrNestedUnitOfWork) || time.Since(start) > 5*time.Second {
		t.Fatalf("nested InTx with the outer unit's key set again: outer %v, inner %v after %v (want ErrNestedUnitOfWork at once)", err, inner, time.Since(start))
	}
	tx, err := e.db.Begin()
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback() }()
	if _, _, err := e.ob.JoinUnit(ctx, tx); !errors.Is(err, outbox.ErrIdempotencyUnsupported) {
		t.Fatalf("JoinUnit with a key: %v", err)
	}
	err = e.ob.InTx(context.Background(), func(ctx context.Context, tx *sql.Tx) error {
		return outbox.SetResult(ctx, []byte("x"))
	})
	if !errors.Is(err, outbox.ErrNoUnitOfWork) {
		t.Fatalf("SetResult without a key: %v", err)
	}
}

// A keyed InTx nested in any unit of work is refused, whatever its key: its claim would commit on
// its own, so a retry of its request would replay a result whose outer unit rolled back. Nothing
// of the inner unit runs or is stored, whether the outer unit is keyed with another key,
// unkeyed, or joined to the caller's transaction.
func TestNestedKeyedInTxRefused(t *testing.T) {
	e := newEnv(t)
	var runs atomic.Int32
	errOuter := errors.New("the outer unit fails after the inner one")
	nested := func(ctx context.Context) error {
		return e.ob.InTx(outbox.WithIdempotencyKey(ctx, "orders", "inner"), placeOrder(&runs, "inner"))
	}
	for name, outer := range map[string]func(fn func(ctx context.Context) error) error{
		"keyed with another key": func(fn func(ctx context.Context) error) error {
			return e.ob.InTx(outbox.WithIdempotencyKey(context.Background(), "orders", "outer"), func(ctx context.Context, _ *sql.Tx) error { return fn(ctx) })
		},
		"unkeyed": func(fn func(ctx context.Context) error) error {
			return e.ob.InTx(context.Background(), func(ctx context.Context, _ *sql.Tx) error { return fn(ctx) })
		},
		"joined": func(fn func(ctx context.Context) error) error {
			tx, err := e.db.Begin()
			if err != nil {
				return err
			}
			defer func() { _ = tx.Rollback() }()
			ctx, _ := e.ob.JoinTx(context.Background(), tx)
			return fn(ctx)
		},
	} {
		var inner error
		err := outer(func(ctx context.Context) error {
			inner = nested(ctx)
			return errOuter
		})
		if !errors.Is(err, errOuter) || !errors.Is(inner, outbox.ErrNestedUnitOfWork) {
			t.Errorf("%s: outer %v, nested keyed InTx %v; want ErrNestedUnitOfWork", name, err, inner)
		}
	}
	mustEqual(t, "runs of the nested unit", runs.Load(), int32(0))
	mustEqual(t, "keys stored", e.count(`SELECT count(*) FROM outbox_idempotency`), 0)
	mustEqual(t, "business rows", e.count(`SELECT count(*) FROM applied`), 0)
}

// A key expires after IdempotencyRetention: a retry later runs again; the cleanup deletes
// expired keys, in batches, and keeps the others. Validate refuses a retention shorter than the
// clients' retry horizon.
func TestKeyedInTxExpiry(t *testing.T) {
	e := newEnv(t)
	const retention = time.Second
	short := e.newOutbox(func(c *outbox.Config) { c.IdempotencyRetention = retention; c.CleanupBatchSize = 2 })
	var runs atomic.Int32
	k0At := time.Now() // before k0's commit: its key expires no sooner than retention after this
	for i := range 5 {
		ctx := outbox.WithIdempotencyKey(context.Background(), "orders", fmt.Sprintf("k%d", i))
		if err := short.InTx(ctx, placeOrder(&runs, fmt.Sprintf("o%d", i))); err != nil {
			t.Fatal(err)
		}
	}
	// One key with the default retention (24 h): not expired.
	if err := e.ob.InTx(outbox.WithIdempotencyKey(context.Background(), "orders", "kept"), placeOrder(&runs, "kept")); err != nil {
		t.Fatal(err)
	}
	ctx := outbox.WithIdempotencyKey(context.Background(), "orders", "k0")
	if err := short.InTx(ctx, placeOrder(&runs, "o0-again")); err != nil {
		t.Fatal(err)
	}
	if _, rep := outbox.IdempotencyResult(ctx); !rep {
		// A machine so loaded that the steps above took longer than the retention expired k0
		// rightly (300 ms of retention failed so under a full parallel test run).
		if took := time.Since(k0At); took < retention {
			t.Fatalf("retry %s after the first run, within the retention (%s), ran again", took, retention)
		}
		t.Skipf("the steps took longer than the retention (%s): nothing to check on this machine now", retention)
	}
	time.Sleep(retention + 100*time.Millisecond)
	// Retaken through an Outbox whose keys live 24 h: retaken through short, k0 expired again
	// whenever the steps below took over 300 ms on a loaded machine, and the cleanup deleted 5.
	if err := e.ob.InTx(ctx, placeOrder(&runs, "o0-again")); err != nil {
		t.Fatal(err)
	}
	if res, rep := outbox.IdempotencyResult(ctx); rep || string(res) != "order o0-again placed" {
		t.Fatalf("retry after expiry: result %q, replayed %v; want a new run", res, rep)
	}
	mustEqual(t, "runs", runs.Load(), int32(7))
	o, err := ops.ForOutbox(short)
	if err != nil {
		t.Fatal(err)
	}
	dry, err := o.Cleanup(context.Background(), ops.CleanupOptions{Actor: "test", Retention: 7 * 24 * time.Hour, DryRun: true})
	if err != nil || dry.Keys != 4 {
		t.Fatalf("dry run: %+v, %v; want 4 expired keys counted", dry, err)
	}
	res, err := short.Cleanup(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	mustEqual(t, "expired keys deleted", res.Keys, int64(4))
	if res.Batches < 2 {
		t.Errorf("cleanup of 4 keys in batches of 2 ran %d batches", res.Batches)
	}
	mustEqual(t, "keys left (k0 claimed again, kept)", e.count(`SELECT count(*) FROM outbox_idempotency`), 2)

	_, err = outbox.New(outbox.Config{DB: e.db, Publisher: e.pub, IdempotencyRetention: time.Hour, ClientRetryHorizon: 2 * time.Hour})
	if !errors.Is(err, outbox.ErrRetentionTooShort) {
		t.Fatalf("IdempotencyRetention below ClientRetryHorizon: %v, want ErrRetentionTooShort", err)
	}
}

// A crash at every step of a keyed unit, then a retry by a restarted process: one business
// change, each effect on the wire under one UUID (the relay sends what the crashed process left),
// and the first run's response returned to the retry when the first run committed.
func TestKeyedInTxCrashThenRetry(t *testing.T) {
	points := []string{outbox.FailpointAfterClaim, outbox.FailpointAfterHandler, outbox.FailpointAfterCommit, outbox.FailpointAfterPublish}
	for _, point := range points {
		t.Run(point, func(t *testing.T) {
			e := newEnv(t)
			crash := errors.New("crash")
			crashing := e.newOutbox(func(c *outbox.Config) {
				c.Failpoint = func(_ context.Context, p string) error {
					if p == point {
						return crash
					}
					return nil
				}
			})
			var runs atomic.Int32
			ctx := outbox.WithIdempotencyKey(context.Background(), "orders", "k-"+point)
			err := crashing.InTx(ctx, placeOrder(&runs, "o1"))
			if point == outbox.FailpointAfterPublish {
				// After its commit InTx returns nil whatever happens to the dispatch: the crash
				// leaves the second effect to the relay.
				if err != nil {
					t.Fatalf("InTx crashing at %s: %v", point, err)
				}
			} else if !errors.Is(err, crash) {
				t.Fatalf("InTx crashing at %s: %v", point, err)
			}
			committed := point == outbox.FailpointAfterCommit || point == outbox.FailpointAfterPublish

			restarted := e.newOutbox(func(c *outbox.Config) {
				c.RelayGrace = 100 * time.Millisecond
				c.RelayInterval = 50 * time.Millisecond
			})
			retry := outbox.WithIdempotencyKey(context.Background(), "orders", "k-"+point)
			if err := restarted.InTx(retry, placeOrder(&runs, "o1")); err != nil {
				t.Fatalf("retry: %v", err)
			}
			res, rep := outbox.IdempotencyResult(retry)
			mustEqual(t, "retry replayed the committed run", rep, committed)
			mustEqual(t, "retry's result", string(res), "order o1 placed")
			wantRuns := int32(1) // fn ran once before the crash and committed, or only in the retry
			if point == outbox.FailpointAfterHandler {
				wantRuns = 2 // it ran, rolled back with the crash, and ran again
			}
			mustEqual(t, "runs of fn", runs.Load(), wantRuns)
			stop := startRun(t, restarted)
			waitFor(t, "the relay to send what was left", func() bool { return e.pendingEffects() == 0 })
			stop()
			mustEqual(t, "business rows", e.count(`SELECT count(*) FROM applied WHERE message_id = 'o1'`), 1)
			mustEqual(t, "stored effects", e.count(`SELECT count(*) FROM all_effects`), 2)
			for _, topic := range []string{"out_a", "out_b"} {
				if w := e.wire(topic); len(w) != 1 {
					t.Errorf("%s: %d UUIDs on the wire (%v), want one", topic, len(w), w)
				}
			}
		})
	}
}

// Effect UUIDs derived from the cause are the same when the cause runs again after its commit
// was lost (here: the committed rows deleted, as a restore to before the commit would): a keyed
// boundary unit and a handled message alike; a unit without a key gets new ones.
func TestDerivedUUIDsEqualAcrossRerun(t *testing.T) {
	e := newEnv(t)
	var runs atomic.Int32
	uuids := func() []string {
		return columnStrings(e, `SELECT uuid FROM all_effects ORDER BY source_id, seq`)
	}
	lose := func() {
		e.flush()
		for _, q := range []string{`DELETE FROM applied`, `DELETE FROM outbox_effects_all`, `DELETE FROM outbox_dispatched`,
			`DELETE FROM outbox_idempotency`, `DELETE FROM outbox_processed`} {
			if _, err := e.db.Exec(q); err != nil {
				t.Fatal(err)
			}
		}
	}
	run := func() []string {
		if err := e.ob.InTx(outbox.WithIdempotencyKey(context.Background(), "orders", "k"), placeOrder(&runs, "o1")); err != nil {
			t.Fatal(err)
		}
		return uuids()
	}
	first := run()
	lose()
	second := run()
	if len(first) != 2 || !slices.Equal(first, second) || first[0] == first[1] {
		t.Fatalf("keyed unit: UUIDs %v, then %v after the lost commit; want two distinct, equal across runs", first, second)
	}
	lose()
	other := func() []string {
		if err := e.ob.InTx(outbox.WithIdempotencyKey(context.Background(), "orders", "k2"), placeOrder(&runs, "o1")); err != nil {
			t.Fatal(err)
		}
		return uuids()
	}()
	if slices.Contains(other, first[0]) || slices.Contains(other, first[1]) {
		t.Fatalf("another key derived the same UUIDs: %v and %v", first, other)
	}
	// A key reused for another request once it expired (a client's counter) is another cause:
	// with the same UUIDs, downstream deduplication, which remembers IDs longer than keys live
	// (Retention 7 days, keys 24 h), dropped the new request's events. The same request sent
	// again derives the same UUIDs.
	withFingerprint := func(fp string) []string {
		lose()
		ctx := outbox.WithIdempotencyKey(context.Background(), "orders", "k", outbox.Fingerprint([]byte(fp)))
		if err := e.ob.InTx(ctx, placeOrder(&runs, "o1")); err != nil {
			t.Fatal(err)
		}
		return uuids()
	}
	a, again, b := withFingerprint("POST /orders {sku: 1}"), withFingerprint("POST /orders {sku: 1}"), withFingerprint("POST /orders {sku: 2}")
	if !slices.Equal(a, again) || slices.Contains(b, a[0]) || slices.Contains(b, a[1]) {
		t.Fatalf("key k with a request's fingerprint: UUIDs %v, the same request again %v, another request %v; want the first two equal, the third apart", a, again, b)
	}

	lose()
	handler := func(msg *message.Message) ([]*message.Message, error) {
		ctx := msg.Context()
		return nil, outbox.Publish(ctx, "out_a", outbox.NewMessage(ctx, []byte("a")), outbox.NewMessage(ctx, []byte("b")))
	}
	msg := message.NewMessage("m-1", nil)
	if err := handle(e.ob, msg, handler); err != nil {
		t.Fatal(err)
	}
	h1 := uuids()
	lose()
	if err := handle(e.ob, copyOf(msg), handler); err != nil {
		t.Fatal(err)
	}
	h2 := uuids()
	if len(h1) != 2 || !slices.Equal(h1, h2) {
		t.Fatalf("handled message: UUIDs %v, then %v after the lost commit", h1, h2)
	}

	lose()
	unkeyed := func() []string {
		err := e.ob.InTx(context.Background(), func(ctx context.Context, tx *sql.Tx) error {
			return outbox.Publish(ctx, "out_a", outbox.NewMessage(ctx, []byte("a")), outbox.NewMessage(ctx, []byte("b")))
		})
		if err != nil {
			t.Fatal(err)
		}
		return uuids()
	}
	u1 := unkeyed()
	lose()
	if u2 := unkeyed(); slices.Equal(u1, u2) {
		t.Fatalf("a unit without a key derived the same UUIDs twice: %v", u1)
	}
}

// Issue 45, item 5: outbox.Record gave every recorded effect a random UUID, so a re-run after a
// lost commit handed the applier, which deduplicates by Effect.UUID, a new one: the change was
// applied twice. Its UUID is derived from the cause as NewUUID's are, in the same sequence.
func TestRecordedEffectUUIDsEqualAcrossRerun(t *testing.T) {
	e := newEnv(t)
	var mu sync.Mutex
	var applied []string
	if err := e.ob.RegisterApplier("charge", func(_ context.Context, eff outbox.Effect) error {
		mu.Lock()
		defer mu.Unlock()
		applied = append(applied, eff.UUID)
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	took := func() []string {
		e.flush()
		mu.Lock()
		defer mu.Unlock()
		out := applied
		applied = nil
		return out
	}
	lose := func() { // a restore to before the commit
		e.flush()
		for _, q := range []string{`DELETE FROM outbox_effects_all`, `DELETE FROM outbox_dispatched`, `DELETE FROM outbox_idempotency`, `DELETE FROM outbox_processed`} {
			if _, err := e.db.Exec(q); err != nil {
				t.Fatal(err)
			}
		}
	}
	record := func(ctx context.Context) error {
		if err := outbox.Publish(ctx, "out_a", outbox.NewMessage(ctx, []byte("a"))); err != nil {
			return err
		}
		if err := outbox.Record(ctx, "charge", []byte("1")); err != nil {
			return err
		}
		return outbox.Record(ctx, "charge", []byte("2"))
	}

	keyed := func() []string {
		if err := e.ob.InTx(outbox.WithIdempotencyKey(context.Background(), "payments", "p1"), func(ctx context.Context, _ *sql.Tx) error {
			return record(ctx)
		}); err != nil {
			t.Fatal(err)
		}
		return took()
	}
	k1 := keyed()
	lose()
	if k2 := keyed(); len(k1) != 2 || k1[0] == k1[1] || !slices.Equal(k1, k2) {
		t.Fatalf("keyed unit: the applier got %v, then %v after the lost commit; want two distinct, equal across runs", k1, k2)
	}

	lose()
	handler := func(msg *message.Message) ([]*message.Message, error) { return nil, record(msg.Context()) }
	msg := message.NewMessage("m-1", nil)
	if err := handle(e.ob, msg, handler); err != nil {
		t.Fatal(err)
	}
	h1 := took()
	lose()
	if err := handle(e.ob, copyOf(msg), handler); err != nil {
		t.Fatal(err)
	}
	if h2 := took(); len(h1) != 2 || !slices.Equal(h1, h2) || slices.Contains(h1, k1[0]) {
		t.Fatalf("handled message: the applier got %v, then %v after the lost commit; want equal, and not the keyed unit's %v", h1, h2, k1)
	}

	lose()
	unkeyed := func() []string {
		if err := e.ob.InTx(context.Background(), func(ctx context.Context, _ *sql.Tx) error { return record(ctx) }); err != nil {
			t.Fatal(err)
		}
		return took()
	}
	if u1, u2 := unkeyed(), unkeyed(); len(u1) != 2 || slices.Equal(u1, u2) {
		t.Fatalf("a unit without a key: the applier got %v and %v; want new UUIDs each time", u1, u2)
	}
}

func columnStrings(e *env, query string) []string {
	e.t.Helper()
	e.flush()
	rows, err := e.db.Query(query)
	if err != nil {
		e.t.Fatal(err)
	}
	defer rows.Close()
	var out []string
	for rows.Next() {
		var s string
		if err := rows.Scan(&s); err != nil {
			e.t.Fatal(err)
		}
		out = append(out, s)
	}
	return out
}

// A retry that waits for the first request is bounded by HandlerTimeout, and by its caller's
// context: it returns an error saying what it waited for, and runs nothing.
func TestKeyedInTxWaitIsBounded(t *testing.T) {
	e := newEnv(t)
	impatient := e.newOutbox(func(c *outbox.Config) { c.HandlerTimeout = 300 * time.Millisecond })
	var runs atomic.Int32
	holding, release := make(chan struct{}), make(chan struct{})
	done := make(chan error, 1)
	go func() {
		done <- e.ob.InTx(outbox.WithIdempotencyKey(context.Background(), "orders", "slow"), func(ctx context.Context, tx *sql.Tx) error {
			close(holding)
			<-release
			return placeOrder(&runs, "o1")(ctx, tx)
		})
	}()
	<-holding
	began := time.Now()
	err := impatient.InTx(outbox.WithIdempotencyKey(context.Background(), "orders", "slow", outbox.WaitInFlight()), placeOrder(&runs, "o1"))
	if err == nil || !strings.Contains(err.Error(), "waited for the unit of work in flight") || time.Since(began) > 5*time.Second {
		t.Errorf("waiting past HandlerTimeout: %v after %s", err, time.Since(began))
	}
	cctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
	defer cancel()
	err = e.ob.InTx(outbox.WithIdempotencyKey(cctx, "orders", "slow", outbox.WaitInFlight()), placeOrder(&runs, "o1"))
	if err == nil || cctx.Err() == nil {
		t.Errorf("waiting past the caller's context: %v", err)
	}
	close(release)
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	mustEqual(t, "runs", runs.Load(), int32(1))
	mustEqual(t, "business rows", e.count(`SELECT count(*) FROM applied`), 1)
}

// TestKeyedInTxWaitEndsDuringALook: a retry waiting for the unit holding its key
// (WaitInFlight) looks at the key again and again, each look a short transaction; when its
// HandlerTimeout ends during a look (here, waiting for the only connection of its pool), not
// between two, the caller is still told the key is in flight (ErrIdempotencyInFlight, what
// an endpoint answers 409 with), not a bare "context deadline exceeded" of the look.
func TestKeyedInTxWaitEndsDuringALook(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	small, err := sql.Open("postgres", e.dsn)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = small.Close() })
	small.SetMaxOpenConns(1)
	conn, err := small.Conn(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := conn.ExecContext(ctx, `SET application_name = 'keyed-retry'`); err != nil {
		t.Fatal(err)
	}
	_ = conn.Close()
	impatient := e.newOutbox(func(c *outbox.Config) { c.DB = small; c.HandlerTimeout = time.Second })
	var runs atomic.Int32
	holding, release := make(chan struct{}), make(chan struct{})
	done := make(chan error, 1)
	go func() {
		done <- e.ob.InTx(outbox.WithIdempotencyKey(ctx, "orders", "slow"), func(ctx context.Context, tx *sql.Tx) error {
			close(holding)
			<-release
			return placeOrder(&runs, "o1")(ctx, tx)
		})
	}()
	defer func() {
		close(release)
		if err := <-done; err != nil {
			t.Error(err)
		}
	}()
	<-holding
	retried := make(chan error, 1)
	go func() {
		retried <- impatient.InTx(outbox.WithIdempotencyKey(ctx, "orders", "slow", outbox.WaitInFlight()), placeOrder(&runs, "o1"))
	}()
	// Its first look has found the key held and rolled back: take the pool's only connection.
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(2 * time.Millisecond) {
		var looked bool
		if err := e.db.QueryRow(`SELECT EXISTS (SELECT FROM pg_stat_activity WHERE application_name = 'keyed-retry' AND query ILIKE 'rollback%')`).Scan(&looked); err != nil {
			t.Fatal(err)
		}
		if looked {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the retry never looked at its key")
		}
	}
	held, err := small.Conn(ctx)
	if err != nil {
		t.Fatal(err)
	}
	err = <-retried
	_ = held.Close()
	if !errors.Is(err, outbox.ErrIdempotencyInFlight) || !strings.Contains(err.Error(), "at most HandlerTimeout") {
		t.Errorf("a wait that ended during a look: %v; want ErrIdempotencyInFlight, saying it waited at most HandlerTimeout", err)
	}
	t.Logf("the retry: %v", err)
}

// TestRandomUUIDsAreTimeOrdered: where no cause derives them, the UUIDs the outbox makes are
// version 7, one after another in ascending order, so that a consumer's deduplication index takes
// them at its right edge.
func TestRandomUUIDsAreTimeOrdered(t *testing.T) {
	prev := ""
	for i := 0; i < 1000; i++ {
		id := outbox.NewUUID(context.Background())
		u, err := uuid.Parse(id)
		if err != nil {
			t.Fatal(err)
		}
		if u.Version() != 7 {
			t.Fatalf("NewUUID outside a unit of work = %s, version %d; want version 7", id, u.Version())
		}
		if id <= prev {
			t.Fatalf("NewUUID: %s after %s: not ascending", id, prev)
		}
		prev = id
	}
}

// CallerScope gives each (caller, scope) pair a scope of its own, valid for the store, whatever
// the caller's name holds: a separator in it, a name longer than a scope may be, a NUL byte.
func TestCallerScope(t *testing.T) {
	pairs := [][2]string{{"a", "b:c"}, {"a:b", "c"}, {"a", ""}, {"a:", ""}, {"1:a", ""},
		{strings.Repeat("x", 300), "orders"}, {strings.Repeat("x", 301), "orders"}, {"a\x00b", "orders"}, {"\xff", "orders"}}
	seen := map[string][2]string{}
	for _, p := range pairs {
		s := outbox.CallerScope(p[0], p[1])
		if other, ok := seen[s]; ok {
			t.Errorf("CallerScope(%q, %q) = CallerScope(%q, %q) = %q", p[0], p[1], other[0], other[1], s)
		}
		seen[s] = p
		if len(s) == 0 || len(s) > 255 || !utf8.ValidString(s) || strings.ContainsRune(s, 0) {
			t.Errorf("CallerScope(%q, %q) = %q: not a valid scope", p[0], p[1], s)
		}
		if s != outbox.CallerScope(p[0], p[1]) {
			t.Errorf("CallerScope(%q, %q) is not stable", p[0], p[1])
		}
	}
}

// An empty caller (an unauthenticated request) got a scope of its own like any caller: every
// anonymous caller shared it, one getting another's stored result for the same key. A unit keyed
// in it is refused now, and runs nothing.
func TestCallerScopeOfNoCallerIsRefused(t *testing.T) {
	e := newEnv(t)
	var runs atomic.Int32
	for _, scope := range []string{"orders", ""} {
		ctx := outbox.WithIdempotencyKey(context.Background(), outbox.CallerScope("", scope), "k1")
		err := e.ob.InTx(ctx, placeOrder(&runs, "o1"))
		if !errors.Is(err, outbox.ErrInvalidIdempotencyKey) || !strings.Contains(err.Error(), "empty caller") {
			t.Errorf("scope %q: %v, want ErrInvalidIdempotencyKey naming the empty caller", scope, err)
		}
	}
	mustEqual(t, "runs", runs.Load(), int32(0))
}

// Retries that wait for the first request with their key (WaitInFlight) hold no connection while
// they wait: with a pool of 2, the first request holding one and three retries waiting, an
// unrelated unit of work still gets a connection at once. Each waiter held a connection (BEGIN,
// then the key's lock) for up to HandlerTimeout, and the unrelated request waited for the pool.
func TestKeyedWaitersLeaveThePool(t *testing.T) {
	e := newEnv(t)
	small, err := sql.Open("postgres", e.dsn)
	if err != nil {
		t.Fatal(err)
	}
	defer small.Close()
	small.SetMaxOpenConns(2)
	ob := e.newOutbox(func(c *outbox.Config) { c.DB = small; c.HandlerTimeout = 20 * time.Second })
	var runs atomic.Int32
	holding, release := make(chan struct{}), make(chan struct{})
	first := make(chan error, 1)
	go func() {
		first <- ob.InTx(outbox.WithIdempotencyKey(context.Background(), "orders", "held"), func(ctx context.Context, tx *sql.Tx) error {
			close(holding)
			<-release
			return placeOrder(&runs, "o1")(ctx, tx)
		})
	}()
	<-holding
	waiters := make(chan error, 3)
	results := make(chan string, 3)
	for range 3 {
		go func() {
			ctx := outbox.WithIdempotencyKey(context.Background(), "orders", "held", outbox.WaitInFlight())
			err := ob.InTx(ctx, placeOrder(&runs, "o1"))
			res, _ := outbox.IdempotencyResult(ctx)
			results <- string(res)
			waiters <- err
		}()
	}
	time.Sleep(300 * time.Millisecond) // the retries are waiting
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
	defer cancel()
	began := time.Now()
	err = ob.InTx(ctx, func(ctx context.Context, tx *sql.Tx) error {
		_, err := tx.ExecContext(ctx, `INSERT INTO applied (message_id, note) VALUES ('other', 'unrelated')`)
		return err
	})
	if err != nil {
		t.Errorf("an unrelated unit of work while three retries waited on a pool of 2: %v after %s", err, time.Since(began))
	}
	close(release)
	if err := <-first; err != nil {
		t.Fatal(err)
	}
	for range 3 {
		if err := <-waiters; err != nil {
			t.Errorf("waiting retry: %v", err)
		}
		if res := <-results; res != "order o1 placed" {
			t.Errorf("waiting retry got %q, want the first request's result", res)
		}
	}
	mustEqual(t, "runs", runs.Load(), int32(1))
}
