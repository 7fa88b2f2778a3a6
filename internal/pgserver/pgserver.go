package pgserver

import (
	"bytes"
	"errors"
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
	"time"
)

// EnvBinDir, if set, is the only directory searched for initdb, pg_ctl and postgres.
const EnvBinDir = "OUTBOX_PG_BINDIR"

// ErrNoBinaries is wrapped by the error of Start when initdb, pg_ctl and postgres cannot be found.
var ErrNoBinaries = errors.New("no PostgreSQL server binaries (initdb, pg_ctl, postgres)")

const (
	installHint  = "install PostgreSQL (apt-get install postgresql) or set " + EnvBinDir + " to the directory of its binaries"
	startTimeout = 60 * time.Second
	osUser       = "postgres" // OS user that runs the server when this process runs as root
	dbUser       = "postgres" // superuser created by initdb -U
)

// Options configure Start.
type Options struct {
	// DataDir is the cluster's data directory. Empty (the default): a new cluster in a temp dir,
	// removed by Stop. Otherwise the directory is kept across runs: initdb runs only if it is missing
	// or empty, and an existing cluster is reused. When running as root it must be usable by the OS
	// user "postgres" (Start creates a missing directory and hands it over to that user).
	DataDir string
	// Logf, if set, receives progress notes (a new cluster, a port retry). Default: silent.
	Logf func(format string, args ...any)
	// Port, when non-zero, is the port to listen on (to restart a server at the same address).
	// Default: a free port.
	Port int
	// StandbyOf, when set, is a libpq connection string of a primary: instead of initdb, Start
	// copies it with pg_basebackup -R and starts a streaming standby of it (hot standby,
	// read-only until Promote). The connection string's application_name is the standby's name
	// for synchronous_standby_names. Only with DataDir empty.
	StandbyOf string
	// Settings are server settings (name=value) added to the command line, for a server of a
	// test's own, e.g. shared_preload_libraries=pg_stat_statements, which can only be set at start.
	Settings []string
}

// Server is a running private PostgreSQL server. Its methods are safe for concurrent use.
type Server struct {
	binDir   string
	version  string
	base     string // temp dir holding sock/, server.log and (unless keepData) data/
	dataDir  string
	keepData bool
	sockDir  string
	logFile  string
	port     int
	runAs    string // OS user to run PostgreSQL as ("" = current user)
	runuser  string // path of runuser, when runAs is set
	logf     func(format string, args ...any)

	reaper     *exec.Cmd
	reaperPipe *os.File // closing it (or our death) tells the reaper to clean up
	killed     atomic.Bool
	stopOnce   sync.Once
	stopErr    error
}

// Start initdb's and starts a private cluster on a free port of 127.0.0.1, reachable with DSN.
// The binaries come from OUTBOX_PG_BINDIR (only there, if set), else from the directory of initdb on
// PATH, else from the highest /usr/lib/postgresql/*/bin. As root, the server runs as the OS user
// "postgres" via runuser -u postgres. With Options.DataDir empty the cluster lives in a temp dir
// that Stop removes; a non-empty DataDir is kept across runs (see Options). If this process dies
// without calling Stop, a detached helper stops the server and removes the temp dir.
func Start(opts Options) (_ *Server, err error) {
	binDir, err := findBinDir()
	if err != nil {
		return nil, err
	}
	s := &Server{binDir: binDir, logf: opts.Logf}
	if s.logf == nil {
		s.logf = func(string, ...any) {}
	}

	uid, gid := -1, -1
	if os.Geteuid() == 0 {
		u, err := user.Lookup(osUser)
		if err != nil {
			return nil, fmt.Errorf("running as root, and PostgreSQL refuses to run as root, but OS user %q to run it as was not found (%w); "+
				"create it (useradd --system %s) or run as a non-root user", osUser, err, osUser)
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
	if s.base, err = os.MkdirTemp(parent, "pgserver-"); err != nil {
		return nil, fmt.Errorf("create temp dir: %w", err)
	}
	defer func() {
		if err != nil {
			_ = os.RemoveAll(s.base)
		}
	}()
	s.sockDir = filepath.Join(s.base, "sock")
	s.logFile = filepath.Join(s.base, "server.log")
	if err := os.Mkdir(s.sockDir, 0o700); err != nil {
		return nil, fmt.Errorf("create socket dir: %w", err)
	}
	if s.runAs != "" {
		if err := chownR(s.base, uid, gid); err != nil {
			return nil, err
		}
		if err := s.checkUsable(s.base, "temp dir", "are its parent directories searchable? try TMPDIR=/tmp"); err != nil {
			return nil, err
		}
	}

	needInit := true
	if opts.StandbyOf != "" && opts.DataDir != "" {
		return nil, errors.New("pgserver: StandbyOf needs a new cluster (DataDir empty)")
	}
	if opts.DataDir == "" {
		s.dataDir = filepath.Join(s.base, "data")
	} else {
		s.keepData = true
		if needInit, err = s.prepareDataDir(opts.DataDir, uid, gid); err != nil {
			return nil, err
		}
	}

	if opts.StandbyOf != "" {
		needInit = false
		// -R writes primary_conninfo and standby.signal; -X stream copies the WAL written meanwhile.
		backup := s.command(filepath.Join(binDir, "pg_basebackup"), "-D", s.dataDir, "-d", opts.StandbyOf, "-R", "-X", "stream", "--no-sync", "-c", "fast")
		if out, err := backup.CombinedOutput(); err != nil {
			return nil, fmt.Errorf("pg_basebackup (%s): %w\n%s", backup, err, tail(out, 40))
		}
	}
	if needInit {
		args := []string{"-D", s.dataDir, "-A", "trust", "-U", dbUser, "-E", "UTF8", "--locale=C"}
		if !s.keepData {
			args = append(args, "--no-sync") // a throwaway cluster does not need to survive a power cut
		} else {
			s.logf("initializing a new PostgreSQL cluster in %s", s.dataDir)
		}
		initdb := s.command(filepath.Join(binDir, "initdb"), args...)
		if out, err := initdb.CombinedOutput(); err != nil {
			return nil, fmt.Errorf("initdb (%s): %w\n%s", initdb, err, tail(out, 40))
		}
	}

	// The reaper stops the server and removes the temp dir if this process dies without calling Stop
	// (a panic, a test timeout, Ctrl-C, os.Exit, ...).
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
		if opts.Port != 0 {
			s.port = opts.Port
		} else if s.port, err = freePort(); err != nil {
			return nil, err
		}
		logBefore := s.logSize()
		serverOpts := fmt.Sprintf("-p %d -k %s -c listen_addresses=127.0.0.1 -c max_connections=300 -c fsync=on -c shared_buffers=128MB",
			s.port, shellQuote(s.sockDir))
		for _, kv := range opts.Settings {
			serverOpts += " -c " + shellQuote(kv)
		}
		start := s.command(filepath.Join(binDir, "pg_ctl"), "-w", "-t", strconv.Itoa(int(startTimeout/time.Second)),
			"-D", s.dataDir, "-l", s.logFile, "-o", serverOpts, "start")
		out, startErr := start.CombinedOutput()
		if startErr == nil {
			return s, nil
		}
		err = fmt.Errorf("pg_ctl start: %w\n%s\n%s", startErr, bytes.TrimSpace(out), s.LogTail())
		// pg_ctl -w may give up while the postmaster still runs: make sure nothing is left behind.
		_, _ = s.command(filepath.Join(binDir, "pg_ctl"), "-D", s.dataDir, "-m", "immediate", "stop").CombinedOutput()
		if i == attempts || opts.Port != 0 || !s.portInUse(logBefore) {
			return nil, err
		}
		s.logf("port %d was taken, retrying with another one", s.port)
	}
}

// prepareDataDir makes dir, a data directory kept across runs, absolute and ready, and reports
// whether it needs initdb (missing or empty) or holds a cluster already.
func (s *Server) prepareDataDir(dir string, uid, gid int) (needInit bool, err error) {
	if s.dataDir, err = filepath.Abs(dir); err != nil {
		return false, fmt.Errorf("data dir %s: %w", dir, err)
	}
	entries, err := os.ReadDir(s.dataDir)
	switch {
	case errors.Is(err, os.ErrNotExist):
		if err := os.MkdirAll(s.dataDir, 0o700); err != nil {
			return false, fmt.Errorf("create data dir: %w", err)
		}
		needInit = true
	case err != nil:
		return false, fmt.Errorf("data dir %s: %w", s.dataDir, err)
	case len(entries) == 0:
		needInit = true
	default:
		if _, err := os.Stat(filepath.Join(s.dataDir, "PG_VERSION")); err != nil {
			return false, fmt.Errorf("data dir %s is neither empty nor a PostgreSQL data directory (no PG_VERSION)", s.dataDir)
		}
		s.logf("using the existing PostgreSQL cluster in %s", s.dataDir)
	}
	if s.runAs != "" {
		if needInit {
			// Empty: hand it over to the server's user, which initdb and the server require.
			if err := os.Lchown(s.dataDir, uid, gid); err != nil {
				return false, fmt.Errorf("chown data dir: %w", err)
			}
		}
		if err := s.checkUsable(s.dataDir, "data dir", "are its parent directories searchable?"); err != nil {
			return false, err
		}
	}
	return needInit, nil
}

// checkUsable checks that the server's OS user can write to dir and reach it through its parents.
func (s *Server) checkUsable(dir, what, hint string) error {
	if out, err := s.command("test", "-w", dir, "-a", "-x", dir).CombinedOutput(); err != nil {
		return fmt.Errorf("%s %s is not usable by OS user %q (%s): %w: %s", what, dir, s.runAs, hint, err, bytes.TrimSpace(out))
	}
	return nil
}

// DSN returns a postgres:// URL for database dbname as the superuser "postgres" (no password).
func (s *Server) DSN(dbname string) string {
	u := url.URL{
		Scheme:   "postgres",
		User:     url.User(dbUser),
		Host:     net.JoinHostPort("127.0.0.1", strconv.Itoa(s.port)),
		Path:     "/" + dbname,
		RawQuery: "sslmode=disable",
	}
	return u.String()
}

// Version returns the output of postgres --version, e.g. "postgres (PostgreSQL) 15.8", or "" if unknown.
func (s *Server) Version() string { return s.version }

// Port returns the TCP port the server listens on (on 127.0.0.1).
func (s *Server) Port() int { return s.port }

// DataDir returns the cluster's data directory.
func (s *Server) DataDir() string { return s.dataDir }

// Promote turns a standby (Options.StandbyOf) into a primary that takes writes, and waits until
// it does (pg_ctl promote -w, at most a minute).
func (s *Server) Promote() error {
	out, err := s.command(filepath.Join(s.binDir, "pg_ctl"), "-D", s.dataDir, "-w", "-t", "60", "promote").CombinedOutput()
	if err != nil {
		return fmt.Errorf("pg_ctl promote: %w: %s\n%s", err, bytes.TrimSpace(out), s.LogTail())
	}
	return nil
}

// Kill ends the server as the loss of its machine would: SIGKILL to the postmaster and every
// process it started, with no shutdown checkpoint and no goodbye to clients or standbys. The
// postmaster is stopped first so that it cannot start a replacement for a child killed before it.
// Stop afterwards only removes the temp dir.
func (s *Server) Kill() error {
	b, err := os.ReadFile(filepath.Join(s.dataDir, "postmaster.pid"))
	if err != nil {
		return fmt.Errorf("read postmaster.pid: %w", err)
	}
	first, _, _ := strings.Cut(string(b), "\n")
	pid, err := strconv.Atoi(strings.TrimSpace(first))
	if err != nil {
		return fmt.Errorf("postmaster.pid: %w", err)
	}
	if err := syscall.Kill(pid, syscall.SIGSTOP); err != nil {
		return fmt.Errorf("stop postmaster %d: %w", pid, err)
	}
	for _, child := range children(pid) {
		_ = syscall.Kill(child, syscall.SIGKILL)
	}
	if err := syscall.Kill(pid, syscall.SIGKILL); err != nil {
		return fmt.Errorf("kill postmaster %d: %w", pid, err)
	}
	// Reap-free wait: the postmaster is not our child; it is gone when signal 0 fails.
	deadline := time.Now().Add(10 * time.Second)
	for syscall.Kill(pid, 0) == nil {
		if time.Now().After(deadline) {
			return fmt.Errorf("postmaster %d still there 10s after SIGKILL", pid)
		}
		time.Sleep(10 * time.Millisecond)
	}
	s.killed.Store(true)
	return nil
}

// children lists the processes whose parent is pid.
func children(pid int) []int {
	entries, _ := os.ReadDir("/proc")
	var out []int
	for _, e := range entries {
		child, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		b, err := os.ReadFile(filepath.Join("/proc", e.Name(), "stat"))
		if err != nil {
			continue
		}
		// The command in parentheses may hold spaces: the parent is the second field after it.
		i := bytes.LastIndexByte(b, ')')
		if i < 0 {
			continue
		}
		f := strings.Fields(string(b[i+1:]))
		if len(f) > 1 && f[1] == strconv.Itoa(pid) {
			out = append(out, child)
		}
	}
	return out
}

// Stop stops the server and removes its temp dir (and the data, unless Options.DataDir was set).
// A throwaway cluster is stopped in immediate mode; a kept one in fast mode, so that it is shut
// down cleanly. Safe to call more than once; later calls return the first result.
func (s *Server) Stop() error {
	s.stopOnce.Do(func() {
		s.killReaper()
		var errs []error
		// After Kill nothing runs, and pg_ctl would only complain about the stale postmaster.pid.
		if out, err := s.command(filepath.Join(s.binDir, "pg_ctl"), "-D", s.dataDir, "-m", s.stopMode(), "-w", "stop").CombinedOutput(); err != nil && !s.killed.Load() {
			errs = append(errs, fmt.Errorf("pg_ctl stop: %w: %s", err, bytes.TrimSpace(out)))
		}
		if err := os.RemoveAll(s.base); err != nil {
			errs = append(errs, fmt.Errorf("remove %s: %w", s.base, err))
		}
		s.stopErr = errors.Join(errs...)
	})
	return s.stopErr
}

func (s *Server) stopMode() string {
	if s.keepData {
		return "fast"
	}
	return "immediate"
}

// LogTail returns the last lines of the server log, framed for an error message.
func (s *Server) LogTail() string {
	b, err := os.ReadFile(s.logFile)
	if err != nil {
		return fmt.Sprintf("(no server log: %v)", err)
	}
	return fmt.Sprintf("--- tail of %s ---\n%s\n--- end of server log ---", s.logFile, tail(b, 40))
}

func (s *Server) logSize() int64 {
	fi, err := os.Stat(s.logFile)
	if err != nil {
		return 0
	}
	return fi.Size()
}

// portInUse reports whether the server log written after offset says the port could not be bound.
func (s *Server) portInUse(offset int64) bool {
	b, err := os.ReadFile(s.logFile)
	if err != nil || int64(len(b)) < offset {
		return false
	}
	return bytes.Contains(b[offset:], []byte("Address already in use"))
}

func (s *Server) startReaper() error {
	r, w, err := os.Pipe()
	if err != nil {
		return fmt.Errorf("reaper pipe: %w", err)
	}
	defer r.Close()
	stop := s.command(filepath.Join(s.binDir, "pg_ctl"), "-D", s.dataDir, "-m", s.stopMode(), "stop")
	// read (a shell builtin: no extra process) sees EOF when every write end of the pipe is closed, i.e. when this
	// process exits (the write end is close-on-exec, so no other child inherits it). Only the temp dir is removed:
	// a kept data directory is outside it.
	script := `while read -r _; do :; done; base=$1; shift; "$@" >/dev/null 2>&1; rm -rf -- "$base"`
	args := append([]string{"-c", script, "pgserver-reaper", s.base}, stop.Args...)
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

func (s *Server) killReaper() {
	if s.reaper == nil {
		return
	}
	_ = s.reaper.Process.Kill()
	_ = s.reaper.Wait()
	_ = s.reaperPipe.Close()
	s.reaper, s.reaperPipe = nil, nil
}

// command builds a command that runs as the server's OS user.
func (s *Server) command(name string, args ...string) *exec.Cmd {
	var cmd *exec.Cmd
	if s.runAs != "" {
		cmd = exec.Command(s.runuser, append([]string{"-u", s.runAs, "--", name}, args...)...)
	} else {
		cmd = exec.Command(name, args...)
	}
	cmd.Dir = s.base // the server's user may not be able to access the current directory
	return cmd
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
			return "", fmt.Errorf("%w in %s=%s (%w); %s", ErrNoBinaries, EnvBinDir, dir, err, installHint)
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
	return "", fmt.Errorf("%w on PATH or in /usr/lib/postgresql/*/bin; %s", ErrNoBinaries, installHint)
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
