package pgtest

import (
	"context"
	"crypto/rand"
	"database/sql"
	"encoding/hex"
	"errors"
	"flag"
	"fmt"
	"net/url"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/lib/pq"
	"go.uber.org/goleak"

	"github.com/watermill-outbox/outbox/internal/pgbouncer"
	"github.com/watermill-outbox/outbox/internal/pgserver"
)

// Environment variables understood by this package.
const (
	// EnvDSN names an existing server to use instead of starting one. The role must be allowed to CREATE DATABASE.
	EnvDSN = "OUTBOX_TEST_DSN"
	// EnvBinDir, if set, is the only directory searched for initdb, pg_ctl and postgres.
	EnvBinDir = pgserver.EnvBinDir
)

const (
	startTimeout    = 60 * time.Second
	createDBTimeout = 2 * time.Minute
	dropDBTimeout   = time.Minute
)

var (
	mu  sync.Mutex
	env *environment // set while Run is executing m.Run

	dbCounter atomic.Uint64
)

// environment is the server provisioned by Run.
type environment struct {
	adminDSN string
	admin    *sql.DB
	local    *pgserver.Server              // nil when EnvDSN is used
	bouncers map[string]*pgbouncer.Bouncer // by pool mode, started by PoolerDSN
}

// Run is called from TestMain: os.Exit(pgtest.Run(m)). It provisions the server (once per test binary), runs m.Run(),
// stops the server, and then verifies that no goroutines leaked (go.uber.org/goleak). A leak makes the run fail
// (non-zero return) with the report printed. If no server can be provisioned Run prints why and returns 1; it never
// skips tests silently.
//
// The server is OUTBOX_TEST_DSN if set; otherwise a private cluster in a temp dir, started with the binaries
// initdb, pg_ctl and postgres found in OUTBOX_PG_BINDIR (only there, if set), else next to initdb on PATH, else in
// the highest /usr/lib/postgresql/*/bin. As root, the server runs as OS user "postgres" (via runuser). If the test
// binary dies without Run returning (test timeout, Ctrl-C), a detached helper stops the server and removes its dir.
// The local server is internal/pgserver's.
func Run(m *testing.M) int {
	if !flag.Parsed() {
		flag.Parse()
	}
	// Goroutines that exist before Run (runtime, testing framework, package init) are not leaks of the tests.
	ignoreBefore := goleak.IgnoreCurrent()

	e, err := setup()
	if err != nil {
		fmt.Fprintf(os.Stderr, "pgtest: cannot provide a PostgreSQL server for the tests: %v\n", err)
		fmt.Fprintln(os.Stderr, "FAIL (pgtest: no test was run)")
		return 1
	}
	if testing.Verbose() && e.local != nil {
		fmt.Fprintf(os.Stderr, "pgtest: started %s on 127.0.0.1:%d (data in %s)\n", e.local.Version(), e.local.Port(), e.local.DataDir())
	}
	mu.Lock()
	env = e
	mu.Unlock()

	code := m.Run()

	mu.Lock()
	env = nil
	mu.Unlock()
	if err := e.close(); err != nil {
		fmt.Fprintf(os.Stderr, "pgtest: teardown: %v\n", err)
		if code == 0 {
			code = 1
		}
	}
	if err := goleak.Find(ignoreBefore); err != nil {
		fmt.Fprintf(os.Stderr, "pgtest: goroutine leak detected after all tests finished and the server was stopped:\n%v\n", err)
		if code == 0 {
			code = 1
		}
	}
	return code
}

// DSN returns a connection string (a postgres:// URL for the built-in server; the form of OUTBOX_TEST_DSN otherwise)
// to a fresh database created for this test. The database is dropped (WITH (FORCE)) in t.Cleanup.
// It is safe to call from parallel tests.
func DSN(t testing.TB) string {
	t.Helper()
	e := current(t)
	name, err := newDBName()
	if err != nil {
		t.Fatalf("pgtest: %v", err)
	}
	if err := e.createDB(name); err != nil {
		t.Fatalf("pgtest: %v", err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), dropDBTimeout)
		defer cancel()
		if _, err := e.admin.ExecContext(ctx, "DROP DATABASE IF EXISTS "+name+" WITH (FORCE)"); err != nil {
			t.Errorf("pgtest: drop database %s: %v", name, err)
		}
	})
	dsn, err := withDBName(e.adminDSN, name)
	if err != nil {
		t.Fatalf("pgtest: %v", err)
	}
	return dsn
}

// Database creates a fresh database, for code that has no testing.TB (Example functions), and
// returns its connection string and a function that drops it.
func Database() (dsn string, drop func(), err error) {
	mu.Lock()
	e := env
	mu.Unlock()
	if e == nil {
		return "", nil, errors.New("pgtest: no server: call os.Exit(pgtest.Run(m)) from TestMain in this package")
	}
	name, err := newDBName()
	if err != nil {
		return "", nil, err
	}
	if err := e.createDB(name); err != nil {
		return "", nil, err
	}
	drop = func() {
		ctx, cancel := context.WithTimeout(context.Background(), dropDBTimeout)
		defer cancel()
		_, _ = e.admin.ExecContext(ctx, "DROP DATABASE IF EXISTS "+name+" WITH (FORCE)")
	}
	if dsn, err = withDBName(e.adminDSN, name); err != nil {
		drop()
		return "", nil, err
	}
	return dsn, drop, nil
}

// DB opens DSN(t) with the database/sql driver "postgres" (lib/pq) and closes it in t.Cleanup
// (before the database is dropped).
func DB(t testing.TB) *sql.DB {
	t.Helper()
	dsn := DSN(t)
	db, err := sql.Open("postgres", dsn)
	if err != nil {
		t.Fatalf("pgtest: open: %v", err)
	}
	t.Cleanup(func() {
		if err := db.Close(); err != nil {
			t.Errorf("pgtest: close db: %v", err)
		}
	})
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := db.PingContext(ctx); err != nil {
		t.Fatalf("pgtest: ping: %v", err)
	}
	return db
}

// AdminDSN returns the DSN of the maintenance database (superuser on the built-in server), for tests that need
// to act on the server itself, e.g. pg_terminate_backend. Do not create objects in it.
func AdminDSN(t testing.TB) string {
	t.Helper()
	return current(t).adminDSN
}

func current(t testing.TB) *environment {
	t.Helper()
	mu.Lock()
	defer mu.Unlock()
	if env == nil {
		t.Fatal("pgtest: no server: call os.Exit(pgtest.Run(m)) from TestMain in this package")
	}
	return env
}

func newDBName() (string, error) {
	var b [6]byte
	if _, err := rand.Read(b[:]); err != nil {
		return "", fmt.Errorf("random database name: %w", err)
	}
	// Only [a-z0-9_]: a safe unquoted identifier, well below the 63-byte limit.
	return fmt.Sprintf("t_%d_%s", dbCounter.Add(1), hex.EncodeToString(b[:])), nil
}

func (e *environment) createDB(name string) error {
	ctx, cancel := context.WithTimeout(context.Background(), createDBTimeout)
	defer cancel()
	backoff := 50 * time.Millisecond
	for {
		_, err := e.admin.ExecContext(ctx, "CREATE DATABASE "+name)
		if err == nil {
			return nil
		}
		// 55006 object_in_use: "source database template1 is being accessed by other users" — transient
		// when somebody (another test binary sharing OUTBOX_TEST_DSN, psql, ...) is connected to template1.
		var pqErr *pq.Error
		if !errors.As(err, &pqErr) || pqErr.SQLState() != "55006" {
			return fmt.Errorf("create database %s: %w", name, err)
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("create database %s: %w (gave up: %w)", name, err, ctx.Err())
		case <-time.After(backoff):
		}
		backoff = min(2*backoff, time.Second)
	}
}

func (e *environment) close() error {
	var errs []error
	for _, b := range e.bouncers {
		if err := b.Stop(); err != nil {
			errs = append(errs, fmt.Errorf("stop PgBouncer: %w", err))
		}
	}
	if e.admin != nil {
		if err := e.admin.Close(); err != nil {
			errs = append(errs, fmt.Errorf("close admin connection: %w", err))
		}
	}
	if e.local != nil {
		if err := e.local.Stop(); err != nil {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

func setup() (*environment, error) {
	e := &environment{}
	if dsn := os.Getenv(EnvDSN); dsn != "" {
		e.adminDSN = dsn
	} else {
		ls, err := pgserver.Start(pgserver.Options{Logf: func(format string, args ...any) {
			fmt.Fprintf(os.Stderr, "pgtest: "+format+"\n", args...)
		}})
		if err != nil {
			return nil, fmt.Errorf("start a local server (or set %s to use an existing one): %w", EnvDSN, err)
		}
		e.local = ls
		e.adminDSN = ls.DSN("postgres")
	}
	timeout := startTimeout
	if e.local == nil {
		timeout = 10 * time.Second // an external server is either up or misconfigured
	}
	admin, err := openAndPing(e.adminDSN, timeout)
	if err != nil {
		err = fmt.Errorf("connect to admin database: %w", err)
		if e.local != nil {
			err = fmt.Errorf("%w\n%s", err, e.local.LogTail())
			if stopErr := e.local.Stop(); stopErr != nil {
				err = errors.Join(err, stopErr)
			}
		} else {
			err = fmt.Errorf("%w (%s=%s)", err, EnvDSN, redact(e.adminDSN))
		}
		return nil, err
	}
	admin.SetMaxOpenConns(8)
	e.admin = admin
	return e, nil
}

// openAndPing opens dsn and pings until it succeeds or timeout passes.
func openAndPing(dsn string, timeout time.Duration) (*sql.DB, error) {
	db, err := sql.Open("postgres", dsn)
	if err != nil {
		return nil, fmt.Errorf("open: %w", err)
	}
	deadline := time.Now().Add(timeout)
	for {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		err = db.PingContext(ctx)
		cancel()
		if err == nil {
			return db, nil
		}
		if time.Now().After(deadline) {
			_ = db.Close()
			return nil, fmt.Errorf("ping for %v: %w", timeout, err)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// withDBName returns dsn with its database replaced by dbname. It accepts URLs (postgres:// or postgresql://) and
// libpq key=value strings.
func withDBName(dsn, dbname string) (string, error) {
	if strings.HasPrefix(dsn, "postgres://") || strings.HasPrefix(dsn, "postgresql://") {
		u, err := url.Parse(dsn)
		if err != nil {
			return "", fmt.Errorf("parse DSN URL: %w", err)
		}
		u.Path, u.RawPath = "/"+dbname, ""
		return u.String(), nil
	}
	kvs, err := parseKV(dsn)
	if err != nil {
		return "", err
	}
	var sb strings.Builder
	replaced := false
	for _, kv := range kvs {
		if kv[0] == "dbname" {
			if replaced {
				continue
			}
			kv[1], replaced = dbname, true
		}
		if sb.Len() > 0 {
			sb.WriteByte(' ')
		}
		sb.WriteString(kv[0] + "=" + quoteKV(kv[1]))
	}
	if !replaced {
		if sb.Len() > 0 {
			sb.WriteByte(' ')
		}
		sb.WriteString("dbname=" + dbname)
	}
	return sb.String(), nil
}

// parseKV parses a libpq key=value connection string (values optionally single-quoted with \ escapes).
func parseKV(s string) ([][2]string, error) {
	var out [][2]string
	r := strings.NewReader(s)
	next := func() (rune, bool) {
		c, _, err := r.ReadRune()
		return c, err == nil
	}
	isSpace := func(c rune) bool { return c == ' ' || c == '\t' || c == '\n' || c == '\r' }
	for {
		c, ok := next()
		for ok && isSpace(c) {
			c, ok = next()
		}
		if !ok {
			return out, nil
		}
		var key strings.Builder
		for ok && c != '=' && !isSpace(c) {
			key.WriteRune(c)
			c, ok = next()
		}
		for ok && isSpace(c) {
			c, ok = next()
		}
		if !ok || c != '=' {
			return nil, fmt.Errorf("parse DSN: missing '=' after %q", key.String())
		}
		c, ok = next()
		for ok && isSpace(c) {
			c, ok = next()
		}
		var val strings.Builder
		if ok && c == '\'' {
			for {
				c, ok = next()
				if !ok {
					return nil, fmt.Errorf("parse DSN: unterminated quoted value for %q", key.String())
				}
				if c == '\\' {
					if c, ok = next(); !ok {
						return nil, fmt.Errorf("parse DSN: trailing backslash in value for %q", key.String())
					}
				} else if c == '\'' {
					break
				}
				val.WriteRune(c)
			}
		} else {
			for ok && !isSpace(c) {
				if c == '\\' {
					if c, ok = next(); !ok {
						return nil, fmt.Errorf("parse DSN: trailing backslash in value for %q", key.String())
					}
				}
				val.WriteRune(c)
				c, ok = next()
			}
		}
		out = append(out, [2]string{key.String(), val.String()})
	}
}

func quoteKV(v string) string {
	if v != "" && !strings.ContainsAny(v, " \t\n\r'\\") {
		return v
	}
	return "'" + strings.NewReplacer(`\`, `\\`, `'`, `\'`).Replace(v) + "'"
}

// redact hides a password in dsn for error messages.
func redact(dsn string) string {
	if u, err := url.Parse(dsn); err == nil && u.User != nil {
		if _, has := u.User.Password(); has {
			return u.Redacted()
		}
		return dsn
	}
	if kvs, err := parseKV(dsn); err == nil {
		parts := make([]string, 0, len(kvs))
		for _, kv := range kvs {
			if kv[0] == "password" {
				kv[1] = "xxxxx"
			}
			parts = append(parts, kv[0]+"="+quoteKV(kv[1]))
		}
		return strings.Join(parts, " ")
	}
	return "(unparseable)"
}
