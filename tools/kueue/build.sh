#!/usr/bin/env bash
# Builds Kueue's controller manager (kubernetes-sigs/kueue, Apache-2.0) from the Go modules
# pinned in this folder's go.mod/go.sum and caches it outside the checkout, keyed by a hash of
# those files (and of this script), so CI and later runs reuse it:
#   ${BATON_CACHE_DIR:-$HOME/.cache/baton}/kueue/<hash>/kueue
#   ${BATON_CACHE_DIR:-$HOME/.cache/baton}/kueue/<hash>/config/crd/*.yaml      (Kueue's CRDs)
#   ${BATON_CACHE_DIR:-$HOME/.cache/baton}/kueue/<hash>/config/webhook.yaml    (its webhooks)
# The YAML comes out of the same module's config/ (kustomize bases), so it always matches the
# binary. tests/baton_testing/kueue.py installs it on the local cluster and runs the manager.
#
# Prints progress on stderr and the binary's path as the last line of stdout.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
cache_root="${BATON_CACHE_DIR:-$HOME/.cache/baton}/kueue"
hash="$(cat "$here/go.mod" "$here/go.sum" "$here/build.sh" | sha256sum | cut -c1-16)"
dir="$cache_root/$hash"
out="$dir/kueue"

if [ -x "$out" ] && [ -f "$dir/config/webhook.yaml" ]; then
    echo "==> kueue: cached build $out" >&2
    echo "$out"
    exit 0
fi

command -v go >/dev/null || { echo "error: Go is needed to build Kueue: install Go 1.26+" >&2; exit 1; }
version="$(cd "$here" && go list -m -f '{{.Version}}' sigs.k8s.io/kueue)"
echo "==> kueue: building $version from Go modules (first time only; about 10 minutes on a busy 2-core machine)" >&2
mkdir -p "$dir"
tmp="$(mktemp "$dir/.kueue.XXXXXX")"
tmpcfg="$(mktemp -d "$dir/.config.XXXXXX")"
trap 'rm -rf "$tmp" "$tmpcfg"' EXIT
# The version ldflag is what Kueue's own Makefile sets (its log's first line says it).
# GOTOOLCHAIN=local: fail fast rather than fetch another toolchain.
(
    cd "$here"
    GOTOOLCHAIN=local CGO_ENABLED=0 nice -n 10 go build -trimpath \
        -ldflags "-s -w -X sigs.k8s.io/kueue/pkg/version.GitVersion=$version" \
        -o "$tmp" sigs.k8s.io/kueue/cmd/kueue
)
chmod 0755 "$tmp"
# The CRDs and webhook configurations of the very module version the binary was built from.
src="$(cd "$here" && go list -m -f '{{.Dir}}' sigs.k8s.io/kueue)/config/components"
mkdir -p "$tmpcfg/crd"
cp "$src"/crd/bases/*.yaml "$tmpcfg/crd/"
cp "$src/webhook/manifests.yaml" "$tmpcfg/webhook.yaml"
chmod -R u+w "$tmpcfg"  # the module cache is read-only; the copies need not be
rm -rf "$dir/config"
mv "$tmpcfg" "$dir/config"
mv -f "$tmp" "$out"  # rename: a concurrent run never sees a half-written binary
trap - EXIT
echo "==> kueue: built $out" >&2
echo "$out"
