"""probe --rpc (runtime/rpc_servers.py, probe.with_rpc): each RPC server the app configured gets a reason code from a
real conversation on loopback, as ggml's client has it (HELLO, then DEVICE_COUNT), here with stand-in servers
that answer each way a server can: right, with another protocol version, with nothing, with bytes that are not
the protocol, with no device. Only the servers that answered join llama-server's flags, with the device names
ggml gives them. The real ggml-rpc-server is asked in tests/e2e/test_rpc_bundle.py."""

from __future__ import annotations

import json
import socket
import struct
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from importlib import resources
from pathlib import Path

import pytest

from llamabundle.reasons import Chosen, Reason
from llamabundle.runtime import probe as probe_mod
from llamabundle.runtime import rpc_servers
from llamabundle.runtime.rpc_servers import RpcReason, check, check_all, split_endpoint
from tests.unit.test_probe_causes import valid_json
from tests.unit.test_rpc_backend import bundle


def _recv(c: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = c.recv(n - len(data))
        if not chunk:
            raise ConnectionError
        data += chunk
    return data


@contextmanager
def server(kind: str = "ok", devices: int = 2, version: tuple[int, int, int] = (7, 0, 0)) -> Iterator[str]:
    """A stand-in on 127.0.0.1: `ok` answers HELLO and DEVICE_COUNT as ggml-rpc-server does; `close` closes at
    once; `garbage` answers HELLO with the wrong size; `silent` never answers; `http` answers like a web server."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    seen: list[bytes] = []

    def serve() -> None:
        try:
            c, _ = s.accept()
        except OSError:
            return
        with c:
            try:
                if kind == "close":
                    return
                if kind == "http":
                    c.sendall(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")
                    return
                cmd, size = struct.unpack("<BQ", _recv(c, 9))
                seen.append(bytes([cmd]) + _recv(c, size))
                if kind == "silent":
                    c.recv(1)
                    return
                if kind == "garbage":
                    c.sendall(struct.pack("<Q", 3) + b"abc")
                    return
                c.sendall(struct.pack("<Q", 28) + bytes([*version, 0]) + bytes(24))
                cmd, size = struct.unpack("<BQ", _recv(c, 9))
                seen.append(bytes([cmd]) + _recv(c, size))
                c.sendall(struct.pack("<Q", 4) + struct.pack("<I", devices))
            except OSError:
                return

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    try:
        yield f"127.0.0.1:{s.getsockname()[1]}"
    finally:
        s.close()
        t.join(timeout=5)
    if kind == "ok":  # HELLO with no transport offered, then DEVICE_COUNT where the version is one ggml's client takes
        assert seen == [bytes([14]) + bytes(24), *([bytes([15])] if version[:2] == (7, 0) else [])], seen


def test_a_ggml_server_is_usable_with_its_version_and_devices() -> None:
    with server(devices=2) as ep:
        got = check(ep)
    assert (got.reason, got.version, got.devices) == (RpcReason.OK, "7.0.0", 2)
    said = got.to_json()
    assert said["reason"] == "rpc_ok" and "serves 2 device(s)" in said["sentence"] and "no authentication" in said["fix"]


@pytest.mark.parametrize(("kind", "version", "devices", "reason"), [
    ("close", (7, 0, 0), 1, RpcReason.NOT_RPC),
    ("garbage", (7, 0, 0), 1, RpcReason.NOT_RPC),
    ("http", (7, 0, 0), 1, RpcReason.NOT_RPC),
    ("silent", (7, 0, 0), 1, RpcReason.NOT_RPC),
    ("ok", (6, 1, 0), 1, RpcReason.VERSION_MISMATCH),
    ("ok", (7, 1, 0), 1, RpcReason.VERSION_MISMATCH),  # a newer minor: ggml's client refuses it too
    ("ok", (7, 0, 9), 0, RpcReason.NO_DEVICES),
    ("ok", (7, 0, 0), 100000, RpcReason.NOT_RPC),
])
def test_each_wrong_answer_has_its_own_code(kind: str, version: tuple[int, int, int], devices: int,
                                            reason: RpcReason) -> None:
    with server(kind, devices=devices, version=version) as ep:
        got = check(ep, timeout=0.5)
    assert got.reason is reason, got
    assert got.to_json()["sentence"] and got.seconds < 5


def test_nothing_listening_and_no_address_are_said_as_such() -> None:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    assert check(f"127.0.0.1:{port}").reason is RpcReason.UNREACHABLE
    for bad in ("nonsense", "host:", ":50052", "host:0", "host:65536", "host:12ab", "a b:1"):
        assert check(bad).reason is RpcReason.ENDPOINT_INVALID, bad
    assert split_endpoint("[::1]:50052") == ("::1", 50052) and split_endpoint("gpu-box:50052") == ("gpu-box", 50052)


def test_device_names_follow_the_order_of_the_usable_servers() -> None:
    with server(devices=2) as a, server("close") as b, server(devices=1) as c:
        got = check_all([a, b, c], bundle_has_rpc=True, timeout=1)
    assert [(s.reason, s.device_names) for s in got] == [(RpcReason.OK, ("RPC0", "RPC1")), (RpcReason.NOT_RPC, ()),
                                                          (RpcReason.OK, ("RPC2",))]


def test_a_bundle_without_rpc_cannot_use_any_server_and_none_is_contacted() -> None:
    with server("silent") as ep:
        got = check_all([ep], bundle_has_rpc=False)
    assert [s.reason for s in got] == [RpcReason.BACKEND_MISSING]


def _result(bundle_dir: Path | None, args: list[str]) -> probe_mod.ProbeResult:
    return probe_mod.ProbeResult.make(Reason.GPU_MISSING, {"bundle_dir": str(bundle_dir) if bundle_dir else None,
                                                           "server_args": args, "server_env": {}})


@pytest.mark.parametrize(("local", "want"), [("none", "RPC0,RPC1"), ("CUDA0", "CUDA0,RPC0,RPC1")])
def test_the_usable_servers_join_the_run_flags_and_the_local_decision_stays(tmp_path: Path, local: str,
                                                                            want: str) -> None:
    root, _ = bundle(tmp_path)
    (root / "bundle.json").write_text((tmp_path / "stage" / "bundle.json").read_text())
    with server(devices=2) as ok, server("close") as bad:
        got = probe_mod.with_rpc(_result(root, ["--device", local]), [ok, bad], timeout=1)
    assert got.facts["server_args"] == ["--rpc", ok, "--device", want]
    assert [s["reason"] for s in got.facts["rpc_servers"]] == ["rpc_ok", "rpc_not_rpc"]
    assert (got.reason, got.backend) == (Reason.GPU_MISSING, Chosen.CPU)
    valid_json(got)  # what probe --json prints, against the committed schema


def test_no_usable_server_leaves_the_flags_as_they_were(tmp_path: Path) -> None:
    with server("close") as bad:
        got = probe_mod.with_rpc(_result(None, ["--device", "none"]), [bad], timeout=1)
    assert got.facts["server_args"] == ["--device", "none"]
    assert got.facts["rpc_servers"][0]["reason"] == "rpc_backend_missing", "no bundle, so no RPC backend"
    assert probe_mod.with_rpc(got, []) is got


def test_every_code_has_its_words_and_the_schema_lists_every_code() -> None:
    table = rpc_servers._table()
    assert set(table) == {r.value for r in RpcReason}
    assert all(v["sentence"] and v["fix"] for v in table.values())
    schema = json.loads((resources.files("llamabundle.data") / "schemas" / "cli-probe.schema.json").read_text(encoding="utf-8"))
    item = schema["properties"]["facts"]["properties"]["rpc_servers"]["items"]
    assert item["properties"]["reason"]["enum"] == [r.value for r in RpcReason]
    with server(devices=1) as ok:
        said = check_all([ok, "nonsense"], bundle_has_rpc=True)
    assert [set(s.to_json()) for s in said] == [set(item["required"])] * 2
