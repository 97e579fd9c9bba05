"""Start-up and the house's figures, each measured in this one run: the wall time of `llamabundle --help`, `key`,
`recipe lint` and `check` (a miss on an empty store) against `python -c pass` (median of --repeat runs each, the
ratio to pass the figure), the modules of the package and the third-party modules each command and
`import llamabundle.recipe` load, and the import layers (tests/unit/test_layers.py's figures).

    python bench/startup.py [--repeat N] [--before REF] [--unit-tier] [--json] [--json-out FILE]

--before REF measures a git worktree of REF the same way, in the same run (the tree before a change), and
--unit-tier times the unit tests of both trees: this one with the README's test command as configured
(`python -m pytest tests/unit`), REF's as its own configuration runs it."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench import add_json_args, emit_json  # noqa: E402

RECIPE = "linux-x86_64-cpu"
HEAVY = ("requests", "urllib3", "rich", "elftools", "pefile", "py7zr", "gguf", "numpy", "yaml", "click", "filelock")
FORBIDDEN_FOR_RECIPE = ("requests", "rich", "elftools", "pefile")

# Runs a command line of the CLI in this interpreter, then prints what it loaded (executed modules only: a
# module a LazyLoader put in sys.modules but never ran does not count).
_LOADED = r"""
import json, sys
args, heavy = json.loads(sys.argv[1]), set(json.loads(sys.argv[2]))
if args[0] == "--import":
    __import__(args[1])
else:
    sys.argv = ["llamabundle", *args]
    from llamabundle.cli import main
    try:
        main()
    except SystemExit:
        pass
ran = [m for m, mod in list(sys.modules.items()) if type(mod).__name__ != "_LazyModule"]
print("\n" + json.dumps({"package": sorted(m for m in ran if m == "llamabundle" or m.startswith("llamabundle.")),
                         "third": sorted({m.split(".")[0] for m in ran} & heavy)}))
"""


def commands(store: Path) -> dict[str, list[str]]:
    return {"--help": ["--help"], "key": ["key", RECIPE], "recipe lint": ["recipe", "lint", RECIPE],
            "check (miss)": ["check", RECIPE, "--store", str(store)]}


def environment(tree: Path, cache: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLAMABUNDLE_")}
    return {**env, "PYTHONPATH": str(tree), "LLAMABUNDLE_CACHE_DIR": str(cache), "PYTHONDONTWRITEBYTECODE": "0"}


def wall(argv: list[str], *, env: dict[str, str], cwd: Path, repeat: int) -> float:
    """The median wall time of `argv` over `repeat` runs (after one run that warms the page cache and .pyc)."""
    times = []
    for i in range(repeat + 1):
        t0 = time.perf_counter()
        subprocess.run(argv, env=env, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)
        if i:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def loaded(args: list[str], *, env: dict[str, str], cwd: Path) -> dict[str, Any]:
    out = subprocess.run([sys.executable, "-c", _LOADED, json.dumps(args), json.dumps(HEAVY)], env=env, cwd=cwd,
                         capture_output=True, text=True, check=True)
    found: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return found


def measure(tree: Path, *, repeat: int, work: Path) -> dict[str, Any]:
    """Every figure of one tree (the package is imported from `tree`: PYTHONPATH wins over an editable install)."""
    store = work / "empty-store"
    store.mkdir(exist_ok=True)
    env = environment(tree, work / "cache")
    base = wall([sys.executable, "-c", "pass"], env=env, cwd=tree, repeat=repeat)
    out: dict[str, Any] = {"pass_s": base, "commands": {}}
    for name, args in commands(store).items():
        s = wall([sys.executable, "-m", "llamabundle", *args], env=env, cwd=tree, repeat=repeat)
        mods = loaded(args, env=env, cwd=tree)
        out["commands"][name] = {"s": s, "ratio": s / base, "package_modules": len(mods["package"]),
                                 "third_party": mods["third"]}
    recipe = loaded(["--import", "llamabundle.recipe"], env=env, cwd=tree)
    out["import_recipe"] = {"package_modules": recipe["package"], "third_party": recipe["third"]}
    return out


def layer_figures(tree: Path) -> str | None:
    test = tree / "tests" / "unit" / "test_layers.py"
    if not test.is_file():
        return None
    res = subprocess.run([sys.executable, "-m", "tests.unit.test_layers"], cwd=tree, capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(tree)})
    return res.stdout.strip() if res.returncode == 0 else None


def unit_tier(tree: Path, *, work: Path) -> float:
    """Wall time of `python -m pytest tests/unit` in `tree` with its own configuration (its pyproject's addopts)."""
    env = {**environment(tree, work / "unit-cache"), "PYTEST_ADDOPTS": "-q -p no:cacheprovider"}
    t0 = time.perf_counter()
    res = subprocess.run([sys.executable, "-m", "pytest", "tests/unit"], cwd=tree, env=env, capture_output=True, text=True)
    took = time.perf_counter() - t0
    tail = (res.stdout.strip().splitlines() or ["?"])[-1]
    print(f"    unit tier of {tree.name}: {took:.0f} s ({tail})", flush=True)
    return took


def table(label: str, f: dict[str, Any], before: dict[str, Any] | None) -> list[str]:
    rows = [f"{label}: python -c pass {f['pass_s'] * 1000:.0f} ms"]
    for name, c in f["commands"].items():
        was = before["commands"][name] if before else None
        then = f"; before {was['s'] * 1000:.0f} ms ({was['ratio']:.1f}x pass, {was['package_modules']} modules, " \
               f"{', '.join(was['third_party']) or 'none'})" if was else ""
        rows.append(f"  {name:14} {c['s'] * 1000:5.0f} ms = {c['ratio']:4.1f}x pass; {c['package_modules']:3} modules "
                    f"of the package; third-party: {', '.join(c['third_party']) or 'none'}{then}")
    for when, figures in (("", f), ("  before: ", before)):
        if figures is None:
            continue
        r = figures["import_recipe"]
        rows.append(f"  {when}import llamabundle.recipe: {len(r['package_modules'])} modules of the package "
                    f"({', '.join(r['package_modules'])}); of {', '.join(FORBIDDEN_FOR_RECIPE)}: "
                    f"{', '.join(m for m in r['third_party'] if m in FORBIDDEN_FOR_RECIPE) or 'none'}")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=9)
    ap.add_argument("--before", metavar="REF", help="also measure a worktree of this git ref (the tree before)")
    ap.add_argument("--unit-tier", action="store_true", help="also time the unit tests of this tree (and of REF)")
    add_json_args(ap)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="lb-startup-") as tmp:
        work = Path(tmp)
        result: dict[str, Any] = {"repeat": a.repeat, "after": measure(REPO, repeat=a.repeat, work=work)}
        result["layers"] = layer_figures(REPO)
        old: Path | None = None
        if a.before:
            old = work / "before"
            subprocess.run(["git", "-C", str(REPO), "worktree", "add", "-q", "--detach", str(old), a.before], check=True)
        try:
            if old is not None:
                result["before_ref"] = a.before
                result["before"] = measure(old, repeat=a.repeat, work=work)
            if a.unit_tier:
                result["unit_tier_s"] = {"after": unit_tier(REPO, work=work)}
                if old is not None:
                    result["unit_tier_s"]["before"] = unit_tier(old, work=work)
        finally:
            if old is not None:
                subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(old)], check=False)
    print("\n".join(table("this tree", result["after"], result.get("before"))))
    if result.get("layers"):
        print("import layers (tests/unit/test_layers.py):\n  " + result["layers"].replace("\n", "\n  "))
    if "unit_tier_s" in result:
        u = result["unit_tier_s"]
        print(f"unit tier: {u['after']:.0f} s" + (f"; before ({a.before}) {u['before']:.0f} s, "
                                                    f"ratio {u['after'] / u['before']:.2f}" if "before" in u else ""))
    emit_json(a, result)


if __name__ == "__main__":
    main()
