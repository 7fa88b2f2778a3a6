package outbox_test

import (
	"context"
	"database/sql"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wsql "github.com/ThreeDotsLabs/watermill-sql/v3/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"

	"github.com/watermill-outbox/outbox"
	"github.com/watermill-outbox/outbox/drivers/postgres"
	"github.com/watermill-outbox/outbox/internal/pgserver"
)

// TestDatabaseRestartedMidMessage stops the whole PostgreSQL server (immediate shutdown, as a
// crash) while a handler runs, starts it again on the same data and port, and redelivers: the
// same *sql.DB recovers, the business change happens once and the effects are sent.
func TestDatabaseRestartedMidMessage(t *testing.T) {
	// t.TempDir's parents are private to this user; the server may run as the postgres OS user.
	base, err := os.MkdirTemp("", "outbox-restart-")
	if err != nil {
		t.Fatal(err)
	}
	defer os.RemoveAll(base)
	if err := os.Chmod(base, 0o755); err != nil {
		t.Fatal(err)
	}
	dataDir := filepath.Join(base, "data")
	srv, err := pgserver.Start(pgserver.Options{DataDir: dataDir})
	if err != nil {
		t.Fatal(err)
	}
	port := srv.Port()
	defer func() { _ = srv.Stop() }()
	db, err := sql.Open("postgres", srv.DSN("postgres"))
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	pub, err := wsql.NewPublisher(db, wsql.PublisherConfig{SchemaAdapter: brokerSchema(), AutoInitializeSchema: true}, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	ob, err := outbox.New(outbox.Config{DB: db, Driver: postgres.Driver{}, Publisher: pub})
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	if err := ob.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	if _, err := db.Exec(`CREATE TABLE applied (message_id text NOT NULL)`); err != nil {
		t.Fatal(err)
	}

	calls := 0
	h := func(msg *message.Message) ([]*message.Message, error) {
		calls++
		ctx := msg.Context()
		if _, err := outbox.Tx(ctx).ExecContext(ctx, `INSERT INTO applied VALUES ($1)`, msg.UUID); err != nil {
			return nil, err
		}
		if calls == 1 {
			// The server goes down mid-transaction, as in a crash, and comes back.
			if err := srv.Stop(); err != nil {
				return nil, err
			}
			if srv, err = pgserver.Start(pgserver.Options{DataDir: dataDir, Port: port}); err != nil {
				return nil, err
			}
		}
		return nil, outbox.Publish(ctx, "out_a", message.NewMessage(uuid.NewString(), []byte("reserved")))
	}
	msg := message.NewMessage(uuid.NewString(), nil)
	err = ob.Handle(msg.Copy(), outbox.HandleParams{Consumer: "c1", MessageID: msg.UUID}, h)
	if err == nil {
		t.Fatal("want an error from the transaction the restart cut off")
	}
	t.Logf("error during the restart: %v", err)

	deadline := time.Now().Add(30 * time.Second)
	for {
		err = ob.Handle(msg.Copy(), outbox.HandleParams{Consumer: "c1", MessageID: msg.UUID}, h)
		if err == nil {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("redelivery after the restart kept failing: %v", err)
		}
		time.Sleep(100 * time.Millisecond) // the pool drops the connections the restart broke
	}
	var applied, sent int
	if err := db.QueryRow(`SELECT count(*) FROM applied`).Scan(&applied); err != nil {
		t.Fatal(err)
	}
	if err := db.QueryRow(`SELECT count(*) FROM watermill_out_a`).Scan(&sent); err != nil {
		t.Fatal(err)
	}
	if applied != 1 || sent != 1 {
		t.Fatalf("after the restart: business rows %d, messages sent %d; want 1 and 1", applied, sent)
	}
}
