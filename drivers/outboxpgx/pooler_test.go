package outboxpgx_test

import (
	"context"
	"database/sql"
	"testing"

	_ "github.com/jackc/pgx/v5/stdlib" // database/sql driver "pgx"

	"github.com/watermill-outbox/outbox"
	"github.com/watermill-outbox/outbox/drivers/outboxpgx"
	"github.com/watermill-outbox/outbox/drivers/postgres"
	"github.com/watermill-outbox/outbox/internal/pgtest"
	"github.com/watermill-outbox/outbox/internal/poolertest"
)

// execMode is what the pgx forms need behind a pooler in transaction mode: statements sent with
// their parameters in one round trip, none prepared under a name.
const execMode = "default_query_exec_mode=exec"

// pgxStdlib is the database/sql form on pgx's stdlib driver.
var pgxStdlib = poolertest.Form{
	Setting: execMode,
	Open: func(t testing.TB, dsn, listenDSN string, cfg outbox.Config) (*outbox.Outbox, error) {
		db, err := sql.Open("pgx", dsn)
		if err != nil {
			return nil, err
		}
		t.Cleanup(func() { _ = db.Close() })
		if listenDSN == "" {
			listenDSN = dsn
		}
		// ListenDSN is lib/pq's: without the pgx parameter.
		cfg.DB, cfg.Driver = db, postgres.Driver{ListenDSN: poolertest.WithoutParam(t, listenDSN, "default_query_exec_mode")}
		ob, err := outbox.New(cfg)
		if err == nil {
			t.Cleanup(func() { _ = ob.Close() })
		}
		return ob, err
	},
	Write: func(ctx context.Context, id string) error {
		_, err := outbox.Tx(ctx).ExecContext(ctx, `INSERT INTO orders (id) VALUES ($1)`, id)
		return err
	},
}

// pgxPool is the pgx form in mode.
func pgxPool(mode outboxpgx.Concurrency) poolertest.Form {
	return poolertest.Form{
		Setting: execMode,
		Open: func(t testing.TB, dsn, listenDSN string, cfg outbox.Config) (*outbox.Outbox, error) {
			opts := []outboxpgx.Option{outboxpgx.WithConcurrency(mode)}
			if listenDSN != "" {
				opts = append(opts, outboxpgx.WithListenDSN(listenDSN))
			}
			return newOutbox(t, openPool(t, dsn, 8, nil), cfg, opts...)
		},
		Write: func(ctx context.Context, id string) error {
			_, err := outboxpgx.Tx(ctx).Exec(ctx, `INSERT INTO orders (id) VALUES ($1)`, id)
			return err
		},
	}
}

func TestBehindPgBouncer(t *testing.T) {
	forms := map[string]poolertest.Form{
		"stdlib":      pgxStdlib,
		"optimistic":  pgxPool(outboxpgx.Optimistic),
		"pessimistic": pgxPool(outboxpgx.Pessimistic),
	}
	for name, form := range forms {
		t.Run(name, func(t *testing.T) {
			t.Run("transaction", func(t *testing.T) { poolertest.Run(t, form, pgtest.PoolTransaction) })
			t.Run("session", func(t *testing.T) { poolertest.Run(t, form, pgtest.PoolSession) })
			t.Run("refused", func(t *testing.T) { poolertest.Refused(t, form) })
		})
	}
}
