#!/usr/bin/env bash
# The same `flexoff run` from two checkouts, alternately, on one machine: a change's effect on
# throughput, with the machine's drift between runs spread over both. Prints one line a run.
#
#   bash bench/ab_run.sh OLD_CHECKOUT ROUNDS -- RUN_ARGS...
set -uo pipefail
OLD=$1; ROUNDS=$2; shift 3
NEW=$(cd "$(dirname "$0")/.." && pwd)
for round in $(seq "$ROUNDS"); do
  for side in old new; do
    tree=$([ "$side" = old ] && echo "$OLD" || echo "$NEW")
    # An older checkout has no flexoff/__main__.py; its command line is flexoff.cli there.
    module=$([ -f "$tree/flexoff/__main__.py" ] && echo flexoff || echo flexoff.cli)
    total=$(cd "$tree" && PYTHONPATH="$tree:${SITE:-}" python -m "$module" run "$@" 2>/dev/null | grep -E "^total")
    echo "round $round $side $total"
  done
done
