package outbox_test

import (
	"context"
	"database/sql"
	"errors"
	"go/ast"
	"go/parser"
	"go/token"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"

	"github.com/watermill-outbox/outbox"
)

// modelPending lists the steps of the protocol's model that have no failpoint in the code yet,
// each with the reason. It is empty: every step has one. A step may be listed here only when
// placing its failpoint would mean restructuring the code around it.
var modelPending = map[string]string{}

// TestModelFailpoints keeps the protocol's model (model/outbox.pml) and the code one protocol:
// every step of the model after which a process may crash is a failpoint of the code
// (outbox.Failpoint*) that the code calls, every failpoint is a step of the model, and every
// invariant the model checks is named in docs/protocol.md.
func TestModelFailpoints(t *testing.T) {
	pml, err := os.ReadFile(filepath.Join("model", "outbox.pml"))
	if err != nil {
		t.Fatal(err)
	}
	steps := map[string]bool{}
	for _, m := range regexp.MustCompile(`\b(?:crash_at|abort_at)\((\w+)\)`).FindAllStringSubmatch(string(pml), -1) {
		if m[1] != "step" { // the macros' own definitions
			steps[strings.ReplaceAll(m[1], "_", "-")] = true
		}
	}
	if len(steps) < 5 {
		t.Fatalf("found only %d steps in model/outbox.pml: %v", len(steps), steps)
	}

	failpoints := failpointConstants(t) // value -> constant name
	for step := range steps {
		_, isFailpoint := failpoints[step]
		_, isPending := modelPending[step]
		switch {
		case isFailpoint && isPending:
			t.Errorf("model step %q has a failpoint now: take it off the pending list", step)
		case !isFailpoint && !isPending:
			t.Errorf("model step %q has no failpoint in the code (add a Failpoint constant and call it at that step, or list it as pending with the reason)", step)
		}
	}
	for value, name := range failpoints {
		if !steps[value] {
			t.Errorf("failpoint %s (%q) is no step of model/outbox.pml: add the step (crash_at(%s)) or remove the failpoint", name, value, strings.ReplaceAll(value, "-", "_"))
		}
	}
	for step := range modelPending {
		if !steps[step] {
			t.Errorf("pending step %q is no step of the model", step)
		}
	}

	// Each failpoint is called somewhere in the code: the library's, or a driver's (which cannot
	// import the root package: it names the failpoint by its value).
	var code strings.Builder
	for _, dir := range []string{".", filepath.Join("drivers", "postgres"), filepath.Join("drivers", "outboxpgx")} {
		files, err := filepath.Glob(filepath.Join(dir, "*.go"))
		if err != nil {
			t.Fatal(err)
		}
		for _, f := range files {
			if strings.HasSuffix(f, "_test.go") || filepath.Base(f) == "config.go" {
				continue
			}
			b, err := os.ReadFile(f)
			if err != nil {
				t.Fatal(err)
			}
			code.Write(b)
		}
	}
	for value, name := range failpoints {
		call := regexp.MustCompile(`(?:failpoint|fail)\([^,()]+,\s*(?:(?:outbox\.)?` + name + `|"` + regexp.QuoteMeta(value) + `")\)`)
		if !call.MatchString(code.String()) {
			t.Errorf("failpoint %s is never called in the code", name)
		}
	}

	// The invariants are named in the docs as the model names them.
	doc, err := os.ReadFile(filepath.Join("docs", "protocol.md"))
	if err != nil {
		t.Fatal(err)
	}
	var invariants []string
	for _, m := range regexp.MustCompile(`CHECK\((\w+),`).FindAllStringSubmatch(string(pml), -1) {
		if m[1] != "inv" && !slices.Contains(invariants, m[1]) {
			invariants = append(invariants, m[1])
		}
	}
	if len(invariants) < 7 {
		t.Fatalf("found only %d invariants in the model: %v", len(invariants), invariants)
	}
	for _, inv := range invariants {
		if !strings.Contains(string(doc), "`"+inv+"`") {
			t.Errorf("invariant %s of the model is not named in docs/protocol.md", inv)
		}
	}
}

// failpointConstants returns the Failpoint* constants of config.go, by value.
func failpointConstants(t *testing.T) map[string]string {
	t.Helper()
	f, err := parser.ParseFile(token.NewFileSet(), "config.go", nil, 0)
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]string{}
	for _, decl := range f.Decls {
		gd, ok := decl.(*ast.GenDecl)
		if !ok || gd.Tok != token.CONST {
			continue
		}
		for _, spec := range gd.Specs {
			vs := spec.(*ast.ValueSpec)
			for i, name := range vs.Names {
				if !strings.HasPrefix(name.Name, "Failpoint") || i >= len(vs.Values) {
					continue
				}
				lit, ok := vs.Values[i].(*ast.BasicLit)
				if !ok || lit.Kind != token.STRING {
					t.Fatalf("%s is not a string literal", name.Name)
				}
				v, err := strconv.Unquote(lit.Value)
				if err != nil {
					t.Fatal(err)
				}
				out[v] = name.Name
			}
		}
	}
	if len(out) < 5 {
		t.Fatalf("found only %d failpoint constants in config.go", len(out))
	}
	return out
}

// TestRelayFailpoints crashes a relay round at its steps, as the protocol's model does: after
// its lease, nothing is sent until the lease ends; after its mark, what it sent stays marked.
func TestRelayFailpoints(t *testing.T) {
	var crashAt atomic.Value // the failpoint that fails, "" for none
	crashAt.Store("")
	var mu sync.Mutex
	seen := map[string]int{}
	e := newEnv(t, func(c *outbox.Config) {
		c.RelayGrace = time.Millisecond
		c.RelayInterval = 20 * time.Millisecond
		c.Failpoint = func(_ context.Context, point string) error {
			mu.Lock()
			seen[point]++
			mu.Unlock()
			if point == crashAt.Load().(string) {
				return errors.New("crash")
			}
			return nil
		}
	})
	hits := func(point string) int {
		mu.Lock()
		defer mu.Unlock()
		return seen[point]
	}
	ctx := context.Background()

	// Two effects committed and left to the relay: the boundary crashes after its commit.
	crashAt.Store(outbox.FailpointAfterCommit)
	var ids []string
	err := e.ob.InTx(ctx, func(ctx context.Context, tx *sql.Tx) error {
		for _, p := range []string{"one", "two"} {
			m := message.NewMessage(uuid.NewString(), []byte(p))
			ids = append(ids, m.UUID)
			if err := outbox.Publish(ctx, "out_a", m); err != nil {
				return err
			}
		}
		return nil
	})
	if !errors.Is(err, outbox.ErrFailpoint) {
		t.Fatalf("InTx with a crash after commit: %v, want ErrFailpoint", err)
	}
	mustEqual(t, "pending effects after the crash", e.pendingEffects(), 2)

	// A crash after the round's lease: nothing sent, the key leased.
	crashAt.Store(outbox.FailpointAfterRelayClaim)
	stop := startRun(t, e.ob)
	waitFor(t, "a relay round to crash after its lease", func() bool { return hits(outbox.FailpointAfterRelayClaim) > 0 })
	stop()
	mustEqual(t, "messages on the wire after a crash after the lease", len(e.wire("out_a")), 0)
	mustEqual(t, "leased effects", e.count(`SELECT count(*) FROM outbox_effects_all WHERE next_attempt_at > now()`), 1)

	// The lease runs out; a crash after the round's mark leaves what it sent marked, once on the wire.
	if _, err := e.db.Exec(`UPDATE outbox_effects_all SET next_attempt_at = now()`); err != nil {
		t.Fatal(err)
	}
	crashAt.Store(outbox.FailpointAfterRelayMark)
	stop = startRun(t, e.ob)
	waitFor(t, "a relay round to crash after its mark", func() bool { return hits(outbox.FailpointAfterRelayMark) > 0 })
	stop()
	mustEqual(t, "pending effects after a crash after the mark", e.pendingEffects(), 0)
	wire := e.wire("out_a")
	for _, id := range ids {
		mustEqual(t, "copies on the wire of "+id, wire[id], 1)
	}
	if hits(outbox.FailpointAfterPublish) == 0 {
		t.Error("the relay's publish did not reach its failpoint")
	}
}
