package e2e

import (
	"bytes"
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"os/signal"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	amqp "github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill-redisstream/pkg/redisstream"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"
	_ "github.com/lib/pq"
	"github.com/redis/go-redis/v9"

	"github.com/watermill-outbox/outbox"
	"github.com/watermill-outbox/outbox/drivers/outboxpgx"
	"github.com/watermill-outbox/outbox/drivers/postgres"
	"github.com/watermill-outbox/outbox/internal/brokertest"
	"github.com/watermill-outbox/outbox/internal/pgtest"
	"github.com/watermill-outbox/outbox/internal/routertest"
	"github.com/watermill-outbox/outbox/middleware"
)

// The test binary is also the consumer process: with OUTBOX_E2E_ROLE=consumer it runs one
// instance of the consumer "reserve-stock" until it is stopped or killed.
func TestMain(m *testing.M) {
	if os.Getenv("OUTBOX_E2E_ROLE") == "consumer" {
		os.Exit(runConsumer())
	}
	os.Exit(pgtest.Run(m))
}

const (
	ordersTopic = "orders"
	stockTopic  = "stock"
	consumer    = "reserve-stock"
)

// broker makes the Publishers and Subscribers of one kind of broker, with the settings the
// guarantee needs (see docs/brokers.md).
type broker struct {
	kind string
	addr string
}

func (b broker) amqpConfig() amqp.Config {
	c := amqp.NewDurableQueueConfig(b.addr)
	// Publisher confirms: Publish returns once the broker has the message (on disk, for a durable
	// queue and a persistent message). Without them a broker crash loses what the outbox marked sent.
	c.Publish.ConfirmDelivery = true
	c.Connection.Reconnect = &amqp.ReconnectConfig{BackoffInitialInterval: 100 * time.Millisecond,
		BackoffRandomizationFactor: 0.5, BackoffMultiplier: 1.5, BackoffMaxInterval: time.Second}
	c.Consume.Qos.PrefetchCount = 8
	return c
}

func (b broker) redisClient() *redis.Client {
	return redis.NewClient(&redis.Options{Addr: b.addr, MaxRetries: 3})
}

func (b broker) publisher() (message.Publisher, func(), error) {
	switch b.kind {
	case brokertest.Kafka:
		return b.kafkaPublisher()
	case brokertest.RabbitMQ:
		p, err := amqp.NewPublisher(b.amqpConfig(), watermill.NopLogger{})
		if err != nil {
			return nil, nil, err
		}
		return p, func() { _ = p.Close() }, nil
	default:
		c := b.redisClient()
		p, err := redisstream.NewPublisher(redisstream.PublisherConfig{Client: c}, watermill.NopLogger{})
		if err != nil {
			return nil, nil, err
		}
		return p, func() { _ = p.Close(); _ = c.Close() }, nil
	}
}

// subscriber returns a Subscriber of group (RabbitMQ: the topic's queue, which the group's
// subscribers share; Redis and Kafka: a consumer group); name tells its members apart.
func (b broker) subscriber(group, name string) (message.Subscriber, func(), error) {
	switch b.kind {
	case brokertest.Kafka:
		return b.kafkaSubscriber(group)
	case brokertest.RabbitMQ:
		s, err := amqp.NewSubscriber(b.amqpConfig(), watermill.NopLogger{})
		if err != nil {
			return nil, nil, err
		}
		return s, func() { _ = s.Close() }, nil
	default:
		c := b.redisClient()
		s, err := redisstream.NewSubscriber(redisstream.SubscriberConfig{
			Client: c, ConsumerGroup: group, Consumer: name,
			// A nack comes back at once without it: the outbox's RetryDelay spaces them anyway.
			NackResendSleep: 100 * time.Millisecond,
			// A killed consumer's pending message goes to another one after MaxIdleTime.
			ClaimInterval: 500 * time.Millisecond, MaxIdleTime: 3 * time.Second,
			BlockTime: 200 * time.Millisecond,
		}, watermill.NopLogger{})
		if err != nil {
			return nil, nil, err
		}
		return s, func() { _ = s.Close(); _ = c.Close() }, nil
	}
}

// runConsumer is one consumer process: a Router whose handler "reserve-stock" applies an order
// once (a row in reserved) and records one outgoing message to the stock topic.
func runConsumer() int {
	b := broker{kind: os.Getenv("OUTBOX_E2E_BROKER"), addr: os.Getenv("OUTBOX_E2E_ADDR")}
	instance := os.Getenv("OUTBOX_E2E_INSTANCE")
	fail := func(err error) int {
		fmt.Fprintf(os.Stderr, "consumer %s: %v\n", instance, err)
		return 1
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, os.Interrupt)
	defer stop()
	db, err := sql.Open("postgres", os.Getenv("OUTBOX_E2E_DSN"))
	if err != nil {
		return fail(err)
	}
	defer db.Close()
	pub, closePub, err := b.publisher()
	if err != nil {
		return fail(err)
	}
	defer closePub()
	logger := watermill.NewStdLogger(false, false)
	cfg := outbox.Config{Publisher: pub, Logger: logger,
		RelayInterval: 200 * time.Millisecond, RelayGrace: 2 * time.Second, PublishTimeout: 5 * time.Second,
		RetryDelay: 50 * time.Millisecond, RetryDelayMax: time.Second}
	// The control of the poison messages: with OUTBOX_E2E_DEAD_LETTERS=off the run must fail.
	cfg.DeadLetters = outbox.DeadLetterPolicy(os.Getenv("OUTBOX_E2E_DEAD_LETTERS"))
	// One Router per form, on the same tables and the same consumer group: copies of one order
	// meet across forms and modes.
	var ob *outbox.Outbox
	form := forms[instance]
	var write func(ctx context.Context, query string, args ...any) error
	switch form {
	case formSQL:
		cfg.DB, cfg.Driver = db, postgres.Driver{}
		ob, err = outbox.New(cfg)
		write = func(ctx context.Context, query string, args ...any) error {
			_, err := outbox.Tx(ctx).ExecContext(ctx, query, args...)
			return err
		}
	default:
		pool, perr := pgxpool.New(ctx, os.Getenv("OUTBOX_E2E_DSN"))
		if perr != nil {
			return fail(perr)
		}
		defer pool.Close()
		mode := outboxpgx.Optimistic
		if form == formPgxPessimistic {
			mode = outboxpgx.Pessimistic
		}
		ob, err = outboxpgx.New(pool, cfg, outboxpgx.WithConcurrency(mode))
		write = func(ctx context.Context, query string, args ...any) error {
			_, err := outboxpgx.Tx(ctx).Exec(ctx, query, args...)
			return err
		}
	}
	if err != nil {
		return fail(err)
	}
	defer ob.Close()
	runDone := make(chan struct{})
	runCtx, stopRun := context.WithCancel(context.Background())
	go func() { defer close(runDone); _ = ob.Run(runCtx) }()
	defer func() { stopRun(); <-runDone }()
	sub, closeSub, err := b.subscriber(consumer, instance)
	if err != nil {
		return fail(err)
	}
	defer closeSub()
	r, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, watermill.NopLogger{})
	if err != nil {
		return fail(err)
	}
	r.AddConsumerHandler(consumer, ordersTopic, sub, func(msg *message.Message) error {
		ctx := msg.Context()
		var o order
		if err := json.Unmarshal(msg.Payload, &o); err != nil {
			// No attempt can decode it: dead-lettered at once, without running MaxAttempts times.
			return outbox.Permanent(fmt.Errorf("decode order %s: %w", msg.UUID, err))
		}
		if err := write(ctx, `INSERT INTO reserved (order_id, instance) VALUES ($1, $2)`, msg.UUID, instance); err != nil {
			return err
		}
		if o.SKU == unknownSKU {
			// Written, then refused with an error the handler does not know to be permanent: the
			// write is rolled back every time, and the message dead-lettered after MaxAttempts.
			return fmt.Errorf("order %s: %w", msg.UUID, errUnknownSKU)
		}
		return outbox.Publish(ctx, stockTopic, message.NewMessage(uuid.NewString(), []byte(msg.UUID)))
	}).AddMiddleware(middleware.New(ob))
	if err := middleware.CheckRouter(r); err != nil {
		return fail(err)
	}
	if err := r.Run(ctx); err != nil {
		return fail(err)
	}
	return 0
}

// order is the payload of an order message; Key is its ordering key (on Kafka, its partition).
type order struct {
	Key string `json:"key"`
	SKU string `json:"sku"`
}

// unknownSKU is the SKU of the orders the handler refuses every time.
const unknownSKU = "no-such-sku"

var errUnknownSKU = errors.New("no such SKU " + unknownSKU)

// The forms of the framework the three consumer processes run: c1, the one the test kills with
// SIGKILL, runs the pgx form whose effects are inline in the claim.
const (
	formSQL            = "database/sql"
	formPgx            = "pgx (optimistic)"
	formPgxPessimistic = "pgx (pessimistic)"
)

var forms = map[string]string{"c0": formSQL, "c1": formPgx, "c2": formPgxPessimistic}

// consumerProcess is one consumer process started by the test.
type consumerProcess struct {
	cmd  *exec.Cmd
	done chan error
}

func startConsumer(t *testing.T, b broker, dsn, instance string) *consumerProcess {
	t.Helper()
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(exe, "-test.run=^$")
	cmd.Env = append(os.Environ(), "OUTBOX_E2E_ROLE=consumer", "OUTBOX_E2E_BROKER="+b.kind, "OUTBOX_E2E_ADDR="+b.addr,
		"OUTBOX_E2E_DSN="+dsn, "OUTBOX_E2E_INSTANCE="+instance)
	cmd.Stdout, cmd.Stderr = os.Stderr, os.Stderr
	if testing.Verbose() {
		cmd.Stdout, cmd.Stderr = os.Stdout, os.Stdout
	} else {
		cmd.Stdout, cmd.Stderr = nil, nil
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	p := &consumerProcess{cmd: cmd, done: make(chan error, 1)}
	go func() { p.done <- cmd.Wait() }()
	return p
}

func (p *consumerProcess) kill() {
	_ = p.cmd.Process.Kill()
	<-p.done
}

func (p *consumerProcess) stop(t *testing.T) {
	_ = p.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-p.done:
	case <-time.After(30 * time.Second):
		t.Errorf("consumer %d did not stop within 30 s of SIGTERM", p.cmd.Process.Pid)
		p.kill()
	}
}

// TestRabbitMQ and TestRedisStreams run orders through three consumer processes over a real
// broker, with duplicated deliveries, a consumer killed with SIGKILL, a broker restart and a
// broker killed with SIGKILL, and poison messages among the orders with the default config, and
// check that each order was applied once and its effect arrived, with one UUID, and that each
// poison message is one dead letter while the orders behind it went on.
func TestRabbitMQ(t *testing.T)     { testBroker(t, brokertest.RabbitMQ) }
func TestRedisStreams(t *testing.T) { testBroker(t, brokertest.Redis) }

func testBroker(t *testing.T, kind string) {
	const dupPercent = 30
	orders := 600
	if v := os.Getenv("OUTBOX_E2E_ORDERS"); v != "" { // a longer run: OUTBOX_E2E_ORDERS=3000 make e2e
		n, err := strconv.Atoi(v)
		if err != nil || n < 10 {
			t.Fatalf("OUTBOX_E2E_ORDERS=%q: want a number of orders, at least 10", v)
		}
		orders = n
	}
	start := time.Now()
	srv, err := brokertest.Start(kind)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(srv.Close)
	b := broker{kind: kind, addr: srv.Addr()}
	dsn := pgtest.DSN(t)
	db, err := sql.Open("postgres", dsn)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = db.Close() })
	if _, err := db.Exec(`CREATE TABLE reserved (order_id text NOT NULL, instance text NOT NULL)`); err != nil {
		t.Fatal(err)
	}
	ob, err := outbox.New(outbox.Config{DB: db, Driver: postgres.Driver{}, Publisher: nopPublisher{}})
	if err != nil {
		t.Fatal(err)
	}
	if err := ob.Migrate(context.Background()); err != nil {
		t.Fatal(err)
	}

	// The verifier reads every message on the stock topic.
	arrived := &arrivals{byOrder: map[string]map[string]int{}}
	vsub, closeV, err := b.subscriber("verifier", "verifier")
	if err != nil {
		t.Fatal(err)
	}
	vctx, stopV := context.WithCancel(context.Background())
	vdone := make(chan struct{})
	msgs, err := vsub.Subscribe(vctx, stockTopic)
	if err != nil {
		t.Fatal(err)
	}
	go func() {
		defer close(vdone)
		for m := range msgs {
			arrived.add(string(m.Payload), m.UUID)
			m.Ack()
		}
	}()
	t.Cleanup(func() { stopV(); closeV(); <-vdone })

	// Both topics exist before anything is sent to them. On RabbitMQ a message published to a
	// queue nobody has declared yet is dropped, and still confirmed (docs/brokers.md).
	if si, ok := vsub.(message.SubscribeInitializer); ok {
		for _, topic := range []string{ordersTopic, stockTopic} {
			if err := si.SubscribeInitialize(topic); err != nil {
				t.Fatalf("declare %s: %v", topic, err)
			}
		}
	}
	producer, closeP, err := b.publisher()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(closeP)
	var consumers []*consumerProcess
	for i := 0; i < 3; i++ {
		consumers = append(consumers, startConsumer(t, b, dsn, fmt.Sprintf("c%d", i)))
	}
	t.Cleanup(func() {
		for _, c := range consumers {
			c.stop(t)
		}
	})
	if kind == brokertest.Kafka {
		waitKafkaGroup(t, b, consumer, len(consumers))
	}

	// The producer sends each order once and 30% of them a second time with the same UUID, and
	// retries a send the broker refused (it is down for a while below). Each order has one of
	// orderKeys ordering keys (on Kafka, its partition key, so that the orders of a key are read in
	// order on one partition).
	ids := make([]string, orders)
	spec := map[string]sendSpec{}
	for i := range ids {
		ids[i] = uuid.NewString()
		key := fmt.Sprintf("k%d", i%orderKeys)
		spec[ids[i]] = sendSpec{key: key, payload: mustJSON(t, order{Key: key})}
	}
	sends := append([]string(nil), ids...)
	r := rand.New(rand.NewPCG(1, 2))
	for _, i := range r.Perm(orders)[:orders*dupPercent/100] {
		sends = append(sends, ids[i])
	}
	r.Shuffle(len(sends)-orders, func(i, j int) { sends[orders+i], sends[orders+j] = sends[orders+j], sends[orders+i] })
	// Poison messages with the default configuration, on the keys of the orders: three ahead of
	// every order (the first messages the consumers read; on Kafka, at the head of their
	// partitions), three among them, and one of them sent a second time. Half cannot be decoded
	// (a permanent error), half are refused by the handler every time after its write.
	poison := make([]string, 6)
	for i := range poison {
		poison[i] = uuid.NewString()
		key := fmt.Sprintf("k%d", (i*5)%orderKeys)
		payload := []byte(`{"key":"` + key + `","sku":`) // cut short
		if i%2 == 1 {
			payload = mustJSON(t, order{Key: key, SKU: unknownSKU})
		}
		spec[poison[i]] = sendSpec{key: key, payload: payload}
	}
	sends = append(append([]string(nil), poison[:3]...), sends...)
	for j, id := range append(poison[3:], poison[0]) {
		at := (j + 1) * len(sends) / 5
		sends = append(sends[:at], append([]string{id}, sends[at:]...)...)
	}
	var sent atomic.Int32
	chaos := map[int]func(){
		len(sends) / 5: func() {
			t.Logf("killing consumer c1 with SIGKILL and starting it again")
			consumers[1].kill()
			consumers[1] = startConsumer(t, b, dsn, "c1")
		},
		2 * len(sends) / 5: func() {
			t.Logf("restarting %s", kind)
			if err := srv.Restart(); err != nil {
				t.Fatal(err)
			}
		},
		3 * len(sends) / 5: func() {
			t.Logf("killing %s with SIGKILL and starting it again", kind)
			if err := srv.Kill(); err != nil {
				t.Fatal(err)
			}
			time.Sleep(time.Second)
			if err := srv.Start(); err != nil {
				t.Fatal(err)
			}
		},
	}
	for i, id := range sends {
		if f := chaos[i]; f != nil {
			f()
		}
		for try := 0; ; try++ {
			m := message.NewMessage(id, spec[id].payload)
			m.Metadata.Set(outbox.MetadataOrderingKey, spec[id].key)
			err := producer.Publish(ordersTopic, m)
			if err == nil {
				break
			}
			if try == 600 {
				t.Fatalf("the producer could not send order %d for a minute: %v", i, err)
			}
			time.Sleep(100 * time.Millisecond)
		}
		sent.Add(1)
		if i%50 == 0 {
			time.Sleep(50 * time.Millisecond) // spread the orders over the chaos
		}
	}

	// Wait until everything is through, or until nothing has moved for a minute.
	last, lastMove := [4]int{}, time.Now()
	for {
		applied, reached, pending := count(t, db, `SELECT count(DISTINCT order_id) FROM reserved`), arrived.orders(),
			count(t, db, `SELECT (SELECT count(*) FROM outbox_effects_all) + (SELECT count(*) FROM outbox_processed WHERE effects IS NOT NULL)`)
		dead := count(t, db, `SELECT count(*) FROM outbox_dead_letters`)
		if applied == orders && reached == orders && pending == 0 && dead >= len(poison) {
			break
		}
		if now := [4]int{applied, reached, pending, dead}; now != last {
			last, lastMove = now, time.Now()
		}
		if time.Since(lastMove) > time.Minute {
			t.Fatalf("stuck for a minute: %d of %d orders applied, effects of %d arrived, %d effects pending (rows and inline), %d of %d poison messages dead-lettered; %s",
				applied, orders, reached, pending, dead, len(poison), missing(t, db, sends, poison, arrived))
		}
		time.Sleep(200 * time.Millisecond)
	}
	time.Sleep(time.Second) // late copies
	t.Logf("the first order's effects: %s", effectState(t, db, sends[0]))

	routertest.MustEqual(t, "business rows (an order applied twice?)", count(t, db, `SELECT count(*) FROM reserved`), orders)
	checkPoison(t, ob, poison, spec, sends)
	if p := arrived.orders() - orders; p != 0 {
		t.Errorf("effects of %d messages arrived that are not orders (a poison message's rolled-back effect sent?)", p)
	}
	copies, multi := arrived.check(ids)
	if len(multi) > 0 {
		t.Errorf("orders whose effect arrived with more than one UUID: %d (first: %v)", len(multi), multi[:min(3, len(multi))])
	}
	perInstance := map[string]int{}
	rows, err := db.Query(`SELECT instance, count(*) FROM reserved GROUP BY instance`)
	if err != nil {
		t.Fatal(err)
	}
	for rows.Next() {
		var inst string
		var n int
		if err := rows.Scan(&inst, &n); err != nil {
			t.Fatal(err)
		}
		perInstance[inst] = n
	}
	rows.Close()
	for inst, form := range forms {
		if perInstance[inst] == 0 {
			t.Errorf("consumer %s (%s) applied no order: its form was not exercised", inst, form)
		}
	}
	t.Logf("%s: %d orders (+%d duplicates) through 3 consumer processes (%v) in %s; applied per instance %v; %d copies of effects on the wire (same UUIDs)",
		kind, orders, len(sends)-orders, forms, time.Since(start).Round(time.Millisecond), perInstance, copies)
}

// defaultMaxAttempts is Config.MaxAttempts's default, which the consumers keep.
const defaultMaxAttempts = 5

// orderKeys is the number of ordering keys of the orders.
const orderKeys = 12

// sendSpec is what the producer sends under a message UUID.
type sendSpec struct {
	key     string
	payload []byte
}

func mustJSON(t *testing.T, v any) []byte {
	t.Helper()
	b, err := json.Marshal(v)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// checkPoison checks that each poison message is one dead letter of the consumer, with what was
// sent and why it failed, that no other message is one, and tells how many orders were sent
// after a poison message with its key (the messages behind it, which were all applied).
func checkPoison(t *testing.T, ob *outbox.Outbox, poison []string, spec map[string]sendSpec, sends []string) {
	t.Helper()
	dead, err := ob.DeadLetters(context.Background(), outbox.DeadLetterFilter{Limit: 1000})
	if err != nil {
		t.Fatal(err)
	}
	byID := map[string][]outbox.DeadLetter{}
	for _, d := range dead {
		byID[d.MessageID] = append(byID[d.MessageID], d)
	}
	routertest.MustEqual(t, "dead letters (a poison message dead-lettered twice, or an order dead-lettered?)", len(dead), len(poison))
	for i, id := range poison {
		ds := byID[id]
		if len(ds) != 1 {
			t.Errorf("poison message %s: %d dead letters, want 1", id, len(ds))
			continue
		}
		d := ds[0]
		permanent := i%2 == 0
		want := "decode order"
		if !permanent {
			want = errUnknownSKU.Error()
		}
		if d.Consumer != consumer || d.SourceTopic != ordersTopic || !bytes.Equal(d.Payload, spec[id].payload) ||
			!strings.Contains(d.Reason, want) || d.Permanent != permanent || d.State != outbox.DeadLetterDead ||
			(!permanent && d.Attempts < defaultMaxAttempts) {
			t.Errorf("poison message %s: dead letter consumer %q, topic %q, payload %q, reason %q, permanent %t, attempts %d, state %q; want %q, %q, %q, a reason with %q, permanent %t, state dead",
				id, d.Consumer, d.SourceTopic, d.Payload, d.Reason, d.Permanent, d.Attempts, d.State, consumer, ordersTopic, spec[id].payload, want, permanent)
		}
	}
	behind := map[string]bool{}
	poisoned := map[string]bool{}
	for _, id := range sends {
		if _, isPoison := byID[id]; isPoison {
			poisoned[spec[id].key] = true
		} else if poisoned[spec[id].key] {
			behind[id] = true
		}
	}
	t.Logf("%d poison messages dead-lettered once each; %d orders sent after one on its key, all applied", len(poison), len(behind))
}

// arrivals records, per order, the UUIDs of the stock messages that arrived.
type arrivals struct {
	mu      sync.Mutex
	byOrder map[string]map[string]int
}

func (a *arrivals) add(order, id string) {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.byOrder[order] == nil {
		a.byOrder[order] = map[string]int{}
	}
	a.byOrder[order][id]++
}

func (a *arrivals) orders() int {
	a.mu.Lock()
	defer a.mu.Unlock()
	return len(a.byOrder)
}

// check returns how many copies beyond the first arrived, and the orders with several UUIDs.
func (a *arrivals) check(ids []string) (copies int, multi []string) {
	a.mu.Lock()
	defer a.mu.Unlock()
	for _, id := range ids {
		if len(a.byOrder[id]) > 1 {
			multi = append(multi, id)
		}
		for _, n := range a.byOrder[id] {
			copies += n - 1
		}
	}
	sort.Strings(multi)
	return copies, multi
}

// missing describes the orders not applied, or whose effect did not arrive (poison messages left
// out): their positions in the producer's sends (the chaos steps are at 1/5, 2/5 and 3/5 of them).
// effectState tells where the outbox holds the effects of message id: its claims (when their
// effects were marked sent, whether effects are still kept inline in one), its pending effect
// rows and those marked sent. An order whose effect did not arrive with its effect marked sent
// was lost after the broker acknowledged it; one still pending waits for the relay.
func effectState(t *testing.T, db *sql.DB, id string) string {
	t.Helper()
	var claims, inline, pending, sent int
	var marked sql.NullTime
	if err := db.QueryRow(`SELECT count(*), count(*) FILTER (WHERE effects IS NOT NULL), max(dispatched_at) FROM outbox_processed WHERE message_id = $1`, id).Scan(&claims, &inline, &marked); err != nil {
		return fmt.Sprintf("claims: %v", err)
	}
	if err := db.QueryRow(`SELECT (SELECT count(*) FROM outbox_effects_all WHERE source_id = $1), (SELECT count(*) FROM outbox_dispatched WHERE source_id = $1)`, id).Scan(&pending, &sent); err != nil {
		return fmt.Sprintf("effects: %v", err)
	}
	return fmt.Sprintf("claims %d, effects inline in %d, claim marked sent at %v; effect rows pending %d, marked sent %d", claims, inline, marked.Time.Format(time.RFC3339Nano), pending, sent)
}

func missing(t *testing.T, db *sql.DB, sends, poison []string, arrived *arrivals) string {
	t.Helper()
	applied := map[string]bool{}
	seen := map[string]bool{}
	for _, id := range poison {
		seen[id] = true // never applied
	}
	rows, err := db.Query(`SELECT order_id FROM reserved`)
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	for rows.Next() {
		var id string
		if err := rows.Scan(&id); err != nil {
			t.Fatal(err)
		}
		applied[id] = true
	}
	positions := map[string][]int{}
	for i, id := range sends {
		positions[id] = append(positions[id], i)
	}
	var out []string
	for _, id := range sends {
		if seen[id] {
			continue
		}
		seen[id] = true
		arrived.mu.Lock()
		reached := len(arrived.byOrder[id]) > 0
		arrived.mu.Unlock()
		if !applied[id] || !reached {
			out = append(out, fmt.Sprintf("%s (applied %t, effect arrived %t, sent at %v of %d; %s)", id, applied[id], reached, positions[id], len(sends), effectState(t, db, id)))
		}
	}
	if len(out) > 5 {
		out = append(out[:5], fmt.Sprintf("and %d more", len(out)-5))
	}
	return "missing: " + strings.Join(out, "; ")
}

func count(t *testing.T, db *sql.DB, query string) int {
	t.Helper()
	pgtest.CheckEffectsParent(t, query)
	var n int
	if err := db.QueryRow(query).Scan(&n); err != nil {
		t.Fatalf("%s: %v", query, err)
	}
	return n
}

type nopPublisher struct{}

func (nopPublisher) Publish(string, ...*message.Message) error {
	return errors.New("not for publishing")
}
func (nopPublisher) Close() error { return nil }
