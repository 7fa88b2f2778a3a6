package store

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"strconv"

	"github.com/watermill-outbox/outbox/outboxdriver"
)

var _ outboxdriver.KeyStore = (*SQL)(nil)

// KeyLockName is the name of the lock a unit of work holds on an idempotency key of the tables
// named by n while it runs: unique per tables, scope and key (the scope's length sets it apart
// from the key).
func KeyLockName(n Names, scope, key string) string {
	return n.Schema + "." + n.Prefix + "idempotency/" + strconv.Itoa(len(scope)) + ":" + scope + key
}

// KeyRow runs one statement of a keyed unit of work and scans its row, if any, into dest; it tells
// whether there was one.
type KeyRow func(ctx context.Context, query string, args []any, dest ...any) (bool, error)

// ClaimKey is the claim of an idempotency key on any connection type: the key's lock first (so
// that a retry while the first request runs is told at once, or waits for its outcome), then the
// claim of an absent or expired key, or the committed claim found.
func ClaimKey(ctx context.Context, q Queries, n Names, row KeyRow, p outboxdriver.KeyClaimParams) (outboxdriver.KeyClaim, error) {
	if q.KeyLock == "" {
		return outboxdriver.KeyClaim{}, outboxdriver.ErrKeysUnsupported
	}
	var locked bool
	if _, err := row(ctx, q.KeyLock, []any{KeyLockName(n, p.Scope, p.Key), p.Wait}, &locked); err != nil {
		return outboxdriver.KeyClaim{}, fmt.Errorf("lock idempotency key: %w", err)
	}
	if !locked {
		return outboxdriver.KeyClaim{}, fmt.Errorf("%w (scope %q, key %q)", outboxdriver.ErrKeyInFlight, p.Scope, p.Key)
	}
	fp := p.Fingerprint
	if fp == nil {
		fp = []byte{}
	}
	var one int
	claimed, err := row(ctx, q.KeyClaim, []any{p.Scope, p.Key, fp, p.Retention.Milliseconds()}, &one)
	if err != nil {
		return outboxdriver.KeyClaim{}, fmt.Errorf("claim idempotency key: %w", err)
	}
	if claimed {
		return outboxdriver.KeyClaim{Claimed: true}, nil
	}
	// A statement of its own, with a snapshot that sees the claim the insert ran into.
	var c outboxdriver.KeyClaim
	found, err := row(ctx, q.KeyRead, []any{p.Scope, p.Key}, &c.Fingerprint, &c.Result)
	switch {
	case err != nil:
		return outboxdriver.KeyClaim{}, fmt.Errorf("read idempotency key: %w", err)
	case !found:
		// The lock is held: no other transaction can delete it between the two statements but
		// an operator's statement.
		return outboxdriver.KeyClaim{}, fmt.Errorf("idempotency key %q (scope %q) vanished between its claim and its read", p.Key, p.Scope)
	}
	return c, nil
}

// KeyClaim implements outboxdriver.KeyStore.
func (s *SQL) KeyClaim(ctx context.Context, tx *sql.Tx, p outboxdriver.KeyClaimParams) (outboxdriver.KeyClaim, error) {
	if s.d.Hooks.KeyClaim != nil {
		c, err := s.d.Hooks.KeyClaim(ctx, tx, p)
		return c, s.wrap(err)
	}
	return ClaimKey(ctx, s.d.Queries, s.names, func(ctx context.Context, query string, args []any, dest ...any) (bool, error) {
		err := s.queryRow(ctx, tx, query, args, dest...)
		if errors.Is(err, sql.ErrNoRows) {
			return false, nil
		}
		return err == nil, err
	}, p)
}

// KeySave implements outboxdriver.KeyStore.
func (s *SQL) KeySave(ctx context.Context, tx *sql.Tx, scope, key string, result []byte) error {
	if s.d.Queries.KeySave == "" {
		return outboxdriver.ErrKeysUnsupported
	}
	if result == nil {
		result = []byte{}
	}
	if _, err := s.exec(ctx, tx, s.d.Queries.KeySave, scope, key, result); err != nil {
		return fmt.Errorf("store the result of idempotency key %q: %w", key, err)
	}
	return nil
}
