#!/usr/bin/env bash
# Build llama.cpp's llama-server (the CPU anchor of benchmarks/serve.py and cpu_step's peers) from
# the llama.cpp sources vendored in llama-cpp-python's sdist on PyPI (no other network), for this
# CPU (GGML_NATIVE), without curl, OpenSSL or the web UI, into build/llama-server/bin/llama-server.
# About 25 minutes on 2 cores; needs cmake and a C++ compiler. Put the binary on PATH for the
# benchmarks to find it.
#
#   scripts/build_llama_server.sh [VERSION]     (default llama-cpp-python 0.3.36)
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION="${1:-0.3.36}"
WORK=build/llama-server
PYTHON="${PYTHON:-.venv/bin/python}"
mkdir -p "$WORK"
"$PYTHON" -m pip download -q --no-deps --no-binary :all: -d "$WORK" "llama-cpp-python==$VERSION"
tar -xzf "$WORK/llama_cpp_python-$VERSION.tar.gz" -C "$WORK"
SRC="$WORK/llama_cpp_python-$VERSION/vendor/llama.cpp"
cmake -S "$SRC" -B "$WORK/cmake" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \
  -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_TESTS=OFF \
  -DLLAMA_BUILD_EXAMPLES=OFF -DBUILD_SHARED_LIBS=OFF >/dev/null
cmake --build "$WORK/cmake" --target llama-server -j "$(nproc)"
mkdir -p "$WORK/bin"
cp "$WORK/cmake/bin/llama-server" "$WORK/bin/llama-server"
"$WORK/bin/llama-server" --version 2>&1 | head -1
echo "built $WORK/bin/llama-server; e.g. export PATH=\"$PWD/$WORK/bin:\$PATH\""
