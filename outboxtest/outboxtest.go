// Package outboxtest tests handlers with the outbox switched on: a PostgreSQL for the tests, a
// Publisher that records what was sent, a way to run one message through a unit of work and see
// what it recorded, and CrashMatrix, which runs your handler on your messages with a crash at
// every step of the unit of work, with concurrent and later copies, and fails the test if a
// business change happened twice, or a side effect was lost or sent under a second ID.
//
// Call Main from TestMain:
//
//	func TestMain(m *testing.M) { os.Exit(outboxtest.Main(m)) }
//
// It starts a throwaway PostgreSQL server (initdb and postgres from the PATH, or
// /usr/lib/postgresql/*/bin; as root it runs as the OS user postgres) once per test binary, or
// uses the server in OUTBOX_TEST_DSN (the role must be allowed to CREATE DATABASE); each test
// gets a database of its own. It fails the run, never skips it, when it cannot, and reports
// goroutines the tests leaked.
package outboxtest

import (
	"cmp"
	"context"
	"database/sql"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	_ "github.com/lib/pq" // the database/sql driver of the test databases

	"github.com/watermill-outbox/outbox"
	"github.com/watermill-outbox/outbox/drivers/postgres"
	"github.com/watermill-outbox/outbox/internal/pgtest"
	"github.com/watermill-outbox/outbox/outboxdriver"
	"github.com/watermill-outbox/outbox/store"
)

// EnvDSN names a PostgreSQL server to use instead of starting one.
const EnvDSN = "OUTBOX_TEST_DSN"

// Main provisions PostgreSQL, runs the tests, stops it and checks for leaked goroutines. Call it
// from TestMain: os.Exit(outboxtest.Main(m)).
func Main(m *testing.M) int { return pgtest.Run(m) }

// DB returns a fresh database of its own for the test (lib/pq), dropped when the test ends.
func DB(t testing.TB) *sql.DB { return pgtest.DB(t) }

// DSN returns the connection string of a fresh database for the test, dropped when it ends.
func DSN(t testing.TB) string { return pgtest.DSN(t) }

// Sent is one message a Recorder was given.
type Sent struct {
	Topic   string
	Message *message.Message
}

// Recorder is a message.Publisher that keeps what it is given, in order. Fail makes it refuse
// messages, as a broker that is down would. It is safe for concurrent use.
type Recorder struct {
	mu   sync.Mutex
	sent []Sent
	fail error
}

// Publish records msgs, or returns the error set with Fail.
func (r *Recorder) Publish(topic string, msgs ...*message.Message) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.fail != nil {
		return r.fail
	}
	for _, m := range msgs {
		c := m.Copy()
		r.sent = append(r.sent, Sent{Topic: topic, Message: c})
	}
	return nil
}

// Close does nothing.
func (r *Recorder) Close() error { return nil }

// Fail makes Publish return err from now on; Fail(nil) ends the outage.
func (r *Recorder) Fail(err error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.fail = err
}

// All returns every message sent so far, in order.
func (r *Recorder) All() []Sent {
	r.mu.Lock()
	defer r.mu.Unlock()
	return slices.Clone(r.sent)
}

// Messages returns the messages sent to topic so far, in order.
func (r *Recorder) Messages(topic string) []*message.Message {
	var out []*message.Message
	for _, s := range r.All() {
		if s.Topic == topic {
			out = append(out, s.Message)
		}
	}
	return out
}

// Harness is an Outbox on a fresh test database with a Recorder as its Publisher.
type Harness struct {
	t   testing.TB
	DB  *sql.DB
	Pub *Recorder
	Ob  *outbox.Outbox

	database *Database
	// audit is the table of the audit of deleted effects (installAudit), empty without one.
	audit string

	failpoint func(ctx context.Context, point string) error
	fpMu      sync.Mutex
}

// New returns a Harness: a fresh database with the outbox tables, and an Outbox on it whose
// Publisher is a Recorder. cfg sets what else the Outbox needs (PoisonTopic, Retention, ...);
// its DB, Driver, Publisher and Failpoint are the harness's. EffectRetention defaults to an hour,
// so that what was dispatched can be read back. setup, if not nil, creates the business tables.
func New(t testing.TB, cfg outbox.Config, setup func(ctx context.Context, db *sql.DB) error) *Harness {
	t.Helper()
	return NewWith(t, nil, cfg, setup)
}

// Opener builds the Outbox of a harness on the test database dsn from cfg, whose Publisher and
// Failpoint are the harness's and whose DB and Driver are unset. The default (nil) is
// outbox.New on database/sql (lib/pq) with the postgres driver; the pgx form opens a pool on dsn
// and calls outboxpgx.New (its close goes in t.Cleanup).
type Opener func(t testing.TB, dsn string, cfg outbox.Config) (*outbox.Outbox, error)

// Database is a database other than PostgreSQL for a harness: a driver's own tests run the
// crash matrix on it (the MySQL driver's module, with its server and database/sql driver).
type Database struct {
	// Open returns a fresh, empty database and its DSN (given to an Opener); it registers
	// their cleanup with t.
	Open func(t testing.TB) (db *sql.DB, dsn string)
	// Driver is the outbox driver of the database/sql form on it.
	Driver outboxdriver.Driver
	// Effects returns the query of every effect committed for a message, pending or
	// dispatched, with its arguments consumer and message ID, as rows of (seq, kind, topic,
	// uuid, payload, ordering_key), for the tables of schema (empty when not set) and prefix.
	Effects func(schema, prefix string) string
	// Delayed returns the query of the delayed effects of a message that wait for their due
	// time (not moved into the effects yet), as Effects does; nil when the database keeps none.
	Delayed func(schema, prefix string) string
}

// NewWith is New with the Outbox built by open (nil: the database/sql form).
func NewWith(t testing.TB, open Opener, cfg outbox.Config, setup func(ctx context.Context, db *sql.DB) error) *Harness {
	t.Helper()
	return NewOn(t, nil, open, cfg, setup)
}

// NewOn is NewWith on database (nil: PostgreSQL, started by Main).
func NewOn(t testing.TB, database *Database, open Opener, cfg outbox.Config, setup func(ctx context.Context, db *sql.DB) error) *Harness {
	t.Helper()
	return newHarness(t, database, open, cfg, setup, false)
}

// newHarness is NewOn; with deleteSent the Outbox keeps EffectRetention 0 (sent effects deleted,
// the default) and, on PostgreSQL, an audit keeps what was committed and deleted readable.
func newHarness(t testing.TB, database *Database, open Opener, cfg outbox.Config, setup func(ctx context.Context, db *sql.DB) error,
	deleteSent bool) *Harness {
	t.Helper()
	if deleteSent && database != nil {
		t.Fatal("outboxtest: DeleteSent runs on PostgreSQL only: the audit of deleted effects is PostgreSQL's triggers")
	}
	var db *sql.DB
	var dsn string
	if database != nil {
		db, dsn = database.Open(t)
	} else {
		dsn = DSN(t)
		var err error
		if db, err = sql.Open("postgres", dsn); err != nil {
			t.Fatalf("outboxtest: open: %v", err)
		}
		t.Cleanup(func() { _ = db.Close() })
	}
	h := &Harness{t: t, DB: db, Pub: &Recorder{}, database: database}
	if setup != nil {
		if err := setup(context.Background(), h.DB); err != nil {
			t.Fatalf("outboxtest: set up the business tables: %v", err)
		}
	}
	cfg.Publisher = h.Pub
	if open == nil {
		cfg.DB, cfg.Driver = h.DB, postgres.Driver{}
		if database != nil {
			cfg.Driver = database.Driver
		}
		open = func(_ testing.TB, _ string, cfg outbox.Config) (*outbox.Outbox, error) { return outbox.New(cfg) }
	}
	if deleteSent {
		cfg.EffectRetention = 0
	} else if cfg.EffectRetention == 0 {
		cfg.EffectRetention = time.Hour
	}
	if cfg.DuplicateWait == 0 {
		cfg.DuplicateWait = 20 * time.Millisecond // the copies of the tests need not wait long
	}
	if cfg.RetryDelay == 0 {
		cfg.RetryDelay = -1
	}
	cfg.Failpoint = func(ctx context.Context, point string) error {
		h.fpMu.Lock()
		fp := h.failpoint
		h.fpMu.Unlock()
		if fp == nil {
			return nil
		}
		return fp(ctx, point)
	}
	ob, err := open(t, dsn, cfg)
	if err != nil {
		t.Fatalf("outboxtest: %v", err)
	}
	if err := ob.Migrate(context.Background()); err != nil {
		t.Fatalf("outboxtest: %v", err)
	}
	h.Ob = ob
	if deleteSent {
		h.installAudit()
	}
	return h
}

// installAudit keeps, by triggers, every effect that leaves the tables otherwise than by a
// rollback: an effect row deleted (sent and not kept, or moved), and the inline effects a claim
// held before an update cleared or changed them (sent: marked, also by the claim of another
// message that a mark rode on). What was committed and then deleted stays readable for
// committedEffects. Each entry carries its transaction's ID, and so does every claim inserted:
// rode tells whether a message's mark was written by another message's claim.
func (h *Harness) installAudit() {
	h.t.Helper()
	cfg := h.Ob.Config()
	schema := cmp.Or(cfg.Schema, postgres.DefaultSchema)
	n, err := postgres.NewNames(schema, cfg.TablePrefix)
	if err != nil {
		h.t.Fatalf("outboxtest: %v", err)
	}
	q := func(name string) string { return `"` + schema + `"."` + cfg.TablePrefix + name + `"` }
	h.audit = q("crash_audit")
	for _, stmt := range []string{
		`CREATE TABLE ` + h.audit + ` (what text NOT NULL, consumer text, source text, seq int, kind text, topic text, uuid text,
			payload bytea, ordering_key text, effects bytea, xid bigint NOT NULL DEFAULT txid_current())`,
		`CREATE FUNCTION ` + q("crash_audit_row") + `() RETURNS trigger LANGUAGE plpgsql AS $$
		BEGIN
			INSERT INTO ` + h.audit + ` (what, consumer, source, seq, kind, topic, uuid, payload, ordering_key)
				VALUES ('row', OLD.source_consumer, OLD.source_id, OLD.seq, OLD.kind, OLD.topic, OLD.uuid, OLD.payload, OLD.ordering_key);
			RETURN NULL;
		END $$`,
		`CREATE TRIGGER crash_audit_row AFTER DELETE ON ` + n.Effects + ` FOR EACH ROW EXECUTE FUNCTION ` + q("crash_audit_row") + `()`,
		`CREATE FUNCTION ` + q("crash_audit_inline") + `() RETURNS trigger LANGUAGE plpgsql AS $$
		BEGIN
			INSERT INTO ` + h.audit + ` (what, consumer, source, effects) VALUES ('inline', OLD.consumer, OLD.message_id, OLD.effects);
			RETURN NULL;
		END $$`,
		`CREATE TRIGGER crash_audit_inline AFTER UPDATE OF effects ON ` + n.Processed + ` FOR EACH ROW
			WHEN (OLD.effects IS NOT NULL AND NEW.effects IS DISTINCT FROM OLD.effects) EXECUTE FUNCTION ` + q("crash_audit_inline") + `()`,
		`CREATE TRIGGER crash_audit_gone AFTER DELETE ON ` + n.Processed + ` FOR EACH ROW
			WHEN (OLD.effects IS NOT NULL) EXECUTE FUNCTION ` + q("crash_audit_inline") + `()`,
		`CREATE FUNCTION ` + q("crash_audit_claim") + `() RETURNS trigger LANGUAGE plpgsql AS $$
		BEGIN
			INSERT INTO ` + h.audit + ` (what, consumer, source) VALUES ('claim', NEW.consumer, NEW.message_id);
			RETURN NULL;
		END $$`,
		`CREATE TRIGGER crash_audit_claim AFTER INSERT ON ` + n.Processed + ` FOR EACH ROW EXECUTE FUNCTION ` + q("crash_audit_claim") + `()`,
	} {
		if _, err := h.DB.Exec(stmt); err != nil {
			h.t.Fatalf("outboxtest: the audit of deleted effects: %v", err)
		}
	}
}

// audited returns the effects of the message that the audit kept (committed, then deleted or
// cleared), those in have left out.
func (h *Harness) audited(consumer, id string, have []seqEffect) []seqEffect {
	h.t.Helper()
	type key struct {
		seq             int
		topic, uuid, pl string
	}
	seen := map[key]bool{}
	for _, se := range have {
		seen[key{se.seq, se.e.Topic, se.e.UUID, string(se.e.Payload)}] = true
	}
	rows, err := h.DB.Query(`SELECT seq, kind, topic, uuid, payload, ordering_key, effects FROM `+h.audit+`
		WHERE what <> 'claim' AND consumer = $1 AND source = $2`, consumer, id)
	if err != nil {
		h.t.Fatalf("outboxtest: read the audit of deleted effects: %v", err)
	}
	defer rows.Close()
	var out []seqEffect
	add := func(se seqEffect) {
		if k := (key{se.seq, se.e.Topic, se.e.UUID, string(se.e.Payload)}); !seen[k] {
			seen[k] = true
			out = append(out, se)
		}
	}
	for rows.Next() {
		var seq sql.NullInt64
		var kind, topic, uuid, okey sql.NullString
		var payload, blob []byte
		if err := rows.Scan(&seq, &kind, &topic, &uuid, &payload, &okey, &blob); err != nil {
			h.t.Fatalf("outboxtest: %v", err)
		}
		if blob == nil {
			add(seqEffect{seq: int(seq.Int64), e: Effect{Kind: kind.String, Topic: topic.String, UUID: uuid.String, Payload: payload, OrderingKey: okey.String}})
			continue
		}
		inline, err := store.DecodeEffects(blob, outbox.Source{Consumer: consumer, ID: id})
		if err != nil {
			h.t.Fatalf("outboxtest: decode the audited inline effects of %q for %q: %v", id, consumer, err)
		}
		for _, e := range inline {
			add(seqEffect{seq: e.Seq, e: Effect{Kind: e.Kind, Topic: e.Topic, UUID: e.UUID, Payload: e.Payload, OrderingKey: e.OrderingKey}})
		}
	}
	if err := rows.Err(); err != nil {
		h.t.Fatalf("outboxtest: %v", err)
	}
	return out
}

// rode tells whether the inline effects of the message carrier were cleared in the transaction
// that inserted the claim of the message by (its mark rode on that claim), by the audit.
func (h *Harness) rode(consumer, carrier, by string) bool {
	h.t.Helper()
	var ok bool
	if err := h.DB.QueryRow(`SELECT EXISTS (SELECT FROM `+h.audit+` c JOIN `+h.audit+` m ON m.xid = c.xid
		WHERE c.what = 'claim' AND c.consumer = $1 AND c.source = $3 AND m.what = 'inline' AND m.consumer = $1 AND m.source = $2)`,
		consumer, carrier, by).Scan(&ok); err != nil {
		h.t.Fatalf("outboxtest: read the audit of deleted effects: %v", err)
	}
	return ok
}

// setFailpoint makes the harness's Outbox call fp at each step (nil: none).
func (h *Harness) setFailpoint(fp func(ctx context.Context, point string) error) {
	h.fpMu.Lock()
	defer h.fpMu.Unlock()
	h.failpoint = fp
}

// Effect is a side effect as it was committed.
type Effect struct {
	Kind        string // outbox.KindPublish for messages, else the applier's name
	Topic       string
	UUID        string
	Payload     []byte
	Metadata    map[string]string
	OrderingKey string
	// Delayed: the effect was recorded with a delay and was still waiting for its due time when
	// it was read (not yet moved to the pending effects by a relay).
	Delayed bool
}

// Result is what one unit of work did.
type Result struct {
	// Err is what Handle returned (nil: the message would be acked).
	Err error
	// Committed tells whether the message is recorded as processed.
	Committed bool
	// Effects are the side effects committed for the message, in order (by every unit of work
	// of this message so far: one commit at most).
	Effects []Effect
	// Sent are the messages the Recorder got while the unit of work ran.
	Sent []Sent
}

// Run handles msg once as consumer, as the middleware would, and returns what the unit of work
// committed and sent. The handler's writes go through outbox.Tx(msg.Context()).
func (h *Harness) Run(consumer string, msg *message.Message, handler message.HandlerFunc) Result {
	h.t.Helper()
	before := len(h.Pub.All())
	err := h.Ob.Handle(msg.Copy(), outbox.HandleParams{Consumer: consumer, MessageID: msg.UUID}, handler)
	h.Ob.FlushMarks()
	res := Result{Err: err, Sent: h.Pub.All()[before:]}
	src := outbox.Source{Consumer: consumer, ID: msg.UUID}
	ctx := context.Background()
	committed, serr := h.Ob.Store().MessageIsProcessed(ctx, src)
	if serr != nil {
		h.t.Fatalf("outboxtest: %v", serr)
	}
	res.Committed = committed
	res.Effects = h.committedEffects(consumer, msg.UUID)
	return res
}

// committedEffects reads every effect committed for the message, pending or dispatched: effect
// rows, dispatched rows kept for EffectRetention, delayed effects not due yet, and effects kept
// inline in the claim (the pgx form's optimistic mode), in the order they were recorded.
func (h *Harness) committedEffects(consumer, id string) []Effect {
	h.t.Helper()
	cfg := h.Ob.Config()
	if h.database != nil {
		all := h.readEffects(h.database.Effects(cfg.Schema, cfg.TablePrefix), consumer, id, false)
		if h.database.Delayed != nil {
			all = append(all, h.readEffects(h.database.Delayed(cfg.Schema, cfg.TablePrefix), consumer, id, true)...)
		}
		return h.sentMetadata(all)
	}
	schema := cfg.Schema
	if schema == "" {
		schema = postgres.DefaultSchema
	}
	n, err := postgres.NewNames(schema, cfg.TablePrefix)
	if err != nil {
		h.t.Fatalf("outboxtest: %v", err)
	}
	rows, err := h.DB.Query(`SELECT seq, kind, topic, uuid, payload, ordering_key, false FROM `+n.Effects+` WHERE source_consumer = $1 AND source_id = $2
		UNION ALL SELECT seq, kind, topic, uuid, payload, ordering_key, false FROM `+n.Dispatched+` WHERE source_consumer = $1 AND source_id = $2
		UNION ALL SELECT seq, kind, topic, uuid, payload, ordering_key, true FROM `+n.Delayed+` WHERE source_consumer = $1 AND source_id = $2`, consumer, id)
	if err != nil {
		h.t.Fatalf("outboxtest: read the committed effects: %v", err)
	}
	defer rows.Close()
	var all []seqEffect
	for rows.Next() {
		var se seqEffect
		e := &se.e
		if err := rows.Scan(&se.seq, &e.Kind, &e.Topic, &e.UUID, &e.Payload, &e.OrderingKey, &e.Delayed); err != nil {
			h.t.Fatalf("outboxtest: %v", err)
		}
		all = append(all, se)
	}
	if err := rows.Err(); err != nil {
		h.t.Fatalf("outboxtest: %v", err)
	}
	var blob []byte
	switch err := h.DB.QueryRow(`SELECT effects FROM `+n.Processed+` WHERE consumer = $1 AND message_id = $2 AND effects IS NOT NULL`,
		consumer, id).Scan(&blob); {
	case errors.Is(err, sql.ErrNoRows):
	case err != nil:
		h.t.Fatalf("outboxtest: read the inline effects: %v", err)
	default:
		inline, err := store.DecodeEffects(blob, outbox.Source{Consumer: consumer, ID: id})
		if err != nil {
			h.t.Fatalf("outboxtest: decode the inline effects of %q for %q: %v", id, consumer, err)
		}
		for _, e := range inline {
			all = append(all, seqEffect{seq: e.Seq, e: Effect{Kind: e.Kind, Topic: e.Topic, UUID: e.UUID, Payload: e.Payload,
				Metadata: e.Metadata, OrderingKey: e.OrderingKey}})
		}
	}
	if h.audit != "" {
		all = append(all, h.audited(consumer, id, all)...)
	}
	return h.sentMetadata(all)
}

// seqEffect is an effect with its place among its message's.
type seqEffect struct {
	seq int
	e   Effect
}

// readEffects reads the effects that query (arguments consumer and id) returns, delayed or not.
func (h *Harness) readEffects(query, consumer, id string, delayed bool) []seqEffect {
	h.t.Helper()
	rows, err := h.DB.Query(query, consumer, id)
	if err != nil {
		h.t.Fatalf("outboxtest: read the committed effects: %v", err)
	}
	defer rows.Close()
	var all []seqEffect
	for rows.Next() {
		var se seqEffect
		e := &se.e
		if err := rows.Scan(&se.seq, &e.Kind, &e.Topic, &e.UUID, &e.Payload, &e.OrderingKey); err != nil {
			h.t.Fatalf("outboxtest: %v", err)
		}
		e.Delayed = delayed
		all = append(all, se)
	}
	if err := rows.Err(); err != nil {
		h.t.Fatalf("outboxtest: %v", err)
	}
	return all
}

// sentMetadata orders the effects by seq and gives each the metadata it was sent with.
func (h *Harness) sentMetadata(all []seqEffect) []Effect {
	slices.SortStableFunc(all, func(a, b seqEffect) int { return a.seq - b.seq })
	out := make([]Effect, len(all))
	for i, se := range all {
		out[i] = se.e
	}
	// Metadata as sent: the wire copy carries it. One message may go to several topics, so the
	// copy is the one on the effect's topic.
	for i := range out {
		for _, s := range h.Pub.All() {
			if s.Topic == out[i].Topic && s.Message.UUID == out[i].UUID {
				out[i].Metadata = maps.Clone(map[string]string(s.Message.Metadata))
				break
			}
		}
	}
	return out
}

// CrashMatrix says what to run and how to count what it changed.
type CrashMatrix struct {
	// Consumer is the consumer name the messages are deduplicated under.
	Consumer string
	// Handler returns the handler under test, as the middleware would wrap it, for the database
	// of one scenario (each runs in a fresh one): build it as your service does, with db where
	// it needs the database outside the unit of work.
	Handler func(db *sql.DB) message.HandlerFunc
	// Messages are the incoming messages to try (their UUIDs are the deduplication IDs).
	Messages []*message.Message
	// Setup creates the business tables in each fresh database.
	Setup func(ctx context.Context, db *sql.DB) error
	// Applied returns how many times the business change of msg happened in db: the check is
	// that it is exactly once.
	Applied func(ctx context.Context, db *sql.DB, msg *message.Message) (int, error)
	// Config sets the rest of the Outbox's configuration, as New's cfg.
	Config outbox.Config
	// Register, if not nil, is called with each scenario's Outbox before anything runs, to
	// register the appliers the handler records effects for.
	Register func(ob *outbox.Outbox, db *sql.DB) error
	// Copies is how many copies of each message are delivered at the same moment after the
	// crash. Default: 4.
	Copies int
	// Open builds each scenario's Outbox (nil: the database/sql form); see Opener.
	Open Opener
	// Database is the database of the scenarios (nil: PostgreSQL, started by Main).
	Database *Database
	// DeleteSent runs the scenarios with EffectRetention 0, the default (sent effects are
	// deleted when marked, not kept), where the matrix otherwise keeps them for an hour to read
	// them back: triggers keep an audit of what was committed and deleted instead (PostgreSQL
	// only). Run runs from the start of each scenario, and with two messages or more each
	// scenario first delivers the next message of Messages, a carrier whose mark may ride on the
	// claim of the unit that crashes (on the database/sql form); the carrier is checked as the
	// message is.
	DeleteSent bool
}

// crashPoints are the steps of a unit of work at which CrashMatrix crashes ("" : none).
var crashPoints = []string{"", outbox.FailpointAfterClaim, outbox.FailpointAfterHandler, outbox.FailpointAfterCommit,
	outbox.FailpointAfterPublish, outbox.FailpointAfterMark}

// errCrash is the crash CrashMatrix injects.
var errCrash = errors.New("outboxtest: crash")

// Run runs each message through each scenario in a fresh database, as a subtest named after the
// message and the crash point: the first delivery crashes at the point (none, after the claim,
// the handler, the commit, a publish, the mark), then Copies copies are delivered at the same
// moment, then one more later, and the relay runs until nothing is pending. The subtest fails
// with a report if the business change did not happen exactly once, the side effects committed
// differ (by kind, topic and ordering key) from those of the run without a crash (one lost, or
// added, by the crash), a committed side effect never reached the Publisher on its topic, a crash
// point the unit of work passes was never reached (an Open that drops the Config's Failpoint),
// something reached a topic under a UUID that was never committed to it (a second ID for one
// effect, or an effect of a rolled-back attempt), or effects of one ordering key were first sent
// out of the order they were recorded in. An effect is a (topic, UUID): one message published to
// two topics is two effects, each checked.
func (c CrashMatrix) Run(t *testing.T) {
	t.Helper()
	if c.Handler == nil || c.Applied == nil || len(c.Messages) == 0 || c.Consumer == "" {
		t.Fatal("outboxtest.CrashMatrix: Consumer, Handler, Messages and Applied are required")
	}
	copies := c.Copies
	if copies <= 0 {
		copies = 4
	}
	for _, msg := range c.Messages {
		// What the run without a crash committed: every crash scenario must commit the same
		// side effects (kind, topic, ordering key), or one was lost, or added, by the crash.
		var baseline []string
		for _, point := range crashPoints {
			name := msg.UUID + "/crash-" + point
			if point == "" {
				name = msg.UUID + "/no-crash"
			}
			t.Run(name, func(t *testing.T) {
				failures, committed := c.run(t, msg, point, copies, baseline)
				if point == "" && len(failures) == 0 {
					baseline = committed
				}
				if len(failures) > 0 {
					t.Error(joinLines(failures))
				}
			})
		}
	}
}

// effectShapes returns what must be alike in the side effects of two runs of one message: their
// kind, topic and ordering key (their UUIDs and payloads may differ, drawn anew by a handler),
// sorted.
func effectShapes(effects []Effect) []string {
	out := make([]string, len(effects))
	for i, e := range effects {
		out[i] = fmt.Sprintf("%s %q key %q", e.Kind, e.Topic, e.OrderingKey)
	}
	slices.Sort(out)
	return out
}

// scenario runs one message with one crash point and returns what went wrong, with the report.
func (c CrashMatrix) scenario(t testing.TB, msg *message.Message, point string, copies int) []string {
	failures, _ := c.run(t, msg, point, copies, nil)
	return failures
}

// run is scenario, which also checks the committed side effects against baseline (those of the
// run without a crash, nil: not checked) and returns their shapes (effectShapes).
func (c CrashMatrix) run(t testing.TB, msg *message.Message, point string, copies int, baseline []string) ([]string, []string) {
	ctx := context.Background()
	h := newHarness(t, c.Database, c.Open, c.Config, c.Setup, c.DeleteSent)
	if c.Register != nil {
		if err := c.Register(h.Ob, h.DB); err != nil {
			t.Fatalf("outboxtest: Register: %v", err)
		}
	}
	handler := c.Handler(h.DB)
	var report []string
	// The relay: from the start with DeleteSent (marks ride on claims only while Run runs),
	// otherwise once every delivery is done.
	running := false
	runCtx, stop := context.WithCancel(ctx)
	done := make(chan error, 1)
	startRun := func() {
		running = true
		go func() { done <- h.Ob.Run(runCtx) }()
	}
	defer func() {
		stop()
		if running {
			<-done
		}
	}()
	var carrier *message.Message
	if c.DeleteSent {
		startRun()
		if i := slices.Index(c.Messages, msg); i >= 0 && len(c.Messages) > 1 {
			carrier = c.Messages[(i+1)%len(c.Messages)]
		}
	}
	if carrier != nil {
		// Not through h.Run, whose flush would write its mark before the next claim.
		err := h.Ob.Handle(carrier.Copy(), outbox.HandleParams{Consumer: c.Consumer, MessageID: carrier.UUID}, handler)
		report = append(report, fmt.Sprintf("carrier %s delivered first: err=%v", carrier.UUID, err))
	}
	// The first to reach the point crashes there: the first delivery, or, with DeleteSent (the
	// relay running from the start), the relay, which passes the same points (its publish, its
	// mark) with what it sends meanwhile: the effects of an ordering key, as rows, are its own
	// while it runs. So the flag is shared with the relay's goroutines.
	var didCrash atomic.Bool
	h.setFailpoint(func(_ context.Context, p string) error {
		if p == point && didCrash.CompareAndSwap(false, true) {
			return errCrash
		}
		return nil
	})
	first := h.Run(c.Consumer, msg, handler)
	report = append(report, fmt.Sprintf("first delivery: err=%v committed=%v", first.Err, first.Committed))
	if carrier != nil {
		report = append(report, fmt.Sprintf("the carrier's mark rode on its claim: %v", h.rode(c.Consumer, carrier.UUID, msg.UUID)))
	}
	h.setFailpoint(nil)
	if point != "" && !didCrash.Load() {
		report = append(report, "(neither the handler nor the relay had reached "+point+")")
	}

	var wg sync.WaitGroup
	errs := make([]error, copies)
	for i := range copies {
		wg.Add(1)
		go func() {
			defer wg.Done()
			errs[i] = h.Ob.Handle(msg.Copy(), outbox.HandleParams{Consumer: c.Consumer, MessageID: msg.UUID}, handler)
		}()
	}
	wg.Wait()
	report = append(report, fmt.Sprintf("%d concurrent copies: errors %v", copies, errs))
	later := h.Run(c.Consumer, msg, handler)
	report = append(report, fmt.Sprintf("a later copy: err=%v", later.Err))

	// Only the relay sends a delayed effect, once due: none may be on the wire before it runs.
	beforeRelay := h.Pub.All()

	// The relay sends what a failed or crashed dispatch left behind.
	if !running {
		startRun()
	}
	waitCtx, cancel := context.WithTimeout(ctx, 30*time.Second)
	idleErr := h.Ob.WaitIdle(waitCtx)
	if idleErr == nil {
		// Delayed effects are no backlog until due: wait for them too, then for their dispatch.
		idleErr = h.waitDelayed(waitCtx, c.Consumer, msg.UUID)
	}
	if idleErr == nil {
		idleErr = h.Ob.WaitIdle(waitCtx)
	}
	if idleErr == nil && carrier != nil {
		idleErr = h.waitDelayed(waitCtx, c.Consumer, carrier.UUID)
		if idleErr == nil {
			idleErr = h.Ob.WaitIdle(waitCtx)
		}
	}
	cancel()
	stop()
	<-done
	running = false
	if idleErr != nil {
		report = append(report, idleErr.Error())
	}

	var failures []string
	fail := func(format string, args ...any) { failures = append(failures, fmt.Sprintf(format, args...)) }
	if !later.Committed {
		fail("the message is not recorded as processed after every delivery (the last: %v)", later.Err)
	}
	// A crash that was never injected makes the scenario the no-crash one again: an Open that
	// sets a Config.Failpoint of its own, a failpoint the framework no longer passes.
	if point != "" && !didCrash.Load() {
		sends := false
		for _, e := range later.Effects {
			sends = sends || e.Kind == outbox.KindPublish && !e.Delayed
		}
		switch point {
		case outbox.FailpointAfterClaim, outbox.FailpointAfterHandler, outbox.FailpointAfterCommit:
			fail("the crash at %s was never injected: the unit of work did not pass it (does Open keep the Config's Failpoint?)", point)
		case outbox.FailpointAfterPublish, outbox.FailpointAfterMark:
			// With the relay running from the start (DeleteSent), the unit may rightly leave its
			// effects to it (their ordering key its own meanwhile), and it sends them after the
			// first delivery, past the crash's window.
			if sends && !c.DeleteSent {
				fail("the crash at %s was never injected although the message has side effects to send (does Open keep the Config's Failpoint?)", point)
			}
		}
	}
	n, err := c.Applied(ctx, h.DB, msg)
	if err != nil {
		t.Fatalf("Applied: %v", err)
	}
	if n != 1 {
		fail("the business change of %s happened %d times, want exactly once", msg.UUID, n)
	}
	effects := [][]Effect{later.Effects}
	if carrier != nil {
		n, err := c.Applied(ctx, h.DB, carrier)
		if err != nil {
			t.Fatalf("Applied: %v", err)
		}
		if n != 1 {
			fail("the business change of the carrier %s happened %d times, want exactly once", carrier.UUID, n)
		}
		effects = append(effects, h.committedEffects(c.Consumer, carrier.UUID))
	}
	// An effect is a message on a topic: one message (one UUID) may go to several topics, and
	// each copy must reach its own.
	type onTopic struct{ topic, uuid string }
	committed := map[onTopic]bool{}
	for _, es := range effects {
		for _, e := range es {
			if e.Kind == outbox.KindPublish {
				committed[onTopic{e.Topic, e.UUID}] = true
			}
		}
	}
	// With the relay running from the start (DeleteSent), it may rightly send a delayed effect
	// that fell due during the deliveries: nothing tells that copy from an early one.
	for _, e := range later.Effects {
		if !e.Delayed || e.Kind != outbox.KindPublish || c.DeleteSent {
			continue
		}
		for _, sent := range beforeRelay {
			if sent.Topic == e.Topic && sent.Message.UUID == e.UUID {
				fail("delayed side effect %s to %q was sent before its due time (by a unit of work, not the relay)", e.UUID, e.Topic)
				break
			}
		}
	}
	onWire := map[onTopic]int{}
	for _, s := range h.Pub.All() {
		onWire[onTopic{s.Topic, s.Message.UUID}]++
	}
	for _, es := range effects {
		for _, e := range es {
			if e.Kind == outbox.KindPublish && onWire[onTopic{e.Topic, e.UUID}] == 0 {
				fail("side effect %s to %q was committed but never sent (lost)", e.UUID, e.Topic)
			}
		}
	}
	// Effects of one ordering key first reach the Publisher in the order they were recorded
	// (a delayed one joins its key when it is due: it is left out), message by message.
	firstAt := map[onTopic]int{}
	for i, s := range h.Pub.All() {
		if _, ok := firstAt[onTopic{s.Topic, s.Message.UUID}]; !ok {
			firstAt[onTopic{s.Topic, s.Message.UUID}] = i
		}
	}
	type keyed struct {
		at int
		e  Effect
	}
	for _, es := range effects {
		lastOf := map[string]keyed{}
		for _, e := range es {
			at, ok := firstAt[onTopic{e.Topic, e.UUID}]
			if e.Delayed || e.Kind != outbox.KindPublish || !ok {
				continue
			}
			if prev, ok := lastOf[e.OrderingKey]; ok && at < prev.at {
				fail("side effect %s to %q was first sent before %s to %q, recorded before it with the same ordering key %q",
					e.UUID, e.Topic, prev.e.UUID, prev.e.Topic, e.OrderingKey)
			}
			lastOf[e.OrderingKey] = keyed{at, e}
		}
	}
	sent := slices.SortedFunc(maps.Keys(onWire), func(a, b onTopic) int {
		return cmp.Or(strings.Compare(a.topic, b.topic), strings.Compare(a.uuid, b.uuid))
	})
	for _, k := range sent {
		if !committed[k] {
			fail("message %s was sent to %q but never committed to it: a second ID for an effect, or an effect of a rolled-back attempt", k.uuid, k.topic)
		}
	}
	if idleErr != nil {
		fail("side effects left pending")
	}
	shapes := effectShapes(later.Effects)
	if baseline != nil && !slices.Equal(shapes, baseline) {
		fail("the side effects committed differ from those of the run without a crash (one lost, or added, by the crash): %q, want %q", shapes, baseline)
	}
	if len(failures) > 0 {
		failures = append(failures, "what happened:", joinLines(report))
	}
	return failures, shapes
}

// waitDelayed waits until no delayed effect of the message waits for its due time.
func (h *Harness) waitDelayed(ctx context.Context, consumer, id string) error {
	cfg := h.Ob.Config()
	var query string
	switch {
	case h.database == nil:
		n, err := postgres.NewNames(cmp.Or(cfg.Schema, postgres.DefaultSchema), cfg.TablePrefix)
		if err != nil {
			return err
		}
		query = `SELECT count(*) FROM ` + n.Delayed + ` WHERE source_consumer = $1 AND source_id = $2`
	case h.database.Delayed == nil:
		return nil // the database keeps no delayed effects
	default:
		query = `SELECT count(*) FROM (` + h.database.Delayed(cfg.Schema, cfg.TablePrefix) + `) d`
	}
	for {
		var waiting int
		if err := h.DB.QueryRowContext(ctx, query, consumer, id).Scan(&waiting); err != nil {
			return fmt.Errorf("outboxtest: wait for the delayed effects: %w", err)
		}
		if waiting == 0 {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("outboxtest: %d delayed effects still waiting: %w", waiting, ctx.Err())
		case <-time.After(20 * time.Millisecond):
		}
	}
}

func joinLines(lines []string) string {
	out := ""
	for i, l := range lines {
		if i > 0 {
			out += "\n  "
		}
		out += l
	}
	return out
}
