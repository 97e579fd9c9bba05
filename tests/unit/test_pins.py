"""A build refuses a machine outside its recipe's pins before anything starts: the real g++ here (Debian 12's
12.2.0) for a recipe pinned to Ubuntu 24.04's 13.3.0 stops `build` with exit 3 naming the pin, and nothing is
fetched or built. (The pins themselves: test_key.py; glslc's: test_vulkan.py; MSVC's toolset: test_repair.py and
test_show_msvc.py.)"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from llamabundle.compilers import detect_version

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(shutil.which("g++") is None, reason="no g++ here")
def test_build_refuses_a_compiler_outside_the_pin_before_anything_starts(tmp_path: Path) -> None:
    here = detect_version("gcc")
    assert here is not None
    other = "linux-x86_64-cpu-ubuntu24.04" if here != "13.3.0" else "linux-x86_64-cpu"
    pin = "13.3.0" if here != "13.3.0" else "12.2.0"
    cache = tmp_path / "cache"
    done = subprocess.run([sys.executable, "-m", "llamabundle", "build", str(ROOT / "recipes" / f"{other}.yaml"),
                           "--store", str(tmp_path / "store")],
                          env={"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": str(tmp_path), "LANG": "C.UTF-8",
                               "LLAMABUNDLE_CACHE_DIR": str(cache)},
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 3, done.stderr
    assert f"g++ {here} is outside the recipe's toolchain.version ={pin}" in done.stderr
    assert "Traceback" not in done.stderr
    made = {p.name for p in cache.iterdir()} if cache.is_dir() else set()
    assert not made & {"src", "build", "toolkits", "out"}, made  # nothing fetched, configured or packed


def show(recipe: str, tmp_path: Path, path: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "llamabundle", "show", recipe, "--json"],
                          env={"PATH": path, "HOME": str(tmp_path), "LANG": "C.UTF-8",
                               "LLAMABUNDLE_CACHE_DIR": str(tmp_path / "cache")},
                          capture_output=True, text=True, timeout=120, check=False)


def test_show_names_the_pins_and_the_load_environment_without_any_tool(tmp_path: Path) -> None:
    """On a machine with none of the tools: `show` still says what each recipe pins and the environment the load
    check runs its bundle in (Windows: what Windows gives a program), and why the toolchain is not set up."""
    import json

    from tests.clicontract import valid

    bare = str(Path(sys.executable).parent)
    msvc = valid("show", json.loads(show("windows-x86_64-cuda12.8", tmp_path, bare).stdout))
    assert msvc["toolchain"]["pin"] == ("MSVC toolset 14.44.35207 (cl 19.44), pinned: vcvars64.bat -vcvars_ver=14.44.35207 "
                                        "of a Visual Studio in [17.0,18.0)")
    assert msvc["load_env"] == {"SystemRoot": "%SystemRoot%", "windir": "%SystemRoot%", "SystemDrive": "%SystemDrive%",
                                "PATH": "<bundle>;%SystemRoot%\\System32;%SystemRoot%", "TEMP": "<tmp>", "TMP": "<tmp>"}
    linux = valid("show", json.loads(show("linux-x86_64-vulkan", tmp_path, bare).stdout))
    assert linux["toolchain"]["pin"] == "gcc =12.2.0: exactly that version; `build` stops on another"
    assert linux["load_env"] == {"PATH": "/usr/bin:/bin", "HOME": "<bundle>", "LANG": "C.UTF-8", "TMPDIR": "<tmp>"}
    assert linux["toolchain"]["unavailable"].startswith("cannot find the version of g++")
    assert "-DVulkan_GLSLC_EXECUTABLE=glslc" in linux["plan"]["configure"]  # none found: the plan names the program


@pytest.mark.skipif(shutil.which("glslc") is None, reason="no glslc here")
def test_show_plans_with_the_glslc_found_where_it_is_the_pinned_one(tmp_path: Path) -> None:
    import json

    got = json.loads(show("linux-x86_64-vulkan", tmp_path, "/usr/local/bin:/usr/bin:/bin").stdout)
    glslc = f"-DVulkan_GLSLC_EXECUTABLE={shutil.which('glslc', path='/usr/local/bin:/usr/bin:/bin')}"
    if got["toolchain"]["unavailable"] is None:  # this machine's glslc is the pinned one (Debian 12's)
        assert glslc in got["plan"]["configure"]
    else:
        assert "pins glslc shaderc 2023.2-1" in got["toolchain"]["unavailable"]
