#!/usr/bin/env bash
# Issue 16's GPU-machine session, unattended (the machine goes back 30 s after a call, so the calls only start
# and poll it):
#   1. the CUDA recipe with archs [80-real] (no Hopper SASS, no PTX), built through llamabundle with the
#      machine's toolkit: probe and verify --level gpu on the H200 must name cuda_arch_unsupported;
#   2. llama.cpp's own GPU buffers against `llamabundle plan` (bench/gpu/offload_buffers.sh) for four models
#      (F16 of three shapes and a Q4_K_M made by the build tree's llama-quantize) at full and partial offload,
#      2,048 to 32,768 tokens of context, from that same bundle: the buffers are reserved and logged before
#      any kernel runs, so --no-warmup lets a bundle without Hopper kernels report them; GGML_SCHED_DEBUG=2
#      logs of a few points (the scheduler's splits and their inputs); a few points without flash attention.
#
#   bash bench/gpu/sm80_offload.sh start   # carry .devtree .whl; sets up, starts, then polls like `poll`
#   bash bench/gpu/sm80_offload.sh poll    # wait (at most POLL_S seconds) for the end; results in $OUT
set -uo pipefail
W=/tmp/lbgpu
R=$W/results
# shellcheck source=poll.sh
source bench/gpu/poll.sh
POINTS_ALL="ALL:2048 ALL:4096 ALL:8192 ALL:16384 ALL:32768 HALF:2048 HALF:4096 HALF:8192 HALF:16384 HALF:32768 1:4096 0:2048 0:4096 0:8192 0:16384 0:32768"

sweep() {  # NAME MODEL [env...]: offload_buffers.sh on the sm80 bundle
  local name=$1 model=$2; shift 2
  [ -f "$model" ] || { say "$name: no model $model"; return; }
  env "$@" OUT=$R/$name RUN_TIMEOUT=90 SERVER_FLAGS=--no-warmup bash bench/gpu/offload_buffers.sh $W/b80 "$model" > $R/$name.txt 2>&1
  say "$name rc=$? $(grep -c ',gpu,' $R/$name/offload_buffers.csv 2> /dev/null) gpu rows"
  grep ',compute,gpu,' $R/$name/offload_buffers.csv >> $R/session.log 2> /dev/null
}

orchestrate() {
  local zip build
  arch_bundle 80-real bench/gpu/sm80_offload.sh $W/b80 || { say "all done"; return; }
  zip=$(python3 -c "import json; print(json.load(open('$W/build.json'))['zip'])")
  python3 -c "import sys,zipfile; sys.stdout.buffer.write(zipfile.ZipFile(sys.argv[1]).read('bundle.json'))" "$zip" > $R/bundle-sm80.json
  /usr/local/cuda/bin/cuobjdump --list-elf --list-ptx $W/b80/libggml-cuda.so 2>&1 | sed 's/.*\.\(sm_[0-9a-z]*\)\.\(cubin\|ptx\)/\2 \1/' | sort | uniq -c > $R/cuobjdump-sm80.txt
  python3 -m llamabundle probe --bundle $W/b80 --json > $R/probe-sm80.json 2> $R/probe-sm80.err; say "probe rc=$?"
  python3 -m llamabundle probe --bundle $W/b80 > $R/probe-sm80.txt 2>&1
  python3 -c "import json; r=json.load(open('$R/probe-sm80.json')); print('probe:', r['backend'], r['reason'], r['sentence']); print(json.dumps(r['facts'].get('kernels'), indent=1))" >> $R/session.log 2>&1
  python3 -m llamabundle verify "$zip" --level gpu --json > $R/verify-gpu-sm80.json 2> $R/verify-gpu-sm80.err; say "verify gpu rc=$?"
  python3 -m llamabundle verify "$zip" --level gpu --require-gpu > $R/verify-gpu-sm80-require.txt 2>&1; say "verify gpu --require-gpu rc=$?"
  tail -6 $R/verify-gpu-sm80-require.txt >> $R/session.log
  for _ in $(seq 1 120); do [ -f $W/m3.rc ] && break; sleep 2; done
  say "models: $(cat $W/m1.rc $W/m2.rc $W/m3.rc 2> /dev/null | tr '\n' ' ') $(ls -l $W/*.gguf | awk '{print $5}' | tr '\n' ' ')"
  # a real run without --no-warmup: the warm-up is the first kernel; no sm_90 code, no PTX
  (cd /tmp && timeout 60 env -i PATH=/usr/bin:/bin $W/b80/llama-server -m $W/m1.gguf -ngl 99 -c 4096 --port 18170 --fit off) > $R/server-sm80-warmup.log 2>&1
  say "llama-server with warm-up rc=$?"; grep -E "CUDA error|buffer size|ggml_cuda|error" $R/server-sm80-warmup.log | tail -6 >> $R/session.log
  sweep offload-m1 $W/m1.gguf POINTS="$POINTS_ALL"
  build=$(ls -d $W/cache/build/*/ | head -1)
  nice cmake --build "$build" --target llama-quantize > $R/quantize-build.log 2>&1 && \
    (cd "$build/bin" && LD_LIBRARY_PATH=. ./llama-quantize $W/m2.gguf $W/m2q.gguf Q4_K_M 16) > $R/quantize.log 2>&1
  say "quantize rc=$? $(stat -c %s $W/m2q.gguf 2> /dev/null) bytes"; tail -3 $R/quantize.log >> $R/session.log
  sweep offload-m2q $W/m2q.gguf POINTS="$POINTS_ALL"
  sweep offload-m2 $W/m2.gguf POINTS="ALL:4096 ALL:32768 HALF:4096 HALF:32768 1:4096 0:2048 0:4096 0:16384"
  sweep offload-m3 $W/m3.gguf POINTS="ALL:4096 ALL:32768 HALF:2048 HALF:4096 HALF:16384 1:4096 0:4096 0:32768"
  sweep sched-m1 $W/m1.gguf GGML_SCHED_DEBUG=2 POINTS="17:4096 8:4096 0:4096 8:16384"
  sweep offload-m1-nofa $W/m1.gguf FA=off POINTS="ALL:4096 HALF:4096 0:4096 HALF:16384"
  say "all done"
}

dispatch "$0" "$@"
