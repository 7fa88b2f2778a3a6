package outboxpgx

import (
	"context"

	"github.com/watermill-outbox/outbox/drivers/postgres"
	"github.com/watermill-outbox/outbox/outboxdriver"
)

// EffectListPending returns the effect rows of src and then its inline effects (StoreID 0), read
// in one statement on the pool: the duplicate path waits for one round trip. Moving, marking and
// sweeping inline effects are the postgres driver's, as in every PostgreSQL form.
func (s *pgxStore) EffectListPending(ctx context.Context, src outboxdriver.Source) ([]outboxdriver.Effect, error) {
	rows, err := s.pool.Query(ctx, s.q.pending, src.Consumer, src.ID)
	if err != nil {
		return nil, wrap(err)
	}
	defer rows.Close()
	effects, err := postgres.ScanPending(rows, src)
	return effects, wrap(err)
}
