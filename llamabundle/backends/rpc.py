"""ggml's RPC backend: the `ggml-rpc` module, through which a llama-server uses the devices of other machines
(`--rpc HOST:PORT`), and `ggml-rpc-server`, which serves this machine's devices (every backend module beside it:
CPU, CUDA, …). Its protocol has no authentication and no encryption: the server binds to 127.0.0.1 unless told
otherwise (`-H`), and should be reached only over a private network or a tunnel (docs/rpc.md).

The load check runs both from inside the bundle: the bundle's ggml-rpc-server on 127.0.0.1 on a free port, then
the bundle's llama-server with `--rpc` to it, which must list the device it serves (RPC0)."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from .. import proc
from ..errors import VerifyError
from ..platforms import load
from .base import NoExtras

if TYPE_CHECKING:
    from ..bundle.manifest import Manifest
    from ..platforms.base import Platform
    from ..recipe import HostFacts, Recipe

SERVER = "ggml-rpc-server"
LISTEN_TIMEOUT = 60.0  # seconds the server may take to listen (under an emulator too)
LOOPBACK = "127.0.0.1"


def free_port() -> int:
    """A TCP port on loopback nothing listens on now (the kernel's choice)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((LOOPBACK, 0))
        port: int = s.getsockname()[1]
        return port


def wait_listening(port: int, exited: Callable[[], int | None], *, log_path: Path, timeout: float) -> None:
    """Until something accepts a connection on LOOPBACK:port; VerifyError with the server's last lines when it
    exits first (`exited`: its exit code, None while it runs) or `timeout` seconds pass."""
    deadline = time.monotonic() + timeout
    while True:
        if (code := exited()) is not None:
            raise VerifyError(f"the bundle's {SERVER} exited with {code} before it listened",
                              details=_tail(log_path))
        try:
            with socket.create_connection((LOOPBACK, port), timeout=1):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise VerifyError(f"the bundle's {SERVER} did not listen on {LOOPBACK}:{port} in {timeout:.0f}s",
                                  details=_tail(log_path)) from None
            time.sleep(0.05)


def _tail(log_path: Path) -> str:
    try:
        return "\n".join(log_path.read_text(encoding="utf-8", errors="replace").splitlines()[-20:])
    except OSError:
        return ""


class Rpc(NoExtras):
    name = "rpc"
    loader_name = "RPC"
    gpu = False
    # cmake_switch stays None: GGML_RPC=OFF is ggml's default, so only a recipe with rpc names the switch (ON), and
    # the plans of every other recipe stay as they were

    def cmake_definitions(self, recipe: Recipe, host: HostFacts, *, platform: Platform,
                          toolkit_root: Path | None) -> dict[str, str]:
        return {"GGML_RPC": "ON"}

    def targets(self, recipe: Recipe) -> tuple[str, ...]:
        return ("ggml-rpc",)

    def programs(self, recipe: Recipe) -> tuple[str, ...]:
        return (SERVER,)

    def check(self, root: Path, manifest: Manifest, *, platform: Platform) -> dict[str, str]:
        missing = [f for f in (platform.library_file("ggml-rpc"), platform.program_file(SERVER)) if not (root / f).is_file()]
        if missing:
            raise VerifyError(f"bundle.json declares the RPC backend but the bundle has no {' and no '.join(missing)}",
                              fix="rebuild the bundle")
        return {}

    def check_loaded(self, root: Path, manifest: Manifest, *, platform: Platform, runner: Sequence[str] | None,
                     env: Mapping[str, str]) -> dict[str, str]:
        """The bundle's ggml-rpc-server on 127.0.0.1 and a free port, and the bundle's llama-server listing the
        device it serves through `--rpc`; the server is stopped after, whatever happened."""
        if runner is None:
            return {"rpc": f"skipped: this machine does not run {manifest.platform} programs as plain processes"}
        server, llama = root / platform.program_file(SERVER), root / platform.program_file("llama-server")
        port = free_port()
        endpoint = f"{LOOPBACK}:{port}"
        log_path = root.parent / f".{SERVER}-{port}.log"
        try:
            with proc.serving([*runner, str(server), "-H", LOOPBACK, "-p", str(port)], cwd=root.parent, env=env,
                              log_path=log_path) as p:
                wait_listening(port, p.poll, log_path=log_path, timeout=LISTEN_TIMEOUT)
                out = load.checked_run([*runner, str(llama), "--rpc", endpoint, "--list-devices"], cwd=root.parent,
                                       env=env, timeout=load.LOAD_TIMEOUT, what=f"llama-server --rpc {endpoint}",
                                       failed="llama-server could not use the bundle's own RPC server")
            lines = (out.stderr + out.stdout).splitlines()
            served = [line.strip() for line in load.device_lines(lines) if line.strip().startswith("RPC")]
            if not served:
                raise VerifyError(f"llama-server --rpc {endpoint} listed no RPC device",
                                  why=f"the bundle's {SERVER} served nothing it could use",
                                  details="\n".join([*lines[-10:], "--- server ---", _tail(log_path)]))
            return {"rpc": f"passed ({SERVER} on {endpoint}; llama-server --rpc listed {served[0]})"}
        except OSError as e:
            raise VerifyError(f"{SERVER} could not be started", why=str(e)) from None
        finally:
            log_path.unlink(missing_ok=True)


RPC = Rpc()
