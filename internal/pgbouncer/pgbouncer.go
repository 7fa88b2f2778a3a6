// Package pgbouncer starts a private PgBouncer on loopback in front of a PostgreSQL server, for
// the tests that run the framework behind a connection pooler.
package pgbouncer

import (
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"
)

// EnvBin, if set, is the path of the pgbouncer binary.
const EnvBin = "OUTBOX_PGBOUNCER"

// ErrNoBinary is wrapped by the error of Start when pgbouncer cannot be found.
var ErrNoBinary = errors.New("no pgbouncer binary")

// Modes of pooling (PgBouncer's pool_mode).
const (
	Transaction = "transaction"
	Session     = "session"
)

// osUser runs PgBouncer when this process runs as root: PgBouncer refuses to run as root.
const osUser = "postgres"

const startTimeout = 15 * time.Second

// Options configure Start.
type Options struct {
	// Upstream is the host:port of the PostgreSQL server; every database name is passed through
	// to it, logging in as User.
	Upstream string
	// User is the PostgreSQL role PgBouncer logs in as (whatever user a client names).
	User string
	// Mode is Transaction or Session.
	Mode string
	// PoolSize is the number of server connections per database (default 20).
	PoolSize int
}

// Bouncer is a running PgBouncer.
type Bouncer struct {
	dir  string
	port int
	cmd  *exec.Cmd
	done chan struct{}

	stopOnce sync.Once
	stopErr  error
}

// Start starts PgBouncer on a free port of 127.0.0.1 with opts, and waits until it accepts
// connections.
func Start(opts Options) (_ *Bouncer, err error) {
	bin, err := findBinary()
	if err != nil {
		return nil, err
	}
	if opts.Mode != Transaction && opts.Mode != Session {
		return nil, fmt.Errorf("pgbouncer: unknown pool mode %q", opts.Mode)
	}
	if opts.PoolSize == 0 {
		opts.PoolSize = 20
	}
	host, port, err := net.SplitHostPort(opts.Upstream)
	if err != nil {
		return nil, fmt.Errorf("pgbouncer: upstream %q: %w", opts.Upstream, err)
	}
	b := &Bouncer{done: make(chan struct{})}
	if b.dir, err = os.MkdirTemp("", "pgbouncer-"); err != nil {
		return nil, fmt.Errorf("pgbouncer: temp dir: %w", err)
	}
	defer func() {
		if err != nil {
			_ = os.RemoveAll(b.dir)
		}
	}()
	var cred *syscall.Credential
	if os.Geteuid() == 0 {
		u, err := user.Lookup(osUser)
		if err != nil {
			return nil, fmt.Errorf("pgbouncer refuses to run as root, and OS user %q to run it as was not found: %w", osUser, err)
		}
		uid, _ := strconv.Atoi(u.Uid)
		gid, _ := strconv.Atoi(u.Gid)
		cred = &syscall.Credential{Uid: uint32(uid), Gid: uint32(gid)}
		if err := os.Chown(b.dir, uid, gid); err != nil {
			return nil, fmt.Errorf("pgbouncer: chown temp dir: %w", err)
		}
	}
	if b.port, err = freePort(); err != nil {
		return nil, err
	}
	// server_idle_timeout is short so that a test database can be dropped soon after its test;
	// the drop forces the rest off anyway.
	conf := fmt.Sprintf(`[databases]
* = host=%s port=%s user=%s

[pgbouncer]
listen_addr = 127.0.0.1
listen_port = %d
unix_socket_dir =
auth_type = any
pool_mode = %s
default_pool_size = %d
max_client_conn = 2000
server_idle_timeout = 10
server_login_retry = 1
ignore_startup_parameters = extra_float_digits
logfile = %s
`, host, port, opts.User, b.port, opts.Mode, opts.PoolSize, filepath.Join(b.dir, "pgbouncer.log"))
	confFile := filepath.Join(b.dir, "pgbouncer.ini")
	if err := os.WriteFile(confFile, []byte(conf), 0o644); err != nil {
		return nil, fmt.Errorf("pgbouncer: write config: %w", err)
	}
	b.cmd = exec.Command(bin, confFile)
	// Pdeathsig: PgBouncer goes when the test process dies without calling Stop.
	b.cmd.SysProcAttr = &syscall.SysProcAttr{Credential: cred, Pdeathsig: syscall.SIGTERM, Setpgid: true}
	// Pdeathsig is sent when the OS thread that started the child exits, not the process: a
	// thread the runtime lets go mid-test killed PgBouncer under a loaded make test. The thread
	// that starts it stays locked, and alive, until PgBouncer exits.
	started := make(chan error, 1)
	go func() {
		runtime.LockOSThread()
		if err := b.cmd.Start(); err != nil {
			started <- err
			close(b.done)
			return
		}
		started <- nil
		_ = b.cmd.Wait()
		close(b.done)
	}()
	if err := <-started; err != nil {
		return nil, fmt.Errorf("pgbouncer: start %s: %w", bin, err)
	}
	deadline := time.Now().Add(startTimeout)
	for {
		c, err := net.DialTimeout("tcp", b.Addr(), time.Second)
		if err == nil {
			_ = c.Close()
			return b, nil
		}
		select {
		case <-b.done:
			return nil, fmt.Errorf("pgbouncer exited at start: %s", b.LogTail())
		case <-time.After(50 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			_ = b.Stop()
			return nil, fmt.Errorf("pgbouncer did not accept connections on %s within %s: %s", b.Addr(), startTimeout, b.LogTail())
		}
	}
}

// Exited reports whether the PgBouncer process has exited.
func (b *Bouncer) Exited() bool {
	select {
	case <-b.done:
		return true
	default:
		return false
	}
}

// Status says whether PgBouncer runs, and if it exited, how, with the end of its log.
func (b *Bouncer) Status() string {
	if !b.Exited() {
		return fmt.Sprintf("PgBouncer (pid %d) is running", b.cmd.Process.Pid)
	}
	return fmt.Sprintf("PgBouncer (pid %d) exited (%v); its log ends: %s", b.cmd.Process.Pid, b.cmd.ProcessState, b.LogTail())
}

// Addr is the host:port PgBouncer listens on.
func (b *Bouncer) Addr() string { return net.JoinHostPort("127.0.0.1", strconv.Itoa(b.port)) }

// Port is the port PgBouncer listens on (on 127.0.0.1).
func (b *Bouncer) Port() int { return b.port }

// LogTail returns the end of PgBouncer's log.
func (b *Bouncer) LogTail() string {
	out, _ := os.ReadFile(filepath.Join(b.dir, "pgbouncer.log"))
	s := string(out)
	if len(s) > 4000 {
		s = s[len(s)-4000:]
	}
	return strings.TrimSpace(s)
}

// Stop stops PgBouncer (waiting at most 10s) and removes its directory.
func (b *Bouncer) Stop() error {
	b.stopOnce.Do(func() {
		_ = b.cmd.Process.Signal(syscall.SIGINT) // immediate shutdown
		select {
		case <-b.done:
		case <-time.After(10 * time.Second):
			_ = b.cmd.Process.Kill()
			select {
			case <-b.done:
			case <-time.After(5 * time.Second):
				b.stopErr = fmt.Errorf("pgbouncer (pid %d) did not exit", b.cmd.Process.Pid)
			}
		}
		if err := os.RemoveAll(b.dir); err != nil && b.stopErr == nil {
			b.stopErr = err
		}
	})
	return b.stopErr
}

func findBinary() (string, error) {
	if p := os.Getenv(EnvBin); p != "" {
		return p, nil
	}
	if p, err := exec.LookPath("pgbouncer"); err == nil {
		return p, nil
	}
	for _, p := range []string{"/usr/sbin/pgbouncer", "/usr/local/sbin/pgbouncer", "/usr/local/bin/pgbouncer"} {
		if _, err := os.Stat(p); err == nil {
			return p, nil
		}
	}
	return "", fmt.Errorf("%w: install PgBouncer (apt-get install pgbouncer) or set %s to its path", ErrNoBinary, EnvBin)
}

func freePort() (int, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, fmt.Errorf("pgbouncer: find a free port: %w", err)
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port, nil
}

// Version returns the first line of `pgbouncer -V` ("PgBouncer 1.18.0"), or the reason it could
// not be read.
func Version() string {
	bin, err := findBinary()
	if err != nil {
		return err.Error()
	}
	out, err := exec.Command(bin, "-V").Output()
	if err != nil {
		return fmt.Sprintf("pgbouncer -V: %v", err)
	}
	line, _, _ := strings.Cut(strings.TrimSpace(string(out)), "\n")
	return line
}
