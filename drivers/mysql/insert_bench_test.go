package mysql_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/watermill-outbox/outbox/drivers/mysql"
	"github.com/watermill-outbox/outbox/drivers/mysql/internal/mysqltest"
	"github.com/watermill-outbox/outbox/outboxdriver"
)

// BenchmarkKeyedEffectInsert weighs the insert's own look at due delayed effects (a locking
// read inside the INSERT of effects with an ordering key of their own, which sees what
// committed after the snapshot of MySQL's REPEATABLE READ): each iteration runs one unit (claim,
// insert of one keyed effect, commit) with it and one without, interleaved, and reports their
// times and the ratio.
func BenchmarkKeyedEffectInsert(b *testing.B) {
	db := mysqltest.DB(b)
	st, err := mysql.Driver{}.Open(db, outboxdriver.StoreOptions{})
	if err != nil {
		b.Fatal(err)
	}
	ctx := context.Background()
	if err := st.Migrate(ctx); err != nil {
		b.Fatal(err)
	}
	defer mysql.SetLockingDueRead(true)
	unit := func(i int, locking bool) time.Duration {
		mysql.SetLockingDueRead(locking)
		src := outboxdriver.Source{Consumer: "bench", ID: fmt.Sprintf("m-%t-%d", locking, i)}
		began := time.Now()
		tx, err := db.BeginTx(ctx, nil)
		if err != nil {
			b.Fatal(err)
		}
		if c, err := st.MessageClaim(ctx, tx, src); err != nil || !c.Claimed {
			b.Fatalf("claim: %+v %v", c, err)
		}
		e := outboxdriver.Effect{Kind: outboxdriver.KindPublish, Topic: "t", UUID: src.ID, Payload: []byte("p"),
			Source: src, OrderingKey: fmt.Sprintf("order-%d", i%64)}
		if _, err := st.EffectInsert(ctx, tx, src, []outboxdriver.Effect{e}); err != nil {
			b.Fatal(err)
		}
		if err := tx.Commit(); err != nil {
			b.Fatal(err)
		}
		return time.Since(began)
	}
	var with, without time.Duration
	b.ResetTimer()
	for i := range b.N {
		if i%2 == 0 {
			with += unit(i, true)
			without += unit(i, false)
		} else {
			without += unit(i, false)
			with += unit(i, true)
		}
	}
	b.ReportMetric(float64(with.Microseconds())/float64(b.N), "µs/unit-locking")
	b.ReportMetric(float64(without.Microseconds())/float64(b.N), "µs/unit-plain")
	b.ReportMetric(float64(with)/float64(without), "ratio")
}
