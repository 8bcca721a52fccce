#!/usr/bin/env bash
# The planner on the GPU machine's Python 3.12 (torch with CUDA, transformers, no network), with
# flexoff's other dependencies at their newest releases: the wheels bench/py312_wheels.sh put in
# .whl/. Runs the planner tests, `flexoff search` on every policy in policies/ with the profile it
# was searched on, the README's first command, and a job the GPU cannot hold (planned by the LP).
# Prints the versions it ran with; logs go to $OUT (if set) or /tmp/py312-check.
#   bench/py312_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
LOGS=${OUT:-/tmp/py312-check}
SITE=${SITE:-/tmp/site}
WHEELS=${WHEELS:-.whl}
mkdir -p "$LOGS"
ls "$WHEELS"/*.whl > /dev/null || { echo "py312_check.sh: no wheels in $WHEELS: run bench/py312_wheels.sh first" >&2; exit 1; }

python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$WHEELS"/*.whl
export PYTHONPATH=$SITE:$PWD

failed=()
step() {  # step NAME COMMAND...: run it, its output also in $LOGS/NAME.log; go on if it fails
    local name=$1; shift
    echo "== $name: $*"
    if "$@" 2>&1 | tee "$LOGS/$name.log"; then echo "== $name: ok"; else echo "== $name: FAILED"; failed+=("$name"); fi
}

versions() {
    python3 --version
    git log -1 --format='flexoff %h %s' 2>/dev/null || true
    python3 - <<'PY' || return 1
import importlib.metadata, importlib.util

for name in ("torch", "numpy", "pulp", "highspy", "psutil", "tqdm", "safetensors", "transformers", "tokenizers",
             "huggingface_hub", "accelerate", "pytest", "hypothesis"):
    try:
        version = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        print(f"{name:16} not installed")
        continue
    spec = importlib.util.find_spec(name)
    print(f"{name:16} {version:12} {spec.origin if spec else '?'}")
import pulp, torch
print("LP solvers available:", pulp.listSolvers(onlyAvailable=True))
print("CUDA:", torch.version.cuda, torch.cuda.get_device_name() if torch.cuda.is_available() else "none")
PY
    python3 -m pip list --path "$SITE"
}
step versions versions

# TESTS: another selection, for a dry run elsewhere
read -r -a tests <<< "${TESTS:-tests/planner tests/test_default_plan.py}"
# The planner's tests are CPU tests: a few run a job under a GPU cap sized for a CPU's budget, which
# CUDA's allocator, holding the job to it for real, refuses.
step planner-tests env CUDA_VISIBLE_DEVICES= python3 -m pytest -q -p no:cacheprovider -o addopts="" -m "not gpu" \
    "${tests[@]}"

for file in policies/*.json; do
    name=$(basename "$file" .json)              # e.g. opt-175b-4bit.t4
    model=${name%%.*}; hardware=${name#*.}
    compress=off; [[ $model == *-4bit ]] && { compress=on; model=${model%-4bit}; }
    step "search-$name" python3 -m flexoff search --model "$model" --hardware "$hardware" --compress "$compress" \
        --output "$LOGS/$name.json"
    step "same-$name" python3 -c "
import sys
from flexoff.policy import Policy
stored, fresh = Policy.load(sys.argv[1]).to_dict(), Policy.load(sys.argv[2]).to_dict()
for part in ('weights', 'cache', 'activations'):  # equal-cost vertices may differ by a sliver
    assert all(abs(stored[part][t] - fresh[part][t]) <= 0.01 for t in stored[part]), (part, stored[part], fresh[part])
    stored.pop(part), fresh.pop(part)
assert stored == fresh, (stored, fresh)
print('the search found', sys.argv[1])" "$file" "$LOGS/$name.json"
done
# the issue's traceback on Python 3.12 with PuLP 4
step search-opt-30b-h200-16GiB python3 -m flexoff search --model opt-30b --hardware h200 --gpu-mem 16GiB

# README command 1: the embedded default job
step readme-run python3 -m flexoff run
# a job the GPU cannot hold under the cap is planned by the LP, then runs
step planned-run python3 -m flexoff run --model opt-1.3b --dummy --dtype float16 --hardware h200 --gpu-mem 1.5GiB \
    --prompt-len 256 --gen-len 8 --num-prompts 16

echo
if [ ${#failed[@]} -eq 0 ]; then echo "py312_check: all passed (logs in $LOGS)"; exit 0; fi
echo "py312_check: FAILED: ${failed[*]} (logs in $LOGS)"
exit 1
