package mysql_test

import (
	"regexp"
	"testing"

	wsql "github.com/ThreeDotsLabs/watermill-sql/v3/pkg/sql"

	"github.com/watermill-outbox/outbox/drivers/mysql"
	"github.com/watermill-outbox/outbox/drivers/mysql/internal/mysqltest"
	"github.com/watermill-outbox/outbox/internal/campaign"
)

var dollarParam = regexp.MustCompile(`\$[0-9]+`)

// campaignDatabase is MariaDB (or MySQL) for the fault campaign, with watermill-sql's MySQL
// broker on the same server.
var campaignDatabase = &campaign.Database{
	DriverName: "mysql",
	Broker:     wsql.DefaultMySQLSchema{GeneratePayloadType: func(string) string { return "LONGBLOB" }},
	Bind:       func(q string) string { return dollarParam.ReplaceAllString(q, "?") },
	IDType:     "VARBINARY(64)", // compared byte for byte, as the IDs with a trailing space need
	Wire: func(topic string) string {
		return "SELECT uuid, payload FROM `watermill_" + topic + "` ORDER BY `offset`"
	},
	KillConnection:        `KILL CONNECTION_ID()`,
	Sleep:                 `SELECT SLEEP($1)`,
	AnyClaimAfterRollback: true,
	ExpireKey:             "UPDATE `%sidempotency` SET expires_at = UTC_TIMESTAMP(6) - INTERVAL 1 SECOND WHERE scope = $1 AND `key` = $2",
	Unsupported: map[string]string{
		"held-claim":      "no inline effects, so no sweep whose look-back a late claim could fall behind",
		"clock-step":      "no inline effects, so no sweep watermark for a clock step to move",
		"deleted-effects": "the check reads deleted effects from an audit kept by PostgreSQL triggers",
	},
}

// sqlForm is the database/sql form on MySQL: each instance has a pool of its own, as a process
// would.
func sqlForm() campaign.Form { return campaign.DatabaseSQLForm("mysql", "mysql", mysql.Driver{}, 8) }

// TestFaultCampaign is the fault campaign (internal/campaign) on MySQL: three instances of the
// database/sql form on the same tables and consumer group.
//
//	go test -run TestFaultCampaign . -args -campaign.runs=400      # longer (or OUTBOX_CAMPAIGN_RUNS)
//	go test -run TestFaultCampaign . -args -campaign.seed=1234     # replay one run
func TestFaultCampaign(t *testing.T) {
	f := sqlForm()
	campaign.Run(t, mysqltest.DSN(t), campaign.Options{
		Deployments: []campaign.Deployment{{Name: "mysql", Forms: []campaign.Form{f, f, f}}},
		Runs:        16,
		Replay:      "go test -race -run TestFaultCampaign . -args -campaign.seed=%d",
		Database:    campaignDatabase,
	})
}
