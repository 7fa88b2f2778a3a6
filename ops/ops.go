// Package ops is the operator's view of the outbox tables: status per consumer and topic, parked
// effects with filters and failure groups, failing messages, a look-up of one message, and the
// repairs (retry, discard, replay), each written to an audit table with who did it. It runs the
// statements of the store's dialect (store.OpsQueries): PostgreSQL by default, or the driver
// Options.Driver names (MySQL and MariaDB with drivers/mysql). The CLI (cmd/outbox) is built on
// it; an application can call it too.
package ops

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"regexp"
	"sort"
	"strings"
	"time"

	"github.com/watermill-outbox/outbox"
	"github.com/watermill-outbox/outbox/drivers/postgres"
	"github.com/watermill-outbox/outbox/outboxdriver"
	"github.com/watermill-outbox/outbox/store"
)

// Ops reads and repairs the outbox tables of one schema and prefix.
type Ops struct {
	db *sql.DB
	q  store.OpsQueries
	st auditedStore
}

// auditedStore is a store built on store.SQL, whose repairs write their audit entry in their own
// transaction, and whose dialect has the statements of the operators' tools.
type auditedStore interface {
	outboxdriver.Store
	EffectUnparkAudited(ctx context.Context, ids []int64, audit func(changed int) store.Audit) (int, error)
	EffectDiscardAudited(ctx context.Context, ids []int64, audit func(changed int) store.Audit) (int, error)
	MessageReplayAudited(ctx context.Context, src outboxdriver.Source, audit *store.Audit) (bool, error)
	CleanupCount(ctx context.Context, p outboxdriver.CleanupParams) (outboxdriver.CleanupResult, error)
	WriteAudit(ctx context.Context, a store.Audit) error
	OpsQueries() (store.OpsQueries, error)
}

// Options say which tables an Ops works on, and how the service that uses them keeps what it
// dispatched.
type Options struct {
	// Driver is the dialect of the database (nil: postgres.Driver{}), the one the service's
	// Config.Driver names: mysql.Driver{} of drivers/mysql for MySQL and MariaDB.
	Driver outboxdriver.Driver
	// Schema of the tables (empty: the driver's default, "public" on PostgreSQL, the
	// connection's database on MySQL).
	Schema string
	// Prefix of the tables (empty: "outbox_").
	Prefix string
	// DeleteDispatched says that the service keeps no dispatched effects (its
	// Config.EffectRetention is zero): a discarded effect is then deleted, as the service's
	// Outbox.DiscardParked deletes it. When false (the default, and the safe one when the
	// service's configuration is unknown) a discarded effect is kept in the dispatched table,
	// noted as discarded, until a cleanup with the service's EffectRetention deletes it.
	DeleteDispatched bool
}

// Open returns the Ops of the PostgreSQL tables in schema (empty: "public") with prefix (empty:
// "outbox_"), keeping discarded effects (see Options.DeleteDispatched). It does no I/O. OpenWith
// opens those of another driver.
func Open(db *sql.DB, schema, prefix string) (*Ops, error) {
	return OpenWith(db, Options{Schema: schema, Prefix: prefix})
}

// OpenWith returns the Ops of the tables opt names. It does no I/O.
func OpenWith(db *sql.DB, opt Options) (*Ops, error) {
	o, _, err := open(db, opt)
	return o, err
}

// open is OpenWith that also returns the driver's store, when it could open one.
func open(db *sql.DB, opt Options) (*Ops, outboxdriver.Store, error) {
	prefix := opt.Prefix
	if prefix == "" {
		prefix = "outbox_"
	}
	d := opt.Driver
	if d == nil {
		d = postgres.Driver{}
	}
	st, err := d.Open(db, outboxdriver.StoreOptions{Schema: opt.Schema, TablePrefix: prefix, DeleteDispatched: opt.DeleteDispatched})
	if err != nil {
		return nil, nil, fmt.Errorf("ops: %w", err)
	}
	sq, ok := st.(auditedStore)
	if !ok {
		return nil, st, fmt.Errorf("%w: %T (%T)", errNotAudited, d, st)
	}
	q, err := sq.OpsQueries()
	if err != nil {
		return nil, st, fmt.Errorf("ops: %T: %w", d, err)
	}
	return &Ops{db: db, q: q, st: sq}, st, nil
}

// Store returns the store of the tables (for Migrate, Cleanup and SchemaCheck).
func (o *Ops) Store() outboxdriver.Store { return o.st }

// Group is one line of a status: the effects of one consumer ("" for the boundary) and topic.
type Group struct {
	Consumer      string        `json:"consumer"`
	Topic         string        `json:"topic"`
	Pending       int64         `json:"pending"`
	OldestPending time.Duration `json:"oldest_pending_ns"`
	Parked        int64         `json:"parked"`
}

// FailingCount is the number of failing messages of one consumer.
type FailingCount struct {
	Consumer string `json:"consumer"`
	Messages int64  `json:"messages"`
	Attempts int64  `json:"attempts"`
}

// Status is what `outbox status` shows.
type Status struct {
	Totals   outboxdriver.Stats `json:"totals"`
	Groups   []Group            `json:"groups"`
	Failing  []FailingCount     `json:"failing"`
	Retained map[string]int64   `json:"retained_by_consumer"`
	// LastDispatch is when a claim last recorded a dispatch (the relay's or a consumer's), by the
	// database's clock, among the claims of the last hour; zero if none.
	LastDispatch time.Time `json:"last_dispatch,omitzero"`
	Audit        []Audit   `json:"recent_audit"`
	// AuditUnreadable is true when the role may not read the audit table (an application role
	// may only append to it): Audit is then empty.
	AuditUnreadable bool `json:"audit_unreadable,omitempty"`
}

// totalsJSON is outboxdriver.Stats as the JSON output shows it.
type totalsJSON struct {
	Pending         int64     `json:"pending"`
	OldestPendingNS int64     `json:"oldest_pending_ns"`
	Parked          int64     `json:"parked"`
	OldestParkedNS  int64     `json:"oldest_parked_ns"`
	Failing         int64     `json:"failing"`
	Retained        int64     `json:"retained"`
	Estimated       bool      `json:"estimated,omitempty"`
	CleanupLagNS    int64     `json:"cleanup_lag_ns"`
	SampledAt       time.Time `json:"sampled_at"`
	Delayed         int64     `json:"delayed"`
	DeadLetters     int64     `json:"dead_letters"`
}

// statusJSON is a Status as JSON shows it.
type statusJSON struct {
	plainStatus
	Totals totalsJSON `json:"totals"`
}

type plainStatus Status

// MarshalJSON writes the status with snake_case field names throughout.
func (s Status) MarshalJSON() ([]byte, error) {
	t := s.Totals
	return json.Marshal(statusJSON{plainStatus(s), totalsJSON{Pending: t.Pending, OldestPendingNS: int64(t.OldestPending), Parked: t.Parked,
		OldestParkedNS: int64(t.OldestParked), Failing: t.Failing, Retained: t.Retained, Estimated: t.Estimated,
		CleanupLagNS: int64(t.CleanupLag), SampledAt: t.SampledAt, Delayed: t.Delayed, DeadLetters: t.DeadLetters}})
}

// UnmarshalJSON reads what MarshalJSON writes.
func (s *Status) UnmarshalJSON(b []byte) error {
	var j statusJSON
	if err := json.Unmarshal(b, &j); err != nil {
		return err
	}
	*s = Status(j.plainStatus)
	t := j.Totals
	s.Totals = outboxdriver.Stats{Pending: t.Pending, OldestPending: time.Duration(t.OldestPendingNS), Parked: t.Parked,
		OldestParked: time.Duration(t.OldestParkedNS), Failing: t.Failing, Retained: t.Retained, Estimated: t.Estimated,
		CleanupLag: time.Duration(t.CleanupLagNS), SampledAt: t.SampledAt, Delayed: t.Delayed, DeadLetters: t.DeadLetters}
	return nil
}

// Audit is one change an operator made.
type Audit struct {
	At     time.Time `json:"at"`
	Actor  string    `json:"actor"`
	Action string    `json:"action"`
	Target string    `json:"target"`
	Detail string    `json:"detail,omitempty"`
	// Role is the database role that wrote the entry, and ClientAddr the address of its
	// connection (empty over a Unix socket), both set by the database; Remote is the address of
	// the HTTP client the console served (empty otherwise).
	Role       string `json:"db_role,omitempty"`
	ClientAddr string `json:"client_addr,omitempty"`
	Remote     string `json:"remote_addr,omitempty"`
}

// Status samples the tables: totals (as Outbox.Stats), pending and parked effects per consumer
// and topic, failing messages per consumer, retained IDs per consumer (counted up to
// StatsCountCap each), the last dispatch of the last hour and the ten latest audit entries.
func (o *Ops) Status(ctx context.Context, retention time.Duration) (Status, error) {
	var s Status
	var err error
	if s.Totals, err = o.st.Stats(ctx, outboxdriver.StatsParams{Retention: retention}); err != nil {
		return s, fmt.Errorf("ops: status: %w", err)
	}
	rows, err := o.db.QueryContext(ctx, o.q.Groups)
	if err != nil {
		return s, fmt.Errorf("ops: status: %w", err)
	}
	for rows.Next() {
		var g Group
		var ms int64
		if err := rows.Scan(&g.Consumer, &g.Topic, &g.Pending, &ms, &g.Parked); err != nil {
			_ = rows.Close()
			return s, err
		}
		g.OldestPending = time.Duration(ms) * time.Millisecond
		s.Groups = append(s.Groups, g)
	}
	if err := closeRows(rows); err != nil {
		return s, fmt.Errorf("ops: status: %w", err)
	}
	rows, err = o.db.QueryContext(ctx, o.q.FailingCounts)
	if err != nil {
		return s, fmt.Errorf("ops: status: %w", err)
	}
	for rows.Next() {
		var f FailingCount
		if err := rows.Scan(&f.Consumer, &f.Messages, &f.Attempts); err != nil {
			_ = rows.Close()
			return s, err
		}
		s.Failing = append(s.Failing, f)
	}
	if err := closeRows(rows); err != nil {
		return s, fmt.Errorf("ops: status: %w", err)
	}
	s.Retained = map[string]int64{}
	rows, err = o.db.QueryContext(ctx, o.q.Retained, outboxdriver.StatsCountCap)
	if err != nil {
		return s, fmt.Errorf("ops: status: %w", err)
	}
	for rows.Next() {
		var c string
		var n sql.NullInt64
		if err := rows.Scan(&c, &n); err != nil {
			_ = rows.Close()
			return s, err
		}
		s.Retained[c] = outboxdriver.StatsCountCap
		if n.Valid && n.Int64 < outboxdriver.StatsCountCap {
			s.Retained[c] = n.Int64
		}
	}
	if err := closeRows(rows); err != nil {
		return s, fmt.Errorf("ops: status: %w", err)
	}
	var last sql.NullTime
	if err := o.db.QueryRowContext(ctx, o.q.LastDispatch).Scan(&last); err != nil {
		return s, fmt.Errorf("ops: status: %w", err)
	}
	s.LastDispatch = last.Time
	if s.Audit, err = o.AuditLog(ctx, 10); errors.Is(err, ErrAuditUnreadable) {
		s.AuditUnreadable = true
	} else if err != nil {
		return s, err
	}
	return s, nil
}

func closeRows(rows *sql.Rows) error {
	err := rows.Err()
	return errors.Join(err, rows.Close())
}

// ParkedFilter selects parked effects. A list with zero fields lists every parked effect; a
// repair needs a selection (a field other than Limit), or All.
type ParkedFilter struct {
	IDs           []int64
	Topic         string
	Consumer      string
	OlderThan     time.Duration // parked for longer than this
	ErrorContains string
	// All selects every parked effect for a repair, which refuses a filter without a selection
	// otherwise (ErrNoSelection), so that none applies to everything by accident.
	All   bool
	Limit int // default 1000
	// AfterID lists the effects with a larger store ID only: the next page of a list.
	AfterID int64
}

// selects tells whether f selects effects by something other than its limit.
func (f ParkedFilter) selects() bool {
	return f.All || len(f.IDs) > 0 || f.Topic != "" || f.Consumer != "" || f.OlderThan > 0 || f.ErrorContains != ""
}

// ErrNoSelection is returned by a repair whose filter selects nothing in particular: set a
// field of ParkedFilter, or All.
var ErrNoSelection = errors.New("ops: a repair needs a selection (IDs, Topic, Consumer, OlderThan, ErrorContains) or All")

// DefaultLimit bounds a list or a repair whose filter has no Limit.
const DefaultLimit = 1000

// Parked is a parked effect, with the fingerprint of its error.
type Parked struct {
	outboxdriver.ParkedEffect
	Fingerprint string `json:"fingerprint"`
}

// parkedJSON is a Parked as JSON shows it: what an operator needs, with snake_case names.
type parkedJSON struct {
	StoreID     int64     `json:"store_id"`
	Consumer    string    `json:"consumer"`
	MessageID   string    `json:"message_id"`
	Kind        string    `json:"kind"`
	Topic       string    `json:"topic,omitempty"`
	UUID        string    `json:"uuid"`
	OrderingKey string    `json:"ordering_key"`
	Attempts    int       `json:"attempts"`
	Failures    int       `json:"failures"`
	LastError   string    `json:"last_error"`
	Fingerprint string    `json:"fingerprint"`
	ParkedAt    time.Time `json:"parked_at"`
	CreatedAt   time.Time `json:"created_at"`
}

// MarshalJSON writes what an operator needs of a parked effect, with snake_case field names.
func (p Parked) MarshalJSON() ([]byte, error) {
	return json.Marshal(parkedJSON{p.StoreID, p.Source.Consumer, p.Source.ID, p.Kind, p.Topic, p.UUID, p.OrderingKey,
		p.Attempts, p.Failures, p.LastError, p.Fingerprint, p.ParkedAt, p.CreatedAt})
}

// UnmarshalJSON reads what MarshalJSON writes.
func (p *Parked) UnmarshalJSON(b []byte) error {
	var j parkedJSON
	if err := json.Unmarshal(b, &j); err != nil {
		return err
	}
	*p = Parked{Fingerprint: j.Fingerprint}
	p.StoreID, p.Source, p.Kind, p.Topic, p.UUID, p.OrderingKey = j.StoreID, outboxdriver.Source{Consumer: j.Consumer, ID: j.MessageID}, j.Kind, j.Topic, j.UUID, j.OrderingKey
	p.Attempts, p.Failures, p.LastError, p.ParkedAt, p.CreatedAt, p.Parked = j.Attempts, j.Failures, j.LastError, j.ParkedAt, j.CreatedAt, true
	return nil
}

// ParkedEffects lists the parked effects f selects, oldest first.
func (o *Ops) ParkedEffects(ctx context.Context, f ParkedFilter) ([]Parked, error) {
	limit := f.Limit
	if limit <= 0 {
		limit = DefaultLimit
	}
	var ids any
	if len(f.IDs) > 0 {
		ids = idList(f.IDs)
	}
	rows, err := o.db.QueryContext(ctx, o.q.Parked, ids, f.Topic, f.Consumer, f.OlderThan.Milliseconds(), f.ErrorContains, f.AfterID, limit)
	if err != nil {
		return nil, fmt.Errorf("ops: list parked effects: %w", err)
	}
	var out []Parked
	for rows.Next() {
		var p Parked
		if err := rows.Scan(&p.StoreID, &p.Source.Consumer, &p.Source.ID, &p.Kind, &p.Topic, &p.UUID, &p.OrderingKey,
			&p.Attempts, &p.Failures, &p.LastError, &p.ParkedAt, &p.CreatedAt); err != nil {
			_ = rows.Close()
			return nil, err
		}
		p.Parked = true
		p.Fingerprint = Fingerprint(p.LastError)
		out = append(out, p)
	}
	if err := closeRows(rows); err != nil {
		return nil, fmt.Errorf("ops: list parked effects: %w", err)
	}
	return out, nil
}

// FailureGroup is the parked effects that failed for the same normalized reason.
type FailureGroup struct {
	Fingerprint string   `json:"fingerprint"`
	Count       int      `json:"count"`
	Topics      []string `json:"topics"`
	Example     string   `json:"example"`
	StoreIDs    []int64  `json:"store_ids"`
}

// GroupByFingerprint groups parked effects by the fingerprint of their error, largest group first.
func GroupByFingerprint(parked []Parked) []FailureGroup {
	byFP := map[string]*FailureGroup{}
	var order []string
	for _, p := range parked {
		g, ok := byFP[p.Fingerprint]
		if !ok {
			g = &FailureGroup{Fingerprint: p.Fingerprint, Example: p.LastError}
			byFP[p.Fingerprint] = g
			order = append(order, p.Fingerprint)
		}
		g.Count++
		g.StoreIDs = append(g.StoreIDs, p.StoreID)
		if !contains(g.Topics, p.Topic) {
			g.Topics = append(g.Topics, p.Topic)
		}
	}
	out := make([]FailureGroup, 0, len(order))
	for _, fp := range order {
		out = append(out, *byFP[fp])
	}
	sort.SliceStable(out, func(i, j int) bool { return out[i].Count > out[j].Count })
	return out
}

func contains(list []string, s string) bool {
	for _, x := range list {
		if x == s {
			return true
		}
	}
	return false
}

var (
	uuidRe   = regexp.MustCompile(`[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}`)
	quotedRe = regexp.MustCompile(`"[^"]*"|'[^']*'`)
	hexRe    = regexp.MustCompile(`\b0x[0-9a-fA-F]+\b`)
	numberRe = regexp.MustCompile(`\b\d+(\.\d+)?(ms|s|m|h|µs|ns)?\b`)
	spaceRe  = regexp.MustCompile(`\s+`)
)

// Fingerprint normalizes an error text so that failures of one cause group together: UUIDs,
// quoted strings, hexadecimal and decimal numbers (with a duration unit) become placeholders,
// and the result is cut to 200 bytes.
func Fingerprint(reason string) string {
	s := uuidRe.ReplaceAllString(reason, "<uuid>")
	s = quotedRe.ReplaceAllString(s, "<str>")
	s = hexRe.ReplaceAllString(s, "<hex>")
	s = numberRe.ReplaceAllString(s, "<n>")
	s = strings.TrimSpace(spaceRe.ReplaceAllString(s, " "))
	if len(s) > 200 {
		s = strings.ToValidUTF8(s[:200], "")
	}
	return s
}

// Change is what a repair did (or, with DryRun, would do).
type Change struct {
	Action  string  `json:"action"`
	DryRun  bool    `json:"dry_run"`
	Matched int     `json:"matched"`
	Changed int     `json:"changed"`
	IDs     []int64 `json:"store_ids"`
	// More is true when the filter's Limit cut the repair short: more parked effects match.
	More bool `json:"more_matched"`
}

// RepairOptions say who repairs and how.
type RepairOptions struct {
	// Actor is written to the audit table. Required.
	Actor string
	// DryRun reports what would change and changes nothing.
	DryRun bool
	// BatchSize bounds the effects changed per statement batch (default 500), so that a bulk
	// repair never holds many rows at once.
	BatchSize int
	// Progress, if set, is called after each batch with the effects changed so far.
	Progress func(done, total int)
	// Remote is the address of the client the change came from (the console sets the HTTP
	// client's), written to the audit table with the database role and connection address.
	Remote string
}

// RetryParked makes the parked effects f selects due again with fresh counts, in batches, each
// written to the audit table in its own transaction (a batch whose entry cannot be written is not
// applied). f must select (ErrNoSelection otherwise); Change.More tells that f.Limit cut it short.
// The relays send them at their next round.
func (o *Ops) RetryParked(ctx context.Context, f ParkedFilter, opt RepairOptions) (Change, error) {
	return o.repair(ctx, "retry", f, opt, o.st.EffectUnparkAudited)
}

// DiscardParked gives up the parked effects f selects for good (marked dispatched without being
// sent; the later effects of their ordering keys go on), in batches, audited as RetryParked's. They are kept in
// the dispatched table, noted as discarded, unless Options.DeleteDispatched.
func (o *Ops) DiscardParked(ctx context.Context, f ParkedFilter, opt RepairOptions) (Change, error) {
	return o.repair(ctx, "discard", f, opt, o.st.EffectDiscardAudited)
}

func (o *Ops) repair(ctx context.Context, action string, f ParkedFilter, opt RepairOptions,
	apply func(context.Context, []int64, func(int) store.Audit) (int, error)) (Change, error) {
	if strings.TrimSpace(opt.Actor) == "" {
		return Change{}, errors.New("ops: an actor is required for the audit table")
	}
	if !f.selects() {
		return Change{}, ErrNoSelection
	}
	// One more than the limit tells whether the limit cut the repair short.
	if f.Limit <= 0 {
		f.Limit = DefaultLimit
	}
	limit := f.Limit
	f.Limit++
	parked, err := o.ParkedEffects(ctx, f)
	if err != nil {
		return Change{}, err
	}
	ch := Change{Action: action, DryRun: opt.DryRun}
	if len(parked) > limit {
		parked, ch.More = parked[:limit], true
	}
	ch.Matched = len(parked)
	for _, p := range parked {
		ch.IDs = append(ch.IDs, p.StoreID)
	}
	if opt.DryRun || len(parked) == 0 {
		return ch, nil
	}
	size := opt.BatchSize
	if size <= 0 {
		size = 500
	}
	for start := 0; start < len(ch.IDs); start += size {
		batch := ch.IDs[start:min(start+size, len(ch.IDs))]
		// The entry is written in the batch's transaction: a batch whose entry cannot be written
		// is not applied.
		n, err := apply(ctx, batch, func(n int) store.Audit {
			return auditEntry(opt.Actor, action+"-parked", "effects "+idList(batch), fmt.Sprintf("%d of %d changed", n, len(batch)), opt.Remote)
		})
		if err != nil {
			return ch, fmt.Errorf("ops: %s parked effects: %w", action, err)
		}
		ch.Changed += n
		if opt.Progress != nil {
			opt.Progress(start+len(batch), len(ch.IDs))
		}
	}
	return ch, nil
}

// Failing is a message with failed attempts that was neither processed nor poisoned.
type Failing struct {
	Consumer      string    `json:"consumer"`
	MessageID     string    `json:"message_id"`
	Attempts      int       `json:"attempts"`
	LastError     string    `json:"last_error"`
	FirstFailedAt time.Time `json:"first_failed_at"`
	LastFailedAt  time.Time `json:"last_failed_at"`
}

// FailingMessages lists up to limit failing messages (of consumer, if not empty), most attempts first.
func (o *Ops) FailingMessages(ctx context.Context, consumer string, limit int) ([]Failing, error) {
	if limit <= 0 {
		limit = 1000
	}
	rows, err := o.db.QueryContext(ctx, o.q.Failing, consumer, limit)
	if err != nil {
		return nil, fmt.Errorf("ops: list failing messages: %w", err)
	}
	var out []Failing
	for rows.Next() {
		var f Failing
		if err := rows.Scan(&f.Consumer, &f.MessageID, &f.Attempts, &f.LastError, &f.FirstFailedAt, &f.LastFailedAt); err != nil {
			_ = rows.Close()
			return nil, err
		}
		out = append(out, f)
	}
	return out, closeRows(rows)
}

// ReplayPoisoned forgets the poisoned claim and the failed attempts of a message, so that its next
// delivery runs the handler (see Outbox.ReplayPoisoned), and audits it in the same transaction,
// in which its dead letter, if still dead, is marked retried by opt.Actor. It reports whether
// the message was poisoned; with DryRun it only looks.
func (o *Ops) ReplayPoisoned(ctx context.Context, consumer, messageID string, opt RepairOptions) (bool, error) {
	if strings.TrimSpace(opt.Actor) == "" {
		return false, errors.New("ops: an actor is required for the audit table")
	}
	if opt.DryRun {
		var poisoned bool
		err := o.db.QueryRowContext(ctx, o.q.IsPoisoned, consumer, messageID).Scan(&poisoned)
		if errors.Is(err, sql.ErrNoRows) {
			return false, nil
		}
		return poisoned, err
	}
	a := auditEntry(opt.Actor, "replay-poisoned", consumer+"/"+messageID, "", opt.Remote)
	ok, err := o.st.MessageReplayAudited(ctx, outboxdriver.Source{Consumer: consumer, ID: messageID}, &a)
	if err != nil {
		return false, fmt.Errorf("ops: replay: %w", err)
	}
	return ok, nil
}

// Poisoned is a message moved to the poison topic.
type Poisoned struct {
	Consumer  string    `json:"consumer"`
	MessageID string    `json:"message_id"`
	At        time.Time `json:"at"`
	// Attempts and Reason are those of its last failed attempt, while its attempt counter is
	// kept (Retention after the last failure); a message rejected for an unusable ID has none.
	Attempts int    `json:"attempts,omitempty"`
	Reason   string `json:"reason,omitempty"`
}

// PoisonedMessages lists up to limit poisoned messages (of consumer, if not empty), newest first.
func (o *Ops) PoisonedMessages(ctx context.Context, consumer string, limit int) ([]Poisoned, error) {
	if limit <= 0 {
		limit = 1000
	}
	rows, err := o.db.QueryContext(ctx, o.q.Poisoned, consumer, limit)
	if err != nil {
		return nil, fmt.Errorf("ops: list poisoned messages: %w", err)
	}
	var out []Poisoned
	for rows.Next() {
		var p Poisoned
		if err := rows.Scan(&p.Consumer, &p.MessageID, &p.At, &p.Attempts, &p.Reason); err != nil {
			_ = rows.Close()
			return nil, err
		}
		out = append(out, p)
	}
	return out, closeRows(rows)
}

// Lookup is everything the tables know of one message of one consumer. DispatchedAt is when its
// last effect left the pending ones, sent or discarded (zero while one is pending or parked).
type Lookup struct {
	Consumer     string         `json:"consumer"`
	MessageID    string         `json:"message_id"`
	Processed    bool           `json:"processed"`
	Poisoned     bool           `json:"poisoned"`
	ProcessedAt  time.Time      `json:"processed_at,omitzero"`
	DispatchedAt time.Time      `json:"dispatched_at,omitzero"`
	Effects      []LookupEffect `json:"effects"`
	Attempts     int            `json:"attempts"`
	LastError    string         `json:"last_error,omitempty"`
}

// LookupEffect is one side effect of a looked-up message.
type LookupEffect struct {
	StoreID      int64     `json:"store_id"`
	Kind         string    `json:"kind"`
	Topic        string    `json:"topic"`
	UUID         string    `json:"uuid"`
	State        string    `json:"state"` // pending, parked, dispatched, discarded
	CreatedAt    time.Time `json:"created_at"`
	DispatchedAt time.Time `json:"dispatched_at,omitzero"`
	DiscardedAt  time.Time `json:"discarded_at,omitzero"`
	LastError    string    `json:"last_error,omitempty"`
}

// discardedNote ends the last error of a discarded effect: the stores keep it beside the
// dispatched ones, with the discard's time as its dispatch time, and this is all that tells it
// from an effect that was sent.
const discardedNote = " (discarded)"

// Lookup tells whether consumer processed messageID, when, what it sent and what is pending.
// Dispatched effects show only while they are kept (Config.EffectRetention).
func (o *Ops) Lookup(ctx context.Context, consumer, messageID string) (Lookup, error) {
	l := Lookup{Consumer: consumer, MessageID: messageID}
	var dispatched sql.NullTime
	err := o.db.QueryRowContext(ctx, o.q.LookupClaim, consumer, messageID).Scan(&l.ProcessedAt, &dispatched, &l.Poisoned)
	switch {
	case errors.Is(err, sql.ErrNoRows):
	case err != nil:
		return l, fmt.Errorf("ops: lookup: %w", err)
	default:
		l.Processed = true
		l.DispatchedAt = dispatched.Time
	}
	rows, err := o.db.QueryContext(ctx, o.q.LookupEffects, consumer, messageID)
	if err != nil {
		return l, fmt.Errorf("ops: lookup: %w", err)
	}
	for rows.Next() {
		var e LookupEffect
		var at sql.NullTime
		if err := rows.Scan(&e.StoreID, &e.Kind, &e.Topic, &e.UUID, &e.State, &e.CreatedAt, &at, &e.LastError); err != nil {
			_ = rows.Close()
			return l, err
		}
		e.DispatchedAt = at.Time
		if msg, ok := strings.CutSuffix(e.LastError, discardedNote); ok && e.State == "dispatched" {
			e.State, e.LastError = "discarded", msg
			e.DiscardedAt, e.DispatchedAt = e.DispatchedAt, time.Time{}
		}
		l.Effects = append(l.Effects, e)
	}
	if err := closeRows(rows); err != nil {
		return l, fmt.Errorf("ops: lookup: %w", err)
	}
	err = o.db.QueryRowContext(ctx, o.q.LookupAttempts, consumer, messageID).Scan(&l.Attempts, &l.LastError)
	if err != nil && !errors.Is(err, sql.ErrNoRows) {
		return l, fmt.Errorf("ops: lookup: %w", err)
	}
	return l, nil
}

// AuditLog returns the latest limit audit entries, newest first.
func (o *Ops) AuditLog(ctx context.Context, limit int) ([]Audit, error) {
	rows, err := o.db.QueryContext(ctx, o.q.AuditLog, limit)
	if err != nil {
		if o.q.IsInsufficientPrivilege != nil && o.q.IsInsufficientPrivilege(err) {
			return nil, fmt.Errorf("%w: %w", ErrAuditUnreadable, err)
		}
		return nil, fmt.Errorf("ops: audit log: %w", err)
	}
	var out []Audit
	for rows.Next() {
		var a Audit
		if err := rows.Scan(&a.At, &a.Actor, &a.Action, &a.Target, &a.Detail, &a.Role, &a.ClientAddr, &a.Remote); err != nil {
			_ = rows.Close()
			return nil, err
		}
		out = append(out, a)
	}
	return out, closeRows(rows)
}

// ErrAuditUnreadable means the role may not read the audit table. The application role may only
// append to it (see postgres.Grants); an operator's role reads it.
var ErrAuditUnreadable = errors.New("ops: this role may not read the audit table")

func (o *Ops) audit(ctx context.Context, actor, action, target, detail, remote string) error {
	if err := o.st.WriteAudit(ctx, auditEntry(actor, action, target, detail, remote)); err != nil {
		return fmt.Errorf("ops: %w", err)
	}
	return nil
}

func auditEntry(actor, action, target, detail, remote string) store.Audit {
	return store.Audit{Actor: outboxdriver.StorableText(actor), Action: action, Target: outboxdriver.StorableText(target), Detail: outboxdriver.StorableText(detail), Remote: outboxdriver.StorableText(remote)}
}

func idList(ids []int64) string {
	parts := make([]string, len(ids))
	for i, id := range ids {
		parts[i] = fmt.Sprint(id)
	}
	return strings.Join(parts, ",")
}

// errNotAudited means that a driver's store is not built on store.SQL, whose repairs write their
// audit entry in the transaction of the change.
var errNotAudited = errors.New("ops: the driver's store cannot audit in the transaction of a change")

// ForOutbox returns the Ops of the tables an Outbox works on, through its Config.Driver, which
// discards effects as the Outbox does: kept with its EffectRetention, deleted without. A driver
// whose store wraps the postgres driver's (the pgx form's, which runs everything off the hot path
// on its statements through ob.Config().DB) gets the postgres driver's Ops.
func ForOutbox(ob *outbox.Outbox) (*Ops, error) {
	cfg := ob.Config()
	opt := Options{Driver: cfg.Driver, Schema: cfg.Schema, Prefix: cfg.TablePrefix, DeleteDispatched: cfg.EffectRetention == 0}
	o, st, err := open(cfg.DB, opt)
	// Of the stores here, only PostgreSQL's keep inline effects.
	if _, inline := st.(outboxdriver.InlineStore); errors.Is(err, errNotAudited) && inline {
		opt.Driver = postgres.Driver{}
		return OpenWith(cfg.DB, opt)
	}
	return o, err
}
