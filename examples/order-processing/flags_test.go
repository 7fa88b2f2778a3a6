package main

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/watermill-outbox/outbox"
)

// -after-dispatch-failure and -relay-max-attempts are validated and reach the Config of every
// Outbox the service creates; -form is validated.
func TestDispatchFailureFlags(t *testing.T) {
	cases := []struct {
		args     []string
		want     outbox.DispatchFailurePolicy
		attempts int
		err      string
	}{
		{nil, outbox.DispatchFailureNack, 0, ""},
		{[]string{"-after-dispatch-failure", "ack", "-relay-max-attempts", "3"}, outbox.DispatchFailureAck, 3, ""},
		{[]string{"-after-dispatch-failure", "nack"}, outbox.DispatchFailureNack, 0, ""},
		{[]string{"-after-dispatch-failure", "drop"}, "", 0, `-after-dispatch-failure must be nack or ack, not "drop"`},
		{[]string{"-after-dispatch-failure", ""}, "", 0, "-after-dispatch-failure must be nack or ack"},
		{[]string{"-relay-max-attempts", "-1"}, "", 0, "-relay-max-attempts must not be negative"},
		{[]string{"-form", "pgx"}, "", 0, "-form pgx needs -postgres DSN"},
		{[]string{"-form", "gorm"}, "", 0, `-form must be sql or pgx, not "gorm"`},
		{[]string{"-postgres", "postgres://localhost/orders", "-mysql", "root@tcp(localhost:3306)/orders"}, "", 0, "-postgres and -mysql name two databases"},
		{[]string{"-mysql", "root@tcp(localhost:3306)/orders", "-form", "pgx"}, "", 0, "-form pgx needs -postgres DSN"},
	}
	for _, tc := range cases {
		t.Run(strings.Join(tc.args, " "), func(t *testing.T) {
			cfg, err := parseFlags(append([]string{"-data", t.TempDir(), "-addr", "127.0.0.1:0"}, tc.args...))
			if tc.err != "" {
				if err == nil || !strings.Contains(err.Error(), tc.err) {
					t.Fatalf("parseFlags(%q): %v, want an error with %q", tc.args, err, tc.err)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			s, err := openService(context.Background(), cfg, 2*time.Second)
			if err != nil {
				t.Fatal(err)
			}
			defer s.close()
			var got outbox.Config
			_, pub, err := s.newOutbox(func(c *outbox.Config) { got = *c })
			if err != nil {
				t.Fatal(err)
			}
			_ = pub.Close()
			if got.AfterDispatchFailure != tc.want || got.RelayMaxAttempts != tc.attempts {
				t.Errorf("Config.AfterDispatchFailure %q, RelayMaxAttempts %d; want %q and %d",
					got.AfterDispatchFailure, got.RelayMaxAttempts, tc.want, tc.attempts)
			}
		})
	}
}
