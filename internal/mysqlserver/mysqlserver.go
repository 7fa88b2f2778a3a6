// Package mysqlserver runs a private MariaDB (or MySQL) server from the locally installed
// binaries, for the tests of the MySQL driver (Debian: apt-get install mariadb-server; the system
// service is not needed and is not touched).
//
// Start initializes a data directory in a temp dir (mariadb-install-db, or mysqld
// --initialize-insecure for MySQL) and starts mysqld on a free port of 127.0.0.1 and a socket of
// its own, without grant tables: any user name connects, with every right. If the process dies
// without calling Stop (a panic, a test timeout, os.Exit), a detached helper kills the server and
// removes the temp dir. mysqld refuses to run as root unless told to: as root it runs with
// --user=root.
package mysqlserver

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"
)

// ErrNoBinaries is wrapped by the error of Start when mysqld cannot be found.
var ErrNoBinaries = errors.New("no MariaDB or MySQL server binaries (mysqld, mariadb-install-db)")

const (
	installHint  = "install MariaDB (apt-get install mariadb-server; the system service need not run)"
	startTimeout = 60 * time.Second
)

// Server is a running private server. Stop is safe for concurrent use.
type Server struct {
	// Addr is the server's TCP address, 127.0.0.1:port.
	Addr string
	// Version is what mysqld --version says.
	Version string

	base   string
	cmd    *exec.Cmd
	exited chan struct{}
	reaper *exec.Cmd
	pipe   io.WriteCloser

	stopOnce sync.Once
	stopErr  error
}

// Start initializes a data directory in a new temp dir and starts mysqld on it. Every wait is
// bounded; an error says what failed, with the end of the server's log. extra are mysqld options
// added after the defaults, which they override (the last of an option wins): a benchmark asks
// for durable commits with --innodb-flush-log-at-trx-commit=1.
func Start(extra ...string) (_ *Server, err error) {
	mysqld, err := lookPath("mariadbd", "mysqld")
	if err != nil {
		return nil, err
	}
	out, err := exec.Command(mysqld, "--version").Output()
	if err != nil {
		return nil, fmt.Errorf("%s --version: %w", mysqld, err)
	}
	s := &Server{Version: strings.TrimSpace(string(out)), exited: make(chan struct{})}
	// A Unix socket path is limited to 107 bytes.
	parent := ""
	if len(os.TempDir()) > 60 {
		parent = "/tmp"
	}
	if s.base, err = os.MkdirTemp(parent, "mysqlserver-"); err != nil {
		return nil, fmt.Errorf("create temp dir: %w", err)
	}
	defer func() {
		if err != nil {
			_ = s.Stop()
		}
	}()
	if err := s.startReaper(); err != nil {
		return nil, err
	}
	data := filepath.Join(s.base, "data")
	// A temp dir of its own: a server removes the #sql files of its temp dir when it starts, and
	// the installer's bootstrap keeps its temporary tables there, so that servers of several test
	// binaries sharing /tmp broke each other's installation.
	tmp := filepath.Join(s.base, "tmp")
	if err := os.Mkdir(tmp, 0o700); err != nil {
		return nil, fmt.Errorf("create the server's temp dir: %w", err)
	}
	// The options of the installer and the server alike.
	common := []string{"--tmpdir=" + tmp}
	if os.Geteuid() == 0 {
		common = append(common, "--user=root")
	}
	if strings.Contains(s.Version, "MariaDB") {
		installDB, err := lookPath("mariadb-install-db", "mysql_install_db")
		if err != nil {
			return nil, err
		}
		args := append([]string{"--no-defaults", "--datadir=" + data, "--auth-root-authentication-method=normal", "--skip-test-db"}, common...)
		if err := run(installDB, args...); err != nil {
			return nil, err
		}
	} else if err := run(mysqld, append([]string{"--no-defaults", "--initialize-insecure", "--datadir=" + data}, common...)...); err != nil {
		return nil, err
	}
	var lastErr error
	for range 3 { // a free port may be taken before mysqld binds it
		port, err := freePort()
		if err != nil {
			return nil, err
		}
		if lastErr = s.start(mysqld, data, port, append(common, extra...)); lastErr == nil {
			return s, nil
		}
		if !strings.Contains(lastErr.Error(), "Address already in use") {
			break
		}
		s.exited = make(chan struct{})
	}
	return nil, lastErr
}

// start runs mysqld on port, with the options more after the defaults, and waits until it
// accepts connections.
func (s *Server) start(mysqld, data string, port int, more []string) error {
	logFile := filepath.Join(s.base, "server.log")
	args := append([]string{"--no-defaults",
		"--datadir=" + data,
		"--socket=" + filepath.Join(s.base, "mysqld.sock"),
		"--pid-file=" + filepath.Join(s.base, "mysqld.pid"),
		"--log-error=" + logFile,
		"--bind-address=127.0.0.1",
		"--port=" + strconv.Itoa(port),
		"--skip-grant-tables",
		"--skip-log-bin",
		"--character-set-server=utf8mb4",
		"--max-connections=500",
		"--innodb-buffer-pool-size=128M",
		// The tests kill clients, not the server: a commit need not reach the disk.
		"--innodb-flush-log-at-trx-commit=2",
	}, more...)
	s.cmd = exec.Command(mysqld, args...)
	s.cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if err := s.cmd.Start(); err != nil {
		return fmt.Errorf("start %s: %w", mysqld, err)
	}
	if _, err := fmt.Fprintf(s.pipe, "%d\n", s.cmd.Process.Pid); err != nil {
		return fmt.Errorf("tell the reaper the server's pid: %w", err)
	}
	exited := s.exited
	go func() { _ = s.cmd.Wait(); close(exited) }()
	addr := net.JoinHostPort("127.0.0.1", strconv.Itoa(port))
	deadline := time.Now().Add(startTimeout)
	for {
		select {
		case <-exited:
			return fmt.Errorf("mysqld exited while starting: %s", tail(logFile))
		default:
		}
		if err := handshake(addr); err == nil {
			s.Addr = addr
			return nil
		} else if time.Now().After(deadline) {
			_ = s.cmd.Process.Kill()
			return fmt.Errorf("mysqld did not accept connections on %s within %s (%v): %s", addr, startTimeout, err, tail(logFile))
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// handshake reads the server's greeting: a server that sends one accepts connections.
func handshake(addr string) error {
	c, err := net.DialTimeout("tcp", addr, time.Second)
	if err != nil {
		return err
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(2 * time.Second))
	hdr := make([]byte, 5)
	if _, err := io.ReadFull(c, hdr); err != nil {
		return fmt.Errorf("read greeting: %w", err)
	}
	if hdr[4] == 0xff {
		return errors.New("server refused the connection (starting up?)")
	}
	return nil
}

// startReaper starts a detached shell that kills the server and removes the temp dir once this
// process closes the pipe to it, or dies.
func (s *Server) startReaper() error {
	script := `pids=; while read -r pid; do pids="$pids $pid"; done; kill -9 $pids 2>/dev/null; sleep 1; rm -rf "$1"`
	s.reaper = exec.Command("/bin/sh", "-c", script, "reaper", s.base)
	s.reaper.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	var err error
	if s.pipe, err = s.reaper.StdinPipe(); err != nil {
		return fmt.Errorf("reaper: %w", err)
	}
	if err := s.reaper.Start(); err != nil {
		return fmt.Errorf("start the reaper: %w", err)
	}
	return nil
}

// Stop kills the server and removes its temp dir.
func (s *Server) Stop() error {
	s.stopOnce.Do(func() {
		if s.cmd != nil && s.cmd.Process != nil {
			_ = s.cmd.Process.Kill()
			select {
			case <-s.exited:
			case <-time.After(30 * time.Second):
				s.stopErr = errors.New("mysqld did not exit within 30s of SIGKILL")
			}
		}
		if s.pipe != nil {
			_ = s.pipe.Close() // the reaper finds the server gone and removes the dir
			done := make(chan error, 1)
			go func() { done <- s.reaper.Wait() }()
			select {
			case <-done:
			case <-time.After(30 * time.Second):
				s.stopErr = errors.Join(s.stopErr, errors.New("the reaper did not finish within 30s"))
			}
		}
		if s.base != "" {
			s.stopErr = errors.Join(s.stopErr, os.RemoveAll(s.base))
		}
	})
	return s.stopErr
}

func lookPath(names ...string) (string, error) {
	for _, n := range names {
		if p, err := exec.LookPath(n); err == nil {
			return p, nil
		}
		for _, dir := range []string{"/usr/sbin", "/usr/bin", "/usr/local/mysql/bin"} {
			if p := filepath.Join(dir, n); isExec(p) {
				return p, nil
			}
		}
	}
	return "", fmt.Errorf("%w: none of %v found on PATH or in /usr/sbin; %s", ErrNoBinaries, names, installHint)
}

func isExec(p string) bool {
	fi, err := os.Stat(p)
	return err == nil && !fi.IsDir() && fi.Mode()&0o111 != 0
}

func run(name string, args ...string) error {
	cmd := exec.Command(name, args...)
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	done := make(chan error, 1)
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("%s: %w", name, err)
	}
	go func() { done <- cmd.Wait() }()
	select {
	case err := <-done:
		if err != nil {
			return fmt.Errorf("%s %s: %w: %s", name, strings.Join(args, " "), err, lastLines(out.String()))
		}
		return nil
	case <-time.After(startTimeout):
		_ = cmd.Process.Kill()
		<-done
		return fmt.Errorf("%s did not finish within %s: %s", name, startTimeout, lastLines(out.String()))
	}
}

func freePort() (int, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, fmt.Errorf("find a free port: %w", err)
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port, nil
}

func tail(file string) string {
	b, err := os.ReadFile(file)
	if err != nil {
		return fmt.Sprintf("(no log: %v)", err)
	}
	return lastLines(string(b))
}

func lastLines(s string) string {
	lines := strings.Split(strings.TrimSpace(s), "\n")
	return strings.Join(lines[max(0, len(lines)-15):], "\n")
}
