package main

import (
	"bytes"
	"context"
	"database/sql"
	"errors"
	"fmt"
	"net"
	"net/url"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"slices"
	"sort"
	"strconv"
	"strings"
	"syscall"
	"time"
)

// pgServer is a throwaway PostgreSQL cluster for one benchmark run: the minimum of the library's
// internal/pgserver (which another module cannot import). As root it runs the server as the OS user
// "postgres" through runuser, as PostgreSQL refuses to run as root. A detached helper stops the
// server and removes its directory if this process dies without calling stop.
type pgServer struct {
	binDir  string
	version string
	base    string
	dataDir string
	port    int
	runAs   string
	runuser string
	reaper  *exec.Cmd
	pipe    *os.File
}

// serverSettings are the settings the benchmark runs the server with. synchronous_commit and
// fsync stay on (the default): every durable commit waits for its WAL flush, which is the limit
// being measured. Checkpoints are pushed out of the runs (each run starts with an explicit
// CHECKPOINT instead), so that a timed checkpoint does not land on one contender only.
var serverSettings = []string{
	"listen_addresses=127.0.0.1",
	"max_connections=400",
	"fsync=on",
	"synchronous_commit=on",
	"shared_buffers=512MB",
	"max_wal_size=16GB",
	"checkpoint_timeout=1h",
	"maintenance_work_mem=512MB",
}

// extraSettings are added to serverSettings for one run (-pgss loads pg_stat_statements).
var extraSettings []string

func startPG() (_ *pgServer, err error) {
	s := &pgServer{}
	if s.binDir, err = findBinDir(); err != nil {
		return nil, err
	}
	if out, err := exec.Command(filepath.Join(s.binDir, "postgres"), "--version").Output(); err == nil {
		s.version = strings.TrimSpace(string(out))
	}
	uid, gid := -1, -1
	if os.Geteuid() == 0 {
		u, err := user.Lookup("postgres")
		if err != nil {
			return nil, fmt.Errorf("running as root: PostgreSQL must run as the OS user postgres, which was not found: %w", err)
		}
		if s.runuser, err = exec.LookPath("runuser"); err != nil {
			s.runuser = "/usr/sbin/runuser"
		}
		uid, _ = strconv.Atoi(u.Uid)
		gid, _ = strconv.Atoi(u.Gid)
		s.runAs = "postgres"
	}
	if s.base, err = os.MkdirTemp("/tmp", "outbox-bench-pg-"); err != nil {
		return nil, err
	}
	defer func() {
		if err != nil {
			_ = os.RemoveAll(s.base)
		}
	}()
	s.dataDir = filepath.Join(s.base, "data")
	if err := os.Mkdir(filepath.Join(s.base, "sock"), 0o700); err != nil {
		return nil, err
	}
	if s.runAs != "" {
		if err := filepath.WalkDir(s.base, func(p string, _ os.DirEntry, err error) error {
			if err != nil {
				return err
			}
			return os.Lchown(p, uid, gid)
		}); err != nil {
			return nil, err
		}
	}
	initdb := s.command(filepath.Join(s.binDir, "initdb"), "-D", s.dataDir, "-A", "trust", "-U", "postgres", "-E", "UTF8", "--locale=C", "--no-sync")
	if out, err := initdb.CombinedOutput(); err != nil {
		return nil, fmt.Errorf("initdb: %w\n%s", err, out)
	}
	if err := s.startReaper(); err != nil {
		return nil, err
	}
	for attempt := 1; ; attempt++ {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			return nil, err
		}
		s.port = l.Addr().(*net.TCPAddr).Port
		_ = l.Close()
		opts := fmt.Sprintf("-p %d -k %s", s.port, filepath.Join(s.base, "sock"))
		settings := append(slices.Clone(serverSettings), extraSettings...)
		if extra := os.Getenv("OUTBOX_BENCH_PG_SETTINGS"); extra != "" {
			// Settings to try a planner or server change with (comma-separated key=value),
			// e.g. enable_hashjoin=off: not for published numbers.
			settings = append(settings, strings.Split(extra, ",")...)
		}
		for _, kv := range settings {
			opts += " -c " + kv
		}
		out, err := s.command(filepath.Join(s.binDir, "pg_ctl"), "-w", "-t", "60", "-D", s.dataDir,
			"-l", filepath.Join(s.base, "server.log"), "-o", opts, "start").CombinedOutput()
		if err == nil {
			return s, nil
		}
		_, _ = s.command(filepath.Join(s.binDir, "pg_ctl"), "-D", s.dataDir, "-m", "immediate", "stop").CombinedOutput()
		if attempt == 3 {
			s.killReaper()
			log, _ := os.ReadFile(filepath.Join(s.base, "server.log"))
			return nil, fmt.Errorf("pg_ctl start: %w\n%s\n%s", err, bytes.TrimSpace(out), log)
		}
	}
}

func (s *pgServer) dsn(db string) string {
	u := url.URL{Scheme: "postgres", User: url.User("postgres"), Host: net.JoinHostPort("127.0.0.1", strconv.Itoa(s.port)),
		Path: "/" + db, RawQuery: "sslmode=disable"}
	return u.String()
}

func (s *pgServer) stop() {
	s.killReaper()
	_, _ = s.command(filepath.Join(s.binDir, "pg_ctl"), "-D", s.dataDir, "-m", "immediate", "-w", "stop").CombinedOutput()
	_ = os.RemoveAll(s.base)
}

func (s *pgServer) command(name string, args ...string) *exec.Cmd {
	var cmd *exec.Cmd
	if s.runAs != "" {
		cmd = exec.Command(s.runuser, append([]string{"-u", s.runAs, "--", name}, args...)...)
	} else {
		cmd = exec.Command(name, args...)
	}
	cmd.Dir = s.base
	return cmd
}

// startReaper starts a detached shell that waits for this process to close its end of a pipe
// (which happens when it exits, however it exits) and then stops the server and removes its dir.
func (s *pgServer) startReaper() error {
	r, w, err := os.Pipe()
	if err != nil {
		return err
	}
	defer r.Close()
	stop := s.command(filepath.Join(s.binDir, "pg_ctl"), "-D", s.dataDir, "-m", "immediate", "stop")
	script := `while read -r _; do :; done; base=$1; shift; "$@" >/dev/null 2>&1; rm -rf -- "$base"`
	cmd := exec.Command("/bin/sh", append([]string{"-c", script, "bench-pg-reaper", s.base}, stop.Args...)...)
	cmd.Stdin = r
	cmd.Dir = "/"
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	if err := cmd.Start(); err != nil {
		_ = w.Close()
		return err
	}
	s.reaper, s.pipe = cmd, w
	return nil
}

func (s *pgServer) killReaper() {
	if s.reaper == nil {
		return
	}
	_ = s.reaper.Process.Kill()
	_ = s.reaper.Wait()
	_ = s.pipe.Close()
	s.reaper = nil
}

func findBinDir() (string, error) {
	if dir := os.Getenv("OUTBOX_PG_BINDIR"); dir != "" {
		return dir, nil
	}
	if p, err := exec.LookPath("initdb"); err == nil {
		if real, err := filepath.EvalSymlinks(p); err == nil {
			return filepath.Dir(real), nil
		}
	}
	matches, _ := filepath.Glob("/usr/lib/postgresql/*/bin")
	sort.Slice(matches, func(i, j int) bool {
		a, _ := strconv.Atoi(filepath.Base(filepath.Dir(matches[i])))
		b, _ := strconv.Atoi(filepath.Base(filepath.Dir(matches[j])))
		return a > b
	})
	for _, dir := range matches {
		if _, err := os.Stat(filepath.Join(dir, "initdb")); err == nil {
			return dir, nil
		}
	}
	return "", errors.New("no PostgreSQL server binaries (apt-get install postgresql), and no -dsn / OUTBOX_BENCH_DSN given")
}

var _ = time.Second

// openBenchDatabase starts a throwaway PostgreSQL unless dsn names a server, creates database name
// on it afresh and opens it, noting the server in m. stop ends what it started.
func openBenchDatabase(ctx context.Context, dsn, name string, m *machine) (admin *sql.DB, benchDSN string, stop func(), err error) {
	stop = func() {}
	if dsn == "" {
		logf("starting a throwaway PostgreSQL")
		srv, err := startPG()
		if err != nil {
			return nil, "", stop, err
		}
		stop = srv.stop
		dsn = srv.dsn("postgres")
		m.Postgres = srv.version
		m.ServerSettings = strings.Join(serverSettings, ", ")
	} else {
		m.ServerSettings = "external server (-dsn): its own settings"
	}
	benchDSN, err = createDatabase(ctx, dsn, name)
	if err == nil {
		admin, err = sql.Open("postgres", benchDSN)
	}
	if err != nil {
		stop()
		return nil, "", func() {}, err
	}
	if m.Postgres == "" {
		_ = admin.QueryRow(`SELECT version()`).Scan(&m.Postgres)
	}
	stopServer := stop
	return admin, benchDSN, func() { _ = admin.Close(); stopServer() }, nil
}
