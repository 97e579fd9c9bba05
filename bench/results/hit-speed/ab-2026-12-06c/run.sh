#!/bin/bash
# A/B of the hit paths, interleaved: the tree at 3163a54 (this stop's start) and /work/main, on the CPU bundle, round by
# round, both run by a venv holding only the dependencies (/tmp/lbv: no editable install), bytecode written, sync before
# each run
OUT=/tmp/ab50
mkdir -p $OUT
CPU=$HOME/.cache/llamabundle/out/linux-x86_64-cpu-e0bc1e94aad9.zip
for tree in /tmp/before /work/main; do env -u PYTHONDONTWRITEBYTECODE /tmp/lbv/bin/python -m compileall -q $tree/llamabundle $tree/bench > /dev/null; done
for round in 1 2 3; do
  for tree in /tmp/before /work/main; do
    name=$([ $tree = /tmp/before ] && echo before || echo main)
    cd $tree
    sync; env -u PYTHONDONTWRITEBYTECODE PYTHONPATH=$tree /tmp/lbv/bin/python -m bench.hit_speed $CPU --recipe recipes/linux-x86_64-cpu.yaml --repeat 5 --json-out $OUT/cpu-$name-$round.json > $OUT/cpu-$name-$round.txt 2>&1
  done
done
echo done > $OUT/done
