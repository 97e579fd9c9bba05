"""The RPC backend in a real x86-64 CPU bundle (issue 35): the shipped CPU recipe with `rpc` added, built after the
shared build (its compiles are then compiler-cache hits, ggml-rpc's aside). The build's own load check starts the
bundle's ggml-rpc-server on loopback and has its llama-server list the device; the server listens on 127.0.0.1
unless told otherwise; and a model is served through it: llama-server with --rpc and -dev RPC0 offloads every
layer to the bundle's server and completes a prompt there."""

from __future__ import annotations

import json
import re
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from llamabundle import proc
from llamabundle.backends.rpc import free_port
from llamabundle.runtime import rpc_servers
from tests.e2e.conftest import RECIPE, build_recipe, run_cli, wait_healthy
from tests.e2e.probeprogram import run_probe
from tests.e2e.tinymodel import write_tiny_qwen2

COMMIT = "0c1e57098bba43ac29e6e3b677cdceebdd22334f"
ENV = {"PATH": "/usr/bin:/bin"}


@pytest.fixture(scope="module")
def rpc_bundle(first_build: dict[str, Any], e2e_env: dict[str, str], store: Path,
               tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], Path]:
    tmp = tmp_path_factory.mktemp("rpc")
    text = RECIPE.read_text(encoding="utf-8")
    assert text.count("backends: [cpu]\n") == 1 and text.count("name: linux-x86_64-cpu-e2e\n") == 1
    recipe = tmp / "linux-x86_64-cpu-rpc.yaml"  # the shared build's recipe (its CPU variants cut) with RPC
    recipe.write_text(text.replace("backends: [cpu]\n", "backends: [cpu, rpc]\n")
                      .replace("name: linux-x86_64-cpu-e2e\n", "name: linux-x86_64-cpu-rpc\n"), encoding="utf-8")
    out = tmp / "bundle"
    return build_recipe(recipe, store=store, env=e2e_env, what="the CPU+RPC bundle",
                        more=("--out", out, "--ops-tool")), out


def _listening(port: int, timeout: float = 30) -> list[str]:
    """The local addresses of the TCP sockets listening on `port` (/proc/net/tcp and tcp6, as the kernel shows
    them: 0100007F is 127.0.0.1), once there is one."""
    deadline = time.monotonic() + timeout
    while True:
        found = []
        for table in ("/proc/net/tcp", "/proc/net/tcp6"):
            for line in Path(table).read_text().splitlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                if state == "0A" and int(local.rsplit(":", 1)[1], 16) == port:
                    found.append(local.rsplit(":", 1)[0])
        if found or time.monotonic() > deadline:
            return found
        time.sleep(0.1)


def test_the_build_checks_its_own_rpc_server_and_the_bundle_holds_it(rpc_bundle: tuple[dict[str, Any], Path]) -> None:
    result, out = rpc_bundle
    rpc = result["verify"]["levels"]["rpc"]
    assert re.fullmatch(r"passed \(ggml-rpc-server on 127\.0\.0\.1:\d+; llama-server --rpc listed "
                        r"RPC0: 127\.0\.0\.1:\d+ \(\d+ MiB, \d+ MiB free\)\)", rpc), rpc
    manifest = json.loads((out / "bundle.json").read_text())
    roles = {f["path"]: f["role"] for f in manifest["files"]}
    assert manifest["backends"] == ["cpu", "rpc"]
    assert (roles["ggml-rpc-server"], roles["libggml-rpc.so"]) == ("exe", "backend")


def test_the_server_listens_on_loopback_unless_told_otherwise(rpc_bundle: tuple[dict[str, Any], Path],
                                                               tmp_path: Path) -> None:
    _, out = rpc_bundle
    port = free_port()
    with proc.serving([out / "ggml-rpc-server", "-p", str(port)], cwd=tmp_path, env=ENV,
                      log_path=tmp_path / "server.log"):
        assert _listening(port) == ["0100007F"]  # 127.0.0.1, and nothing else


def test_a_model_is_served_through_the_bundles_rpc_server(rpc_bundle: tuple[dict[str, Any], Path],
                                                          e2e_env: dict[str, str], tmp_path: Path) -> None:
    _, out = rpc_bundle
    model = write_tiny_qwen2(Path(e2e_env["LLAMABUNDLE_CACHE_DIR"]) / "src" / COMMIT, tmp_path / "tiny.gguf")
    rpc_port, http_port = free_port(), free_port()
    log = tmp_path / "llama-server.log"
    with proc.serving([out / "ggml-rpc-server", "-p", str(rpc_port)], cwd=tmp_path, env=ENV,
                      log_path=tmp_path / "rpc.log"):
        assert _listening(rpc_port)
        with proc.serving([out / "llama-server", "-m", model, "--rpc", f"127.0.0.1:{rpc_port}", "-dev", "RPC0",
                           "-ngl", "99", "--host", "127.0.0.1", "--port", str(http_port), "-c", "256", "-t", "2",
                           "-lv", "4"], cwd=tmp_path, env={**ENV, "HOME": str(tmp_path)}, log_path=log) as server:
            wait_healthy(http_port, server, said=lambda: log.read_text(errors="replace")[-3000:])
            req = urllib.request.Request(f"http://127.0.0.1:{http_port}/completion", method="POST",
                                         data=json.dumps({"prompt": "Hello", "n_predict": 4}).encode(),
                                         headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=120) as r:
                body = json.load(r)
    said = log.read_text(errors="replace")
    assert body["tokens_predicted"] == 4
    assert re.search(r"load_tensors: offloaded (\d+)/\1 layers to GPU", said), said[-3000:]
    assert re.search(rf"RPC0\[127\.0\.0\.1:{rpc_port}\] model buffer size", said)


def test_ops_through_the_bundles_rpc_server_agree_with_its_cpu_backend(rpc_bundle: tuple[dict[str, Any], Path],
                                                                       e2e_env: dict[str, str]) -> None:
    """verify --level ops of a CPU bundle with rpc: test-backend-ops (built beside the zip by --ops-tool, with its
    RPC preload) against RPC0, the bundle's own ggml-rpc-server on 127.0.0.1, compared with the local CPU backend."""
    result, _ = rpc_bundle
    tool = Path(result["ops_tool"])
    assert (tool.parent / (tool.name + ".rpc-preload.so")).is_file()
    res = run_cli("verify", result["zip"], "--level", "ops", "--ops-budget", "40", "--json", env=e2e_env, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    report = json.loads(res.stdout)
    assert re.match(r"passed \(RPC0 \(serving CPU\): [1-9]\d* passed, 0 failed", report["levels"]["ops"]), \
        report["levels"]["ops"]
    assert [(d["device"], d["serves"]) for d in report["ops"]] == [("RPC0", "CPU")], "no GPU here: the server serves the CPU"


def test_probe_reports_the_servers_the_app_configured(rpc_bundle: tuple[dict[str, Any], Path],
                                                      e2e_env: dict[str, str], tmp_path: Path) -> None:
    """probe --rpc: the bundle's own ggml-rpc-server is rpc_ok with its protocol and device, a closed port is
    rpc_unreachable, and only the usable one joins the run flags; llama-server started with those flags lists it."""
    _, out = rpc_bundle
    port, closed = free_port(), free_port()
    with proc.serving([out / "ggml-rpc-server", "-p", str(port)], cwd=tmp_path, env=ENV,
                      log_path=tmp_path / "rpc.log"):
        assert _listening(port)
        res = run_cli("probe", "--bundle", out, "--rpc", f"127.0.0.1:{port},127.0.0.1:{closed}", "--max-age", "0",
                      "--json", env=e2e_env, timeout=120)
        assert res.returncode == 0, res.stderr[-3000:]
        facts = json.loads(res.stdout)["facts"]
        args = facts["server_args"]
        listed = proc.capture([out / "llama-server", *args, "--list-devices"], cwd=tmp_path, env=ENV, timeout=60)
    servers = [(s["endpoint"], s["reason"], s["version"], s["device_names"]) for s in facts["rpc_servers"]]
    assert servers == [(f"127.0.0.1:{port}", "rpc_ok", "7.0.0", ["RPC0"]),
                       (f"127.0.0.1:{closed}", "rpc_unreachable", None, [])]
    assert args == ["--rpc", f"127.0.0.1:{port}", "--device", "RPC0"]
    assert f"RPC0: 127.0.0.1:{port}" in listed.stdout + listed.stderr


def test_the_bundles_own_probe_asks_the_servers_as_probe_does(rpc_bundle: tuple[dict[str, Any], Path],
                                                               tmp_path: Path) -> None:
    """llamabundle-probe --rpc (the native program an app not written in Python runs): each server with the same
    reason as `probe --rpc` gives it (runtime/rpc_servers.py), and the usable one's device listed as RPC0 with the
    RPC backend; its answer fits the schema llamabundle ships."""
    _, out = rpc_bundle
    port, closed = free_port(), free_port()
    named = [f"127.0.0.1:{port}", f"127.0.0.1:{closed}", "no-port"]
    with proc.serving([out / "ggml-rpc-server", "-p", str(port)], cwd=tmp_path, env=ENV,
                      log_path=tmp_path / "rpc.log"):
        assert _listening(port)
        said = run_probe([str(out / "llamabundle-probe"), "--rpc", ",".join(named)], env=ENV, cwd=tmp_path, timeout=60)
        python = rpc_servers.check_all(named, bundle_has_rpc=True)
    got = [(s["endpoint"], s["reason"], s["version"], s["devices"], s["device_names"]) for s in said["rpc_servers"]]
    assert got == [(named[0], "rpc_ok", "7.0.0", 1, ["RPC0"]), (named[1], "rpc_unreachable", None, 0, []),
                   (named[2], "rpc_endpoint_invalid", None, 0, [])]
    assert [s["reason"] for s in said["rpc_servers"]] == [s.reason.value for s in python]
    assert [list(s.device_names) for s in python] == [s["device_names"] for s in said["rpc_servers"]]
    (rpc0,) = [d for d in said["devices"] if d["name"] == "RPC0"]
    assert rpc0["backend"] == "RPC" and rpc0["description"] == named[0] and rpc0["memory_total"] > 0
    assert "Connection refused" in said["rpc_servers"][1]["detail"]
