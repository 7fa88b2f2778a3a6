// Package pgx runs the framework through pgx's database/sql driver (kept out of the library
// module's requirements).
package pgx_test

import (
	"context"
	"database/sql"
	"errors"
	"os"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/google/uuid"
	_ "github.com/jackc/pgx/v5/stdlib"

	"github.com/watermill-outbox/outbox"
	"github.com/watermill-outbox/outbox/drivers/postgres"
	"github.com/watermill-outbox/outbox/internal/pgtest"
)

func TestMain(m *testing.M) { os.Exit(pgtest.Run(m)) }

func newOutbox(t *testing.T, db *sql.DB) (*outbox.Outbox, error) {
	t.Helper()
	pub := gochannel.NewGoChannel(gochannel.Config{}, nil)
	t.Cleanup(func() { _ = pub.Close() })
	return outbox.New(outbox.Config{DB: db, Driver: postgres.Driver{}, Publisher: pub})
}

// TestPgxStdlib runs the unit of work through pgx's database/sql driver instead of lib/pq.
func TestPgxStdlib(t *testing.T) {
	db, err := sql.Open("pgx", pgtest.DSN(t))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = db.Close() })
	ctx := context.Background()
	ob, err := newOutbox(t, db)
	if err != nil {
		t.Fatal(err)
	}
	if err := ob.CheckSchema(ctx); !errors.Is(err, outbox.ErrSchemaMissing) {
		t.Fatalf("pgx errors must be classified too: got %v", err)
	}
	if err := ob.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	if _, err := db.Exec(`CREATE TABLE applied (id text)`); err != nil {
		t.Fatal(err)
	}
	calls := 0
	h := func(msg *message.Message) ([]*message.Message, error) {
		calls++
		ctx := msg.Context()
		if _, err := outbox.Tx(ctx).ExecContext(ctx, `INSERT INTO applied VALUES ($1)`, msg.UUID); err != nil {
			return nil, err
		}
		out := message.NewMessage(uuid.NewString(), []byte("\x00\xff"))
		out.Metadata.Set("k\x00", "\xff")
		return nil, outbox.Publish(ctx, "t", out)
	}
	msg := message.NewMessage(uuid.NewString(), nil)
	for i := 0; i < 3; i++ {
		if err := ob.Handle(msg.Copy(), outbox.HandleParams{Consumer: "c", MessageID: msg.UUID}, h); err != nil {
			t.Fatal(err)
		}
	}
	ob.FlushMarks() // marks are written in the background
	var n, pending int
	if err := db.QueryRow(`SELECT count(*) FROM applied`).Scan(&n); err != nil {
		t.Fatal(err)
	}
	if err := db.QueryRow(`SELECT count(*) FROM outbox_effects_all WHERE dispatched_at IS NULL`).Scan(&pending); err != nil {
		t.Fatal(err)
	}
	if calls != 1 || n != 1 || pending != 0 {
		t.Fatalf("calls=%d rows=%d pending=%d", calls, n, pending)
	}
}
