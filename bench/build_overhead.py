"""Tool overhead: a cold `llamabundle build` against plain `cmake -G Ninja … && cmake --build …` with
the same flags and targets, both measured in this one run (target ratio <= 1.05).

Both start from the same proven source tree (copied into a fresh cache for the tool), with no
compiler cache. The tool's time includes configure, compile, runtime closure, pack, load
verification and storing; the plain time is configure + compile only.

    python bench/build_overhead.py [--recipe recipes/linux-x86_64-cpu.yaml] [--jobs N] [--json] [--json-out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench import add_json_args, emit_json  # noqa: E402
from llamabundle import keys  # noqa: E402
from llamabundle.build import plan_build, resolve_tools  # noqa: E402
from llamabundle.log import Log  # noqa: E402
from llamabundle.recipe import NO_HOST  # noqa: E402
from llamabundle.settings import Settings  # noqa: E402
from llamabundle.source import fetch_source  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--recipe", default=str(REPO / "recipes" / "linux-x86_64-cpu.yaml"))
    ap.add_argument("--jobs", type=int, default=None)
    ap.add_argument("--workdir", default=None, help="where to build (default: a temporary directory)")
    add_json_args(ap)
    a = ap.parse_args()
    recipe = keys.load(a.recipe)
    settings = Settings.from_env(os.environ)
    src = fetch_source(recipe, settings, Log())  # from the user cache; not timed
    work = Path(a.workdir or tempfile.mkdtemp(prefix="lb-bench-"))
    env = {k: v for k, v in os.environ.items() if k not in ("CCACHE_DIR",)}
    # Plain cmake: the same configure and build commands, a fresh build directory.
    tools = resolve_tools(path=env.get("PATH"))
    plain = plan_build(recipe, NO_HOST, source_dir=src.path, build_dir=work / "plain-build", tools=tools, jobs=a.jobs)
    t0 = time.monotonic()
    subprocess.run(plain.configure, check=True, stdout=subprocess.DEVNULL, env=env)
    subprocess.run(plain.build, check=True, stdout=subprocess.DEVNULL, env=env)
    t_plain = time.monotonic() - t0
    shutil.rmtree(work / "plain-build")
    # llamabundle: a fresh cache holding only the proven source tree.
    cache = work / "cache"
    shutil.copytree(src.path, cache / "src" / recipe.llama_cpp.commit, symlinks=True)
    tool_env = {**env, "LLAMABUNDLE_CACHE_DIR": str(cache)}
    cmd = [sys.executable, "-m", "llamabundle", "--quiet", "build", a.recipe, "--store", str(work / "store"),
           "--compiler-cache", "none", "--json"]  # compiled, as plain cmake compiles: compiler caches are bench/rebuild.py's
    if a.jobs:
        cmd += ["--jobs", str(a.jobs)]
    t0 = time.monotonic()
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=tool_env)
    t_tool = time.monotonic() - t0
    result = json.loads(out.stdout)
    assert result["hit"] is False and result["compiled"] > 0, result
    shutil.rmtree(work, ignore_errors=True)
    print(f"plain cmake + ninja : {t_plain:8.1f} s")
    print(f"llamabundle build   : {t_tool:8.1f} s  (configure, compile, collect, pack, verify --level load, store)")
    print(f"ratio tool/plain    : {t_tool / t_plain:8.3f}  (target <= 1.05)")
    print(f"tool overhead       : {t_tool - t_plain:8.1f} s")
    emit_json(a, {"benchmark": "build_overhead", "recipe": str(a.recipe), "jobs": a.jobs, "plain_s": round(t_plain, 2),
                  "tool_s": round(t_tool, 2), "ratio": round(t_tool / t_plain, 4),
                  "overhead_s": round(t_tool - t_plain, 2), "compiled": result["compiled"], "target_ratio": 1.05})


if __name__ == "__main__":
    main()
