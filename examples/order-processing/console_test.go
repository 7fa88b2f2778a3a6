package main

import (
	"context"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/watermill-outbox/outbox/internal/pgtest"
)

// On PostgreSQL and on MySQL the service mounts the outbox's web console at /outbox/, behind HTTP
// Basic authentication as user operator.
func TestConsoleIsMountedBehindAuthentication(t *testing.T) {
	t.Run("postgres", func(t *testing.T) {
		cfg := testConfig(t)
		cfg.postgres = pgtest.DSN(t)
		checkConsole(t, cfg)
	})
	t.Run("mysql", func(t *testing.T) {
		cfg := testConfig(t)
		cfg.mysql = mysqlDSN(t)
		checkConsole(t, cfg)
	})
}

func checkConsole(t *testing.T, cfg config) {
	cfg.consolePassword = "s3cret"
	out := &syncBuffer{}
	base, client := startService(t, cfg, out)
	// The operator chose the password: it is not printed (only a generated one is).
	if strings.Contains(out.String(), "s3cret") || !strings.Contains(out.String(), "/outbox/") {
		t.Errorf("the console's banner shows the operator's password, or no console:\n%s", out.String())
	}
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

// An error that carries the DSN (lib/pq puts the whole URL in a parse error) is printed without
// its password.
func TestErrorsDoNotPrintTheDatabasePassword(t *testing.T) {
	cfg := testConfig(t)
	cfg.postgres = "postgres://orders:Zq%zzS3cretA@127.0.0.1:1/orders?sslmode=disable&connect_timeout=1"
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	err := serve(ctx, cfg, io.Discard, nil)
	if err == nil {
		t.Fatal("the service started on an unparsable DSN")
	}
	if text := errorText(err, cfg); strings.Contains(text, "S3cretA") || strings.Contains(text, "%zz") {
		t.Errorf("the error printed shows the password: %s", text)
	}
}
