#!/usr/bin/env bash
# beside.sh BACKGROUND STEP...: runs the shell command BACKGROUND beside the STEPs, which run one
# after the other (the first that fails ends them), waits for BACKGROUND, and then prints its
# output whole, so that the two never interleave. Fails when BACKGROUND or a STEP failed.
#
# make test runs the pgx form's tests this way: their fault campaign spends most of its eleven
# minutes waiting (for leases, retries, a database held down), with the machine's two cores
# mostly idle, while the MySQL driver's, the example's and the end-to-end tests take about as long.
set -uo pipefail

if [[ $# -lt 2 ]]; then
	echo "usage: $0 BACKGROUND STEP..." >&2
	exit 2
fi
bg=$1
shift
log=$(mktemp)
start=${SECONDS}
echo "${bg}    (beside the steps below; its output follows them)"
bash -c "${bg}" >"${log}" 2>&1 &
pid=$!
# Interrupted, the background command goes too.
trap 'kill "${pid}" 2>/dev/null; rm -f "${log}"' EXIT
rc=0
for step in "$@"; do
	echo "${step}"
	if ! bash -c "${step}"; then
		rc=1
		echo "beside.sh: a step failed; waiting for the background command to end" >&2
		break
	fi
done
wait "${pid}"
bgrc=$?
echo "==> ${bg}: exit ${bgrc} after $((SECONDS - start))s, its output:"
cat "${log}"
if [[ ${bgrc} -ne 0 ]]; then
	echo "beside.sh: failed (exit ${bgrc}): ${bg}" >&2
	rc=1
fi
exit "${rc}"
