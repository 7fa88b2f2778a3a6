package console_test

import (
	"context"
	"database/sql"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	_ "github.com/lib/pq"

	"github.com/watermill-outbox/outbox"
	"github.com/watermill-outbox/outbox/console"
	"github.com/watermill-outbox/outbox/drivers/postgres"
	"github.com/watermill-outbox/outbox/internal/pgtest"
	"github.com/watermill-outbox/outbox/ops"
	"github.com/watermill-outbox/outbox/tenant"
)

// The console mounted under /outbox/ of the service's own mux, behind the service's
// authentication; only the user "alice" may repair. A request without a user is refused.
func ExampleNew() {
	dsn, drop, err := pgtest.Database() // the service's database; here a fresh one for the example
	if err != nil {
		panic(err)
	}
	defer drop()
	db, err := sql.Open("postgres", dsn)
	if err != nil {
		panic(err)
	}
	defer db.Close()
	pubSub := gochannel.NewGoChannel(gochannel.Config{}, watermill.NopLogger{})
	defer pubSub.Close()
	ob, err := outbox.New(outbox.Config{DB: db, Driver: postgres.Driver{}, Publisher: pubSub})
	if err != nil {
		panic(err)
	}
	if err := ob.Migrate(context.Background()); err != nil {
		panic(err)
	}

	o, err := ops.ForOutbox(ob)
	if err != nil {
		panic(err)
	}
	h, err := console.New(o, console.Options{
		Authenticate: func(r *http.Request) (string, bool) {
			user := r.Header.Get("X-User") // stands for the service's session or SSO check
			return user, user != ""
		},
		Authorize: func(r *http.Request, user string, a console.Action) bool { return user == "alice" },
	})
	if err != nil {
		panic(err)
	}
	mux := http.NewServeMux()
	mux.Handle("/outbox/", http.StripPrefix("/outbox", h))

	for _, user := range []string{"alice", ""} {
		req := httptest.NewRequest(http.MethodGet, "/outbox/", nil)
		if user != "" {
			req.Header.Set("X-User", user)
		}
		rec := httptest.NewRecorder()
		mux.ServeHTTP(rec, req)
		fmt.Printf("user %q: %d, the page names the parked effects: %v\n",
			user, rec.Code, strings.Contains(strings.ToLower(rec.Body.String()), "parked"))
	}
	// Output:
	// user "alice": 200, the page names the parked effects: true
	// user "": 401, the page names the parked effects: false
}

// The console of a tenant.Set: its root lists the members, and ?member=NAME picks one, whose
// page and repairs are on that member's database only. It follows the Set: a tenant added while
// the process runs is served at once.
func ExampleNewMembersFunc() {
	set, err := tenant.New(tenant.Config{Metadata: "tenant", Unresolved: "unresolved"})
	if err != nil {
		panic(err)
	}
	// add adds a member on a database of its own, and returns what drops the database.
	add := func(name string) (drop func()) {
		dsn, dropDB, err := pgtest.Database() // the member's database; here a fresh one for the example
		if err != nil {
			panic(err)
		}
		db, err := sql.Open("postgres", dsn)
		if err != nil {
			panic(err)
		}
		ob, err := outbox.New(outbox.Config{DB: db, Driver: postgres.Driver{}, Publisher: gochannel.NewGoChannel(gochannel.Config{}, watermill.NopLogger{})})
		if err != nil {
			panic(err)
		}
		if err := ob.Migrate(context.Background()); err != nil {
			panic(err)
		}
		if err := set.Add(name, ob); err != nil {
			panic(err)
		}
		return func() { _ = db.Close(); dropDB() }
	}
	for _, name := range []string{"acme", "globex", "unresolved"} {
		drop := add(name)
		defer drop()
	}

	h, err := console.NewMembersFunc(console.MembersOf(set), console.Options{
		Authenticate: func(r *http.Request) (string, bool) { return "alice", true }, // the service's own check
		Authorize: func(r *http.Request, user string, a console.Action) bool {
			return user == "alice" && a.Member != "globex" // per tenant
		},
	})
	if err != nil {
		panic(err)
	}
	show := func(path string) {
		rec := httptest.NewRecorder()
		h.ServeHTTP(rec, httptest.NewRequest(http.MethodGet, path, nil))
		fmt.Printf("%s: %d, lists the members: %v\n", path, rec.Code, strings.Contains(rec.Body.String(), `id="members"`))
	}
	show("/")
	show("/?member=acme")
	show("/?member=initech")
	drop := add("initech") // a tenant signs up
	defer drop()
	show("/?member=initech")
	// Output:
	// /: 200, lists the members: true
	// /?member=acme: 200, lists the members: false
	// /?member=initech: 404, lists the members: false
	// /?member=initech: 200, lists the members: false
}
