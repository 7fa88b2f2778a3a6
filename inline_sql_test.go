package outbox_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"

	"github.com/watermill-outbox/outbox"
	"github.com/watermill-outbox/outbox/drivers/postgres"
	"github.com/watermill-outbox/outbox/outboxdriver"
	"github.com/watermill-outbox/outbox/store"
)

// The database/sql form on PostgreSQL keeps the effects of a message with its own ordering key in
// the claim (outboxdriver.InlineRecorder), written as they are recorded; these tests check what
// the claim holds and what is sent through savepoints, several records, keys of their own, a
// handler that ends the transaction, and the boundary (no claim: rows).

// inlineOf returns the UUIDs the claim of id holds inline, in order (empty when none).
func (e *env) inlineOf(id string) []string {
	e.t.Helper()
	var blob []byte
	if err := e.db.QueryRow(`SELECT effects FROM outbox_processed WHERE consumer = 'c1' AND message_id = $1`, id).Scan(&blob); err != nil {
		e.t.Fatal(err)
	}
	return decodeUUIDs(e.t, blob)
}

// decodeUUIDs returns the UUIDs of the inline effects blob, in order.
func decodeUUIDs(t testing.TB, blob []byte) []string {
	t.Helper()
	if blob == nil {
		return nil
	}
	effects, err := store.DecodeEffects(blob, outboxdriver.Source{})
	if err != nil {
		t.Fatal(err)
	}
	out := make([]string, len(effects))
	for i, e := range effects {
		out[i] = e.UUID
	}
	return out
}

// sent returns the UUIDs on topic in the order they reached it.
func (e *env) sent(topic string) []string {
	e.t.Helper()
	return e.strings(`SELECT uuid FROM "watermill_` + topic + `" ORDER BY "offset"`)
}

// TestInlineEffectsOfTheDatabaseSQLForm: a message whose handler publishes three times, once
// inside a savepoint it rolls back, commits its effects in its claim and no effect row; with the
// broker down they stay there (the claim holds exactly the two that survived), a redelivery sends
// those two in order, and the mark clears the claim.
func TestInlineEffectsOfTheDatabaseSQLForm(t *testing.T) {
	e := newEnv(t, func(c *outbox.Config) { c.EffectRetention = 0 })
	a, b, c := uuid.NewString(), uuid.NewString(), uuid.NewString()
	h := func(msg *message.Message) ([]*message.Message, error) {
		ctx := msg.Context()
		tx := outbox.Tx(ctx)
		if err := outbox.Publish(ctx, "out_a", message.NewMessage(a, []byte("a"))); err != nil {
			return nil, err
		}
		if _, err := tx.ExecContext(ctx, `SAVEPOINT sp`); err != nil {
			return nil, err
		}
		if err := outbox.Publish(ctx, "out_a", message.NewMessage(b, []byte("b"))); err != nil {
			return nil, err
		}
		if _, err := tx.ExecContext(ctx, `ROLLBACK TO SAVEPOINT sp`); err != nil {
			return nil, err
		}
		return nil, outbox.Publish(ctx, "out_a", message.NewMessage(c, []byte("c")))
	}
	msg := message.NewMessage(uuid.NewString(), nil)
	e.pub.failAll.Store(true)
	if err := handle(e.ob, msg, h); err == nil {
		t.Fatal("dispatch through a failing publisher reported success")
	}
	// A failed dispatch moves inline effects to rows (each is then retried and parked on its own).
	mustEqual(t, "effect rows after the failed dispatch", e.count(`SELECT count(*) FROM outbox_effects_all`), 2)
	if got := e.storedEffects("c1", msg.UUID); !slices.Equal(got, []string{a, c}) {
		t.Fatalf("committed effects %v, want %v (the one in the rolled-back savepoint left out)", got, []string{a, c})
	}
	e.pub.failAll.Store(false)
	if err := handle(e.ob, copyOf(msg), h); err != nil {
		t.Fatal(err)
	}
	if got := e.sent("out_a"); !slices.Equal(got, []string{a, c}) {
		t.Fatalf("sent %v, want %v", got, []string{a, c})
	}

	// The same handler with the broker up: nothing but the claim is written, and it is cleared.
	msg2 := message.NewMessage(uuid.NewString(), nil)
	a, b, c = uuid.NewString(), uuid.NewString(), uuid.NewString()
	var held []string
	hold := func(msg *message.Message) ([]*message.Message, error) {
		if _, err := h(msg); err != nil {
			return nil, err
		}
		held = e.inlineHeldBy(msg)
		return nil, nil
	}
	if err := handle(e.ob, msg2, hold); err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(held, []string{a, c}) {
		t.Fatalf("the claim held %v before the commit, want %v", held, []string{a, c})
	}
	mustEqual(t, "effect rows", e.count(`SELECT count(*) FROM outbox_effects_all`), 0)
	mustEqual(t, "claims still holding effects after the mark", e.count(`SELECT count(*) FROM outbox_processed WHERE effects IS NOT NULL`), 0)
	if got := e.sent("out_a"); !slices.Equal(got[2:], []string{a, c}) {
		t.Fatalf("sent %v, want %v after the first two", got, []string{a, c})
	}
}

// inlineHeldBy reads, inside the unit of work of msg, what its claim holds inline.
func (e *env) inlineHeldBy(msg *message.Message) []string {
	e.t.Helper()
	ctx := msg.Context()
	var blob []byte
	if err := outbox.Tx(ctx).QueryRowContext(ctx, `SELECT effects FROM outbox_processed WHERE consumer = 'c1' AND message_id = $1`, msg.UUID).Scan(&blob); err != nil {
		e.t.Fatal(err)
	}
	return decodeUUIDs(e.t, blob)
}

// TestInlineEffectsWithKeysOfTheirOwn: effects with an ordering key of their own are rows, behind
// the earlier effects of their key, while those of the message's own key stay in the claim; each
// key keeps its order on every path: with the key held by an earlier effect (everything goes
// through the relay), and on redelivery.
func TestInlineEffectsWithKeysOfTheirOwn(t *testing.T) {
	e := newEnv(t, func(c *outbox.Config) {
		c.EffectRetention = 0
		c.RelayGrace = time.Hour // only a hand-over makes an effect due
		c.RelayInterval = 20 * time.Millisecond
	})
	// An earlier effect of key k, pending: the message's own effects of k must wait behind it.
	e.pub.failAll.Store(true)
	earlier := uuid.NewString()
	if err := e.ob.InTx(context.Background(), func(ctx context.Context, _ *sql.Tx) error {
		return outbox.Publish(outbox.WithOrderingKey(ctx, "k"), "out_b", message.NewMessage(earlier, nil))
	}); err != nil {
		t.Fatal(err)
	}
	e.pub.failAll.Store(false)
	own1, keyed, own2 := uuid.NewString(), uuid.NewString(), uuid.NewString()
	var held []string
	h := func(msg *message.Message) ([]*message.Message, error) {
		ctx := msg.Context()
		if err := outbox.Publish(ctx, "out_a", message.NewMessage(own1, nil)); err != nil {
			return nil, err
		}
		if err := outbox.Publish(outbox.WithOrderingKey(ctx, "k"), "out_b", message.NewMessage(keyed, nil)); err != nil {
			return nil, err
		}
		if err := outbox.Publish(ctx, "out_a", message.NewMessage(own2, nil)); err != nil {
			return nil, err
		}
		held = e.inlineHeldBy(msg)
		return nil, nil
	}
	msg := message.NewMessage(uuid.NewString(), nil)
	if err := handle(e.ob, msg, h); err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(held, []string{own1, own2}) {
		t.Fatalf("the claim held %v, want the effects of the message's own key %v", held, []string{own1, own2})
	}
	// Key k was held: the relay sends everything, k in order, the claim's effects as rows.
	mustEqual(t, "claims holding effects after the hand-over", e.count(`SELECT count(*) FROM outbox_processed WHERE effects IS NOT NULL`), 0)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error)
	go func() { done <- e.ob.Run(ctx) }()
	// Every effect marked, not only published: the publisher's row is visible before its Publish
	// returns, and a relay call still out when Run stops is taken as not delivered (its effect
	// stays leased, pending), which would hold key k for the redelivery below. A loaded CI run
	// failed so: the redelivery's dispatch was handed to the relay, and reported success.
	waitFor(t, "the relay", func() bool {
		return len(e.sent("out_a")) == 2 && len(e.sent("out_b")) == 2 && e.count(`SELECT count(*) FROM outbox_effects_all`) == 0
	})
	cancel()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if got := e.sent("out_b"); !slices.Equal(got, []string{earlier, keyed}) {
		t.Fatalf("key k sent as %v, want %v", got, []string{earlier, keyed})
	}
	if got := e.sent("out_a"); !slices.Equal(got, []string{own1, own2}) {
		t.Fatalf("the message's own key sent as %v, want %v", got, []string{own1, own2})
	}

	// Redelivered after a failed dispatch, with nothing holding k: both keys in order again.
	e.pub.failAll.Store(true)
	own1, keyed, own2 = uuid.NewString(), uuid.NewString(), uuid.NewString()
	msg2 := message.NewMessage(uuid.NewString(), nil)
	if err := handle(e.ob, msg2, h); err == nil {
		t.Fatal("dispatch through a failing publisher reported success")
	}
	e.pub.failAll.Store(false)
	if err := handle(e.ob, copyOf(msg2), h); err != nil {
		t.Fatal(err)
	}
	if got := e.sent("out_a")[2:]; !slices.Equal(got, []string{own1, own2}) {
		t.Fatalf("on redelivery the message's own key sent as %v, want %v", got, []string{own1, own2})
	}
	if got := e.sent("out_b")[2:]; !slices.Equal(got, []string{keyed}) {
		t.Fatalf("on redelivery key k sent as %v, want %v", got, []string{keyed})
	}
}

// TestInlineEffectsAfterTheHandlerCommits: a handler that commits the transaction with SQL (which
// database/sql cannot see) and then publishes gets its effect stored in the claim, committed at
// once, and sent once, as an effect row was.
func TestInlineEffectsAfterTheHandlerCommits(t *testing.T) {
	e := newEnv(t, func(c *outbox.Config) { c.EffectRetention = 0 })
	out := uuid.NewString()
	h := func(msg *message.Message) ([]*message.Message, error) {
		ctx := msg.Context()
		if _, err := outbox.Tx(ctx).ExecContext(ctx, `COMMIT`); err != nil {
			return nil, err
		}
		return nil, outbox.Publish(ctx, "out_a", message.NewMessage(out, nil))
	}
	msg := message.NewMessage(uuid.NewString(), nil)
	e.pub.failAll.Store(true)
	if err := handle(e.ob, msg, h); err == nil {
		t.Fatal("dispatch through a failing publisher reported success")
	}
	e.pub.failAll.Store(false)
	// In the claim: the framework's COMMIT is refused, which is the handler's doing (nothing
	// dispatched until the redelivery), not a commit lost in flight.
	if got := append(e.storedEffects("c1", msg.UUID), e.inlineOf(msg.UUID)...); !slices.Equal(got, []string{out}) {
		t.Fatalf("committed effects %v, want %v", got, []string{out})
	}
	if err := handle(e.ob, copyOf(msg), h); err != nil {
		t.Fatal(err)
	}
	if got := e.sent("out_a"); !slices.Equal(got, []string{out}) {
		t.Fatalf("sent %v, want %v", got, []string{out})
	}
}

// TestBoundaryEffectsAreRows: a unit of work at the boundary has no claim: its effects are rows.
func TestBoundaryEffectsAreRows(t *testing.T) {
	e := newEnv(t, func(c *outbox.Config) { c.EffectRetention = 0 })
	e.pub.failAll.Store(true)
	if err := e.ob.InTx(context.Background(), func(ctx context.Context, _ *sql.Tx) error {
		return outbox.Publish(ctx, "out_a", message.NewMessage(uuid.NewString(), nil))
	}); err != nil {
		t.Fatal(err)
	}
	mustEqual(t, "effect rows of a boundary unit", e.count(`SELECT count(*) FROM outbox_effects_all`), 1)
	mustEqual(t, "claims", e.count(`SELECT count(*) FROM outbox_processed`), 0)
}

// TestRefusedEffectAfterASuccessIsParked: in one dispatch the broker takes one effect and refuses
// the next, which is poison, not an outage: with RelayMaxAttempts 1 it is parked at once, though
// its move from the claim to a row (after the failure) takes longer than the unit of work did.
func TestRefusedEffectAfterASuccessIsParked(t *testing.T) {
	e := newEnv(t, func(c *outbox.Config) {
		c.RelayMaxAttempts = 1
		c.Failpoint = func(_ context.Context, point string) error {
			if point == outbox.FailpointAfterMaterialize {
				time.Sleep(100 * time.Millisecond) // a slow move: far longer than the unit of work
			}
			return nil
		}
	})
	e.pub.refuse = "out_b"
	msg := message.NewMessage(uuid.NewString(), nil)
	if err := handle(e.ob, msg, func(msg *message.Message) ([]*message.Message, error) {
		ctx := msg.Context()
		if err := outbox.Publish(ctx, "out_a", message.NewMessage(uuid.NewString(), nil)); err != nil {
			return nil, err
		}
		return nil, outbox.Publish(ctx, "out_b", message.NewMessage(uuid.NewString(), nil))
	}); err == nil {
		t.Fatal("a refused effect reported success")
	}
	mustEqual(t, "parked effects", e.count(`SELECT count(*) FROM outbox_effects_all WHERE parked_at IS NOT NULL AND topic = 'out_b'`), 1)
	mustEqual(t, "sent", len(e.sent("out_a")), 1)
}

// TestOneAtATimeRecordsSpillToRows: a handler that publishes its messages one Publish call at a
// time does not rewrite every earlier one at each call. Each record rewrites what the claim
// keeps, so the claim keeps effects only while its writes stay within the store's budget
// (postgres.Driver.MaxInlineBytes); then they move to effect rows, in order, and the claim holds
// none. Everything is sent in the order recorded, after the commit and on redelivery.
func TestOneAtATimeRecordsSpillToRows(t *testing.T) {
	e := newEnv(t, func(c *outbox.Config) { c.EffectRetention = 0 })
	const n = 100
	payload := make([]byte, 300)
	var ids []string
	var claimBytes, rows int
	h := func(msg *message.Message) ([]*message.Message, error) {
		ctx := msg.Context()
		ids = ids[:0]
		for range n {
			id := uuid.NewString()
			ids = append(ids, id)
			if err := outbox.Publish(ctx, "out_a", message.NewMessage(id, payload)); err != nil {
				return nil, err
			}
		}
		tx := outbox.Tx(ctx)
		if err := tx.QueryRowContext(ctx, `SELECT coalesce(length(effects), 0) FROM outbox_processed WHERE consumer = 'c1' AND message_id = $1`, msg.UUID).Scan(&claimBytes); err != nil {
			return nil, err
		}
		return nil, tx.QueryRowContext(ctx, `SELECT count(*) FROM outbox_effects_all WHERE source_id = $1`, msg.UUID).Scan(&rows)
	}
	msg := message.NewMessage(uuid.NewString(), nil)
	if err := handle(e.ob, msg, h); err != nil {
		t.Fatal(err)
	}
	if claimBytes != 0 || rows != n {
		t.Fatalf("after %d records of one effect the claim held %d bytes and %d effects were rows: every record rewrote all the effects before it (want none in the claim, %d rows)",
			n, claimBytes, rows, n)
	}
	if got := e.sent("out_a"); !slices.Equal(got, ids) {
		t.Fatalf("sent %d effects, not the %d recorded in their order", len(got), n)
	}
	mustEqual(t, "pending effects after the dispatch", e.count(`SELECT count(*) FROM outbox_effects_all`), 0)

	// Redelivered after a failed dispatch: the rows, in order.
	e.pub.failAll.Store(true)
	msg2 := message.NewMessage(uuid.NewString(), nil)
	if err := handle(e.ob, msg2, h); err == nil {
		t.Fatal("dispatch through a failing publisher reported success")
	}
	want := slices.Clone(ids)
	e.pub.failAll.Store(false)
	if err := handle(e.ob, copyOf(msg2), h); err != nil {
		t.Fatal(err)
	}
	if got := e.sent("out_a")[n:]; !slices.Equal(got, want) {
		t.Fatalf("on redelivery sent %d effects, not the %d committed in their order", len(got), n)
	}
}

// TestSpillsThroughSavepoints: with a budget of two effects, the third record moves the claim's
// effects to rows (a spill). Savepoints rolled back around, before and after a spill give back
// what was kept before them, in the claim or as rows; whatever mix is left, the effects that
// commit are those recorded outside the rolled-back savepoints, stored in one place in the order
// recorded, and sent in that order after the commit and on redelivery.
func TestSpillsThroughSavepoints(t *testing.T) {
	cases := []struct {
		name  string
		steps []string // a label publishes a message; sp: SAVEPOINT; rb: ROLLBACK TO SAVEPOINT
		want  []string // the labels committed, in order
	}{
		{"spill in a savepoint rolled back, then a record", []string{"a", "b", "sp", "c", "rb", "d"}, []string{"a", "b", "d"}},
		{"spill in a savepoint rolled back, nothing after", []string{"a", "b", "sp", "c", "rb"}, []string{"a", "b"}},
		{"two savepoints rolled back", []string{"a", "b", "sp", "c", "rb", "d", "sp", "e", "rb", "f"}, []string{"a", "b", "d", "f"}},
		{"spill before a savepoint", []string{"a", "b", "c", "sp", "d", "rb", "e"}, []string{"a", "b", "c", "e"}},
		{"savepoint before every write", []string{"sp", "a", "b", "c", "rb", "d"}, []string{"d"}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			e := newEnv(t, func(c *outbox.Config) {
				c.EffectRetention = 0
				c.Driver = postgres.Driver{MaxInlineBytes: 600}
			})
			ids := map[string]string{}
			var spilled bool
			h := func(msg *message.Message) ([]*message.Message, error) {
				ctx := msg.Context()
				tx := outbox.Tx(ctx)
				clear(ids)
				for _, step := range tc.steps {
					var err error
					switch step {
					case "sp":
						_, err = tx.ExecContext(ctx, `SAVEPOINT sp`)
					case "rb":
						_, err = tx.ExecContext(ctx, `ROLLBACK TO SAVEPOINT sp`)
					default:
						ids[step] = uuid.NewString()
						err = outbox.Publish(ctx, "out_a", message.NewMessage(ids[step], []byte(step)))
					}
					if err != nil {
						return nil, err
					}
					if step == "c" {
						var rows int
						if err := tx.QueryRowContext(ctx, `SELECT count(*) FROM outbox_effects_all WHERE source_id = $1`, msg.UUID).Scan(&rows); err != nil {
							return nil, err
						}
						spilled = rows == 3 && len(e.inlineHeldBy(msg)) == 0
					}
				}
				return nil, nil
			}
			labels := func(uuids []string) []string {
				var out []string
				for _, u := range uuids {
					for l, id := range ids {
						if id == u {
							out = append(out, l)
						}
					}
				}
				return out
			}
			msg := message.NewMessage(uuid.NewString(), nil)
			if err := handle(e.ob, msg, h); err != nil {
				t.Fatal(err)
			}
			if !spilled {
				t.Fatal("the third record did not move the effects to three rows")
			}
			if got := labels(e.sent("out_a")); !slices.Equal(got, tc.want) {
				t.Fatalf("sent %v, want %v", got, tc.want)
			}
			mustEqual(t, "effect rows left", e.count(`SELECT count(*) FROM outbox_effects_all`), 0)
			mustEqual(t, "claims holding effects", e.count(`SELECT count(*) FROM outbox_processed WHERE effects IS NOT NULL`), 0)

			// Crashed after the commit: what committed, in order, in one place (rows or the
			// claim, never both), and sent in order on redelivery.
			crashing := e.newOutbox(func(c *outbox.Config) {
				c.EffectRetention = 0
				c.Driver = postgres.Driver{MaxInlineBytes: 600}
				c.Failpoint = func(_ context.Context, point string) error {
					if point == outbox.FailpointAfterCommit {
						return errors.New("crashed")
					}
					return nil
				}
			})
			msg2 := message.NewMessage(uuid.NewString(), nil)
			if err := handle(crashing, msg2, h); err == nil {
				t.Fatal("a unit that crashed after its commit reported success")
			}
			inClaim, asRows := labels(e.inlineOf(msg2.UUID)), labels(e.storedEffects("c1", msg2.UUID))
			if len(inClaim) > 0 && len(asRows) > 0 || !slices.Equal(append(asRows, inClaim...), tc.want) {
				t.Fatalf("committed %v as rows and %v in the claim, want %v in one place", asRows, inClaim, tc.want)
			}
			if err := handle(e.ob, copyOf(msg2), h); err != nil {
				t.Fatal(err)
			}
			if got := labels(e.sent("out_a")[len(tc.want):]); !slices.Equal(got, tc.want) {
				t.Fatalf("on redelivery sent %v, want %v", got, tc.want)
			}
		})
	}
}

// TestSpillAfterTheHandlerCommits: a handler that commits the transaction with SQL and then
// records past the budget runs the spill outside any transaction: the claim's effects and the new
// one become rows in one statement, so that none is lost or doubled, and all are sent in order.
func TestSpillAfterTheHandlerCommits(t *testing.T) {
	e := newEnv(t, func(c *outbox.Config) {
		c.EffectRetention = 0
		c.Driver = postgres.Driver{MaxInlineBytes: 600}
	})
	var ids []string
	h := func(msg *message.Message) ([]*message.Message, error) {
		ctx := msg.Context()
		ids = ids[:0]
		for i, label := range []string{"a", "b", "commit", "c", "d"} {
			if label == "commit" {
				if _, err := outbox.Tx(ctx).ExecContext(ctx, `COMMIT`); err != nil {
					return nil, err
				}
				if got := e.inlineOf(msg.UUID); len(got) != 2 {
					return nil, fmt.Errorf("the claim committed %d effects, want 2", len(got))
				}
				continue
			}
			ids = append(ids, uuid.NewString())
			if err := outbox.Publish(ctx, "out_a", message.NewMessage(ids[len(ids)-1], []byte(label))); err != nil {
				return nil, fmt.Errorf("record %d: %w", i, err)
			}
			if label == "c" && len(e.inlineOf(msg.UUID)) > 0 {
				return nil, errors.New("the third record did not move the claim's effects to rows")
			}
		}
		return nil, nil
	}
	msg := message.NewMessage(uuid.NewString(), nil)
	e.pub.failAll.Store(true)
	if err := handle(e.ob, msg, h); err == nil {
		t.Fatal("dispatch through a failing publisher reported success")
	}
	want := slices.Clone(ids)
	if got, held := e.storedEffects("c1", msg.UUID), e.inlineOf(msg.UUID); !slices.Equal(got, want) || len(held) > 0 {
		t.Fatalf("committed %v as rows and %v in the claim, want %v as rows", got, held, want)
	}
	e.pub.failAll.Store(false)
	if err := handle(e.ob, copyOf(msg), h); err != nil {
		t.Fatal(err)
	}
	if got := e.sent("out_a"); !slices.Equal(got, want) {
		t.Fatalf("sent %v, want %v", got, want)
	}
}
