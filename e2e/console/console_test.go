// Package console drives the outbox web console in a real headless Chromium (Debian's chromium
// package; .ci/run installs it): it lists a parked effect, an operator clicks retry, and the effect
// leaves the list and reaches the broker.
package console_test

import (
	"context"
	"errors"
	"os"
	"os/exec"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"net/http"
	"net/http/httptest"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/chromedp/chromedp"

	"github.com/watermill-outbox/outbox"
	"github.com/watermill-outbox/outbox/console"
	"github.com/watermill-outbox/outbox/drivers/postgres"
	"github.com/watermill-outbox/outbox/internal/pgtest"
	"github.com/watermill-outbox/outbox/ops"
)

func TestMain(m *testing.M) { os.Exit(pgtest.Run(m)) }

// broker refuses the messages whose payload starts with "v1:" while refusing is set (a consumer
// that requires a newer schema), and keeps the rest.
type broker struct {
	refusing atomic.Bool
	mu       sync.Mutex
	sent     map[string]int
}

func (b *broker) Publish(_ string, msgs ...*message.Message) error {
	for _, m := range msgs {
		if b.refusing.Load() && strings.HasPrefix(string(m.Payload), "v1:") {
			return errors.New("refused by the broker: schema v1 is no longer accepted for order " + strings.TrimPrefix(string(m.Payload), "v1:"))
		}
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	for _, m := range msgs {
		b.sent[m.UUID]++
	}
	return nil
}
func (b *broker) Close() error { return nil }

func (b *broker) count(uuid string) int {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.sent[uuid]
}

func chromium(t *testing.T) string {
	t.Helper()
	for _, name := range []string{"chromium", "chromium-browser", "google-chrome"} {
		if p, err := exec.LookPath(name); err == nil {
			return p
		}
	}
	t.Fatal("no Chromium on PATH: apt-get install chromium (.ci/run installs it)")
	return ""
}

func TestConsoleInABrowser(t *testing.T) {
	db := pgtest.DB(t)
	ctx := context.Background()
	b := &broker{sent: map[string]int{}}
	b.refusing.Store(true)
	ob, err := outbox.New(outbox.Config{DB: db, Driver: postgres.Driver{}, Publisher: b, RelayMaxAttempts: 1,
		RetryDelay: -1, MaxAttempts: 1, PoisonTopic: "poison", RelayInterval: 50 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	if err := ob.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	// Three orders whose invoice (v1) the broker refuses while the receipt goes out: parked.
	var parked []string
	for _, order := range []string{"o-1001", "o-1002", "o-1003"} {
		err := ob.Handle(message.NewMessage("placed-"+order, nil), outbox.HandleParams{Consumer: "billing", MessageID: "placed-" + order},
			func(msg *message.Message) ([]*message.Message, error) {
				ctx := msg.Context()
				if err := outbox.Publish(ctx, "receipts", message.NewMessage("", []byte("v2:"+order))); err != nil {
					return nil, err
				}
				m := message.NewMessage(watermill.NewUUID(), []byte("v1:"+order))
				parked = append(parked, m.UUID)
				return nil, outbox.Publish(ctx, "invoices", m)
			})
		if !errors.Is(err, outbox.ErrDispatchFailed) {
			t.Fatalf("parking the invoice of %s: %v", order, err)
		}
	}
	// A poisoned message and a failing one, for the rest of the page.
	_ = ob.Handle(message.NewMessage("placed-o-1004", nil), outbox.HandleParams{Consumer: "shipping", MessageID: "placed-o-1004"},
		func(*message.Message) ([]*message.Message, error) { return nil, errors.New("address missing") })
	if _, err := db.Exec(`INSERT INTO outbox_attempts (consumer, message_id, attempts, last_error) VALUES ('shipping', 'placed-o-1005', 2, 'carrier API timeout')`); err != nil {
		t.Fatal(err)
	}
	ob.FlushMarks()
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
		chromedp.ExecPath(chromium(t)), chromedp.NoSandbox, chromedp.Headless, chromedp.DisableGPU,
		chromedp.WindowSize(1400, 1000))...)
	defer cancelAlloc()
	bctx, cancelBrowser := chromedp.NewContext(alloc)
	defer cancelBrowser()
	bctx, cancelTimeout := context.WithTimeout(bctx, 90*time.Second)
	defer cancelTimeout()

	if resp, err := http.Get(srv.URL + "/outbox/"); err != nil || resp.StatusCode != http.StatusOK {
		t.Fatalf("GET the console: %v %v", resp, err)
	} else {
		_ = resp.Body.Close()
	}
	row := chromedp.CSS(`tr[data-uuid="` + parked[0] + `"]`)
	if err := chromedp.Do(bctx, chromedp.Navigate(srv.URL+"/outbox/")); err != nil {
		t.Fatalf("loading the console: %v", err)
	}
	if err := chromedp.Do(bctx, chromedp.WaitVisible(row)); err != nil {
		t.Fatalf("the parked effect in the console: %v", err)
	}
	screenshot, err := chromedp.Run(bctx, chromedp.FullScreenshot(100))
	if err != nil {
		t.Fatalf("screenshot: %v", err)
	}
	path := t.TempDir() + "/console.png"
	if os.Getenv("OUTBOX_UPDATE_SCREENSHOTS") != "" {
		path = "../../docs/console.png"
	}
	if err := os.WriteFile(path, screenshot, 0o644); err != nil {
		t.Fatal(err)
	}

	// The consumer of invoices is fixed: retry the first parked invoice.
	b.refusing.Store(false)
	if err := chromedp.Do(bctx, chromedp.Click(row+` button.retry`), chromedp.WaitVisible(chromedp.CSS(`#flash`))); err != nil {
		t.Fatalf("retrying in the console: %v", err)
	}
	flash, err := chromedp.Run(bctx, chromedp.Text(chromedp.CSS(`#flash`)))
	if err != nil {
		t.Fatal(err)
	}
	rows, err := chromedp.Run(bctx, chromedp.Evaluate[int](`document.querySelectorAll('tr[data-uuid="`+parked[0]+`"]').length`))
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(flash, "1 parked effect(s) retried") || rows != 0 {
		t.Fatalf("after retry: flash %q, %d rows of the effect, want it retried and gone from the list", flash, rows)
	}
	deadline := time.Now().Add(30 * time.Second)
	for b.count(parked[0]) != 1 {
		if time.Now().After(deadline) {
			t.Fatal("the retried invoice did not reach the broker within 30s")
		}
		time.Sleep(20 * time.Millisecond)
	}
	if b.count(parked[1]) != 0 {
		t.Error("an invoice that was not retried was sent")
	}
	var audit string
	if err := db.QueryRow(`SELECT actor || ' ' || action FROM outbox_audit`).Scan(&audit); err != nil || audit != "operator (console) retry-parked" {
		t.Errorf("audit: %q %v", audit, err)
	}

	// Discard the second: the console asks first, and nothing changes until the operator confirms.
	row2 := chromedp.CSS(`tr[data-uuid="` + parked[1] + `"]`)
	if err := chromedp.Do(bctx, chromedp.Click(row2+` button.discard`), chromedp.WaitVisible(chromedp.CSS(`#confirm-discard`))); err != nil {
		t.Fatalf("asking before the discard: %v", err)
	}
	stillParked := func() int {
		var n int
		if err := db.QueryRow(`SELECT count(*) FROM outbox_effects_all WHERE uuid = $1 AND parked_at IS NOT NULL AND dispatched_at IS NULL`, parked[1]).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}
	if stillParked() != 1 {
		t.Fatal("the question discarded the effect before it was answered")
	}
	if err := chromedp.Do(bctx, chromedp.Click(chromedp.CSS(`#confirm-discard`)), chromedp.WaitVisible(chromedp.CSS(`#flash`))); err != nil {
		t.Fatalf("confirming the discard: %v", err)
	}
	if flash, err = chromedp.Run(bctx, chromedp.Text(chromedp.CSS(`#flash`))); err != nil || !strings.Contains(flash, "1 parked effect(s) discarded") || stillParked() != 0 {
		t.Fatalf("after the confirmed discard: flash %q (%v), %d parked", flash, err, stillParked())
	}
	// The relays run here (Run samples the tables): the page says so, with the sample's age.
	relay, err := chromedp.Run(bctx, chromedp.AttributeValue(chromedp.CSS(`#relay`), "class"))
	if err != nil || relay.Value != "relay ok" {
		t.Errorf("relay indicator with Run running: %q %v", relay.Value, err)
	}
	// A link cannot make the page show a notice the console did not write.
	if err := chromedp.Do(bctx, chromedp.Navigate(srv.URL+"/outbox/?flash=Session+expired%3A+sign+in+at+evil.example"),
		chromedp.WaitVisible(chromedp.CSS(`#relay`))); err != nil {
		t.Fatal(err)
	}
	if n, err := chromedp.Run(bctx, chromedp.Evaluate[int](`document.querySelectorAll('#flash').length`)); err != nil || n != 0 {
		t.Errorf("a notice from a link is shown (%d, %v)", n, err)
	}
}

// TestConsoleBasicAuthInABrowser: the console behind its own BasicAuth makes the browser ask for
// the credentials (a challenge), and shows, for effects pending with no relay running, that no
// relay runs.
func TestConsoleBasicAuthInABrowser(t *testing.T) {
	db := pgtest.DB(t)
	ctx := context.Background()
	b := &broker{sent: map[string]int{}}
	b.refusing.Store(true)
	ob, err := outbox.New(outbox.Config{DB: db, Driver: postgres.Driver{}, Publisher: b, RetryDelay: -1})
	if err != nil {
		t.Fatal(err)
	}
	if err := ob.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	err = ob.Handle(message.NewMessage("placed-o-2001", nil), outbox.HandleParams{Consumer: "billing", MessageID: "placed-o-2001"},
		func(msg *message.Message) ([]*message.Message, error) {
			return nil, outbox.Publish(msg.Context(), "invoices", message.NewMessage(watermill.NewUUID(), []byte("v1:o-2001")))
		})
	if !errors.Is(err, outbox.ErrDispatchFailed) {
		t.Fatalf("leaving the invoice pending: %v", err)
	}
	ob.FlushMarks()
	o, err := ops.ForOutbox(ob)
	if err != nil {
		t.Fatal(err)
	}
	h, err := console.New(o, console.Options{BasicAuth: func(user, password string) bool { return user == "operator" && password == "s3cret" }})
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
	bctx, cancelTimeout := context.WithTimeout(bctx, 60*time.Second)
	defer cancelTimeout()
	// The browser answers a challenge with the credentials of the address, as it would with what
	// the user types into its prompt; without a challenge it shows the refusal.
	u := strings.Replace(srv.URL, "http://", "http://operator:s3cret@", 1) + "/outbox/"
	if err := chromedp.Do(bctx, chromedp.Navigate(u)); err != nil {
		t.Fatalf("loading the console: %v", err)
	}
	text, err := chromedp.Run(bctx, chromedp.Text(chromedp.CSS(`body`)))
	if err != nil || !strings.Contains(text, "signed in as operator") {
		t.Fatalf("the console behind BasicAuth in a browser: %q %v", text, err)
	}
	relay, err := chromedp.Run(bctx, chromedp.Text(chromedp.CSS(`#relay`)))
	if err != nil || !strings.Contains(relay, "1 side effects pending and no relay seems to be running") {
		t.Errorf("relay indicator without Run: %q %v", relay, err)
	}
}

// TestConsoleAfterARepairInABrowser: the tiles agree with the lists right after a repair, and
// when a failing message succeeds, although a service stored its sample of the counts (with
// the effects still parked and the message still failing) moments before.
func TestConsoleAfterARepairInABrowser(t *testing.T) {
	db := pgtest.DB(t)
	ctx := context.Background()
	b := &broker{sent: map[string]int{}}
	b.refusing.Store(true)
	// A first instance, which samples nothing, parks the invoices the broker refuses (while the
	// receipts go out, so that the refusals count).
	cfg := outbox.Config{DB: db, Driver: postgres.Driver{}, Publisher: b, RelayMaxAttempts: 1,
		RetryDelay: -1, StatsInterval: -1, RelayInterval: 50 * time.Millisecond}
	first, err := outbox.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	if err := first.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	for _, order := range []string{"o-3001", "o-3002", "o-3003"} {
		err := first.Handle(message.NewMessage("placed-"+order, nil), outbox.HandleParams{Consumer: "billing", MessageID: "placed-" + order},
			func(msg *message.Message) ([]*message.Message, error) {
				ctx := msg.Context()
				if err := outbox.Publish(ctx, "receipts", message.NewMessage(watermill.NewUUID(), []byte("v2:"+order))); err != nil {
					return nil, err
				}
				return nil, outbox.Publish(ctx, "invoices", message.NewMessage(watermill.NewUUID(), []byte("v1:"+order)))
			})
		if !errors.Is(err, outbox.ErrDispatchFailed) {
			t.Fatalf("leaving the invoice of %s undispatched: %v", order, err)
		}
	}
	if _, err := db.Exec(`INSERT INTO outbox_attempts (consumer, message_id, attempts, last_error) VALUES ('shipping', 'placed-o-3004', 2, 'carrier API timeout')`); err != nil {
		t.Fatal(err)
	}
	first.FlushMarks()
	waitFor := func(what, query string) {
		t.Helper()
		pgtest.CheckEffectsParent(t, query)
		deadline := time.Now().Add(30 * time.Second)
		for {
			var ok bool
			if err := db.QueryRow(query).Scan(&ok); err == nil && ok {
				return
			}
			if time.Now().After(deadline) {
				t.Fatalf("%s: not within 30s", what)
			}
			time.Sleep(20 * time.Millisecond)
		}
	}
	firstCtx, stopFirst := context.WithCancel(ctx)
	firstDone := make(chan error, 1)
	go func() { firstDone <- first.Run(firstCtx) }()
	waitFor("the relay parks the 3 invoices", `SELECT count(*) = 3 FROM outbox_effects_all WHERE parked_at IS NOT NULL`)
	stopFirst()
	<-firstDone

	// The service that runs on samples once at its start and not again during the test: its
	// sample (3 parked, 1 failing) stays younger than the console's MaxSampleAge, as a sample
	// taken just before a repair does.
	cfg.StatsInterval = time.Hour
	ob, err := outbox.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	runCtx, stopRun := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- ob.Run(runCtx) }()
	defer func() { stopRun(); <-done }()
	waitFor("Run stores a sample of 3 parked effects and 1 failing message",
		`SELECT coalesce(sample, '') LIKE '%"Parked":3%"Failing":1%' FROM outbox_stats`)

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

	// tiles reads the parked and failing tiles and the rows of the two lists.
	tiles := func() (parked, parkedRows, failing, failingRows string) {
		t.Helper()
		js := `[document.querySelector('#parked-count').textContent,
			String(document.querySelectorAll('#parked tr[data-id]').length),
			document.querySelector('#failing-count').textContent,
			String(document.querySelectorAll('#failing tr[data-message]').length)]`
		v, err := chromedp.Run(bctx, chromedp.Evaluate[[]string](js))
		if err != nil || len(v) != 4 {
			t.Fatalf("reading the tiles: %v %v", v, err)
		}
		return v[0], v[1], v[2], v[3]
	}
	if err := chromedp.Do(bctx, chromedp.Navigate(srv.URL+"/outbox/"), chromedp.WaitVisible(chromedp.CSS(`#groups button`))); err != nil {
		t.Fatalf("loading the console: %v", err)
	}
	if p, pr, f, fr := tiles(); p != "3" || pr != "3" || f != "1" || fr != "1" {
		t.Fatalf("before the repair: parked tile %s, %s rows; failing tile %s, %s rows; want 3, 3, 1, 1", p, pr, f, fr)
	}

	// The broker takes v1 again: retry the whole failure group.
	b.refusing.Store(false)
	if err := chromedp.Do(bctx, chromedp.Click(chromedp.CSS(`#groups button`)), chromedp.WaitVisible(chromedp.CSS(`#flash`))); err != nil {
		t.Fatalf("retrying all in the console: %v", err)
	}
	flash, err := chromedp.Run(bctx, chromedp.Text(chromedp.CSS(`#flash`)))
	if err != nil || !strings.Contains(flash, "3 parked effect(s) retried") {
		t.Fatalf("after retry all: flash %q %v", flash, err)
	}
	if p, pr, _, _ := tiles(); p != "0" || pr != "0" {
		t.Errorf("after retry all: the parked tile says %s while the list shows %s parked effects", p, pr)
	}
	if class, err := chromedp.Run(bctx, chromedp.AttributeValue(chromedp.CSS(`#parked-tile`), "class")); err != nil || strings.Contains(class.Value, "bad") {
		t.Errorf("after retry all: the parked tile is still red (%q %v)", class.Value, err)
	}

	// The failing message is delivered again and succeeds: it leaves the count at once.
	if _, err := db.Exec(`INSERT INTO outbox_processed (consumer, message_id, processed_at) VALUES ('shipping', 'placed-o-3004', now())`); err != nil {
		t.Fatal(err)
	}
	if err := chromedp.Do(bctx, chromedp.Navigate(srv.URL+"/outbox/"), chromedp.WaitVisible(chromedp.CSS(`#relay`))); err != nil {
		t.Fatal(err)
	}
	if _, _, f, fr := tiles(); f != "0" || fr != "0" {
		t.Errorf("after the failing message succeeded: the failing tile says %s while the list shows %s failing messages", f, fr)
	}
}
