package ops_test

import (
	"os"
	"testing"

	"github.com/watermill-outbox/outbox/internal/pgtest"
)

// The examples need a PostgreSQL: the test binary starts one (or uses OUTBOX_TEST_DSN).
func TestMain(m *testing.M) { os.Exit(pgtest.Run(m)) }
