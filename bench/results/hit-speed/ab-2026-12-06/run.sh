#!/bin/bash
# A/B of the hit paths, interleaved: the tree at 31f224b (this stop's start) and /work/main, round by round, both
# run by a venv holding only the dependencies (/tmp/lbv: no editable install), sync before each run
OUT=/tmp/ab49
mkdir -p $OUT
ZIP=$HOME/.cache/llamabundle/out/linux-x86_64-cpu-e0bc1e94aad9.zip
for round in 1 2 3; do
  for tree in /tmp/before /work/main; do
    sync; cd $tree
    name=$([ $tree = /tmp/before ] && echo before || echo main)
    PYTHONPATH=$tree /tmp/lbv/bin/python -m bench.hit_speed $ZIP --recipe recipes/linux-x86_64-cpu.yaml --repeat 5 --json-out $OUT/cpu-$name-$round.json > $OUT/cpu-$name-$round.txt 2>&1
  done
done
echo done > $OUT/done
