package main

import (
	"fmt"
	"os"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	wnats "github.com/ThreeDotsLabs/watermill-nats/v2/pkg/nats"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
)

// outTopic is the broker topic every contender publishes its outgoing message to. JetStream
// stream names cannot hold dots, and watermill-nats names the stream after the topic.
const outTopic = "bench_out"

// streamMaxMsgs bounds the stream of outTopic.
const streamMaxMsgs = 10_000

// Metadata the workload puts on every outgoing message, so that the recorder can tell which
// delivery caused it.
const (
	mdIndex  = "bench_i"   // index of the delivery (in the run's delivery list) that produced it
	mdSource = "bench_src" // ID of the incoming message
)

// broker is an in-process NATS server with JetStream (file storage, in a temp dir), the same for
// every contender: a real broker whose publish is synchronous (the publisher waits for the
// stream's ack), and which does not share PostgreSQL's WAL or fsyncs.
type broker struct {
	ns   *server.Server
	dir  string
	nc   *nats.Conn
	js   nats.JetStreamContext
	pub  *wnats.Publisher
	rec  *recorder
	conn []*nats.Conn
	// nullCount counts what the null publisher took, when there is no broker (newNullBroker).
	nullCount atomic.Int64
}

// newNullBroker is the broker of -broker none: no server; its publisher records and counts each
// message and returns at once.
func newNullBroker() *broker { return &broker{rec: &recorder{}} }

func startBroker() (*broker, error) {
	dir, err := os.MkdirTemp("", "outbox-bench-nats-")
	if err != nil {
		return nil, err
	}
	ns, err := server.NewServer(&server.Options{JetStream: true, StoreDir: dir, DontListen: true, NoLog: true, NoSigs: true})
	if err != nil {
		return nil, err
	}
	go ns.Start()
	if !ns.ReadyForConnections(10 * time.Second) {
		return nil, fmt.Errorf("NATS not ready")
	}
	b := &broker{ns: ns, dir: dir, rec: &recorder{}}
	if b.nc, err = nats.Connect("", nats.InProcessServer(ns), nats.Name("bench-admin")); err != nil {
		return nil, err
	}
	if b.js, err = b.nc.JetStream(); err != nil {
		return nil, err
	}
	// The stream keeps only the latest messages (the recorder counts them on the client side), so
	// that the broker's storage, in this process and on this disk, does not grow with the run.
	if _, err := b.js.AddStream(&nats.StreamConfig{Name: outTopic, Subjects: []string{outTopic}, Storage: nats.FileStorage,
		MaxMsgs: streamMaxMsgs, Discard: nats.DiscardOld}); err != nil {
		return nil, err
	}
	pc, err := nats.Connect("", nats.InProcessServer(ns), nats.Name("bench-pub"))
	if err != nil {
		return nil, err
	}
	b.conn = append(b.conn, pc)
	b.pub, err = wnats.NewPublisherWithNatsConn(pc, wnats.PublisherPublishConfig{
		Marshaler:         &wnats.NATSMarshaler{},
		SubjectCalculator: wnats.DefaultSubjectCalculator,
		// No Nats-Msg-Id deduplication: what reaches the broker twice is counted, not hidden.
		JetStream: wnats.JetStreamConfig{TrackMsgId: false},
	}, nil)
	if err != nil {
		return nil, err
	}
	return b, nil
}

// publisher is the broker's publisher, recorded: every contender publishes through it.
func (b *broker) publisher() message.Publisher { return recordingPublisher{b: b} }

// purge empties the stream between runs.
func (b *broker) purge() error {
	if b.js == nil {
		return nil
	}
	return b.js.PurgeStream(outTopic)
}

// streamMsgs is how many messages the stream holds.
func (b *broker) streamMsgs() (uint64, error) {
	si, err := b.js.StreamInfo(outTopic)
	if err != nil {
		return 0, err
	}
	return si.State.Msgs, nil
}

func (b *broker) close() {
	if b.ns == nil {
		return
	}
	_ = b.pub.Close()
	for _, c := range b.conn {
		c.Close()
	}
	b.nc.Close()
	b.ns.Shutdown()
	b.ns.WaitForShutdown()
	_ = os.RemoveAll(b.dir)
}

type recordingPublisher struct{ b *broker }

func (p recordingPublisher) Publish(topic string, msgs ...*message.Message) error {
	if p.b.pub == nil {
		p.b.nullCount.Add(int64(len(msgs)))
	} else if err := p.b.pub.Publish(topic, msgs...); err != nil {
		return err
	}
	p.b.rec.published(msgs)
	return nil
}

func (p recordingPublisher) Close() error { return nil }

// recorder remembers, for the current run, when the outgoing message of each delivery reached the
// broker, and every (source, UUID) pair that did, for the safety checks.
type recorder struct {
	run atomic.Pointer[runRecord]
}

type runRecord struct {
	start   time.Time
	pubAt   []atomic.Int64 // ns since start, per delivery index; 0 = not yet
	count   atomic.Int64   // outgoing messages published in this run
	mu      sync.Mutex
	bySrc   map[string]map[string]int // source message ID -> outgoing UUID -> copies
	keepSrc bool
}

func (r *recorder) begin(n int, keepSrc bool) *runRecord {
	rr := &runRecord{start: time.Now(), pubAt: make([]atomic.Int64, n), keepSrc: keepSrc}
	if keepSrc {
		rr.bySrc = map[string]map[string]int{}
	}
	r.run.Store(rr)
	return rr
}

func (r *recorder) end() { r.run.Store(nil) }

func (r *recorder) published(msgs []*message.Message) {
	rr := r.run.Load()
	if rr == nil {
		return
	}
	now := int64(time.Since(rr.start))
	if now == 0 {
		now = 1
	}
	for _, m := range msgs {
		rr.count.Add(1)
		if i, err := strconv.Atoi(m.Metadata.Get(mdIndex)); err == nil && i >= 0 && i < len(rr.pubAt) {
			rr.pubAt[i].CompareAndSwap(0, now)
		}
		if rr.keepSrc {
			src := m.Metadata.Get(mdSource)
			rr.mu.Lock()
			if rr.bySrc[src] == nil {
				rr.bySrc[src] = map[string]int{}
			}
			rr.bySrc[src][m.UUID]++
			rr.mu.Unlock()
		}
	}
}
