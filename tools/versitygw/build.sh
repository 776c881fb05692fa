#!/usr/bin/env bash
# Builds the versitygw S3 gateway (Versity, Apache-2.0) from the Go modules pinned in this
# folder's go.mod/go.sum and caches the binary outside the checkout, keyed by a hash of those
# files (and of this script), so CI and later runs reuse it:
#   ${BATON_CACHE_DIR:-$HOME/.cache/baton}/versitygw/<hash>/versitygw
# The tests (tests/baton_testing/s3.py), bench/s3.py and the demo's `--storage s3` start it
# with its POSIX backend on a temporary folder.
#
# Prints progress on stderr and the binary's path as the last line of stdout.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
cache_root="${BATON_CACHE_DIR:-$HOME/.cache/baton}/versitygw"
hash="$(cat "$here/go.mod" "$here/go.sum" "$here/build.sh" | sha256sum | cut -c1-16)"
out="$cache_root/$hash/versitygw"

if [ -x "$out" ]; then
    echo "==> versitygw: cached build $out" >&2
    echo "$out"
    exit 0
fi

command -v go >/dev/null || { echo "error: Go is needed to build versitygw: install Go 1.26+" >&2; exit 1; }
version="$(cd "$here" && go list -m -f '{{.Version}}' github.com/versity/versitygw)"
echo "==> versitygw: building $version from Go modules (first time only; a few minutes)" >&2
mkdir -p "$cache_root/$hash"
tmp="$(mktemp "$cache_root/$hash/.versitygw.XXXXXX")"
trap 'rm -f "$tmp"' EXIT
# main.Version is what versitygw's own Makefile sets (`versitygw --version`).
# GOTOOLCHAIN=local: fail fast rather than fetch another toolchain.
(
    cd "$here"
    GOTOOLCHAIN=local CGO_ENABLED=0 nice -n 10 go build -trimpath \
        -ldflags "-s -w -X main.Version=$version -X main.Build=modules" \
        -o "$tmp" github.com/versity/versitygw/cmd/versitygw
)
chmod 0755 "$tmp"
mv -f "$tmp" "$out"  # rename: a concurrent run never sees a half-written binary
trap - EXIT
echo "==> versitygw: built $out" >&2
echo "$out"
