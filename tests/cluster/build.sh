#!/usr/bin/env bash
# Builds the localcluster binary (control plane + node agents + kubectl, see README.md) into
# ${BATON_CACHE_DIR:-~/.cache/baton}/localcluster/<hash>/, where <hash> covers build.sh, go.mod,
# go.sum and every *.go file here, so a cached binary is reused until any of them changes.
# The last line of output is the binary's path. A cold build takes 10-25 minutes on 2 cores.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
cd "$here"
export GOTOOLCHAIN=local
export GOFLAGS="${GOFLAGS:-} -buildvcs=false"

if ! command -v go >/dev/null 2>&1; then
    echo "build.sh: 'go' not found; install Go 1.26 or newer (see tests/cluster/README.md)" >&2
    exit 1
fi

# The binaries report the Kubernetes version they are built from (the default is
# v0.0.0-master, which version checks in kubectl, Helm and clients reject or warn about).
k8s_version="$(awk '$1 == "k8s.io/kubernetes" && $2 ~ /^v/ {print $2; exit}' go.mod)"
minor="$(echo "$k8s_version" | cut -d. -f2)"
ldflags="-s -w"
for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
    ldflags+=" -X $pkg.gitVersion=$k8s_version -X $pkg.gitMajor=1 -X $pkg.gitMinor=$minor"
    ldflags+=" -X $pkg.gitTreeState=clean"
done

hash="$({
    cat build.sh go.mod go.sum
    find . -name '*.go' -type f | LC_ALL=C sort | while read -r f; do
        printf '%s\n' "$f"
        cat "$f"
    done
} | sha256sum | cut -c1-16)"
out_dir="${BATON_CACHE_DIR:-$HOME/.cache/baton}/localcluster/$hash"
bin="$out_dir/localcluster"

if [[ -x "$bin" ]]; then
    echo "localcluster: cached build $hash"
    echo "$bin"
    exit 0
fi

mkdir -p "$out_dir"
# One build at a time per hash (parallel test runs share the cache).
exec 9>"$out_dir/.lock"
flock 9
if [[ -x "$bin" ]]; then
    echo "$bin"
    exit 0
fi

start=$(date +%s)
elapsed() { echo "$(( ($(date +%s) - start) / 60 ))m$(( ($(date +%s) - start) % 60 ))s"; }

echo "localcluster: building $hash (k8s.io/kubernetes control plane; a cold build takes 10-25 min on 2 cores)"
echo "localcluster: downloading modules if needed (about 700 MB the first time) ..."
go mod download
total="$(go list -deps . 2>/dev/null | wc -l)"
echo "localcluster: [$(elapsed)] compiling up to $total packages (already-cached packages are skipped)"

log="$out_dir/build.log"
( while sleep 60; do echo "localcluster: [$(elapsed)] still building ..."; done ) &
ticker=$!
trap 'kill "$ticker" 2>/dev/null || true' EXIT
trap 'exit 130' INT TERM  # runs the EXIT trap, so the ticker does not outlive us

status=0
go build -v -trimpath -ldflags "$ldflags" -o "$bin.tmp" . 2>&1 | tee "$log" | {
    n=0
    while read -r line; do
        n=$((n + 1))
        if (( n % 100 == 0 )); then
            echo "localcluster: [$(elapsed)] compiled $n packages (of up to $total)"
        fi
        case "$line" in
            *.go:*|*error*|*cannot*) echo "$line" ;;
        esac
    done
} || status=$?
if [[ $status -ne 0 || ! -x "$bin.tmp" ]]; then
    echo "localcluster: build failed after $(elapsed); full log: $log" >&2
    rm -f "$bin.tmp"
    exit 1
fi
mv "$bin.tmp" "$bin"
ln -sf localcluster "$out_dir/kubectl"
echo "localcluster: built in $(elapsed) ($(du -h "$bin" | cut -f1)); kubectl: $out_dir/kubectl"
echo "$bin"
