#!/usr/bin/env bash
# On the GPU machine (device tool): does nvcc 13.0 (with the machine's gcc) give the same ggml-cuda objects
# from two source/build directories? The flags llamabundle passes (backends/cuda: prefix maps, -objtemp,
# cudafe's source path), against the prefix maps alone. CMake configures each tree as a build of the CUDA
# recipe would; ninja builds only the objects named in FILES (a full ggml-cuda build takes ~7 minutes).
set -uo pipefail
W=/tmp/nvrepro; rm -rf $W; mkdir -p $W/a/src $W/b/elsewhere/src
tar -C $W/a/src -xJf .devtree/llama-src.tar.xz && cp -a $W/a/src/. $W/b/elsewhere/src/
FILES=${FILES:-"argsort sum cumsum mean fill scale softmax norm getrows concat pad arange"}
FIX="-objtemp -Xcudafe=--orig_src_path_name=/llama.cpp"
build() {  # $1 source dir, $2 build dir, $3 extra nvcc flags
  local maps="-Xcompiler=-ffile-prefix-map=$1=/llama.cpp -Xcompiler=-ffile-prefix-map=$2=/build"
  cmake -S $1 -B $2 -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=ON -DGGML_BACKEND_DL=ON -DGGML_NATIVE=OFF \
    -DGGML_CPU_ALL_VARIANTS=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DGGML_CUDA_NCCL=OFF \
    -DCMAKE_CUDA_ARCHITECTURES='75-virtual;90-real' -DGGML_CUDA_COMPRESSION_MODE=size \
    "-DCMAKE_CUDA_FLAGS=$maps $3" > $2.configure.log 2>&1 || { echo "configure failed: $2"; tail -5 $2.configure.log; return 1; }
  local objs=""; for f in $FILES; do objs="$objs ggml/src/ggml-cuda/CMakeFiles/ggml-cuda.dir/$f.cu.o"; done
  # BUDGET (seconds) stops the build early; what was built in both trees is compared.
  timeout ${BUDGET:-3600} ninja -C $2 -j${JOBS:-8} $objs > $2.build.log 2>&1 || { echo "build stopped or failed: $2"; tail -2 $2.build.log; }
}
compare() {  # $1 tag
  local same=0 differ=0 bytes=0 missing=0
  for f in $FILES; do
    o=ggml/src/ggml-cuda/CMakeFiles/ggml-cuda.dir/$f.cu.o
    [ -f $W/a/build-$1/$o ] && [ -f $W/b/elsewhere/build-$1/$o ] || { missing=$((missing+1)); continue; }
    n=$(cmp -l $W/a/build-$1/$o $W/b/elsewhere/build-$1/$o 2>/dev/null | wc -l)
    if [ "$n" = 0 ] && cmp -s $W/a/build-$1/$o $W/b/elsewhere/build-$1/$o; then same=$((same+1)); else differ=$((differ+1)); bytes=$((bytes+n)); echo "  $1 $f.cu.o: $n bytes differ"; fi
  done
  echo "$1: $same of $(echo $FILES | wc -w) objects identical, $differ differ ($bytes bytes), $missing not built in time"
}
nvcc_v=$(/usr/local/cuda/bin/nvcc --version | tail -1); echo "nvcc: $nvcc_v; $(gcc --version | head -1)"
t0=$(date +%s)
export PATH=/usr/local/cuda/bin:$PATH; command -v ninja >/dev/null || export PATH=/opt/torch/.venv/bin:$PATH
( build $W/a/src $W/a/build-fix "$FIX" ) & ( build $W/b/elsewhere/src $W/b/elsewhere/build-fix "$FIX" ) &
if [ "${FIX_ONLY:-0}" = 0 ]; then ( build $W/a/src $W/a/build-maps "" ) & ( build $W/b/elsewhere/src $W/b/elsewhere/build-maps "" ) & fi; wait
echo "built in $(( $(date +%s) - t0 )) s"
: > $OUT/nvcc-repro.txt; [ "${FIX_ONLY:-0}" = 0 ] && compare maps | tee -a $OUT/nvcc-repro.txt
compare fix | tee -a $OUT/nvcc-repro.txt
sha256sum $W/a/build-fix/ggml/src/ggml-cuda/CMakeFiles/ggml-cuda.dir/*.cu.o $W/a/build-fix/ggml/src/ggml-cuda/CMakeFiles/ggml-cuda.dir/template-instances/*.cu.o 2>/dev/null | sed "s|$W/a/build-fix/||" > $OUT/fix-a.sha256
sha256sum $W/b/elsewhere/build-fix/ggml/src/ggml-cuda/CMakeFiles/ggml-cuda.dir/*.cu.o $W/b/elsewhere/build-fix/ggml/src/ggml-cuda/CMakeFiles/ggml-cuda.dir/template-instances/*.cu.o 2>/dev/null | sed "s|$W/b/elsewhere/build-fix/||" > $OUT/fix-b.sha256
diff $OUT/fix-a.sha256 $OUT/fix-b.sha256 > /dev/null && echo "fix: sha256 lists identical" | tee -a $OUT/nvcc-repro.txt
