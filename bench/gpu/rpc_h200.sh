#!/usr/bin/env bash
# The RPC backend on the H200 (issue 35, Show): the CUDA bundle's ggml-rpc-server serving CUDA0 on 127.0.0.1, and
# a CPU bundle built here (with rpc) using it: its llama-server listing RPC0; the CUDA bundle's llamabundle-probe --rpc
# asking its server (and a closed port); verify --level ops of the CUDA bundle:
# test-backend-ops against CUDA0 and against RPC0, its own rpc-server serving CUDA0 (LD_PRELOAD of
# llamabundle/data/rpc_preload.c, which answers supports_op for RPC0 as CUDA0 does), each compared with the CPU
# backend; llama-bench pp512/tg128 through RPC against the same llama-bench on local CUDA0 (flash attention off on
# both where the bundle was built without it: FA=OFF). Sourced by rebuild_h200.sh (RPC=1), which
# calls rpc_phase ZIP after its rows; needs W, R and say (poll.sh). Carry .rpc: cpu-rpc.zip (the CPU bundle),
# test-backend-ops, llama-bench and libllama-bench-impl.so from its build tree, shim.so (the preload, compiled here).
RPC_PORT=50052

rpc_phase() {  # ZIP: the CUDA bundle's zip
  rm -rf $W/rpc && mkdir -p $W/rpc/cuda
  python3 -m zipfile -e "$1" $W/rpc/cuda || { say "rpc: unzip failed"; return; }
  rpc_dir "$1"
}

rpc_dir() {  # the CUDA bundle unpacked in $W/rpc/cuda; ZIP (verify --level ops of it), or '' (rpc_carried.sh:
  # verify.check_ops on the directory, with the tool in $W/rpc/tbo)
  local zip=$1 c=$W/rpc/cuda p=$W/rpc/cpu m=$W/rpc/model.gguf
  rm -rf $p && mkdir -p $p
  (xz -dc .rpc/ggml-vocab-qwen2.gguf.xz > $W/rpc/vocab.gguf; python3 .rpc/make_synthetic_gguf.py $W/rpc/vocab.gguf $m --layers 16 --hidden 1536 --ffn 4096 \
     --heads 12 --kv-heads 2 > $W/rpc/model.log 2>&1; echo $? > $W/rpc/model.rc) &
  python3 -m zipfile -e .rpc/cpu-rpc.zip $p || { say "rpc: unzip failed"; return; }
  chmod +x $c/llama-server $c/ggml-rpc-server $p/llama-server $p/ggml-rpc-server
  cp .rpc/test-backend-ops .rpc/llama-bench .rpc/libllama-bench-impl.so $p/ && cp .rpc/shim.so $W/rpc/shim.so
  (cd $c && setsid ./ggml-rpc-server -H 127.0.0.1 -p $RPC_PORT > $R/rpc-server.log 2>&1 &)
  for _ in $(seq 1 100); do (exec 3<> /dev/tcp/127.0.0.1/$RPC_PORT) 2> /dev/null && break; sleep 0.2; done
  say "rpc: server up: $(head -c 600 $R/rpc-server.log | tr '\n' '|')"
  (cd $p && ./llama-server --rpc 127.0.0.1:$RPC_PORT --list-devices) > $R/rpc-list-devices.txt 2>&1
  say "rpc: CPU bundle's llama-server --rpc: $(grep -A4 'Available devices' $R/rpc-list-devices.txt | tr '\n' '|')"
  # the CUDA bundle's own llamabundle-probe --rpc (derivation 11): its server and a closed port, with reason codes
  (cd $c && ./llamabundle-probe --rpc 127.0.0.1:$RPC_PORT,127.0.0.1:1) > $R/rpc-probe.json 2> $R/rpc-probe.err
  say "rpc: llamabundle-probe --rpc rc=$? $(python3 -c "import json,sys; r=json.load(open(sys.argv[1])); print([(s['endpoint'], s['reason'], s['version'], s['device_names']) for s in r['rpc_servers']], [(d['name'], d['description'], d['memory_total']) for d in r['devices'] if d['name'].startswith('RPC')])" $R/rpc-probe.json 2>&1 | head -c 800)"
  # verify --level ops through the tool: test-backend-ops (the CPU bundle's tree's, same commit) from inside the CUDA
  # bundle against CUDA0 and against RPC0, the bundle's own rpc-server serving CUDA0, through the preload
  [ -f $W/rpc/tbo ] || { cp .rpc/test-backend-ops $W/rpc/tbo && cp .rpc/shim.so $W/rpc/tbo.rpc-preload.so; }
  say "rpc: verify --level ops (CUDA0 and RPC0, budget ${OPS_BUDGET:-100} s)${zip:- on the directory (verify.check_ops)}"
  if [ -n "$zip" ]; then
    python3 -m llamabundle verify "$zip" --level ops --ops-tool $W/rpc/tbo --ops-budget ${OPS_BUDGET:-100} --json \
      > $R/rpc-verify-ops.json 2> $R/rpc-verify-ops.err
  else
    python3 - $c $W/rpc/tbo ${OPS_BUDGET:-100} > $R/rpc-verify-ops.json 2> $R/rpc-verify-ops.err <<'PY'
import json, sys
from pathlib import Path
from llamabundle import bundle, verify
from llamabundle.errors import LlamaBundleError
root, tool, budget = Path(sys.argv[1]), Path(sys.argv[2]), float(sys.argv[3])
m = bundle.read_manifest(root)
report = verify.VerifyReport(path=str(root), key=m.key, platform=m.platform, files=len(m.files), bytes=0)
try:
    verify.check_ops(root, m, report, tool=tool, budget=budget)
except LlamaBundleError as e:
    print(json.dumps({"error": str(e), "ops": report.ops}))
    sys.exit(1)
print(json.dumps({"levels": report.levels, "ops": report.ops}))
PY
  fi
  say "rpc: verify --level ops rc=$? $(python3 -c "import json,sys; r=json.load(open(sys.argv[1])); print(r.get('levels', {}).get('ops') or r)" $R/rpc-verify-ops.json 2>&1 | head -c 1500)"
  for _ in $(seq 1 120); do [ -f $W/rpc/model.rc ] && break; sleep 1; done
  say "rpc: model rc=$(cat $W/rpc/model.rc 2> /dev/null) $(stat -c %s $m 2> /dev/null) bytes"
  cp .rpc/llama-bench .rpc/libllama-bench-impl.so $c/
  local fa=(); [ "${FA:-ON}" = OFF ] && fa=(-fa off)  # a bundle without the flash-attention kernels: off on both sides
  (cd $c && LD_LIBRARY_PATH=$c ./llama-bench -m $m -p 512 -n 128 -ngl 99 -r 2 "${fa[@]}" -dev CUDA0 -o json) > $R/bench-local-cuda.json 2> $R/bench-local-cuda.err
  say "rpc: llama-bench local CUDA0 rc=$?"
  (cd $p && LD_LIBRARY_PATH=$p ./llama-bench -m $m -p 512 -n 128 -ngl 99 -r 2 "${fa[@]}" --rpc 127.0.0.1:$RPC_PORT -o json) > $R/bench-rpc.json 2> $R/bench-rpc.err
  say "rpc: llama-bench through RPC rc=$?"
  python3 - $R/bench-local-cuda.json $R/bench-rpc.json <<'PY' >> $R/session.log 2>&1
import json, sys
for f in sys.argv[1:]:
    try:
        for r in json.load(open(f)):
            print(f.rsplit('/', 1)[1], r.get("devices") or r.get("backends"), "pp" if r["n_prompt"] else "tg", r["n_prompt"] or r["n_gen"], round(r["avg_ts"], 1), "t/s")
    except Exception as e:
        print(f, "unreadable:", e)
PY
  pkill -f "ggml-rpc-server -H 127.0.0.1 -p $RPC_PORT"
  tail -5 $R/rpc-server.log >> $R/session.log
}
