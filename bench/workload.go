package main

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"hash/fnv"

	"github.com/jackc/pgx/v5"
)

// The workloads a run can put in every contender's transaction (-workload).
const (
	// workloadInsert is one INSERT into a table without a unique index (businessWrite): the
	// workload of the published tables.
	workloadInsert = "insert"
	// workloadTwoStatement is a reservation as an order service makes one: an UPDATE of a stock
	// row by primary key and an INSERT of a reservation keyed by the delivery's ID, in one
	// transaction. The UPDATE makes the handler's own work, and its WAL, larger than the single
	// INSERT, so that the framework's share of a message is measured against a handler that
	// does something.
	workloadTwoStatement = "two-statement"
)

// workload is the run's -workload; set once in main before any contender is built.
var workload = workloadInsert

// stockRows is the number of stock rows of the two-statement workload: enough that sixteen
// consumers rarely wait for one another's row lock, few enough to stay in cache.
const stockRows = 1000

const (
	stockUpdate       = `UPDATE stock SET qty = qty - 1 WHERE id = $1`
	reservationInsert = `INSERT INTO reservation (id, stock_id) VALUES ($1, $2)`
	// stockInitial is every stock row's quantity before the first run: no run reaches zero.
	stockInitial = 1_000_000_000
)

// workloadContenders are the contenders that implement the two-statement workload: the bare
// forms and the framework's consumer path in each form (and their twins through PgBouncer).
var workloadContenders = map[string]bool{
	"bare": true, "ceiling": true, "protocol-sql": true, "bare-pgx": true, "protocol-pgx": true,
	"outbox-middleware": true, "outbox-pgx": true, "outbox-pgx-pessimistic": true,
	"bare" + pooledSuffix: true, "outbox-middleware" + pooledSuffix: true,
	"bare-pgx" + pooledSuffix: true, "outbox-pgx" + pooledSuffix: true,
}

// checkWorkload tells why contender name cannot run the current workload, or nil.
func checkWorkload(name string) error {
	if workload == workloadTwoStatement && !workloadContenders[name] {
		return fmt.Errorf("the %s workload is implemented for bare, ceiling, protocol-sql, bare-pgx, protocol-pgx, outbox-middleware, outbox-pgx and "+
			"outbox-pgx-pessimistic (and their -pgbouncer twins) only", workload)
	}
	return nil
}

// setupWorkload creates the tables of the two-statement workload.
func setupWorkload(ctx context.Context, db *sql.DB) error {
	if workload != workloadTwoStatement {
		return nil
	}
	_, err := db.ExecContext(ctx, fmt.Sprintf(`
		CREATE TABLE stock (id int PRIMARY KEY, qty bigint NOT NULL);
		INSERT INTO stock (id, qty) SELECT g, %d FROM generate_series(0, %d) g;
		CREATE TABLE reservation (id text PRIMARY KEY, stock_id int NOT NULL, reserved_at timestamptz NOT NULL DEFAULT now());`,
		stockInitial, stockRows-1))
	if err == nil {
		_, err = db.ExecContext(ctx, `VACUUM ANALYZE stock`)
	}
	if err != nil {
		return fmt.Errorf("two-statement workload tables: %w", err)
	}
	return nil
}

// workloadTables are the business tables a run starts empty.
func workloadTables() []string {
	if workload == workloadTwoStatement {
		return []string{"applied", "reservation"}
	}
	return []string{"applied"}
}

// stockOf is the stock row a delivery reserves from: the same for every copy of a message.
func stockOf(id string) int {
	h := fnv.New32a()
	_, _ = h.Write([]byte(id))
	return int(h.Sum32() % stockRows)
}

// sqlExecer is a *sql.Tx or a *sql.DB.
type sqlExecer interface {
	ExecContext(ctx context.Context, query string, args ...any) (sql.Result, error)
}

// businessSQL runs the workload's business write for message id through database/sql.
func businessSQL(ctx context.Context, tx sqlExecer, id string) error {
	if workload != workloadTwoStatement {
		_, err := tx.ExecContext(ctx, businessWrite, id)
		return err
	}
	if _, err := tx.ExecContext(ctx, stockUpdate, stockOf(id)); err != nil {
		return err
	}
	_, err := tx.ExecContext(ctx, reservationInsert, id, stockOf(id))
	return err
}

// businessPgx is businessSQL through pgx.
func businessPgx(ctx context.Context, tx pgx.Tx, id string) error {
	if workload != workloadTwoStatement {
		_, err := tx.Exec(ctx, businessWrite, id)
		return err
	}
	if _, err := tx.Exec(ctx, stockUpdate, stockOf(id)); err != nil {
		return err
	}
	_, err := tx.Exec(ctx, reservationInsert, id, stockOf(id))
	return err
}

// isUniqueViolation tells a duplicate key error (lib/pq's and pgx's alike). A contender without
// deduplication meets one when a redelivered message finds its reservation committed: it drops
// the copy, as a consumer relying on the primary key does.
func isUniqueViolation(err error) bool {
	var s interface{ SQLState() string }
	return errors.As(err, &s) && s.SQLState() == "23505"
}

// appliedCounts reads how many times each message's business change was applied, and how many
// changes were applied beyond one per message where that cannot be told per message (the
// two-statement workload: the reservation's primary key keeps one row per message, a second
// application shows as a stock decrement more than there are reservations).
func appliedCounts(ctx context.Context, db *sql.DB, stockBefore int64) (map[string]int, int, error) {
	q := `SELECT message_id, count(*) FROM applied GROUP BY message_id`
	if workload == workloadTwoStatement {
		q = `SELECT id, 1 FROM reservation`
	}
	applied := map[string]int{}
	rows, err := db.QueryContext(ctx, q)
	if err != nil {
		return nil, 0, err
	}
	defer rows.Close()
	for rows.Next() {
		var id string
		var n int
		if err := rows.Scan(&id, &n); err != nil {
			return nil, 0, err
		}
		applied[id] = n
	}
	if err := rows.Err(); err != nil {
		return nil, 0, err
	}
	if workload != workloadTwoStatement {
		return applied, 0, nil
	}
	after, err := stockSum(ctx, db)
	if err != nil {
		return nil, 0, err
	}
	return applied, int(stockBefore-after) - len(applied), nil
}

// stockSum is the sum of the stock quantities (0 outside the two-statement workload).
func stockSum(ctx context.Context, db *sql.DB) (int64, error) {
	if workload != workloadTwoStatement {
		return 0, nil
	}
	var n int64
	err := db.QueryRowContext(ctx, `SELECT sum(qty) FROM stock`).Scan(&n)
	return n, err
}
