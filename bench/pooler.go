package main

import (
	"fmt"
	"net"
	"net/url"
	"strconv"
	"strings"

	"github.com/watermill-outbox/outbox/drivers/outboxpgx"
	"github.com/watermill-outbox/outbox/internal/pgbouncer"
)

// The contenders through a connection pooler: PgBouncer in transaction mode on loopback in front
// of the same server, each beside its direct twin, configured as docs/operations.md ("Connection
// poolers") says a deployment behind such a pooler must be: lib/pq with binary_parameters=yes
// (statement and parameters in one message, no statement kept across transactions), pgx with
// default_query_exec_mode=exec (nothing prepared under a name), and the pgx form's listener on a
// direct connection (a LISTEN through a transaction-mode pooler hears nothing).
const pooledSuffix = "-pgbouncer"

// poolerSize is PgBouncer's server connections for the bench database: more than the most
// consumers of a run (16) plus what a framework uses beside them (relay, marks, stats), so that
// a contender waits for a server connection only as long as a transaction holds one.
const poolerSize = 32

// startPooler starts PgBouncer in transaction mode in front of the server of dsn (a postgres://
// URL) and returns it with the DSN of the same database through it.
func startPooler(dsn string) (*pgbouncer.Bouncer, string, error) {
	u, err := url.Parse(dsn)
	if err != nil || u.Host == "" {
		return nil, "", fmt.Errorf("the pooler needs a postgres:// URL DSN, not %q", dsn)
	}
	user := "postgres"
	if u.User != nil {
		user = u.User.Username()
	}
	b, err := pgbouncer.Start(pgbouncer.Options{Upstream: u.Host, User: user, Mode: pgbouncer.Transaction, PoolSize: poolerSize})
	if err != nil {
		return nil, "", err
	}
	u.Host = net.JoinHostPort("127.0.0.1", strconv.Itoa(b.Port()))
	return b, u.String(), nil
}

// withParam adds key=value to the query of a URL DSN.
func withParam(dsn, key, value string) string {
	u, err := url.Parse(dsn)
	if err != nil {
		return dsn
	}
	q := u.Query()
	q.Set(key, value)
	u.RawQuery = q.Encode()
	return u.String()
}

// newPooled returns the contender name (one of the -pgbouncer names) on e.pooledDSN.
func newPooled(e *env, name string) (contender, error) {
	if e.pooledDSN == "" {
		return nil, fmt.Errorf("no PgBouncer: %s", e.poolerErr)
	}
	libpq := withParam(e.pooledDSN, "binary_parameters", "yes")
	pgxDSN := withParam(e.pooledDSN, "default_query_exec_mode", "exec")
	switch strings.TrimSuffix(name, pooledSuffix) {
	case "bare":
		b, err := newBaseDSN(e, libpq, pooledSuffix)
		return &bare{base: b}, err
	case "outbox-middleware":
		return newFrameworkDSN(e, false, "pgb_", libpq, pooledSuffix)
	case "bare-pgx":
		b, pool, err := newPgxBaseDSN(e, pgxDSN, pooledSuffix)
		return &barePgx{base: b, pool: pool}, err
	case "outbox-pgx":
		return newFrameworkPgxDSN(e, "pgxb_", outboxpgx.Optimistic, pgxDSN, pooledSuffix, outboxpgx.WithListenDSN(e.dsn))
	}
	return nil, fmt.Errorf("unknown contender %q", name)
}
