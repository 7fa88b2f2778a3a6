package main

import (
	"os"
	"regexp"
	"strings"
	"testing"
)

// Item: the alert texts told the on-call engineer to call Outbox.ParkedEffects,
// Outbox.DeadLetters or Outbox.Health, methods of the service's code that nobody runs at 3 a.m.
// Every command an alert names must exist (its help exits 0), and no alert names a Go method
// of the Outbox but Run: whether a process runs its relay is a question about the service's
// code, which no command can answer or change.
func TestAlertTextsNameCommands(t *testing.T) {
	rules, err := os.ReadFile("../../deploy/prometheus/outbox-alerts.yaml")
	if err != nil {
		t.Fatal(err)
	}
	text := string(rules)
	cmds := regexp.MustCompile("`outbox((?: [a-z]+)+)").FindAllStringSubmatch(text, -1)
	if len(cmds) < 8 {
		t.Fatalf("the alert rules name %d commands, want the parked, failing, dead, replay, status and migrate ones", len(cmds))
	}
	for _, m := range cmds {
		words := strings.Fields(m[1])
		if code, out, errOut := noDSN(append(words, "-h")...); code != 0 || !strings.Contains(out, "usage: outbox "+strings.Join(words, " ")) {
			t.Errorf("an alert names `outbox %s`, which is no command: exit %d\n%s%s", m[1], code, out, errOut)
		}
	}
	for _, m := range regexp.MustCompile(`\b(?:Outbox|ops)\.([A-Z]\w*)`).FindAllStringSubmatch(text, -1) {
		if m[1] != "Run" {
			t.Errorf("an alert names the Go method %s instead of a command", m[0])
		}
	}
	// The alert on failing messages is the one that is read while a message holds up its
	// consumer: it must name the command that moves the message aside at once.
	if !strings.Contains(text, "`outbox dead now") {
		t.Errorf("no alert names `outbox dead now`, which dead-letters a failing message at once")
	}
}
