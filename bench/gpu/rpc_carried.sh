#!/usr/bin/env bash
# Issue 35's GPU runs (rpc_h200.sh's RPC phase) where too little device time is left to build the CUDA bundle on the
# GPU machine: the CUDA bundle built on the build host (recipes/linux-x86_64-cuda13.0.yaml narrowed to archs [90-real]
# with GGML_CUDA_FA off, PyPI toolkit 13.0.2, --ops-tool) travels in .gpu/ without NVIDIA's libraries, which exceed
# what a call carries: cuda.tar.xz (the unpacked bundle less them), tbo and tbo.rpc-preload.so (its test-backend-ops and
# RPC preload). There each missing library is copied from the machine's CUDA 13 (/usr/local/cuda) and compared with the
# sha256 bundle.json records. Where all agree, the zip is made again (llamabundle's pack) and verified --level ops as
# it is; else the ops level runs on the directory (verify.check_ops, what verify --level ops runs) and the log names the
# libraries that differ. Carry .gpu, .rpc and .whl.
#
#   bash bench/gpu/rpc_carried.sh start   # set up, start in the background, poll
#   bash bench/gpu/rpc_carried.sh poll    # wait (at most POLL_S seconds); results in $OUT/results.tgz
set -uo pipefail
W=/tmp/lbgpu
R=$W/results
# shellcheck source=poll.sh
source bench/gpu/poll.sh
# shellcheck source=rpc_h200.sh
source bench/gpu/rpc_h200.sh

orchestrate() {
  export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 LLAMABUNDLE_CACHE_DIR=$W/cache
  local c=$W/rpc/cuda
  mkdir -p $c && tar -C $c -xJf .gpu/cuda.tar.xz && cp .gpu/tbo .gpu/tbo.rpc-preload.so $W/rpc/
  python3 - $c >> $R/session.log 2>&1 <<'PY'
import hashlib, json, shutil, sys
from pathlib import Path
root = Path(sys.argv[1])
files = {f["path"]: f["sha256"] for f in json.loads((root / "bundle.json").read_text())["files"]}
libs = [d for d in (Path("/usr/local/cuda/lib64"), Path("/usr/local/cuda/targets/x86_64-linux/lib")) if d.is_dir()]
same = True
for path, sha in sorted(files.items()):
    if (root / path).exists():
        continue
    found = next((d / path for d in libs if (d / path).is_file()), None)
    if found is None:
        print(f"missing: {path}: not in {[str(d) for d in libs]}"); same = False; continue
    shutil.copy(found, root / path)
    got = hashlib.sha256((root / path).read_bytes()).hexdigest()
    print(f"{path}: from {found.resolve()}: {'the same bytes' if got == sha else 'differs from the bundle built (sha256 ' + got[:12] + ', recorded ' + sha[:12] + ')'}")
    same &= got == sha
if same:
    from llamabundle import bundle
    import datetime as dt
    built = dt.datetime.fromisoformat(bundle.read_manifest(root).built_at.replace("Z", "+00:00"))
    bundle.pack(root, Path(sys.argv[1] + ".zip"), source_date_epoch=int(built.timestamp()))
    print("all NVIDIA libraries the same: zip made again")
PY
  say "nvidia libs: $(grep -c 'the same bytes' $R/session.log) same, $(grep -c 'differs\|missing' $R/session.log) differ or missing"
  if [ -f $c.zip ]; then rpc_dir $c.zip; else rpc_dir ""; fi
  say "all done"
}

case "${1:-}" in
  start) rm -rf $W && mkdir -p $R && : > $R/session.log
         python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
         nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $R/gpu.txt; nproc >> $R/gpu.txt
         ls -l /usr/local/cuda/lib64/ | grep -E "cublas|cudart|nvrtc" >> $R/gpu.txt
         setsid nohup bash bench/gpu/rpc_carried.sh orchestrate > $R/orchestrate.out 2>&1 < /dev/null &
         sleep 5; POLL_S=${POLL_S:-540} poll ;;
  orchestrate) orchestrate ;;
  poll) poll ;;
  *) echo "usage: $0 start|poll"; exit 2 ;;
esac
