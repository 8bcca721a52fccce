#!/usr/bin/env bash
# CPU attention over part of the host cache while the rest travels, against plain CPU attention:
# the given policy files (bench/split_policies: split 1 beside the split the cost model picks, or
# a probe where it picks none), run alternately ROUNDS times on this machine, so that the machine's
# drift spreads over all of them. OPT-30B fp16, dummy weights, 16 GiB GPU cap, prompt 512,
# generate 32, two blocks of prompts (MODEL=... for another model). Prints one line a run.
#
#   bash bench/split_attention.sh ROUNDS POLICY.json... [-- EXTRA RUN ARGS]
set -uo pipefail
ROUNDS=$1; shift
files=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do files+=("$1"); shift; done
[ "${1:-}" = "--" ] && shift
ROOT=$(cd "$(dirname "$0")/.." && pwd)
OFFLOAD=${OFFLOAD_DIR:-/tmp/flexoff-split}
mkdir -p "$OFFLOAD"
for round in $(seq "$ROUNDS"); do
  for file in "${files[@]}"; do
    prompts=$(python -c "import json, sys; p = json.load(open(sys.argv[1])); \
print(2 * p['gpu_batch_size'] * p['num_gpu_batches'])" "$file")
    figures=$(cd "$ROOT" && PYTHONPATH="$ROOT" python -m flexoff run --model "${MODEL:-opt-30b}" --dummy --policy "$file" \
      --gpu-mem 16GiB --prompt-len 512 --gen-len 32 --num-prompts "$prompts" --ignore-eos --warmup --quiet \
      --offload-dir "$OFFLOAD" "$@" 2>&1 | grep -E "^(decode|total|peak)" | tr -s ' ' | paste -sd ';')
    echo "round $round $(basename "$file" .json): $figures"
  done
done
