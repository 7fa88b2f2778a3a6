package ops

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"time"

	"github.com/watermill-outbox/outbox/outboxdriver"
)

// OverviewParams are the parameters of Ops.Overview.
type OverviewParams struct {
	// Retention is the service's Config.Retention, for the cleanup lag.
	Retention time.Duration
	// MaxAge is how old the stored sample may be; an older one is replaced by a sample taken
	// now, which is not stored. Default: one minute.
	MaxAge time.Duration
	// Fresh takes a sample now (not stored) whatever the age of the stored one: after a repair,
	// when a sample from before it would contradict the lists.
	Fresh bool
	// Window bounds the undispatched effects (the oldest ones) grouped by consumer and topic.
	// Default: 10,000.
	Window int
	// CountsOnly reads the totals and the age of the stored sample, not the groups nor the audit
	// log: a page that lists many databases reads each at the cost of one sample.
	CountsOnly bool
}

// Overview is what the console shows at the top of its page, at a cost that does not grow with
// the backlog.
type Overview struct {
	// Totals are the sampled counts: the sample a running service stored (Outbox.Run samples
	// every StatsInterval), or one taken now when that one is older than MaxAge.
	Totals outboxdriver.Stats
	// ServiceSampled is how long ago a service last stored a sample; negative when none ever
	// did. A running Outbox.Run (and so its relay) stores one every StatsInterval, on one
	// instance at a time: a sample much older than that means that no Run is running anywhere,
	// unless every service turned sampling off.
	ServiceSampled time.Duration
	// Groups are the oldest Window undispatched effects by consumer and topic.
	Groups []Group
	// WindowFull is true when there were more undispatched effects than Window: Groups counts
	// only the oldest of them.
	WindowFull bool
	// Audit and AuditUnreadable are as in Status.
	Audit           []Audit
	AuditUnreadable bool
}

// Overview samples the tables as Status does, with bounded cost: the counts come from the stored
// sample (or a new one, whose counts are capped at outboxdriver.StatsCountCap), the groups look
// at the oldest p.Window undispatched effects only, and the audit log at its newest ten entries.
func (o *Ops) Overview(ctx context.Context, p OverviewParams) (Overview, error) {
	if p.MaxAge <= 0 {
		p.MaxAge = time.Minute
	}
	if p.Window <= 0 {
		p.Window = 10_000
	}
	v := Overview{ServiceSampled: -1}
	var ms sql.NullInt64
	if err := o.db.QueryRowContext(ctx, o.q.SampleAge).Scan(&ms); err != nil && !errors.Is(err, sql.ErrNoRows) {
		return v, fmt.Errorf("ops: overview: %w", err)
	}
	if ms.Valid {
		v.ServiceSampled = time.Duration(max(ms.Int64, 0)) * time.Millisecond
	}
	// A sample taken here is not stored, so that the age of the stored one keeps telling whether
	// a service samples.
	sp := outboxdriver.StatsParams{Retention: p.Retention}
	if ms.Valid && v.ServiceSampled < p.MaxAge && !p.Fresh {
		sp.Interval = p.MaxAge
	}
	var err error
	if v.Totals, err = o.st.Stats(ctx, sp); err != nil {
		return v, fmt.Errorf("ops: overview: %w", err)
	}
	if p.CountsOnly {
		return v, nil
	}
	rows, err := o.db.QueryContext(ctx, o.q.GroupsWindow, p.Window)
	if err != nil {
		return v, fmt.Errorf("ops: overview: %w", err)
	}
	for rows.Next() {
		var g Group
		var oldest int64
		if err := rows.Scan(&g.Consumer, &g.Topic, &g.Pending, &oldest, &g.Parked); err != nil {
			_ = rows.Close()
			return v, err
		}
		g.OldestPending = time.Duration(oldest) * time.Millisecond
		v.Groups = append(v.Groups, g)
	}
	if err := closeRows(rows); err != nil {
		return v, fmt.Errorf("ops: overview: %w", err)
	}
	if err := o.db.QueryRowContext(ctx, o.q.WindowFull, p.Window).Scan(&v.WindowFull); err != nil {
		return v, fmt.Errorf("ops: overview: %w", err)
	}
	if v.Audit, err = o.AuditLog(ctx, 10); errors.Is(err, ErrAuditUnreadable) {
		v.AuditUnreadable = true
	} else if err != nil {
		return v, err
	}
	return v, nil
}
