"""llama.cpp's own memory figures for one llama-server launch, from the bundle's `llamabundle-memory`
(data/programs/llamabundle-memory.cpp, built beside llama-server into every bundle): it parses llama-server's
flags as llama-server does, sets the output limits llama-server sets, and prints llama.cpp's no_alloc dry
run (no weight read, no buffer allocated), one `DEVICE MODEL CONTEXT COMPUTE` line per device in whole MiB
and a last `Host` line. `plan` asks it for every rung it weighs where such a bundle runs here; why not
llama-fit-params, and how close the closed form comes, is in docs/offload.md."""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .. import data, proc
from ..data import MEMORY_PROGRAM
from ..errors import UsageError

TIMEOUT = 120.0  # seconds one dry run may take (it reads the GGUF header and initialises the backends)
MiB = 1 << 20
_ROW = re.compile(r"(\S+) ([0-9]{1,12}) ([0-9]{1,12}) ([0-9]{1,12}) ?")
# llama-server's placement flags the dry run takes as the app gives them (each takes one value)
PASSTHROUGH = ("-ot", "--override-tensor", "-ts", "--tensor-split", "-sm", "--split-mode", "-dev", "--device",
               "-mg", "--main-gpu", "-ncffn", "--n-cpu-ffn")
_DEVICE_FLAGS = ("-dev", "--device")
# the caller's device selection, kept in the dry run's clean environment as the app's llama-server sees it
# (probe's server_env; GGML_VK_VISIBLE_DEVICES=0 also makes lavapipe a device)
DEVICE_ENV = ("CUDA_VISIBLE_DEVICES", "GGML_VK_VISIBLE_DEVICES")


@dataclass(frozen=True, kw_only=True)
class DeviceMemory:
    """One line of the dry run: what llama.cpp puts on `device`, in bytes (whole MiB, rounded down)."""

    device: str
    model: int
    context: int
    compute: int

    @property
    def total(self) -> int:
        return self.model + self.context + self.compute

    def to_json(self) -> dict[str, Any]:
        return {"device": self.device, "model": self.model, "context": self.context, "compute": self.compute}


def parse_fit_print(text: str) -> list[DeviceMemory]:
    """The device lines of llamabundle-memory's stdout (common_fit_print's table), Host last. Raises ValueError saying
    what is wrong when the output is not that table."""
    rows = []
    for line in (ln.strip() for ln in text.splitlines() if ln.strip()):
        m = _ROW.fullmatch(line)
        if m is None:
            raise ValueError(f"it printed {line[:120]!r}, not 'DEVICE MODEL CONTEXT COMPUTE' in MiB")
        rows.append(DeviceMemory(device=m[1], model=int(m[2]) * MiB, context=int(m[3]) * MiB, compute=int(m[4]) * MiB))
    if not rows or rows[-1].device != "Host":
        raise ValueError("its table has no final Host line")
    return rows


@dataclass(frozen=True, kw_only=True)
class Launch:
    """The memory-relevant part of one llama-server launch."""

    ngl: int
    ctx: int
    n_parallel: int = 1
    kv_unified: bool = False
    n_cpu_moe: int = 0
    kv_type: str = "f16"
    kv_type_v: str = "f16"
    flash_attn: bool = True
    n_ubatch: int | None = None
    n_batch: int | None = None
    op_offload: bool = True

    def args(self) -> list[str]:
        """llama-server's flags for it."""
        out = ["-ngl", str(self.ngl), "-c", str(self.ctx), "-np", str(self.n_parallel), "-kvu" if self.kv_unified
               else "-no-kvu", "-ctk", self.kv_type, "-ctv", self.kv_type_v, "-fa", "on" if self.flash_attn else "off"]
        if self.n_cpu_moe:
            out += ["--n-cpu-moe", str(self.n_cpu_moe)]
        if self.n_batch is not None:
            out += ["-b", str(self.n_batch)]
        if self.n_ubatch is not None:
            out += ["-ub", str(self.n_ubatch)]
        return out if self.op_offload else [*out, "--no-op-offload"]


def passthrough_args(argv: Sequence[str]) -> list[str]:
    """The app's placement flags with their values (-ot, -ts, -sm, -dev, -mg, -ncffn), for the dry run."""
    out: list[str] = []
    for i, flag in enumerate(argv):
        if flag in PASSTHROUGH and i + 1 < len(argv):
            out += [flag, argv[i + 1]]
    return out


@dataclass(kw_only=True)
class DryRun:
    """llamabundle-memory of one unpacked bundle, run natively in verify's clean environment."""

    root: Path
    program: Path
    bundle: str  # name (key12)
    env: dict[str, str]
    extra: list[str] = field(default_factory=list)  # the app's placement flags, passed as they are
    on_run: Callable[[Launch, DeviceMemory | None, float], None] | None = None
    runs: int = 0
    seconds: float = 0.0
    device: str | None = None  # the GPU device measured (the first run's)
    warnings: list[str] = field(default_factory=list)

    def table(self, model: Path, launch: Launch) -> list[DeviceMemory]:
        """llama.cpp's figures for every device and the host. Raises UsageError when the dry run fails:
        llama-server would fail to load the model with the same flags."""
        argv = [str(self.program), "-m", str(model), *launch.args(), *self.extra]
        what = f"llama.cpp's dry run of {model.name} failed ({MEMORY_PROGRAM} of {self.bundle})"
        t0 = time.monotonic()
        try:
            done = proc.capture(argv, cwd=self.root.parent, env=self.env, timeout=TIMEOUT)
        except proc.Timeout:
            raise UsageError(what, why=f"it did not finish in {TIMEOUT:g}s (it was stopped)",
                             fix="run it by hand to see where it hangs: " + " ".join(argv)) from None
        except OSError as e:
            raise UsageError(what, why=f"it could not be started: {e}", fix="reinstall the bundle") from None
        self.runs += 1
        self.seconds += time.monotonic() - t0
        if done.returncode != 0:
            tail = [ln.strip() for ln in (done.stderr + done.stdout).splitlines() if ln.strip()][-3:]
            raise UsageError(what, why=f"it exited with {done.returncode}: {' | '.join(tail)[:600] or 'no output'}",
                             fix="check the model file and the server flags (llama-server would fail the same way)")
        try:
            return parse_fit_print(done.stdout)
        except ValueError as e:
            raise UsageError(what, why=str(e), fix="reinstall the bundle") from None

    def measure(self, model: Path, launch: Launch) -> DeviceMemory | None:
        """The GPU device's figures for `launch`, or None when the dry run lists no GPU device (the bundle's GPU
        backend does not load here). The device is the one -dev names, else the first GPU device listed."""
        t0 = time.monotonic()
        rows = self.table(model, launch)
        gpu = re.compile(data.load("offload.json")["gpu_buffer_regex"])
        found = [r for r in rows[:-1] if gpu.match(r.device)]
        named = next((self.extra[i + 1] for i, a in enumerate(self.extra) if a in _DEVICE_FLAGS), None)
        chosen = next((r for r in found if r.device == named.split(",")[0]), None) if named else None
        chosen = chosen or (found[0] if found else None)
        if chosen is not None and self.device is None:
            self.device = chosen.device
            if len(found) > 1 and not named:
                self.warnings.append(f"llama.cpp spreads the layers over {', '.join(r.device for r in found)}: the "
                                     f"plan is for {chosen.device} (pass -dev {chosen.device} to use it alone)")
        if self.on_run is not None:
            self.on_run(launch, chosen, time.monotonic() - t0)
        return chosen

    def to_json(self) -> dict[str, Any]:
        return {"program": str(self.program), "bundle": self.bundle, "device": self.device, "runs": self.runs,
                "seconds": round(self.seconds, 3)}


def open_dry_run(bundle: Path, *, extra: Sequence[str] = (), host: str | None = None,
                 on_run: Callable[[Launch, DeviceMemory | None, float], None] | None = None) -> DryRun | str:
    """The dry run of an unpacked bundle directory, or why it cannot be used here (a sentence)."""
    from .. import platforms
    from ..backends import run_keep
    from ..bundle import read_manifest
    from ..platforms.load import clean_env

    manifest = read_manifest(bundle)  # not a bundle: its ManifestError (the caller named it)
    host = host or platforms.host_name()
    name = f"{manifest.name} ({manifest.key[:12]})"
    if manifest.platform != host:
        return f"the bundle {name} is for {manifest.platform}, and this machine is {host}"
    platform = platforms.get(manifest.platform)
    program = bundle.resolve() / platform.program_file(MEMORY_PROGRAM)
    if not program.is_file():
        return f"the bundle {name} has no {MEMORY_PROGRAM} (built by an older llamabundle: rebuild or reinstall it)"
    keep = run_keep(manifest, *DEVICE_ENV)
    return DryRun(root=bundle.resolve(), program=program, bundle=name, env=clean_env(bundle.resolve(), keep),
                  extra=list(extra), on_run=on_run)


def find_dry_run(bundle: Path | None, *, root: Path, extra: Sequence[str] = (),
                 on_run: Callable[[Launch, DeviceMemory | None, float], None] | None = None,
                 ) -> tuple[DryRun | None, str | None]:
    """(the dry run of `bundle`, else of the installed GPU bundle probe would pick in `root`; or None and why not)."""
    if bundle is None:
        from .probe import gpu_candidate

        installed = gpu_candidate(root)
        if installed is None:
            return None, f"no GPU bundle for this machine is installed in {root} (--bundle DIR names one)"
        bundle = installed.path
    got = open_dry_run(bundle, extra=extra, on_run=on_run)
    return (got, None) if isinstance(got, DryRun) else (None, got)
