package tenant_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/watermill-outbox/outbox"
	"github.com/watermill-outbox/outbox/drivers/postgres"
	"github.com/watermill-outbox/outbox/internal/pgtest"
	"github.com/watermill-outbox/outbox/internal/silent"
	"github.com/watermill-outbox/outbox/middleware"
	"github.com/watermill-outbox/outbox/tenant"
)

// relayRuns tells whether ob's Health reports its relay running.
func relayRuns(ob *outbox.Outbox) bool {
	for _, ck := range ob.Health(context.Background()).Checks {
		if ck.Name == outbox.CheckRelay {
			return ck.OK
		}
	}
	return false
}

// stalledMember returns an Outbox (tables prefixed name_) on a pool of its own to srv, a server
// that accepts connections and never answers: its background work holds its stop for its
// ShutdownTimeout (2 s).
func stalledMember(t *testing.T, srv *silent.Server, name string, w *wire) *outbox.Outbox {
	t.Helper()
	db, err := sql.Open("postgres", srv.DSN())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = db.Close() })
	ob, err := outbox.New(outbox.Config{DB: db, Driver: postgres.Driver{}, Publisher: w, TablePrefix: name + "_",
		ShutdownTimeout: 2 * time.Second, StatsInterval: -1})
	if err != nil {
		t.Fatal(err)
	}
	return ob
}

// waitRun waits up to 20 s for a Run to return.
func waitRun(t *testing.T, done <-chan error, what string) error {
	t.Helper()
	select {
	case err := <-done:
		return err
	case <-time.After(20 * time.Second):
		t.Fatalf("%s did not return within 20 s", what)
		return nil
	}
}

// A supervisor that runs the Set again as soon as it cancelled it gets a second Run that starts
// once the first returned, and runs every member's background work until its own ctx ends. The
// first Run is held in its shutdown by a member whose database does not answer (its
// ShutdownTimeout, 2 s). Before, the second Run started its members while the first was still
// stopping them: the first then stopped the second's background work of the members it had not
// stopped yet, lost its own, and waited for ever.
func TestSetRunAgainWhileTheLastStops(t *testing.T) {
	srv, err := silent.Start()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = srv.Close() })
	w := newWire()
	a := newMember(t, pgtest.DB(t), "", w)
	set := newSet(t, tenant.Config{Unresolved: "unrouted"}, map[string]*outbox.Outbox{
		"unrouted": newMember(t, pgtest.DB(t), "", w), "a": a, "stalled": stalledMember(t, srv, "stalled", w)})

	ctx1, cancel1 := context.WithCancel(context.Background())
	defer cancel1()
	done1 := make(chan error, 1)
	go func() { done1 <- set.Run(ctx1) }()
	if !srv.WaitConns(1, 30*time.Second) {
		t.Fatal("the stalled member's background work never connected")
	}
	eventually(t, "a's relay runs", func() bool { return relayRuns(a) })
	cancel1()
	time.Sleep(300 * time.Millisecond) // the first Run is in its shutdown, held by the stalled member
	// A Run that waits for the last one's shutdown ends with its own ctx.
	short, cancelShort := context.WithTimeout(context.Background(), 200*time.Millisecond)
	defer cancelShort()
	if err := set.Run(short); !errors.Is(err, context.DeadlineExceeded) || !strings.Contains(err.Error(), "last Run") {
		t.Errorf("a Run whose ctx ends while the last one stops = %v, want its ctx's error naming the wait", err)
	}

	ctx2, cancel2 := context.WithCancel(context.Background())
	defer cancel2()
	done2 := make(chan error, 1)
	go func() { done2 <- set.Run(ctx2) }()
	if err := waitRun(t, done1, "the first Run, a second one called during its shutdown,"); err == nil || !strings.Contains(err.Error(), `member "stalled"`) {
		t.Errorf("the first Run = %v, want the error of the stalled member's stop", err)
	}
	eventually(t, "a's relay runs under the second Run", func() bool { return relayRuns(a) })
	select {
	case err := <-done2:
		t.Fatalf("the second Run returned before its context ended: %v", err)
	case <-time.After(300 * time.Millisecond):
	}
	if !relayRuns(a) {
		t.Error("a's relay stopped while the second Run runs")
	}
	if err := set.Run(ctx2); err == nil || !strings.Contains(err.Error(), "runs already") {
		t.Errorf("a Run beside a running one = %v, want an error at once", err)
	}
	cancel2()
	// The stalled member's stop reports its call still out, when one is: under load its database
	// gate, told by the first Run's shutdown that the database does not answer, may hold its
	// background work back for the whole second Run (its probe fails), and then no call of it is
	// out and the second Run ends cleanly.
	if err := waitRun(t, done2, "the second Run"); err != nil && !strings.Contains(err.Error(), `member "stalled"`) {
		t.Errorf("the second Run = %v, want nil or the error of the stalled member's stop", err)
	} else if err == nil {
		t.Log("the second Run ended cleanly: no call of the stalled member was out at its end")
	}
	if relayRuns(a) {
		t.Error("a's relay still runs after both Runs returned")
	}

}

// Run's shutdown stops the background work of a member that a Remove is taking out, and does not
// wait for that Remove, which waits for the member's unit in flight for as long as its own ctx
// lets it (here: none). Before, Run waited for the Remove, so for the unit: for ever, if it
// never ends. The unit ends later, and the Remove returns once it has.
func TestSetRunStopsAMemberBeingRemoved(t *testing.T) {
	w := newWire()
	a := newMember(t, pgtest.DB(t), "", w)
	set := newSet(t, tenant.Config{}, map[string]*outbox.Outbox{"a": a, "b": newMember(t, pgtest.DB(t), "", w)})
	sh := newShop(func(string) string { return "orders" })
	release := make(chan struct{})
	sh.hold["a-slow"] = release
	h := set.WrapConsumer(sh.handle, middleware.WithConsumer("shop"))

	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	runDone := make(chan error, 1)
	go func() { runDone <- set.Run(ctx) }()
	eventually(t, "a's relay runs", func() bool { return relayRuns(a) })
	handled := make(chan error, 1)
	go func() { handled <- h(tenantMsg("a-slow", "a")) }()
	eventually(t, "a-slow's handler runs", func() bool { return sh.runsOf("a-slow") == 1 })
	removed := make(chan error, 1)
	go func() { removed <- set.Remove(context.Background(), "a") }()
	eventually(t, "a is out of the Set", func() bool { return len(set.Members()) == 1 })

	cancel()
	if err := waitRun(t, runDone, "Run, with a member's Remove waiting for its unit in flight,"); err != nil {
		t.Errorf("Run = %v", err)
	}
	if relayRuns(a) {
		t.Error("the background work of the member being removed still runs after Run returned")
	}
	select {
	case err := <-removed:
		t.Fatalf("Remove returned (%v) while the member's unit was in flight", err)
	default:
	}
	close(release)
	if err := <-handled; err != nil {
		t.Errorf("the unit in flight: %v", err)
	}
	select {
	case err := <-removed:
		if err != nil {
			t.Errorf("Remove = %v", err)
		}
	case <-time.After(20 * time.Second):
		t.Fatal("Remove did not return after the unit ended")
	}
	checkTenant(t, a.Config().DB, "orders", "a", []string{"a-slow"}, sh, w)
}

// An Outbox runs one background life: the Set refuses it under a second name, and under any name
// while a Remove is still stopping it. Two lives of one Outbox stopped each other's delayed-effect
// timer, and its metrics carry one member name.
func TestSetAddRefusesAnOutboxTwice(t *testing.T) {
	w := newWire()
	a := newMember(t, pgtest.DB(t), "", w)
	set := newSet(t, tenant.Config{}, map[string]*outbox.Outbox{"a": a})
	if err := set.Add("a2", a); err == nil || !strings.Contains(err.Error(), `member "a"`) {
		t.Errorf("Add of a member's Outbox under a second name = %v, want an error naming the member", err)
	}
	sh := newShop(func(string) string { return "orders" })
	release := make(chan struct{})
	sh.hold["a-slow"] = release
	h := set.WrapConsumer(sh.handle, middleware.WithConsumer("shop"))
	handled := make(chan error, 1)
	go func() { handled <- h(tenantMsg("a-slow", "a")) }()
	eventually(t, "a-slow's handler runs", func() bool { return sh.runsOf("a-slow") == 1 })
	removed := make(chan error, 1)
	go func() { removed <- set.Remove(context.Background(), "a") }()
	eventually(t, "a is out of the Set", func() bool { return len(set.Members()) == 0 })
	if err := set.Add("a", a); err == nil || !strings.Contains(err.Error(), "Remove") {
		t.Errorf("Add of an Outbox that a Remove under way stops = %v, want an error", err)
	}
	if err := set.Remove(context.Background(), "a"); !errors.Is(err, tenant.ErrUnknownMember) || !strings.Contains(err.Error(), "under way") {
		t.Errorf("a second Remove while the first is under way = %v, want ErrUnknownMember saying so", err)
	}
	close(release)
	if err := <-handled; err != nil {
		t.Fatal(err)
	}
	if err := <-removed; err != nil {
		t.Fatal(err)
	}
	if err := set.Add("a", a); err != nil {
		t.Errorf("Add once the Remove returned = %v", err)
	}
}

// Two members on one set of tables (one *sql.DB, Schema and TablePrefix) are refused: they share
// their claims, so a tenant's message whose ID another tenant's message had (an order number
// read by WithMessageID) was acked as a duplicate, and lost.
func TestSetAddRefusesMembersOnOneSetOfTables(t *testing.T) {
	w := newWire()
	db := pgtest.DB(t)
	a := newMember(t, db, "", w)
	b, err := outbox.New(outbox.Config{DB: db, Driver: postgres.Driver{}, Publisher: w})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = b.Close() })
	set := newSet(t, tenant.Config{}, map[string]*outbox.Outbox{"a": a})
	if err := set.Add("b", b); err == nil || !strings.Contains(err.Error(), `member "a"`) {
		t.Errorf("Add of a second Outbox on member a's tables = %v, want an error naming a", err)
	}
	if err := set.Add("c", newMember(t, db, "c_", w)); err != nil {
		t.Errorf("Add of an Outbox on tables of its own, in the same database = %v", err)
	}
}

// The Unresolved member must keep what it refuses: one with DeadLettersOff and no PoisonTopic
// nacked every message the Set could not route, for ever, which is what Unresolved prevents.
func TestSetAddRefusesAnUnresolvedMemberThatKeepsNothing(t *testing.T) {
	u, err := outbox.New(outbox.Config{DB: pgtest.DB(t), Driver: postgres.Driver{}, Publisher: newWire(), DeadLetters: outbox.DeadLettersOff})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = u.Close() })
	set, err := tenant.New(tenant.Config{Resolver: tenant.FromMetadata("tenant"), Unresolved: "unrouted"})
	if err != nil {
		t.Fatal(err)
	}
	if err := set.Add("unrouted", u); err == nil || !strings.Contains(err.Error(), "DeadLettersOff") {
		t.Errorf("Add of an Unresolved member that keeps no refusals = %v, want an error", err)
	}
	if err := set.Add("a", u); err != nil {
		t.Errorf("Add of that Outbox as a tenant's member = %v", err)
	}
}

// The Unresolved member keeps what it refuses under each message's UUID, not under the ID the
// middleware's options read: with middleware.WithMessageID reading a tenant's own key, messages
// of two unknown tenants that share a key are two dead letters. Before, the second was taken for
// a copy of the first and acked without one: lost. A copy of either (its UUID) still finds it.
func TestSetUnresolvedKeepsTenantsKeysApart(t *testing.T) {
	w := newWire()
	unrouted := newMember(t, pgtest.DB(t), "", w)
	set := newSet(t, tenant.Config{Unresolved: "unrouted"}, map[string]*outbox.Outbox{
		"a": newMember(t, pgtest.DB(t), "", w), "unrouted": unrouted})
	sh := newShop(func(string) string { return "orders" })
	byKey := middleware.WithMessageID(func(msg *message.Message) (string, error) { return msg.Metadata.Get("order"), nil })
	h := set.WrapConsumer(sh.handle, middleware.WithConsumer("shop"), byKey)
	msg := func(uuid, tn string) *message.Message {
		m := tenantMsg(uuid, tn)
		m.Metadata.Set("order", "42")
		return m
	}
	for _, m := range []*message.Message{msg("zz-42", "zz"), msg("yy-42", "yy"), msg("zz-42", "zz")} {
		if err := h(m); err != nil {
			t.Fatalf("refusing %s: %v", m.UUID, err)
		}
	}
	dls, err := unrouted.DeadLetters(context.Background(), outbox.DeadLetterFilter{Consumer: "shop"})
	if err != nil {
		t.Fatal(err)
	}
	got := map[string]string{}
	for _, dl := range dls {
		got[dl.MessageID] = dl.Metadata["tenant"]
	}
	if len(dls) != 2 || got["zz-42"] != "zz" || got["yy-42"] != "yy" {
		t.Errorf("the Unresolved member holds %d dead letters (message ID -> tenant: %v), want zz-42 and yy-42", len(dls), got)
	}
	if n := set.Refused(); n != 3 {
		t.Errorf("Refused() = %d, want 3", n)
	}
}

// Health checks the members of one database/sql pool (a table prefix each) at most
// Config.PoolConcurrent (2) at a time, so that it opens no connection beyond the pool's two idle
// ones. Before, it checked every member at once: a connection each, closed again after.
func TestSetHealthKeepsToThePool(t *testing.T) {
	w := newWire()
	db := pgtest.DB(t)
	members := map[string]*outbox.Outbox{}
	for i := range 12 {
		name := string(rune('a' + i))
		members[name] = newMember(t, db, name+"_", w)
	}
	set := newSet(t, tenant.Config{}, members)
	before := db.Stats().MaxIdleClosed
	r := set.Health(context.Background()) // unhealthy: no Run, no relay; the databases answer
	ok := 0
	for _, ck := range r.Checks {
		if strings.HasSuffix(ck.Name, "/"+outbox.CheckDatabase) && ck.OK {
			ok++
		}
	}
	if ok != 12 {
		t.Errorf("Health found %d of the 12 members' databases answering: %v", ok, r.Err())
	}
	if closed := db.Stats().MaxIdleClosed - before; closed != 0 {
		t.Errorf("Health opened %d connections beyond the pool's idle ones (closed once it returned), want none", closed)
	}
}

// An Outbox runs one background life across Sets and its own Run too: a running Set refuses to
// add an Outbox that its own Run runs, or that another Set runs, and a Set's Run leaves such a
// member's background work to what runs it. Two lives stopped each other's delayed-effect timer,
// and the first to stop wrote the marks while the other still queued them.
func TestSetRefusesAnOutboxThatRunsElsewhere(t *testing.T) {
	w := newWire()
	db := pgtest.DB(t)
	a := newMember(t, db, "", w)
	b := newMember(t, db, "b_", w)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	ran := make(chan error, 1)
	go func() { ran <- a.Run(ctx) }()
	eventually(t, "a's Run runs", func() bool { return relayRuns(a) })

	set := newSet(t, tenant.Config{}, nil)
	sctx, scancel := context.WithCancel(context.Background())
	setRan := make(chan error, 1)
	go func() { setRan <- set.Run(sctx) }()
	if err := set.Add("b", b); err != nil {
		t.Fatal(err)
	}
	eventually(t, "b runs in the Set", func() bool { return relayRuns(b) })
	if err := set.Add("a", a); !errors.Is(err, outbox.ErrRunning) || !strings.Contains(err.Error(), "Run") {
		t.Errorf("Add of an Outbox that its own Run runs = %v, want ErrRunning naming Run", err)
	}
	if got := set.Members(); len(got) != 1 {
		t.Errorf("members after a refused Add: %v, want only b", got)
	}
	c := newMember(t, db, "c_", w)
	other := newSet(t, tenant.Config{}, map[string]*outbox.Outbox{"c": c})
	octx, ocancel := context.WithCancel(context.Background())
	otherRan := make(chan error, 1)
	go func() { otherRan <- other.Run(octx) }()
	eventually(t, "the other Set runs", func() bool { return relayRuns(c) })
	if err := other.Add("b2", b); !errors.Is(err, outbox.ErrRunning) || !strings.Contains(err.Error(), `member "b"`) {
		t.Errorf("Add to a second Set of an Outbox that the first runs = %v, want ErrRunning naming the member", err)
	}
	ocancel()
	if err := waitRun(t, otherRan, "the other Set's Run"); err != nil {
		t.Error(err)
	}
	if err := a.Run(ctx); !errors.Is(err, outbox.ErrRunning) {
		t.Errorf("a second Run of a running Outbox = %v, want ErrRunning", err)
	}
	scancel()
	if err := waitRun(t, setRan, "the Set's Run"); err != nil {
		t.Error(err)
	}
	cancel()
	if err := waitRun(t, ran, "a's Run"); err != nil {
		t.Error(err)
	}
	// Once each life ended, another may begin.
	if err := set.Add("a", a); err != nil {
		t.Errorf("Add of an Outbox whose Run returned = %v", err)
	}
	ctx2, cancel2 := context.WithCancel(context.Background())
	again := make(chan error, 1)
	go func() { again <- b.Run(ctx2) }()
	eventually(t, "b runs on its own once the Set stopped", func() bool { return relayRuns(b) })
	cancel2()
	if err := waitRun(t, again, "b's Run"); err != nil {
		t.Error(err)
	}
}

// Remove with a context that already ended, of a member with no unit in flight, removes it
// without an error: select picked the ended context half the time, and Remove said units were
// still in flight when none were.
func TestSetRemoveWithAnEndedContext(t *testing.T) {
	w := newWire()
	db := pgtest.DB(t)
	ended, cancel := context.WithCancel(context.Background())
	cancel()
	for i := range 10 { // select picked either at random: ten tries miss it once in a thousand
		ob := newMember(t, db, fmt.Sprintf("m%d_", i), w)
		set := newSet(t, tenant.Config{}, map[string]*outbox.Outbox{"a": ob})
		if err := set.Remove(ended, "a"); err != nil {
			t.Fatalf("Remove %d with an ended context and no unit in flight = %v, want nil", i, err)
		}
	}
}

// A handler wrapped by the Set's middleware where it is called (a wrap per message) leaves
// nothing behind once it is gone: each member kept the handler it built for every wrap it
// served, for good.
func TestWrapsPerMessageAreForgotten(t *testing.T) {
	a := newMember(t, pgtest.DB(t), "", newWire())
	set := newSet(t, tenant.Config{}, map[string]*outbox.Outbox{"a": a})
	const wraps = 200
	for i := range wraps {
		h := set.WrapConsumer(func(*message.Message) error { return nil }, middleware.WithConsumer("c"))
		if err := h(tenantMsg(fmt.Sprintf("m-%d", i), "a")); err != nil {
			t.Fatal(err)
		}
	}
	eventually(t, "the handlers built for the wraps gone", func() bool {
		runtime.GC()
		return tenant.CachedHandlers(set, "a") < wraps/10
	})
}
