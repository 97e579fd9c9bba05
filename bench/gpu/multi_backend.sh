#!/usr/bin/env bash
# The CPU+CUDA+Vulkan bundle on the GPU machine (device tool): build it there with the machine's CUDA
# (--toolkit-source system) and --ops-tool, then what the multi-backend and app-side checks need on a real
# GPU: --list-devices, verify --level gpu and --level ops for both GPU backends, probe --json (CUDA chosen,
# and why), llama-bench pp512/tg128 for CUDA and for Vulkan on one synthetic model, and the bundle's size.
# The image has no Vulkan loader, glslc or SPIR-V headers and can fetch nothing, so they travel as Debian
# packages: .gl/ (the loader, as the device README lists it), .vk/ (glslc, libshaderc1, spirv-headers) and
# the recipe's pinned libvulkan-dev in .devtree/ (besides cuda_build.sh's source tree and wheels).
#
#   bash bench/gpu/multi_backend.sh pack     # on this host: .gl, .vk, .devtree/vulkan (then cuda_build.sh pack)
#   bash bench/gpu/multi_backend.sh start    # on the device (carry .devtree .whl .gl .vk): set up, build
#   bash bench/gpu/multi_backend.sh wait     # poll (each call at most ~9 min); when built, verify as cuda_build.sh
#   bash bench/gpu/multi_backend.sh checks   # the checks above, results in $OUT
#
# Every device call must begin the same way (the loader is unpacked into / each time: a fresh machine
# has none), which `start`, `wait` and `checks` do themselves.
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

checks() {
  export LLAMABUNDLE_CACHE_DIR=$W/cache PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH
  zip=$(python3 -c "import json; print(json.load(open('$W/build.json'))['zip'])") || { echo "no bundle: run start/wait first"; exit 1; }
  key=$(python3 -c "import json; print(json.load(open('$W/build.json'))['key'])")
  echo "bundle zip: $(stat -c %s "$zip") bytes" | tee $OUT/sizes.txt
  rm -rf $W/b && python3 -m llamabundle fetch "$key" --store $W/store --out $W/b > /dev/null || exit 1
  du -sb $W/b | tee -a $OUT/sizes.txt
  (cd /tmp && env -i PATH=/usr/bin:/bin VK_DRIVER_FILES=$VK_DRIVER_FILES $W/b/llama-server --verbose --list-devices) > $OUT/list-devices.txt 2>&1
  cat $OUT/list-devices.txt
  python3 -m llamabundle verify "$zip" --level gpu --require-gpu --json > $OUT/verify-gpu.json; echo "verify gpu rc=$?"
  timeout 420 python3 -m llamabundle verify "$zip" --level ops --ops-budget 300 --json > $OUT/verify-ops.json; echo "verify ops rc=$?"
  python3 -c "import json; r=json.load(open('$OUT/verify-ops.json')); print(json.dumps(r.get('levels'), indent=1))"
  python3 -m llamabundle probe --bundle $W/b --json > $OUT/probe.json; echo "probe rc=$?"
  python3 -c "import json; r=json.load(open('$OUT/probe.json')); print(r['backend'], r['reason'], r['sentence'])"
  # llama-bench from the same build tree, run from inside the unpacked bundle on one synthetic model
  build=$(ls -d $W/cache/build/*/ | head -1)
  cmake --build "$build" --target llama-bench > $OUT/llama-bench-build.log 2>&1 && cp "$build/bin/llama-bench" $W/b/ || { tail -5 $OUT/llama-bench-build.log; exit 1; }
  [ -f $W/model.gguf ] || python3 .devtree/make_synthetic_gguf.py .devtree/ggml-vocab-qwen2.gguf $W/model.gguf \
    --layers 16 --hidden 1536 --ffn 4096 --heads 12 --kv-heads 2 > /dev/null
  for dev in CUDA0 Vulkan0; do
    (cd /tmp && env -i PATH=/usr/bin:/bin VK_DRIVER_FILES=$VK_DRIVER_FILES timeout 240 \
      $W/b/llama-bench -m $W/model.gguf -p 512 -n 128 -ngl 99 -dev $dev -o md) > $OUT/llama-bench-$dev.md 2>&1
    echo "$dev rc=$?"; cat $OUT/llama-bench-$dev.md | tail -4
  done
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
  checks) vulkan_env > /dev/null; checks ;;
  *) echo "usage: $0 pack|start|wait|checks"; exit 2 ;;
esac
