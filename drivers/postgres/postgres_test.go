package postgres_test

import (
	"context"
	"database/sql"
	"errors"
	"os"
	"strings"
	"sync"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/google/uuid"

	"github.com/watermill-outbox/outbox"
	"github.com/watermill-outbox/outbox/drivers/postgres"
	"github.com/watermill-outbox/outbox/internal/pgtest"
	"github.com/watermill-outbox/outbox/outboxdriver"
	"github.com/watermill-outbox/outbox/store"
)

func TestMain(m *testing.M) { os.Exit(pgtest.Run(m)) }

func newOutbox(t *testing.T, db *sql.DB, schema, prefix string) (*outbox.Outbox, error) {
	t.Helper()
	pub := gochannel.NewGoChannel(gochannel.Config{}, nil)
	t.Cleanup(func() { _ = pub.Close() })
	return outbox.New(outbox.Config{DB: db, Driver: postgres.Driver{}, Publisher: pub, Schema: schema, TablePrefix: prefix})
}

func TestMigrateIsIdempotentAndSafeConcurrently(t *testing.T) {
	db := pgtest.DB(t)
	ctx := context.Background()
	var wg sync.WaitGroup
	errs := make([]error, 6)
	for i := range errs {
		ob, err := newOutbox(t, db, "billing", "ob_")
		if err != nil {
			t.Fatal(err)
		}
		wg.Add(1)
		go func() { defer wg.Done(); errs[i] = ob.Migrate(ctx) }()
	}
	wg.Wait()
	for _, err := range errs {
		if err != nil {
			t.Fatal(err)
		}
	}
	ob, _ := newOutbox(t, db, "billing", "ob_")
	if err := ob.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	if err := ob.CheckSchema(ctx); err != nil {
		t.Fatal(err)
	}
	var n int
	if err := db.QueryRow(`SELECT count(*) FROM billing.ob_migrations`).Scan(&n); err != nil {
		t.Fatal(err)
	}
	if want := len(mustMigrations(t)); n != want {
		t.Fatalf("migrations recorded: %d, want each of the %d once", n, want)
	}
	// The tables live where they were asked for, and nothing leaked into public.
	if err := db.QueryRow(`SELECT count(*) FROM pg_tables WHERE schemaname = 'billing' AND tablename LIKE 'ob\_%'`).Scan(&n); err != nil {
		t.Fatal(err)
	}
	names, err := store.NewNames("billing", "ob_")
	if err != nil {
		t.Fatal(err)
	}
	if want := len(names.Tables()); n != want {
		t.Fatalf("tables in billing: %d, want %d", n, want)
	}
	if err := db.QueryRow(`SELECT count(*) FROM pg_tables WHERE schemaname = 'public'`).Scan(&n); err != nil {
		t.Fatal(err)
	}
	if n != 0 {
		t.Fatalf("tables in public: %d, want 0", n)
	}
}

func TestMissingTablesNameTheFix(t *testing.T) {
	db := pgtest.DB(t)
	ob, err := newOutbox(t, db, "", "")
	if err != nil {
		t.Fatal(err)
	}
	err = ob.CheckSchema(context.Background())
	if !errors.Is(err, outboxdriver.ErrSchemaMissing) || !strings.Contains(err.Error(), "Migrate") {
		t.Fatalf("want ErrSchemaMissing naming Migrate, got %v", err)
	}
	// The same hint reaches a consumer that runs before Migrate.
	msg := message.NewMessage(uuid.NewString(), nil)
	err = ob.Handle(msg, outbox.HandleParams{Consumer: "c", MessageID: msg.UUID}, func(*message.Message) ([]*message.Message, error) { return nil, nil })
	if !errors.Is(err, outboxdriver.ErrSchemaMissing) {
		t.Fatalf("Handle before Migrate: want ErrSchemaMissing, got %v", err)
	}
	// Tables from an older build are reported as outdated.
	if err := ob.Migrate(context.Background()); err != nil {
		t.Fatal(err)
	}
	if _, err := db.Exec(`DELETE FROM outbox_migrations`); err != nil {
		t.Fatal(err)
	}
	if err := ob.CheckSchema(context.Background()); !errors.Is(err, outboxdriver.ErrSchemaOutdated) {
		t.Fatalf("want ErrSchemaOutdated, got %v", err)
	}
}

func TestIdentifiersAreValidated(t *testing.T) {
	db := pgtest.DB(t)
	for _, c := range []struct{ schema, prefix string }{
		{`public"; DROP TABLE x; --`, ""},
		{"", "a-b"},
		{"Upper", ""},
		{"", "1abc"},
		{"", strings.Repeat("p", 41)},
		{"", "x\x00"},
	} {
		if _, err := newOutbox(t, db, c.schema, c.prefix); err == nil {
			t.Fatalf("schema %q prefix %q: want an error", c.schema, c.prefix)
		}
	}
}

func mustMigrations(t testing.TB) []store.Migration {
	t.Helper()
	ms, err := postgres.Migrations("", "")
	if err != nil {
		t.Fatal(err)
	}
	return ms
}
