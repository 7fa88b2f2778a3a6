#!/usr/bin/env bash
# Alternates relay drains of several commits of the library in one run, against one PostgreSQL,
# so that they can be compared as ratios on a machine whose speed moves between runs.
#
#   OUTBOX_BENCH_DSN=postgres://postgres@127.0.0.1:5432/postgres?sslmode=disable \
#     bench/relaydrain/ab.sh 6 "before=29741a8 main=HEAD" -instances 3 -reuse
#
# Each contender is relaydrain (this directory's main.go) built against that commit's tree: its
# source is exported with git archive into a temporary directory. The contenders run one drain each
# per round, their order rotated from round to round; the extra arguments go to every drain. The
# output has a line per drain: "<name> instances=... effects/s=...".
set -euo pipefail
[ $# -ge 2 ] || { echo "usage: $0 ROUNDS \"name=commit ...\" [relaydrain flags]" >&2; exit 2; }
: "${OUTBOX_BENCH_DSN:?set OUTBOX_BENCH_DSN to a PostgreSQL superuser DSN}"
rounds=$1
read -r -a specs <<<"$2"
shift 2
repo=$(git -C "$(dirname "$0")" rev-parse --show-toplevel)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
names=()
for spec in "${specs[@]}"; do
	name=${spec%%=*} commit=${spec#*=}
	mkdir -p "$work/$name"
	git -C "$repo" archive "$commit" | tar -x -C "$work/$name"
	mkdir -p "$work/$name/bench/relaydrain"
	cp "$repo/bench/relaydrain/main.go" "$work/$name/bench/relaydrain/"
	(cd "$work/$name/bench" && go build -o "$work/relaydrain-$name" ./relaydrain)
	echo "built $name from $(git -C "$repo" rev-parse --short "$commit")" >&2
	names+=("$name")
done
n=${#names[@]}
for ((i = 0; i < rounds; i++)); do
	for ((j = 0; j < n; j++)); do
		name=${names[$(((i + j) % n))]}
		"$work/relaydrain-$name" -label "$name" "$@" || echo "$name failed" >&2
	done
done
