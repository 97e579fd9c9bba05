# Shared by the unattended GPU-machine sessions (session.sh, sm80_offload.sh, dryrun_h200.sh): the machine goes back 30 s
# after a call, so a session runs in the background (setsid) and each device call only polls it. Sourced;
# the caller sets W (work dir) and R (results dir) and writes "all done" to $R/session.log at the end.
say() { echo "$(date +%T) $*" >> $R/session.log; }

collect() {  # everything so far, as one file (at most 8 come back)
  [ -d $R ] && tar -C $W -czf "$OUT/results.tgz" results 2> /dev/null
  tail -${TAIL:-60} $R/session.log 2> /dev/null
  grep -ho '\[[0-9]*/[0-9]*\]' $W/cache/build/*/llamabundle-build.log $W/c80/build/*/llamabundle-build.log 2> /dev/null | tail -1
  tail -2 $W/build.log 2> /dev/null
}

poll() {  # wait at most POLL_S seconds for the end (UNTIL_NEW=1: for a few new log lines), then collect
  local n0
  if [ ! -f $R/session.log ]; then  # a fresh machine: the one that ran the session was given back
    echo "error: no session on this machine ($R/session.log missing): the machine was given back and its work lost; start again" >&2
    return 3
  fi
  n0=$(wc -l < $R/session.log 2> /dev/null || echo 0)
  for _ in $(seq 1 $(( ${POLL_S:-560} / 5 ))); do
    grep -q "all done\|B: no zip" $R/session.log 2> /dev/null && break
    [ "${UNTIL_NEW:-0}" = 1 ] && [ "$(wc -l < $R/session.log)" -gt "$((n0 + 2))" ] && break
    sleep 5
  done
  collect
}

# The models of the offload sessions (sm80_offload.sh, dryrun_h200.sh), made on the GPU machine meanwhile.
gen() {  # NAME make_synthetic_gguf.py flags...: an F16 Qwen2 model with random weights
  local name=$1; shift
  python3 .devtree/make_synthetic_gguf.py .devtree/ggml-vocab-qwen2.gguf $W/$name.gguf "$@" > $W/$name.log 2>&1
  echo $? > $W/$name.rc
}

models() {
  gen m1 --layers 16 --hidden 1536 --ffn 4096 --heads 12 --kv-heads 2   # the stop-23 model
  gen m2 --layers 6 --hidden 3584 --ffn 18944 --heads 28 --kv-heads 4   # Qwen2.5-7B's shape, 6 blocks
  gen m3 --layers 8 --hidden 2048 --ffn 5632 --heads 16 --kv-heads 16   # no GQA: large K/V views
}

dispatch() {  # SCRIPT start|orchestrate|poll|models: a session script's commands (it defines orchestrate)
  local script=$1; shift
  case "${1:-}" in
    start)
      mkdir -p $R
      nvidia-smi --query-gpu=name,driver_version,memory.total,compute_cap --format=csv,noheader > $R/gpu.txt; nproc >> $R/gpu.txt
      setsid nohup bash "$script" orchestrate > $R/orchestrate.out 2>&1 < /dev/null &
      sleep 20; cat $R/gpu.txt; poll ;;
    orchestrate) orchestrate ;;
    poll) poll ;;
    models) models ;;
    *) echo "usage: $script start|poll"; exit 2 ;;
  esac
}

arch_bundle() {  # ARCH SCRIPT DIR: the shipped CUDA 13.0 recipe with archs [ARCH], built through llamabundle
  # (bench/gpu/cuda_build.sh) while SCRIPT makes the models, fetched from the store unpacked into DIR; sets
  # key (the bundle's) and the environment the session runs llamabundle in, or fails when there is no bundle
  export LLAMABUNDLE_CACHE_DIR=$W/cache PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1
  sed "s/^  archs: .*/  archs: [$1]/" recipes/linux-x86_64-cuda13.0.yaml > $W/cuda-$1.yaml
  grep -n "archs" $W/cuda-$1.yaml >> $R/session.log
  say "build cuda-$1.yaml"
  RECIPE=$W/cuda-$1.yaml NOCOMP=0 POLLS=1 bash bench/gpu/cuda_build.sh start >> $R/session.log 2>&1
  (nice -n 5 bash "$2" models) &
  for _ in $(seq 1 300); do [ -f $W/build.rc ] && break; sleep 5; done
  say "build rc=$(cat $W/build.rc 2> /dev/null) in $(( $(cat $W/t1) - $(cat $W/t0) )) s"
  tail -30 $W/build.log >> $R/session.log; cp $W/build.log $W/build.json $R/ 2> /dev/null
  key=$(python3 -c "import json; print(json.load(open('$W/build.json'))['key'])") || { say "no bundle"; return 1; }
  rm -rf "$3" && python3 -m llamabundle fetch "$key" --store $W/store --out "$3" >> $R/session.log 2>&1
}

vulkan_recipe() {  # the CPU+CUDA+Vulkan recipe with this image's g++ 13.3: its path (the caller runs multi_backend.sh's
  # vulkan_env first, in its own shell: it exports what the build needs)
  sed 's/^name: linux-x86_64-cuda13.0-vulkan$/name: linux-x86_64-cuda13.0-vulkan-ubuntu24.04/; s/version: "=12.2.0"/version: "=13.3.0"/' \
    recipes/linux-x86_64-cuda13.0-vulkan.yaml > $W/linux-x86_64-cuda13.0-vulkan-ubuntu24.04.yaml
  echo $W/linux-x86_64-cuda13.0-vulkan-ubuntu24.04.yaml
}

built_bundle() {  # RECIPE: built through llamabundle into $W/store (cuda_build.sh) with the carried web UI; sets zip
  # and key, or says so and fails when there is no bundle
  ui=$W/cache/ui/$(cat .devtree/ui.id) && mkdir -p "$ui" && tar -C "$ui" -xJf .devtree/ui.tar.xz
  say "build $1"
  RECIPE=$1 NOCOMP=0 POLLS=1 bash bench/gpu/cuda_build.sh start >> $R/session.log 2>&1
  while [ ! -f $W/build.rc ]; do sleep 5; done
  say "build rc=$(cat $W/build.rc) in $(( $(cat $W/t1) - $(cat $W/t0) )) s"
  cp $W/build.log $W/build.json $R/ 2>/dev/null
  zip=$(python3 -c "import json; print(json.load(open('$W/build.json'))['zip'])") || { say "no zip"; return 1; }
  key=$(python3 -c "import json; print(json.load(open('$W/build.json'))['key'])")
}
