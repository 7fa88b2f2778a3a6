package outboxpgx_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/watermill-outbox/outbox"
	"github.com/watermill-outbox/outbox/drivers/outboxpgx"
	"github.com/watermill-outbox/outbox/drivers/postgres"
	"github.com/watermill-outbox/outbox/internal/logtest"
	"github.com/watermill-outbox/outbox/outboxtest"
)

var errCrash = errors.New("crash")

// crashAfterCommit is a Failpoint that crashes every unit of work right after its commit: the
// effects are committed (inline in the claim, in the optimistic mode) and never sent.
func crashAfterCommit(_ context.Context, point string) error {
	if point == outbox.FailpointAfterCommit {
		return errCrash
	}
	return nil
}

// otherForms open, on the tables of dsn, an instance of each form that is not the pgx optimistic
// one: none of them writes inline effects, and each must send and move those another left behind.
var otherForms = map[string]func(t *testing.T, dsn string, cfg outbox.Config) *outbox.Outbox{
	"pgx-pessimistic": func(t *testing.T, dsn string, cfg outbox.Config) *outbox.Outbox {
		return ready(t, openPool(t, dsn, 8, nil), cfg, outboxpgx.WithConcurrency(outboxpgx.Pessimistic))
	},
	"database-sql": func(t *testing.T, dsn string, cfg outbox.Config) *outbox.Outbox {
		db, err := sql.Open("postgres", dsn) // lib/pq
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = db.Close() })
		cfg.DB, cfg.Driver = db, postgres.Driver{}
		ob, err := outbox.New(cfg)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = ob.Close() })
		if err := ob.Migrate(context.Background()); err != nil {
			t.Fatal(err)
		}
		return ob
	},
}

// sentTimes counts how often the message with uuid went out through any of recs.
func sentTimes(uuid string, recs ...*outboxtest.Recorder) int {
	n := 0
	for _, r := range recs {
		for _, m := range r.All() {
			if m.Message.UUID == uuid {
				n++
			}
		}
	}
	return n
}

// waitUntil polls cond until it holds, failing the test after timeout.
func waitUntil(t *testing.T, timeout time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("waited %s for %s", timeout, what)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// inlineLeft counts the claims that still hold inline effects, and the effect rows.
func inlineLeft(t *testing.T, pool *pgxpool.Pool) (claims, rows int) {
	t.Helper()
	if err := pool.QueryRow(context.Background(), `SELECT (SELECT count(*) FROM outbox_processed WHERE effects IS NOT NULL),
		(SELECT count(*) FROM outbox_effects_all)`).Scan(&claims, &rows); err != nil {
		t.Fatal(err)
	}
	return claims, rows
}

// runRelay runs ob.Run until the test ends.
func runRelay(t *testing.T, ob *outbox.Outbox) {
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- ob.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		select {
		case <-done:
		case <-time.After(10 * time.Second):
			t.Error("Run did not return")
		}
	})
}

// TestRedeliveryToAnotherFormSendsInlineEffects: an optimistic instance commits a message with
// its effects inline and crashes before sending them; the redelivery reaches an instance of
// another form (pgx pessimistic, database/sql), which sends them, once, with their UUIDs.
func TestRedeliveryToAnotherFormSendsInlineEffects(t *testing.T) {
	for name, open := range otherForms {
		t.Run(name, func(t *testing.T) {
			dsn := outboxtest.DSN(t)
			pool := openPool(t, dsn, 8, nil)
			crashed, other := &outboxtest.Recorder{}, &outboxtest.Recorder{}
			opt := ready(t, pool, outbox.Config{Publisher: crashed, Failpoint: crashAfterCommit})
			ob := open(t, dsn, outbox.Config{Publisher: other, DuplicateWait: 50 * time.Millisecond})
			if err := opt.Handle(message.NewMessage("m1", nil), outbox.HandleParams{Consumer: "c", MessageID: "m1"}, consume(handler)); !errors.Is(err, errCrash) {
				t.Fatalf("crash after commit: %v", err)
			}
			if c, r := inlineLeft(t, pool); c != 1 || r != 0 {
				t.Fatalf("after the crash: %d claims with inline effects, %d effect rows; want 1, 0", c, r)
			}
			for range 2 { // the redelivery, and one more
				if err := ob.Handle(message.NewMessage("m1", nil), outbox.HandleParams{Consumer: "c", MessageID: "m1"}, consume(handler)); err != nil {
					t.Fatalf("redelivery to the %s instance: %v", name, err)
				}
				ob.FlushMarks()
			}
			if n := sentTimes("out-m1", crashed, other); n != 1 {
				t.Errorf("out-m1 sent %d times, want once (by the %s instance)", n, name)
			}
			if n := count(t, ob.Config().DB, "m1"); n != 1 {
				t.Errorf("the business change applied %d times", n)
			}
			if c, r := inlineLeft(t, pool); c != 0 || r != 0 {
				t.Errorf("after the redelivery: %d claims with inline effects, %d effect rows; want none", c, r)
			}
		})
	}
}

// TestRelayOfAnotherFormMovesInlineEffects: inline effects left behind by a crashed optimistic
// instance are moved and sent by the relay of an instance of another form, the only one running.
func TestRelayOfAnotherFormMovesInlineEffects(t *testing.T) {
	for name, open := range otherForms {
		t.Run(name, func(t *testing.T) {
			dsn := outboxtest.DSN(t)
			pool := openPool(t, dsn, 8, nil)
			crashed, other := &outboxtest.Recorder{}, &outboxtest.Recorder{}
			opt := ready(t, pool, outbox.Config{Publisher: crashed, Failpoint: crashAfterCommit})
			for i := range 3 {
				id := fmt.Sprint("m", i)
				if err := opt.Handle(message.NewMessage(id, nil), outbox.HandleParams{Consumer: "c", MessageID: id}, consume(handler)); !errors.Is(err, errCrash) {
					t.Fatalf("crash after commit: %v", err)
				}
			}
			ob := open(t, dsn, outbox.Config{Publisher: other, RelayGrace: 200 * time.Millisecond, RelayInterval: 50 * time.Millisecond})
			runRelay(t, ob)
			waitUntil(t, 15*time.Second, "the relay of the "+name+" instance to send the inline effects left behind", func() bool {
				c, r := inlineLeft(t, pool)
				return c == 0 && r == 0 && sentTimes("out-m0", other)+sentTimes("out-m1", other)+sentTimes("out-m2", other) == 3
			})
			for i := range 3 {
				if n := sentTimes(fmt.Sprint("out-m", i), crashed, other); n != 1 {
					t.Errorf("out-m%d sent %d times", i, n)
				}
			}
		})
	}
}

// TestSweepFindsAClaimThatWaitedOnACopy: an optimistic claim's INSERT waits on the unique key
// while a pessimistic copy holds the claim (and then rolls back) for longer than the sweep used
// to look back behind where it got to; the claim commits, its instance crashes before sending,
// and the relay (running all along) still finds and sends its effects.
func TestSweepFindsAClaimThatWaitedOnACopy(t *testing.T) {
	const hold = 3 * time.Second
	dsn := outboxtest.DSN(t)
	pool := openPool(t, dsn, 8, nil)
	ctx := context.Background()
	recs := []*outboxtest.Recorder{{}, {}, {}}
	relay := ready(t, pool, outbox.Config{Publisher: recs[0], RelayGrace: 200 * time.Millisecond, RelayInterval: 50 * time.Millisecond})
	opt := ready(t, openPool(t, dsn, 8, nil), outbox.Config{Publisher: recs[1], Failpoint: crashAfterCommit})
	pess := ready(t, openPool(t, dsn, 8, nil), outbox.Config{Publisher: recs[2], RetryDelay: -1}, outboxpgx.WithConcurrency(outboxpgx.Pessimistic))
	runRelay(t, relay)

	held, release := make(chan struct{}), make(chan struct{})
	pessDone := make(chan error, 1)
	go func() {
		pessDone <- pess.Handle(message.NewMessage("m1", nil), outbox.HandleParams{Consumer: "c", MessageID: "m1"}, consume(func(*message.Message) error {
			close(held)
			<-release
			return errors.New("the copy fails and rolls back")
		}))
	}()
	<-held
	optDone := make(chan error, 1)
	go func() {
		optDone <- opt.Handle(message.NewMessage("m1", nil), outbox.HandleParams{Consumer: "c", MessageID: "m1"}, consume(handler))
	}()
	waitUntil(t, 10*time.Second, "the optimistic claim to wait on the copy's", func() bool {
		var n int
		if err := pool.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity
			WHERE datname = current_database() AND wait_event_type = 'Lock' AND query LIKE 'INSERT INTO%outbox_processed%'`).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n == 1
	})
	time.Sleep(hold)
	close(release)
	if err := <-pessDone; err == nil {
		t.Fatal("the pessimistic copy succeeded")
	}
	if err := <-optDone; !errors.Is(err, errCrash) {
		t.Fatalf("the optimistic copy: %v, want the crash after its commit", err)
	}
	waitUntil(t, 10*time.Second, "the relay to send the effects of the claim that waited", func() bool {
		return sentTimes("out-m1", recs...) == 1
	})
	time.Sleep(300 * time.Millisecond)
	if n := sentTimes("out-m1", recs...); n != 1 {
		t.Errorf("out-m1 sent %d times", n)
	}
}

// TestSweepDoesNotTrustClocks: where the sweep got to was written by a clock ahead of the
// database's (a failover to a server whose clock is behind), and inline effects were left behind
// during a relay outage longer than the sweep's look-back; another claim's time is in the future.
// The relay sends both.
func TestSweepDoesNotTrustClocks(t *testing.T) {
	dsn := outboxtest.DSN(t)
	pool := openPool(t, dsn, 8, nil)
	ctx := context.Background()
	rec := &outboxtest.Recorder{}
	opt := ready(t, pool, outbox.Config{Publisher: &outboxtest.Recorder{}, Failpoint: crashAfterCommit})
	for _, id := range []string{"past", "future"} {
		if err := opt.Handle(message.NewMessage(id, nil), outbox.HandleParams{Consumer: "c", MessageID: id}, consume(handler)); !errors.Is(err, errCrash) {
			t.Fatalf("crash after commit: %v", err)
		}
	}
	if _, err := pool.Exec(ctx, `UPDATE outbox_stats SET swept_to = now() + interval '1 hour';
		UPDATE outbox_processed SET processed_at = now() - interval '10 minutes', dispatched_at = now() - interval '10 minutes' WHERE message_id = 'past';
		UPDATE outbox_processed SET processed_at = now() + interval '1 hour', dispatched_at = now() + interval '1 hour' WHERE message_id = 'future'`); err != nil {
		t.Fatal(err)
	}
	relay := ready(t, openPool(t, dsn, 8, nil), outbox.Config{Publisher: rec, RelayGrace: 200 * time.Millisecond, RelayInterval: 50 * time.Millisecond})
	runRelay(t, relay)
	waitUntil(t, 10*time.Second, "the relay to send both", func() bool {
		return sentTimes("out-past", rec) == 1 && sentTimes("out-future", rec) == 1
	})
}

// TestUndecodableInlineEffectsAreSetAside: a full sweep batch of claims whose inline effects
// cannot be decoded, then a good claim left behind: the good one is sent, and the undecodable
// ones are set aside (kept, reported, no longer looked at).
func TestUndecodableInlineEffectsAreSetAside(t *testing.T) {
	const bad = 500 // a sweep's batch
	dsn := outboxtest.DSN(t)
	pool := openPool(t, dsn, 8, nil)
	ctx := context.Background()
	opt := ready(t, pool, outbox.Config{Publisher: &outboxtest.Recorder{}, Failpoint: crashAfterCommit})
	handle := func(id string) {
		t.Helper()
		if err := opt.Handle(message.NewMessage(id, nil), outbox.HandleParams{Consumer: "c", MessageID: id}, consume(handler)); !errors.Is(err, errCrash) {
			t.Fatalf("crash after commit: %v", err)
		}
	}
	for i := range bad {
		handle(fmt.Sprint("bad-", i))
	}
	if _, err := pool.Exec(ctx, `UPDATE outbox_processed SET effects = '\x02'::bytea WHERE effects IS NOT NULL`); err != nil {
		t.Fatal(err)
	}
	handle("good")
	rec, logs := &outboxtest.Recorder{}, &logtest.Errors{}
	relay := ready(t, openPool(t, dsn, 8, nil), outbox.Config{Publisher: rec, Logger: logs, RelayGrace: 200 * time.Millisecond, RelayInterval: 50 * time.Millisecond})
	runRelay(t, relay)
	waitUntil(t, 15*time.Second, "the good claim's effect", func() bool { return sentTimes("out-good", rec) == 1 })
	if !logs.Contains("bad-0") {
		t.Errorf("the undecodable claims were not reported by name: %v", logs.Lines())
	}
	var kept, aside int
	if err := pool.QueryRow(ctx, `SELECT count(*), count(*) FILTER (WHERE inline_xid IS NULL)
		FROM outbox_processed WHERE effects = '\x02'::bytea`).Scan(&kept, &aside); err != nil {
		t.Fatal(err)
	}
	if kept != bad || aside != bad {
		t.Errorf("%d undecodable claims kept, %d of them set aside; want %d, %d", kept, aside, bad, bad)
	}
	if n := len(rec.All()); n != 1 {
		t.Errorf("sent %d messages, want 1", n)
	}
}

// TestRelaysOfEveryFormTogether: inline effects left behind by many crashed units of work, and the
// relays of an optimistic, a pessimistic and a database/sql instance running at once: each effect
// is sent once, and none is left.
func TestRelaysOfEveryFormTogether(t *testing.T) {
	const n = 60
	dsn := outboxtest.DSN(t)
	pool := openPool(t, dsn, 8, nil)
	opt := ready(t, pool, outbox.Config{Publisher: &outboxtest.Recorder{}, Failpoint: crashAfterCommit})
	if err := concurrently(n, func(i int) error {
		id := fmt.Sprint("m", i)
		if err := opt.Handle(message.NewMessage(id, nil), outbox.HandleParams{Consumer: "c", MessageID: id}, consume(handler)); !errors.Is(err, errCrash) {
			return fmt.Errorf("crash after commit of %s: %v", id, err)
		}
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	cfg := func(rec *outboxtest.Recorder) outbox.Config {
		return outbox.Config{Publisher: rec, RelayGrace: 100 * time.Millisecond, RelayInterval: 20 * time.Millisecond}
	}
	recs := []*outboxtest.Recorder{{}, {}, {}}
	runRelay(t, ready(t, openPool(t, dsn, 8, nil), cfg(recs[0])))
	runRelay(t, otherForms["pgx-pessimistic"](t, dsn, cfg(recs[1])))
	runRelay(t, otherForms["database-sql"](t, dsn, cfg(recs[2])))
	waitUntil(t, 20*time.Second, "the relays to send every effect left behind", func() bool {
		c, r := inlineLeft(t, pool)
		return c == 0 && r == 0
	})
	for i := range n {
		if got := sentTimes(fmt.Sprint("out-m", i), recs...); got != 1 {
			t.Errorf("out-m%d sent %d times", i, got)
		}
	}
}
