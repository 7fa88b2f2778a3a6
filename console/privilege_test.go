package console_test

import (
	"context"
	"database/sql"
	"errors"
	"net/http"
	"net/http/cookiejar"
	"net/url"
	"strings"
	"testing"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/watermill-outbox/outbox"
	"github.com/watermill-outbox/outbox/console"
	"github.com/watermill-outbox/outbox/drivers/postgres"
	"github.com/watermill-outbox/outbox/internal/pgtest"
	"github.com/watermill-outbox/outbox/ops"
)

// The console runs in the service, as the application's role with exactly the grants
// postgres.Grants gives it: the page shows (without the audit entries it may not read back), and
// a retry is applied and audited.
func TestConsoleRunsAsTheApplicationRole(t *testing.T) {
	ownerDSN := pgtest.DSN(t)
	owner, err := sql.Open("postgres", ownerDSN)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = owner.Close() })
	ctx := context.Background()
	migrator, err := outbox.New(outbox.Config{DB: owner, Driver: postgres.Driver{}, Publisher: refusing{}})
	if err != nil {
		t.Fatal(err)
	}
	if err := migrator.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	grants, err := postgres.Grants("", "outbox_", "console_app", false)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := owner.Exec(`CREATE ROLE console_app LOGIN PASSWORD 'pw'; ` + strings.Join(grants, "; ")); err != nil {
		t.Fatal(err)
	}
	u, _ := url.Parse(ownerDSN)
	u.User = url.UserPassword("console_app", "pw")
	app, err := sql.Open("postgres", u.String())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = app.Close() })
	ob, err := outbox.New(outbox.Config{DB: app, Driver: postgres.Driver{}, Publisher: refusing{}, RelayMaxAttempts: 1, RetryDelay: -1})
	if err != nil {
		t.Fatal(err)
	}
	err = ob.Handle(message.NewMessage("m-1", nil), outbox.HandleParams{Consumer: "billing", MessageID: "m-1"},
		func(msg *message.Message) ([]*message.Message, error) {
			if err := outbox.Publish(msg.Context(), "ok", message.NewMessage("", []byte("fine"))); err != nil {
				return nil, err
			}
			return nil, outbox.Publish(msg.Context(), "invoices", message.NewMessage(watermill.NewUUID(), []byte("poison")))
		})
	if !errors.Is(err, outbox.ErrDispatchFailed) {
		t.Fatalf("parking: %v", err)
	}
	ob.FlushMarks()
	o, err := ops.ForOutbox(ob)
	if err != nil {
		t.Fatal(err)
	}
	srv := serve(t, o, console.Options{
		Authenticate: func(*http.Request) (string, bool) { return "alice", true },
		Authorize:    func(*http.Request, string, string) bool { return true },
	})
	jar, _ := cookiejar.New(nil)
	c := &http.Client{Jar: jar, CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }}
	code, body := get(t, c, srv.URL+"/outbox/")
	if code != http.StatusOK || !strings.Contains(body, "not readable") {
		t.Fatalf("page as the application role: %d\n%s", code, body)
	}
	token, id := tokenRe.FindStringSubmatch(body)[1], idRe.FindStringSubmatch(body)[1]
	resp, err := c.PostForm(srv.URL+"/outbox/retry", url.Values{"ids": {id}, "token": {token}})
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	var parked, audited int
	if err := owner.QueryRow(`SELECT (SELECT count(*) FROM outbox_effects WHERE parked_at IS NOT NULL),
		(SELECT count(*) FROM outbox_audit WHERE action = 'retry-parked' AND actor = 'alice (console)')`).Scan(&parked, &audited); err != nil {
		t.Fatal(err)
	}
	if resp.StatusCode != http.StatusSeeOther || parked != 0 || audited != 1 {
		t.Errorf("retry as the application role: %d, %d parked, %d audit entries; want 303, 0, 1", resp.StatusCode, parked, audited)
	}
}
