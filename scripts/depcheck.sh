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

# consumer installs a throwaway module NAME that imports the packages given, from the proxy at
# this version with no replace, after `go get` of MODULE, and fails when its graph holds a heavy
# dependency other than the ALLOWED one (an alternative of heavy), named WHAT in the messages.
consumer() {
	local name="$1" module="$2" allowed="$3" what="$4"
	shift 4
	mkdir "${tmp}/${name}"
	printf 'module example.com/%sconsumer\n\ngo 1.25.0\n' "${name}" >"${tmp}/${name}/go.mod"
	{
		printf 'package main\n\nimport (\n'
		for p in "$@"; do printf '\t_ "%s"\n' "${p}"; done
		printf ')\n\nfunc main() {}\n'
	} >"${tmp}/${name}/main.go"
	(
		cd "${tmp}/${name}"
		"${go}" get "${module}@${version}" >/dev/null 2>&1 || "${go}" get "${module}@${version}"
		"${go}" mod tidy >/dev/null
		"${go}" build ./...
		local others graph found
		others="$(echo "|${heavy}|" | sed "s#|${allowed}|#|#; s#^|##; s#|\$##")"
		graph="$("${go}" list -m all)"
		found="$( { echo "${graph}"; cat go.sum; } | grep -E "${others}" | sort -u || true)"
		if [[ -n "${found}" ]]; then
			echo "depcheck: a module importing ${what} gets heavy dependencies beyond ${allowed}:" >&2
			echo "${found}" >&2
			exit 1
		fi
		echo "depcheck: a module importing ${what} needs $(echo "${graph}" | wc -l) modules: ${allowed} and nothing else heavy (installed from a proxy at ${version}, no replace)"
	)
}

# The pgx form (its own module) adds pgx and what pgx needs, nothing else heavy.
consumer pgx "${lib}/drivers/outboxpgx" 'jackc/pgx' 'the pgx form' "${lib}/drivers/outboxpgx" "${lib}/middleware"
# The MySQL driver (its own module) adds go-sql-driver/mysql and what it needs, nothing else heavy.
consumer mysql "${lib}/drivers/mysql" 'go-sql-driver/mysql' 'the MySQL driver' "${lib}" "${lib}/drivers/mysql" "${lib}/middleware"
