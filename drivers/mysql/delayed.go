package mysql

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/watermill-outbox/outbox/outboxdriver"
	"github.com/watermill-outbox/outbox/store"
)

// delayedInsert stores delayed effects of src in tx. A due time is the effect's delay from the
// insert by the database's clock, the clock the move compares it with.
func (q queries) delayedInsert(ctx context.Context, tx *sql.Tx, src outboxdriver.Source, effects []outboxdriver.Effect) error {
	var b strings.Builder
	b.WriteString(`INSERT INTO ` + q.n.Delayed + ` (source_consumer, source_id, seq, kind, topic, uuid, payload, metadata, ordering_key,
		created_at, due_at, cancel_key) VALUES `)
	args := make([]any, 0, 11*len(effects))
	at := time.Now()
	for i, e := range effects {
		if i > 0 {
			b.WriteString(", ")
		}
		b.WriteString(`(?, ?, ?, ?, ?, ?, ?, ?, ?, ` + now + `, ` + fromNow("?") + `, ?)`)
		payload := e.Payload
		if payload == nil {
			payload = []byte{}
		}
		var key any
		if e.CancelKey != "" {
			key = e.CancelKey
		}
		args = append(args, src.Consumer, src.ID, e.Seq, string(e.Kind), e.Topic, e.UUID, payload, store.EncodeMetadata(e.Metadata),
			e.OrderingKey, max(e.DueAt.Sub(at), 0).Milliseconds(), key)
	}
	_, err := tx.ExecContext(ctx, b.String(), args...)
	return err
}

// moveDelayed moves the delayed effects of the ids in (locked by tx) into pending effects, handed
// over, with ids in due order.
func (q queries) moveDelayed(ctx context.Context, tx *sql.Tx, in string) error {
	if _, err := tx.ExecContext(ctx, `INSERT INTO `+q.n.Effects+` (source_consumer, source_id, seq, kind, topic, uuid, payload, metadata,
			ordering_key, created_at, next_attempt_at)
		SELECT source_consumer, source_id, seq, kind, topic, uuid, payload, metadata, ordering_key, due_at, `+now+`
		FROM `+q.n.Delayed+` FORCE INDEX (PRIMARY) WHERE id IN (`+in+`) ORDER BY due_at, id`); err != nil {
		return err
	}
	_, err := tx.ExecContext(ctx, `DELETE FROM `+q.n.Delayed+` WHERE id IN (`+in+`)`)
	return err
}

// notPastAHeldOne returns the delayed effects of list (locked by tx) that no delayed effect left
// out of it comes before on their key.
func (q queries) notPastAHeldOne(ctx context.Context, tx *sql.Tx, list []int64) ([]int64, error) {
	ids := idList(list)
	rows, err := tx.QueryContext(ctx, `SELECT c.id FROM `+q.n.Delayed+` c WHERE c.id IN (`+ids+`)
		AND NOT EXISTS (SELECT 1 FROM `+q.n.Delayed+` e WHERE e.ordering_key = c.ordering_key AND e.due_at <= c.due_at
			AND (e.due_at < c.due_at OR e.id < c.id) AND e.id NOT IN (`+ids+`))
		ORDER BY c.due_at, c.id`)
	if err != nil {
		return nil, fmt.Errorf("read the delayed effects held back by a held one: %w", err)
	}
	var out []int64
	for rows.Next() {
		var id int64
		if err := rows.Scan(&id); err != nil {
			rows.Close()
			return nil, err
		}
		out = append(out, id)
	}
	return out, errors.Join(rows.Err(), rows.Close())
}

// delayedPromote moves up to limit due delayed effects into the effects table, in one
// transaction at READ COMMITTED (no gap locks: the inserts of new delayed effects never wait for
// it). An idle pass is one read of the due index, outside any transaction. The due rows are
// taken FOR UPDATE SKIP LOCKED, in due order: a row a cancel holds is left (it is gone once the
// cancel commits, or due again at the next pass), and a cancel that comes after waits for this
// transaction and finds nothing. The moved effects are handed over (next_attempt_at set: no grace
// period) and count as stored at their due time; their IDs follow the due order, so that effects
// of one key due together keep it.
func (q queries) delayedPromote(ctx context.Context, db *sql.DB, limit int) (int, error) {
	due := `SELECT id FROM ` + q.n.Delayed + ` WHERE due_at <= ` + now + ` ORDER BY due_at, id LIMIT ?`
	var some bool
	if err := db.QueryRowContext(ctx, `SELECT EXISTS (`+due+`)`, 1).Scan(&some); err != nil || !some {
		return 0, err
	}
	tx, err := db.BeginTx(ctx, readCommitted)
	if err != nil {
		return 0, fmt.Errorf("begin: %w", err)
	}
	defer func() { _ = tx.Rollback() }()
	rows, err := tx.QueryContext(ctx, due+` FOR UPDATE SKIP LOCKED`, max(limit, 1))
	if err != nil {
		return 0, err
	}
	var list []int64
	for rows.Next() {
		var id int64
		if err := rows.Scan(&id); err != nil {
			rows.Close()
			return 0, err
		}
		list = append(list, id)
	}
	if err := errors.Join(rows.Err(), rows.Close()); err != nil {
		return 0, err
	}
	if len(list) == 0 {
		return 0, nil
	}
	// A due one left (a cancel holds it) holds back the later ones of its key, which would
	// otherwise take ids before it: the cancel may roll back. READ COMMITTED reads it, its
	// delete not committed.
	if list, err = q.notPastAHeldOne(ctx, tx, list); err != nil || len(list) == 0 {
		return 0, err
	}
	if err := q.moveDelayed(ctx, tx, idList(list)); err != nil {
		return 0, err
	}
	if err := tx.Commit(); err != nil {
		return 0, fmt.Errorf("commit: %w", err)
	}
	return len(list), nil
}
