package console_test

import (
	"context"
	"database/sql"
	"errors"
	"net/http"
	"net/url"
	"regexp"
	"slices"
	"strings"
	"sync"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/watermill-outbox/outbox"
	"github.com/watermill-outbox/outbox/console"
	"github.com/watermill-outbox/outbox/drivers/postgres"
	"github.com/watermill-outbox/outbox/internal/pgtest"
	"github.com/watermill-outbox/outbox/ops"
	"github.com/watermill-outbox/outbox/outboxdriver"
)

// deadEnv returns the Ops of a database with a dead letter of each message given (consumer and
// ID), its Outbox and the database.
func deadEnv(t *testing.T, keys ...outboxdriver.Source) (*ops.Ops, *outbox.Outbox, *sql.DB) {
	t.Helper()
	db := pgtest.DB(t)
	ob, err := outbox.New(outbox.Config{DB: db, Driver: postgres.Driver{}, Publisher: refusing{}, RetryDelay: -1})
	if err != nil {
		t.Fatal(err)
	}
	if err := ob.Migrate(context.Background()); err != nil {
		t.Fatal(err)
	}
	for _, k := range keys {
		err := ob.Handle(message.NewMessage(k.ID, []byte(k.ID)), outbox.HandleParams{Consumer: k.Consumer, MessageID: k.ID, Topic: "orders"},
			func(*message.Message) ([]*message.Message, error) {
				return nil, outbox.Permanent(errors.New("no customer " + k.ID))
			})
		if err != nil {
			t.Fatal(err)
		}
	}
	o, err := ops.ForOutbox(ob)
	if err != nil {
		t.Fatal(err)
	}
	return o, ob, db
}

// TestDeadLetterDiscardAsksAndIsAuthorized: the dead letters are listed (read-only: without
// buttons); Authorize is asked with the messages a dead-letter action changes, and a discard asks
// first, then changes the dead letter and writes its audit entry.
func TestDeadLetterDiscardAsksAndIsAuthorized(t *testing.T) {
	billing, shipping := outboxdriver.Source{Consumer: "billing", ID: "m1"}, outboxdriver.Source{Consumer: "shipping", ID: "m2"}
	o, ob, db := deadEnv(t, billing, shipping)
	ctx := context.Background()

	ro := serve(t, o, console.Options{AllowUnauthenticated: true})
	_, body := get(t, ro.Client(), ro.URL+"/outbox/")
	if !strings.Contains(body, `data-dead="m1"`) || !strings.Contains(body, `id="dead-count">2<`) || strings.Contains(body, `action="retry-dead"`) {
		t.Fatalf("read-only page: want both dead letters, counted, without buttons:\n%s", body)
	}

	var mu sync.Mutex
	var asked []console.Action
	srv := serve(t, o, console.Options{
		Authenticate: func(*http.Request) (string, bool) { return "alice", true },
		Authorize: func(_ *http.Request, _ string, a console.Action) bool {
			mu.Lock()
			defer mu.Unlock()
			asked = append(asked, a)
			return slices.Equal(a.Consumers, []string{"billing"})
		},
	})
	c := noRedirect()
	_, body = get(t, c, srv.URL+"/outbox/")
	token := tokenOf.FindStringSubmatch(body)[1]
	if resp, _ := postForm(t, c, srv.URL+"/outbox/retry-dead", url.Values{"consumer": {"shipping"}, "message_id": {"m2"}, "token": {token}}); resp.StatusCode != http.StatusForbidden {
		t.Errorf("retry of shipping's dead letter: %d, want 403", resp.StatusCode)
	}
	mu.Lock()
	last := asked[len(asked)-1]
	mu.Unlock()
	if last.Name != console.ActionRetryDeadLetter || !slices.Equal(last.Messages, []outboxdriver.Source{shipping}) {
		t.Errorf("the last question: %+v, want a retry of shipping/m2", last)
	}
	dead := func() []outboxdriver.Source {
		t.Helper()
		dls, err := ob.DeadLetters(ctx, outbox.DeadLetterFilter{State: outbox.DeadLetterDead})
		if err != nil {
			t.Fatal(err)
		}
		var keys []outboxdriver.Source
		for _, d := range dls {
			keys = append(keys, outboxdriver.Source{Consumer: d.Consumer, ID: d.MessageID})
		}
		return keys
	}
	form := url.Values{"consumer": {"billing"}, "message_id": {"m1"}, "token": {token}}
	resp, body := postForm(t, c, srv.URL+"/outbox/discard-dead", form)
	if resp.StatusCode != http.StatusOK || len(dead()) != 2 || !strings.Contains(body, `id="confirm-discard-dead"`) {
		t.Fatalf("a discard without confirmation: %d, %d dead; want the question (200, 2 dead):\n%s", resp.StatusCode, len(dead()), body)
	}
	form.Set("confirm", "yes")
	resp, _ = postForm(t, c, srv.URL+"/outbox/discard-dead", form)
	if resp.StatusCode != http.StatusSeeOther || !slices.Equal(dead(), []outboxdriver.Source{shipping}) {
		t.Fatalf("the confirmed discard: %d, dead %v; want 303, shipping's only", resp.StatusCode, dead())
	}
	_, body = get(t, c, srv.URL+"/outbox/"+strings.TrimPrefix(resp.Header.Get("Location"), "./"))
	if !strings.Contains(body, `id="flash">1 dead letter(s) discarded<`) || !strings.Contains(body, `id="dead-count">1<`) || strings.Contains(body, `data-dead="m1"`) {
		t.Errorf("the page after the discard: want the notice, 1 dead letter, m1 gone:\n%s", body)
	}
	var actor string
	if err := db.QueryRow(`SELECT actor FROM outbox_audit WHERE action = 'discard-dead-letter' AND target = 'billing/m1'`).Scan(&actor); err != nil || actor != "alice (console)" {
		t.Errorf("audit: %q %v", actor, err)
	}
}

// TestDeadLetterNowFromTheConsole: a failing message has a button that dead-letters it on its
// next delivery, without running the handler again; the request is audited with the user.
func TestDeadLetterNowFromTheConsole(t *testing.T) {
	db := pgtest.DB(t)
	ctx := context.Background()
	ob, err := outbox.New(outbox.Config{DB: db, Driver: postgres.Driver{}, Publisher: refusing{}, RetryDelay: -1, MaxAttempts: 5})
	if err != nil {
		t.Fatal(err)
	}
	if err := ob.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	calls := 0
	deliver := func() error {
		return ob.Handle(message.NewMessage("m-7", []byte("order 7")), outbox.HandleParams{Consumer: "shipping", MessageID: "m-7", Topic: "orders"},
			func(*message.Message) ([]*message.Message, error) {
				calls++
				return nil, errors.New("carrier API timeout")
			})
	}
	if err := deliver(); err == nil {
		t.Fatal("first delivery: want the handler's failure")
	}
	o, err := ops.ForOutbox(ob)
	if err != nil {
		t.Fatal(err)
	}
	srv := serve(t, o, console.Options{
		Authenticate: func(*http.Request) (string, bool) { return "alice", true },
		Authorize:    func(_ *http.Request, _ string, a console.Action) bool { return a.Name == console.ActionDeadLetterNow },
	})
	c := noRedirect()
	_, body := get(t, c, srv.URL+"/outbox/")
	if !strings.Contains(body, `class="dead-now"`) {
		t.Fatalf("want a dead-letter button on the failing message:\n%s", body)
	}
	token := tokenOf.FindStringSubmatch(body)[1]
	resp, _ := postForm(t, c, srv.URL+"/outbox/dead-letter-now", url.Values{"consumer": {"shipping"}, "message_id": {"m-7"}, "token": {token}})
	if resp.StatusCode != http.StatusSeeOther {
		t.Fatalf("dead-letter now: %d, want 303", resp.StatusCode)
	}
	_, body = get(t, c, srv.URL+"/outbox/"+strings.TrimPrefix(resp.Header.Get("Location"), "./"))
	if !strings.Contains(body, "its next delivery stores it as a dead letter") {
		t.Errorf("the notice after the request:\n%s", body)
	}
	if err := deliver(); err != nil || calls != 1 {
		t.Fatalf("the next delivery: %v, %d handler calls; want it acked without running the handler again", err, calls)
	}
	var actor string
	if err := db.QueryRow(`SELECT actor FROM outbox_audit WHERE action = 'dead-letter-now' AND target = 'shipping/m-7'`).Scan(&actor); err != nil || actor != "alice (console)" {
		t.Errorf("audit: %q %v", actor, err)
	}
	if dead, err := ob.DeadLetters(ctx, outbox.DeadLetterFilter{State: outbox.DeadLetterDead}); err != nil || len(dead) != 1 || dead[0].MessageID != "m-7" {
		t.Fatalf("dead letters: %+v %v", dead, err)
	}
}

var setOf = regexp.MustCompile(`name="set" value="([0-9a-f]+)"`)

// TestDeadLetterGroupActionChangesTheGroupAsShown: "discard all N" and "retry all N" of a group
// changed the group as it was when the operator confirmed, not as the page counted it: dead
// letters of the same cause stored meanwhile (an incident going on) were given up unseen. The
// forms carry the dead letters counted, and a group that changed is counted again, not changed.
func TestDeadLetterGroupActionChangesTheGroupAsShown(t *testing.T) {
	o, ob, _ := deadEnv(t, outboxdriver.Source{Consumer: "billing", ID: "1"})
	ctx := context.Background()
	srv := serve(t, o, console.Options{
		Authenticate: func(*http.Request) (string, bool) { return "alice", true },
		Authorize:    func(*http.Request, string, console.Action) bool { return true },
	})
	c := noRedirect()
	_, body := get(t, c, srv.URL+"/outbox/")
	token := tokenOf.FindStringSubmatch(body)[1]
	shown := setOf.FindStringSubmatch(body)
	if shown == nil {
		t.Fatalf("the group's forms carry no set of dead letters:\n%s", body)
	}
	groups, _, err := o.DeadLetterGroups(ctx, "billing")
	if err != nil || len(groups) != 1 {
		t.Fatalf("groups: %+v, %v", groups, err)
	}
	form := url.Values{"consumer": {"billing"}, "group": {groups[0].Fingerprint}, "set": {shown[1]}, "token": {token}}
	resp, body := postForm(t, c, srv.URL+"/outbox/discard-dead", form)
	if resp.StatusCode != http.StatusOK || !strings.Contains(body, `discard 1 dead letter(s)`) {
		t.Fatalf("the question: %d:\n%s", resp.StatusCode, body)
	}
	// Another of the same cause, while the operator reads the question.
	if err := ob.Handle(message.NewMessage("2", []byte("2")), outbox.HandleParams{Consumer: "billing", MessageID: "2", Topic: "orders"},
		func(*message.Message) ([]*message.Message, error) {
			return nil, outbox.Permanent(errors.New("no customer 2"))
		}); err != nil {
		t.Fatal(err)
	}
	dead := func() int {
		t.Helper()
		dls, err := ob.DeadLetters(ctx, outbox.DeadLetterFilter{State: outbox.DeadLetterDead})
		if err != nil {
			t.Fatal(err)
		}
		return len(dls)
	}
	form.Set("set", setOf.FindStringSubmatch(body)[1]) // as the question's form carries it
	form.Set("confirm", "yes")
	resp, body = postForm(t, c, srv.URL+"/outbox/discard-dead", form)
	if resp.StatusCode != http.StatusOK || dead() != 2 || !strings.Contains(body, `id="group-changed"`) || !strings.Contains(body, `discard 2 dead letter(s)`) {
		t.Fatalf("the confirmed discard of a group that changed: %d, %d dead; want both kept and the question asked again of 2:\n%s", resp.StatusCode, dead(), body)
	}
	retry := url.Values{"consumer": {"billing"}, "group": {groups[0].Fingerprint}, "set": {shown[1]}, "token": {token}}
	if resp, _ := postForm(t, c, srv.URL+"/outbox/retry-dead", retry); resp.StatusCode != http.StatusSeeOther || dead() != 2 {
		t.Fatalf("retry all of a group that changed: %d, %d dead; want nothing retried", resp.StatusCode, dead())
	}
	// Confirmed as counted again: both.
	form.Set("set", setOf.FindStringSubmatch(body)[1])
	if resp, _ := postForm(t, c, srv.URL+"/outbox/discard-dead", form); resp.StatusCode != http.StatusSeeOther || dead() != 0 {
		t.Fatalf("the confirmed discard of the group as counted again: %d, %d dead; want both discarded", resp.StatusCode, dead())
	}
	// A group form without the set (a page from before) is refused.
	form.Del("set")
	if resp, _ := postForm(t, c, srv.URL+"/outbox/retry-dead", form); resp.StatusCode != http.StatusBadRequest {
		t.Errorf("a group action without the dead letters counted: %d, want 400", resp.StatusCode)
	}
}
