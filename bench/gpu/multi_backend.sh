#!/usr/bin/env bash
# The CPU+CUDA+Vulkan bundle on the GPU machine (device tool): build it there with the machine's CUDA
# (--toolkit-source system) and --ops-tool. The checks on a real GPU (--list-devices, verify gpu/ops, probe,
# llama-bench CUDA vs Vulkan, the fallback causes, the offload buffers) are bench/gpu/session.sh's, which
# sources this file for vulkan_env and runs everything unattended.
# The image has no Vulkan loader, glslc or SPIR-V headers and can fetch nothing, so they travel as Debian
# packages: .gl/ (the loader, as the device README lists it), .vk/ (glslc, libshaderc1, spirv-headers) and
# the recipe's pinned libvulkan-dev in .devtree/ (besides cuda_build.sh's source tree and wheels).
#
#   bash bench/gpu/multi_backend.sh pack     # on this host: .gl, .vk, .devtree/vulkan (then cuda_build.sh pack)
#   bash bench/gpu/multi_backend.sh start    # on the device (carry .devtree .whl .gl .vk): set up, build
#   bash bench/gpu/multi_backend.sh wait     # poll (each call at most ~9 min); when built, verify as cuda_build.sh
#
# Every device call must begin the same way (the loader is unpacked into / each time: a fresh machine
# has none), which `start` and `wait` do themselves.
set -uo pipefail
RECIPE=recipes/linux-x86_64-cuda13.0-vulkan.yaml
W=/tmp/lbgpu
VK=/tmp/vk
export RECIPE

vulkan_env() {  # the loader in /, glslc and the SPIR-V headers under $VK, the NVIDIA ICD named
  for f in .gl/*.deb; do dpkg -x "$f" /; done
  ldconfig
  mkdir -p $VK && for f in .vk/*.deb; do dpkg -x "$f" $VK; done
  mkdir -p $VK/bin
  printf '#!/bin/sh\nLD_LIBRARY_PATH=%s/usr/lib/x86_64-linux-gnu exec %s/usr/bin/glslc "$@"\n' $VK $VK > $VK/bin/glslc
  chmod +x $VK/bin/glslc
  export PATH=$VK/bin:$PATH CMAKE_PREFIX_PATH=$VK/usr${CMAKE_PREFIX_PATH:+:$CMAKE_PREFIX_PATH}
  export CPLUS_INCLUDE_PATH=$VK/usr/include  # ggml-vulkan includes spirv.hpp without the package's include dir
  export VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
  export __EGL_VENDOR_LIBRARY_FILENAMES=/usr/local/nvidia/share/glvnd/egl_vendor.d/10_nvidia.json
  # the recipe's headers where llamabundle looks for its download (nothing can be fetched here)
  local sha name
  sha=$(python3 -c "import yaml,sys; print(yaml.safe_load(open(sys.argv[1]))['vulkan']['headers']['sha256'])" $RECIPE)
  name=$(basename .devtree/vulkan/*.deb)
  mkdir -p $W/cache/downloads/$sha && cp -n .devtree/vulkan/$name $W/cache/downloads/$sha/$name
  glslc --version | head -1
  ldconfig -p | grep -m1 libvulkan.so.1 || echo "no Vulkan loader"
}

pack() {
  grep -qx '/.gl/' .git/info/exclude || echo /.gl/ >> .git/info/exclude
  grep -qx '/.vk/' .git/info/exclude || echo /.vk/ >> .git/info/exclude
  mkdir -p .gl .vk .devtree/vulkan /tmp/amd64/partial
  o='-oAPT::Architecture=amd64 -oAPT::Architectures=amd64 -oDir::State::Lists=/tmp/amd64'
  apt-get $o update -qq
  (cd .gl && apt-get $o download libvulkan1 libegl1 libglvnd0 libopengl0 libgl1 libglx0 libgles2)
  (cd .vk && apt-get $o download glslc libshaderc1 spirv-headers)
  url=$(python3 -c "import yaml,sys; print(yaml.safe_load(open(sys.argv[1]))['vulkan']['headers']['url'])" $RECIPE)
  [ -f .devtree/vulkan/$(basename $url) ] || curl -fsSL -o .devtree/vulkan/$(basename $url) "$url"
  du -shc .gl .vk .devtree/vulkan
}

[ "${BASH_SOURCE[0]}" = "$0" ] || return 0  # sourced (session.sh): the functions only
case "${1:-}" in
  pack) pack ;;
  start) vulkan_env; BUILD_ARGS="--ops-tool ${BUILD_ARGS:-}" NOCOMP=0 bash bench/gpu/cuda_build.sh start ;;
  wait) vulkan_env > /dev/null; bash bench/gpu/cuda_build.sh wait ;;
  *) echo "usage: $0 pack|start|wait"; exit 2 ;;
esac
