#!/usr/bin/env bash
# llama.cpp's GPU buffers against `llamabundle plan` for more model shapes, in one device call (the rest of a
# session's device time): a plain CMake build of the pinned llama-server and llama-quantize for sm_90 only
# (no bundle: the buffers do not depend on packaging), the models made meanwhile (Qwen2.5-7B's shape with 6
# blocks, F16 and quantized to Q4_K_M; a model without GQA), then bench/gpu/offload_buffers.sh on each. Every
# step is bounded so that what was measured comes back as $OUT/results.tgz before the call's limit.
#
#   bash bench/gpu/offload_sweep.sh     # carry .devtree .whl; LIMIT_S (default 540) bounds the whole run
set -uo pipefail
W=/tmp/lbsweep R=/tmp/lbsweep/results
mkdir -p $R
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH
end=$(( $(date +%s) + ${LIMIT_S:-540} ))
left() { echo $(( end - $(date +%s) )); }
say() { echo "$(date +%T) $*" | tee -a $R/session.log; }
finish() { tar -C $W -czf "$OUT/results.tgz" results; exit 0; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || finish
mkdir -p $W/src && tar -C $W/src -xJf .devtree/llama-src.tar.xz
gen() { python3 .devtree/make_synthetic_gguf.py .devtree/ggml-vocab-qwen2.gguf $W/$1.gguf "${@:2}" > $R/gen-$1.log 2>&1; }
(nice -n 10 bash -c "$(declare -f gen); W=$W R=$R; gen m2 --layers 6 --hidden 3584 --ffn 18944 --heads 28 --kv-heads 4; gen m3 --layers 8 --hidden 2048 --ffn 5632 --heads 16 --kv-heads 16") &
say "configure"
cmake -S $W/src -B $W/b -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=ON -DGGML_NATIVE=ON -DLLAMA_BUILD_TESTS=OFF \
  -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DGGML_CUDA_NCCL=OFF -DCMAKE_CUDA_ARCHITECTURES=90-real \
  -DCMAKE_CUDA_COMPILER=/usr/local/cuda/bin/nvcc > $R/configure.log 2>&1 || { tail -20 $R/configure.log; finish; }
say "build"
timeout $(( $(left) - 150 )) cmake --build $W/b --target llama-server llama-quantize -j 16 > $R/build.log 2>&1
say "build rc=$? $(grep -o '\[[0-9]*/[0-9]*\]' $R/build.log | tail -1)"
[ -x $W/b/bin/llama-server ] || finish
wait
(cd $W/b/bin && LD_LIBRARY_PATH=. timeout 60 ./llama-quantize $W/m2.gguf $W/m2q.gguf Q4_K_M 16) > $R/quantize.log 2>&1
say "quantize rc=$? $(ls -l $W/*.gguf | awk '{print $5}' | tr '\n' ' ')"
sweep() {
  local name=$1 model=$2; shift 2
  [ "$(left)" -gt 25 ] || return
  env "$@" OUT=$R/$name RUN_TIMEOUT=30 timeout $(( $(left) - 10 )) bash bench/gpu/offload_buffers.sh $W/b/bin "$model" > $R/$name.txt 2>&1
  say "$name rc=$?"; grep ',compute,gpu,' $R/$name/offload_buffers.csv 2> /dev/null | tee -a $R/session.log
}
sweep offload-m2q $W/m2q.gguf POINTS="ALL:4096 ALL:16384 HALF:4096 HALF:16384 1:4096 0:4096 0:16384 0:32768"
sweep offload-m3 $W/m3.gguf POINTS="ALL:4096 HALF:4096 HALF:16384 0:4096 0:16384"
sweep offload-m2 $W/m2.gguf POINTS="ALL:4096 HALF:4096 0:4096 0:16384"
finish
