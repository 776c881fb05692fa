#!/usr/bin/env bash
# Run tests many times beside CPU-burning processes, to find the flakes a loaded CI machine
# shows before CI does (issue #26). Every run's result, time and the load average are printed;
# the script exits 1 if any run failed, and keeps each failed run's log.
#
#   tools/stress-suite.sh [-n RUNS] [-b BURNERS] [-- PYTEST_ARGS...]
#
# Defaults: 3 runs of every cluster-marked test (`-m cluster`, on two workers as `make test`
# runs them: `-n 2 --dist loadfile`) beside 1 burner (on 2 cores a load average of 5-8, above
# what the suite itself makes). For example:
#   tools/stress-suite.sh -n 5 -b 2 -- tests/operator/test_recovery_cluster.py
# Needs `make build` first (.venv/, the local cluster's binaries).
set -euo pipefail
cd "$(dirname "$0")/.."
runs=3
burners=1
while [ $# -gt 0 ]; do
    case "$1" in
        -n) runs=$2; shift 2 ;;
        -b) burners=$2; shift 2 ;;
        --) shift; break ;;
        -h|--help) sed -n '2,12p' "$0"; exit 0 ;;
        *) echo "unknown option $1 (see $0 --help)" >&2; exit 2 ;;
    esac
done
args=("$@")
[ ${#args[@]} -gt 0 ] || args=(-m cluster -n 2 --dist loadfile)
py=.venv/bin/python
[ -x "$py" ] || { echo "no .venv/: run 'make build' first" >&2; exit 2; }

pids=()
stop_burners() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; }
trap stop_burners EXIT
for _ in $(seq "$burners"); do
    # A pure CPU loop: it competes for the cores, not for memory or disk.
    "$py" -c 'while True: pass' &
    pids+=($!)
done

logdir=$(mktemp -d -t baton-stress.XXXXXX)
failed=0
printf '%-4s %-7s %-8s %-18s %s\n' run result seconds "load (1/5/15 min)" summary
for i in $(seq "$runs"); do
    log="$logdir/run-$i.log"
    start=$SECONDS
    rc=0
    "$py" -m pytest -q -p no:cacheprovider "${args[@]}" >"$log" 2>&1 || rc=$?
    took=$((SECONDS - start))
    load=$(cut -d' ' -f1-3 /proc/loadavg)
    summary=$(grep -E '^(=+ )?[0-9]+ (passed|failed)|(passed|failed|error)' "$log" | tail -1 | tr -d '=')
    result=ok
    if [ "$rc" -ne 0 ]; then result=FAILED; failed=$((failed + 1)); fi
    printf '%-4s %-7s %-8s %-18s %s\n' "$i" "$result" "$took" "$load" "$summary"
    if [ "$rc" -ne 0 ]; then
        grep -E '^(FAILED|ERROR) ' "$log" | sed 's/^/     /' || true
        echo "     log: $log"
    else
        rm -f "$log"
    fi
done
echo "$failed of $runs runs failed"
[ "$failed" -eq 0 ]
