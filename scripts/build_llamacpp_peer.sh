#!/usr/bin/env bash
# The llama.cpp peer of the benchmarks (never run in CI): llama-cpp-python 0.3.36 in its own virtualenv, for
# single-stream decode/prefill (benchmarks.engine_bench --llama-python), and llama-server from the llama.cpp that
# sdist vendors (commit 0c1e570), for the concurrent comparison (benchmarks.serving_bench --llama-server).
# Both compile from source: about 11 and 8-15 minutes on 2 cores. Needs cmake, g++ and network access to PyPI.
#
#   bash scripts/build_llamacpp_peer.sh [DIR]      (default DIR: build/llamacpp)
#   -> DIR/venv/bin/python (has llama_cpp), DIR/bin/llama-server
set -euo pipefail
DIR=${1:-build/llamacpp}
VERSION=0.3.36
mkdir -p "$DIR/src" "$DIR/bin"
DIR=$(cd "$DIR" && pwd)

if [ ! -x "$DIR/venv/bin/python" ] || ! "$DIR/venv/bin/python" -c "import llama_cpp" 2>/dev/null; then
    python3 -m venv "$DIR/venv"
    CMAKE_ARGS="-DGGML_NATIVE=ON" CMAKE_BUILD_PARALLEL_LEVEL=2 \
        "$DIR/venv/bin/pip" install --no-cache-dir "llama-cpp-python==$VERSION"
fi

if [ ! -x "$DIR/bin/llama-server" ]; then
    "$DIR/venv/bin/pip" download --no-binary :all: --no-deps "llama-cpp-python==$VERSION" -d "$DIR/src"
    tar xzf "$DIR/src/llama_cpp_python-$VERSION.tar.gz" -C "$DIR/src"
    src="$DIR/src/llama_cpp_python-$VERSION/vendor/llama.cpp"
    # static (no .so files next to it); no web UI (it would be downloaded), no tests or examples
    cmake -S "$src" -B "$src/build-static" -DGGML_NATIVE=ON -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF \
        -DLLAMA_CURL=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF
    cmake --build "$src/build-static" --target llama-server -j2
    cp "$src/build-static/bin/llama-server" "$DIR/bin/"
fi
# What each was built for (GGML_NATIVE: this host's ISA). llama-server logs its system_info only at trace verbosity
# (-lv 4), at startup before it loads a model: asked for a model that is not there, it prints it and exits.
echo "llama-cpp-python: $DIR/venv/bin/python"
echo "  system_info: $("$DIR/venv/bin/python" -c 'import llama_cpp; print(llama_cpp.llama_print_system_info().decode().strip())')"
echo "llama-server:     $DIR/bin/llama-server"
echo "  $("$DIR/bin/llama-server" --version 2>&1 | head -1)"
echo "  $(timeout 60 "$DIR/bin/llama-server" -lv 4 -m "$DIR/no-model.gguf" --port 0 2>&1 | grep -m1 -o 'system_info:.*' || true)"
