package mysqlserver

import (
	"net"
	"os"
	"testing"
	"time"
)

// TestStartStop starts a server, checks that it greets a client, and that Stop leaves nothing behind.
func TestStartStop(t *testing.T) {
	s, err := Start()
	if err != nil {
		t.Fatal(err)
	}
	if err := handshake(s.Addr); err != nil {
		t.Fatalf("greeting of the started server: %v", err)
	}
	if err := s.Stop(); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(s.base); !os.IsNotExist(err) {
		t.Fatalf("temp dir %s still there after Stop (%v)", s.base, err)
	}
	if c, err := net.DialTimeout("tcp", s.Addr, time.Second); err == nil {
		c.Close()
		t.Fatalf("server still accepts connections on %s after Stop", s.Addr)
	}
}
