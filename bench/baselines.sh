#!/usr/bin/env bash
# The two baselines bench/throughput.py adds with --systems ...,deepspeed,llamacpp, made ready for the GPU
# machine, which has no network:
#   bench/baselines.sh pack [DIR]    here: DeepSpeed's source package with the hjson and gguf wheels, and
#                                    llama.cpp's sources as the llama-cpp-python source package vendors them,
#                                    cut to what a build of llama-batched-bench reads (no other backends,
#                                    tools, docs or vocabularies), into DIR (default .baselines, which git
#                                    ignores)
#   bench/baselines.sh build [DIR]   there: DeepSpeed and the wheels installed into /tmp/site (no compiled ops), and
#                                    llama-batched-bench built for CUDA on the card's architecture into
#                                    DIR/bin, statically linked to llama.cpp, with the build's time and size;
#                                    where DIR holds llama-batched-bench.xz.part* from an earlier call, those
#                                    are put together instead of building again
#   bench/baselines.sh bundle [DIR] OUTDIR   there, after build: the binary xz-compressed in parts of 15 MiB
#                                    into OUTDIR ($OUT), to come back and be carried in DIR by later calls
# Then: python bench/throughput.py ... --systems flexoff,deepspeed,llamacpp --llamacpp-bin DIR/bin
set -euo pipefail
cd "$(dirname "$0")/.."
LLAMA_CPP_PYTHON=0.3.36 # vendors llama.cpp 0c1e570
DEEPSPEED=0.19.8
HJSON=3.1.0
GGUF=0.19.0
MODE=${1:?usage: bench/baselines.sh pack|build [DIR]}
DIR=${2:-.baselines}
PYTHON=${PYTHON:-python3}
mkdir -p "$DIR"

pack() {
    local work
    work=$(mktemp -d)
    trap 'rm -rf "$work"' RETURN
    "$PYTHON" -m pip download -q --no-deps --no-binary=:all: -d "$work" \
        "llama-cpp-python==$LLAMA_CPP_PYTHON" "deepspeed==$DEEPSPEED"
    cp "$work"/deepspeed-*.tar.gz "$DIR"/
    # What the GPU machine's image lacks: DeepSpeed's config reader, and the writer of the dummy GGUF files.
    "$PYTHON" -m pip download -q --no-deps --only-binary=:all: -d "$DIR" "hjson==$HJSON" "gguf==$GGUF"
    tar -xzf "$work"/llama_cpp_python-*.tar.gz -C "$work"
    local src=$work/llama_cpp_python-$LLAMA_CPP_PYTHON/vendor/llama.cpp out=$work/llama.cpp
    mkdir -p "$out/tools" "$out/ggml/src"
    cp -r "$src"/{CMakeLists.txt,LICENSE,cmake,include,src,common,vendor,licenses} "$out"/
    cp -r "$src"/tools/batched-bench "$out/tools/"
    # Only the tool that runs; the others read files this cut leaves out.
    printf 'find_package(Threads REQUIRED)\nllama_add_compile_flags()\nadd_subdirectory(batched-bench)\n' \
        >"$out/tools/CMakeLists.txt"
    cp -r "$src"/ggml/{CMakeLists.txt,cmake,include} "$out/ggml/"
    cp "$src"/ggml/src/*.{c,cpp,h,in,txt} "$out/ggml/src/" 2>/dev/null || true
    cp -r "$src"/ggml/src/{ggml-cpu,ggml-cuda,ggml-blas} "$out/ggml/src/"
    # The cut has no git history, from which llama.cpp's build takes the commit its --version prints.
    local commit
    commit=$(git -C "$src" rev-parse --short=7 HEAD)
    sed -i "s/^set(BUILD_COMMIT \"unknown\")/set(BUILD_COMMIT \"$commit\")/" "$out/cmake/build-info.cmake"
    tar -czf "$DIR/llama.cpp.tar.gz" -C "$work" llama.cpp
    du -b "$DIR"/*.tar.gz
    echo "$(du -cb "$DIR"/*.tar.gz | tail -1 | cut -f1 | awk '{printf "%.1f", $1 / 2^20}') MiB in $DIR"
}

build() {
    local start=$SECONDS
    DS_BUILD_OPS=0 "$PYTHON" -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/site \
        "$DIR"/deepspeed-*.tar.gz "$DIR"/*.whl
    echo "deepspeed: installed in $((SECONDS - start)) s"
    start=$SECONDS
    if compgen -G "$DIR/llama-batched-bench.xz.part*" >/dev/null; then
        mkdir -p "$DIR/bin" && cat "$DIR"/llama-batched-bench.xz.part* | xz -d >"$DIR/bin/llama-batched-bench"
        chmod +x "$DIR/bin/llama-batched-bench"
        echo "llama.cpp: the earlier build unpacked in $((SECONDS - start)) s"
        "$DIR/bin/llama-batched-bench" --version 2>&1 | head -1
        return
    fi
    rm -rf "$DIR/llama.cpp" && tar -xzf "$DIR/llama.cpp.tar.gz" -C "$DIR"
    local arch
    arch=$("$PYTHON" -c "import torch; major, minor = torch.cuda.get_device_capability(); print(f'{major}{minor}')")
    # Git must not climb from the cut to an enclosing repository, whose commit --version would print.
    GIT_CEILING_DIRECTORIES=$(cd "$DIR" && pwd) cmake -S "$DIR/llama.cpp" -B "$DIR/llama.cpp/build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
        -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES="$arch" -DBUILD_SHARED_LIBS=OFF -DGGML_NATIVE=ON \
        -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
        -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF >"$DIR/cmake.log"
    echo "llama.cpp: configured in $((SECONDS - start)) s (sm_$arch)"
    start=$SECONDS
    cmake --build "$DIR/llama.cpp/build" --target llama-batched-bench -j "$(nproc)" >"$DIR/build.log"
    mkdir -p "$DIR/bin" && cp "$DIR/llama.cpp/build/bin/llama-batched-bench" "$DIR/bin/"
    echo "llama.cpp: built in $((SECONDS - start)) s, $(du -h "$DIR/bin/llama-batched-bench" | cut -f1)"
    "$DIR/bin/llama-batched-bench" --version 2>&1 | head -1
}

bundle() {
    local out=${1:?usage: bench/baselines.sh bundle DIR OUTDIR}
    xz -T0 -9 -c "$DIR/bin/llama-batched-bench" | split -b 15M -d - "$out/llama-batched-bench.xz.part"
    ls -l "$out"/llama-batched-bench.xz.part*
}

case "$MODE" in
pack) pack ;;
build) build ;;
bundle) bundle "${3:-}" ;;
*) echo "baselines.sh: error: unknown mode $MODE; use pack, build or bundle" >&2 && exit 2 ;;
esac
