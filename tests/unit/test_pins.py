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
