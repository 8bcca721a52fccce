#!/usr/bin/env bash
# CI: every direct dependency at its declared lower bound (pyproject.toml's `>=`; their own
# dependencies at the newest releases that fit), torch at the one CPU build this machine has, and
# the planner, model-equality, CLI, default-plan and lm-eval adapter tests. The venv is
# .venv-lowest; a second run reuses it. Arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
TORCH=${TORCH:-torch==2.13.0}  # pinned and installed first: a plain torch requirement pulls a CUDA build

[ -x .venv-lowest/bin/python ] || "$PYTHON" -m venv .venv-lowest
. .venv-lowest/bin/activate
pip install -q "$TORCH"

# One `name==lower` line per direct dependency, core and every extra; one without a lower bound fails.
python - "$TORCH" > .venv-lowest/lowest.txt <<'PY'
import re, sys, tomllib

project = tomllib.load(open("pyproject.toml", "rb"))["project"]
requirements = list(project["dependencies"])
for extra in project["optional-dependencies"].values():
    requirements += extra
pins = {}
for requirement in requirements:
    found = re.fullmatch(r"\s*([A-Za-z0-9_.-]+)\s*>=\s*([^,;\s]+)\s*(,.*)?", requirement)
    if found is None:
        sys.exit(f"lowest.sh: {requirement!r} has no lower bound")
    name = found[1].lower().replace("_", "-")
    if name != "torch":
        pins[name] = f"{found[1]}=={found[2]}"
print(sys.argv[1])  # keeps the torch installed above
print("\n".join(sorted(pins.values())))
PY
echo "lowest direct dependencies:"; sed 's/^/  /' .venv-lowest/lowest.txt
pip install -q -r .venv-lowest/lowest.txt
pip install -q -e . --no-deps
python - .venv-lowest/lowest.txt <<'PY'
import importlib.metadata, re, sys

for line in open(sys.argv[1]):
    name = re.split(r"[=<>]", line)[0]
    print(f"installed  {name} {importlib.metadata.version(name)}")
PY
# The trained model's placement loops repeat at these versions what the main suite proves; its
# conversion, tokenizer, chat template and GGUF tests run here, where the versions differ most.
python -m pytest -q -p no:cacheprovider -n 2 --dist loadfile tests/planner tests/models tests/test_cli.py tests/test_default_plan.py \
    tests/harness/test_lm_eval_cli.py \
    -k "not greedy_text_equals_transformers and not scores_along_transformers and not seeded_samples" "$@"
