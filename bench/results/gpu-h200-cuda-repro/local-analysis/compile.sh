#!/bin/bash
# usage: compile.sh <tree-root(contains src/)> <instance-name e.g. dkq72-dv72> <outtag> [extra nvcc flags...]
T=$1; I=$2; TAG=$3; shift 3
C=/tmp/e2e/cache/toolkits/cuda-13.0.2-linux-x86_64-pypi-7ea53c75bfab41b0
S=$T/src; B=$T/build; mkdir -p $B/$TAG
cd $B
FA="-DGGML_CUDA_FA_BF16_BF16=1 -DGGML_CUDA_FA_F16_F16=1 -DGGML_CUDA_FA_Q4_0_Q4_0=1 -DGGML_CUDA_FA_Q8_0_Q8_0=1"
for k in F16 BF16 Q4_0 Q4_1 Q5_0 Q5_1 Q8_0; do for v in F16 BF16 Q4_0 Q4_1 Q5_0 Q5_1 Q8_0; do
  case "${k}_${v}" in BF16_BF16|F16_F16|Q4_0_Q4_0|Q8_0_Q8_0) ;; *) FA="$FA -DGGML_CUDA_FA_${k}_${v}=0";; esac; done; done
X=$TAG/fattn-tile-instance-$I.cu.o
[ "$I" = "${I#fattn}" ] && SRCF=$S/ggml/src/ggml-cuda/template-instances/fattn-tile-instance-$I.cu || SRCF=$S/ggml/src/ggml-cuda/template-instances/$I.cu
start=$(date +%s.%N)
$LAUNCH $C/bin/nvcc -forward-unknown-to-host-compiler -ccbin=g++ -DGGML_BACKEND_BUILD -DGGML_BACKEND_DL -DGGML_BACKEND_SHARED $FA \
 -DGGML_CUDA_FA_QUANTS=\"q4_0-q4_0,q8_0-q8_0,f16-f16,bf16-bf16\" -DGGML_CUDA_USE_GRAPHS -DGGML_SCHED_MAX_COPIES=4 -DGGML_SHARED -D_GNU_SOURCE -D_XOPEN_SOURCE=600 -Dggml_cuda_EXPORTS \
 -I$S/ggml/src/ggml-cuda/.. -I$S/ggml/src/../include -isystem $C/include -isystem $C/include/cccl \
 -Xcompiler=-ffile-prefix-map=$S=/llama.cpp -Xcompiler=-ffile-prefix-map=$B=/build -Xcompiler=-ffile-prefix-map=$C=/cuda -objtemp -Xcudafe=--orig_src_path_name=/llama.cpp \
 -O3 -DNDEBUG -std=c++17 "--generate-code=arch=compute_75,code=[compute_75]" "--generate-code=arch=compute_90,code=[sm_90]" -Xcompiler=-fPIC -use_fast_math -extended-lambda -compress-mode=size \
 "$@" -MD -MT $X -MF $X.d -x cu -c $SRCF -o $X
rc=$?
end=$(date +%s.%N)
echo "$T $I $TAG rc=$rc time=$(echo "$end - $start" | bc)s sha=$(sha256sum $B/$X | cut -c1-16) size=$(stat -c %s $B/$X)"
