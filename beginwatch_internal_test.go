package outbox

import (
	"context"
	"database/sql"
	"database/sql/driver"
	"errors"
	"testing"
	"time"

	"github.com/watermill-outbox/outbox/internal/pgtest"
)

// BenchmarkBeginWatch is the watch's own cost on a unit's path, around a BEGIN that returns at
// once: "goroutine" is what every unit paid before (a goroutine, a timer, a channel and a mutex,
// over BEGIN and the claim), and still pays on lib/pq; "pooled" is a unit on a pooled
// connection with a driver that honours its context (a look at the pool's counters);
// "dial" arms the timer alone, as a unit that opens a connection does.
func BenchmarkBeginWatch(b *testing.B) {
	db := pgtest.DB(b)
	if err := db.Ping(); err != nil { // one idle connection
		b.Fatal(err)
	}
	gate := &dbGate{minDelay: time.Hour, maxDelay: time.Hour, unreachable: unreachable, probe: db.PingContext}
	begin := func(context.Context) (int, error) { return 1, nil }
	ctx := context.Background()
	for _, c := range []struct {
		name string
		w    *beginWatch
	}{
		{"none", nil},
		{"goroutine", &beginWatch{gate: gate, db: db, blind: func() bool { return true }}},
		{"pooled", &beginWatch{gate: gate, db: db}},
	} {
		b.Run(c.name, func(b *testing.B) {
			b.ReportAllocs()
			for range b.N {
				if _, err := watchBegin(ctx, c.w, begin, func(int) {}); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
	b.Run("dial", func(b *testing.B) {
		b.ReportAllocs()
		for range b.N {
			t := time.AfterFunc(beginStall, func() {})
			if _, err := begin(ctx); err != nil {
				b.Fatal(err)
			}
			t.Stop()
		}
	})
}

// Driver shares its type name with pgx's stdlib driver and modernc's SQLite driver: only its
// package path tells it from them.
type Driver struct{}

func (Driver) Open(string) (driver.Conn, error) { return nil, errors.New("not a driver") }

// TestHonoursContextByPackagePath: a driver is known by its package path and type name, not by
// how %T prints it, which a driver of any package with the same names would match; lib/pq
// and unknown drivers are watched as blind.
func TestHonoursContextByPackagePath(t *testing.T) {
	fake := sql.OpenDB(fakeConnector{})
	defer fake.Close()
	if honoursContext(fake) {
		t.Errorf("a driver of this package named Driver is taken for one that honours its context")
	}
	if honoursContext(pgtest.DB(t)) {
		t.Errorf("lib/pq is taken for a driver that honours its context")
	}
	for _, name := range []string{"github.com/jackc/pgx/v5/stdlib.Driver", "github.com/go-sql-driver/mysql.MySQLDriver", "modernc.org/sqlite.Driver"} {
		if !contextHonouringDrivers[name] {
			t.Errorf("%s is not known", name)
		}
	}
}

type fakeConnector struct{}

func (fakeConnector) Connect(context.Context) (driver.Conn, error) {
	return nil, errors.New("not a driver")
}
func (fakeConnector) Driver() driver.Driver { return Driver{} }
