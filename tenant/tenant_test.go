package tenant_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	wmw "github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	_ "github.com/lib/pq"

	"github.com/watermill-outbox/outbox"
	"github.com/watermill-outbox/outbox/drivers/postgres"
	"github.com/watermill-outbox/outbox/internal/pgtest"
	"github.com/watermill-outbox/outbox/internal/silent"
	"github.com/watermill-outbox/outbox/middleware"
	"github.com/watermill-outbox/outbox/tenant"
)

func TestMain(m *testing.M) { os.Exit(pgtest.Run(m)) }

// wire records what the members publish.
type wire struct {
	mu   sync.Mutex
	sent map[string]int // UUID -> times published
}

func newWire() *wire { return &wire{sent: map[string]int{}} }

func (w *wire) Publish(_ string, msgs ...*message.Message) error {
	w.mu.Lock()
	defer w.mu.Unlock()
	for _, m := range msgs {
		w.sent[m.UUID]++
	}
	return nil
}

func (w *wire) Close() error { return nil }

func (w *wire) count(uuid string) int {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.sent[uuid]
}

// newMember returns an Outbox on db with its tables and an orders table under prefix.
func newMember(t *testing.T, db *sql.DB, prefix string, pub message.Publisher) *outbox.Outbox {
	t.Helper()
	ob, err := outbox.New(outbox.Config{DB: db, Driver: postgres.Driver{}, Publisher: pub, TablePrefix: prefix,
		RelayInterval: 50 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	if err := ob.Migrate(context.Background()); err != nil {
		t.Fatal(err)
	}
	if _, err := db.Exec(`CREATE TABLE ` + prefix + `orders (id text, tenant text)`); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = ob.Close() })
	return ob
}

// newSet returns a Set of cfg (resolving the "tenant" metadata when cfg has no Resolver) with
// members. A cfg without Unresolved nacks what the Set cannot route: the tests either route
// every message or look at the nack.
func newSet(t *testing.T, cfg tenant.Config, members map[string]*outbox.Outbox) *tenant.Set {
	t.Helper()
	if cfg.Resolver == nil {
		cfg.Resolver = tenant.FromMetadata("tenant")
	}
	cfg.NackUnresolved = cfg.Unresolved == ""
	set, err := tenant.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	for name, ob := range members {
		if err := set.Add(name, ob); err != nil {
			t.Fatal(err)
		}
	}
	return set
}

// shop is the business handler of the tests: one order row in the tenant's table, and one event.
type shop struct {
	table func(tenant string) string // the orders table of a tenant

	mu   sync.Mutex
	runs map[string]int // message UUID -> handler runs
	hold map[string]chan struct{}
}

func newShop(table func(string) string) *shop {
	return &shop{table: table, runs: map[string]int{}, hold: map[string]chan struct{}{}}
}

func (s *shop) handle(msg *message.Message) error {
	s.mu.Lock()
	s.runs[msg.UUID]++
	hold := s.hold[msg.UUID]
	s.mu.Unlock()
	if hold != nil {
		<-hold
	}
	ctx := msg.Context()
	tn := msg.Metadata.Get("tenant")
	if _, err := outbox.Tx(ctx).ExecContext(ctx, `INSERT INTO `+s.table(tn)+` VALUES ($1, $2)`, msg.UUID, tn); err != nil {
		return err
	}
	return outbox.Publish(ctx, "events", message.NewMessage("event-"+msg.UUID, nil))
}

func (s *shop) runsOf(uuid string) int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.runs[uuid]
}

func tenantMsg(uuid, tn string) *message.Message {
	m := message.NewMessage(uuid, []byte(uuid))
	if tn != "" {
		m.Metadata.Set("tenant", tn)
	}
	return m
}

// service runs a Router with the Set's consumer on topic orders of a gochannel, and the Set.
type service struct {
	orders *gochannel.GoChannel
	router *message.Router
}

func startService(t *testing.T, set *tenant.Set, sh *shop) *service {
	t.Helper()
	orders := gochannel.NewGoChannel(gochannel.Config{OutputChannelBuffer: 64}, watermill.NopLogger{})
	router, err := message.NewRouter(message.RouterConfig{}, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	router.AddConsumerHandler("shop", "orders", orders, set.WrapConsumer(sh.handle))
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	wg.Add(2)
	go func() { defer wg.Done(); _ = router.Run(ctx) }()
	go func() { defer wg.Done(); _ = set.Run(ctx) }()
	<-router.Running()
	t.Cleanup(func() {
		_ = router.Close()
		cancel()
		wg.Wait()
		_ = orders.Close()
	})
	return &service{orders: orders, router: router}
}

func (s *service) send(t *testing.T, msgs ...*message.Message) {
	t.Helper()
	if err := s.orders.Publish("orders", msgs...); err != nil {
		t.Fatal(err)
	}
}

// rows returns the (id, tenant) rows of table.
func rows(t *testing.T, db *sql.DB, table string) map[string][]string {
	t.Helper()
	rs, err := db.Query(`SELECT id, tenant FROM ` + table)
	if err != nil {
		t.Fatal(err)
	}
	defer rs.Close()
	out := map[string][]string{}
	for rs.Next() {
		var id, tn string
		if err := rs.Scan(&id, &tn); err != nil {
			t.Fatal(err)
		}
		out[id] = append(out[id], tn)
	}
	if err := rs.Err(); err != nil {
		t.Fatal(err)
	}
	return out
}

// eventually polls cond for up to 30 seconds.
func eventually(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting until %s", what)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// checkTenant asserts that table on db holds exactly the orders ids, each once and of tenant tn,
// that the handler ran once for each, and that each one's event goes out.
func checkTenant(t *testing.T, db *sql.DB, table, tn string, ids []string, sh *shop, w *wire) {
	t.Helper()
	checkTenantRows(t, db, table, tn, ids, w)
	for _, id := range ids {
		if n := sh.runsOf(id); n != 1 {
			t.Errorf("the handler ran %d times for %s, want once (copies skip it)", n, id)
		}
	}
}

// checkTenantRows is checkTenant without the handler's runs: for a tenant whose units an outage
// cut (rolled back, and run again on redelivery).
func checkTenantRows(t *testing.T, db *sql.DB, table, tn string, ids []string, w *wire) {
	t.Helper()
	got := rows(t, db, table)
	if len(got) != len(ids) {
		t.Errorf("%s holds %d orders, want %d: %v", table, len(got), len(ids), got)
	}
	for _, id := range ids {
		if g := got[id]; len(g) != 1 || g[0] != tn {
			t.Errorf("%s: order %s stored %v, want once for %s", table, id, g, tn)
		}
	}
	// An order is visible at its commit, its event goes out just after.
	eventually(t, "the events of "+tn+" went out", func() bool {
		for _, id := range ids {
			if w.count("event-"+id) < 1 {
				return false
			}
		}
		return true
	})
}

// Two tenants with a database each, their messages interleaved on one subscriber, with copies:
// each tenant's orders and events land in its own database, once.
func TestSetTwoDatabasesInterleaved(t *testing.T) {
	dbA, dbB := pgtest.DB(t), pgtest.DB(t)
	w := newWire()
	set := newSet(t, tenant.Config{}, map[string]*outbox.Outbox{"a": newMember(t, dbA, "", w), "b": newMember(t, dbB, "", w)})
	sh := newShop(func(string) string { return "orders" })
	svc := startService(t, set, sh)

	var idsA, idsB []string
	for i := range 20 {
		tn, ids := "a", &idsA
		if i%2 == 1 {
			tn, ids = "b", &idsB
		}
		id := fmt.Sprintf("%s-%d", tn, i)
		*ids = append(*ids, id)
		svc.send(t, tenantMsg(id, tn))
	}
	eventually(t, "every order is stored", func() bool {
		return len(rows(t, dbA, "orders")) == len(idsA) && len(rows(t, dbB, "orders")) == len(idsB)
	})
	// Copies of every message, redelivered once the originals were acked.
	for i := range 20 {
		tn := []string{"a", "b"}[i%2]
		svc.send(t, tenantMsg(fmt.Sprintf("%s-%d", tn, i), tn))
	}
	eventually(t, "every copy is handled", func() bool {
		return sh.runsOf("a-0") > 0 && len(rows(t, dbA, "orders")) >= len(idsA)
	})
	// The copies reach the handler's consumer in order after the originals; the last copy's
	// claim check is done once a message sent after it was handled.
	svc.send(t, tenantMsg("a-last", "a"))
	idsA = append(idsA, "a-last")
	eventually(t, "the last message is stored", func() bool { return len(rows(t, dbA, "orders")) == len(idsA) })
	checkTenant(t, dbA, "orders", "a", idsA, sh, w)
	checkTenant(t, dbB, "orders", "b", idsB, sh, w)
	if n := set.Refused(); n != 0 {
		t.Errorf("Refused() = %d, want 0", n)
	}
}

// Schema per tenant on one *sql.DB: each member its own TablePrefix on one pool.
func TestSetTablePrefixesOnOnePool(t *testing.T) {
	db := pgtest.DB(t)
	w := newWire()
	set := newSet(t, tenant.Config{}, map[string]*outbox.Outbox{"a": newMember(t, db, "a_", w), "b": newMember(t, db, "b_", w)})
	sh := newShop(func(tn string) string { return tn + "_orders" })
	svc := startService(t, set, sh)
	var ids = map[string][]string{}
	for i := range 12 {
		tn := []string{"a", "b"}[i%2]
		id := fmt.Sprintf("%s-%d", tn, i)
		ids[tn] = append(ids[tn], id)
		svc.send(t, tenantMsg(id, tn))
	}
	eventually(t, "every order is stored", func() bool {
		return len(rows(t, db, "a_orders")) == 6 && len(rows(t, db, "b_orders")) == 6
	})
	checkTenant(t, db, "a_orders", "a", ids["a"], sh, w)
	checkTenant(t, db, "b_orders", "b", ids["b"], sh, w)
	// Each member's claims are in its own tables.
	for _, tn := range []string{"a", "b"} {
		var n int
		if err := db.QueryRow(`SELECT count(*) FROM ` + tn + `_processed`).Scan(&n); err != nil {
			t.Fatal(err)
		}
		if n != 6 {
			t.Errorf("%s_processed holds %d claims, want 6", tn, n)
		}
	}
}

// Without an Unresolved member, a message the Set cannot route is nacked with an error that says
// why, the handler does not run, nothing is stored, and it is counted.
func TestSetUnresolvedNacked(t *testing.T) {
	db := pgtest.DB(t)
	w := newWire()
	set := newSet(t, tenant.Config{Resolver: func(msg *message.Message) (string, error) {
		switch msg.Metadata.Get("resolver") {
		case "fail":
			return "", errors.New("no tenant in the key")
		case "panic":
			panic("bad key")
		}
		return tenant.FromMetadata("tenant")(msg)
	}}, map[string]*outbox.Outbox{"a": newMember(t, db, "", w)})
	sh := newShop(func(string) string { return "orders" })
	h := set.WrapConsumer(sh.handle, middleware.WithConsumer("shop"))
	failing, panicking := tenantMsg("m-fail", "a"), tenantMsg("m-panic", "a")
	failing.Metadata.Set("resolver", "fail")
	panicking.Metadata.Set("resolver", "panic")
	for _, c := range []struct {
		msg  *message.Message
		says string
	}{
		{tenantMsg("m-none", ""), `no metadata "tenant"`},
		{tenantMsg("m-unknown", "zz"), `member "zz" is not in the Set`},
		{failing, "no tenant in the key"},
		{panicking, "the Resolver panicked: bad key"},
	} {
		err := h(c.msg)
		if !errors.Is(err, tenant.ErrUnresolved) || !strings.Contains(err.Error(), c.says) {
			t.Errorf("%s: got %v, want ErrUnresolved saying %q", c.msg.UUID, err, c.says)
		}
		if n := sh.runsOf(c.msg.UUID); n != 0 {
			t.Errorf("%s: the handler ran %d times", c.msg.UUID, n)
		}
	}
	if n := set.Refused(); n != 4 {
		t.Errorf("Refused() = %d, want 4", n)
	}
	var claims int
	if err := db.QueryRow(`SELECT count(*) FROM outbox_processed`).Scan(&claims); err != nil {
		t.Fatal(err)
	}
	if got := rows(t, db, "orders"); len(got) != 0 || claims != 0 {
		t.Errorf("a refused message left %d orders and %d claims", len(got), claims)
	}
}

// With an Unresolved member, such a message is stored as its dead letter, with the reason, and
// acked; a copy too.
func TestSetUnresolvedDeadLettered(t *testing.T) {
	dbA, dbU := pgtest.DB(t), pgtest.DB(t)
	w := newWire()
	set := newSet(t, tenant.Config{Unresolved: "unrouted"}, map[string]*outbox.Outbox{"a": newMember(t, dbA, "", w)})
	unrouted := newMember(t, dbU, "", w)
	sh := newShop(func(string) string { return "orders" })
	h := set.WrapConsumer(sh.handle, middleware.WithConsumer("shop"))
	// Until the Unresolved member is in the Set, the message is nacked.
	if err := h(tenantMsg("m-unknown", "zz")); !errors.Is(err, tenant.ErrUnresolved) {
		t.Fatalf("without the Unresolved member: got %v, want ErrUnresolved", err)
	}
	if err := set.Add("unrouted", unrouted); err != nil {
		t.Fatal(err)
	}
	for range 2 { // the message and a copy
		if err := h(tenantMsg("m-unknown", "zz")); err != nil {
			t.Fatalf("refusing in the Unresolved member: %v", err)
		}
	}
	dls, err := unrouted.DeadLetters(context.Background(), outbox.DeadLetterFilter{Consumer: "shop"})
	if err != nil {
		t.Fatal(err)
	}
	if len(dls) != 1 {
		t.Fatalf("the Unresolved member holds %d dead letters, want 1: %+v", len(dls), dls)
	}
	dl := dls[0]
	if dl.MessageID != "m-unknown" || !strings.Contains(dl.Reason, `member "zz" is not in the Set`) || !dl.Permanent || string(dl.Payload) != "m-unknown" || dl.Metadata["tenant"] != "zz" {
		t.Errorf("dead letter = %+v", dl)
	}
	if n := sh.runsOf("m-unknown"); n != 0 {
		t.Errorf("the handler ran %d times", n)
	}
	if n := set.Refused(); n != 3 {
		t.Errorf("Refused() = %d, want 3", n)
	}
}

// A tenant added while the process runs gets its messages processed, its background work runs,
// and Health names it; before it was added its message was refused in the Unresolved member.
func TestSetRefusesNamesThatReadAsOthers(t *testing.T) {
	set, err := tenant.New(tenant.Config{Metadata: "tenant", NackUnresolved: true})
	if err != nil {
		t.Fatal(err)
	}
	// A bidirectional override makes "acme\u202egro" print as "acmeorg" reversed in a log line,
	// a metric label, a health report or the console; a line separator starts a new log line.
	for _, bad := range []string{"", "a/b", "a\nb", string([]byte{0xff}), "acme\u202egro", "a\u2066b", "a\u2028b", strings.Repeat("x", 201)} {
		if err := set.Add(bad, nil); err == nil || !strings.Contains(err.Error(), "invalid member name") {
			t.Errorf("Add(%q) = %v, want the name refused", bad, err)
		}
		if _, err := tenant.New(tenant.Config{Metadata: "tenant", Unresolved: bad}); err == nil {
			t.Errorf("Unresolved %q accepted", bad)
		}
	}
	if err := set.Add(strings.Repeat("x", 200), nil); err == nil || strings.Contains(err.Error(), "invalid member name") {
		t.Errorf("Add of a 200-byte name = %v, want it taken (and the nil Outbox refused)", err)
	}
}

func TestSetAddWhileRunning(t *testing.T) {
	dbA, dbC, dbU := pgtest.DB(t), pgtest.DB(t), pgtest.DB(t)
	w := newWire()
	unrouted := newMember(t, dbU, "", w)
	set := newSet(t, tenant.Config{Unresolved: "unrouted"}, map[string]*outbox.Outbox{"a": newMember(t, dbA, "", w), "unrouted": unrouted})
	sh := newShop(func(string) string { return "orders" })
	svc := startService(t, set, sh)
	svc.send(t, tenantMsg("c-early", "c"), tenantMsg("a-1", "a"))
	eventually(t, "a's order is stored", func() bool { return len(rows(t, dbA, "orders")) == 1 })
	eventually(t, "c's early message is dead-lettered", func() bool {
		dls, err := unrouted.DeadLetters(context.Background(), outbox.DeadLetterFilter{})
		return err == nil && len(dls) == 1 && dls[0].MessageID == "c-early" && dls[0].SourceTopic == "orders"
	})

	c := newMember(t, dbC, "", w)
	if err := set.Add("c", c); err != nil {
		t.Fatal(err)
	}
	svc.send(t, tenantMsg("c-1", "c"), tenantMsg("a-2", "a"), tenantMsg("c-2", "c"))
	eventually(t, "c's orders are stored", func() bool {
		return len(rows(t, dbC, "orders")) == 2 && len(rows(t, dbA, "orders")) == 2
	})
	checkTenant(t, dbC, "orders", "c", []string{"c-1", "c-2"}, sh, w)
	checkTenant(t, dbA, "orders", "a", []string{"a-1", "a-2"}, sh, w)
	eventually(t, "c's relay runs and Health names it", func() bool {
		for _, ck := range set.Health(context.Background()).Checks {
			if ck.Name == "c/"+outbox.CheckRelay {
				return ck.OK
			}
		}
		return false
	})
}

// Remove waits for the member's unit of work in flight, then stops its background work; its
// later messages are refused; Health names the member that is unhealthy.
func TestSetRemoveWaitsForUnitInFlight(t *testing.T) {
	dbA, dbB := pgtest.DB(t), pgtest.DB(t)
	w := newWire()
	a := newMember(t, dbA, "", w)
	set := newSet(t, tenant.Config{}, map[string]*outbox.Outbox{"a": a, "b": newMember(t, dbB, "", w)})
	sh := newShop(func(string) string { return "orders" })
	release := make(chan struct{})
	sh.hold["a-slow"] = release
	svc := startService(t, set, sh)
	relayOK := func(ob *outbox.Outbox) bool {
		for _, ck := range ob.Health(context.Background()).Checks {
			if ck.Name == outbox.CheckRelay {
				return ck.OK
			}
		}
		return false
	}
	eventually(t, "a's relay runs", func() bool { return relayOK(a) })
	svc.send(t, tenantMsg("a-slow", "a"))
	eventually(t, "a-slow's handler runs", func() bool { return sh.runsOf("a-slow") == 1 })

	removed := make(chan error, 1)
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		removed <- set.Remove(ctx, "a")
	}()
	select {
	case err := <-removed:
		t.Fatalf("Remove returned (%v) while a unit of the member was in flight", err)
	case <-time.After(300 * time.Millisecond):
	}
	if got := set.Members(); len(got) != 1 || got[0] != "b" {
		t.Errorf("Members() = %v while a is being removed, want [b]", got)
	}
	close(release)
	select {
	case err := <-removed:
		if err != nil {
			t.Fatalf("Remove: %v", err)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("Remove did not return after the unit ended")
	}
	checkTenant(t, dbA, "orders", "a", []string{"a-slow"}, sh, w)
	if relayOK(a) {
		t.Error("the removed member's relay still runs")
	}
	err := set.WrapConsumer(sh.handle, middleware.WithConsumer("shop"))(tenantMsg("a-late", "a"))
	if !errors.Is(err, tenant.ErrUnresolved) {
		t.Errorf("a message of a removed member: got %v, want ErrUnresolved", err)
	}
	if err := set.InTx(context.Background(), "a", func(context.Context, *sql.Tx) error { return nil }); !errors.Is(err, tenant.ErrUnknownMember) {
		t.Errorf("InTx on a removed member: got %v, want ErrUnknownMember", err)
	}
	// b's relay is stopped by hand: Health names b.
	r := set.Health(context.Background())
	for _, ck := range r.Checks {
		if strings.HasPrefix(ck.Name, "a/") {
			t.Errorf("Health reports the removed member: %+v", ck)
		}
	}
	if !r.Healthy {
		t.Errorf("Health after removal: %v", r.Err())
	}
}

// Health names the member that is unhealthy.
func TestSetHealthNamesMember(t *testing.T) {
	dbA, dbB := pgtest.DB(t), pgtest.DB(t)
	w := newWire()
	set := newSet(t, tenant.Config{}, map[string]*outbox.Outbox{"a": newMember(t, dbA, "", w), "b": newMember(t, dbB, "", w)})
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- set.Run(ctx) }()
	defer func() { cancel(); <-done }()
	eventually(t, "the Set is healthy", func() bool { return set.Health(context.Background()).Healthy })
	if _, err := dbB.Exec(`DROP TABLE outbox_migrations`); err != nil {
		t.Fatal(err)
	}
	r := set.Health(context.Background())
	err := r.Err()
	if r.Healthy || err == nil || !strings.Contains(err.Error(), "b/"+outbox.CheckSchema) || strings.Contains(err.Error(), "a/") {
		t.Errorf("Health after b's schema was dropped: healthy %v, %v; want b/schema named, a not", r.Healthy, err)
	}
}

// A boundary unit of work on a member stores its business write and its effect in that
// member's database.
func TestSetInTx(t *testing.T) {
	dbA, dbB := pgtest.DB(t), pgtest.DB(t)
	w := newWire()
	set := newSet(t, tenant.Config{}, map[string]*outbox.Outbox{"a": newMember(t, dbA, "", w), "b": newMember(t, dbB, "", w)})
	ctx := context.Background()
	err := set.InTx(ctx, "b", func(ctx context.Context, tx *sql.Tx) error {
		if _, err := tx.ExecContext(ctx, `INSERT INTO orders VALUES ('b-api', 'b')`); err != nil {
			return err
		}
		return outbox.Publish(ctx, "events", message.NewMessage("event-b-api", nil))
	})
	if err != nil {
		t.Fatal(err)
	}
	if got := rows(t, dbB, "orders"); len(got) != 1 {
		t.Errorf("b's orders = %v", got)
	}
	if got := rows(t, dbA, "orders"); len(got) != 0 {
		t.Errorf("a's orders = %v", got)
	}
	if w.count("event-b-api") != 1 {
		t.Errorf("the event went out %d times", w.count("event-b-api"))
	}
}

// Adds, removes, resolutions, units of work and health checks at once (run with -race): every
// message either ran on its member, once, or was refused as unresolved, never anything else.
func TestSetConcurrentAddRemoveResolve(t *testing.T) {
	db := pgtest.DB(t)
	w := newWire()
	names := []string{"t0", "t1", "t2"}
	obs := map[string]*outbox.Outbox{}
	for _, n := range names {
		obs[n] = newMember(t, db, n+"_", w)
	}
	set := newSet(t, tenant.Config{}, map[string]*outbox.Outbox{"t0": obs["t0"]})
	sh := newShop(func(tn string) string { return tn + "_orders" })
	h := set.WrapConsumer(sh.handle, middleware.WithConsumer("shop"))
	ctx, cancel := context.WithCancel(context.Background())
	runDone := make(chan error, 1)
	go func() { runDone <- set.Run(ctx) }()

	stop := make(chan struct{})
	var churn sync.WaitGroup
	for _, n := range names[1:] {
		churn.Add(1)
		go func() {
			defer churn.Done()
			for {
				select {
				case <-stop:
					return
				default:
				}
				if err := set.Add(n, obs[n]); err != nil {
					t.Errorf("Add %s: %v", n, err)
					return
				}
				time.Sleep(5 * time.Millisecond)
				_ = set.Health(context.Background())
				rctx, rcancel := context.WithTimeout(context.Background(), 30*time.Second)
				err := set.Remove(rctx, n)
				rcancel()
				if err != nil {
					t.Errorf("Remove %s: %v", n, err)
					return
				}
			}
		}()
	}
	var (
		mu      sync.Mutex
		handled = map[string][]string{} // tenant -> ids acked
	)
	var senders sync.WaitGroup
	for g := range 4 {
		senders.Add(1)
		go func() {
			defer senders.Done()
			for i := range 25 {
				tn := names[(g+i)%3]
				id := fmt.Sprintf("%s-%d-%d", tn, g, i)
				err := h(tenantMsg(id, tn))
				switch {
				case err == nil:
					mu.Lock()
					handled[tn] = append(handled[tn], id)
					mu.Unlock()
				case errors.Is(err, tenant.ErrUnresolved) && tn != "t0":
				default:
					t.Errorf("%s: %v", id, err)
				}
			}
		}()
	}
	senders.Wait()
	close(stop)
	churn.Wait()
	cancel()
	if err := <-runDone; err != nil {
		t.Fatal(err)
	}
	var sentT0 int
	for g := range 4 {
		for i := range 25 {
			if (g+i)%3 == 0 {
				sentT0++
			}
		}
	}
	if len(handled["t0"]) != sentT0 {
		t.Errorf("t0, never removed, handled %d of its %d messages", len(handled["t0"]), sentT0)
	}
	if len(handled["t1"])+len(handled["t2"]) == 0 {
		t.Error("no message of the members added and removed ran: the churn tested nothing")
	}
	for _, n := range names {
		got := rows(t, db, n+"_orders")
		if len(got) != len(handled[n]) {
			t.Errorf("%s_orders holds %d orders, %d were acked", n, len(got), len(handled[n]))
		}
		for _, id := range handled[n] {
			if len(got[id]) != 1 {
				t.Errorf("%s stored %d times", id, len(got[id]))
			}
		}
	}
}

// CheckRouter sees the Set's middleware as the outbox middleware: Retry inside it is reported.
func TestSetCheckRouter(t *testing.T) {
	set, err := tenant.New(tenant.Config{Resolver: tenant.FromMetadata("tenant"), NackUnresolved: true})
	if err != nil {
		t.Fatal(err)
	}
	pubsub := gochannel.NewGoChannel(gochannel.Config{}, watermill.NopLogger{})
	defer pubsub.Close()
	r, err := message.NewRouter(message.RouterConfig{}, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	r.AddConsumerHandler("shop", "orders", pubsub, func(*message.Message) error { return nil }).
		AddMiddleware(set.Middleware(), wmw.Retry{MaxRetries: 3}.Middleware)
	err = middleware.CheckRouter(r)
	if !errors.Is(err, middleware.ErrUnsafeMiddlewareOrder) || !strings.Contains(err.Error(), "Retry runs inside the outbox middleware") {
		t.Errorf("CheckRouter = %v, want Retry inside the outbox middleware reported", err)
	}
	// The safe order passes.
	r2, err := message.NewRouter(message.RouterConfig{}, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	r2.AddConsumerHandler("shop", "orders", pubsub, func(*message.Message) error { return nil }).
		AddMiddleware(wmw.Retry{MaxRetries: 3}.Middleware, set.Middleware())
	if err := middleware.CheckRouter(r2); err != nil {
		t.Errorf("CheckRouter on the safe order = %v", err)
	}
}

// FromTopic: a topic per tenant on one subscriber, each message on its topic's member; outside a
// Router a message has no topic and is refused.
func TestSetFromTopic(t *testing.T) {
	dbA, dbB := pgtest.DB(t), pgtest.DB(t)
	w := newWire()
	set := newSet(t, tenant.Config{Resolver: tenant.FromTopic(func(topic string) (string, error) {
		name, ok := strings.CutPrefix(topic, "orders.")
		if !ok {
			return "", fmt.Errorf("topic %q is no tenant's", topic)
		}
		return name, nil
	})}, map[string]*outbox.Outbox{"a": newMember(t, dbA, "", w), "b": newMember(t, dbB, "", w)})
	sh := newShop(func(string) string { return "orders" })
	pubsub := gochannel.NewGoChannel(gochannel.Config{}, watermill.NopLogger{})
	defer pubsub.Close()
	router, err := message.NewRouter(message.RouterConfig{}, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	for _, tn := range []string{"a", "b"} {
		router.AddConsumerHandler("shop-"+tn, "orders."+tn, pubsub, set.WrapConsumer(sh.handle, middleware.WithConsumer("shop")))
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); _ = router.Run(ctx) }()
	defer func() { cancel(); <-done }()
	<-router.Running()
	for i := range 6 {
		tn := []string{"a", "b"}[i%2]
		// The tenant metadata is what the shop stores as the order's tenant: here it says which
		// topic the message went to, and the topic alone picks the member.
		if err := pubsub.Publish("orders."+tn, tenantMsg(fmt.Sprintf("%s-%d", tn, i), tn)); err != nil {
			t.Fatal(err)
		}
	}
	eventually(t, "every order is stored", func() bool {
		return len(rows(t, dbA, "orders")) == 3 && len(rows(t, dbB, "orders")) == 3
	})
	checkTenant(t, dbA, "orders", "a", []string{"a-0", "a-2", "a-4"}, sh, w)
	checkTenant(t, dbB, "orders", "b", []string{"b-1", "b-3", "b-5"}, sh, w)
	err = set.WrapConsumer(sh.handle, middleware.WithConsumer("shop"))(tenantMsg("no-topic", "a"))
	if !errors.Is(err, tenant.ErrUnresolved) || !strings.Contains(err.Error(), "no topic") {
		t.Errorf("a message without a topic: got %v, want ErrUnresolved saying it has no topic", err)
	}
}

// Without an Unresolved member, Watermill's PoisonQueueWithFilter for ErrUnresolved outside the
// Set's middleware moves an unroutable message to the poison topic (the order CheckRouter accepts),
// and the tenant's messages still run on their member.
func TestSetUnresolvedToPoisonQueue(t *testing.T) {
	db := pgtest.DB(t)
	w := newWire()
	set := newSet(t, tenant.Config{}, map[string]*outbox.Outbox{"a": newMember(t, db, "", w)})
	sh := newShop(func(string) string { return "orders" })
	pubsub := gochannel.NewGoChannel(gochannel.Config{Persistent: true}, watermill.NopLogger{})
	defer pubsub.Close()
	poisoned, err := pubsub.Subscribe(context.Background(), "orders.poison")
	if err != nil {
		t.Fatal(err)
	}
	pq, err := wmw.PoisonQueueWithFilter(pubsub, "orders.poison", func(err error) bool { return errors.Is(err, tenant.ErrUnresolved) })
	if err != nil {
		t.Fatal(err)
	}
	router, err := message.NewRouter(message.RouterConfig{}, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	router.AddConsumerHandler("shop", "orders", pubsub, sh.handle).AddMiddleware(pq, set.Middleware())
	if err := middleware.CheckRouter(router); err != nil {
		t.Fatalf("CheckRouter: %v", err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); _ = router.Run(ctx) }()
	defer func() { cancel(); <-done }()
	<-router.Running()
	if err := pubsub.Publish("orders", tenantMsg("zz-1", "zz"), tenantMsg("a-1", "a")); err != nil {
		t.Fatal(err)
	}
	select {
	case m := <-poisoned:
		m.Ack()
		if m.UUID != "zz-1" || !strings.Contains(m.Metadata.Get(wmw.ReasonForPoisonedKey), `member "zz" is not in the Set`) {
			t.Errorf("poisoned %s, reason %q", m.UUID, m.Metadata.Get(wmw.ReasonForPoisonedKey))
		}
	case <-time.After(30 * time.Second):
		t.Fatal("the unroutable message never reached the poison topic")
	}
	eventually(t, "a's order is stored", func() bool { return len(rows(t, db, "orders")) == 1 })
	checkTenant(t, db, "orders", "a", []string{"a-1"}, sh, w)
	if n := sh.runsOf("zz-1"); n != 0 {
		t.Errorf("the handler ran %d times for the unroutable message", n)
	}
}

// By default a Set has a member to refuse unroutable messages in: without one they would be
// nacked and redelivered for ever, freezing their consumer. New refuses a Config without
// Unresolved unless NackUnresolved says the router moves them away itself, Run refuses to start
// without the Unresolved member, and Remove refuses to take it out.
func TestSetUnresolvedRequired(t *testing.T) {
	if _, err := tenant.New(tenant.Config{Resolver: tenant.FromMetadata("tenant")}); err == nil || !strings.Contains(err.Error(), "NackUnresolved") {
		t.Errorf("New without Unresolved = %v, want an error that names NackUnresolved", err)
	}
	if _, err := tenant.New(tenant.Config{Resolver: tenant.FromMetadata("tenant"), Unresolved: "unrouted", NackUnresolved: true}); err == nil {
		t.Error("New with Unresolved and NackUnresolved: no error")
	}
	if _, err := tenant.New(tenant.Config{Resolver: tenant.FromMetadata("tenant"), NackUnresolved: true}); err != nil {
		t.Errorf("New with NackUnresolved: %v", err)
	}

	dbA, dbU := pgtest.DB(t), pgtest.DB(t)
	w := newWire()
	set := newSet(t, tenant.Config{Unresolved: "unrouted"}, map[string]*outbox.Outbox{"a": newMember(t, dbA, "", w)})
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := set.Run(ctx); err == nil || !strings.Contains(err.Error(), `"unrouted"`) {
		t.Errorf("Run without the Unresolved member = %v, want an error that names it", err)
	}
	if err := set.Add("unrouted", newMember(t, dbU, "", w)); err != nil {
		t.Fatal(err)
	}
	if err := set.Remove(ctx, "unrouted"); !errors.Is(err, tenant.ErrUnresolvedMember) {
		t.Errorf("Remove of the Unresolved member = %v, want ErrUnresolvedMember", err)
	}
	if _, ok := set.Member("unrouted"); !ok {
		t.Error("the Unresolved member was removed")
	}
	runCtx, stop := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- set.Run(runCtx) }()
	stop()
	if err := <-done; err != nil {
		t.Errorf("Run with the Unresolved member = %v", err)
	}
}

// The Set's Run returns within a member's ShutdownTimeout even while that member's background call
// ignores its context (its database accepts connections and never answers, and lib/pq waits while
// it connects), with an error that names the member; the other members stop as usual. Two such
// members cost one ShutdownTimeout (2 s), not one each.
func TestSetRunShutdownIsBounded(t *testing.T) {
	srv, err := silent.Start()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = srv.Close() })
	w := newWire()
	members := map[string]*outbox.Outbox{"unrouted": newMember(t, pgtest.DB(t), "", w)}
	for _, name := range []string{"stalled", "stalled2"} {
		// A pool each: members of one pool run at most PoolConcurrent (2) calls at once, and
		// the two of one stalled pool could be both of one member's.
		members[name] = stalledMember(t, srv, name, w)
	}
	set := newSet(t, tenant.Config{Unresolved: "unrouted"}, members)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- set.Run(ctx) }()
	// Each stalled member has two tasks (relay, cleanup): a third connection is of the second.
	if !srv.WaitConns(3, 30*time.Second) {
		t.Fatal("the stalled members' background work never connected")
	}
	cancel()
	cancelled := time.Now()
	select {
	case err := <-done:
		took := time.Since(cancelled)
		t.Logf("Run returned %s after its context ended: %v", took.Round(time.Millisecond), err)
		if took > 3500*time.Millisecond {
			t.Errorf("Run returned %s after its context ended, want about the members' ShutdownTimeout (2 s)", took.Round(time.Millisecond))
		}
		if err == nil || !strings.Contains(err.Error(), `member "stalled"`) || !strings.Contains(err.Error(), `member "stalled2"`) ||
			!strings.Contains(err.Error(), "ShutdownTimeout") {
			t.Errorf("Run = %v, want an error that names both stalled members and ShutdownTimeout", err)
		}
	case <-time.After(20 * time.Second):
		_ = srv.Close()
		<-done
		t.Fatal("Run did not return within 20 s of its context's end while a member's background call was stuck")
	}
}

// TestSetRefusesTwoMembersOnOneSetOfTables: two members on one pool whose tables are the same
// once the driver's default schema is applied (Schema "" and "public"), or whose prefixes are
// one: their claims would ack each other's messages as duplicates. The Set compared the
// configured strings, and took "" and "public" for two sets of tables.
func TestSetRefusesTwoMembersOnOneSetOfTables(t *testing.T) {
	db := pgtest.DB(t)
	open := func(schema, prefix string) *outbox.Outbox {
		ob, err := outbox.New(outbox.Config{DB: db, Driver: postgres.Driver{}, Publisher: newWire(), Schema: schema, TablePrefix: prefix})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = ob.Close() })
		return ob
	}
	set, err := tenant.New(tenant.Config{Resolver: tenant.FromMetadata("tenant"), NackUnresolved: true})
	if err != nil {
		t.Fatal(err)
	}
	if err := set.Add("a", open("", "")); err != nil {
		t.Fatal(err)
	}
	for name, ob := range map[string]*outbox.Outbox{"public": open("public", ""), "outbox_": open("", "outbox_")} {
		if err := set.Add(name, ob); err == nil || !strings.Contains(err.Error(), `its tables are member "a"'s`) {
			t.Errorf("Add(%q) = %v, want it refused: member a's tables", name, err)
		}
	}
	if err := set.Add("b", open("", "b_")); err != nil {
		t.Errorf("Add of a member with tables of its own: %v", err)
	}
}
