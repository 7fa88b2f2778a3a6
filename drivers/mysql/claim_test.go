package mysql_test

import (
	"context"
	"database/sql"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/watermill-outbox/outbox"
	"github.com/watermill-outbox/outbox/drivers/mysql"
	"github.com/watermill-outbox/outbox/drivers/mysql/internal/mysqltest"
	"github.com/watermill-outbox/outbox/outboxtest"
)

// isolations are the isolation levels a service may run its transactions at: MySQL's default
// and the one many set.
var isolations = []string{"REPEATABLE-READ", "READ-COMMITTED"}

// openAt opens a fresh database whose sessions run at isolation, with extra session variables
// (name=value, in DSN form).
func openAt(t *testing.T, isolation string, extra ...string) *sql.DB {
	t.Helper()
	dsn := mysqltest.DSN(t)
	// MariaDB before 11.1 knows the variable as tx_isolation only, MySQL 8 as
	// transaction_isolation only.
	variable := "transaction_isolation"
	if strings.Contains(mysqltest.Version(t), "MariaDB") {
		variable = "tx_isolation"
	}
	dsn += "&" + variable + "=%27" + isolation + "%27"
	for _, e := range extra {
		dsn += "&" + e
	}
	db, err := sql.Open("mysql", dsn)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = db.Close() })
	var got string
	if err := db.QueryRow(`SELECT @@` + variable).Scan(&got); err != nil || got != isolation {
		t.Fatalf("session isolation %q (%v), want %q", got, err, isolation)
	}
	if _, err := db.Exec(`CREATE TABLE reservations (order_id VARCHAR(64) NOT NULL) ENGINE = InnoDB`); err != nil {
		t.Fatal(err)
	}
	return db
}

// copies delivers n copies of each message at the same moment to one Outbox and returns what
// each Handle returned, per message.
func copies(t *testing.T, ob *outbox.Outbox, msgs []*message.Message, n int, h message.HandlerFunc) map[string][]error {
	t.Helper()
	var mu sync.Mutex
	out := map[string][]error{}
	var wg sync.WaitGroup
	start := make(chan struct{})
	for _, msg := range msgs {
		for range n {
			wg.Add(1)
			go func() {
				defer wg.Done()
				<-start
				c := msg.Copy()
				err := ob.Handle(c, outbox.HandleParams{Consumer: "reserve", MessageID: msg.UUID}, h)
				mu.Lock()
				out[msg.UUID] = append(out[msg.UUID], err)
				mu.Unlock()
			}()
		}
	}
	close(start)
	wg.Wait()
	return out
}

func newOutbox(t *testing.T, db *sql.DB) *outbox.Outbox {
	t.Helper()
	ob, err := outbox.New(outbox.Config{DB: db, Driver: mysql.Driver{}, Publisher: &outboxtest.Recorder{},
		DuplicateWait: time.Millisecond, RetryDelay: -1, HandlerTimeout: 30 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = ob.Close() })
	if err := ob.Migrate(context.Background()); err != nil {
		t.Fatal(err)
	}
	return ob
}

func count(t *testing.T, db *sql.DB, query string, args ...any) int {
	t.Helper()
	var n int
	if err := db.QueryRow(query, args...).Scan(&n); err != nil {
		t.Fatalf("%s: %v", query, err)
	}
	return n
}

// TestClaimCopiesAfterAFailure: copies of a message wait on the claim of the first, whose handler
// fails and rolls back. The waiters then hold shared locks on the same key and each wants it
// exclusively: InnoDB kills all but one with a deadlock (1213). That is not a failure of the
// message: the unit of work runs again at once and finds the winner's claim. So at every
// isolation level: the handler succeeds once per message, every copy but the failed one is
// acked, and one failed attempt is counted, the handler's.
func TestClaimCopiesAfterAFailure(t *testing.T) {
	for _, iso := range isolations {
		t.Run(iso, func(t *testing.T) {
			db := openAt(t, iso)
			ob := newOutbox(t, db)
			var msgs []*message.Message
			for i := range 10 {
				msgs = append(msgs, message.NewMessage(fmt.Sprintf("order-%d", i), []byte(fmt.Sprintf("o-%d", i))))
			}
			var mu sync.Mutex
			calls := map[string]int{}
			var running sync.Map
			var overlapped atomic.Bool
			h := func(msg *message.Message) ([]*message.Message, error) {
				if _, loaded := running.LoadOrStore(msg.UUID, true); loaded {
					overlapped.Store(true)
				}
				defer running.Delete(msg.UUID)
				mu.Lock()
				calls[msg.UUID]++
				first := calls[msg.UUID] == 1
				mu.Unlock()
				ctx := msg.Context()
				if _, err := outbox.Tx(ctx).ExecContext(ctx, `INSERT INTO reservations VALUES (?)`, msg.UUID); err != nil {
					return nil, err
				}
				if first {
					time.Sleep(300 * time.Millisecond) // the copies queue up on the claim
					return nil, fmt.Errorf("first attempt fails")
				}
				return nil, outbox.Publish(ctx, "stock.reserved", message.NewMessage("", msg.Payload))
			}
			results := copies(t, ob, msgs, 4, h)
			if overlapped.Load() {
				t.Error("two copies of one message ran the handler at the same time")
			}
			for _, msg := range msgs {
				var failed []error
				for _, err := range results[msg.UUID] {
					if err != nil {
						failed = append(failed, err)
					}
				}
				if len(failed) != 1 || !strings.Contains(failed[0].Error(), "first attempt fails") {
					t.Errorf("%s: copies failed with %v, want only the first attempt's failure", msg.UUID, failed)
				}
				if calls[msg.UUID] != 2 {
					t.Errorf("%s: handler ran %d times, want twice (the failure, then one copy)", msg.UUID, calls[msg.UUID])
				}
				if n := count(t, db, `SELECT count(*) FROM reservations WHERE order_id = ?`, msg.UUID); n != 1 {
					t.Errorf("%s: reserved %d times, want once", msg.UUID, n)
				}
				if n := count(t, db, `SELECT coalesce(max(attempts), 0) FROM outbox_attempts WHERE message_id = ?`, msg.UUID); n != 1 {
					t.Errorf("%s: %d failed attempts counted, want 1 (the handler's; a deadlock between copies is none)", msg.UUID, n)
				}
			}
		})
	}
}

// TestClaimCopiesPastTheLockWaitTimeout: a copy that waits on the claim longer than
// innodb_lock_wait_timeout gets 1205; that is not a failure either: it waits again, and is acked
// as a duplicate once the original commits.
func TestClaimCopiesPastTheLockWaitTimeout(t *testing.T) {
	for _, iso := range isolations {
		t.Run(iso, func(t *testing.T) {
			db := openAt(t, iso, "innodb_lock_wait_timeout=1")
			ob := newOutbox(t, db)
			msg := message.NewMessage("order-1", []byte("o-1"))
			var calls atomic.Int32
			h := func(msg *message.Message) ([]*message.Message, error) {
				calls.Add(1)
				ctx := msg.Context()
				if _, err := outbox.Tx(ctx).ExecContext(ctx, `INSERT INTO reservations VALUES (?)`, msg.UUID); err != nil {
					return nil, err
				}
				time.Sleep(1500 * time.Millisecond) // longer than the copies' lock wait timeout
				return nil, nil
			}
			results := copies(t, ob, []*message.Message{msg}, 3, h)
			for _, err := range results[msg.UUID] {
				if err != nil {
					t.Errorf("a copy failed: %v", err)
				}
			}
			if n := calls.Load(); n != 1 {
				t.Errorf("handler ran %d times, want once", n)
			}
			if n := count(t, db, `SELECT count(*) FROM outbox_attempts`); n != 0 {
				t.Errorf("%d failed attempts counted, want none", n)
			}
		})
	}
}

// TestDispatchTimeOfAClaimThatWaited: a delivery whose claim waited for a copy's (the copy held
// it, then rolled back) kept as its dispatch time the time its INSERT began, before the wait,
// when it sent its effects at once: "sent within a second of the claim" was judged from the end
// of the wait. Retention, counted from dispatch, started that much early.
func TestDispatchTimeOfAClaimThatWaited(t *testing.T) {
	db := openAt(t, "REPEATABLE-READ")
	ob := newOutbox(t, db)
	msg := message.NewMessage("waited", nil)
	holding := make(chan struct{})
	first := make(chan error, 1)
	handle := func(h message.HandlerFunc) error {
		return ob.Handle(msg.Copy(), outbox.HandleParams{Consumer: "reserve", MessageID: msg.UUID}, h)
	}
	go func() {
		first <- handle(func(*message.Message) ([]*message.Message, error) {
			close(holding)
			time.Sleep(3 * time.Second)
			return nil, fmt.Errorf("the copy fails after holding its claim")
		})
	}()
	<-holding
	if err := handle(func(m *message.Message) ([]*message.Message, error) {
		return nil, outbox.Publish(m.Context(), "reserved", message.NewMessage("reserved-"+m.UUID, nil))
	}); err != nil {
		t.Fatalf("the delivery that waited: %v", err)
	}
	if err := <-first; err == nil {
		t.Fatal("the copy: want its failure")
	}
	ob.FlushMarks()
	var early float64
	if err := db.QueryRow(`SELECT TIMESTAMPDIFF(MICROSECOND, dispatched_at, UTC_TIMESTAMP(6)) / 1e6 FROM outbox_processed WHERE message_id = ?`,
		msg.UUID).Scan(&early); err != nil {
		t.Fatal(err)
	}
	t.Logf("dispatch time %.3f s before now", early)
	if early > 1.5 {
		t.Errorf("the claim's dispatch time is %.1f s before its effects were sent; want within a second of it", early)
	}
}
