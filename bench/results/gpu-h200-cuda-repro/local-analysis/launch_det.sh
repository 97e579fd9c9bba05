#!/bin/bash
# compiler launcher: no ASLR + pinned srand for the whole nvcc process tree
exec setarch x86_64 -R env LD_PRELOAD=/tmp/fattn-repro/srand_pin.so "$@"
