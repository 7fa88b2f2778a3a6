package campaign

import (
	"database/sql"
	"fmt"
	"slices"
	"strings"
	"sync/atomic"
	"time"

	"github.com/watermill-outbox/outbox/outboxdriver"
	"github.com/watermill-outbox/outbox/store"
)

// pending returns how many committed effects are not sent yet: effect rows, claims still
// holding inline effects, and delayed effects (all due within the drain).
func (c *run) pending() int {
	c.flushMarks()
	n := 0
	for _, db := range c.dbs {
		var rows, inline, delayed int
		if err := db.QueryRow(`SELECT (SELECT count(*) FROM `+c.effectsTable()+` WHERE dispatched_at IS NULL), `+
			c.inlineCount()+`, `+c.delayedCount()).Scan(&rows, &inline, &delayed); err != nil {
			c.t.Fatal(err)
		}
		n += rows + inline + delayed
	}
	return n
}

// effectsTable is the table the effect rows are read through: on PostgreSQL the partitioned
// parent (migration 023), whose partition 0 alone is named effects.
func (c *run) effectsTable() string {
	if c.database == postgresDatabase {
		return c.prefix + "effects_all"
	}
	return c.prefix + "effects"
}

// inlineCount is the SQL of the number of claims holding inline effects (none but on PostgreSQL).
func (c *run) inlineCount() string {
	if c.database != postgresDatabase {
		return `0`
	}
	return `(SELECT count(*) FROM ` + c.prefix + `processed WHERE effects IS NOT NULL)`
}

// delayedCount is the SQL of the number of delayed effects waiting (none on a database that
// keeps none).
func (c *run) delayedCount() string {
	if !c.keepsDelayed() {
		return `0`
	}
	return `(SELECT count(*) FROM ` + c.prefix + `delayed)`
}

// keepsDelayed tells whether the database keeps delayed effects (a table of them).
func (c *run) keepsDelayed() bool {
	_, unsupported := c.database.Unsupported["delayed"]
	return !unsupported
}

// effect is one committed side effect.
type effect struct {
	consumer string // empty for a boundary unit of work's (a keyed request's)
	source   string // the message ID (one consumer), or the boundary unit's ID
	seq      int
	topic    string
	uuid     string
	payload  string
	where    string // "row", "dispatched", "delayed" or "inline"
}

func (e effect) String() string {
	return fmt.Sprintf("(%s, seq %d, %s, %s, %q, %s)", e.source[:8], e.seq, e.topic, e.uuid, e.payload, e.where)
}

// committed reads every committed effect, of every tenant: pending rows, dispatched ones kept
// for EffectRetention, delayed ones not moved yet, and inline ones still in their claims.
func (c *run) committed() []effect {
	var out []effect
	for _, db := range c.dbs {
		out = append(out, c.committedIn(db)...)
	}
	return out
}

// committedIn reads the committed effects of one tenant's database.
func (c *run) committedIn(db *sql.DB) []effect {
	t := c.t
	var out []effect
	query := `SELECT source_consumer, source_id, seq, topic, uuid, payload, 'row' FROM ` + c.effectsTable()
	if c.database == postgresDatabase {
		query += ` UNION ALL SELECT source_consumer, source_id, seq, topic, uuid, payload, 'dispatched' FROM ` + c.prefix + `dispatched`
	}
	if c.keepsDelayed() {
		query += ` UNION ALL SELECT source_consumer, source_id, seq, topic, uuid, payload, 'delayed' FROM ` + c.prefix + `delayed`
	}
	rows, err := db.Query(query)
	if err != nil {
		t.Fatal(err)
	}
	for rows.Next() {
		var e effect
		var payload []byte
		if err := rows.Scan(&e.consumer, &e.source, &e.seq, &e.topic, &e.uuid, &payload, &e.where); err != nil {
			t.Fatal(err)
		}
		e.payload = string(payload)
		out = append(out, e)
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	rows.Close()
	if c.database != postgresDatabase {
		return out // no inline effects
	}
	rows, err = db.Query(`SELECT consumer, message_id, effects FROM ` + c.prefix + `processed WHERE effects IS NOT NULL`)
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	for rows.Next() {
		var src outboxdriver.Source
		var blob []byte
		if err := rows.Scan(&src.Consumer, &src.ID, &blob); err != nil {
			t.Fatal(err)
		}
		effects, err := store.DecodeEffects(blob, src)
		if err != nil {
			c.fail("inline effects of %s: %v", src.ID, err)
			continue
		}
		for _, d := range effects {
			out = append(out, effect{consumer: src.Consumer, source: src.ID, seq: d.Seq, topic: d.Topic, uuid: d.UUID, payload: string(d.Payload), where: "inline"})
		}
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	return append(out, c.audited(db, out)...)
}

// installAudit keeps in db, by triggers, every effect that leaves the run's tables otherwise
// than by a rollback: an effect row deleted (sent and not kept, moved to the dispatched table, a
// spill undone), and the inline effects a claim held before an update changed or cleared them
// (sent, moved to rows, rewritten by the next record). What was committed and then deleted stays
// readable for the check (committedIn), whatever EffectRetention the instances have. Only
// committed writes leave an entry: the trigger's insert is undone with its transaction (or
// savepoint).
func (c *run) installAudit(db *sql.DB) {
	p := c.prefix
	for _, q := range []string{
		`CREATE TABLE ` + p + `campaign_audit (consumer text, source text, seq int, topic text, uuid text, payload bytea, effects bytea,
			created_at timestamptz)`,
		`CREATE FUNCTION ` + p + `campaign_audit_row() RETURNS trigger LANGUAGE plpgsql AS $$
		BEGIN
			INSERT INTO ` + p + `campaign_audit (consumer, source, seq, topic, uuid, payload, created_at)
				VALUES (OLD.source_consumer, OLD.source_id, OLD.seq, OLD.topic, OLD.uuid, OLD.payload, OLD.created_at);
			RETURN NULL;
		END $$`,
		`CREATE TRIGGER ` + p + `campaign_audit_row AFTER DELETE ON ` + c.effectsTable() + ` FOR EACH ROW EXECUTE FUNCTION ` + p + `campaign_audit_row()`,
		`CREATE FUNCTION ` + p + `campaign_audit_inline() RETURNS trigger LANGUAGE plpgsql AS $$
		BEGIN
			INSERT INTO ` + p + `campaign_audit (consumer, source, effects, created_at)
				VALUES (OLD.consumer, OLD.message_id, OLD.effects, coalesce(OLD.dispatched_at, OLD.processed_at));
			RETURN NULL;
		END $$`,
		`CREATE TRIGGER ` + p + `campaign_audit_inline AFTER UPDATE OF effects ON ` + p + `processed FOR EACH ROW
			WHEN (OLD.effects IS NOT NULL AND NEW.effects IS DISTINCT FROM OLD.effects) EXECUTE FUNCTION ` + p + `campaign_audit_inline()`,
		`CREATE TRIGGER ` + p + `campaign_audit_claim AFTER DELETE ON ` + p + `processed FOR EACH ROW
			WHEN (OLD.effects IS NOT NULL) EXECUTE FUNCTION ` + p + `campaign_audit_inline()`,
	} {
		if _, err := db.Exec(q); err != nil {
			c.t.Fatalf("audit of the deleted effects: %v", err)
		}
	}
}

// audited returns the effects of db's audit (installAudit) that are not in current (the effects
// the tables hold now): what was committed and left the tables since, each once.
func (c *run) audited(db *sql.DB, current []effect) []effect {
	t := c.t
	same := func(e effect) [6]string {
		return [6]string{e.consumer, e.source, fmt.Sprint(e.seq), e.topic, e.uuid, e.payload}
	}
	seen := map[[6]string]bool{}
	for _, e := range current {
		seen[same(e)] = true
	}
	rows, err := db.Query(`SELECT consumer, source, seq, topic, uuid, payload, effects, created_at FROM ` + c.prefix + `campaign_audit`)
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	var out []effect
	add := func(e effect) {
		if k := same(e); !seen[k] {
			seen[k] = true
			out = append(out, e)
		}
	}
	for rows.Next() {
		var consumer, source string
		var seq sql.NullInt64
		var topic, id sql.NullString
		var payload, blob []byte
		var at time.Time
		if err := rows.Scan(&consumer, &source, &seq, &topic, &id, &payload, &blob, &at); err != nil {
			t.Fatal(err)
		}
		if blob == nil {
			c.auditedAt(id.String, at)
			add(effect{consumer: consumer, source: source, seq: int(seq.Int64), topic: topic.String, uuid: id.String, payload: string(payload), where: "deleted row"})
			continue
		}
		effects, err := store.DecodeEffects(blob, outboxdriver.Source{Consumer: consumer, ID: source})
		if err != nil {
			c.fail("audited inline effects of %s: %v", source, err)
			continue
		}
		for _, d := range effects {
			c.auditedAt(d.UUID, at)
			add(effect{consumer: consumer, source: source, seq: d.Seq, topic: d.Topic, uuid: d.UUID, payload: string(d.Payload), where: "cleared inline"})
		}
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	return out
}

// auditedAt records that an effect with UUID id was stored at at, by the audit: the first and
// last such times, for storedAfter.
func (c *run) auditedAt(id string, at time.Time) {
	if c.auditTimes == nil {
		c.auditTimes = map[string][2]time.Time{}
	}
	span, ok := c.auditTimes[id]
	if !ok {
		span = [2]time.Time{at, at}
	}
	if at.Before(span[0]) {
		span[0] = at
	}
	if at.After(span[1]) {
		span[1] = at
	}
	c.auditTimes[id] = span
}

// wireCopy is one copy on a broker topic.
type wireCopy struct {
	topic, uuid, payload string
}

func (c *run) wire() []wireCopy {
	var out []wireCopy
	for _, topic := range append(c.topics[:], c.inTopic) {
		rows, err := c.db.Query(c.database.Wire(topic))
		if err != nil {
			c.t.Fatal(err)
		}
		for rows.Next() {
			w := wireCopy{topic: topic}
			var payload []byte
			if err := rows.Scan(&w.uuid, &payload); err != nil {
				c.t.Fatal(err)
			}
			w.payload = string(payload)
			out = append(out, w)
		}
		if err := rows.Err(); err != nil {
			c.t.Fatal(err)
		}
		rows.Close()
	}
	return out
}

// check checks the guarantee effect by effect (source, sequence, topic, UUID): each business
// change applied once (at most once for a message never acked), every committed effect sent on
// its topic with exactly the UUID it committed with, nothing sent that did not commit, and the
// effects of each message sent in the order they were recorded (their ordering key).
func (c *run) check(specs []*spec, acked []atomic.Bool, rqs []*request) {
	t := c.t
	// Bound the report: one defect can fail thousands of effects of a big unit.
	reported := 0
	fail := func(format string, args ...any) {
		reported++
		switch {
		case reported <= 25:
			c.fail(format, args...)
		case reported == 26:
			c.fail("(further failures of this run not shown)")
		}
	}
	if *flagLog {
		c.describePending()
	}
	if n := c.pending(); n > 0 {
		var parked, inline int
		for _, db := range c.dbs {
			var p, i int
			if err := db.QueryRow(`SELECT (SELECT count(*) FROM `+c.effectsTable()+` WHERE parked_at IS NOT NULL AND dispatched_at IS NULL), `+
				c.inlineCount()).Scan(&p, &i); err != nil {
				t.Fatal(err)
			}
			parked, inline = parked+p, inline+i
		}
		fail("%d effects still pending after the relays ran for %s (%d parked effect rows, %d claims holding inline effects)", n, drainFor, parked, inline)
		c.describePending()
	}

	for i, sp := range specs {
		var n int
		if err := c.dbs[sp.tenant].QueryRow(c.database.Bind(`SELECT count(*) FROM `+c.applied+` WHERE message_id = $1`), sp.id).Scan(&n); err != nil {
			t.Fatal(err)
		}
		if sp.poison && !sp.retry {
			// Dead-lettered and never fixed: its handler never succeeded.
			if n != 0 {
				fail("poison message %s applied %d times", sp.id, n)
			}
			continue
		}
		if n > 1 || (n != 1 && acked[i].Load()) {
			fail("message %s applied %d times (acked: %v, poison %v)", sp.id, n, acked[i].Load(), sp.poison)
		}
	}
	c.checkDeadLetters(specs, acked)

	all := c.committed()
	bySource := map[string][]effect{}
	byKey := map[[2]string]effect{}   // (source, seq)
	byWire := map[wireKey]effect{}    // (topic, UUID)
	byPayload := map[wireKey]effect{} // (topic, payload)
	for _, e := range all {
		k := [2]string{e.source, fmt.Sprint(e.seq)}
		if prev, ok := byKey[k]; ok {
			fail("effect %s committed twice: %v and %v", k, prev, e)
		}
		byKey[k] = e
		if prev, ok := byWire[wireKey{e.topic, e.uuid}]; ok && !rerun(rqs, prev, e) {
			fail("two committed effects with one topic and UUID: %v and %v", prev, e)
		}
		byWire[wireKey{e.topic, e.uuid}] = e
		byPayload[wireKey{e.topic, e.payload}] = e
		bySource[e.source] = append(bySource[e.source], e)
		if e.consumer != "" && !strings.HasPrefix(e.payload, e.source+"/") {
			fail("effect %v committed under another message's source", e)
		}
		if strings.HasSuffix(e.payload, "/undone") {
			fail("effect %v (recorded in a rolled-back savepoint) committed", e)
		}
	}
	for i, sp := range specs {
		want := c.wantEffects(sp)
		if dk := (wireKey{c.topics[1], sp.id + "/delayed"}); sp.cancelled.Load() == -1 {
			// The cancel failed, its commit's outcome unknown: the delayed effect is committed
			// and sent, or cancelled and never sent (the wire check still holds it to that).
			if _, ok := byPayload[dk]; !ok {
				want = slices.DeleteFunc(want, func(w wireKey) bool { return w == dk })
			}
		}
		got := bySource[sp.id]
		if sp.poison && !sp.retry {
			if len(got) != 0 {
				fail("poison message %s committed %d effects", sp.id, len(got))
			}
			continue
		}
		if !acked[i].Load() && len(got) == 0 {
			continue
		}
		for _, w := range want {
			if _, ok := byPayload[w]; !ok {
				fail("effect %s to %s never committed (%d of %d effects of the message committed)", w.uuid, w.topic, len(got), len(want))
			}
		}
		if len(got) != len(want) {
			fail("message %s committed %d effects, want %d", sp.id, len(got), len(want))
		}
	}

	c.checkRequests(rqs, bySource)

	// The wire: every copy is of a committed effect, on its topic, with its UUID; every committed
	// effect has a copy.
	sent := map[wireKey]int{}
	for _, w := range c.wire() {
		e, ok := byPayload[wireKey{w.topic, w.payload}]
		switch {
		case strings.HasSuffix(w.payload, "/undone"):
			fail("%q (recorded in a rolled-back savepoint) reached %s", w.payload, w.topic)
		case !ok:
			fail("%q reached %s (UUID %s), but no effect with that payload committed to that topic", w.payload, w.topic, w.uuid)
		case e.uuid != w.uuid:
			fail("effect %v reached the wire with UUID %s", e, w.uuid)
		}
		sent[wireKey{w.topic, w.uuid}]++
	}
	for _, e := range all {
		if sent[wireKey{e.topic, e.uuid}] == 0 {
			fail("committed effect %v never reached %s", e, e.topic)
		}
	}

	// Per-key order (the key of every effect here is its message, but a followed delayed
	// effect's): an effect never reaches the broker before one recorded before it by the same
	// unit of work.
	c.pub.mu.Lock()
	defer c.pub.mu.Unlock()
	ownKey := map[string]bool{} // the payloads of the delayed effects with a key of their own
	for _, sp := range specs {
		if sp.follow {
			ownKey[sp.id+"/delayed"] = true
		}
	}
	for _, effects := range bySource {
		slices.SortFunc(effects, func(a, b effect) int { return a.seq - b.seq })
		prev, prevE := 0, effect{}
		for _, e := range effects {
			at, ok := c.pub.first[wireKey{e.topic, e.uuid}]
			if !ok || ownKey[e.payload] {
				continue
			}
			if at < prev {
				fail("effect %v reached the broker before %v, recorded before it", e, prevE)
			}
			prev, prevE = at, e
		}
	}
	// A delayed effect, once due, is never overtaken by an effect of its key recorded after.
	for _, sp := range specs {
		if !sp.follow || sp.followed.Load() == 0 {
			continue
		}
		d, dok := byPayload[wireKey{c.topics[1], sp.id + "/delayed"}]
		a, aok := byPayload[wireKey{c.topics[0], sp.id + "/after"}]
		if !dok || !aok {
			continue // cancelled, or the later unit did not commit
		}
		atD, okD := c.pub.first[wireKey{d.topic, d.uuid}]
		atA, okA := c.pub.first[wireKey{a.topic, a.uuid}]
		if okD && okA && atA < atD && c.storedAfter(c.dbs[sp.tenant], a.uuid, d.uuid) {
			fail("effect %v, recorded once the delayed effect %v of its key was due, reached the broker before it", a, d)
		}
	}
}

// storedAfter tells whether the effect with UUID a was stored after the effect with UUID b,
// moved from the delayed effects, was due: by the database's clock, which decides what is due
// (a moved effect is stored with its due time). Both are in db, their tenant's.
func (c *run) storedAfter(db *sql.DB, a, b string) bool {
	rows := c.effectsTable()
	if c.database == postgresDatabase {
		rows = `(SELECT uuid, created_at FROM ` + c.effectsTable() + ` UNION ALL SELECT uuid, created_at FROM ` + c.prefix + `dispatched)`
	}
	var lastA, firstB sql.NullTime
	if err := db.QueryRow(c.database.Bind(`SELECT (SELECT max(created_at) FROM `+rows+` x WHERE uuid = $1),
		(SELECT min(created_at) FROM `+rows+` y WHERE uuid = $2)`), a, b).Scan(&lastA, &firstB); err != nil {
		c.t.Fatal(err)
	}
	// Sent and not kept (EffectRetention 0): the audit's times, taken from the same columns.
	if span, ok := c.auditTimes[a]; ok && (!lastA.Valid || span[1].After(lastA.Time)) {
		lastA = sql.NullTime{Time: span[1], Valid: true}
	}
	if span, ok := c.auditTimes[b]; ok && (!firstB.Valid || span[0].Before(firstB.Time)) {
		firstB = sql.NullTime{Time: span[0], Valid: true}
	}
	if !lastA.Valid || !firstB.Valid {
		c.fail("no stored time of effect %s or %s, to order them", a, b)
		return false
	}
	return lastA.Time.After(firstB.Time)
}

// rerun tells two effects of two runs of one request, the second after its key expired: they
// derive the same UUIDs from the key (docs/boundary.md, "Effect UUIDs derived from their cause").
func rerun(rqs []*request, a, b effect) bool {
	for _, rq := range rqs {
		if rq.gen == 0 {
			continue
		}
		ga, ka, okA := strings.Cut(strings.TrimPrefix(a.payload, rq.id+"/g"), "/")
		gb, kb, okB := strings.Cut(strings.TrimPrefix(b.payload, rq.id+"/g"), "/")
		if okA && okB && ga != gb && ka == kb && strings.HasPrefix(a.payload, rq.id+"/g") && strings.HasPrefix(b.payload, rq.id+"/g") {
			return true
		}
	}
	return false
}

// describePending notes what is still pending after the drain, row by row (at most 20 of each
// kind per database): where an effect stopped is what a failed drain's replay has to find.
func (c *run) describePending() {
	queries := []string{`SELECT 'effect row ' || source_id || ' seq ' || seq || ': attempts ' || attempts || ', failures ' || failures ||
			', created ' || (clock_timestamp() - created_at) || ' ago, next attempt in ' || coalesce((next_attempt_at - clock_timestamp())::text, 'null') ||
			', backoff until ' || coalesce(backoff_until::text, 'null') || ', parked ' || coalesce(parked_at::text, 'no')
		FROM ` + c.effectsTable() + ` WHERE dispatched_at IS NULL ORDER BY id LIMIT 20`}
	if c.database == postgresDatabase {
		queries = append(queries, `SELECT 'claim ' || p.consumer || ' ' || p.message_id || ' holding ' || length(p.effects) || ' bytes of inline effects: inline_xid ' ||
				coalesce(p.inline_xid::text, 'null') || ' (swept to xid ' || coalesce(st.swept_xid::text, 'null') || ', now at ' || txid_current() || '), processed ' ||
				(clock_timestamp() - p.processed_at) || ' ago, dispatched_at ' || coalesce((clock_timestamp() - p.dispatched_at)::text || ' ago', 'null') ||
				', effects ' || encode(substring(p.effects from 1 for 300), 'escape')
			FROM `+c.prefix+`processed p, `+c.prefix+`stats st WHERE st.id = 1 AND p.effects IS NOT NULL LIMIT 20`)
	}
	for k, db := range c.dbs {
		for _, q := range queries {
			rows, err := db.Query(q)
			if err != nil {
				c.note("describing what is pending in database %d: %v", k, err)
				continue
			}
			for rows.Next() {
				var line string
				if err := rows.Scan(&line); err != nil {
					c.note("describing what is pending in database %d: %v", k, err)
					break
				}
				c.note("pending in database %d: %s", k, line)
			}
			rows.Close()
		}
	}
}
