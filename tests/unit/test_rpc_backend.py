"""The RPC backend (backends/rpc.py): `backends: [cpu, rpc]` builds ggml-rpc and ggml-rpc-server (GGML_RPC=ON; the
plans of recipes without it do not change), the static check wants both files, and the load check starts the
bundle's server on 127.0.0.1 and a free port, has its llama-server list the device through --rpc, and leaves
nothing running. Here with stand-in programs on loopback (real sockets, real processes); the real ones are in
tests/e2e."""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path

import pytest

from llamabundle import keys, platforms
from llamabundle.backends.rpc import RPC, SERVER
from llamabundle.build import BuildTools, plan_build
from llamabundle.bundle import manifest as manifest_mod
from llamabundle.errors import VerifyError
from llamabundle.recipe import NO_HOST
from tests import bundles as test_bundles
from tests.processes import alive

LINUX = platforms.get("linux-x86_64")
RECIPE = """
recipe: 1
name: t-rpc
platform: linux-x86_64
llama_cpp:
  commit: 0c1e57098bba43ac29e6e3b677cdceebdd22334f
  sources: [{{github: ggml-org/llama.cpp}}]
backends: [{backends}]
toolchain: {{compiler: gcc, version: "=12.2.0"}}
cmake: {{GGML_BACKEND_DL: "ON", GGML_CPU_ALL_VARIANTS: "OFF", GGML_NATIVE: "OFF"}}
targets: [llama-server]
"""

# A stand-in ggml-rpc-server: listens where -H/-p say, records its pid, answers nothing (the real one speaks ggml's
# RPC protocol; llama-server's stand-in below only checks that it listens).
FAKE_SERVER = """#!{python}
import os, socket, sys
args = sys.argv[1:]
host, port = args[args.index("-H") + 1], int(args[args.index("-p") + 1])
open(os.path.join(os.path.dirname(__file__), "server.pid"), "w").write(str(os.getpid()))
open(os.path.join(os.path.dirname(__file__), "server.env"), "w").write(repr(os.environ.get("CUDA_VISIBLE_DEVICES")))
if os.environ.get("FAKE_SERVER_FAILS"):
    print("bind: address in use", flush=True)
    sys.exit(1)
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind((host, port)); s.listen()
print(f"listening on {{host}}:{{port}}, serving {{args[args.index('-d') + 1] if '-d' in args else 'its choice'}}", flush=True)
while True:
    c, _ = s.accept(); c.close()
"""
# A stand-in llama-server: --rpc HOST:PORT must reach a listener; then it lists it as llama-server does
FAKE_LLAMA = """#!{python}
import os, socket, sys
args = sys.argv[1:]
endpoint = args[args.index("--rpc") + 1]
host, port = endpoint.rsplit(":", 1)
socket.create_connection((host, int(port)), timeout=5).close()
with open(os.path.join(os.path.dirname(__file__), "client.env"), "w") as f:
    f.write(repr({{k: os.environ.get(k) for k in ("CUDA_VISIBLE_DEVICES", "GGML_VK_VISIBLE_DEVICES")}}))
print("Available devices:")
if not os.environ.get("FAKE_LISTS_NOTHING"):
    print(f"  RPC0: {{endpoint}} (24105 MiB, 24105 MiB free)")
"""


def recipe(backends: str) -> keys.Recipe:
    return keys.parse(RECIPE.format(backends=backends))


def plan(backends: str) -> tuple[str, ...]:
    r = recipe(backends)
    return plan_build(r, NO_HOST, source_dir=Path("/s"), build_dir=Path("/b"),
                      tools=BuildTools(cmake="cmake", ninja="ninja")).configure


def test_rpc_builds_its_module_and_server_and_leaves_other_plans_as_they_were() -> None:
    r = recipe("cpu, rpc")
    p = plan_build(r, NO_HOST, source_dir=Path("/s"), build_dir=Path("/b"), tools=BuildTools(cmake="cmake", ninja="ninja"))
    assert "-DGGML_RPC=ON" in p.configure
    assert p.programs[:2] == ("llama-server", SERVER) and p.backends == ("libggml-cpu.so", "libggml-rpc.so")
    assert {"ggml-rpc", SERVER} <= set(p.targets)
    assert not [a for a in plan("cpu") if "GGML_RPC" in a]
    assert keys.resolve(r).key != keys.resolve(recipe("cpu")).key


def bundle(tmp: Path) -> tuple[Path, manifest_mod.Manifest]:
    root = tmp / "bundle"
    root.mkdir()
    for name, text in ((SERVER, FAKE_SERVER), ("llama-server", FAKE_LLAMA)):
        (root / name).write_text(text.format(python=sys.executable))
        (root / name).chmod(0o755)
    (root / "libggml-rpc.so").write_bytes(b"module")
    stage = tmp / "stage"
    m = test_bundles.write_bundle(stage, {}, {}, inputs=test_bundles.inputs_for("rpc"), backends=["cpu", "rpc"])
    return root, manifest_mod.parse(m)


def env(**more: str) -> dict[str, str]:
    return {"PATH": "/usr/bin:/bin", "HOME": "/tmp", **more}


def test_the_load_check_serves_on_loopback_lists_the_device_and_stops_the_server(tmp_path: Path) -> None:
    root, m = bundle(tmp_path)
    got = RPC.check_loaded(root, m, platform=LINUX, runner=[], env=env())
    assert got["rpc"].startswith(f"passed ({SERVER} on 127.0.0.1:") and "llama-server --rpc listed RPC0: 127.0.0.1:" in got["rpc"]
    port = int(got["rpc"].split("127.0.0.1:")[1].split(";")[0])
    assert not alive(int((root / "server.pid").read_text())), "the server is stopped after the check"
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=1)
    assert not list(root.parent.glob(f".{SERVER}-*.log")), "its log goes with it"


def test_the_client_runs_with_the_bundles_gpus_hidden_and_the_server_with_what_it_was_given(tmp_path: Path) -> None:
    """The platform's check lists the GPUs; the RPC client starting their drivers again only cost time. The server
    serves what it would (the caller's CUDA_VISIBLE_DEVICES reaches it)."""
    import ast
    import dataclasses

    root, m = bundle(tmp_path)
    gpus = dataclasses.replace(m, backends=("cpu", "cuda", "vulkan", "rpc"))
    assert RPC.check_loaded(root, gpus, platform=LINUX, runner=[], env=env(CUDA_VISIBLE_DEVICES="1"))["rpc"].startswith("passed")
    assert ast.literal_eval((root / "client.env").read_text()) == {"CUDA_VISIBLE_DEVICES": "", "GGML_VK_VISIBLE_DEVICES": ""}
    assert ast.literal_eval((root / "server.env").read_text()) == "1"
    RPC.check_loaded(root, m, platform=LINUX, runner=[], env=env(CUDA_VISIBLE_DEVICES="1"))  # no GPU backend: nothing hidden
    assert ast.literal_eval((root / "client.env").read_text()) == {"CUDA_VISIBLE_DEVICES": "1", "GGML_VK_VISIBLE_DEVICES": None}


def test_a_server_that_exits_says_so_with_its_words(tmp_path: Path) -> None:
    root, m = bundle(tmp_path)
    with pytest.raises(VerifyError) as e:
        RPC.check_loaded(root, m, platform=LINUX, runner=[], env=env(FAKE_SERVER_FAILS="1"))
    assert e.value.what == f"the bundle's {SERVER} exited with 1 before it listened"
    assert "bind: address in use" in (e.value.details or "")


def test_no_rpc_device_listed_fails_and_the_server_is_stopped_all_the_same(tmp_path: Path) -> None:
    root, m = bundle(tmp_path)
    with pytest.raises(VerifyError) as e:
        RPC.check_loaded(root, m, platform=LINUX, runner=[], env=env(FAKE_LISTS_NOTHING="1"))
    assert "listed no RPC device" in e.value.what
    assert not alive(int((root / "server.pid").read_text()))


def test_a_machine_that_cannot_run_the_bundle_skips_it_and_the_static_check_wants_both_files(tmp_path: Path) -> None:
    root, m = bundle(tmp_path)
    assert RPC.check_loaded(root, m, platform=LINUX, runner=None, env=env())["rpc"].startswith("skipped: ")
    assert RPC.check(root, m, platform=LINUX) == {}
    os.unlink(root / SERVER)
    with pytest.raises(VerifyError, match=f"declares the RPC backend but the bundle has no {SERVER}"):
        RPC.check(root, m, platform=LINUX)


def test_the_load_check_runs_the_rpc_server_beside_the_platforms_check_and_reports_it_after(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """verify's load level: for a bundle this machine runs natively, what a backend runs of the bundle (RPC's server
    and llama-server through it) starts at the same time as the platform's check (each waits for its GPU driver),
    is reported when that check passed, and the platform's failure is the one raised."""
    import threading
    import time

    from llamabundle import verify
    from llamabundle.platforms.load import Loaded

    root, m = bundle(tmp_path)
    rpc_started = threading.Event()
    seen: dict[str, bool] = {}

    def platform_check(root: Path, manifest: object, **_: object) -> Loaded:
        seen["rpc started meanwhile"] = rpc_started.wait(10)
        if os.environ.get("PLATFORM_FAILS"):
            raise VerifyError("llama-server --list-devices exited with 1")
        return Loaded(level="passed", env=env(), source="llamabundle-probe")

    real = RPC.check_loaded

    def rpc_check(*args: object, **kw: object) -> dict[str, str]:
        rpc_started.set()
        return real(*args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(LINUX, "check_load", platform_check)
    monkeypatch.setattr(RPC, "check_loaded", rpc_check)
    report = verify.VerifyReport(path="b.zip", key=m.key, platform=m.platform, files=0, bytes=0)
    t0 = time.monotonic()
    verify.check_load(root, m, report)
    assert seen == {"rpc started meanwhile": True} and time.monotonic() - t0 < 10
    assert report.levels["load"] == "passed" and report.levels["rpc"].startswith(f"passed ({SERVER} on 127.0.0.1:")
    assert not alive(int((root / "server.pid").read_text()))
    monkeypatch.setenv("PLATFORM_FAILS", "1")
    report = verify.VerifyReport(path="b.zip", key=m.key, platform=m.platform, files=0, bytes=0)
    with pytest.raises(VerifyError, match="llama-server --list-devices exited with 1"):
        verify.check_load(root, m, report)
    assert "rpc" not in report.levels and not alive(int((root / "server.pid").read_text()))
