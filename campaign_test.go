package outbox_test

import (
	"testing"

	"github.com/watermill-outbox/outbox/internal/campaign"
	"github.com/watermill-outbox/outbox/internal/pgtest"
)

// TestFaultCampaign is the fault campaign (internal/campaign) on the database/sql form: three
// instances on the same tables and consumer group, or three tenant.Sets of two members on two
// databases. drivers/outboxpgx runs it on the pgx form and
// on mixed deployments.
//
//	go test -run TestFaultCampaign . -args -campaign.runs=400      # longer (or OUTBOX_CAMPAIGN_RUNS)
//	go test -run TestFaultCampaign . -args -campaign.seed=1234     # replay one run
//	go test -run TestFaultCampaign . -args -campaign.off=copy-after # without a scenario
func TestFaultCampaign(t *testing.T) {
	// It has a database of its own (pgtest.DSN) and changes nothing outside it, so it runs beside
	// the package's other parallel tests, which spend their half minute waiting for a relay lease
	// to end: the package takes the campaign's time, not the campaign's and theirs.
	t.Parallel()
	campaign.Run(t, pgtest.DSN(t), campaign.Options{
		Deployments: []campaign.Deployment{
			{Name: "database/sql", Forms: []campaign.Form{campaign.SQLForm(), campaign.SQLForm(), campaign.SQLForm()}},
			// Units that move the effects kept in their claim to rows (spill) at their second
			// record (a budget of 500 bytes) or their fourth (1,200 bytes: the one inside the
			// handler's savepoint, when it makes one, which a rollback undoes), and an instance
			// that keeps none in the claim, on the same tables.
			{Name: "database/sql spilling", Forms: []campaign.Form{campaign.SQLFormInline(500), campaign.SQLFormInline(1200), campaign.SQLFormInline(-1)}, Shuffle: true},
			// Each instance a tenant.Set of two members on two databases, the messages of both
			// tenants interleaved on the instances.
			{Name: "database/sql tenants", Forms: []campaign.Form{campaign.SQLForm(), campaign.SQLForm(), campaign.SQLForm()}, Tenants: true},
		},
		SecondDSN: pgtest.DSN(t),
		Runs:      36,
		Replay:    "go test -race -run TestFaultCampaign . -args -campaign.seed=%d",
	})
}
