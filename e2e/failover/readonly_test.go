package failover_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/watermill-outbox/outbox"
	"github.com/watermill-outbox/outbox/drivers/outboxpgx"
	"github.com/watermill-outbox/outbox/drivers/postgres"
	"github.com/watermill-outbox/outbox/internal/logtest"
	"github.com/watermill-outbox/outbox/internal/pgserver"
	"github.com/watermill-outbox/outbox/internal/routertest"
	"github.com/watermill-outbox/outbox/outboxdriver"
)

// TestUnitOfWorkOnAStandbyIsReadOnly: a unit of work whose connection reaches a standby (an
// address not yet moved after a failover) fails with an error that wraps ErrReadOnly, in every
// form, whatever statement the standby refuses first: lib/pq begins with BEGIN READ WRITE, which
// a server in recovery refuses with SQLSTATE 0A000 (not 25006); pgx begins plainly, and the
// claim (pessimistic) or the COMMIT's claim (optimistic) is refused with 25006.
func TestUnitOfWorkOnAStandbyIsReadOnly(t *testing.T) {
	ctx := context.Background()
	primary := startServer(t, pgserver.Options{})
	admin := openDB(t, primary.DSN("postgres"))
	ob, err := outbox.New(outbox.Config{DB: admin, Driver: postgres.Driver{}, Publisher: discard{}, Logger: &logtest.Errors{}})
	if err != nil {
		t.Fatal(err)
	}
	if err := ob.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	standby := startServer(t, pgserver.Options{StandbyOf: fmt.Sprintf("host=127.0.0.1 port=%d user=postgres application_name=readonly1", primary.Port())})
	sdb := openDB(t, standby.DSN("postgres"))
	routertest.WaitUntil(t, "the standby has the outbox tables", func() (bool, string) {
		var ok bool
		err := sdb.QueryRow(`SELECT to_regclass('outbox_processed') IS NOT NULL`).Scan(&ok)
		return err == nil && ok, fmt.Sprint(err)
	})

	forms := map[string]func(t *testing.T) *outbox.Outbox{
		"database/sql": func(t *testing.T) *outbox.Outbox {
			ob, err := outbox.New(outbox.Config{DB: sdb, Driver: postgres.Driver{}, Publisher: discard{}, Logger: &logtest.Errors{}})
			if err != nil {
				t.Fatal(err)
			}
			return ob
		},
	}
	for _, mode := range []struct {
		name string
		c    outboxpgx.Concurrency
	}{{"pgx optimistic", outboxpgx.Optimistic}, {"pgx pessimistic", outboxpgx.Pessimistic}} {
		forms[mode.name] = func(t *testing.T) *outbox.Outbox {
			pool, err := pgxpool.New(ctx, standby.DSN("postgres"))
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(pool.Close)
			ob, err := outboxpgx.New(pool, outbox.Config{Publisher: discard{}, Logger: &logtest.Errors{}}, outboxpgx.WithConcurrency(mode.c))
			if err != nil {
				t.Fatal(err)
			}
			return ob
		}
	}
	for name, newOutbox := range forms {
		t.Run(name, func(t *testing.T) {
			ob := newOutbox(t)
			t.Cleanup(func() { _ = ob.Close() })
			msg := message.NewMessage(uuid.NewString(), nil)
			msg.SetContext(ctx)
			err := ob.Handle(msg, outbox.HandleParams{Consumer: "c", MessageID: msg.UUID}, func(msg *message.Message) ([]*message.Message, error) {
				return nil, outbox.Publish(msg.Context(), "out", message.NewMessage(uuid.NewString(), nil))
			})
			// The unit of work's own error, not only that of counting its attempt (also refused).
			own, _, _ := strings.Cut(fmt.Sprint(err), " (and counting the attempt failed")
			if !errors.Is(err, outboxdriver.ErrReadOnly) || !strings.Contains(own, outboxdriver.ErrReadOnly.Error()) {
				t.Errorf("a unit of work on a standby: %v, want an error wrapping ErrReadOnly", err)
			} else {
				t.Logf("reported: %v", err)
			}
		})
	}
}

// discard is a Publisher that takes everything.
type discard struct{}

func (discard) Publish(string, ...*message.Message) error { return nil }
func (discard) Close() error                              { return nil }
