package main

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// The check fails a block that misuses the API, at the Markdown line of the mistake, and passes
// the same block written right; a go-check comment declares what the block leaves out.
func TestCheckFindsDrift(t *testing.T) {
	dir := t.TempDir()
	md := filepath.Join(dir, "doc.md")
	doc := "# Doc\n\n<!-- go-check note\nfunc sku(*message.Message) string { return \"\" }\n-->\n```go\n" +
		"h := router.AddConsumerHandler(\"reserve\", \"orders\", subscriber, func(msg *message.Message) error {\n" +
		"\t_ = sku(msg)\n\treturn outbox.Publish(msg.Context(), \"reserved\", message.NewMessage(\"\", nil))\n})\n" +
		"h.AddMiddleware(middleware.New(ob, \"inventory\"))\n```\n"
	run := func(doc string) []string {
		t.Helper()
		if err := os.WriteFile(md, []byte(doc), 0o644); err != nil {
			t.Fatal(err)
		}
		blocks, err := readBlocks(md)
		if err != nil {
			t.Fatal(err)
		}
		units, err := build(md, blocks)
		if err != nil {
			t.Fatal(err)
		}
		problems, err := check(units)
		if err != nil {
			t.Fatal(err)
		}
		return problems
	}
	problems := run(doc)
	if len(problems) != 1 || !strings.Contains(problems[0], "doc.md:11:") || !strings.Contains(problems[0], "middleware.Option") {
		t.Errorf("middleware.New(ob, \"inventory\"): %q, want one problem at doc.md:11 about middleware.Option", problems)
	}
	if problems := run(strings.Replace(doc, `middleware.New(ob, "inventory")`, `middleware.New(ob, middleware.WithConsumer("inventory"))`, 1)); len(problems) != 0 {
		t.Errorf("the block written right: %q", problems)
	}
	if problems := run(strings.Replace(doc, "<!-- go-check note\nfunc sku(*message.Message) string { return \"\" }\n-->\n", "", 1)); len(problems) == 0 ||
		!strings.Contains(problems[0], "undefined: sku") {
		t.Errorf("without the go-check declaration: %q, want undefined: sku", problems)
	}
}

// A program shown in parts must build when its blocks are pasted in reading order: a block
// between two parts of a function would land inside it, and is refused at its line.
func TestProgramPastedInReadingOrder(t *testing.T) {
	md := filepath.Join(t.TempDir(), "tutorial.md")
	head := "```go\npackage main\n\nimport \"fmt\"\n\nfunc main() {\n\tfmt.Println(greeting())\n```\n\n"
	helper := "```go\nfunc greeting() string { return \"hello\" }\n```\n\n"
	tail := "```go\n\tfmt.Println(\"bye\")\n}\n```\n"
	build := func(doc string) error {
		t.Helper()
		if err := os.WriteFile(md, []byte(doc), 0o644); err != nil {
			t.Fatal(err)
		}
		blocks, err := readBlocks(md)
		if err != nil {
			t.Fatal(err)
		}
		units, err := build(md, blocks)
		if err != nil {
			return err
		}
		problems, err := check(units)
		if err != nil {
			t.Fatal(err)
		}
		if len(problems) > 0 {
			t.Fatalf("type-check: %q", problems)
		}
		return nil
	}
	if err := build(head + helper + tail); err == nil || !strings.Contains(err.Error(), "tutorial.md:11:") {
		t.Errorf("a helper between the parts of main: %v, want it refused at tutorial.md:11", err)
	}
	if err := build(head + tail + helper); err != nil {
		t.Errorf("the parts of main, then the helper: %v", err)
	}
}
