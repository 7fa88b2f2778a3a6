package pgserver_test

import (
	"context"
	"database/sql"
	"errors"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	_ "github.com/lib/pq"
	"go.uber.org/goleak"

	"github.com/watermill-outbox/outbox/internal/pgserver"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

func start(t *testing.T, opts pgserver.Options) *pgserver.Server {
	t.Helper()
	opts.Logf = t.Logf
	s, err := pgserver.Start(opts)
	if err != nil {
		t.Fatalf("Start: %v", err)
	}
	t.Cleanup(func() { _ = s.Stop() })
	return s
}

func query(t *testing.T, dsn, q string, dest ...any) {
	t.Helper()
	db, err := sql.Open("postgres", dsn)
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if len(dest) == 0 {
		if _, err := db.ExecContext(ctx, q); err != nil {
			t.Fatalf("%s: %v", q, err)
		}
		return
	}
	if err := db.QueryRowContext(ctx, q).Scan(dest...); err != nil {
		t.Fatalf("%s: %v", q, err)
	}
}

// TestTempCluster starts a throwaway cluster, uses it, and checks that Stop removes its data.
func TestTempCluster(t *testing.T) {
	s := start(t, pgserver.Options{})
	if !strings.Contains(s.Version(), "PostgreSQL") {
		t.Errorf("Version() = %q", s.Version())
	}
	var one int
	query(t, s.DSN("postgres"), "SELECT 1", &one)
	if one != 1 {
		t.Fatalf("SELECT 1 = %d", one)
	}
	dir := s.DataDir()
	if _, err := os.Stat(filepath.Join(dir, "PG_VERSION")); err != nil {
		t.Fatalf("data dir: %v", err)
	}
	if err := s.Stop(); err != nil {
		t.Fatalf("Stop: %v", err)
	}
	if err := s.Stop(); err != nil {
		t.Fatalf("second Stop: %v", err)
	}
	if _, err := os.Stat(dir); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("data dir %s still there after Stop (%v)", dir, err)
	}
}

// TestKeptDataDir checks that a cluster in Options.DataDir survives Stop and is reused by the next Start.
func TestKeptDataDir(t *testing.T) {
	// Not t.TempDir: as root, the server's OS user must be able to reach the data dir through its parent.
	parent, err := os.MkdirTemp("", "pgserver-test-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = os.RemoveAll(parent) })
	if err := os.Chmod(parent, 0o755); err != nil {
		t.Fatal(err)
	}
	dataDir := filepath.Join(parent, "data")

	s := start(t, pgserver.Options{DataDir: dataDir})
	query(t, s.DSN("postgres"), "CREATE TABLE kept (v text); INSERT INTO kept VALUES ('still here')")
	if err := s.Stop(); err != nil {
		t.Fatalf("Stop: %v", err)
	}
	if _, err := os.Stat(filepath.Join(dataDir, "PG_VERSION")); err != nil {
		t.Fatalf("data dir not kept: %v", err)
	}

	s = start(t, pgserver.Options{DataDir: dataDir})
	var v string
	query(t, s.DSN("postgres"), "SELECT v FROM kept", &v)
	if v != "still here" {
		t.Fatalf("kept row = %q", v)
	}
}

// TestDataDirNotACluster checks that a non-empty directory without a cluster is refused, not initdb'd.
func TestDataDirNotACluster(t *testing.T) {
	dir := t.TempDir()
	if err := os.WriteFile(filepath.Join(dir, "precious.txt"), []byte("x"), 0o600); err != nil {
		t.Fatal(err)
	}
	s, err := pgserver.Start(pgserver.Options{DataDir: dir})
	if err == nil {
		_ = s.Stop()
		t.Fatal("Start succeeded on a non-empty directory that holds no cluster")
	}
	if !strings.Contains(err.Error(), "PG_VERSION") {
		t.Fatalf("unexpected error: %v", err)
	}
}

// TestNoBinaries checks the error, with its install hint, when the binaries cannot be found.
func TestNoBinaries(t *testing.T) {
	t.Setenv(pgserver.EnvBinDir, t.TempDir())
	s, err := pgserver.Start(pgserver.Options{})
	if err == nil {
		_ = s.Stop()
		t.Fatal("Start succeeded without binaries")
	}
	if !errors.Is(err, pgserver.ErrNoBinaries) || !strings.Contains(err.Error(), "apt-get install postgresql") {
		t.Fatalf("error %q: want ErrNoBinaries with the install hint", err)
	}
}

// TestStandbyPromote: a standby streams what the primary commits, is read-only, and takes writes
// once promoted after the primary was killed.
func TestStandbyPromote(t *testing.T) {
	primary := start(t, pgserver.Options{})
	query(t, primary.DSN("postgres"), `CREATE TABLE t (v int)`)
	standby := start(t, pgserver.Options{StandbyOf: "host=127.0.0.1 port=" + strconv.Itoa(primary.Port()) + " user=postgres application_name=s1"})
	var inRecovery bool
	query(t, standby.DSN("postgres"), `SELECT pg_is_in_recovery()`, &inRecovery)
	if !inRecovery {
		t.Fatal("the standby is not in recovery")
	}
	query(t, primary.DSN("postgres"), `ALTER SYSTEM SET synchronous_standby_names = 's1'`)
	query(t, primary.DSN("postgres"), `SELECT pg_reload_conf()`)
	deadline := time.Now().Add(30 * time.Second)
	for {
		var state string
		db, err := sql.Open("postgres", primary.DSN("postgres"))
		if err != nil {
			t.Fatal(err)
		}
		err = db.QueryRow(`SELECT coalesce(max(sync_state), '') FROM pg_stat_replication WHERE application_name = 's1'`).Scan(&state)
		db.Close()
		if err == nil && state == "sync" {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the standby is not a synchronous standby after 30s (state %q, %v)", state, err)
		}
		time.Sleep(50 * time.Millisecond)
	}
	// Synchronous: the commit returns once the standby has it.
	query(t, primary.DSN("postgres"), `INSERT INTO t VALUES (1)`)
	if err := primary.Kill(); err != nil {
		t.Fatal(err)
	}
	if err := standby.Promote(); err != nil {
		t.Fatal(err)
	}
	query(t, standby.DSN("postgres"), `INSERT INTO t VALUES (2)`)
	var n int
	query(t, standby.DSN("postgres"), `SELECT count(*) FROM t`, &n)
	if n != 2 {
		t.Errorf("%d rows on the promoted standby, want 2", n)
	}
	if err := primary.Stop(); err != nil {
		t.Errorf("Stop after Kill: %v", err)
	}
}
