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
		Authorize:    func(*http.Request, string, console.Action) bool { return true },
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
	if err := owner.QueryRow(`SELECT (SELECT count(*) FROM outbox_effects_all WHERE parked_at IS NOT NULL),
		(SELECT count(*) FROM outbox_audit WHERE action = 'retry-parked' AND actor = 'alice (console)')`).Scan(&parked, &audited); err != nil {
		t.Fatal(err)
	}
	if resp.StatusCode != http.StatusSeeOther || parked != 0 || audited != 1 {
		t.Errorf("retry as the application role: %d, %d parked, %d audit entries; want 303, 0, 1", resp.StatusCode, parked, audited)
	}
	// The entry names the database role and the client's addresses (the database's view and the
	// HTTP one), which the database sets: a writer that names another role is not believed.
	var role, client, remote string
	if err := owner.QueryRow(`SELECT db_role, coalesce(host(client_addr), 'local'), remote_addr FROM outbox_audit
		WHERE action = 'retry-parked'`).Scan(&role, &client, &remote); err != nil {
		t.Fatal(err)
	}
	if role != "console_app" || client == "" || !strings.HasPrefix(remote, "127.0.0.1:") {
		t.Errorf("audit origin: role %q, client %q, HTTP remote %q; want console_app, an address, 127.0.0.1:port", role, client, remote)
	}
	if _, err := app.Exec(`INSERT INTO outbox_audit (actor, action, target, db_role) VALUES ('x', 'forged', 'y', 'postgres')`); err != nil {
		t.Fatal(err)
	}
	if err := owner.QueryRow(`SELECT db_role FROM outbox_audit WHERE action = 'forged'`).Scan(&role); err != nil || role != "console_app" {
		t.Errorf("a forged role: %q %v, want console_app", role, err)
	}
}
