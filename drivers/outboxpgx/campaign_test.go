package outboxpgx_test

import (
	"context"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/watermill-outbox/outbox"
	"github.com/watermill-outbox/outbox/drivers/outboxpgx"
	"github.com/watermill-outbox/outbox/internal/campaign"
	"github.com/watermill-outbox/outbox/outboxtest"
)

// campaignForm is the pgx form in mode, for the fault campaign: each instance has a pool of its
// own, as a process would.
func campaignForm(name string, mode outboxpgx.Concurrency) campaign.Form {
	return campaign.Form{
		Name: name,
		Open: func(dsn string, cfg outbox.Config) (*outbox.Outbox, func(), error) {
			pc, err := pgxpool.ParseConfig(dsn)
			if err != nil {
				return nil, nil, err
			}
			pc.MaxConns = 4
			pool, err := pgxpool.NewWithConfig(context.Background(), pc)
			if err != nil {
				return nil, nil, err
			}
			ob, err := outboxpgx.New(pool, cfg, outboxpgx.WithConcurrency(mode), outboxpgx.WithRotateEvery(campaign.RotateEvery))
			if err != nil {
				pool.Close()
				return nil, nil, err
			}
			return ob, func() { _ = ob.Close(); pool.Close() }, nil
		},
		Exec: func(ctx context.Context, query string, args ...any) error {
			_, err := outboxpgx.Tx(ctx).Exec(ctx, query, args...)
			return err
		},
		Savepoint: func(ctx context.Context) (func() error, error) {
			sp, err := outboxpgx.Tx(ctx).Begin(ctx)
			if err != nil {
				return nil, err
			}
			return func() error { return sp.Rollback(ctx) }, nil
		},
	}
}

// TestFaultCampaign is the fault campaign (internal/campaign) on the pgx form in each mode, and on
// deployments that mix the database/sql form and both modes of the pgx form on the same tables
// and consumer group, alone and as the members of a tenant.Set. Runs take turns: optimistic,
// pessimistic, mixed, mixed spilling, mixed tenants.
//
//	go test -run TestFaultCampaign . -args -campaign.runs=400      # longer (or OUTBOX_CAMPAIGN_RUNS)
//	go test -run TestFaultCampaign . -args -campaign.seed=1234     # replay one run
//	go test -run TestFaultCampaign . -args -campaign.off=held-claim # without a scenario
func TestFaultCampaign(t *testing.T) {
	opt := campaignForm("pgx optimistic", outboxpgx.Optimistic)
	pess := campaignForm("pgx pessimistic", outboxpgx.Pessimistic)
	campaign.Run(t, outboxtest.DSN(t), campaign.Options{
		Deployments: []campaign.Deployment{
			{Name: "pgx optimistic", Forms: []campaign.Form{opt, opt, opt}},
			{Name: "pgx pessimistic", Forms: []campaign.Form{pess, pess, pess}},
			{Name: "mixed", Forms: []campaign.Form{campaign.SQLForm(), opt, pess}, Shuffle: true},
			// The database/sql form moving its claims' effects to rows at the fourth record.
			{Name: "mixed spilling", Forms: []campaign.Form{campaign.SQLFormInline(1200), opt, pess}, Shuffle: true},
			// Each instance a tenant.Set of two members of its form on two databases (the second
			// one down for a while in half the runs), the three forms mixed on the same tables
			// and the messages of both tenants interleaved on the instances.
			{Name: "mixed tenants", Forms: []campaign.Form{campaign.SQLForm(), opt, pess}, Shuffle: true, Tenants: true},
		},
		SecondDSN: outboxtest.DSN(t),
		Runs:      40,
		Replay:    "cd drivers/outboxpgx && go test -race -run TestFaultCampaign . -args -campaign.seed=%d",
	})
}
