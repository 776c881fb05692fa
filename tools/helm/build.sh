#!/usr/bin/env bash
# Builds the helm CLI from the Go modules pinned in this folder's go.mod/go.sum and caches
# the binary outside the checkout, keyed by a hash of those files (and of this script), so
# CI and later runs reuse it:  ${BATON_CACHE_DIR:-$HOME/.cache/baton}/helm/<hash>/helm
#
# Prints progress on stderr and the binary's path as the last line of stdout.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
cache_root="${BATON_CACHE_DIR:-$HOME/.cache/baton}/helm"
hash="$(cat "$here/go.mod" "$here/go.sum" "$here/build.sh" | sha256sum | cut -c1-16)"
out="$cache_root/$hash/helm"

if [ -x "$out" ]; then
    echo "==> helm: cached build $out" >&2
    echo "$out"
    exit 0
fi

command -v go >/dev/null || { echo "error: Go is needed to build helm: install Go 1.26+" >&2; exit 1; }
version="$(cd "$here" && go list -m -f '{{.Version}}' helm.sh/helm/v3)"
# The Kubernetes version helm assumes offline (`helm template`, `helm lint`) comes from the
# client-go it was built with, as in helm's own Makefile; unset, it would be v1.20.
client_go="$(cd "$here" && go list -m -f '{{.Version}}' k8s.io/client-go)"  # v0.37.0
IFS=. read -r kmaj kmin _ <<< "${client_go#v}"
kmaj=$((kmaj + 1))
echo "==> helm: building $version from Go modules (first time only; a few minutes)" >&2
mkdir -p "$cache_root/$hash"
tmp="$(mktemp "$cache_root/$hash/.helm.XXXXXX")"
trap 'rm -f "$tmp"' EXIT
# The version ldflag is what helm's own Makefile sets; without it `helm version` says
# v3.x-unreleased. GOTOOLCHAIN=local: fail fast rather than fetch another toolchain.
(
    cd "$here"
    GOTOOLCHAIN=local CGO_ENABLED=0 nice -n 10 go build -trimpath \
        -ldflags "-s -w -X helm.sh/helm/v3/internal/version.version=$version \
            -X helm.sh/helm/v3/pkg/chartutil.k8sVersionMajor=$kmaj \
            -X helm.sh/helm/v3/pkg/chartutil.k8sVersionMinor=$kmin \
            -X helm.sh/helm/v3/pkg/lint/rules.k8sVersionMajor=$kmaj \
            -X helm.sh/helm/v3/pkg/lint/rules.k8sVersionMinor=$kmin" \
        -o "$tmp" helm.sh/helm/v3/cmd/helm
)
chmod 0755 "$tmp"
mv -f "$tmp" "$out"  # rename: a concurrent run never sees a half-written binary
trap - EXIT
echo "==> helm: built $out" >&2
echo "$out"
