package postgres_test

import (
	"context"
	"database/sql"
	"testing"

	"github.com/watermill-outbox/outbox"
	"github.com/watermill-outbox/outbox/drivers/postgres"
	"github.com/watermill-outbox/outbox/internal/pgtest"
	"github.com/watermill-outbox/outbox/internal/poolertest"
)

// libpq is the database/sql form on lib/pq: behind a pooler in transaction mode it needs
// binary_parameters=yes, with which lib/pq sends a statement and its parameters at once. Its
// units move the effects kept in their claim to rows at their second or third record (a small
// MaxInlineBytes), so that the spill runs through the pooler too.
var libpq = poolertest.Form{
	Setting: "binary_parameters=yes",
	Open: func(t testing.TB, dsn, listenDSN string, cfg outbox.Config) (*outbox.Outbox, error) {
		db, err := sql.Open("postgres", dsn)
		if err != nil {
			return nil, err
		}
		t.Cleanup(func() { _ = db.Close() })
		cfg.DB, cfg.Driver = db, postgres.Driver{ListenDSN: listenDSN, MaxInlineBytes: 250}
		if listenDSN == "" {
			cfg.Driver = postgres.Driver{ListenDSN: dsn, MaxInlineBytes: 250}
		}
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

func TestBehindPgBouncer(t *testing.T) {
	t.Run("transaction", func(t *testing.T) { poolertest.Run(t, libpq, pgtest.PoolTransaction) })
	t.Run("session", func(t *testing.T) { poolertest.Run(t, libpq, pgtest.PoolSession) })
	t.Run("refused", func(t *testing.T) { poolertest.Refused(t, libpq) })
}
