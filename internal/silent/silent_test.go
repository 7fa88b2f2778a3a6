package silent

import (
	"io"
	"net"
	"testing"
	"time"

	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// A connection is accepted, counted and never answered; Close ends it, so that a read returns.
func TestAcceptsAndNeverAnswers(t *testing.T) {
	s, err := Start()
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	c, err := net.Dial("tcp", s.Addr())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if !s.WaitConns(1, 5*time.Second) {
		t.Fatal("the connection was not accepted")
	}
	if s.WaitConns(2, 50*time.Millisecond) {
		t.Fatalf("WaitConns(2) true with %d connections", s.Conns())
	}
	if _, err := c.Write([]byte("hello")); err != nil {
		t.Fatal(err)
	}
	_ = c.SetReadDeadline(time.Now().Add(100 * time.Millisecond))
	if n, err := c.Read(make([]byte, 1)); n != 0 || !isTimeout(err) {
		t.Fatalf("read = %d, %v: want nothing until the deadline", n, err)
	}
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	_ = s.Close() // again: no effect
	_ = c.SetReadDeadline(time.Now().Add(5 * time.Second))
	if _, err := c.Read(make([]byte, 1)); err != io.EOF && !isReset(err) {
		t.Fatalf("read after Close = %v, want the connection closed", err)
	}
}

func isTimeout(err error) bool {
	ne, ok := err.(net.Error)
	return ok && ne.Timeout()
}

func isReset(err error) bool { return err != nil && !isTimeout(err) }
