"""First contact: the README's command (a), pasted into a shell in a fresh clone with empty caches,
from start to stored bundle, against plain `cmake -G Ninja … && cmake --build …` of the same flags and
targets on the same source tree, both measured in this one run (target ratio <= 1.10). Also the
source step alone (the sdist's download and its proof), read from the tool's own step timings.

The command is taken from the README as written (the first line of its first bash block), so the
figure is of what a new user runs: the venv, `pip install '.[tools]'`, and the whole build.

    python bench/first_contact.py [--workdir DIR] [--json] [--json-out FILE]
"""

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

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench import add_json_args, emit_json  # noqa: E402


def readme_command(readme: Path) -> str:
    """The first command line of the README's first ```bash block."""
    block = re.search(r"```bash\n(.*?)```", readme.read_text(encoding="utf-8"), re.S)
    assert block, "the README has no bash block"
    lines = [ln for ln in block.group(1).splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    return lines[0]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workdir", default=None, help="where to clone and build (default: a temporary directory)")
    add_json_args(ap)
    a = ap.parse_args()
    work = Path(a.workdir or tempfile.mkdtemp(prefix="lb-first-"))
    clone = work / "clone"
    subprocess.run(["git", "clone", "-q", str(REPO), str(clone)], check=True)
    cache = work / "cache"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LLAMABUNDLE_", "VIRTUAL_ENV", "CCACHE"))}
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep)
                                  if "ccache" not in p and ".venv" not in p)
    env["LLAMABUNDLE_CACHE_DIR"] = str(cache)
    env["PIP_NO_CACHE_DIR"] = "1"
    cmd = readme_command(clone / "README.md")
    print(f"README (a): {cmd}", flush=True)
    t0 = time.monotonic()
    out = subprocess.run(["bash", "-c", cmd], cwd=clone, env=env, capture_output=True, text=True)
    t_tool = time.monotonic() - t0
    (work / "readme-a.log").write_text(out.stdout + out.stderr)
    if out.returncode != 0:
        sys.exit(f"README command (a) failed ({out.returncode}); log: {work / 'readme-a.log'}\n{out.stderr[-3000:]}")
    steps = {m.group(1): float(m.group(2)) for m in re.finditer(r"^ {4}(.+?): done in ([0-9.]+)s$", out.stderr, re.M)}
    t_source = next((v for k, v in steps.items() if k.startswith("source llama.cpp")), float("nan"))

    # Plain cmake: the exact configure and build commands of the plan, on the proven tree, a fresh build dir.
    venv_py = clone / ".venv" / "bin" / "python"
    show = subprocess.run([str(venv_py), "-m", "llamabundle", "show", "linux-x86_64-cpu", "--json"], cwd=clone,
                          env=env, capture_output=True, text=True, check=True)
    plan = json.loads(show.stdout)["plan"]
    build_dir = work / "plain-build"
    configure = [str(x).replace(plan["build_dir"], str(build_dir)) for x in plan["configure"]]
    build = [str(x).replace(plan["build_dir"], str(build_dir)) for x in plan["build"]]
    for path, text in plan.get("files", {}).items():
        f = Path(path.replace(plan["build_dir"], str(build_dir)))
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(text.replace(plan["build_dir"], str(build_dir)))
    plain_env = {**env, "PATH": f"{clone / '.venv' / 'bin'}{os.pathsep}{env['PATH']}"}
    t0 = time.monotonic()
    subprocess.run(configure, check=True, stdout=subprocess.DEVNULL, env=plain_env)
    subprocess.run(build, check=True, stdout=subprocess.DEVNULL, env=plain_env)
    t_plain = time.monotonic() - t0
    sdist = next(cache.glob("downloads/*/*.tar.gz"), None)
    if not a.workdir:
        shutil.rmtree(work, ignore_errors=True)
    print(f"README (a), fresh clone, empty caches : {t_tool:8.1f} s  (venv, pip install, source, build, collect, "
          "pack, verify, store)")
    print(f"  of which the source step             : {t_source:8.1f} s  ({sdist.stat().st_size / 1e6 if sdist else 0:.1f} MB "
          "sdist: download, sha256, extract, proof)")
    print(f"plain cmake + ninja, same flags        : {t_plain:8.1f} s")
    print(f"ratio                                  : {t_tool / t_plain:8.3f}  (target <= 1.10)")
    emit_json(a, {"benchmark": "first_contact", "command": cmd, "tool_s": round(t_tool, 2),
                  "source_s": round(t_source, 2), "plain_s": round(t_plain, 2),
                  "ratio": round(t_tool / t_plain, 4), "target_ratio": 1.10, "steps": steps})


if __name__ == "__main__":
    main()
