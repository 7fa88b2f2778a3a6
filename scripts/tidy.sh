#!/usr/bin/env bash
# go mod tidy in every module of the repository. go mod tidy works outside the workspace, so a
# module that requires the library at the version of the next release, which the module proxy
# does not have yet, gets the library's modules from a file-system proxy made of this tree.
# Their go.sum lines are dropped afterwards: inside the workspace go.work replaces that version
# with this tree, and the hash of a tree that is not yet tagged would be a guess.
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
go="${GO:-go}"
tmp="$(mktemp -d)"
trap 'rm -rf "${tmp}"' EXIT
lib=github.com/watermill-outbox/outbox

version="$(sed -nE "s#^[[:space:]]*(require[[:space:]]+)?${lib} (v[^[:space:]]+).*#\\2#p" "${repo}/drivers/outboxpgx/go.mod")"
(cd "${repo}" && "${go}" run ./internal/cmd/modproxy -out "${tmp}/proxy" -version "${version}" . drivers/outboxpgx drivers/mysql >/dev/null)
proxy="file://${tmp}/proxy,$("${go}" env GOPROXY)"

# The module cache keeps what it once fetched for a version, and this version is the tree's, not a
# release: a copy cached from an older tree (a package it did not have yet) would win over the
# proxy above. Drop the library's modules at this version from the cache first, and read them
# without the go command's index of module cache directories (GODEBUG=goindex=0), which it keeps
# in the build cache and never checks against a directory extracted again.
modcache="$("${go}" env GOMODCACHE)"
for m in "" /drivers/outboxpgx /drivers/mysql; do
	dir="${modcache}/${lib}${m}@${version}"
	if [ -d "${dir}" ]; then
		chmod -R u+w "${dir}"
		rm -rf "${dir}"
	fi
	rm -f "${modcache}/cache/download/${lib}${m}/@v/${version}."*
done

for mod in . drivers/outboxpgx drivers/mysql e2e bench examples/order-processing internal/kfakeserver; do
	echo "tidy: ${mod}"
	(
		cd "${repo}/${mod}"
		GOWORK=off GOPROXY="${proxy}" GONOSUMDB="${lib}" GOFLAGS=-mod=mod GODEBUG=goindex=0 "${go}" mod tidy
		sed -i -E "\\#^${lib}(/drivers/(outboxpgx|mysql))? #d" go.sum
	)
done
