package mysql_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	gomysql "github.com/go-sql-driver/mysql"

	"github.com/watermill-outbox/outbox"
	"github.com/watermill-outbox/outbox/drivers/mysql"
	"github.com/watermill-outbox/outbox/drivers/mysql/internal/mysqltest"
	"github.com/watermill-outbox/outbox/outboxdriver"
	"github.com/watermill-outbox/outbox/outboxtest"
)

// placeOrder is the keyed unit of work of these tests: one business row, two effects with UUIDs
// derived from the key, and the response as the result.
func placeOrder(runs *atomic.Int32, order string) func(ctx context.Context, tx *sql.Tx) error {
	return func(ctx context.Context, tx *sql.Tx) error {
		runs.Add(1)
		if _, err := tx.ExecContext(ctx, `INSERT INTO reservations VALUES (?)`, order); err != nil {
			return err
		}
		if err := outbox.Publish(ctx, "placed", outbox.NewMessage(ctx, []byte("placed "+order))); err != nil {
			return err
		}
		if err := outbox.Publish(ctx, "charge", outbox.NewMessage(ctx, []byte("charge "+order))); err != nil {
			return err
		}
		return outbox.SetResult(ctx, []byte("order "+order+" placed"))
	}
}

func keyedOutbox(t *testing.T, db *sql.DB, change func(*outbox.Config)) *outbox.Outbox {
	t.Helper()
	cfg := outbox.Config{DB: db, Driver: mysql.Driver{}, Publisher: &outboxtest.Recorder{}, RetryDelay: -1, HandlerTimeout: 30 * time.Second}
	if change != nil {
		change(&cfg)
	}
	ob, err := outbox.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = ob.Close() })
	if err := ob.Migrate(context.Background()); err != nil {
		t.Fatal(err)
	}
	return ob
}

// callers runs n keyed InTx calls of one key at the same moment, each running fn, and counts
// their outcomes: ran (fn committed), replayed (the key was committed before), in flight, and
// the results they got.
type keyedOutcome struct {
	ran, replayed, inFlight int
	results                 map[string]int
	errs                    []error
}

func callers(ob *outbox.Outbox, n int, key string, opts []outbox.KeyOption, fn func(ctx context.Context, tx *sql.Tx) error) keyedOutcome {
	out := keyedOutcome{results: map[string]int{}}
	var mu sync.Mutex
	var wg sync.WaitGroup
	start := make(chan struct{})
	for range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			<-start
			ctx := outbox.WithIdempotencyKey(context.Background(), "orders", key, opts...)
			err := ob.InTx(ctx, fn)
			mu.Lock()
			defer mu.Unlock()
			switch {
			case errors.Is(err, outbox.ErrIdempotencyInFlight):
				out.inFlight++
				return
			case err != nil:
				out.errs = append(out.errs, err)
				return
			}
			res, rep := outbox.IdempotencyResult(ctx)
			out.results[string(res)]++
			if rep {
				out.replayed++
			} else {
				out.ran++
			}
		}()
	}
	close(start)
	wg.Wait()
	return out
}

// TestKeyedInTxConcurrentRetriesRunOnce: 24 clients retry one key at once, at each isolation
// level: fn runs once, one business row and two effects commit, and every caller gets the first
// one's result. With WaitInFlight every caller waits for it (none is failed by a deadlock or a
// lock wait timeout between them, even with innodb_lock_wait_timeout shorter than the first
// one's run); without, those that came while it ran are told at once that it is in flight.
func TestKeyedInTxConcurrentRetriesRunOnce(t *testing.T) {
	for _, iso := range isolations {
		for _, wait := range []bool{true, false} {
			t.Run(fmt.Sprintf("%s/wait=%v", iso, wait), func(t *testing.T) {
				db := openAt(t, iso, "innodb_lock_wait_timeout=1")
				ob := keyedOutbox(t, db, nil)
				const n = 24
				var runs atomic.Int32
				var opts []outbox.KeyOption
				if wait {
					opts = append(opts, outbox.WaitInFlight())
				}
				began := time.Now()
				out := callers(ob, n, "o-1", opts, func(ctx context.Context, tx *sql.Tx) error {
					// Longer than the lock wait timeout: the others arrive, and wait, while it runs.
					time.Sleep(1200 * time.Millisecond)
					return placeOrder(&runs, "o-1")(ctx, tx)
				})
				t.Logf("%d callers in %s: %d ran, %d replayed, %d told in flight, errors %v", n, time.Since(began).Round(time.Millisecond),
					out.ran, out.replayed, out.inFlight, out.errs)
				if len(out.errs) > 0 {
					t.Errorf("callers failed: %v", out.errs)
				}
				if runs.Load() != 1 || out.ran != 1 {
					t.Errorf("fn ran %d times (%d callers ran it), want once", runs.Load(), out.ran)
				}
				if got := count(t, db, `SELECT count(*) FROM reservations WHERE order_id = 'o-1'`); got != 1 {
					t.Errorf("business rows: %d, want 1", got)
				}
				if got := count(t, db, `SELECT count(*) FROM outbox_effects`); got != 2 {
					t.Errorf("stored effects: %d, want 2", got)
				}
				if wait && (out.inFlight != 0 || out.replayed != n-1) {
					t.Errorf("waiting callers: %d told in flight, %d replayed; want none, %d", out.inFlight, out.replayed, n-1)
				}
				if !wait && out.inFlight == 0 {
					t.Error("no caller was told the key was in flight, though all came while the first ran")
				}
				for res, k := range out.results {
					if res != "order o-1 placed" {
						t.Errorf("%d callers got result %q", k, res)
					}
				}
				// A retry after all of them, on a pool whose connections served the keyed units:
				// the stored result, nothing run, no lock left behind.
				ctx := outbox.WithIdempotencyKey(context.Background(), "orders", "o-1")
				if err := ob.InTx(ctx, placeOrder(&runs, "o-1")); err != nil {
					t.Fatal(err)
				}
				if res, rep := outbox.IdempotencyResult(ctx); !rep || string(res) != "order o-1 placed" {
					t.Errorf("late retry: %q, replayed %v", res, rep)
				}
			})
		}
	}
}

// TestKeyedInTxFirstRunFails: the first run fails while the others wait; the key is not stored,
// so exactly one of the waiting retries runs fn and the rest replay its result.
func TestKeyedInTxFirstRunFails(t *testing.T) {
	for _, iso := range isolations {
		t.Run(iso, func(t *testing.T) {
			db := openAt(t, iso)
			ob := keyedOutbox(t, db, nil)
			var runs atomic.Int32
			out := callers(ob, 8, "o-2", []outbox.KeyOption{outbox.WaitInFlight()}, func(ctx context.Context, tx *sql.Tx) error {
				if err := placeOrder(&runs, "o-2")(ctx, tx); err != nil {
					return err
				}
				time.Sleep(300 * time.Millisecond)
				if runs.Load() == 1 {
					return errors.New("card declined")
				}
				return nil
			})
			if len(out.errs) != 1 || !strings.Contains(out.errs[0].Error(), "card declined") {
				t.Errorf("errors %v, want only the first run's", out.errs)
			}
			if runs.Load() != 2 || out.ran != 1 || out.replayed != 6 {
				t.Errorf("fn ran %d times, %d callers ran, %d replayed; want 2 runs (the failed one, then one), 1, 6", runs.Load(), out.ran, out.replayed)
			}
			if got := count(t, db, `SELECT count(*) FROM reservations`); got != 1 {
				t.Errorf("business rows: %d, want 1", got)
			}
		})
	}
}

// TestKeyLockOutlivesNoUnit: the key's lock is the session's, so it must be released whatever
// ends the unit: a failure, a panic, and a HandlerTimeout reached while fn runs no statement
// (database/sql then rolls the transaction back itself, and would put the connection back into
// the pool with the lock). After each, a retry without waiting from another process (other
// sessions) runs at once instead of finding the key in flight.
func TestKeyLockOutlivesNoUnit(t *testing.T) {
	db := openAt(t, "REPEATABLE-READ")
	ob := keyedOutbox(t, db, func(c *outbox.Config) { c.HandlerTimeout = 500 * time.Millisecond })
	var schema string
	if err := db.QueryRow(`SELECT database()`).Scan(&schema); err != nil {
		t.Fatal(err)
	}
	other := keyedOutbox(t, openAt(t, "REPEATABLE-READ"), func(c *outbox.Config) { c.Schema = schema })
	ends := map[string]func(ctx context.Context, tx *sql.Tx) error{
		"failure": func(context.Context, *sql.Tx) error { return errors.New("failed") },
		"timeout": func(context.Context, *sql.Tx) error {
			time.Sleep(700 * time.Millisecond) // past HandlerTimeout: database/sql has rolled back
			return nil
		},
		"panic": func(context.Context, *sql.Tx) error { panic("handler bug") },
	}
	for name, end := range ends {
		t.Run(name, func(t *testing.T) {
			key := "k-" + name
			func() {
				defer func() { _ = recover() }()
				if err := ob.InTx(outbox.WithIdempotencyKey(context.Background(), "orders", key), end); err == nil {
					t.Error("the unit that ends badly returned nil")
				}
			}()
			var runs atomic.Int32
			ctx := outbox.WithIdempotencyKey(context.Background(), "orders", key)
			if err := other.InTx(ctx, placeOrder(&runs, key)); err != nil {
				t.Fatalf("retry after the unit ended by %s: %v", name, err)
			}
			if _, rep := outbox.IdempotencyResult(ctx); rep || runs.Load() != 1 {
				t.Errorf("retry after the unit ended by %s: replayed %v, ran %d", name, rep, runs.Load())
			}
		})
	}
	// A handler that switches the session to another database: the lock's name, taken from
	// DATABASE() when no schema is configured, names another lock by the time it is released.
	t.Run("use", func(t *testing.T) {
		if _, err := db.Exec("CREATE DATABASE IF NOT EXISTS outbox_elsewhere"); err != nil {
			t.Fatal(err)
		}
		if err := ob.InTx(outbox.WithIdempotencyKey(context.Background(), "orders", "k-use"), func(ctx context.Context, tx *sql.Tx) error {
			_, err := tx.ExecContext(ctx, "USE outbox_elsewhere")
			return err
		}); err != nil {
			t.Fatal(err)
		}
		var runs atomic.Int32
		ctx := outbox.WithIdempotencyKey(context.Background(), "orders", "k-use")
		if err := other.InTx(ctx, placeOrder(&runs, "k-use")); err != nil {
			t.Fatalf("retry after a unit that switched databases: %v", err)
		}
		if _, rep := outbox.IdempotencyResult(ctx); !rep || runs.Load() != 0 {
			t.Errorf("retry after a unit that switched databases: replayed %v, ran %d; want the stored result", rep, runs.Load())
		}
	})
}

// TestKeyedInTxMismatchExpiryAndCleanup: a key reused with another fingerprint is refused; an
// expired key is taken over by the next request; cleanup deletes expired keys only, in batches,
// and its dry run counts them.
func TestKeyedInTxMismatchExpiryAndCleanup(t *testing.T) {
	db := openAt(t, "REPEATABLE-READ")
	ob := keyedOutbox(t, db, nil)
	short := keyedOutbox(t, db, func(c *outbox.Config) { c.IdempotencyRetention = 300 * time.Millisecond; c.CleanupBatchSize = 2 })
	var runs atomic.Int32
	fp := outbox.Fingerprint([]byte("POST /orders {sku: 1}"))
	if err := ob.InTx(outbox.WithIdempotencyKey(context.Background(), "orders", "kept", fp), placeOrder(&runs, "kept")); err != nil {
		t.Fatal(err)
	}
	err := ob.InTx(outbox.WithIdempotencyKey(context.Background(), "orders", "kept", outbox.Fingerprint([]byte("POST /orders {sku: 2}"))),
		placeOrder(&runs, "other"))
	if !errors.Is(err, outbox.ErrIdempotencyMismatch) {
		t.Fatalf("key reused with another fingerprint: %v, want ErrIdempotencyMismatch", err)
	}
	if err := ob.InTx(outbox.WithIdempotencyKey(context.Background(), "other-scope", "kept"), placeOrder(&runs, "kept-2")); err != nil {
		t.Fatalf("the same key in another scope: %v", err)
	}
	for i := range 5 {
		if err := short.InTx(outbox.WithIdempotencyKey(context.Background(), "orders", fmt.Sprintf("k%d", i)), placeOrder(&runs, fmt.Sprintf("o%d", i))); err != nil {
			t.Fatal(err)
		}
	}
	ctx := outbox.WithIdempotencyKey(context.Background(), "orders", "k0")
	if err := short.InTx(ctx, placeOrder(&runs, "o0-again")); err != nil {
		t.Fatal(err)
	}
	if _, rep := outbox.IdempotencyResult(ctx); !rep {
		t.Fatal("retry within the retention ran again")
	}
	time.Sleep(400 * time.Millisecond)
	if err := short.InTx(ctx, placeOrder(&runs, "o0-again")); err != nil {
		t.Fatal(err)
	}
	if res, rep := outbox.IdempotencyResult(ctx); rep || string(res) != "order o0-again placed" {
		t.Fatalf("retry after expiry: result %q, replayed %v; want a new run", res, rep)
	}
	if runs.Load() != 8 {
		t.Errorf("runs: %d, want 8", runs.Load())
	}
	// The dry run of the operators' tool (ops.Cleanup reads the service's configuration with
	// PostgreSQL's SQL: the store's count is called here).
	counter := short.Store().(interface {
		CleanupCount(context.Context, outboxdriver.CleanupParams) (outboxdriver.CleanupResult, error)
	})
	dry, err := counter.CleanupCount(context.Background(), outboxdriver.CleanupParams{Retention: 7 * 24 * time.Hour})
	if err != nil || dry.Keys != 4 {
		t.Fatalf("dry run: %+v, %v; want 4 expired keys counted", dry, err)
	}
	res, err := short.Cleanup(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if res.Keys != 4 || res.Batches < 2 {
		t.Errorf("cleanup: %+v; want 4 expired keys deleted in batches of 2", res)
	}
	if got := count(t, db, `SELECT count(*) FROM outbox_idempotency`); got != 3 {
		t.Errorf("keys left: %d, want 3 (kept twice, k0 claimed again)", got)
	}
}

// TestKeyedInTxWaitIsBounded: a retry that waits for the first request is bounded by
// HandlerTimeout and by its caller's context, and runs nothing.
func TestKeyedInTxWaitIsBounded(t *testing.T) {
	db := openAt(t, "REPEATABLE-READ")
	ob := keyedOutbox(t, db, nil)
	impatient := keyedOutbox(t, db, func(c *outbox.Config) { c.HandlerTimeout = 300 * time.Millisecond })
	var runs atomic.Int32
	holding, release := make(chan struct{}), make(chan struct{})
	done := make(chan error, 1)
	go func() {
		done <- ob.InTx(outbox.WithIdempotencyKey(context.Background(), "orders", "slow"), func(ctx context.Context, tx *sql.Tx) error {
			close(holding)
			<-release
			return placeOrder(&runs, "o1")(ctx, tx)
		})
	}()
	<-holding
	began := time.Now()
	err := impatient.InTx(outbox.WithIdempotencyKey(context.Background(), "orders", "slow", outbox.WaitInFlight()), placeOrder(&runs, "o1"))
	if err == nil || !strings.Contains(err.Error(), "waited for the unit of work in flight") || time.Since(began) > 5*time.Second {
		t.Errorf("waiting past HandlerTimeout: %v after %s", err, time.Since(began))
	}
	cctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
	defer cancel()
	err = ob.InTx(outbox.WithIdempotencyKey(cctx, "orders", "slow", outbox.WaitInFlight()), placeOrder(&runs, "o1"))
	if err == nil || cctx.Err() == nil {
		t.Errorf("waiting past the caller's context: %v", err)
	}
	close(release)
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if runs.Load() != 1 || count(t, db, `SELECT count(*) FROM reservations`) != 1 {
		t.Errorf("runs %d, want 1", runs.Load())
	}
}

// TestCheckWritable: a session whose transactions are read-only is reported as ErrReadOnly by
// the start-up check (Health), and a unit of work on it fails with ErrReadOnly, before fn runs.
func TestCheckWritable(t *testing.T) {
	dsn := mysqltest.DSN(t)
	open := func(extra string) *sql.DB {
		db, err := sql.Open("mysql", dsn+extra)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = db.Close() })
		return db
	}
	rw := open("")
	ob := keyedOutbox(t, rw, nil)
	if err := ob.Store().(outboxdriver.WritableChecker).CheckWritable(context.Background()); err != nil {
		t.Fatalf("CheckWritable on a writable server: %v", err)
	}
	if _, err := rw.Exec(`CREATE TABLE reservations (order_id VARCHAR(64) NOT NULL) ENGINE = InnoDB`); err != nil {
		t.Fatal(err)
	}
	// MariaDB before 11.1 knows the variable as tx_read_only only, MySQL 8 as
	// transaction_read_only only.
	variable := "transaction_read_only"
	if strings.Contains(mysqltest.Version(t), "MariaDB") {
		variable = "tx_read_only"
	}
	ro, err := outbox.New(outbox.Config{DB: open("&" + variable + "=1"), Driver: mysql.Driver{}, Publisher: &outboxtest.Recorder{}})
	if err != nil {
		t.Fatal(err)
	}
	defer ro.Close()
	err = ro.Store().(outboxdriver.WritableChecker).CheckWritable(context.Background())
	if !errors.Is(err, outboxdriver.ErrReadOnly) || !strings.Contains(err.Error(), "read-only") {
		t.Fatalf("CheckWritable on read-only transactions: %v, want ErrReadOnly", err)
	}
	if h := ro.Health(context.Background()); h.Checks[0].OK {
		t.Errorf("Health on read-only transactions: %+v, want the database check failed", h.Checks[0])
	}
	var runs atomic.Int32
	err = ro.InTx(outbox.WithIdempotencyKey(context.Background(), "orders", "ro"), placeOrder(&runs, "ro"))
	if !errors.Is(err, outboxdriver.ErrReadOnly) || runs.Load() != 0 {
		t.Errorf("keyed unit on read-only transactions: %v (ran %d), want ErrReadOnly before fn", err, runs.Load())
	}
	msg := message.NewMessage("m-ro", nil)
	err = ro.Handle(msg, outbox.HandleParams{Consumer: "reserve", MessageID: msg.UUID}, func(*message.Message) ([]*message.Message, error) { return nil, nil })
	if !errors.Is(err, outboxdriver.ErrReadOnly) {
		t.Errorf("a message's unit of work on read-only transactions: %v, want ErrReadOnly", err)
	}
}

// TestCheckWritableReadOnlyServer: a server started read-only (a replica) is reported by the
// start-up check. It changes the server's global read_only: only on the tests' own server (whose
// root user writes whatever read_only says, so the refusal of a write is IsReadOnly's test).
func TestCheckWritableReadOnlyServer(t *testing.T) {
	if !mysqltest.Private() {
		t.Skip("sets the server's global read_only: only on the server the tests started")
	}
	db := mysqltest.DB(t)
	ob := keyedOutbox(t, db, nil)
	checker := ob.Store().(outboxdriver.WritableChecker)
	if err := checker.CheckWritable(context.Background()); err != nil {
		t.Fatalf("CheckWritable before read_only: %v", err)
	}
	if _, err := db.Exec(`SET GLOBAL read_only = ON`); err != nil {
		t.Fatal(err)
	}
	defer func() {
		if _, err := db.Exec(`SET GLOBAL read_only = OFF`); err != nil {
			t.Fatalf("set read_only back: %v", err)
		}
	}()
	err := checker.CheckWritable(context.Background())
	if !errors.Is(err, outboxdriver.ErrReadOnly) || !strings.Contains(err.Error(), "server is read-only") {
		t.Fatalf("CheckWritable on a read-only server: %v, want ErrReadOnly", err)
	}
}

// TestIsReadOnly: the server's refusals of a write because it takes none are read-only, and only
// those: 1290 is also the refusal of a statement by other options.
func TestIsReadOnly(t *testing.T) {
	for _, c := range []struct {
		err  *gomysql.MySQLError
		want bool
	}{
		{&gomysql.MySQLError{Number: 1290, Message: "The MySQL server is running with the --read-only option so it cannot execute this statement"}, true},
		{&gomysql.MySQLError{Number: 1290, Message: "The MySQL server is running with the --super-read-only option so it cannot execute this statement"}, true},
		{&gomysql.MySQLError{Number: 1290, Message: "The MariaDB server is running with the --read-only option so it cannot execute this statement"}, true},
		{&gomysql.MySQLError{Number: 1792, Message: "Cannot execute statement in a READ ONLY transaction"}, true},
		{&gomysql.MySQLError{Number: 1836, Message: "Running in read-only mode"}, true},
		{&gomysql.MySQLError{Number: 1290, Message: "The MariaDB server is running with the --skip-grant-tables option so it cannot execute this statement"}, false},
		{&gomysql.MySQLError{Number: 1290, Message: "The MySQL server is running with the --secure-file-priv option so it cannot execute this statement"}, false},
		{&gomysql.MySQLError{Number: 1213, Message: "Deadlock found when trying to get lock; try restarting transaction"}, false},
	} {
		if got := mysql.IsReadOnly(fmt.Errorf("wrapped: %w", c.err)); got != c.want {
			t.Errorf("IsReadOnly(%d %q) = %v, want %v", c.err.Number, c.err.Message, got, c.want)
		}
	}
}

// TestIsUnreachable: the server's refusals of a connection (too many, for the server or the user;
// a shutdown in progress) make the Outbox wait for its probe; a statement's own errors do not.
func TestIsUnreachable(t *testing.T) {
	for _, c := range []struct {
		err  *gomysql.MySQLError
		want bool
	}{
		{&gomysql.MySQLError{Number: 1040, Message: "Too many connections"}, true},
		{&gomysql.MySQLError{Number: 1203, Message: "User app already has more than 'max_user_connections' active connections"}, true},
		{&gomysql.MySQLError{Number: 1053, Message: "Server shutdown in progress"}, true},
		{&gomysql.MySQLError{Number: 1213, Message: "Deadlock found when trying to get lock; try restarting transaction"}, false},
		{&gomysql.MySQLError{Number: 1146, Message: "Table 'app.outbox_processed' doesn't exist"}, false},
	} {
		if got := mysql.IsUnreachable(fmt.Errorf("wrapped: %w", c.err)); got != c.want {
			t.Errorf("IsUnreachable(%d %q) = %v, want %v", c.err.Number, c.err.Message, got, c.want)
		}
	}
}

// panickingKeys is the MySQL store with a claim that panics once, after taking the key's lock, when
// armed: a bug in a store or driver step of a keyed unit, outside the application's fn.
type panickingKeys struct {
	outboxdriver.Store
	armed *atomic.Bool
}

func (s panickingKeys) KeyClaim(ctx context.Context, tx *sql.Tx, p outboxdriver.KeyClaimParams) (outboxdriver.KeyClaim, error) {
	c, err := s.Store.(outboxdriver.KeyStore).KeyClaim(ctx, tx, p)
	if s.armed.CompareAndSwap(true, false) {
		panic("store bug after the claim")
	}
	return c, err
}

func (s panickingKeys) KeySave(ctx context.Context, tx *sql.Tx, scope, key string, result []byte) error {
	return s.Store.(outboxdriver.KeyStore).KeySave(ctx, tx, scope, key, result)
}

func (s panickingKeys) KeyUnlock(ctx context.Context, conn *sql.Conn, scope, key string) error {
	return s.Store.(outboxdriver.KeySessionLocker).KeyUnlock(ctx, conn, scope, key)
}

type panickingKeysDriver struct{ armed *atomic.Bool }

func (d panickingKeysDriver) Open(db *sql.DB, opts outboxdriver.StoreOptions) (outboxdriver.Store, error) {
	st, err := mysql.Driver{}.Open(db, opts)
	return panickingKeys{Store: st, armed: d.armed}, err
}

// TestKeyLockReleasedAfterAPanicOutsideFn: a panic in a step of the keyed unit other than fn (here
// the store's claim, after it took the key's lock) rolls the unit back on its way up, so that its
// reserved connection, and the session lock of the key, go back: a retry from another process
// runs instead of finding the key in flight.
func TestKeyLockReleasedAfterAPanicOutsideFn(t *testing.T) {
	var armed atomic.Bool
	db := openAt(t, "REPEATABLE-READ")
	ob := keyedOutbox(t, db, func(c *outbox.Config) { c.Driver = panickingKeysDriver{armed: &armed} })
	var schema string
	if err := db.QueryRow(`SELECT database()`).Scan(&schema); err != nil {
		t.Fatal(err)
	}
	other := keyedOutbox(t, openAt(t, "REPEATABLE-READ"), func(c *outbox.Config) { c.Schema = schema })
	var runs atomic.Int32
	armed.Store(true)
	func() {
		defer func() {
			if r := recover(); r == nil {
				t.Error("the store's panic did not reach the caller")
			}
		}()
		_ = ob.InTx(outbox.WithIdempotencyKey(context.Background(), "orders", "k-store-panic"), placeOrder(&runs, "k-store-panic"))
	}()
	ctx := outbox.WithIdempotencyKey(context.Background(), "orders", "k-store-panic")
	if err := other.InTx(ctx, placeOrder(&runs, "k-store-panic")); err != nil {
		t.Fatalf("retry after a store step panicked: %v", err)
	}
	if runs.Load() != 1 {
		t.Errorf("fn ran %d times, want once (the retry)", runs.Load())
	}
}

// TestInTxBeginsAgainOnADeadPooledConnection: a boundary unit on MySQL runs on a connection it
// reserves; one that died in the pool (the server ended its session) is left for another, as
// database/sql's own BeginTx does, instead of failing the unit with "bad connection".
func TestInTxBeginsAgainOnADeadPooledConnection(t *testing.T) {
	db := openAt(t, "REPEATABLE-READ", "checkConnLiveness=false")
	db.SetMaxIdleConns(4)
	ob := keyedOutbox(t, db, nil)
	var id int64
	if err := db.QueryRow(`SELECT CONNECTION_ID()`).Scan(&id); err != nil {
		t.Fatal(err)
	}
	admin := openAt(t, "REPEATABLE-READ")
	if _, err := admin.Exec(fmt.Sprintf("KILL %d", id)); err != nil {
		t.Fatal(err)
	}
	time.Sleep(100 * time.Millisecond)
	var runs atomic.Int32
	if err := ob.InTx(outbox.WithIdempotencyKey(context.Background(), "orders", "k-dead"), placeOrder(&runs, "k-dead")); err != nil {
		t.Fatalf("InTx on a pool whose idle connection died: %v", err)
	}
	if runs.Load() != 1 {
		t.Errorf("fn ran %d times, want once", runs.Load())
	}
}

// TestKeyOutsideTheBasicPlane: with Schema "" the key's lock name was the SHA-1 of DATABASE()
// (utf8mb3) joined to the key (utf8mb4), which the server refused for a key or scope holding a
// character outside the Basic Multilingual Plane (an emoji: error 1267, illegal mix of
// collations): every call with such a key failed. The names are joined as bytes now, the same
// bytes (the same lock name) for every key that worked before.
func TestKeyOutsideTheBasicPlane(t *testing.T) {
	db := openAt(t, "REPEATABLE-READ")
	ob := keyedOutbox(t, db, nil)
	var runs atomic.Int32
	for range 2 {
		ctx := outbox.WithIdempotencyKey(context.Background(), "orders \U0001F6D2", "k-\U0001F600")
		if err := ob.InTx(ctx, placeOrder(&runs, "o-emoji")); err != nil {
			t.Fatalf("keyed InTx with an emoji in its scope and key: %v", err)
		}
	}
	if n := runs.Load(); n != 1 {
		t.Errorf("fn ran %d times, want once (the second call replayed)", n)
	}
}

// TestKeyFreedAtHandlerTimeout: a keyed InTx whose fn ignores its context past HandlerTimeout has
// its transaction rolled back by database/sql, which can never commit, but the key's lock (of
// the session, GET_LOCK) was released only once fn returned: every retry was told the key was
// in flight for as long as fn ran. It is released at HandlerTimeout now, as on PostgreSQL.
func TestKeyFreedAtHandlerTimeout(t *testing.T) {
	db := openAt(t, "REPEATABLE-READ")
	ob := keyedOutbox(t, db, func(c *outbox.Config) { c.HandlerTimeout = 300 * time.Millisecond })
	release := make(chan struct{})
	first := make(chan error, 1)
	var runs atomic.Int32
	go func() {
		first <- ob.InTx(outbox.WithIdempotencyKey(context.Background(), "orders", "hung"), func(ctx context.Context, tx *sql.Tx) error {
			runs.Add(1)
			<-release // ignores its context
			return nil
		})
	}()
	defer func() {
		select {
		case <-release:
		default:
			close(release)
		}
	}()
	time.Sleep(time.Second)
	err := ob.InTx(outbox.WithIdempotencyKey(context.Background(), "orders", "hung"), placeOrder(&runs, "o-hung"))
	if err != nil {
		t.Fatalf("a retry 1 s after the first call's HandlerTimeout (300 ms): %v; want it run", err)
	}
	close(release)
	if err := <-first; err == nil {
		t.Error("the call whose fn outlived HandlerTimeout: nil, want its timeout")
	}
	if n := runs.Load(); n != 2 {
		t.Errorf("fn ran %d times, want twice (the hung one, the retry)", n)
	}
}
