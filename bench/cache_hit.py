"""Cache-hit path: a second `llamabundle build` of a stored recipe against `cp` + `unzip` of the same
zip, measured in this one run (target: under 2 s of tool overhead, no compiler started), plus the
bundle's size, file count and bundled libraries.

Needs the bundle in a store: by default it runs one `llamabundle build` into a temporary store first
(fast when the user cache holds the build tree; a full build otherwise).

    python bench/cache_hit.py [--recipe recipes/linux-x86_64-cpu.yaml] [--store DIR] [--repeat 5] [--json] [--json-out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench import add_json_args, emit_json  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--recipe", default=str(REPO / "recipes" / "linux-x86_64-cpu.yaml"))
    ap.add_argument("--store", default=None)
    ap.add_argument("--repeat", type=int, default=5)
    add_json_args(ap)
    a = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="lb-hit-"))
    store = Path(a.store) if a.store else work / "store"
    lb = [sys.executable, "-m", "llamabundle", "--quiet"]
    first = subprocess.run([*lb, "build", a.recipe, "--store", str(store), "--json"], capture_output=True, text=True)
    if first.returncode != 0:
        sys.exit(f"the first build failed:\n{first.stderr[-3000:]}")
    zip_path = Path(json.loads(first.stdout)["location"] or json.loads(first.stdout)["zip"])
    # The hit path may not find any build tool: PATH names nothing.
    env = {**os.environ, "PATH": "/nonexistent"}
    hits, plain = [], []
    for i in range(a.repeat):
        t0 = time.monotonic()
        res = subprocess.run([*lb, "build", a.recipe, "--store", str(store), "--json"], capture_output=True, text=True, env=env)
        hits.append(time.monotonic() - t0)
        out = json.loads(res.stdout)
        assert res.returncode == 0 and out["hit"] and out["compiled"] == 0, res.stderr
        dest = work / f"plain-{i}"
        t0 = time.monotonic()
        dest.mkdir()
        subprocess.run(["cp", str(zip_path), str(dest / zip_path.name)], check=True)
        if shutil.which("unzip"):
            subprocess.run(["unzip", "-q", str(dest / zip_path.name), "-d", str(dest / "x")], check=True)
        else:
            subprocess.run([sys.executable, "-m", "zipfile", "-e", str(dest / zip_path.name), str(dest / "x")], check=True)
        plain.append(time.monotonic() - t0)
    t_hit, t_plain = statistics.median(hits), statistics.median(plain)
    with zipfile.ZipFile(zip_path) as zf:
        manifest = json.loads(zf.read("bundle.json"))
        unpacked = sum(i.file_size for i in zf.infolist())
    files = manifest["files"]
    zip_size = zip_path.stat().st_size
    shutil.rmtree(work, ignore_errors=True)
    print(f"cache-hit build (median of {a.repeat}) : {t_hit:6.2f} s  (lookup + sha256, fetch, unpack, verify --level load)")
    print(f"cp + unzip      (median of {a.repeat}) : {t_plain:6.2f} s")
    print(f"ratio hit / (cp + unzip)        : {t_hit / t_plain:6.2f}")
    print(f"tool overhead                   : {t_hit - t_plain:6.2f} s  (target < 2 s)")
    print(f"bundle zip                      : {zip_size / 1e6:6.1f} MB ({unpacked / 1e6:.1f} MB unpacked), {len(files)} files")
    print("roles                           : " + ", ".join(f"{r} {sum(f['role'] == r for f in files)}" for r in ("exe", "backend", "runtime", "license")))
    print("runtime libraries               : " + ", ".join(f["path"] for f in files if f["role"] == "runtime"))
    print("system deps (not bundled)       : " + ", ".join(manifest["system_deps"]))
    print(f"glibc floor                     : {manifest['glibc_floor']}")
    emit_json(a, {"benchmark": "cache_hit", "recipe": str(a.recipe), "repeat": a.repeat,
                  "hit_s_median": round(t_hit, 3), "plain_s_median": round(t_plain, 3),
                  "hit_s": [round(t, 3) for t in hits], "plain_s": [round(t, 3) for t in plain],
                  "ratio": round(t_hit / t_plain, 3), "overhead_s": round(t_hit - t_plain, 3), "target_overhead_s": 2.0,
                  "zip_name": zip_path.name, "zip_bytes": zip_size, "unpacked_bytes": unpacked, "files": len(files),
                  "roles": {r: sum(f["role"] == r for f in files) for r in ("exe", "backend", "runtime", "license")},
                  "runtime_libraries": [f["path"] for f in files if f["role"] == "runtime"],
                  "system_deps": manifest["system_deps"], "glibc_floor": manifest["glibc_floor"]})


if __name__ == "__main__":
    main()
