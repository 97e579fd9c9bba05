#!/usr/bin/env bash
# Layered bundles on the H200: the CPU+CUDA+Vulkan recipe for this image built through llamabundle into a directory
# store (files by content, zstd blobs), published to a distribution registry started on 127.0.0.1 (Debian's
# docker-registry 2.8, carried as .reg/docker-registry), then installed from that registry: the CPU part alone
# (--backends cpu), CUDA added to it (only its files), and the whole bundle into a new root, against the zip
# installed from the directory store (a pin of the zip takes the zip path); probe and verify --level gpu on the
# whole install; the codec measured on the whole bundle (bench/codec_choice.py); then the same recipe with another
# arch list built and installed over the whole install (an update: what moves; UPDATE=0 leaves it out); between
# them bench/hit_speed.py on the whole bundle. Carry .devtree .whl .gl .vk .reg.
#
#   bash bench/gpu/layered_h200.sh start   # starts in the background, then polls
#   bash bench/gpu/layered_h200.sh poll    # wait (at most POLL_S seconds); results in $OUT/results.tgz
set -uo pipefail
W=/tmp/lbgpu
R=$W/results
REG=oci://127.0.0.1:5000/llamabundle/bundles
# shellcheck source=poll.sh
source bench/gpu/poll.sh

timed() {  # NAME CMD...: run, stdout to $R/NAME.json, stderr to $R/NAME.err, seconds into the log
  local name=$1 t0 rc
  shift
  t0=$(date +%s.%N)
  "$@" > "$R/$name.json" 2> "$R/$name.err"
  rc=$?
  say "$name: rc=$rc $(python3 -c "print(f'{$(date +%s.%N) - $t0:.2f}')") s"
  return $rc
}

registry() {  # the distribution registry on 127.0.0.1:5000 (started once)
  python3 -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:5000/v2/')" 2>/dev/null && return
  mkdir -p $W/registry
  printf 'version: 0.1\nstorage:\n  filesystem:\n    rootdirectory: %s/registry\nhttp:\n  addr: 127.0.0.1:5000\n' $W > $W/registry.yml
  setsid nohup .reg/docker-registry serve $W/registry.yml > $W/registry.log 2>&1 < /dev/null &
  for _ in $(seq 1 50); do python3 -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:5000/v2/')" 2>/dev/null && break; sleep 0.2; done
}

from_registry() {  # zip, key and zipsha set: publish to the registry, install from it, probe and verify the installs
  registry
  timed publish-oci python3 -m llamabundle publish "$zip" --store $REG --json
  timed publish-oci-again python3 -m llamabundle publish "$zip" --store $REG --json
  say "registry blobs: $(find $W/registry -path '*blobs/sha256/*/data' | wc -l) files, $(find $W/registry -path '*blobs/sha256/*/data' -printf '%s\n' | awk '{s+=$1} END {print s}') bytes"

  timed install-zip python3 -m llamabundle install --store $W/store --key "$key" --dest $W/z --expect-sha256 "$zipsha" --json
  timed install-cpu python3 -m llamabundle install --store $REG --key "$key" --dest $W/a --backends cpu --json
  timed install-cpu-cuda python3 -m llamabundle install --store $REG --key "$key" --dest $W/a --backends cpu,cuda --json
  timed install-auto python3 -m llamabundle install --store $REG --key "$key" --dest $W/auto --backends auto --json
  timed install-full python3 -m llamabundle install --store $REG --key "$key" --dest $W/f --json
  full=$(python3 -c "import json; print(json.load(open('$R/install-full.json'))['path'])")
  timed probe-full env VK_DRIVER_FILES="${VK_DRIVER_FILES:-}" python3 -m llamabundle probe --dest $W/f --json --max-age 0
  timed verify-full-gpu python3 -m llamabundle verify "$full" --level gpu --require-gpu --json
  cpu=$(python3 -c "import json; print(json.load(open('$R/install-cpu-cuda.json'))['path'])")
  timed verify-cpu-cuda-gpu python3 -m llamabundle verify "$cpu" --level gpu --require-gpu --json
  timed probe-cpu-cuda python3 -m llamabundle probe --dest $W/a --json --max-age 0
}

run() {
  export LLAMABUNDLE_CACHE_DIR=$W/cache PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1
  # shellcheck source=multi_backend.sh
  source bench/gpu/multi_backend.sh
  vulkan_env >> $R/session.log 2>&1
  built_bundle "$(vulkan_recipe)" || { say "all done"; return; }
  zipsha=$(sha256sum "$zip" | cut -d' ' -f1)
  say "zip $(stat -c %s "$zip") bytes, sha256 $zipsha; store blobs $(du -sb $W/store/blobs | cut -f1) bytes"
  cp $W/store/$key/bundle.json $R/bundle.json
  timed codec python3 -m bench.codec_choice "$zip" --levels 3,9 --json-out $R/codec-figures.json

  from_registry
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader > $R/nvidia-smi.txt
  # a hit at the speed of the disk (issue 34): fetch and install of this bundle against cp + sha256sum + unzip
  python3 -m bench.hit_speed "$zip" --repeat 3 --json-out $R/hit-speed.json > $R/hit-speed.txt 2>&1
  say "hit-speed: rc=$? $(tail -7 $R/hit-speed.txt | tr '\n' '|')"
  [ "${UPDATE:-1}" = 0 ] && { say "all done"; return; }

  # an update to a bundle of the same toolkit and commit with another arch list: only what changed moves
  sed 's/^  archs: .*/  archs: [90-real]/' "$(vulkan_recipe)" > $W/archs90.yaml
  first=$key
  built_bundle $W/archs90.yaml || { say "all done"; return; }
  timed publish-oci-archs python3 -m llamabundle publish "$zip" --store $REG --json
  timed install-update python3 -m llamabundle install --store $REG --key "$key" --dest $W/f --json
  python3 - $W/store/$first/bundle.json $W/store/$key/bundle.json > $R/update-files.json <<'PY'
import json, sys
a, b = ({f["path"]: f for f in json.load(open(p))["files"]} for p in sys.argv[1:3])
changed = sorted(p for p in b if p not in a or a[p]["sha256"] != b[p]["sha256"])
print(json.dumps({"files": len(b), "changed": changed, "changed_bytes": sum(b[p]["size"] for p in changed),
                  "bytes": sum(f["size"] for f in b.values())}, indent=2))
PY
  say "all done"
}

case "${1:-}" in
  start) rm -rf $W && mkdir -p $R && : > $R/session.log
         python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
         setsid nohup bash bench/gpu/layered_h200.sh run > $W/run.log 2>&1 < /dev/null &
         sleep 2; POLL_S=${POLL_S:-560} poll ;;
  run) run ;;
  poll) poll ;;
  oci) export LLAMABUNDLE_CACHE_DIR=$W/cache PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH
       # (again on a machine that built both: new install roots; $4, the second bundle's key, installed over the whole)
       rm -rf $W/a $W/f $W/auto $W/z
       zip=$2 key=$3 zipsha=$(sha256sum "$2" | cut -d' ' -f1); from_registry
       [ -n "${4:-}" ] && timed install-update python3 -m llamabundle install --store $REG --key "$4" --dest $W/f --json
       tail -16 $R/session.log; collect > /dev/null ;;
  *) echo "usage: $0 start|poll"; exit 2 ;;
esac
