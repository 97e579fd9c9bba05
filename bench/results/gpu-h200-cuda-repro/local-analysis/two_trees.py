"""Two CUDA trees configured by llamabundle's own plan (plan_build + run_build at the fixed-length links under
$FIXED, the launcher and cicc's pin), the fattn-tile instance objects built in each, their sha256 printed.

Usage: FIXED=DIR [FIXED_A=DIR FIXED_B=DIR TOOLKIT=DIR TOOLKIT_A=DIR TOOLKIT_B=DIR] python two_trees.py RECIPE SRC_A:BUILD_A SRC_B:BUILD_B [DKQ,...]
(per tree: FIXED_x, the fixed root, as another cache would have it, defaults to $FIXED, and
TOOLKIT_x to $TOOLKIT; DKQ selects instances by their dkq, e.g. 40,72; default all)."""

from __future__ import annotations

import dataclasses
import hashlib
import os
import sys
from pathlib import Path

from llamabundle import keys
from llamabundle.build import locate_tools, plan_build, run_build
from llamabundle.log import Log
from llamabundle.recipe import NO_HOST

INSTANCES = "ggml/src/ggml-cuda/template-instances"
OBJECTS = "ggml/src/ggml-cuda/CMakeFiles/ggml-cuda.dir/template-instances"


def main(argv: list[str]) -> int:
    recipe = keys.load(Path(argv[1]))
    tools = dataclasses.replace(locate_tools(path=os.environ["PATH"]), compiler_cache=None)
    trees = [tuple(Path(p) for p in arg.split(":")) for arg in argv[2:4]]
    want = set(argv[4].split(",")) if len(argv) > 4 else None
    sources = sorted((trees[0][0] / INSTANCES).glob("fattn-tile-instance-*.cu"))
    objects = [f"{OBJECTS}/{s.name}.o" for s in sources if want is None or s.name.split("-")[3][3:] in want]
    sums = []
    for name, (src, build) in zip("AB", trees, strict=True):
        toolkit = Path(os.environ.get(f"TOOLKIT_{name}") or os.environ["TOOLKIT"])
        plan = plan_build(recipe, NO_HOST, source_dir=src, build_dir=build, tools=tools, jobs=2,
                          toolkit_roots={"cuda": toolkit}, env={},
                          fixed_root=Path(os.environ.get(f"FIXED_{name}") or os.environ["FIXED"]))
        plan = dataclasses.replace(plan, build=(tools.ninja, "-C", plan.links[1][0], "-j2", *objects), programs=(),
                                   backends=())
        run_build(plan, log=Log(), env=dict(os.environ), clean=True)
        sums.append([hashlib.sha256((build / o).read_bytes()).hexdigest()[:16] for o in objects])
        print(name, f"source {len(str(src))} chars, build {len(str(build))} chars, toolkit {len(str(toolkit))} chars:",
              " ".join(sums[-1]), flush=True)
    print("SAME" if sums[0] == sums[1] else "DIFFER", f"({len(objects)} objects)")
    return 0 if sums[0] == sums[1] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
