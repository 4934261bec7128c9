#!/usr/bin/env bash
# Checks what building llama.cpp for one backend needs (installing it when missing, as root on
# Debian or Ubuntu) and prints the extra CMake flags this system needs for that backend, beside
# llama.cpp's own switch: used by the builds of llama-cpp-python (build_llama_cpp.sh) and of
# llama-server (loadtest/build_llama_server.sh), so both find the same toolchain.
# Usage: deploy/backend_deps.sh BACKEND   (cpu, vulkan, cuda, rocm or metal)
set -euo pipefail
backend=$1
cd "$(dirname "$0")/.."

# $1: a command (or, with a leading /, a file) the build needs; $2: the package that has it
# (Debian, Ubuntu), installed when missing; $3: what provides it on other systems. Everything
# but the flags goes to stderr: the caller captures stdout.
need() {
    if [[ $1 == /* ]]; then [ -e "$1" ] && return; else command -v "$1" >/dev/null && return; fi
    if command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
        (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$2") >&2
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
            deploy/vulkan_headers.sh
        fi ;;
    cuda) need nvcc nvidia-cuda-toolkit "NVIDIA's CUDA toolkit" ;;
    rocm) need hipconfig hipcc "AMD's ROCm" ;;
    *) echo "BACKEND is cpu, vulkan, cuda, rocm or metal, not '$backend'" >&2; exit 2 ;;
esac
