package tenant

import (
	"cmp"
	"context"
	"slices"
	"sync"

	"github.com/watermill-outbox/outbox"
)

// Health checks every member (outbox.Outbox.Health, all at once, each bounded by ctx and by five
// seconds) and reports their checks named after the member, "acme/database" for example, so that
// an unhealthy report names the member. An empty Set is healthy.
func (s *Set) Health(ctx context.Context) outbox.HealthReport {
	s.mu.RLock()
	ms := make([]*member, 0, len(s.members))
	for _, m := range s.members {
		ms = append(ms, m)
	}
	s.mu.RUnlock()
	slices.SortFunc(ms, func(a, b *member) int { return cmp.Compare(a.name, b.name) })
	reports := make([]outbox.HealthReport, len(ms))
	var wg sync.WaitGroup
	for i, m := range ms {
		wg.Add(1)
		go func() {
			defer wg.Done()
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
