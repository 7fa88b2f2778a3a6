// Package pgproxy is a TCP proxy in front of a PostgreSQL server that a test takes down and
// brings back, for the tests of what the framework does while its database is unreachable (the
// gate's probes, the fault campaign's member-down scenario).
//
// While down, the proxy breaks the connections it carried and answers every new one as a server
// that is starting up does (FATAL 57P03), or, in hang mode, accepts it and answers nothing, as a
// server that stalls; every connection opened while down is counted. When it comes back, the
// connections that hung are carried on to the server: the stall ends and their handshake goes on.
package pgproxy

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"net/url"
	"strings"
	"sync"
	"sync/atomic"
	"time"
)

// Proxy stands between clients and one PostgreSQL server.
type Proxy struct {
	ln       net.Listener
	target   string
	attempts atomic.Int64 // connections opened while down

	mu     sync.Mutex
	down   bool
	hang   bool
	closed bool
	conns  map[net.Conn]struct{} // carried ones, both ends
	held   []net.Conn            // accepted while down in hang mode, not answered
	wg     sync.WaitGroup
}

// Start starts a proxy to target (host:port) on a free port of 127.0.0.1.
func Start(target string) (*Proxy, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, fmt.Errorf("pgproxy: %w", err)
	}
	p := &Proxy{ln: ln, target: target, conns: map[net.Conn]struct{}{}}
	p.wg.Add(1)
	go p.serve()
	return p, nil
}

// StartFor starts a proxy to the server of dsn, a postgres:// URL, and returns dsn rewritten to
// connect through it.
func StartFor(dsn string) (*Proxy, string, error) {
	if !strings.HasPrefix(dsn, "postgres://") && !strings.HasPrefix(dsn, "postgresql://") {
		return nil, "", errors.New("pgproxy: the DSN is not a postgres:// URL")
	}
	u, err := url.Parse(dsn)
	if err != nil {
		return nil, "", fmt.Errorf("pgproxy: %w", err)
	}
	if u.Hostname() == "" || strings.HasPrefix(u.Hostname(), "/") {
		return nil, "", errors.New("pgproxy: the DSN names no TCP host")
	}
	target := u.Host
	if u.Port() == "" {
		target = net.JoinHostPort(u.Hostname(), "5432")
	}
	p, err := Start(target)
	if err != nil {
		return nil, "", err
	}
	u.Host = p.Addr()
	return p, u.String(), nil
}

// Addr is the proxy's host:port.
func (p *Proxy) Addr() string { return p.ln.Addr().String() }

// Attempts is the number of connections opened while the proxy was down.
func (p *Proxy) Attempts() int64 { return p.attempts.Load() }

// SetHang sets how the connections opened while down are answered: not at all (true) or with
// 57P03 (false).
func (p *Proxy) SetHang(hang bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.hang = hang
}

// SetDown starts an outage (the connections carried so far break) or ends one (the connections
// that hung are carried on).
func (p *Proxy) SetDown(down bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.down = down
	if down {
		p.closeCarried()
		return
	}
	for _, c := range p.held {
		if p.closed {
			_ = c.Close()
			continue
		}
		p.wg.Add(1)
		go func() { defer p.wg.Done(); p.pipe(c) }()
	}
	p.held = nil
}

// Close stops the proxy, closes every connection and waits for its goroutines.
func (p *Proxy) Close() error {
	err := p.ln.Close()
	p.mu.Lock()
	p.closed = true
	p.closeCarried()
	for _, c := range p.held {
		_ = c.Close()
	}
	p.held = nil
	p.mu.Unlock()
	p.wg.Wait()
	return err
}

func (p *Proxy) serve() {
	defer p.wg.Done()
	for {
		c, err := p.ln.Accept()
		if err != nil {
			return
		}
		// Decided under the lock, so that a connection held now is released by the SetDown(false)
		// that follows, not left behind by one that ran meanwhile.
		p.mu.Lock()
		closed, down, hang := p.closed, p.down, p.hang
		switch {
		case closed:
			_ = c.Close()
		case down && hang:
			p.held = append(p.held, c)
		default:
			p.wg.Add(1)
		}
		p.mu.Unlock()
		if down {
			p.attempts.Add(1)
		}
		switch {
		case closed, down && hang:
		case down:
			go func() { defer p.wg.Done(); refuseStartup(c) }()
		default:
			go func() { defer p.wg.Done(); p.pipe(c) }()
		}
	}
}

// refuseStartup reads the client's startup packets and answers with PostgreSQL's FATAL 57P03.
func refuseStartup(c net.Conn) {
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(5 * time.Second))
	for {
		var hdr [8]byte
		if _, err := io.ReadFull(c, hdr[:]); err != nil {
			return
		}
		n := int(binary.BigEndian.Uint32(hdr[:4]))
		if n < 8 || n > 1<<16 {
			return
		}
		if _, err := io.CopyN(io.Discard, c, int64(n-8)); err != nil {
			return
		}
		if code := binary.BigEndian.Uint32(hdr[4:]); code == 80877103 || code == 80877104 { // SSL, GSSENC
			if _, err := c.Write([]byte{'N'}); err != nil {
				return
			}
			continue
		}
		break
	}
	var body []byte
	for _, f := range []string{"SFATAL", "VFATAL", "C57P03", "Mthe database system is starting up"} {
		body = append(append(body, f...), 0)
	}
	body = append(body, 0)
	msg := append([]byte{'E', 0, 0, 0, 0}, body...)
	binary.BigEndian.PutUint32(msg[1:], uint32(4+len(body)))
	_, _ = c.Write(msg)
}

// pipe carries c to the server until either end closes.
func (p *Proxy) pipe(c net.Conn) {
	s, err := net.DialTimeout("tcp", p.target, 5*time.Second)
	if err != nil {
		_ = c.Close()
		return
	}
	p.mu.Lock()
	if p.closed || p.down {
		// Taken down (or closed) while dialling: this connection breaks with the others.
		p.mu.Unlock()
		_ = c.Close()
		_ = s.Close()
		return
	}
	p.conns[c], p.conns[s] = struct{}{}, struct{}{}
	p.mu.Unlock()
	done := make(chan struct{}, 2)
	go func() { _, _ = io.Copy(s, c); done <- struct{}{} }()
	go func() { _, _ = io.Copy(c, s); done <- struct{}{} }()
	<-done
	_ = c.Close()
	_ = s.Close()
	<-done
	p.mu.Lock()
	delete(p.conns, c)
	delete(p.conns, s)
	p.mu.Unlock()
}

// closeCarried closes the connections carried. Called with p.mu held.
func (p *Proxy) closeCarried() {
	for c := range p.conns {
		_ = c.Close()
	}
}
