// Command outbox inspects and repairs the outbox tables of a PostgreSQL database, next to a
// running service:
//
//	outbox [flags] status [-retention D]
//	outbox [flags] parked list|groups|retry|discard [-id N]... [-topic T] [-consumer C] [-older-than D] [-error TEXT] [-all] ...
//	outbox [flags] failing list [-consumer C] [-limit N]
//	outbox [flags] dead list|groups|retry|discard|now ...
//	outbox [flags] replay [-dry-run] CONSUMER MESSAGE_ID
//	outbox [flags] lookup CONSUMER MESSAGE_ID
//	outbox [flags] migrate up|status|sql|grants ...
//	outbox [flags] cleanup [-retention D] [-effect-retention D] [-force] [-dry-run] [-batch N]
//	outbox help [COMMAND [SUBCOMMAND]]
//
// Global flags, before or after the command: -dsn (default $OUTBOX_DSN, then $DATABASE_URL; lib/pq
// format), -members FILE and -member NAME (the databases of a tenant.Set: status shows them all,
// every other command needs -member), -schema, -prefix, -o text|json, -actor (default $USER), -timeout. `outbox COMMAND -h`
// prints the help of a command, with its flags and their defaults, and needs no database. Exit
// status: 0 done; 1 failed, or nothing matched; 2 a mistake in the command line. Every change
// (retry, discard, replay, cleanup) is written to the audit table with the actor; status shows
// the latest. Text output escapes the control characters of what it prints from the tables; the
// password of the DSN is never printed.
// The commands are in internal/outboxcli; for MySQL and MariaDB, drivers/mysql/cmd/outbox-mysql
// is the same command.
//
// Install it with: go install github.com/watermill-outbox/outbox/cmd/outbox@latest
package main

import (
	"context"
	"io"
	"os"

	_ "github.com/lib/pq"

	"github.com/watermill-outbox/outbox/internal/outboxcli"
)

func main() {
	os.Exit(run(context.Background(), os.Args[1:], os.Stdout, os.Stderr, os.Getenv))
}

func run(ctx context.Context, args []string, stdout, stderr io.Writer, getenv func(string) string) int {
	return outboxcli.Run(ctx, outboxcli.PostgreSQL(), args, stdout, stderr, getenv)
}
