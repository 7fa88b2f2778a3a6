// Package brokertest runs throwaway RabbitMQ, Redis and Kafka servers on loopback for the
// end-to-end tests and the example's chaos mode, and kills and restarts them on demand: RabbitMQ
// and Redis from the binaries of Debian's rabbitmq-server and redis-server packages, Kafka as
// franz-go's kfake built from internal/kfakeserver (no Kafka server package installs here). A
// server dies with the process that started it, even one that is killed.
package brokertest

import (
	"bufio"
	"cmp"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
	"syscall"
	"time"
)

// Kinds of server.
const (
	RabbitMQ = "rabbitmq"
	Redis    = "redis"
	// Kafka is kfake (github.com/twmb/franz-go/pkg/kfake), one broker that speaks the Kafka wire
	// protocol, with its log on disk and fsynced per batch: it survives SIGKILL with what it
	// acknowledged. It is not Apache Kafka: see docs/brokers.md for what it proves.
	Kafka = "kafka"
)

// KafkaPartitions is the number of partitions of the topics the Kafka server creates on first use.
const KafkaPartitions = 8

const startTimeout = 90 * time.Second

// ErrNoBinaries is wrapped by the error of Start when the server's binaries are missing.
var ErrNoBinaries = errors.New("broker binaries not found")

// Server is one running (or stopped) broker. Its methods are safe for concurrent use.
type Server struct {
	kind string
	dir  string
	port int
	// RabbitMQ only: the Erlang distribution and epmd ports, so that no two servers share one.
	distPort, epmdPort int

	mu     sync.Mutex
	cmd    *exec.Cmd
	exited chan struct{}
	epmd   *exec.Cmd // RabbitMQ only: the Erlang port mapper, run here rather than left to daemonize
	reaper *exec.Cmd
	pipe   *os.File
	bin    string // Kafka only: the kfakeserver binary, built by Start
}

// Start starts a server of kind in a new temporary directory.
func Start(kind string) (*Server, error) {
	s := &Server{kind: kind}
	var err error
	if err = s.findBinaries(); err != nil {
		return nil, err
	}
	if s.dir, err = os.MkdirTemp("", "outbox-"+kind+"-"); err != nil {
		return nil, err
	}
	for _, p := range []*int{&s.port, &s.distPort, &s.epmdPort} {
		if *p, err = freePort(); err != nil {
			return nil, err
		}
	}
	if err := s.startReaper(); err != nil {
		_ = os.RemoveAll(s.dir)
		return nil, err
	}
	if kind == Kafka {
		if err := s.buildKafka(); err != nil {
			s.Close()
			return nil, err
		}
	}
	if kind == RabbitMQ {
		// epmd would daemonize itself out of reach of Kill and Close: run it as a child instead.
		s.epmd = exec.Command("epmd", "-port", fmt.Sprint(s.epmdPort), "-address", "127.0.0.1")
		s.epmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
		if err := s.epmd.Start(); err != nil {
			s.Close()
			return nil, fmt.Errorf("start epmd: %w", err)
		}
		_ = os.WriteFile(filepath.Join(s.dir, "epmd.pid"), []byte(fmt.Sprint(s.epmd.Process.Pid)), 0o644)
	}
	if err := s.Start(); err != nil {
		s.Close()
		return nil, err
	}
	return s, nil
}

func (s *Server) findBinaries() error {
	var bin, pkg string
	switch s.kind {
	case RabbitMQ:
		bin, pkg = "/usr/lib/rabbitmq/bin/rabbitmq-server", "rabbitmq-server"
	case Redis:
		bin, pkg = "redis-server", "redis-server"
	case Kafka:
		bin, pkg = "go", "golang (the go command builds internal/kfakeserver)"
	default:
		return fmt.Errorf("unknown broker kind %q", s.kind)
	}
	if _, err := exec.LookPath(bin); err != nil {
		return fmt.Errorf("%w: %s (apt-get install %s): %w", ErrNoBinaries, bin, pkg, err)
	}
	return nil
}

// buildKafka builds internal/kfakeserver into the server's directory. It is a module of its own,
// outside the workspace (kfake requires a newer Go than the library's floor); its source is found
// beside this file.
func (s *Server) buildKafka() error {
	_, file, _, ok := runtime.Caller(0)
	if !ok {
		return errors.New("brokertest: cannot find the source of internal/kfakeserver")
	}
	src := filepath.Join(filepath.Dir(file), "..", "kfakeserver")
	s.bin = filepath.Join(s.dir, "kfakeserver")
	// Under the oldest Go (make test-oldest) the go command on PATH is that Go's: OUTBOX_GO names
	// the newer one, and GOTOOLCHAIN=auto lets either take the Go kfake requires.
	gocmd := cmp.Or(os.Getenv("OUTBOX_GO"), "go")
	cmd := exec.Command(gocmd, "build", "-o", s.bin, ".")
	cmd.Dir = src
	cmd.Env = append(os.Environ(), "GOWORK=off", "GOFLAGS=", "GOTOOLCHAIN=auto")
	if gocmd != "go" {
		cmd.Env = append(cmd.Env, "GOROOT=") // the test's GOROOT is the older Go's
	}
	if out, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("build %s: %w\n%s", src, err, out)
	}
	return nil
}

// Addr is the server's address: an AMQP URL for RabbitMQ, host:port for Redis and Kafka.
func (s *Server) Addr() string {
	if s.kind == RabbitMQ {
		return fmt.Sprintf("amqp://guest:guest@127.0.0.1:%d/", s.port)
	}
	return fmt.Sprintf("127.0.0.1:%d", s.port)
}

func (s *Server) command() *exec.Cmd {
	var cmd *exec.Cmd
	switch s.kind {
	case RabbitMQ:
		cmd = exec.Command("/usr/lib/rabbitmq/bin/rabbitmq-server")
		cmd.Env = append(os.Environ(),
			"HOME="+s.dir,
			"RABBITMQ_NODENAME=outbox"+fmt.Sprint(s.port)+"@localhost",
			"RABBITMQ_NODE_IP_ADDRESS=127.0.0.1",
			fmt.Sprintf("RABBITMQ_NODE_PORT=%d", s.port),
			fmt.Sprintf("RABBITMQ_DIST_PORT=%d", s.distPort),
			fmt.Sprintf("ERL_EPMD_PORT=%d", s.epmdPort),
			"RABBITMQ_MNESIA_BASE="+filepath.Join(s.dir, "mnesia"),
			"RABBITMQ_LOG_BASE="+filepath.Join(s.dir, "log"),
			"RABBITMQ_ENABLED_PLUGINS_FILE="+filepath.Join(s.dir, "enabled_plugins"),
			"RABBITMQ_CONFIG_FILE="+filepath.Join(s.dir, "rabbitmq"),
			"RABBITMQ_ADVANCED_CONFIG_FILE="+filepath.Join(s.dir, "advanced.config"),
			"RABBITMQ_CONF_ENV_FILE="+filepath.Join(s.dir, "rabbitmq-env.conf"),
		)
	case Redis:
		// Every write is on disk before it is acknowledged: a kill -9 loses nothing acknowledged.
		cmd = exec.Command("redis-server", "--port", fmt.Sprint(s.port), "--bind", "127.0.0.1",
			"--dir", s.dir, "--appendonly", "yes", "--appendfsync", "always", "--save", "",
			"--protected-mode", "no", "--daemonize", "no")
	case Kafka:
		cmd = exec.Command(s.bin, "-port", fmt.Sprint(s.port), "-dir", s.dir, "-partitions", fmt.Sprint(KafkaPartitions))
	}
	cmd.Dir = s.dir
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true} // one group: kill reaches the Erlang VM's children
	return cmd
}

// Start starts the server again after Kill or Stop; it returns when the server accepts connections.
func (s *Server) Start() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.cmd != nil {
		return errors.New("brokertest: already running")
	}
	if s.kind == RabbitMQ {
		if err := os.WriteFile(filepath.Join(s.dir, "enabled_plugins"), []byte("[].\n"), 0o644); err != nil {
			return err
		}
		if err := os.WriteFile(filepath.Join(s.dir, "rabbitmq.conf"), []byte("loopback_users = none\n"), 0o644); err != nil {
			return err
		}
	}
	if s.kind == Kafka {
		if err := os.Remove(filepath.Join(s.dir, "ready")); err != nil && !errors.Is(err, os.ErrNotExist) {
			return err
		}
	}
	log, err := os.OpenFile(filepath.Join(s.dir, "server.log"), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return err
	}
	cmd := s.command()
	cmd.Stdout, cmd.Stderr = log, log
	if err := cmd.Start(); err != nil {
		_ = log.Close()
		return fmt.Errorf("start %s: %w", s.kind, err)
	}
	// The reaper kills this process group if the process that started it dies.
	_ = os.WriteFile(filepath.Join(s.dir, "pgid"), []byte(fmt.Sprint(cmd.Process.Pid)), 0o644)
	exited := make(chan struct{})
	go func() { _ = cmd.Wait(); _ = log.Close(); close(exited) }()
	s.cmd, s.exited = cmd, exited
	deadline := time.Now().Add(startTimeout)
	for !s.ready() {
		select {
		case <-exited:
			s.cmd = nil
			return fmt.Errorf("%s exited while starting; its log:\n%s", s.kind, s.logTail())
		default:
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("%s not ready after %s; its log:\n%s", s.kind, startTimeout, s.logTail())
		}
		time.Sleep(100 * time.Millisecond)
	}
	return nil
}

// ready tells whether the server answers: Redis a PING, RabbitMQ the AMQP protocol header, Kafka
// once it has loaded its state (it says so in a file) and accepts connections.
func (s *Server) ready() bool {
	if s.kind == Kafka {
		if _, err := os.Stat(filepath.Join(s.dir, "ready")); err != nil {
			return false
		}
	}
	c, err := net.DialTimeout("tcp", fmt.Sprintf("127.0.0.1:%d", s.port), time.Second)
	if err != nil {
		return false
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(2 * time.Second))
	switch s.kind {
	case Redis:
		if _, err := c.Write([]byte("PING\r\n")); err != nil {
			return false
		}
		line, err := bufio.NewReader(c).ReadString('\n')
		return err == nil && strings.HasPrefix(line, "+PONG")
	case Kafka:
		return true
	default:
		if _, err := c.Write([]byte("AMQP\x00\x00\x09\x01")); err != nil {
			return false
		}
		b := make([]byte, 1)
		_, err := c.Read(b)
		return err == nil && b[0] == 1 // a Connection.Start method frame
	}
}

// Kill kills the server with SIGKILL, as a crash would, and waits until it is gone.
func (s *Server) Kill() error { return s.stop(syscall.SIGKILL) }

// Stop stops the server gracefully (SIGTERM) and waits until it is gone.
func (s *Server) Stop() error { return s.stop(syscall.SIGTERM) }

// Restart stops the server gracefully and starts it again.
func (s *Server) Restart() error {
	if err := s.Stop(); err != nil {
		return err
	}
	return s.Start()
}

func (s *Server) stop(sig syscall.Signal) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.cmd == nil {
		return nil
	}
	_ = syscall.Kill(-s.cmd.Process.Pid, sig)
	select {
	case <-s.exited:
	case <-time.After(startTimeout):
		_ = syscall.Kill(-s.cmd.Process.Pid, syscall.SIGKILL)
		<-s.exited
	}
	s.cmd = nil
	return nil
}

// Close kills the server and removes its directory.
func (s *Server) Close() {
	_ = s.Kill()
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.epmd != nil {
		_ = s.epmd.Process.Kill()
		_ = s.epmd.Wait()
		s.epmd = nil
	}
	if s.reaper != nil {
		_ = s.reaper.Process.Kill()
		_ = s.reaper.Wait()
		_ = s.pipe.Close()
		s.reaper = nil
	}
	_ = os.RemoveAll(s.dir)
}

// startReaper starts a detached shell that, once this process is gone (the pipe's write end is
// closed with it), kills whatever runs in the server's directory and removes it.
func (s *Server) startReaper() error {
	r, w, err := os.Pipe()
	if err != nil {
		return err
	}
	defer r.Close()
	script := `while read -r _; do :; done; for f in pgid epmd.pid; do [ -f "$1/$f" ] && kill -9 -- "-$(cat "$1/$f")" 2>/dev/null; done; rm -rf -- "$1"`
	cmd := exec.Command("/bin/sh", "-c", script, "brokertest-reaper", s.dir)
	cmd.Stdin = r
	cmd.Dir = "/"
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	if err := cmd.Start(); err != nil {
		_ = w.Close()
		return fmt.Errorf("start reaper: %w", err)
	}
	s.reaper, s.pipe = cmd, w
	return nil
}

func (s *Server) logTail() string {
	b, _ := os.ReadFile(filepath.Join(s.dir, "server.log"))
	lines := strings.Split(strings.TrimSpace(string(b)), "\n")
	if len(lines) > 30 {
		lines = lines[len(lines)-30:]
	}
	return strings.Join(lines, "\n")
}

func freePort() (int, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, fmt.Errorf("find a free port: %w", err)
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port, nil
}
