// Command outbox inspects and repairs the outbox tables of a PostgreSQL database, next to a
// running service (see internal/outboxcli for its commands and flags; `outbox -h` prints them).
// For MySQL and MariaDB, drivers/mysql/cmd/outbox-mysql is the same command.
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
