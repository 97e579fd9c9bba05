"""End-to-end tests: one real build of the pinned llama.cpp through `llamabundle build`, reused.

The build tree lives in the llamabundle cache (LLAMABUNDLE_E2E_CACHE_DIR, else the user cache dir),
so a second test run recompiles nothing; the store is new for every run, so the first `check` is
always a miss and the first `build` always runs the whole pipeline (source, cmake, collect, pack,
verify, store)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time
import urllib.request
import zipfile
from pathlib import Path
from typing import Any

import platformdirs
import pytest

from llamabundle import keys
from llamabundle.backends.cuda.toolkit.layout import Toolkit
from llamabundle.backends.cuda.toolkit.pypi import install_from_pypi
from llamabundle.log import Log
from llamabundle.settings import Settings

REPO = Path(__file__).resolve().parents[2]
SHIPPED = REPO / "recipes" / "linux-x86_64-cpu.yaml"
# The shared build's CPU variants (of 14): the baseline, AVX2 (what this machine and CI's pick; the Vulkan, CPU+RPC
# and reproducibility builds take both from its compiler cache) and the most demanding one (AMX, AVX-512 BF16: it
# compiles with the pinned g++ and is opened and scored by the probe, unsupported where the CPU lacks it). All 14
# were 60 % of the shared build's compiles, CI's longest chain; each variant is the same sources with other -march
# flags, and the 14 of the shipped recipe stay checked by the unit tier (the plan and cmake arguments of `show`).
SHARED_KEEP = ("x64", "haswell", "sapphirerapids")
BUILD_TIMEOUT = 75 * 60


def run_cli(*args: object, env: dict[str, str], timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "llamabundle", *map(str, args)], env=env, capture_output=True,
                          text=True, timeout=timeout, stdin=subprocess.DEVNULL)


def build_recipe(recipe: Path, *, store: Path, env: dict[str, str], what: str, more: tuple[object, ...] = ()) -> dict[str, Any]:
    """`llamabundle build RECIPE --store STORE --json` (and `more`) as a user runs it: its JSON, or the test fails with
    the tail of what it said; prints how long it took and the zip's size."""
    started = time.monotonic()
    res = run_cli("build", recipe, "--store", store, "--json", *more, env=env, timeout=BUILD_TIMEOUT)
    if res.returncode != 0:
        pytest.fail(f"llamabundle build of {what} failed ({res.returncode}):\n{res.stderr[-6000:]}")
    out: dict[str, Any] = json.loads(res.stdout)
    print(f"\n{what}: built in {time.monotonic() - started:.0f} s, {Path(out['location']).stat().st_size / 1e6:.1f} MB zip")
    return out


def unzip(zip_path: str | Path, out: Path, *, executable: bool = False) -> Path:
    """A bundle zip extracted with Python's zipfile, which keeps no modes (`executable`: every file 0755, for a
    bundle whose programs are run from there)."""
    with zipfile.ZipFile(zip_path) as zf:
        zf.extractall(out)
    if executable:
        for f in out.iterdir():
            f.chmod(0o755)
    return out


def wait_healthy(port: int, server: subprocess.Popen[Any] | Any, *, said: Any, timeout: float = 120) -> None:
    """Until llama-server on 127.0.0.1:port answers /health with ok; fails with `said()` (what it printed) when it
    exits first or `timeout` seconds pass."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                if json.load(r).get("status") == "ok":
                    return
        except OSError:
            pass
        assert server.poll() is None, said()
        assert time.monotonic() < deadline, f"llama-server did not become healthy in {timeout:.0f} s"
        time.sleep(0.5)


@pytest.fixture(scope="session")
def e2e_env() -> dict[str, str]:
    env = dict(os.environ)
    env["LLAMABUNDLE_CACHE_DIR"] = env.get("LLAMABUNDLE_E2E_CACHE_DIR") or platformdirs.user_cache_dir("llamabundle", appauthor=False)
    env.pop("LLAMABUNDLE_STORE", None)
    env.pop("GITHUB_ACTIONS", None)
    return env


@pytest.fixture(scope="session")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("store")


@pytest.fixture(scope="session")
def recipe_key(e2e_env: dict[str, str]) -> str:
    out = run_cli("key", RECIPE, env=e2e_env)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


@pytest.fixture(scope="session")
def first_build(e2e_env: dict[str, str], store: Path) -> dict[str, Any]:
    """check (miss) → build (the real pipeline) → check (hit), recorded for the tests below."""
    miss = run_cli("check", RECIPE, "--store", store, env=e2e_env)
    build = run_cli("build", RECIPE, "--store", store, "--json", env=e2e_env, timeout=BUILD_TIMEOUT)
    if build.returncode != 0:
        pytest.fail(f"llamabundle build failed ({build.returncode}):\n{build.stderr[-6000:]}")
    hit = run_cli("check", RECIPE, "--store", store, "--json", env=e2e_env)
    return {"miss": miss, "build": build, "result": json.loads(build.stdout), "hit": hit}


@pytest.fixture(scope="session")
def unpacked(first_build: dict[str, Any], e2e_env: dict[str, str], store: Path, recipe_key: str,
             tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("fetched") / "bundle"
    res = run_cli("fetch", recipe_key, "--store", store, "--out", out, env=e2e_env)
    assert res.returncode == 0, res.stderr
    return out


CUDA_RECIPE = REPO / "recipes" / "linux-x86_64-cuda13.0.yaml"


def cut_variants(recipe: Path, dest: Path, *, keep: tuple[str, ...], every: list[str] | None = None) -> Path:
    """A shipped recipe named `<name>-e2e` with its CPU variants cut to `keep` of `every` (x86-64's unless given):
    its own cpu_variants section replaced by one excluding every other variant; the same text every run (so the
    same key and build tree)."""
    from llamabundle import data

    text = recipe.read_text(encoding="utf-8")
    name = re.search(r"^name: (\S+)\n", text, re.M)
    assert name is not None
    # its own section, in block or flow style (a recipe this function wrote)
    text = re.sub(r"^cpu_variants:.*\n(?:  .*\n)*", "", text, flags=re.M).replace(name.group(0), f"name: {name.group(1)}-e2e\n")
    every = every if every is not None else list(data.build_knowledge()["cpu_variants"]["x86_64"])
    assert set(keep) <= set(every), keep
    drop = [v for v in every if v not in keep]
    text += f"cpu_variants: {{exclude: [{', '.join(drop)}]}}\n"
    if not dest.is_file() or dest.read_text(encoding="utf-8") != text:  # both workers write it: whole or not at all
        part = dest.with_name(f".{dest.name}.{os.getpid()}")
        part.write_text(text, encoding="utf-8")
        part.replace(dest)
    return dest


def _shared_recipe() -> Path:
    """The shipped CPU recipe cut to SHARED_KEEP, the session's shared build: the same text, so the same key and
    build tree, in every process."""
    where = Path(tempfile.gettempdir()) / f"llamabundle-e2e-{os.getuid()}"
    where.mkdir(exist_ok=True)
    return cut_variants(SHIPPED, where / SHIPPED.name, keep=SHARED_KEEP)


RECIPE = _shared_recipe()


@pytest.fixture(scope="session")
def toolkit(e2e_env: dict[str, str]) -> Toolkit:
    """The CUDA recipe's toolkit from NVIDIA's wheels on PyPI (cuda_nvrtc included), cached in the e2e cache."""
    recipe = keys.load(CUDA_RECIPE)
    assert recipe.cuda is not None and "cuda_nvrtc" in recipe.cuda.components
    return install_from_pypi(version=recipe.cuda.toolkit, platform="linux-x86_64", components=list(recipe.cuda.components),
                             settings=Settings.from_env(e2e_env), log=Log(quiet=True))
