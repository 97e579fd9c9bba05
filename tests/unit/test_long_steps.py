"""`llamabundle build` as a separate process, its cmake a stand-in that hangs in the configure step
(silently, with a child of its own): a step timeout ends it with exit 4, Ctrl-C with exit 130, and
either way nothing is left running and nothing half-written in the store, the output or the cache.
A recipe whose compiler pin does not match this machine is refused (exit 3) before anything starts."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.gitsources import FILES, make_repo
from tests.processes import alive, wait_text

pytestmark = pytest.mark.skipif(sys.platform == "win32" or shutil.which("g++") is None,
                                reason="POSIX signals and a host g++ for the compiler check")

FAKE_CMAKE = """#!/bin/sh
if [ "$1" = "--version" ]; then echo "cmake version 3.28.0"; exit 0; fi
echo $$ > "{state}/cmake.pid"
sleep 300 &
echo $! > "{state}/child.pid"
wait
"""
FAKE_NINJA = "#!/bin/sh\necho 1.11.1\n"


def recipe(tmp: Path, commit: str, *, toolchain: str = "{compiler: gcc}") -> Path:
    r = tmp / "r.yaml"
    r.write_text("\n".join(["recipe: 1", "name: hang-cpu", "platform: linux-x86_64", "llama_cpp:", f"  commit: {commit}",
                            "  sources:", "    - path: ./llama.cpp", "backends: [cpu]", f"toolchain: {toolchain}",
                            "targets: [llama-server]", ""]), encoding="utf-8")
    return r


@pytest.fixture
def setup(tmp_path: Path) -> dict[str, object]:
    commit = make_repo(tmp_path / "llama.cpp", FILES)
    bin_dir, state = tmp_path / "bin", tmp_path / "state"
    bin_dir.mkdir()
    state.mkdir()
    (bin_dir / "cmake").write_text(FAKE_CMAKE.format(state=state))
    (bin_dir / "ninja").write_text(FAKE_NINJA)
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
           "LLAMABUNDLE_CACHE_DIR": str(tmp_path / "cache"), "PYTHONUNBUFFERED": "1"}
    env.pop("GITHUB_ACTIONS", None)
    return {"tmp": tmp_path, "commit": commit, "state": state, "env": env, "recipe": recipe(tmp_path, commit)}


def start_build(s: dict[str, object], *extra: str) -> subprocess.Popen[str]:
    tmp = s["tmp"]
    assert isinstance(tmp, Path)
    argv = [sys.executable, "-m", "llamabundle", "build", str(s["recipe"]), "--store", str(tmp / "store"),
            "--out", str(tmp / "out"), *extra]
    return subprocess.Popen(argv, env=s["env"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,  # type: ignore[arg-type]
                            stdin=subprocess.DEVNULL, cwd=tmp)


def assert_nothing_left(s: dict[str, object]) -> None:
    tmp, state = s["tmp"], s["state"]
    assert isinstance(tmp, Path) and isinstance(state, Path)
    assert not any(alive(int((state / n).read_text())) for n in ("cmake.pid", "child.pid"))
    assert not (tmp / "out").exists()
    assert not (tmp / "store").exists() or not any((tmp / "store").iterdir())
    cache = tmp / "cache"
    assert not (cache / "out").exists() or not any((cache / "out").iterdir())
    assert not list(cache.rglob("*.partial*")) and not list(cache.rglob("*.part"))


def test_a_silent_configure_step_is_stopped_at_the_build_timeout(setup: dict[str, object]) -> None:
    setup["env"]["LLAMABUNDLE_BUILD_TIMEOUT"] = "3"  # type: ignore[index]
    p = start_build(setup)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 4, err
    assert "error: cmake configure failed: timed out after 3s" in err and "Traceback" not in err
    assert_nothing_left(setup)


@pytest.mark.race
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_ctrl_c_during_a_long_step_exits_130_with_nothing_left(setup: dict[str, object], sig: int) -> None:
    p = start_build(setup)
    state = setup["state"]
    assert isinstance(state, Path)
    wait_text(state / "child.pid", procs=[p])
    p.send_signal(sig)  # SIGINT: a terminal's Ctrl-C; SIGTERM: a CI job cancelled, `kill`
    out, err = p.communicate(timeout=60)
    assert p.returncode == 130, err
    assert "interrupted" in err and "Traceback" not in err
    assert_nothing_left(setup)


def test_a_compiler_outside_the_pin_is_refused_before_anything_starts(setup: dict[str, object]) -> None:
    tmp = setup["tmp"]
    assert isinstance(tmp, Path)
    setup["recipe"] = recipe(tmp, str(setup["commit"]), toolchain='{compiler: gcc, version: "[99,100)"}')
    p = start_build(setup)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 3, err
    assert "is outside the recipe's toolchain.version [99,100)" in err
    state = setup["state"]
    assert isinstance(state, Path)
    assert not (state / "cmake.pid").exists()  # configure never ran
    assert not (tmp / "cache" / "src").exists()  # nor was the source fetched
