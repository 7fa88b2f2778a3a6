package pgtest

import (
	"fmt"
	"go/ast"
	"go/parser"
	"go/token"
	"io/fs"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
)

// Where outbox_effects is the whole effects table: MySQL, MariaDB and SQLite keep it plain.
var plainEffectsTable = []string{"drivers/mysql/", "drivers/sqlite/", "e2e/sqlite/", "bench/mysql.go"}

// TestNoStatementNamesPartition0 reads the string literals of every Go file of the repository
// (every module: tests, examples, e2e, bench, the CLI and the console) and fails on one that
// names outbox_effects without the opt-in, outside the MySQL and SQLite code. The helpers check
// what they send (CheckEffectsParent); this also finds the statements sent past them, straight
// through a *sql.DB, a transaction or a pgx pool.
func TestNoStatementNamesPartition0(t *testing.T) {
	root, err := filepath.Abs("../..")
	if err != nil {
		t.Fatal(err)
	}
	var found []string
	files := 0
	err = filepath.WalkDir(root, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel := filepath.ToSlash(strings.TrimPrefix(path, root+string(filepath.Separator)))
		if d.IsDir() {
			if strings.HasPrefix(d.Name(), ".") || d.Name() == "testdata" || d.Name() == "vendor" {
				return filepath.SkipDir
			}
			return nil
		}
		if !strings.HasSuffix(path, ".go") || rel == "internal/pgtest/effects.go" || rel == "internal/pgtest/effects_test.go" ||
			rel == "internal/cmd/docsnippets/effects_test.go" { // the docs check's own examples
			return nil
		}
		for _, p := range plainEffectsTable {
			if strings.HasPrefix(rel, p) {
				return nil
			}
		}
		files++
		found = append(found, partition0Literals(t, path, rel)...)
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if files < 100 {
		t.Fatalf("read %d Go files under %s: not the repository", files, root)
	}
	for _, f := range found {
		t.Errorf("%s names outbox_effects, partition 0 of PostgreSQL's effects table: read outbox_effects_all, or mark it %s", f, Partition0OptIn)
	}
}

// partition0Literals returns the positions of the string literals of the Go file path that
// NamesPartition0.
func partition0Literals(t *testing.T, path, rel string) []string {
	t.Helper()
	fset := token.NewFileSet()
	f, err := parser.ParseFile(fset, path, nil, parser.SkipObjectResolution)
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	ast.Inspect(f, func(n ast.Node) bool {
		if lit, ok := n.(*ast.BasicLit); ok && lit.Kind == token.STRING && NamesPartition0(lit.Value) {
			out = append(out, rel+":"+strconv.Itoa(fset.Position(lit.Pos()).Line))
		}
		return true
	})
	return out
}

// The guard's own cases: what counts as naming partition 0, and what does not.
func TestNamesPartition0(t *testing.T) {
	for q, want := range map[string]bool{
		`SELECT count(*) FROM outbox_effects WHERE dispatched_at IS NULL`:     true,
		`SELECT count(*) FROM outbox_effects`:                                 true,
		`UPDATE "public"."outbox_effects" SET next_attempt_at = now()`:        true,
		`LOCK TABLE OUTBOX_EFFECTS IN ACCESS EXCLUSIVE MODE`:                  true,
		`SELECT count(*) FROM outbox_effects_all WHERE dispatched_at IS NULL`: false,
		`INSERT INTO outbox_effects_1 (id) VALUES (1)`:                        false,
		`SELECT gen FROM outbox_effects_rotation`:                             false,
		`SELECT count(*) FROM outbox_effects /* partition 0 */`:               false,
		`SELECT count(*) FROM all_effects`:                                    false,
		`SELECT count(*) FROM outbox_processed WHERE effects IS NOT NULL`:     false,
		`ALTER TABLE outbox_effects_all SET (fillfactor = 50)`:                false,
	} {
		if got := NamesPartition0(q); got != want {
			t.Errorf("NamesPartition0(%q) = %v, want %v", q, got, want)
		}
	}
}

// errorsOf records what a check reports instead of failing the test that runs it.
type errorsOf struct {
	testing.TB
	reported []string
}

func (e *errorsOf) Helper() {}

func (e *errorsOf) Errorf(format string, args ...any) {
	e.reported = append(e.reported, fmt.Sprintf(format, args...))
}

// The helpers' check fails the test of a statement on partition 0, and passes the same statement
// on the parent or opted in.
func TestCheckEffectsParentFailsThePartition(t *testing.T) {
	for q, fails := range map[string]bool{
		`SELECT count(*) FROM outbox_effects WHERE dispatched_at IS NULL`:                   true,
		`SELECT count(*) FROM outbox_effects_all WHERE dispatched_at IS NULL`:               false,
		`SELECT count(*) FROM outbox_effects /* partition 0 */ WHERE dispatched_at IS NULL`: false,
	} {
		rec := &errorsOf{TB: t}
		CheckEffectsParent(rec, q)
		if got := len(rec.reported) > 0; got != fails {
			t.Errorf("CheckEffectsParent(%q) failed the test: %v, want %v (%q)", q, got, fails, rec.reported)
		}
	}
}
