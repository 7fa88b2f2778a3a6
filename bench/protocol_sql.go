package main

import (
	"context"
	"database/sql"
	"errors"

	"github.com/google/uuid"
	"github.com/lib/pq"

	"github.com/watermill-outbox/outbox"
	"github.com/watermill-outbox/outbox/drivers/postgres"
	"github.com/watermill-outbox/outbox/outboxdriver"
	"github.com/watermill-outbox/outbox/store"
)

// protocolSQL is the database/sql form's protocol written out by hand, with nothing around it, as
// protocolPgx is the pgx form's: the statements outbox-middleware sends for a message, on tables
// its migrations made, through the same driver (lib/pq) and pool, prepared per connection as the
// framework prepares them. BEGIN; the claim (an INSERT that a concurrent copy waits behind, and
// that tells a copy whether its claim is settled); the business write; the effect written into the
// claim (a HOT update); COMMIT; the publish, called in place; the mark, batched in the background
// (5 ms, as the framework's marker) with asynchronous commit, sent as the framework sends it. No
// relay, no sweep, no timeouts, no telemetry, no savepoint guard, no recovery: not exactly-once
// when something fails, so it runs in no safety check.
//
// protocol-sql / bare is the most any client of these statements reaches through database/sql on
// this machine; outbox-middleware / protocol-sql is what the framework's code adds to them.
type protocolSQL struct {
	base
	ob                  *outbox.Outbox // its migrations made the tables; it is never run
	claim, record, mark *sql.Stmt
	marks               *protocolMarker
}

const protocolSQLPrefix = "protosql_"

func newProtocolSQL(e *env) (contender, error) {
	b, err := newBase(e)
	if err != nil {
		return nil, err
	}
	c := &protocolSQL{base: b}
	if err := c.open(e); err != nil {
		c.close()
		return nil, err
	}
	return c, nil
}

func (c *protocolSQL) open(e *env) error {
	var err error
	if c.ob, err = outbox.New(outbox.Config{DB: c.db, Driver: postgres.Driver{}, Publisher: e.pub, TablePrefix: protocolSQLPrefix}); err != nil {
		return err
	}
	if err := c.ob.Migrate(context.Background()); err != nil {
		return err
	}
	n, err := postgres.NewNames("public", protocolSQLPrefix)
	if err != nil {
		return err
	}
	// The framework's statements, as pg_stat_statements shows them (the postgres driver's claim,
	// its write of inline effects into the claim, its mark).
	if c.claim, err = c.db.Prepare(postgres.Queries(n, true, nil).MessageClaim); err != nil {
		return err
	}
	if c.record, err = c.db.Prepare(postgres.InlineRecord(n)); err != nil {
		return err
	}
	if c.mark, err = c.db.Prepare(postgres.InlineMark(n)); err != nil {
		return err
	}
	c.marks = &protocolMarker{exec: func(ctx context.Context, ids []string) error {
		_, err := c.mark.ExecContext(ctx, protocolConsumer, pq.Array(ids))
		return err
	}}
	return nil
}

func (c *protocolSQL) name() string       { return "protocol-sql" }
func (c *protocolSQL) path() string       { return "ceiling" }
func (c *protocolSQL) safe() bool         { return false }
func (c *protocolSQL) crashPoint() string { return "" }
func (c *protocolSQL) tables() []string {
	return []string{protocolSQLPrefix + "processed", protocolSQLPrefix + "effects"}
}

func (c *protocolSQL) stop() error {
	if c.marks != nil {
		c.marks.wait()
	}
	return nil
}

func (c *protocolSQL) close() {
	_ = c.stop()
	for _, st := range []*sql.Stmt{c.claim, c.record, c.mark} {
		if st != nil {
			_ = st.Close()
		}
	}
	if c.ob != nil {
		_ = c.ob.Close()
	}
	c.base.close()
}

func (c *protocolSQL) handle(ctx context.Context, d delivery) (bool, error) {
	tx, err := c.db.BeginTx(ctx, nil)
	if err != nil {
		return false, err
	}
	var claimed bool
	var age sql.NullInt64
	var settled sql.NullBool
	if err := tx.StmtContext(ctx, c.claim).QueryRowContext(ctx, protocolConsumer, d.id).Scan(&claimed, &age, &settled); err != nil {
		_ = tx.Rollback()
		return false, err
	}
	if !claimed {
		// A copy: its effect went out with the first delivery and was marked (settled), as the
		// benchmark's copies come after their original; the framework would read what is pending
		// otherwise.
		return false, tx.Rollback()
	}
	if err := businessSQL(ctx, tx, d.id); err != nil {
		_ = tx.Rollback()
		return false, err
	}
	m := outgoing(d, uuid.NewString())
	src := outboxdriver.Source{Consumer: protocolConsumer, ID: d.id}
	effect := outboxdriver.Effect{Kind: outboxdriver.KindPublish, Topic: outTopic, UUID: m.UUID, Payload: m.Payload,
		Metadata: m.Metadata, Source: src, OrderingKey: outboxdriver.DefaultOrderingKey(src)}
	var nested bool
	err = tx.StmtContext(ctx, c.record).QueryRowContext(ctx, protocolConsumer, d.id, store.EncodeEffects([]outboxdriver.Effect{effect}), 0).Scan(&nested)
	if errors.Is(err, sql.ErrNoRows) {
		err = errors.New("protocol-sql: the claim was not found to write the effect into")
	}
	if err != nil {
		_ = tx.Rollback()
		return false, err
	}
	if err := tx.Commit(); err != nil {
		return false, err
	}
	if err := c.e.pub.Publish(outTopic, m); err != nil {
		return false, err
	}
	c.marks.add(d.id)
	return false, nil
}
