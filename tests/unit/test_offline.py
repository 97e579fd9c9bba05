"""Builds without a network (issue 31): on Linux configure and build run in a network namespace of their own
(a server on this machine's loopback cannot be reached from inside it), and `recipe lint` warns about the CMake
settings known to download (no shipped recipe has one). A build that tries to download stops naming the
setting: tests/e2e/test_offline_build.py (it runs cmake). Real unshare and a loopback server; no mocks."""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path

import pytest
from rich.console import Console

from llamabundle import offline, proc
from llamabundle.log import Log
from llamabundle.recipe import shipped_recipes
from tests.clirun import run
from tests.loopback import Loopback, Reply

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux only: network namespaces")
CONNECT = "import socket, sys; socket.create_connection(('127.0.0.1', int(sys.argv[1])), timeout=5); print('reached')"


def quiet_log() -> tuple[Log, io.StringIO]:
    buf = io.StringIO()
    return Log(console=Console(file=buf, width=300, highlight=False, color_system=None)), buf


def test_the_settings_known_to_download_are_named_with_what_to_set() -> None:
    assert offline.downloading({"LLAMA_USE_PREBUILT_UI": "OFF"}) == []
    [(name, why)] = offline.downloading({"GGML_NATIVE": "OFF"})  # left out: llama.cpp's default, ON, downloads
    assert name == "LLAMA_USE_PREBUILT_UI" and "not set (ON)" in why and why.endswith("set it to OFF")
    [(_, why)] = offline.downloading({"LLAMA_USE_PREBUILT_UI": "on"})
    assert "LLAMA_USE_PREBUILT_UI is ON" in why
    # llama.cpp's scripts/ui-assets.cmake at the pinned commit, with LLAMA_USE_PREBUILT_UI=ON and no network
    for line in ("-- UI: downloading from b0: https://huggingface.co/buckets/ggml-org/llama-ui/resolve/b0/dist.tar.gz",
                 '-- UI: download dist.tar.gz.sha256 from b0 failed: "Couldn\'t resolve host name"',
                 "-- UI: HF download failed"):
        assert offline.tried(line) is not None and offline.tried(line)[1] == "LLAMA_USE_PREBUILT_UI", line
    assert offline.tried("curl: (6) Could not resolve host: huggingface.co") == ("Could not resolve host", None)
    assert offline.tried("[12/300] Building CXX object ggml/src/ggml.c.o") is None


def test_no_shipped_recipe_downloads_and_lint_warns_about_one_that_does(tmp_path: Path,
                                                                         capsys: pytest.CaptureFixture[str]) -> None:
    shipped = shipped_recipes()
    code, out, err = run(capsys, "recipe", "lint", *map(str, shipped.values()), "--json")
    assert code == 0, err
    assert all(r["warnings"] == [] for r in json.loads(out)["recipes"]), out
    text = shipped["linux-x86_64-cpu"].read_text(encoding="utf-8")
    downloading = tmp_path / "ui.yaml"
    downloading.write_text(text.replace("LLAMA_USE_PREBUILT_UI: OFF", "LLAMA_USE_PREBUILT_UI: ON")
                           .replace("ui: build ", "ui: none "), encoding="utf-8")  # (ui: build refuses it outright)
    code, out, err = run(capsys, "recipe", "lint", str(downloading))
    assert code == 0 and "downloads at build time: LLAMA_USE_PREBUILT_UI is ON" in err and "set it to OFF" in err
    downloading.write_text(text.replace("LLAMA_USE_PREBUILT_UI: OFF", "LLAMA_USE_PREBUILT_UI: ON"), encoding="utf-8")
    code, out, err = run(capsys, "recipe", "lint", str(downloading))
    assert code == 2 and "ui: build lays the web UI into the build itself, and LLAMA_USE_PREBUILT_UI is ON" in err


@linux_only
def test_a_build_command_cannot_reach_the_network(tmp_path: Path) -> None:
    if not offline.available():
        pytest.skip("no network namespace can be made here (unshare --net refused): builds run with the network")
    with Loopback(lambda _req: Reply(body=b"hello")) as server:
        port = str(server.url.rsplit(":", 1)[1].split("/")[0])
        outside = proc.capture([sys.executable, "-c", CONNECT, port], timeout=30)
        inside = proc.capture(offline.wrap([sys.executable, "-c", CONNECT, port]), timeout=30)
    assert outside.returncode == 0 and outside.stdout == "reached\n"
    assert inside.returncode != 0 and "reached" not in inside.stdout
