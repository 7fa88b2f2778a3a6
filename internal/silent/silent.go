// Package silent is a TCP server that accepts connections and never answers on them: a database
// that stopped answering, for the tests of what waits on one (a driver that ignores its context
// while it connects waits until the connection closes).
package silent

import (
	"net"
	"sync"
	"time"
)

// Server accepts connections on 127.0.0.1 and keeps them open, unanswered, until Close.
type Server struct {
	ln    net.Listener
	done  chan struct{}
	mu    sync.Mutex
	conns []net.Conn
	more  chan struct{} // closed and replaced at each accepted connection
	once  sync.Once
}

// Start starts a Server on a free port.
func Start() (*Server, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	s := &Server{ln: ln, done: make(chan struct{}), more: make(chan struct{})}
	go s.accept()
	return s, nil
}

func (s *Server) accept() {
	defer close(s.done)
	for {
		c, err := s.ln.Accept()
		if err != nil {
			return
		}
		s.mu.Lock()
		s.conns = append(s.conns, c)
		close(s.more)
		s.more = make(chan struct{})
		s.mu.Unlock()
	}
}

// Addr is the server's host:port.
func (s *Server) Addr() string { return s.ln.Addr().String() }

// DSN is a PostgreSQL connection string to the server (lib/pq, pgx).
func (s *Server) DSN() string { return "postgres://outbox@" + s.Addr() + "/outbox?sslmode=disable" }

// Conns is the number of connections accepted so far.
func (s *Server) Conns() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.conns)
}

// WaitConns waits until n connections were accepted, or timeout passed; it reports whether they were.
func (s *Server) WaitConns(n int, timeout time.Duration) bool {
	deadline := time.NewTimer(timeout)
	defer deadline.Stop()
	for {
		s.mu.Lock()
		got, more := len(s.conns), s.more
		s.mu.Unlock()
		if got >= n {
			return true
		}
		select {
		case <-more:
		case <-deadline.C:
			return false
		}
	}
}

// Close stops accepting and closes every connection, so that the calls waiting on them return.
// It may be called more than once.
func (s *Server) Close() error {
	var err error
	s.once.Do(func() {
		err = s.ln.Close()
		<-s.done
		s.mu.Lock()
		defer s.mu.Unlock()
		for _, c := range s.conns {
			_ = c.Close()
		}
	})
	return err
}
