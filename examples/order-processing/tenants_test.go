package main

import (
	"bytes"
	"context"
	"database/sql"
	"encoding/json"
	"fmt"
	"net/http"
	"path/filepath"
	"strings"
	"testing"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/lib/pq"

	"github.com/watermill-outbox/outbox/drivers/sqlite"
	"github.com/watermill-outbox/outbox/internal/pgtest"
)

// TestTenants runs the service with -tenants acme,globex on SQLite (a file per tenant) and the
// embedded NATS server, and checks that each tenant's orders live in its own database only.
func TestTenants(t *testing.T) {
	dir := t.TempDir()
	cfg, err := parseFlags([]string{"-data", dir, "-addr", "127.0.0.1:0", "-tenants", "acme,globex"})
	if err != nil {
		t.Fatal(err)
	}
	open := func(name string) *sql.DB {
		db, err := sql.Open("sqlite", sqlite.DSN(filepath.Join(dir, "orders-"+name+".db")))
		if err != nil {
			t.Fatal(err)
		}
		return db
	}
	testTenants(t, cfg, open)
	// The unresolved member's database has the outbox's tables only: no order can land there.
	db := open(unresolvedMember)
	defer db.Close()
	var n int
	if err := db.QueryRow(`SELECT count(*) FROM sqlite_master WHERE name = 'orders'`).Scan(&n); err != nil || n != 0 {
		t.Errorf("an orders table in the unresolved member's database: %d, %v", n, err)
	}
}

// TestTenantsOnPostgres is TestTenants with -postgres: the service creates a database per tenant
// on the server of the DSN, and the broker (-broker postgres) keeps its tables in the DSN's own
// database.
func TestTenantsOnPostgres(t *testing.T) {
	dsn := pgtest.DSN(t)
	cfg, err := parseFlags([]string{"-data", t.TempDir(), "-addr", "127.0.0.1:0", "-postgres", dsn, "-broker", "postgres", "-tenants", "acme,globex",
		"-console-password", "s3cret"})
	if err != nil {
		t.Fatal(err)
	}
	base, err := pq.NewConfig(dsn)
	if err != nil {
		t.Fatal(err)
	}
	admin, err := sql.Open("postgres", dsn)
	if err != nil {
		t.Fatal(err)
	}
	// Registered before the service starts, so it runs after the service stopped.
	t.Cleanup(func() {
		for _, name := range []string{"acme", "globex", unresolvedMember} {
			if _, err := admin.Exec(`DROP DATABASE IF EXISTS ` + pq.QuoteIdentifier(base.Database+"_"+name) + ` WITH (FORCE)`); err != nil {
				t.Errorf("drop the database of tenant %s: %v", name, err)
			}
		}
		_ = admin.Close()
	})
	open := func(name string) *sql.DB {
		c := base.Clone()
		c.Database = base.Database + "_" + name
		conn, err := pq.NewConnectorConfig(c)
		if err != nil {
			t.Fatal(err)
		}
		return sql.OpenDB(conn)
	}
	service, client := testTenants(t, cfg, open)
	// Neither the DSN's own database nor the unresolved member's has an orders table.
	unresolved := open(unresolvedMember)
	defer unresolved.Close()

	// Messages that name no tenant of the service, sent to the broker (its tables are in the
	// DSN's database), end as dead letters of the unresolved member, with the reason.
	pub, err := (&sqlBroker{db: admin, logger: watermill.NopLogger{}}).Publisher()
	if err != nil {
		t.Fatal(err)
	}
	defer pub.Close()
	placed := []byte(`{"order_id":"o-1","customer":"ada@example.com","sku":"espresso-beans","quantity":1,"amount_cents":1890}`)
	untagged, stranger := message.NewMessage(uuid.NewString(), placed), message.NewMessage(uuid.NewString(), placed)
	stranger.Metadata.Set(metadataTenant, "initech")
	if err := pub.Publish(topicOrderPlaced, untagged, stranger); err != nil {
		t.Fatal(err)
	}
	waitUntil(t, "two dead letters in the unresolved member", func() (bool, string) {
		rows, err := unresolved.Query(`SELECT message_id, consumer, reason FROM outbox_dead_letters ORDER BY dead_at`)
		if err != nil {
			return false, err.Error()
		}
		defer rows.Close()
		var got []string
		for rows.Next() {
			var id, consumer, reason string
			if err := rows.Scan(&id, &consumer, &reason); err != nil {
				t.Fatal(err)
			}
			if consumer != "inventory" || !strings.Contains(reason, "resolves to no member") ||
				(id != untagged.UUID && id != stranger.UUID) {
				t.Fatalf("dead letter %s of %s: %q", id, consumer, reason)
			}
			got = append(got, id)
		}
		return len(got) == 2, fmt.Sprintf("dead letters %v", got)
	})
	checkTenantsConsole(t, service, client, stranger.UUID)

	for name, db := range map[string]*sql.DB{"the DSN's": admin, "the unresolved member's": unresolved} {
		var none bool
		if err := db.QueryRow(`SELECT to_regclass('orders') IS NULL`).Scan(&none); err != nil || !none {
			t.Errorf("an orders table in %s database: %v", name, err)
		}
	}
}

// testTenants places orders for two tenants through the HTTP API, refuses requests that name no
// tenant of the service, waits until the orders are final, and checks in each tenant's database
// (opened by open) that its orders are there, the other tenant's are not, and every effect
// happened once.
// It returns the service's address and a client.
func testTenants(t *testing.T, cfg config, open func(tenant string) *sql.DB) (base string, client *http.Client) {
	out := &syncBuffer{}
	base, client = startService(t, cfg, out)

	do := func(method, path, tenant, body string) (int, Order) {
		t.Helper()
		req, err := http.NewRequest(method, base+path, strings.NewReader(body))
		if err != nil {
			t.Fatal(err)
		}
		if tenant != "" {
			req.Header.Set(headerTenant, tenant)
		}
		resp, err := client.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		var o Order
		_ = json.NewDecoder(resp.Body).Decode(&o)
		return resp.StatusCode, o
	}

	// Refused before anything is written: no tenant, a tenant the service does not serve, and the
	// member that only keeps the messages of unknown tenants.
	order := `{"customer":"ada@example.com","sku":"espresso-beans","quantity":1}`
	for tenant, want := range map[string]int{"": http.StatusBadRequest, "initech": http.StatusNotFound, unresolvedMember: http.StatusNotFound} {
		if code, _ := do(http.MethodPost, "/orders", tenant, order); code != want {
			t.Errorf("POST /orders with %s %q: %d, want %d", headerTenant, tenant, code, want)
		}
	}

	type placed struct {
		tenant, sku string
		quantity    int
		status      string // final
	}
	orders := []placed{
		{"acme", "espresso-beans", 2, "paid"},
		{"acme", "gooseneck-kettle", 4, "rejected"}, // 3 in stock
		{"globex", "espresso-beans", 1, "paid"},
		{"globex", "gooseneck-kettle", 1, "paid"}, // globex's stock is its own
	}
	ids := make([]string, len(orders))
	for i, o := range orders {
		code, got := do(http.MethodPost, "/orders", o.tenant,
			fmt.Sprintf(`{"customer":"ada@example.com","sku":%q,"quantity":%d}`, o.sku, o.quantity))
		if code != http.StatusCreated || got.ID == "" {
			t.Fatalf("POST /orders for %s: %d %+v", o.tenant, code, got)
		}
		ids[i] = got.ID
	}
	for i, o := range orders {
		// Final, and every event of the order handled: a paid order has StockReserved and
		// PaymentCaptured in its history, a rejected one StockRejected. Each step is a message
		// some consumer published: one without the tenant would be dead-lettered, and the order
		// would stop there.
		history := map[string]int{"paid": 2, "rejected": 1}[o.status]
		waitUntil(t, fmt.Sprintf("order %d of %s is %s", i, o.tenant, o.status), func() (bool, string) {
			code, got := do(http.MethodGet, "/orders/"+ids[i], o.tenant, "")
			if code != http.StatusOK {
				t.Fatalf("GET /orders/%s for %s: %d", ids[i], o.tenant, code)
			}
			return got.Status == o.status && len(got.History) == history, fmt.Sprintf("%s, history %+v", got.Status, got.History)
		})
		other := map[string]string{"acme": "globex", "globex": "acme"}[o.tenant]
		if code, _ := do(http.MethodGet, "/orders/"+ids[i], other, ""); code != http.StatusNotFound {
			t.Errorf("GET of an order of %s for %s: %d, want 404", o.tenant, other, code)
		}
	}

	ctx := context.Background()
	count := func(db *sql.DB, query string, args ...any) int {
		t.Helper()
		var n int
		if err := db.QueryRowContext(ctx, query, args...).Scan(&n); err != nil {
			t.Fatalf("%s: %v", query, err)
		}
		return n
	}
	dbs := map[string]*sql.DB{"acme": open("acme"), "globex": open("globex")}
	for _, db := range dbs {
		defer db.Close()
	}
	for i, o := range orders {
		for name, db := range dbs {
			want := map[bool]int{true: 1}[name == o.tenant]
			if n := count(db, `SELECT count(*) FROM orders WHERE id = $1`, ids[i]); n != want {
				t.Errorf("order %d of %s: %d rows in the orders of %s, want %d", i, o.tenant, n, name, want)
			}
			if n := count(db, `SELECT count(*) FROM reservations WHERE order_id = $1`, ids[i]); n != want {
				t.Errorf("order %d of %s: %d reservations in %s, want %d", i, o.tenant, n, name, want)
			}
			if o.status != "paid" {
				want = 0
			}
			if n := count(db, `SELECT count(*) FROM payments WHERE order_id = $1`, ids[i]); n != want {
				t.Errorf("order %d of %s: %d payments in %s, want %d", i, o.tenant, n, name, want)
			}
		}
	}
	for name, want := range map[string]map[string]int{
		"acme":   {"espresso-beans": 100000 - 2, "gooseneck-kettle": 3},
		"globex": {"espresso-beans": 100000 - 1, "gooseneck-kettle": 2},
	} {
		for sku, units := range want {
			if n := count(dbs[name], `SELECT available FROM stock WHERE sku = $1`, sku); n != units {
				t.Errorf("stock of %s at %s: %d, want %d", sku, name, n, units)
			}
		}
	}
	// One receipt per paid order (the receipt applier runs after the commit: give it a moment).
	waitUntil(t, "one receipt per paid order", func() (bool, string) {
		files, err := filepath.Glob(filepath.Join(cfg.dataDir, "mail", "*.eml"))
		if err != nil {
			t.Fatal(err)
		}
		var state []string
		ok := len(files) == 3
		for i, o := range orders {
			n := 0
			for _, f := range files {
				if strings.HasPrefix(filepath.Base(f), ids[i]+".") {
					n++
				}
			}
			if n != map[string]int{"paid": 1}[o.status] {
				ok = false
			}
			state = append(state, fmt.Sprintf("order %d (%s): %d", i, o.status, n))
		}
		return ok, strings.Join(state, ", ")
	})

	// The members' metrics carry their member name; the unresolved member refused nothing.
	waitUntil(t, "/metrics names the members", func() (bool, string) {
		families := scrape(t, client, base+"/metrics")
		f := families["outbox_messages_handled_total"]
		acme := counterValue(f, map[string]string{"outbox_member": "acme", "outbox_outcome": "processed"})
		globex := counterValue(f, map[string]string{"outbox_member": "globex", "outbox_outcome": "processed"})
		unresolved := counterValue(f, map[string]string{"outbox_member": unresolvedMember})
		if unresolved != 0 {
			t.Fatalf("the unresolved member handled %v messages, want none", unresolved)
		}
		// acme: 2 by inventory, 1 by payment, 3 by the status consumers; globex: 2, 2, 4.
		return acme == 6 && globex == 8, fmt.Sprintf("processed by acme %v (want 6), by globex %v (want 8)", acme, globex)
	})
	waitUntil(t, "GET /healthz reports healthy", func() (bool, string) {
		resp, err := client.Get(base + "/healthz")
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		var body bytes.Buffer
		_, _ = body.ReadFrom(resp.Body)
		return resp.StatusCode == http.StatusOK, fmt.Sprintf("%s %s", resp.Status, body.String())
	})
	waitUntil(t, "a progress line per tenant", func() (bool, string) {
		s := out.String()
		return strings.Contains(s, "acme: orders placed 2  paid 1  rejected 1") &&
			strings.Contains(s, "globex: orders placed 2  paid 2  rejected 0"), "printed:\n" + s
	})
	return base, client
}

// TestTenantsFlags: -tenants names are checked before they reach a file name or SQL, and the
// combinations it does not run with are refused.
func TestTenantsFlags(t *testing.T) {
	for _, c := range []struct {
		args []string
		err  string
	}{
		{[]string{"-tenants", "acme,globex"}, ""},
		{[]string{"-tenants", " acme , globex "}, ""},
		{[]string{"-tenants", "acme,../etc"}, `"../etc" is not a tenant name`},
		{[]string{"-tenants", `acme,x"; DROP DATABASE y`}, "is not a tenant name"},
		{[]string{"-tenants", "Acme"}, "is not a tenant name"},
		{[]string{"-tenants", "acme,,globex"}, `"" is not a tenant name`},
		{[]string{"-tenants", "acme,acme"}, "named twice"},
		{[]string{"-tenants", "unresolved"}, "keeps the messages of unknown tenants"},
		{[]string{"-tenants", "acme", "-mysql", "root@tcp(localhost:3306)/orders"}, "-tenants is supported on SQLite and PostgreSQL"},
		{[]string{"-tenants", "acme", "-postgres", "postgres://localhost/orders", "-form", "pgx"}, "-form sql"},
		{[]string{"-tenants", "acme", "-chaos"}, "-tenants does not run with -chaos"},
	} {
		cfg, err := parseFlags(c.args)
		switch {
		case c.err == "" && err != nil:
			t.Errorf("%q: %v", c.args, err)
		case c.err == "" && strings.Join(cfg.tenants, ",") != "acme,globex":
			t.Errorf("%q: tenants %q", c.args, cfg.tenants)
		case c.err != "" && (err == nil || !strings.Contains(err.Error(), c.err)):
			t.Errorf("%q: error %v, want one containing %q", c.args, err, c.err)
		}
	}
	t.Setenv("ORDERS_TENANTS", "acme,globex")
	if cfg, err := parseFlags(nil); err != nil || strings.Join(cfg.tenants, ",") != "acme,globex" {
		t.Errorf("ORDERS_TENANTS: %q, %v", cfg.tenants, err)
	}
}

// checkTenantsConsole: with -tenants the console at /outbox/ (behind the operator's password)
// lists every member, and each member's page shows its own database: the dead letter of a message
// for an unknown tenant (deadID) on the unresolved member's page, not on acme's; a name that is
// not a member is 404.
func checkTenantsConsole(t *testing.T, base string, client *http.Client, deadID string) {
	t.Helper()
	get := func(path string, auth bool) (int, string) {
		t.Helper()
		req, _ := http.NewRequest(http.MethodGet, base+path, nil)
		if auth {
			req.SetBasicAuth("operator", "s3cret")
		}
		resp, err := client.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		var b bytes.Buffer
		_, _ = b.ReadFrom(resp.Body)
		return resp.StatusCode, b.String()
	}
	if code, _ := get("/outbox/", false); code != http.StatusUnauthorized {
		t.Errorf("the console without the password: %d, want 401", code)
	}
	code, body := get("/outbox/", true)
	if code != http.StatusOK {
		t.Fatalf("the page of members: %d\n%s", code, body)
	}
	for _, name := range []string{"acme", "globex", unresolvedMember} {
		if !strings.Contains(body, `<tr data-member="`+name+`"><td><a href="./?member=`+name+`">`) {
			t.Errorf("the page of members does not list %s:\n%s", name, body)
		}
	}
	code, body = get("/outbox/?member="+unresolvedMember, true)
	if code != http.StatusOK || !strings.Contains(body, `data-dead="`+deadID+`"`) {
		t.Errorf("the unresolved member's page: %d, want the dead letter %s:\n%s", code, deadID, body)
	}
	code, body = get("/outbox/?member=acme", true)
	if code != http.StatusOK || strings.Contains(body, deadID) || !strings.Contains(body, "No dead letters.") {
		t.Errorf("acme's page: %d, want no dead letter:\n%s", code, body)
	}
	if code, _ := get("/outbox/?member=initech", true); code != http.StatusNotFound {
		t.Errorf("the page of a tenant the service does not serve: %d, want 404", code)
	}
}
