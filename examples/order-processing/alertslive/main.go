// Command alertslive runs the example service's chaos mode under a real Prometheus loaded with the
// shipped alert rules (deploy/prometheus/outbox-alerts.yaml), kills the service when the run is
// over, and reports which alerts fired and when: the rules checked against what the exporter
// really serves and how a real Prometheus evaluates them, where the promtool unit tests feed
// series written by hand. `make alerts-live` runs it; it needs the prometheus binary (Debian:
// apt-get install prometheus), and fails when it is missing.
//
// With -fault, the service keeps taking an order a second after its report, the fault is injected
// a minute later and held for -hold before the kill: broker-down (the embedded NATS server shuts
// down), refuse-topic (the broker refuses one topic), db-stall (a side transaction holds the
// outbox_effects_all table (every partition) locked; the run then uses a private PostgreSQL). The kill itself is the
// dead-service fault, at the end of every run. -fast divides every `for:` of a copy of the rules by
// 10, for a quick look; the report says so.
package main

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"time"

	"github.com/watermill-outbox/outbox/internal/pgserver"
)

func main() {
	if err := run(); err != nil {
		fmt.Fprintln(os.Stderr, "alertslive:", err)
		os.Exit(1)
	}
}

func run() error {
	orders := flag.Int("orders", 300, "orders the chaos run places")
	after := flag.Duration("after", 30*time.Second, "how long the service stays up after its report before it is killed")
	watch := flag.Duration("watch", 3*time.Minute, "how long Prometheus keeps evaluating after the kill")
	chaosArgs := flag.String("chaos-args", "", "more flags for the chaos run, space-separated (e.g. \"-fail-rate 0.3\")")
	fault := flag.String("fault", "", "a fault injected a minute after the report: broker-down, refuse-topic or db-stall (empty: only the kill)")
	hold := flag.Duration("hold", 13*time.Minute, "with -fault: how long the fault is held before the kill")
	fast := flag.Bool("fast", false, "evaluate a copy of the rules with every for: divided by 10 (not the shipped rules)")
	flag.Parse()
	const faultAfter = time.Minute
	if *fault != "" {
		*after = faultAfter + *hold
	}

	prom, err := exec.LookPath(envOr("PROMETHEUS", "prometheus"))
	if err != nil {
		return fmt.Errorf("the prometheus binary is needed (apt-get install prometheus, or PROMETHEUS=/path): %w", err)
	}
	rules, err := filepath.Abs("../../deploy/prometheus/outbox-alerts.yaml")
	if err != nil {
		return err
	}
	if _, err := os.Stat(rules); err != nil {
		return fmt.Errorf("run from examples/order-processing (the rules are read from ../../deploy): %w", err)
	}
	dir, err := os.MkdirTemp("", "alertslive-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	rulesNote := "deploy/prometheus/outbox-alerts.yaml"
	if *fast {
		if rules, err = fastRules(rules, dir); err != nil {
			return err
		}
		rulesNote = "FAST: a copy of deploy/prometheus/outbox-alerts.yaml with every for: divided by 10"
	}

	bin := filepath.Join(dir, "order-processing")
	if out, err := exec.Command("go", "build", "-o", bin, ".").CombinedOutput(); err != nil {
		return fmt.Errorf("build the example: %w\n%s", err, out)
	}
	svcAddr, promAddr := freeAddr(), freeAddr()
	cfg := fmt.Sprintf(`global:
  scrape_interval: 1s
  scrape_timeout: 1s
  evaluation_interval: 1s
rule_files: [%q]
scrape_configs:
  - job_name: order-processing
    static_configs:
      - targets: [%q]
`, rules, svcAddr)
	cfgFile := filepath.Join(dir, "prometheus.yml")
	if err := os.WriteFile(cfgFile, []byte(cfg), 0o600); err != nil {
		return err
	}

	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	promLog, err := os.Create(filepath.Join(dir, "prometheus.log"))
	if err != nil {
		return err
	}
	defer promLog.Close()
	pcmd := exec.CommandContext(ctx, prom, "--config.file="+cfgFile, "--storage.tsdb.path="+filepath.Join(dir, "tsdb"),
		"--web.listen-address="+promAddr)
	pcmd.Stdout, pcmd.Stderr = promLog, promLog
	pcmd.Cancel = func() error { return pcmd.Process.Signal(os.Interrupt) }
	pcmd.WaitDelay = 10 * time.Second
	if err := pcmd.Start(); err != nil {
		return fmt.Errorf("start prometheus: %w", err)
	}
	defer func() { cancel(); _ = pcmd.Wait() }()
	if err := waitReady(ctx, "http://"+promAddr+"/-/ready", time.Minute); err != nil {
		return fmt.Errorf("prometheus: %w (its log: %s)", err, promLog.Name())
	}
	fmt.Printf("prometheus %s, rules %s, scraping the service at %s\n", promAddr, rules, svcAddr)

	args := []string{"-chaos", "-orders", strconv.Itoa(*orders), "-chaos-addr", svcAddr, "-linger", "-1s", "-data", filepath.Join(dir, "data")}
	if *fault != "" {
		// Nothing else fails, so that what fires is the fault's.
		args = append(args, "-fault", *fault, "-fault-after", faultAfter.String(),
			"-fail-rate", "0", "-crash-rate", "0", "-dup-rate", "0", "-restart-every", "0", "-malformed", "0")
	}
	if *fault == "db-stall" {
		pg, err := pgserver.Start(pgserver.Options{})
		if err != nil {
			return fmt.Errorf("start PostgreSQL for the database stall: %w", err)
		}
		defer func() { _ = pg.Stop() }()
		args = append(args, "-postgres", pg.DSN("postgres"))
		fmt.Printf("PostgreSQL %s on port %d\n", pg.Version(), pg.Port())
	}
	args = append(args, strings.Fields(*chaosArgs)...)
	start := time.Now()
	svc := exec.Command(bin, args...)
	stdout, err := svc.StdoutPipe()
	if err != nil {
		return err
	}
	svc.Stderr = os.Stderr
	if err := svc.Start(); err != nil {
		return fmt.Errorf("start the service: %w", err)
	}
	events := []event{{0, "service started: chaos run of " + strconv.Itoa(*orders) + " orders"}}
	reported := make(chan struct{})
	injected := make(chan time.Duration, 1)
	go func() {
		sc := bufio.NewScanner(stdout)
		closed := false
		for sc.Scan() {
			fmt.Println("  | " + sc.Text())
			if strings.HasPrefix(sc.Text(), "fault injected") {
				injected <- time.Since(start)
			}
			if !closed && strings.Contains(sc.Text(), "still serving") {
				close(reported)
				closed = true
			}
		}
		if !closed {
			close(reported)
		}
	}()
	select {
	case <-reported:
	case <-time.After(15 * time.Minute):
		_ = svc.Process.Kill()
		_ = svc.Wait()
		return errors.New("the chaos run did not report within 15 minutes")
	}
	events = append(events, event{time.Since(start), "chaos run reported; the service keeps serving /metrics"})
	time.Sleep(*after)
	if err := svc.Process.Kill(); err != nil {
		return fmt.Errorf("kill the service: %w", err)
	}
	_ = svc.Wait()
	killed := time.Since(start)
	events = append(events, event{killed, "service killed (SIGKILL)"})
	faultAt := time.Duration(-1)
	select {
	case faultAt = <-injected:
		events = append(events, event{faultAt, "fault injected: " + *fault})
	default:
		if *fault != "" {
			events = append(events, event{killed, "fault " + *fault + " was NOT injected (see the service's output)"})
		}
	}
	fmt.Printf("service killed at +%s; Prometheus keeps evaluating for %s\n", killed.Round(time.Second), *watch)
	time.Sleep(*watch)
	end := time.Now()

	fired, err := firing(ctx, promAddr, start, end)
	if err != nil {
		return err
	}
	fmt.Printf("\nalerts-live: %d orders, fault %q, service killed at +%s, watched until +%s (rules: %s)\n\n",
		*orders, *fault, killed.Round(time.Second), end.Sub(start).Round(time.Second), rulesNote)
	since := func(at time.Duration) string {
		s := "+" + at.Round(time.Second).String()
		if faultAt >= 0 && at >= faultAt {
			s += fmt.Sprintf(" (fault +%s)", (at - faultAt).Round(time.Second))
		}
		if at >= killed {
			s += fmt.Sprintf(" (kill +%s)", (at - killed).Round(time.Second))
		}
		return s
	}
	for _, f := range fired {
		until := "firing at the end"
		if end.Sub(f.to) > 5*time.Second {
			until = "resolved at " + since(f.to.Sub(start)+time.Second)
		}
		events = append(events, event{f.from.Sub(start), fmt.Sprintf("`%s` firing%s (%s)", f.name, f.labels, until)})
	}
	sort.SliceStable(events, func(i, j int) bool { return events[i].at < events[j].at })
	fmt.Println("| at | event |")
	fmt.Println("| --- | --- |")
	for _, e := range events {
		fmt.Printf("| %s | %s |\n", since(e.at), e.what)
	}
	if len(fired) == 0 {
		fmt.Println("\nno alert fired")
	}
	return nil
}

type event struct {
	at   time.Duration
	what string
}

type alert struct {
	name, labels string
	from, to     time.Time
}

// firing asks Prometheus for the alerts that fired between start and end (the ALERTS series).
func firing(ctx context.Context, promAddr string, start, end time.Time) ([]alert, error) {
	q := url.Values{
		"query": {`ALERTS{alertstate="firing"}`},
		"start": {strconv.FormatInt(start.Unix(), 10)},
		"end":   {strconv.FormatInt(end.Unix(), 10)},
		"step":  {"1"},
	}
	rctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(rctx, http.MethodGet, "http://"+promAddr+"/api/v1/query_range?"+q.Encode(), nil)
	if err != nil {
		return nil, err
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return nil, fmt.Errorf("query the alerts: %w", err)
	}
	defer resp.Body.Close()
	var body struct {
		Status string
		Error  string
		Data   struct {
			Result []struct {
				Metric map[string]string
				Values [][2]any
			}
		}
	}
	if err := json.NewDecoder(resp.Body).Decode(&body); err != nil {
		return nil, fmt.Errorf("query the alerts: %w", err)
	}
	if body.Status != "success" {
		return nil, fmt.Errorf("query the alerts: %s", body.Error)
	}
	var out []alert
	for _, r := range body.Data.Result {
		if len(r.Values) == 0 {
			continue
		}
		var ls []string
		for k, v := range r.Metric {
			if k != "__name__" && k != "alertname" && k != "alertstate" {
				ls = append(ls, k+"="+v)
			}
		}
		sort.Strings(ls)
		first, _ := r.Values[0][0].(float64)
		last, _ := r.Values[len(r.Values)-1][0].(float64)
		out = append(out, alert{name: r.Metric["alertname"], labels: " {" + strings.Join(ls, ", ") + "}",
			from: time.Unix(int64(first), 0), to: time.Unix(int64(last), 0)})
	}
	sort.Slice(out, func(i, j int) bool { return out[i].from.Before(out[j].from) })
	return out, nil
}

// fastRules writes a copy of the rules with every `for:` divided by 10 and returns its path.
func fastRules(rules, dir string) (string, error) {
	b, err := os.ReadFile(rules)
	if err != nil {
		return "", err
	}
	re := regexp.MustCompile(`(?m)^(\s+for: )(\d+)m$`)
	out := re.ReplaceAllStringFunc(string(b), func(m string) string {
		g := re.FindStringSubmatch(m)
		n, _ := strconv.Atoi(g[2])
		return fmt.Sprintf("%s%ds", g[1], n*6)
	})
	p := filepath.Join(dir, "outbox-alerts-fast.yaml")
	return p, os.WriteFile(p, []byte(out), 0o600)
}

func waitReady(ctx context.Context, u string, timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	for {
		req, err := http.NewRequestWithContext(ctx, http.MethodGet, u, nil)
		if err != nil {
			return err
		}
		resp, err := http.DefaultClient.Do(req)
		if err == nil {
			_, _ = io.Copy(io.Discard, resp.Body)
			_ = resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return nil
			}
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("not ready at %s within %s (last error: %v)", u, timeout, err)
		}
		time.Sleep(200 * time.Millisecond)
	}
}

// freeAddr returns a loopback address with a port that was free a moment ago.
func freeAddr() string {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		panic(err)
	}
	defer ln.Close()
	return ln.Addr().String()
}

func envOr(key, def string) string {
	if v := os.Getenv(key); v != "" {
		return v
	}
	return def
}
