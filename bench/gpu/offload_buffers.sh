#!/usr/bin/env bash
# llama.cpp's own GPU buffer sizes against `llamabundle plan`, on the GPU machine (device tool): for full and
# partial offload at a few contexts, start the bundle's llama-server (127.0.0.1, --fit off, --verbose), wait
# until the model is loaded, stop it, and read its "model / KV / compute / output buffer size" lines; then ask
# `python3 -m llamabundle plan` for the same flags (--free-vram 1MiB --headroom 0: the app's -ngl is kept, so
# its bytes are the estimate of exactly these flags). Writes $OUT/offload_buffers.csv (one row per buffer:
# CUDA0, CUDA_Host, CPU...; estimate and ratio on the GPU rows), the logs and the plans beside it.
#
#   PYTHONPATH=$PWD bash bench/gpu/offload_buffers.sh BUNDLE_DIR MODEL.gguf
#
# MODEL.gguf: e.g. python3 /work/shared/tools/make_synthetic_gguf.py ggml-vocab-qwen2.gguf m.gguf \
#   --layers 16 --hidden 1536 --ffn 4096 --heads 12 --kv-heads 2      (F16, about 1.6 GB with the qwen2 vocab)
# Every server run is bounded (RUN_TIMEOUT, default 90 s, then TERM, KILL), every plan 60 s; the 8 points of a
# ~1.6 GB model take well under 5 minutes on an H200. POINTS="ngl:ctx ..." picks others (ngl ALL or HALF:
# N + 1 or N / 2), FA=off turns flash attention off, SERVER_FLAGS adds llama-server flags (--no-warmup: the
# buffers are logged before the warm-up, so a bundle whose kernels cannot run on this GPU still reports them).
set -uo pipefail
B=${1:?usage: $0 BUNDLE_DIR MODEL.gguf}
M=${2:?usage: $0 BUNDLE_DIR MODEL.gguf}
OUT=${OUT:-$PWD/offload-buffers}
RUN_TIMEOUT=${RUN_TIMEOUT:-90}
SERVER=$B/llama-server
[ -x "$SERVER" ] || { echo "error: no llama-server in $B (pass an unpacked CUDA bundle directory)" >&2; exit 2; }
[ -f "$M" ] || { echo "error: no model at $M" >&2; exit 2; }
mkdir -p "$OUT"
export LD_LIBRARY_PATH=$B${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
nvidia-smi --query-gpu=index,name,memory.free,memory.total --format=csv,noheader > "$OUT/gpu.txt" 2>&1
"$SERVER" --version > "$OUT/version.txt" 2>&1
N=$(timeout 60 python3 -m llamabundle plan "$M" --free-vram 1TiB --json |
    python3 -c 'import json, sys; print(json.load(sys.stdin)["model"]["n_layer"])') ||
    { echo "error: python3 -m llamabundle plan cannot read $M (is PYTHONPATH set?)" >&2; exit 2; }
ALL=$((N + 1)); HALF=$((N / 2))
POINTS=${POINTS:-"ALL:4096 ALL:16384 ALL:32768 HALF:4096 HALF:16384 1:4096 0:4096 0:16384"}
POINTS=${POINTS//ALL/$ALL}; POINTS=${POINTS//HALF/$HALF}  # ALL: every layer (N + 1), HALF: N / 2

port=18180
for p in $POINTS; do
  ngl=${p%%:*}; ctx=${p#*:}; tag=ngl$ngl-c$ctx; port=$((port + 1))
  flags="-ngl $ngl -c $ctx -np 1 -fa ${FA:-on}"
  log=$OUT/server-$tag.log
  t0=$(date +%s)
  # shellcheck disable=SC2086  # flags are words
  "$SERVER" -m "$M" $flags ${SERVER_FLAGS:-} --host 127.0.0.1 --port $port --fit off --verbose < /dev/null > "$log" 2>&1 &
  pid=$!  # bounded by the loop below: RUN_TIMEOUT seconds, then stopped by its pid
  for _ in $(seq 1 $((RUN_TIMEOUT * 2))); do
    grep -qE "server is listening|model loaded|main: exiting|failed to" "$log" && break
    kill -0 $pid 2> /dev/null || break
    sleep 0.5
  done
  kill -TERM $pid 2> /dev/null
  for _ in $(seq 1 20); do kill -0 $pid 2> /dev/null || break; sleep 0.25; done
  kill -KILL $pid 2> /dev/null; wait $pid 2> /dev/null
  # shellcheck disable=SC2086
  timeout 60 python3 -m llamabundle plan "$M" --free-vram 1MiB --headroom 0 --json -- $flags > "$OUT/plan-$tag.json" 2> "$OUT/plan-$tag.err"
  echo "$tag: $(( $(date +%s) - t0 ))s, $(grep -c 'buffer size' "$log") buffer lines"
done

python3 - "$OUT" "$POINTS" << 'EOF'
import csv, json, sys
from pathlib import Path
from llamabundle.runtime.offload import MiB, parse_buffer_log

out, points = Path(sys.argv[1]), sys.argv[2].split()
kinds = {"model": "weights", "kv": "kv", "compute": "compute"}
with open(out / "offload_buffers.csv", "w", newline="") as f:
    w = csv.writer(f)
    w.writerow(["ngl", "ctx", "kind", "buffer", "llama_mib", "estimate_mib", "ratio"])
    for p in points:
        ngl, ctx = p.split(":")
        tag = f"ngl{ngl}-c{ctx}"
        rep = parse_buffer_log((out / f"server-{tag}.log").read_text(errors="replace"))
        try:
            est = json.loads((out / f"plan-{tag}.json").read_text())["bytes"]
        except (OSError, ValueError, KeyError):
            est = {}
        for kind, per in sorted(rep.sizes.items()):
            for buf, size in sorted(per.items()):
                w.writerow([ngl, ctx, kind, buf, f"{size / MiB:.2f}", "", ""])
        for kind, key in kinds.items():  # the GPU total of each kind against the estimate
            theirs, mine = rep.gpu(kind), est.get(key)
            ratio = f"{mine / theirs:.3f}" if theirs and mine is not None else ""
            w.writerow([ngl, ctx, kind, "gpu", f"{theirs / MiB:.2f}",
                        "" if mine is None else f"{mine / MiB:.2f}", ratio])
print((out / "offload_buffers.csv").read_text())
EOF
