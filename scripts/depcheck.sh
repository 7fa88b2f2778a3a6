#!/usr/bin/env bash
# Builds a throwaway module that imports the library as a service would (outbox, middleware,
# drivers/postgres, drivers/sqlite, outboxtest) and fails if its module graph or go.sum holds
# anything heavy: a broker server or client the library does not use, an SQLite implementation,
# pgx, an OpenTelemetry SDK or exporter, a benchmark peer. (Watermill itself requires the Prometheus client for its metrics component: that one is the foundation's.) Those belong to the e2e, example and
# bench modules, whose requirements a user of the library never downloads.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
go="${GO:-go}"
tmp="$(mktemp -d)"
trap 'rm -rf "${tmp}"' EXIT

cat >"${tmp}/go.mod" <<EOF
module example.com/consumer

go 1.25.0

require github.com/watermill-outbox/outbox v0.0.0

replace github.com/watermill-outbox/outbox => ${root}
EOF
cat >"${tmp}/main.go" <<'EOF'
package main

import (
	_ "github.com/watermill-outbox/outbox"
	_ "github.com/watermill-outbox/outbox/drivers/postgres"
	_ "github.com/watermill-outbox/outbox/drivers/sqlite"
	_ "github.com/watermill-outbox/outbox/middleware"
	_ "github.com/watermill-outbox/outbox/console"
	_ "github.com/watermill-outbox/outbox/ops"
	_ "github.com/watermill-outbox/outbox/outboxtest"
)

func main() {}
EOF

cd "${tmp}"
"${go}" mod tidy >/dev/null
"${go}" build ./...

heavy='nats-io/nats-server|nats-io/nats\.go|watermill-nats|watermill-amqp|watermill-redisstream|redis/go-redis|rabbitmq|modernc\.org/sqlite|mattn/go-sqlite3|jackc/pgx|riverqueue|rbaliyan|go\.opentelemetry\.io/otel/sdk|go\.opentelemetry\.io/otel/exporters|otel/exporters/prometheus|chromedp'
graph="$("${go}" list -m all)"
found="$( { echo "${graph}"; cat go.sum; } | grep -E "${heavy}" | sort -u || true)"
if [[ -n "${found}" ]]; then
	echo "depcheck: a module that imports only the library gets heavy dependencies in its module graph or go.sum:" >&2
	echo "${found}" >&2
	echo "(move the test or tool that needs them into the e2e, example or bench module)" >&2
	exit 1
fi
echo "depcheck: a module importing the library's packages needs $(echo "${graph}" | wc -l) modules, none of them heavy"

# The pgx form (its own module) adds pgx and what pgx needs, nothing else heavy.
mkdir "${tmp}/pgx"
cat >"${tmp}/pgx/go.mod" <<EOF2
module example.com/pgxconsumer

go 1.25.0

require (
	github.com/watermill-outbox/outbox v0.0.0
	github.com/watermill-outbox/outbox/drivers/outboxpgx v0.0.0
)

replace github.com/watermill-outbox/outbox => ${root}

replace github.com/watermill-outbox/outbox/drivers/outboxpgx => ${root}/drivers/outboxpgx
EOF2
cat >"${tmp}/pgx/main.go" <<'EOF2'
package main

import (
	_ "github.com/watermill-outbox/outbox/drivers/outboxpgx"
	_ "github.com/watermill-outbox/outbox/middleware"
)

func main() {}
EOF2
cd "${tmp}/pgx"
"${go}" mod tidy >/dev/null
"${go}" build ./...
pgxHeavy="$(echo "${heavy}" | sed 's/|jackc\/pgx//')"
graph="$("${go}" list -m all)"
found="$( { echo "${graph}"; cat go.sum; } | grep -E "${pgxHeavy}" | sort -u || true)"
if [[ -n "${found}" ]]; then
	echo "depcheck: a module importing the pgx form gets heavy dependencies beyond pgx:" >&2
	echo "${found}" >&2
	exit 1
fi
echo "depcheck: a module importing the pgx form needs $(echo "${graph}" | wc -l) modules: pgx and nothing else heavy"
