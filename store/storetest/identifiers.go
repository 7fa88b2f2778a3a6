package storetest

import (
	"errors"
	"fmt"
	"time"

	"github.com/watermill-outbox/outbox/outboxdriver"
)

// lookalikes are identifiers that a database may wrongly hold equal: trailing and leading
// spaces (equal under a PAD SPACE collation, such as MySQL's utf8mb4_bin), a tab and other
// control characters (NUL is refused before any store sees it), and "é" composed (NFC) and
// decomposed (NFD, "e" and a combining acute accent). The framework compares identifiers byte for
// byte, as PostgreSQL's text does: each is an identifier of its own.
var lookalikes = []string{"a", "a ", " a", "a  ", "a\t", "a\x01\x1f\x7f", "\u00e9", "e\u0301"}

// testLookalikeClaims: a message whose ID differs from a processed one's by its spaces, a control
// character or its normalization form is another message (a duplicate would be acked, and its
// handler never run); so is a consumer named so. Attempts are counted apart as well.
func testLookalikeClaims(f *fixture) {
	for _, id := range lookalikes {
		src := f.src(id)
		tx := f.begin()
		if !f.claim(tx, src) {
			_ = tx.Rollback()
			f.t.Fatalf("claim of message %q after the claims of %q: taken for a duplicate", id, lookalikes)
		}
		if err := tx.Commit(); err != nil {
			f.t.Fatal(err)
		}
	}
	tx := f.begin()
	for _, consumer := range lookalikes {
		if !f.claim(tx, outboxdriver.Source{Consumer: consumer, ID: "m"}) {
			_ = tx.Rollback()
			f.t.Fatalf("claim of message m by consumer %q after those of %q: taken for a duplicate", consumer, lookalikes)
		}
	}
	_ = tx.Rollback()
	for _, id := range lookalikes {
		if !f.processed(f.src(id)) {
			f.t.Fatalf("message %q not processed", id)
		}
		if got := f.attempt(f.src(id), "failed"); got != 1 {
			f.t.Fatalf("first attempt of message %q counted as %d: counted with another's", id, got)
		}
	}
	if f.processed(f.src("a   ")) || f.processed(f.src("\ta")) {
		f.t.Fatal("a message never claimed is processed: it matched a claim of another ID")
	}
}

// testLookalikeEffects: effects are listed by their own source only, and ordering keys that
// differ by spaces, a control character or normalization form are keys of their own: one does
// not block another, in the fast path's check or at the relay.
func testLookalikeEffects(f *fixture) {
	var all []outboxdriver.Effect
	for _, id := range lookalikes {
		src := f.src(id)
		es := f.effects(src, "k-"+id, 1)
		// Unclaimed: the claims are testLookalikeClaims's.
		f.commit(src, false, es)
		all = append(all, es...)
	}
	for i, id := range lookalikes {
		wantUUIDs(f.t, fmt.Sprintf("pending effects of message %q", id), f.pending(f.src(id)), all[i])
		if f.keyBlocked(f.src(id), "k-"+id) {
			f.t.Fatalf("the effect with ordering key %q is blocked by an effect with another key", "k-"+id)
		}
	}
	// The first key backs off for an hour: the effects of the others are due all the same.
	f.age("effects", "created_at", outboxdriver.Source{}, 2*time.Hour)
	f.recordFailures(failures(all[:1], "broker down", time.Hour)...)
	wantSet(f.t, "relay round while key k-a backs off", f.relay(due, sent), all[1:]...)
}

// testLookalikeIdempotencyKeys: an idempotency key or scope that differs from a committed one by
// its spaces, a control character or its normalization form is claimed anew, and keeps its own
// result; the committed one's result is not replayed to it.
func testLookalikeIdempotencyKeys(f *fixture) {
	ks := f.keyStore()
	for _, key := range lookalikes {
		p := outboxdriver.KeyClaimParams{Scope: "orders", Key: "k-" + key, Fingerprint: []byte("fp " + key), Retention: time.Hour}
		if c := f.claimKey(ks, p, "result of "+key, true); !c.Claimed {
			f.t.Fatalf("claim of key %q after those of %q: %+v, want claimed (not the replay of another key)", p.Key, lookalikes, c)
		}
	}
	for _, scope := range lookalikes {
		p := outboxdriver.KeyClaimParams{Scope: "s-" + scope, Key: "k-a", Retention: time.Hour}
		if c := f.claimKey(ks, p, "result in "+scope, true); !c.Claimed {
			f.t.Fatalf("claim of key k-a in scope %q: %+v, want claimed (scopes keep keys apart)", p.Scope, c)
		}
	}
	for _, key := range lookalikes {
		p := outboxdriver.KeyClaimParams{Scope: "orders", Key: "k-" + key, Retention: time.Hour}
		if c := f.claimKey(ks, p, "", false); c.Claimed || string(c.Fingerprint) != "fp "+key || string(c.Result) != "result of "+key {
			f.t.Fatalf("claim of committed key %q: %+v, want its own fingerprint and result", p.Key, c)
		}
	}
}

// testLookalikeCancelKeys: a cancel key cancels the delayed effects recorded with that key, not
// those of a key that differs from it by its spaces, a control character or normalization form.
func testLookalikeCancelKeys(f *fixture) {
	ds := f.delayedStore()
	src := f.src("delayed")
	es := f.effects(src, "k", len(lookalikes))
	for i, key := range lookalikes {
		es[i].DueAt, es[i].CancelKey = time.Now().Add(time.Hour), "x-"+key
	}
	tx := f.begin()
	defer func() { _ = tx.Rollback() }()
	if err := ds.DelayedInsert(f.ctx, tx, src, es); err != nil {
		f.t.Fatalf("DelayedInsert: %v", err)
	}
	for _, key := range lookalikes {
		if n, err := ds.DelayedCancel(f.ctx, tx, "x-"+key); err != nil || n != 1 {
			f.t.Fatalf("DelayedCancel(%q) = %d, %v; want the 1 effect of that key", "x-"+key, n, err)
		}
	}
	if n, err := ds.DelayedCancel(f.ctx, tx, "x-a   "); err != nil || n != 0 {
		f.t.Fatalf("DelayedCancel of a key no effect has = %d, %v; want 0", n, err)
	}
}

// delayedStore returns the store as a DelayedStore, or skips the test when it keeps no delayed
// effects.
func (f *fixture) delayedStore() outboxdriver.DelayedStore {
	ds, ok := f.st.(outboxdriver.DelayedStore)
	if ok {
		probe := f.begin()
		err := ds.DelayedInsert(f.ctx, probe, f.src("probe"), f.effects(f.src("probe"), "k", 1))
		_ = probe.Rollback()
		ok = !errors.Is(err, outboxdriver.ErrDelayedUnsupported)
		if err != nil && ok {
			f.t.Fatalf("DelayedInsert: %v", err)
		}
	}
	if !ok {
		f.t.Skip("the store keeps no delayed effects")
	}
	return ds
}
