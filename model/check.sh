#!/usr/bin/env bash
# Model-checks model/outbox.pml and model/relays.pml with SPIN (docs/protocol.md): the protocol as fixed must keep every
# invariant, and each old variant must be caught breaking the invariant named for it, so that the
# model is known to see the defects it was written for.
#
#   model/check.sh quick   (make model, part of make test: two to three minutes on 2 cores)
#   model/check.sh full    (make model-full: larger bounds, ten minutes, up to 10 GB)
#
# Each run: spin -a generates the verifier, gcc compiles it (safety only), pan searches every
# state up to the depth bound; a search cut short by the depth bound fails the run.
set -euo pipefail

mode=${1:-quick}
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
for tool in spin gcc; do
	if ! command -v "${tool}" >/dev/null; then
		echo "model: ${tool} is not installed; the protocol's model cannot be checked (apt-get install spin gcc)" >&2
		exit 1
	fi
done
work=$(mktemp -d)
trap 'rm -rf "${work}"' EXIT

# check NAME EXPECT SPIN-FLAGS...: EXPECT is "pass" or the invariant the run must break. States are
# stored hash-compacted: 32 bits of each beside its slot in a 2^25-slot table, so that a state is
# skipped only when two of n states share 57 bits (chance about n^2/2^58: 2e-4 for the quick
# run's 7 million states, 1e-3 for 20 million) at a tenth of the memory of exact storage. pan
# stops at 2 GB (MEMLIM, in MB, and HASHW, the table's 2^n slots, set otherwise for one run), and
# a search cut short by the depth or memory bound fails the run.
check() {
	local name=$1 expect=$2
	shift 2
	local dir="${work}/${name}" cc=(-O2 -w -DSAFETY -DHC4 "-DMEMLIM=${MEMLIM:-2000}") run=(-m50000 "-w${HASHW:-25}")
	local failed=0
	mkdir -p "${dir}"
	trap 'echo "${failed}" >"${dir}/failed"' RETURN
	local model=${MODEL:-outbox.pml}
	cp "${here}/${model}" "${dir}/"
	local start=${SECONDS}
	if ! (cd "${dir}" && spin -a "$@" "${model}" >spin.out 2>&1 && gcc "${cc[@]}" -o pan pan.c >gcc.out 2>&1 &&
		./pan "${run[@]}" >pan.out 2>&1); then
		echo "FAIL ${name}: spin, gcc or pan did not run:" >&2
		cat "${dir}"/spin.out "${dir}"/gcc.out "${dir}"/pan.out 2>/dev/null | tail -20 >&2
		failed=1
		return
	fi
	local out="${dir}/pan.out" took=$((SECONDS - start))
	local states errors violated
	states=$(awk '/states, stored/ {print $1; exit}' "${out}")
	errors=$(sed -n 's/.*errors: \([0-9]*\).*/\1/p' "${out}" | head -1)
	violated=$(sed -n 's/.*assertion violated *!(\([a-z_]*\)).*/\1/p' "${out}" | head -1)
	if grep -qE 'max search depth too small|MEMLIM|out of memory' "${out}"; then
		echo "FAIL ${name}: the search hit its depth or memory bound: $(grep -m1 -E 'depth too small|MEMLIM|out of memory' "${out}")" >&2
		failed=1
		return
	fi
	if [[ ${expect} == pass ]]; then
		if [[ ${errors} == 0 ]]; then
			echo "ok   ${name}: every invariant holds (${states} states, ${took}s; $*)"
		else
			echo "FAIL ${name}: ${errors} error(s), first: ${violated:-$(grep -m1 -E 'pan:1|error' "${out}")} ($*)" >&2
			(cd "${dir}" && spin -t -p "$@" "${model}" 2>&1 | tail -60) >&2 || true
			failed=1
		fi
	else
		if [[ ${violated} == "${expect}" ]]; then
			echo "ok   ${name}: breaks ${expect}, as it should (${took}s; $*)"
		else
			echo "FAIL ${name}: expected a violation of ${expect}, got errors=${errors} ${violated:+(${violated})} ($*)" >&2
			failed=1
		fi
	fi
}

# The runs go in parallel (a core each, where there are several); their lines come in order.
runs=()
start() {
	runs+=("$1")
	check "$@" >"${work}/$1.log" 2>&1 &
}
case ${mode} in
quick)
	# The protocol as fixed: 2 messages, 2 copies each on an optimistic and a pessimistic or
	# database/sql instance, a crash at any step (the database/sql one: 45 million states, the
	# longest run); and 1 message with more crashes and failures, instance 1 of either form.
	start fixed-2msg pass -DNM=2 -DMAXCRASH=1 -DMAXFAIL=0 -DFORM1=ROWS
	start fixed-2msg-pinl pass -DNM=2 -DMAXCRASH=1 -DMAXFAIL=0 -DFORM1=PINL
	start fixed-faults pass -DNM=1 -DMAXCRASH=2 -DMAXFAIL=2
	# The database/sql form whose effects commit in its claim or, spilled, as rows.
	start fixed-spill pass -DNM=1 -DMAXCRASH=2 -DMAXFAIL=2 -DFORM1=PINL -DSPILL
	# The protocol as it was: each defect is found.
	start old-sweep eventually_sent -DNM=1 -DMAXCRASH=1 -DMAXFAIL=1 -DOLD_SWEEP
	start old-round lease_held -DNM=1 -DMAXCRASH=1 -DMAXFAIL=1 -DOLD_ROUND
	start old-blind eventually_sent -DNM=1 -DMAXCRASH=1 -DMAXFAIL=1 -DOLD_BLIND
	start no-xid eventually_sent -DNM=1 -DMAXCRASH=1 -DMAXFAIL=1 -DNO_XID
	# Two relays sharing one key (model/relays.pml): the hand-over between them, as fixed, and
	# the two ways it let a second call of an effect start beside a running one.
	MODEL=relays.pml start relays pass
	MODEL=relays.pml start relays-old-release one_call -DOLD_RELEASE
	MODEL=relays.pml start relays-old-order one_call -DOLD_ORDER
	;;
full)
	# Larger bounds: a failure among 2 messages; 2 messages on a database/sql instance that may
	# spill; 1 message with more crashes and failures and a slower clock (leases and grace of
	# several ticks); each old defect among 2 messages. One at a time: each may take up to 2 GB,
	# the database/sql form's with a failure 6 GB (77 million states, 5 GB and three minutes),
	# with spills 10 GB (105 million states, 8.1 GB and four and a half minutes).
	start fixed-2msg-failure pass -DNM=2 -DMAXCRASH=0 -DMAXFAIL=1 -DFORM1=ROWS && wait
	MEMLIM=6000 HASHW=28 start fixed-2msg-failure-pinl pass -DNM=2 -DMAXCRASH=0 -DMAXFAIL=1 -DFORM1=PINL && wait
	MEMLIM=10000 HASHW=29 start fixed-2msg-spill pass -DNM=2 -DMAXCRASH=1 -DMAXFAIL=0 -DFORM1=PINL -DSPILL && wait
	start fixed-1msg-slow pass -DNM=1 -DMAXCRASH=3 -DMAXFAIL=2 -DTMAX=3 -DGRACE=1 && wait
	start old-sweep-2msg eventually_sent -DNM=2 -DMAXCRASH=1 -DMAXFAIL=1 -DOLD_SWEEP && wait
	start old-round-2msg lease_held -DNM=2 -DMAXCRASH=1 -DMAXFAIL=1 -DOLD_ROUND && wait
	start old-blind-2msg eventually_sent -DNM=2 -DMAXCRASH=1 -DMAXFAIL=0 -DOLD_BLIND
	;;
*)
	echo "usage: $0 quick|full" >&2
	exit 2
	;;
esac
wait
failed=0
for name in "${runs[@]}"; do
	cat "${work}/${name}.log"
	if [[ $(cat "${work}/${name}/failed" 2>/dev/null) != 0 ]]; then
		failed=1
	fi
done
if [[ ${failed} != 0 ]]; then
	echo "model: FAILED" >&2
	exit 1
fi
echo "model: ok"
