#!/usr/bin/env bash
# The llama.cpp peer of the benchmarks (never run in CI): llama-cpp-python 0.3.36 in its own virtualenv, for
# single-stream decode/prefill (benchmarks.engine_bench --llama-python), and llama-server from the llama.cpp that
# sdist vendors (commit 0c1e570), for the concurrent comparison (benchmarks.serving_bench --llama-server).
# Both compile from source, for this host (-march=native; AMX left out where it faults): about 10-17 and 7-10
# minutes on 2 cores. Needs cmake, g++ and network access to PyPI. Ends by printing each one's system_info.
#
#   bash scripts/build_llamacpp_peer.sh [DIR]      (default DIR: build/llamacpp)
#   -> DIR/venv/bin/python (has llama_cpp), DIR/bin/llama-server
set -euo pipefail
DIR=${1:-build/llamacpp}
VERSION=0.3.36
mkdir -p "$DIR/src" "$DIR/bin"
DIR=$(cd "$DIR" && pwd)

# -march=native (GGML_NATIVE) builds every ISA the CPU lists. Some VMs (this project's 2-core Firecracker box) list
# AMX (amx_tile) and grant its permission, yet fault on the first tile instruction: llama.cpp then dies in
# ggml_backend_amx_mul_mat (ldtilecfg, SIGSEGV) at its first decode. A probe that runs one tile instruction decides;
# where it fails, the build leaves AMX out (explicit -mno-* flags win over -march=native in either order).
amx_runs() {
    local probe rc
    probe=$(mktemp -d)
    cat > "$probe/amx.c" <<'EOF'
#include <immintrin.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>
int main(void) {
    unsigned char cfg[64];
    if (syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */)) return 1;
    memset(cfg, 0, sizeof cfg);
    cfg[0] = 1;                  /* palette 1 */
    cfg[16] = 64, cfg[48] = 16;  /* tile 0: 16 rows of 64 bytes */
    _tile_loadconfig(cfg);
    _tile_zero(0);
    _tile_release();
    return 0;
}
EOF
    rc=1
    if gcc -O1 -mamx-tile "$probe/amx.c" -o "$probe/amx" 2>/dev/null && ("$probe/amx" || exit 1) 2>/dev/null; then rc=0; fi
    rm -rf "$probe"
    return $rc
}
NATIVE_FLAGS=""
if grep -qw amx_tile /proc/cpuinfo && ! amx_runs; then
    NATIVE_FLAGS="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
    echo "AMX is listed but faults here: building without it ($NATIVE_FLAGS)"
fi

if [ ! -x "$DIR/venv/bin/python" ] || ! "$DIR/venv/bin/python" -c "import llama_cpp" 2>/dev/null; then
    python3 -m venv "$DIR/venv"
    CFLAGS="$NATIVE_FLAGS" CXXFLAGS="$NATIVE_FLAGS" CMAKE_ARGS="-DGGML_NATIVE=ON" CMAKE_BUILD_PARALLEL_LEVEL=2 \
        "$DIR/venv/bin/pip" install --no-cache-dir "llama-cpp-python==$VERSION"
fi

if [ ! -x "$DIR/bin/llama-server" ]; then
    "$DIR/venv/bin/pip" download --no-binary :all: --no-deps "llama-cpp-python==$VERSION" -d "$DIR/src"
    tar xzf "$DIR/src/llama_cpp_python-$VERSION.tar.gz" -C "$DIR/src"
    src="$DIR/src/llama_cpp_python-$VERSION/vendor/llama.cpp"
    # static (no .so files next to it); no web UI (it would be downloaded), no tests or examples
    cmake -S "$src" -B "$src/build-static" -DGGML_NATIVE=ON -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF \
        -DCMAKE_C_FLAGS="$NATIVE_FLAGS" -DCMAKE_CXX_FLAGS="$NATIVE_FLAGS" \
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
