package main

import (
	"encoding/json"
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

// Item: the dashboard's panels told the reader to run Outbox.RetryParked or
// Outbox.ReplayPoisoned, and showed no dead letters, although failing messages end there by
// default. Its descriptions name commands, as the alerts do, and it shows the dead letters
// waiting and the messages dead-lettered.
func TestDashboardNamesCommandsAndShowsDeadLetters(t *testing.T) {
	raw, err := os.ReadFile("../../deploy/grafana/outbox-dashboard.json")
	if err != nil {
		t.Fatal(err)
	}
	var dash struct {
		Panels []struct {
			Title, Description string
			Targets            []struct{ Expr string }
		}
	}
	if err := json.Unmarshal(raw, &dash); err != nil {
		t.Fatal(err)
	}
	method := regexp.MustCompile(`\b(?:Outbox|ops)\.([A-Z]\w*)`)
	var gauge, outcome bool
	for _, p := range dash.Panels {
		for _, m := range method.FindAllStringSubmatch(p.Description, -1) {
			if m[1] != "Run" {
				t.Errorf("panel %q names the Go method %s instead of a command", p.Title, m[0])
			}
		}
		for _, c := range regexp.MustCompile("`outbox((?: [a-z]+)+)").FindAllStringSubmatch(p.Description, -1) {
			words := strings.Fields(c[1])
			if code, out, _ := noDSN(append(words, "-h")...); code != 0 || !strings.Contains(out, "usage: outbox "+strings.Join(words, " ")) {
				t.Errorf("panel %q names `outbox %s`, which is no command", p.Title, c[1])
			}
		}
		for _, q := range p.Targets {
			gauge = gauge || strings.Contains(q.Expr, "outbox_messages_dead{")
			outcome = outcome || strings.Contains(q.Expr, "dead_lettered")
		}
	}
	if !gauge || !outcome {
		t.Errorf("the dashboard shows the dead letters waiting: %v, the messages dead-lettered: %v; want both", gauge, outcome)
	}
}
