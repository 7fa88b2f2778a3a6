package brokertest

import (
	"testing"
)

// TestKillAndRestart starts each broker, kills it, starts it again, restarts it gracefully.
func TestKillAndRestart(t *testing.T) {
	for _, kind := range []string{Redis, RabbitMQ, Kafka} {
		t.Run(kind, func(t *testing.T) {
			s, err := Start(kind)
			if err != nil {
				t.Fatal(err)
			}
			defer s.Close()
			if !s.ready() {
				t.Fatal("not ready after Start")
			}
			if err := s.Kill(); err != nil {
				t.Fatal(err)
			}
			if s.ready() {
				t.Fatal("ready after Kill")
			}
			if err := s.Start(); err != nil {
				t.Fatal(err)
			}
			if err := s.Restart(); err != nil {
				t.Fatal(err)
			}
			if !s.ready() {
				t.Fatal("not ready after Restart")
			}
		})
	}
}
