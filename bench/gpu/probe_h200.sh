#!/usr/bin/env bash
# Issue 32 on the H200: the CUDA recipe for this image (linux-x86_64-cuda13.0-ubuntu24.04: g++ 13.3, the machine's
# CUDA 13.0 via --toolkit-source system) built through llamabundle, then the bundle's own llamabundle-probe run as an
# app runs it (env -i, from its directory): CUDA0 with its compute capability, memory and bus id; the same with
# libcudart.so.13 out of the bundle and the machine's toolkit hidden (a mount namespace): the CUDA module's failure
# in the loader's words; `llamabundle probe --bundle` and `verify --level gpu` on it (their load_source: the probe).
# The proven source travels as .devtree/llama-src.tar.xz (cuda_build.sh pack), the kept web UI as .devtree/ui.tar.xz
# with its cache id in .devtree/ui.id (nothing can be fetched there, npm included), Python packages as .whl/.
#
#   bash bench/gpu/probe_h200.sh start   # carry .devtree .whl; starts in the background, then polls
#   VULKAN=1 bash bench/gpu/probe_h200.sh start   # the CPU+CUDA+Vulkan recipe (carry .gl .vk too: multi_backend.sh pack)
#   bash bench/gpu/probe_h200.sh poll    # wait (at most POLL_S seconds) for the end; results in $OUT/results.tgz
set -uo pipefail
W=/tmp/lbgpu
R=$W/results
RECIPE=recipes/linux-x86_64-cuda13.0-ubuntu24.04.yaml
# shellcheck source=poll.sh
source bench/gpu/poll.sh

run() {
  export LLAMABUNDLE_CACHE_DIR=$W/cache PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1
  local probe_env=(PATH=/usr/bin:/bin HOME=/root)
  if [ "${VULKAN:-0}" = 1 ]; then  # the CPU+CUDA+Vulkan recipe with this image's g++ (multi_backend.sh's packages)
    # shellcheck source=multi_backend.sh
    source bench/gpu/multi_backend.sh
    vulkan_env >> $R/session.log 2>&1
    RECIPE=$(vulkan_recipe)
    probe_env+=(VK_DRIVER_FILES="$VK_DRIVER_FILES" __EGL_VENDOR_LIBRARY_FILENAMES="$__EGL_VENDOR_LIBRARY_FILENAMES")
  fi
  built_bundle $RECIPE || { say "all done"; return; }
  python3 -m llamabundle fetch "$key" --store $W/store --out $W/b >> $R/session.log 2>&1
  cp $W/b/bundle.json $R/bundle.json
  env -i "${probe_env[@]}" $W/b/llamabundle-probe > $R/probe-cuda.json 2> $R/probe-cuda.err
  say "probe: rc=$? $(wc -c < $R/probe-cuda.json) bytes"
  cp -a $W/b $W/nocudart && rm -f $W/nocudart/libcudart.so*
  libdir=$(readlink -f /usr/local/cuda/lib64)
  unshare -m sh -c "mount -t tmpfs none $libdir && exec env -i ${probe_env[*]} $W/nocudart/llamabundle-probe" \
    > $R/probe-no-libcudart.json 2> $R/probe-no-libcudart.err
  say "probe without libcudart ($libdir hidden): rc=$?"
  python3 -m llamabundle probe --bundle $W/b --json --max-age 0 > $R/probe-cli.json 2> $R/probe-cli.err
  say "llamabundle probe --bundle: rc=$?"
  python3 -m llamabundle verify "$zip" --level gpu --require-gpu --json > $R/verify-gpu.json 2> $R/verify-gpu.err
  say "verify --level gpu --require-gpu: rc=$?"
  nvidia-smi --query-gpu=name,driver_version,memory.total,memory.free,pci.bus_id --format=csv,noheader > $R/nvidia-smi.txt
  say "all done"
}

case "${1:-}" in
  start) rm -rf $W && mkdir -p $R && : > $R/session.log
         python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
         setsid nohup env VULKAN="${VULKAN:-0}" bash bench/gpu/probe_h200.sh run > $W/run.log 2>&1 < /dev/null &
         sleep 5; POLL_S=${POLL_S:-540} poll ;;
  run) run ;;
  poll) poll ;;
  *) echo "usage: $0 start|poll"; exit 2 ;;
esac
