package main

import (
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
)

var (
	// On PostgreSQL outbox_effects is partition 0 of the effects table (migration 023); the
	// effects are read through outbox_effects_all.
	partition0 = regexp.MustCompile(`(?i)\boutbox_effects\b`)
	// An inline code span that is a statement, not a table named in prose.
	statementSpan = regexp.MustCompile("`((?i:SELECT|UPDATE|DELETE|INSERT|WITH|VACUUM|ANALYZE|LOCK|TRUNCATE|ALTER)\\b[^`]*)`")
)

// partition0Statements returns the lines of the Markdown doc whose SQL names partition 0 of
// PostgreSQL's effects table: a line of a code block, or an inline statement. A GRANT is left
// alone (the grants name every partition on purpose), as is a statement marked /* partition 0 */
// or one the paragraph before its block says is MySQL's or SQLite's (their effects table is
// plain).
func partition0Statements(name, doc string) []string {
	var out []string
	lines := strings.Split(doc, "\n")
	inBlock, plain := false, false
	for i, line := range lines {
		trimmed := strings.TrimSpace(line)
		if strings.HasPrefix(trimmed, "```") {
			if !inBlock {
				info := strings.ToLower(strings.TrimPrefix(trimmed, "```"))
				plain = strings.Contains(info, "mysql") || strings.Contains(info, "sqlite") || plainBefore(lines, i)
			}
			inBlock = !inBlock
			continue
		}
		if inBlock {
			if !plain && partition0.MatchString(line) && !strings.Contains(line, "/* partition 0 */") &&
				!strings.HasPrefix(strings.ToUpper(trimmed), "GRANT ") {
				out = append(out, name+":"+strconv.Itoa(i+1)+": "+trimmed)
			}
		}
	}
	// Inline statements may run over a line break; find them in the prose, blocks left out.
	var prose strings.Builder
	inBlock = false
	for _, line := range lines {
		if strings.HasPrefix(strings.TrimSpace(line), "```") {
			inBlock = !inBlock
			prose.WriteString("\n")
			continue
		}
		if !inBlock {
			prose.WriteString(line)
		}
		prose.WriteString("\n")
	}
	text := prose.String()
	for _, m := range statementSpan.FindAllStringSubmatchIndex(text, -1) {
		stmt := text[m[2]:m[3]]
		if partition0.MatchString(stmt) && !strings.Contains(stmt, "/* partition 0 */") {
			line := strings.Count(text[:m[0]], "\n") + 1
			out = append(out, name+":"+strconv.Itoa(line)+": "+strings.Join(strings.Fields(stmt), " "))
		}
	}
	return out
}

// plainBefore tells whether the paragraph before the code block opening at line i is about
// MySQL or SQLite only.
func plainBefore(lines []string, i int) bool {
	var para []string
	j := i - 1
	for j >= 0 && strings.TrimSpace(lines[j]) == "" {
		j--
	}
	for ; j >= 0 && strings.TrimSpace(lines[j]) != ""; j-- {
		para = append(para, lines[j])
	}
	p := strings.Join(para, " ")
	return (strings.Contains(p, "MySQL") || strings.Contains(p, "SQLite")) && !strings.Contains(p, "PostgreSQL")
}

// The SQL of README and docs/ reads the effects through PostgreSQL's partitioned parent: a query
// of outbox_effects copied by an operator would see partition 0 alone, and report nothing
// pending while effects wait in partitions 1 and 2.
func TestDocsQueryTheEffectsParent(t *testing.T) {
	root := filepath.Join("..", "..", "..")
	docs, err := filepath.Glob(filepath.Join(root, "docs", "*.md"))
	if err != nil {
		t.Fatal(err)
	}
	examples, err := filepath.Glob(filepath.Join(root, "examples", "*", "README.md"))
	if err != nil {
		t.Fatal(err)
	}
	files := append(append([]string{filepath.Join(root, "README.md")}, docs...), examples...)
	if len(docs) < 5 {
		t.Fatalf("found %d docs under %s", len(docs), root)
	}
	for _, f := range files {
		b, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		rel, _ := filepath.Rel(root, f)
		for _, p := range partition0Statements(filepath.ToSlash(rel), string(b)) {
			t.Errorf("%s: names outbox_effects, partition 0 of PostgreSQL's effects table; query outbox_effects_all", p)
		}
	}
}

// The check finds a statement on partition 0 in a block and inline, across a line break, and
// leaves the parent, the grants, MySQL's blocks and a table named in prose alone.
func TestDocsCheckFindsPartition0(t *testing.T) {
	doc := "# Ops\n\nThe backlog:\n\n```sql\nSELECT count(*) FROM outbox_effects WHERE dispatched_at IS NULL;\n" +
		"SELECT count(*) FROM outbox_effects_all WHERE dispatched_at IS NULL;\n" +
		"GRANT SELECT ON TABLE \"public\".\"outbox_effects\" TO \"app\";\n```\n\n" +
		"Then `VACUUM outbox_processed,\noutbox_effects` and `VACUUM outbox_effects_all`; the table `outbox_effects`.\n\n" +
		"On MySQL:\n\n```sql\nSELECT count(*) FROM outbox_effects;\n```\n"
	got := partition0Statements("doc.md", doc)
	want := []string{
		"doc.md:6: SELECT count(*) FROM outbox_effects WHERE dispatched_at IS NULL;",
		"doc.md:11: VACUUM outbox_processed, outbox_effects",
	}
	if strings.Join(got, "\n") != strings.Join(want, "\n") {
		t.Errorf("found\n%s\nwant\n%s", strings.Join(got, "\n"), strings.Join(want, "\n"))
	}
}
