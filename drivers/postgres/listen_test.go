package postgres_test

import (
	"context"
	"net"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"go.uber.org/goleak"

	"github.com/watermill-outbox/outbox"
	"github.com/watermill-outbox/outbox/drivers/postgres"
	"github.com/watermill-outbox/outbox/internal/pgtest"
	"github.com/watermill-outbox/outbox/internal/silent"
)

// TestRunReturnsWhileTheListenDSNIsUnreachable: Run returns promptly after its context is
// cancelled while the ListenDSN database refuses connections, or accepts them and never answers,
// and its listener leaves no goroutine behind.
func TestRunReturnsWhileTheListenDSNIsUnreachable(t *testing.T) {
	for _, c := range []struct {
		name   string
		server func(t *testing.T) string // returns the address
	}{
		{"closed port", func(t *testing.T) string {
			ln, err := net.Listen("tcp", "127.0.0.1:0")
			if err != nil {
				t.Fatal(err)
			}
			addr := ln.Addr().String()
			_ = ln.Close()
			return addr
		}},
		{"never answers", func(t *testing.T) string {
			srv, err := silent.Start()
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { _ = srv.Close() })
			return srv.Addr()
		}},
	} {
		t.Run(c.name, func(t *testing.T) {
			db := pgtest.DB(t)
			pub := gochannel.NewGoChannel(gochannel.Config{}, nil)
			t.Cleanup(func() { _ = pub.Close() })
			addr := c.server(t)
			ignore := goleak.IgnoreCurrent()
			ob, err := outbox.New(outbox.Config{DB: db, Publisher: pub,
				Driver: postgres.Driver{ListenDSN: "postgres://u@" + addr + "/db?sslmode=disable"}})
			if err != nil {
				t.Fatal(err)
			}
			if err := ob.Migrate(context.Background()); err != nil {
				t.Fatal(err)
			}
			ctx, cancel := context.WithCancel(context.Background())
			done := make(chan error, 1)
			go func() { done <- ob.Run(ctx) }()
			time.Sleep(500 * time.Millisecond) // the listener is trying to connect
			cancel()
			select {
			case <-done:
			case <-time.After(3 * time.Second):
				t.Fatal("Run did not return within 3s of its context's end")
			}
			if err := ob.Close(); err != nil {
				t.Fatal(err)
			}
			if err := goleak.Find(ignore); err != nil {
				t.Error(err)
			}
		})
	}
}
