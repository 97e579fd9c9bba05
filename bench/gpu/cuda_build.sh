#!/usr/bin/env bash
# Build and verify the linux-x86_64-cuda13.0 bundle on the GPU machine (device tool), with the
# machine's own CUDA 13.0 toolkit (--toolkit-source system). Nothing can be fetched there, so the
# proven llama.cpp tree travels as .devtree/llama-src.tar.xz (models/ and docs/ left out; made by
# `bash bench/gpu/cuda_build.sh pack` from this host's proven source cache, with its marker's proof
# and commit date in .devtree/proof.json) and the Python packages the image lacks as wheels in .whl/.
#
#   bash bench/gpu/cuda_build.sh start   # set up, start the build (and a plain ggml-cuda build with
#                                        # GGML_CUDA_COMPRESSION_MODE=none for the size comparison)
#   BUILD_ARGS=--check-reproducible bash bench/gpu/cuda_build.sh start   # build twice, compare the zips
#   bash bench/gpu/cuda_build.sh wait    # wait (at most ~9 min per call); when done, verify and
#                                        # copy bundle.json, verify output and logs to $OUT
set -uo pipefail
COMMIT=0c1e57098bba43ac29e6e3b677cdceebdd22334f
W=/tmp/lbgpu
export LLAMABUNDLE_CACHE_DIR=$W/cache PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1
RECIPE=${RECIPE:-recipes/linux-x86_64-cuda13.0.yaml}  # multi_backend.sh sets the CPU+CUDA+Vulkan one

start() {
  mkdir -p $W && rm -f $W/build.rc $W/t1 $W/nocomp.rc
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  /usr/local/cuda/bin/nvcc --version | tail -2; ls /usr/local/cuda/lib64/libcudart.so.* /usr/local/cuda/lib64/libcublas.so.* | head -4; ls /usr/local/cuda/EULA.txt /usr/local/cuda/*.txt 2>&1 | head -3
  gcc --version | head -1; cmake --version | head -1; nproc
  src=$LLAMABUNDLE_CACHE_DIR/src/$COMMIT
  mkdir -p $src && tar -C $src -xJf .devtree/llama-src.tar.xz
  # The marker the source cache re-proves (format 2): the build host's proof and commit date, this tree's listing.
  python3 - "$src" <<'PY' || exit 1
import json, sys
from pathlib import Path
from llamabundle import source
src = Path(sys.argv[1]); carried = json.loads(Path(".devtree/proof.json").read_text())
m = source.Marker(commit=src.name, origin=carried["origin"] + " (proven on the build host; models/ and docs/ left out for transfer)",
                  commit_time=carried["commit_time"], proof=carried["proof"], tree=source.record_tree(src))
(src / source.MARKER).write_text(json.dumps(m.to_json()), encoding="utf-8")
print("source marker written:", m.tree.files, "files")
PY
  date +%s > $W/t0
  setsid nohup bash -c "python3 -m llamabundle build $RECIPE --toolkit-source system --store $W/store ${BUILD_ARGS:-} --json > $W/build.json 2> $W/build.log; echo \$? > $W/build.rc; date +%s > $W/t1" > /dev/null 2>&1 &
  if [ "${NOCOMP:-1}" = 0 ]; then echo skipped > $W/nocomp.rc; sleep 5; tail -3 $W/build.log; wait_build; return; fi
  # Same source, same archs, compression off: only the ggml-cuda target, at lower priority.
  setsid nohup bash -c "nice -n 10 cmake -S $src -B $W/nocomp -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=ON -DGGML_BACKEND_DL=ON -DGGML_NATIVE=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DCMAKE_CUDA_ARCHITECTURES='75-virtual;90-real' -DGGML_CUDA_COMPRESSION_MODE=none > $W/nocomp.log 2>&1 && nice -n 10 cmake --build $W/nocomp --target ggml-cuda >> $W/nocomp.log 2>&1; echo \$? > $W/nocomp.rc" > /dev/null 2>&1 &
  sleep 5; tail -3 $W/build.log
  wait_build
}

wait_build() {
  for i in $(seq 1 ${POLLS:-106}); do
    [ -f $W/build.rc ] && [ -f $W/nocomp.rc ] && break
    sleep 5
  done
  grep -o '\[[0-9]*/[0-9]*\]' $LLAMABUNDLE_CACHE_DIR/build/*/llamabundle-build.log 2>/dev/null | tail -1
  grep -o '\[[0-9]*/[0-9]*\]' $W/nocomp.log 2>/dev/null | tail -1
  if [ -f $W/build.rc ]; then finish; else echo "still building"; fi
}

finish() {
  echo "build rc=$(cat $W/build.rc) seconds=$(( $(cat $W/t1) - $(cat $W/t0) ))"
  tail -40 $W/build.log
  cp $W/build.log $OUT/build.log; cp $W/build.json $OUT/build.json
  zip=$(python3 -c "import json; print(json.load(open('$W/build.json'))['zip'])" 2>/dev/null) || { echo "no bundle"; return; }
  python3 -m llamabundle verify "$zip" --level gpu --require-gpu > $OUT/verify-gpu.txt 2>&1; echo "verify rc=$?" >> $OUT/verify-gpu.txt
  python3 -m llamabundle verify "$zip" --level gpu --json > $OUT/verify-gpu.json 2>/dev/null
  cat $OUT/verify-gpu.txt
  python3 -c "import zipfile,sys; sys.stdout.buffer.write(zipfile.ZipFile(sys.argv[1]).read(\"bundle.json\"))" "$zip" > $OUT/bundle.json
  rm -rf $W/x; python3 -m zipfile -e "$zip" $W/x
  /usr/local/cuda/bin/cuobjdump --list-elf --list-ptx $W/x/libggml-cuda.so | sed 's/.*\.\(sm_[0-9a-z]*\)\.\(cubin\|ptx\)/\2 \1/' | sort | uniq -c > $OUT/cuobjdump.txt
  cat $OUT/cuobjdump.txt
  {
    echo "bundle zip: $(stat -c %s "$zip") bytes"
    echo "libggml-cuda.so (compression size): $(stat -c %s $W/x/libggml-cuda.so) bytes"
    if [ "$(cat $W/nocomp.rc 2>/dev/null)" = 0 ]; then
      n=$(ls $W/nocomp/bin/libggml-cuda.so); echo "libggml-cuda.so (compression none): $(stat -c %s $n) bytes"
      cp -r $W/x $W/y && cp $n $W/y/libggml-cuda.so && python3 -c "import sys; sys.path.insert(0, \"$PWD\"); from pathlib import Path; from llamabundle.bundle import pack; pack(Path(sys.argv[1]), Path(sys.argv[2]))" $W/y $W/nocomp.zip && echo "bundle zip with the uncompressed ggml-cuda (same packer): $(stat -c %s $W/nocomp.zip) bytes"
    else echo "no-compression build: rc=$(cat $W/nocomp.rc 2>/dev/null)"; tail -5 $W/nocomp.log; fi
  } | tee $OUT/sizes.txt
}

pack() {  # on the build host: the proven source tree without models/ and docs/, and its marker's proof
  local cache=${LLAMABUNDLE_HOST_CACHE:-$HOME/.cache/llamabundle} src
  src=$cache/src/$COMMIT
  [ -f $src/.llamabundle-source.json ] || { echo "no proven source in $src: run a build there first"; exit 1; }
  mkdir -p .devtree && grep -qx '/.devtree/' .git/info/exclude 2>/dev/null || echo /.devtree/ >> .git/info/exclude
  tar -C $src --exclude=./models --exclude=./docs --exclude=./.llamabundle-source.json -cJf .devtree/llama-src.tar.xz .
  python3 -c "import json,sys; m=json.load(open(sys.argv[1])); json.dump({k: m[k] for k in ('origin','commit_time','proof')}, open('.devtree/proof.json','w'))" $src/.llamabundle-source.json
  ls -l .devtree
}

case "${1:-}" in start) start ;; wait) wait_build ;; pack) pack ;; *) echo "usage: $0 pack|start|wait"; exit 2 ;; esac
