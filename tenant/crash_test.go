package tenant_test

import (
	"context"
	"database/sql"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/watermill-outbox/outbox"
	"github.com/watermill-outbox/outbox/drivers/postgres"
	"github.com/watermill-outbox/outbox/internal/pgtest"
	"github.com/watermill-outbox/outbox/internal/settest"
)

// The crash matrix over a Set of database/sql members (internal/settest): two tenants with a
// database each, or a schema (TablePrefix) each on one pool, one of them crashing at every step.
func TestSetCrashMatrix(t *testing.T) {
	member := func(t *testing.T, db *sql.DB, prefix string, pub message.Publisher, failpoint func(context.Context, string) error) settest.Member {
		ob, err := outbox.New(outbox.Config{DB: db, Driver: postgres.Driver{}, Publisher: pub, TablePrefix: prefix,
			RelayInterval: 50 * time.Millisecond, RetryDelay: time.Millisecond, Failpoint: failpoint})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = ob.Close() })
		if err := ob.Migrate(context.Background()); err != nil {
			t.Fatal(err)
		}
		table := prefix + "orders"
		if _, err := db.Exec(`CREATE TABLE ` + table + ` (id text, tenant text)`); err != nil {
			t.Fatal(err)
		}
		return settest.Member{
			Ob: ob,
			Insert: func(ctx context.Context, id, tn string) error {
				_, err := outbox.Tx(ctx).ExecContext(ctx, `INSERT INTO `+table+` VALUES ($1, $2)`, id, tn)
				return err
			},
			Orders: func(context.Context) (map[string][]string, error) { return rows(t, db, table), nil },
		}
	}
	var mu sync.Mutex
	shared := map[*testing.T]*sql.DB{} // the schemas layout's one database per scenario
	settest.CrashMatrix(t, map[string]settest.NewMember{
		"databases": func(t *testing.T, _ string, pub message.Publisher, fp func(context.Context, string) error) settest.Member {
			return member(t, pgtest.DB(t), "", pub, fp)
		},
		"schemas": func(t *testing.T, name string, pub message.Publisher, fp func(context.Context, string) error) settest.Member {
			mu.Lock()
			db := shared[t]
			if db == nil {
				db = pgtest.DB(t)
				shared[t] = db
			}
			mu.Unlock()
			return member(t, db, name+"_", pub, fp)
		},
	}, true)
}
