package pgtest

import (
	"bytes"
	"context"
	"crypto/rand"
	"database/sql"
	"encoding/hex"
	"errors"
	"flag"
	"fmt"
	"net"
	"net/url"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/lib/pq"
	"go.uber.org/goleak"
)

// Environment variables understood by this package.
const (
	// EnvDSN names an existing server to use instead of starting one. The role must be allowed to CREATE DATABASE.
	EnvDSN = "OUTBOX_TEST_DSN"
	// EnvBinDir, if set, is the only directory searched for initdb, pg_ctl and postgres.
	EnvBinDir = "OUTBOX_PG_BINDIR"
)

const (
	installHint     = "install PostgreSQL (apt-get install postgresql) or set " + EnvDSN
	startTimeout    = 60 * time.Second
	createDBTimeout = 2 * time.Minute
	dropDBTimeout   = time.Minute
	osUser          = "postgres" // OS user that runs the server when the tests run as root
	dbUser          = "postgres" // superuser created by initdb -U
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
	local    *localServer // nil when EnvDSN is used
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
		fmt.Fprintf(os.Stderr, "pgtest: started %s on 127.0.0.1:%d (data in %s)\n", e.local.version, e.local.port, e.local.base)
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
	if e.admin != nil {
		if err := e.admin.Close(); err != nil {
			errs = append(errs, fmt.Errorf("close admin connection: %w", err))
		}
	}
	if e.local != nil {
		if err := e.local.stop(); err != nil {
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
		ls, err := startLocal()
		if err != nil {
			return nil, err
		}
		e.local = ls
		e.adminDSN = ls.dsn("postgres")
	}
	timeout := startTimeout
	if e.local == nil {
		timeout = 10 * time.Second // an external server is either up or misconfigured
	}
	admin, err := openAndPing(e.adminDSN, timeout)
	if err != nil {
		err = fmt.Errorf("connect to admin database: %w", err)
		if e.local != nil {
			err = fmt.Errorf("%w\n%s", err, e.local.logTail())
			if stopErr := e.local.stop(); stopErr != nil {
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

// localServer is a private PostgreSQL cluster in a temporary directory.
type localServer struct {
	binDir  string
	version string
	base    string // temp dir holding data/, sock/ and server.log
	dataDir string
	sockDir string
	logFile string
	port    int
	runAs   string // OS user to run PostgreSQL as ("" = current user)
	runuser string // path of runuser, when runAs is set

	reaper     *exec.Cmd
	reaperPipe *os.File // closing it (or our death) tells the reaper to clean up
	stopOnce   sync.Once
	stopErr    error
}

func (s *localServer) dsn(dbname string) string {
	u := url.URL{
		Scheme:   "postgres",
		User:     url.User(dbUser),
		Host:     net.JoinHostPort("127.0.0.1", strconv.Itoa(s.port)),
		Path:     "/" + dbname,
		RawQuery: "sslmode=disable",
	}
	return u.String()
}

func startLocal() (_ *localServer, err error) {
	binDir, err := findBinDir()
	if err != nil {
		return nil, err
	}
	s := &localServer{binDir: binDir}

	var uid, gid = -1, -1
	if os.Geteuid() == 0 {
		u, err := user.Lookup(osUser)
		if err != nil {
			return nil, fmt.Errorf("running as root, and PostgreSQL refuses to run as root, but OS user %q to run it as was not found (%w); "+
				"create it (useradd --system %s), run the tests as a non-root user, or set %s", osUser, err, osUser, EnvDSN)
		}
		if s.runuser, err = findRunuser(); err != nil {
			return nil, fmt.Errorf("running as root requires runuser (util-linux) to start PostgreSQL as %q: %w", osUser, err)
		}
		if uid, err = strconv.Atoi(u.Uid); err != nil {
			return nil, fmt.Errorf("uid of %q: %w", osUser, err)
		}
		if gid, err = strconv.Atoi(u.Gid); err != nil {
			return nil, fmt.Errorf("gid of %q: %w", osUser, err)
		}
		s.runAs = osUser
	}

	if out, err := exec.Command(filepath.Join(binDir, "postgres"), "--version").Output(); err == nil {
		s.version = strings.TrimSpace(string(out))
	}

	// Unix socket paths are limited to ~107 bytes; fall back to /tmp if TMPDIR is deep.
	parent := ""
	if len(os.TempDir()) > 60 {
		parent = "/tmp"
	}
	if s.base, err = os.MkdirTemp(parent, "pgtest-"); err != nil {
		return nil, fmt.Errorf("create temp dir: %w", err)
	}
	defer func() {
		if err != nil {
			_ = os.RemoveAll(s.base)
		}
	}()
	s.dataDir = filepath.Join(s.base, "data")
	s.sockDir = filepath.Join(s.base, "sock")
	s.logFile = filepath.Join(s.base, "server.log")
	if err := os.Mkdir(s.sockDir, 0o700); err != nil {
		return nil, fmt.Errorf("create socket dir: %w", err)
	}
	if s.runAs != "" {
		if err := chownR(s.base, uid, gid); err != nil {
			return nil, err
		}
		// The temp dir's ancestors must be searchable by the server's user.
		if out, err := s.command("test", "-w", s.base, "-a", "-x", s.base).CombinedOutput(); err != nil {
			return nil, fmt.Errorf("temp dir %s is not writable by OS user %q (are its parent directories searchable? try TMPDIR=/tmp): %w: %s",
				s.base, s.runAs, err, bytes.TrimSpace(out))
		}
	}

	initdb := s.command(filepath.Join(binDir, "initdb"),
		"-D", s.dataDir, "-A", "trust", "-U", dbUser, "--no-sync", "-E", "UTF8", "--locale=C")
	if out, err := initdb.CombinedOutput(); err != nil {
		return nil, fmt.Errorf("initdb (%s): %w\n%s", initdb, err, tail(out, 40))
	}

	// The reaper stops the server and removes the temp dir if this process dies without calling stop
	// (test timeout panic, Ctrl-C, os.Exit in a test, ...).
	if err := s.startReaper(); err != nil {
		return nil, err
	}
	defer func() {
		if err != nil {
			s.killReaper()
		}
	}()

	// Picking a free port and binding it in the server is racy: retry with another port if it was taken meanwhile.
	const attempts = 3
	for i := 1; ; i++ {
		if s.port, err = freePort(); err != nil {
			return nil, err
		}
		logBefore := s.logSize()
		opts := fmt.Sprintf("-p %d -k %s -c listen_addresses=127.0.0.1 -c max_connections=300 -c fsync=on -c shared_buffers=128MB",
			s.port, shellQuote(s.sockDir))
		start := s.command(filepath.Join(binDir, "pg_ctl"), "-w", "-t", strconv.Itoa(int(startTimeout/time.Second)),
			"-D", s.dataDir, "-l", s.logFile, "-o", opts, "start")
		out, startErr := start.CombinedOutput()
		if startErr == nil {
			return s, nil
		}
		err = fmt.Errorf("pg_ctl start: %w\n%s\n%s", startErr, bytes.TrimSpace(out), s.logTail())
		// pg_ctl -w may give up while the postmaster still runs: make sure nothing is left behind.
		_, _ = s.command(filepath.Join(binDir, "pg_ctl"), "-D", s.dataDir, "-m", "immediate", "stop").CombinedOutput()
		if i == attempts || !s.portInUse(logBefore) {
			return nil, err
		}
		fmt.Fprintf(os.Stderr, "pgtest: port %d was taken, retrying with another one\n", s.port)
	}
}

func (s *localServer) logSize() int64 {
	fi, err := os.Stat(s.logFile)
	if err != nil {
		return 0
	}
	return fi.Size()
}

// portInUse reports whether the server log written after offset says the port could not be bound.
func (s *localServer) portInUse(offset int64) bool {
	b, err := os.ReadFile(s.logFile)
	if err != nil || int64(len(b)) < offset {
		return false
	}
	return bytes.Contains(b[offset:], []byte("Address already in use"))
}

// stop stops the server (immediate mode) and removes its directory. Safe to call more than once.
func (s *localServer) stop() error {
	s.stopOnce.Do(func() {
		s.killReaper()
		var errs []error
		if out, err := s.command(filepath.Join(s.binDir, "pg_ctl"), "-D", s.dataDir, "-m", "immediate", "-w", "stop").CombinedOutput(); err != nil {
			errs = append(errs, fmt.Errorf("pg_ctl stop: %w: %s", err, bytes.TrimSpace(out)))
		}
		if err := os.RemoveAll(s.base); err != nil {
			errs = append(errs, fmt.Errorf("remove %s: %w", s.base, err))
		}
		s.stopErr = errors.Join(errs...)
	})
	return s.stopErr
}

func (s *localServer) startReaper() error {
	r, w, err := os.Pipe()
	if err != nil {
		return fmt.Errorf("reaper pipe: %w", err)
	}
	defer r.Close()
	stop := s.command(filepath.Join(s.binDir, "pg_ctl"), "-D", s.dataDir, "-m", "immediate", "stop")
	// read (a shell builtin: no extra process) sees EOF when every write end of the pipe is closed, i.e. when this
	// process exits (the write end is close-on-exec, so no other child inherits it).
	script := `while read -r _; do :; done; base=$1; shift; "$@" >/dev/null 2>&1; rm -rf -- "$base"`
	args := append([]string{"-c", script, "pgtest-reaper", s.base}, stop.Args...)
	cmd := exec.Command("/bin/sh", args...)
	cmd.Stdin = r
	cmd.Dir = "/"
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true} // survive Ctrl-C sent to our process group
	if err := cmd.Start(); err != nil {
		_ = w.Close()
		return fmt.Errorf("start reaper: %w", err)
	}
	s.reaper, s.reaperPipe = cmd, w
	return nil
}

func (s *localServer) killReaper() {
	if s.reaper == nil {
		return
	}
	_ = s.reaper.Process.Kill()
	_ = s.reaper.Wait()
	_ = s.reaperPipe.Close()
	s.reaper, s.reaperPipe = nil, nil
}

// command builds a command that runs as the server's OS user.
func (s *localServer) command(name string, args ...string) *exec.Cmd {
	var cmd *exec.Cmd
	if s.runAs != "" {
		cmd = exec.Command(s.runuser, append([]string{"-u", s.runAs, "--", name}, args...)...)
	} else {
		cmd = exec.Command(name, args...)
	}
	cmd.Dir = s.base // the server's user may not be able to access the current directory
	return cmd
}

func (s *localServer) logTail() string {
	b, err := os.ReadFile(s.logFile)
	if err != nil {
		return fmt.Sprintf("(no server log: %v)", err)
	}
	return fmt.Sprintf("--- tail of %s ---\n%s\n--- end of server log ---", s.logFile, tail(b, 40))
}

// findRunuser finds runuser on PATH or in the sbin directories, which are not always on a non-login PATH.
func findRunuser() (string, error) {
	p, err := exec.LookPath("runuser")
	if err == nil {
		return p, nil
	}
	for _, p := range []string{"/usr/sbin/runuser", "/sbin/runuser"} {
		if _, statErr := os.Stat(p); statErr == nil {
			return p, nil
		}
	}
	return "", err
}

// findBinDir returns a directory that holds initdb, pg_ctl and postgres.
func findBinDir() (string, error) {
	if dir := os.Getenv(EnvBinDir); dir != "" {
		if err := checkBinDir(dir); err != nil {
			return "", fmt.Errorf("%s=%s: %w; %s", EnvBinDir, dir, err, installHint)
		}
		return dir, nil
	}
	if p, err := exec.LookPath("initdb"); err == nil {
		// Prefer the real directory of a symlinked initdb (e.g. /usr/local/bin/initdb -> /usr/lib/postgresql/15/bin/initdb)
		// so that all three binaries come from the same installation.
		var dirs []string
		if real, err := filepath.EvalSymlinks(p); err == nil {
			dirs = append(dirs, filepath.Dir(real))
		}
		dirs = append(dirs, filepath.Dir(p))
		for _, dir := range dirs {
			if abs, err := filepath.Abs(dir); err == nil && checkBinDir(abs) == nil {
				return abs, nil
			}
		}
	}
	matches, _ := filepath.Glob("/usr/lib/postgresql/*/bin")
	sort.Slice(matches, func(i, j int) bool { // highest version first
		return versionLess(filepath.Base(filepath.Dir(matches[j])), filepath.Base(filepath.Dir(matches[i])))
	})
	for _, dir := range matches {
		if checkBinDir(dir) == nil {
			return dir, nil
		}
	}
	return "", fmt.Errorf("no PostgreSQL server binaries (initdb, pg_ctl, postgres) on PATH or in /usr/lib/postgresql/*/bin, and %s is not set; %s",
		EnvDSN, installHint)
}

func checkBinDir(dir string) error {
	for _, name := range []string{"initdb", "pg_ctl", "postgres"} {
		p := filepath.Join(dir, name)
		fi, err := os.Stat(p)
		if err != nil {
			return fmt.Errorf("%s: %w", name, err)
		}
		if fi.IsDir() || fi.Mode()&0o111 == 0 {
			return fmt.Errorf("%s is not an executable file", p)
		}
	}
	return nil
}

// versionLess compares dotted numeric versions ("9.6" < "15").
func versionLess(a, b string) bool {
	pa, pb := strings.Split(a, "."), strings.Split(b, ".")
	for i := 0; i < len(pa) && i < len(pb); i++ {
		na, errA := strconv.Atoi(pa[i])
		nb, errB := strconv.Atoi(pb[i])
		if errA != nil || errB != nil {
			if pa[i] != pb[i] {
				return pa[i] < pb[i]
			}
			continue
		}
		if na != nb {
			return na < nb
		}
	}
	return len(pa) < len(pb)
}

func freePort() (int, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, fmt.Errorf("find a free port: %w", err)
	}
	port := l.Addr().(*net.TCPAddr).Port
	if err := l.Close(); err != nil {
		return 0, fmt.Errorf("find a free port: %w", err)
	}
	return port, nil
}

func chownR(root string, uid, gid int) error {
	err := filepath.WalkDir(root, func(p string, _ os.DirEntry, err error) error {
		if err != nil {
			return err
		}
		return os.Lchown(p, uid, gid)
	})
	if err != nil {
		return fmt.Errorf("chown %s: %w", root, err)
	}
	return nil
}

func shellQuote(s string) string {
	return "'" + strings.ReplaceAll(s, "'", `'\''`) + "'"
}

func tail(b []byte, lines int) string {
	b = bytes.TrimRight(b, "\n")
	idx := len(b)
	for n := 0; n < lines && idx > 0; n++ {
		idx = bytes.LastIndexByte(b[:idx], '\n')
		if idx < 0 {
			return string(b)
		}
	}
	return string(b[idx+1:])
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
