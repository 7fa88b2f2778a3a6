// Command order-processing is an example order service on watermill-outbox: an HTTP API that places
// orders, and consumers that reserve stock, take the payment, e-mail a receipt and track each
// order's status, every step exactly once through crashes, redeliveries and duplicates.
//
//	go run .                       # SQLite + in-process NATS JetStream
//	go run . -mysql 'app:secret@tcp(localhost:3306)/orders'   # MySQL or MariaDB
//	go run . -chaos -orders 1000   # load, faults, and a reconciliation
//
// See README.md for a walk through the code and a run.
package main

import (
	"context"
	"database/sql"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/url"
	"os"
	"os/signal"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgxpool"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"

	"github.com/watermill-outbox/outbox"
	"github.com/watermill-outbox/outbox/drivers/postgres"
	"github.com/watermill-outbox/outbox/middleware"
	"github.com/watermill-outbox/outbox/outboxdriver"
	"github.com/watermill-outbox/outbox/tenant"
)

// config is what the flags and environment variables set.
type config struct {
	addr     string // HTTP listen address
	dataDir  string // SQLite file, embedded NATS storage, e-mail spool
	postgres string // PostgreSQL DSN; empty: SQLite in dataDir (or MySQL)
	mysql    string // MySQL or MariaDB DSN (go-sql-driver/mysql's form); empty: SQLite in dataDir (or PostgreSQL)
	form     string // "sql" (database/sql) or "pgx" (pgxpool and drivers/outboxpgx; PostgreSQL only)
	// consolePassword is the web console's password for user "operator"; empty: a random one.
	consolePassword string
	broker          string // "nats", "postgres" (watermill-sql on the PostgreSQL database), "amqp", "redis" or "kafka"
	natsURL         string // an external NATS server; empty: an in-process one
	amqpURL         string // the RabbitMQ server of -broker amqp
	redis           string // the Redis server (host:port) of -broker redis
	kafkaBrokers    string // the Kafka bootstrap servers (host:port,...) of -broker kafka
	verbose         bool
	// afterDispatchFailure is outbox.Config.AfterDispatchFailure: "nack" (the default) or "ack".
	afterDispatchFailure string
	// relayMaxAttempts is outbox.Config.RelayMaxAttempts; 0: the default (10).
	relayMaxAttempts int

	// tenants, from -tenants: a database per tenant and one tenant.Set over their Outboxes
	// (tenants.go); empty: one database.
	tenants []string

	// paymentTimeout is how long a reserved order waits for its payment; 0: the default.
	paymentTimeout time.Duration

	chaos bool
	chaosConfig
}

func main() {
	cfg, err := parseFlags(os.Args[1:])
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(2)
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if cfg.chaos {
		var rep *chaosReport
		if rep, err = runChaos(ctx, cfg, os.Stdout); err == nil && !rep.ok() {
			err = errors.New("the numbers do not reconcile")
		}
	} else {
		err = serve(ctx, cfg, os.Stdout, nil)
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "error:", errorText(err, cfg))
		stop()
		os.Exit(1)
	}
}

// errorText is err for printing, without the passwords of the connection strings it may carry
// (lib/pq puts the whole URL in a parse error).
func errorText(err error, cfg config) string {
	text := err.Error()
	for _, dsn := range []string{cfg.postgres, cfg.amqpURL, cfg.redis, cfg.natsURL} {
		if dsn != "" {
			text = postgres.RedactDSN(text, dsn)
		}
	}
	if cfg.mysql != "" {
		text = redactMySQLDSN(text, cfg.mysql)
	}
	return text
}

func parseFlags(args []string) (config, error) {
	env := func(key, def string) string {
		if v := os.Getenv(key); v != "" {
			return v
		}
		return def
	}
	var cfg config
	fs := flag.NewFlagSet("order-processing", flag.ContinueOnError)
	fs.StringVar(&cfg.addr, "addr", env("ORDERS_ADDR", "localhost:8080"), "HTTP listen address (ORDERS_ADDR)")
	fs.StringVar(&cfg.dataDir, "data", env("ORDERS_DATA", filepath.Join(os.TempDir(), "order-processing")),
		"directory for the SQLite database, the embedded NATS server's storage and the e-mail spool (ORDERS_DATA)")
	fs.StringVar(&cfg.postgres, "postgres", env("ORDERS_POSTGRES", ""), "PostgreSQL DSN; empty: SQLite (ORDERS_POSTGRES)")
	fs.StringVar(&cfg.mysql, "mysql", env("ORDERS_MYSQL", ""),
		"MySQL or MariaDB DSN, user:password@tcp(host:3306)/database (go-sql-driver/mysql); empty: SQLite (ORDERS_MYSQL)")
	fs.StringVar(&cfg.form, "form", env("ORDERS_FORM", formSQL),
		"the framework's form: sql (database/sql: lib/pq, go-sql-driver/mysql, or SQLite) or pgx (a pgxpool and drivers/outboxpgx; needs -postgres) (ORDERS_FORM)")
	fs.StringVar(&cfg.broker, "broker", env("ORDERS_BROKER", "nats"),
		"nats (embedded, or -nats-url), postgres (watermill-sql pub/sub on the -postgres database), amqp (RabbitMQ at -amqp-url), redis (Redis Streams at -redis) or kafka (at -kafka-brokers) (ORDERS_BROKER)")
	fs.StringVar(&cfg.natsURL, "nats-url", env("ORDERS_NATS_URL", ""), "external NATS server with JetStream; empty: in-process (ORDERS_NATS_URL)")
	fs.StringVar(&cfg.amqpURL, "amqp-url", env("ORDERS_AMQP_URL", "amqp://guest:guest@localhost:5672/"), "RabbitMQ server of -broker amqp (ORDERS_AMQP_URL)")
	fs.StringVar(&cfg.redis, "redis", env("ORDERS_REDIS", "localhost:6379"), "Redis server (host:port) of -broker redis (ORDERS_REDIS)")
	fs.StringVar(&cfg.kafkaBrokers, "kafka-brokers", env("ORDERS_KAFKA_BROKERS", "localhost:9092"), "Kafka bootstrap servers (host:port, comma-separated) of -broker kafka (ORDERS_KAFKA_BROKERS)")
	fs.BoolVar(&cfg.verbose, "v", false, "log what Watermill and the outbox do")
	fs.StringVar(&cfg.consolePassword, "console-password", env("ORDERS_CONSOLE_PASSWORD", ""),
		"password of user operator for the web console at /outbox/ (PostgreSQL or MySQL); empty: a random one, printed at start (ORDERS_CONSOLE_PASSWORD)")

	fs.StringVar(&cfg.afterDispatchFailure, "after-dispatch-failure", env("ORDERS_AFTER_DISPATCH_FAILURE", string(outbox.DispatchFailureNack)),
		"when a message's events cannot all be sent after its commit: nack (redeliver it; its redelivery sends them) or ack (leave them to the relay) (ORDERS_AFTER_DISPATCH_FAILURE)")
	fs.IntVar(&cfg.relayMaxAttempts, "relay-max-attempts", 0, "failed dispatches of one event, while the broker takes others, that park it (0: the outbox default, 10)")

	fs.DurationVar(&cfg.paymentTimeout, "payment-timeout", 0, fmt.Sprintf(
		"how long a reserved order waits for its payment before it is cancelled and its stock released (0: %s, %s with -chaos)",
		defaultPaymentWindow, defaultChaosPaymentWindow))

	tenants := fs.String("tenants", env("ORDERS_TENANTS", ""),
		"comma-separated tenant names, e.g. acme,globex: a database per tenant (SQLite or PostgreSQL), picked per request by the X-Tenant header; empty: one database (ORDERS_TENANTS)")

	fs.BoolVar(&cfg.chaos, "chaos", false, "run the load-and-chaos check instead of serving")
	fs.IntVar(&cfg.orders, "orders", 1000, "chaos: orders to place")
	fs.IntVar(&cfg.malformed, "malformed", 3, "chaos: undecodable messages sent to the orders topic, ahead of and among the orders; each must become a dead letter")
	fs.IntVar(&cfg.clients, "clients", 8, "chaos: concurrent HTTP clients")
	fs.Float64Var(&cfg.dupRate, "dup-rate", 0.1, "chaos: share of messages the broker delivers twice")
	fs.Float64Var(&cfg.failRate, "fail-rate", 0.1, "chaos: share of handler runs that fail after their writes")
	fs.Float64Var(&cfg.crashRate, "crash-rate", 0.02, "chaos: chance that a consumer crashes at each step of a message")
	fs.DurationVar(&cfg.restartEvery, "restart-every", 3*time.Second, "chaos: mean time between abrupt consumer restarts (0: none)")
	fs.Uint64Var(&cfg.seed, "seed", 1, "chaos: random seed")
	fs.DurationVar(&cfg.timeout, "timeout", 5*time.Minute, "chaos: how long orders may take to reach a final state")
	fs.StringVar(&cfg.chaosConfig.addr, "chaos-addr", "127.0.0.1:0", "chaos: listen address of the API and GET /metrics (port 0: a free one, printed at start)")
	fs.DurationVar(&cfg.linger, "linger", 0, "chaos: keep serving /metrics this long after the report, for a last scrape (negative: until interrupted)")
	fs.StringVar(&cfg.fault, "fault", "", "chaos: a fault to inject during the linger, while an order a second is placed: "+strings.Join(faults, ", "))
	fs.DurationVar(&cfg.faultAfter, "fault-after", time.Minute, "chaos: when the -fault is injected, from the start of the linger")
	if err := fs.Parse(args); err != nil {
		return cfg, err
	}
	var err error
	if cfg.tenants, err = parseTenants(*tenants); err != nil {
		return cfg, err
	}
	if err := checkTenants(cfg); err != nil {
		return cfg, err
	}
	switch {
	case !slices.Contains([]string{"nats", "postgres", "amqp", "redis", "kafka"}, cfg.broker):
		return cfg, fmt.Errorf("-broker must be nats, postgres, amqp, redis or kafka, not %q", cfg.broker)
	case cfg.postgres != "" && cfg.mysql != "":
		return cfg, errors.New("-postgres and -mysql name two databases: give one")
	case cfg.form != formSQL && cfg.form != formPgx:
		return cfg, fmt.Errorf("-form must be sql or pgx, not %q", cfg.form)
	case cfg.form == formPgx && cfg.postgres == "":
		return cfg, errors.New("-form pgx needs -postgres DSN")
	case cfg.broker == "postgres" && cfg.postgres == "":
		return cfg, errors.New("-broker postgres needs -postgres DSN")
	case cfg.fault != "" && !slices.Contains(faults, cfg.fault):
		return cfg, fmt.Errorf("-fault must be one of %s, not %q", strings.Join(faults, ", "), cfg.fault)
	case cfg.fault != "" && cfg.linger == 0:
		return cfg, errors.New("-fault is injected during the -linger")
	case cfg.broker != "nats" && cfg.natsURL != "":
		return cfg, errors.New("-nats-url is for -broker nats")
	case cfg.afterDispatchFailure != string(outbox.DispatchFailureNack) && cfg.afterDispatchFailure != string(outbox.DispatchFailureAck):
		return cfg, fmt.Errorf("-after-dispatch-failure must be nack or ack, not %q", cfg.afterDispatchFailure)
	case cfg.malformed < 0:
		return cfg, fmt.Errorf("-malformed must not be negative, not %d", cfg.malformed)
	case cfg.relayMaxAttempts < 0:
		return cfg, fmt.Errorf("-relay-max-attempts must not be negative, not %d", cfg.relayMaxAttempts)
	}
	return cfg, nil
}

// consumer is one message handler of the service. Its name is the Router handler name, the
// identity under which the outbox deduplicates its messages, and its durable consumer (NATS),
// consumer group (watermill-sql, Redis, Kafka) or queue (RabbitMQ) on the broker. Renaming one starts it over.
type consumer struct {
	name, topic string
	handle      message.NoPublishHandlerFunc
}

var consumers = []consumer{
	{"inventory", topicOrderPlaced, reserveStock},
	{"payment", topicStockReserved, capturePayment},
	{"order-status-reserved", topicStockReserved, markReserved},
	{"order-status-rejected", topicStockRejected, markRejected},
	{"order-status-paid", topicPaymentCaptured, markPaid},
	{"inventory-release", topicPaymentTimedOut, releaseStock},
	{"order-status-cancelled", topicPaymentTimedOut, markCancelled},
}

// service holds what the API and the consumers share.
type service struct {
	db     *sql.DB
	pool   *pgxpool.Pool // the pgx form's pool (db is a database/sql handle on it); nil: database/sql
	driver outboxdriver.Driver
	broker broker
	mail   *mailer
	logger watermill.LoggerAdapter
	desc   string // where the data lives, for the start-up banner

	// meters receives the metrics of every Outbox of the service; metrics serves them (GET /metrics).
	meters  *sdkmetric.MeterProvider
	metrics http.Handler

	// afterDispatchFailure and relayMaxAttempts come from the flags of the same names.
	afterDispatchFailure outbox.DispatchFailurePolicy
	relayMaxAttempts     int

	// tenantDBs and set, with -tenants: the members' databases and their Set (tenants.go). db is
	// then the database of the -postgres DSN, or nil on SQLite, and holds no orders.
	tenantDBs []tenantDB
	set       *tenant.Set

	// tune, when set, adjusts every outbox configuration (the chaos mode injects faults with it).
	tune func(*outbox.Config)
}

// openService opens the database (and creates the business tables), the broker and the e-mail spool.
func openService(ctx context.Context, cfg config, ackWait time.Duration) (_ *service, err error) {
	if err := os.MkdirAll(cfg.dataDir, 0o755); err != nil {
		return nil, err
	}
	setPaymentWindow(cfg)
	s := &service{mail: &mailer{dir: filepath.Join(cfg.dataDir, "mail")}, logger: watermill.NopLogger{},
		afterDispatchFailure: outbox.DispatchFailurePolicy(cfg.afterDispatchFailure), relayMaxAttempts: cfg.relayMaxAttempts}
	// Watermill and the outbox log errors (a failed handler, a failed send) to stderr; -v adds
	// what they do. The chaos mode fails on purpose all the time: it logs only with -v.
	level := slog.LevelError
	if cfg.verbose {
		level = slog.LevelDebug
	}
	if cfg.verbose || !cfg.chaos {
		s.logger = watermill.NewSlogLogger(slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: level})))
	}
	if err := os.MkdirAll(s.mail.dir, 0o755); err != nil {
		return nil, err
	}
	if s.meters, s.metrics, err = newMetrics(); err != nil {
		return nil, err
	}
	var dbDesc string
	if len(cfg.tenants) > 0 {
		// A database per tenant, each with the business tables (tenants.go).
		if dbDesc, err = s.openTenants(ctx, cfg); err != nil {
			s.close()
			return nil, err
		}
	} else if s.db, s.pool, s.driver, dbDesc, err = openDatabase(ctx, cfg); err != nil {
		_ = s.meters.Shutdown(context.Background())
		return nil, err
	}
	defer func() {
		if err != nil {
			s.close()
		}
	}()
	if len(cfg.tenants) == 0 {
		if err := createSchema(ctx, s.db, s.driver); err != nil {
			return nil, err
		}
	}
	brokerDesc := "embedded NATS JetStream in " + filepath.Join(cfg.dataDir, "nats")
	switch {
	case cfg.broker == "postgres":
		s.broker, err = startSQLBroker(ctx, s.db, s.logger)
		brokerDesc = "watermill-sql pub/sub on PostgreSQL"
	case cfg.broker == "amqp":
		s.broker, err = startAMQP(cfg.amqpURL, s.logger)
		brokerDesc = "RabbitMQ at " + redactURL(cfg.amqpURL)
	case cfg.broker == "redis":
		s.broker, err = startRedis(ctx, cfg.redis, ackWait, s.logger)
		brokerDesc = "Redis Streams at " + cfg.redis
	case cfg.broker == "kafka":
		s.broker, err = startKafka(strings.Split(cfg.kafkaBrokers, ","), s.logger)
		brokerDesc = "Kafka at " + cfg.kafkaBrokers
	case cfg.natsURL != "":
		s.broker, err = startNATS(cfg.dataDir, cfg.natsURL, ackWait, s.logger)
		brokerDesc = "NATS JetStream at " + cfg.natsURL
	default:
		s.broker, err = startNATS(cfg.dataDir, "", ackWait, s.logger)
	}
	if err != nil {
		return nil, err
	}
	s.desc = fmt.Sprintf("database: %s\nbroker:   %s\ne-mails:  %s", dbDesc, brokerDesc, s.mail.dir)
	return s, nil
}

func (s *service) close() {
	if s.broker != nil {
		_ = s.broker.Close()
	}
	if s.db != nil {
		_ = s.db.Close()
	}
	for _, t := range s.tenantDBs {
		_ = t.db.Close()
	}
	if s.pool != nil {
		s.pool.Close()
	}
	_ = s.meters.Shutdown(context.Background())
}

// newOutbox returns an Outbox with its own publisher and the receipt applier registered. Closing
// the publisher closes the Outbox too (form.go): do it after the Outbox's last use. Every Outbox
// needs every applier: its relay may be the one that sends a receipt another instance recorded.
func (s *service) newOutbox(tune ...func(*outbox.Config)) (*outbox.Outbox, message.Publisher, error) {
	pub, err := s.broker.Publisher()
	if err != nil {
		return nil, nil, err
	}
	cfg := outbox.Config{
		DB: s.db, Driver: s.driver, Publisher: pub, Logger: s.logger,
		MeterProvider: s.meters, // GET /metrics serves what it records
		// With ordering keys, an event whose predecessor (same key) was published but not yet
		// marked as sent is left to the relay, which sends it at its next round. A consumer is
		// often that fast, so poll every 100 ms rather than every second (the default).
		RelayInterval: 100 * time.Millisecond,

		AfterDispatchFailure: s.afterDispatchFailure,
		RelayMaxAttempts:     s.relayMaxAttempts,
	}
	for _, t := range append([]func(*outbox.Config){s.tune}, tune...) {
		if t != nil {
			t(&cfg)
		}
	}
	ob, err := s.newOutboxOn(cfg)
	if err != nil {
		_ = pub.Close()
		return nil, nil, err
	}
	closer := &outboxPublisher{Publisher: pub, ob: ob}
	if err := ob.RegisterApplier(applierReceipt, s.mail.sendReceipt); err != nil {
		_ = closer.Close()
		return nil, nil, err
	}
	return ob, closer, nil
}

// startConsumers runs every consumer on a new Router until stop is called. Each handler
// is wrapped in the outbox middleware (of ob, or with -tenants of s.set, which runs each message
// on its tenant's member): its writes, the claim "this consumer processed this
// message" and the events it publishes commit in one transaction, and a redelivered copy skips the
// handler. wrap, when set, decorates the handlers and adds outer middleware (the chaos mode).
// running reports whether the Router still runs, for the readiness probe: the outbox's own checks
// cannot see consumers that stopped.
func startConsumers(ctx context.Context, s *service, ob *outbox.Outbox, wrap *chaos) (stop func() error, running func(context.Context) error, err error) {
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 30 * time.Second}, s.logger)
	if err != nil {
		return nil, nil, err
	}
	var subs []message.Subscriber
	for _, c := range consumers {
		sub, err := s.broker.Subscriber(c.name)
		if err != nil {
			_ = router.Close() // closes the subscribers added so far
			return nil, nil, fmt.Errorf("subscriber %s: %w", c.name, err)
		}
		handle := c.handle
		if wrap != nil {
			handle = wrap.handler(handle) // the injected faults run inside the unit of work
		}
		// WrapConsumer: the unit of work around the handler function itself, innermost whatever
		// middleware the Router gets.
		var wrapped message.NoPublishHandlerFunc
		if s.set != nil {
			// -tenants: the Set runs each message on the member its metadata names.
			wrapped = s.set.WrapConsumer(handle)
		} else {
			wrapped = middleware.WrapConsumer(ob, handle)
		}
		h := router.AddConsumerHandler(c.name, c.topic, sub, wrapped)
		if wrap != nil {
			h.AddMiddleware(wrap.countDeliveries)
		}
		subs = append(subs, sub)
	}
	// The Router stops only through stop, not when ctx ends: the subscribers must drain first.
	done := make(chan error, 1)
	go func() { done <- router.Run(context.WithoutCancel(ctx)) }()
	select {
	case <-router.Running():
	case err := <-done:
		return nil, nil, fmt.Errorf("router stopped at start: %w", errors.Join(err, router.Close()))
	}
	running = func(context.Context) error {
		if router.IsClosed() || !router.IsRunning() {
			return errors.New("the consumers' Router is not running")
		}
		return nil
	}
	return func() error {
		// watermill-nats closes a subscription's output channel without waiting for a message
		// callback still running, which then panics ("send on closed channel") when a Router stops
		// while messages flow. Draining the NATS connections first lets those callbacks finish.
		for _, sub := range subs {
			if d, ok := sub.(interface{ Drain() }); ok {
				d.Drain()
			}
		}
		err := router.Close()
		return errors.Join(err, <-done)
	}, running, nil
}

// serve runs the service until ctx ends. ready, when set, receives the HTTP address once it listens.
func serve(ctx context.Context, cfg config, out io.Writer, ready func(addr string)) error {
	if len(cfg.tenants) > 0 {
		return serveTenants(ctx, cfg, out, ready)
	}
	s, err := openService(ctx, cfg, 30*time.Second)
	if err != nil {
		return err
	}
	defer s.close()

	// One Outbox for the API and the consumers, as one process of a real deployment would have.
	ob, pub, err := s.newOutbox()
	if err != nil {
		return err
	}
	defer func() { _ = pub.Close() }()
	if err := ob.Migrate(ctx); err != nil { // idempotent; safe from several instances at once
		return err
	}
	feats, err := probeFeatures(ctx, ob)
	if err != nil {
		return err
	}

	runCtx, cancel := context.WithCancel(ctx)
	var wg sync.WaitGroup
	wg.Add(1)
	go func() { defer wg.Done(); _ = ob.Run(runCtx) }() // the relay and the retention cleanup
	defer func() { cancel(); wg.Wait() }()

	stopConsumers, consumersRunning, err := startConsumers(runCtx, s, ob, nil)
	if err != nil {
		return err
	}
	defer func() { _ = stopConsumers() }()

	ln, err := net.Listen("tcp", cfg.addr)
	if err != nil {
		return err
	}
	// The probe shows healthy or not, and nothing else, to whoever can reach it: the reasons
	// (database, relay, consumers) are in Outbox.Health and the logs.
	health := ob.HealthHandlerWith(outbox.HealthHandlerOptions{Extra: map[string]func(context.Context) error{"consumers": consumersRunning}})
	a := &api{db: s.db, ob: ob, metrics: s.metrics, health: health}
	consoleNote, err := a.mountConsole(cfg)
	if err != nil {
		return err
	}
	srv := &http.Server{Handler: a.routes(), ReadHeaderTimeout: 10 * time.Second}
	served := make(chan error, 1)
	go func() { served <- srv.Serve(ln) }()

	addr := ln.Addr().String()
	fmt.Fprintf(out, "order-processing listening on http://%s\n%s\n\n", addr, s.desc)
	fmt.Fprintf(out, "Place an order:\n  curl -si http://%s/orders -d '{\"customer\":\"ada@example.com\",\"sku\":\"espresso-beans\",\"quantity\":2}'\n", addr)
	fmt.Fprintf(out, "Then look at it (it ends as \"paid\"):\n  curl -s http://%s/orders/<id>\n", addr)
	if feats.keys {
		fmt.Fprintf(out, "Send it twice with one Idempotency-Key (one order; the second answer is the first, replayed):\n"+
			"  curl -si http://%s/orders -H 'Idempotency-Key: order-42' -d '{\"customer\":\"ada@example.com\",\"sku\":\"espresso-beans\",\"quantity\":2}'\n", addr)
	}
	fmt.Fprint(out, feats.notes())
	fmt.Fprintf(out, "Metrics (Prometheus):\n  curl -s http://%s/metrics | grep ^outbox_\n", addr)
	fmt.Fprintf(out, "Readiness probe (200 or 503):\n  curl -s http://%s/healthz\n", addr)
	fmt.Fprintf(out, "Web console:\n  %s\n\nCtrl-C stops.\n\n", strings.ReplaceAll(consoleNote, "ADDR", addr))
	// From here on only the progress printer writes to out.
	wg.Add(1)
	go func() { defer wg.Done(); printProgress(runCtx, out, s.db, ob) }()
	if ready != nil {
		ready(addr)
	}

	return serveUntil(ctx, srv, served)
}

// redactURL hides the password of a URL for printing.
func redactURL(s string) string {
	u, err := url.Parse(s)
	if err != nil {
		return "(unparsable URL)"
	}
	return u.Redacted()
}

// serveUntil waits until ctx ends or the server fails (served), and then shuts the server down.
func serveUntil(ctx context.Context, srv *http.Server, served chan error) error {
	select {
	case <-ctx.Done():
	case err := <-served:
		return err
	}
	shutdownCtx, done := context.WithTimeout(context.Background(), 10*time.Second)
	defer done()
	err := srv.Shutdown(shutdownCtx)
	<-served
	return err
}
