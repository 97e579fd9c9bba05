"""The cost of reading hostile input safely (issue 30): `verify` of a CPU bundle zip and a cache-hit `fetch` of
it from a local store, this tree against a worktree of REF (the tree before the checks), interleaved run by
run in this one run (median of N each), printed as ratios. The checks must not make either slower by more
than 5 %.

    python bench/hostile_speed.py --zip BUNDLE.zip --before REF [--repeat 7] [--json] [--json-out FILE]

BUNDLE.zip: a bundle zip of the shipped Linux CPU recipe (e.g. what README command (a) left in
<cache>/out/, 16 MB)."""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench import add_json_args, emit_json, timed_run  # noqa: E402


def _env(tree: Path, cache: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(tree), "LLAMABUNDLE_CACHE_DIR": str(cache)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--zip", required=True, type=Path, help="a bundle zip of the shipped Linux CPU recipe")
    ap.add_argument("--before", required=True, metavar="REF", help="the tree before (a git ref)")
    ap.add_argument("--repeat", type=int, default=7)
    add_json_args(ap)
    a = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="lb-hostile-"))
    old = work / "before"
    subprocess.run(["git", "-C", str(REPO), "worktree", "add", "-q", "--detach", str(old), a.before], check=True)
    lb = [sys.executable, "-m", "llamabundle", "--quiet"]
    try:
        trees = {"after": REPO, "before": old}
        store = work / "store"
        key = None
        for name, tree in trees.items():  # each publishes into its own store (the same bytes)
            env = _env(tree, work / f"cache-{name}")
            r = subprocess.run([*lb, "publish", str(a.zip), "--store", str(store / name)], env=env,
                               capture_output=True, text=True)
            if r.returncode != 0:
                sys.exit(f"publish failed in {name}:\n{r.stderr[-2000:]}")
            key = next(p.name for p in (store / name).iterdir() if len(p.name) == 64)
        times: dict[str, dict[str, list[float]]] = {t: {"verify": [], "fetch": []} for t in trees}
        for i in range(a.repeat):
            for name in (("after", "before") if i % 2 else ("before", "after")):  # interleaved: drift hits both
                env = _env(trees[name], work / f"cache-{name}")
                times[name]["verify"].append(timed_run([*lb, "verify", str(a.zip)], env))
                out = work / f"out-{name}-{i}"
                times[name]["fetch"].append(timed_run([*lb, "fetch", str(key), "--store", str(store / name),
                                                    "--out", str(out)], env))
                shutil.rmtree(out)
        med = {t: {k: statistics.median(v) for k, v in d.items()} for t, d in times.items()}
        rows = {k: {"before_s": med["before"][k], "after_s": med["after"][k],
                    "ratio": med["after"][k] / med["before"][k]} for k in ("verify", "fetch")}
        size = a.zip.stat().st_size / 1e6
        print(f"{a.zip.name} ({size:.1f} MB), median of {a.repeat}, this tree against {a.before}:")
        for k, r in rows.items():
            print(f"  {k:7s} before {r['before_s']:.3f} s  after {r['after_s']:.3f} s  ratio {r['ratio']:.3f}")
        emit_json(a, {"zip_mb": size, "repeat": a.repeat, "before": a.before, "rows": rows})
    finally:
        subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(old)], check=False)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
