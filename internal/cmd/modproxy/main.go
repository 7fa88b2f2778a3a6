// Command modproxy writes a file-system Go module proxy (for GOPROXY=file://DIR) that serves
// the given module directories at one version, laid out as the module proxy protocol says
// (@v/list, .info, .mod, .zip) and zipped as the go command zips a module: every file of the
// module's directory except the .git directory, vendor directories and nested modules (any
// directory with its own go.mod), under the prefix module@version/.
//
// It lets the repository test what a user's build does with a release before the release
// exists: a throwaway module with no replace directive resolves the library from this proxy.
//
//	go run ./internal/cmd/modproxy -out /tmp/proxy -version v0.1.0 . drivers/outboxpgx
package main

import (
	"archive/zip"
	"bytes"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strings"
	"time"
)

func main() {
	out := flag.String("out", "", "directory to write the proxy into (created)")
	version := flag.String("version", "", "version to serve every module at, such as v0.1.0")
	flag.Usage = func() {
		fmt.Fprintf(os.Stderr, "usage: modproxy -out DIR -version vX.Y.Z MODULE_DIR...\n")
		flag.PrintDefaults()
	}
	flag.Parse()
	if *out == "" || !strings.HasPrefix(*version, "v") || flag.NArg() == 0 {
		flag.Usage()
		os.Exit(2)
	}
	for _, dir := range flag.Args() {
		path, err := writeModule(*out, dir, *version)
		if err != nil {
			fmt.Fprintf(os.Stderr, "modproxy: %s: %v\n", dir, err)
			os.Exit(1)
		}
		fmt.Printf("modproxy: %s@%s from %s\n", path, *version, dir)
	}
}

func writeModule(out, dir, version string) (string, error) {
	gomod, err := os.ReadFile(filepath.Join(dir, "go.mod"))
	if err != nil {
		return "", fmt.Errorf("read go.mod: %w", err)
	}
	path := modulePath(gomod)
	if path == "" {
		return "", errors.New("go.mod has no module line")
	}
	files, err := moduleFiles(dir)
	if err != nil {
		return "", err
	}
	escaped, err := escapePath(path)
	if err != nil {
		return "", err
	}
	vdir := filepath.Join(out, filepath.FromSlash(escaped), "@v")
	if err := os.MkdirAll(vdir, 0o755); err != nil {
		return "", fmt.Errorf("create %s: %w", vdir, err)
	}
	var zbuf bytes.Buffer
	zw := zip.NewWriter(&zbuf)
	prefix := path + "@" + version + "/"
	for _, rel := range files {
		data, err := os.ReadFile(filepath.Join(dir, filepath.FromSlash(rel)))
		if err != nil {
			return "", fmt.Errorf("read %s: %w", rel, err)
		}
		w, err := zw.Create(prefix + rel)
		if err != nil {
			return "", fmt.Errorf("zip %s: %w", rel, err)
		}
		if _, err := w.Write(data); err != nil {
			return "", fmt.Errorf("zip %s: %w", rel, err)
		}
	}
	if err := zw.Close(); err != nil {
		return "", fmt.Errorf("zip: %w", err)
	}
	info, err := json.Marshal(struct {
		Version string
		Time    time.Time
	}{version, time.Now().UTC().Truncate(time.Second)})
	if err != nil {
		return "", fmt.Errorf("info: %w", err)
	}
	for name, data := range map[string][]byte{
		version + ".info": info,
		version + ".mod":  gomod,
		version + ".zip":  zbuf.Bytes(),
		"list":            []byte(version + "\n"),
	} {
		if err := os.WriteFile(filepath.Join(vdir, name), data, 0o644); err != nil {
			return "", fmt.Errorf("write %s: %w", name, err)
		}
	}
	return path, nil
}

func modulePath(gomod []byte) string {
	for _, line := range strings.Split(string(gomod), "\n") {
		if f := strings.Fields(line); len(f) == 2 && f[0] == "module" {
			return strings.Trim(f[1], `"`)
		}
	}
	return ""
}

// moduleFiles lists the files of the module rooted at dir, slash-separated and relative to
// it. In a git work tree it takes what git would commit (tracked and untracked files, not the
// ignored ones), so that build outputs lying around stay out, as they stay out of a tag.
func moduleFiles(dir string) ([]string, error) {
	var candidates []string
	cmd := exec.Command("git", "ls-files", "-z", "--cached", "--others", "--exclude-standard", ".")
	cmd.Dir = dir
	if listed, err := cmd.Output(); err == nil {
		for _, f := range strings.Split(string(listed), "\x00") {
			if f != "" {
				candidates = append(candidates, f)
			}
		}
	} else {
		err := filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
			if err != nil {
				return err
			}
			if d.IsDir() && d.Name() == ".git" {
				return filepath.SkipDir
			}
			if !d.IsDir() {
				rel, err := filepath.Rel(dir, p)
				if err != nil {
					return err
				}
				candidates = append(candidates, filepath.ToSlash(rel))
			}
			return nil
		})
		if err != nil {
			return nil, fmt.Errorf("list files: %w", err)
		}
	}
	nested := map[string]bool{}
	isNested := func(rel string) bool {
		// A directory below the root with its own go.mod is another module: its files are not
		// this module's, whatever lies deeper.
		for d := pathDir(rel); d != "."; d = pathDir(d) {
			known, seen := nested[d]
			if !seen {
				_, err := os.Stat(filepath.Join(dir, filepath.FromSlash(d), "go.mod"))
				known = err == nil
				nested[d] = known
			}
			if known {
				return true
			}
		}
		return false
	}
	var files []string
	for _, rel := range candidates {
		if strings.HasPrefix(rel, "vendor/") || strings.Contains(rel, "/vendor/") || isNested(rel) {
			continue
		}
		st, err := os.Lstat(filepath.Join(dir, filepath.FromSlash(rel)))
		if err != nil || !st.Mode().IsRegular() {
			continue // deleted in the work tree, or a symlink, which a module zip cannot hold
		}
		files = append(files, rel)
	}
	sort.Strings(files)
	return files, nil
}

func pathDir(p string) string {
	i := strings.LastIndex(p, "/")
	if i < 0 {
		return "."
	}
	return p[:i]
}

// escapePath applies the module proxy's case encoding: an upper-case letter becomes '!' and
// its lower-case form.
func escapePath(path string) (string, error) {
	var b strings.Builder
	for _, r := range path {
		switch {
		case r == '!':
			return "", fmt.Errorf("module path %q has '!'", path)
		case 'A' <= r && r <= 'Z':
			b.WriteByte('!')
			b.WriteRune(r + ('a' - 'A'))
		default:
			b.WriteRune(r)
		}
	}
	return b.String(), nil
}
