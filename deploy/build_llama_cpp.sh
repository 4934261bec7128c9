#!/usr/bin/env bash
# Installs llama-cpp-python (the version pyproject.toml pins) built for one backend into a
# Python environment: build_llama_cpp.sh BACKEND PYTHON "CMAKE ARGS" (the Makefile's setup).
#
# Each build's wheel is kept in ~/.cache/prefixgate/wheels/<backend>-<hash of pin, flags and
# Python>: pip's own wheel cache does not tell builds with different CMAKE_ARGS apart (it would
# hand a CPU wheel to a Vulkan setup), and only the first build of each pays (about 5 minutes
# for the CPU on 2 cores, 20 for Vulkan, whose shaders compile too).
set -euo pipefail
backend=$1 python=$2 cmake_args=$3
cd "$(dirname "$0")/.."
pin=$(grep -o '"llama-cpp-python==[^"]*"' pyproject.toml | head -1 | tr -d '"')

# $1: a command (or, with a leading /, a file) the build needs; $2: the package that has it
# (Debian, Ubuntu), installed when missing; $3: what provides it on other systems.
need() {
    if [[ $1 == /* ]]; then [ -e "$1" ] && return; else command -v "$1" >/dev/null && return; fi
    if command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$2"
    else
        echo "BACKEND=$backend needs $1: install $2 ($3)" >&2
        exit 1
    fi
}

case $backend in
    cpu | metal) ;;
    vulkan)
        if [ -z "${VULKAN_SDK:-}" ]; then  # LunarG's SDK has both
            need glslc glslc "LunarG's Vulkan SDK"
            need /usr/include/vulkan/vulkan.h libvulkan-dev "LunarG's Vulkan SDK"
            need /usr/share/cmake/SPIRV-Headers/SPIRV-HeadersConfig.cmake spirv-headers \
                "LunarG's Vulkan SDK"
            cmake_args="$cmake_args $(deploy/vulkan_headers.sh)"
        fi ;;
    cuda) need nvcc nvidia-cuda-toolkit "NVIDIA's CUDA toolkit" ;;
    rocm) need hipconfig hipcc "AMD's ROCm" ;;
    *) echo "BACKEND is cpu, vulkan, cuda, rocm or metal, not '$backend'" >&2; exit 2 ;;
esac

key=$(printf '%s\n' "$pin" "$cmake_args" "$("$python" -V)" | sha256sum | cut -c1-12)
wheels=${XDG_CACHE_HOME:-$HOME/.cache}/prefixgate/wheels/$backend-$key
if ! compgen -G "$wheels/llama_cpp_python-*.whl" >/dev/null; then
    echo "building $pin for $backend: $cmake_args"
    rm -rf "$wheels.part"
    CMAKE_ARGS="$cmake_args" "$python" -m pip wheel --quiet --no-deps --no-cache-dir \
        --wheel-dir "$wheels.part" "$pin"
    rm -rf "$wheels" && mv "$wheels.part" "$wheels"
fi
"$python" -m pip install --quiet --no-deps --force-reinstall "$wheels"/llama_cpp_python-*.whl
