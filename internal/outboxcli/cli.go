// Package outboxcli is the command `outbox`, which inspects and repairs the outbox tables next to
// a running service, for one kind of database (a Database): cmd/outbox builds it for PostgreSQL,
// drivers/mysql/cmd/outbox-mysql for MySQL and MariaDB (whose database/sql driver the library
// module does not depend on).
//
//	outbox [flags] status [-retention D]
//	outbox [flags] parked list|groups [-id N]... [-topic T] [-consumer C] [-older-than D] [-error TEXT] [-limit N]
//	outbox [flags] parked retry|discard (filters or -all) [-dry-run] [-batch N] [-effect-retention D]
//	outbox [flags] failing list [-consumer C] [-limit N]
//	outbox [flags] dead list|groups|retry|discard|now ...
//	outbox [flags] replay [-dry-run] CONSUMER MESSAGE_ID
//	outbox [flags] lookup CONSUMER MESSAGE_ID
//	outbox [flags] migrate up|status
//	outbox [flags] migrate sql [-grant ROLE] [-operator ROLE]
//	outbox [flags] migrate grants [-operator] ROLE
//	outbox [flags] cleanup [-retention D] [-effect-retention D] [-force] [-dry-run] [-batch N]
//	outbox help [COMMAND [SUBCOMMAND]]
//
// Global flags, before or after the command: -dsn (default $OUTBOX_DSN, then $DATABASE_URL; in the
// Database's format), -members FILE and -member NAME (the member databases of a tenant.Set), -schema,
// -prefix, -o text|json, -actor (default $USER), -timeout. Each
// command and group has its own help (-h, --help or `outbox help COMMAND`: stdout, exit status 0,
// no database needed), with the defaults of its flags. Exit status: 0 done (an empty list too);
// 1 failed, or nothing matched what the command names (a selection to repair, a message to replay
// or look up: stderr says "nothing matched", stdout has the empty result); 2 a mistake in the
// command line. Every change (retry, discard, replay, cleanup) is written to the audit table with
// the actor; status shows the latest. Text output escapes the control characters of what it
// prints from the tables; the password of the DSN is never printed.
package outboxcli

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"net/url"
	"os"
	"os/user"
	"slices"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"
	"unicode"
	"unicode/utf8"

	"github.com/lib/pq"
	"github.com/watermill-outbox/outbox/drivers/postgres"
	"github.com/watermill-outbox/outbox/internal/fanout"
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
	// Every read and write on its connections must end by deadline (the command's -timeout),
	// also where the driver does not watch the context (lib/pq while it connects to a server
	// that accepts and never answers).
	Open func(dsn string, deadline time.Time) (*sql.DB, error)
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
		Open: func(dsn string, deadline time.Time) (*sql.DB, error) {
			if strings.Contains(dsn, "://") {
				// url.Parse's error quotes the URL, and a part of a malformed escape is part of
				// the password: none of it is repeated.
				if _, err := url.Parse(dsn); err != nil {
					return nil, errors.New("the DSN is not a valid URL: percent-encode the special characters of the user and password (% as %25, @ as %40, / as %2F), and check the host and port")
				}
			}
			c, err := pq.NewConnector(dsn)
			if err != nil {
				return nil, err
			}
			c.Dialer(deadlineDialer{deadline: deadline})
			return sql.OpenDB(c), nil
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
// status: 0 done, 1 failed or nothing matched, 2 a mistake in the command line. Help (-h, --help,
// `outbox help COMMAND`) goes to stdout with status 0 and needs no database.
func Run(ctx context.Context, d Database, args []string, stdout, stderr io.Writer, getenv func(string) string) int {
	g := newGlobals(d, getenv)
	defer g.close()
	err := g.run(ctx, root(d), args, stdout)
	// Errors may carry the DSN (lib/pq puts the whole URL in a parse error): its password is
	// taken out of everything printed.
	var ue usageError
	var hr helpRequest
	switch {
	case err == nil:
		return 0
	case errors.As(err, &hr):
		fmt.Fprint(stdout, hr.text)
		return 0
	case errors.As(err, &ue):
		fmt.Fprintf(stderr, "outbox: %s\n%s", clean(g.redact(ue.msg)), g.help)
		return 2
	case d.IsUndefinedTable(err):
		// The raw "relation does not exist" does not say what to do about it.
		fmt.Fprintf(stderr, "outbox: %v\noutbox: the outbox tables are not in this database under these -schema and -prefix: "+
			"run `outbox migrate up` (with the same -schema and -prefix), or point -dsn, -schema, -prefix at the service's tables\n", clean(g.redact(err.Error())))
		return 1
	default:
		fmt.Fprintf(stderr, "outbox: %s\n", clean(g.redact(err.Error())))
		return 1
	}
}

// usageError is a mistake in the command line: it is reported with the help of the command,
// exit status 2.
type usageError struct{ msg string }

func (e usageError) Error() string { return e.msg }

// helpRequest is -h or --help: text is printed on stdout, exit status 0.
type helpRequest struct{ text string }

func (e helpRequest) Error() string { return "help requested" }

// nothingMatched is the one rule for a command that names what it acts on or looks up (a
// selection to repair, a message to replay or look up) when nothing matched, as grep has it: exit
// status 1, "nothing matched" on stderr, the (empty) result on stdout. A wrong -id is not a
// success. A list is not such a command: an empty one is an answer (exit 0).
type nothingMatched struct{ msg string }

func (e nothingMatched) Error() string { return "nothing matched: " + e.msg }

// command is a command of the CLI: a group of subcommands (subs), or one that runs.
type command struct {
	name  string // "parked retry"
	args  string // what follows the flags in the usage line
	short string // one line, in the list of its parent
	long  string // what it does, in its help
	subs  []*command
	run   func(ctx context.Context, g *globals, c *command, args []string, out printer) error
}

// root returns the commands of the CLI.
func root(d Database) *command {
	filters := "Filters select them: -id, -topic, -consumer, -older-than, -error; at most -limit of them."
	return &command{name: "", subs: []*command{
		{name: "status", short: "pending, parked, failing, retained, cleanup lag, last dispatch, recent changes", run: status,
			long: "Status shows the pending, delayed and parked effects (per consumer and topic), the failing messages,\n" +
				"the retained message IDs, the cleanup lag, the last dispatch and the latest audited changes; on\n" +
				"PostgreSQL also what holds back the xmin horizon (a session, slot or prepared transaction) and the\n" +
				"dead tuples of the outbox tables."},
		{name: "parked", short: "parked effects: list, group, retry or discard them",
			long: "Parked effects are the side effects the relay gave up sending.\n" + filters, subs: []*command{
				{name: "parked list", short: "the parked effects, with their last error", run: parked,
					long: "List the parked effects, oldest first.\n" + filters},
				{name: "parked groups", short: "the parked effects grouped by a normalized error fingerprint", run: parked,
					long: "Group the parked effects that match the filters by their failure: the last error with its\n" +
						"numbers, IDs and addresses normalized, with the topics of each group."},
				{name: "parked retry", short: "make parked effects due again, with fresh attempt counts", run: parked,
					long: "Make the selected parked effects due again, with fresh attempt counts: the relays send them.\n" +
						"It needs a selection (a filter, or -all), changes at most -limit effects in batches of\n" +
						"-batch, says when more match, and writes each batch to the audit table."},
				{name: "parked discard", short: "give parked effects up for good", run: parked,
					long: "Give the selected parked effects up for good; the later effects of their ordering keys go on.\n" +
						"A discarded effect is kept in the dispatched table, noted as discarded, as a service with\n" +
						"EffectRetention does; -effect-retention 0 deletes it, as a service without does. It needs a\n" +
						"selection (a filter, or -all) and writes each batch to the audit table."},
			}},
		{name: "failing", short: "messages whose handler failed", long: "Failing messages are those whose handler failed and that are not processed.", subs: []*command{
			{name: "failing list", short: "messages whose handler failed and that were not processed", run: failing,
				long: "List the messages whose handler failed and that were not processed, with their attempts and last error."},
		}},
		{name: "dead", short: "dead letters: list, group, retry or discard them",
			long: "Dead letters are the messages a consumer gave up on (failed MaxAttempts times, failed with a\n" +
				"permanent error, or without a usable ID), stored with their payload and acked.", subs: []*command{
				{name: "dead list", short: "the dead letters, oldest first, with their reason", run: dead,
					long: "List the dead letters, oldest first: -consumer, -state (dead, retried, discarded; empty: all), -limit."},
				{name: "dead groups", short: "the dead letters grouped by consumer and a normalized reason", run: dead,
					long: "Group the dead letters still dead by consumer and their reason's fingerprint (numbers, IDs and\n" +
						"addresses normalized), largest group first."},
				{name: "dead retry", args: "CONSUMER MESSAGE_ID", short: "hand a dead letter back to its consumer, once", run: dead,
					long: "Retry a dead letter: in one transaction, its claim and attempts are reset and the stored message\n" +
						"is recorded for the topic it came from, with its own UUID; the relays send it and the consumer\n" +
						"runs it once. Written to the audit table."},
				{name: "dead discard", args: "CONSUMER MESSAGE_ID", short: "give a dead letter up (kept; its copies are still acked)", run: dead,
					long: "Discard a dead letter: it is kept, noted as discarded, and copies of the message are still acked.\n" +
						"Written to the audit table."},
				{name: "dead now", args: "CONSUMER MESSAGE_ID", short: "dead-letter a failing message on its next delivery", run: dead,
					long: "Dead-letter a failing message (its handler failed, fewer than MaxAttempts times) at once: its\n" +
						"next delivery stores it as a dead letter and acks it, without running the handler again (a\n" +
						"delivery to a process that has not seen it fail runs it once more). Written to the audit table."},
			}},
		{name: "replay", args: "CONSUMER MESSAGE_ID", short: "let a poisoned message run its handler again on its next delivery", run: replay,
			long: "Replay a poisoned message: its next delivery (put it back on its topic, ID unchanged) runs the\n" +
				"handler again. Its dead letter, if still dead, is marked retried with it. Written to the audit table."},
		{name: "lookup", args: "CONSUMER MESSAGE_ID", short: "was a message processed, when, what did it send, what is pending", run: lookup,
			long: "Look a message up: whether the consumer processed it (or poisoned it), when, its failed attempts,\n" +
				"and its side effects with their state (dispatched ones while EffectRetention keeps them)."},
		{name: "migrate", short: "the migrations of the outbox tables: apply, show, print as SQL, grants",
			long: "The migrations of the outbox tables.", subs: []*command{
				{name: "migrate up", short: "apply the missing migrations (needs a role that may create tables)", run: migrateUp,
					long: "Apply the missing migrations, in one transaction, and name the ones applied. It needs a role\n" +
						"that may create tables in the schema."},
				{name: "migrate status", short: "the migrations and whether each is applied", run: migrateStatus,
					long: "List the migrations and whether each is applied."},
				{name: "migrate sql", short: "print the migrations as one SQL script (and grants); no database", run: migrateSQL,
					long: "Print every migration as one SQL script for -schema and -prefix, for psql or a migration tool:\n" +
						"it creates the schema and the migrations table if missing, and runs each migration with the\n" +
						"row that records it in a transaction of its own (run it without psql's --single-transaction).\n" +
						"Needs no database."},
				{name: "migrate grants", args: "ROLE", short: "print the grants of a role; no database", run: migrateGrants,
					long: "Print the grants of ROLE on the outbox tables: what a service needs, or with -operator what\n" +
						"the operators' CLI needs too (reading the audit table). Needs no database."},
			}},
		{name: "cleanup", short: "one retention cleanup pass now, with progress", run: cleanup,
			long: "Run one retention cleanup pass now, with progress: delete the claims and attempt counters older\n" +
				"than -retention and the dispatched effects older than -effect-retention. A retention below the\n" +
				"service's recorded one, or below its redelivery horizon, needs -force. Written to the audit table."},
		{name: "help", args: "[COMMAND [SUBCOMMAND]]", short: "the help of a command", run: help,
			long: "Print the help of a command, or of outbox."},
	}}
}

// find returns the subcommand of c named word.
func (c *command) find(word string) *command {
	for _, s := range c.subs {
		if strings.TrimPrefix(s.name, c.name+" ") == strings.TrimSpace(word) {
			return s
		}
	}
	return nil
}

// subNames lists the names of the subcommands of c: "a, b or c".
func (c *command) subNames() string {
	var names []string
	for _, s := range c.subs {
		names = append(names, strings.TrimPrefix(s.name, c.name+" "))
	}
	if len(names) < 2 {
		return strings.Join(names, "")
	}
	return strings.Join(names[:len(names)-1], ", ") + " or " + names[len(names)-1]
}

type globals struct {
	db                                 Database
	getenv                             func(string) string
	top                                *flag.FlagSet
	dsn, schema, prefix, output, actor string
	timeout                            time.Duration
	// membersFile and member: -members names the databases of a process's members (a tenant or
	// shard each) in a file of "NAME DSN" lines; -member picks one of them. members is the file
	// read, in its order.
	membersFile, member string
	members             []memberDSN
	// help is the help of the command being parsed, printed with a mistake in its command line.
	help   string
	sqlDB  *sql.DB
	cancel context.CancelFunc
}

func newGlobals(d Database, getenv func(string) string) *globals {
	g := &globals{db: d, getenv: getenv}
	fs := flag.NewFlagSet("outbox", flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	// The defaults from the environment are applied after parsing: the help shows where they
	// come from, never the DSN (and its password) it would use.
	fs.StringVar(&g.dsn, "dsn", "", "`DSN` of the "+d.Title+" database, in "+d.DSNFormat+" (default $OUTBOX_DSN, then $DATABASE_URL)")
	fs.StringVar(&g.schema, "schema", "", "schema of the outbox tables (default: "+d.DefaultSchema+")")
	fs.StringVar(&g.prefix, "prefix", "outbox_", "prefix of the outbox tables")
	fs.StringVar(&g.output, "o", "text", "output: text or json")
	fs.StringVar(&g.actor, "actor", "", "who makes the change, for the audit table (default $USER, then the OS user)")
	fs.DurationVar(&g.timeout, "timeout", time.Minute, "bound of the whole command")
	fs.StringVar(&g.membersFile, "members", "", "`FILE` naming the databases of the members of a service (a tenant or shard each, a tenant.Set), a \"NAME DSN\" line each: status shows them all, -member picks one (default $OUTBOX_MEMBERS)")
	fs.StringVar(&g.member, "member", "", "the `NAME` in -members of the database to act on")
	g.top = fs
	return g
}

func (g *globals) close() {
	if g.cancel != nil {
		g.cancel()
	}
	if g.sqlDB != nil {
		_ = g.sqlDB.Close()
	}
}

// run parses the global flags, then runs the command (or the subcommand of a group) the rest
// names. Global flags may also follow the command, among its own flags.
func (g *globals) run(ctx context.Context, c *command, args []string, stdout io.Writer) error {
	g.help = g.groupHelp(c)
	fs := flag.NewFlagSet(c.name, flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	if c.name != "" {
		g.top.VisitAll(func(f *flag.Flag) { fs.Var(f.Value, f.Name, f.Usage) })
	} else {
		fs = g.top
	}
	err := fs.Parse(args)
	switch {
	case errors.Is(err, flag.ErrHelp):
		return helpRequest{g.help}
	case err != nil:
		return usageError{err.Error()}
	}
	rest := fs.Args()
	if len(rest) == 0 {
		if c.name == "" {
			return usageError{"no command"}
		}
		return usageError{fmt.Sprintf("%s: want %s", c.name, c.subNames())}
	}
	sub := c.find(rest[0])
	if sub == nil {
		if c.name == "" {
			return usageError{fmt.Sprintf("unknown command %q", rest[0])}
		}
		return usageError{fmt.Sprintf("%s %s: unknown command; want %s", c.name, rest[0], c.subNames())}
	}
	if sub.run == nil {
		return g.run(ctx, sub, rest[1:], stdout)
	}
	return sub.run(ctx, g, sub, rest[1:], printer{w: stdout, g: g})
}

// flags returns the flag set of the command c, for its own flags.
func (g *globals) flags(c *command) *flag.FlagSet {
	fs := flag.NewFlagSet(c.name, flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	return fs
}

// parse parses the command line of c: its own flags (in fs) and the global flags, in any order,
// among its arguments (all of them after --), and returns the arguments. want is how many it
// takes (-1: any).
func (g *globals) parse(fs *flag.FlagSet, c *command, args []string, want int) ([]string, error) {
	g.help = g.leafHelp(c, fs)
	g.top.VisitAll(func(f *flag.Flag) { fs.Var(f.Value, f.Name, f.Usage) })
	var pos []string
	for {
		err := fs.Parse(args)
		switch {
		case errors.Is(err, flag.ErrHelp):
			return nil, helpRequest{g.help}
		case err != nil:
			return nil, usageError{err.Error()}
		}
		rest := fs.Args()
		if n := len(args) - len(rest); n > 0 && args[n-1] == "--" {
			pos = append(pos, rest...)
			break
		}
		if len(rest) == 0 {
			break
		}
		pos, args = append(pos, rest[0]), rest[1:]
	}
	switch {
	case want == 0 && len(pos) > 0:
		return nil, usageError{c.name + ": unexpected " + strings.Join(pos, " ")}
	case want > 0 && len(pos) != want:
		return nil, usageError{c.name + ": want " + c.args}
	}
	if g.output != "text" && g.output != "json" {
		return nil, usageError{fmt.Sprintf("-o %q: want text or json", g.output)}
	}
	if err := g.pickMember(c); err != nil {
		return nil, err
	}
	if g.dsn == "" && g.membersFile == "" {
		if g.dsn = g.getenv("OUTBOX_DSN"); g.dsn == "" {
			g.dsn = g.getenv("DATABASE_URL")
		}
	}
	if g.actor == "" {
		if g.actor = g.getenv("USER"); g.actor == "" {
			if u, err := user.Current(); err == nil {
				g.actor = u.Username
			}
		}
	}
	return pos, nil
}

// memberDSN is a line of the -members file.
type memberDSN struct{ name, dsn string }

// pickMember reads the -members file (default $OUTBOX_MEMBERS) and, with -member, takes that
// member's DSN as -dsn. Without -member, only status acts on every member: a repair or a lookup
// names the one database it acts on.
func (g *globals) pickMember(c *command) error {
	if g.membersFile == "" {
		g.membersFile = g.getenv("OUTBOX_MEMBERS")
	}
	if g.membersFile == "" {
		if g.member != "" {
			return usageError{"-member " + strconv.Quote(g.member) + ": no -members file names the members"}
		}
		return nil
	}
	if g.dsn != "" {
		return usageError{"-dsn and -members: give one (-member picks a database of -members)"}
	}
	members, err := readMembers(g.membersFile)
	if err != nil {
		return usageError{err.Error()}
	}
	g.members = members
	if g.member == "" {
		if c.run != nil && c.name != "status" && c.name != "help" {
			return usageError{fmt.Sprintf("%s: -members names %d databases: pick one with -member NAME (only status shows them all)", c.name, len(members))}
		}
		return nil
	}
	for _, m := range members {
		if m.name == g.member {
			g.dsn = m.dsn
			return nil
		}
	}
	names := make([]string, len(members))
	for i, m := range members {
		names[i] = m.name
	}
	return usageError{fmt.Sprintf("-member %q is not in %s (members: %s)", g.member, g.membersFile, strings.Join(names, ", "))}
}

// readMembers reads a -members file: a "NAME DSN" line per member (blank lines and lines
// starting with # are skipped). The names are unique.
func readMembers(path string) ([]memberDSN, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("-members: %w", err)
	}
	var out []memberDSN
	seen := map[string]int{}
	for i, line := range strings.Split(string(data), "\n") {
		line = strings.TrimSpace(line)
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		name, dsn, ok := strings.Cut(line, " ")
		dsn = strings.TrimSpace(dsn)
		if !ok || dsn == "" {
			return nil, fmt.Errorf("-members %s, line %d: want NAME DSN", path, i+1)
		}
		if !utf8.ValidString(name) || strings.ContainsFunc(name, unsafeRune) {
			return nil, fmt.Errorf("-members %s, line %d: the name is not printable text", path, i+1)
		}
		if prev, dup := seen[name]; dup {
			return nil, fmt.Errorf("-members %s, line %d: member %q is on line %d already", path, i+1, name, prev)
		}
		seen[name] = i + 1
		out = append(out, memberDSN{name, dsn})
	}
	if len(out) == 0 {
		return nil, fmt.Errorf("-members %s: no member in it", path)
	}
	return out, nil
}

// redact takes the password of every DSN the command line named out of text.
func (g *globals) redact(text string) string {
	text = g.db.RedactDSN(text, g.dsn)
	for _, m := range g.members {
		text = g.db.RedactDSN(text, m.dsn)
	}
	return text
}

// connect opens the database and checks that it answers, within -timeout, which bounds the
// rest of the command through the context it returns.
func (g *globals) connect(ctx context.Context) (context.Context, *ops.Ops, error) {
	if g.dsn == "" {
		return ctx, nil, usageError{"no database: set -dsn, OUTBOX_DSN or DATABASE_URL"}
	}
	ctx, g.cancel = context.WithTimeout(ctx, g.timeout)
	deadline, _ := ctx.Deadline()
	db, err := g.db.Open(g.dsn, deadline)
	if err != nil {
		return ctx, nil, err
	}
	g.sqlDB = db
	o, err := ops.OpenWith(db, ops.Options{Driver: g.db.Driver, Schema: g.schema, Prefix: g.prefix})
	if err != nil {
		return ctx, nil, usageError{err.Error()}
	}
	// Without this, a database out of reach was reported by the first query, under the name of
	// what that query was for.
	if err := db.PingContext(ctx); err != nil {
		if ctx.Err() != nil || errors.Is(err, os.ErrDeadlineExceeded) {
			return ctx, nil, fmt.Errorf("connect to %s: no answer within -timeout (%v): %w", g.db.Title, g.timeout, err)
		}
		return ctx, nil, fmt.Errorf("connect to %s: %w", g.db.Title, err)
	}
	return ctx, o, nil
}

const exitText = `Exit status: 0 done (a list with nothing in it too: [] in JSON); 1 failed, or nothing matched what
the command names (a selection to repair, a message to replay or look up: stderr says "nothing
matched", and stdout has the empty result, [] in JSON); 2 a mistake in the command line.
`

// groupHelp is the help of a group of commands, or of outbox itself (the root).
func (g *globals) groupHelp(c *command) string {
	var b strings.Builder
	tw := tabwriter.NewWriter(&b, 0, 4, 2, ' ', 0)
	if c.name == "" {
		fmt.Fprintf(&b, "usage: outbox [flags] COMMAND [flags] [arguments]\n\n"+
			"outbox inspects and repairs the outbox tables of a %s database, next to a running service.\n"+
			"Every change (retry, discard, replay, cleanup) is written to the audit table with -actor.\n\nCommands:\n", g.db.Title)
		for _, s := range c.subs {
			if s.subs == nil {
				fmt.Fprintf(tw, "  %s\t%s\n", s.name, s.short)
			}
			for _, ss := range s.subs {
				fmt.Fprintf(tw, "  %s\t%s\n", ss.name, ss.short)
			}
		}
		_ = tw.Flush()
		fmt.Fprintf(&b, "\nFlags (before or after the command):\n%s\n%s\n"+
			"Run `outbox COMMAND -h` or `outbox help COMMAND` for the help of a command.\n", defaults(g.top), exitText)
		return b.String()
	}
	fmt.Fprintf(&b, "usage: outbox %s COMMAND [flags] [arguments]\n\n%s\n\nCommands:\n", c.name, c.long)
	for _, s := range c.subs {
		fmt.Fprintf(tw, "  %s\t%s\n", strings.TrimPrefix(s.name, c.name+" "), s.short)
	}
	_ = tw.Flush()
	fmt.Fprintf(&b, "\nRun `outbox %s COMMAND -h` for the flags of a command.\n", c.name)
	return b.String()
}

// leafHelp is the help of the command c, whose own flags are fs's.
func (g *globals) leafHelp(c *command, fs *flag.FlagSet) string {
	var b strings.Builder
	fmt.Fprintf(&b, "usage: outbox %s [flags]", c.name)
	if c.args != "" {
		fmt.Fprintf(&b, " %s", c.args)
	}
	fmt.Fprintf(&b, "\n\n%s\n", c.long)
	if own := defaults(fs); own != "" {
		fmt.Fprintf(&b, "\nFlags:\n%s", own)
	}
	fmt.Fprintf(&b, "\nThe global flags (-dsn, -schema, -prefix, -o, -actor, -timeout) go before or after the\ncommand: see `outbox -h`.\n")
	return b.String()
}

// defaults lists the flags of fs with their defaults, as the flag package prints them.
func defaults(fs *flag.FlagSet) string {
	var b strings.Builder
	// A copy keeps the defaults, whatever the command line has set before -h.
	p := flag.NewFlagSet(fs.Name(), flag.ContinueOnError)
	fs.VisitAll(func(f *flag.Flag) {
		p.Var(f.Value, f.Name, f.Usage)
		p.Lookup(f.Name).DefValue = f.DefValue
	})
	p.SetOutput(&b)
	p.PrintDefaults()
	return b.String()
}

// help prints the help of the command its arguments name.
func help(ctx context.Context, g *globals, c *command, args []string, out printer) error {
	fs := g.flags(c)
	words, err := g.parse(fs, c, args, -1)
	if err != nil {
		return err
	}
	r := root(g.db)
	if len(words) == 0 {
		return helpRequest{g.groupHelp(r)}
	}
	for i, cur := 0, r; i < len(words); i++ {
		if cur = cur.find(words[i]); cur == nil {
			return usageError{fmt.Sprintf("unknown command %q", strings.Join(words[:i+1], " "))}
		}
	}
	return g.run(ctx, r, append(words, "-h"), out.w)
}

type printer struct {
	w io.Writer
	g *globals
}

// list prints the n rows of v, or, when there are none, [] in JSON and what (what is empty) in
// text. An empty list is an answer, not a failure: a script that checks that nothing is parked
// under set -e must not stop at the healthy state (kubectl get does the same).
func (p printer) list(v any, n int, what string, text func(w *tabwriter.Writer)) error {
	if n > 0 {
		return p.emit(v, text)
	}
	if p.json() {
		return p.emit([]any{}, nil)
	}
	_, err := fmt.Fprintln(p.w, what)
	return err
}

// json tells whether the output is JSON (-o may come after the command, so it is read late).
func (p printer) json() bool { return p.g.output == "json" }

// emit prints v as JSON, or calls text to print it for a person.
func (p printer) emit(v any, text func(w *tabwriter.Writer)) error {
	if p.json() {
		enc := json.NewEncoder(p.w)
		enc.SetIndent("", "  ")
		return enc.Encode(v)
	}
	tw := tabwriter.NewWriter(p.w, 0, 4, 2, ' ', 0)
	text(tw)
	return tw.Flush()
}

func status(ctx context.Context, g *globals, c *command, args []string, out printer) error {
	fs := g.flags(c)
	retention := fs.Duration("retention", 0, "the service's Config.Retention, for the cleanup lag (default: as the service recorded it, or 7 days)")
	if _, err := g.parse(fs, c, args, 0); err != nil {
		return err
	}
	if len(g.members) > 0 && g.member == "" {
		return statusOfMembers(ctx, g, *retention, out)
	}
	ctx, o, err := g.connect(ctx)
	if err != nil {
		return err
	}
	s, err := statusOf(ctx, o, *retention)
	if err != nil {
		return err
	}
	return out.emit(s, func(w *tabwriter.Writer) { printStatus(w, s) })
}

// memberStatus is the status of one member of -members (JSON: an array of them).
type memberStatus struct {
	Member string      `json:"member"`
	Status *ops.Status `json:"status,omitempty"`
	Error  string      `json:"error,omitempty"`
}

// membersAtOnce bounds the members that status reads at once, and memberTurn how long a member
// keeps its turn before the next one begins beside it.
const (
	membersAtOnce = 8
	memberTurn    = time.Second
)

// statusOfMembers shows the status of every member of -members, read side by side
// (membersAtOnce at a time, each holding its turn for memberTurn at most) within -timeout for
// them all: a member that cannot be read, or has not answered by then, is reported as such (exit
// status 1), and the others are shown all the same. A read that has not answered is not waited
// for: a driver may not watch the context while it connects (lib/pq, to a server that accepts and
// never answers, without connect_timeout), and the command is for the incidents where a member is
// in that state.
func statusOfMembers(ctx context.Context, g *globals, retention time.Duration, out printer) error {
	ctx, cancel := context.WithTimeout(ctx, g.timeout)
	defer cancel()
	all, states := fanout.Each(ctx, len(g.members), membersAtOnce, memberTurn, func(ctx context.Context, i int) memberStatus {
		m := g.members[i]
		ms := memberStatus{Member: m.name}
		s, err := func() (*ops.Status, error) {
			mg := *g
			mg.dsn, mg.sqlDB, mg.cancel = m.dsn, nil, nil
			defer mg.close()
			ctx, o, err := mg.connect(ctx)
			if err != nil {
				return nil, err
			}
			return statusOf(ctx, o, retention)
		}()
		if err != nil {
			ms.Error = clean(g.redact(err.Error()))
		} else {
			ms.Status = s
		}
		return ms
	})
	for i, m := range g.members {
		all[i].Member = m.name
		switch states[i] {
		case fanout.Pending:
			all[i].Error = fmt.Sprintf("no answer within -timeout (%v): connecting to it or reading it did not return", g.timeout)
		case fanout.NotBegun:
			all[i].Error = fmt.Sprintf("not read within -timeout (%v): its turn did not come (members are read %d at a time, a turn lasting up to %v)",
				g.timeout, membersAtOnce, memberTurn)
		}
	}
	failed := 0
	for i := range all {
		if all[i].Status == nil {
			failed++
		}
	}
	if err := out.emit(all, func(w *tabwriter.Writer) {
		for i, ms := range all {
			if i > 0 {
				fmt.Fprintln(w)
			}
			fmt.Fprintf(w, "== member %s\t\t\n", clean(ms.Member))
			if ms.Status == nil {
				fmt.Fprintf(w, "error\t%s\t\n", ms.Error)
				continue
			}
			printStatus(w, ms.Status)
		}
	}); err != nil {
		return err
	}
	if failed > 0 {
		return fmt.Errorf("status: %d of %d members could not be read", failed, len(all))
	}
	return nil
}

// statusOf reads the status of the database of o, with retention, or the one the service
// recorded (else the default) when it is zero.
func statusOf(ctx context.Context, o *ops.Ops, retention time.Duration) (*ops.Status, error) {
	if retention <= 0 {
		c, err := o.ServiceConfig(ctx)
		if err != nil {
			return nil, err
		}
		retention = ops.DefaultRetention
		if c.Retention > 0 {
			retention = c.Retention
		}
	}
	s, err := o.Status(ctx, retention)
	if err != nil {
		return nil, err
	}
	return &s, nil
}

// printStatus prints s as status does in text.
func printStatus(w *tabwriter.Writer, s *ops.Status) {
	t := s.Totals
	fmt.Fprintf(w, "pending\t%d\toldest %s\n", t.Pending, t.OldestPending.Round(time.Millisecond))
	fmt.Fprintf(w, "delayed\t%d\tnot due yet (no backlog)\n", t.Delayed)
	fmt.Fprintf(w, "parked\t%d\toldest %s\n", t.Parked, t.OldestParked.Round(time.Millisecond))
	fmt.Fprintf(w, "failing messages\t%d\t\n", t.Failing)
	fmt.Fprintf(w, "dead letters\t%d\t(outbox dead groups)\n", t.DeadLetters)
	fmt.Fprintf(w, "retained IDs\t%d\t%s\n", t.Retained, map[bool]string{true: "(estimated)"}[t.Estimated])
	fmt.Fprintf(w, "cleanup lag\t%s\t\n", t.CleanupLag.Round(time.Second))
	if t.Tables != nil { // PostgreSQL's
		if h := t.XminHold; h != nil {
			fmt.Fprintf(w, "xmin held\t%s\t%d transactions, by %s\n", h.Age.Round(time.Second), h.Transactions, clean(h.Who()))
		} else {
			fmt.Fprintf(w, "xmin held\tnone\t\n")
		}
		var dead int64
		var each []string
		for _, tv := range t.Tables {
			dead += tv.DeadTuples
			if tv.DeadTuples > 0 {
				each = append(each, fmt.Sprintf("%s %d", tv.Table, tv.DeadTuples))
			}
		}
		fmt.Fprintf(w, "dead tuples\t%d\t%s\n", dead, strings.Join(each, ", "))
	}
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

func parked(ctx context.Context, g *globals, c *command, args []string, out printer) error {
	sub := strings.TrimPrefix(c.name, "parked ")
	fs := g.flags(c)
	var f ops.ParkedFilter
	var ids idFlags
	fs.Var(&ids, "id", "only the effect of this store `ID` (repeatable, or comma-separated)")
	fs.StringVar(&f.Topic, "topic", "", "only effects to this topic")
	fs.StringVar(&f.Consumer, "consumer", "", "only effects of this consumer")
	fs.DurationVar(&f.OlderThan, "older-than", 0, "only effects parked longer ago than this")
	fs.StringVar(&f.ErrorContains, "error", "", "only effects whose last error contains this text")
	fs.IntVar(&f.Limit, "limit", ops.DefaultLimit, "at most this many effects")
	var dryRun bool
	var batch int
	var effectRetention time.Duration
	if sub == "retry" || sub == "discard" {
		fs.BoolVar(&f.All, "all", false, "every parked effect (up to -limit), without a filter")
		fs.BoolVar(&dryRun, "dry-run", false, "say what would change, change nothing")
		fs.IntVar(&batch, "batch", 500, "effects changed per batch")
	}
	if sub == "discard" {
		fs.DurationVar(&effectRetention, "effect-retention", 0,
			"the service's Config.EffectRetention: 0 deletes the discarded effects, as that service does; unset: they are kept, noted as discarded, until cleanup")
	}
	if _, err := g.parse(fs, c, args, 0); err != nil {
		return err
	}
	f.IDs = ids
	if (sub == "retry" || sub == "discard") &&
		len(f.IDs) == 0 && f.Topic == "" && f.Consumer == "" && f.OlderThan == 0 && f.ErrorContains == "" && !f.All {
		return usageError{"parked " + sub + ": select the effects (-id, -topic, -consumer, -older-than or -error), or give -all"}
	}
	ctx, o, err := g.connect(ctx)
	if err != nil {
		return err
	}
	if sub == "discard" && set(fs, "effect-retention") && effectRetention == 0 {
		if o, err = ops.OpenWith(g.sqlDB, ops.Options{Driver: g.db.Driver, Schema: g.schema, Prefix: g.prefix, DeleteDispatched: true}); err != nil {
			return usageError{err.Error()}
		}
	}
	switch sub {
	case "list":
		list, err := o.ParkedEffects(ctx, f)
		if err != nil {
			return err
		}
		return out.list(list, len(list), "no parked effect matches the filters", func(w *tabwriter.Writer) {
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
		return out.list(groups, len(groups), "no parked effect matches the filters", func(w *tabwriter.Writer) {
			fmt.Fprintf(w, "COUNT\tTOPICS\tFAILURE\n")
			for _, gr := range groups {
				fmt.Fprintf(w, "%d\t%s\t%s\n", gr.Count, clean(strings.Join(gr.Topics, ",")), oneLine(gr.Fingerprint, 120))
			}
		})
	case "retry", "discard":
		opt := ops.RepairOptions{Actor: g.actor, DryRun: dryRun, BatchSize: batch}
		if !out.json() {
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
			if out.json() {
				if err := out.emit(ch, nil); err != nil {
					return err
				}
			}
			return nothingMatched{fmt.Sprintf("parked %s: no parked effect matched the selection; nothing changed (see `outbox parked list`)", sub)}
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
	return usageError{fmt.Sprintf("parked %s: unknown command", sub)}
}

// oneLine prints s on one line of at most about n bytes, escaped (see clean).
func oneLine(s string, n int) string {
	s = strings.Join(strings.Fields(s), " ")
	if len(s) > n {
		s = strings.ToValidUTF8(s[:n], "") + "..."
	}
	return clean(s)
}

func failing(ctx context.Context, g *globals, c *command, args []string, out printer) error {
	fs := g.flags(c)
	consumer := fs.String("consumer", "", "only the messages of this consumer")
	limit := fs.Int("limit", 1000, "at most this many messages")
	if _, err := g.parse(fs, c, args, 0); err != nil {
		return err
	}
	ctx, o, err := g.connect(ctx)
	if err != nil {
		return err
	}
	list, err := o.FailingMessages(ctx, *consumer, *limit)
	if err != nil {
		return err
	}
	return out.list(list, len(list), "no failing message", func(w *tabwriter.Writer) {
		fmt.Fprintf(w, "CONSUMER\tMESSAGE\tATTEMPTS\tLAST FAILED\tERROR\n")
		for _, f := range list {
			fmt.Fprintf(w, "%s\t%s\t%d\t%s ago\t%s\n", clean(f.Consumer), clean(f.MessageID), f.Attempts,
				time.Since(f.LastFailedAt).Round(time.Second), oneLine(f.LastError, 100))
		}
	})
}

// deadNow asks that a failing message be dead-lettered on its next delivery.
func deadNow(ctx context.Context, g *globals, o *ops.Ops, key outboxdriver.Source, dryRun bool, out printer) error {
	ok, err := o.DeadLetterNow(ctx, key, ops.RepairOptions{Actor: g.actor, DryRun: dryRun})
	if err != nil {
		return err
	}
	res := map[string]any{"action": "now", "consumer": key.Consumer, "message_id": key.ID, "changed": map[bool]int{true: 1}[ok], "dry_run": dryRun}
	name := clean(key.Consumer) + "/" + clean(key.ID)
	if !ok {
		if out.json() {
			if err := out.emit(res, nil); err != nil {
				return err
			}
		}
		return nothingMatched{name + " is not failing (no failed attempt counted, or processed or dead-lettered already): nothing to dead-letter"}
	}
	return out.emit(res, func(w *tabwriter.Writer) {
		if dryRun {
			fmt.Fprintf(w, "dry run: %s is failing; its next delivery would dead-letter it\n", name)
			return
		}
		fmt.Fprintf(w, "%s: its next delivery stores it as a dead letter and acks it (outbox dead list)\n", name)
	})
}

func dead(ctx context.Context, g *globals, c *command, args []string, out printer) error {
	sub := strings.TrimPrefix(c.name, "dead ")
	fs := g.flags(c)
	var f outboxdriver.DeadLetterFilter
	var dryRun bool
	want := 0
	switch sub {
	case "list":
		fs.StringVar(&f.Consumer, "consumer", "", "only the dead letters of this consumer")
		state := fs.String("state", "", "only the dead letters in this state: dead, retried or discarded (empty: all)")
		fs.IntVar(&f.Limit, "limit", ops.DefaultLimit, "at most this many dead letters")
		if _, err := g.parse(fs, c, args, 0); err != nil {
			return err
		}
		switch outboxdriver.DeadLetterState(*state) {
		case "", outboxdriver.DeadLetterDead, outboxdriver.DeadLetterRetried, outboxdriver.DeadLetterDiscarded:
			f.State = outboxdriver.DeadLetterState(*state)
		default:
			return usageError{fmt.Sprintf("dead list: -state %q: want dead, retried or discarded", *state)}
		}
	case "groups":
		fs.StringVar(&f.Consumer, "consumer", "", "only the dead letters of this consumer")
		if _, err := g.parse(fs, c, args, 0); err != nil {
			return err
		}
	case "now":
		fs.BoolVar(&dryRun, "dry-run", false, "say whether the message is failing, change nothing")
		want = 2
	default:
		fs.BoolVar(&dryRun, "dry-run", false, "say whether it is a dead letter, change nothing")
		want = 2
	}
	var pos []string
	if want > 0 {
		var err error
		if pos, err = g.parse(fs, c, args, want); err != nil {
			return err
		}
	}
	ctx, o, err := g.connect(ctx)
	if err != nil {
		return err
	}
	switch sub {
	case "list":
		list, err := o.DeadLetters(ctx, f)
		if err != nil {
			return err
		}
		return out.list(list, len(list), "no dead letter matches", func(w *tabwriter.Writer) {
			fmt.Fprintf(w, "CONSUMER\tMESSAGE\tTOPIC\tSTATE\tATTEMPTS\tDEAD\tREASON\n")
			for _, d := range list {
				fmt.Fprintf(w, "%s\t%s\t%s\t%s\t%d\t%s ago\t%s\n", clean(d.Consumer), clean(d.MessageID), clean(d.SourceTopic), d.State,
					d.Attempts, time.Since(d.DeadAt).Round(time.Second), oneLine(d.Reason, 100))
			}
		})
	case "groups":
		groups, more, err := o.DeadLetterGroups(ctx, f.Consumer)
		if err != nil {
			return err
		}
		return out.list(groups, len(groups), "no dead letter", func(w *tabwriter.Writer) {
			fmt.Fprintf(w, "COUNT\tCONSUMER\tOLDEST\tREASON\n")
			for _, gr := range groups {
				fmt.Fprintf(w, "%d\t%s\t%s ago\t%s\n", gr.Count, clean(gr.Consumer), time.Since(gr.Oldest).Round(time.Second), oneLine(gr.Reason, 120))
			}
			if more {
				fmt.Fprintf(w, "(the oldest dead letters only: more are dead)\n")
			}
		})
	}
	key := outboxdriver.Source{Consumer: pos[0], ID: pos[1]}
	if sub == "now" {
		return deadNow(ctx, g, o, key, dryRun, out)
	}
	repair := o.RetryDeadLetters
	if sub == "discard" {
		repair = o.DiscardDeadLetters
	}
	n, err := repair(ctx, []outboxdriver.Source{key}, ops.RepairOptions{Actor: g.actor, DryRun: dryRun})
	if err != nil {
		return err
	}
	res := map[string]any{"action": sub, "consumer": key.Consumer, "message_id": key.ID, "changed": n, "dry_run": dryRun}
	name := clean(key.Consumer) + "/" + clean(key.ID)
	if n == 0 {
		if out.json() {
			if err := out.emit(res, nil); err != nil {
				return err
			}
		}
		return nothingMatched{name + " is not a dead letter (or was retried or discarded already): nothing to " + sub}
	}
	return out.emit(res, func(w *tabwriter.Writer) {
		switch {
		case dryRun:
			fmt.Fprintf(w, "dry run: %s is a dead letter; %s would change it\n", name, sub)
		case sub == "retry":
			fmt.Fprintf(w, "%s: retried; the relays send it back to its topic and the consumer runs it once\n", name)
		default:
			fmt.Fprintf(w, "%s: discarded\n", name)
		}
	})
}

func replay(ctx context.Context, g *globals, c *command, args []string, out printer) error {
	fs := g.flags(c)
	dryRun := fs.Bool("dry-run", false, "say whether the message is poisoned, change nothing")
	pos, err := g.parse(fs, c, args, 2)
	if err != nil {
		return err
	}
	ctx, o, err := g.connect(ctx)
	if err != nil {
		return err
	}
	consumer, id := pos[0], pos[1]
	ok, err := o.ReplayPoisoned(ctx, consumer, id, ops.RepairOptions{Actor: g.actor, DryRun: *dryRun})
	if err != nil {
		return err
	}
	res := map[string]any{"consumer": consumer, "message_id": id, "poisoned": ok, "dry_run": *dryRun}
	name := clean(consumer) + "/" + clean(id)
	if !ok {
		if out.json() {
			if err := out.emit(res, nil); err != nil {
				return err
			}
		}
		return nothingMatched{name + " is not a poisoned message: nothing to replay"}
	}
	return out.emit(res, func(w *tabwriter.Writer) {
		switch {
		case *dryRun:
			fmt.Fprintf(w, "dry run: %s is poisoned; replay would let its next delivery run the handler\n", name)
		default:
			fmt.Fprintf(w, "%s: its next delivery runs the handler (put it back on its topic, ID unchanged)\n", name)
		}
	})
}

func lookup(ctx context.Context, g *globals, c *command, args []string, out printer) error {
	pos, err := g.parse(g.flags(c), c, args, 2)
	if err != nil {
		return err
	}
	ctx, o, err := g.connect(ctx)
	if err != nil {
		return err
	}
	l, err := o.Lookup(ctx, pos[0], pos[1])
	if err != nil {
		return err
	}
	name := clean(l.Consumer) + "/" + clean(l.MessageID)
	if !l.Processed && l.Attempts == 0 && len(l.Effects) == 0 {
		if out.json() {
			if err := out.emit(l, nil); err != nil {
				return err
			}
		}
		return nothingMatched{name + " was not processed, has no failed attempt and no effect (or was forgotten after Retention)"}
	}
	return out.emit(l, func(w *tabwriter.Writer) {
		switch {
		case l.Poisoned:
			fmt.Fprintf(w, "%s: poisoned at %s\n", name, l.ProcessedAt.Format(time.RFC3339))
		case l.Processed && l.DispatchedAt.IsZero():
			// The claim has no dispatch time until its last effect is sent.
			fmt.Fprintf(w, "%s: processed at %s, its effects not all dispatched yet\n", name, l.ProcessedAt.Format(time.RFC3339Nano))
		case l.Processed:
			// The claim's time is also moved by a discard, and is the commit's for a message
			// that sent nothing: a dispatch is named only from an effect that was sent.
			// A store may set the claim's time at the commit (MySQL): a pending effect is named
			// from the effects.
			var sent time.Time
			discarded, pending := false, false
			for _, e := range l.Effects {
				if e.DispatchedAt.After(sent) {
					sent = e.DispatchedAt
				}
				discarded = discarded || e.State == "discarded"
				pending = pending || e.State == "pending" || e.State == "parked"
			}
			switch {
			case pending:
				fmt.Fprintf(w, "%s: processed at %s, its effects not all dispatched yet\n", name, l.ProcessedAt.Format(time.RFC3339Nano))
			case !sent.IsZero():
				fmt.Fprintf(w, "%s: processed at %s, last dispatch %s\n", name,
					l.ProcessedAt.Format(time.RFC3339Nano), sent.Format(time.RFC3339Nano))
			case discarded:
				fmt.Fprintf(w, "%s: processed at %s, nothing sent: its effects were discarded (last at %s)\n", name,
					l.ProcessedAt.Format(time.RFC3339Nano), l.DispatchedAt.Format(time.RFC3339Nano))
			default:
				// No effect, or the sent ones deleted after the service's EffectRetention.
				fmt.Fprintf(w, "%s: processed at %s, nothing pending since %s\n", name,
					l.ProcessedAt.Format(time.RFC3339Nano), l.DispatchedAt.Format(time.RFC3339Nano))
			}
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

func migrateUp(ctx context.Context, g *globals, c *command, args []string, out printer) error {
	if _, err := g.parse(g.flags(c), c, args, 0); err != nil {
		return err
	}
	ctx, o, err := g.connect(ctx)
	if err != nil {
		return err
	}
	db := g.sqlDB
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
}

func migrateStatus(ctx context.Context, g *globals, c *command, args []string, out printer) error {
	if _, err := g.parse(g.flags(c), c, args, 0); err != nil {
		return err
	}
	ctx, _, err := g.connect(ctx)
	if err != nil {
		return err
	}
	db := g.sqlDB
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

// appliedMigrations returns the versions recorded in the migrations table; none if it does not exist.
func appliedMigrations(ctx context.Context, db *sql.DB, g *globals) (map[int]bool, error) {
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
func migrationsTable(g *globals) (string, error) {
	t, err := g.db.MigrationsTable(g.schema, g.prefix)
	if err != nil {
		return "", usageError{err.Error()}
	}
	return t, nil
}

// migrateSQL prints every migration as one script for the schema and prefix, for psql or a
// migration tool of the team's, followed by the grants of the roles -grant and -operator name.
func migrateSQL(_ context.Context, g *globals, c *command, args []string, out printer) error {
	fs := g.flags(c)
	app := fs.String("grant", "", "also grant this role what the application needs")
	operator := fs.String("operator", "", "also grant this role what an operator needs")
	if _, err := g.parse(fs, c, args, 0); err != nil {
		return err
	}
	stdout := out.w
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
func migrateGrants(_ context.Context, g *globals, c *command, args []string, out printer) error {
	fs := g.flags(c)
	operator := fs.Bool("operator", false, "the role of an operator: may also read the audit table")
	pos, err := g.parse(fs, c, args, 1)
	if err != nil {
		return err
	}
	role := pos[0]
	if g.db.Grants == nil {
		return usageError{"migrate grants: not available for " + g.db.Title}
	}
	grants, err := g.db.Grants(g.schema, g.prefix, role, *operator)
	if err != nil {
		return usageError{err.Error()}
	}
	if out.json() {
		return out.emit(map[string]any{"role": role, "operator": *operator, "statements": grants}, nil)
	}
	fmt.Fprintf(out.w, "%s;\n", strings.Join(grants, ";\n"))
	return nil
}

func cleanup(ctx context.Context, g *globals, c *command, args []string, out printer) error {
	fs := g.flags(c)
	retention := fs.Duration("retention", 0, "the service's Config.Retention (default: as the service recorded it)")
	effectRetention := fs.Duration("effect-retention", 0, "the service's Config.EffectRetention; 0 deletes every dispatched effect (default: -retention, or the service's recorded EffectRetention when longer)")
	force := fs.Bool("force", false, "allow a retention below the service's Retention or redelivery horizon")
	dryRun := fs.Bool("dry-run", false, "count what would be deleted, delete nothing")
	batch := fs.Int("batch", 1000, "rows per batch")
	if _, err := g.parse(fs, c, args, 0); err != nil {
		return err
	}
	if set(fs, "retention") && *retention <= 0 {
		return usageError{fmt.Sprintf("cleanup: -retention %s would forget every processed message ID, and every redelivery would run its handler again: give a positive retention (below the service's, with -force)", *retention)}
	}
	ctx, o, err := g.connect(ctx)
	if err != nil {
		return err
	}
	r, err := o.CheckRetention(ctx, ops.CleanupOptions{Retention: *retention, Force: *force})
	switch {
	case errors.Is(err, ops.ErrRetentionUnknown):
		return usageError{"cleanup: no service has recorded its Retention here yet: give -retention"}
	case err != nil:
		return err
	}
	// Not told how long the service keeps what it dispatched (unset), ops keeps it as long as the
	// claims, never shorter than the service recorded. Deleting young effects takes an explicit
	// value; 0 deletes them all.
	deleteDispatched := set(fs, "effect-retention") && *effectRetention == 0
	if !out.json() {
		verb := "cleaning"
		if *dryRun {
			verb = "dry run"
		}
		effects := "dispatched effects: as long as the claims, or the service's EffectRetention"
		switch {
		case deleteDispatched:
			effects = "every dispatched effect"
		case set(fs, "effect-retention"):
			effects = "dispatched effects " + effectRetention.String()
		}
		fmt.Fprintf(out.w, "%s (retention %s, %s)...\n", verb, r, effects)
	}
	rep, err := o.Cleanup(ctx, ops.CleanupOptions{Actor: g.actor, Retention: r, EffectRetention: *effectRetention, DeleteDispatched: deleteDispatched,
		Force: *force, DryRun: *dryRun, BatchSize: *batch,
		Progress: func(r outboxdriver.CleanupResult) {
			if !out.json() && r.Claims+r.Effects+r.Attempts > 0 {
				fmt.Fprintf(out.w, "\r%d claims, %d effects, %d attempt counters deleted", r.Claims, r.Effects, r.Attempts)
			}
		}})
	if !out.json() && !*dryRun {
		fmt.Fprintln(out.w)
	}
	if err != nil {
		return err
	}
	return out.emit(rep, func(w *tabwriter.Writer) {
		switch {
		case rep.DryRun:
			fmt.Fprintf(w, "would delete %d claims, %d dispatched effects, %d attempt counters, %d expired idempotency keys, %d settled dead letters\n",
				rep.Claims, rep.Effects, rep.Attempts, rep.Keys, rep.DeadLetters)
		case rep.Skipped && rep.Batches > 0:
			fmt.Fprintf(w, "deleted %d claims, %d dispatched effects, %d attempt counters, %d expired idempotency keys, %d settled dead letters in %d batches (audited as %s), then stopped: another process took the cleanup lock between two batches, and goes on with it\n",
				rep.Claims, rep.Effects, rep.Attempts, rep.Keys, rep.DeadLetters, rep.Batches, clean(g.actor))
		case rep.Skipped:
			fmt.Fprintln(w, "another process is cleaning; nothing done")
		default:
			fmt.Fprintf(w, "deleted %d claims, %d dispatched effects, %d attempt counters, %d expired idempotency keys, %d settled dead letters in %d batches (audited as %s)\n",
				rep.Claims, rep.Effects, rep.Attempts, rep.Keys, rep.DeadLetters, rep.Batches, clean(g.actor))
		}
	})
}

// deadlineDialer opens connections whose reads and writes end by deadline, whatever lib/pq sets
// (it clears the deadline of connect_timeout once connected): lib/pq does not watch the context
// while it connects, and a server that accepts and never answers held the command for ever.
type deadlineDialer struct{ deadline time.Time }

func (d deadlineDialer) Dial(network, address string) (net.Conn, error) {
	return d.DialContext(context.Background(), network, address)
}

func (d deadlineDialer) DialTimeout(network, address string, timeout time.Duration) (net.Conn, error) {
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	return d.DialContext(ctx, network, address)
}

func (d deadlineDialer) DialContext(ctx context.Context, network, address string) (net.Conn, error) {
	ctx, cancel := context.WithDeadline(ctx, d.deadline)
	defer cancel()
	var nd net.Dialer
	c, err := nd.DialContext(ctx, network, address)
	if err != nil {
		return nil, err
	}
	dc := &deadlineConn{Conn: c, deadline: d.deadline}
	if err := dc.SetDeadline(time.Time{}); err != nil {
		_ = c.Close()
		return nil, err
	}
	return dc, nil
}

// deadlineConn keeps every deadline set on it no later than its own.
type deadlineConn struct {
	net.Conn
	deadline time.Time
}

func (c *deadlineConn) bound(t time.Time) time.Time {
	if t.IsZero() || t.After(c.deadline) {
		return c.deadline
	}
	return t
}

func (c *deadlineConn) SetDeadline(t time.Time) error     { return c.Conn.SetDeadline(c.bound(t)) }
func (c *deadlineConn) SetReadDeadline(t time.Time) error { return c.Conn.SetReadDeadline(c.bound(t)) }
func (c *deadlineConn) SetWriteDeadline(t time.Time) error {
	return c.Conn.SetWriteDeadline(c.bound(t))
}
