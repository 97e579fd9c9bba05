#!/usr/bin/env bash
# Issue 16's partial-offload sizes on the H200, unattended (the machine goes back 30 s after a call, so the
# calls only start and poll it):
#   1. the shipped CUDA 13.0 recipe with archs [90-real], built through llamabundle with the machine's
#      toolkit (llamabundle-memory built beside llama-server) and fetched from the store as an unpacked bundle;
#   2. bench/offload_dryrun.py on four models (stop 23's 16-block model, Qwen2.5-7B's shape with 6 blocks in
#      F16 and in Q4_K_M from the build tree's llama-quantize, a model without GQA): llama-server's logged
#      GPU buffers against the bundle's llamabundle-memory (what `plan` asks) and the closed form,
#      at full and partial offload; then `plan` with the dry run for free-VRAM sizes that force partial
#      offload, each plan launched and checked to fit;
#   3. `llamabundle plan --bundle` itself, free VRAM from nvidia-smi and from --free-vram (text and --json).
#
#   bash bench/gpu/dryrun_h200.sh start   # carry .devtree .whl; sets up, starts, then polls like `poll`
#   bash bench/gpu/dryrun_h200.sh poll    # wait (at most POLL_S seconds) for the end; results in $OUT
set -uo pipefail
W=/tmp/lbgpu
R=$W/results
# shellcheck source=poll.sh
source bench/gpu/poll.sh

compare() {  # NAME MODEL offload_dryrun.py args...
  local name=$1 model=$2; shift 2
  [ -f "$model" ] || { say "$name: no model $model"; return; }
  timeout 300 python3 bench/offload_dryrun.py $W/b90 "$model" "$@" --json $R/$name.json > $R/$name.txt 2>&1
  say "$name rc=$?"; cat $R/$name.txt >> $R/session.log
}

orchestrate() {
  local build
  arch_bundle 90-real bench/gpu/dryrun_h200.sh $W/b90 || { say "all done"; return; }
  ls -l $W/b90 >> $R/session.log
  build=$(ls -d $W/cache/build/*/ | head -1)
  (nice cmake --build "$build" --target llama-quantize > $R/quantize-build.log 2>&1) &
  for _ in $(seq 1 120); do [ -f $W/m3.rc ] && break; sleep 2; done
  say "models: $(cat $W/m1.rc $W/m2.rc $W/m3.rc 2> /dev/null | tr '\n' ' ') $(ls -l $W/*.gguf | awk '{print $5}' | tr '\n' ' ')"
  compare dryrun-m1 $W/m1.gguf 0:4096 1:4096 4:4096 HALF:4096 HALF:16384 HALF:32768 16:8192 8:16384:4:u ALL:4096 ALL:32768 \
    --plan 1000:32768 --plan 700:8192 --plan 1500:16384
  wait
  (cd "$build/bin" && LD_LIBRARY_PATH=. ./llama-quantize $W/m2.gguf $W/m2q.gguf Q4_K_M 16) > $R/quantize.log 2>&1
  say "quantize rc=$? $(stat -c %s $W/m2q.gguf 2> /dev/null) bytes"
  compare dryrun-m2q $W/m2q.gguf 0:4096 1:4096 HALF:4096 HALF:16384 HALF:32768 5:8192 3:16384:4:u ALL:4096 ALL:16384 \
    --plan 1500:16384 --plan 1100:32768 --plan 2500:4096
  compare dryrun-m3 $W/m3.gguf 0:4096 HALF:4096 HALF:16384 2:16384 6:32768 ALL:4096 --plan 1200:16384 --plan 2500:32768
  compare dryrun-m2 $W/m2.gguf 0:4096 HALF:4096 HALF:32768 ALL:4096 --plan 4000:8192 --plan 6000:32768
  # llama-fit-params (built in the same tree) for a few of the same launches: its context keeps every logit
  (cd "$build" && nice cmake --build . --target llama-fit-params > $R/fit-params-build.log 2>&1)
  for a in "-ngl 0 -c 4096" "-ngl 4 -c 4096" "-ngl 17 -c 4096"; do
    echo "llama-fit-params --fit-print on $a: $(cd $build/bin && LD_LIBRARY_PATH=. ./llama-fit-params --fit-print on -m $W/m1.gguf $a -np 1 -fa on 2> /dev/null | tr '\n' ' ')" >> $R/fit-params.txt
    echo "llamabundle-memory $a: $($W/b90/llamabundle-memory -m $W/m1.gguf $a -np 1 -fa on 2> /dev/null | tr '\n' ' ')" >> $R/fit-params.txt
  done
  cat $R/fit-params.txt >> $R/session.log
  python3 -m llamabundle plan $W/m2q.gguf --bundle $W/b90 -- -c 32768 -np 2 -fa on > $R/plan-cli-smi.txt 2>&1; say "plan (nvidia-smi) rc=$?"
  cat $R/plan-cli-smi.txt >> $R/session.log
  python3 -m llamabundle plan $W/m2q.gguf --bundle $W/b90 --free-vram 1200MiB --ctx 16384 --json > $R/plan-cli.json 2> $R/plan-cli.err
  say "plan --json rc=$? $(python3 -c "import json; d=json.load(open('$R/plan-cli.json')); print(d['ngl'], d['estimate_by'], d['dry_run'], d['bytes'])")"
  say "all done"
}

dispatch "$0" "$@"
