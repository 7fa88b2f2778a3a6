package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/watermill-outbox/outbox/internal/pgtest"
	"github.com/watermill-outbox/outbox/internal/silent"
)

// A service of several member databases (a tenant.Set) is inspected through one -members file:
// status shows every member, a member that cannot be read is named and the others still shown,
// -member picks one database for any command, and a repair never runs on all of them at once.
func TestMembersFile(t *testing.T) {
	acme := newFixture(t) // two parked effects, a failing and a poisoned message
	globex := pgtest.DSN(t)
	if code, out := acme.cli(t, "-dsn", globex, "migrate", "up"); code != 0 {
		t.Fatalf("migrate globex: exit %d: %s", code, out)
	}
	down, err := url.Parse(globex)
	if err != nil {
		t.Fatal(err)
	}
	down.User = url.UserPassword("nobody", "s3cret-pw")
	down.Path = "/no_such_database"
	file := filepath.Join(t.TempDir(), "members")
	content := "# the tenants of the order service\nacme " + acme.dsn + "\n\nglobex " + globex + "\ninitech " + down.String() + "\n"
	if err := os.WriteFile(file, []byte(content), 0o600); err != nil {
		t.Fatal(err)
	}
	cli := func(args ...string) (int, string, string) {
		var out, errOut bytes.Buffer
		env := map[string]string{"USER": "alice"}
		code := run(context.Background(), args, &out, &errOut, func(k string) string { return env[k] })
		return code, out.String(), errOut.String()
	}

	code, out, errOut := cli("-members", file, "status")
	if code != 1 || !strings.Contains(errOut, "1 of 3 members could not be read") {
		t.Errorf("status of all members: exit %d (want 1: initech cannot be read), stderr %q", code, errOut)
	}
	for _, want := range []string{"== member acme", "== member globex", "== member initech", "parked            2"} {
		if !strings.Contains(strings.Join(strings.Fields(out), " "), strings.Join(strings.Fields(want), " ")) {
			t.Errorf("status of all members lacks %q:\n%s", want, out)
		}
	}
	if strings.Contains(out+errOut, "s3cret-pw") {
		t.Errorf("a member's password was printed:\n%s%s", out, errOut)
	}

	code, out, errOut = cli("-members", file, "-o", "json", "status")
	var all []struct {
		Member string `json:"member"`
		Status *struct {
			Totals struct {
				Parked int `json:"parked"`
			} `json:"totals"`
		} `json:"status"`
		Error string `json:"error"`
	}
	if err := json.Unmarshal([]byte(out), &all); err != nil || code != 1 {
		t.Fatalf("status -o json: exit %d, %v: %s%s", code, err, out, errOut)
	}
	if len(all) != 3 || all[0].Member != "acme" || all[0].Status == nil || all[1].Status == nil || all[2].Error == "" {
		t.Fatalf("status -o json of the members: %+v", all)
	}
	if p0, p1 := all[0].Status.Totals.Parked, all[1].Status.Totals.Parked; p0 != 2 || p1 != 0 {
		t.Errorf("parked effects by member: acme %d (want 2), globex %d (want 0)", p0, p1)
	}

	// -member picks one database, for a list and for a repair alike.
	code, out, errOut = cli("-members", file, "-member", "acme", "parked", "list")
	if code != 0 || strings.Count(out, "billing") != 2 {
		t.Errorf("parked list -member acme: exit %d: %s%s", code, out, errOut)
	}
	if code, out, errOut = cli("-members", file, "-member", "globex", "parked", "retry", "-all"); code != 1 || !strings.Contains(errOut, "nothing matched") {
		t.Errorf("parked retry -all -member globex: exit %d (want 1, nothing parked there): %s%s", code, out, errOut)
	}

	// A repair never runs on every member at once, nor a lookup on a database left to guess.
	for _, args := range [][]string{{"parked", "retry", "-all"}, {"lookup", "billing", "m-ok"}, {"cleanup", "-dry-run"}} {
		code, out, errOut := cli(append([]string{"-members", file}, args...)...)
		if code != 2 || !strings.Contains(errOut, "pick one with -member") {
			t.Errorf("%v with -members and no -member: exit %d (want 2, pick one): %s%s", args, code, out, errOut)
		}
	}
	if n := acme.parkedCount(t); n != 2 {
		t.Errorf("after the refused repairs, acme has %d parked effects, want 2", n)
	}

	// Mistakes in the file or the flags are usage errors that say what is wrong.
	dup := filepath.Join(t.TempDir(), "dup")
	if err := os.WriteFile(dup, []byte("a "+globex+"\na "+globex+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		args []string
		want string
	}{
		{[]string{"-members", file, "-member", "hooli", "status"}, `-member "hooli" is not in`},
		{[]string{"-members", dup, "status"}, `member "a" is on line 1 already`},
		{[]string{"-members", file, "-dsn", globex, "status"}, "-dsn and -members: give one"},
		{[]string{"-member", "acme", "-dsn", globex, "status"}, "no -members file"},
		{[]string{"-members", filepath.Join(t.TempDir(), "missing"), "status"}, "-members"},
	} {
		code, out, errOut := cli(c.args...)
		if code != 2 || !strings.Contains(errOut, c.want) {
			t.Errorf("%v: exit %d, stderr %q; want 2 and %q (stdout %q)", c.args, code, errOut, c.want, out)
		}
	}
}

// parkedCount is the number of parked effects in the fixture's database.
func (f *fixture) parkedCount(t *testing.T) int {
	t.Helper()
	var n int
	if err := f.db.QueryRow(`SELECT count(*) FROM outbox_effects_all WHERE parked_at IS NOT NULL AND dispatched_at IS NULL`).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

// TestStatusOfASilentDatabaseEndsByTheTimeout: a server (or a pooler) that accepts connections
// and never answers held a command on one database for ever: lib/pq does not watch the context
// while it connects, and -timeout, said to bound every command, did not. Its connections now
// end by the command's deadline.
func TestStatusOfASilentDatabaseEndsByTheTimeout(t *testing.T) {
	srv, err := silent.Start()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = srv.Close() })
	for _, dsn := range []string{srv.DSN(), srv.DSN() + "&connect_timeout=60"} {
		done := make(chan [2]string, 1)
		go func() {
			var out, errOut bytes.Buffer
			code := run(context.Background(), []string{"-dsn", dsn, "-timeout", "2s", "status"}, &out, &errOut, func(string) string { return "" })
			done <- [2]string{fmt.Sprint(code), errOut.String()}
		}()
		select {
		case r := <-done:
			if r[0] != "1" || !strings.Contains(r[1], "no answer within -timeout (2s)") {
				t.Errorf("%s: exit %s, stderr %q: want 1 and the timeout named", dsn, r[0], r[1])
			}
		case <-time.After(15 * time.Second):
			t.Fatalf("%s: status with -timeout 2s has not returned after 15 s", dsn)
		}
	}
}

// status of all members returns within -timeout whatever a member does: nine members whose
// server accepts connections and never answers (lib/pq does not watch the context while it
// connects), first in the file, are reported by name as not answering, and the member that
// answers, last in the file, is shown. Before, the members were read one after another and the
// command waited for ever on the first silent one, printing nothing; then eight at a time, each
// holding its turn until it returned, and the eight first silent ones kept the member that
// answers from being read at all. A turn now lasts a second at most.
func TestMembersStatusWithSilentMembers(t *testing.T) {
	acme := newFixture(t)
	srv, err := silent.Start()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = srv.Close() })
	content := ""
	for i := range 9 {
		content += fmt.Sprintf("silent%d %s\n", i, srv.DSN())
	}
	content += "acme " + acme.dsn + "\n"
	file := filepath.Join(t.TempDir(), "members")
	if err := os.WriteFile(file, []byte(content), 0o600); err != nil {
		t.Fatal(err)
	}
	type result struct {
		code        int
		out, errOut string
	}
	done := make(chan result, 1)
	began := time.Now()
	go func() {
		var out, errOut bytes.Buffer
		code := run(context.Background(), []string{"-members", file, "-timeout", "5s", "status"}, &out, &errOut, func(string) string { return "" })
		done <- result{code, out.String(), errOut.String()}
	}()
	select {
	case r := <-done:
		took := time.Since(began)
		if took > 8*time.Second {
			t.Errorf("status took %v with -timeout 5s", took.Round(time.Millisecond))
		}
		if r.code != 1 || !strings.Contains(r.errOut, "9 of 10 members could not be read") {
			t.Errorf("exit %d, stderr %q: want 1 and the silent members counted", r.code, r.errOut)
		}
		flat := strings.Join(strings.Fields(r.out), " ")
		for _, want := range []string{"== member acme", "parked 2"} {
			if !strings.Contains(flat, want) {
				t.Errorf("status lacks %q:\n%s", want, r.out)
			}
		}
		// Each silent member's error names the timeout: the turn's ("no answer within -timeout
		// (5s): connecting to it or reading it did not return"), or its connection's, which
		// carries the same deadline ("connect to PostgreSQL: no answer within -timeout (5s)").
		for _, name := range []string{"silent0", "silent7", "silent8"} {
			_, rest, found := strings.Cut(flat, "== member "+name+" error ")
			if line, _, _ := strings.Cut(rest, "=="); !found || !strings.Contains(line, "no answer within -timeout (5s)") {
				t.Errorf("status of %s does not name the timeout:\n%s", name, r.out)
			}
		}
	case <-time.After(30 * time.Second):
		t.Fatal("status of members, nine of them silent, did not return within 30 s with -timeout 5s")
	}
}
