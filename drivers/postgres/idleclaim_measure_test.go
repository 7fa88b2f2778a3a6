package postgres

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"sort"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/watermill-outbox/outbox/internal/pgtest"
	"github.com/watermill-outbox/outbox/outboxdriver"
)

// TestMeasureIdleClaim measures the relay's claim that finds nothing due, with and without the
// column that says when the earliest pending effect falls due (EffectClaim.Pending), interleaved
// in batches on one table: with nothing pending (an idle member), and with 500 effects of one
// window leased by a relay that crashed (the claim then reads them once more). It prints the
// server's execution times, in batches of 50 of each. Set
// OUTBOX_MEASURE_IDLE_CLAIM to the number of claims per variant; it is skipped otherwise.
func TestMeasureIdleClaim(t *testing.T) {
	n, _ := strconv.Atoi(os.Getenv("OUTBOX_MEASURE_IDLE_CLAIM"))
	if n <= 0 {
		t.Skip("OUTBOX_MEASURE_IDLE_CLAIM not set")
	}
	db := pgtest.DB(t)
	st := rotationStore(t, db, -1)
	names, err := NewNames(DefaultSchema, "rot_")
	if err != nil {
		t.Fatal(err)
	}
	withPending := queries(names, false, new(Generation)).EffectClaimDue
	from := strings.Index(withPending, "(SELECT (extract(epoch FROM min(p.at)")
	to := strings.Index(withPending, "WHERE p.at > now())") + len("WHERE p.at > now())")
	if from < 0 || to < from {
		t.Fatal("the claim's pending column not found")
	}
	without := withPending[:from] + "NULL::bigint" + withPending[to:]
	p := outboxdriver.EffectClaimParams{Grace: 10 * time.Second, Limit: 500, Lease: time.Hour}
	args := []any{p.Grace.Milliseconds(), p.Limit, int64(1 << 40), p.Lease.Milliseconds(), int64(0), int64(p.Limit * 4), "[]", int64(0)}
	// The server's execution time (EXPLAIN ANALYZE, without per-node timing): the round trip
	// and the client's scheduling on a loaded machine would drown the difference.
	claim := func(q string) time.Duration {
		var plan string
		if err := db.QueryRowContext(context.Background(), `EXPLAIN (ANALYZE, TIMING OFF, FORMAT JSON) `+q, args...).Scan(&plan); err != nil {
			t.Fatal(err)
		}
		var out []struct {
			Plan struct {
				Rows int `json:"Actual Rows"`
			} `json:"Plan"`
			Execution float64 `json:"Execution Time"`
		}
		if err := json.Unmarshal([]byte(plan), &out); err != nil || len(out) != 1 {
			t.Fatalf("EXPLAIN: %v: %s", err, plan)
		}
		if out[0].Plan.Rows != 1 {
			t.Fatalf("the claim returned %d rows, want the one of a claim that took nothing", out[0].Plan.Rows)
		}
		return time.Duration(out[0].Execution * float64(time.Millisecond))
	}
	measure := func(what string) {
		var a, b []time.Duration
		for i := 0; i < n; i += 50 {
			for j := 0; j < 50; j++ {
				a = append(a, claim(without))
			}
			for j := 0; j < 50; j++ {
				b = append(b, claim(withPending))
			}
		}
		pct := func(ds []time.Duration, q float64) time.Duration {
			sort.Slice(ds, func(i, j int) bool { return ds[i] < ds[j] })
			return ds[int(q*float64(len(ds)-1))]
		}
		fmt.Printf("%s: without the column p50 %s p90 %s; with it p50 %s p90 %s (%d claims each)\n", what,
			pct(a, 0.5), pct(a, 0.9), pct(b, 0.5), pct(b, 0.9), len(a))
	}
	measure("nothing pending")
	record(t, st, db, "u", "k", 500)
	if _, err := db.Exec(`UPDATE ` + names.Effects + ` SET next_attempt_at = now() + interval '1 hour'`); err != nil {
		t.Fatal(err)
	}
	measure("500 effects leased")
}
