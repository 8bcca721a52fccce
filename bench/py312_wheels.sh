#!/usr/bin/env bash
# Download, here, the wheels bench/py312_check.sh installs on the GPU machine (Python 3.12, torch
# with CUDA, no network): the newest release of each non-torch direct dependency of flexoff that
# the machine's image lacks or may hold older. The image already has numpy, scipy, transformers,
# tokenizers, huggingface_hub, accelerate, pytest and hypothesis; numpy stays the image's, the one
# its torch was built with.
#   bench/py312_wheels.sh [DIR]     (default .whl, which git ignores; keep it under ~40 MB)
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${1:-.whl}
PYTHON=${PYTHON:-python3}
# PuLP with its own dependencies (PuLP 4 imports orloge, which needs pydantic, to read solver
# logs); the others alone: highspy needs only numpy.
WITH_DEPS=(pulp)
ALONE=(highspy psutil tqdm safetensors)
PACKAGES=("${WITH_DEPS[@]}" "${ALONE[@]}")

mkdir -p "$DIR"
rm -f "$DIR"/*.whl
download() {
    "$PYTHON" -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        --platform any -d "$DIR" "$@"
}
download "${WITH_DEPS[@]}"
download --no-deps "${ALONE[@]}"
ls -l "$DIR"/*.whl
total=$(du -cb "$DIR"/*.whl | tail -1 | cut -f1)
echo "$(ls "$DIR"/*.whl | wc -l) wheels, $((total / 1000000)) MB in $DIR"
for name in "${PACKAGES[@]}"; do
    ls "$DIR" | grep -qi "^${name//-/_}-.*\.whl$" || { echo "py312_wheels.sh: no wheel of $name in $DIR" >&2; exit 1; }
done
[ "$total" -le 40000000 ] || { echo "py312_wheels.sh: $DIR holds more than 40 MB" >&2; exit 1; }
