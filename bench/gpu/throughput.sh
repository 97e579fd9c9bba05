#!/usr/bin/env bash
# GPU throughput on the H200 machine (device tool), issue 7: does packaging for many architectures cost
# anything at run time? Builds three llama.cpp binaries of the pinned commit with the machine's CUDA 13.0:
#   (a) a llamabundle bundle whose arch list has no sm_90 code: [80-virtual] (Hopper JIT-compiles PTX 8.0)
#   (b) the same list plus 90-real: [80-virtual, 90-real]
#   (c) a plain native build: cmake + ninja, CMAKE_CUDA_ARCHITECTURES=90-real, no llamabundle
# writes a synthetic Qwen2.5-7B-shaped model (random F16 weights), quantizes it to Q4_K_M with (b)'s own
# llama-quantize, and runs `llama-bench -p 512 -n 128 -r 5` for each, plus the first-start latency with an
# empty JIT cache (CUDA_CACHE_PATH pointed at a new directory). Then the app side (issue 6) on the real GPU:
# install (b) from the store, `probe` (cuda/ok, and cuda_gpu_layers_zero with --ngl 0), `doctor`, and the
# offload planner against llama.cpp's own buffer sizes.
#
#   bash bench/gpu/throughput.sh start   # set up, start the three builds and the model in the background
#   bash bench/gpu/throughput.sh wait    # poll (at most ~8 min per call); once built, run the measurements
#                                        # in the background; every call copies what is measured to $OUT
# The model maker is the workplace's make_synthetic_gguf.py, carried in .devtree/ with the vocab file.
set -uo pipefail
COMMIT=0c1e57098bba43ac29e6e3b677cdceebdd22334f
W=/tmp/lbtp
export LLAMABUNDLE_CACHE_DIR=$W/cache PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1
BASE=recipes/linux-x86_64-cuda13.0.yaml
SRC=$LLAMABUNDLE_CACHE_DIR/src/$COMMIT
LB="python3 -m llamabundle"
R=$W/out  # results, copied to $OUT by every call

recipe() {  # NAME ARCHS: the shipped CUDA recipe with another arch list, and the bench tools as targets
  sed -e "s/^name: .*/name: $1/" -e "s/^  archs: .*/  archs: [$2]/" \
      -e "s/^targets: .*/targets: [llama-server, llama-bench, llama-quantize]/" $BASE > $W/$1.yaml
}

start() {
  rm -rf $W; mkdir -p $W $R
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee $W/gpu.txt
  /usr/local/cuda/bin/nvcc --version | tail -1; nproc
  mkdir -p $SRC && tar -C $SRC -xJf .devtree/llama-src.tar.xz && mkdir -p $SRC/models && cp .devtree/ggml-vocab-qwen2.gguf $SRC/models/
  printf '{"commit": "%s", "origin": "pypi:llama-cpp-python==0.3.36 (proven on the build host; models/ and docs/ left out for transfer)", "commit_time": 1790820708}' $COMMIT > $SRC/.llamabundle-source.json
  recipe tp-a "80-virtual"; recipe tp-b "80-virtual, 90-real"
  for x in b a; do
    setsid nohup bash -c "date +%s > $W/$x.t0; nice -n $([ $x = a ] && echo 5 || echo 0) $LB build $W/tp-$x.yaml --toolkit-source system --store $W/store --json > $W/$x.json 2> $W/$x.log; echo \$? > $W/$x.rc; date +%s > $W/$x.t1" > /dev/null 2>&1 &
  done
  setsid nohup bash -c "date +%s > $W/c.t0; cmake -S $SRC -B $W/native -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90-real -DLLAMA_BUILD_TESTS=OFF -DLLAMA_USE_PREBUILT_UI=OFF > $W/c.log 2>&1 && cmake --build $W/native --target llama-bench llama-server >> $W/c.log 2>&1; echo \$? > $W/c.rc; date +%s > $W/c.t1" > /dev/null 2>&1 &
  setsid nohup bash -c "date +%s > $W/m.t0; python3 .devtree/make_synthetic_gguf.py $SRC/models/ggml-vocab-qwen2.gguf $W/qwen7b-f16.gguf --layers 28 --hidden 3584 --ffn 18944 --heads 28 --kv-heads 4 > $W/m.log 2>&1; echo \$? > $W/m.rc; date +%s > $W/m.t1" > /dev/null 2>&1 &
  sleep 20; tail -2 $W/b.log; tail -2 $W/c.log
  poll
}

poll() {
  for i in $(seq 1 ${POLLS:-96}); do
    if [ -f $W/a.rc ] && [ -f $W/b.rc ] && [ -f $W/c.rc ] && [ -f $W/m.rc ] && [ ! -f $W/f.started ]; then
      touch $W/f.started
      setsid nohup bash -c "bash bench/gpu/throughput.sh finish > $R/finish.log 2>&1; touch $W/f.done" > /dev/null 2>&1 &
    fi
    [ -f $W/f.done ] && break
    sleep 5
  done
  for x in a b; do echo "$x: rc=$(cat $W/$x.rc 2>/dev/null)"; done
  grep -ho '\[[0-9]*/[0-9]*\]' $LLAMABUNDLE_CACHE_DIR/build/*/llamabundle-build.log 2>/dev/null | tail -2
  echo "c: $(grep -o '\[[0-9]*/[0-9]*\]' $W/c.log | tail -1) rc=$(cat $W/c.rc 2>/dev/null); model rc=$(cat $W/m.rc 2>/dev/null)"
  cp -r $R/. $OUT/ 2>/dev/null
  if [ -f $W/f.done ]; then echo DONE; tail -40 $R/finish.log; else echo "still running"; tail -5 $R/finish.log 2>/dev/null; fi
}

secs() { echo $(( $(cat $W/$1.t1) - $(cat $W/$1.t0) )); }

bench() {  # NAME BINDIR: first start with an empty JIT cache, a warm one, then pp512/tg128
  local n=$1 bin=$2 cold=$W/jit-$1
  rm -rf $cold; mkdir -p $cold
  local t0=$(date +%s.%N)
  CUDA_CACHE_PATH=$cold $bin/llama-bench -m $W/q4.gguf -p 16 -n 1 -r 1 -ngl 99 -o json > $W/$n-first.json 2> $W/$n-first.log
  local t1=$(date +%s.%N)
  CUDA_CACHE_PATH=$cold $bin/llama-bench -m $W/q4.gguf -p 16 -n 1 -r 1 -ngl 99 -o json > /dev/null 2>&1
  local t2=$(date +%s.%N)
  echo "$n first_start_cold_s=$(python3 -c "print(round($t1 - $t0, 2))") first_start_warm_s=$(python3 -c "print(round($t2 - $t1, 2))") jit_cache_bytes=$(du -sb $cold | cut -f1)" | tee -a $R/first-start.txt
  CUDA_CACHE_PATH=$cold $bin/llama-bench -m $W/q4.gguf -p 512 -n 128 -r 5 -ngl 99 -o json > $R/bench-$n.json 2> $W/$n-bench.log
  python3 -c "import json,sys; [print(sys.argv[1], 'pp512' if r['n_prompt'] else 'tg128', round(r['avg_ts'],1), '+-', round(r['stddev_ts'],1), 't/s') for r in json.load(open(sys.argv[2]))]" $n $R/bench-$n.json | tee -a $R/throughput.txt
}

finish() {
  for x in a b c m; do echo "$x rc=$(cat $W/$x.rc) seconds=$(secs $x)"; done | tee $R/times.txt
  tail -5 $W/m.log; tail -3 $W/c.log; cp $W/a.log $W/b.log $W/c.log $R/ 2>/dev/null
  for x in a b; do
    [ "$(cat $W/$x.rc)" = 0 ] || continue
    key=$($LB key $W/tp-$x.yaml)
    $LB fetch $key --store $W/store --out $W/$x --level gpu > $R/fetch-$x.txt 2>&1; echo "fetch $x rc=$?" | tee -a $R/fetch-$x.txt
    $LB verify $(python3 -c "import json; print(json.load(open('$W/$x.json'))['zip'])") --level gpu --require-gpu --json > $R/verify-$x.json 2>> $R/fetch-$x.txt
    cp $W/$x/bundle.json $R/bundle-$x.json
    /usr/local/cuda/bin/cuobjdump --list-elf --list-ptx $W/$x/libggml-cuda.so | sed 's/.*\.\(sm_[0-9a-z]*\)\.\(cubin\|ptx\)/\2 \1/' | sort | uniq -c > $R/cuobjdump-$x.txt
  done
  $W/b/llama-server --version > $R/version-b.txt 2>&1; $W/native/bin/llama-server --version > $R/version-c.txt 2>&1; cat $R/version-*.txt
  t0=$(date +%s); $W/b/llama-quantize $W/qwen7b-f16.gguf $W/q4.gguf Q4_K_M > $W/q.log 2>&1; echo "quantize rc=$? seconds=$(( $(date +%s) - t0 ))" | tee -a $R/times.txt
  ls -la $W/qwen7b-f16.gguf $W/q4.gguf | tee -a $R/times.txt
  if [ -x $W/a/llama-bench ]; then bench a $W/a
  else  # (a) not built (device time): the same PTX 8.0, JIT-compiled for sm_90 because the driver is told to
    echo "a: not built; measured as (b) with CUDA_FORCE_PTX_JIT=1 (the driver ignores (b)'s SASS and JITs its compute_80 PTX)" | tee -a $R/first-start.txt $R/throughput.txt
    CUDA_FORCE_PTX_JIT=1 bench a $W/b
  fi
  bench b $W/b; bench c $W/native/bin
  # the app side on the real GPU (issue 6)
  $LB install --store $W/store --recipe $W/tp-b.yaml --dest $W/apps --json > $R/install.json 2> $R/install.log; echo "install rc=$?" >> $R/install.log
  $LB probe --dest $W/apps --json --max-age 0 > $R/probe.json 2>&1; echo "probe rc=$?" >> $R/probe.json
  $LB probe --dest $W/apps --json --max-age 0 --ngl 0 > $R/probe-ngl0.json 2>&1
  $LB doctor --dest $W/apps > $R/doctor.txt 2>&1
  free=$(nvidia-smi --query-gpu=memory.free --format=csv,noheader,nounits | head -1)
  $LB plan $W/q4.gguf --free-vram ${free}MiB --ctx 32768 > $R/plan-q4.txt 2>&1
  $LB plan $W/q4.gguf --free-vram 6GiB --ctx 32768 >> $R/plan-q4.txt 2>&1
  timeout 240 python3 bench/offload_compare.py --server $W/b/llama-server --model $W/q4.gguf --points 29:4096,29:32768,15:8192,1:4096,0:4096 --out $R/offload-h200.md > $R/offload.log 2>&1; echo "offload rc=$?" >> $R/offload.log
  cat $R/first-start.txt $R/throughput.txt; head -30 $R/offload-h200.md; cat $R/probe.json | head -30
}

case "${1:-}" in start) start ;; wait) poll ;; finish) finish ;; *) echo "usage: $0 start|wait"; exit 2 ;; esac
