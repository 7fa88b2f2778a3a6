package outbox_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"

	"github.com/watermill-outbox/outbox"
	"github.com/watermill-outbox/outbox/internal/logtest"
)

// Tests of the boundary unit of work (InTx, JoinTx) and of the relay that sweeps what the fast path
// left behind. They use only the public API and SQL reads of the outbox and broker tables.

// startRun runs ob.Run in the background. The returned stop cancels it and waits for it to return;
// it is also called at cleanup, so that no Run goroutine outlives the test even if it fails early.
func startRun(t *testing.T, ob *outbox.Outbox) (stop func()) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- ob.Run(ctx) }()
	var once sync.Once
	stop = func() {
		once.Do(func() {
			cancel()
			select {
			case err := <-done:
				if err != nil {
					t.Errorf("Run returned %v after cancel, want nil", err)
				}
			case <-time.After(time.Minute):
				t.Errorf("Run did not return within a minute of its context being cancelled")
			}
		})
	}
	t.Cleanup(stop)
	return stop
}

// waitWithin polls cond every 20ms until it holds, failing the test after d.
func waitWithin(t testing.TB, d time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(d)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %s waiting for %s", d, what)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// wireCopy is one message as the broker stored it.
type wireCopy struct {
	offset  int64
	uuid    string
	payload string
}

// wireInOrder returns every copy on the broker topic in publish ("offset") order.
func (e *env) wireInOrder(topic string) []wireCopy {
	e.t.Helper()
	rows, err := e.db.Query(`SELECT "offset", uuid, payload FROM "watermill_` + topic + `" ORDER BY "offset"`)
	if err != nil {
		e.t.Fatal(err)
	}
	defer rows.Close()
	var out []wireCopy
	for rows.Next() {
		var c wireCopy
		var payload []byte
		if err := rows.Scan(&c.offset, &c.uuid, &payload); err != nil {
			e.t.Fatal(err)
		}
		c.payload = string(payload)
		out = append(out, c)
	}
	if err := rows.Err(); err != nil {
		e.t.Fatal(err)
	}
	return out
}

// firstCopies returns, per UUID, the first copy of it on the broker topic.
func firstCopies(copies []wireCopy) map[string]wireCopy {
	out := map[string]wireCopy{}
	for _, c := range copies {
		if _, ok := out[c.uuid]; !ok {
			out[c.uuid] = c
		}
	}
	return out
}

// checkKeyOrder reports every ordering key whose messages (wanted in the order of want[key]) did not
// reach the broker in that order, comparing the offsets of their first copies.
func checkKeyOrder(t *testing.T, first map[string]wireCopy, want map[string][]string) {
	t.Helper()
	bad := 0
	for key, ids := range want {
		prev := int64(-1)
		for i, id := range ids {
			c, ok := first[id]
			if !ok {
				t.Errorf("key %s: message %d (%s) is not on the wire", key, i, id)
				bad++
				break
			}
			if c.offset <= prev {
				t.Errorf("key %s: message %d (%s, payload %q) published at offset %d, before its predecessor (offset %d)",
					key, i, id, c.payload, c.offset, prev)
				bad++
				break
			}
			prev = c.offset
		}
		if bad >= 5 {
			t.Errorf("(stopping after %d keys out of order)", bad)
			return
		}
	}
}

// effectUUIDsByKey returns the UUIDs of the stored effects per ordering key, in effect id order.
func (e *env) effectUUIDsByKey() map[string][]string {
	e.t.Helper()
	rows, err := e.db.Query(`SELECT ordering_key, uuid FROM all_effects ORDER BY id`)
	if err != nil {
		e.t.Fatal(err)
	}
	defer rows.Close()
	out := map[string][]string{}
	for rows.Next() {
		var key, id string
		if err := rows.Scan(&key, &id); err != nil {
			e.t.Fatal(err)
		}
		out[key] = append(out[key], id)
	}
	if err := rows.Err(); err != nil {
		e.t.Fatal(err)
	}
	return out
}

func crashAfterCommit(_ context.Context, point string) error {
	if point == outbox.FailpointAfterCommit {
		return errors.New("process killed after commit")
	}
	return nil
}

// rejectingPublisher forwards to next, except calls carrying a message reject refuses (as a broker
// refuses a whole batch).
type rejectingPublisher struct {
	next   message.Publisher
	reject func(*message.Message) bool
}

func (p *rejectingPublisher) Publish(topic string, msgs ...*message.Message) error {
	for _, m := range msgs {
		if p.reject(m) {
			return fmt.Errorf("broker refused message %s (payload %q)", m.UUID, m.Payload)
		}
	}
	return p.next.Publish(topic, msgs...)
}

func (p *rejectingPublisher) Close() error { return nil }

// instancePublisher counts the messages one Outbox instance got through to the shared broker.
type instancePublisher struct {
	next message.Publisher
	sent atomic.Int64
}

func (p *instancePublisher) Publish(topic string, msgs ...*message.Message) error {
	if err := p.next.Publish(topic, msgs...); err != nil {
		return err
	}
	p.sent.Add(int64(len(msgs)))
	return nil
}

func (p *instancePublisher) Close() error { return nil }

func TestBoundaryInTxCommitsAndDispatchesAtOnce(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()

	// Commit: the business row and both messages, sent before InTx returns (no Run anywhere).
	m1 := message.NewMessage(uuid.NewString(), []byte("first"))
	m2 := message.NewMessage(uuid.NewString(), []byte("second"))
	m1.Metadata.Set("k", "v")
	err := e.ob.InTx(ctx, func(ctx context.Context, tx *sql.Tx) error {
		if _, err := tx.ExecContext(ctx, `INSERT INTO applied (message_id, note) VALUES ('http-1', 'committed')`); err != nil {
			return err
		}
		return outbox.Publish(ctx, "out_a", m1, m2)
	})
	if err != nil {
		t.Fatalf("InTx: %v", err)
	}
	wire := e.wire("out_a")
	mustEqual(t, "copies of message 1", wire[m1.UUID], 1)
	mustEqual(t, "copies of message 2", wire[m2.UUID], 1)
	mustEqual(t, "messages on the wire", len(wire), 2)
	mustEqual(t, "pending effects", e.pendingEffects(), 0)
	mustEqual(t, "business rows", e.count(`SELECT count(*) FROM applied WHERE message_id = 'http-1'`), 1)

	causation := map[string]string{}
	for _, id := range []string{m1.UUID, m2.UUID} {
		var c sql.NullString
		if err := e.db.QueryRow(`SELECT metadata->>'causation_id' FROM watermill_out_a WHERE uuid = $1`, id).Scan(&c); err != nil {
			t.Fatal(err)
		}
		causation[id] = c.String
	}
	if causation[m1.UUID] == "" || causation[m1.UUID] != causation[m2.UUID] {
		t.Fatalf("causation_id on the wire: %q and %q, want the same non-empty boundary id", causation[m1.UUID], causation[m2.UUID])
	}
	mustEqual(t, "effects whose source is the boundary id",
		e.count(`SELECT count(*) FROM all_effects WHERE source_consumer = '' AND source_id = $1`, causation[m1.UUID]), 2)
	var k sql.NullString
	if err := e.db.QueryRow(`SELECT metadata->>'k' FROM watermill_out_a WHERE uuid = $1`, m1.UUID).Scan(&k); err != nil {
		t.Fatal(err)
	}
	mustEqual(t, "caller's metadata kept", k.String, "v")

	// fn fails: the error comes back, nothing is stored or sent.
	errRefused := errors.New("validation failed")
	m3 := message.NewMessage(uuid.NewString(), []byte("never"))
	err = e.ob.InTx(ctx, func(ctx context.Context, tx *sql.Tx) error {
		if _, err := tx.ExecContext(ctx, `INSERT INTO applied (message_id, note) VALUES ('http-2', 'rolled back')`); err != nil {
			return err
		}
		if err := outbox.Publish(ctx, "out_a", m3); err != nil {
			return err
		}
		return errRefused
	})
	if !errors.Is(err, errRefused) {
		t.Fatalf("InTx with a failing fn returned %v, want %v", err, errRefused)
	}
	mustEqual(t, "copies of the rolled-back message", e.wire("out_a")[m3.UUID], 0)
	mustEqual(t, "business rows of the failed fn", e.count(`SELECT count(*) FROM applied WHERE message_id = 'http-2'`), 0)
	mustEqual(t, "effect rows of the failed fn", e.count(`SELECT count(*) FROM all_effects WHERE uuid = $1`, m3.UUID), 0)

	// fn panics: the panic reaches the caller, nothing is committed or sent.
	m4 := message.NewMessage(uuid.NewString(), []byte("never either"))
	type boom struct{ why string }
	recovered := func() (r any) {
		defer func() { r = recover() }()
		_ = e.ob.InTx(ctx, func(ctx context.Context, tx *sql.Tx) error {
			if _, err := tx.ExecContext(ctx, `INSERT INTO applied (message_id, note) VALUES ('http-3', 'panicked')`); err != nil {
				return err
			}
			if err := outbox.Publish(ctx, "out_a", m4); err != nil {
				return err
			}
			panic(boom{"handler bug"})
		})
		return nil
	}()
	if b, ok := recovered.(boom); !ok || b.why != "handler bug" {
		t.Fatalf("InTx with a panicking fn: recovered %#v, want the panic value boom{handler bug}", recovered)
	}
	mustEqual(t, "copies of the panicked message", e.wire("out_a")[m4.UUID], 0)
	mustEqual(t, "business rows of the panicked fn", e.count(`SELECT count(*) FROM applied WHERE message_id = 'http-3'`), 0)
	mustEqual(t, "effect rows of the panicked fn", e.count(`SELECT count(*) FROM all_effects WHERE uuid = $1`, m4.UUID), 0)

	// Nothing else reached the broker, and the connection pool is not left with an open transaction.
	mustEqual(t, "messages on the wire at the end", len(e.wire("out_a")), 2)
	mustEqual(t, "total effect rows", e.count(`SELECT count(*) FROM all_effects`), 2)
	mustEqual(t, "transactions left open", e.count(`SELECT count(*) FROM pg_stat_activity
		WHERE datname = current_database() AND state LIKE 'idle in transaction%'`), 0)
}

func TestBoundaryJoinTx(t *testing.T) {
	cfg := func(c *outbox.Config) { c.RelayGrace = 200 * time.Millisecond; c.RelayInterval = 50 * time.Millisecond }
	ctx := context.Background()

	// joined opens a transaction the caller owns, joins it, writes a business row and publishes msg.
	joined := func(t *testing.T, e *env, msg *message.Message) (*sql.Tx, func(context.Context)) {
		t.Helper()
		tx, err := e.db.BeginTx(ctx, nil)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = tx.Rollback() })
		ctx2, dispatch := e.ob.JoinTx(ctx, tx)
		if outbox.Tx(ctx2) != tx {
			t.Fatal("outbox.Tx of the joined context is not the caller's transaction")
		}
		if _, err := tx.ExecContext(ctx2, `INSERT INTO applied (message_id) VALUES ($1)`, msg.UUID); err != nil {
			t.Fatal(err)
		}
		if err := outbox.Publish(ctx2, "out_a", msg); err != nil {
			t.Fatal(err)
		}
		return tx, dispatch
	}

	t.Run("commit then dispatch", func(t *testing.T) {
		e := newEnv(t, cfg)
		msg := message.NewMessage(uuid.NewString(), []byte("joined"))
		tx, dispatch := joined(t, e, msg)
		if err := tx.Commit(); err != nil {
			t.Fatal(err)
		}
		mustEqual(t, "copies before dispatch", e.wire("out_a")[msg.UUID], 0)
		dispatch(ctx)
		mustEqual(t, "copies after dispatch", e.wire("out_a")[msg.UUID], 1)
		mustEqual(t, "pending effects", e.pendingEffects(), 0)
		mustEqual(t, "business rows", e.count(`SELECT count(*) FROM applied WHERE message_id = $1`, msg.UUID), 1)
	})

	// A request whose context ended between its commit and its dispatch (the client went away),
	// and a dispatch called twice: the effects go out once, at once. The read-back failed on the
	// ended context and left them to the relay after RelayGrace with an error line; a second call
	// sent them again (its marks are written asynchronously, so they were still pending).
	t.Run("dispatch on an ended context, and twice", func(t *testing.T) {
		logs := &logtest.Errors{}
		e := newEnv(t, func(c *outbox.Config) { c.RelayGrace = time.Hour; c.Logger = logs })
		msg := message.NewMessage(uuid.NewString(), []byte("joined"))
		tx, dispatch := joined(t, e, msg)
		if err := tx.Commit(); err != nil {
			t.Fatal(err)
		}
		ended, cancel := context.WithCancel(ctx)
		cancel()
		dispatch(ended)
		dispatch(ctx)
		mustEqual(t, "copies after dispatch", e.wire("out_a")[msg.UUID], 1)
		if lines := logs.Lines(); len(lines) > 0 {
			t.Errorf("error lines: %q", lines)
		}
	})

	t.Run("rollback then dispatch", func(t *testing.T) {
		e := newEnv(t, cfg)
		msg := message.NewMessage(uuid.NewString(), []byte("rolled back"))
		tx, dispatch := joined(t, e, msg)
		if err := tx.Rollback(); err != nil {
			t.Fatal(err)
		}
		dispatch(ctx)
		if n := e.wire("out_a")[msg.UUID]; n != 0 {
			t.Errorf("dispatch after the caller rolled back sent %d copies of a message whose transaction rolled back, want 0 "+
				"(JoinTx documents: \"If tx rolls back, nothing was stored and dispatch sends nothing\")", n)
		}
		mustEqual(t, "effect rows", e.count(`SELECT count(*) FROM all_effects`), 0)
		mustEqual(t, "business rows", e.count(`SELECT count(*) FROM applied`), 0)
	})

	t.Run("commit without dispatch, the relay sends it", func(t *testing.T) {
		e := newEnv(t, cfg)
		msg := message.NewMessage(uuid.NewString(), []byte("forgotten"))
		tx, _ := joined(t, e, msg)
		if err := tx.Commit(); err != nil {
			t.Fatal(err)
		}
		mustEqual(t, "copies before the relay", e.wire("out_a")[msg.UUID], 0)
		var storedUUID string
		if err := e.db.QueryRow(`SELECT uuid FROM all_effects`).Scan(&storedUUID); err != nil {
			t.Fatal(err)
		}
		mustEqual(t, "stored UUID", storedUUID, msg.UUID)

		stop := startRun(t, e.ob)
		waitFor(t, "the relay to send the undispatched effect", func() bool { return e.pendingEffects() == 0 })
		stop()
		mustEqual(t, "copies of the stored UUID", e.wire("out_a")[storedUUID], 1)
		mustEqual(t, "messages on the wire", len(e.wire("out_a")), 1)
		// The relay honoured RelayGrace: it claimed the effect at least 200ms after its transaction began.
		mustEqual(t, "effects relayed after the grace period",
			e.count(`SELECT count(*) FROM all_effects WHERE dispatched_at - created_at >= interval '200 milliseconds'`), 1)
	})
}

func TestBoundaryCrashBetweenCommitAndDispatch(t *testing.T) {
	e := newEnv(t, func(c *outbox.Config) { c.Failpoint = crashAfterCommit })
	ctx := context.Background()
	msg := message.NewMessage(uuid.NewString(), []byte("after the crash"))
	err := e.ob.InTx(ctx, func(ctx context.Context, tx *sql.Tx) error {
		if _, err := tx.ExecContext(ctx, `INSERT INTO applied (message_id) VALUES ($1)`, msg.UUID); err != nil {
			return err
		}
		return outbox.Publish(ctx, "out_a", msg)
	})
	if !errors.Is(err, outbox.ErrFailpoint) {
		t.Fatalf("InTx with a crash after commit returned %v, want an error wrapping ErrFailpoint", err)
	}
	mustEqual(t, "copies before the restart", len(e.wire("out_a")), 0)
	mustEqual(t, "business rows committed", e.count(`SELECT count(*) FROM applied WHERE message_id = $1`, msg.UUID), 1)
	mustEqual(t, "pending effects", e.pendingEffects(), 1)
	var storedUUID string
	if err := e.db.QueryRow(`SELECT uuid FROM outbox_effects_all WHERE dispatched_at IS NULL`).Scan(&storedUUID); err != nil {
		t.Fatal(err)
	}
	mustEqual(t, "stored UUID", storedUUID, msg.UUID)

	restarted := e.newOutbox(func(c *outbox.Config) { c.RelayGrace = 100 * time.Millisecond; c.RelayInterval = 50 * time.Millisecond })
	stop := startRun(t, restarted)
	waitFor(t, "the restarted process to relay the effect", func() bool { return e.pendingEffects() == 0 })
	stop()
	wire := e.wire("out_a")
	mustEqual(t, "copies of the stored UUID", wire[storedUUID], 1)
	mustEqual(t, "messages on the wire", len(wire), 1)
}

func TestBrokerDownThenUpKeepsPerKeyOrder(t *testing.T) {
	e := newEnv(t, func(c *outbox.Config) {
		c.RelayGrace = 50 * time.Millisecond
		c.RelayInterval = 20 * time.Millisecond
		c.RelayMaxAttempts = 1000
	})
	ctx := context.Background()
	e.pub.failAll.Store(true)

	want := map[string][]string{} // ordering key -> UUIDs in recording order
	payloadOf := map[string]string{}
	seq := 0
	for i := 0; i < 20; i++ {
		key := fmt.Sprintf("order-%d", i%4)
		var msgs []*message.Message
		for j := 0; j < 3; j++ {
			m := message.NewMessage(uuid.NewString(), []byte(fmt.Sprintf("%s:%d", key, seq)))
			seq++
			msgs = append(msgs, m)
		}
		err := e.ob.InTx(ctx, func(ctx context.Context, tx *sql.Tx) error {
			return outbox.Publish(outbox.WithOrderingKey(ctx, key), "out_a", msgs...)
		})
		if err != nil {
			t.Fatalf("InTx %d: %v (a failed dispatch after commit must not fail InTx)", i, err)
		}
		for _, m := range msgs {
			want[key] = append(want[key], m.UUID)
			payloadOf[m.UUID] = string(m.Payload)
		}
	}
	mustEqual(t, "messages on the wire while the broker is down", len(e.wire("out_a")), 0)
	mustEqual(t, "pending effects", e.pendingEffects(), 60)
	// Each effect is due for the relay: either its own fast path failed (attempt recorded, retry
	// scheduled) or it was handed to the relay behind an earlier pending effect with its key.
	mustEqual(t, "effects handed to the relay", e.count(`SELECT count(*) FROM outbox_effects_all WHERE next_attempt_at IS NOT NULL`), 60)
	mustEqual(t, "parked effects", e.count(`SELECT count(*) FROM outbox_effects_all WHERE parked_at IS NOT NULL`), 0)

	stop := startRun(t, e.ob)
	// The fast path recorded one failure; wait until the relay has failed too. Nothing reached
	// the broker meanwhile: an outage, so no failure counts toward parking.
	waitFor(t, "a failed relay attempt", func() bool {
		return e.count(`SELECT count(*) FROM outbox_effects_all WHERE failures >= 2`) > 0
	})
	failedRounds := e.count(`SELECT coalesce(max(failures), 0) FROM outbox_effects_all`)
	mustEqual(t, "failures counted toward parking during the outage", e.count(`SELECT coalesce(max(attempts), 0) FROM outbox_effects_all`), 0)
	mustEqual(t, "messages on the wire while the broker is down", len(e.wire("out_a")), 0)
	e.pub.failAll.Store(false)

	waitFor(t, "all 60 effects dispatched", func() bool { return e.pendingEffects() == 0 })
	stop()

	copies := e.wireInOrder("out_a")
	first := firstCopies(copies)
	t.Logf("attempts before the broker came back: up to %d; copies on the wire: %d for %d distinct messages (%d duplicates)",
		failedRounds, len(copies), len(first), len(copies)-len(first))
	mustEqual(t, "distinct messages on the wire", len(first), 60)
	for id, p := range payloadOf {
		if c, ok := first[id]; !ok || c.payload != p {
			t.Errorf("message %s: first copy on the wire %+v, want payload %q", id, c, p)
		}
	}
	mustEqual(t, "parked effects", e.count(`SELECT count(*) FROM outbox_effects_all WHERE parked_at IS NOT NULL`), 0)
	checkKeyOrder(t, first, want)
}

func TestThreeRelayInstancesShare10000Effects(t *testing.T) {
	const (
		sources   = 100
		perSource = 100
		keys      = 50
		total     = sources * perSource
	)
	e := newEnv(t, func(c *outbox.Config) { c.Failpoint = crashAfterCommit })
	ctx := context.Background()

	// 10,000 committed effects that no fast path dispatched: every InTx "crashes" after its commit.
	start := time.Now()
	n := 0
	for s := 0; s < sources; s++ {
		err := e.ob.InTx(ctx, func(ctx context.Context, tx *sql.Tx) error {
			for j := 0; j < perSource; j++ {
				key := fmt.Sprintf("k%d", (s*perSource+j)%keys)
				m := message.NewMessage(uuid.NewString(), []byte(fmt.Sprintf("%s:%d", key, s*perSource+j)))
				if err := outbox.Publish(outbox.WithOrderingKey(ctx, key), "out_a", m); err != nil {
					return err
				}
			}
			return nil
		})
		if !errors.Is(err, outbox.ErrFailpoint) {
			t.Fatalf("InTx %d: %v, want the failpoint error", s, err)
		}
		n += perSource
	}
	t.Logf("recorded %d effects in %s", n, time.Since(start).Round(time.Millisecond))
	mustEqual(t, "pending effects", e.pendingEffects(), total)
	mustEqual(t, "effects with attempts recorded", e.count(`SELECT count(*) FROM all_effects WHERE attempts > 0`), 0)
	mustEqual(t, "messages on the wire before the relays start", len(e.wire("out_a")), 0)
	want := e.effectUUIDsByKey()
	mustEqual(t, "ordering keys", len(want), keys)

	var pubs []*instancePublisher
	var stops []func()
	start = time.Now()
	for i := 0; i < 3; i++ {
		p := &instancePublisher{next: e.pub}
		pubs = append(pubs, p)
		ob := e.newOutbox(func(c *outbox.Config) {
			c.Publisher = p
			c.RelayGrace = time.Millisecond
			c.RelayInterval = 20 * time.Millisecond
			c.RelayBatchSize = 200
		})
		stops = append(stops, startRun(t, ob))
	}
	waitWithin(t, 5*time.Minute, "three relays to dispatch 10,000 effects", func() bool { return e.pendingEffects() == 0 })
	elapsed := time.Since(start)
	for _, stop := range stops {
		stop()
	}

	copies := e.wireInOrder("out_a")
	first := firstCopies(copies)
	sent := make([]int64, len(pubs))
	for i, p := range pubs {
		sent[i] = p.sent.Load()
	}
	t.Logf("three relays dispatched %d effects in %s (%.0f/s); copies on the wire %d, distinct %d, duplicates %d; sent per instance %v",
		total, elapsed.Round(time.Millisecond), float64(total)/elapsed.Seconds(), len(copies), len(first), len(copies)-len(first), sent)
	mustEqual(t, "distinct messages on the wire", len(first), total)
	mustEqual(t, "duplicate copies on the wire", len(copies)-len(first), 0)
	mustEqual(t, "messages the instances sent", sent[0]+sent[1]+sent[2], int64(len(copies)))
	mustEqual(t, "parked or failed effects", e.count(`SELECT count(*) FROM all_effects WHERE attempts > 0 OR parked_at IS NOT NULL`), 0)
	checkKeyOrder(t, first, want)
}

func TestPoisonEffectIsParkedAndOtherKeysFlow(t *testing.T) {
	var flaky atomic.Bool // while set, the broker refuses the message "flaky"
	flaky.Store(true)
	e := newEnv(t, func(c *outbox.Config) {
		c.Publisher = &rejectingPublisher{next: c.Publisher, reject: func(m *message.Message) bool {
			switch string(m.Payload) {
			case "poison":
				return true
			case "flaky":
				return flaky.Load()
			}
			return false
		}}
		c.RelayMaxAttempts = 3
		c.RelayGrace = 20 * time.Millisecond
		c.RelayInterval = 20 * time.Millisecond
	})
	ctx := context.Background()
	publish := func(key string, payloads ...string) []string {
		t.Helper()
		var ids []string
		err := e.ob.InTx(ctx, func(ctx context.Context, tx *sql.Tx) error {
			for _, p := range payloads {
				m := message.NewMessage(uuid.NewString(), []byte(p))
				ids = append(ids, m.UUID)
				if err := outbox.Publish(outbox.WithOrderingKey(ctx, key), "out_a", m); err != nil {
					return err
				}
			}
			return nil
		})
		if err != nil {
			t.Fatalf("InTx publishing %v: %v", payloads, err)
		}
		return ids
	}
	a := publish("A", "poison", "after-poison")
	poisonID, afterPoisonID := a[0], a[1]
	okID := publish("B", "ok")[0]
	flakyID := publish("C", "flaky")[0]

	stop := startRun(t, e.ob)
	parkedByUUID := func() map[string]outbox.ParkedEffect {
		parked, err := e.ob.ParkedEffects(ctx, 100)
		if err != nil {
			t.Fatal(err)
		}
		out := map[string]outbox.ParkedEffect{}
		for _, p := range parked {
			out[p.UUID] = p
		}
		return out
	}
	// Other messages flow meanwhile (to out_b): the broker is healthy, so the refusals count.
	waitFor(t, "the poison and the flaky effects to be parked", func() bool {
		if err := e.ob.InTx(ctx, func(ctx context.Context, tx *sql.Tx) error {
			return outbox.Publish(ctx, "out_b", message.NewMessage(uuid.NewString(), []byte("traffic")))
		}); err != nil {
			t.Fatal(err)
		}
		p := parkedByUUID()
		_, ok1 := p[poisonID]
		_, ok2 := p[flakyID]
		return ok1 && ok2
	})
	parked := parkedByUUID()
	mustEqual(t, "parked effects", len(parked), 2)
	poison := parked[poisonID]
	mustEqual(t, "attempts of the parked poison", poison.Attempts, 3)
	if !strings.Contains(poison.LastError, "broker refused") {
		t.Errorf("last error of the parked poison: %q, want the broker's refusal", poison.LastError)
	}
	if poison.ParkedAt.IsZero() || poison.StoreID == 0 || string(poison.Payload) != "poison" || poison.OrderingKey != "A" {
		t.Errorf("parked poison: %+v", poison)
	}
	mustEqual(t, "attempts of the parked flaky effect", parked[flakyID].Attempts, 3)

	wire := e.wire("out_a")
	mustEqual(t, `copies of "ok" (key B)`, wire[okID], 1)
	mustEqual(t, `copies of "after-poison" (behind the parked poison)`, wire[afterPoisonID], 0)
	mustEqual(t, "copies of the poison", wire[poisonID], 0)
	mustEqual(t, "copies of the flaky message", wire[flakyID], 0)

	// Discarding the poison unblocks the effect behind it, without sending the poison.
	n, err := e.ob.DiscardParked(ctx, poison.StoreID)
	if err != nil {
		t.Fatal(err)
	}
	mustEqual(t, "discarded", n, 1)
	waitFor(t, `"after-poison" to be sent`, func() bool { return e.wire("out_a")[afterPoisonID] > 0 })

	// Retrying the flaky effect once the broker accepts it again sends it once.
	flaky.Store(false)
	n, err = e.ob.RetryParked(ctx, parked[flakyID].StoreID)
	if err != nil {
		t.Fatal(err)
	}
	mustEqual(t, "unparked", n, 1)
	waitFor(t, "the retried effect to be sent", func() bool { return e.pendingEffects() == 0 })
	stop()

	wire = e.wire("out_a")
	mustEqual(t, "copies of the poison after discard", wire[poisonID], 0)
	mustEqual(t, `copies of "after-poison"`, wire[afterPoisonID], 1)
	mustEqual(t, "copies of the retried effect", wire[flakyID], 1)
	mustEqual(t, `copies of "ok"`, wire[okID], 1)
	mustEqual(t, "messages on the wire", len(wire), 3)
	mustEqual(t, "parked effects left", len(parkedByUUID()), 0)
}

// gatePublisher holds the publication of one message (by UUID) until release is closed.
type gatePublisher struct {
	next    message.Publisher
	uuid    string
	entered chan struct{} // closed when the held message reaches the publisher
	release chan struct{}
	once    sync.Once
}

func (p *gatePublisher) Publish(topic string, msgs ...*message.Message) error {
	for _, m := range msgs {
		if m.UUID == p.uuid {
			p.once.Do(func() { close(p.entered) })
			<-p.release
		}
	}
	return p.next.Publish(topic, msgs...)
}

func (p *gatePublisher) Close() error { return nil }

// TestBoundarySlowFastPathKeepsPerKeyOrder: a transaction with a custom ordering key commits while
// the fast path of an earlier transaction with the same key is still publishing (a slow broker).
// Its effect must not reach the broker before the earlier one: "the relay dispatches effects with
// the same key in the order they were recorded", and a later effect is handed to the relay "which
// sends both in order".
func TestBoundarySlowFastPathKeepsPerKeyOrder(t *testing.T) {
	first := message.NewMessage(uuid.NewString(), []byte("OrderCreated"))
	second := message.NewMessage(uuid.NewString(), []byte("OrderUpdated"))
	gate := &gatePublisher{uuid: first.UUID, entered: make(chan struct{}), release: make(chan struct{})}
	e := newEnv(t, func(c *outbox.Config) {
		gate.next = c.Publisher
		c.Publisher = gate
		c.RelayInterval = 20 * time.Millisecond // RelayGrace keeps its default (10s)
	})
	ctx := context.Background()
	var releaseOnce sync.Once
	release := func() { releaseOnce.Do(func() { close(gate.release) }) }
	t.Cleanup(release)
	stop := startRun(t, e.ob)

	publishOrder := func(m *message.Message) error {
		return e.ob.InTx(ctx, func(ctx context.Context, tx *sql.Tx) error {
			return outbox.Publish(outbox.WithOrderingKey(ctx, "order-42"), "out_a", m)
		})
	}
	var firstErr error
	firstDone := make(chan struct{})
	go func() { defer close(firstDone); firstErr = publishOrder(first) }()
	t.Cleanup(func() { release(); <-firstDone })
	select {
	case <-gate.entered:
	case <-firstDone:
		t.Fatalf("the first InTx returned (%v) without publishing", firstErr)
	case <-time.After(30 * time.Second):
		t.Fatal("the first InTx's fast path did not reach the publisher")
	}
	// The first effect is committed and being published; the second commits now.
	if err := publishOrder(second); err != nil {
		t.Fatal(err)
	}
	// Give the relay (kicked, polling every 20ms) up to 2s to send the second effect early.
	deadline := time.Now().Add(2 * time.Second)
	for time.Now().Before(deadline) && e.wire("out_a")[second.UUID] == 0 {
		time.Sleep(20 * time.Millisecond)
	}
	release()
	<-firstDone
	if firstErr != nil {
		t.Fatal(firstErr)
	}
	waitFor(t, "both effects dispatched", func() bool { return e.pendingEffects() == 0 })
	stop()

	copies := e.wireInOrder("out_a")
	got := firstCopies(copies)
	mustEqual(t, "copies on the wire", len(copies), 2)
	mustEqual(t, "distinct messages on the wire", len(got), 2)
	if got[second.UUID].offset < got[first.UUID].offset {
		t.Errorf("per-key order broken: %q (recorded second, key order-42) reached the broker at offset %d, "+
			"before %q (recorded first, same key) at offset %d",
			second.Payload, got[second.UUID].offset, first.Payload, got[first.UUID].offset)
	}
}

// TestJoinTxMisuseAndClose: JoinTx with a nil *sql.Tx panics with ErrNoUnitOfWork (its signature
// has no error to return, and recording into nothing must not pass silently); Close may be
// called twice, and the Outbox still works on its DB afterwards (unprepared).
func TestJoinTxMisuseAndClose(t *testing.T) {
	e := newEnv(t)
	func() {
		defer func() {
			err, _ := recover().(error)
			if !errors.Is(err, outbox.ErrNoUnitOfWork) {
				t.Errorf("JoinTx(nil) recovered %v, want an error wrapping ErrNoUnitOfWork", err)
			}
		}()
		e.ob.JoinTx(context.Background(), nil)
	}()
	for range 2 {
		if err := e.ob.Close(); err != nil {
			t.Fatalf("Close: %v", err)
		}
	}
	if err := e.ob.InTx(context.Background(), func(ctx context.Context, tx *sql.Tx) error {
		return outbox.Publish(ctx, "out", message.NewMessage("after-close", nil))
	}); err != nil {
		t.Fatalf("InTx after Close: %v", err)
	}
}

// fn's context carries HandlerTimeout's deadline, as a consumer handler's does (Config says so):
// it had none, so that past HandlerTimeout, with the transaction rolled back and an idempotency
// key's lock released with it, fn went on (a call to a payment provider, say) while a retry with
// the same key ran it again beside it.
func TestInTxFnContextEndsAtHandlerTimeout(t *testing.T) {
	e := newEnv(t)
	ob := e.newOutbox(func(c *outbox.Config) { c.HandlerTimeout = 300 * time.Millisecond })
	began := time.Now()
	err := ob.InTx(context.Background(), func(ctx context.Context, _ *sql.Tx) error {
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(3 * time.Second):
			return errors.New("fn's context did not end at HandlerTimeout")
		}
	})
	if took := time.Since(began); !errors.Is(err, context.DeadlineExceeded) || took > 2*time.Second {
		t.Errorf("InTx with HandlerTimeout 300 ms and an fn that waits for its context: %v after %s, want a deadline within a second", err, took.Round(time.Millisecond))
	}
}
