package outbox_test

import (
	"go/ast"
	"go/parser"
	"go/token"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
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
