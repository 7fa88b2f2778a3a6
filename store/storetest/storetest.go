package storetest

import (
	"bytes"
	"context"
	"database/sql"
	"errors"
	"fmt"
	"maps"
	"reflect"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/watermill-outbox/outbox/outboxdriver"
)

// Harness is one fresh, empty set of outbox tables for one test, and what the suite needs to know
// about its dialect: a database of its own, or a schema or table prefix of its own in a database
// whose other tables are busy meanwhile (the members of a tenant.Set on one pool: the tenant
// package's tests run the suite so, beside other members' traffic).
type Harness struct {
	// DB is the database. The suite runs only dialect-neutral SQL on it, without parameters.
	DB *sql.DB
	// Open returns a new Store over DB, as another process would have one. It must not migrate.
	Open func(t testing.TB) outboxdriver.Store
	// Table returns the qualified, quoted name of the outbox table "processed", "effects",
	// "attempts" or "migrations" of the stores Open returns.
	Table func(name string) string
	// Age moves the timestamp column of the rows of src in table ("processed", "effects",
	// "attempts" or "dead_letters") back by d; a NULL stays NULL. A zero src means every row of the table. The
	// columns that hold a row's source are given by KeyColumns. ("effects", "dispatched_at") means
	// the dispatched effects, wherever the dialect keeps them.
	Age func(t testing.TB, table, column string, src outboxdriver.Source, d time.Duration)
	// CountEffects counts every effect row: pending, and dispatched ones kept for EffectRetention
	// (which a dialect may keep in a table of their own).
	CountEffects func(t testing.TB) int
	// HoldCleanupLock takes, in another session, what the Cleanup of another process holds
	// while it deletes, and keeps it until release is called.
	HoldCleanupLock func(t testing.TB) (release func())
	// Blocked reports whether a session of DB is waiting for a lock that another one holds. The
	// suite polls it to know that a concurrent call under test has reached the point where it
	// waits. When DB holds other outbox tables in use, only a session working on this test's
	// tables counts.
	Blocked func(t testing.TB) bool
	// Capabilities says what the dialect can do.
	Capabilities Capabilities
}

// Capabilities are what a dialect may legitimately lack; the suite checks the documented
// degraded behaviour of a dialect that lacks one.
type Capabilities struct {
	// Listen: EffectListen delivers the EffectNotify calls of other sessions. Without it,
	// EffectListen returns outboxdriver.ErrListenUnsupported at once and EffectNotify does nothing.
	Listen bool
	// RowLocks: another session can lock an effect row (SELECT ... FOR UPDATE) while a relay
	// claims; the claim must then hold the row's ordering key.
	RowLocks bool
	// CleanupSkips: Cleanup returns at once, Skipped, while another process cleans. Without it,
	// Cleanup waits until the other one's batch is done and then cleans.
	CleanupSkips bool
	// ClaimReportsConcurrent: MessageClaim tells a claim committed while it waited for it
	// (Claim.Concurrent) from one committed before it began. Without it, Concurrent is always false.
	ClaimReportsConcurrent bool
	// ClaimReportsSettled: MessageClaim tells a duplicate whether the claim it ran into has
	// anything pending (Claim.Settled). Without it, Settled is always false.
	ClaimReportsSettled bool
	// KeyInFlight: a KeyClaim without Wait of a key another transaction holds uncommitted returns
	// ErrKeyInFlight at once. Without it (one writer at a time), the second transaction waits to
	// begin until the first has ended.
	KeyInFlight bool
}

// KeyColumns returns the columns of an outbox table that hold the source of a row.
func KeyColumns(table string) (consumer, id string) {
	if table == "effects" || table == "dispatched" {
		return "source_consumer", "source_id"
	}
	return "consumer", "message_id"
}

// waitLimit bounds every wait of the suite; reaching it is a failure.
const waitLimit = 30 * time.Second

// Run runs the conformance suite: a subtest per behaviour of every outboxdriver.Store method, in
// parallel. newHarness is called once per subtest and must return fresh, empty tables of its own
// (see Harness); it registers its cleanup with t, and may check there what the subtest left.
func Run(t *testing.T, newHarness func(t *testing.T) Harness) {
	for _, tc := range []struct {
		name string
		fn   func(*fixture)
	}{
		{"Migrate/Idempotent", testMigrateIdempotent},
		{"Migrate/Concurrent", testMigrateConcurrent},
		{"SchemaCheck/Missing", testSchemaMissing},
		{"SchemaCheck/Outdated", testSchemaOutdated},
		{"MessageClaim/ClaimAndDuplicate", testClaimAndDuplicate},
		{"MessageClaim/RollbackFreesTheClaim", testClaimRollback},
		{"MessageClaim/ConcurrentCopyWaitsForCommit", func(f *fixture) { testClaimConcurrent(f, true) }},
		{"MessageClaim/ConcurrentCopyWaitsForRollback", func(f *fixture) { testClaimConcurrent(f, false) }},
		{"MessageClaim/DuplicateReportsAge", testClaimAge},
		{"MessageClaim/DuplicateReportsSettled", testClaimSettled},
		{"MessageIsProcessed", testIsProcessed},
		{"MessagePoison", testPoison},
		{"AttemptRecord", testAttemptRecord},
		{"Reasons/AnyBytesAreStored", testUnstorableReasons},
		{"EffectInsert/RoundTrip", testInsertRoundTrip},
		{"EffectInsert/RolledBack", testInsertRolledBack},
		{"EffectInsert/LargeBatch", testInsertLargeBatch},
		{"EffectInsert/InSavepoint", testInsertInSavepoint},
		{"EffectMarkDispatched/OnlyTheListed", testMarkOnlyTheListed},
		{"EffectListPending/PendingFor", testPendingFor},
		{"EffectMarkDispatched", testMarkDispatched},
		{"EffectMarkDispatched/RetentionCountsFromDispatch", testMarkMovesClaim},
		{"EffectMarkDispatched/ManySources", testMarkMany},
		{"EffectMarkDispatched/ClaimLeftAlone", testMarkKeepsClaim},
		{"EffectRecordFailures/DueAtOnce", testRecordFailuresAtOnce},
		{"EffectRecordFailures/Delay", testRecordFailuresDelay},
		{"EffectRecordFailures/CountedAndParked", testRecordFailuresCountedAndParked},
		{"EffectRecordFailures/Release", testRecordFailuresRelease},
		{"EffectRecordFailures/ParkedStaysParked", testRecordFailuresKeepParked},
		{"EffectHandToRelay", testHandToRelay},
		{"EffectRetryNow", testRetryNow},
		{"EffectKeyBlocked", testKeyBlocked},
		{"EffectClaimDue/Grace", testRelayGrace},
		{"EffectClaimDue/Limit", testRelayLimit},
		{"EffectClaimDue/Backoff", testRelayBackoff},
		{"EffectClaimDue/BlockedIsNeitherMarkedNorCounted", testRelayBlocked},
		{"EffectClaimDue/ParkAfterMaxAttempts", testRelayPark},
		{"EffectClaimDue/KeyWaitsBehindFailure", testRelayKeyBehindFailure},
		{"EffectClaimDue/KeyWaitsBehindFastPath", testRelayKeyBehindFastPath},
		{"EffectClaimDue/MarksTheClaim", testRelayMarksClaim},
		{"EffectClaimDue/Instances", testRelayInstances},
		{"EffectClaimDue/Lease", testClaimDueLease},
		{"EffectClaimDue/PendingFallsDue", testClaimDuePending},
		{"EffectClaimDue/OutcomeWaitsBehindTheLease", testClaimDueOutcomeBehindLease},
		{"EffectClaimDue/MaxBytes", testClaimDueMaxBytes},
		{"EffectClaimDue/BeyondABlockedPrefix", testClaimDueBeyondABlockedPrefix},
		{"EffectClaimDue/LockedEarlierEffectHoldsItsKey", testClaimDueLockedEarlier},
		{"EffectDiscard/RetentionCountsFromDiscard", testDiscardMovesClaim},
		{"MessageReplay", testReplay},
		{"MessageReplay/DeadLetter", testReplayDeadLetter},
		{"DeadLetters", testDeadLetters},
		{"DeadLetters/ProcessedMeanwhile", testDeadLetterProcessedMeanwhile},
		{"DeadLetters/UUID", testDeadLetterUUID},
		{"DeadLetters/CleanupWhileDeadAgain", testDeadLettersCleanupDeadAgain},
		{"DeadLetters/MaxRetriesOnAStaleCount", testDeadLettersMaxRetriesStale},
		{"DeadLetters/Redrivable", testDeadLettersRedrivable},
		{"PoisonWith", testPoisonWith},
		{"DeadLetterNow", testDeadLetterNow},
		{"EffectListParked", testListParked},
		{"EffectUnpark", testUnpark},
		{"EffectDiscard", testDiscard},
		{"EffectNotifyListen", testNotifyListen},
		{"Stats/Sample", testStatsSample},
		{"Stats/OneSamplerPerInterval", testStatsShared},
		{"Stats/Concurrent", testStatsConcurrent},
		{"Cleanup/RetentionAndCounts", testCleanupRetention},
		{"Cleanup/Batches", testCleanupBatches},
		{"Cleanup/EveryStepHasItsTurn", testCleanupEveryStepHasItsTurn},
		{"Cleanup/AnotherProcessCleaning", testCleanupLocked},
		{"Cleanup/AttemptCountedMeanwhile", testCleanupAttemptCounted},
		{"Delayed/DueCancelAndOrder", testDelayed},
		{"Delayed/DueNotOvertaken", testDelayedDueNotOvertaken},
		{"Delayed/DueAfterTheClaimNotOvertaken", testDelayedDueAfterTheClaimNotOvertaken},
		{"Delayed/MoveStopsAtAHeldOne", testDelayedMoveStopsAtAHeldOne},
		{"KeyClaim/ReplayMismatchExpiryCleanup", testKeys},
		{"KeyClaim/InFlight", testKeysInFlight},
		{"KeyClaim/ConcurrentClaimsOneRuns", testKeysConcurrent},
		{"KeyClaim/CleanupWhileTakenOver", testKeysCleanupTakeOver},
		{"Identifiers/Claims", testLookalikeClaims},
		{"Identifiers/EffectsAndOrderingKeys", testLookalikeEffects},
		{"Identifiers/IdempotencyKeys", testLookalikeIdempotencyKeys},
		{"Identifiers/CancelKeys", testLookalikeCancelKeys},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			h := newHarness(t)
			f := &fixture{t: t, h: h, ctx: context.Background(), st: h.Open(t)}
			if !strings.HasPrefix(tc.name, "Migrate/") && !strings.HasPrefix(tc.name, "SchemaCheck/") {
				if err := f.st.Migrate(f.ctx); err != nil {
					t.Fatalf("Migrate: %v", err)
				}
			}
			tc.fn(f)
		})
	}
}

// fixture is one subtest's harness and store, with helpers that fail the test on errors.
type fixture struct {
	t   *testing.T
	h   Harness
	st  outboxdriver.Store
	ctx context.Context
	n   int
}

// src returns a new message source of consumer "c".
func (f *fixture) src(name string) outboxdriver.Source {
	return outboxdriver.Source{Consumer: "c", ID: name}
}

// effects returns n publish effects of src with ordering key key, each with its own UUID and payload.
func (f *fixture) effects(src outboxdriver.Source, key string, n int) []outboxdriver.Effect {
	out := make([]outboxdriver.Effect, n)
	for i := range out {
		f.n++
		out[i] = outboxdriver.Effect{
			Seq:         i,
			Kind:        outboxdriver.KindPublish,
			Topic:       "topic",
			UUID:        fmt.Sprintf("%s-%s-%d-%d", src.Consumer, src.ID, i, f.n),
			Payload:     []byte(fmt.Sprintf("payload %d of %s", i, src.ID)),
			Metadata:    map[string]string{"n": fmt.Sprint(f.n)},
			OrderingKey: key,
			Source:      src,
		}
	}
	return out
}

func (f *fixture) begin() *sql.Tx {
	f.t.Helper()
	tx, err := f.h.DB.BeginTx(f.ctx, nil)
	if err != nil {
		f.t.Fatalf("begin: %v", err)
	}
	return tx
}

// commit stores effects of src in one transaction, claiming src first when claim is set.
func (f *fixture) commit(src outboxdriver.Source, claim bool, effects []outboxdriver.Effect) {
	f.t.Helper()
	tx := f.begin()
	defer func() { _ = tx.Rollback() }()
	if claim {
		c, err := f.st.MessageClaim(f.ctx, tx, src)
		if err != nil || !c.Claimed {
			f.t.Fatalf("MessageClaim(%v) = %+v, %v; want claimed", src, c, err)
		}
	}
	if len(effects) > 0 {
		if _, err := f.st.EffectInsert(f.ctx, tx, src, effects); err != nil {
			f.t.Fatalf("EffectInsert(%v): %v", src, err)
		}
		for _, e := range effects {
			if e.StoreID == 0 {
				f.t.Fatalf("EffectInsert(%v) left the StoreID of effect %d unset", src, e.Seq)
			}
		}
	}
	if err := tx.Commit(); err != nil {
		f.t.Fatalf("commit: %v", err)
	}
}

func (f *fixture) pending(src outboxdriver.Source) []outboxdriver.Effect {
	f.t.Helper()
	es, err := f.st.EffectListPending(f.ctx, src)
	if err != nil {
		f.t.Fatalf("EffectListPending(%v): %v", src, err)
	}
	return es
}

// mark marks the pending effects of src dispatched, by their store IDs, and moves the claim.
func (f *fixture) mark(src outboxdriver.Source) {
	f.t.Helper()
	if err := f.st.EffectMarkDispatched(f.ctx, markOf(src, f.pending(src), true)); err != nil {
		f.t.Fatalf("EffectMarkDispatched(%v): %v", src, err)
	}
}

// markOf returns the mark of effects of src.
func markOf(src outboxdriver.Source, effects []outboxdriver.Effect, moveClaim bool) outboxdriver.DispatchMark {
	m := outboxdriver.DispatchMark{Source: src, MoveClaim: moveClaim}
	for _, e := range effects {
		m.StoreIDs = append(m.StoreIDs, e.StoreID)
	}
	return m
}

func (f *fixture) processed(src outboxdriver.Source) bool {
	f.t.Helper()
	ok, err := f.st.MessageIsProcessed(f.ctx, src)
	if err != nil {
		f.t.Fatalf("MessageIsProcessed(%v): %v", src, err)
	}
	return ok
}

func (f *fixture) age(table, column string, src outboxdriver.Source, d time.Duration) {
	f.t.Helper()
	f.h.Age(f.t, table, column, src, d)
}

// relayParams are the settings of a relay round of the suite's own (see round).
type relayParams struct {
	Grace       time.Duration
	Limit       int
	MaxBytes    int
	MaxAttempts int
	Backoff     func(attempts int) time.Duration
}

// due are relay parameters under which effects aged by two hours are due and failures back off
// for an hour.
var due = relayParams{Grace: time.Hour, Limit: 100, MaxAttempts: 10, Backoff: func(int) time.Duration { return time.Hour }}

// errBlocked is the outcome an effect is given when the round does not try it: it is released.
var errBlocked = errors.New("blocked behind an earlier effect with the same ordering key")

// round runs one relay round on st, as the framework's relay does: it claims what is due, and
// marks each effect sent, records it failed (counted, parked at p.MaxAttempts) or releases it,
// as outcome answers for it (nil: sent; errBlocked: not tried). It returns the claimed effects.
func (f *fixture) round(st outboxdriver.Store, p relayParams, outcome func(outboxdriver.Effect) error) []outboxdriver.Effect {
	f.t.Helper()
	got := f.claimDue(st, outboxdriver.EffectClaimParams{Grace: p.Grace, Limit: p.Limit, MaxBytes: p.MaxBytes, Lease: time.Hour})
	for i := 1; i < len(got); i++ {
		if got[i].StoreID <= got[i-1].StoreID {
			f.t.Fatalf("EffectClaimDue returned effects out of store order: %d after %d", got[i].StoreID, got[i-1].StoreID)
		}
	}
	var marks []outboxdriver.DispatchMark
	var fails []outboxdriver.EffectFailure
	for _, e := range got {
		err := outcome(e)
		switch {
		case err == nil:
			marks = append(marks, outboxdriver.DispatchMark{Source: e.Source, StoreIDs: []int64{e.StoreID}, MoveClaim: true})
		case errors.Is(err, errBlocked):
			fails = append(fails, outboxdriver.EffectFailure{StoreID: e.StoreID})
		default:
			var delay time.Duration
			if p.Backoff != nil {
				delay = p.Backoff(e.Attempts + 1)
			}
			fails = append(fails, outboxdriver.EffectFailure{StoreID: e.StoreID, Reason: err.Error(), Counted: true,
				Park: p.MaxAttempts > 0 && e.Attempts+1 >= p.MaxAttempts, RetryAfter: delay})
		}
	}
	// The failures before the marks, as the framework's relay writes them (see
	// testClaimDueOutcomeBehindLease).
	if err := st.EffectRecordFailures(f.ctx, fails...); err != nil {
		f.t.Fatalf("EffectRecordFailures: %v", err)
	}
	if err := st.EffectMarkDispatched(f.ctx, marks...); err != nil {
		f.t.Fatalf("EffectMarkDispatched: %v", err)
	}
	return got
}

// claimDue claims as the relay does: it follows EffectClaim.Next until a claim returns effects or
// the store has looked at every pending effect.
func (f *fixture) claimDue(st outboxdriver.Store, p outboxdriver.EffectClaimParams) []outboxdriver.Effect {
	f.t.Helper()
	for {
		c, err := st.EffectClaimDue(f.ctx, p)
		if err != nil {
			f.t.Fatalf("EffectClaimDue: %v", err)
		}
		if len(c.Effects) > 0 || c.Next == 0 {
			return c.Effects
		}
		if c.Next <= p.After {
			f.t.Fatalf("EffectClaimDue(After: %d) returned Next %d: it must move forward", p.After, c.Next)
		}
		p.After = c.Next
	}
}

// relayOn runs one relay round on st and returns what it claimed.
func (f *fixture) relayOn(st outboxdriver.Store, p relayParams, outcome func(outboxdriver.Effect) error) []outboxdriver.Effect {
	f.t.Helper()
	return f.round(st, p, outcome)
}

func (f *fixture) relay(p relayParams, outcome func(outboxdriver.Effect) error) []outboxdriver.Effect {
	f.t.Helper()
	return f.relayOn(f.st, p, outcome)
}

// drain runs relay rounds until nothing is due and returns every effect dispatched.
func (f *fixture) drain(p relayParams, outcome func(outboxdriver.Effect) error) []outboxdriver.Effect {
	f.t.Helper()
	var all []outboxdriver.Effect
	for {
		got := f.relay(p, outcome)
		if len(got) == 0 {
			return all
		}
		all = append(all, got...)
	}
}

func sent(outboxdriver.Effect) error { return nil }

func (f *fixture) count(table string) int {
	f.t.Helper()
	var n int
	if err := f.h.DB.QueryRowContext(f.ctx, `SELECT count(*) FROM `+f.h.Table(table)).Scan(&n); err != nil {
		f.t.Fatalf("count %s: %v", table, err)
	}
	return n
}

func (f *fixture) cleanup(p outboxdriver.CleanupParams) outboxdriver.CleanupResult {
	f.t.Helper()
	res, err := f.st.Cleanup(f.ctx, p)
	if err != nil {
		f.t.Fatalf("Cleanup: %v", err)
	}
	return res
}

// waitUntil polls cond until it holds, failing the test after waitLimit.
func (f *fixture) waitUntil(what string, cond func() bool) {
	f.t.Helper()
	deadline := time.Now().Add(waitLimit)
	for !cond() {
		if time.Now().After(deadline) {
			f.t.Fatalf("timed out after %s waiting for %s", waitLimit, what)
		}
		time.Sleep(2 * time.Millisecond)
	}
}

// receive waits for a value on ch, failing the test after waitLimit.
func receive[T any](f *fixture, what string, ch <-chan T) T {
	f.t.Helper()
	select {
	case v := <-ch:
		return v
	case <-time.After(waitLimit):
		f.t.Fatalf("timed out after %s waiting for %s", waitLimit, what)
		panic("unreachable")
	}
}

// gate is a channel closed once, by the test or at its cleanup, so that no goroutine it holds
// outlives the test.
func (f *fixture) gate() (wait <-chan struct{}, open func()) {
	ch := make(chan struct{})
	var once sync.Once
	open = func() { once.Do(func() { close(ch) }) }
	f.t.Cleanup(open)
	return ch, open
}

func uuids(es []outboxdriver.Effect) []string {
	out := make([]string, len(es))
	for i, e := range es {
		out[i] = e.UUID
	}
	return out
}

func wantSet(t *testing.T, what string, got []outboxdriver.Effect, want ...outboxdriver.Effect) {
	t.Helper()
	g, w := uuids(got), uuids(want)
	slices.Sort(g)
	slices.Sort(w)
	if !slices.Equal(g, w) {
		t.Fatalf("%s: got effects %v, want %v", what, g, w)
	}
}

func wantUUIDs(t *testing.T, what string, got []outboxdriver.Effect, want ...outboxdriver.Effect) {
	t.Helper()
	g, w := uuids(got), uuids(want)
	if strings.Join(g, ",") != strings.Join(w, ",") {
		t.Fatalf("%s: got effects %v, want %v", what, g, w)
	}
}

// sameEffect compares what the store returned with what was inserted.
func sameEffect(t *testing.T, got, want outboxdriver.Effect) {
	t.Helper()
	if got.StoreID <= 0 {
		t.Errorf("effect %s: StoreID %d, want > 0", want.UUID, got.StoreID)
	}
	if got.Seq != want.Seq || got.Kind != want.Kind || got.Topic != want.Topic || got.UUID != want.UUID ||
		got.OrderingKey != want.OrderingKey || got.Source != want.Source {
		t.Errorf("effect: got seq=%d kind=%q topic=%q uuid=%q key=%q source=%v, want seq=%d kind=%q topic=%q uuid=%q key=%q source=%v",
			got.Seq, got.Kind, got.Topic, got.UUID, got.OrderingKey, got.Source,
			want.Seq, want.Kind, want.Topic, want.UUID, want.OrderingKey, want.Source)
	}
	if !bytes.Equal(got.Payload, want.Payload) {
		t.Errorf("effect %s: payload %q, want %q", want.UUID, got.Payload, want.Payload)
	}
	if len(got.Metadata) != len(want.Metadata) || !maps.Equal(got.Metadata, want.Metadata) {
		t.Errorf("effect %s: metadata %q, want %q", want.UUID, got.Metadata, want.Metadata)
	}
}

func testMigrateIdempotent(f *fixture) {
	for i := 0; i < 2; i++ {
		if err := f.st.Migrate(f.ctx); err != nil {
			f.t.Fatalf("Migrate #%d: %v", i+1, err)
		}
	}
	if err := f.st.SchemaCheck(f.ctx); err != nil {
		f.t.Fatalf("SchemaCheck after Migrate: %v", err)
	}
	f.checkMigrationsRecordedOnce()
	// A store of another process finds the tables ready.
	if err := f.h.Open(f.t).SchemaCheck(f.ctx); err != nil {
		f.t.Fatalf("SchemaCheck of another store: %v", err)
	}
}

// checkMigrationsRecordedOnce checks that every version is recorded once, without gaps.
func (f *fixture) checkMigrationsRecordedOnce() {
	f.t.Helper()
	var n, maxV int
	if err := f.h.DB.QueryRowContext(f.ctx, `SELECT count(*), max(version) FROM `+f.h.Table("migrations")).Scan(&n, &maxV); err != nil {
		f.t.Fatal(err)
	}
	if n < 1 || n != maxV {
		f.t.Fatalf("migrations recorded: %d rows up to version %d, want each version once", n, maxV)
	}
}

func testMigrateConcurrent(f *fixture) {
	errs := make([]error, 6)
	stores := make([]outboxdriver.Store, len(errs))
	for i := range stores {
		stores[i] = f.h.Open(f.t)
	}
	var wg sync.WaitGroup
	for i := range errs {
		wg.Add(1)
		go func() { defer wg.Done(); errs[i] = stores[i].Migrate(f.ctx) }()
	}
	wg.Wait()
	for i, err := range errs {
		if err != nil {
			f.t.Fatalf("concurrent Migrate #%d: %v", i, err)
		}
	}
	if err := f.st.SchemaCheck(f.ctx); err != nil {
		f.t.Fatal(err)
	}
	f.checkMigrationsRecordedOnce()
}

func testSchemaMissing(f *fixture) {
	err := f.st.SchemaCheck(f.ctx)
	if !errors.Is(err, outboxdriver.ErrSchemaMissing) || !strings.Contains(err.Error(), "Migrate") {
		f.t.Fatalf("SchemaCheck before Migrate: want ErrSchemaMissing naming Migrate, got %v", err)
	}
	src := f.src("m")
	calls := map[string]func() error{
		"MessageClaim": func() error {
			tx := f.begin()
			defer func() { _ = tx.Rollback() }()
			_, err := f.st.MessageClaim(f.ctx, tx, src)
			return err
		},
		"MessageIsProcessed": func() error { _, err := f.st.MessageIsProcessed(f.ctx, src); return err },
		"AttemptRecord":      func() error { _, err := f.st.AttemptRecord(f.ctx, src, "x"); return err },
		"EffectListPending":  func() error { _, err := f.st.EffectListPending(f.ctx, src); return err },
		"EffectListParked":   func() error { _, err := f.st.EffectListParked(f.ctx, 10); return err },
		"EffectClaimDue": func() error {
			_, err := f.st.EffectClaimDue(f.ctx, outboxdriver.EffectClaimParams{Grace: time.Hour, Limit: 10, Lease: time.Minute})
			return err
		},
		"Cleanup": func() error {
			_, err := f.st.Cleanup(f.ctx, outboxdriver.CleanupParams{Retention: time.Hour, EffectRetention: time.Hour, BatchSize: 10})
			return err
		},
	}
	for name, call := range calls {
		if err := call(); !errors.Is(err, outboxdriver.ErrSchemaMissing) {
			f.t.Errorf("%s before Migrate: want ErrSchemaMissing, got %v", name, err)
		}
	}
}

func testSchemaOutdated(f *fixture) {
	if err := f.st.Migrate(f.ctx); err != nil {
		f.t.Fatal(err)
	}
	if _, err := f.h.DB.ExecContext(f.ctx, `DELETE FROM `+f.h.Table("migrations")); err != nil {
		f.t.Fatal(err)
	}
	if err := f.st.SchemaCheck(f.ctx); !errors.Is(err, outboxdriver.ErrSchemaOutdated) {
		f.t.Fatalf("SchemaCheck with no migration recorded: want ErrSchemaOutdated, got %v", err)
	}
	// Migrate repairs it: the migrations are idempotent.
	if err := f.st.Migrate(f.ctx); err != nil {
		f.t.Fatal(err)
	}
	if err := f.st.SchemaCheck(f.ctx); err != nil {
		f.t.Fatal(err)
	}
}

func (f *fixture) claim(tx *sql.Tx, src outboxdriver.Source) bool {
	f.t.Helper()
	c, err := f.st.MessageClaim(f.ctx, tx, src)
	if err != nil {
		f.t.Fatalf("MessageClaim(%v): %v", src, err)
	}
	if c.Claimed && c.Concurrent {
		f.t.Fatalf("MessageClaim(%v) = %+v: a claim that succeeded ran into no other", src, c)
	}
	return c.Claimed
}

func testClaimAndDuplicate(f *fixture) {
	src := f.src("m1")
	tx := f.begin()
	if !f.claim(tx, src) {
		f.t.Fatal("first claim: want true")
	}
	if err := tx.Commit(); err != nil {
		f.t.Fatal(err)
	}
	tx = f.begin()
	if f.claim(tx, src) {
		f.t.Fatal("claim of a processed message: want false")
	}
	_ = tx.Rollback()
	// The claim is per consumer and message.
	tx = f.begin()
	defer func() { _ = tx.Rollback() }()
	if !f.claim(tx, outboxdriver.Source{Consumer: "other", ID: src.ID}) || !f.claim(tx, f.src("m2")) {
		f.t.Fatal("claims of another consumer or message: want true")
	}
}

func testClaimRollback(f *fixture) {
	src := f.src("m1")
	tx := f.begin()
	if !f.claim(tx, src) {
		f.t.Fatal("first claim: want true")
	}
	if err := tx.Rollback(); err != nil {
		f.t.Fatal(err)
	}
	if f.processed(src) {
		f.t.Fatal("a rolled-back claim counts as processed")
	}
	tx = f.begin()
	defer func() { _ = tx.Rollback() }()
	if !f.claim(tx, src) {
		f.t.Fatal("claim after a rollback: want true")
	}
}

// testClaimConcurrent: a second copy's claim waits for the first copy's transaction and sees its
// outcome: false after a commit, true after a rollback.
func testClaimConcurrent(f *fixture, commit bool) {
	src := f.src("m1")
	tx1 := f.begin()
	defer func() { _ = tx1.Rollback() }()
	if !f.claim(tx1, src) {
		f.t.Fatal("first claim: want true")
	}
	type result struct {
		ok  bool
		c   outboxdriver.Claim
		err error
	}
	second := make(chan result, 2)
	release, open := f.gate()
	go func() {
		tx2, err := f.h.DB.BeginTx(f.ctx, nil)
		if err != nil {
			second <- result{err: err}
			return
		}
		defer func() { _ = tx2.Rollback() }()
		c, err := f.st.MessageClaim(f.ctx, tx2, src)
		second <- result{c.Claimed, c, err}
		<-release
		if err == nil {
			err = tx2.Commit()
		}
		second <- result{c.Claimed, c, err}
	}()
	f.waitUntil("the second claim to wait for the first transaction", func() bool { return f.h.Blocked(f.t) })
	select {
	case r := <-second:
		f.t.Fatalf("the second claim returned (%v, %v) while the first transaction was open", r.ok, r.err)
	default:
	}
	var err error
	if commit {
		err = tx1.Commit()
	} else {
		err = tx1.Rollback()
	}
	if err != nil {
		f.t.Fatal(err)
	}
	r := receive(f, "the second claim", second)
	open()
	if r.err != nil {
		f.t.Fatalf("second claim: %v", r.err)
	}
	if r.ok != !commit {
		f.t.Fatalf("second claim after the first %s: got %v, want %v", map[bool]string{true: "committed", false: "rolled back"}[commit], r.ok, !commit)
	}
	// A copy that waited for a claim committed meanwhile is told so (the original is most likely
	// dispatching right now); one that claimed is not.
	if want := commit && f.h.Capabilities.ClaimReportsConcurrent; r.c.Concurrent != want {
		f.t.Fatalf("second claim after the first %s: Concurrent = %v, want %v", map[bool]string{true: "committed", false: "rolled back"}[commit], r.c.Concurrent, want)
	}
	if r := receive(f, "the second transaction", second); r.err != nil {
		f.t.Fatalf("second transaction: %v", r.err)
	}
	if !f.processed(src) {
		f.t.Fatal("message not processed after both transactions")
	}
}

func testIsProcessed(f *fixture) {
	src := f.src("m1")
	if f.processed(src) {
		f.t.Fatal("processed before any claim")
	}
	tx := f.begin()
	defer func() { _ = tx.Rollback() }()
	f.claim(tx, src)
	if f.processed(src) {
		f.t.Fatal("an uncommitted claim counts as processed")
	}
	if err := tx.Commit(); err != nil {
		f.t.Fatal(err)
	}
	if !f.processed(src) {
		f.t.Fatal("a committed claim does not count as processed")
	}
	if f.processed(outboxdriver.Source{Consumer: "other", ID: src.ID}) {
		f.t.Fatal("processed by another consumer")
	}
}

func testPoison(f *fixture) {
	src := f.src("poisoned")
	for i := 0; i < 2; i++ {
		if err := f.st.MessagePoison(f.ctx, src); err != nil {
			f.t.Fatalf("MessagePoison #%d: %v", i+1, err)
		}
	}
	if !f.processed(src) {
		f.t.Fatal("poisoned message not processed")
	}
	tx := f.begin()
	if f.claim(tx, src) {
		f.t.Fatal("claim of a poisoned message: want false")
	}
	_ = tx.Rollback()
	if es := f.pending(src); len(es) != 0 {
		f.t.Fatalf("poisoned message has %d pending effects", len(es))
	}
	// Poisoning a message already processed keeps it processed, effects and all.
	done := f.src("done")
	f.commit(done, true, f.effects(done, "k", 1))
	if err := f.st.MessagePoison(f.ctx, done); err != nil {
		f.t.Fatal(err)
	}
	if !f.processed(done) || len(f.pending(done)) != 1 {
		f.t.Fatal("MessagePoison changed a processed message")
	}
	// Poisoned claims expire like the others.
	f.age("processed", "processed_at", src, 30*24*time.Hour)
	f.age("processed", "dispatched_at", src, 30*24*time.Hour)
	// A batch size below 1 is refused: no batch would ever be the last (the loop went on for
	// ever, and on SQLite a LIMIT below 0 is none).
	for _, size := range []int{0, -1} {
		done := make(chan error, 1)
		go func() {
			_, err := f.st.Cleanup(f.ctx, outboxdriver.CleanupParams{Retention: 7 * 24 * time.Hour, EffectRetention: time.Hour, BatchSize: size})
			done <- err
		}()
		select {
		case err := <-done:
			if err == nil {
				f.t.Fatalf("cleanup with BatchSize %d: no error", size)
			}
		case <-time.After(10 * time.Second):
			f.t.Fatalf("cleanup with BatchSize %d did not return", size)
		}
	}
	if !f.processed(src) {
		f.t.Fatal("a refused cleanup deleted the expired claim")
	}
	if res := f.cleanup(outboxdriver.CleanupParams{Retention: 7 * 24 * time.Hour, EffectRetention: time.Hour, BatchSize: 10}); res.Claims != 1 {
		f.t.Fatalf("cleanup of an expired poisoned claim: %+v", res)
	}
	if f.processed(src) {
		f.t.Fatal("expired poisoned claim still there")
	}
}

func (f *fixture) attempt(src outboxdriver.Source, reason string) int {
	f.t.Helper()
	n, err := f.st.AttemptRecord(f.ctx, src, reason)
	if err != nil {
		f.t.Fatalf("AttemptRecord(%v): %v", src, err)
	}
	return n
}

func testAttemptRecord(f *fixture) {
	src := f.src("m1")
	for want := 1; want <= 3; want++ {
		if got := f.attempt(src, fmt.Sprintf("failure %d", want)); got != want {
			f.t.Fatalf("attempt %d counted as %d", want, got)
		}
	}
	if got := f.attempt(f.src("m2"), "x"); got != 1 {
		f.t.Fatalf("another message's first attempt counted as %d", got)
	}
	if got := f.attempt(outboxdriver.Source{Consumer: "other", ID: src.ID}, "x"); got != 1 {
		f.t.Fatalf("another consumer's first attempt counted as %d", got)
	}
	// Counting works inside no transaction: it survives the rollback of the message's.
	tx := f.begin()
	f.claim(tx, src)
	_ = tx.Rollback()
	if got := f.attempt(src, "after rollback"); got != 4 {
		f.t.Fatalf("attempt after a rollback counted as %d, want 4", got)
	}
}

// testUnstorableReasons: failure reasons come from handlers, brokers and appliers and may hold
// what a text column cannot (NUL, invalid UTF-8) or be huge; every path that stores one must
// store something rather than fail.
func testUnstorableReasons(f *fixture) {
	bad := "nul\x00 and \xff\xfe " + strings.Repeat("long ", 5000)
	src := f.src("m1")
	if got := f.attempt(src, bad); got != 1 {
		f.t.Fatalf("attempt with an unstorable reason counted as %d", got)
	}
	es := f.effects(src, "k", 1)
	f.commit(src, true, es)
	if err := f.st.EffectRecordFailures(f.ctx, outboxdriver.EffectFailure{StoreID: es[0].StoreID, Reason: bad}); err != nil {
		f.t.Fatalf("EffectRecordFailures with an unstorable reason: %v", err)
	}
}

// binaryEffects are effects whose payloads and metadata hold what text columns cannot.
func binaryEffects(src outboxdriver.Source) []outboxdriver.Effect {
	all := make([]byte, 256)
	for i := range all {
		all[i] = byte(i)
	}
	payloads := [][]byte{nil, {}, []byte("nul\x00inside\x00"), {0xff, 0xfe, 0x00, 0xc3, 0x28}, all}
	metadata := []map[string]string{
		nil,
		{},
		{"k\x00ey": "v\xffal", "": "", "ü": "\x00"},
		{"trace": strings.Repeat("x", 10000)},
		{"a": "1", "b": "2"},
	}
	out := make([]outboxdriver.Effect, len(payloads))
	for i := range out {
		kind, topic := outboxdriver.KindPublish, fmt.Sprintf("topic-%d", i)
		if i == 3 {
			kind, topic = "applier", ""
		}
		out[i] = outboxdriver.Effect{
			Seq: i, Kind: kind, Topic: topic, UUID: fmt.Sprintf("uuid-%s-%d", src.ID, i),
			Payload: payloads[i], Metadata: metadata[i], OrderingKey: "key-" + src.ID, Source: src,
		}
	}
	return out
}

func testInsertRoundTrip(f *fixture) {
	src, other := f.src("m1"), f.src("m2")
	want := binaryEffects(src)
	tx := f.begin()
	defer func() { _ = tx.Rollback() }()
	f.claim(tx, src)
	// Two inserts in one transaction, as two Publish calls of one handler do.
	if _, err := f.st.EffectInsert(f.ctx, tx, src, want[:2]); err != nil {
		f.t.Fatal(err)
	}
	if _, err := f.st.EffectInsert(f.ctx, tx, other, f.effects(other, "k", 2)); err != nil {
		f.t.Fatal(err)
	}
	if _, err := f.st.EffectInsert(f.ctx, tx, src, want[2:]); err != nil {
		f.t.Fatal(err)
	}
	if err := tx.Commit(); err != nil {
		f.t.Fatal(err)
	}
	got := f.pending(src)
	if len(got) != len(want) {
		f.t.Fatalf("pending effects: %d, want %d", len(got), len(want))
	}
	for i := range want {
		sameEffect(f.t, got[i], want[i])
		if got[i].StoreID != want[i].StoreID {
			f.t.Errorf("effect %d: StoreID %d, but EffectInsert set %d", i, got[i].StoreID, want[i].StoreID)
		}
		if got[i].Attempts != 0 || got[i].Failures != 0 || got[i].Parked {
			f.t.Errorf("effect %d: attempts %d, failures %d, parked %v; want none", i, got[i].Attempts, got[i].Failures, got[i].Parked)
		}
		if got[i].Attempts != 0 {
			f.t.Errorf("effect %d: attempts %d, want 0", i, got[i].Attempts)
		}
		if got[i].PendingFor < 0 || got[i].PendingFor > time.Minute {
			f.t.Errorf("effect %d: pending for %s just after its commit", i, got[i].PendingFor)
		}
		if i > 0 && got[i].StoreID == got[i-1].StoreID {
			f.t.Errorf("effects %d and %d share StoreID %d", i-1, i, got[i].StoreID)
		}
	}
	if n := len(f.pending(other)); n != 2 {
		f.t.Fatalf("other source: %d pending, want 2", n)
	}
	// A boundary source (no consumer) round-trips too.
	boundary := outboxdriver.Source{ID: "boundary-1"}
	bw := binaryEffects(boundary)
	f.commit(boundary, false, bw)
	for i, e := range f.pending(boundary) {
		sameEffect(f.t, e, bw[i])
	}
}

func testInsertRolledBack(f *fixture) {
	src := f.src("m1")
	tx := f.begin()
	f.claim(tx, src)
	if _, err := f.st.EffectInsert(f.ctx, tx, src, f.effects(src, "k", 3)); err != nil {
		f.t.Fatal(err)
	}
	if err := tx.Rollback(); err != nil {
		f.t.Fatal(err)
	}
	if n := len(f.pending(src)); n != 0 {
		f.t.Fatalf("%d effects of a rolled-back transaction are pending", n)
	}
	if got := f.relay(relayParams{Limit: 100}, sent); len(got) != 0 {
		f.t.Fatalf("the relay found %d effects of a rolled-back transaction", len(got))
	}
}

// testInsertLargeBatch: one call stores more effects than one statement's parameters hold
// (PostgreSQL: 65,535, 7 per effect).
func testInsertLargeBatch(f *fixture) {
	src := f.src("big")
	want := f.effects(src, "k", 10_000)
	f.commit(src, true, want)
	got := f.pending(src)
	if len(got) != len(want) {
		f.t.Fatalf("pending effects: %d, want %d", len(got), len(want))
	}
	for i := range want {
		sameEffect(f.t, got[i], want[i])
	}
}

// testInsertInSavepoint: effects written inside a savepoint are reported as such, and
// EffectExisting tells which of them survived its rollback.
func testInsertInSavepoint(f *fixture) {
	src := f.src("m1")
	tx := f.begin()
	defer func() { _ = tx.Rollback() }()
	f.claim(tx, src)
	before := f.effects(src, "k", 1)
	if _, err := f.st.EffectInsert(f.ctx, tx, src, before); err != nil {
		f.t.Fatal(err)
	}
	exec := func(q string) {
		if _, err := tx.ExecContext(f.ctx, q); err != nil {
			f.t.Fatalf("%s: %v", q, err)
		}
	}
	insert := func(seq int) ([]outboxdriver.Effect, bool) {
		es := f.effects(src, "k", 1)
		es[0].Seq = seq
		nested, err := f.st.EffectInsert(f.ctx, tx, src, es)
		if err != nil {
			f.t.Fatal(err)
		}
		return es, nested
	}
	exec("SAVEPOINT sp_undo")
	undone, nested := insert(1)
	if !nested {
		f.t.Fatal("EffectInsert inside a savepoint: want inSavepoint")
	}
	exec("ROLLBACK TO SAVEPOINT sp_undo")
	exec("SAVEPOINT sp_keep")
	kept, nested := insert(2)
	if !nested {
		f.t.Fatal("EffectInsert inside a savepoint: want inSavepoint")
	}
	exec("RELEASE SAVEPOINT sp_keep")
	ids := []int64{before[0].StoreID, undone[0].StoreID, kept[0].StoreID}
	got, err := f.st.EffectExisting(f.ctx, tx, ids)
	if err != nil {
		f.t.Fatal(err)
	}
	slices.Sort(got)
	want := []int64{before[0].StoreID, kept[0].StoreID}
	if !slices.Equal(got, want) {
		f.t.Fatalf("EffectExisting(%v) = %v, want %v (the one written in the rolled-back savepoint is gone)", ids, got, want)
	}
}

// testMarkOnlyTheListed: a mark covers exactly the effects it lists, never "whatever is pending
// for the source" (an effect recorded concurrently and not sent must stay pending).
func testMarkOnlyTheListed(f *fixture) {
	src := f.src("m1")
	es := f.effects(src, "k", 3)
	f.commit(src, true, es)
	if err := f.st.EffectMarkDispatched(f.ctx, markOf(src, []outboxdriver.Effect{es[0], es[2]}, true)); err != nil {
		f.t.Fatal(err)
	}
	got := f.pending(src)
	if len(got) != 1 || got[0].StoreID != es[1].StoreID {
		f.t.Fatalf("pending after marking effects 0 and 2: %v, want effect 1 only", uuids(got))
	}
}

func testPendingFor(f *fixture) {
	src := f.src("m1")
	f.commit(src, true, f.effects(src, "k", 1))
	f.age("effects", "created_at", src, time.Hour)
	got := f.pending(src)[0].PendingFor
	if got < time.Hour || got > time.Hour+time.Minute {
		f.t.Fatalf("PendingFor of an effect stored an hour ago: %s", got)
	}
}

// testMarkMany marks many sources in one call (the background marker's batches), more than one
// statement's worth, some moving their claims and some not, and leaves the others alone.
func testMarkMany(f *fixture) {
	var srcs []outboxdriver.Source
	var marks []outboxdriver.DispatchMark
	for i := 0; i < 300; i++ {
		src := f.src(fmt.Sprintf("many-%03d", i))
		es := f.effects(src, "k", 1)
		f.commit(src, true, es)
		srcs = append(srcs, src)
		marks = append(marks, markOf(src, es, i%3 == 0))
	}
	keep := f.src("keep")
	f.commit(keep, true, f.effects(keep, "k", 1))
	if err := f.st.EffectMarkDispatched(f.ctx, append(marks, marks[1])...); err != nil {
		f.t.Fatalf("EffectMarkDispatched(300 sources): %v", err)
	}
	for _, src := range srcs {
		if n := len(f.pending(src)); n != 0 {
			f.t.Fatalf("%s: %d effects pending after a batch mark", src.ID, n)
		}
	}
	if n := len(f.pending(keep)); n != 1 {
		f.t.Fatalf("a batch mark touched another source: %d pending, want 1", n)
	}
}

func testMarkDispatched(f *fixture) {
	src, other := f.src("m1"), f.src("m2")
	f.commit(src, true, f.effects(src, "k1", 3))
	eo := f.effects(other, "k2", 1)
	f.commit(other, true, eo)
	f.mark(src)
	if n := len(f.pending(src)); n != 0 {
		f.t.Fatalf("%d effects pending after EffectMarkDispatched", n)
	}
	if n := len(f.pending(other)); n != 1 {
		f.t.Fatalf("EffectMarkDispatched touched another source: %d pending, want 1", n)
	}
	f.mark(src) // nothing pending: no error, no change
	boundary := outboxdriver.Source{ID: "b1"}
	f.commit(boundary, false, f.effects(boundary, "k3", 2))
	f.mark(boundary)
	if n := len(f.pending(boundary)); n != 0 {
		f.t.Fatalf("%d boundary effects pending after EffectMarkDispatched", n)
	}
	// Dispatched effects are not relayed.
	f.age("effects", "created_at", outboxdriver.Source{}, 2*time.Hour)
	got := f.relay(due, sent)
	wantUUIDs(f.t, "relay after marking", got, eo...)
}

// testMarkKeepsClaim: a mark without MoveClaim (effects sent right after their claim) marks the
// effects and keeps the claim, whose retention then counts from the time it was written with (a
// store may move it anyway).
func testMarkKeepsClaim(f *fixture) {
	src, other := f.src("m1"), f.src("m2")
	f.commit(src, true, f.effects(src, "k1", 2))
	f.commit(other, true, f.effects(other, "k2", 1))
	if err := f.st.EffectMarkDispatched(f.ctx, markOf(src, f.pending(src), false)); err != nil {
		f.t.Fatalf("EffectMarkDispatched: %v", err)
	}
	if n := len(f.pending(src)); n != 0 {
		f.t.Fatalf("%d effects pending after a mark without MoveClaim", n)
	}
	if n := len(f.pending(other)); n != 1 {
		f.t.Fatalf("the mark touched another source: %d pending, want 1", n)
	}
	if !f.processed(src) {
		f.t.Fatal("the claim is gone after a mark")
	}
	week := outboxdriver.CleanupParams{Retention: 7 * 24 * time.Hour, EffectRetention: time.Hour, BatchSize: 10}
	if res := f.cleanup(week); res.Claims != 0 || !f.processed(src) {
		f.t.Fatalf("cleanup deleted a claim written just now: %+v", res)
	}
}

// testMarkMovesClaim: the claim's retention counts from the dispatch, not from the processing.
func testMarkMovesClaim(f *fixture) {
	src := f.src("m1")
	f.commit(src, true, f.effects(src, "k", 2))
	f.age("processed", "processed_at", src, 30*24*time.Hour)
	f.age("processed", "dispatched_at", src, 30*24*time.Hour)
	week := outboxdriver.CleanupParams{Retention: 7 * 24 * time.Hour, EffectRetention: time.Hour, BatchSize: 10}
	if res := f.cleanup(week); res.Claims != 0 || !f.processed(src) {
		f.t.Fatalf("cleanup deleted a claim with pending effects: %+v", res)
	}
	f.mark(src)
	if res := f.cleanup(week); res.Claims != 0 || !f.processed(src) {
		f.t.Fatalf("cleanup deleted a claim dispatched just now (processed 30 days ago): %+v", res)
	}
	f.age("processed", "dispatched_at", src, 8*24*time.Hour)
	if res := f.cleanup(week); res.Claims != 1 || f.processed(src) {
		f.t.Fatalf("cleanup kept a claim dispatched 8 days ago: %+v", res)
	}
}

// failures returns uncounted failure records of effects, due again after delay.
func failures(effects []outboxdriver.Effect, reason string, delay time.Duration) []outboxdriver.EffectFailure {
	out := make([]outboxdriver.EffectFailure, len(effects))
	for i, e := range effects {
		out[i] = outboxdriver.EffectFailure{StoreID: e.StoreID, Reason: reason, RetryAfter: delay}
	}
	return out
}

func (f *fixture) recordFailures(fs ...outboxdriver.EffectFailure) {
	f.t.Helper()
	if err := f.st.EffectRecordFailures(f.ctx, fs...); err != nil {
		f.t.Fatalf("EffectRecordFailures: %v", err)
	}
}

// testRecordFailuresAtOnce: a failed dispatch recorded with no delay makes the effects due for
// the relay at once, without the grace period; an uncounted failure is recorded (Failures, its
// time) without counting toward parking.
func testRecordFailuresAtOnce(f *fixture) {
	src, fresh := f.src("m1"), f.src("m2")
	es := f.effects(src, "k1", 2)
	f.commit(src, true, es)
	f.commit(fresh, true, f.effects(fresh, "k2", 1))
	f.recordFailures(failures(es, "broker down", 0)...)
	for _, e := range f.pending(src) {
		if e.Attempts != 0 || e.Failures != 1 || e.SinceFailure < 0 || e.SinceFailure > time.Minute || e.Parked {
			f.t.Fatalf("effect %s after one uncounted failure: attempts %d, failures %d, since failure %s, parked %v",
				e.UUID, e.Attempts, e.Failures, e.SinceFailure, e.Parked)
		}
	}
	// Due at once, without waiting for the grace period; the fresh source is not.
	got := f.relay(due, sent)
	wantUUIDs(f.t, "relay after a failure recorded with no delay", got, es...)
	// Dispatched effects are left alone.
	f.recordFailures(failures(es, "late", 0)...)
	if got := f.relay(due, sent); len(got) != 0 {
		f.t.Fatalf("EffectRecordFailures revived %d dispatched effects", len(got))
	}
}

func testRecordFailuresDelay(f *fixture) {
	src := f.src("m1")
	es := f.effects(src, "k", 1)
	f.commit(src, true, es)
	f.recordFailures(failures(es, "broker down", time.Hour)...)
	if got := f.relay(relayParams{Limit: 100}, sent); len(got) != 0 {
		f.t.Fatalf("an effect to retry in an hour was relayed at once: %v", uuids(got))
	}
	f.age("effects", "next_attempt_at", src, 2*time.Hour)
	got := f.relay(due, sent)
	wantUUIDs(f.t, "relay after the retry delay", got, es...)
	if got[0].Attempts != 0 || got[0].Failures != 1 {
		f.t.Fatalf("attempts %d, failures %d; want 0 and 1", got[0].Attempts, got[0].Failures)
	}
}

// testRecordFailuresCountedAndParked: a counted failure counts toward parking; Park parks.
func testRecordFailuresCountedAndParked(f *fixture) {
	src := f.src("m1")
	es := f.effects(src, "k", 2)
	f.commit(src, true, es)
	f.recordFailures(outboxdriver.EffectFailure{StoreID: es[0].StoreID, Reason: "refused", Counted: true})
	f.recordFailures(outboxdriver.EffectFailure{StoreID: es[0].StoreID, Reason: "refused again", Counted: true, Park: true})
	got := f.pending(src)
	if !got[0].Parked || got[0].Attempts != 2 || got[0].Failures != 2 {
		f.t.Fatalf("after two counted failures, the second parking it: %+v", got[0])
	}
	if got[1].Parked || got[1].Attempts != 0 || got[1].Failures != 0 {
		f.t.Fatalf("the other effect of the source was touched: %+v", got[1])
	}
	parked := f.parked(10)
	if len(parked) != 1 || parked[0].LastError != "refused again" {
		f.t.Fatalf("parked effects: %+v", parked)
	}
	// The effect behind the parked one (same key) is never relayed.
	f.age("effects", "created_at", outboxdriver.Source{}, 2*time.Hour)
	if got := f.relay(due, sent); len(got) != 0 {
		f.t.Fatalf("relayed behind a parked effect: %v", uuids(got))
	}
}

// testRecordFailuresKeepParked: a failure recorded without parking, by a path that tried the
// effect while the relay parked it (a redelivery, another relay whose lease ran out), leaves it
// parked, since the time it was first parked.
func testRecordFailuresKeepParked(f *fixture) {
	src := f.src("m1")
	es := f.effects(src, "k", 1)
	f.commit(src, true, es)
	f.recordFailures(outboxdriver.EffectFailure{StoreID: es[0].StoreID, Reason: "refused", Counted: true, Park: true})
	first := f.parked(10)
	if len(first) != 1 {
		f.t.Fatalf("parked effects after parking one: %+v", first)
	}
	time.Sleep(20 * time.Millisecond) // a second park must not move parked_at
	f.recordFailures(outboxdriver.EffectFailure{StoreID: es[0].StoreID, Reason: "refused elsewhere", Counted: true})
	if got := f.pending(src); len(got) != 1 || !got[0].Parked {
		f.t.Fatalf("a failure recorded without parking un-parked the effect: %+v", got)
	}
	f.recordFailures(outboxdriver.EffectFailure{StoreID: es[0].StoreID, Reason: "refused once more", Counted: true, Park: true})
	parked := f.parked(10)
	if len(parked) != 1 || !parked[0].ParkedAt.Equal(first[0].ParkedAt) {
		f.t.Fatalf("parked effects after two more failures: %+v, want the one parked at %s", parked, first[0].ParkedAt)
	}
	f.age("effects", "created_at", outboxdriver.Source{}, 2*time.Hour)
	if got := f.relay(due, sent); len(got) != 0 {
		f.t.Fatalf("a parked effect was relayed: %v", uuids(got))
	}
}

// testRecordFailuresRelease: an effect recorded without a reason (not tried) gets only a retry
// time: no failure, no count.
func testRecordFailuresRelease(f *fixture) {
	src := f.src("m1")
	es := f.effects(src, "k", 1)
	f.commit(src, true, es)
	f.recordFailures(outboxdriver.EffectFailure{StoreID: es[0].StoreID, RetryAfter: time.Hour})
	got := f.pending(src)[0]
	if got.Failures != 0 || got.Attempts != 0 {
		f.t.Fatalf("a released effect was charged: %+v", got)
	}
	f.age("effects", "created_at", outboxdriver.Source{}, 2*time.Hour)
	if got := f.relay(due, sent); len(got) != 0 {
		f.t.Fatalf("a released effect was relayed before its retry time: %v", uuids(got))
	}
}

// testRetryNow: once a destination takes messages again, the effects that back off after a
// failure to it become due at once: to that topic (or applier) only, up to the limit, and never
// one whose retry time a lease or a release set since, failures or not (a leased one may be in
// another relay's call), nor a parked one.
func testRetryNow(f *fixture) {
	r, ok := f.st.(outboxdriver.EffectRetrier)
	if !ok {
		f.t.Skipf("%T cannot end a backoff early", f.st)
	}
	// Each effect has a key of its own, so that none waits behind another.
	one := func(name, kind, topic string) outboxdriver.Effect {
		src := f.src(name)
		es := f.effects(src, name, 1)
		es[0].Kind, es[0].Topic = kind, topic
		f.commit(src, true, es)
		return es[0]
	}
	backedOff := []outboxdriver.Effect{one("a1", outboxdriver.KindPublish, "a"), one("a2", outboxdriver.KindPublish, "a"),
		one("a3", outboxdriver.KindPublish, "a")}
	leased := one("leased", outboxdriver.KindPublish, "a")
	released := one("released", outboxdriver.KindPublish, "a")
	parked := one("parked", outboxdriver.KindPublish, "a")
	otherTopic := one("b", outboxdriver.KindPublish, "b")
	applier := one("x", "refund", "")
	otherApplier := one("y", "charge", "")
	padded := one("z", "refund ", "") // another applier, whose name differs by a space
	f.age("effects", "created_at", outboxdriver.Source{}, 2*time.Hour)

	all := append(slices.Clone(backedOff), parked, otherTopic, applier, otherApplier, padded)
	f.recordFailures(failures(all, "broker down", time.Hour)...)
	f.recordFailures(outboxdriver.EffectFailure{StoreID: parked.StoreID, Reason: "refused", Counted: true, Park: true, RetryAfter: time.Hour})
	// The leased and the released effect failed before (due again at once) and were claimed
	// since: the retry time of one is the lease's, of the other the release's (a round that did
	// not try it).
	f.recordFailures(failures([]outboxdriver.Effect{leased, released}, "broker down", 0)...)
	wantSet(f.t, "claim of the effects to lease", f.claimDue(f.st, outboxdriver.EffectClaimParams{Grace: time.Hour, Limit: 100, Lease: time.Hour}),
		leased, released)
	f.recordFailures(outboxdriver.EffectFailure{StoreID: released.StoreID, RetryAfter: time.Hour})
	if got := f.relay(due, sent); len(got) != 0 {
		f.t.Fatalf("claimed while everything backs off or is leased: %v", uuids(got))
	}

	retry := func(kind, topic string, limit int) int {
		f.t.Helper()
		n, err := r.EffectRetryNow(f.ctx, kind, topic, limit)
		if err != nil {
			f.t.Fatalf("EffectRetryNow(%q, %q): %v", kind, topic, err)
		}
		return n
	}
	if n := retry(outboxdriver.KindPublish, "a", 2); n != 2 {
		f.t.Fatalf("EffectRetryNow(topic a, limit 2) made %d due, want 2", n)
	}
	if n := retry(outboxdriver.KindPublish, "a", 100); n != 1 {
		f.t.Fatalf("EffectRetryNow(topic a) made %d more due, want the third backing off only", n)
	}
	wantSet(f.t, "claim after topic a recovered", f.relay(due, sent), backedOff...)
	if n := retry(outboxdriver.KindPublish, "a", 100); n != 0 {
		f.t.Fatalf("EffectRetryNow(topic a) again made %d due: the leased, the released or the parked one", n)
	}
	if n := retry("refund", "", 100); n != 1 {
		f.t.Fatalf("EffectRetryNow(applier refund) made %d due, want 1", n)
	}
	wantSet(f.t, "claim after the applier recovered", f.relay(due, sent), applier)
	if got := f.relay(due, sent); len(got) != 0 {
		f.t.Fatalf("claimed what still backs off, is leased, released or parked: %v", uuids(got))
	}
	// The others are due when their own time comes, as before.
	f.age("effects", "next_attempt_at", outboxdriver.Source{}, 2*time.Hour)
	wantSet(f.t, "claim once every retry time passed", f.relay(due, sent), leased, released, otherTopic, otherApplier, padded)
}

func testHandToRelay(f *fixture) {
	src, fresh := f.src("m1"), f.src("m2")
	es := f.effects(src, "k1", 2)
	f.commit(src, true, es)
	f.commit(fresh, true, f.effects(fresh, "k2", 1))
	if got := f.relay(due, sent); len(got) != 0 {
		f.t.Fatalf("effects in their grace period were relayed: %v", uuids(got))
	}
	if err := f.st.EffectHandToRelay(f.ctx, src); err != nil {
		f.t.Fatal(err)
	}
	got := f.relay(due, sent)
	wantUUIDs(f.t, "relay after EffectHandToRelay", got, es...)
	for _, e := range got {
		if e.Attempts != 0 {
			f.t.Fatalf("EffectHandToRelay counted an attempt: %d", e.Attempts)
		}
	}
}

func (f *fixture) keyBlocked(src outboxdriver.Source, key string) bool {
	f.t.Helper()
	b, err := f.st.EffectKeyBlocked(f.ctx, src, key)
	if err != nil {
		f.t.Fatalf("EffectKeyBlocked(%v, %q): %v", src, key, err)
	}
	return b
}

func testKeyBlocked(f *fixture) {
	a, b, c := f.src("a"), f.src("b"), f.src("c")
	f.commit(a, true, f.effects(a, "k", 2))
	f.commit(b, true, f.effects(b, "k", 2))
	if f.keyBlocked(a, "k") {
		f.t.Fatal("the first effects with a key are blocked (by their own, or by later ones)")
	}
	if !f.keyBlocked(b, "k") {
		f.t.Fatal("effects behind an undispatched earlier one with their key are not blocked")
	}
	if f.keyBlocked(b, "other") {
		f.t.Fatal("blocked on a key no earlier effect has")
	}
	f.commit(c, true, f.effects(c, "k", 1))
	f.mark(a)
	if f.keyBlocked(b, "k") {
		f.t.Fatal("still blocked after the earlier effects were dispatched")
	}
	if !f.keyBlocked(c, "k") {
		f.t.Fatal("the third source is not blocked behind the second")
	}
	// A source's effect of another key, stored before another source's effect with the key (its
	// unit wrote it first), does not let its own effects with the key pass that one: the check
	// is on the source's first pending effect with the key. It was on the source's first pending
	// effect of any key, and the later effect with the key went out first.
	d, e := f.src("d"), f.src("e")
	f.commit(d, true, f.effects(d, "own-d", 1))
	f.commit(e, true, f.effects(e, "k2", 1))
	later := f.effects(d, "k2", 1)
	later[0].Seq = 1
	f.commit(d, false, later)
	if !f.keyBlocked(d, "k2") {
		f.t.Fatal("effects with a key are not blocked behind another source's earlier one, past an earlier effect of their source with another key")
	}
	if f.keyBlocked(e, "k2") {
		f.t.Fatal("the first effect with a key is blocked")
	}
}

func testRelayGrace(f *fixture) {
	src := f.src("m1")
	es := f.effects(src, "k", 3)
	f.commit(src, true, es)
	if got := f.relay(due, sent); len(got) != 0 {
		f.t.Fatalf("effects in their grace period were relayed: %v", uuids(got))
	}
	f.age("effects", "created_at", src, 2*time.Hour)
	got := f.relay(due, sent)
	wantUUIDs(f.t, "relay after the grace period", got, es...)
	for i := range es {
		sameEffect(f.t, got[i], es[i])
		if got[i].PendingFor < 2*time.Hour {
			f.t.Errorf("effect %d: pending for %s, want at least 2h", i, got[i].PendingFor)
		}
	}
	if n := len(f.pending(src)); n != 0 {
		f.t.Fatalf("%d effects pending after the relay sent them", n)
	}
	if got := f.relay(due, sent); len(got) != 0 {
		f.t.Fatalf("the relay sent %d effects twice", len(got))
	}
}

func testRelayLimit(f *fixture) {
	src := f.src("m1")
	es := f.effects(src, "k", 5)
	f.commit(src, true, es)
	f.age("effects", "created_at", src, 2*time.Hour)
	p := due
	p.Limit = 2
	for _, want := range [][]outboxdriver.Effect{es[0:2], es[2:4], es[4:5], nil} {
		wantUUIDs(f.t, "relay round with limit 2", f.relay(p, sent), want...)
	}
}

func testRelayBackoff(f *fixture) {
	src := f.src("m1")
	es := f.effects(src, "k", 1)
	f.commit(src, true, es)
	f.age("effects", "created_at", src, 2*time.Hour)
	var backoffArg int
	p := due
	p.Backoff = func(attempts int) time.Duration { backoffArg = attempts; return time.Hour }
	wantUUIDs(f.t, "first round", f.relay(p, func(outboxdriver.Effect) error { return errors.New("broker down") }), es...)
	if backoffArg != 1 {
		f.t.Fatalf("Backoff called with %d, want 1", backoffArg)
	}
	if pe := f.pending(src); len(pe) != 1 || pe[0].Attempts != 1 {
		f.t.Fatalf("after a failed relay: pending %v", pe)
	}
	if got := f.relay(p, sent); len(got) != 0 {
		f.t.Fatalf("an effect backing off for an hour was relayed again at once")
	}
	f.age("effects", "next_attempt_at", src, 2*time.Hour)
	got := f.relay(p, sent)
	wantUUIDs(f.t, "relay after the backoff", got, es...)
	if got[0].Attempts != 1 {
		f.t.Fatalf("attempts %d, want 1", got[0].Attempts)
	}
	if len(f.pending(src)) != 0 {
		f.t.Fatal("still pending after a successful retry")
	}
}

func testRelayBlocked(f *fixture) {
	src := f.src("m1")
	es := f.effects(src, "k", 2)
	f.commit(src, true, es)
	f.age("effects", "created_at", src, 2*time.Hour)
	blocked := func(outboxdriver.Effect) error { return fmt.Errorf("wrapped: %w", errBlocked) }
	wantUUIDs(f.t, "first round", f.relay(due, blocked), es...)
	for _, e := range f.pending(src) {
		if e.Attempts != 0 {
			f.t.Fatalf("a blocked effect was counted: attempts %d", e.Attempts)
		}
	}
	wantUUIDs(f.t, "a blocked effect is due again at once", f.relay(due, sent), es...)
}

func testRelayPark(f *fixture) {
	src := f.src("m1")
	es := f.effects(src, "k", 1)
	f.commit(src, true, es)
	f.age("effects", "created_at", src, 2*time.Hour)
	p := due
	p.MaxAttempts = 2
	p.Backoff = nil // due again at once
	// Brokers and appliers may fail with any text: NUL and invalid UTF-8 must not fail the round.
	fail := func(outboxdriver.Effect) error { return errors.New("rejected: \x00 and \xff are not allowed") }
	wantUUIDs(f.t, "first attempt", f.relay(p, fail), es...)
	if parked := f.parked(10); len(parked) != 0 {
		f.t.Fatalf("parked after 1 of 2 attempts")
	}
	wantUUIDs(f.t, "second attempt", f.relay(p, fail), es...)
	parked := f.parked(10)
	if len(parked) != 1 || parked[0].UUID != es[0].UUID || parked[0].Attempts != 2 {
		f.t.Fatalf("after 2 of 2 attempts: parked %v", parked)
	}
	if le := parked[0].LastError; !strings.HasPrefix(le, "rejected: ") || !strings.Contains(le, "are not allowed") {
		f.t.Fatalf("last error of the parked effect: %q", le)
	}
	if got := f.relay(p, sent); len(got) != 0 {
		f.t.Fatal("a parked effect was relayed")
	}
	if pe := f.pending(src); len(pe) != 1 {
		f.t.Fatal("a parked effect is no longer pending: it would never be sent")
	}
}

// testRelayKeyBehindFailure: later effects with a key wait behind a failed one while it backs off
// and while it is parked; effects with other keys flow; discarding the failed one unblocks them.
func testRelayKeyBehindFailure(f *fixture) {
	a, b, c := f.src("a"), f.src("b"), f.src("c")
	ea, eb, ec := f.effects(a, "k", 1), f.effects(b, "k", 1), f.effects(c, "other", 1)
	f.commit(a, true, ea)
	f.commit(b, true, eb)
	f.commit(c, true, ec)
	f.age("effects", "created_at", outboxdriver.Source{}, 2*time.Hour)
	p := due
	p.MaxAttempts = 2
	// As the outbox's relay does: after a failure, later effects with its key are not tried.
	outcome := func(e outboxdriver.Effect) error {
		switch e.Source {
		case a:
			return errors.New("rejected")
		case b:
			return errBlocked
		}
		return nil
	}
	wantSet(f.t, "first rounds", f.drain(p, outcome), ea[0], eb[0], ec[0])
	if got := f.relay(p, sent); len(got) != 0 {
		f.t.Fatalf("effects behind one backing off were relayed: %v", uuids(got))
	}
	f.age("effects", "next_attempt_at", a, 2*time.Hour)
	wantUUIDs(f.t, "round after the backoff", f.relay(p, outcome), ea[0], eb[0])
	if parked := f.parked(10); len(parked) != 1 || parked[0].UUID != ea[0].UUID {
		f.t.Fatalf("parked: %v, want the failing effect", parked)
	}
	if got := f.relay(p, sent); len(got) != 0 {
		f.t.Fatalf("effects behind a parked one were relayed: %v", uuids(got))
	}
	if n := f.discard(f.parked(10)[0].StoreID); n != 1 {
		f.t.Fatalf("EffectDiscard changed %d", n)
	}
	wantUUIDs(f.t, "round after the discard", f.relay(p, sent), eb[0])
}

// testRelayKeyBehindFastPath: an effect handed to the relay (its transaction found the key
// blocked) waits behind an earlier undispatched effect with its key even while that one is not
// due for the relay (in its grace period: the transaction that stored it may be sending it right
// now), and goes once that one is dispatched.
func testRelayKeyBehindFastPath(f *fixture) {
	a, b := f.src("a"), f.src("b")
	ea, eb := f.effects(a, "k", 1), f.effects(b, "k", 1)
	f.commit(a, true, ea)
	f.commit(b, true, eb)
	if !f.keyBlocked(b, "k") {
		f.t.Fatal("EffectKeyBlocked: want blocked")
	}
	if err := f.st.EffectHandToRelay(f.ctx, b); err != nil {
		f.t.Fatal(err)
	}
	if got := f.relay(due, sent); len(got) != 0 {
		f.t.Fatalf("the relay sent %v before the earlier effect %s with its key", uuids(got), ea[0].UUID)
	}
	f.mark(a)
	wantUUIDs(f.t, "relay after the earlier effect was dispatched", f.relay(due, sent), eb...)
}

// testRelayMarksClaim: once the relay has sent every effect of a message, the claim's retention
// counts from then.
func testRelayMarksClaim(f *fixture) {
	src := f.src("m1")
	f.commit(src, true, f.effects(src, "k", 2))
	f.age("processed", "processed_at", src, 30*24*time.Hour)
	f.age("processed", "dispatched_at", src, 30*24*time.Hour)
	f.age("effects", "created_at", src, 2*time.Hour)
	week := outboxdriver.CleanupParams{Retention: 7 * 24 * time.Hour, EffectRetention: time.Hour, BatchSize: 10}
	// One effect sent, the other not yet: the claim stays.
	f.relay(due, func(e outboxdriver.Effect) error {
		if e.Seq == 0 {
			return nil
		}
		return errors.New("broker down")
	})
	if res := f.cleanup(week); res.Claims != 0 || !f.processed(src) {
		f.t.Fatalf("cleanup deleted a claim with a pending effect: %+v", res)
	}
	f.age("effects", "next_attempt_at", src, 2*time.Hour)
	if got := f.relay(due, sent); len(got) != 1 {
		f.t.Fatalf("relay: %d effects, want the one left", len(got))
	}
	if res := f.cleanup(week); res.Claims != 0 || !f.processed(src) {
		f.t.Fatalf("cleanup deleted a claim whose last effect the relay sent just now: %+v", res)
	}
	f.age("processed", "dispatched_at", src, 8*24*time.Hour)
	if res := f.cleanup(week); res.Claims != 1 {
		f.t.Fatalf("cleanup kept a claim dispatched 8 days ago: %+v", res)
	}
}

// testRelayInstances: two instances claim at once. The second gets other effects than the
// first holds, and no later effect with a key the first holds; every effect is sent once.
func testRelayInstances(f *fixture) {
	const keys = 64
	var all []outboxdriver.Effect
	tx := f.begin()
	for round := 0; round < 2; round++ {
		for i := 0; i < keys; i++ {
			src := outboxdriver.Source{ID: fmt.Sprintf("boundary-%02d-%d", i, round)}
			es := f.effects(src, fmt.Sprintf("key-%02d", i), 1)
			if _, err := f.st.EffectInsert(f.ctx, tx, src, es); err != nil {
				f.t.Fatal(err)
			}
			all = append(all, es...)
		}
	}
	if err := tx.Commit(); err != nil {
		f.t.Fatal(err)
	}
	f.age("effects", "created_at", outboxdriver.Source{}, 2*time.Hour)
	other := f.h.Open(f.t)
	claim := func(st outboxdriver.Store) []outboxdriver.Effect {
		return f.claimDue(st, outboxdriver.EffectClaimParams{Grace: time.Hour, Limit: 10, Lease: time.Hour})
	}
	held := claim(f.st)
	second := claim(other)
	if len(held) != 10 || len(second) != 10 {
		f.t.Fatalf("two instances claimed %d and %d effects, want 10 each", len(held), len(second))
	}
	heldKeys := map[string]bool{}
	sentBy := map[string]int{}
	for _, e := range held {
		heldKeys[e.OrderingKey] = true
		sentBy[e.UUID]++
	}
	for _, e := range second {
		if heldKeys[e.OrderingKey] {
			f.t.Fatalf("the second instance claimed %s with key %s, which the first instance holds", e.UUID, e.OrderingKey)
		}
		sentBy[e.UUID]++
	}
	for _, batch := range [][]outboxdriver.Effect{second, held} {
		var marks []outboxdriver.DispatchMark
		for _, e := range batch {
			marks = append(marks, markOf(e.Source, []outboxdriver.Effect{e}, true))
		}
		if err := f.st.EffectMarkDispatched(f.ctx, marks...); err != nil {
			f.t.Fatal(err)
		}
	}
	for _, e := range f.drain(due, sent) {
		sentBy[e.UUID]++
	}
	for _, e := range all {
		if sentBy[e.UUID] != 1 {
			f.t.Errorf("effect %s relayed %d times, want once", e.UUID, sentBy[e.UUID])
		}
	}
}

// testClaimDueLease: claimed effects are not claimed again, nor are later effects with their
// key, until they are marked or recorded, or their lease runs out (their relay died).
func testClaimDueLease(f *fixture) {
	a, b := f.src("a"), f.src("b")
	ea, eb := f.effects(a, "k", 1), f.effects(b, "k", 1)
	f.commit(a, true, ea)
	f.commit(b, true, eb)
	f.age("effects", "created_at", outboxdriver.Source{}, 2*time.Hour)
	got := f.claimDue(f.st, outboxdriver.EffectClaimParams{Grace: time.Hour, Limit: 1, Lease: time.Hour})
	wantUUIDs(f.t, "first claim", got, ea...)
	if got := f.relay(due, sent); len(got) != 0 {
		f.t.Fatalf("claimed while the first effect with their key is leased: %v", uuids(got))
	}
	f.age("effects", "next_attempt_at", a, 2*time.Hour) // the lease ran out
	wantUUIDs(f.t, "claim after the lease ran out", f.relay(due, sent), ea[0], eb[0])
}

// testClaimDuePending: a claim that takes nothing says when the earliest pending effect that is
// not due yet falls due by itself (EffectClaim.Pending): a lease's end, or the end of a grace
// period, whichever comes first; an effect due by itself that waits behind a leased one of its
// key does not count (it falls due with that one). A store that cannot tell says nothing.
func testClaimDuePending(f *fixture) {
	p := outboxdriver.EffectClaimParams{Grace: time.Hour, Limit: 10, Lease: 2 * time.Hour}
	pending := func(what string) *outboxdriver.PendingDue {
		f.t.Helper()
		c, err := f.st.EffectClaimDue(f.ctx, p)
		if err != nil {
			f.t.Fatalf("EffectClaimDue: %v", err)
		}
		if len(c.Effects) > 0 {
			f.t.Fatalf("%s: claimed %v, want nothing", what, uuids(c.Effects))
		}
		return c.Pending
	}
	near := func(what string, got *outboxdriver.PendingDue, want time.Duration) {
		f.t.Helper()
		if got == nil || !got.Waiting || got.In > want || got.In < want-5*time.Minute {
			f.t.Fatalf("%s: Pending = %+v, want an effect falling due in about %s", what, got, want)
		}
	}
	if got := pending("nothing pending"); got == nil {
		f.t.Skip("the store does not tell when pending effects fall due")
	} else if got.Waiting {
		f.t.Fatalf("nothing pending: Pending = %+v, want none waiting", got)
	}
	a, b := f.src("a"), f.src("b")
	ea, eb := f.effects(a, "k", 1), f.effects(b, "k", 1)
	f.commit(a, true, ea)
	f.commit(b, true, eb)
	f.age("effects", "created_at", outboxdriver.Source{}, 3*time.Hour)
	wantUUIDs(f.t, "the first claim", f.claimDue(f.st, p), ea[0], eb[0])
	// a is leased for two hours; b, due by itself, waits behind it.
	near("a leased", pending("a leased"), 2*time.Hour)
	c := f.src("c")
	f.commit(c, true, f.effects(c, "j", 1))
	near("c in its grace period", pending("c in its grace period"), time.Hour)
}

// testClaimDueOutcomeBehindLease: the framework's relay writes a round's outcome in two steps,
// the failures and then the marks, and relies on this store for what another instance may claim
// in between. A round sent the first of a key's three effects, the second failed (due again at
// once), and a shutdown stopped waiting for the call of the third (leased again until the
// round's lease ends). With the failures written and the mark not yet, the key waits behind its
// leased, undispatched first effect: another instance claims none of it, though the failed one
// has a retry time that has passed. Once the mark lands, it claims the failed one alone, the
// third waiting behind it until its own retry time. Written the other way round, the failed
// effect was claimable (and leased) between the mark and the failure record, which then ended
// that lease.
func testClaimDueOutcomeBehindLease(f *fixture) {
	src := f.src("m1")
	es := f.effects(src, "k", 3)
	f.commit(src, true, es)
	f.age("effects", "created_at", outboxdriver.Source{}, 2*time.Hour)
	p := outboxdriver.EffectClaimParams{Grace: time.Hour, Limit: 10, Lease: time.Hour}
	held := f.claimDue(f.st, p)
	wantUUIDs(f.t, "the round's claim", held, es...)
	other := f.h.Open(f.t)
	f.recordFailures(
		outboxdriver.EffectFailure{StoreID: held[1].StoreID, Reason: "refused", Counted: true},
		outboxdriver.EffectFailure{StoreID: held[2].StoreID, RetryAfter: time.Hour})
	if got := f.claimDue(other, p); len(got) != 0 {
		f.t.Fatalf("another instance claimed %v while the round's first effect of their key is leased and unmarked", uuids(got))
	}
	if err := f.st.EffectMarkDispatched(f.ctx, outboxdriver.DispatchMark{Source: src, StoreIDs: []int64{held[0].StoreID}, MoveClaim: true}); err != nil {
		f.t.Fatalf("EffectMarkDispatched: %v", err)
	}
	wantUUIDs(f.t, "another instance's claim after the mark", f.claimDue(other, p), es[1])
}

// testClaimDueBeyondABlockedPrefix: a thousand effects held behind a parked one at the front of
// the backlog do not hide a due effect after them (a store that claims in windows says where to
// look next).
func testClaimDueBeyondABlockedPrefix(f *fixture) {
	parked, _ := f.parkThree()
	key := parked[0].OrderingKey
	src := f.src("behind")
	f.commit(src, true, f.effects(src, key, 1000))
	free := f.src("free")
	ef := f.effects(free, "free", 1)
	f.commit(free, true, ef)
	f.age("effects", "created_at", outboxdriver.Source{}, 2*time.Hour)
	p := due
	p.Limit = 10
	wantUUIDs(f.t, "claim behind a blocked prefix", f.relay(p, sent), ef...)
}

// testClaimDueMaxBytes: a claim loads at most MaxBytes of payload and metadata, and always one
// effect.
func testClaimDueMaxBytes(f *fixture) {
	src := f.src("m1")
	es := f.effects(src, "k", 4)
	for i := range es {
		es[i].Payload = bytes.Repeat([]byte{'x'}, 1000)
	}
	f.commit(src, true, es)
	f.age("effects", "created_at", src, 2*time.Hour)
	p := due
	p.MaxBytes = 2500
	wantUUIDs(f.t, "claim of 2500 bytes", f.relay(p, sent), es[0], es[1])
	p.MaxBytes = 1
	wantUUIDs(f.t, "claim of 1 byte", f.relay(p, sent), es[2])
}

// testClaimDueLockedEarlier: an earlier effect that another statement has locked at the moment
// of the claim holds its key: SKIP LOCKED must not let a later effect overtake it.
func testClaimDueLockedEarlier(f *fixture) {
	if !f.h.Capabilities.RowLocks {
		return
	}
	a, b, c := f.src("a"), f.src("b"), f.src("c")
	ea, eb, ec := f.effects(a, "k", 1), f.effects(b, "k", 1), f.effects(c, "other", 1)
	f.commit(a, true, ea)
	f.commit(b, true, eb)
	f.commit(c, true, ec)
	f.age("effects", "created_at", outboxdriver.Source{}, 2*time.Hour)
	tx := f.begin()
	defer func() { _ = tx.Rollback() }()
	if _, err := tx.ExecContext(f.ctx, fmt.Sprintf(`SELECT 1 FROM %s WHERE id = %d FOR UPDATE`, f.h.Table("effects"), ea[0].StoreID)); err != nil {
		f.t.Fatal(err)
	}
	wantUUIDs(f.t, "claim while the first effect of key k is locked", f.relay(due, sent), ec...)
	if err := tx.Rollback(); err != nil {
		f.t.Fatal(err)
	}
	wantUUIDs(f.t, "claim after the lock is gone", f.relay(due, sent), ea[0], eb[0])
}

// testDiscardMovesClaim: retention counts from the last dispatch or discard: a claim whose parked
// effect is discarded long after its processing is kept for the whole retention from then.
func testDiscardMovesClaim(f *fixture) {
	parked, _ := f.parkThree()
	src := parked[0].Source
	f.age("processed", "processed_at", outboxdriver.Source{}, 30*24*time.Hour)
	f.age("processed", "dispatched_at", outboxdriver.Source{}, 30*24*time.Hour)
	for _, e := range f.parked(10) {
		f.discard(e.StoreID)
	}
	week := outboxdriver.CleanupParams{Retention: 7 * 24 * time.Hour, EffectRetention: time.Hour, BatchSize: 10}
	f.cleanup(week)
	if !f.processed(src) {
		f.t.Fatal("cleanup deleted the claim of a message whose effects were discarded just now")
	}
}

// testReplay: MessageReplay forgets a poisoned claim and its attempts, and leaves a processed
// (not poisoned) claim alone.
func testReplay(f *fixture) {
	poisoned, done := f.src("poisoned"), f.src("done")
	f.attempt(poisoned, "failed")
	if err := f.st.MessagePoison(f.ctx, poisoned); err != nil {
		f.t.Fatal(err)
	}
	f.commit(done, true, nil)
	for _, c := range []struct {
		src  outboxdriver.Source
		want bool
	}{{poisoned, true}, {done, false}, {f.src("unknown"), false}} {
		ok, err := f.st.MessageReplay(f.ctx, c.src)
		if err != nil || ok != c.want {
			f.t.Fatalf("MessageReplay(%v) = %v, %v; want %v", c.src, ok, err, c.want)
		}
	}
	if f.processed(poisoned) || !f.processed(done) {
		f.t.Fatal("after MessageReplay: the poisoned claim must be gone, the processed one kept")
	}
	if got := f.attempt(poisoned, "again"); got != 1 {
		f.t.Fatalf("attempts after a replay start at %d, want 1", got)
	}
}

func (f *fixture) parked(limit int) []outboxdriver.ParkedEffect {
	f.t.Helper()
	ps, err := f.st.EffectListParked(f.ctx, limit)
	if err != nil {
		f.t.Fatalf("EffectListParked: %v", err)
	}
	return ps
}

func (f *fixture) discard(ids ...int64) int {
	f.t.Helper()
	n, err := f.st.EffectDiscard(f.ctx, ids)
	if err != nil {
		f.t.Fatalf("EffectDiscard: %v", err)
	}
	return n
}

func (f *fixture) unpark(ids ...int64) int {
	f.t.Helper()
	n, err := f.st.EffectUnpark(f.ctx, ids)
	if err != nil {
		f.t.Fatalf("EffectUnpark: %v", err)
	}
	return n
}

// parkThree parks one effect of each of three sources (keys k0, k1, k2) and leaves a second
// effect of the first source pending behind its parked one.
func (f *fixture) parkThree() (parked []outboxdriver.Effect, behind outboxdriver.Effect) {
	f.t.Helper()
	for i := 0; i < 3; i++ {
		src := f.src(fmt.Sprintf("m%d", i))
		es := binaryEffects(src)[:2]
		for j := range es {
			es[j].OrderingKey = fmt.Sprintf("k%d", i)
		}
		if i > 0 {
			es = es[:1]
		}
		f.commit(src, true, es)
		parked = append(parked, es[0])
		if i == 0 {
			behind = es[1]
		}
	}
	f.age("effects", "created_at", outboxdriver.Source{}, 2*time.Hour)
	p := due
	p.MaxAttempts = 1
	f.drain(p, func(e outboxdriver.Effect) error {
		if e.Seq == 0 {
			return fmt.Errorf("rejected %s", e.UUID)
		}
		return errBlocked
	})
	return parked, behind
}

func testListParked(f *fixture) {
	start := time.Now()
	want, _ := f.parkThree()
	got := f.parked(10)
	if len(got) != len(want) {
		f.t.Fatalf("parked: %d, want %d", len(got), len(want))
	}
	for i, p := range got {
		sameEffect(f.t, p.Effect, want[i])
		if i > 0 && p.StoreID <= got[i-1].StoreID {
			f.t.Errorf("parked effects not oldest first: %d after %d", p.StoreID, got[i-1].StoreID)
		}
		if p.Attempts != 1 || p.LastError != "rejected "+want[i].UUID {
			f.t.Errorf("parked %s: attempts %d, last error %q", p.UUID, p.Attempts, p.LastError)
		}
		if p.ParkedAt.Before(p.CreatedAt) || p.ParkedAt.Sub(start).Abs() > time.Minute ||
			p.CreatedAt.Sub(start.Add(-2*time.Hour)).Abs() > time.Minute {
			f.t.Errorf("parked %s: created at %s, parked at %s; test started at %s, effects aged by 2h",
				p.UUID, p.CreatedAt, p.ParkedAt, start)
		}
		if p.PendingFor < 2*time.Hour {
			f.t.Errorf("parked %s: pending for %s, want at least 2h", p.UUID, p.PendingFor)
		}
	}
	if got := f.parked(2); len(got) != 2 || got[0].UUID != want[0].UUID || got[1].UUID != want[1].UUID {
		f.t.Fatalf("parked with limit 2: %v", got)
	}
}

func testUnpark(f *fixture) {
	parked, behind := f.parkThree()
	ps := f.parked(10)
	if n := f.unpark(ps[0].StoreID, ps[0].StoreID+1_000_000); n != 1 {
		f.t.Fatalf("EffectUnpark changed %d, want 1", n)
	}
	if n := f.unpark(ps[0].StoreID); n != 0 {
		f.t.Fatalf("EffectUnpark of an effect no longer parked changed %d", n)
	}
	if n := f.unpark(); n != 0 {
		f.t.Fatalf("EffectUnpark of nothing changed %d", n)
	}
	if left := f.parked(10); len(left) != 2 || left[0].UUID != parked[1].UUID {
		f.t.Fatalf("parked after unparking the first: %v", left)
	}
	// Due at once with a fresh attempt count, and the effect behind it follows in the same round.
	got := f.relay(due, sent)
	wantUUIDs(f.t, "relay after EffectUnpark", got, parked[0], behind)
	if got[0].Attempts != 0 || got[0].Failures != 0 {
		f.t.Fatalf("attempts and failures after EffectUnpark: %d and %d, want 0 (an operator's retry starts afresh)", got[0].Attempts, got[0].Failures)
	}
}

func testDiscard(f *fixture) {
	parked, behind := f.parkThree()
	ps := f.parked(10)
	if n := f.discard(ps[0].StoreID, ps[1].StoreID); n != 2 {
		f.t.Fatalf("EffectDiscard changed %d, want 2", n)
	}
	if n := f.discard(ps[0].StoreID); n != 0 {
		f.t.Fatalf("EffectDiscard of a discarded effect changed %d", n)
	}
	// Only parked effects can be discarded: not the pending one behind them.
	if n := f.discard(f.pending(behind.Source)[0].StoreID); n != 0 {
		f.t.Fatalf("EffectDiscard of a pending, unparked effect changed %d", n)
	}
	if left := f.parked(10); len(left) != 1 || left[0].UUID != parked[2].UUID {
		f.t.Fatalf("parked after discarding two: %v", left)
	}
	if pe := f.pending(parked[1].Source); len(pe) != 0 {
		f.t.Fatalf("a discarded effect is still pending: %v", uuids(pe))
	}
	// The effect behind the discarded one goes; the discarded one is never sent.
	wantUUIDs(f.t, "relay after EffectDiscard", f.relay(due, sent), behind)
}

func testNotifyListen(f *fixture) {
	if err := f.st.EffectNotify(f.ctx); err != nil {
		f.t.Fatalf("EffectNotify: %v", err)
	}
	ctx, cancel := context.WithCancel(f.ctx)
	defer cancel()
	woken := make(chan struct{}, 1)
	done := make(chan error, 1)
	go func() {
		done <- f.st.EffectListen(ctx, func() {
			select {
			case woken <- struct{}{}:
			default:
			}
		})
	}()
	if !f.h.Capabilities.Listen {
		if err := receive(f, "EffectListen of a store that cannot listen to return", done); !errors.Is(err, outboxdriver.ErrListenUnsupported) {
			f.t.Fatalf("EffectListen: want ErrListenUnsupported at once, got %v", err)
		}
		return
	}
	// Another process notifies; the listener may not be listening yet, so notify until it wakes.
	notifier := f.h.Open(f.t)
	deadline := time.Now().Add(waitLimit)
	for awake := false; !awake; {
		if time.Now().After(deadline) {
			f.t.Fatal("EffectListen never woke up")
		}
		if err := notifier.EffectNotify(f.ctx); err != nil {
			f.t.Fatal(err)
		}
		select {
		case <-woken:
			awake = true
		case err := <-done:
			f.t.Fatalf("EffectListen returned before its context was cancelled: %v", err)
		case <-time.After(50 * time.Millisecond):
		}
	}
	// Now surely listening: one notification, one wake-up.
	if err := notifier.EffectNotify(f.ctx); err != nil {
		f.t.Fatal(err)
	}
	receive(f, "a wake-up after EffectNotify", woken)
	cancel()
	if err := receive(f, "EffectListen to return after its context was cancelled", done); err != nil && !errors.Is(err, context.Canceled) {
		f.t.Fatalf("EffectListen after cancel: %v", err)
	}
}

func testCleanupRetention(f *fixture) {
	const day = 24 * time.Hour
	a, b, c, d := f.src("a-expired"), f.src("b-recent-dispatch"), f.src("c-pending"), f.src("d-new")
	f.commit(a, true, f.effects(a, "ka", 2))
	f.mark(a)
	f.commit(b, true, f.effects(b, "kb", 2))
	f.mark(b)
	f.commit(c, true, f.effects(c, "kc", 2))
	f.age("effects", "created_at", c, 30*day)
	// c: the relay sent its first effect; the second is still pending.
	f.relay(due, func(e outboxdriver.Effect) error {
		if e.Seq == 0 {
			return nil
		}
		return errBlocked
	})
	f.commit(d, true, nil)
	for _, s := range []outboxdriver.Source{a, b, c} {
		f.age("processed", "processed_at", s, 30*day)
	}
	f.age("processed", "dispatched_at", a, 8*day)
	f.age("processed", "dispatched_at", b, 1*day)
	f.age("processed", "dispatched_at", c, 8*day)
	f.age("effects", "dispatched_at", a, 2*time.Hour)
	f.age("effects", "dispatched_at", b, 30*time.Minute)
	f.age("effects", "dispatched_at", c, 2*time.Hour)
	x, y := f.src("x-old-failure"), f.src("y-new-failure")
	f.attempt(x, "boom")
	f.attempt(y, "boom")
	f.age("attempts", "first_failed_at", x, 8*day)
	f.age("attempts", "last_failed_at", x, 8*day)

	p := outboxdriver.CleanupParams{Retention: 7 * day, EffectRetention: time.Hour, BatchSize: 100}
	// A store that counts for a dry run counts what the cleanup then deletes.
	if c, ok := f.st.(interface {
		CleanupCount(context.Context, outboxdriver.CleanupParams) (outboxdriver.CleanupResult, error)
	}); ok {
		dry, err := c.CleanupCount(f.ctx, p)
		if err != nil {
			f.t.Fatalf("CleanupCount: %v", err)
		}
		if want := (outboxdriver.CleanupResult{Claims: 1, Effects: 3, Attempts: 1}); dry != want {
			f.t.Fatalf("dry run: %+v, want %+v", dry, want)
		}
	}
	res := f.cleanup(p)
	// One batch per table: three, and one more for each of idempotency keys and dead letters
	// that a store keeps.
	if want := (outboxdriver.CleanupResult{Batches: res.Batches, Claims: 1, Effects: 3, Attempts: 1}); res != want || res.Batches < 3 || res.Batches > 5 {
		f.t.Fatalf("cleanup: %+v, want %+v in 3 to 5 batches", res, want)
	}
	if f.processed(a) || !f.processed(b) || !f.processed(c) || !f.processed(d) {
		f.t.Fatalf("processed after cleanup: a=%v b=%v c=%v d=%v, want only a gone",
			f.processed(a), f.processed(b), f.processed(c), f.processed(d))
	}
	if pe := f.pending(c); len(pe) != 1 || pe[0].Seq != 1 {
		f.t.Fatalf("the pending effect was not kept: %v", pe)
	}
	if n := f.h.CountEffects(f.t); n != 3 {
		f.t.Fatalf("effects left: %d, want b's two and c's pending one", n)
	}
	if got := f.attempt(x, "again"); got != 1 {
		f.t.Fatalf("the old attempt counter was not deleted: next attempt counted %d", got)
	}
	if got := f.attempt(y, "again"); got != 2 {
		f.t.Fatalf("the recent attempt counter was deleted: next attempt counted %d", got)
	}
	if res := f.cleanup(p); res != (outboxdriver.CleanupResult{Batches: res.Batches}) || res.Batches < 3 || res.Batches > 5 {
		f.t.Fatalf("second cleanup: %+v, want nothing deleted in one batch per table", res)
	}
}

// testCleanupEveryStepHasItsTurn: runs cut short in a long first step (a backlog of claims, a
// deadline) each begin one step further, so that the attempt counters, after the claims, are
// cleaned too. Every run began with the claims, and the rest waited for the backlog to end.
func testCleanupEveryStepHasItsTurn(f *fixture) {
	tx := f.begin()
	for i := range 30 {
		f.claim(tx, f.src(fmt.Sprintf("backlog %02d", i)))
	}
	if err := tx.Commit(); err != nil {
		f.t.Fatal(err)
	}
	f.age("processed", "processed_at", outboxdriver.Source{}, 30*24*time.Hour)
	f.age("processed", "dispatched_at", outboxdriver.Source{}, 30*24*time.Hour)
	failing := f.src("failed long ago")
	f.attempt(failing, "boom")
	f.age("attempts", "first_failed_at", failing, 30*24*time.Hour)
	f.age("attempts", "last_failed_at", failing, 30*24*time.Hour)
	for run := range 6 {
		ctx, cancel := context.WithCancel(f.ctx)
		batches := 0
		_, err := f.st.Cleanup(ctx, outboxdriver.CleanupParams{Retention: 7 * 24 * time.Hour, EffectRetention: time.Hour, BatchSize: 1,
			Progress: func(outboxdriver.CleanupResult) {
				if batches++; batches == 2 {
					cancel() // the run's deadline, two batches in
				}
			}})
		cancel()
		if err != nil && !errors.Is(err, context.Canceled) {
			f.t.Fatalf("Cleanup run %d: %v", run, err)
		}
	}
	if n := f.count("attempts"); n != 0 {
		f.t.Fatalf("%d attempt counters left after six runs cut short among 30 expired claims, want the expired one deleted", n)
	}
}

func testCleanupBatches(f *fixture) {
	const n = 25
	tx := f.begin()
	for i := 0; i < n; i++ {
		f.claim(tx, f.src(fmt.Sprintf("m%02d", i)))
	}
	if err := tx.Commit(); err != nil {
		f.t.Fatal(err)
	}
	f.age("processed", "processed_at", outboxdriver.Source{}, 30*24*time.Hour)
	f.age("processed", "dispatched_at", outboxdriver.Source{}, 30*24*time.Hour)
	p := outboxdriver.CleanupParams{Retention: 7 * 24 * time.Hour, EffectRetention: time.Hour, BatchSize: 10, PauseBetweenBatches: time.Hour}

	// Each batch commits on its own: cancelled during the pause after the first batch, Cleanup
	// reports the ten it deleted.
	type result struct {
		res outboxdriver.CleanupResult
		err error
	}
	oneBatch := func(p outboxdriver.CleanupParams, left int) {
		ctx, cancel := context.WithCancel(f.ctx)
		defer cancel()
		done := make(chan result, 1)
		go func() {
			res, err := f.st.Cleanup(ctx, p)
			done <- result{res, err}
		}()
		f.waitUntil("one batch", func() bool { return f.count("processed") == left })
		cancel()
		r := receive(f, "Cleanup to return after its context was cancelled", done)
		if !errors.Is(r.err, context.Canceled) || r.res.Claims != 10 {
			f.t.Fatalf("cancelled after one batch: %+v, %v; want 10 claims and context.Canceled", r.res, r.err)
		}
	}
	oneBatch(p, n-10)
	// A pause in proportion to the batch: a billion times a batch's duration is a pause of seconds
	// at the least, so the second batch waits for it as for a fixed pause.
	p.PauseBetweenBatches, p.PauseFactor = 0, 1e9
	oneBatch(p, n-20)
	p.PauseFactor = 0
	if res := f.cleanup(p); res.Claims != n-20 {
		f.t.Fatalf("cleanup of the rest: %+v, want %d claims", res, n-20)
	}
	if left := f.count("processed"); left != 0 {
		f.t.Fatalf("%d claims left", left)
	}
}

func testCleanupLocked(f *fixture) {
	src := f.src("m1")
	f.commit(src, true, nil)
	f.age("processed", "processed_at", src, 30*24*time.Hour)
	f.age("processed", "dispatched_at", src, 30*24*time.Hour)
	p := outboxdriver.CleanupParams{Retention: 7 * 24 * time.Hour, EffectRetention: time.Hour, BatchSize: 10}
	release := f.h.HoldCleanupLock(f.t)
	released := false
	defer func() {
		if !released {
			release()
		}
	}()
	if f.h.Capabilities.CleanupSkips {
		res := f.cleanup(p)
		if !res.Skipped || res.Claims+res.Effects+res.Attempts != 0 {
			f.t.Fatalf("cleanup while another process cleans: %+v, want skipped", res)
		}
		release()
		released = true
		if res := f.cleanup(p); res.Skipped || res.Claims != 1 {
			f.t.Fatalf("cleanup after the other process finished: %+v", res)
		}
		return
	}
	type result struct {
		res outboxdriver.CleanupResult
		err error
	}
	done := make(chan result, 1)
	go func() {
		res, err := f.st.Cleanup(f.ctx, p)
		done <- result{res, err}
	}()
	f.waitUntil("cleanup to wait for the other process", func() bool { return f.h.Blocked(f.t) })
	select {
	case r := <-done:
		f.t.Fatalf("cleanup returned %+v, %v while another process held the database", r.res, r.err)
	default:
	}
	release()
	released = true
	r := receive(f, "cleanup after the other process finished", done)
	if r.err != nil || r.res.Skipped || r.res.Claims != 1 {
		f.t.Fatalf("cleanup after waiting: %+v, %v; want 1 claim, not skipped", r.res, r.err)
	}
}

// testCleanupAttemptCounted: a cleanup that finds a message's failed attempts old while a new
// failure is being counted (its row updated, uncommitted) waits for it, and then leaves the count:
// a cleanup that judged the row by what it first saw would reset the count, and the message would
// get MaxAttempts more attempts before it is poisoned.
func testCleanupAttemptCounted(f *fixture) {
	if !f.h.Capabilities.RowLocks {
		return // one writer at a time: a cleanup cannot run while the count is held
	}
	src := f.src("m1")
	f.attempt(src, "boom")
	f.attempt(src, "boom")
	f.age("attempts", "first_failed_at", src, 8*24*time.Hour)
	f.age("attempts", "last_failed_at", src, 8*24*time.Hour)
	// The suite's SQL has no parameters: the counting statement of every dialect, in a
	// transaction held open, with the source inlined.
	consumer, id := KeyColumns("attempts")
	tx := f.begin()
	defer func() { _ = tx.Rollback() }()
	if _, err := tx.ExecContext(f.ctx, `UPDATE `+f.h.Table("attempts")+` SET attempts = attempts + 1, last_failed_at = CURRENT_TIMESTAMP
		WHERE `+consumer+` = '`+src.Consumer+`' AND `+id+` = '`+src.ID+`'`); err != nil {
		f.t.Fatalf("count an attempt: %v", err)
	}
	type result struct {
		res outboxdriver.CleanupResult
		err error
	}
	done := make(chan result, 1)
	go func() {
		res, err := f.st.Cleanup(f.ctx, outboxdriver.CleanupParams{Retention: 7 * 24 * time.Hour, EffectRetention: time.Hour, BatchSize: 10})
		done <- result{res, err}
	}()
	f.waitUntil("cleanup to wait for the counted attempt", func() bool { return f.h.Blocked(f.t) })
	if err := tx.Commit(); err != nil {
		f.t.Fatalf("commit the count: %v", err)
	}
	r := receive(f, "cleanup after the count committed", done)
	if r.err != nil || r.res.Attempts != 0 {
		f.t.Fatalf("cleanup while an attempt was counted: %+v, %v; want no count deleted", r.res, r.err)
	}
	if got := f.attempt(src, "boom"); got != 4 {
		f.t.Fatalf("the attempt after the cleanup counted as %d, want 4", got)
	}
}

func testClaimAge(f *fixture) {
	src := f.src("m1")
	f.commit(src, true, nil)
	f.age("processed", "processed_at", src, time.Hour)
	tx := f.begin()
	defer func() { _ = tx.Rollback() }()
	c, err := f.st.MessageClaim(f.ctx, tx, src)
	if err != nil {
		f.t.Fatal(err)
	}
	if c.Claimed || c.Concurrent || c.Age < time.Hour-time.Minute || c.Age > time.Hour+time.Minute {
		f.t.Fatalf("claim of a message processed an hour ago: %+v, want a duplicate with Age about 1h", c)
	}
}

// testClaimSettled: a duplicate's claim is settled when nothing of the claim it ran into is
// pending (no effects, or all marked dispatched), and not while an effect is pending or parked.
func testClaimSettled(f *fixture) {
	settled := func(src outboxdriver.Source) bool {
		f.t.Helper()
		tx := f.begin()
		defer func() { _ = tx.Rollback() }()
		c, err := f.st.MessageClaim(f.ctx, tx, src)
		if err != nil || c.Claimed || c.Concurrent {
			f.t.Fatalf("claim of a processed message: %+v, %v; want a duplicate", c, err)
		}
		if c.Settled && !f.h.Capabilities.ClaimReportsSettled {
			f.t.Fatalf("claim %+v: Settled, and the store does not claim to tell", c)
		}
		return c.Settled
	}
	want := f.h.Capabilities.ClaimReportsSettled
	none := f.src("none")
	f.commit(none, true, nil)
	if got := settled(none); got != want {
		f.t.Errorf("a duplicate of a message that recorded no effect: Settled = %v, want %v", got, want)
	}
	sent := f.src("sent")
	f.commit(sent, true, f.effects(sent, "", 2))
	if settled(sent) {
		f.t.Error("a duplicate of a message whose effects are pending: Settled")
	}
	f.mark(sent)
	if got := settled(sent); got != want {
		f.t.Errorf("a duplicate of a message whose effects were sent: Settled = %v, want %v", got, want)
	}
	parked := f.src("parked")
	es := f.effects(parked, "", 1)
	f.commit(parked, true, es)
	f.recordFailures(outboxdriver.EffectFailure{StoreID: es[0].StoreID, Reason: "refused", Counted: true, Park: true})
	if settled(parked) {
		f.t.Error("a duplicate of a message whose effect is parked: Settled")
	}
	// What the claim saw counts, not another consumer's claim of the same message.
	other := outboxdriver.Source{Consumer: "other", ID: parked.ID}
	f.commit(other, true, nil)
	if got := settled(other); got != want {
		f.t.Errorf("a duplicate of another consumer's message with nothing pending: Settled = %v, want %v", got, want)
	}
}

func (f *fixture) stats(p outboxdriver.StatsParams) outboxdriver.Stats {
	f.t.Helper()
	s, err := f.st.Stats(f.ctx, p)
	if err != nil {
		f.t.Fatalf("Stats(%+v): %v", p, err)
	}
	return s
}

func testStatsSample(f *fixture) {
	const day = 24 * time.Hour
	if s := f.stats(outboxdriver.StatsParams{Retention: 7 * day}); !reflect.DeepEqual(s, outboxdriver.Stats{SampledAt: s.SampledAt, XminHold: s.XminHold, Tables: s.Tables}) || time.Since(s.SampledAt) > time.Minute {
		f.t.Fatalf("stats of empty tables: %+v, want zeros sampled now", s)
	}
	f.parkThree() // three parked effects, and one pending behind the first (aged two hours)
	fresh := f.src("fresh")
	f.commit(fresh, true, f.effects(fresh, "kf", 2))
	failing, recovered := f.src("failing"), f.src("recovered")
	f.attempt(failing, "boom")
	f.attempt(recovered, "boom")
	f.commit(recovered, true, nil)
	old := f.src("old")
	f.commit(old, true, nil)
	f.age("processed", "processed_at", old, 8*day)
	f.age("processed", "dispatched_at", old, 8*day)

	s := f.stats(outboxdriver.StatsParams{Retention: 7 * day})
	if s.Pending != 3 || s.Parked != 3 || s.Failing != 1 || s.Retained != 6 || s.Estimated {
		f.t.Fatalf("stats: %+v, want 3 pending, 3 parked, 1 failing, 6 retained, nothing estimated", s)
	}
	near := func(got, want time.Duration) bool { return got > want-time.Minute && got < want+time.Minute }
	if !near(s.OldestPending, 2*time.Hour) || !near(s.OldestParked, 2*time.Hour) || !near(s.CleanupLag, day) {
		f.t.Fatalf("stats: %+v, want the oldest pending and parked 2h old and a cleanup lag of 1 day", s)
	}
}

func testStatsShared(f *fixture) {
	p := outboxdriver.StatsParams{Interval: time.Hour, Retention: time.Hour}
	first := f.stats(p)
	if first.SampledAt.IsZero() || first.Pending != 0 {
		f.t.Fatalf("first sample: %+v, want one taken now", first)
	}
	src := f.src("m1")
	f.commit(src, true, f.effects(src, "k", 2))
	// Within the interval every caller gets the stored sample; none samples again.
	if again := f.stats(p); again.Pending != 0 || again.SampledAt.After(first.SampledAt.Add(time.Minute)) {
		f.t.Fatalf("sample within the interval: %+v, want the stored one (%+v)", again, first)
	}
	if now := f.stats(outboxdriver.StatsParams{Retention: time.Hour}); now.Pending != 2 {
		f.t.Fatalf("a sample taken now: %+v, want 2 pending", now)
	}
	time.Sleep(20 * time.Millisecond)
	if next := f.stats(outboxdriver.StatsParams{Interval: 10 * time.Millisecond, Retention: time.Hour}); next.Pending != 2 {
		f.t.Fatalf("sample after the interval: %+v, want a new one with 2 pending", next)
	}
	// The database's clock stepped back an hour (a failover to a server whose clock is
	// behind): the lease and the sample lie in the future. Nobody sampled until the clock caught
	// up, and the stored sample looked fresh all the while.
	f.age("stats", "leased_at", outboxdriver.Source{}, -time.Hour)
	f.age("stats", "sampled_at", outboxdriver.Source{}, -time.Hour)
	f.commit(f.src("m2"), true, f.effects(f.src("m2"), "k2", 1))
	if next := f.stats(outboxdriver.StatsParams{Interval: time.Second, Retention: time.Hour}); next.Pending != 3 {
		f.t.Fatalf("sample after the clock stepped back: %+v, want a new one with 3 pending", next)
	}
}

// Instances sampling at the same moment all succeed, and whatever sample they report is the same.
func testStatsConcurrent(f *fixture) {
	src := f.src("m1")
	f.commit(src, true, f.effects(src, "k", 3))
	const n = 8
	got := make([]outboxdriver.Stats, n)
	errs := make([]error, n)
	var wg sync.WaitGroup
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			got[i], errs[i] = f.st.Stats(f.ctx, outboxdriver.StatsParams{Interval: time.Hour, Retention: time.Hour})
		}()
	}
	wg.Wait()
	taken := 0
	for i := range n {
		if errs[i] != nil {
			f.t.Fatalf("concurrent Stats %d: %v", i, errs[i])
		}
		if got[i].SampledAt.IsZero() {
			continue // lost the lease before the winner stored its sample
		}
		taken++
		if got[i].Pending != 3 {
			f.t.Errorf("concurrent Stats %d: %+v, want 3 pending", i, got[i])
		}
	}
	if taken == 0 {
		f.t.Fatal("no concurrent caller got a sample")
	}
}

// testDelayed: delayed effects (a DelayedStore) are stored in the transaction (nothing if it
// rolls back), are neither pending nor claimed before their due time, and are moved, once due,
// into pending effects the relay claims at once (no grace), with everything they were recorded
// with, behind what is pending with their key; a cancel counts what it deleted, only if it
// commits; Stats counts the delayed ones apart.
func testDelayed(f *fixture) {
	ds, ok := f.st.(outboxdriver.DelayedStore)
	if !ok {
		f.t.Skip("the store keeps no delayed effects")
	}
	src := f.src("delayed")
	insert := func(effects []outboxdriver.Effect, commit bool) {
		f.t.Helper()
		tx := f.begin()
		defer func() { _ = tx.Rollback() }()
		if err := ds.DelayedInsert(f.ctx, tx, src, effects); err != nil {
			f.t.Fatalf("DelayedInsert: %v", err)
		}
		if commit {
			if err := tx.Commit(); err != nil {
				f.t.Fatalf("commit: %v", err)
			}
		}
	}
	promote := func() (int, time.Duration, bool) {
		f.t.Helper()
		n, next, waiting, err := ds.DelayedPromote(f.ctx, 100)
		if err != nil {
			f.t.Fatalf("DelayedPromote: %v", err)
		}
		return n, next, waiting
	}
	cancel := func(key string, commit bool) int {
		f.t.Helper()
		tx := f.begin()
		defer func() { _ = tx.Rollback() }()
		n, err := ds.DelayedCancel(f.ctx, tx, key)
		if err != nil {
			f.t.Fatalf("DelayedCancel(%q): %v", key, err)
		}
		if commit {
			if err := tx.Commit(); err != nil {
				f.t.Fatalf("commit: %v", err)
			}
		}
		return n
	}
	probe := f.begin()
	err := ds.DelayedInsert(f.ctx, probe, f.src("probe"), f.effects(f.src("probe"), "k", 1))
	_ = probe.Rollback()
	if errors.Is(err, outboxdriver.ErrDelayedUnsupported) {
		f.t.Skip("the store keeps no delayed effects")
	}
	es := f.effects(src, "k", 3)
	now := time.Now()
	// The steps up to the first promote must end before the second falls due: 400 ms did not
	// always suffice on a loaded machine (2 cores, 20 runnable processes).
	const soon = 2 * time.Second
	es[0].DueAt = now.Add(-time.Second) // due at once
	es[1].DueAt, es[1].CancelKey = now.Add(soon), "soon"
	es[2].DueAt, es[2].CancelKey = now.Add(time.Hour), "later"
	insert(f.effects(f.src("rolled-back"), "k", 1), false)
	// An effect of key k pending in rows: the delayed ones go behind it, however early recorded.
	before := f.effects(f.src("before"), "k", 1)
	f.commit(before[0].Source, false, before)
	insert(es, true)

	if got := f.pending(src); len(got) != 0 {
		f.t.Fatalf("delayed effects listed as pending: %v", uuids(got))
	}
	if s, err := f.st.Stats(f.ctx, outboxdriver.StatsParams{}); err != nil || s.Delayed != 2 || s.Pending != 2 {
		f.t.Fatalf("Stats = %+v, %v; want 2 delayed not due, 2 pending (1 effect row, 1 delayed past due)", s, err)
	}
	params := outboxdriver.EffectClaimParams{Grace: time.Hour, Limit: 10, Lease: time.Minute}
	if n, next, waiting := promote(); n != 1 || !waiting || next <= 0 || next > soon {
		f.t.Fatalf("DelayedPromote = %d moved, next in %s (%v); want 1 moved (the one due), the next within %s", n, next, waiting, soon)
	}
	if got := f.claimDue(f.st, params); len(got) != 0 {
		f.t.Fatalf("claimed %v while the effect pending with its key before its due time (in its grace period) is not sent", uuids(got))
	}
	f.mark(before[0].Source)
	wantUUIDs(f.t, "claimed once the first is due and what was before it on its key sent (grace 1 h: only what was moved)", f.claimDue(f.st, params), es[0])
	if n := cancel("soon", false); n != 1 {
		f.t.Fatalf("cancel that rolls back: %d, want 1 counted", n)
	}
	time.Sleep(time.Until(es[1].DueAt) + 50*time.Millisecond)
	if n, _, _ := promote(); n != 1 {
		f.t.Fatalf("DelayedPromote after the second's due time: %d moved, want 1 (its cancel rolled back)", n)
	}
	if n := cancel("soon", true); n != 0 {
		f.t.Fatalf("cancel after the move: %d, want 0 (on its way)", n)
	}
	got := f.pending(src)
	if len(got) != 2 {
		f.t.Fatalf("pending after the moves: %v, want the two moved", uuids(got))
	}
	sameEffect(f.t, got[1], es[1])
	if got[1].StoreID <= before[0].StoreID {
		f.t.Errorf("moved effect %d is before the effect %d pending with its key when it was due", got[1].StoreID, before[0].StoreID)
	}
	if n := cancel("later", true); n != 1 {
		f.t.Fatalf("cancel before the due time: %d, want 1", n)
	}
	if n, _, waiting := promote(); n != 0 || waiting {
		f.t.Fatalf("DelayedPromote with nothing left: %d moved, waiting %v", n, waiting)
	}
	if s, err := f.st.Stats(f.ctx, outboxdriver.StatsParams{}); err != nil || s.Delayed != 0 {
		f.t.Fatalf("Stats = %+v, %v; want none delayed", s, err)
	}
}

// testDelayedDueNotOvertaken: an effect inserted with an ordering key once a delayed effect of
// another source with that key is due, and before any relay moved it, goes behind it: the
// insert moves the due one ahead of it (handed over, claimed at once), so that EffectKeyBlocked
// holds the new effect back and the relay's claim sends the delayed one first. A delayed effect
// of the key that is not due stays delayed, as does a due one of the inserting source (its unit's
// own order is its record order), and an insert that rolls back leaves the due one delayed.
// testDelayedDueAfterTheClaimNotOvertaken: a delayed effect of another source, due, committed
// after a unit's claim and before the unit records an effect of its key, is moved ahead of that
// effect. On a database whose transactions read one snapshot (MySQL's REPEATABLE READ, its
// default, takes it at the claim's read), a plain read did not see it: the effect took the id
// before it, and was sent first.
func testDelayedDueAfterTheClaimNotOvertaken(f *fixture) {
	ds, ok := f.st.(outboxdriver.DelayedStore)
	if !ok {
		f.t.Skip("the store keeps no delayed effects")
	}
	if !f.h.Capabilities.RowLocks {
		f.t.Skip("one writer at a time: no delayed effect commits while a unit holds its claim")
	}
	ci, _ := f.st.(outboxdriver.ClaimedEffectInserter)
	for _, c := range []struct {
		name    string
		n       int
		claimed bool
	}{{"one", 1, false}, {"three", 3, false}, {"one claimed", 1, true}, {"three claimed", 3, true}} {
		if c.claimed && ci == nil {
			continue
		}
		key := "late " + c.name
		src := f.src("claimed-first " + c.name)
		tx := f.begin()
		if !f.claim(tx, src) {
			_ = tx.Rollback()
			f.t.Fatalf("%s: the claim of a new message: want it claimed", c.name)
		}
		timeout := f.src("timeout " + c.name)
		due := f.effects(timeout, key, 1)
		due[0].DueAt = time.Now().Add(-time.Second)
		dtx := f.begin()
		err := ds.DelayedInsert(f.ctx, dtx, timeout, due)
		if errors.Is(err, outboxdriver.ErrDelayedUnsupported) {
			_ = dtx.Rollback()
			_ = tx.Rollback()
			f.t.Skip("the store keeps no delayed effects")
		}
		if err != nil {
			f.t.Fatalf("DelayedInsert: %v", err)
		}
		if err := dtx.Commit(); err != nil {
			f.t.Fatalf("commit the delayed effect: %v", err)
		}
		own := f.effects(src, key, c.n)
		if c.n > 1 {
			own[1].OrderingKey = "another key " + c.name
		}
		insert := f.st.EffectInsert
		if c.claimed {
			insert = ci.EffectInsertClaimed
		}
		if _, err := insert(f.ctx, tx, src, own); err != nil {
			_ = tx.Rollback()
			f.t.Fatalf("%s: EffectInsert: %v", c.name, err)
		}
		if err := tx.Commit(); err != nil {
			f.t.Fatalf("%s: commit: %v", c.name, err)
		}
		moved := f.pending(timeout)
		if len(moved) != 1 || moved[0].StoreID >= own[0].StoreID {
			f.t.Errorf("%s: the due delayed effect: moved %+v, want it moved before the effect recorded after it fell due (%d)", c.name, moved, own[0].StoreID)
		}
		if got := f.pending(src); len(got) != c.n {
			f.t.Errorf("%s: %d effects stored, want %d", c.name, len(got), c.n)
		}
	}
}

// testDelayedMoveStopsAtAHeldOne: a move that skips a due delayed effect another transaction
// holds (a cancel that may yet roll back) moves none of that key's later ones: moved past it,
// they took ids before it and were sent first once the cancel rolled back.
func testDelayedMoveStopsAtAHeldOne(f *fixture) {
	ds, ok := f.st.(outboxdriver.DelayedStore)
	if !ok {
		f.t.Skip("the store keeps no delayed effects")
	}
	if !f.h.Capabilities.RowLocks {
		f.t.Skip("one writer at a time: no move runs while a cancel is under way")
	}
	first, second, other := f.src("held first"), f.src("held second"), f.src("held other key")
	e1, e2, e3 := f.effects(first, "held key", 1), f.effects(second, "held key", 1), f.effects(other, "free key", 1)
	e1[0].DueAt, e1[0].CancelKey = time.Now().Add(-2*time.Second), "held cancel"
	e2[0].DueAt = time.Now().Add(-time.Second)
	e3[0].DueAt = time.Now().Add(-time.Second)
	for _, d := range []struct {
		src outboxdriver.Source
		es  []outboxdriver.Effect
	}{{first, e1}, {second, e2}, {other, e3}} {
		tx := f.begin()
		err := ds.DelayedInsert(f.ctx, tx, d.src, d.es)
		if errors.Is(err, outboxdriver.ErrDelayedUnsupported) {
			_ = tx.Rollback()
			f.t.Skip("the store keeps no delayed effects")
		}
		if err != nil {
			f.t.Fatalf("DelayedInsert: %v", err)
		}
		if err := tx.Commit(); err != nil {
			f.t.Fatal(err)
		}
	}
	cancel := f.begin()
	defer func() { _ = cancel.Rollback() }()
	if n, err := ds.DelayedCancel(f.ctx, cancel, "held cancel"); err != nil || n != 1 {
		f.t.Fatalf("DelayedCancel = %d, %v; want 1", n, err)
	}
	moved, _, _, err := ds.DelayedPromote(f.ctx, 100)
	if err != nil {
		f.t.Fatalf("DelayedPromote: %v", err)
	}
	if moved != 1 || len(f.pending(second)) != 0 || len(f.pending(other)) != 1 {
		f.t.Fatalf("a move beside a held delayed effect moved %d (the later one of its key: %d), want 1: the other key's only", moved, len(f.pending(second)))
	}
	_ = cancel.Rollback() // the cancel does not happen: both are due, in their order
	if _, _, _, err := ds.DelayedPromote(f.ctx, 100); err != nil {
		f.t.Fatalf("DelayedPromote: %v", err)
	}
	p1, p2 := f.pending(first), f.pending(second)
	if len(p1) != 1 || len(p2) != 1 || p1[0].StoreID >= p2[0].StoreID {
		f.t.Fatalf("after the cancel rolled back: %+v then %+v, want both, the first due first", p1, p2)
	}
}

func testDelayedDueNotOvertaken(f *fixture) {
	ds, ok := f.st.(outboxdriver.DelayedStore)
	if !ok {
		f.t.Skip("the store keeps no delayed effects")
	}
	delay := func(src outboxdriver.Source, es []outboxdriver.Effect) {
		f.t.Helper()
		tx := f.begin()
		defer func() { _ = tx.Rollback() }()
		err := ds.DelayedInsert(f.ctx, tx, src, es)
		if errors.Is(err, outboxdriver.ErrDelayedUnsupported) {
			f.t.Skip("the store keeps no delayed effects")
		}
		if err != nil {
			f.t.Fatalf("DelayedInsert: %v", err)
		}
		if err := tx.Commit(); err != nil {
			f.t.Fatalf("commit: %v", err)
		}
	}
	now := time.Now()
	timeout := f.src("timeout")
	due := f.effects(timeout, "order", 2)
	due[0].DueAt = now.Add(-time.Second)
	due[1].DueAt = now.Add(-time.Second)
	delay(timeout, due)
	reminder := f.src("reminder")
	later := f.effects(reminder, "order", 1)
	later[0].DueAt = now.Add(time.Hour)
	delay(reminder, later)
	shipped := f.src("shipped")
	own := f.effects(shipped, "order", 2)
	own[0].DueAt = now.Add(-time.Second)
	delay(shipped, own[:1])

	// Rolled back: the due ones stay delayed.
	tx := f.begin()
	if _, err := f.st.EffectInsert(f.ctx, tx, f.src("rolled-back"), f.effects(f.src("rolled-back"), "order", 1)); err != nil {
		f.t.Fatalf("EffectInsert: %v", err)
	}
	_ = tx.Rollback()
	if n := f.count("delayed"); n != 4 {
		f.t.Fatalf("%d delayed effects after an insert that rolled back, want 4", n)
	}

	f.commit(shipped, false, own[1:])
	if n := f.count("delayed"); n != 2 {
		f.t.Fatalf("%d delayed effects after the insert, want 2 (the one not due, the inserting source's own)", n)
	}
	if !f.keyBlocked(shipped, "order") {
		f.t.Fatal("EffectKeyBlocked: the effect inserted after the due delayed ones must wait behind them")
	}
	moved := f.pending(timeout)
	if len(moved) != 2 || moved[0].StoreID >= own[1].StoreID || moved[1].StoreID >= own[1].StoreID || moved[0].StoreID >= moved[1].StoreID {
		f.t.Fatalf("moved %v (%+v), want both, in their order, before the inserted effect %d", uuids(moved), moved, own[1].StoreID)
	}
	sameEffect(f.t, moved[0], due[0])
	sameEffect(f.t, moved[1], due[1])
	if err := f.st.EffectHandToRelay(f.ctx, shipped); err != nil {
		f.t.Fatalf("EffectHandToRelay: %v", err)
	}
	params := outboxdriver.EffectClaimParams{Grace: time.Hour, Limit: 10, Lease: time.Minute}
	wantUUIDs(f.t, "claimed (grace 1 h: what was moved or handed over), in key order", f.claimDue(f.st, params), due[0], due[1], own[1])
}

// keyTx is a transaction that claims an idempotency key, on a connection of its own when the
// store's key locks belong to the session (outboxdriver.KeySessionLocker), as a unit of work's.
type keyTx struct {
	f     *fixture
	ks    outboxdriver.KeyStore
	tx    *sql.Tx
	conn  *sql.Conn
	scope string
	key   string
}

// keyStore returns the store as a KeyStore, or skips the test when it keeps no keys.
func (f *fixture) keyStore() outboxdriver.KeyStore {
	ks, ok := f.st.(outboxdriver.KeyStore)
	if !ok {
		f.t.Skip("the store keeps no idempotency keys")
	}
	k := f.beginKeyed(ks)
	_, err := k.claim(outboxdriver.KeyClaimParams{Scope: "probe", Key: "probe", Retention: time.Hour})
	k.end(false)
	if errors.Is(err, outboxdriver.ErrKeysUnsupported) {
		f.t.Skip("the store keeps no idempotency keys")
	}
	return ks
}

func (f *fixture) beginKeyed(ks outboxdriver.KeyStore) *keyTx {
	f.t.Helper()
	k := &keyTx{f: f, ks: ks}
	if _, ok := ks.(outboxdriver.KeySessionLocker); ok {
		conn, err := f.h.DB.Conn(f.ctx)
		if err != nil {
			f.t.Fatalf("connect: %v", err)
		}
		k.conn = conn
		if k.tx, err = conn.BeginTx(f.ctx, nil); err != nil {
			f.t.Fatalf("begin: %v", err)
		}
		return k
	}
	k.tx = f.begin()
	return k
}

// claim claims p's key in the transaction (with a bound on a wait for another one).
func (k *keyTx) claim(p outboxdriver.KeyClaimParams) (outboxdriver.KeyClaim, error) {
	k.scope, k.key = p.Scope, p.Key
	ctx, cancel := context.WithTimeout(k.f.ctx, waitLimit)
	defer cancel()
	return k.ks.KeyClaim(ctx, k.tx, p)
}

func (k *keyTx) save(result string) {
	k.f.t.Helper()
	if err := k.ks.KeySave(k.f.ctx, k.tx, k.scope, k.key, []byte(result)); err != nil {
		k.f.t.Fatalf("KeySave(%q): %v", k.key, err)
	}
}

// end commits or rolls the transaction back, then releases a session lock of the key.
func (k *keyTx) end(commit bool) {
	k.f.t.Helper()
	var err error
	if commit {
		err = k.tx.Commit()
	} else {
		_ = k.tx.Rollback()
	}
	if k.conn != nil {
		if k.key != "" {
			if uerr := k.ks.(outboxdriver.KeySessionLocker).KeyUnlock(k.f.ctx, k.conn, k.scope, k.key); uerr != nil {
				k.f.t.Errorf("KeyUnlock(%q): %v", k.key, uerr)
			}
		}
		_ = k.conn.Close()
	}
	if err != nil {
		k.f.t.Fatalf("commit: %v", err)
	}
}

// claimKey claims a key in a transaction of its own and ends it (commit: with result saved when
// claimed).
func (f *fixture) claimKey(ks outboxdriver.KeyStore, p outboxdriver.KeyClaimParams, result string, commit bool) outboxdriver.KeyClaim {
	f.t.Helper()
	k := f.beginKeyed(ks)
	c, err := k.claim(p)
	if err != nil {
		k.end(false)
		f.t.Fatalf("KeyClaim(%q, %q): %v", p.Scope, p.Key, err)
	}
	if c.Claimed && result != "" {
		k.save(result)
	}
	k.end(commit && c.Claimed)
	return c
}

// testKeys: a key claimed and committed with its result is found by the next claim with its
// fingerprint and result, not claimed; scopes keep equal keys apart; a rolled-back claim stores
// nothing; an expired key is claimed again in place; cleanup deletes the expired keys only, and
// its dry run counts them.
func testKeys(f *fixture) {
	ks := f.keyStore()
	p := outboxdriver.KeyClaimParams{Scope: "orders", Key: "k1", Fingerprint: []byte("fp1"), Retention: time.Hour}
	if c := f.claimKey(ks, p, "result 1", true); !c.Claimed {
		f.t.Fatalf("first claim: %+v, want claimed", c)
	}
	other := p
	other.Fingerprint = []byte("fp2")
	if c := f.claimKey(ks, other, "", false); c.Claimed || string(c.Fingerprint) != "fp1" || string(c.Result) != "result 1" {
		f.t.Fatalf("claim of a committed key: %+v, want not claimed, fingerprint fp1, result 1", c)
	}
	scoped := p
	scoped.Scope = "refunds"
	if c := f.claimKey(ks, scoped, "", true); !c.Claimed {
		f.t.Fatalf("the same key in another scope: %+v, want claimed", c)
	}
	rolled := outboxdriver.KeyClaimParams{Scope: "orders", Key: "rolled-back", Retention: time.Hour}
	if c := f.claimKey(ks, rolled, "lost", false); !c.Claimed {
		f.t.Fatalf("first claim: %+v", c)
	}
	if c := f.claimKey(ks, rolled, "", false); !c.Claimed {
		f.t.Fatalf("claim after a rolled-back claim: %+v, want claimed", c)
	}
	var expired []outboxdriver.KeyClaimParams
	for i := range 3 {
		e := outboxdriver.KeyClaimParams{Scope: "orders", Key: fmt.Sprintf("short-%d", i), Fingerprint: []byte("old"), Retention: time.Millisecond}
		f.claimKey(ks, e, "old result", true)
		expired = append(expired, e)
	}
	time.Sleep(50 * time.Millisecond)
	again := expired[0]
	again.Fingerprint, again.Retention = []byte("new"), time.Hour
	if c := f.claimKey(ks, again, "new result", true); !c.Claimed {
		f.t.Fatalf("claim of an expired key: %+v, want claimed (taken over)", c)
	}
	if c := f.claimKey(ks, again, "", false); c.Claimed || string(c.Fingerprint) != "new" || string(c.Result) != "new result" {
		f.t.Fatalf("claim after the take-over: %+v, want the new fingerprint and result", c)
	}
	p2 := outboxdriver.CleanupParams{Retention: 7 * 24 * time.Hour, EffectRetention: time.Hour, BatchSize: 1}
	if c, ok := f.st.(interface {
		CleanupCount(context.Context, outboxdriver.CleanupParams) (outboxdriver.CleanupResult, error)
	}); ok {
		dry, err := c.CleanupCount(f.ctx, p2)
		if err != nil || dry.Keys != 2 {
			f.t.Fatalf("CleanupCount: %+v, %v; want the 2 expired keys counted", dry, err)
		}
	}
	if res := f.cleanup(p2); res.Keys != 2 {
		f.t.Fatalf("cleanup: %+v, want the 2 expired keys deleted (in batches of 1)", res)
	}
	if c := f.claimKey(ks, p, "", false); c.Claimed {
		f.t.Fatal("cleanup deleted a key that has not expired")
	}
	if c := f.claimKey(ks, expired[1], "", false); !c.Claimed {
		f.t.Fatal("an expired key is still there after cleanup")
	}
}

// testKeysCleanupTakeOver: a cleanup that finds a key expired while a retry holds it taken over
// (uncommitted) waits for the retry, and then leaves the key it committed: the retry's claim and
// result are there for the next retry. A cleanup that judged the key by the row it first saw
// would delete the new claim, and the next retry would run the unit once more.
func testKeysCleanupTakeOver(f *fixture) {
	ks := f.keyStore()
	if !f.h.Capabilities.RowLocks {
		return // one writer at a time: a cleanup cannot run while the retry's claim is held
	}
	p := outboxdriver.KeyClaimParams{Scope: "orders", Key: "retaken", Fingerprint: []byte("fp"), Retention: time.Millisecond}
	f.claimKey(ks, p, "first", true)
	time.Sleep(50 * time.Millisecond)
	retry := f.beginKeyed(ks)
	p.Retention = time.Hour
	if c, err := retry.claim(p); err != nil || !c.Claimed {
		retry.end(false)
		f.t.Fatalf("claim of the expired key: %+v, %v; want claimed (taken over)", c, err)
	}
	type result struct {
		res outboxdriver.CleanupResult
		err error
	}
	done := make(chan result, 1)
	go func() {
		res, err := f.st.Cleanup(f.ctx, outboxdriver.CleanupParams{Retention: 7 * 24 * time.Hour, EffectRetention: time.Hour, BatchSize: 10})
		done <- result{res, err}
	}()
	f.waitUntil("cleanup to wait for the retry's claim", func() bool { return f.h.Blocked(f.t) })
	retry.save("second")
	retry.end(true)
	r := receive(f, "cleanup after the retry committed", done)
	if r.err != nil || r.res.Keys != 0 {
		f.t.Fatalf("cleanup while a retry held the expired key: %+v, %v; want no key deleted", r.res, r.err)
	}
	if c := f.claimKey(ks, p, "", false); c.Claimed || string(c.Result) != "second" {
		f.t.Fatalf("claim after the cleanup: %+v; want the retry's key with its result", c)
	}
}

// testKeysInFlight: while a transaction holds an uncommitted claim of a key, a claim without
// Wait is told ErrKeyInFlight at once (a dialect that can tell), and one with Wait waits for the
// outcome: the stored result when it commits, the claim when it rolls back.
func testKeysInFlight(f *fixture) {
	ks := f.keyStore()
	for _, commit := range []bool{true, false} {
		p := outboxdriver.KeyClaimParams{Scope: "orders", Key: fmt.Sprintf("held-%v", commit), Fingerprint: []byte("fp"), Retention: time.Hour}
		holder := f.beginKeyed(ks)
		if c, err := holder.claim(p); err != nil || !c.Claimed {
			f.t.Fatalf("first claim: %+v, %v", c, err)
		}
		if f.h.Capabilities.KeyInFlight {
			began := time.Now()
			k := f.beginKeyed(ks)
			_, err := k.claim(p)
			k.end(false)
			if !errors.Is(err, outboxdriver.ErrKeyInFlight) || time.Since(began) > 5*time.Second {
				f.t.Fatalf("claim without Wait of a key held uncommitted: %v after %s, want ErrKeyInFlight at once", err, time.Since(began))
			}
		}
		type outcome struct {
			c   outboxdriver.KeyClaim
			err error
		}
		done := make(chan outcome, 1)
		go func() {
			k := f.beginKeyed(ks)
			wp := p
			wp.Wait = true
			c, err := k.claim(wp)
			if err == nil && c.Claimed {
				k.save("second")
			}
			k.end(err == nil && c.Claimed)
			done <- outcome{c, err}
		}()
		select {
		case o := <-done:
			f.t.Fatalf("a waiting claim returned while the key was held: %+v, %v", o.c, o.err)
		case <-time.After(300 * time.Millisecond):
		}
		holder.save("first")
		holder.end(commit)
		o := receive(f, "the waiting claim", done)
		switch {
		case o.err != nil:
			f.t.Fatalf("waiting claim: %v", o.err)
		case commit && (o.c.Claimed || string(o.c.Result) != "first"):
			f.t.Fatalf("waiting claim after the holder committed: %+v, want its result", o.c)
		case !commit && !o.c.Claimed:
			f.t.Fatalf("waiting claim after the holder rolled back: %+v, want claimed", o.c)
		}
	}
}

// testKeysConcurrent: 24 transactions claim one key at once, waiting for each other: exactly one
// claims it, and each of the others finds its result.
func testKeysConcurrent(f *fixture) {
	ks := f.keyStore()
	const n = 24
	p := outboxdriver.KeyClaimParams{Scope: "orders", Key: "contended", Fingerprint: []byte("fp"), Retention: time.Hour, Wait: true}
	var mu sync.Mutex
	claimed, replayed := 0, 0
	var errs []error
	var wg sync.WaitGroup
	start := make(chan struct{})
	for range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			<-start
			k := f.beginKeyed(ks)
			c, err := k.claim(p)
			if err == nil && c.Claimed {
				time.Sleep(100 * time.Millisecond) // the others arrive while it runs
				k.save("the result")
			}
			k.end(err == nil && c.Claimed)
			mu.Lock()
			defer mu.Unlock()
			switch {
			case err != nil:
				errs = append(errs, err)
			case c.Claimed:
				claimed++
			case string(c.Result) == "the result":
				replayed++
			default:
				errs = append(errs, fmt.Errorf("found the key with result %q", c.Result))
			}
		}()
	}
	close(start)
	wg.Wait()
	if claimed != 1 || replayed != n-1 || len(errs) > 0 {
		f.t.Fatalf("%d concurrent claims: %d claimed, %d found the result, errors %v; want 1, %d, none", n, claimed, replayed, errs, n-1)
	}
}
