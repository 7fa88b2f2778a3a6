package main

import (
	"bytes"
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"maps"
	"math/rand/v2"
	"net"
	"net/http"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"

	"github.com/watermill-outbox/outbox"
	"github.com/watermill-outbox/outbox/drivers/mysql"
	"github.com/watermill-outbox/outbox/drivers/sqlite"
	"github.com/watermill-outbox/outbox/outboxdriver"
)

// The chaos mode places orders through the HTTP API while
//   - the broker delivers some messages twice (the second copy a little later),
//   - handlers fail at random after their business writes,
//   - consumers crash at random steps of a message (outbox.Config.Failpoint), and the whole
//     consumer side is killed and restarted now and then (a new Outbox, Router and subscribers),
//   - malformed messages that no handler can decode reach the orders topic, ahead of and among
//     the orders,
//
// and then reconciles what the database, the e-mail spool and the counters say: every order must
// reach a final state, no business effect may happen twice, and each malformed message must be
// one dead letter (outbox.Config.DeadLetters, on by default) without holding up the orders.

type chaosConfig struct {
	orders, clients              int
	malformed                    int // undecodable messages sent to topicOrderPlaced
	dupRate, failRate, crashRate float64
	restartEvery                 time.Duration
	seed                         uint64
	timeout                      time.Duration
	// addr is where the API and GET /metrics listen during the run (port 0: any free one; the
	// address is printed at start).
	addr string
	// linger keeps the API and /metrics up this long after the report, so that Prometheus can
	// scrape the final state; negative: until the process is interrupted.
	linger time.Duration
	// fault, when set, is injected faultAfter into the linger and held until the process ends,
	// while a client keeps placing an order a second and the consumers keep running: what an
	// operator's alerts must see (make alerts-live). One of faults.
	fault      string
	faultAfter time.Duration
}

// The faults the chaos mode can inject after its report.
const (
	faultBrokerDown  = "broker-down"  // the embedded NATS server shuts down
	faultRefuseTopic = "refuse-topic" // the broker refuses every publish to topicStockReserved
	faultDBStall     = "db-stall"     // a side transaction holds outbox_effects_all locked (PostgreSQL)
)

var faults = []string{faultBrokerDown, faultRefuseTopic, faultDBStall}

var (
	errInjected = errors.New("chaos: injected handler failure")
	errCrashed  = errors.New("chaos: consumer crashed")
)

var failpoints = []string{outbox.FailpointAfterClaim, outbox.FailpointAfterHandler, outbox.FailpointAfterCommit,
	outbox.FailpointAfterPublish, outbox.FailpointAfterMark}

// chaos injects the faults and counts what happens.
type chaos struct {
	cfg chaosConfig

	mu       sync.Mutex
	rng      *rand.Rand
	held     map[string][]*message.Message // duplicates waiting for the next publish to their topic
	sentIDs  map[string]bool               // every message ID handed to the broker
	refused  atomic.Pointer[string]        // a topic the broker refuses (fault refuse-topic)
	postgres bool                          // the database is PostgreSQL (fault db-stall)
	feats    features                      // without keys the clients send none; without delays no order waits for a confirmation

	sent, injectedDups                    atomic.Int64
	delivered, duplicates, runs, failures atomic.Int64
	aborted                               atomic.Int64
	restarts                              atomic.Int64
	crashes                               map[string]*atomic.Int64 // per failpoint
	// retries counts the orders a client sent again with its Idempotency-Key after a 201 (as if
	// the response had been lost); retryNewOrder those for which it got another order.
	retries, retryNewOrder atomic.Int64

	// malformedPub sends the malformed messages straight to the broker (not through
	// chaosPublisher: they are no events of the service); malformed holds their IDs and payloads.
	malformedPub message.Publisher
	malformed    map[string][]byte
}

func newChaos(cfg chaosConfig) *chaos {
	c := &chaos{cfg: cfg, rng: rand.New(rand.NewPCG(cfg.seed, 0x0c4a05)), held: map[string][]*message.Message{},
		sentIDs: map[string]bool{}, crashes: map[string]*atomic.Int64{}, malformed: map[string][]byte{}}
	for _, p := range failpoints {
		c.crashes[p] = new(atomic.Int64)
	}
	return c
}

func (c *chaos) roll(rate float64) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.rng.Float64() < rate
}

// tune is applied to every Outbox of the run.
func (c *chaos) tune(cfg *outbox.Config) {
	cfg.Publisher = &chaosPublisher{c: c, next: cfg.Publisher}
	// The payment timeouts go out through the relays, and a consumer killed in a relay round
	// leaves its effects leased (2 x PublishTimeout + 30 s): 40 s, within the wait for the run
	// to settle, not the default 90 s.
	cfg.PublishTimeout = 5 * time.Second
	// The injected handler failures are transient (failRate, 10% by default, of every run): with
	// the default MaxAttempts (5) one message in 100,000 fails five times in a row and is given
	// up on, a dead letter for an order that never failed for a reason of its own (about one
	// in 25 runs of the tests' chaos cases). Only the malformed messages are to be dead letters.
	cfg.MaxAttempts = 20
}

// chaosPublisher is the broker misbehaving: some messages are delivered twice, with the same
// UUID, the second copy riding along with the next publish to the topic. It also counts what
// reaches the broker.
type chaosPublisher struct {
	c    *chaos
	next message.Publisher
}

func (p *chaosPublisher) Publish(topic string, msgs ...*message.Message) error {
	c := p.c
	if t := c.refused.Load(); t != nil && *t == topic {
		return fmt.Errorf("chaos: the broker refuses topic %s", topic)
	}
	c.mu.Lock()
	out := append([]*message.Message{}, msgs...)
	out = append(out, c.held[topic]...)
	c.held[topic] = nil
	for _, m := range msgs {
		if c.rng.Float64() < c.cfg.dupRate {
			cp := message.NewMessage(m.UUID, m.Payload)
			cp.Metadata = maps.Clone(m.Metadata)
			c.held[topic] = append(c.held[topic], cp)
		}
	}
	c.mu.Unlock()
	if err := p.next.Publish(topic, out...); err != nil {
		return err
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	for i, m := range out {
		if i >= len(msgs) {
			c.injectedDups.Add(1)
		}
		c.sentIDs[m.UUID] = true
	}
	c.sent.Add(int64(len(out)))
	return nil
}

func (p *chaosPublisher) Close() error { return p.next.Close() }

type ranKey struct{}

// handler wraps a consumer's handler (inside the outbox middleware): it counts runs, and fails
// some of them after the handler's writes, which the middleware then rolls back.
func (c *chaos) handler(h message.NoPublishHandlerFunc) message.NoPublishHandlerFunc {
	return func(msg *message.Message) error {
		c.runs.Add(1)
		if ran, ok := msg.Context().Value(ranKey{}).(*atomic.Bool); ok {
			ran.Store(true)
		}
		if err := h(msg); err != nil {
			return err
		}
		if c.roll(c.cfg.failRate) {
			c.failures.Add(1)
			return errInjected
		}
		return nil
	}
}

// countDeliveries is the outermost middleware: it sees every copy the broker delivers. A copy
// acked without running the handler is a duplicate the outbox suppressed.
func (c *chaos) countDeliveries(next message.HandlerFunc) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		c.delivered.Add(1)
		ran := new(atomic.Bool)
		msg.SetContext(context.WithValue(msg.Context(), ranKey{}, ran))
		out, err := next(msg)
		switch {
		case ran.Load():
		case err == nil:
			c.duplicates.Add(1)
		default:
			c.aborted.Add(1) // failed before reaching the handler: a crash at a step, or a killed consumer
		}
		return out, err
	}
}

// incarnation is one life of the consumer side: its own Outbox, Router and subscribers, as a
// separate consumer process would have.
type incarnation struct {
	dead          atomic.Bool
	pub           message.Publisher
	stopConsumers func() error
	cancel        context.CancelFunc
	done          chan struct{}
}

func (c *chaos) start(ctx context.Context, s *service) (*incarnation, error) {
	inc := &incarnation{done: make(chan struct{})}
	ob, pub, err := s.newOutbox(func(cfg *outbox.Config) {
		cfg.Failpoint = func(_ context.Context, point string) error {
			if inc.dead.Load() {
				return errCrashed // killed: whatever was in flight stops at its next step
			}
			// The steps of a message's unit of work crash at random; the relay's and the sweep's
			// steps crash only when the whole incarnation is killed (above): a random crash there
			// would hold its effects for a lease, longer than a chaos run lasts.
			if n, ok := c.crashes[point]; ok && c.roll(c.cfg.crashRate) {
				n.Add(1)
				return errCrashed
			}
			return nil
		}
	})
	if err != nil {
		return nil, err
	}
	ictx, cancel := context.WithCancel(ctx)
	inc.pub, inc.cancel = pub, cancel
	go func() { defer close(inc.done); _ = ob.Run(ictx) }()
	if inc.stopConsumers, _, err = startConsumers(ictx, s, ob, c); err != nil {
		cancel()
		<-inc.done
		_ = pub.Close()
		return nil, err
	}
	return inc, nil
}

// kill ends an incarnation the hard way: every unit of work in flight, and every message the
// subscribers still hold, fails at its next step, as if the process died there. The broker
// redelivers them: after a nack, or after its ack timeout for what was never answered.
func (inc *incarnation) kill() error {
	inc.dead.Store(true)
	err := inc.stopConsumers()
	inc.cancel()
	<-inc.done
	return errors.Join(err, inc.pub.Close())
}

// chaosReport is the reconciliation.
type chaosReport struct {
	Setup                                     string
	Placed, Final, Paid, Rejected, Cancelled  int
	PaidAndCancelled                          int
	EventsPublished, EventsExpected           int
	CopiesSent, InjectedDuplicates            int64
	Delivered, Duplicates, Runs, Failures     int64
	Aborted                                   int64
	Crashes                                   map[string]int64
	Restarts                                  int64
	Decisions, Payments, Receipts, StatusRows int
	ReceiptRepeats                            int64
	StockUnaccounted                          int64
	Lost, AppliedTwice                        int
	Retries, RetryNewOrder                    int64
	// Malformed messages sent, those stored as one dead letter of the inventory consumer with
	// their payload, and dead letters of anything else (an order given up on).
	Malformed, MalformedDead, OtherDead int
	// OtherDeadLetters says what each of the other dead letters was: its consumer, topic,
	// attempts and reason.
	OtherDeadLetters []string
	Took             time.Duration
}

// ok tells whether the numbers reconcile: nothing lost or applied twice, and each consumer's
// effects as many as the final orders call for (a consumer that lost every message of its own,
// one that writes and publishes nothing, shows only there).
func (r *chaosReport) ok() bool {
	return r.Lost == 0 && r.AppliedTwice == 0 && r.StockUnaccounted == 0 && r.EventsPublished == r.EventsExpected && r.PaidAndCancelled == 0 &&
		r.MalformedDead == r.Malformed && r.OtherDead == 0 &&
		r.Decisions == r.Final && r.Payments == r.Paid && r.Receipts == r.Paid && r.StatusRows == r.Final+r.Paid+r.Cancelled
}

// runChaos runs the chaos mode in a fresh directory under cfg.dataDir and prints the
// reconciliation to out.
func runChaos(ctx context.Context, cfg config, out io.Writer) (*chaosReport, error) {
	start := time.Now()
	runID := uuid.NewString()[:8]
	cfg.dataDir = filepath.Join(cfg.dataDir, "chaos-"+runID)
	cfg.chaos = true // as with -chaos, whoever calls it: the chaos mode's payment window and logging
	c := newChaos(cfg.chaosConfig)
	c.postgres = cfg.postgres != ""

	// A crashed consumer's messages come back after the broker's ack timeout, and until then they
	// count against its MaxAckPending: 2 s, so that the run does not idle (the service uses 30 s).
	s, err := openService(ctx, cfg, 2*time.Second)
	if err != nil {
		return nil, err
	}
	defer s.close()
	s.tune = c.tune
	fmt.Fprintf(out, "chaos run %s: %d orders, %d malformed messages, %d clients, %.0f%% duplicated, %.0f%% handler failures, "+
		"%.0f%% crash chance per step, restart every ~%s, seed %d\n%s\n\n",
		runID, cfg.orders, cfg.malformed, cfg.clients, 100*cfg.dupRate, 100*cfg.failRate, 100*cfg.crashRate, cfg.restartEvery, cfg.seed, s.desc)
	if cfg.malformed > 0 {
		if c.malformedPub, err = s.broker.Publisher(); err != nil {
			return nil, err
		}
		defer func() { _ = c.malformedPub.Close() }()
	}

	// The API: its own Outbox, which never crashes, behind a real HTTP server.
	apiOb, apiPub, err := s.newOutbox()
	if err != nil {
		return nil, err
	}
	defer func() { _ = apiPub.Close() }()
	if err := apiOb.Migrate(ctx); err != nil {
		return nil, err
	}
	if c.feats, err = probeFeatures(ctx, apiOb); err != nil {
		return nil, err
	}
	fmt.Fprint(out, c.feats.notes())
	if !c.feats.keys {
		fmt.Fprint(out, "The clients place their orders without an Idempotency-Key, and retry none.\n\n")
	} else if !c.feats.delays {
		fmt.Fprintln(out)
	}

	// This run's customer and products, so that a shared PostgreSQL database reconciles per run.
	customer := "chaos-" + runID + "@example.com"
	plenty, scarce := "chaos-"+runID+"-beans", "chaos-"+runID+"-grinder"
	stock := map[string]int64{plenty: int64(3 * cfg.orders), scarce: int64(cfg.orders / 5)}
	for sku, units := range stock {
		// Three of the scarce product cost more than a payment may without the customer's
		// confirmation, which never comes: those orders time out, and their stock comes back.
		// Without payment timeouts no order may wait for one: it would never be final.
		price := int64(1000)
		switch {
		case sku == scarce && c.feats.delays:
			price = confirmAboveCents/3 + 1
		case sku == scarce:
			price = confirmAboveCents / 3
		}
		if err := addProduct(ctx, s.db, s.driver, sku, sku, price, units); err != nil {
			return nil, err
		}
	}
	runCtx, cancel := context.WithCancel(ctx)
	defer cancel()
	apiDone := make(chan struct{})
	go func() { defer close(apiDone); _ = apiOb.Run(runCtx) }()
	defer func() { cancel(); <-apiDone }()
	addr := cfg.chaosConfig.addr
	if addr == "" {
		addr = "127.0.0.1:0"
	}
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("chaos: listen on %s: %w", addr, err)
	}
	fmt.Fprintf(out, "API and metrics: http://%s (Prometheus: GET /metrics)\n\n", ln.Addr())
	srv := &http.Server{Handler: (&api{db: s.db, ob: apiOb, metrics: s.metrics}).routes(), ReadHeaderTimeout: 10 * time.Second}
	served := make(chan struct{})
	go func() { defer close(served); _ = srv.Serve(ln) }()
	defer func() {
		shutdownCtx, done := context.WithTimeout(context.Background(), 10*time.Second)
		defer done()
		_ = srv.Shutdown(shutdownCtx)
		<-served
	}()

	// The consumers, killed and restarted at random until every order is final.
	side, err := c.startConsumerSide(runCtx, s)
	if err != nil {
		return nil, err
	}
	defer func() { _ = side.stop() }()

	accepted, err := c.placeAndWait(ctx, out, s, "http://"+ln.Addr().String(), customer, plenty, scarce, start)
	if err != nil {
		return nil, err
	}
	if err := side.stopRestarts(); err != nil {
		return nil, err
	}
	if err := waitSettled(ctx, out, s, customer); err != nil {
		return nil, err
	}
	if cfg.fault == "" {
		_ = side.stop()
	} // else the consumers keep running for the fault (the deferred stop ends them)

	rep, err := c.reconcile(ctx, s, apiOb, customer, accepted, stock, start)
	if err != nil {
		return nil, err
	}
	rep.Setup = s.desc
	rep.Took = time.Since(start)
	rep.print(out)
	if l := cfg.linger; l != 0 {
		fmt.Fprintf(out, "\nstill serving http://%s/metrics", ln.Addr())
		wait := make(<-chan time.Time) // never: until interrupted
		if l > 0 {
			fmt.Fprintf(out, " for %s", l)
			t := time.NewTimer(l)
			defer t.Stop()
			wait = t.C
		}
		fmt.Fprintln(out, " (interrupt to stop)")
		if cfg.fault != "" {
			faultDone := make(chan struct{})
			go func() {
				defer close(faultDone)
				c.injectFault(runCtx, out, s, "http://"+ln.Addr().String(), customer, runID)
			}()
			defer func() { cancel(); <-faultDone }()
		}
		select {
		case <-ctx.Done():
		case <-wait:
		}
	}
	return rep, nil
}

// injectFault keeps placing an order a second and, after faultAfter, injects the fault, which
// holds until ctx ends. Errors are printed: the orders are expected to fail under some faults.
func (c *chaos) injectFault(ctx context.Context, out io.Writer, s *service, baseURL, customer, runID string) {
	sku := "chaos-" + runID + "-trickle"
	if err := addProduct(ctx, s.db, s.driver, sku, sku, 1000, 1<<40); err != nil {
		fmt.Fprintf(out, "fault: add the product for the trickle of orders: %v\n", err)
		return
	}
	client := &http.Client{Timeout: 10 * time.Second}
	inject := time.NewTimer(c.cfg.faultAfter)
	defer inject.Stop()
	tick := time.NewTicker(time.Second)
	defer tick.Stop()
	var placed, failed int
	for {
		select {
		case <-ctx.Done():
			fmt.Fprintf(out, "fault: %d orders placed and %d refused during the linger\n", placed, failed)
			return
		case <-inject.C:
			if err := c.startFault(ctx, s); err != nil {
				fmt.Fprintf(out, "fault %s NOT injected: %v\n", c.cfg.fault, err)
				continue
			}
			fmt.Fprintf(out, "fault injected: %s\n", c.cfg.fault)
		case <-tick.C:
			octx, done := context.WithTimeout(ctx, 10*time.Second)
			_, err := c.postOrder(octx, client, baseURL, placeOrderRequest{Customer: customer, SKU: sku, Quantity: 1})
			done()
			if err != nil {
				failed++
			} else {
				placed++
			}
		}
	}
}

// startFault injects c.cfg.fault; a database stall holds until ctx ends.
func (c *chaos) startFault(ctx context.Context, s *service) error {
	switch c.cfg.fault {
	case faultBrokerDown:
		nb, ok := s.broker.(*natsBroker)
		if !ok || nb.server == nil {
			return errors.New("needs the embedded NATS server (-broker nats without -nats-url)")
		}
		// The clients stay: they reconnect in vain, and every publish fails, as when the
		// broker's host goes away.
		nb.server.Shutdown()
		return nil
	case faultRefuseTopic:
		t := topicStockReserved
		c.refused.Store(&t)
		return nil
	case faultDBStall:
		if !c.postgres {
			return errors.New("needs PostgreSQL (-postgres DSN)")
		}
		conn, err := s.db.Conn(ctx)
		if err != nil {
			return fmt.Errorf("side connection: %w", err)
		}
		tx, err := conn.BeginTx(ctx, nil)
		if err == nil {
			_, err = tx.ExecContext(ctx, `LOCK TABLE outbox_effects_all IN ACCESS EXCLUSIVE MODE`)
		}
		if err != nil {
			_ = conn.Close()
			return fmt.Errorf("lock outbox_effects_all: %w", err)
		}
		go func() {
			<-ctx.Done()
			_ = tx.Rollback()
			_ = conn.Close()
		}()
		return nil
	}
	return fmt.Errorf("unknown fault %q (want one of %s)", c.cfg.fault, strings.Join(faults, ", "))
}

// consumerSide runs the consumers and, every restartEvery or so, kills them and starts new ones.
type consumerSide struct {
	c     *chaos
	s     *service
	ctx   context.Context
	stopc chan struct{}
	once  sync.Once
	done  chan error

	mu  sync.Mutex
	inc *incarnation
}

func (c *chaos) startConsumerSide(ctx context.Context, s *service) (*consumerSide, error) {
	inc, err := c.start(ctx, s)
	if err != nil {
		return nil, err
	}
	cs := &consumerSide{c: c, s: s, ctx: ctx, stopc: make(chan struct{}), done: make(chan error, 1), inc: inc}
	go cs.restartLoop()
	return cs, nil
}

func (cs *consumerSide) restartLoop() {
	var err error
	defer func() { cs.done <- err }()
	if cs.c.cfg.restartEvery <= 0 {
		<-cs.stopc
		return
	}
	for {
		cs.c.mu.Lock()
		wait := time.Duration((0.5 + cs.c.rng.Float64()) * float64(cs.c.cfg.restartEvery))
		cs.c.mu.Unlock()
		select {
		case <-cs.stopc:
			return
		case <-time.After(wait):
		}
		cs.mu.Lock()
		_ = cs.inc.kill() // a killed incarnation's errors are expected
		cs.c.restarts.Add(1)
		cs.inc, err = cs.c.start(cs.ctx, cs.s)
		cs.mu.Unlock()
		if err != nil {
			err = fmt.Errorf("restart consumers: %w", err)
			return
		}
	}
}

// stopRestarts ends the restarts; the current consumers keep running.
func (cs *consumerSide) stopRestarts() error {
	var err error
	cs.once.Do(func() {
		close(cs.stopc)
		err = <-cs.done
	})
	return err
}

// stop ends the restarts and the consumers.
func (cs *consumerSide) stop() error {
	err := cs.stopRestarts()
	cs.mu.Lock()
	defer cs.mu.Unlock()
	if cs.inc != nil {
		_ = cs.inc.kill()
		cs.inc = nil
	}
	return err
}

// placeAndWait places the orders and waits until every order placed is final, printing progress.
func (c *chaos) placeAndWait(ctx context.Context, out io.Writer, s *service, baseURL, customer, plenty, scarce string, start time.Time) ([]string, error) {
	loadDone := make(chan struct{})
	var accepted []string
	var loadErr error
	go func() {
		defer close(loadDone)
		accepted, loadErr = c.placeOrders(ctx, baseURL, customer, plenty, scarce)
	}()
	deadline := time.Now().Add(c.cfg.timeout)
	lastPrint := time.Now()
	for {
		placed, final, _, _, err := countOrders(ctx, s.db, customer)
		if err != nil {
			<-loadDone
			return nil, err
		}
		select {
		case <-loadDone:
			if loadErr != nil {
				return nil, loadErr
			}
			if final == placed {
				return accepted, nil
			}
		default:
		}
		if time.Now().After(deadline) {
			<-loadDone
			fmt.Fprintf(out, "timed out after %s: %d of %d orders final\n", c.cfg.timeout, final, placed)
			return accepted, loadErr
		}
		if time.Since(lastPrint) >= 2*time.Second {
			lastPrint = time.Now()
			fmt.Fprintf(out, "%5.1fs  placed %4d  final %4d  deliveries %5d  restarts %d\n",
				time.Since(start).Seconds(), placed, final, c.delivered.Load(), c.restarts.Load())
		}
		select {
		case <-ctx.Done():
			<-loadDone
			return nil, ctx.Err()
		case <-time.After(100 * time.Millisecond):
		}
	}
}

// waitSettled waits until nothing is left to do, so that the counters are complete: no side
// effect waits to be sent, the broker has every copy acked, every paid order has its receipt.
// The consumers keep failing and crashing at steps meanwhile.
func waitSettled(ctx context.Context, out io.Writer, s *service, customer string) error {
	deadline := time.Now().Add(time.Minute)
	for {
		done, state, err := settled(ctx, s, customer)
		if err != nil || done {
			return err
		}
		if time.Now().After(deadline) {
			fmt.Fprintf(out, "not settled after a minute: %s\n", state)
			return nil
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(200 * time.Millisecond):
		}
	}
}

// placeOrders places cfg.orders orders from cfg.clients concurrent clients and returns the IDs of
// those the API accepted. One order in five is for the scarce product, which runs out.
func (c *chaos) placeOrders(ctx context.Context, baseURL, customer, plenty, scarce string) ([]string, error) {
	transport := &http.Transport{MaxIdleConnsPerHost: c.cfg.clients}
	defer transport.CloseIdleConnections()
	client := &http.Client{Transport: transport, Timeout: 30 * time.Second}
	jobs := make(chan int)
	var mu sync.Mutex
	var ids []string
	var errs []error
	var wg sync.WaitGroup
	for w := range c.cfg.clients {
		wg.Add(1)
		go func() {
			defer wg.Done()
			rng := rand.New(rand.NewPCG(c.cfg.seed, uint64(w)))
			for range jobs {
				req := placeOrderRequest{Customer: customer, SKU: plenty, Quantity: 1 + rng.IntN(3)}
				if rng.IntN(5) == 0 {
					req.SKU = scarce
				}
				key := ""
				if c.feats.keys {
					key = uuid.NewString()
				}
				id, err := postKeyed(ctx, client, baseURL, req, key)
				if err == nil && key != "" && rng.Float64() < c.cfg.dupRate {
					// The response was lost on its way: the client sends the order again with its
					// key, and must get the same order, not a second one.
					c.retries.Add(1)
					again, rerr := postKeyed(ctx, client, baseURL, req, key)
					switch {
					case rerr != nil:
						err = fmt.Errorf("retry with the same Idempotency-Key: %w", rerr)
					case again != id:
						c.retryNewOrder.Add(1)
					}
				}
				mu.Lock()
				if err != nil {
					errs = append(errs, err)
				} else {
					ids = append(ids, id)
				}
				mu.Unlock()
			}
		}()
	}
	var malformedErr error
	sentMalformed := 0
	for i := range c.cfg.orders {
		// The first malformed message goes ahead of every order, the others among them.
		for malformedErr == nil && sentMalformed < c.cfg.malformed && i >= sentMalformed*c.cfg.orders/c.cfg.malformed {
			malformedErr = c.sendMalformed(sentMalformed)
			sentMalformed++
		}
		select {
		case jobs <- i:
		case <-ctx.Done():
		}
	}
	for malformedErr == nil && sentMalformed < c.cfg.malformed { // more of them than orders
		malformedErr = c.sendMalformed(sentMalformed)
		sentMalformed++
	}
	close(jobs)
	wg.Wait()
	if malformedErr != nil {
		return ids, fmt.Errorf("send a malformed message: %w", malformedErr)
	}
	if len(errs) > 0 {
		return ids, fmt.Errorf("%d orders not placed, the first: %w", len(errs), errs[0])
	}
	return ids, nil
}

// malformedPayloads are what the malformed messages carry, in turn: none decodes as OrderPlaced.
var malformedPayloads = [][]byte{
	[]byte(`{"order_id": "cut short`),
	{0x00, 0xff, 0xfe, 0x01},
	[]byte(`not json at all`),
	[]byte(`{"quantity": "three"}`),
}

// sendMalformed sends the n-th malformed message to the orders topic.
func (c *chaos) sendMalformed(n int) error {
	msg := message.NewMessage(uuid.NewString(), malformedPayloads[n%len(malformedPayloads)])
	c.mu.Lock()
	c.malformed[msg.UUID] = msg.Payload
	c.mu.Unlock()
	return c.malformedPub.Publish(topicOrderPlaced, msg)
}

// postOrder places one order with an Idempotency-Key of its own (see postKeyed), when the
// service takes one.
func (c *chaos) postOrder(ctx context.Context, client *http.Client, baseURL string, req placeOrderRequest) (string, error) {
	key := ""
	if c.feats.keys {
		key = uuid.NewString()
	}
	return postKeyed(ctx, client, baseURL, req, key)
}

// postKeyed places one order with Idempotency-Key key, retrying on a server error, no answer
// (the order may have been placed: the key makes the retry return it rather than place another)
// and 409 (the first attempt is still running). Without a key (empty) it sends the order once:
// a retry could place it twice.
func postKeyed(ctx context.Context, client *http.Client, baseURL string, req placeOrderRequest, key string) (string, error) {
	body, _ := json.Marshal(req)
	var lastErr error
	attempts := 5
	if key == "" {
		attempts = 1
	}
	for attempt := range attempts {
		if attempt > 0 {
			time.Sleep(time.Duration(attempt) * 100 * time.Millisecond)
		}
		r, err := http.NewRequestWithContext(ctx, http.MethodPost, baseURL+"/orders", bytes.NewReader(body))
		if err != nil {
			return "", err
		}
		if key != "" {
			r.Header.Set("Idempotency-Key", key)
		}
		resp, err := client.Do(r)
		if err != nil {
			lastErr = err
			continue
		}
		var o Order
		err = json.NewDecoder(resp.Body).Decode(&o)
		_ = resp.Body.Close()
		switch {
		case resp.StatusCode == http.StatusCreated && err == nil:
			return o.ID, nil
		case resp.StatusCode >= 500 || resp.StatusCode == http.StatusConflict:
			lastErr = fmt.Errorf("POST /orders: %s", resp.Status)
		default:
			return "", fmt.Errorf("POST /orders: %s", resp.Status)
		}
	}
	return "", lastErr
}

func countOrders(ctx context.Context, db *sql.DB, customer string) (placed, final, paid, rejected int, err error) {
	var cancelled int
	placed, paid, rejected, cancelled, err = countOrderStates(ctx, db, customer)
	return placed, paid + rejected + cancelled, paid, rejected, err
}

// countOrderStates counts the orders of customer, and those paid, rejected and cancelled (not
// paid in time).
func countOrderStates(ctx context.Context, db *sql.DB, customer string) (placed, paid, rejected, cancelled int, err error) {
	err = db.QueryRowContext(ctx, `SELECT count(*),
			coalesce(sum(CASE WHEN status = 'paid' THEN 1 ELSE 0 END), 0),
			coalesce(sum(CASE WHEN status = 'rejected' THEN 1 ELSE 0 END), 0),
			coalesce(sum(CASE WHEN status = 'cancelled' THEN 1 ELSE 0 END), 0)
		FROM orders WHERE customer = $1`, customer).Scan(&placed, &paid, &rejected, &cancelled)
	return placed, paid, rejected, cancelled, err
}

// effectsTable is the table the effect rows are read through: PostgreSQL's partitioned parent
// (its partition 0 alone is named outbox_effects); MySQL and SQLite keep one plain table.
func effectsTable(driver outboxdriver.Driver) string {
	switch driver.(type) {
	case mysql.Driver, sqlite.Driver:
		return "outbox_" + "effects" // the whole table here (the PostgreSQL check of literals does not apply)
	}
	return "outbox_effects_all"
}

// settled tells whether nothing is left to do: no side effect waits to be sent, the broker has
// every copy acked, and every paid order has its receipt.
func settled(ctx context.Context, s *service, customer string) (bool, string, error) {
	var pending int
	if err := s.db.QueryRowContext(ctx, `SELECT count(*) FROM `+effectsTable(s.driver)+` WHERE dispatched_at IS NULL`).Scan(&pending); err != nil {
		return false, "", err
	}
	if pending > 0 {
		return false, fmt.Sprintf("%d side effects pending", pending), nil
	}
	if ok, state, err := s.broker.CaughtUp(ctx); err != nil || !ok {
		return false, state, err
	}
	_, _, paid, _, err := countOrders(ctx, s.db, customer)
	if err != nil {
		return false, "", err
	}
	receipts, err := s.mail.receipts()
	if err != nil {
		return false, "", err
	}
	if len(receipts) < paid {
		return false, fmt.Sprintf("%d receipts for %d paid orders", len(receipts), paid), nil
	}
	return true, "", nil
}

// receipts returns the order ID of every receipt in the spool, one entry per file.
func (m *mailer) receipts() ([]string, error) {
	files, err := filepath.Glob(filepath.Join(m.dir, "*.eml"))
	if err != nil {
		return nil, err
	}
	ids := make([]string, len(files))
	for i, f := range files {
		ids[i], _, _ = strings.Cut(filepath.Base(f), ".")
	}
	return ids, nil
}

// reconcile counts, from the database and the e-mail spool, what happened to this run's orders.
func (c *chaos) reconcile(ctx context.Context, s *service, ob *outbox.Outbox, customer string, accepted []string, stock map[string]int64, start time.Time) (*chaosReport, error) {
	r := &chaosReport{
		Placed: len(accepted), CopiesSent: c.sent.Load(), InjectedDuplicates: c.injectedDups.Load(),
		Delivered: c.delivered.Load(), Duplicates: c.duplicates.Load(), Runs: c.runs.Load(), Failures: c.failures.Load(),
		Aborted:  c.aborted.Load(),
		Restarts: c.restarts.Load(), ReceiptRepeats: s.mail.repeats.Load(), Crashes: map[string]int64{},
		Retries: c.retries.Load(), RetryNewOrder: c.retryNewOrder.Load(),
	}
	r.AppliedTwice += int(r.RetryNewOrder) // an order placed twice by one client request
	for p, n := range c.crashes {
		r.Crashes[p] = n.Load()
	}
	c.mu.Lock()
	r.EventsPublished = len(c.sentIDs)
	c.mu.Unlock()

	inRun, err := queryStrings(ctx, s.db, `SELECT id FROM orders WHERE customer = $1`, customer)
	if err != nil {
		return nil, err
	}
	var dbPlaced int
	if dbPlaced, r.Final, r.Paid, r.Rejected, err = countOrders(ctx, s.db, customer); err != nil {
		return nil, err
	}
	known := map[string]bool{}
	for _, id := range inRun {
		known[id] = true
	}
	for _, id := range accepted {
		if !known[id] {
			r.Lost++ // accepted by the API but not in the database
		}
	}
	r.Lost += dbPlaced - r.Final // never reached paid, rejected or cancelled
	if _, _, _, r.Cancelled, err = countOrderStates(ctx, s.db, customer); err != nil {
		return nil, err
	}
	// A reserved order is paid or times out, never both: its PaymentCaptured, or its
	// PaymentTimedOut (sent when the payment window closed, unless the payment cancelled it).
	r.EventsExpected = 2*dbPlaced + r.Paid + r.Cancelled

	// Rows per order (per order and event for the history): any surplus was applied twice.
	for _, q := range []struct {
		rows *int
		sql  string
	}{
		{&r.Decisions, `SELECT count(*), count(DISTINCT x.order_id) FROM reservations x JOIN orders o ON o.id = x.order_id WHERE o.customer = $1`},
		{&r.Payments, `SELECT count(*), count(DISTINCT x.order_id) FROM payments x JOIN orders o ON o.id = x.order_id WHERE o.customer = $1`},
		{&r.StatusRows, `SELECT count(*), count(DISTINCT concat(x.order_id, '/', x.event)) FROM order_history x JOIN orders o ON o.id = x.order_id WHERE o.customer = $1`},
	} {
		var distinct int
		if err := s.db.QueryRowContext(ctx, q.sql, customer).Scan(q.rows, &distinct); err != nil {
			return nil, err
		}
		r.AppliedTwice += *q.rows - distinct
	}
	var paidWithoutPayment int
	if err := s.db.QueryRowContext(ctx, `SELECT count(*) FROM orders o WHERE o.customer = $1 AND o.status = 'paid'
		AND NOT EXISTS (SELECT 1 FROM payments p WHERE p.order_id = o.id)`, customer).Scan(&paidWithoutPayment); err != nil {
		return nil, err
	}
	r.Lost += paidWithoutPayment
	// Cancelled, its stock still reserved: the release was lost (the stock count cannot tell,
	// the reservation still counting what is gone).
	var cancelledHeld int
	if err := s.db.QueryRowContext(ctx, `SELECT count(*) FROM orders o WHERE o.customer = $1 AND o.status = 'cancelled'
		AND NOT EXISTS (SELECT 1 FROM reservations x WHERE x.order_id = o.id AND x.outcome = 'released')`, customer).Scan(&cancelledHeld); err != nil {
		return nil, err
	}
	r.Lost += cancelledHeld
	// Both the payment and the timeout took effect: a charge for a cancelled order.
	if err := s.db.QueryRowContext(ctx, `SELECT count(*) FROM orders o WHERE o.customer = $1
		AND (o.status = 'cancelled' AND EXISTS (SELECT 1 FROM payments p WHERE p.order_id = o.id)
		  OR EXISTS (SELECT 1 FROM reservations x WHERE x.order_id = o.id AND x.outcome = 'released') AND o.status <> 'cancelled')`,
		customer).Scan(&r.PaidAndCancelled); err != nil {
		return nil, err
	}

	receipts, err := s.mail.receipts()
	if err != nil {
		return nil, err
	}
	perOrder := map[string]int{}
	for _, id := range receipts {
		if known[id] {
			perOrder[id]++
			r.Receipts++
		}
	}
	r.AppliedTwice += r.Receipts - len(perOrder)
	paidIDs, err := queryStrings(ctx, s.db, `SELECT id FROM orders WHERE customer = $1 AND status = 'paid'`, customer)
	if err != nil {
		return nil, err
	}
	for _, id := range paidIDs {
		if perOrder[id] == 0 {
			r.Lost++ // paid, but no receipt was sent
		}
	}

	// Stock: what is gone must be exactly what was reserved.
	for sku, initial := range stock {
		var available, reserved int64
		if err := s.db.QueryRowContext(ctx, `SELECT available,
				(SELECT coalesce(sum(quantity), 0) FROM reservations WHERE sku = $1 AND outcome = 'reserved')
			FROM stock WHERE sku = $1`, sku).Scan(&available, &reserved); err != nil {
			return nil, err
		}
		d := initial - available - reserved
		if d < 0 {
			d = -d
		}
		r.StockUnaccounted += d
	}

	// Dead letters: one per malformed message, of the consumer of the orders topic, with what was
	// sent; none of anything else since the run started (a shared database may hold older ones).
	dead, err := ob.DeadLetters(ctx, outbox.DeadLetterFilter{Limit: 100000})
	if err != nil {
		return nil, err
	}
	r.Malformed = len(c.malformed)
	for _, d := range dead {
		payload, malformed := c.malformed[d.MessageID]
		switch {
		case malformed && d.Consumer == "inventory" && d.SourceTopic == topicOrderPlaced && bytes.Equal(d.Payload, payload):
			r.MalformedDead++
		case malformed, !d.DeadAt.Before(start): // stored wrong or by another consumer; or an order given up on
			r.OtherDead++
			r.OtherDeadLetters = append(r.OtherDeadLetters, fmt.Sprintf("%s of %s from %q (malformed: %t), %d attempts, permanent %t: %s",
				d.MessageID, d.Consumer, d.SourceTopic, malformed, d.Attempts, d.Permanent, d.Reason))
		}
	}
	return r, nil
}

func queryStrings(ctx context.Context, db *sql.DB, query string, args ...any) ([]string, error) {
	rows, err := db.QueryContext(ctx, query, args...)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	var out []string
	for rows.Next() {
		var s string
		if err := rows.Scan(&s); err != nil {
			return nil, err
		}
		out = append(out, s)
	}
	return out, rows.Err()
}

func (r *chaosReport) print(out io.Writer) {
	var crashes int64
	var at []string
	for _, p := range failpoints {
		crashes += r.Crashes[p]
		at = append(at, fmt.Sprintf("%s %d", p, r.Crashes[p]))
	}
	verdict := func(n int) string {
		if n == 0 {
			return "must be 0"
		}
		return "MUST BE 0"
	}
	row := func(label string, n any, note string) {
		fmt.Fprintln(out, strings.TrimRight(fmt.Sprintf("  %-32s %7v   %s", label, n, note), " "))
	}
	fmt.Fprintf(out, "\nReconciliation after %s\n", r.Took.Round(100*time.Millisecond))
	row("orders placed (HTTP 201)", r.Placed, "")
	row("orders retried (same key)", r.Retries, fmt.Sprintf("after their 201, as if it was lost: %d placed a second order, must be 0", r.RetryNewOrder))
	row("orders final", r.Final, fmt.Sprintf("paid %d, rejected %d (out of stock), cancelled %d (not paid in time)", r.Paid, r.Rejected, r.Cancelled))
	row("events published (distinct IDs)", r.EventsPublished, fmt.Sprintf("want %d: OrderPlaced, StockReserved/Rejected, PaymentCaptured/TimedOut", r.EventsExpected))
	row("copies sent to the broker", r.CopiesSent, fmt.Sprintf("incl. %d extra copies from the broker, and re-sends with the same ID", r.InjectedDuplicates))
	row("copies delivered to handlers", r.Delivered, fmt.Sprintf("= handler runs + duplicates suppressed + %d that failed before the handler", r.Aborted))
	row("duplicates suppressed", r.Duplicates, "copies acked without running the handler")
	row("handler runs", r.Runs, fmt.Sprintf("%d failed on purpose after their writes, rolled back; malformed messages fail to decode", r.Failures))
	row("consumer crashes", crashes+r.Restarts, fmt.Sprintf("%d kills and restarts; at a step: %s", r.Restarts, strings.Join(at, ", ")))
	row("business effects applied", r.Decisions+r.Payments+r.Receipts+r.StatusRows, "")
	row("stock reservations/rejections", r.Decisions, fmt.Sprintf("want %d", r.Final))
	row("payments", r.Payments, fmt.Sprintf("want %d", r.Paid))
	row("receipts e-mailed", r.Receipts, fmt.Sprintf("want %d (%d repeated sends skipped by the applier)", r.Paid, r.ReceiptRepeats))
	row("order status changes", r.StatusRows, fmt.Sprintf("want %d", r.Final+r.Paid+r.Cancelled))
	row("stock units unaccounted", r.StockUnaccounted, "must be 0")
	row("malformed messages sent", r.Malformed, "undecodable, ahead of and among the orders")
	row("dead letters of them", r.MalformedDead, fmt.Sprintf("want %d: one each, inventory's, with its payload", r.Malformed))
	row("other dead letters", r.OtherDead, verdict(r.OtherDead))
	for _, d := range r.OtherDeadLetters {
		fmt.Fprintf(out, "      %s\n", d)
	}
	row("paid and also cancelled", r.PaidAndCancelled, verdict(r.PaidAndCancelled))
	row("lost", r.Lost, verdict(r.Lost))
	row("applied twice", r.AppliedTwice, verdict(r.AppliedTwice))
	if r.ok() {
		fmt.Fprintln(out, "\nOK: every order final, every effect applied exactly once, every malformed message a dead letter")
	} else {
		fmt.Fprintln(out, "\nFAILED: the numbers do not reconcile")
	}
}
