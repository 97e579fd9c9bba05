#!/bin/bash
# A/B of the hit paths, interleaved: the tree at c6fc835 (this stop's start, derivation 11: its CPU zip 5438af77)
# and /work/main (derivation 12: its CPU zip e0bc1e94), round by round, sync before each run
OUT=/tmp/ab3
for round in 1 2 3; do
  for tree in /tmp/before /work/main; do
    sync; cd $tree
    if [ $tree = /tmp/before ]; then ZIP=$HOME/.cache/llamabundle/out/linux-x86_64-cpu-5438af77a2d3.zip; name=before; else ZIP=$HOME/.cache/llamabundle/out/linux-x86_64-cpu-e0bc1e94aad9.zip; name=main; fi
    PYTHONPATH=$tree /work/main/.venv/bin/python -m bench.hit_speed $ZIP --recipe linux-x86_64-cpu --repeat 5 --json-out $OUT/cpu-$name-$round.json > $OUT/cpu-$name-$round.txt 2>&1
  done
done
echo done > $OUT/done
