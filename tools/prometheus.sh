#!/usr/bin/env bash
# Makes sure a real Prometheus server and promtool are on this machine, for the tests in
# tests/deploy/ (promtool checks the alert rules; the server scrapes real sidecars and
# runs every dashboard and alert query). Nothing can be downloaded here except through
# package registries, so this installs Debian's `prometheus` package, which ships both.
#
# Idempotent: does nothing when both binaries are already on PATH. Prints the path of
# the prometheus binary as its last line.
set -euo pipefail

have_all() { command -v prometheus >/dev/null 2>&1 && command -v promtool >/dev/null 2>&1; }

if ! have_all; then
    if [ "$(id -u)" -ne 0 ]; then
        echo "error: prometheus/promtool are missing and installing them needs root:" \
            "run 'sudo apt-get update && sudo apt-get install -y prometheus'" >&2
        exit 1
    fi
    echo "==> installing Debian's prometheus package (server + promtool)" >&2
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq >&2
    # --no-install-recommends keeps out the node exporter and friends; the package's
    # post-install starts a system service only where systemd runs, which the tests
    # never rely on: they start their own server on a free loopback port.
    apt-get install -y -qq --no-install-recommends prometheus >&2
    have_all || {
        echo "error: the prometheus package installed but prometheus/promtool are not on PATH" >&2
        exit 1
    }
fi
echo "==> $(prometheus --version 2>&1 | head -n1)" >&2
command -v prometheus
