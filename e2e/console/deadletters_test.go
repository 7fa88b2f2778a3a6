package console_test

import (
	"context"
	"errors"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/chromedp/chromedp"

	"github.com/watermill-outbox/outbox"
	"github.com/watermill-outbox/outbox/console"
	"github.com/watermill-outbox/outbox/drivers/postgres"
	"github.com/watermill-outbox/outbox/internal/pgtest"
	"github.com/watermill-outbox/outbox/ops"
)

// keeping is a broker that keeps what it is sent, by topic.
type keeping struct {
	mu   sync.Mutex
	sent map[string][]*message.Message
}

func (k *keeping) Publish(topic string, msgs ...*message.Message) error {
	k.mu.Lock()
	defer k.mu.Unlock()
	for _, m := range msgs {
		k.sent[topic] = append(k.sent[topic], m.Copy())
	}
	return nil
}
func (k *keeping) Close() error { return nil }

func (k *keeping) on(topic string) []*message.Message {
	k.mu.Lock()
	defer k.mu.Unlock()
	return append([]*message.Message(nil), k.sent[topic]...)
}

// TestDeadLettersInABrowser: messages a consumer gave up on are listed and grouped by cause; an
// operator retries one group from the console, the consumer (fixed) processes the message it
// gets back, and the dead letter leaves the list and the tile; the other group stays. Then a
// failing message is dead-lettered at once from the console, and its next delivery makes it one.
func TestDeadLettersInABrowser(t *testing.T) {
	db := pgtest.DB(t)
	ctx := context.Background()
	b := &keeping{sent: map[string][]*message.Message{}}
	ob, err := outbox.New(outbox.Config{DB: db, Driver: postgres.Driver{}, Publisher: b, RetryDelay: -1,
		RelayInterval: 50 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	if err := ob.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	var fixed bool
	var processed []string
	billing := func(msg *message.Message) ([]*message.Message, error) {
		if !fixed && strings.HasPrefix(string(msg.Payload), "customer ") {
			return nil, outbox.Permanent(errors.New("no " + string(msg.Payload)))
		}
		if !fixed {
			return nil, outbox.Permanent(errors.New("currency XYZ is not supported"))
		}
		processed = append(processed, string(msg.Payload))
		return nil, nil
	}
	deliver := func(msg *message.Message) {
		t.Helper()
		if err := ob.Handle(msg, outbox.HandleParams{Consumer: "billing", MessageID: msg.UUID, Topic: "orders"}, billing); err != nil {
			t.Fatalf("handling %s: %v", msg.UUID, err)
		}
	}
	deliver(message.NewMessage("placed-o-5001", []byte("customer 4711")))
	deliver(message.NewMessage("placed-o-5002", []byte("customer 12")))
	deliver(message.NewMessage("placed-o-5003", []byte("in XYZ")))

	runCtx, stopRun := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- ob.Run(runCtx) }()
	defer func() { stopRun(); <-done }()
	o, err := ops.ForOutbox(ob)
	if err != nil {
		t.Fatal(err)
	}
	h, err := console.New(o, console.Options{
		Authenticate: func(*http.Request) (string, bool) { return "operator", true },
		Authorize:    func(*http.Request, string, console.Action) bool { return true },
	})
	if err != nil {
		t.Fatal(err)
	}
	mux := http.NewServeMux()
	mux.Handle("/outbox/", http.StripPrefix("/outbox", h))
	srv := httptest.NewServer(mux)
	defer srv.Close()

	alloc, cancelAlloc := chromedp.NewExecAllocator(ctx, append(chromedp.DefaultExecAllocatorOptions[:],
		chromedp.ExecPath(chromium(t)), chromedp.NoSandbox, chromedp.Headless, chromedp.DisableGPU)...)
	defer cancelAlloc()
	bctx, cancelBrowser := chromedp.NewContext(alloc)
	defer cancelBrowser()
	bctx, cancelTimeout := context.WithTimeout(bctx, 90*time.Second)
	defer cancelTimeout()

	// page reads the dead-letter tile, the rows of the list and the groups (consumer, count).
	page := func() (tile string, rows []string, groups []string) {
		t.Helper()
		js := `[document.querySelector('#dead-count').textContent,
			Array.from(document.querySelectorAll('#dead-letters tr[data-dead]')).map(r => r.dataset.dead).join(' '),
			Array.from(document.querySelectorAll('#dead-groups tr[data-consumer]')).map(r => r.dataset.consumer + ':' + r.children[1].textContent).join(' ')]`
		v, err := chromedp.Run(bctx, chromedp.Evaluate[[]string](js))
		if err != nil || len(v) != 3 {
			t.Fatalf("reading the page: %v %v", v, err)
		}
		return v[0], strings.Fields(v[1]), strings.Fields(v[2])
	}
	if err := chromedp.Do(bctx, chromedp.Navigate(srv.URL+"/outbox/"), chromedp.WaitVisible(chromedp.CSS(`#dead-groups`))); err != nil {
		t.Fatalf("loading the console: %v", err)
	}
	if tile, rows, groups := page(); tile != "3" || len(rows) != 3 || strings.Join(groups, " ") != "billing:2 billing:1" {
		t.Fatalf("before the retry: tile %s, rows %v, groups %v; want 3, the 3 messages, billing:2 billing:1", tile, rows, groups)
	}

	// The customers exist now: retry the group of the two.
	fixed = true
	if err := chromedp.Do(bctx, chromedp.Click(chromedp.CSS(`#dead-groups tr:nth-child(2) button.retry`)), chromedp.WaitVisible(chromedp.CSS(`#flash`))); err != nil {
		t.Fatalf("retrying the group in the console: %v", err)
	}
	flash, err := chromedp.Run(bctx, chromedp.Text(chromedp.CSS(`#flash`)))
	if err != nil || !strings.Contains(flash, "2 dead letter(s) retried") {
		t.Fatalf("after the retry: flash %q %v", flash, err)
	}
	if tile, rows, groups := page(); tile != "1" || strings.Join(rows, " ") != "placed-o-5003" || strings.Join(groups, " ") != "billing:1" {
		t.Errorf("after the retry: tile %s, rows %v, groups %v; want 1, placed-o-5003, billing:1", tile, rows, groups)
	}
	var audit string
	if err := db.QueryRow(`SELECT string_agg(actor || ' ' || action || ' ' || target, ', ' ORDER BY target) FROM outbox_audit`).Scan(&audit); err != nil ||
		audit != "operator (console) retry-dead-letter billing/placed-o-5001, operator (console) retry-dead-letter billing/placed-o-5002" {
		t.Errorf("audit: %q %v", audit, err)
	}

	// The relay sends the retried messages to their topic; the consumer gets them and processes them.
	deadline := time.Now().Add(30 * time.Second)
	for len(b.on("orders")) < 2 {
		if time.Now().After(deadline) {
			t.Fatalf("the retried messages did not reach the broker within 30s: %d", len(b.on("orders")))
		}
		time.Sleep(20 * time.Millisecond)
	}
	for _, m := range b.on("orders") {
		deliver(m)
	}
	slices.Sort(processed) // the relay sends the two in either order
	if strings.Join(processed, ", ") != "customer 12, customer 4711" {
		t.Fatalf("processed: %q, want both retried messages", processed)
	}
	if err := chromedp.Do(bctx, chromedp.Navigate(srv.URL+"/outbox/"), chromedp.WaitVisible(chromedp.CSS(`#dead-tile`))); err != nil {
		t.Fatal(err)
	}
	if tile, rows, _ := page(); tile != "1" || strings.Join(rows, " ") != "placed-o-5003" {
		t.Errorf("after processing: tile %s, rows %v; want 1, placed-o-5003", tile, rows)
	}

	// A message whose handler times out (1 attempt of 5) is dead-lettered at once from the console.
	slow := message.NewMessage("placed-o-5004", []byte("order 5004"))
	calls := 0
	timingOut := func(*message.Message) ([]*message.Message, error) {
		calls++
		return nil, errors.New("carrier API timeout")
	}
	if err := ob.Handle(slow, outbox.HandleParams{Consumer: "shipping", MessageID: slow.UUID, Topic: "orders"}, timingOut); err == nil {
		t.Fatal("the first delivery of placed-o-5004: want the handler's failure")
	}
	failingRow := chromedp.CSS(`#failing tr[data-message="placed-o-5004"]`)
	if err := chromedp.Do(bctx, chromedp.Navigate(srv.URL+"/outbox/"), chromedp.WaitVisible(failingRow)); err != nil {
		t.Fatalf("the failing message in the console: %v", err)
	}
	if err := chromedp.Do(bctx, chromedp.Click(failingRow+` button.dead-now`), chromedp.WaitVisible(chromedp.CSS(`#flash`))); err != nil {
		t.Fatalf("dead-lettering it in the console: %v", err)
	}
	if flash, err = chromedp.Run(bctx, chromedp.Text(chromedp.CSS(`#flash`))); err != nil || !strings.Contains(flash, "its next delivery stores it as a dead letter") {
		t.Fatalf("after dead-letter now: flash %q %v", flash, err)
	}
	if err := ob.Handle(slow, outbox.HandleParams{Consumer: "shipping", MessageID: slow.UUID, Topic: "orders"}, timingOut); err != nil || calls != 1 {
		t.Fatalf("the next delivery of placed-o-5004: %v, %d handler calls; want it acked without running the handler", err, calls)
	}
	if err := chromedp.Do(bctx, chromedp.Navigate(srv.URL+"/outbox/"), chromedp.WaitVisible(chromedp.CSS(`#dead-tile`))); err != nil {
		t.Fatal(err)
	}
	if tile, rows, _ := page(); tile != "2" || strings.Join(rows, " ") != "placed-o-5003 placed-o-5004" {
		t.Errorf("after dead-letter now: tile %s, rows %v; want 2, placed-o-5003 placed-o-5004", tile, rows)
	}
}
