package tenant

import (
	"cmp"
	"context"
	"fmt"
	"slices"
	"sync"
	"time"

	"github.com/watermill-outbox/outbox"
)

// healthTimeout bounds Set.Health as a whole, as outbox.Outbox.Health bounds one member's.
const healthTimeout = 5 * time.Second

// healthConcurrent caps the members that Set.Health checks at once: each check pings its
// member's database and reads its tables, and 200 members checked at once opened a connection
// each.
const healthConcurrent = 16

// Health checks every member (outbox.Outbox.Health) and reports their checks named after the
// member, "acme/database" for example, so that an unhealthy report names the member. An empty
// Set is healthy. The members are checked side by side, at most 16 at a time and, of the
// members that share a pool (one Config.DB, or one pgxpool in the pgx form: schemas or table
// prefixes of one database), at most
// Config.PoolConcurrent at a time, so that a check opens no more connections than the Set's
// background work would; all of it is bounded by ctx and by five seconds. A member whose turn
// did not come within that (its pool's other members' checks were slow: a database that does not
// answer) is reported unhealthy, with the reason.
func (s *Set) Health(ctx context.Context) outbox.HealthReport {
	ctx, cancel := context.WithTimeout(ctx, healthTimeout)
	defer cancel()
	s.mu.RLock()
	ms := make([]*member, 0, len(s.members))
	for _, m := range s.members {
		ms = append(ms, m)
	}
	s.mu.RUnlock()
	slices.SortFunc(ms, func(a, b *member) int { return cmp.Compare(a.name, b.name) })
	all := make(chan struct{}, healthConcurrent)
	pools := map[any]chan struct{}{}
	if s.cfg.PoolConcurrent > 0 {
		for _, m := range ms {
			if id := poolOf(m.ob); id != nil && pools[id] == nil {
				pools[id] = make(chan struct{}, s.cfg.PoolConcurrent)
			}
		}
	}
	acquire := func(sem chan struct{}) bool {
		if sem == nil {
			return true
		}
		select {
		case sem <- struct{}{}:
			return true
		case <-ctx.Done():
			return false
		}
	}
	release := func(sem chan struct{}) {
		if sem != nil {
			<-sem
		}
	}
	reports := make([]outbox.HealthReport, len(ms))
	var wg sync.WaitGroup
	for i, m := range ms {
		wg.Add(1)
		go func() {
			defer wg.Done()
			// The pool's turn first: a check waiting for its pool holds no place of the others'.
			pool := pools[poolOf(m.ob)]
			if !acquire(pool) {
				reports[i] = notChecked(ctx, "its pool's other members")
				return
			}
			defer release(pool)
			if !acquire(all) {
				reports[i] = notChecked(ctx, "the other members")
				return
			}
			defer release(all)
			reports[i] = m.ob.Health(ctx)
		}()
	}
	wg.Wait()
	r := outbox.HealthReport{Healthy: true}
	for i, rep := range reports {
		r.Healthy = r.Healthy && rep.Healthy
		for _, c := range rep.Checks {
			c.Name = ms[i].name + "/" + c.Name
			r.Checks = append(r.Checks, c)
		}
	}
	return r
}

// notChecked is the report of a member whose check did not get its turn before ctx ended.
func notChecked(ctx context.Context, behind string) outbox.HealthReport {
	return outbox.HealthReport{Checks: []outbox.HealthCheck{{Name: outbox.CheckDatabase,
		Reason: fmt.Sprintf("not checked: waited for the checks of %s until the health check's bound: %v", behind, ctx.Err())}}}
}
