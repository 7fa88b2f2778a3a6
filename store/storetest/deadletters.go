package storetest

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"maps"
	"strings"
	"time"

	"github.com/watermill-outbox/outbox/outboxdriver"
)

// testDeadLetters: a dead letter is stored with everything needed to hand the message back, its
// claim acks later copies, a retry hands it back once (claim and attempts reset, the message an
// effect to its source topic with its own UUID), and a discard keeps it.
func testDeadLetters(f *fixture) {
	ds, ok := f.st.(outboxdriver.DeadLetterStore)
	if !ok {
		f.t.Skipf("%T keeps no dead letters", f.st)
	}
	src := f.src("dead")
	payload := []byte("bytes \x00\xff of the message")
	md := map[string]string{"k": "v", "nul": "a\x00b\xff"}
	f.attempt(src, "first failure")
	poison := &outboxdriver.Effect{Kind: outboxdriver.KindPublish, Topic: "poison", UUID: src.ID, Payload: payload,
		Metadata: md, Source: src, OrderingKey: outboxdriver.DefaultOrderingKey(src)}
	n, err := ds.DeadLetterInsert(f.ctx, outboxdriver.DeadLetter{Consumer: src.Consumer, MessageID: src.ID, SourceTopic: "orders",
		Payload: payload, Metadata: md, Reason: "bad \x00 input", Permanent: true}, true, poison)
	if err != nil || n != 2 {
		f.t.Fatalf("DeadLetterInsert = %d, %v; want the second attempt counted", n, err)
	}
	if poison.StoreID == 0 {
		f.t.Fatal("DeadLetterInsert left the StoreID of the poison copy unset")
	}
	// The claim is written with it: a copy delivered later is a duplicate, with the poison copy
	// pending.
	if !f.processed(src) {
		f.t.Fatal("dead-lettered message not processed")
	}
	tx := f.begin()
	if f.claim(tx, src) {
		f.t.Fatal("claim of a dead-lettered message: want a duplicate")
	}
	_ = tx.Rollback()
	if es := f.pending(src); len(es) != 1 || es[0].Topic != "poison" || es[0].UUID != src.ID {
		f.t.Fatalf("pending effects of the dead-lettered message: %+v; want the poison copy", es)
	}

	other := f.src("other")
	if n, err := ds.DeadLetterInsert(f.ctx, outboxdriver.DeadLetter{Consumer: other.Consumer, MessageID: other.ID,
		Reason: "max attempts", Attempts: 5}, false, nil); err != nil || n != 5 {
		f.t.Fatalf("DeadLetterInsert without counting = %d, %v; want 5", n, err)
	}
	list := func(filter outboxdriver.DeadLetterFilter) []outboxdriver.DeadLetter {
		f.t.Helper()
		dls, err := ds.DeadLetterList(f.ctx, filter)
		if err != nil {
			f.t.Fatalf("DeadLetterList(%+v): %v", filter, err)
		}
		return dls
	}
	dls := list(outboxdriver.DeadLetterFilter{State: outboxdriver.DeadLetterDead})
	if len(dls) != 2 {
		f.t.Fatalf("dead letters: %+v; want 2", dls)
	}
	// Brief: the same dead letters, without their payloads and metadata.
	brief := list(outboxdriver.DeadLetterFilter{State: outboxdriver.DeadLetterDead, Brief: true})
	if len(brief) != 2 || brief[0].MessageID != dls[0].MessageID || brief[0].Reason != dls[0].Reason ||
		len(brief[0].Payload) != 0 || len(brief[0].Metadata) != 0 {
		f.t.Fatalf("brief list: %+v; want the dead letters without payload or metadata", brief)
	}
	d := dls[0]
	if d.MessageID != src.ID || d.Consumer != src.Consumer || d.SourceTopic != "orders" || !bytes.Equal(d.Payload, payload) ||
		!maps.Equal(d.Metadata, md) || !strings.HasPrefix(d.Reason, "bad") || d.Attempts != 2 || !d.Permanent ||
		d.State != outboxdriver.DeadLetterDead || d.DeadAt.IsZero() || !d.ChangedAt.IsZero() {
		f.t.Fatalf("dead letter read back as %+v", d)
	}
	if dls[1].MessageID != other.ID || dls[1].Permanent || dls[1].SourceTopic != "" {
		f.t.Fatalf("second dead letter read back as %+v", dls[1])
	}
	if got := list(outboxdriver.DeadLetterFilter{Consumer: "nobody"}); len(got) != 0 {
		f.t.Fatalf("dead letters of another consumer: %+v", got)
	}
	// A consumer named by spaces is one like any other, not "every consumer" (a comparison
	// that ignores trailing spaces took it for the empty filter).
	if got := list(outboxdriver.DeadLetterFilter{Consumer: " "}); len(got) != 0 {
		f.t.Fatalf("dead letters of consumer %q: %+v; want none", " ", got)
	}
	if got := list(outboxdriver.DeadLetterFilter{Limit: 1}); len(got) != 1 {
		f.t.Fatalf("limit 1: %d dead letters", len(got))
	}
	if c, err := ds.DeadLetterCount(f.ctx); err != nil || c != 2 {
		f.t.Fatalf("DeadLetterCount = %d, %v; want 2", c, err)
	}
	if s, err := f.st.Stats(f.ctx, outboxdriver.StatsParams{}); err != nil || s.DeadLetters != 2 {
		f.t.Fatalf("Stats = %+v, %v; want 2 dead letters", s, err)
	}

	// Looked up by its key (a dry run of a retry or discard), with the key's bytes exactly.
	isDead, lookup := f.st.(interface {
		DeadLetterIsDead(context.Context, outboxdriver.Source) (bool, error)
	})
	if lookup {
		upper := outboxdriver.Source{Consumer: src.Consumer, ID: strings.ToUpper(src.ID)}
		for _, c := range []struct {
			key  outboxdriver.Source
			want bool
		}{{src, true}, {upper, false}, {outboxdriver.Source{Consumer: src.Consumer, ID: src.ID + " "}, false}} {
			if dead, err := isDead.DeadLetterIsDead(f.ctx, c.key); err != nil || dead != c.want {
				f.t.Fatalf("DeadLetterIsDead(%q) = %v, %v; want %v", c.key.ID, dead, err, c.want)
			}
		}
	}
	// A retry, twice: the second finds it retried already and changes nothing.
	retrySrc := outboxdriver.Source{ID: "retry-of-dead"}
	for i, want := range []int{1, 0} {
		n, err := ds.DeadLetterRetry(f.ctx, outboxdriver.DeadLetterChange{Keys: []outboxdriver.Source{src}, Actor: "ops"},
			func() outboxdriver.Source { return retrySrc })
		if err != nil || n != want {
			f.t.Fatalf("DeadLetterRetry #%d = %d, %v; want %d", i+1, n, err, want)
		}
	}
	if f.processed(src) {
		f.t.Fatal("retried dead letter: the claim is still there, the message would be acked as a duplicate")
	}
	if lookup {
		if dead, err := isDead.DeadLetterIsDead(f.ctx, src); err != nil || dead {
			f.t.Fatalf("DeadLetterIsDead of a retried dead letter = %v, %v; want false", dead, err)
		}
	}
	if got := f.attempt(src, "after the retry"); got != 1 {
		f.t.Fatalf("first attempt after the retry counted as %d; want its attempts reset", got)
	}
	es := f.pending(retrySrc)
	addressed := maps.Clone(md)
	addressed[outboxdriver.MetadataRetryFor] = src.Consumer // for its consumer only
	if len(es) != 1 || es[0].Topic != "orders" || es[0].UUID != src.ID || !bytes.Equal(es[0].Payload, payload) || !maps.Equal(es[0].Metadata, addressed) {
		f.t.Fatalf("effect of the retry: %+v; want the message to its source topic with its UUID, addressed to its consumer", es)
	}
	// Handed to the relay at once: the operator who retried it does not wait for the grace period.
	if got := f.relay(due, sent); len(got) != 1 || got[0].UUID != src.ID || got[0].Topic != "orders" {
		f.t.Fatalf("relayed after the retry: %+v; want the retried message at once", got)
	}
	// One without a source topic cannot be retried: nothing changes.
	if _, err := ds.DeadLetterRetry(f.ctx, outboxdriver.DeadLetterChange{Keys: []outboxdriver.Source{other}, Actor: "ops"},
		func() outboxdriver.Source { return outboxdriver.Source{ID: "retry-of-other"} }); err == nil {
		f.t.Fatal("retry of a dead letter without a source topic: want an error")
	}
	if len(f.pending(outboxdriver.Source{ID: "retry-of-other"})) != 0 || !f.processed(other) {
		f.t.Fatal("failed retry changed something")
	}
	if n, err := ds.DeadLetterDiscard(f.ctx, outboxdriver.DeadLetterChange{Keys: []outboxdriver.Source{other}, Actor: "ops"}); err != nil || n != 1 {
		f.t.Fatalf("DeadLetterDiscard = %d, %v; want 1", n, err)
	}
	if !f.processed(other) {
		f.t.Fatal("discarded dead letter: the claim is gone, a copy would run the handler")
	}
	if c, err := ds.DeadLetterCount(f.ctx); err != nil || c != 0 {
		f.t.Fatalf("DeadLetterCount after retry and discard = %d, %v; want 0", c, err)
	}
	if s, err := f.st.Stats(f.ctx, outboxdriver.StatsParams{}); err != nil || s.DeadLetters != 0 {
		f.t.Fatalf("Stats after retry and discard = %+v, %v; want no dead letters", s, err)
	}
	dls = list(outboxdriver.DeadLetterFilter{})
	if len(dls) != 2 || dls[0].State != outboxdriver.DeadLetterRetried || dls[0].Retries != 1 || dls[0].ChangedBy != "ops" ||
		dls[0].ChangedAt.IsZero() || dls[1].State != outboxdriver.DeadLetterDiscarded || dls[1].Retries != 0 {
		f.t.Fatalf("dead letters after retry and discard: %+v", dls)
	}

	// Dead again after its retry: the dead letter is replaced, its retries kept.
	if n, err := ds.DeadLetterInsert(f.ctx, outboxdriver.DeadLetter{Consumer: src.Consumer, MessageID: src.ID,
		Payload: payload, Metadata: md, Reason: "again"}, true, nil); err != nil || n != 2 {
		f.t.Fatalf("DeadLetterInsert after the retry = %d, %v; want 2 attempts", n, err)
	}
	dls = list(outboxdriver.DeadLetterFilter{State: outboxdriver.DeadLetterDead})
	if len(dls) != 1 || dls[0].Retries != 1 || dls[0].Reason != "again" || dls[0].SourceTopic != "orders" || dls[0].Permanent {
		f.t.Fatalf("dead letter dead again: %+v", dls)
	}
	if !f.processed(src) {
		f.t.Fatal("dead again: no claim")
	}

	// Cleanup deletes a dead letter retried or discarded more than Retention ago, never a dead one.
	time.Sleep(20 * time.Millisecond)
	p := outboxdriver.CleanupParams{Retention: 10 * time.Millisecond, EffectRetention: time.Hour, BatchSize: 10}
	if cc, ok := f.st.(interface {
		CleanupCount(context.Context, outboxdriver.CleanupParams) (outboxdriver.CleanupResult, error)
	}); ok {
		if dry, err := cc.CleanupCount(f.ctx, p); err != nil || dry.DeadLetters != 1 {
			f.t.Fatalf("CleanupCount = %+v, %v; want the discarded dead letter", dry, err)
		}
	}
	if res := f.cleanup(p); res.DeadLetters != 1 {
		f.t.Fatalf("cleanup: %+v; want the discarded dead letter deleted", res)
	}
	dls = list(outboxdriver.DeadLetterFilter{})
	if len(dls) != 1 || dls[0].MessageID != src.ID {
		f.t.Fatalf("dead letters after the cleanup: %+v; want the dead one kept", dls)
	}
}

// testDeadLettersCleanupDeadAgain: a cleanup that finds a dead letter retried long ago while the
// message is being dead-lettered again (uncommitted) waits for it, and then leaves the new dead
// letter alone. A cleanup that judged the row by the version it first saw would delete the dead
// letter of a message that is dead now: its claim acks every later copy, and nothing would list
// it or hand it back any more.
func testDeadLettersCleanupDeadAgain(f *fixture) {
	ds, ok := f.st.(outboxdriver.DeadLetterStore)
	if !ok {
		f.t.Skipf("%T keeps no dead letters", f.st)
	}
	if !f.h.Capabilities.RowLocks {
		return // one writer at a time: a cleanup cannot run while the new dead letter is held
	}
	src := f.src("dead-again")
	if _, err := ds.DeadLetterInsert(f.ctx, outboxdriver.DeadLetter{Consumer: src.Consumer, MessageID: src.ID, SourceTopic: "orders",
		Payload: []byte("p"), Reason: "first"}, true, nil); err != nil {
		f.t.Fatalf("DeadLetterInsert: %v", err)
	}
	if n, err := ds.DeadLetterRetry(f.ctx, outboxdriver.DeadLetterChange{Keys: []outboxdriver.Source{src}, Actor: "ops"},
		func() outboxdriver.Source { return outboxdriver.Source{ID: "retry-of-dead-again"} }); err != nil || n != 1 {
		f.t.Fatalf("DeadLetterRetry = %d, %v; want 1", n, err)
	}
	f.age("dead_letters", "changed_at", src, 2*time.Hour)

	// What DeadLetterInsert writes when the retried message fails for good again, held
	// uncommitted so that the cleanup reaches the row while it is locked.
	tx := f.begin()
	defer func() { _ = tx.Rollback() }()
	if _, err := tx.ExecContext(f.ctx, `UPDATE `+f.h.Table("dead_letters")+` SET state = 'dead', changed_at = NULL,
		changed_by = '', reason = 'again' WHERE consumer = '`+src.Consumer+`' AND message_id = '`+src.ID+`'`); err != nil {
		f.t.Fatalf("dead-letter again: %v", err)
	}
	type result struct {
		res outboxdriver.CleanupResult
		err error
	}
	done := make(chan result, 1)
	go func() {
		res, err := f.st.Cleanup(f.ctx, outboxdriver.CleanupParams{Retention: time.Hour, EffectRetention: time.Hour, BatchSize: 10})
		done <- result{res, err}
	}()
	f.waitUntil("cleanup to wait for the new dead letter", func() bool { return f.h.Blocked(f.t) })
	if err := tx.Commit(); err != nil {
		f.t.Fatalf("commit the new dead letter: %v", err)
	}
	r := receive(f, "cleanup after the new dead letter committed", done)
	if r.err != nil || r.res.DeadLetters != 0 {
		f.t.Fatalf("cleanup while the message was dead-lettered again: %+v, %v; want no dead letter deleted", r.res, r.err)
	}
	dls, err := ds.DeadLetterList(f.ctx, outboxdriver.DeadLetterFilter{State: outboxdriver.DeadLetterDead})
	if err != nil || len(dls) != 1 || dls[0].MessageID != src.ID || dls[0].Reason != "again" || dls[0].Retries != 1 {
		f.t.Fatalf("dead letters after the cleanup: %+v, %v; want the message dead again, its retry counted", dls, err)
	}
}

// testReplayDeadLetter: a replay of a dead-lettered message (its claim written poisoned by the
// dead letter) settles its dead letter as retried in the same transaction: the message is
// handed back by hand, so the dead letter is no longer listed or counted as dead, and a retry
// from it afterwards hands nothing over a second time.
func testReplayDeadLetter(f *fixture) {
	ds, ok := f.st.(outboxdriver.DeadLetterStore)
	if !ok {
		f.t.Skipf("%T keeps no dead letters", f.st)
	}
	src := f.src("replayed-dead")
	if _, err := ds.DeadLetterInsert(f.ctx, outboxdriver.DeadLetter{Consumer: src.Consumer, MessageID: src.ID, SourceTopic: "orders",
		Payload: []byte("p"), Reason: "bad input", Permanent: true}, true, nil); err != nil {
		f.t.Fatalf("DeadLetterInsert: %v", err)
	}
	if ok, err := f.st.MessageReplay(f.ctx, src); err != nil || !ok {
		f.t.Fatalf("MessageReplay of a dead-lettered message = %v, %v; want true", ok, err)
	}
	if f.processed(src) {
		f.t.Fatal("replayed dead-lettered message: its claim is still there")
	}
	if got := f.attempt(src, "after the replay"); got != 1 {
		f.t.Fatalf("first attempt after the replay counted as %d; want its attempts reset", got)
	}
	dls, err := ds.DeadLetterList(f.ctx, outboxdriver.DeadLetterFilter{})
	if err != nil || len(dls) != 1 || dls[0].State != outboxdriver.DeadLetterRetried || dls[0].Retries != 1 || dls[0].ChangedAt.IsZero() {
		f.t.Fatalf("dead letter after the replay: %+v, %v; want it retried, its retry counted", dls, err)
	}
	if c, err := ds.DeadLetterCount(f.ctx); err != nil || c != 0 {
		f.t.Fatalf("DeadLetterCount after the replay = %d, %v; want 0", c, err)
	}
	retrySrc := outboxdriver.Source{ID: "retry-of-replayed"}
	if n, err := ds.DeadLetterRetry(f.ctx, outboxdriver.DeadLetterChange{Keys: []outboxdriver.Source{src}, Actor: "ops"},
		func() outboxdriver.Source { return retrySrc }); err != nil || n != 0 {
		f.t.Fatalf("DeadLetterRetry after the replay = %d, %v; want 0 (replayed already)", n, err)
	}
	if es := f.pending(retrySrc); len(es) != 0 {
		f.t.Fatalf("retry after the replay recorded %+v; want the message handed over once", es)
	}
}

// testDeadLetterNow: an operator's request to dead-letter a failing message marks its attempt
// counter with who asked, which the next delivery reads; a message without failed attempts, or
// one that is processed (here: poisoned), cannot be asked for.
func testDeadLetterNow(f *fixture) {
	ds, ok := f.st.(outboxdriver.DeadLetterNowStore)
	if !ok {
		f.t.Skipf("%T cannot dead-letter a failing message at once", f.st)
	}
	src, never, done := f.src("failing"), f.src("never"), f.src("done")
	f.attempt(src, "carrier API timeout")
	f.attempt(src, "carrier API timeout again")
	f.attempt(done, "first failure")
	if err := f.st.MessagePoison(f.ctx, done); err != nil {
		f.t.Fatal(err)
	}
	if r, err := ds.DeadLetterRequested(f.ctx, src); err != nil || r != (outboxdriver.DeadLetterRequest{Attempts: 2, LastError: "carrier API timeout again"}) {
		f.t.Fatalf("DeadLetterRequested before the request = %+v, %v; want 2 attempts, the last error, nobody", r, err)
	}
	ok, err := ds.DeadLetterNow(f.ctx, src, "alice")
	if errors.Is(err, outboxdriver.ErrDeadLetterNowUnsupported) {
		f.t.Skipf("%T cannot dead-letter a failing message at once", f.st)
	}
	if err != nil || !ok {
		f.t.Fatalf("DeadLetterNow of a failing message = %v, %v; want true", ok, err)
	}
	if r, err := ds.DeadLetterRequested(f.ctx, src); err != nil || r.By != "alice" || r.Attempts != 2 {
		f.t.Fatalf("DeadLetterRequested after the request = %+v, %v; want alice's, 2 attempts", r, err)
	}
	for _, s := range []outboxdriver.Source{never, done} {
		if ok, err := ds.DeadLetterNow(f.ctx, s, "alice"); err != nil || ok {
			f.t.Errorf("DeadLetterNow of %s (not failing) = %v, %v; want false", s.ID, ok, err)
		}
		if r, err := ds.DeadLetterRequested(f.ctx, s); err != nil || r.By != "" {
			f.t.Errorf("DeadLetterRequested of %s = %+v, %v; want no request", s.ID, r, err)
		}
	}
}

// testDeadLettersMaxRetriesStale: two redrivers with a limit of one retry both read the dead
// letter at no retries; the first retries it and the message dies again before the second
// acts. The second's retry, decided on the count it read, must find the limit reached: a check
// of the count apart from the retry would hand the message back a second time. An operator's
// retry (no limit) still goes through.
func testDeadLettersMaxRetriesStale(f *fixture) {
	ds, ok := f.st.(outboxdriver.DeadLetterStore)
	if !ok {
		f.t.Skipf("%T keeps no dead letters", f.st)
	}
	src := f.src("redrive-stale")
	die := func(reason string) {
		f.t.Helper()
		if _, err := ds.DeadLetterInsert(f.ctx, outboxdriver.DeadLetter{Consumer: src.Consumer, MessageID: src.ID, SourceTopic: "orders",
			Payload: []byte("p"), Reason: reason}, true, nil); err != nil {
			f.t.Fatalf("DeadLetterInsert (%s): %v", reason, err)
		}
	}
	retry := func(max int, id string) int {
		f.t.Helper()
		n, err := ds.DeadLetterRetry(f.ctx, outboxdriver.DeadLetterChange{Keys: []outboxdriver.Source{src}, Actor: "redrive", MaxRetries: max},
			func() outboxdriver.Source { return outboxdriver.Source{ID: id} })
		if err != nil {
			f.t.Fatalf("DeadLetterRetry (max %d): %v", max, err)
		}
		return n
	}
	state := func() (outboxdriver.DeadLetterState, int) {
		f.t.Helper()
		dls, err := ds.DeadLetterList(f.ctx, outboxdriver.DeadLetterFilter{Consumer: src.Consumer, Limit: 1000})
		if err != nil {
			f.t.Fatalf("DeadLetterList: %v", err)
		}
		for _, d := range dls {
			if d.MessageID == src.ID {
				return d.State, d.Retries
			}
		}
		f.t.Fatal("dead letter not listed")
		return "", 0
	}
	die("first")
	if n := retry(1, "redrive-stale-1"); n != 1 {
		f.t.Fatalf("first redriver's retry = %d; want 1", n)
	}
	die("again")
	if n := retry(1, "redrive-stale-2"); n != 0 {
		st, r := state()
		f.t.Fatalf("second redriver's retry (limit 1, already retried once) = %d, dead letter %s with %d retries; want it left dead", n, st, r)
	}
	if st, r := state(); st != outboxdriver.DeadLetterDead || r != 1 {
		f.t.Fatalf("dead letter after the refused retry: %s, %d retries; want dead, 1", st, r)
	}
	if len(f.pending(outboxdriver.Source{ID: "redrive-stale-2"})) != 0 {
		f.t.Fatal("refused retry stored the message for its topic")
	}
	if !f.processed(src) {
		f.t.Fatal("refused retry deleted the poisoned claim")
	}
	if n := retry(0, "redrive-stale-3"); n != 1 {
		f.t.Fatalf("operator's retry (no limit) = %d; want 1", n)
	}
	if st, r := state(); st != outboxdriver.DeadLetterRetried || r != 2 {
		f.t.Fatalf("dead letter after the operator's retry: %s, %d retries; want retried, 2", st, r)
	}
}

// testDeadLetterProcessedMeanwhile: a delivery that failed while a copy of its message was
// processed (the copy's claim committed first) stores no dead letter and no poison copy: the
// message is not dead. A message dead-lettered before (its claim poisoned) is
// dead-lettered again as before.
func testDeadLetterProcessedMeanwhile(f *fixture) {
	ds, ok := f.st.(outboxdriver.DeadLetterStore)
	if !ok {
		f.t.Skipf("%T keeps no dead letters", f.st)
	}
	src := f.src("processed-by-a-copy")
	f.commit(src, true, nil) // the copy that succeeded
	poison := &outboxdriver.Effect{Kind: outboxdriver.KindPublish, Topic: "poison", UUID: src.ID, Source: src,
		OrderingKey: outboxdriver.DefaultOrderingKey(src)}
	_, err := ds.DeadLetterInsert(f.ctx, outboxdriver.DeadLetter{Consumer: src.Consumer, MessageID: src.ID, SourceTopic: "orders",
		Reason: "failed beside the copy"}, true, poison)
	if !errors.Is(err, outboxdriver.ErrProcessedMeanwhile) {
		f.t.Fatalf("DeadLetterInsert of a message a copy processed = %v, want ErrProcessedMeanwhile", err)
	}
	dls, err := ds.DeadLetterList(f.ctx, outboxdriver.DeadLetterFilter{Consumer: src.Consumer})
	if err != nil {
		f.t.Fatal(err)
	}
	for _, d := range dls {
		if d.MessageID == src.ID {
			f.t.Fatalf("a dead letter was stored for a message a copy processed: %+v", d)
		}
	}
	if es := f.pending(src); len(es) != 0 {
		f.t.Fatalf("pending effects of a message a copy processed: %+v, want no poison copy", es)
	}
	if !f.processed(src) {
		f.t.Fatal("the copy's claim is gone")
	}

	dead := f.src("dead-twice")
	for i := range 2 {
		if _, err := ds.DeadLetterInsert(f.ctx, outboxdriver.DeadLetter{Consumer: dead.Consumer, MessageID: dead.ID,
			Reason: "max attempts", Attempts: 3}, false, nil); err != nil {
			f.t.Fatalf("DeadLetterInsert %d of a message whose claim it poisoned: %v", i+1, err)
		}
	}
}

// testPoisonWith: with dead letters off, a message moved to the poison topic has its claim
// poisoned and its copy for the topic pending in one transaction; one that a copy processed
// (or moved there before) gets neither.
func testPoisonWith(f *fixture) {
	ps, ok := f.st.(outboxdriver.PoisonStore)
	if !ok {
		f.t.Skipf("%T moves no message to the poison topic in one transaction", f.st)
	}
	copyFor := func(src outboxdriver.Source) *outboxdriver.Effect {
		return &outboxdriver.Effect{Kind: outboxdriver.KindPublish, Topic: "poison", UUID: src.ID, Payload: []byte("bad \x00"),
			Source: src, OrderingKey: outboxdriver.DefaultOrderingKey(src)}
	}
	src := f.src("poisoned")
	poison := copyFor(src)
	if err := ps.MessagePoisonWith(f.ctx, src, poison); err != nil {
		f.t.Fatalf("MessagePoisonWith: %v", err)
	}
	if poison.StoreID == 0 {
		f.t.Fatal("MessagePoisonWith left the StoreID of the copy unset")
	}
	if !f.processed(src) {
		f.t.Fatal("poisoned message not processed")
	}
	if es := f.pending(src); len(es) != 1 || es[0].Topic != "poison" || es[0].UUID != src.ID {
		f.t.Fatalf("pending effects of the poisoned message: %+v; want its copy", es)
	}
	if err := ps.MessagePoisonWith(f.ctx, src, copyFor(src)); !errors.Is(err, outboxdriver.ErrProcessedMeanwhile) {
		f.t.Fatalf("MessagePoisonWith again = %v, want ErrProcessedMeanwhile", err)
	}
	if es := f.pending(src); len(es) != 1 {
		f.t.Fatalf("pending effects after the second move: %+v; want the first copy only", es)
	}
	done := f.src("processed-by-a-copy")
	f.commit(done, true, nil)
	if err := ps.MessagePoisonWith(f.ctx, done, copyFor(done)); !errors.Is(err, outboxdriver.ErrProcessedMeanwhile) {
		f.t.Fatalf("MessagePoisonWith of a message a copy processed = %v, want ErrProcessedMeanwhile", err)
	}
	if es := f.pending(done); len(es) != 0 {
		f.t.Fatalf("pending effects of a message a copy processed: %+v, want no poison copy", es)
	}
}

// testDeadLetterUUID: a dead letter keyed by a message ID that is not the message's UUID (a
// consumer reading its ID from the metadata) keeps the UUID; a retry publishes the message with
// it, which a dead letter of the message again without one keeps. A retry under the message ID
// made a copy with a UUID of its own, no duplicate to the topic's other consumers.
func testDeadLetterUUID(f *fixture) {
	ds, ok := f.st.(outboxdriver.DeadLetterStore)
	if !ok {
		f.t.Skipf("%T keeps no dead letters", f.st)
	}
	src := f.src("order-7")
	const uuid = "0b9d2a7e-uuid-of-the-message"
	if _, err := ds.DeadLetterInsert(f.ctx, outboxdriver.DeadLetter{Consumer: src.Consumer, MessageID: src.ID, UUID: uuid,
		SourceTopic: "orders", Payload: []byte("p"), Reason: "bad"}, true, nil); err != nil {
		f.t.Fatal(err)
	}
	dls, err := ds.DeadLetterList(f.ctx, outboxdriver.DeadLetterFilter{Consumer: src.Consumer})
	if err != nil || len(dls) != 1 || dls[0].UUID != uuid || dls[0].MessageID != src.ID {
		f.t.Fatalf("DeadLetterList = %+v, %v; want the dead letter with UUID %q", dls, err, uuid)
	}
	retry := func(id string) []outboxdriver.Effect {
		f.t.Helper()
		rs := outboxdriver.Source{ID: id}
		if n, err := ds.DeadLetterRetry(f.ctx, outboxdriver.DeadLetterChange{Keys: []outboxdriver.Source{src}, Actor: "ops"},
			func() outboxdriver.Source { return rs }); err != nil || n != 1 {
			f.t.Fatalf("DeadLetterRetry = %d, %v; want 1", n, err)
		}
		return f.pending(rs)
	}
	if es := retry("retry-1-of-order-7"); len(es) != 1 || es[0].UUID != uuid {
		f.t.Fatalf("effect of the retry: %+v; want the message with its UUID %q", es, uuid)
	}
	// Dead again, by a delivery that cannot tell the UUID: the one stored is kept.
	if _, err := ds.DeadLetterInsert(f.ctx, outboxdriver.DeadLetter{Consumer: src.Consumer, MessageID: src.ID,
		Payload: []byte("p"), Reason: "again"}, true, nil); err != nil {
		f.t.Fatal(err)
	}
	if es := retry("retry-2-of-order-7"); len(es) != 1 || es[0].UUID != uuid {
		f.t.Fatalf("effect of the second retry: %+v; want the message with its UUID %q", es, uuid)
	}
	// A dead letter without a UUID (stored by a version that kept none) is retried under its ID.
	old := f.src("stored-before")
	if _, err := ds.DeadLetterInsert(f.ctx, outboxdriver.DeadLetter{Consumer: old.Consumer, MessageID: old.ID,
		SourceTopic: "orders", Payload: []byte("p"), Reason: "bad"}, true, nil); err != nil {
		f.t.Fatal(err)
	}
	rs := outboxdriver.Source{ID: "retry-of-stored-before"}
	if _, err := ds.DeadLetterRetry(f.ctx, outboxdriver.DeadLetterChange{Keys: []outboxdriver.Source{old}, Actor: "ops"},
		func() outboxdriver.Source { return rs }); err != nil {
		f.t.Fatal(err)
	}
	if es := f.pending(rs); len(es) != 1 || es[0].UUID != old.ID {
		f.t.Fatalf("effect of the retry without a UUID: %+v; want UUID %q", es, old.ID)
	}
}

// A redrive policy reads only the dead letters it may retry: not permanent, retried fewer times
// than its limit, with a source topic, dead long enough, oldest first. Listing the oldest of all
// and filtering them in the process stopped for good once that window held only dead letters it
// may not retry (permanent ones kept for inspection).
func testDeadLettersRedrivable(f *fixture) {
	ds, ok := f.st.(outboxdriver.DeadLetterStore)
	if !ok {
		f.t.Skipf("%T keeps no dead letters", f.st)
	}
	r, ok := f.st.(outboxdriver.DeadLetterRedriver)
	if !ok {
		f.t.Skipf("%T lists no dead letters to redrive", f.st)
	}
	die := func(id, topic string, permanent bool) outboxdriver.Source {
		f.t.Helper()
		src := f.src(id)
		if _, err := ds.DeadLetterInsert(f.ctx, outboxdriver.DeadLetter{Consumer: src.Consumer, MessageID: src.ID, SourceTopic: topic,
			Payload: []byte("p"), Reason: "failed", Permanent: permanent}, true, nil); err != nil {
			f.t.Fatalf("DeadLetterInsert(%s): %v", id, err)
		}
		return src
	}
	for i := range 5 {
		die(fmt.Sprint("permanent-", i), "orders", true)
	}
	die("no-topic", "", false)
	retried := die("retried", "orders", false)
	if n, err := ds.DeadLetterRetry(f.ctx, outboxdriver.DeadLetterChange{Keys: []outboxdriver.Source{retried}, Actor: "redrive", MaxRetries: 1},
		func() outboxdriver.Source { return outboxdriver.Source{ID: "retry-1"} }); err != nil || n != 1 {
		f.t.Fatalf("DeadLetterRetry = %d, %v", n, err)
	}
	die("retried", "orders", false) // dead again, retried once
	eligible := die("eligible", "orders", false)
	get := func(maxRetries int, deadFor time.Duration, limit int) []outboxdriver.Source {
		f.t.Helper()
		keys, err := r.DeadLetterRedrivable(f.ctx, maxRetries, deadFor, limit)
		if err != nil {
			f.t.Fatalf("DeadLetterRedrivable(%d, %s, %d): %v", maxRetries, deadFor, limit, err)
		}
		return keys
	}
	if keys := get(1, 0, 3); len(keys) != 1 || keys[0] != eligible {
		f.t.Errorf("redrivable with one retry allowed, a limit of 3: %v; want %v only", keys, eligible)
	}
	if keys := get(2, 0, 10); len(keys) != 2 || keys[0] != retried || keys[1] != eligible {
		f.t.Errorf("redrivable with two retries allowed: %v; want %v then %v", keys, retried, eligible)
	}
	if keys := get(2, time.Hour, 10); len(keys) != 0 {
		f.t.Errorf("redrivable once dead an hour: %v; want none yet", keys)
	}
}
