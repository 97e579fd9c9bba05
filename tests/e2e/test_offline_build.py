"""A build that tries to download stops naming the setting (issue 31): a small CMake project whose build
downloads as llama.cpp's web UI does with LLAMA_USE_PREBUILT_UI=ON (in the words of its scripts/ui-assets.cmake),
from a server on this machine, built through run_build in its network namespace. Real cmake, ninja, unshare."""

from __future__ import annotations

import io
import shutil
import sys
from pathlib import Path

import pytest
from rich.console import Console

from llamabundle import offline, proc
from llamabundle.build import BuildPlan, run_build
from llamabundle.errors import BuildError
from llamabundle.log import Log
from tests.loopback import Loopback, Reply

pytestmark = [pytest.mark.e2e, pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux only: network namespaces")]


CMAKELISTS = """\
cmake_minimum_required(VERSION 3.16)
project(downloads NONE)
add_custom_target(assets ALL COMMAND ${CMAKE_COMMAND} -DURL=${URL} -P ${CMAKE_CURRENT_SOURCE_DIR}/fetch.cmake)
"""
# what llama.cpp's scripts/ui-assets.cmake does at build time, in its words
FETCH = """\
file(DOWNLOAD "${URL}" "${CMAKE_CURRENT_BINARY_DIR}/dist.tar.gz" STATUS status TIMEOUT 10)
list(GET status 0 code)
if(code EQUAL 0)
  message(STATUS "UI: HF download succeeded")
else()
  message(STATUS "UI: HF download failed")
endif()
"""


@pytest.mark.skipif(shutil.which("cmake") is None or shutil.which("ninja") is None, reason="cmake and ninja")
def test_a_build_that_tries_to_download_stops_naming_the_setting(tmp_path: Path) -> None:
    """A project whose build downloads (as llama.cpp's web UI does with LLAMA_USE_PREBUILT_UI=ON) from a server
    on this machine: without the network the download fails and the build stops there, naming the setting."""
    if not offline.available():
        pytest.skip("no network namespace can be made here (unshare --net refused): builds run with the network")
    src, bd = tmp_path / "src", tmp_path / "build"
    src.mkdir()
    (src / "CMakeLists.txt").write_text(CMAKELISTS, encoding="utf-8")
    (src / "fetch.cmake").write_text(FETCH, encoding="utf-8")
    with Loopback(lambda _req: Reply(body=b"assets")) as server:
        plan = BuildPlan(source_dir=src, build_dir=bd, targets=("assets",), programs=(), backends=(), output_dir=bd,
                         configure=("cmake", "-S", str(src), "-B", str(bd), "-G", "Ninja", f"-DURL={server.url}/a",
                                    "-DLLAMA_USE_PREBUILT_UI=ON"),
                         build=("cmake", "--build", str(bd), "--target", "assets", "--verbose"))
        buf = io.StringIO()
        log = Log(console=Console(file=buf, width=300, highlight=False, color_system=None))
        with pytest.raises(BuildError) as e:
            run_build(plan, log=log, env={"PATH": "/usr/bin:/bin"}, timeout=300)
        # the same project reaches the server when run as it is (the failure is the namespace's, not the server's)
        direct = proc.capture(["cmake", "-DURL=" + server.url + "/a", "-P", str(src / "fetch.cmake")], cwd=bd, timeout=60)
    assert "UI: HF download succeeded" in direct.stdout + direct.stderr
    assert e.value.what == "the build tried to download: -- UI: HF download failed"  # the first line that says so
    assert "LLAMA_USE_PREBUILT_UI is ON" in e.value.why and "no key" in e.value.why
    assert e.value.fix == "set LLAMA_USE_PREBUILT_UI: OFF in the recipe's cmake:"
    assert "without a network" in buf.getvalue()
