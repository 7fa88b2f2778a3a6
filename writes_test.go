package outbox_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"

	"github.com/watermill-outbox/outbox"
	"github.com/watermill-outbox/outbox/drivers/postgres"
	"github.com/watermill-outbox/outbox/internal/pgtest"
	"github.com/watermill-outbox/outbox/outboxtest"
)

// writesPerMessage is how many messages each form processes in TestWritesPerMessage.
const writesPerMessage = 40

// measureWrites runs each of n units of work through a fresh Outbox of the default
// configuration on database/sql and returns what they wrote to each outbox table (and applied),
// the background marks included. The Outbox's connections are closed before the counts are read
// (a backend reports them at its exit), and the migration's writes are left out.
func measureWrites(t *testing.T, n int, unit func(ctx context.Context, ob *outbox.Outbox, i int) error) map[string]pgtest.Writes {
	t.Helper()
	return measureWritesWith(t, n, nil, unit, nil)
}

// measureWritesWith is measureWrites on an Outbox whose configuration mutate changes (when not
// nil), followed by then (when not nil), whose writes count too.
func measureWritesWith(t *testing.T, n int, mutate func(*outbox.Config), unit func(ctx context.Context, ob *outbox.Outbox, i int) error,
	then func(ctx context.Context, ob *outbox.Outbox, reader *sql.DB)) map[string]pgtest.Writes {
	t.Helper()
	ctx := context.Background()
	dsn := pgtest.DSN(t)
	open := func() (*sql.DB, *outbox.Outbox) {
		db, err := sql.Open("postgres", dsn)
		if err != nil {
			t.Fatal(err)
		}
		cfg := outbox.Config{DB: db, Driver: postgres.Driver{}, Publisher: &outboxtest.Recorder{}, Logger: watermill.NopLogger{}}
		if mutate != nil {
			mutate(&cfg)
		}
		ob, err := outbox.New(cfg)
		if err != nil {
			t.Fatal(err)
		}
		return db, ob
	}
	reader, err := sql.Open("postgres", dsn)
	if err != nil {
		t.Fatal(err)
	}
	defer reader.Close()

	db, ob := open()
	if err := ob.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	if _, err := db.Exec(`CREATE TABLE applied (message_id text NOT NULL, note text)`); err != nil {
		t.Fatal(err)
	}
	// Under an autoanalyze of a table the units filled (its snapshot keeps pruning from freeing
	// a page's old versions), a mark's update that would be HOT was not: one in 120, in a loaded
	// run of the package.
	pgtest.NoAutovacuum(t, db)
	if err := ob.Close(); err != nil {
		t.Fatal(err)
	}
	_ = db.Close()
	before := pgtest.TableWrites(t, reader, "public")

	db, ob = open()
	for i := range n {
		if err := unit(ctx, ob, i); err != nil {
			t.Fatalf("unit %d: %v", i, err)
		}
	}
	if then != nil {
		then(ctx, ob, reader)
	}
	if err := ob.Close(); err != nil { // waits for the background marks
		t.Fatal(err)
	}
	_ = db.Close()
	got, names := pgtest.WritesSince(pgtest.TableWrites(t, reader, "public"), before)
	for _, name := range names {
		t.Logf("%-20s per unit: %s", name, got[name].Per(n))
	}
	return got
}

// atMost fails the test unless every count of got is at most n times the one of want, but for
// the updates that were not HOT: one in ten units may have one more. An update is HOT only if
// its page has room, which pruning frees once no snapshot sees the old versions, and any
// transaction of the database holds such a snapshot for a moment (the autovacuum worker's visit
// to the catalogs, once a minute: 1 to 3 such updates in 40 units with a visit a second). A
// form whose updates are not HOT by design (an indexed column written, a page always full) has
// them all so, and fails.
func atMost(t *testing.T, what string, got pgtest.Writes, n int, want pgtest.Writes) {
	t.Helper()
	if got.Inserts > want.Inserts*int64(n) || got.Updates > want.Updates*int64(n) ||
		got.NonHOT() > want.NonHOT()*int64(n)+int64(n/10) || got.Deletes > want.Deletes*int64(n) {
		t.Errorf("%s: %s per unit, want at most %s", what, got.Per(n), want.Per(1))
	}
}

// TestWritesPerMessage counts the row versions a unit of work with two effects writes to the
// outbox tables in each database/sql form, its mark included, on a real PostgreSQL: every update
// and delete is a dead version that vacuum must remove and that a long transaction elsewhere keeps
// (docs/benchmarks.md, "Writes per message"). The bounds are what the forms write today; a change
// that writes more per message fails here.
func TestWritesPerMessage(t *testing.T) {
	publishTwo := func(ctx context.Context) error {
		if err := outbox.Publish(ctx, "out_a", message.NewMessage(uuid.NewString(), []byte(`{"step":1}`))); err != nil {
			return err
		}
		return outbox.Publish(ctx, "out_b", message.NewMessage(uuid.NewString(), []byte(`{"step":2}`)))
	}

	consume := func(ob *outbox.Outbox, i int) error {
		msg := message.NewMessage(fmt.Sprint("m-", i), nil)
		return ob.Handle(msg, outbox.HandleParams{Consumer: "c1", MessageID: msg.UUID}, func(msg *message.Message) ([]*message.Message, error) {
			ctx := msg.Context()
			if _, err := outbox.Tx(ctx).ExecContext(ctx, `INSERT INTO applied (message_id) VALUES ($1)`, msg.UUID); err != nil {
				return nil, err
			}
			return nil, publishTwo(ctx)
		})
	}

	t.Run("database/sql", func(t *testing.T) {
		// The effects are kept in the claim: its insert, one write per record, the mark.
		got := measureWrites(t, writesPerMessage, func(_ context.Context, ob *outbox.Outbox, i int) error { return consume(ob, i) })
		atMost(t, "claims", got["outbox_processed"], writesPerMessage, pgtest.Writes{Inserts: 1, Updates: 3, HOT: 3})
		atMost(t, "effect rows", got["outbox_effects_all"], writesPerMessage, pgtest.Writes{})
	})

	t.Run("database/sql, 600-byte effects", func(t *testing.T) {
		// A claim holds three versions of itself at its commit (its insert and two records, the
		// second with both effects: 1.3 KB), all of which must fit on its page for the records to be
		// HOT updates; pruning then frees the space the older ones took.
		payload := make([]byte, 600)
		got := measureWrites(t, writesPerMessage, func(_ context.Context, ob *outbox.Outbox, i int) error {
			msg := message.NewMessage(fmt.Sprint("m-", i), nil)
			return ob.Handle(msg, outbox.HandleParams{Consumer: "c1", MessageID: msg.UUID}, func(msg *message.Message) ([]*message.Message, error) {
				ctx := msg.Context()
				if err := outbox.Publish(ctx, "out_a", message.NewMessage(uuid.NewString(), payload)); err != nil {
					return nil, err
				}
				return nil, outbox.Publish(ctx, "out_b", message.NewMessage(uuid.NewString(), payload))
			})
		})
		atMost(t, "claims", got["outbox_processed"], writesPerMessage, pgtest.Writes{Inserts: 1, Updates: 3, HOT: 3})
		atMost(t, "effect rows", got["outbox_effects_all"], writesPerMessage, pgtest.Writes{})
	})

	t.Run("database/sql, late, in the claim and a row", func(t *testing.T) {
		// A unit that takes longer than ClaimClockSlack moves its claim's dispatch time with its
		// mark; one of its effects is in the claim, the other (a key of its own) a row.
		got := measureWrites(t, 3, func(_ context.Context, ob *outbox.Outbox, i int) error {
			msg := message.NewMessage(fmt.Sprint("m-", i), nil)
			return ob.Handle(msg, outbox.HandleParams{Consumer: "c1", MessageID: msg.UUID}, func(msg *message.Message) ([]*message.Message, error) {
				ctx := msg.Context()
				if err := outbox.Publish(ctx, "out_a", message.NewMessage(uuid.NewString(), []byte(`{"step":1}`))); err != nil {
					return nil, err
				}
				if err := outbox.Publish(outbox.WithOrderingKey(ctx, fmt.Sprint("k-", i)), "out_b", message.NewMessage(uuid.NewString(), []byte(`{"step":2}`))); err != nil {
					return nil, err
				}
				time.Sleep(outbox.ClaimClockSlack + 100*time.Millisecond)
				return nil, nil
			})
		})
		atMost(t, "claims", got["outbox_processed"], 3, pgtest.Writes{Inserts: 1, Updates: 2, HOT: 2})
		atMost(t, "effect rows", got["outbox_effects_all"], 3, pgtest.Writes{Inserts: 1, Deletes: 1})
	})

	t.Run("boundary", func(t *testing.T) {
		// No claim: the effects are rows, deleted by the mark.
		got := measureWrites(t, writesPerMessage, func(ctx context.Context, ob *outbox.Outbox, i int) error {
			return ob.InTx(ctx, func(ctx context.Context, tx *sql.Tx) error {
				if _, err := tx.ExecContext(ctx, `INSERT INTO applied (message_id) VALUES ($1)`, fmt.Sprint("b-", i)); err != nil {
					return err
				}
				return publishTwo(ctx)
			})
		})
		atMost(t, "claims", got["outbox_processed"], writesPerMessage, pgtest.Writes{})
		atMost(t, "effect rows", got["outbox_effects_all"], writesPerMessage, pgtest.Writes{Inserts: 2, Deletes: 2})
	})

	// Units that crash after their commit leave their effects to the relay (a sweep moves the
	// ones in claims to rows first): each key's first effect is leased (an update), and the
	// relay's marks delete the rows.
	crash := errors.New("crash after the commit")
	leftBehind := func(unit func(ctx context.Context, ob *outbox.Outbox, i int) error) (
		func(*outbox.Config), func(ctx context.Context, ob *outbox.Outbox, i int) error, func(ctx context.Context, ob *outbox.Outbox, reader *sql.DB)) {
		var crashing atomic.Bool
		crashing.Store(true)
		mutate := func(c *outbox.Config) {
			c.RelayGrace, c.RelayInterval = time.Millisecond, 20*time.Millisecond
			c.Failpoint = func(_ context.Context, point string) error {
				if point == outbox.FailpointAfterCommit && crashing.Load() {
					return crash
				}
				return nil
			}
		}
		crashed := func(ctx context.Context, ob *outbox.Outbox, i int) error {
			if err := unit(ctx, ob, i); !errors.Is(err, crash) {
				return fmt.Errorf("want the crash, got %w", err)
			}
			return nil
		}
		drain := func(ctx context.Context, ob *outbox.Outbox, reader *sql.DB) {
			crashing.Store(false)
			ctx, cancel := context.WithCancel(ctx)
			done := make(chan error, 1)
			go func() { done <- ob.Run(ctx) }()
			waitFor(t, "the relay to send every effect", func() bool {
				var n int
				if err := reader.QueryRow(`SELECT (SELECT count(*) FROM outbox_effects_all)
					+ (SELECT count(*) FROM outbox_processed WHERE effects IS NOT NULL)`).Scan(&n); err != nil {
					t.Fatal(err)
				}
				return n == 0
			})
			cancel()
			if err := <-done; err != nil && !errors.Is(err, context.Canceled) {
				t.Fatal(err)
			}
		}
		return mutate, crashed, drain
	}

	t.Run("boundary, left to the relay", func(t *testing.T) {
		mutate, unit, drain := leftBehind(func(ctx context.Context, ob *outbox.Outbox, i int) error {
			return ob.InTx(ctx, func(ctx context.Context, tx *sql.Tx) error {
				if _, err := tx.ExecContext(ctx, `INSERT INTO applied (message_id) VALUES ($1)`, fmt.Sprint("r-", i)); err != nil {
					return err
				}
				return publishTwo(ctx)
			})
		})
		got := measureWritesWith(t, writesPerMessage, mutate, unit, drain)
		atMost(t, "effect rows", got["outbox_effects_all"], writesPerMessage, pgtest.Writes{Inserts: 2, Updates: 1, HOT: 1, Deletes: 2})
	})

	t.Run("database/sql, left to the relay", func(t *testing.T) {
		mutate, unit, drain := leftBehind(func(_ context.Context, ob *outbox.Outbox, i int) error {
			return consume(ob, i)
		})
		got := measureWritesWith(t, writesPerMessage, mutate, unit, drain)
		atMost(t, "claims", got["outbox_processed"], writesPerMessage, pgtest.Writes{Inserts: 1, Updates: 9, HOT: 9})
		atMost(t, "effect rows", got["outbox_effects_all"], writesPerMessage, pgtest.Writes{Inserts: 2, Updates: 9, HOT: 9, Deletes: 2})
	})
}
