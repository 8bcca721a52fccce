#!/usr/bin/env bash
# The headline command with no policy flags, on a fresh GPU machine (no saved profile): the job is
# planned (a quick profile is measured and saved first), printed, and run; a model no lossless
# policy fits is refused in one line. Logs go to $LOGS (default: ./headline-logs).
#
#   bash bench/headline_plan.sh /tmp/offload
set -uo pipefail
OFFLOAD=${1:-/tmp/flexoff-offload}
LOGS=${LOGS:-headline-logs}
mkdir -p "$LOGS" "$OFFLOAD"
export XDG_CACHE_HOME=${XDG_CACHE_HOME:-$(mktemp -d)}  # no saved profile: the first run measures one
run() {
  local name=$1; shift
  local start=$(date +%s%N)
  python -m flexoff run "$@" --offload-dir "$OFFLOAD" >"$LOGS/$name.out" 2>"$LOGS/$name.err"
  local code=$?
  local ms=$(( ($(date +%s%N) - start) / 1000000 ))
  printf '%-16s exit %s in %d.%03d s\n' "$name" "$code" $((ms / 1000)) $((ms % 1000))
  grep -E "^(profile|planned|flexoff)" "$LOGS/$name.err" | tail -4
  grep -E "^(policy|weights|total|decode|peak)" "$LOGS/$name.out"
  echo "offload dir after: $(ls -A "$OFFLOAD" | wc -l) entries"
}
run opt-175b --model opt-175b --dummy --quiet
run opt-13b --model opt-13b --dummy --quiet
run opt-30b-16GiB --model opt-30b --dummy --gpu-mem 16GiB --quiet
run opt-66b --model opt-66b --dummy --quiet
