package postgres_test

import (
	"context"
	"database/sql"
	"database/sql/driver"
	"errors"
	"fmt"
	"net"
	"sync/atomic"
	"syscall"
	"testing"

	"github.com/watermill-outbox/outbox/drivers/postgres"
	"github.com/watermill-outbox/outbox/outboxdriver"
)

// refusingConnector refuses every connection, counting them, as a database that is gone does.
type refusingConnector struct{ dials atomic.Int64 }

func (c *refusingConnector) Connect(context.Context) (driver.Conn, error) {
	c.dials.Add(1)
	return nil, &net.OpError{Op: "dial", Net: "tcp", Err: syscall.ECONNREFUSED}
}

func (c *refusingConnector) Driver() driver.Driver { return nil }

// TestMarksStopAtAnUnreachableDatabase: a batch of marks (inline effects of 1,000 claims, in
// statements of 200, and effect rows) written while the database is gone makes one connection
// attempt and returns its error, which says so. Every statement went on to try: six attempts,
// each joined into the error, once per outage's start for each batch of marks in flight.
func TestMarksStopAtAnUnreachableDatabase(t *testing.T) {
	conn := &refusingConnector{}
	db := sql.OpenDB(conn)
	t.Cleanup(func() { _ = db.Close() })
	st, err := postgres.Driver{}.Open(db, outboxdriver.StoreOptions{TablePrefix: "outbox_", DeleteDispatched: true,
		Unreachable: func(err error) bool {
			var op *net.OpError
			return errors.As(err, &op) && op.Op == "dial"
		}})
	if err != nil {
		t.Fatal(err)
	}
	var marks []outboxdriver.DispatchMark
	for i := range 1000 {
		marks = append(marks, outboxdriver.DispatchMark{Source: outboxdriver.Source{Consumer: "c", ID: fmt.Sprint(i)}, Inline: true, MoveClaim: i%2 == 0})
	}
	marks = append(marks, outboxdriver.DispatchMark{Source: outboxdriver.Source{Consumer: "c", ID: "rows"}, StoreIDs: []int64{1, 2, 3}})
	err = st.EffectMarkDispatched(context.Background(), marks...)
	var op *net.OpError
	if !errors.As(err, &op) {
		t.Fatalf("marks with the database gone: %v, want the refused connection", err)
	}
	if n := conn.dials.Load(); n != 1 {
		t.Errorf("marks with the database gone: %d connection attempts, want 1", n)
	}
}
