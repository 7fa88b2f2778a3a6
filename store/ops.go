package store

import (
	"context"
	"errors"
	"fmt"
)

// OpsQueries are the statements of one dialect that the operators' tools (package ops) run on
// the tables besides the Store's own: reads for status, lists and look-ups. Each names its
// arguments and result columns; durations are in milliseconds, times are the tables' own. A
// dialect that leaves them empty has no operators' tools (ops refuses to open its store).
type OpsQueries struct {
	// Groups -> consumer, topic, pending, age of the oldest pending in ms (0 when none), parked:
	// the undispatched effects per consumer and topic, ordered by both.
	Groups string
	// GroupsWindow (window) -> as Groups, over the oldest window undispatched effects only.
	GroupsWindow string
	// WindowFull (window) -> whether more than window effects are undispatched.
	WindowFull string
	// FailingCounts -> consumer, messages, attempts: the failing messages (attempts without a
	// claim) per consumer, ordered by consumer.
	FailingCounts string
	// Retained (count cap) -> consumer, claims: every consumer with claims, its claims counted up
	// to the cap, at a cost that does not grow with the claims. A count that is NULL or above the
	// cap means more than the cap.
	Retained string
	// LastDispatch -> the latest dispatch time among the claims of the last hour (NULL: none).
	LastDispatch string
	// Parked (ids text or NULL, topic or "", consumer or "", parked longer than ms, error
	// contains or "", after id, limit) -> id, consumer, message id, kind, topic, uuid, ordering
	// key, attempts, failures, last error ("" when none), parked at, created at; by id.
	Parked string
	// Failing (consumer or "", limit) -> consumer, message id, attempts, last error, first
	// failed at, last failed at: attempts without a claim, most attempts first.
	Failing string
	// IsPoisoned (consumer, message id) -> poisoned; no row without a claim.
	IsPoisoned string
	// Poisoned (consumer or "", limit) -> consumer, message id, poisoned at, attempts (0 when
	// none), last error ("" when none); newest first.
	Poisoned string
	// LookupClaim (consumer, message id) -> processed at, dispatched at (NULL allowed), poisoned.
	LookupClaim string
	// LookupEffects (consumer, message id) -> id, kind, topic, uuid, state ("pending", "parked"
	// or "dispatched"), created at, dispatched at (NULL allowed), last error ("" when none); by id.
	LookupEffects string
	// LookupAttempts (consumer, message id) -> attempts, last error.
	LookupAttempts string
	// AuditLog (limit) -> at, actor, action, target, detail, database role or user, client
	// address ("" when unknown), remote address; newest first.
	AuditLog string
	// SampleAge -> ms since a service stored a stats sample (NULL or no row: never).
	SampleAge string
	// ServiceConfig -> retention ms, effect retention ms, redelivery horizon ms, recorded at
	// (each NULL allowed; no row allowed).
	ServiceConfig string
	// IsInsufficientPrivilege tells whether err means the role may not run the statement (the
	// audit log is unreadable to an application role); nil when the dialect cannot tell.
	IsInsufficientPrivilege func(error) bool
}

// OpsQueries returns the dialect's statements for the operators' tools, and an error when the
// dialect has none.
func (s *SQL) OpsQueries() (OpsQueries, error) {
	if s.d.Ops.Groups == "" {
		return OpsQueries{}, errors.New("this store's dialect has no statements for the operators' tools")
	}
	return s.d.Ops, nil
}

// WriteAudit writes a to the audit table by itself: for an operator's action whose changes are
// not made in one transaction with it (the start of a cleanup, its totals).
func (s *SQL) WriteAudit(ctx context.Context, a Audit) error {
	if s.d.Queries.AuditInsert == "" {
		return errors.New("this store has no audit table")
	}
	if _, err := s.db.ExecContext(ctx, s.d.Queries.AuditInsert, a.Actor, a.Action, a.Target, a.Detail, a.Remote); err != nil {
		return fmt.Errorf("write the audit entry: %w", s.wrap(err))
	}
	return nil
}
