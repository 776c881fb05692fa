#!/usr/bin/env bash
# Runs one part of `make build` (see the Makefile's SETUP_PARTS) so that several can run side by
# side and still be read: every line the part prints is prefixed with its name, a part that
# has printed nothing for a minute is reported as still running, and the end says how long it
# took. The part's exit status is this script's, so one failed part fails the whole build.
#
#   tools/setup-part.sh NAME COMMAND [ARG...]
set -uo pipefail

if [[ $# -lt 2 ]]; then
    echo "usage: $0 NAME COMMAND [ARG...]" >&2
    exit 2
fi
name="$1"
shift
start=$SECONDS
elapsed() { printf '%dm%02ds' $(((SECONDS - start) / 60)) $(((SECONDS - start) % 60)); }

"$@" 2>&1 | {
    while true; do
        if IFS= read -r -t ${SETUP_QUIET_SECONDS:-60} line; then
            printf '[%s] %s\n' "$name" "$line"
        elif (($? > 128)); then  # read timed out: nothing printed for a minute
            [[ -n "$line" ]] && printf '[%s] %s\n' "$name" "$line"  # a line cut by the timeout
            printf '[%s] still running (%s)\n' "$name" "$(elapsed)"
        else  # end of output: the command has finished (its last line may lack a newline)
            [[ -n "$line" ]] && printf '[%s] %s\n' "$name" "$line"
            break
        fi
    done
}
status=$?
if ((status != 0)); then
    printf '[%s] FAILED (exit %d) after %s; its output is above\n' "$name" "$status" "$(elapsed)" >&2
    exit "$status"
fi
printf '[%s] ready (%s)\n' "$name" "$(elapsed)"
