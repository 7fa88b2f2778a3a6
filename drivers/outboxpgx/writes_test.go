package outboxpgx_test

import (
	"context"
	"database/sql"
	"fmt"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/watermill-outbox/outbox"
	"github.com/watermill-outbox/outbox/drivers/outboxpgx"
	"github.com/watermill-outbox/outbox/internal/pgtest"
	"github.com/watermill-outbox/outbox/outboxtest"
)

// writesPerMessage is how many units of work each form runs in TestWritesPerMessage.
const writesPerMessage = 40

// measureWrites runs n units of work through a fresh pgx-form Outbox in mode and returns what
// they wrote to each table, the background marks included. The pool is closed before the counts
// are read (a backend reports them at its exit), and the migration's writes are left out.
func measureWrites(t *testing.T, n int, mode outboxpgx.Concurrency, unit func(ctx context.Context, ob *outbox.Outbox, i int) error) map[string]pgtest.Writes {
	t.Helper()
	ctx := context.Background()
	dsn := outboxtest.DSN(t)
	reader, err := sql.Open("postgres", dsn)
	if err != nil {
		t.Fatal(err)
	}
	defer reader.Close()
	phase := func(do func(ob *outbox.Outbox)) {
		pool, err := pgxpool.New(ctx, dsn)
		if err != nil {
			t.Fatal(err)
		}
		defer pool.Close()
		ob, err := outboxpgx.New(pool, outbox.Config{Publisher: &outboxtest.Recorder{}}, outboxpgx.WithConcurrency(mode))
		if err != nil {
			t.Fatal(err)
		}
		do(ob)
		if err := ob.Close(); err != nil { // waits for the background marks
			t.Fatal(err)
		}
	}
	phase(func(ob *outbox.Outbox) {
		if err := ob.Migrate(ctx); err != nil {
			t.Fatal(err)
		}
		if _, err := reader.Exec(`CREATE TABLE applied (message_id text NOT NULL, note text NOT NULL DEFAULT '')`); err != nil {
			t.Fatal(err)
		}
	})
	before := pgtest.TableWrites(t, reader, "public")
	phase(func(ob *outbox.Outbox) {
		for i := range n {
			if err := unit(ctx, ob, i); err != nil {
				t.Fatalf("unit %d: %v", i, err)
			}
		}
	})
	got, names := pgtest.WritesSince(pgtest.TableWrites(t, reader, "public"), before)
	for _, name := range names {
		t.Logf("%-20s per unit: %s", name, got[name].Per(n))
	}
	return got
}

// atMost fails the test unless every count of got is at most n times the one of want.
func atMost(t *testing.T, what string, got pgtest.Writes, n int, want pgtest.Writes) {
	t.Helper()
	if got.Inserts > want.Inserts*int64(n) || got.Updates > want.Updates*int64(n) ||
		got.NonHOT() > want.NonHOT()*int64(n) || got.Deletes > want.Deletes*int64(n) {
		t.Errorf("%s: %s per unit, want at most %s", what, got.Per(n), want.Per(1))
	}
}

// TestWritesPerMessage counts the row versions a unit of work with two effects writes to the
// outbox tables in each mode of the pgx form, its mark included (docs/benchmarks.md, "Writes per
// message"; the database/sql forms: the root module's test of that name). The bounds are what the
// forms write today; a change that writes more per message fails here.
func TestWritesPerMessage(t *testing.T) {
	record := func(ctx context.Context, tx pgx.Tx, id string) error {
		if _, err := tx.Exec(ctx, `INSERT INTO applied (message_id) VALUES ($1)`, id); err != nil {
			return err
		}
		if err := outbox.Publish(ctx, "out_a", message.NewMessage(uuid.NewString(), []byte(`{"step":1}`))); err != nil {
			return err
		}
		return outbox.Publish(ctx, "out_b", message.NewMessage(uuid.NewString(), []byte(`{"step":2}`)))
	}
	consume := func(ctx context.Context, ob *outbox.Outbox, i int) error {
		msg := message.NewMessage(fmt.Sprint("m-", i), nil)
		return ob.Handle(msg, outbox.HandleParams{Consumer: "c1", MessageID: msg.UUID}, func(msg *message.Message) ([]*message.Message, error) {
			return nil, record(msg.Context(), outboxpgx.Tx(msg.Context()), msg.UUID)
		})
	}

	t.Run("optimistic", func(t *testing.T) {
		// The claim is written at COMMIT with the effects in it; the mark clears them.
		got := measureWrites(t, writesPerMessage, outboxpgx.Optimistic, consume)
		atMost(t, "claims", got["outbox_processed"], writesPerMessage, pgtest.Writes{Inserts: 1, Updates: 1, HOT: 1})
		atMost(t, "effect rows", got["outbox_effects"], writesPerMessage, pgtest.Writes{})
	})
	t.Run("pessimistic", func(t *testing.T) {
		// The claim is written at BEGIN, the effects as rows at COMMIT; the mark deletes them.
		got := measureWrites(t, writesPerMessage, outboxpgx.Pessimistic, consume)
		atMost(t, "claims", got["outbox_processed"], writesPerMessage, pgtest.Writes{Inserts: 1})
		atMost(t, "effect rows", got["outbox_effects"], writesPerMessage, pgtest.Writes{Inserts: 2, Deletes: 2})
	})
	t.Run("boundary", func(t *testing.T) {
		got := measureWrites(t, writesPerMessage, outboxpgx.Optimistic, func(ctx context.Context, ob *outbox.Outbox, i int) error {
			return outboxpgx.InTx(ctx, ob, func(ctx context.Context, tx pgx.Tx) error { return record(ctx, tx, fmt.Sprint("b-", i)) })
		})
		atMost(t, "claims", got["outbox_processed"], writesPerMessage, pgtest.Writes{})
		atMost(t, "effect rows", got["outbox_effects"], writesPerMessage, pgtest.Writes{Inserts: 2, Deletes: 2})
	})
}
