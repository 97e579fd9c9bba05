"""Rebuilds through a compiler cache (issue 34, Deliver 3 and 4), measured in one run on one machine:

    python -m bench.rebuild RECIPE [--caches ccache,sccache] [--new-dir] [--cold-again] [--touch PATH] [--after-cold CMD]
                               [--after-cache CMD] [--json-out F] [-- BUILD ARGS...]

Each row is `llamabundle build RECIPE --force` into a scratch store with the same llamabundle cache (the source,
toolkits and web UI are ready after the first row; the build tree is what changes):

- cold: `--clean --compiler-cache none`, the denominator;
- for each cache, with its directory empty (CCACHE_DIR / SCCACHE_DIR in a scratch directory):
  miss (`--clean`, the cache filled), warm (`--clean` again: a clean build directory at the same path), and with
  --new-dir for ccache warm in a new directory (the same key through another path to ccache: another build tree's name, what a
  new runner or cache directory has);
- touch: PATH (relative to the llama.cpp source tree) touched, then built with the tree kept (the last cache's). The
  source is proven before every build (its files' sizes and mtimes against the record, source/proof.py): the touched
  tree fails that and is unpacked again at the commit, so nothing recompiles. The row measures that: a change to
  the pinned source never reaches a bundle (a new commit is a new recipe and key).

Each row gives the seconds of the compile step (`build N targets (ninja)` in the tool's log) and of the whole
command (and in the JSON every step of the log with its seconds: where the rest of a warm row goes), their ratio to cold, the cache's hits and misses, and the zip's sha256 (all the same, or the run says so
and exits 1). Needs the recipe buildable here (its source and toolkit reachable, as for `build`)."""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

STEP = re.compile(r"build \d+ targets \(ninja\): \S+ in ([0-9.]+)s")
STEPS = re.compile(r"^ +(.+): done in ([0-9.]+)s$", re.M)  # every step of the tool's log, with its seconds


def run(recipe: str, args: list[str], env: dict[str, str], store: Path) -> dict[str, Any]:
    t0 = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "llamabundle", "build", recipe, "--force", "--store", str(store),
                           "--no-publish", "--json", *args], env=env, capture_output=True, text=True, check=False)
    took = time.monotonic() - t0
    if done.returncode != 0:
        sys.stderr.write(done.stderr[-4000:])
        raise SystemExit(f"build {' '.join(args)} failed ({done.returncode})")
    out = json.loads(done.stdout)
    m = STEP.search(done.stderr)
    from llamabundle.digest import sha256_file

    return {"seconds": round(took, 1), "compile_seconds": float(m.group(1)) if m else None, "compiled": out["compiled"],
            "cache": out.get("compiler_cache"), "sha256": sha256_file(Path(out["zip"])), "zip": out["zip"],
            "steps": [[t, float(sec)] for t, sec in STEPS.findall(done.stderr)]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("recipe")
    ap.add_argument("--caches", default="ccache,sccache")
    ap.add_argument("--touch", default="ggml/src/ggml.c",
                    help="a source file to touch (relative to the llama.cpp tree); '' leaves the touch row out")
    ap.add_argument("--after-cold", metavar="CMD",
                    help="a shell command run after the cold row, untimed, with ZIP set to its zip (work that needs a "
                         "bundle of the recipe and must not run beside a timed row)")
    ap.add_argument("--after-cache", metavar="CMD",
                    help="a shell command run after each cache's rows, untimed, with CACHE set to its name and ZIP to "
                         "the cold row's zip")
    ap.add_argument("--new-dir", action="store_true", help="also ccache warm in a new build directory")
    ap.add_argument("--cold-again", action="store_true",
                    help="a second cold row right after the first cache's rows: its miss sits between two cold builds, "
                         "whose difference is the noise a miss's cost is read against")
    ap.add_argument("--json-out", type=Path)
    argv = sys.argv[1:] if argv is None else argv
    cut = argv.index("--") if "--" in argv else len(argv)  # more `build` arguments after --
    a = ap.parse_args(argv[:cut])
    a.build_args = argv[cut + 1:]
    scratch = Path(tempfile.mkdtemp(prefix="bench-rebuild-"))
    env = dict(os.environ)
    rows: list[dict[str, Any]] = []

    def row(name: str, args: list[str], e: dict[str, str] | None = None) -> dict[str, Any]:
        r = {"row": name, **run(a.recipe, [*args, *a.build_args], e or env, scratch / "store")}
        rows.append(r)
        cold = rows[0]
        ratio = (r["compile_seconds"] / cold["compile_seconds"]) if r["compile_seconds"] and cold["compile_seconds"] else None
        c = r["cache"] or {}
        print(f"{name:28} compile {r['compile_seconds'] or 0:8.1f} s  ({ratio if ratio is not None else float('nan'):.3f} of cold)"
              f"  whole {r['seconds']:8.1f} s ({r['seconds'] / cold['seconds']:.3f})  "
              f"hits {c.get('hits', '-')} misses {c.get('misses', '-')}  zip {r['sha256'][:12]}", flush=True)
        print("    steps of 1 s or more: " + " | ".join(f"{t} {sec:.1f}" for t, sec in r["steps"] if sec >= 1.0), flush=True)
        if a.json_out:
            a.json_out.write_text(json.dumps({"recipe": a.recipe, "cores": os.cpu_count(), "rows": rows}, indent=2))
        return r

    try:
        cold_row = row("cold (no cache)", ["--clean", "--compiler-cache", "none"])
        if a.after_cold:
            subprocess.run(a.after_cold, shell=True, env={**env, "ZIP": cold_row["zip"]}, check=False)
        last = "none"
        for cache in [c for c in a.caches.split(",") if c]:
            e = {**env, "CCACHE_DIR": str(scratch / "ccache"), "SCCACHE_DIR": str(scratch / "sccache"),
                 "CCACHE_MAXSIZE": "20G", "SCCACHE_CACHE_SIZE": "20G"}
            shutil.rmtree(scratch / cache, ignore_errors=True)
            row(f"{cache} miss (empty cache)", ["--clean", "--compiler-cache", cache], e)
            row(f"{cache} warm, clean tree", ["--clean", "--compiler-cache", cache], e)
            if cache == "ccache" and a.new_dir:
                from llamabundle import compiler_cache

                b = scratch / "bin"
                b.mkdir(exist_ok=True)
                found = compiler_cache.find("ccache", path=env.get("PATH"))
                assert found is not None
                (b / "ccache").unlink(missing_ok=True)
                (b / "ccache").symlink_to(found)
                row("ccache warm, new directory", ["--clean", "--compiler-cache", cache],
                    {**e, "PATH": f"{b}{os.pathsep}{env.get('PATH', '')}"})
            last, last_env = cache, e
            if a.cold_again and cache == a.caches.split(",")[0]:
                row("cold again (no cache)", ["--clean", "--compiler-cache", "none"])
            if a.after_cache:
                subprocess.run(a.after_cache, shell=True, env={**env, "CACHE": cache, "ZIP": cold_row["zip"]}, check=False)
        if a.touch:
            from llamabundle import keys
            from llamabundle.settings import Settings

            commit = keys.load(a.recipe).llama_cpp.commit
            src = Settings.from_env(env).cache_dir / "src" / commit / a.touch
            os.utime(src)
            row(f"touch {Path(a.touch).name} ({last})", ["--compiler-cache", last], last_env if last != "none" else env)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    same = len({r["sha256"] for r in rows}) == 1
    print(f"same zip in every row: {'yes' if same else 'NO'}")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
