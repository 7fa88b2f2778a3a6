// Command docsnippets type-checks the Go code blocks of Markdown files against the repository's
// packages, so that the code in README and docs/ cannot drift from the API.
//
//	go run ./internal/cmd/docsnippets README.md docs/*.md doc.go drivers/outboxpgx/outboxpgx.go
//
// A .go file stands for its package comment: its code blocks are checked as fragments, with the
// helpers they leave to the reader allowed to be undefined (a comment has no place for go-check
// declarations); a wrong call of the API still fails.
//
// How a block is checked:
//
//   - A block that starts with a package clause is a file of its own; the blocks after it in the
//     same Markdown file belong to that package (a tutorial that builds a program piece by piece).
//     A block that opens a function without closing it is continued by the next indented blocks,
//     and by nothing else: a block in between would land inside the function when the reader
//     pastes the blocks in order (a tutorial's program must build that way).
//   - Any other block is a fragment, checked in a package of its own. It gets the imports it names
//     (outbox., middleware., message., ...) and a prelude of the variables that fragments take
//     for granted (ctx, db, ob, publisher, router, msg, pool, ...). Statements are wrapped in a
//     function that returns error; declarations stay at the top level.
//   - An HTML comment right before the block, <!-- go-check ... -->, adds Go declarations for
//     what the block leaves to the reader (helpers such as sku(msg), an import under another
//     name); it is invisible in the rendered page. "{ ... }" in a block stands for a body.
//
// Unused variables and imports are allowed (a fragment shows a part); every other error of the
// type checker fails the check, reported at the Markdown file's line.
package main

import (
	"bufio"
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"go/ast"
	"go/importer"
	"go/parser"
	"go/scanner"
	"go/token"
	"go/types"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"sort"
	"strings"
)

// knownImports are the package names a fragment may use without importing them.
var knownImports = map[string]string{
	"outbox":      "github.com/watermill-outbox/outbox",
	"postgres":    "github.com/watermill-outbox/outbox/drivers/postgres",
	"sqlite":      "github.com/watermill-outbox/outbox/drivers/sqlite",
	"outboxpgx":   "github.com/watermill-outbox/outbox/drivers/outboxpgx",
	"mysql":       "github.com/watermill-outbox/outbox/drivers/mysql",
	"middleware":  "github.com/watermill-outbox/outbox/middleware",
	"outboxmw":    "github.com/watermill-outbox/outbox/middleware",
	"outboxtest":  "github.com/watermill-outbox/outbox/outboxtest",
	"ops":         "github.com/watermill-outbox/outbox/ops",
	"console":     "github.com/watermill-outbox/outbox/console",
	"idempotency": "github.com/watermill-outbox/outbox/idempotency",
	"tenant":      "github.com/watermill-outbox/outbox/tenant",
	"sha256":      "crypto/sha256",
	"watermill":   "github.com/ThreeDotsLabs/watermill",
	"message":     "github.com/ThreeDotsLabs/watermill/message",
	"gochannel":   "github.com/ThreeDotsLabs/watermill/pubsub/gochannel",
	"pgx":         "github.com/jackc/pgx/v5",
	"pgxpool":     "github.com/jackc/pgx/v5/pgxpool",
	"context":     "context",
	"sql":         "database/sql",
	"errors":      "errors",
	"fmt":         "fmt",
	"time":        "time",
	"http":        "net/http",
	"os":          "os",
	"testing":     "testing",
	"json":        "encoding/json",
	"filepath":    "path/filepath",
	"log":         "log",
	"strings":     "strings",
}

// prelude declares what fragments take for granted.
const prelude = `package snippet

import (
	"context"
	"database/sql"
	"net/http"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/watermill-outbox/outbox"
)

var (
	ctx        context.Context
	db         *sql.DB
	ob         *outbox.Outbox
	publisher  message.Publisher
	pub        message.Publisher
	subscriber message.Subscriber
	sub        message.Subscriber
	router     *message.Router
	msg        *message.Message
	pool       *pgxpool.Pool
	mux        *http.ServeMux
	t          *testing.T
	payload    []byte
)
`

// block is one fenced Go block of a Markdown file, or one code block of a package comment.
type block struct {
	file  string
	line  int // of the block's first code line
	code  string
	extra string // the go-check comment before it
	// lenient: a package comment has no place for go-check declarations, so the helpers it
	// leaves to the reader may be undefined; every other error counts.
	lenient bool
}

// unit is one package to type-check.
type unit struct {
	name    string
	files   []*srcFile
	lenient bool
}

// srcFile is one generated Go file; lines maps its lines back to Markdown lines (0: generated).
type srcFile struct {
	name  string
	buf   bytes.Buffer
	lines []mdLine
}

type mdLine struct {
	file string
	line int
}

func (f *srcFile) add(text string, from mdLine) {
	for i, l := range strings.Split(strings.TrimSuffix(text, "\n"), "\n") {
		f.buf.WriteString(l)
		f.buf.WriteByte('\n')
		m := from
		if m.line > 0 {
			m.line += i
		}
		f.lines = append(f.lines, m)
	}
}

func main() {
	if len(os.Args) < 2 {
		fmt.Fprintln(os.Stderr, "usage: docsnippets FILE.md...")
		os.Exit(2)
	}
	var units []*unit
	blocks := 0
	for _, path := range os.Args[1:] {
		var bs []block
		var err error
		if strings.HasSuffix(path, ".go") {
			bs, err = readDocComment(path)
		} else {
			bs, err = readBlocks(path)
		}
		if err != nil {
			fmt.Fprintf(os.Stderr, "docsnippets: %v\n", err)
			os.Exit(1)
		}
		blocks += len(bs)
		us, err := build(path, bs)
		if err != nil {
			fmt.Fprintf(os.Stderr, "docsnippets: %v\n", err)
			os.Exit(1)
		}
		units = append(units, us...)
	}
	problems, err := check(units)
	if err != nil {
		fmt.Fprintf(os.Stderr, "docsnippets: %v\n", err)
		os.Exit(1)
	}
	for _, p := range problems {
		fmt.Fprintln(os.Stderr, p)
	}
	if len(problems) > 0 {
		fmt.Fprintf(os.Stderr, "docsnippets: %d problem(s) in the Go blocks of the docs\n", len(problems))
		os.Exit(1)
	}
	fmt.Printf("docsnippets: %d Go blocks in %d files type-check\n", blocks, len(os.Args)-1)
}

// readDocComment returns the code blocks (tab-indented lines) of a Go file's package comment.
func readDocComment(path string) ([]block, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	var blocks []block
	var cur *block
	for i, l := range strings.Split(string(data), "\n") {
		if strings.HasPrefix(l, "package ") {
			break
		}
		if code, ok := strings.CutPrefix(l, "//\t"); ok {
			if strings.HasPrefix(code, "import ") {
				continue // an import line shown to the reader; the check imports by itself
			}
			if cur == nil {
				blocks = append(blocks, block{file: path, line: i + 1, lenient: true})
				cur = &blocks[len(blocks)-1]
			}
			cur.code += code + "\n"
			continue
		}
		if strings.TrimSpace(l) != "//" {
			cur = nil
		}
	}
	return blocks, nil
}

// goCheckBefore returns the declarations of the go-check comment that ends right before a
// block (its first line, after "go-check", is a note to the reader of the Markdown source).
func goCheckBefore(lines []string) string {
	end := len(lines) - 1
	if end < 0 || strings.TrimSpace(lines[end]) != "-->" {
		return ""
	}
	for start := end - 1; start >= 0; start-- {
		if l := strings.TrimSpace(lines[start]); strings.HasPrefix(l, "<!--") {
			if !strings.HasPrefix(strings.TrimSpace(strings.TrimPrefix(l, "<!--")), "go-check") {
				return ""
			}
			return strings.Join(lines[start+1:end], "\n")
		}
	}
	return ""
}

func readBlocks(path string) ([]block, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	var blocks []block
	lines := strings.Split(string(data), "\n")
	for i := 0; i < len(lines); i++ {
		if strings.TrimSpace(lines[i]) != "```go" {
			continue
		}
		extra := goCheckBefore(lines[:i])
		start := i + 1
		j := start
		for j < len(lines) && strings.TrimSpace(lines[j]) != "```" {
			j++
		}
		if j == len(lines) {
			return nil, fmt.Errorf("%s:%d: unterminated code block", path, i+1)
		}
		blocks = append(blocks, block{file: path, line: start + 1, code: strings.Join(lines[start:j], "\n") + "\n", extra: extra})
		i = j
	}
	return blocks, nil
}

var elided = regexp.MustCompile(`\{ \.\.\. \}`)

// braceBalance counts the braces a block opens and does not close.
func braceBalance(code string) int {
	var s scanner.Scanner
	fset := token.NewFileSet()
	s.Init(fset.AddFile("", -1, len(code)), []byte(code), func(token.Position, string) {}, 0)
	n := 0
	for {
		_, tok, _ := s.Scan()
		switch tok {
		case token.EOF:
			return n
		case token.LBRACE:
			n++
		case token.RBRACE:
			n--
		}
	}
}

func build(path string, bs []block) ([]*unit, error) {
	var units []*unit
	var pkg *unit      // the package of the Markdown file's package-clause blocks, if any
	var cur *srcFile   // its file that blocks are appended to
	var open *srcFile  // a file whose last function is still open
	var pending string // the open function's text so far
	var pendingAt mdLine
	balance := 0
	base := strings.TrimSuffix(filepath.Base(path), filepath.Ext(path))
	for i, b := range bs {
		code := elided.ReplaceAllString(b.code, `{ panic("elided") }`)
		at := mdLine{b.file, b.line}
		indented := strings.HasPrefix(code, "\t") || strings.HasPrefix(code, "    ")
		if open != nil && indented {
			pending += code
			balance += braceBalance(code)
			if balance <= 0 {
				open.add(pending, pendingAt)
				open, pending, balance = nil, "", 0
			}
			continue
		}
		if open != nil {
			// A reader who pastes the blocks in order would put this one inside the function.
			return nil, fmt.Errorf("%s:%d: a block starts before the function opened at line %d is closed: pasted in reading order, it lands inside that function", b.file, b.line, pendingAt.line)
		}
		if hasPackageClause(code) {
			if pkg == nil {
				pkg = &unit{name: path}
				units = append(units, pkg)
			}
			cur = &srcFile{name: fmt.Sprintf("%s_%d.go", base, i)}
			pkg.files = append(pkg.files, cur)
			if b.extra != "" {
				pkg.files = append(pkg.files, autoFile(fmt.Sprintf("%s_%d_extra.go", base, i), packageLine(code), "", b.extra, at)...)
			}
			if n := braceBalance(code); n > 0 {
				open, pending, pendingAt, balance = cur, code, at, n
				continue
			}
			cur.add(code, at)
			continue
		}
		if pkg != nil {
			if n := braceBalance(code); n > 0 {
				// A function the next indented blocks go on with: it lives in the package's
				// file, with that file's imports, as the reader's program does.
				open, pending, pendingAt, balance = cur, code, at, n
				continue
			}
			// Another part of the package, its imports left to the reader.
			pkg.files = append(pkg.files, autoFile(fmt.Sprintf("%s_%d.go", base, i), packageLine(cur.buf.String()), code, b.extra, at)...)
			continue
		}
		u, err := fragment(b, code, fmt.Sprintf("%s_%d", base, i))
		if err != nil {
			return nil, err
		}
		units = append(units, u)
	}
	if open != nil {
		return nil, fmt.Errorf("%s:%d: the function opened here is never closed", pendingAt.file, pendingAt.line)
	}
	return units, nil
}

// hasPackageClause tells whether the block is a whole file: its first line that is neither
// empty nor a comment is a package clause.
func hasPackageClause(code string) bool {
	for _, l := range strings.Split(code, "\n") {
		l = strings.TrimSpace(l)
		if l == "" || strings.HasPrefix(l, "//") {
			continue
		}
		return strings.HasPrefix(l, "package ")
	}
	return false
}

// addDecls appends a block to a file: as it is if it is declarations, else wrapped in a function.
func addDecls(f *srcFile, code string, at mdLine) {
	if _, err := parser.ParseFile(token.NewFileSet(), "", "package p\n"+code, parser.SkipObjectResolution); err == nil {
		f.add(code, at)
		return
	}
	f.add("func _() error {", mdLine{})
	f.add(code, at)
	f.add("\treturn nil\n}", mdLine{})
}

func packageLine(code string) string {
	sc := bufio.NewScanner(strings.NewReader(code))
	for sc.Scan() {
		if l := strings.TrimSpace(sc.Text()); strings.HasPrefix(l, "package ") {
			return l
		}
	}
	return "package snippet"
}

var selector = regexp.MustCompile(`\b([a-z][A-Za-z0-9]*)\.[A-Za-z]`)

// fragment makes the package of a block without a package clause: the block, the prelude (less
// what the block declares itself) and the go-check declarations.
func fragment(b block, code, name string) (*unit, error) {
	u := &unit{name: fmt.Sprintf("%s:%d", b.file, b.line), lenient: b.lenient}
	u.files = autoFile(name+".go", "package snippet", code, b.extra, mdLine{b.file, b.line})
	declared := map[string]bool{}
	for _, f := range u.files {
		for n := range topLevelNames(f.buf.String()) {
			declared[n] = true
		}
	}
	pf := &srcFile{name: name + "_prelude.go"}
	pf.add(dropDecls(prelude, declared), mdLine{})
	u.files = append(u.files, pf)
	return u, nil
}

// autoFile returns the file of a block (if code is not empty) and the file of its go-check
// declarations (if any), each importing the packages it names. Statements are wrapped in a
// function that returns error; declarations stay at the top level.
func autoFile(name, pkgLine, code, extra string, at mdLine) []*srcFile {
	extraImports, extraDecls := splitImports(extra)
	head := func(text string) string {
		imports := map[string]string{}
		for _, m := range selector.FindAllStringSubmatch(text, -1) {
			if path, ok := knownImports[m[1]]; ok {
				imports[m[1]] = path
			}
		}
		for n, p := range extraImports {
			imports[n] = p
		}
		names := make([]string, 0, len(imports))
		for n := range imports {
			names = append(names, n)
		}
		sort.Strings(names)
		var h strings.Builder
		h.WriteString(pkgLine + "\n\nimport (\n")
		for _, n := range names {
			fmt.Fprintf(&h, "\t%s %q\n", n, imports[n])
		}
		h.WriteString(")\n")
		return h.String()
	}
	var files []*srcFile
	if code != "" {
		f := &srcFile{name: name}
		f.add(head(code), mdLine{})
		addDecls(f, code, at)
		files = append(files, f)
	}
	if extraDecls != "" {
		ef := &srcFile{name: strings.TrimSuffix(name, ".go") + "_check.go"}
		ef.add(head(extraDecls)+"\n"+extraDecls, mdLine{})
		files = append(files, ef)
	}
	return files
}

var importLine = regexp.MustCompile(`^\s*import\s+(\w+)\s+("[^"]+")\s*$`)

// splitImports takes `import name "path"` lines out of a go-check comment.
func splitImports(extra string) (map[string]string, string) {
	imports := map[string]string{}
	var rest []string
	for _, l := range strings.Split(extra, "\n") {
		if m := importLine.FindStringSubmatch(l); m != nil {
			imports[m[1]] = strings.Trim(m[2], `"`)
			continue
		}
		rest = append(rest, l)
	}
	return imports, strings.TrimSpace(strings.Join(rest, "\n"))
}

func topLevelNames(src string) map[string]bool {
	names := map[string]bool{}
	f, err := parser.ParseFile(token.NewFileSet(), "", src, parser.SkipObjectResolution)
	if err != nil {
		return names
	}
	for _, d := range f.Decls {
		switch d := d.(type) {
		case *ast.FuncDecl:
			if d.Recv == nil {
				names[d.Name.Name] = true
			}
		case *ast.GenDecl:
			for _, s := range d.Specs {
				switch s := s.(type) {
				case *ast.ValueSpec:
					for _, n := range s.Names {
						names[n.Name] = true
					}
				case *ast.TypeSpec:
					names[s.Name.Name] = true
				}
			}
		}
	}
	return names
}

// dropDecls removes the prelude's variable lines that declare one of names.
func dropDecls(src string, names map[string]bool) string {
	var out []string
	for _, l := range strings.Split(src, "\n") {
		if f := strings.Fields(l); len(f) == 2 && names[f[0]] {
			continue
		}
		out = append(out, l)
	}
	return strings.Join(out, "\n")
}

// check type-checks every unit, with the repository's packages (and their dependencies) read
// from the export data the go command builds in the workspace.
func check(units []*unit) ([]string, error) {
	fset := token.NewFileSet()
	parsed := map[*unit][]*ast.File{}
	where := map[string]*srcFile{}
	var problems []string
	importSet := map[string]bool{}
	for _, u := range units {
		for _, sf := range u.files {
			name := filepath.Join(sanitize(u.name), sf.name)
			where[name] = sf
			f, err := parser.ParseFile(fset, name, sf.buf.Bytes(), parser.ParseComments|parser.SkipObjectResolution)
			if err != nil {
				var list scanner.ErrorList
				if errors.As(err, &list) {
					for _, e := range list {
						problems = append(problems, locate(where, e.Pos, e.Msg))
					}
				} else {
					problems = append(problems, fmt.Sprintf("%s: %v", u.name, err))
				}
				continue
			}
			parsed[u] = append(parsed[u], f)
			for _, imp := range f.Imports {
				importSet[strings.Trim(imp.Path.Value, `"`)] = true
			}
		}
	}
	if len(problems) > 0 {
		return problems, nil
	}
	exports, err := exportData(importSet)
	if err != nil {
		return nil, err
	}
	imp := importer.ForCompiler(fset, "gc", func(path string) (io.ReadCloser, error) {
		file, ok := exports[path]
		if !ok {
			return nil, fmt.Errorf("no export data for %q (is it in the workspace's module graph?)", path)
		}
		return os.Open(file)
	})
	for _, u := range units {
		conf := types.Config{
			Importer: imp,
			Error: func(err error) {
				var te types.Error
				if errors.As(err, &te) {
					if te.Soft && strings.Contains(te.Msg, "not used") {
						return
					}
					if u.lenient && strings.HasPrefix(te.Msg, "undefined: ") && !strings.Contains(te.Msg, ".") {
						return // a helper the package comment leaves to the reader
					}
					problems = append(problems, locate(where, te.Fset.Position(te.Pos), te.Msg))
					return
				}
				problems = append(problems, fmt.Sprintf("%s: %v", u.name, err))
			},
		}
		_, _ = conf.Check("snippet", fset, parsed[u], nil)
	}
	return problems, nil
}

func sanitize(s string) string {
	return strings.NewReplacer("/", "_", ":", "_", ".", "_").Replace(s)
}

// locate names the Markdown line of a position in a generated file.
func locate(where map[string]*srcFile, pos token.Position, msg string) string {
	sf := where[pos.Filename]
	if sf != nil && pos.Line >= 1 && pos.Line <= len(sf.lines) {
		if m := sf.lines[pos.Line-1]; m.line > 0 {
			return fmt.Sprintf("%s:%d: %s", m.file, m.line, msg)
		}
		return fmt.Sprintf("%s (a go-check declaration or generated wrapper, line %d: %q): %s", pos.Filename, pos.Line,
			strings.TrimSpace(strings.Split(sf.buf.String(), "\n")[pos.Line-1]), msg)
	}
	return fmt.Sprintf("%s: %s", pos, msg)
}

// exportData builds the packages with the go command and returns where their export data is.
func exportData(paths map[string]bool) (map[string]string, error) {
	args := []string{"list", "-export", "-deps", "-json=ImportPath,Export,Error"}
	for p := range paths {
		args = append(args, p)
	}
	cmd := exec.Command("go", args...)
	cmd.Stderr = os.Stderr
	out, err := cmd.Output()
	if err != nil {
		return nil, fmt.Errorf("go list -export: %w", err)
	}
	exports := map[string]string{}
	dec := json.NewDecoder(bytes.NewReader(out))
	for {
		var p struct {
			ImportPath, Export string
			Error              *struct{ Err string }
		}
		if err := dec.Decode(&p); err == io.EOF {
			break
		} else if err != nil {
			return nil, fmt.Errorf("go list output: %w", err)
		}
		if p.Error != nil {
			return nil, fmt.Errorf("go list: %s: %s", p.ImportPath, p.Error.Err)
		}
		exports[p.ImportPath] = p.Export
	}
	return exports, nil
}
