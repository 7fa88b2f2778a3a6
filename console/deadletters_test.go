package console_test

import (
	"context"
	"database/sql"
	"errors"
	"net/http"
	"net/url"
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
