package main

import (
	"context"
	"database/sql"
	"encoding/binary"
	"fmt"
	"net"
	"os"
	"slices"
	"strings"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	gomysql "github.com/go-sql-driver/mysql"
	"github.com/google/uuid"

	"github.com/watermill-outbox/outbox"
	"github.com/watermill-outbox/outbox/drivers/mysql"
	"github.com/watermill-outbox/outbox/internal/mysqlserver"
	"github.com/watermill-outbox/outbox/middleware"
)

// The MySQL contenders run the same workload (same deliveries, same broker) on a throwaway
// MariaDB (or MySQL) server: bare-mysql, a plain database/sql transaction with the business write
// and a publish after the commit, and outbox-mysql, this framework on drivers/mysql with
// middleware.New. They compare with each other: the database and its settings are not the
// PostgreSQL of the other contenders.

const mysqlSuffix = "-mysql"

func isMySQL(contender string) bool { return strings.HasSuffix(contender, mysqlSuffix) }

// mysqlSettings are the server options of the benchmark's MariaDB, after internal/mysqlserver's
// defaults: durable commits (every commit waits for its redo log flush, as PostgreSQL's
// synchronous_commit does in the other contenders' server), a larger buffer pool, room for the
// contenders' connections. The binary log stays off, as MariaDB ships.
var mysqlSettings = []string{
	"--innodb-flush-log-at-trx-commit=1",
	"--innodb-buffer-pool-size=512M",
	"--max-connections=400",
}

// envMySQLDSN names an existing server (go-sql-driver/mysql's DSN, a user that may create and drop
// the database outbox_bench) instead of a throwaway one.
const envMySQLDSN = "OUTBOX_BENCH_MYSQL_DSN"

// mysqlBusinessWrite is businessWrite in MySQL's placeholders.
const mysqlBusinessWrite = `INSERT INTO applied (message_id) VALUES (?)`

// mysqlBench is the database of the MySQL contenders, set by startMySQL.
var mysqlBench struct {
	dsn   string // the bench database, with mysql.DSNParams
	admin *sql.DB
}

// startMySQL starts a throwaway MariaDB or MySQL server from the local binaries when cfg selects a
// MySQL contender that runs the workload (unless OUTBOX_BENCH_MYSQL_DSN names one), creates the bench database with the
// business table, and returns what stops it. It fails when it cannot: a run that selected them
// (the default) does not quietly leave them out.
func startMySQL(ctx context.Context, cfg config, rep *report) (_ func(), err error) {
	stopServer := func() {}
	if !slices.ContainsFunc(cfg.Contenders, func(n string) bool { return isMySQL(n) && checkWorkload(n) == nil }) {
		return stopServer, nil
	}
	base := os.Getenv(envMySQLDSN)
	if base == "" {
		logf("starting a throwaway MariaDB")
		srv, err := mysqlserver.Start(mysqlSettings...)
		if err != nil {
			return nil, fmt.Errorf("the MySQL contenders need a MariaDB or MySQL server (deselect them with -contenders, or set %s): %w", envMySQLDSN, err)
		}
		stopServer = func() { _ = srv.Stop() }
		defer func() {
			if err != nil {
				stopServer()
			}
		}()
		base = "root@tcp(" + srv.Addr + ")/"
	}
	c, err := gomysql.ParseDSN(base)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", envMySQLDSN, err)
	}
	c.DBName = ""
	root, err := sql.Open("mysql", c.FormatDSN())
	if err != nil {
		return nil, err
	}
	defer root.Close()
	for _, q := range []string{`DROP DATABASE IF EXISTS outbox_bench`, `CREATE DATABASE outbox_bench`} {
		if _, err := root.ExecContext(ctx, q); err != nil {
			return nil, fmt.Errorf("mysql: %s: %w", q, err)
		}
	}
	c.DBName = "outbox_bench"
	dsn := c.FormatDSN()
	if strings.Contains(dsn, "?") {
		dsn += "&" + mysql.DSNParams
	} else {
		dsn += "?" + mysql.DSNParams
	}
	admin, err := sql.Open("mysql", dsn)
	if err != nil {
		return nil, err
	}
	// As on PostgreSQL: no index, so that a message applied twice shows as two rows.
	if _, err := admin.ExecContext(ctx, `CREATE TABLE applied (message_id VARCHAR(64) NOT NULL) ENGINE = InnoDB`); err != nil {
		_ = admin.Close()
		return nil, fmt.Errorf("mysql: create the business table: %w", err)
	}
	var version string
	if err := admin.QueryRowContext(ctx, `SELECT version()`).Scan(&version); err != nil {
		_ = admin.Close()
		return nil, fmt.Errorf("mysql: %w", err)
	}
	rep.Machine.MySQL = version + ", options " + strings.Join(mysqlSettings, " ")
	if os.Getenv(envMySQLDSN) != "" {
		rep.Machine.MySQL = version + ", external server (" + envMySQLDSN + "): its own settings"
	}
	mysqlBench.dsn, mysqlBench.admin = dsn, admin
	return func() { _ = admin.Close(); stopServer() }, nil
}

// appliedDB is the database of c's business table: the MariaDB one for a MySQL contender.
func appliedDB(e *env, c contender) *sql.DB {
	if _, ok := unwrap(c).(*onMySQL); ok {
		return mysqlBench.admin
	}
	return e.admin
}

// newMySQLContender returns bare-mysql or outbox-mysql.
func newMySQLContender(e *env, name string) (contender, error) {
	if mysqlBench.admin == nil {
		return nil, fmt.Errorf("%s: no MariaDB server", name)
	}
	wc := &wireCounters{}
	db, err := openCountedMySQL(name, wc, 64)
	if err != nil {
		return nil, err
	}
	b := base{e: e, db: db, wc: wc, crash: new(atomic.Pointer[string])}
	switch name {
	case "bare-mysql":
		return &onMySQL{contender: &bareMySQL{b}, n: name, own: []string{"applied"}}, nil
	case "outbox-mysql":
		c, err := newFrameworkMySQL(b, "outbox_")
		if err != nil {
			b.close()
			return nil, err
		}
		return &onMySQL{contender: c, n: name, own: []string{"applied", "outbox_processed", "outbox_effects", "outbox_attempts"}}, nil
	}
	b.close()
	return nil, fmt.Errorf("unknown contender %q", name)
}

// onMySQL is a contender on the MariaDB server. The harness's reset empties the tables of
// PostgreSQL; start empties this contender's own, on MariaDB, before each run. With DELETE, not
// TRUNCATE: TRUNCATE starts AUTO_INCREMENT over, and the framework, which remembers the IDs of the
// effects it marked dispatched a moment ago, would take the next run's first effects for those
// and leave them to the relay (PostgreSQL's TRUNCATE keeps its sequences).
type onMySQL struct {
	contender
	n   string
	own []string // its tables on MariaDB, the business table included
}

func (c *onMySQL) name() string     { return c.n }
func (c *onMySQL) tables() []string { return nil }
func (c *onMySQL) start(ctx context.Context) error {
	for _, t := range c.own {
		if _, err := mysqlBench.admin.ExecContext(ctx, "DELETE FROM "+t); err != nil {
			return fmt.Errorf("empty %s: %w", t, err)
		}
	}
	return c.contender.start(ctx)
}

// bareMySQL is bare on MariaDB: the business write in a plain transaction, publish after commit.
type bareMySQL struct{ base }

func (c *bareMySQL) name() string       { return "bare-mysql" }
func (c *bareMySQL) path() string       { return "consumer" }
func (c *bareMySQL) safe() bool         { return false }
func (c *bareMySQL) crashPoint() string { return "after commit, before publish" }
func (c *bareMySQL) tables() []string   { return nil }
func (c *bareMySQL) handle(ctx context.Context, d delivery) (bool, error) {
	tx, err := c.db.BeginTx(ctx, nil)
	if err != nil {
		return false, err
	}
	if _, err := tx.ExecContext(ctx, mysqlBusinessWrite, d.id); err != nil {
		_ = tx.Rollback()
		return false, err
	}
	return false, c.commitThenPublish(tx, d)
}

// newFrameworkMySQL is outbox-middleware on MariaDB: outbox.New with drivers/mysql, middleware.New
// around the handler, the write through outbox.Tx; the same configuration (RelayGrace 2 s).
func newFrameworkMySQL(b base, prefix string) (*framework, error) {
	c := &framework{base: b, prefix: prefix}
	var err error
	c.ob, err = outbox.New(outbox.Config{
		DB:          b.db,
		Driver:      mysql.Driver{},
		Publisher:   b.e.pub,
		TablePrefix: prefix,
		RelayGrace:  2 * time.Second,
		Failpoint:   c.failpoint,
	})
	if err != nil {
		return nil, err
	}
	if err := c.ob.Migrate(context.Background()); err != nil {
		_ = c.ob.Close()
		return nil, err
	}
	c.h = middleware.New(c.ob, middleware.WithConsumer("bench"))(func(msg *message.Message) ([]*message.Message, error) {
		ctx := msg.Context()
		if _, err := outbox.Tx(ctx).ExecContext(ctx, mysqlBusinessWrite, msg.UUID); err != nil {
			return nil, err
		}
		d := ctx.Value(deliveryKey{}).(delivery)
		return nil, outbox.Publish(ctx, outTopic, outgoing(d, uuid.NewString()))
	})
	return c, nil
}

// openCountedMySQL opens the bench database with go-sql-driver/mysql through a dialer that counts
// what the connections write in c, registered for the contender.
func openCountedMySQL(contender string, c *wireCounters, maxConns int) (*sql.DB, error) {
	cfg, err := gomysql.ParseDSN(mysqlBench.dsn)
	if err != nil {
		return nil, err
	}
	network := "bench-" + contender
	gomysql.RegisterDialContext(network, func(ctx context.Context, addr string) (net.Conn, error) {
		var d net.Dialer
		conn, err := d.DialContext(ctx, "tcp", addr)
		if err != nil {
			return nil, err
		}
		cc := &mysqlCountingConn{}
		cc.roundTripConn = roundTripConn{Conn: conn, c: c, parse: cc.parse}
		return cc, nil
	})
	cfg.Net = network
	connector, err := gomysql.NewConnector(cfg)
	if err != nil {
		return nil, err
	}
	db := sql.OpenDB(connector)
	db.SetMaxOpenConns(maxConns)
	db.SetMaxIdleConns(maxConns)
	return db, nil
}

// mysqlCountingConn counts round trips as countingConn does (a write after a read is one wait for
// the server) and reads the client's packets of the MySQL protocol: a 3-byte little-endian length
// and a sequence number; a packet with sequence number 0 starts a command, whose first byte says
// which (COM_QUERY: a statement, its arguments interpolated; COM_STMT_PREPARE, COM_STMT_EXECUTE).
type mysqlCountingConn struct {
	roundTripConn
	hdr     []byte // partial packet header
	skip    int    // payload bytes of the current packet still to skip
	command bool   // the next payload byte is a command byte
}

const (
	comQuery       = 0x03
	comStmtPrepare = 0x16
	comStmtExecute = 0x17
)

func (cc *mysqlCountingConn) parse(p []byte) {
	for len(p) > 0 {
		if cc.skip > 0 {
			if cc.command {
				switch p[0] {
				case comQuery:
					cc.c.simple.Add(1)
				case comStmtExecute:
					cc.c.execute.Add(1)
				case comStmtPrepare:
					cc.c.parse.Add(1)
				}
				cc.command = false
			}
			k := min(cc.skip, len(p))
			cc.skip -= k
			p = p[k:]
			continue
		}
		k := min(4-len(cc.hdr), len(p))
		cc.hdr = append(cc.hdr, p[:k]...)
		p = p[k:]
		if len(cc.hdr) < 4 {
			return
		}
		cc.skip = int(binary.LittleEndian.Uint32(append(cc.hdr[:3:3], 0)))
		cc.command = cc.hdr[3] == 0 && cc.skip > 0
		cc.hdr = cc.hdr[:0]
	}
}

// mysqlSection is the section of benchmarks.md on the MySQL contenders, empty when none ran.
func mysqlSection(r *report) string {
	var concs []int
	for _, conc := range r.Config.Concs {
		_, ok1 := r.cell("bare-mysql", conc)
		_, ok2 := r.cell("outbox-mysql", conc)
		if ok1 || ok2 {
			concs = append(concs, conc)
		}
	}
	if len(concs) == 0 {
		return ""
	}
	var b strings.Builder
	w := func(format string, args ...any) { fmt.Fprintf(&b, format, args...) }
	w("\n### On MySQL (MariaDB)\n\n")
	// In a run of the whole matrix they are interleaved with the other contenders; on their own
	// (-contenders bare-mysql,outbox-mysql) the section says which run it comes from.
	run := "in the same interleaved repetitions as the contenders above"
	if len(withoutMySQL(r).Cells) == 0 {
		run = fmt.Sprintf("in a run of their own (`cd bench && go run . -mode %s -n %d -reps %d -contenders %s -skip-scale`, %s, load average %s at its start, %s at its end)",
			r.Mode, r.Config.N, r.Config.Reps, strings.Join(r.Config.Contenders, ","), r.Started, r.Machine.LoadAtStart, r.Machine.LoadAtEnd)
	}
	w("The workload on a throwaway MariaDB server (%s), %s, with the same broker and deliveries: database/sql with "+
		"go-sql-driver/mysql and `mysql.DSNParams` (interpolateParams: a statement and its arguments in one round trip), the business "+
		"write `%s`. **bare-mysql**: a plain transaction, publish after commit, no deduplication. **outbox-mysql**: this framework's "+
		"`outbox.New` with `drivers/mysql`, `middleware.New` around the handler, the write through `outbox.Tx`, the relay running. "+
		"The ratio compares the two with each other only: MariaDB and its settings are not the PostgreSQL of the other contenders.\n\n",
		r.Machine.MySQL, run, mysqlBusinessWrite)
	w("| consumers | bare-mysql msg/s | outbox-mysql msg/s | outbox-mysql / bare-mysql | p50 ms bare / outbox | p99 ms bare / outbox | round trips/msg waited for, bare / outbox | statements/msg bare / outbox |\n")
	w("|--:|--:|--:|--:|--:|--:|--:|--:|\n")
	for _, conc := range concs {
		bc, ok1 := r.cell("bare-mysql", conc)
		oc, ok2 := r.cell("outbox-mysql", conc)
		ratio := "–"
		if ok1 && ok2 && bc.Throughput > 0 {
			ratio = fmt.Sprintf("**%.2fx**", oc.Throughput/bc.Throughput)
		}
		pair := func(a, b float64, f func(float64) string) string { return f(a) + " / " + f(b) }
		w("| %d | %s | %s | %s | %s | %s | %s | %s |\n", conc, f0(bc.Throughput), f0(oc.Throughput), ratio,
			pair(bc.P50, oc.P50, f2), pair(bc.P99, oc.P99, f2), pair(bc.SyncRoundTrips, oc.SyncRoundTrips, f2), pair(bc.Statements, oc.Statements, f2))
	}
	w("\nbare-mysql waits for three round trips (START TRANSACTION, the INSERT, COMMIT); outbox-mysql adds the claim's " +
		"look-up and INSERT IGNORE, the effect's INSERT and its check before the commit (drivers/mysql: no savepoint can be told apart), " +
		"and the mark after the publish (a duplicate stops after the claim).\n")
	for _, sr := range r.Safety {
		if isMySQL(sr.Contender) {
			w("\nSafety check, %s (%d deliveries at %d consumers, copies concurrent with their original, one crash %s): "+
				"%d business changes applied twice, %d messages lost, %d extra copies with a new ID.\n",
				sr.Contender, sr.Deliveries, slicesMax(r.Config.Concs), sr.CrashPoint, sr.DupApplied, sr.Lost, sr.CopiesNewID)
		}
	}
	return b.String()
}

// withoutMySQL is r without the MySQL contenders' cells: the tables and the chart of the
// PostgreSQL contenders.
func withoutMySQL(r *report) *report {
	cp := *r
	cp.Cells = slices.DeleteFunc(slices.Clone(r.Cells), func(c cell) bool { return isMySQL(c.Contender) })
	return &cp
}
