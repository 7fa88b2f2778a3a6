package main

import (
	"fmt"
	"io"
	"strings"
)

// ratioRow is one framework contender against its bare form at one concurrency, in one run.
type ratioRow struct {
	Framework, Bare   string
	Conc              int
	Ratio             float64 // throughput, framework over bare
	FrameworkMsgS     float64
	BareMsgS          float64
	FrameworkWAL      float64 // WAL bytes per message
	BareWAL           float64
	FrameworkP50      float64 // ms
	BareP50           float64
	FrameworkSyncRT   float64 // waited-for round trips per message
	BareSyncRT        float64
	FrameworkStmtsMsg float64
	BareStmtsMsg      float64
	// CPU time per message, server (-1: not measured) and client, and Go allocations per message.
	FrameworkServerCPU, BareServerCPU float64
	FrameworkClientCPU, BareClientCPU float64
	FrameworkAllocs, BareAllocs       float64
}

// ratioPairs are the framework contenders and the bare form each is measured against: the same
// driver, the same route to the server.
var ratioPairs = [][2]string{
	{"outbox-pgx", "bare-pgx"},
	{"protocol-pgx", "bare-pgx"},
	{"outbox-pgx", "protocol-pgx"},
	{"outbox-pgx-pessimistic", "bare-pgx"},
	{"outbox-middleware", "bare"},
	{"protocol-sql", "bare"},
	{"outbox-middleware", "protocol-sql"},
	{"outbox-pgx" + pooledSuffix, "bare-pgx" + pooledSuffix},
	{"outbox-middleware" + pooledSuffix, "bare" + pooledSuffix},
}

// ratios are the framework/bare rows of r, pair by pair, for the pairs whose both sides ran.
func ratios(r *report) []ratioRow {
	var out []ratioRow
	for _, p := range ratioPairs {
		for _, conc := range r.Config.Concs {
			f, ok1 := r.cell(p[0], conc)
			b, ok2 := r.cell(p[1], conc)
			if !ok1 || !ok2 || b.Throughput == 0 {
				continue
			}
			out = append(out, ratioRow{Framework: p[0], Bare: p[1], Conc: conc, Ratio: f.Throughput / b.Throughput,
				FrameworkMsgS: f.Throughput, BareMsgS: b.Throughput, FrameworkWAL: f.WALBytes, BareWAL: b.WALBytes,
				FrameworkP50: f.P50, BareP50: b.P50, FrameworkSyncRT: f.SyncRoundTrips, BareSyncRT: b.SyncRoundTrips,
				FrameworkStmtsMsg: f.Statements, BareStmtsMsg: b.Statements,
				FrameworkServerCPU: f.ServerCPUus, BareServerCPU: b.ServerCPUus, FrameworkClientCPU: f.ClientCPUus, BareClientCPU: b.ClientCPUus,
				FrameworkAllocs: f.Allocs, BareAllocs: b.Allocs})
		}
	}
	return out
}

func or(s, def string) string {
	if s == "" {
		return def
	}
	return s
}

// ratiosMarkdown is the "Framework over bare" section of a run's report.
func ratiosMarkdown(r *report) string {
	rows := r.Ratios
	if len(rows) == 0 {
		rows = ratios(r)
	}
	if len(rows) == 0 {
		return ""
	}
	var b strings.Builder
	w := func(format string, args ...any) { fmt.Fprintf(&b, format, args...) }
	w("\n### Framework over bare\n\n")
	w("Broker `%s`, workload `%s`; load average %s at the start, %s at the end. Throughput of each framework contender over its bare "+
		"form's in this run (contenders interleaved, so that both saw the same load), with the WAL each wrote per message "+
		"(`pg_current_wal_lsn()` before and after each run, the whole server's: background work such as autovacuum counts too).\n\n",
		or(r.Config.Broker, "nats"), or(r.Config.Workload, workloadInsert), r.Machine.LoadAtStart, or(r.Machine.LoadAtEnd, "?"))
	w("| framework / bare | consumers | throughput ratio | msg/s | p50 ms | WAL bytes/msg | waited-for round trips/msg | statements/msg | server CPU µs/msg | client CPU µs/msg | allocations/msg |\n")
	w("|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|\n")
	for _, x := range rows {
		w("| %s / %s | %d | **%.2f** | %s / %s | %s / %s | %s / %s | %s / %s | %s / %s | %s / %s | %s / %s | %s / %s |\n", x.Framework, x.Bare, x.Conc, x.Ratio,
			f0(x.FrameworkMsgS), f0(x.BareMsgS), f2(x.FrameworkP50), f2(x.BareP50), f0(x.FrameworkWAL), f0(x.BareWAL),
			f2(x.FrameworkSyncRT), f2(x.BareSyncRT), f2(x.FrameworkStmtsMsg), f2(x.BareStmtsMsg),
			cpuCell(x.FrameworkServerCPU), cpuCell(x.BareServerCPU), cpuCell(x.FrameworkClientCPU), cpuCell(x.BareClientCPU),
			cpuCell(x.FrameworkAllocs), cpuCell(x.BareAllocs))
	}
	w("\nCPU time per message: the server's is every PostgreSQL process's (`/proc`, in 10 ms ticks: backends, WAL writer, " +
		"checkpointer, autovacuum), the client's the benchmark process's own (`getrusage`: the contender's, the harness's and the " +
		"broker's); allocations are the Go heap allocations of that process per message (`runtime.MemStats.Mallocs`). On two CPUs " +
		"shared by both, throughput at 16 consumers follows their sum.\n")
	if r.Config.Broker == "none" {
		w("\nWithout a broker: each contender's handler is a handler of its own Watermill Router (`message.NewRouter`), fed by an " +
			"in-process subscriber that hands out the pre-generated deliveries (one in flight per consumer, the next after the ack), " +
			"and publishes to a null publisher that counts and returns at once. The bare forms and the framework take the same path, " +
			"so the ratio is the framework's own cost against the database.\n")
	}
	if r.Config.Workload == workloadTwoStatement {
		b.WriteString("\nTwo-statement workload: `" + stockUpdate + "` on one of " + fmt.Sprint(stockRows) + " stock rows (chosen by the message ID) and `" +
			reservationInsert + "` (primary key: the message ID) in one transaction. A bare form that meets a redelivered copy's " +
			"duplicate key rolls back and drops the copy.\n")
	}
	return b.String()
}

// printRatios writes a compact table of the run's framework/bare ratios and WAL per message.
func printRatios(out io.Writer, r *report) {
	rows := r.Ratios
	if len(rows) == 0 {
		rows = ratios(r)
	}
	fmt.Fprintf(out, "\nbroker %s, workload %s, load %s -> %s\n", or(r.Config.Broker, "nats"), or(r.Config.Workload, workloadInsert),
		r.Machine.LoadAtStart, r.Machine.LoadAtEnd)
	if len(rows) > 0 {
		fmt.Fprintf(out, "%-48s", "throughput ratio, framework / bare")
		for _, c := range r.Config.Concs {
			fmt.Fprintf(out, " %8s", fmt.Sprintf("c=%d", c))
		}
		fmt.Fprintln(out)
		for _, p := range ratioPairs {
			var line strings.Builder
			found := false
			for _, c := range r.Config.Concs {
				v := "-"
				for _, x := range rows {
					if x.Framework == p[0] && x.Bare == p[1] && x.Conc == c {
						v, found = f2(x.Ratio), true
					}
				}
				fmt.Fprintf(&line, " %8s", v)
			}
			if found {
				fmt.Fprintf(out, "%-48s%s\n", p[0]+" / "+p[1], line.String())
			}
		}
	}
	if len(r.Cells) == 0 {
		return
	}
	printCells(out, r, "msg/s | WAL bytes/msg", 16, func(c cell) string { return fmt.Sprintf("%.0f | %.0f", c.Throughput, c.WALBytes) })
	printCells(out, r, "CPU us/msg server + client | allocs/msg", 18, func(c cell) string {
		return fmt.Sprintf("%s+%s | %.0f", cpuCell(c.ServerCPUus), cpuCell(c.ClientCPUus), c.Allocs)
	})
}

// cpuCell formats a per-message figure that may be unmeasured: negative, or zero in the results
// of a version that did not measure it.
func cpuCell(v float64) string {
	if v <= 0 {
		return "?"
	}
	return f0(v)
}

// printCells writes one line per contender of r with v of each of its cells.
func printCells(out io.Writer, r *report, title string, width int, v func(cell) string) {
	fmt.Fprintf(out, "%-48s", title)
	for _, c := range r.Config.Concs {
		fmt.Fprintf(out, " %*s", width, fmt.Sprintf("c=%d", c))
	}
	fmt.Fprintln(out)
	var names []string
	for _, c := range r.Cells {
		if !contains(names, c.Contender) {
			names = append(names, c.Contender)
		}
	}
	for _, n := range names {
		fmt.Fprintf(out, "%-48s", n)
		for _, conc := range r.Config.Concs {
			s := "-"
			if c, ok := r.cell(n, conc); ok {
				s = v(c)
			}
			fmt.Fprintf(out, " %*s", width, s)
		}
		fmt.Fprintln(out)
	}
}
