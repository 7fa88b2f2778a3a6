// Package outboxcli is the command `outbox`, which inspects and repairs the outbox tables next to
// a running service, for one kind of database (a Database): cmd/outbox builds it for PostgreSQL,
// drivers/mysql/cmd/outbox-mysql for MySQL and MariaDB (whose database/sql driver the library
// module does not depend on).
//
//	outbox [global flags] status
//	outbox [global flags] parked list|groups|retry|discard [-id N]... [-topic T] [-consumer C] [-older-than D] [-error TEXT] [-all] [-limit N] [-dry-run] [-batch N] [-effect-retention D]
//	outbox [global flags] failing list [-consumer C]
//	outbox [global flags] replay [-dry-run] CONSUMER MESSAGE_ID
//	outbox [global flags] lookup CONSUMER MESSAGE_ID
//	outbox [global flags] migrate up|status|sql [-grant ROLE] [-operator ROLE]
//	outbox [global flags] migrate grants [-operator] ROLE
//	outbox [global flags] cleanup [-retention D] [-effect-retention D] [-force] [-dry-run] [-batch N]
//
// Global flags: -dsn (default $OUTBOX_DSN, then $DATABASE_URL; in the Database's format),
// -schema, -prefix, -o text|json, -actor (default $USER), -timeout. Every change (retry, discard,
// replay, cleanup) is written to the audit table with the actor; status shows the latest. Text
// output escapes the control characters of what it prints from the tables; the password of the
// DSN is never printed.
package outboxcli

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"net/url"
	"os/user"
	"slices"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"
	"unicode"
	"unicode/utf8"

	"github.com/watermill-outbox/outbox/drivers/postgres"
	"github.com/watermill-outbox/outbox/ops"
	"github.com/watermill-outbox/outbox/outboxdriver"
	"github.com/watermill-outbox/outbox/store"
)

// Database is what the command needs of one kind of database.
type Database struct {
	// Title names the database in messages ("PostgreSQL").
	Title string
	// DSNFormat describes the connection strings -dsn takes, for the usage.
	DSNFormat string
	// DefaultSchema says what an empty -schema means, for the usage.
	DefaultSchema string
	// Open checks dsn and opens the database (no I/O); its error must not repeat the password.
	Open func(dsn string) (*sql.DB, error)
	// Driver is the outbox driver of the tables.
	Driver outboxdriver.Driver
	// RedactDSN takes the password of dsn out of text.
	RedactDSN func(text, dsn string) string
	// IsUndefinedTable tells whether err means a missing table.
	IsUndefinedTable func(error) bool
	// Migrations are the migrations of the tables, in order.
	Migrations func(schema, prefix string) ([]store.Migration, error)
	// MigrationScript is every migration as one script.
	MigrationScript func(schema, prefix string) (string, error)
	// MigrationsTable is the quoted name of the table of the applied migrations.
	MigrationsTable func(schema, prefix string) (string, error)
	// Grants returns the grants of role (an operator's with operator); nil when the command
	// cannot print them for this database.
	Grants func(schema, prefix, role string, operator bool) ([]string, error)
}

// PostgreSQL is the Database of cmd/outbox (lib/pq, which the program registers).
func PostgreSQL() Database {
	return Database{
		Title:         "PostgreSQL",
		DSNFormat:     "lib/pq format",
		DefaultSchema: postgres.DefaultSchema,
		Open: func(dsn string) (*sql.DB, error) {
			if strings.Contains(dsn, "://") {
				// url.Parse's error quotes the URL, and a part of a malformed escape is part of
				// the password: none of it is repeated.
				if _, err := url.Parse(dsn); err != nil {
					return nil, errors.New("the DSN is not a valid URL: percent-encode the special characters of the user and password (% as %25, @ as %40, / as %2F), and check the host and port")
				}
			}
			return sql.Open("postgres", dsn)
		},
		Driver:           postgres.Driver{},
		RedactDSN:        postgres.RedactDSN,
		IsUndefinedTable: postgres.IsUndefinedTable,
		Migrations:       postgres.Migrations,
		MigrationScript:  postgres.MigrationScript,
		MigrationsTable: func(schema, prefix string) (string, error) {
			if schema == "" {
				schema = postgres.DefaultSchema
			}
			n, err := store.NewNames(schema, prefix)
			return n.Migrations, err
		},
		Grants: postgres.Grants,
	}
}

// Run runs the command line args on d, printing to stdout and stderr, and returns the exit
// status: 0 done, 1 failed, 2 a mistake in the command line.
func Run(ctx context.Context, d Database, args []string, stdout, stderr io.Writer, getenv func(string) string) int {
	var dsn string
	err := runErr(ctx, d, args, stdout, getenv, &dsn)
	// Errors may carry the DSN (lib/pq puts the whole URL in a parse error): its password is
	// taken out of everything printed.
	var ue usageError
	switch {
	case err == nil:
		return 0
	case errors.As(err, &ue):
		fmt.Fprintf(stderr, "outbox: %s\n%s", clean(d.RedactDSN(ue.msg, dsn)), usage(d))
		return 2
	case d.IsUndefinedTable(err):
		// The raw "relation does not exist" does not say what to do about it.
		fmt.Fprintf(stderr, "outbox: %v\noutbox: the outbox tables are not in this database under these -schema and -prefix: "+
			"run `outbox migrate up` (with the same -schema and -prefix), or point -dsn, -schema, -prefix at the service's tables\n", clean(d.RedactDSN(err.Error(), dsn)))
		return 1
	default:
		fmt.Fprintf(stderr, "outbox: %s\n", clean(d.RedactDSN(err.Error(), dsn)))
		return 1
	}
}

// usageError is a mistake in the command line: it is reported with the usage, exit status 2.
type usageError struct{ msg string }

func (e usageError) Error() string { return e.msg }

func usage(d Database) string {
	return fmt.Sprintf("%s\n%s: -dsn in %s; no -schema: %s\n", usageText, d.Title, d.DSNFormat, d.DefaultSchema)
}

const usageText = `usage: outbox [-dsn DSN] [-schema S] [-prefix P] [-o text|json] [-actor NAME] [-timeout D] COMMAND
commands:
  status [-retention D]                   pending, parked, failing, retained, cleanup lag, recent changes
  parked list|groups|retry|discard        parked effects. Filters: -id N (repeatable) -topic T -consumer C
                                          -older-than D -error TEXT; -limit N (default 1000). retry and
                                          discard need a filter or -all, and take -dry-run and -batch N;
                                          discard keeps the effects, noted as discarded, unless
                                          -effect-retention 0
  failing list [-consumer C] [-limit N]   messages whose handler failed and that were not processed
  replay [-dry-run] CONSUMER MESSAGE_ID   let a poisoned message run again on its next delivery
  lookup CONSUMER MESSAGE_ID              was it processed, when, what did it send, what is pending
  migrate up|status                       apply the migrations (needs a role that may create tables),
                                          or show them
  migrate sql [-grant ROLE] [-operator ROLE]
                                          print the migrations as one SQL script (and the grants)
  migrate grants [-operator] ROLE         print the grants of the application's (or an operator's) role
  cleanup [-retention D] [-effect-retention D] [-force] [-dry-run] [-batch N]
                                          one retention cleanup pass now, with progress. -retention
                                          defaults to the service's recorded Retention; a shorter one,
                                          or one below its redelivery horizon, needs -force. Dispatched
                                          effects are kept for -effect-retention (default: -retention)`

type globals struct {
	db                                 Database
	dsn, schema, prefix, output, actor string
	timeout                            time.Duration
}

func runErr(ctx context.Context, d Database, args []string, stdout io.Writer, getenv func(string) string, dsn *string) error {
	fs := flag.NewFlagSet("outbox", flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	g := globals{db: d}
	defaultDSN := getenv("OUTBOX_DSN")
	if defaultDSN == "" {
		defaultDSN = getenv("DATABASE_URL")
	}
	defaultActor := getenv("USER")
	if u, err := user.Current(); err == nil && defaultActor == "" {
		defaultActor = u.Username
	}
	fs.StringVar(&g.dsn, "dsn", defaultDSN, d.Title+" connection string")
	fs.StringVar(&g.schema, "schema", "", "schema of the outbox tables")
	fs.StringVar(&g.prefix, "prefix", "outbox_", "table prefix")
	fs.StringVar(&g.output, "o", "text", "output: text or json")
	fs.StringVar(&g.actor, "actor", defaultActor, "who makes the change, for the audit table")
	fs.DurationVar(&g.timeout, "timeout", time.Minute, "bound of the whole command")
	err := fs.Parse(args)
	*dsn = g.dsn
	if err != nil {
		return usageError{err.Error()}
	}
	if g.output != "text" && g.output != "json" {
		return usageError{fmt.Sprintf("-o %q: want text or json", g.output)}
	}
	rest := fs.Args()
	if len(rest) == 0 {
		return usageError{"no command"}
	}
	cmd, rest := rest[0], rest[1:]
	if cmd == "migrate" && len(rest) > 0 && rest[0] == "sql" {
		return migrateSQL(g, rest[1:], stdout) // needs no database
	}
	if cmd == "migrate" && len(rest) > 0 && rest[0] == "grants" {
		return migrateGrants(g, rest[1:], stdout)
	}
	if g.dsn == "" {
		return usageError{"no database: set -dsn, OUTBOX_DSN or DATABASE_URL"}
	}
	db, err := d.Open(g.dsn)
	if err != nil {
		return err
	}
	defer db.Close()
	ctx, cancel := context.WithTimeout(ctx, g.timeout)
	defer cancel()
	o, err := ops.OpenWith(db, ops.Options{Driver: d.Driver, Schema: g.schema, Prefix: g.prefix})
	if err != nil {
		return usageError{err.Error()}
	}
	out := printer{w: stdout, json: g.output == "json"}
	switch cmd {
	case "status":
		return status(ctx, o, rest, out)
	case "parked":
		return parked(ctx, o, db, g, rest, out)
	case "failing":
		return failing(ctx, o, rest, out)
	case "replay":
		return replay(ctx, o, g, rest, out)
	case "lookup":
		return lookup(ctx, o, rest, out)
	case "migrate":
		return migrate(ctx, o, db, g, rest, out)
	case "cleanup":
		return cleanup(ctx, o, g, rest, out)
	}
	return usageError{fmt.Sprintf("unknown command %q", cmd)}
}

type printer struct {
	w    io.Writer
	json bool
}

// emit prints v as JSON, or calls text to print it for a person.
func (p printer) emit(v any, text func(w *tabwriter.Writer)) error {
	if p.json {
		enc := json.NewEncoder(p.w)
		enc.SetIndent("", "  ")
		return enc.Encode(v)
	}
	tw := tabwriter.NewWriter(p.w, 0, 4, 2, ' ', 0)
	text(tw)
	return tw.Flush()
}

func status(ctx context.Context, o *ops.Ops, args []string, out printer) error {
	fs := flag.NewFlagSet("status", flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	retention := fs.Duration("retention", 0, "the service's Config.Retention, for the cleanup lag (default: as the service recorded it, or 7 days)")
	if err := fs.Parse(args); err != nil {
		return usageError{err.Error()}
	}
	if *retention <= 0 {
		c, err := o.ServiceConfig(ctx)
		if err != nil {
			return err
		}
		*retention = ops.DefaultRetention
		if c.Retention > 0 {
			*retention = c.Retention
		}
	}
	s, err := o.Status(ctx, *retention)
	if err != nil {
		return err
	}
	return out.emit(s, func(w *tabwriter.Writer) {
		t := s.Totals
		fmt.Fprintf(w, "pending\t%d\toldest %s\n", t.Pending, t.OldestPending.Round(time.Millisecond))
		fmt.Fprintf(w, "delayed\t%d\tnot due yet (no backlog)\n", t.Delayed)
		fmt.Fprintf(w, "parked\t%d\toldest %s\n", t.Parked, t.OldestParked.Round(time.Millisecond))
		fmt.Fprintf(w, "failing messages\t%d\t\n", t.Failing)
		fmt.Fprintf(w, "retained IDs\t%d\t%s\n", t.Retained, map[bool]string{true: "(estimated)"}[t.Estimated])
		fmt.Fprintf(w, "cleanup lag\t%s\t\n", t.CleanupLag.Round(time.Second))
		if s.LastDispatch.IsZero() {
			fmt.Fprintf(w, "last dispatch\tnone in the last hour\t\n")
		} else {
			fmt.Fprintf(w, "last dispatch\t%s ago\t\n", time.Since(s.LastDispatch).Round(time.Second))
		}
		if len(s.Groups) > 0 {
			fmt.Fprintf(w, "\nCONSUMER\tTOPIC\tPENDING\tOLDEST\tPARKED\n")
			for _, g := range s.Groups {
				fmt.Fprintf(w, "%s\t%s\t%d\t%s\t%d\n", orBoundary(g.Consumer), clean(g.Topic), g.Pending, g.OldestPending.Round(time.Millisecond), g.Parked)
			}
		}
		if len(s.Failing) > 0 {
			fmt.Fprintf(w, "\nCONSUMER\tFAILING MESSAGES\tATTEMPTS\t\t\n")
			for _, f := range s.Failing {
				fmt.Fprintf(w, "%s\t%d\t%d\t\t\n", clean(f.Consumer), f.Messages, f.Attempts)
			}
		}
		if len(s.Retained) > 0 {
			fmt.Fprintf(w, "\nCONSUMER\tRETAINED IDS\t\t\t\n")
			for c, n := range s.Retained {
				fmt.Fprintf(w, "%s\t%d\t\t\t\n", clean(c), n)
			}
		}
		switch {
		case s.AuditUnreadable:
			fmt.Fprintf(w, "\nrecent changes\tnot readable by this role (it may only append to the audit table)\t\t\t\n")
		case len(s.Audit) > 0:
			fmt.Fprintf(w, "\nRECENT CHANGES\t\t\t\t\n")
			for _, a := range s.Audit {
				who := clean(a.Actor)
				if a.Role != "" { // the role and addresses the database and the console recorded
					who += " [" + strings.Join(slices.DeleteFunc([]string{clean(a.Role), clean(a.ClientAddr), clean(a.Remote)},
						func(s string) bool { return s == "" }), " ") + "]"
				}
				fmt.Fprintf(w, "%s\t%s\t%s\t%s\t%s\n", a.At.Format(time.RFC3339), who, clean(a.Action), clean(a.Target), clean(a.Detail))
			}
		}
	})
}

func orBoundary(consumer string) string {
	if consumer == "" {
		return "(boundary)"
	}
	return clean(consumer)
}

// clean makes text from the tables (message IDs, topics, error texts, actors: anything a message
// or a user could set) safe to print on a terminal: control characters (C0, DEL, C1, which
// include the escape sequences that move the cursor or rewrite the screen), bidirectional
// overrides and invalid UTF-8 are escaped, so that what is printed is what is stored. A tab or
// line break is escaped too: it would break the table.
func clean(s string) string {
	if !strings.ContainsFunc(s, unsafeRune) && utf8.ValidString(s) {
		return s
	}
	var b strings.Builder
	for i := 0; i < len(s); {
		r, size := utf8.DecodeRuneInString(s[i:])
		switch {
		case r == utf8.RuneError && size == 1:
			fmt.Fprintf(&b, `\x%02x`, s[i])
		case unsafeRune(r) && r < 0x100:
			fmt.Fprintf(&b, `\x%02x`, r)
		case unsafeRune(r):
			fmt.Fprintf(&b, `\u%04x`, r)
		default:
			b.WriteRune(r)
		}
		i += size
	}
	return b.String()
}

func unsafeRune(r rune) bool {
	return unicode.IsControl(r) || unicode.Is(unicode.Bidi_Control, r) || r == '\u2028' || r == '\u2029'
}

// idFlags collects repeated -id flags.
type idFlags []int64

func (f *idFlags) String() string { return fmt.Sprint(*f) }
func (f *idFlags) Set(s string) error {
	for _, part := range strings.Split(s, ",") {
		id, err := strconv.ParseInt(strings.TrimSpace(part), 10, 64)
		if err != nil || id <= 0 {
			return fmt.Errorf("-id %q: want a store ID (a positive integer)", part)
		}
		*f = append(*f, id)
	}
	return nil
}

// set tells whether the flag name was given on the command line.
func set(fs *flag.FlagSet, name string) bool {
	found := false
	fs.Visit(func(f *flag.Flag) { found = found || f.Name == name })
	return found
}

func parked(ctx context.Context, o *ops.Ops, db *sql.DB, g globals, args []string, out printer) error {
	if len(args) == 0 {
		return usageError{"parked: want list, groups, retry or discard"}
	}
	sub := args[0]
	fs := flag.NewFlagSet("parked "+sub, flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	var f ops.ParkedFilter
	var ids idFlags
	fs.Var(&ids, "id", "store ID (repeatable, or comma-separated)")
	fs.StringVar(&f.Topic, "topic", "", "only effects to this topic")
	fs.StringVar(&f.Consumer, "consumer", "", "only effects of this consumer")
	fs.DurationVar(&f.OlderThan, "older-than", 0, "only effects parked longer ago than this")
	fs.StringVar(&f.ErrorContains, "error", "", "only effects whose last error contains this text")
	fs.BoolVar(&f.All, "all", false, "retry or discard: every parked effect (up to -limit)")
	fs.IntVar(&f.Limit, "limit", ops.DefaultLimit, "at most this many effects")
	dryRun := fs.Bool("dry-run", false, "say what would change, change nothing")
	batch := fs.Int("batch", 500, "effects changed per batch")
	effectRetention := fs.Duration("effect-retention", 0,
		"the service's Config.EffectRetention: 0 deletes discarded effects, as that service does; unset: they are kept, noted as discarded, until cleanup")
	if err := fs.Parse(args[1:]); err != nil {
		return usageError{err.Error()}
	}
	f.IDs = ids
	if sub == "discard" && set(fs, "effect-retention") && *effectRetention == 0 {
		var err error
		if o, err = ops.OpenWith(db, ops.Options{Driver: g.db.Driver, Schema: g.schema, Prefix: g.prefix, DeleteDispatched: true}); err != nil {
			return usageError{err.Error()}
		}
	}
	switch sub {
	case "list":
		list, err := o.ParkedEffects(ctx, f)
		if err != nil {
			return err
		}
		return out.emit(list, func(w *tabwriter.Writer) {
			fmt.Fprintf(w, "ID\tCONSUMER\tTOPIC\tUUID\tATTEMPTS\tPARKED\tERROR\n")
			for _, p := range list {
				fmt.Fprintf(w, "%d\t%s\t%s\t%s\t%d\t%s ago\t%s\n", p.StoreID, orBoundary(p.Source.Consumer), clean(p.Topic), clean(p.UUID),
					p.Attempts, time.Since(p.ParkedAt).Round(time.Second), oneLine(p.LastError, 100))
			}
		})
	case "groups":
		list, err := o.ParkedEffects(ctx, f)
		if err != nil {
			return err
		}
		groups := ops.GroupByFingerprint(list)
		return out.emit(groups, func(w *tabwriter.Writer) {
			fmt.Fprintf(w, "COUNT\tTOPICS\tFAILURE\n")
			for _, gr := range groups {
				fmt.Fprintf(w, "%d\t%s\t%s\n", gr.Count, clean(strings.Join(gr.Topics, ",")), oneLine(gr.Fingerprint, 120))
			}
		})
	case "retry", "discard":
		if len(f.IDs) == 0 && f.Topic == "" && f.Consumer == "" && f.OlderThan == 0 && f.ErrorContains == "" && !f.All {
			return usageError{"parked " + sub + ": select the effects (-id, -topic, -consumer, -older-than or -error), or give -all"}
		}
		opt := ops.RepairOptions{Actor: g.actor, DryRun: *dryRun, BatchSize: *batch}
		if !out.json {
			opt.Progress = func(done, total int) { fmt.Fprintf(out.w, "%d/%d\n", done, total) }
		}
		repair := o.RetryParked
		if sub == "discard" {
			repair = o.DiscardParked
		}
		ch, err := repair(ctx, f, opt)
		if err != nil {
			return err
		}
		if ch.Matched == 0 {
			// "0 of 0 changed" and exit 0 reads as done: a wrong -id or filter must not. A script
			// still gets the JSON of the (empty) change.
			if out.json {
				if err := out.emit(ch, nil); err != nil {
					return err
				}
			}
			return fmt.Errorf("parked %s: no parked effect matched the selection; nothing changed (see `outbox parked list`)", sub)
		}
		return out.emit(ch, func(w *tabwriter.Writer) {
			if ch.DryRun {
				fmt.Fprintf(w, "dry run: %s would change %d parked effect(s): %v\n", sub, ch.Matched, ch.IDs)
			} else {
				fmt.Fprintf(w, "%s: %d of %d parked effect(s) changed (audited as %s)\n", sub, ch.Changed, ch.Matched, clean(g.actor))
			}
			if ch.More {
				fmt.Fprintf(w, "more parked effects match: -limit %d stopped at %d; run it again (or raise -limit) for the rest\n", f.Limit, ch.Matched)
			}
		})
	}
	return usageError{fmt.Sprintf("parked %s: want list, groups, retry or discard", sub)}
}

// oneLine prints s on one line of at most about n bytes, escaped (see clean).
func oneLine(s string, n int) string {
	s = strings.Join(strings.Fields(s), " ")
	if len(s) > n {
		s = strings.ToValidUTF8(s[:n], "") + "..."
	}
	return clean(s)
}

func failing(ctx context.Context, o *ops.Ops, args []string, out printer) error {
	if len(args) == 0 || args[0] != "list" {
		return usageError{"failing: want list"}
	}
	fs := flag.NewFlagSet("failing list", flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	consumer := fs.String("consumer", "", "only this consumer")
	limit := fs.Int("limit", 1000, "at most this many")
	if err := fs.Parse(args[1:]); err != nil {
		return usageError{err.Error()}
	}
	list, err := o.FailingMessages(ctx, *consumer, *limit)
	if err != nil {
		return err
	}
	return out.emit(list, func(w *tabwriter.Writer) {
		fmt.Fprintf(w, "CONSUMER\tMESSAGE\tATTEMPTS\tLAST FAILED\tERROR\n")
		for _, f := range list {
			fmt.Fprintf(w, "%s\t%s\t%d\t%s ago\t%s\n", clean(f.Consumer), clean(f.MessageID), f.Attempts,
				time.Since(f.LastFailedAt).Round(time.Second), oneLine(f.LastError, 100))
		}
	})
}

func replay(ctx context.Context, o *ops.Ops, g globals, args []string, out printer) error {
	fs := flag.NewFlagSet("replay", flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	dryRun := fs.Bool("dry-run", false, "say whether the message is poisoned, change nothing")
	if err := fs.Parse(args); err != nil {
		return usageError{err.Error()}
	}
	if fs.NArg() != 2 {
		return usageError{"replay: want CONSUMER MESSAGE_ID"}
	}
	consumer, id := fs.Arg(0), fs.Arg(1)
	ok, err := o.ReplayPoisoned(ctx, consumer, id, ops.RepairOptions{Actor: g.actor, DryRun: *dryRun})
	if err != nil {
		return err
	}
	res := map[string]any{"consumer": consumer, "message_id": id, "poisoned": ok, "dry_run": *dryRun}
	name := clean(consumer) + "/" + clean(id)
	return out.emit(res, func(w *tabwriter.Writer) {
		switch {
		case !ok:
			fmt.Fprintf(w, "%s is not a poisoned message: nothing to replay\n", name)
		case *dryRun:
			fmt.Fprintf(w, "dry run: %s is poisoned; replay would let its next delivery run the handler\n", name)
		default:
			fmt.Fprintf(w, "%s: its next delivery runs the handler (put it back on its topic, ID unchanged)\n", name)
		}
	})
}

func lookup(ctx context.Context, o *ops.Ops, args []string, out printer) error {
	if len(args) != 2 {
		return usageError{"lookup: want CONSUMER MESSAGE_ID"}
	}
	l, err := o.Lookup(ctx, args[0], args[1])
	if err != nil {
		return err
	}
	name := clean(l.Consumer) + "/" + clean(l.MessageID)
	return out.emit(l, func(w *tabwriter.Writer) {
		switch {
		case l.Poisoned:
			fmt.Fprintf(w, "%s: poisoned at %s\n", name, l.ProcessedAt.Format(time.RFC3339))
		case l.Processed:
			fmt.Fprintf(w, "%s: processed at %s, last dispatch %s\n", name,
				l.ProcessedAt.Format(time.RFC3339Nano), l.DispatchedAt.Format(time.RFC3339Nano))
		default:
			fmt.Fprintf(w, "%s: not processed (or forgotten after Retention)\n", name)
		}
		if l.Attempts > 0 {
			fmt.Fprintf(w, "failed attempts: %d, last error: %s\n", l.Attempts, oneLine(l.LastError, 200))
		}
		if len(l.Effects) > 0 {
			fmt.Fprintf(w, "ID\tSTATE\tKIND\tTOPIC\tUUID\n")
			for _, e := range l.Effects {
				kind := e.Kind
				if kind == outboxdriver.KindPublish {
					kind = "publish"
				}
				fmt.Fprintf(w, "%d\t%s\t%s\t%s\t%s\n", e.StoreID, e.State, clean(kind), clean(e.Topic), clean(e.UUID))
			}
		}
	})
}

func migrate(ctx context.Context, o *ops.Ops, db *sql.DB, g globals, args []string, out printer) error {
	if len(args) != 1 {
		return usageError{"migrate: want up, status, sql or grants"}
	}
	switch args[0] {
	case "up":
		all, err := g.db.Migrations(g.schema, g.prefix)
		if err != nil {
			return err
		}
		before, err := appliedMigrations(ctx, db, g)
		if err != nil {
			return err
		}
		if err := o.Store().Migrate(ctx); err != nil {
			return err
		}
		// Which ones this run applied: the same words for "created everything" and "nothing to
		// do" left the operator to guess whether the command reached the intended database.
		after, err := appliedMigrations(ctx, db, g)
		if err != nil {
			return err
		}
		res := struct {
			Migrate string   `json:"migrate"`
			Applied []string `json:"applied"`
		}{Migrate: "done", Applied: []string{}}
		for _, m := range all {
			if after[m.Version] && !before[m.Version] {
				res.Applied = append(res.Applied, fmt.Sprintf("%03d_%s", m.Version, m.Name))
			}
		}
		return out.emit(res, func(w *tabwriter.Writer) {
			if len(res.Applied) == 0 {
				fmt.Fprintf(w, "no migration to apply: the outbox tables are current (%d migrations)\n", len(all))
				return
			}
			fmt.Fprintf(w, "applied %d migration(s): %s; the outbox tables are current\n", len(res.Applied), strings.Join(res.Applied, ", "))
		})
	case "status":
		all, err := g.db.Migrations(g.schema, g.prefix)
		if err != nil {
			return err
		}
		applied, err := appliedMigrations(ctx, db, g)
		if err != nil {
			return err
		}
		type row struct {
			Version int    `json:"version"`
			Name    string `json:"name"`
			Applied bool   `json:"applied"`
		}
		var list []row
		for _, m := range all {
			list = append(list, row{m.Version, m.Name, applied[m.Version]})
		}
		return out.emit(list, func(w *tabwriter.Writer) {
			fmt.Fprintf(w, "VERSION\tNAME\tAPPLIED\n")
			for _, r := range list {
				fmt.Fprintf(w, "%03d\t%s\t%v\n", r.Version, r.Name, r.Applied)
			}
		})
	}
	return usageError{fmt.Sprintf("migrate %s: want up, status, sql or grants", args[0])}
}

// appliedMigrations returns the versions recorded in the migrations table; none if it does not exist.
func appliedMigrations(ctx context.Context, db *sql.DB, g globals) (map[int]bool, error) {
	table, err := migrationsTable(g)
	if err != nil {
		return nil, err
	}
	applied := map[int]bool{}
	rows, err := db.QueryContext(ctx, `SELECT version FROM `+table)
	if err != nil {
		if g.db.IsUndefinedTable(err) {
			return applied, nil
		}
		return nil, fmt.Errorf("read the applied migrations: %w", err)
	}
	for rows.Next() {
		var v int
		if err := rows.Scan(&v); err != nil {
			_ = rows.Close()
			return nil, fmt.Errorf("read the applied migrations: %w", err)
		}
		applied[v] = true
	}
	if err := errors.Join(rows.Err(), rows.Close()); err != nil {
		return nil, fmt.Errorf("read the applied migrations: %w", err)
	}
	return applied, nil
}

// migrationsTable is the quoted name of the table that records the applied migrations.
func migrationsTable(g globals) (string, error) {
	t, err := g.db.MigrationsTable(g.schema, g.prefix)
	if err != nil {
		return "", usageError{err.Error()}
	}
	return t, nil
}

// migrateSQL prints every migration as one script for the schema and prefix, for psql or a
// migration tool of the team's, followed by the grants of the roles -grant and -operator name.
func migrateSQL(g globals, args []string, stdout io.Writer) error {
	fs := flag.NewFlagSet("migrate sql", flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	app := fs.String("grant", "", "also grant this role what the application needs")
	operator := fs.String("operator", "", "also grant this role what an operator needs")
	if err := fs.Parse(args); err != nil {
		return usageError{err.Error()}
	}
	if fs.NArg() != 0 {
		return usageError{"migrate sql: unexpected " + strings.Join(fs.Args(), " ")}
	}
	if (*app != "" || *operator != "") && g.db.Grants == nil {
		return usageError{"migrate sql: -grant and -operator are not available for " + g.db.Title}
	}
	script, err := g.db.MigrationScript(g.schema, g.prefix)
	if err != nil {
		return usageError{err.Error()}
	}
	var grants []string
	for _, r := range []struct {
		role     string
		operator bool
	}{{*app, false}, {*operator, true}} {
		if r.role == "" {
			continue
		}
		gs, err := g.db.Grants(g.schema, g.prefix, r.role, r.operator)
		if err != nil {
			return usageError{err.Error()}
		}
		grants = append(grants, gs...)
	}
	fmt.Fprint(stdout, script)
	if len(grants) > 0 {
		fmt.Fprintf(stdout, "-- grants\n%s;\n", strings.Join(grants, ";\n"))
	}
	return nil
}

// migrateGrants prints the grants of a role: what a service needs, or with -operator what the
// operators' CLI needs too (reading the audit table).
func migrateGrants(g globals, args []string, stdout io.Writer) error {
	fs := flag.NewFlagSet("migrate grants", flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	operator := fs.Bool("operator", false, "the role of an operator: may also read the audit table")
	if err := fs.Parse(args); err != nil {
		return usageError{err.Error()}
	}
	if fs.NArg() != 1 {
		return usageError{"migrate grants: want ROLE"}
	}
	if g.db.Grants == nil {
		return usageError{"migrate grants: not available for " + g.db.Title}
	}
	grants, err := g.db.Grants(g.schema, g.prefix, fs.Arg(0), *operator)
	if err != nil {
		return usageError{err.Error()}
	}
	if g.output == "json" {
		return printer{w: stdout, json: true}.emit(map[string]any{"role": fs.Arg(0), "operator": *operator, "statements": grants}, nil)
	}
	fmt.Fprintf(stdout, "%s;\n", strings.Join(grants, ";\n"))
	return nil
}

func cleanup(ctx context.Context, o *ops.Ops, g globals, args []string, out printer) error {
	fs := flag.NewFlagSet("cleanup", flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	retention := fs.Duration("retention", 0, "the service's Config.Retention (default: as the service recorded it)")
	effectRetention := fs.Duration("effect-retention", 0, "the service's Config.EffectRetention (default: -retention)")
	force := fs.Bool("force", false, "allow a retention below the service's Retention or redelivery horizon")
	dryRun := fs.Bool("dry-run", false, "count what would be deleted, delete nothing")
	batch := fs.Int("batch", 1000, "rows per batch")
	if err := fs.Parse(args); err != nil {
		return usageError{err.Error()}
	}
	if fs.NArg() != 0 {
		return usageError{"cleanup: unexpected " + strings.Join(fs.Args(), " ")}
	}
	if set(fs, "retention") && *retention <= 0 {
		return usageError{fmt.Sprintf("cleanup: -retention %s would forget every processed message ID, and every redelivery would run its handler again: give a positive retention (below the service's, with -force)", *retention)}
	}
	r, err := o.CheckRetention(ctx, ops.CleanupOptions{Retention: *retention, Force: *force})
	switch {
	case errors.Is(err, ops.ErrRetentionUnknown):
		return usageError{"cleanup: no service has recorded its Retention here yet: give -retention"}
	case err != nil:
		return err
	}
	if !set(fs, "effect-retention") {
		// Not told how long the service keeps what it dispatched: keep it as long as the claims,
		// never shorter than the service would. Deleting young effects takes an explicit value.
		*effectRetention = r
	}
	if !out.json {
		verb := "cleaning"
		if *dryRun {
			verb = "dry run"
		}
		fmt.Fprintf(out.w, "%s (retention %s, dispatched effects %s)...\n", verb, r, *effectRetention)
	}
	rep, err := o.Cleanup(ctx, ops.CleanupOptions{Actor: g.actor, Retention: r, EffectRetention: *effectRetention,
		Force: *force, DryRun: *dryRun, BatchSize: *batch,
		Progress: func(r outboxdriver.CleanupResult) {
			if !out.json && r.Claims+r.Effects+r.Attempts > 0 {
				fmt.Fprintf(out.w, "\r%d claims, %d effects, %d attempt counters deleted", r.Claims, r.Effects, r.Attempts)
			}
		}})
	if !out.json && !*dryRun {
		fmt.Fprintln(out.w)
	}
	if err != nil {
		return err
	}
	return out.emit(rep, func(w *tabwriter.Writer) {
		switch {
		case rep.DryRun:
			fmt.Fprintf(w, "would delete %d claims, %d dispatched effects, %d attempt counters, %d expired idempotency keys\n", rep.Claims, rep.Effects, rep.Attempts, rep.Keys)
		case rep.Skipped:
			fmt.Fprintln(w, "another process is cleaning; nothing done")
		default:
			fmt.Fprintf(w, "deleted %d claims, %d dispatched effects, %d attempt counters, %d expired idempotency keys in %d batches (audited as %s)\n",
				rep.Claims, rep.Effects, rep.Attempts, rep.Keys, rep.Batches, clean(g.actor))
		}
	})
}
