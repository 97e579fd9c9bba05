"""The RPC servers an app configured (`probe --rpc HOST:PORT,...`): whether each one can be used by the bundle's
llama-server, as a reason code with a sentence and a fix (data/reasons.json, `rpc`), asked the way ggml's own client
asks (ggml-rpc.cpp): a TCP connection, HELLO (the protocol version; a server of another major version, or of a
newer minor one, is refused by the client), then DEVICE_COUNT. Nothing else is sent: no buffer, no graph.

This matters before llama-server starts: at the pinned commit a `--rpc` server that cannot be reached or answers
wrongly aborts llama-server (GGML_ABORT in ggml_backend_rpc_add_server), so probe's server_args name only the
servers that answered, and the devices they serve (RPC0, RPC1, … in that order, as ggml names them)."""

from __future__ import annotations

import socket
import struct
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from enum import StrEnum
from functools import cache
from typing import Any

from ..data import load
from ..reasons import fill

# ggml-rpc.cpp at the pinned commit: the command bytes, HELLO's request (the transport's capabilities, 24 bytes:
# none offered, so the server stays on plain TCP) and its answer (major, minor, patch, padding, capabilities)
CMD_HELLO, CMD_DEVICE_COUNT = 14, 15
CAPS_SIZE = 24
HELLO_ANSWER = 4 + CAPS_SIZE
PROTOCOL = (7, 0, 0)  # RPC_PROTO_*_VERSION in ggml/include/ggml-rpc.h: what the bundle's client speaks
DEFAULT_TIMEOUT = 3.0  # seconds for each server, connection and answers together
MAX_DEVICES = 256  # a server claiming more devices than this is not believed to be ggml's


class RpcReason(StrEnum):
    OK = "rpc_ok"
    ENDPOINT_INVALID = "rpc_endpoint_invalid"
    UNREACHABLE = "rpc_unreachable"
    NOT_RPC = "rpc_not_rpc"
    VERSION_MISMATCH = "rpc_version_mismatch"
    NO_DEVICES = "rpc_no_devices"
    BACKEND_MISSING = "rpc_backend_missing"


@cache
def _table() -> dict[str, Any]:
    table: dict[str, Any] = load("reasons.json")["rpc"]
    assert set(table) == {r.value for r in RpcReason}, f"reasons.json's rpc and RpcReason differ: {set(table) ^ {r.value for r in RpcReason}}"
    return table


@dataclass(frozen=True, kw_only=True)
class Server:
    """One configured server, as probe reports it (facts.rpc_servers)."""

    endpoint: str
    reason: RpcReason
    detail: str = ""
    version: str | None = None  # the server's protocol version, when it answered HELLO
    devices: int = 0  # how many devices it serves
    device_names: tuple[str, ...] = ()  # what llama-server names them with probe's server_args: RPC0, …
    seconds: float = 0.0

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["reason"] = self.reason.value
        d["device_names"] = list(self.device_names)
        d["sentence"], d["fix"] = fill(_table()[self.reason.value], {**d, "device_names": ", ".join(self.device_names)})
        return d


def split_endpoint(endpoint: str) -> tuple[str, int] | None:
    """HOST:PORT (an IPv6 host in brackets) as ggml parses it, or None when it is not one."""
    host, sep, port = endpoint.strip().rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        return None
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return (host, int(port)) if host and not any(c.isspace() for c in host) else None


def _recv(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ConnectionError(f"the connection closed after {len(data)} of {n} bytes")
        data += chunk
    return data


def _command(sock: socket.socket, cmd: int, payload: bytes, answer: int) -> bytes:
    """One request (command byte, little-endian 64-bit size, payload) and its answer (size, then that many bytes,
    which must be `answer`)."""
    sock.sendall(struct.pack("<BQ", cmd, len(payload)) + payload)
    size = struct.unpack("<Q", _recv(sock, 8))[0]
    if size != answer:
        raise ValueError(f"an answer of {size} bytes where {answer} were expected")
    return _recv(sock, answer)


def check(endpoint: str, *, timeout: float = DEFAULT_TIMEOUT) -> Server:
    """Whether the bundle's llama-server can use the server at `endpoint` (never raises)."""
    started = time.monotonic()

    def done(reason: RpcReason, detail: str = "", **more: Any) -> Server:
        return Server(endpoint=endpoint, reason=reason, detail=detail, seconds=round(time.monotonic() - started, 3), **more)

    where = split_endpoint(endpoint)
    if where is None:
        return done(RpcReason.ENDPOINT_INVALID, "not HOST:PORT")
    try:
        sock = socket.create_connection(where, timeout=timeout)
    except OSError as e:
        return done(RpcReason.UNREACHABLE, e.strerror or str(e) or type(e).__name__)
    with sock:
        sock.settimeout(max(0.1, timeout - (time.monotonic() - started)))
        try:
            hello = _command(sock, CMD_HELLO, bytes(CAPS_SIZE), HELLO_ANSWER)
        except (OSError, ValueError) as e:
            return done(RpcReason.NOT_RPC, f"no ggml RPC answer to HELLO: {e}")
        major, minor, patch = hello[0], hello[1], hello[2]
        version = f"{major}.{minor}.{patch}"
        if major != PROTOCOL[0] or minor > PROTOCOL[1]:
            return done(RpcReason.VERSION_MISMATCH, f"the server speaks {version}, the bundle "
                        f"{'.'.join(map(str, PROTOCOL))}", version=version)
        try:
            count = struct.unpack("<I", _command(sock, CMD_DEVICE_COUNT, b"", 4))[0]
        except (OSError, ValueError) as e:
            return done(RpcReason.NOT_RPC, f"no answer to DEVICE_COUNT: {e}", version=version)
    if count == 0:
        return done(RpcReason.NO_DEVICES, "it serves no device", version=version)
    if count > MAX_DEVICES:
        return done(RpcReason.NOT_RPC, f"it claims {count} devices", version=version)
    return done(RpcReason.OK, version=version, devices=count)


def check_all(endpoints: Sequence[str], *, bundle_has_rpc: bool, timeout: float = DEFAULT_TIMEOUT) -> list[Server]:
    """Each configured server in order (the bundle without the RPC backend: each one rpc_backend_missing), with
    the device names the usable ones get when they are passed to llama-server in that order."""
    if not bundle_has_rpc:
        return [Server(endpoint=e, reason=RpcReason.BACKEND_MISSING, detail="the bundle has no ggml-rpc module")
                for e in endpoints]
    out, n = [], 0
    for e in endpoints:
        s = check(e, timeout=timeout)
        if s.reason is RpcReason.OK:
            s = replace(s, device_names=tuple(f"RPC{n + i}" for i in range(s.devices)))
            n += s.devices
        out.append(s)
    return out
