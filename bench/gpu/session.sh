#!/usr/bin/env bash
# One GPU-machine session for everything the H200 has to show, run unattended in the background (the machine
# goes back 30 s after a call, so the calls only start it and poll):
#   B  the CPU+CUDA+Vulkan recipe, `build --ops-tool --check-reproducible` (issue 15's bundle; issue 14's two
#      builds in different directories, zip sha256 of both);
#   C  the CUDA recipe with archs [80-real] and GGML_CUDA_FA=OFF (only to be quick), at lower priority: probe's
#      cuda_arch_unsupported on a Hopper GPU (issue 16);
#   on B's first zip (while its second build runs at nice 19): --list-devices, verify gpu/ops, probe --json,
#   probe with the machine's toolkit hidden (bundle intact; libcudart removed), llama-bench CUDA0 vs Vulkan0,
#   and offload_buffers.sh (on a copy without the Vulkan backend, so that the plan's one GPU is the one used).
#
#   bash bench/gpu/session.sh start   # carry .devtree .whl .gl .vk; sets up, starts, then polls like `poll`
#   bash bench/gpu/session.sh poll    # wait (at most POLL_S seconds) for the next step; results in $OUT
set -uo pipefail
W=/tmp/lbgpu
R=$W/results
export NCCL_NVLS_ENABLE=0

# shellcheck source=poll.sh
source bench/gpu/poll.sh

orchestrate() {
  # shellcheck source=multi_backend.sh
  source bench/gpu/multi_backend.sh
  vulkan_env >> $R/session.log 2>&1
  export LLAMABUNDLE_CACHE_DIR=$W/cache PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1
  say "B: build $RECIPE --ops-tool --check-reproducible"
  BUILD_ARGS="--ops-tool --check-reproducible" NOCOMP=0 POLLS=1 bash bench/gpu/cuda_build.sh start >> $R/session.log 2>&1
  # C in its own cache (its own fixed links and lock), the same proven source
  mkdir -p $W/c80 && cp -a $W/cache/src $W/c80/src
  sed 's/^  archs: .*/  archs: [80-real]/; s/^  GGML_CUDA_NCCL: OFF.*/&\n  GGML_CUDA_FA: OFF/' recipes/linux-x86_64-cuda13.0.yaml > $W/cuda-sm80.yaml
  grep -n "archs\|GGML_CUDA_FA" $W/cuda-sm80.yaml >> $R/session.log
  say "C: build cuda-sm80.yaml"
  (LLAMABUNDLE_CACHE_DIR=$W/c80 nice -n 5 python3 -m llamabundle build $W/cuda-sm80.yaml --toolkit-source system \
     --store $W/store80 --json > $W/build80.json 2> $W/build80.log; echo $? > $W/build80.rc) &
  (python3 .devtree/make_synthetic_gguf.py .devtree/ggml-vocab-qwen2.gguf $W/model.gguf \
     --layers 16 --hidden 1536 --ffn 4096 --heads 12 --kv-heads 2 > $W/model.log 2>&1; echo $? > $W/model.rc) &
  local zip=""
  for _ in $(seq 1 400); do
    [ -f $W/build80.rc ] && [ ! -f $R/probe-sm80-only.json ] && after_c
    zip=$(ls $W/cache/out/linux-x86_64-cuda13.0-vulkan-*.zip 2>/dev/null | grep -v second | head -1)
    [ -n "$zip" ] && [ -f "${zip%.zip}.test-backend-ops" ] && break
    [ -f $W/build.rc ] && break
    sleep 5
  done
  [ -n "$zip" ] || { say "B: no zip (rc $(cat $W/build.rc 2>/dev/null))"; tail -30 $W/build.log >> $R/session.log; return; }
  say "B: first zip $(basename $zip) $(stat -c %s $zip) bytes, ops tool built"
  pgrep -f "llamabundle build recipes" | xargs -r renice -n 19 -p > /dev/null
  pgrep -x ninja | xargs -r renice -n 19 -p > /dev/null
  checks_b "$zip"
  [ -f $W/build80.rc ] && [ ! -f $R/probe-sm80-only.json ] && after_c
  bench_b
  for _ in $(seq 1 400); do [ -f $W/build.rc ] && break; sleep 5; done
  say "B: done rc=$(cat $W/build.rc) in $(( $(cat $W/t1) - $(cat $W/t0) )) s"
  cp $W/build.json $W/build.log $R/ 2>/dev/null
  python3 -c "import json; r=json.load(open('$W/build.json')); print('reproducible:', r.get('reproducible'))" >> $R/session.log 2>&1
  tail -25 $W/build.log >> $R/session.log
  say "all done"
}

after_c() {
  say "C: rc=$(cat $W/build80.rc)"; tail -5 $W/build80.log >> $R/session.log; cp $W/build80.log $R/
  local key
  key=$(python3 -c "import json; print(json.load(open('$W/build80.json'))['key'])") || { echo '{}' > $R/probe-sm80-only.json; return; }
  rm -rf $W/b80 && LLAMABUNDLE_CACHE_DIR=$W/c80 python3 -m llamabundle fetch "$key" --store $W/store80 --out $W/b80 >> $R/session.log 2>&1
  /usr/local/cuda/bin/cuobjdump --list-elf --list-ptx $W/b80/libggml-cuda.so 2>&1 | sed 's/.*\.\(sm_[0-9a-z]*\)\.\(cubin\|ptx\)/\2 \1/' | sort | uniq -c > $R/cuobjdump-sm80.txt
  python3 -m llamabundle probe --bundle $W/b80 --json > $R/probe-sm80-only.json 2> $R/probe-sm80-only.err
  echo "probe rc=$?" >> $R/probe-sm80-only.err
  python3 -c "import json; r=json.load(open('$R/probe-sm80-only.json')); print('C probe:', r['backend'], r['reason'], r['sentence']); print(json.dumps(r['facts'].get('cause'), indent=1))" >> $R/session.log 2>&1
}

checks_b() {
  local zip=$1 key
  key=$(python3 -c "import json,sys,zipfile; print(json.loads(zipfile.ZipFile(sys.argv[1]).read('bundle.json'))['key'])" "$zip")
  python3 -m llamabundle publish "$zip" --store $W/storeA >> $R/session.log 2>&1
  rm -rf $W/b && python3 -m llamabundle fetch "$key" --store $W/storeA --out $W/b >> $R/session.log 2>&1
  du -sb $W/b >> $R/sizes.txt; echo "zip $(stat -c %s "$zip")" >> $R/sizes.txt; ls -l $W/b >> $R/sizes.txt
  python3 -c "import sys,zipfile; sys.stdout.buffer.write(zipfile.ZipFile(sys.argv[1]).read('bundle.json'))" "$zip" > $R/bundle.json
  (cd /tmp && env -i PATH=/usr/bin:/bin VK_DRIVER_FILES=$VK_DRIVER_FILES $W/b/llama-server --verbose --list-devices) > $R/list-devices.txt 2>&1
  say "list-devices:"; grep -v "^$" $R/list-devices.txt | tail -8 >> $R/session.log
  python3 -m llamabundle verify "$zip" --level gpu --require-gpu > $R/verify-gpu.txt 2>&1; say "verify gpu rc=$?"
  python3 -m llamabundle verify "$zip" --level gpu --require-gpu --json > $R/verify-gpu.json 2>/dev/null
  timeout 400 python3 -m llamabundle verify "$zip" --level ops --ops-budget 240 --json > $R/verify-ops.json 2> $R/verify-ops.err; say "verify ops rc=$?"
  python3 -c "import json; r=json.load(open('$R/verify-ops.json')); print(json.dumps(r.get('ops') or r.get('levels'), indent=1)[:3000])" >> $R/session.log 2>&1
  python3 -m llamabundle probe --bundle $W/b --json > $R/probe.json 2> $R/probe.err; say "probe rc=$?"
  python3 -c "import json; r=json.load(open('$R/probe.json')); print(r['backend'], r['reason'], r['sentence'])" >> $R/session.log 2>&1
  for what in intact no-cudart; do
    rm -rf $W/h && cp -a $W/b $W/h
    [ $what = no-cudart ] && rm -f $W/h/libcudart.so*
    unshare -m bash -c "mount -t tmpfs none /usr/local/cuda && python3 -m llamabundle probe --bundle $W/h --json" > $R/probe-hidden-$what.json 2> $R/probe-hidden-$what.err
    say "probe (toolkit hidden, $what) rc=$?"
    python3 -c "import json,sys; r=json.load(open(sys.argv[1])); print(r['backend'], r['reason'], r['sentence']); print(json.dumps(r['facts'].get('cause'), indent=1))" $R/probe-hidden-$what.json >> $R/session.log 2>&1
  done
}

bench_b() {
  local build
  build=$(ls -d $W/cache/build/*/ | head -1)
  nice -n 19 cmake --build "$build" --target llama-bench > $R/llama-bench-build.log 2>&1 && cp "$build/bin/llama-bench" "$build"/bin/libllama-bench-impl.so* $W/b/ || { say "llama-bench: no build"; tail -5 $R/llama-bench-build.log >> $R/session.log; }
  for _ in $(seq 1 60); do [ -f $W/model.rc ] && break; sleep 2; done
  say "model rc=$(cat $W/model.rc 2>/dev/null) $(stat -c %s $W/model.gguf 2>/dev/null) bytes"
  for dev in CUDA0 Vulkan0; do
    (cd /tmp && env -i PATH=/usr/bin:/bin VK_DRIVER_FILES=$VK_DRIVER_FILES timeout 240 \
      $W/b/llama-bench -m $W/model.gguf -p 512 -n 128 -ngl 99 -dev $dev -o md) > $R/llama-bench-$dev.md 2>&1
    say "llama-bench $dev rc=$?"; tail -4 $R/llama-bench-$dev.md >> $R/session.log
  done
  rm -rf $W/bo && cp -a $W/b $W/bo && rm -f $W/bo/libggml-vulkan.so
  OUT=$R/offload RUN_TIMEOUT=60 bash bench/gpu/offload_buffers.sh $W/bo $W/model.gguf > $R/offload.txt 2>&1; say "offload rc=$?"
  tail -40 $R/offload.txt >> $R/session.log
}

case "${1:-}" in
  start)
    mkdir -p $R
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader > $R/gpu.txt; nproc >> $R/gpu.txt
    setsid nohup bash bench/gpu/session.sh orchestrate > $R/orchestrate.out 2>&1 < /dev/null &
    sleep 20; cat $R/gpu.txt; poll ;;
  orchestrate) orchestrate ;;
  poll) poll ;;
  *) echo "usage: $0 start|poll"; exit 2 ;;
esac
