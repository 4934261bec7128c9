#!/usr/bin/env bash
# Prints the CMake flag that points llama.cpp's Vulkan build at headers new enough for it, or
# nothing when the system's are. Debian 12's (libvulkan-dev 1.3.239) lack vk::LayerSettingEXT,
# which llama.cpp's Vulkan backend uses: then the headers of Debian 13's libvulkan-dev are
# fetched from Debian's archive (its own keyring checks them) and unpacked into the cache,
# never installed; the build still links the system's libvulkan, whose ABI is stable.
set -euo pipefail
if grep -qs LayerSettingEXT /usr/include/vulkan/vulkan_structs.hpp; then
    exit 0
fi
headers=${XDG_CACHE_HOME:-$HOME/.cache}/prefixgate/vulkan-headers
if [ ! -e "$headers/usr/include/vulkan/vulkan_structs.hpp" ]; then
    apt=$(mktemp -d)
    trap 'rm -rf "$apt"' EXIT
    mkdir -p "$apt/lists/partial" "$apt/archives/partial"
    echo "deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg]" \
        "http://deb.debian.org/debian trixie main" > "$apt/sources.list"
    options=(-o "Dir::Etc::SourceList=$apt/sources.list" -o "Dir::Etc::SourceParts=/dev/null"
             -o "Dir::State::Lists=$apt/lists" -o "Dir::Cache::Archives=$apt/archives"
             -o "Debug::NoLocking=1" -o "APT::Sandbox::User=$(id -un)")
    apt-get "${options[@]}" update -qq >&2
    (cd "$apt" && apt-get "${options[@]}" download libvulkan-dev >&2)
    mkdir -p "$(dirname "$headers")" && rm -rf "$headers.part"
    dpkg -x "$apt"/libvulkan-dev_*.deb "$headers.part"
    rm -rf "$headers" && mv "$headers.part" "$headers"
fi
echo "-DVulkan_INCLUDE_DIR=$headers/usr/include"
