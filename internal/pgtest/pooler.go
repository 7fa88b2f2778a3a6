package pgtest

import (
	"fmt"
	"net"
	"net/url"
	"strconv"
	"strings"
	"testing"

	"github.com/watermill-outbox/outbox/internal/pgbouncer"
)

// Pooling modes for PoolerDSN.
const (
	PoolTransaction = pgbouncer.Transaction
	PoolSession     = pgbouncer.Session
)

// PoolerCrashed tells whether the PgBouncer in mode started by PoolerDSN has exited with text in
// the end of its log.
func PoolerCrashed(t testing.TB, mode, text string) bool {
	t.Helper()
	e := current(t)
	mu.Lock()
	defer mu.Unlock()
	b, ok := e.bouncers[mode]
	return ok && b.Exited() && strings.Contains(b.LogTail(), text)
}

// PoolerStatus says whether the PgBouncer in mode started by PoolerDSN runs, and if it exited,
// with the end of its log: for the failure of a test behind it.
func PoolerStatus(t testing.TB, mode string) string {
	t.Helper()
	e := current(t)
	mu.Lock()
	defer mu.Unlock()
	b, ok := e.bouncers[mode]
	if !ok {
		return "no PgBouncer in " + mode + " mode was started"
	}
	return b.Status()
}

// PoolerDSN returns DSN(t) (a fresh database) and the same database reached through a PgBouncer
// in mode (PoolTransaction or PoolSession) on loopback, with 20 server connections per database in
// transaction mode and 100 in session mode (one per client connection). One PgBouncer
// per mode serves the whole test binary and is stopped by Run. The test fails if PgBouncer is not
// installed.
func PoolerDSN(t testing.TB, mode string) (direct, pooled string) {
	t.Helper()
	e := current(t)
	direct = DSN(t)
	u, err := url.Parse(direct)
	if err != nil || u.Host == "" {
		t.Fatalf("pgtest: PoolerDSN needs a postgres:// URL (the built-in server, or %s as a URL): %v", EnvDSN, err)
	}
	b, err := e.bouncer(t, u, mode)
	if err != nil {
		t.Fatalf("pgtest: %v", err)
	}
	u.Host = net.JoinHostPort("127.0.0.1", strconv.Itoa(b.Port()))
	return direct, u.String()
}

func (e *environment) bouncer(t testing.TB, u *url.URL, mode string) (*pgbouncer.Bouncer, error) {
	mu.Lock()
	defer mu.Unlock()
	if b, ok := e.bouncers[mode]; ok {
		if !b.Exited() {
			return b, nil
		}
		// It died under an earlier test (which failed for it): said here, and replaced, so that
		// the tests after it run behind a live one.
		t.Logf("pgtest: the PgBouncer in %s mode had exited, starting another: %s", mode, b.Status())
		_ = b.Stop()
		delete(e.bouncers, mode)
	}
	user := "postgres"
	if u.User != nil {
		user = u.User.Username()
	}
	size := 20
	if mode == pgbouncer.Session {
		size = 100 // a client holds its server connection as long as it is connected
	}
	b, err := pgbouncer.Start(pgbouncer.Options{Upstream: u.Host, User: user, Mode: mode, PoolSize: size})
	if err != nil {
		return nil, fmt.Errorf("start PgBouncer in %s mode: %w", mode, err)
	}
	if e.bouncers == nil {
		e.bouncers = map[string]*pgbouncer.Bouncer{}
	}
	e.bouncers[mode] = b
	return b, nil
}
