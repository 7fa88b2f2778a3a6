package outbox_test

import (
	"testing"

	"github.com/watermill-outbox/outbox/internal/campaign"
	"github.com/watermill-outbox/outbox/internal/pgtest"
)

// TestFaultCampaign is the fault campaign (internal/campaign) on the database/sql form: three
// instances on the same tables and consumer group. drivers/outboxpgx runs it on the pgx form and
// on mixed deployments.
//
//	go test -run TestFaultCampaign . -args -campaign.runs=400      # longer (or OUTBOX_CAMPAIGN_RUNS)
//	go test -run TestFaultCampaign . -args -campaign.seed=1234     # replay one run
//	go test -run TestFaultCampaign . -args -campaign.off=copy-after # without a scenario
func TestFaultCampaign(t *testing.T) {
	campaign.Run(t, pgtest.DSN(t), campaign.Options{
		Deployments: []campaign.Deployment{{Name: "database/sql", Forms: []campaign.Form{campaign.SQLForm(), campaign.SQLForm(), campaign.SQLForm()}}},
		Runs:        24,
		Replay:      "go test -race -run TestFaultCampaign . -args -campaign.seed=%d",
	})
}
