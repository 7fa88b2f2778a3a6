package ops

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/google/uuid"

	"github.com/watermill-outbox/outbox/outboxdriver"
	"github.com/watermill-outbox/outbox/store"
)

// deadLetterStore is a store built on store.SQL that keeps dead letters, whose retries and
// discards write their audit entries in their own transactions.
type deadLetterStore interface {
	outboxdriver.DeadLetterStore
	DeadLetterRetryAudited(ctx context.Context, c outboxdriver.DeadLetterChange, newSource func() outboxdriver.Source, audit func(outboxdriver.Source) store.Audit) (int, error)
	DeadLetterDiscardAudited(ctx context.Context, c outboxdriver.DeadLetterChange, audit func(outboxdriver.Source) store.Audit) (int, error)
}

func (o *Ops) deadLetters() (deadLetterStore, error) {
	dl, ok := o.st.(deadLetterStore)
	if !ok {
		return nil, fmt.Errorf("ops: %w", outboxdriver.ErrDeadLettersUnsupported)
	}
	return dl, nil
}

// DeadLetters lists the dead letters f selects, oldest first.
func (o *Ops) DeadLetters(ctx context.Context, f outboxdriver.DeadLetterFilter) ([]outboxdriver.DeadLetter, error) {
	dl, err := o.deadLetters()
	if err != nil {
		return nil, err
	}
	out, err := dl.DeadLetterList(ctx, f)
	if err != nil {
		return nil, fmt.Errorf("ops: %w", err)
	}
	return out, nil
}

// DeadLetterGroup counts the dead letters (in state dead) of one consumer whose reasons have one
// Fingerprint; Reason is the first one's.
type DeadLetterGroup struct {
	Consumer    string    `json:"consumer"`
	Reason      string    `json:"reason"`
	Fingerprint string    `json:"fingerprint"`
	Count       int       `json:"count"`
	Oldest      time.Time `json:"oldest"`
	Newest      time.Time `json:"newest"`
	// Keys are its dead letters, so that an action on the group changes those it counted and
	// not those that joined it since.
	Keys []outboxdriver.Source `json:"-"`
}

// maxGrouped bounds the dead letters DeadLetterGroups reads.
const maxGrouped = 10_000

// DeadLetterGroups groups the dead letters in state dead (of consumer, if not empty) by consumer
// and reason, largest group first; it reads the oldest 10,000 at most, and more tells that there
// were more.
func (o *Ops) DeadLetterGroups(ctx context.Context, consumer string) (groups []DeadLetterGroup, more bool, err error) {
	// Without their payloads: up to 10,000 of them, at every page of the console.
	dls, err := o.DeadLetters(ctx, outboxdriver.DeadLetterFilter{Consumer: consumer, State: outboxdriver.DeadLetterDead, Limit: maxGrouped + 1, Brief: true})
	if err != nil {
		return nil, false, err
	}
	if len(dls) > maxGrouped {
		dls, more = dls[:maxGrouped], true
	}
	byKey := map[[2]string]*DeadLetterGroup{}
	for _, d := range dls {
		// One cause in many messages reads differently in each (an order number, an ID).
		k := [2]string{d.Consumer, Fingerprint(d.Reason)}
		g := byKey[k]
		if g == nil {
			g = &DeadLetterGroup{Consumer: d.Consumer, Reason: d.Reason, Fingerprint: k[1], Oldest: d.DeadAt}
			byKey[k] = g
		}
		g.Count++
		g.Keys = append(g.Keys, outboxdriver.Source{Consumer: d.Consumer, ID: d.MessageID})
		if d.DeadAt.Before(g.Oldest) {
			g.Oldest = d.DeadAt
		}
		if d.DeadAt.After(g.Newest) {
			g.Newest = d.DeadAt
		}
	}
	for _, g := range byKey {
		groups = append(groups, *g)
	}
	slices.SortFunc(groups, func(a, b DeadLetterGroup) int {
		return cmp.Or(b.Count-a.Count, strings.Compare(a.Consumer, b.Consumer), strings.Compare(a.Reason, b.Reason))
	})
	return groups, more, nil
}

// RetryDeadLetters hands the dead letters keys names (Source{Consumer, ID: message ID}) back to
// their consumers (see outbox.Outbox.RetryDeadLetters), each with its audit entry in its
// transaction, and wakes the relays that listen. It returns how many it retried; with DryRun,
// how many it would (those in state dead).
func (o *Ops) RetryDeadLetters(ctx context.Context, keys []outboxdriver.Source, opt RepairOptions) (int, error) {
	dl, err := o.deadLetters()
	if err != nil {
		return 0, err
	}
	if strings.TrimSpace(opt.Actor) == "" {
		return 0, errors.New("ops: an actor is required for the audit table")
	}
	if opt.DryRun {
		return o.countDead(ctx, keys)
	}
	n, err := dl.DeadLetterRetryAudited(ctx, outboxdriver.DeadLetterChange{Keys: keys, Actor: opt.Actor},
		func() outboxdriver.Source { return outboxdriver.Source{ID: uuid.NewString()} },
		func(k outboxdriver.Source) store.Audit {
			return auditEntry(opt.Actor, "retry-dead-letter", k.Consumer+"/"+k.ID, "", opt.Remote)
		})
	if n > 0 {
		_ = o.st.EffectNotify(ctx) // the relays poll otherwise
	}
	if err != nil {
		return n, fmt.Errorf("ops: retry dead letters: %w", err)
	}
	return n, nil
}

// DiscardDeadLetters gives the dead letters keys names up (kept, their copies still acked), each
// with its audit entry in its transaction; it returns how many it changed (with DryRun, would).
func (o *Ops) DiscardDeadLetters(ctx context.Context, keys []outboxdriver.Source, opt RepairOptions) (int, error) {
	dl, err := o.deadLetters()
	if err != nil {
		return 0, err
	}
	if strings.TrimSpace(opt.Actor) == "" {
		return 0, errors.New("ops: an actor is required for the audit table")
	}
	if opt.DryRun {
		return o.countDead(ctx, keys)
	}
	n, err := dl.DeadLetterDiscardAudited(ctx, outboxdriver.DeadLetterChange{Keys: keys, Actor: opt.Actor},
		func(k outboxdriver.Source) store.Audit {
			return auditEntry(opt.Actor, "discard-dead-letter", k.Consumer+"/"+k.ID, "", opt.Remote)
		})
	if err != nil {
		return n, fmt.Errorf("ops: discard dead letters: %w", err)
	}
	return n, nil
}

// countDead counts those of keys that are dead letters in state dead: looked up by key where the
// store can, else among the oldest maxGrouped of each consumer.
func (o *Ops) countDead(ctx context.Context, keys []outboxdriver.Source) (int, error) {
	if st, ok := o.st.(interface {
		DeadLetterIsDead(context.Context, outboxdriver.Source) (bool, error)
	}); ok {
		n := 0
		seen := map[outboxdriver.Source]bool{}
		for _, k := range keys {
			if seen[k] {
				continue
			}
			seen[k] = true
			dead, err := st.DeadLetterIsDead(ctx, k)
			if err != nil {
				return 0, err
			}
			if dead {
				n++
			}
		}
		return n, nil
	}
	want := map[outboxdriver.Source]bool{}
	consumers := map[string]bool{}
	for _, k := range keys {
		want[k] = true
		consumers[k.Consumer] = true
	}
	n := 0
	for c := range consumers {
		dls, err := o.DeadLetters(ctx, outboxdriver.DeadLetterFilter{Consumer: c, State: outboxdriver.DeadLetterDead, Limit: maxGrouped})
		if err != nil {
			return 0, err
		}
		for _, d := range dls {
			if want[outboxdriver.Source{Consumer: d.Consumer, ID: d.MessageID}] {
				n++
			}
		}
	}
	return n, nil
}

// deadLetterNowStore is a store built on store.SQL whose attempt counters carry requests to
// dead-letter a failing message at once, written with their audit entries.
type deadLetterNowStore interface {
	outboxdriver.DeadLetterNowStore
	DeadLetterNowAudited(ctx context.Context, src outboxdriver.Source, actor string, audit func() store.Audit) (bool, error)
}

// DeadLetterNow asks that a failing message, key (Source{Consumer, ID: message ID}: its handler
// failed, and it is neither processed nor dead-lettered), be dead-lettered at once: its next
// delivery stores it as a dead letter and acks it without running the handler again (one that
// reaches a process that has not seen it fail runs the handler once more, and is dead-lettered
// if that fails). The request is written with its audit entry; it reports whether the message
// was failing (with DryRun, is).
func (o *Ops) DeadLetterNow(ctx context.Context, key outboxdriver.Source, opt RepairOptions) (bool, error) {
	ds, ok := o.st.(deadLetterNowStore)
	if !ok {
		return false, fmt.Errorf("ops: %w", outboxdriver.ErrDeadLetterNowUnsupported)
	}
	if strings.TrimSpace(opt.Actor) == "" {
		return false, errors.New("ops: an actor is required for the audit table")
	}
	if opt.DryRun {
		req, err := ds.DeadLetterRequested(ctx, key)
		if err != nil {
			return false, fmt.Errorf("ops: %w", err)
		}
		return req.Attempts > 0, nil
	}
	ok, err := ds.DeadLetterNowAudited(ctx, key, opt.Actor, func() store.Audit {
		return auditEntry(opt.Actor, "dead-letter-now", key.Consumer+"/"+key.ID, "", opt.Remote)
	})
	if err != nil {
		return false, fmt.Errorf("ops: dead-letter now: %w", err)
	}
	return ok, nil
}
