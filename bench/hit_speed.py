"""A hit at the speed of the disk (issue 34): `llamabundle fetch` and `install` of a published bundle, through the
command line as a user runs them, against the plain way of doing the same with the zip: `cp` + `sha256sum` +
`python -m zipfile -e`, in the same run. The bundle zip is published to a directory store in a temporary
directory first (its files by content, zstd blobs); then, each `--repeat` times, in a fresh cache or install
root unless said:

- plain: cp + sha256sum + python -m zipfile -e of the zip (the baseline, 1.00);
- fetch --zip: the zip copied, hashed and unpacked in one pass (the path of a store without blobs);
- fetch, cold: every file decompressed from its blob into the cache, then linked into --out;
- fetch, warm: every blob already in the cache (a second fetch of the bundle, or one sharing its files):
  re-hashed, linked;
- install, cold: the same as a fetch, into an install root, with install's own checks;
- build, hit (with --recipe, the recipe the zip was built from): `build RECIPE --out DIR` in a fresh cache, the key
  computed, looked up, the bundle fetched into --out and verified as a hit is.

Every fetch verifies at `--level` (default static: every file's sha256 and the static checks of the binaries).

Usage: python -m bench.hit_speed ZIP [--recipe RECIPE] [--repeat N] [--level static|load] [--profile DIR] [--json]
       [--json-out FILE]
Prints the median seconds of each path and its ratio to plain."""

from __future__ import annotations

import argparse
import os
import pstats
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path
from typing import Any

from bench import add_json_args, emit_json, timed_run
from llamabundle.bundle import manifest as manifest_mod
from llamabundle.store.local import LocalStore

LB = [sys.executable, "-m", "llamabundle", "--quiet"]


def plain(zip_path: Path, dest: Path) -> float:
    t0 = time.perf_counter()
    dest.mkdir(parents=True)
    subprocess.run(["cp", str(zip_path), str(dest / zip_path.name)], check=True)
    subprocess.run(["sha256sum", str(dest / zip_path.name)], check=True, capture_output=True)
    subprocess.run([sys.executable, "-m", "zipfile", "-e", str(dest / zip_path.name), str(dest / "x")], check=True)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("zip", type=Path)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--recipe", help="the recipe the zip was built from: adds the cache-hit build")
    ap.add_argument("--level", default="static", choices=["manifest", "static", "load"])
    ap.add_argument("--profile", type=Path, metavar="DIR",
                    help="then run each llamabundle path once under cProfile: DIR/<path>.txt, its top functions")
    add_json_args(ap)
    a = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="lb-hit-speed-", dir=os.environ.get("BENCH_TMP")))
    try:
        with zipfile.ZipFile(a.zip) as z:
            m = manifest_mod.loads(z.read("bundle.json"))
        store = work / "store"
        LocalStore(store).publish(a.zip, m)
        key = m.key
        size = a.zip.stat().st_size
        unpacked = sum(f.size for f in m.files)
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        paths = ("plain", "fetch_zip", "fetch_cold", "fetch_warm", "install_cold", *(("build_hit",) if a.recipe else ()))
        if a.recipe:
            from llamabundle import keys

            if keys.resolve(keys.load(a.recipe), env=env).key != key:
                raise SystemExit(f"{a.recipe} does not give the zip's key {key[:12]}: pass the recipe it was built from")
        times: dict[str, list[float]] = {k: [] for k in paths}

        def commands(i: int | str) -> dict[str, tuple[list[str], dict[str, str]]]:
            """Each path's llamabundle arguments and environment, in the order they run (fetch_warm reuses
            fetch_cold's cache)."""
            z, c, b = ({**env, "LLAMABUNDLE_CACHE_DIR": str(work / f"cache-{n}-{i}")} for n in ("zip", "fetch", "build"))
            out = {"fetch_zip": (["fetch", key, "--store", str(store), "--out", str(work / f"z-{i}"), "--zip",
                                  "--level", a.level], z),
                   "fetch_cold": (["fetch", key, "--store", str(store), "--out", str(work / f"c-{i}"), "--level", a.level], c),
                   "fetch_warm": (["fetch", key, "--store", str(store), "--out", str(work / f"w-{i}"), "--level", a.level], c),
                   "install_cold": (["install", "--store", str(store), "--key", key, "--dest", str(work / f"root-{i}")], c)}
            if a.recipe:
                out["build_hit"] = (["build", a.recipe, "--store", str(store), "--out", str(work / f"b-{i}")], b)
            return out

        def clean(i: int | str) -> None:
            for d in ("plain", "z", "c", "w", "root", "b", "cache-zip", "cache-fetch", "cache-build"):
                shutil.rmtree(work / f"{d}-{i}", ignore_errors=True)

        for i in range(a.repeat):
            times["plain"].append(plain(a.zip, work / f"plain-{i}"))
            for name, (args, e) in commands(i).items():
                times[name].append(timed_run([*LB, *args], e))
            clean(i)
        if a.profile:  # once more, each path under cProfile: where its time goes, for the next change
            a.profile.mkdir(parents=True, exist_ok=True)
            for name, (args, e) in commands("p").items():
                prof = a.profile / f"{name}.prof"
                timed_run([sys.executable, "-m", "cProfile", "-o", str(prof), "-m", "llamabundle", "--quiet", *args], e)
                with open(a.profile / f"{name}.txt", "w", encoding="utf-8") as f:
                    st = pstats.Stats(str(prof), stream=f)
                    st.sort_stats("cumulative").print_stats(40)
                    st.sort_stats("tottime").print_stats(25)
                prof.unlink()
            clean("p")
        med = {k: statistics.median(v) for k, v in times.items()}
        base = med["plain"]
        print(f"bundle {m.name} ({key[:12]}): zip {size / 1e6:.1f} MB, {len(m.files)} files, {unpacked / 1e6:.1f} MB "
              f"unpacked; {os.cpu_count()} cores; median of {a.repeat}; fetch --level {a.level}")
        print(f"{'path':<14} {'seconds':>8} {'vs plain':>9}")
        for k, v in med.items():
            print(f"{k:<14} {v:8.2f} {v / base:9.2f}")
        result: dict[str, Any] = {"benchmark": "hit_speed", "zip_bytes": size, "unpacked_bytes": unpacked,
                                  "files": len(m.files), "cores": os.cpu_count(), "repeat": a.repeat, "level": a.level,
                                  "seconds": times, "median": med, "ratio_to_plain": {k: v / base for k, v in med.items()}}
        emit_json(a, result)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
