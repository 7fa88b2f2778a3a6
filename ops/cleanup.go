package ops

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"time"

	"github.com/watermill-outbox/outbox/outboxdriver"
)

// ServiceConfig is the configuration a running service recorded in the stats table (Outbox.Run
// records it before each cleanup pass).
type ServiceConfig struct {
	Retention         time.Duration `json:"retention_ns"`
	EffectRetention   time.Duration `json:"effect_retention_ns"`
	RedeliveryHorizon time.Duration `json:"redelivery_horizon_ns,omitempty"`
	// RecordedAt is when a service last recorded it; zero if none has.
	RecordedAt time.Time `json:"recorded_at"`
}

// ServiceConfig returns what the service recorded of its configuration (zero RecordedAt: none).
func (o *Ops) ServiceConfig(ctx context.Context) (ServiceConfig, error) {
	var c ServiceConfig
	var r, e, h sql.NullInt64
	var at sql.NullTime
	err := o.db.QueryRowContext(ctx, o.q.ServiceConfig).Scan(&r, &e, &h, &at)
	if err != nil && !errors.Is(err, sql.ErrNoRows) {
		return c, fmt.Errorf("ops: read the service's configuration: %w", err)
	}
	ms := func(n sql.NullInt64) time.Duration { return time.Duration(n.Int64) * time.Millisecond }
	return ServiceConfig{Retention: ms(r), EffectRetention: ms(e), RedeliveryHorizon: ms(h), RecordedAt: at.Time}, nil
}

// DefaultRetention is Config.Retention's default. Without a configuration recorded by the
// service, a cleanup refuses a shorter retention unless forced.
const DefaultRetention = 7 * 24 * time.Hour

// CleanupOptions say what a cleanup deletes, who runs it and how.
type CleanupOptions struct {
	// Actor is written to the audit table. Required.
	Actor string
	// Remote is the address of the client the pass came from, for the audit table (see
	// RepairOptions.Remote).
	Remote string
	// Retention: claims and attempt counters older than this are deleted. Zero takes the
	// service's recorded Retention (an error when none is recorded).
	Retention time.Duration
	// EffectRetention: dispatched effects older than this are deleted. Zero: as long as the
	// claims are kept (the retention in effect), and never shorter than the EffectRetention the
	// service recorded: a cleanup not told how long the service keeps what it dispatched deletes
	// none of it early. To delete every dispatched effect whatever its age, set
	// DeleteDispatched.
	EffectRetention time.Duration
	// DeleteDispatched deletes every dispatched effect kept, whatever its age (EffectRetention
	// is then ignored): what a service without EffectRetention does at dispatch.
	DeleteDispatched bool
	// Force allows a Retention shorter than the service's recorded Retention or
	// RedeliveryHorizon (or, with none recorded, than DefaultRetention): every copy of a
	// message delivered again later than the retention then runs its handler again.
	Force bool
	// DryRun counts what would be deleted and deletes nothing.
	DryRun bool
	// BatchSize is the rows deleted per transaction (default 1000).
	BatchSize int
	// Progress, if set, is called after each batch with the totals so far.
	Progress func(outboxdriver.CleanupResult)
}

// CleanupReport is what a cleanup deleted (or, with DryRun, would delete).
type CleanupReport struct {
	DryRun          bool          `json:"dry_run"`
	Retention       time.Duration `json:"retention_ns"`
	EffectRetention time.Duration `json:"effect_retention_ns"`
	Forced          bool          `json:"forced,omitempty"`
	Claims          int64         `json:"claims"`
	Effects         int64         `json:"effects"`
	Attempts        int64         `json:"attempts"`
	// Keys counts the idempotency keys past the expiry each was claimed with (whatever the
	// retention given here: a key's expiry is the service's IdempotencyRetention at its claim).
	Keys int64 `json:"keys"`
	// DeadLetters counts the dead letters retried or discarded more than Retention ago.
	DeadLetters int64 `json:"dead_letters"`
	Batches     int   `json:"batches,omitempty"`
	// Skipped is true when another process held the cleanup lock: nothing was deleted, or, with
	// Batches above zero, the pass stopped when another process took the lock between two of its
	// batches (the counts say what it deleted until then).
	Skipped bool `json:"skipped,omitempty"`
}

// ErrRetentionTooShort means a cleanup was asked to forget processed message IDs sooner than
// the service does, or sooner than its broker may deliver a copy again.
var ErrRetentionTooShort = errors.New("ops: retention shorter than the service's")

// ErrRetentionUnknown means no retention was given and no service has recorded its own.
var ErrRetentionUnknown = errors.New("ops: no retention given, and no service has recorded its Retention")

// CheckRetention returns the retention a cleanup would use (opt.Retention, or the service's)
// and an error wrapping ErrRetentionTooShort when it is below the service's Retention or
// RedeliveryHorizon (DefaultRetention when none is recorded) and opt.Force is not set.
func (o *Ops) CheckRetention(ctx context.Context, opt CleanupOptions) (time.Duration, error) {
	c, err := o.ServiceConfig(ctx)
	if err != nil {
		return 0, err
	}
	retention := opt.Retention
	if retention == 0 {
		if c.RecordedAt.IsZero() || c.Retention <= 0 {
			return 0, ErrRetentionUnknown
		}
		retention = c.Retention
	}
	if retention < 0 {
		return 0, fmt.Errorf("ops: negative retention %s", retention)
	}
	if opt.Force {
		return retention, nil
	}
	switch {
	case c.RecordedAt.IsZero() && retention < DefaultRetention:
		return retention, fmt.Errorf("%w: no service has recorded its Retention, and %s is below the default %s (force it if the service's is shorter)",
			ErrRetentionTooShort, retention, DefaultRetention)
	case !c.RecordedAt.IsZero() && retention < c.Retention:
		return retention, fmt.Errorf("%w: %s is below the service's Retention %s (recorded %s): message IDs forgotten sooner run their handlers again when redelivered",
			ErrRetentionTooShort, retention, c.Retention, c.RecordedAt.Format(time.RFC3339))
	case !c.RecordedAt.IsZero() && retention < c.RedeliveryHorizon:
		return retention, fmt.Errorf("%w: %s is below the broker's redelivery horizon %s (recorded %s)",
			ErrRetentionTooShort, retention, c.RedeliveryHorizon, c.RecordedAt.Format(time.RFC3339))
	}
	return retention, nil
}

// Cleanup deletes, in batches, the claims and attempt counters older than the retention and the
// dispatched effects older than EffectRetention, as the service's own cleanup does, after
// CheckRetention. The run is written to the audit table before anything is deleted (nothing is
// deleted if that fails), and its totals after.
func (o *Ops) Cleanup(ctx context.Context, opt CleanupOptions) (CleanupReport, error) {
	if opt.Actor == "" {
		return CleanupReport{}, errors.New("ops: an actor is required for the audit table")
	}
	retention, err := o.CheckRetention(ctx, opt)
	if err != nil {
		return CleanupReport{}, err
	}
	if opt.EffectRetention < 0 {
		return CleanupReport{}, fmt.Errorf("ops: negative effect retention %s", opt.EffectRetention)
	}
	switch {
	case opt.DeleteDispatched:
		opt.EffectRetention = 0
	case opt.EffectRetention == 0:
		// Zero was every dispatched effect, whatever its age: an audit trail a service keeps
		// for a day went with a cleanup that only meant to expire claims.
		opt.EffectRetention = retention
		if c, err := o.ServiceConfig(ctx); err == nil && c.EffectRetention > retention {
			opt.EffectRetention = c.EffectRetention
		}
	}
	rep := CleanupReport{DryRun: opt.DryRun, Retention: retention, EffectRetention: opt.EffectRetention, Forced: opt.Force}
	if opt.DryRun {
		res, err := o.st.CleanupCount(ctx, outboxdriver.CleanupParams{Retention: retention, EffectRetention: opt.EffectRetention})
		rep.Claims, rep.Effects, rep.Attempts, rep.Keys, rep.DeadLetters = res.Claims, res.Effects, res.Attempts, res.Keys, res.DeadLetters
		if err != nil {
			return rep, fmt.Errorf("ops: %w", err)
		}
		return rep, nil
	}
	params := fmt.Sprintf("retention %s, effect retention %s", retention, opt.EffectRetention)
	if opt.Force {
		params += ", forced"
	}
	if err := o.audit(ctx, opt.Actor, "cleanup", "expired rows", params, opt.Remote); err != nil {
		return rep, fmt.Errorf("%w (nothing was deleted)", err)
	}
	size := opt.BatchSize
	if size <= 0 {
		size = 1000
	}
	res, err := o.st.Cleanup(ctx, outboxdriver.CleanupParams{Retention: retention, EffectRetention: opt.EffectRetention,
		BatchSize: size, PauseBetweenBatches: 20 * time.Millisecond, PauseFactor: 2, Progress: opt.Progress})
	rep.Claims, rep.Effects, rep.Attempts, rep.Keys, rep.Batches, rep.Skipped = res.Claims, res.Effects, res.Attempts, res.Keys, res.Batches, res.Skipped
	rep.DeadLetters = res.DeadLetters
	detail := fmt.Sprintf("deleted %d claims, %d dispatched effects, %d attempt counters, %d expired idempotency keys, %d settled dead letters",
		res.Claims, res.Effects, res.Attempts, res.Keys, res.DeadLetters)
	switch {
	case err != nil:
		detail += "; stopped: " + err.Error()
	case res.Skipped && res.Batches > 0:
		detail += "; stopped: another process took the cleanup lock between two batches"
	case res.Skipped:
		detail = "another process was cleaning; nothing deleted"
	}
	// A separate context: the totals of a pass cut short by its deadline are still recorded.
	actx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
	defer cancel()
	if aerr := o.audit(actx, opt.Actor, "cleanup-done", "expired rows", detail, opt.Remote); aerr != nil {
		err = errors.Join(err, aerr)
	}
	if err != nil {
		return rep, fmt.Errorf("ops: cleanup: %w", err)
	}
	return rep, nil
}
