package postgres_test

import (
	"context"
	"crypto/rand"
	"database/sql"
	"encoding/hex"
	"io"
	"net/url"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"

	"github.com/watermill-outbox/outbox"
	"github.com/watermill-outbox/outbox/drivers/postgres"
	"github.com/watermill-outbox/outbox/internal/pgtest"
	"github.com/watermill-outbox/outbox/outboxdriver"
)

// appRole creates a login role holding exactly the application's grants (store.Grants, what
// `outbox migrate grants` prints) on the default tables of the database of ownerDSN, and
// returns a pool that connects as it.
func appRole(t *testing.T, owner *sql.DB, ownerDSN string) *sql.DB {
	t.Helper()
	var b [4]byte
	_, _ = rand.Read(b[:])
	role := "xmin_" + hex.EncodeToString(b[:])
	grants, err := postgres.Grants("public", "outbox_", role, false)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := owner.Exec(`CREATE ROLE ` + role + ` LOGIN PASSWORD 'pw-` + role + `'`); err != nil {
		t.Fatal(err)
	}
	for _, g := range grants {
		if _, err := owner.Exec(g); err != nil {
			t.Fatalf("%s: %v", g, err)
		}
	}
	u, err := url.Parse(ownerDSN)
	if err != nil {
		t.Fatal(err)
	}
	u.User = url.UserPassword(role, "pw-"+role)
	db, err := sql.Open("postgres", u.String())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = db.Close()
		_, _ = owner.Exec(`DROP OWNED BY ` + role)
		_, _ = owner.Exec(`DROP ROLE ` + role)
	})
	return db
}

// holdXmin begins a REPEATABLE READ transaction on db named app, reads, and leaves it idle in
// transaction: its snapshot holds back the xmin horizon until the returned function ends it.
func holdXmin(t *testing.T, db *sql.DB, app string) (pid int, end func()) {
	t.Helper()
	ctx := context.Background()
	conn, err := db.Conn(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := conn.ExecContext(ctx, `SET application_name = '`+app+`'`); err != nil {
		t.Fatal(err)
	}
	tx, err := conn.BeginTx(ctx, &sql.TxOptions{Isolation: sql.LevelRepeatableRead})
	if err != nil {
		t.Fatal(err)
	}
	if err := tx.QueryRowContext(ctx, `SELECT pg_backend_pid() FROM (SELECT count(*) FROM outbox_effects_all) e`).Scan(&pid); err != nil {
		t.Fatal(err)
	}
	ended := false
	end = func() {
		if !ended {
			ended = true
			_ = tx.Rollback()
			_ = conn.Close()
		}
	}
	t.Cleanup(end)
	return pid, end
}

// burnXids commits n transactions that each take a transaction ID, so that the held xmin ages.
func burnXids(t *testing.T, db *sql.DB, n int) {
	t.Helper()
	for range n {
		if _, err := db.Exec(`SELECT txid_current()`); err != nil {
			t.Fatal(err)
		}
	}
}

func tableVacuum(s outboxdriver.Stats, table string) (outboxdriver.TableVacuum, bool) {
	for _, tv := range s.Tables {
		if tv.Table == table {
			return tv, true
		}
	}
	return outboxdriver.TableVacuum{}, false
}

// A session idle in a REPEATABLE READ transaction after a read holds back the xmin horizon: the
// sample, taken as the application's least-privileged role, names that backend (its pid and
// application name), with its age in time and in transactions, and counts the dead tuples of
// the outbox tables that it keeps from being vacuumed. Once the session ends it holds nothing.
func TestStatsReportXminHolderAndDeadTuples(t *testing.T) {
	ctx := context.Background()
	ownerDSN := pgtest.DSN(t)
	owner, err := sql.Open("postgres", ownerDSN)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = owner.Close() })
	ob, err := newOutbox(t, owner, "", "")
	if err != nil {
		t.Fatal(err)
	}
	if err := ob.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	app := appRole(t, owner, ownerDSN)
	st, err := postgres.Driver{}.Open(app, outboxdriver.StoreOptions{TablePrefix: "outbox_"})
	if err != nil {
		t.Fatal(err)
	}

	pid, end := holdXmin(t, app, "xmin-holder")
	time.Sleep(20 * time.Millisecond)
	burnXids(t, owner, 5)
	if _, err := owner.Exec(`INSERT INTO outbox_attempts (consumer, message_id, attempts, last_error)
		SELECT 'c', 'm' || i, 1, '' FROM generate_series(1, 300) i`); err != nil {
		t.Fatal(err)
	}
	// The statistics of a backend reach the server's counters when it flushes them: at most
	// once a second, and an idle one after 10 s, unless asked (PostgreSQL 15).
	conn, err := owner.Conn(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := conn.ExecContext(ctx, `DELETE FROM outbox_attempts`); err != nil {
		t.Fatal(err)
	}
	// Effects in two partitions of the effects table (migration 023), deleted through the parent:
	// the sample sums the partitions' dead rows (the parent counts none itself).
	for _, part := range []string{"outbox_effects /* partition 0 */", "outbox_effects_1"} {
		if _, err := conn.ExecContext(ctx, `INSERT INTO `+part+` (source_consumer, source_id, seq, kind, topic, uuid, payload, metadata, ordering_key, created_at)
			SELECT 'c', 'm' || i, 0, 'publish', 't', 'u' || i, '\x00', '', 'k', now() FROM generate_series(1, 100) i`); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := conn.ExecContext(ctx, `DELETE FROM outbox_effects_all`); err != nil {
		t.Fatal(err)
	}
	_, _ = conn.ExecContext(ctx, `SELECT pg_stat_force_next_flush()`)
	_ = conn.Close()

	deadline := time.Now().Add(15 * time.Second)
	var s outboxdriver.Stats
	for {
		if s, err = st.Stats(ctx, outboxdriver.StatsParams{Retention: time.Hour}); err != nil {
			t.Fatal(err)
		}
		tv, _ := tableVacuum(s, "attempts")
		if te, _ := tableVacuum(s, "effects"); tv.DeadTuples >= 300 && te.DeadTuples >= 200 || time.Now().After(deadline) {
			break
		}
		time.Sleep(200 * time.Millisecond)
	}
	h := s.XminHold
	if h == nil {
		t.Fatalf("no xmin holder reported while session %d holds a snapshot: %+v", pid, s)
	}
	if h.Holder != outboxdriver.XminBackend || h.PID != pid || h.ApplicationName != "xmin-holder" || h.State != "idle in transaction" {
		t.Errorf("holder %+v, want backend %d (xmin-holder, idle in transaction)", *h, pid)
	}
	if h.Age < 20*time.Millisecond || h.Age > time.Minute {
		t.Errorf("held for %v, want the time since its transaction began (at least 20ms)", h.Age)
	}
	if h.Transactions < 5 {
		t.Errorf("held for %d transactions, want at least the 5 committed since", h.Transactions)
	}
	if len(s.Tables) != 7 {
		t.Errorf("tables %+v, want the 7 outbox tables that churn", s.Tables)
	}
	if tv, ok := tableVacuum(s, "attempts"); !ok || tv.DeadTuples < 300 {
		t.Errorf("attempts: %+v, want at least the 300 deleted rows dead", tv)
	}
	if tv, ok := tableVacuum(s, "effects"); !ok || tv.DeadTuples < 200 {
		t.Errorf("effects: %+v, want at least the 200 rows deleted from its partitions dead", tv)
	}

	end()
	if s, err = st.Stats(ctx, outboxdriver.StatsParams{Retention: time.Hour}); err != nil {
		t.Fatal(err)
	}
	if h := s.XminHold; h != nil && h.PID == pid {
		t.Errorf("the ended session %d still reported as holding the horizon: %+v", pid, *h)
	}
}

// Another role's session holds the horizon too: the role sees its xmin, pid and application
// name but not when its transaction began (without pg_read_all_stats). The samples a service
// stores carry how long they have found that xmin held, so its age grows all the same.
func TestStatsXminOfAnotherRoleAgesAcrossSamples(t *testing.T) {
	ctx := context.Background()
	ownerDSN := pgtest.DSN(t)
	owner, err := sql.Open("postgres", ownerDSN)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = owner.Close() })
	ob, err := newOutbox(t, owner, "", "")
	if err != nil {
		t.Fatal(err)
	}
	if err := ob.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	app := appRole(t, owner, ownerDSN)
	st, err := postgres.Driver{}.Open(app, outboxdriver.StoreOptions{TablePrefix: "outbox_"})
	if err != nil {
		t.Fatal(err)
	}
	pid, _ := holdXmin(t, owner, "other-role")
	burnXids(t, owner, 3)

	sample := func() outboxdriver.XminHold {
		t.Helper()
		// A short interval: each call takes and stores a sample, as Run does every StatsInterval.
		s, err := st.Stats(ctx, outboxdriver.StatsParams{Interval: time.Millisecond, Retention: time.Hour})
		if err != nil {
			t.Fatal(err)
		}
		if s.XminHold == nil || s.XminHold.PID != pid || s.XminHold.ApplicationName != "other-role" {
			t.Fatalf("holder %+v, want backend %d (other-role)", s.XminHold, pid)
		}
		return *s.XminHold
	}
	first := sample()
	if first.State != "" {
		t.Errorf("state %q of another role's session: want it unreadable without pg_read_all_stats", first.State)
	}
	if first.Transactions < 3 {
		t.Errorf("held for %d transactions, want at least 3", first.Transactions)
	}
	time.Sleep(1200 * time.Millisecond)
	second := sample()
	if second.Age < first.Age+time.Second {
		t.Errorf("held for %v, then %v 1.2 s later: want the age carried across samples", first.Age, second.Age)
	}
}

// BenchmarkXminSample measures the statement that samples the xmin horizon on PostgreSQL (once
// per pool and StatsInterval), with many dead tuples held by an open snapshot: it reads the
// activity views, never a table, so its cost does not grow with the tables.
func BenchmarkXminSample(b *testing.B) {
	ctx := context.Background()
	dsn := pgtest.DSN(b)
	db, err := sql.Open("postgres", dsn)
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { _ = db.Close() })
	pub := gochannel.NewGoChannel(gochannel.Config{}, nil)
	b.Cleanup(func() { _ = pub.Close() })
	ob, err := outbox.New(outbox.Config{DB: db, Driver: postgres.Driver{}, Publisher: pub})
	if err != nil {
		b.Fatal(err)
	}
	if err := ob.Migrate(ctx); err != nil {
		b.Fatal(err)
	}
	names, err := postgres.NewNames("public", "outbox_")
	if err != nil {
		b.Fatal(err)
	}
	q := postgres.Queries(names, false, nil).XminSample
	tx, err := db.BeginTx(ctx, &sql.TxOptions{Isolation: sql.LevelRepeatableRead})
	if err != nil {
		b.Fatal(err)
	}
	defer func() { _ = tx.Rollback() }()
	if _, err := tx.Exec(`SELECT 1 FROM outbox_effects_all LIMIT 1`); err != nil {
		b.Fatal(err)
	}
	if _, err := db.Exec(`INSERT INTO outbox_attempts (consumer, message_id, attempts, last_error)
		SELECT 'c', 'm' || i, 1, '' FROM generate_series(1, 200000) i`); err != nil {
		b.Fatal(err)
	}
	if _, err := db.Exec(`DELETE FROM outbox_attempts`); err != nil {
		b.Fatal(err)
	}
	// Planned once per connection in the store (prepared), planned at each call otherwise.
	st, err := db.PrepareContext(ctx, q)
	if err != nil {
		b.Fatal(err)
	}
	defer func() { _ = st.Close() }()
	for _, prepared := range []bool{true, false} {
		b.Run(map[bool]string{true: "prepared", false: "unprepared"}[prepared], func(b *testing.B) {
			for b.Loop() {
				var rows *sql.Rows
				if prepared {
					rows, err = st.QueryContext(ctx)
				} else {
					rows, err = db.QueryContext(ctx, q)
				}
				if err != nil {
					b.Fatal(err)
				}
				n := 0
				for rows.Next() {
					n++
				}
				if err := rows.Close(); err != nil || n != 7 {
					b.Fatalf("%d rows, %v", n, err)
				}
			}
		})
	}
}

// The xmin horizon is one per database, not per outbox: the stores of one pool (the Outboxes of
// tenants with a schema or prefix each) share one sample of it per interval. A store sampling
// within the interval of another's sample reports the holder that one found, aged by the time
// since; once the interval has passed, a sample asks the server again.
func TestStatsXminSharedByThePool(t *testing.T) {
	ctx := context.Background()
	db := pgtest.DB(t)
	stores := map[string]outboxdriver.Store{}
	for _, prefix := range []string{"outbox_", "a_", "b_", "c_"} {
		ob, err := newOutbox(t, db, "", prefix)
		if err != nil {
			t.Fatal(err)
		}
		if err := ob.Migrate(ctx); err != nil {
			t.Fatal(err)
		}
		st, err := postgres.Driver{}.Open(db, outboxdriver.StoreOptions{TablePrefix: prefix})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = st.(io.Closer).Close() })
		stores[prefix] = st
	}
	sample := func(prefix string, interval time.Duration) outboxdriver.Stats {
		t.Helper()
		s, err := stores[prefix].Stats(ctx, outboxdriver.StatsParams{Interval: interval, Retention: time.Hour})
		if err != nil {
			t.Fatal(err)
		}
		if s.SampledAt.IsZero() {
			t.Fatalf("%s: no sample taken (the lease of its own stats row was free)", prefix)
		}
		return s
	}
	pid, end := holdXmin(t, db, "shared-holder")
	first := sample("a_", time.Minute)
	if first.XminHold == nil || first.XminHold.PID != pid {
		t.Fatalf("holder %+v, want backend %d", first.XminHold, pid)
	}
	end()
	time.Sleep(300 * time.Millisecond)
	second := sample("b_", time.Minute)
	if second.XminHold == nil || second.XminHold.PID != pid {
		t.Fatalf("another store of the pool within the interval: holder %+v, want the pool's sample (backend %d), not one of its own", second.XminHold, pid)
	}
	if second.XminHold.Age < first.XminHold.Age+300*time.Millisecond {
		t.Errorf("the shared holder's age: %v, then %v 300 ms later; want it aged by the time since the pool's sample", first.XminHold.Age, second.XminHold.Age)
	}
	if len(second.Tables) != 7 {
		t.Errorf("tables %+v, want the 7 outbox tables of the store's own prefix", second.Tables)
	}
	third := sample("c_", 100*time.Millisecond)
	if h := third.XminHold; h != nil && h.PID == pid {
		t.Errorf("a sample past the interval of the pool's sample still reports the ended session %d: %+v", pid, *h)
	}
}
