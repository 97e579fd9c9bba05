#!/bin/bash
# A/B of the hit paths, interleaved: the tree at 31f224b (the last stop's end) and /work/main, on the CPU bundle and
# the CPU+RPC bundle (its hit runs the RPC check), round by round, both run by a venv holding only the dependencies
# (/tmp/lbv: no editable install), sync before each run
OUT=/tmp/ab49b
mkdir -p $OUT
CPU=$HOME/.cache/llamabundle/out/linux-x86_64-cpu-e0bc1e94aad9.zip
RPC=$HOME/.cache/llamabundle/out/linux-x86_64-cpu-rpc-be4058811f7f.zip
for round in 1 2 3; do
  for tree in /tmp/before /work/main; do
    name=$([ $tree = /tmp/before ] && echo before || echo main)
    cd $tree
    sync; PYTHONPATH=$tree /tmp/lbv/bin/python -m bench.hit_speed $CPU --recipe recipes/linux-x86_64-cpu.yaml --repeat 5 --json-out $OUT/cpu-$name-$round.json > $OUT/cpu-$name-$round.txt 2>&1
    sync; PYTHONPATH=$tree /tmp/lbv/bin/python -m bench.hit_speed $RPC --recipe /tmp/cpu-rpc.yaml --repeat 5 --json-out $OUT/rpc-$name-$round.json > $OUT/rpc-$name-$round.txt 2>&1
  done
done
echo done > $OUT/done
