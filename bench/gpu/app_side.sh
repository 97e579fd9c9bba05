#!/usr/bin/env bash
# The app side's fallback causes on a real GPU (device tool), from a CUDA bundle already built there
# (cuda_build.sh or multi_backend.sh: $W/build.json), each with probe's JSON in $OUT:
#
#   hidden     the machine's CUDA toolkit hidden (a private mount namespace, a tmpfs over /usr/local/cuda)
#              and libcudart removed from a copy of the bundle: cuda_library_missing, naming it
#   intact     the same with the toolkit hidden and the bundle intact: ok (the bundle needs no toolkit)
#   archs      a build for archs [80-real] only (no Hopper SASS, no PTX): cuda_arch_unsupported; the build
#              takes the recipe with its archs replaced (ggml-cuda only, about as long as the full build)
#
#   bash bench/gpu/app_side.sh hidden|intact|archs-start|archs-wait
set -uo pipefail
W=/tmp/lbgpu
export LLAMABUNDLE_CACHE_DIR=$W/cache PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1
OUT=${OUT:-$PWD/app-side}
mkdir -p "$OUT"

unpacked() {  # a fresh copy of the built bundle in $W/$1
  local key
  key=$(python3 -c "import json; print(json.load(open('$W/build.json'))['key'])") || { echo "no bundle: build first"; exit 1; }
  rm -rf "$W/$1" && python3 -m llamabundle fetch "$key" --store $W/store --out "$W/$1" > /dev/null || exit 1
}

probe_hidden() {  # probe the bundle in $W/$1 with /usr/local/cuda hidden; JSON to $OUT/$2
  unshare -m bash -c "mount -t tmpfs none /usr/local/cuda && ls /usr/local/cuda | wc -l && python3 -m llamabundle probe --bundle $W/$1 --json" > "$OUT/$2" 2> "$OUT/$2.err"
  echo "probe rc=$?"
  python3 -c "import json,sys; r=json.loads(open(sys.argv[1]).read().split('\n',1)[1]); print(r['backend'], r['reason'], r['sentence']); print(json.dumps(r['facts'].get('cause'), indent=1))" "$OUT/$2"
}

case "${1:-}" in
  hidden) unpacked hidden; rm -f $W/hidden/libcudart.so*; probe_hidden hidden probe-hidden-no-cudart.json ;;
  intact) unpacked intact; probe_hidden intact probe-hidden-intact.json ;;
  archs-start)
    sed 's/^  archs: .*/  archs: [80-real]/' recipes/linux-x86_64-cuda13.0.yaml > $W/cuda-sm80.yaml
    grep -n "archs" $W/cuda-sm80.yaml
    setsid nohup bash -c "python3 -m llamabundle build $W/cuda-sm80.yaml --toolkit-source system --store $W/store80 --json > $W/build80.json 2> $W/build80.log; echo \$? > $W/build80.rc" > /dev/null 2>&1 &
    sleep 5; tail -3 $W/build80.log ;;
  archs-wait)
    for _ in $(seq 1 ${POLLS:-100}); do [ -f $W/build80.rc ] && break; sleep 5; done
    [ -f $W/build80.rc ] || { echo "still building"; tail -2 $W/build80.log; exit 0; }
    echo "build rc=$(cat $W/build80.rc)"; tail -5 $W/build80.log
    key=$(python3 -c "import json; print(json.load(open('$W/build80.json'))['key'])") || exit 1
    rm -rf $W/b80 && python3 -m llamabundle fetch "$key" --store $W/store80 --out $W/b80 > /dev/null || exit 1
    python3 -m llamabundle probe --bundle $W/b80 --json > "$OUT/probe-sm80-only.json"; echo "probe rc=$?"
    python3 -c "import json; r=json.load(open('$OUT/probe-sm80-only.json')); print(r['backend'], r['reason'], r['sentence'])" ;;
  *) echo "usage: $0 hidden|intact|archs-start|archs-wait"; exit 2 ;;
esac
