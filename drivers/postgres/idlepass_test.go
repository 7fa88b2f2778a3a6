package postgres

import (
	"context"
	"database/sql"
	"database/sql/driver"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/lib/pq"

	"github.com/watermill-outbox/outbox/internal/pgtest"
	"github.com/watermill-outbox/outbox/outboxdriver"
	"github.com/watermill-outbox/outbox/store"
)

// statementLog records what a pool sends: each statement's first words, and BEGIN, COMMIT and
// ROLLBACK as the transactions begin and end. lib/pq sends a statement with arguments as two
// server transactions (Parse, then Bind and Execute), so the log counts statements, not them.
type statementLog struct {
	mu   sync.Mutex
	sent []string
}

func (l *statementLog) add(s string) {
	f := strings.Fields(s)
	s = strings.Join(f[:min(len(f), 8)], " ")
	l.mu.Lock()
	l.sent = append(l.sent, s)
	l.mu.Unlock()
}

// take returns what was sent since the last take.
func (l *statementLog) take() []string {
	l.mu.Lock()
	defer l.mu.Unlock()
	s := l.sent
	l.sent = nil
	return s
}

// countedDB is a pool on dsn whose statements go to log.
func countedDB(t *testing.T, dsn string, log *statementLog) *sql.DB {
	t.Helper()
	c, err := pq.NewConnector(dsn)
	if err != nil {
		t.Fatal(err)
	}
	db := sql.OpenDB(countingConnector{c, log})
	t.Cleanup(func() { _ = db.Close() })
	return db
}

type countingConnector struct {
	driver.Connector
	log *statementLog
}

func (c countingConnector) Connect(ctx context.Context) (driver.Conn, error) {
	conn, err := c.Connector.Connect(ctx)
	if err != nil {
		return nil, err
	}
	return &countingConn{conn.(pqConn), c.log}, nil
}

// pqConn is what lib/pq's connection implements and database/sql uses.
type pqConn interface {
	driver.Conn
	driver.ConnBeginTx
	driver.ConnPrepareContext
	driver.QueryerContext
	driver.ExecerContext
	driver.NamedValueChecker
	driver.SessionResetter
	driver.Validator
}

type countingConn struct {
	pqConn
	log *statementLog
}

func (c *countingConn) BeginTx(ctx context.Context, opts driver.TxOptions) (driver.Tx, error) {
	c.log.add("BEGIN")
	tx, err := c.pqConn.BeginTx(ctx, opts)
	if err != nil {
		return nil, err
	}
	return countingTx{tx, c.log}, nil
}

func (c *countingConn) QueryContext(ctx context.Context, query string, args []driver.NamedValue) (driver.Rows, error) {
	c.log.add(query)
	return c.pqConn.QueryContext(ctx, query, args)
}

func (c *countingConn) ExecContext(ctx context.Context, query string, args []driver.NamedValue) (driver.Result, error) {
	c.log.add(query)
	return c.pqConn.ExecContext(ctx, query, args)
}

func (c *countingConn) PrepareContext(ctx context.Context, query string) (driver.Stmt, error) {
	st, err := c.pqConn.PrepareContext(ctx, query)
	if err != nil {
		return nil, err
	}
	return countingStmt{st.(pqStmt), query, c.log}, nil
}

type pqStmt interface {
	driver.Stmt
	driver.StmtExecContext
	driver.StmtQueryContext
}

type countingStmt struct {
	pqStmt
	query string
	log   *statementLog
}

func (s countingStmt) ExecContext(ctx context.Context, args []driver.NamedValue) (driver.Result, error) {
	s.log.add(s.query)
	return s.pqStmt.ExecContext(ctx, args)
}

func (s countingStmt) QueryContext(ctx context.Context, args []driver.NamedValue) (driver.Rows, error) {
	s.log.add(s.query)
	return s.pqStmt.QueryContext(ctx, args)
}

type countingTx struct {
	driver.Tx
	log *statementLog
}

func (t countingTx) Commit() error   { t.log.add("COMMIT"); return t.Tx.Commit() }
func (t countingTx) Rollback() error { t.log.add("ROLLBACK"); return t.Tx.Rollback() }

// idlePass is a relay pass of st as the relay makes the first of an idle member's passes,
// IdleMax after the one before: the sweep and the look at the rotation both due.
func idlePass(t *testing.T, st *inline, grace time.Duration) outboxdriver.EffectClaim {
	t.Helper()
	st.lastSweep.Store(0)
	st.lastRotate.Store(0)
	c, err := st.EffectClaimDue(context.Background(), outboxdriver.EffectClaimParams{Grace: grace, Limit: 100, MaxBytes: 1 << 20, Lease: time.Minute})
	if err != nil {
		t.Fatal(err)
	}
	return c
}

// TestIdleRelayPassIsOneStatement: a relay pass over tables nothing was written to since the
// pass before is one statement, in no transaction: the claim, which also reads the rotation's row
// and how many writes the claims table has had. It was six and a transaction (the probe, the
// sweep's four statements between BEGIN and COMMIT, the claim), then two (the probe and the
// claim): with a member's passes every 30 s, 200 idle tenants sent some 40 statements and 53
// transactions a second, then 13 statements from their relays. A Store that never rotates reads
// the count alone, with the claim all the same.
func TestIdleRelayPassIsOneStatement(t *testing.T) {
	for _, every := range []time.Duration{0, -1} {
		var log statementLog
		db := countedDB(t, pgtest.DSN(t), &log)
		st := rotationStore(t, db, every)
		idlePass(t, st, 10*time.Second) // the first pass sweeps: it knows nothing of the tables yet
		log.take()
		for pass := range 3 {
			idlePass(t, st, 10*time.Second)
			sent := log.take()
			if len(sent) != 1 {
				t.Errorf("RotateEvery %v: idle pass %d sent %d statements, want 1 (the claim):\n%s", every, pass, len(sent), strings.Join(sent, "\n"))
			}
		}
	}
}

// TestIdleRelayPassClaimsWhatItsSweepMoved: the sweep of an idle pass comes after the claim that
// read whether it may be skipped; when it moves inline effects left behind into effect rows, the
// same pass claims them: they wait for no further pass (IdleMax later for a member backed off).
func TestIdleRelayPassClaimsWhatItsSweepMoved(t *testing.T) {
	dsn := pgtest.DSN(t)
	var log statementLog
	db := countedDB(t, dsn, &log)
	st := rotationStore(t, db, 0)
	other, err := sql.Open("postgres", dsn)
	if err != nil {
		t.Fatal(err)
	}
	defer other.Close()
	const grace = statsLag // the sweep may be skipped: the claim comes first
	idlePass(t, st, grace)
	src := outboxdriver.Source{Consumer: "c", ID: "left-behind"}
	effects := []outboxdriver.Effect{{Source: src, Seq: 1, Kind: outboxdriver.KindPublish, Topic: "t", UUID: "u1", Payload: []byte("p"), OrderingKey: "k"}}
	if _, err := other.Exec(`INSERT INTO rot_processed (consumer, message_id, processed_at, dispatched_at, effects, inline_xid)
		VALUES ($1, $2, now() - interval '1 minute', now() - interval '1 minute', $3, pg_current_xact_id()::text::bigint)`,
		src.Consumer, src.ID, store.EncodeEffects(effects)); err != nil {
		t.Fatal(err)
	}
	log.take()
	written := time.Now()
	for {
		c := idlePass(t, st, grace)
		sent := log.take()
		if !strings.HasPrefix(sent[0], "WITH look AS") {
			t.Fatalf("the idle pass began with %q, want the claim with the look", sent[0])
		}
		if len(sent) > 1 { // swept
			if len(c.Effects) != 1 || c.Effects[0].UUID != "u1" {
				t.Fatalf("the pass that swept the effect left behind claimed %d effects, want it (statements: %q)", len(c.Effects), sent)
			}
			break
		}
		if time.Since(written) > statsLag+5*time.Second {
			t.Fatalf("no pass swept the effect left behind %v after its write", time.Since(written))
		}
		time.Sleep(100 * time.Millisecond)
	}
	if c := idlePass(t, st, grace); len(c.Effects) != 0 {
		t.Errorf("the pass after claimed %d effects, want none (the one before leased it)", len(c.Effects))
	}
}

// TestIdleRelaySweepsWhatAnotherInstanceLeftBehind: an idle relay pass that finds the claims
// table written since its last sweep sweeps again, and moves the inline effects another instance
// left behind (it crashed between its commit and its mark), as soon as the server's statistics
// count the write: within statsLag of the writer's commit. The claim is dated a minute back, as
// one left behind before an idle relay looks is: older than the grace period (the default, 10 s)
// when it is seen. With a shorter grace every sweep runs, skipped or not.
func TestIdleRelaySweepsWhatAnotherInstanceLeftBehind(t *testing.T) {
	dsn := pgtest.DSN(t)
	var log statementLog
	db := countedDB(t, dsn, &log)
	st := rotationStore(t, db, 0)
	other, err := sql.Open("postgres", dsn)
	if err != nil {
		t.Fatal(err)
	}
	defer other.Close()
	const grace = statsLag
	idlePass(t, st, grace)
	idlePass(t, st, grace) // idle from here on

	src := outboxdriver.Source{Consumer: "c", ID: "left-behind"}
	effects := []outboxdriver.Effect{{Source: src, Seq: 1, Kind: outboxdriver.KindPublish, Topic: "t", UUID: "u1", Payload: []byte("p"), OrderingKey: "k"}}
	if _, err := other.Exec(`INSERT INTO rot_processed (consumer, message_id, processed_at, dispatched_at, effects, inline_xid)
		VALUES ($1, $2, now() - interval '1 minute', now() - interval '1 minute', $3, pg_current_xact_id()::text::bigint)`,
		src.Consumer, src.ID, store.EncodeEffects(effects)); err != nil {
		t.Fatal(err)
	}
	written := time.Now()
	skipped := false
	for {
		c := idlePass(t, st, grace)
		sent := log.take()
		skipped = skipped || len(sent) == 1
		if len(c.Effects) == 1 && c.Effects[0].UUID == "u1" {
			t.Logf("claimed %v after the write (passes skipped the sweep meanwhile: %v)", time.Since(written).Round(time.Millisecond), skipped)
			break
		}
		if time.Since(written) > statsLag+5*time.Second {
			t.Fatalf("the effect left behind in a claim was not swept %v after its write (statements of the last pass: %q)", time.Since(written), sent)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// TestIdleRelayRotatesWhatAnotherInstanceWrote: an idle relay, which wrote nothing itself,
// rotates the partitions once another instance wrote effects into the current one and the
// rotation is due.
func TestIdleRelayRotatesWhatAnotherInstanceWrote(t *testing.T) {
	dsn := pgtest.DSN(t)
	var log statementLog
	db := countedDB(t, dsn, &log)
	st := rotationStore(t, db, time.Minute)
	idlePass(t, st, time.Second)
	idlePass(t, st, time.Second)
	before := st.gen.Load()

	other, err := sql.Open("postgres", dsn)
	if err != nil {
		t.Fatal(err)
	}
	defer other.Close()
	writer := rotationStore(t, other, time.Minute)
	record(t, writer, other, "u", "k", 3)
	if _, err := other.Exec(`UPDATE rot_effects_rotation SET rotated_at = now() - interval '2 minutes'`); err != nil {
		t.Fatal(err)
	}
	idlePass(t, st, time.Second)
	var cur int
	if err := other.QueryRow(`SELECT gen FROM rot_effects_rotation`).Scan(&cur); err != nil {
		t.Fatal(err)
	}
	if cur == before || st.gen.Load() != cur {
		t.Errorf("current partition %d before, %d after the idle pass (the idle relay's: %d): want it rotated", before, cur, st.gen.Load())
	}
}

// TestRelayClaimsWhenItsLookFails: the look at the rotation, read with the claim, may fail
// (the rotation's row gone, the table unreadable): the relay claims all the same, and the
// failure is reported, as when the look was a statement of its own.
func TestRelayClaimsWhenItsLookFails(t *testing.T) {
	dsn := pgtest.DSN(t)
	db, err := sql.Open("postgres", dsn)
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	st := rotationStore(t, db, 0)
	var mu sync.Mutex
	var reported []string
	st.onError = func(what string, err error) {
		mu.Lock()
		reported = append(reported, what+": "+err.Error())
		mu.Unlock()
	}
	for _, c := range []struct{ name, breakIt, repair string }{
		{"no rotation row", `DELETE FROM rot_effects_rotation`, `INSERT INTO rot_effects_rotation (gen, rotated_at) VALUES (0, now())`},
		{"no rotation table", `ALTER TABLE rot_effects_rotation RENAME TO rot_effects_rotation_gone`, `ALTER TABLE rot_effects_rotation_gone RENAME TO rot_effects_rotation`},
	} {
		// A grace the sweep's skip trusts, after a pass that swept: the look is read with the
		// claim.
		idlePass(t, st, statsLag)
		record(t, st, db, c.name, "k-"+c.name, 1)
		if _, err := db.Exec(`UPDATE rot_effects_all SET created_at = now() - interval '1 minute'`); err != nil {
			t.Fatal(err)
		}
		if _, err := db.Exec(c.breakIt); err != nil {
			t.Fatal(err)
		}
		mu.Lock()
		reported = nil
		mu.Unlock()
		claim := idlePass(t, st, statsLag)
		mu.Lock()
		got := reported
		mu.Unlock()
		if len(claim.Effects) != 1 || claim.Effects[0].Source.ID != c.name {
			t.Errorf("%s: the pass claimed %d effects, want the one recorded", c.name, len(claim.Effects))
		}
		if len(got) == 0 || !strings.HasPrefix(got[0], "rotating the partitions") {
			t.Errorf("%s: reported %q, want the look's failure", c.name, got)
		}
		if _, err := db.Exec(c.repair); err != nil {
			t.Fatal(err)
		}
	}
}
