#!/usr/bin/env bash
# Builds a throwaway module that imports the library as a service would (outbox, middleware,
# drivers/postgres, drivers/sqlite, outboxtest) and fails if its module graph or go.sum holds
# anything heavy: a broker server or client the library does not use, an SQLite implementation,
# pgx, an OpenTelemetry SDK or exporter, a benchmark peer. (Watermill itself requires the Prometheus client for its metrics component: that one is the foundation's.) Those belong to the e2e, example and
# bench modules, whose requirements a user of the library never downloads.
#
# The throwaway modules have no replace directive: they resolve the library and the pgx
# driver as a user's build does, from a module proxy, here a file-system one
# (internal/cmd/modproxy) that serves the tree at the version the modules require of each
# other (the version the next release tags). So this also checks that the modules install as
# README says, once for the database/sql form and once for the pgx form.
#
# DEPCHECK_ROOT names another tree to check (scripts/release.sh --dry-run passes the tree of
# the tags it made); the default is this repository's work tree.
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
root="$(cd "${DEPCHECK_ROOT:-${repo}}" && pwd)"
go="${GO:-go}"
tmp="$(mktemp -d)"
trap 'rm -rf "${tmp}"' EXIT

lib=github.com/watermill-outbox/outbox
version="$(sed -nE "s#^[[:space:]]*(require[[:space:]]+)?${lib} (v[^[:space:]]+).*#\\2#p" "${root}/drivers/outboxpgx/go.mod")"
if [[ -z "${version}" ]]; then
	echo "depcheck: drivers/outboxpgx/go.mod does not require ${lib} at a version" >&2
	exit 1
fi
# A user's build ignores replace directives in the modules it requires, and v0.0.0 is no tag:
# the modules require each other at the release version, and go.work ties them locally.
for mod in drivers/outboxpgx drivers/mysql e2e bench examples/order-processing; do
	if grep -nE "^[[:space:]]*(replace[[:space:]]+)?${lib}(/[^[:space:]]*)?( v[^[:space:]]+)? =>" "${root}/${mod}/go.mod" >&2; then
		echo "depcheck: ${mod}/go.mod replaces a module of this repository (go.work ties them; see docs/releasing.md)" >&2
		exit 1
	fi
done
if [[ "${version}" == v0.0.0 || "${version}" == v0.0.0-* ]]; then
	echo "depcheck: drivers/outboxpgx/go.mod requires ${lib} ${version}, which no release tags" >&2
	exit 1
fi
(cd "${repo}" && "${go}" run ./internal/cmd/modproxy -out "${tmp}/proxy" -version "${version}" "${root}" "${root}/drivers/outboxpgx" "${root}/drivers/mysql" >/dev/null)

# What a user's environment has, plus the file-system proxy in front for this module path
# (which no checksum database knows yet). No go.work applies out here (GOWORK=off makes sure).
export GOWORK=off GOFLAGS=-mod=mod
export GONOSUMDB="${lib}"
# The module cache is a fresh one, so that a version of the library cached by an earlier run
# cannot stand in for this tree; the other modules come from the machine's cache behind it.
cache="$("${go}" env GOMODCACHE)"
export GOPROXY="file://${tmp}/proxy,file://${cache}/cache/download,$("${go}" env GOPROXY)"
export GOMODCACHE="${tmp}/modcache"
export GOFLAGS="${GOFLAGS} -modcacherw"

mkdir "${tmp}/sql"
cat >"${tmp}/sql/go.mod" <<EOF
module example.com/consumer

go 1.25.0
EOF
cat >"${tmp}/sql/main.go" <<'EOF'
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

cd "${tmp}/sql"
"${go}" get "${lib}@${version}" >/dev/null 2>&1 || "${go}" get "${lib}@${version}"
"${go}" mod tidy >/dev/null
"${go}" build ./...

heavy='go-sql-driver/mysql|nats-io/nats-server|nats-io/nats\.go|watermill-nats|watermill-amqp|watermill-redisstream|redis/go-redis|rabbitmq|modernc\.org/sqlite|mattn/go-sqlite3|jackc/pgx|riverqueue|rbaliyan|go\.opentelemetry\.io/otel/sdk|go\.opentelemetry\.io/otel/exporters|otel/exporters/prometheus|chromedp|watermill-kafka|sarama|twmb/franz-go'
graph="$("${go}" list -m all)"
found="$( { echo "${graph}"; cat go.sum; } | grep -E "${heavy}" | sort -u || true)"
if [[ -n "${found}" ]]; then
	echo "depcheck: a module that imports only the library gets heavy dependencies in its module graph or go.sum:" >&2
	echo "${found}" >&2
	echo "(move the test or tool that needs them into the e2e, example or bench module)" >&2
	exit 1
fi
echo "depcheck: a module importing the library's packages needs $(echo "${graph}" | wc -l) modules, none of them heavy (installed from a proxy at ${version}, no replace)"

# The pgx form (its own module) adds pgx and what pgx needs, nothing else heavy.
mkdir "${tmp}/pgx"
cat >"${tmp}/pgx/go.mod" <<EOF2
module example.com/pgxconsumer

go 1.25.0
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
"${go}" get "${lib}/drivers/outboxpgx@${version}" >/dev/null 2>&1 || "${go}" get "${lib}/drivers/outboxpgx@${version}"
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
echo "depcheck: a module importing the pgx form needs $(echo "${graph}" | wc -l) modules: pgx and nothing else heavy (installed from a proxy at ${version}, no replace)"

# The MySQL driver (its own module) adds go-sql-driver/mysql and what it needs, nothing else heavy.
mkdir "${tmp}/mysql"
cat >"${tmp}/mysql/go.mod" <<EOF3
module example.com/mysqlconsumer

go 1.25.0
EOF3
cat >"${tmp}/mysql/main.go" <<'EOF3'
package main

import (
	_ "github.com/watermill-outbox/outbox"
	_ "github.com/watermill-outbox/outbox/drivers/mysql"
	_ "github.com/watermill-outbox/outbox/middleware"
)

func main() {}
EOF3
cd "${tmp}/mysql"
"${go}" get "${lib}/drivers/mysql@${version}" >/dev/null 2>&1 || "${go}" get "${lib}/drivers/mysql@${version}"
"${go}" mod tidy >/dev/null
"${go}" build ./...
mysqlHeavy="$(echo "${heavy}" | sed 's/go-sql-driver\/mysql|//')"
graph="$("${go}" list -m all)"
found="$( { echo "${graph}"; cat go.sum; } | grep -E "${mysqlHeavy}" | sort -u || true)"
if [[ -n "${found}" ]]; then
	echo "depcheck: a module importing the MySQL driver gets heavy dependencies beyond go-sql-driver/mysql:" >&2
	echo "${found}" >&2
	exit 1
fi
echo "depcheck: a module importing the MySQL driver needs $(echo "${graph}" | wc -l) modules: go-sql-driver/mysql and nothing else heavy (installed from a proxy at ${version}, no replace)"
