#!/bin/bash
# A/B of the hit paths, interleaved: the tree at a8fc3d8 (before the companion scan and the blob hit) and HEAD,
# round by round, with the disk's dirty pages written back (sync) before each run
CPU=$HOME/.cache/llamabundle/out/linux-x86_64-cpu-5438af77a2d3.zip
CUDA=/tmp/e2e-cuda/cudabundle0/bundle.zip
for round in 1 2 3; do
  for tree in /tmp/before /work/main; do
    sync; cd $tree
    PYTHONPATH=$tree /work/main/.venv/bin/python -m bench.hit_speed $CPU --recipe linux-x86_64-cpu --repeat 5 --json-out /tmp/ab2/cpu-$(basename $tree)-$round.json > /tmp/ab2/cpu-$(basename $tree)-$round.txt 2>&1
  done
done
for round in 1 2; do
  for tree in /tmp/before /work/main; do
    sync; cd $tree
    PYTHONPATH=$tree /work/main/.venv/bin/python -m bench.hit_speed $CUDA --repeat 2 --json-out /tmp/ab2/cuda-$(basename $tree)-$round.json > /tmp/ab2/cuda-$(basename $tree)-$round.txt 2>&1
  done
done
echo done > /tmp/ab2/done
