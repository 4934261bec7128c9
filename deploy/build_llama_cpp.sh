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

# The backend's toolchain is checked first; its extra flags (Vulkan headers) join the build's.
extra=$(deploy/backend_deps.sh "$backend")
cmake_args="$cmake_args${extra:+ $extra}"

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
