package postgres

import (
	"context"
	"database/sql"
	"database/sql/driver"
	"errors"

	"fmt"
	"reflect"
	"time"

	"github.com/lib/pq"

	"github.com/watermill-outbox/outbox/outboxdriver"
)

// poolerCheckTimeout bounds the wait for the second connection of the check, which holds the
// first meanwhile.
const poolerCheckTimeout = time.Second

// pgx's QueryExecMode values (github.com/jackc/pgx/v5), read from a pgx stdlib connection
// without importing pgx.
const (
	pgxCacheStatement = 1
	pgxCacheDescribe  = 2
	pgxDescribeExec   = 3
	pgxExec           = 4
	pgxSimpleProtocol = 5
)

// poolerRounds is how many times checkPooler looks for the sign of a pooler before it concludes
// there is none: under load, other clients of the pooler may hide it in one round.
const poolerRounds = 5

// checkPooler tells whether db reaches PostgreSQL through a pooler in transaction mode, and when
// it does, refuses (outboxdriver.ErrUnsafeBehindPooler) a client driver that could bind a
// statement's parameters to another client's statement, or that relies on named statements.
//
// The sign of such a pooler: one client connection is served by different server processes in
// two transactions, or by the process another client connection got meanwhile. In each round one
// connection runs a statement, a second holds a transaction open, and the first runs another:
// in session mode (or directly) the first keeps its process throughout and the second has
// another one; a transaction-mode pooler gives the second the process the first just released
// (PgBouncer reuses the last one), or the first a new one.
func checkPooler(ctx context.Context, db *sql.DB) (bool, error) {
	a, err := db.Conn(ctx)
	if err != nil {
		return false, fmt.Errorf("check for a pooler: %w", err)
	}
	defer a.Close()
	first, err := backendPID(ctx, a)
	if err != nil {
		return false, err
	}
	// A second connection only when the pool has one to spare: nothing waits for a connection
	// while it holds one (the wait is bounded besides, for a spare one taken meanwhile).
	var b *sql.Conn
	if st := db.Stats(); st.MaxOpenConnections == 0 || st.Idle > 0 || st.OpenConnections < st.MaxOpenConnections {
		bctx, cancel := context.WithTimeout(ctx, poolerCheckTimeout)
		b, err = db.Conn(bctx)
		cancel()
		if err != nil {
			if ctx.Err() != nil {
				return false, fmt.Errorf("check for a pooler: %w", err)
			}
			b = nil // a pool without a second connection to give: the first alone
		} else {
			defer b.Close()
		}
	}
	for range poolerRounds {
		pooled, tx, err := poolerRound(ctx, a, b, first)
		if isStatementMixup(err) {
			// The check's own statements, which the driver prepared under a name, went missing
			// (or were another connection's) in the next transaction: a pooler it is.
			if err := checkDriverBehindPooler(ctx, a, nil); err != nil {
				return true, err
			}
			return true, fmt.Errorf("%w: the driver prepares named statements, which the next transaction's server connection "+
				"does not have (%w): configure it to send each statement with its parameters in one round trip, or connect through "+
				"a pooler in session mode", outboxdriver.ErrUnsafeBehindPooler, err)
		}
		if err != nil {
			return false, err
		}
		if pooled {
			if tx != nil {
				defer func() { _ = tx.Rollback() }()
			}
			return true, checkDriverBehindPooler(ctx, a, tx)
		}
	}
	return false, nil
}

// poolerRound looks once for the sign of a transaction-mode pooler (see checkPooler) on a, whose
// first statement ran in process first, and b (nil: none). When it finds it, it returns b's
// transaction still open (its process stays with it), for the probes of the driver.
func poolerRound(ctx context.Context, a, b *sql.Conn, first int) (bool, *sql.Tx, error) {
	pid1, err := backendPID(ctx, a)
	if err != nil {
		return false, nil, err
	}
	var tx *sql.Tx
	pooled := pid1 != first
	if b != nil {
		if tx, err = b.BeginTx(ctx, nil); err != nil {
			return false, nil, fmt.Errorf("check for a pooler: %w", err)
		}
		var pid2 int
		if err := tx.QueryRowContext(ctx, "SELECT pg_backend_pid()").Scan(&pid2); err != nil {
			_ = tx.Rollback()
			return false, nil, fmt.Errorf("check for a pooler: %w", err)
		}
		pooled = pooled || pid2 == pid1
	}
	pid3, err := backendPID(ctx, a)
	if err != nil {
		if tx != nil {
			_ = tx.Rollback()
		}
		return false, nil, err
	}
	pooled = pooled || pid3 != pid1
	if !pooled && tx != nil {
		if err := tx.Rollback(); err != nil {
			return false, nil, fmt.Errorf("check for a pooler: %w", err)
		}
		tx = nil
	}
	return pooled, tx, nil
}

// isStatementMixup tells whether err is PostgreSQL's duplicate_prepared_statement (42P05) or
// invalid_sql_statement_name (26000), from lib/pq or pgx.
func isStatementMixup(err error) bool {
	var s interface{ SQLState() string }
	return errors.As(err, &s) && (s.SQLState() == "42P05" || s.SQLState() == "26000")
}

func backendPID(ctx context.Context, c *sql.Conn) (int, error) {
	var pid int
	if err := c.QueryRowContext(ctx, "SELECT pg_backend_pid()").Scan(&pid); err != nil {
		return 0, fmt.Errorf("check for a pooler: %w", err)
	}
	return pid, nil
}

// checkDriverBehindPooler refuses a client driver that is unsafe behind a transaction-mode
// pooler. The probes run in tx (its server connection stays with it), or in a transaction of c.
//
// Unsafe: a statement prepared under a name (it stays on the server connection of its
// transaction, which the next transaction may not get), and a statement sent in two round trips
// (Parse, then Bind on the unnamed statement: between the two, outside a transaction, the pooler
// may hand the server connection to another client, and the Bind then runs that client's
// statement, with an error only when the parameters do not fit it).
func checkDriverBehindPooler(ctx context.Context, c *sql.Conn, tx *sql.Tx) error {
	var pkg string
	var mode int64 = -1
	_ = c.Raw(func(dc any) error {
		pkg = pkgOf(dc)
		mode = pgxExecMode(dc)
		return nil
	})
	if pkg == "github.com/jackc/pgx/v5/stdlib" && mode > 0 {
		return pgxBehindPooler(mode)
	}
	if tx == nil {
		var err error
		if tx, err = c.BeginTx(ctx, nil); err != nil {
			return fmt.Errorf("check the driver behind a pooler: %w", err)
		}
		defer func() { _ = tx.Rollback() }()
	}
	if pkg == "github.com/lib/pq" {
		// With binary_parameters=yes lib/pq sends Parse, Bind and Execute at once, with []byte
		// parameters in binary (four bytes make an int4); otherwise it describes the statement in
		// a round trip of its own and sends []byte as text, which these bytes are not.
		var got int
		err := tx.QueryRowContext(ctx, "SELECT $1::int4", []byte{0, 0, 0, 7}).Scan(&got)
		var pqErr *pq.Error
		switch {
		case err == nil && got == 7:
		case err == nil || errors.As(err, &pqErr) && pqErr.Code.Class() == "22":
			return fmt.Errorf("%w: lib/pq sends a statement's parameters in a round trip after the statement, which the pooler may give "+
				"to another client's statement: add binary_parameters=yes to the connection string (or connect through a pooler in session mode)",
				outboxdriver.ErrUnsafeBehindPooler)
		default:
			return fmt.Errorf("check the driver behind a pooler: %w", err)
		}
		return nil
	}
	// Another driver: refuse at least one that prepares named statements.
	const count = "SELECT count(*) FROM pg_prepared_statements"
	var before, after int
	if err := tx.QueryRowContext(ctx, count).Scan(&before); err != nil {
		return fmt.Errorf("check the driver behind a pooler: %w", err)
	}
	var one int
	if err := tx.QueryRowContext(ctx, "SELECT $1::int /* outbox pooler check */", 1).Scan(&one); err != nil {
		return fmt.Errorf("check the driver behind a pooler: %w", err)
	}
	if err := tx.QueryRowContext(ctx, count).Scan(&after); err != nil {
		return fmt.Errorf("check the driver behind a pooler: %w", err)
	}
	if after > before {
		return fmt.Errorf("%w: the driver (%s) prepares named statements, which the next transaction's server connection does not have: "+
			"configure it to send each statement with its parameters in one round trip, or connect through a pooler in session mode",
			outboxdriver.ErrUnsafeBehindPooler, pkg)
	}
	return nil
}

// pkgOf returns the import path of the package that defines the driver connection dc.
func pkgOf(dc any) string {
	t := reflect.TypeOf(dc)
	for t != nil && t.Kind() == reflect.Pointer {
		t = t.Elem()
	}
	if t == nil {
		return ""
	}
	return t.PkgPath()
}

// pgxExecMode returns the default QueryExecMode of a pgx stdlib connection (its Conn().Config()),
// or -1.
func pgxExecMode(dc any) (mode int64) {
	defer func() {
		if recover() != nil {
			mode = -1
		}
	}()
	if _, ok := dc.(driver.Conn); !ok {
		return -1
	}
	m := reflect.ValueOf(dc).MethodByName("Conn")
	if !m.IsValid() || m.Type().NumIn() != 0 || m.Type().NumOut() != 1 {
		return -1
	}
	conn := m.Call(nil)[0]
	cfg := conn.MethodByName("Config")
	if !cfg.IsValid() || cfg.Type().NumIn() != 0 || cfg.Type().NumOut() != 1 {
		return -1
	}
	f := reflect.Indirect(cfg.Call(nil)[0]).FieldByName("DefaultQueryExecMode")
	if !f.IsValid() || !f.CanInt() {
		return -1
	}
	return f.Int()
}

// pgxBehindPooler refuses pgx's query exec modes that are unsafe behind a transaction-mode pooler.
func pgxBehindPooler(mode int64) error {
	switch mode {
	case pgxCacheStatement:
		return fmt.Errorf("%w: pgx's default query exec mode, cache_statement, prepares named statements that the next transaction's "+
			"server connection does not have: add default_query_exec_mode=exec to the connection string "+
			"(or set ConnConfig.DefaultQueryExecMode = pgx.QueryExecModeExec), or connect through a pooler in session mode",
			outboxdriver.ErrUnsafeBehindPooler)
	case pgxDescribeExec:
		return fmt.Errorf("%w: pgx's query exec mode describe_exec sends a statement's parameters in a round trip after the statement, "+
			"which the pooler may give to another client's statement: use default_query_exec_mode=exec in the connection string "+
			"(or ConnConfig.DefaultQueryExecMode = pgx.QueryExecModeExec), or connect through a pooler in session mode",
			outboxdriver.ErrUnsafeBehindPooler)
	}
	return nil // cache_describe, exec and simple_protocol send each statement with its parameters
}
