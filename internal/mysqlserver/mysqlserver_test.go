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

// TestStartLeavesSharedTempDirAlone: a server removes the #sql files of its temp dir when it starts,
// and the installer's bootstrap keeps its temporary tables there. Two test binaries starting
// servers at once (go test ./... of a module with two packages of MySQL tests) must not remove
// each other's, or the other's installation fails ("Unknown table mysql.tmp_proxies_priv").
func TestStartLeavesSharedTempDirAlone(t *testing.T) {
	probe, err := os.CreateTemp("", "#sql-mysqlserver-probe-")
	if err != nil {
		t.Fatal(err)
	}
	probe.Close()
	defer os.Remove(probe.Name())
	s, err := Start()
	if err != nil {
		t.Fatal(err)
	}
	defer s.Stop()
	if _, err := os.Stat(probe.Name()); err != nil {
		t.Errorf("%s, another process's temporary file, after a server started: %v", probe.Name(), err)
	}
}
