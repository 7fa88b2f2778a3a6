// Command minimal shows the outbox guarantee end to end: every order is delivered twice and a
// handler fails after its write now and then, yet every business change happens exactly once and
// every follow-up message is sent and applied exactly once downstream.
//
//	go run ./examples/minimal          # starts a throwaway PostgreSQL (apt-get install postgresql)
//	OUTBOX_DSN=postgres://... go run ./examples/minimal
package main

import (
	"context"
	"database/sql"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"os"
	"os/signal"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wsql "github.com/ThreeDotsLabs/watermill-sql/v3/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	_ "github.com/lib/pq"

	"github.com/watermill-outbox/outbox"
	"github.com/watermill-outbox/outbox/drivers/postgres"
	"github.com/watermill-outbox/outbox/internal/pgserver"
	"github.com/watermill-outbox/outbox/middleware"
)

func main() {
	n := flag.Int("n", 50, "number of orders")
	verbose := flag.Bool("v", false, "log what Watermill and the outbox do")
	flag.Parse()
	// A function that returns an error, so that the deferred clean-up (server included) runs before os.Exit.
	if err := run(*n, *verbose); err != nil {
		if errors.Is(err, context.Canceled) {
			err = errors.New("interrupted")
		}
		fmt.Fprintln(os.Stderr, "error:", err)
		os.Exit(1)
	}
}

func run(n int, verbose bool) error {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	var logger watermill.LoggerAdapter = watermill.NopLogger{}
	if verbose {
		logger = watermill.NewSlogLogger(slog.Default())
	}

	dsn := os.Getenv("OUTBOX_DSN")
	if dsn == "" {
		srv, err := pgserver.Start(pgserver.Options{})
		if err != nil {
			return fmt.Errorf("start a throwaway PostgreSQL (or set OUTBOX_DSN): %w", err)
		}
		defer srv.Stop()
		dsn = srv.DSN("postgres")
		fmt.Printf("started throwaway %s at %s\n  (data in %s, removed at exit)\n", srv.Version(), dsn, srv.DataDir())
	} else {
		fmt.Println("using the database in OUTBOX_DSN")
	}
	db, err := sql.Open("postgres", dsn)
	if err != nil {
		return err
	}
	defer db.Close()
	if _, err := db.ExecContext(ctx, `
		CREATE TABLE IF NOT EXISTS stock_reservations (order_id text, reserved_at timestamptz DEFAULT now());
		CREATE TABLE IF NOT EXISTS notifications (order_id text)`); err != nil {
		return err
	}

	// The broker: watermill-sql's Postgres pub/sub. BYTEA payloads, because the default JSON column
	// rejects arbitrary bytes. The topic tables are created up front: subscribers creating them
	// concurrently race in CREATE TABLE IF NOT EXISTS.
	schema := wsql.DefaultPostgreSQLSchema{GeneratePayloadType: func(string) string { return "BYTEA" }}
	offsets := wsql.DefaultPostgreSQLOffsetsAdapter{}
	for _, topic := range []string{"orders.placed", "stock.reserved"} {
		for _, q := range append(schema.SchemaInitializingQueries(topic), offsets.SchemaInitializingQueries(topic)...) {
			if _, err := db.ExecContext(ctx, q.Query, q.Args...); err != nil {
				return fmt.Errorf("create topic tables: %w", err)
			}
		}
	}
	pub, err := wsql.NewPublisher(db, wsql.PublisherConfig{SchemaAdapter: schema}, logger)
	if err != nil {
		return err
	}
	subs := map[string]*wsql.Subscriber{} // one consumer group per handler
	for _, group := range []string{"reserve-stock", "notify"} {
		if subs[group], err = wsql.NewSubscriber(db, wsql.SubscriberConfig{
			ConsumerGroup: group, SchemaAdapter: schema, OffsetsAdapter: offsets, InitializeSchema: true,
			PollInterval: 10 * time.Millisecond, ResendInterval: 50 * time.Millisecond, // a nacked message comes back quickly
		}, logger); err != nil {
			return err
		}
	}

	ob, err := outbox.New(outbox.Config{DB: db, Driver: postgres.Driver{}, Publisher: pub, Logger: logger})
	if err != nil {
		return err
	}
	if err := ob.Migrate(ctx); err != nil {
		return err
	}

	// Order IDs are unique per run, so that an OUTBOX_DSN database reused across runs still reconciles.
	runID := uuid.NewString()[:8]
	orderID := func(i int) string { return fmt.Sprintf("%s-%03d", runID, i) }
	// Which orders fail on their first attempt: ~20%, from a fixed seed, so every run looks the same.
	rng := rand.New(rand.NewPCG(1, 2))
	var failFirst sync.Map
	for i := range n {
		if rng.IntN(100) < 20 {
			failFirst.Store(orderID(i), true)
		}
	}
	var delivered, acked, failed atomic.Int64

	router, err := message.NewRouter(message.RouterConfig{}, logger)
	if err != nil {
		return err
	}
	h := router.AddConsumerHandler("reserve-stock", "orders.placed", subs["reserve-stock"], middleware.WrapConsumer(ob, func(msg *message.Message) error {
		ctx := msg.Context()
		order := string(msg.Payload)
		// The business write goes through the message's transaction: it commits together with the
		// "processed" mark and the outgoing message, or not at all.
		if _, err := outbox.Tx(ctx).ExecContext(ctx, `INSERT INTO stock_reservations (order_id) VALUES ($1)`, order); err != nil {
			return err
		}
		if err := outbox.Publish(ctx, "stock.reserved", message.NewMessage(uuid.NewString(), msg.Payload)); err != nil {
			return err
		}
		if _, fail := failFirst.LoadAndDelete(order); fail {
			failed.Add(1)
			return errors.New("injected failure") // rolls back the insert and the recorded message; the broker redelivers
		}
		return nil
	}))
	// Outermost, so that it sees every copy, duplicates included; the outbox middleware then
	// decides whether the handler runs.
	h.AddMiddleware(func(next message.HandlerFunc) message.HandlerFunc {
		return func(msg *message.Message) ([]*message.Message, error) {
			delivered.Add(1)
			out, err := next(msg)
			if err == nil {
				acked.Add(1)
			}
			return out, err
		}
	})

	router.AddConsumerHandler("notify", "stock.reserved", subs["notify"], middleware.WrapConsumer(ob, func(msg *message.Message) error {
		ctx := msg.Context()
		_, err := outbox.Tx(ctx).ExecContext(ctx, `INSERT INTO notifications (order_id) VALUES ($1)`, string(msg.Payload))
		return err
	}))

	runCtx, cancel := context.WithCancel(ctx)
	var wg sync.WaitGroup
	wg.Add(2)
	go func() { defer wg.Done(); _ = ob.Run(runCtx) }() // the relay re-sends anything a crash left behind
	go func() {
		defer wg.Done()
		if err := router.Run(runCtx); err != nil {
			fmt.Fprintln(os.Stderr, "router:", err)
		}
	}()
	defer func() { cancel(); _ = router.Close(); wg.Wait(); _ = pub.Close() }()
	<-router.Running()

	// Every order twice with the same UUID, as a broker redelivering it would.
	for range 2 {
		for i := range n {
			id := uuid.NewSHA1(uuid.NameSpaceOID, []byte(orderID(i))).String() // one UUID per order
			if err := pub.Publish("orders.placed", message.NewMessage(id, []byte(orderID(i)))); err != nil {
				return err
			}
		}
	}

	// Wait until every copy was acked and every order notified.
	thisRun := runID + "-%"
	for deadline := time.Now().Add(2 * time.Minute); ; {
		var notified int
		err := db.QueryRowContext(ctx, `SELECT count(*) FROM notifications WHERE order_id LIKE $1`, thisRun).Scan(&notified)
		if err != nil {
			return err
		}
		if notified >= n && acked.Load() >= int64(2*n) {
			break
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("timed out: %d of %d notifications, %d of %d copies acked", notified, n, acked.Load(), 2*n)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(50 * time.Millisecond):
		}
	}

	var reservations, notifications, twice int
	if err := db.QueryRowContext(ctx, `SELECT
		(SELECT count(*) FROM stock_reservations WHERE order_id LIKE $1),
		(SELECT count(*) FROM notifications WHERE order_id LIKE $1),
		(SELECT count(*) FROM (
			SELECT order_id FROM stock_reservations WHERE order_id LIKE $1 GROUP BY order_id HAVING count(*) > 1
			UNION ALL
			SELECT order_id FROM notifications WHERE order_id LIKE $1 GROUP BY order_id HAVING count(*) > 1) d)`,
		thisRun).Scan(&reservations, &notifications, &twice); err != nil {
		return err
	}
	fmt.Printf("\n%-34s %6d\n", "orders placed", n)
	fmt.Printf("%-34s %6d  (2 per order + redeliveries)\n", "copies delivered to reserve-stock", delivered.Load())
	fmt.Printf("%-34s %6d  (rolled back, redelivered)\n", "attempts failed after their write", failed.Load())
	fmt.Printf("%-34s %6d  (want %d)\n", "reservations applied", reservations, n)
	fmt.Printf("%-34s %6d  (want %d)\n", "notifications", notifications, n)
	fmt.Printf("%-34s %6d  (want 0)\n", "applied twice", twice)
	if reservations != n || notifications != n || twice != 0 {
		return errors.New("the numbers do not reconcile")
	}
	fmt.Println("\nOK: every order applied exactly once, every follow-up message applied exactly once")
	return nil
}
