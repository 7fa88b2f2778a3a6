package postgres_test

import (
	"context"
	"database/sql"
	"errors"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

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
	// The partitions of the effects table and its rotation (migration 023) besides.
	if want := len(names.Tables()) + 4; n != want {
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

// TestDropIndexMigrationGivesUpBehindALongTransaction: migration 015 drops an index of the effects
// table, which waits for every transaction that uses the table and holds back the new ones while
// it waits. Behind a transaction that does not end, it gives up after its lock_timeout (10 s)
// instead of stalling every unit of work, and a later Migrate applies it.
func TestDropIndexMigrationGivesUpBehindALongTransaction(t *testing.T) {
	db := pgtest.DB(t)
	ctx := context.Background()
	ob, err := newOutbox(t, db, "", "lt_")
	if err != nil {
		t.Fatal(err)
	}
	if err := ob.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	// Back to version 14, with the index.
	for _, q := range []string{`DELETE FROM lt_migrations WHERE version >= 15`,
		`CREATE INDEX lt_effects_pending ON lt_effects (id) WHERE dispatched_at IS NULL`} {
		if _, err := db.Exec(q); err != nil {
			t.Fatal(err)
		}
	}
	long, err := db.BeginTx(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer long.Rollback()
	if _, err := long.Exec(`SELECT count(*) FROM lt_effects`); err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	err = ob.Migrate(ctx)
	waited := time.Since(start)
	if err == nil || !strings.Contains(err.Error(), "lock timeout") {
		t.Fatalf("Migrate behind a transaction on the effects table: %v after %v; want the lock timeout", err, waited)
	}
	if waited > 30*time.Second {
		t.Fatalf("Migrate gave up after %v, want about 10 s", waited)
	}
	// Meanwhile a unit of work's statement on the table went through at once again.
	if _, err := db.Exec(`SELECT count(*) FROM lt_effects`); err != nil {
		t.Fatal(err)
	}
	if err := long.Rollback(); err != nil {
		t.Fatal(err)
	}
	if err := ob.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	var n int
	if err := db.QueryRow(`SELECT count(*) FROM pg_indexes WHERE indexname = 'lt_effects_pending'`).Scan(&n); err != nil {
		t.Fatal(err)
	}
	if n != 0 {
		t.Fatal("effects_pending still there after the migration")
	}
}

// TestProcessedTimeMigration: migration 016 replaces the BRIN index on processed_at with a B-tree.
// An index of its name that a failed CREATE INDEX CONCURRENTLY left invalid (the way to build it
// on a large table without blocking claims, docs/operations.md) is built again; a valid one
// built that way is kept.
func TestProcessedTimeMigration(t *testing.T) {
	db := pgtest.DB(t)
	ctx := context.Background()
	ob, err := newOutbox(t, db, "", "pt_")
	if err != nil {
		t.Fatal(err)
	}
	if err := ob.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	index := func() (def string, valid bool) {
		t.Helper()
		err := db.QueryRow(`SELECT pg_get_indexdef(i.indexrelid), i.indisvalid FROM pg_index i
			WHERE i.indexrelid = 'pt_processed_time'::regclass`).Scan(&def, &valid)
		if err != nil {
			t.Fatal(err)
		}
		return def, valid
	}
	back := func(build ...string) {
		t.Helper()
		for _, q := range append([]string{`DELETE FROM pt_migrations WHERE version >= 16`,
			`DROP INDEX pt_processed_time`,
			`CREATE INDEX pt_processed_processed_at ON pt_processed USING brin (processed_at)`}, build...) {
			if _, err := db.Exec(q); err != nil && !strings.Contains(q, "CONCURRENTLY") {
				t.Fatalf("%s: %v", q, err)
			}
		}
	}
	after := func(name string) {
		t.Helper()
		if err := ob.Migrate(ctx); err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		def, valid := index()
		if !valid || def != `CREATE INDEX pt_processed_time ON public.pt_processed USING btree (processed_at)` {
			t.Errorf("%s: %s (valid: %v)", name, def, valid)
		}
		var brin int
		if err := db.QueryRow(`SELECT count(*) FROM pg_indexes WHERE indexname = 'pt_processed_processed_at'`).Scan(&brin); err != nil {
			t.Fatal(err)
		}
		if brin != 0 {
			t.Errorf("%s: the BRIN index on processed_at is still there", name)
		}
	}

	back()
	after("from version 15")

	// Two claims at the same time: a unique index built concurrently fails and stays, invalid.
	back(`INSERT INTO pt_processed (consumer, message_id, processed_at) VALUES ('c', 'a', '2026-01-01'), ('c', 'b', '2026-01-01')`,
		`CREATE UNIQUE INDEX CONCURRENTLY pt_processed_time ON pt_processed (processed_at)`)
	if def, valid := index(); valid || !strings.Contains(def, "UNIQUE") {
		t.Fatalf("the failed concurrent build left %s (valid: %v), want an invalid unique index", def, valid)
	}
	after("over an invalid index")

	// Built beforehand, concurrently: kept as it is (its OID with it).
	back(`CREATE INDEX CONCURRENTLY pt_processed_time ON pt_processed (processed_at)`)
	var before, kept uint32
	if err := db.QueryRow(`SELECT 'pt_processed_time'::regclass::oid`).Scan(&before); err != nil {
		t.Fatal(err)
	}
	after("over an index built beforehand")
	if err := db.QueryRow(`SELECT 'pt_processed_time'::regclass::oid`).Scan(&kept); err != nil {
		t.Fatal(err)
	}
	if kept != before {
		t.Errorf("the index built beforehand was built again")
	}
}
