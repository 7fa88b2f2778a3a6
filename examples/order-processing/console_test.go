package main

import (
	"io"
	"net/http"
	"strings"
	"testing"

	"github.com/watermill-outbox/outbox/internal/pgtest"
)

// On PostgreSQL the service mounts the outbox's web console at /outbox/, behind HTTP Basic
// authentication as user operator.
func TestConsoleIsMountedBehindAuthentication(t *testing.T) {
	cfg := testConfig(t)
	cfg.postgres = pgtest.DSN(t)
	cfg.consolePassword = "s3cret"
	base, client := startService(t, cfg, &syncBuffer{})
	get := func(user, pass string) (int, string) {
		t.Helper()
		req, _ := http.NewRequest(http.MethodGet, base+"/outbox/", nil)
		if user != "" {
			req.SetBasicAuth(user, pass)
		}
		resp, err := client.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(b)
	}
	if code, _ := get("", ""); code != http.StatusUnauthorized {
		t.Errorf("without credentials: %d, want 401", code)
	}
	if code, _ := get("operator", "wrong"); code != http.StatusUnauthorized {
		t.Errorf("with a wrong password: %d, want 401", code)
	}
	if code, body := get("operator", "s3cret"); code != http.StatusOK || !strings.Contains(body, "signed in as operator") {
		t.Errorf("with the password: %d %s", code, body)
	}
}
