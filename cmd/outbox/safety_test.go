package main

import (
	"context"
	"encoding/json"
	"errors"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/watermill-outbox/outbox/ops"
)

// The password of the DSN is never printed, whatever is wrong with the DSN.
func TestDSNPasswordIsNeverPrinted(t *testing.T) {
	for _, c := range []struct{ dsn, secret string }{
		{"postgres://app:Zq%zzS3cretA@127.0.0.1:5432/shop", "S3cretA"},                // an unescaped % in a generated password
		{"postgres://app:Hunter2pw@127.0.0.1:54x2/shop?sslmode=disable", "Hunter2pw"}, // a port typo
		{"postgres://app:Pa@ss/word9@127.0.0.1:1/shop?sslmode=disable&connect_timeout=1", "word9"},
		{"host=127.0.0.1 port=1 user=app password=Kv5ecret dbname=shop sslmode=disable connect_timeout=1", "Kv5ecret"},
		{"host=127.0.0.1 port=x1 user=app password='Quoted 5ecret' dbname=shop", "5ecret"},
	} {
		code, out, errOut := cliAs(c.dsn, "-timeout", "5s", "status")
		if code == 0 {
			t.Errorf("%s: status succeeded", c.dsn)
		}
		if strings.Contains(out+errOut, c.secret) {
			t.Errorf("the password is printed: %s%s", out, errOut)
		}
	}
}

// `outbox cleanup` refuses to forget processed message IDs sooner than the service does (or
// than the broker may redeliver), unless forced; it has a dry run, and it is audited.
func TestCleanupGuardsTheDeduplicationMemory(t *testing.T) {
	f := newFixture(t)
	claims := func() int {
		var n int
		if err := f.db.QueryRow(`SELECT count(*) FROM outbox_processed`).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}
	before := claims()
	if code, out := f.cli(t, "cleanup", "-retention", "0s"); code != 2 || claims() != before {
		t.Fatalf("cleanup -retention 0s: exit %d (want 2), %d of %d claims left: %s", code, claims(), before, out)
	}
	if code, out := f.cli(t, "cleanup"); code != 2 || !strings.Contains(out, "-retention") {
		t.Errorf("cleanup with no retention recorded nor given: exit %d (want 2, asking for -retention): %s", code, out)
	}
	if code, out := f.cli(t, "cleanup", "-retention", "1h"); code != 1 || claims() != before {
		t.Errorf("cleanup -retention 1h, the service's unknown: exit %d (want 1, below the default): %s", code, out)
	}
	// The service records its configuration when it runs.
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- f.ob.Run(ctx) }()
	var once sync.Once
	stop := func() { once.Do(func() { cancel(); <-done }) }
	t.Cleanup(stop)
	deadline := time.Now().Add(10 * time.Second)
	for {
		var recorded bool
		if err := f.db.QueryRow(`SELECT retention_ms IS NOT NULL FROM outbox_stats`).Scan(&recorded); err != nil {
			t.Fatal(err)
		}
		if recorded {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the service did not record its retention")
		}
		time.Sleep(20 * time.Millisecond)
	}
	stop()
	if _, err := f.db.Exec(`UPDATE outbox_processed SET processed_at = now() - interval '2 days', dispatched_at = now() - interval '2 days'
		WHERE message_id = 'm-ok'`); err != nil {
		t.Fatal(err)
	}
	before = claims()
	code, out := f.cli(t, "cleanup", "-retention", "24h")
	if code != 1 || !strings.Contains(out, "service's Retention 168h") || claims() != before {
		t.Errorf("cleanup -retention 24h, below the service's 7 days: exit %d (want 1, naming the service's): %s", code, out)
	}
	var rep ops.CleanupReport
	f.jsonOf(t, &rep, "cleanup", "-retention", "24h", "-force", "-dry-run")
	if !rep.DryRun || rep.Claims != 1 || claims() != before {
		t.Errorf("cleanup -dry-run: %+v, %d claims left of %d; want 1 claim counted, none deleted", rep, claims(), before)
	}
	f.jsonOf(t, &rep, "cleanup", "-retention", "24h", "-force")
	if rep.DryRun || rep.Claims != 1 || claims() != before-1 {
		t.Errorf("cleanup -force: %+v, %d claims left of %d; want 1 deleted", rep, claims(), before)
	}
	var audited int
	if err := f.db.QueryRow(`SELECT count(*) FROM outbox_audit WHERE action LIKE 'cleanup%' AND actor = 'alice' AND detail LIKE '%forced%'`).Scan(&audited); err != nil || audited != 1 {
		t.Errorf("the forced cleanup's audit entry: %d (%v), want 1", audited, err)
	}
	if code, out := f.cli(t, "cleanup"); code != 0 || !strings.Contains(out, "retention 168h") {
		t.Errorf("cleanup with the service's recorded retention: %d %s", code, out)
	}
	code, out = f.cli(t, "cleanup", "-no-such-flag")
	for _, flag := range []string{"-retention", "-effect-retention", "-force", "-dry-run", "-batch"} {
		if code != 2 || !strings.Contains(out, flag) {
			t.Errorf("the usage text does not show cleanup's %s: %s", flag, out)
		}
	}
}

// A repair through the library needs a selection, as through the command; the command says
// when its -limit cut a repair short.
func TestRepairsNeedASelectionAndSayWhenCut(t *testing.T) {
	f := newFixture(t)
	o, err := ops.Open(f.db, "", "")
	if err != nil {
		t.Fatal(err)
	}
	parked := func() int {
		var n int
		if err := f.db.QueryRow(`SELECT count(*) FROM outbox_effects_all WHERE parked_at IS NOT NULL`).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}
	ctx := context.Background()
	for name, repair := range map[string]func(context.Context, ops.ParkedFilter, ops.RepairOptions) (ops.Change, error){
		"retry": o.RetryParked, "discard": o.DiscardParked} {
		if ch, err := repair(ctx, ops.ParkedFilter{Limit: 10}, ops.RepairOptions{Actor: "alice"}); !errors.Is(err, ops.ErrNoSelection) || parked() != 2 {
			t.Errorf("%s with an empty filter: %+v %v, %d parked; want ErrNoSelection and 2 parked", name, ch, err, parked())
		}
	}
	code, out := f.cli(t, "parked", "retry", "-error", "schema v2", "-limit", "1")
	if code != 0 || parked() != 1 || !strings.Contains(out, "more parked effects match") {
		t.Errorf("retry -limit 1 of 2: exit %d, %d parked: want it to say that more match: %s", code, parked(), out)
	}
	if ch, err := o.RetryParked(ctx, ops.ParkedFilter{All: true}, ops.RepairOptions{Actor: "alice"}); err != nil || ch.Changed != 1 || ch.More {
		t.Errorf("retry All: %+v %v", ch, err)
	}
}

var snakeCase = regexp.MustCompile(`^[a-z0-9]+(_[a-z0-9]+)*$`)

// keys returns the object keys anywhere in v that are not snake_case, and those of internal
// fields.
func badKeys(v any, path string, bad *[]string) {
	switch v := v.(type) {
	case map[string]any:
		for k, x := range v {
			if (!snakeCase.MatchString(k) && !strings.HasSuffix(path, "retained_by_consumer")) || k == "payload" || k == "metadata" || k == "seq" {
				*bad = append(*bad, path+"."+k)
			}
			badKeys(x, path+"."+k, bad)
		}
	case []any:
		for _, x := range v {
			badKeys(x, path+"[]", bad)
		}
	}
}

// Text from messages (IDs, topics, errors) and from operators (actors) reaches the terminal
// escaped; JSON names its fields in one style and leaves internal fields out.
func TestOutputIsSafeAndConsistent(t *testing.T) {
	f := newFixture(t)
	if _, err := f.db.Exec(`INSERT INTO outbox_attempts (consumer, message_id, attempts, last_error)
		VALUES ('billing', E'evil\x1b]0;pwned\x07', 2, E'boom\x1b[2J\u009b31m')`); err != nil {
		t.Fatal(err)
	}
	if _, err := f.db.Exec(`UPDATE outbox_effects_all SET topic = E'inv\x1b[8moices', last_error = E'refused\x1b[1A\r' WHERE parked_at IS NOT NULL`); err != nil {
		t.Fatal(err)
	}
	if code, out := f.cli(t, "-actor", "eve\x1b[31m", "replay", "billing", "m-poisoned"); code != 0 {
		t.Fatalf("replay: %d %s", code, out)
	}
	for _, args := range [][]string{{"status"}, {"failing", "list"}, {"parked", "list"}, {"parked", "groups"},
		{"lookup", "billing", "m-parked-1"}, {"lookup", "billing", "evil\x1b]0;pwned\x07"}} {
		code, out := f.cli(t, args...)
		if code != 0 || strings.ContainsAny(out, "\x1b\x07\x9b\r") || strings.Contains(out, "\u009b") {
			t.Errorf("outbox %q: exit %d, control characters printed: %q", args, code, out)
		}
	}
	for _, args := range [][]string{{"status"}, {"parked", "list"}, {"parked", "groups"}, {"failing", "list"},
		{"lookup", "billing", "m-parked-1"}, {"parked", "retry", "-consumer", "billing", "-dry-run"}, {"cleanup", "-retention", "168h", "-dry-run"}} {
		code, out := f.cli(t, append([]string{"-o", "json"}, args...)...)
		var v any
		if err := json.Unmarshal([]byte(out), &v); code != 0 || err != nil {
			t.Fatalf("outbox -o json %v: %d %v %s", args, code, err, out)
		}
		var bad []string
		badKeys(v, "", &bad)
		if len(bad) > 0 {
			t.Errorf("outbox -o json %v: fields not in snake_case, or internal: %v", args, bad)
		}
		if strings.Contains(out, "0001-01-01") {
			t.Errorf("outbox -o json %v: zero times shown: %s", args, out)
		}
	}
}
