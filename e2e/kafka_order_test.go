package e2e

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"math/rand/v2"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/watermill-outbox/outbox"
	"github.com/watermill-outbox/outbox/drivers/outboxpgx"
	"github.com/watermill-outbox/outbox/drivers/postgres"
	"github.com/watermill-outbox/outbox/internal/brokertest"
	"github.com/watermill-outbox/outbox/internal/pgtest"
	"github.com/watermill-outbox/outbox/internal/routertest"
	"github.com/watermill-outbox/outbox/middleware"
)

// TestKafkaOrderPerKey: effects recorded with one ordering key (an account, here) reach a
// downstream consumer group in the order their transactions committed, on Kafka, whose order is
// per partition: the partitioning marshaler makes the ordering key the message key, so that one
// key's effects share a partition. Commands for the same account are handled concurrently by two
// Routers (database/sql and pgx forms) in one consumer group; the Publisher in front of the
// broker refuses some sends and loses the answer of others (the broker has the message, the
// outbox hears an error), handlers fail after recording, and 30% of the commands are sent twice,
// so that effects go out on the fast path, on redelivery and by the relay. Without the mapping
// (watermill-kafka's DefaultMarshaler, no key) the same run loses the order: the test checks that
// too, so that it is known to be able to fail.
func TestKafkaOrderPerKey(t *testing.T) {
	t.Run("ordering key as partition key", func(t *testing.T) {
		inversions, used, report := runKafkaOrder(t, kafkaMarshaler)
		if inversions > 0 {
			t.Errorf("effects of one ordering key reached the downstream consumer out of commit order: %d inversions; %s", inversions, report)
		}
		// One partition for everything keeps the order too, and serialises every consumer.
		if used < 4 {
			t.Errorf("the effects of %d accounts went to %d partitions of %d: the ordering key does not pick the partition; %s",
				accounts, used, brokertest.KafkaPartitions, report)
		}
		t.Log(report)
	})
	t.Run("control: no partition key", func(t *testing.T) {
		inversions, _, report := runKafkaOrder(t, kafka.DefaultMarshaler{})
		if inversions == 0 {
			t.Errorf("with effects spread over the partitions at random, every key's effects still arrived in order: the test cannot tell; %s", report)
		}
		t.Log(report)
	})
}

const (
	commandsTopic = "account-commands"
	eventsTopic   = "account-events"
	accounts      = 12
)

// runKafkaOrder runs the commands through the two Routers, whose Publishers use marshaler,
// then reads every event downstream and returns how many times, per account, an event arrived
// after one that committed later (the first copy of each UUID counts), and how many partitions
// the events used.
func runKafkaOrder(t *testing.T, marshaler kafka.MarshalerUnmarshaler) (inversions, used int, report string) {
	const commands = 360
	srv, err := brokertest.Start(brokertest.Kafka)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(srv.Close)
	b := broker{kind: brokertest.Kafka, addr: srv.Addr()}
	dsn := pgtest.DSN(t)
	db, err := sql.Open("postgres", dsn)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = db.Close() })
	if _, err := db.Exec(`CREATE TABLE accounts (id text PRIMARY KEY, version int NOT NULL)`); err != nil {
		t.Fatal(err)
	}
	for i := 0; i < accounts; i++ {
		if _, err := db.Exec(`INSERT INTO accounts VALUES ($1, 0)`, fmt.Sprintf("account-%d", i)); err != nil {
			t.Fatal(err)
		}
	}
	admin, closeAdmin, err := b.kafkaSubscriber("admin")
	if err != nil {
		t.Fatal(err)
	}
	for _, topic := range []string{commandsTopic, eventsTopic} {
		if err := admin.(message.SubscribeInitializer).SubscribeInitialize(topic); err != nil {
			t.Fatalf("create %s: %v", topic, err)
		}
	}
	closeAdmin()

	pub, err := kafka.NewPublisher(kafka.PublisherConfig{Brokers: []string{b.addr}, Marshaler: marshaler,
		OverwriteSaramaConfig: kafkaProducerConfig()}, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = pub.Close() })
	flaky := &faultyPublisher{Publisher: pub, r: rand.New(rand.NewPCG(3, 4))}
	var handlerFailures atomic.Int32
	failRand := rand.New(rand.NewPCG(5, 6))
	var failMu sync.Mutex
	cfg := outbox.Config{Publisher: flaky, Logger: watermill.NopLogger{},
		RelayInterval: 100 * time.Millisecond, RelayGrace: 500 * time.Millisecond, PublishTimeout: 5 * time.Second,
		RetryDelay: 20 * time.Millisecond, RetryDelayMax: 200 * time.Millisecond}
	sqlCfg := cfg
	sqlCfg.DB, sqlCfg.Driver = db, postgres.Driver{}
	obSQL, err := outbox.New(sqlCfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = obSQL.Close() })
	if err := obSQL.Migrate(context.Background()); err != nil {
		t.Fatal(err)
	}
	pool, err := pgxpool.New(context.Background(), dsn)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	obPgx, err := outboxpgx.New(pool, cfg, outboxpgx.WithConcurrency(outboxpgx.Optimistic))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = obPgx.Close() })
	type write func(ctx context.Context, query string, args ...any) (int, error)
	routers := []struct {
		ob    *outbox.Outbox
		write write
	}{
		{obSQL, func(ctx context.Context, query string, args ...any) (n int, err error) {
			err = outbox.Tx(ctx).QueryRowContext(ctx, query, args...).Scan(&n)
			return n, err
		}},
		{obPgx, func(ctx context.Context, query string, args ...any) (n int, err error) {
			err = outboxpgx.Tx(ctx).QueryRow(ctx, query, args...).Scan(&n)
			return n, err
		}},
	}
	for i, rt := range routers {
		routertest.RunOutbox(t, rt.ob)
		sub, closeSub, err := b.kafkaSubscriber("apply")
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(closeSub)
		r := routertest.NewRouter(t, watermill.NopLogger{})
		r.AddConsumerHandler(fmt.Sprintf("apply-%d", i), commandsTopic, sub, func(msg *message.Message) error {
			var cmd struct{ N int }
			if err := json.Unmarshal(msg.Payload, &cmd); err != nil {
				return err
			}
			account := fmt.Sprintf("account-%d", cmd.N%accounts)
			ctx := msg.Context()
			// The row lock orders the transactions of one account: version is its commit order.
			version, err := rt.write(ctx, `UPDATE accounts SET version = version + 1 WHERE id = $1 RETURNING version`, account)
			if err != nil {
				return err
			}
			ev := message.NewMessage(uuid.NewString(), []byte(account+" "+strconv.Itoa(version)))
			if err := outbox.Publish(outbox.WithOrderingKey(ctx, account), eventsTopic, ev); err != nil {
				return err
			}
			failMu.Lock()
			fail := failRand.IntN(100) < 10
			failMu.Unlock()
			if fail {
				handlerFailures.Add(1)
				return routertest.ErrInjected // rolled back: version and event with it
			}
			return nil
		}).AddMiddleware(middleware.New(rt.ob))
		routertest.RunRouter(t, r)
	}
	// Both Routers' subscribers share the partitions before the commands go out.
	waitKafkaGroup(t, b, "apply", len(routers))

	producer, closeP, err := b.kafkaPublisher()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(closeP)
	routertest.Produce(t, commands, 30, func(m *message.Message) error { return producer.Publish(commandsTopic, m) })
	routertest.WaitUntil(t, "every command applied and every event dispatched", func() (bool, string) {
		applied := count(t, db, `SELECT coalesce(sum(version), 0) FROM accounts`)
		pending := count(t, db, `SELECT count(*) FROM outbox_effects_all`)
		return applied == commands && pending == 0, fmt.Sprintf("%d of %d commands applied, %d effects pending", applied, commands, pending)
	})

	// The downstream consumer reads the events once they are all on the broker: it fetches every
	// partition's backlog at once, and interleaves the partitions as Sarama's partition consumers
	// hand them over.
	down, closeDown, err := b.kafkaSubscriber("downstream")
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	msgs, err := down.Subscribe(ctx, eventsTopic)
	if err != nil {
		t.Fatal(err)
	}
	seen := map[string]bool{}
	last := map[string]int{}
	partitions := map[string]map[int32]bool{}
	copies := 0
	deadline := time.After(routertest.Timeout)
	for len(seen) < commands {
		select {
		case m := <-msgs:
			m.Ack()
			if seen[m.UUID] {
				copies++
				continue
			}
			seen[m.UUID] = true
			account, v, _ := strings.Cut(string(m.Payload), " ")
			version, _ := strconv.Atoi(v)
			if got := m.Metadata.Get(outbox.MetadataOrderingKey); got != account {
				t.Errorf("event %s of %s carries ordering key %q", m.UUID, account, got)
			}
			if p, ok := kafka.MessagePartitionFromCtx(m.Context()); ok {
				if partitions[account] == nil {
					partitions[account] = map[int32]bool{}
				}
				partitions[account][p] = true
			}
			if version < last[account] {
				inversions++
			}
			last[account] = max(last[account], version)
		case <-deadline:
			cancel()
			closeDown()
			t.Fatalf("the downstream consumer got %d of %d events within %s", len(seen), commands, routertest.Timeout)
		}
	}
	cancel()
	closeDown()
	spread := make([]int, 0, accounts)
	all := map[int32]bool{}
	for _, ps := range partitions {
		spread = append(spread, len(ps))
		for p := range ps {
			all[p] = true
		}
	}
	sort.Ints(spread)
	return inversions, len(all), fmt.Sprintf("%d commands (+30%% sent twice) over %d accounts: partitions per account %v, %d partitions in all; %d events arrived out of commit order, %d copies; %d sends refused and %d answers lost by the Publisher, %d handler failures",
		commands, accounts, spread, len(all), inversions, copies, flaky.refused.Load(), flaky.lost.Load(), handlerFailures.Load())
}

// faultyPublisher stands in front of the broker's Publisher: it refuses some sends (the broker
// never sees them) and reports others as failed after the broker took them (a lost answer), so
// that effects are retried on redelivery and by the relay, and some go out twice.
type faultyPublisher struct {
	message.Publisher
	mu            sync.Mutex
	r             *rand.Rand
	refused, lost atomic.Int32
}

var errFaultInjected = errors.New("injected publish failure")

func (p *faultyPublisher) Publish(topic string, msgs ...*message.Message) error {
	if topic != eventsTopic {
		return p.Publisher.Publish(topic, msgs...)
	}
	p.mu.Lock()
	x := p.r.IntN(100)
	p.mu.Unlock()
	switch {
	case x < 15:
		p.refused.Add(1)
		return errFaultInjected
	case x < 25:
		if err := p.Publisher.Publish(topic, msgs...); err != nil {
			return err
		}
		p.lost.Add(1)
		return errFaultInjected
	}
	return p.Publisher.Publish(topic, msgs...)
}
