"""ggml's RPC backend: the `ggml-rpc` module, through which a llama-server uses the devices of other machines
(`--rpc HOST:PORT`), and `ggml-rpc-server`, which serves this machine's devices (every backend module beside it:
CPU, CUDA, …). Its protocol has no authentication and no encryption: the server binds to 127.0.0.1 unless told
otherwise (`-H`), and should be reached only over a private network or a tunnel (docs/rpc.md).

The load check runs both from inside the bundle: the bundle's ggml-rpc-server on 127.0.0.1 on a free port, then
the bundle's llama-server with `--rpc` to it, which must list the device it serves (RPC0). The ops level runs
test-backend-ops against that device (RPC0, compared with the local CPU backend) through a preload library built
beside the tool by `build --ops-tool`: test-backend-ops has no option naming an RPC server."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from .. import cache, data, proc
from ..compilers import read_cmake_cache
from ..errors import BuildError, VerifyError
from ..platforms import load
from .base import NoExtras, OpsDevices

if TYPE_CHECKING:
    from ..bundle.manifest import Manifest
    from ..log import Log
    from ..platforms.base import Platform
    from ..recipe import HostFacts, Recipe

SERVER = "ggml-rpc-server"
LISTEN_TIMEOUT = 60.0  # seconds the server may take to listen (under an emulator too)
LISTEN_POLL = 0.01  # seconds between two tries to connect (a refused connection on loopback costs microseconds)
LOOPBACK = "127.0.0.1"
PRELOAD_SOURCE = "rpc_preload.c"  # in data/: adds the RPC servers of SERVERS_ENV to test-backend-ops
SERVERS_ENV = "LLAMABUNDLE_RPC_SERVERS"
SUPPORTS_AS_ENV = "LLAMABUNDLE_RPC_SUPPORTS_AS"  # the preload answers supports_op for RPC devices as this device does


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
            time.sleep(LISTEN_POLL)


@contextmanager
def served(root: Path, *, platform: Platform, runner: Sequence[str], env: Mapping[str, str],
           devices: Sequence[str] = ()) -> Iterator[tuple[str, Path]]:
    """The bundle's ggml-rpc-server listening on 127.0.0.1 and a free port for the context (serving `devices`, or
    its own choice: every GPU, else the CPU): (HOST:PORT, its log); stopped after, whatever happened. VerifyError
    when it cannot start or does not listen."""
    port = free_port()
    endpoint = f"{LOOPBACK}:{port}"
    log_path = root.parent / f".{SERVER}-{port}.log"
    try:
        with proc.serving([*runner, str(root / platform.program_file(SERVER)), "-H", LOOPBACK, "-p", str(port),
                           *(["-d", ",".join(devices)] if devices else [])],
                          cwd=root.parent, env=env, log_path=log_path) as p:
            wait_listening(port, p.poll, log_path=log_path, timeout=LISTEN_TIMEOUT)
            try:
                yield endpoint, log_path
            except VerifyError as e:  # what the server said belongs with what its client said
                e.details = "\n".join(x for x in (e.details, f"--- {SERVER} ---", _tail(log_path)) if x)
                raise
    except OSError as e:
        raise VerifyError(f"{SERVER} could not be started", why=str(e)) from None
    finally:
        log_path.unlink(missing_ok=True)


def preload_of(tool: Path) -> Path:
    """Where `build --ops-tool` puts the RPC preload of a test-backend-ops: beside it."""
    return tool.with_name(tool.name + cache.RPC_PRELOAD_SUFFIX)


def _tail(log_path: Path) -> str:
    try:
        return "\n".join(log_path.read_text(encoding="utf-8", errors="replace").splitlines()[-20:])
    except OSError:
        return ""


class Rpc(NoExtras):
    name = "rpc"
    loader_name = "RPC"
    gpu = False
    adds_ops_devices = True
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
        device it serves through `--rpc`; the server is stopped after, whatever happened. The client's own GPUs are
        hidden (each GPU backend's variable set and empty): the platform's check lists them, and starting their
        driver again here doubled the client's time (0.31 s against 0.11 s on an H100 machine)."""
        if runner is None:
            return {"rpc": f"skipped: this machine does not run {manifest.platform} programs as plain processes"}
        from . import of

        llama = root / platform.program_file("llama-server")
        client = {**env, **{b.hide_env: "" for b in of(manifest.backends) if b.gpu and b.hide_env}}
        with served(root, platform=platform, runner=runner, env=env) as (endpoint, _):
            out = load.checked_run([*runner, str(llama), "--rpc", endpoint, "--list-devices"], cwd=root.parent,
                                   env=client, timeout=load.LOAD_TIMEOUT, what=f"llama-server --rpc {endpoint}",
                                   failed="llama-server could not use the bundle's own RPC server")
            lines = (out.stderr + out.stdout).splitlines()
            listed = [line.strip() for line in load.device_lines(lines) if line.strip().startswith("RPC")]
            if not listed:
                raise VerifyError(f"llama-server --rpc {endpoint} listed no RPC device",  # served() adds the
                                  why=f"the bundle's {SERVER} served nothing it could use",  # server's words
                                  details="\n".join(lines[-10:]))
        return {"rpc": f"passed ({SERVER} on {endpoint}; llama-server --rpc listed {listed[0]})"}

    def after_ops_tool(self, tool: Path, *, build_dir: Path, platform: Platform, log: Log,
                       env: Mapping[str, str]) -> None:
        """The preload that gives test-backend-ops the RPC device (data/rpc_preload.c), built with the C compiler
        CMake used for the bundle (its target and sysroot too) and written beside the tool; none for a platform
        whose programs cannot preload a library (Windows): its ops level says so."""
        if not platform.preloads:
            return
        dest = preload_of(tool)
        cmake_cache = read_cmake_cache(build_dir)
        cc = cmake_cache.get("CMAKE_C_COMPILER")
        if not cc:
            raise BuildError(f"cannot build {dest.name}: CMake recorded no C compiler in {build_dir}",
                             fix="rebuild with --clean")
        args = [cc, *([f"--target={cmake_cache['CMAKE_C_COMPILER_TARGET']}"] if cmake_cache.get("CMAKE_C_COMPILER_TARGET") else []),
                *([f"--sysroot={cmake_cache['CMAKE_SYSROOT']}"] if cmake_cache.get("CMAKE_SYSROOT") else [])]
        tmp = dest.with_name(dest.name + ".partial")
        source = tmp.with_name(tmp.name + ".c")
        source.write_text(data.text(PRELOAD_SOURCE), encoding="utf-8")
        try:
            with log.step(f"{dest.name} (test-backend-ops' RPC device; not in the bundle)"):
                proc.run([*args, "-shared", "-fPIC", "-O2", "-o", str(tmp), str(source), "-ldl"], log=log,
                         error=BuildError, what=f"compiling {PRELOAD_SOURCE} failed", label="cc", env=env,
                         fix="check the C compiler CMake used for the bundle")
            tmp.replace(dest)
        finally:
            source.unlink(missing_ok=True)
            tmp.unlink(missing_ok=True)

    def ops_devices(self, root: Path, manifest: Manifest, *, platform: Platform, runner: Sequence[str] | None,
                    env: Mapping[str, str], tool: Path, gpus: Sequence[str] = ()) -> OpsDevices:
        """RPC0, a device of this machine served by the bundle's own server on 127.0.0.1 (the first of `gpus`, the
        GPU devices the ops level tests here, else the CPU), given to test-backend-ops by the preload beside the tool
        (LD_PRELOAD; SERVERS_ENV names the server). Each run gets a server of its own: a run stopped at its time share
        leaves a server that may still be busy with it.

        The preload answers for RPC0 what the served device answers here (SUPPORTS_AS_ENV): at the pinned commit
        ggml's RPC client says every op is supported (ggml_backend_rpc_device_supports_op returns true), so
        test-backend-ops would send the remote backend every case, and a CUDA server aborts on the first one CUDA
        lacks (seen on an H100: a MUL_MAT case)."""
        preload = preload_of(tool)
        if not platform.preloads:
            return OpsDevices(skipped=f"test-backend-ops cannot be given an RPC server on {manifest.platform} "
                                      "(no LD_PRELOAD there)")
        if runner is None or list(runner):
            return OpsDevices(skipped=f"this machine does not run {manifest.platform} programs natively")
        if not preload.is_file():
            return OpsDevices(skipped=f"no {preload.name} beside {tool.name}: rebuild with --ops-tool, which builds "
                                      "it for a bundle with rpc")
        device = gpus[0] if gpus else "CPU"

        @contextmanager
        def one_run() -> Iterator[Mapping[str, str]]:
            with served(root, platform=platform, runner=runner, env=env, devices=(device,)) as (endpoint, _):
                yield {"LD_PRELOAD": str(preload.resolve()), SERVERS_ENV: endpoint, SUPPORTS_AS_ENV: device}

        return OpsDevices(devices={"RPC0": one_run}, serves=device)

RPC = Rpc()
