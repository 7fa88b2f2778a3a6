#!/usr/bin/env bash
# Tags a release of the library's modules together: the root module
# (github.com/watermill-outbox/outbox), the pgx driver
# (github.com/watermill-outbox/outbox/drivers/outboxpgx, tag drivers/outboxpgx/VERSION) and the
# MySQL driver (github.com/watermill-outbox/outbox/drivers/mysql, tag drivers/mysql/VERSION).
#
#   scripts/release.sh v0.2.0            # on a clean main: bump, commit, tag; prints the push
#   scripts/release.sh --dry-run v0.2.0  # the same in a scratch copy of the work tree, then a
#                                        # throwaway module installs the tagged trees (no replace)
#
# The modules require each other at the version being released (a user's build resolves those
# requirements from the module proxy; it ignores replace directives), and go.work ties them to
# the work tree for development. So a release commit sets every such requirement, and the
# go.work replacement of that version, to VERSION, and both tags point at that commit: the
# driver at VERSION requires exactly the library at VERSION. See docs/releasing.md.
set -euo pipefail

usage() { echo "usage: scripts/release.sh [--dry-run] vMAJOR.MINOR.PATCH[-PRE]" >&2; exit 2; }
dry_run=false
version=""
for arg in "$@"; do
	case "${arg}" in
	--dry-run) dry_run=true ;;
	v*) version="${arg}" ;;
	*) usage ;;
	esac
done
[[ "${version}" =~ ^v[0-9]+\.[0-9]+\.[0-9]+(-[0-9A-Za-z.-]+)?$ ]] || usage
[[ "${version}" != v0.0.0 ]] || { echo "release: v0.0.0 is not a release" >&2; exit 2; }

go="${GO:-go}"
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
lib=github.com/watermill-outbox/outbox
pgx="${lib}/drivers/outboxpgx"
mysql="${lib}/drivers/mysql"
# The modules that require the library (or its driver); only the library's own are tagged.
dependents=(drivers/outboxpgx drivers/mysql e2e bench examples/order-processing)
tags=("${version}" "drivers/outboxpgx/${version}" "drivers/mysql/${version}")

tmp="$(mktemp -d)"
trap 'rm -rf "${tmp}"' EXIT

work="${repo}"
if ${dry_run}; then
	# A scratch repository holding what `git commit -a` plus the untracked files would hold, so
	# that the dry run checks the work tree as it is (make test runs it on uncommitted edits).
	work="${tmp}/repo"
	mkdir "${work}"
	(cd "${repo}" && git ls-files -z --cached --others --exclude-standard | xargs -0 -r sh -c 'for f; do [ -f "$f" ] && printf "%s\0" "$f"; done' sh | tar --null -T - -cf -) | tar -C "${work}" -xf -
	git -C "${work}" init -q
	git -C "${work}" add -A
	git -C "${work}" -c user.name=release -c user.email=release@localhost commit -q -m "work tree"
else
	if [[ -n "$(git -C "${work}" status --porcelain)" ]]; then
		echo "release: the work tree has uncommitted changes" >&2
		exit 1
	fi
fi
for tag in "${tags[@]}"; do
	if git -C "${work}" rev-parse -q --verify "refs/tags/${tag}" >/dev/null; then
		echo "release: tag ${tag} exists already" >&2
		exit 1
	fi
done

# The version the dependents require now: one version for all, or the tree is inconsistent.
required() { sed -nE "s#^[[:space:]]*(require[[:space:]]+)?$1 (v[^[:space:]]+).*#\\2#p" "$2"; }
previous="$(required "${lib}" "${work}/drivers/outboxpgx/go.mod")"
for mod in "${dependents[@]}"; do
	for dep in "${lib}" "${pgx}" "${mysql}"; do
		have="$(required "${dep}" "${work}/${mod}/go.mod")"
		if [[ -n "${have}" && "${have}" != "${previous}" ]]; then
			echo "release: ${mod}/go.mod requires ${dep} ${have}, not ${previous} as drivers/outboxpgx does" >&2
			exit 1
		fi
		if [[ -n "${have}" ]]; then
			(cd "${work}/${mod}" && GOWORK=off "${go}" mod edit -require="${dep}@${version}")
		fi
	done
done
(
	cd "${work}"
	"${go}" work edit \
		-dropreplace="${lib}@${previous}" -dropreplace="${pgx}@${previous}" -dropreplace="${mysql}@${previous}" \
		-replace="${lib}@${version}=./" -replace="${pgx}@${version}=./drivers/outboxpgx" -replace="${mysql}@${version}=./drivers/mysql"
)
echo "release: the modules require each other at ${version} (was ${previous})"

# Every module still resolves its packages in the workspace at the new version; a real release
# also builds and vets them (make test vets this tree already, so the dry run stops at loading:
# building five modules again in a scratch directory takes minutes).
for mod in . "${dependents[@]}"; do
	(cd "${work}/${mod}" && "${go}" list -deps -test ./... >/dev/null)
	if ! ${dry_run}; then
		(cd "${work}/${mod}" && "${go}" build ./... && "${go}" vet ./... >/dev/null)
	fi
done

git -C "${work}" add -A
git -C "${work}" -c user.name="$(git -C "${repo}" config user.name || echo release)" \
	-c user.email="$(git -C "${repo}" config user.email || echo release@localhost)" \
	commit -q -m "Release ${version}: the library and its pgx and MySQL drivers require each other at ${version}"
for tag in "${tags[@]}"; do
	git -C "${work}" -c user.name=release -c user.email=release@localhost tag -a -m "${tag}" "${tag}"
done

# What the tags hold installs as a user installs it: a throwaway module without replace
# directives resolves both modules at ${version} from a file-system proxy made of the tags' tree.
mkdir "${tmp}/tree"
git -C "${work}" archive "${version}" | tar -C "${tmp}/tree" -xf -
[[ "$(git -C "${work}" rev-parse "${tags[0]}^{commit}")" == "$(git -C "${work}" rev-parse "${tags[1]}^{commit}")" ]]
DEPCHECK_ROOT="${tmp}/tree" GO="${go}" "${work}/scripts/depcheck.sh"

if ${dry_run}; then
	echo "release: dry run: ${tags[*]} made in a scratch copy; nothing changed here"
else
	echo "release: tagged ${tags[*]}; publish with:"
	echo "  git push origin HEAD ${tags[*]}"
fi
