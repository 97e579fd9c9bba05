"""Which backend will run, and why (DESIGN §8): NVIDIA GPU and driver, the driver against the bundle's floor,
and the installed CUDA bundle's own `llama-server --verbose --list-devices`. One reason code per result.

Results are cached as JSON with a TTL. Each probe takes a token (a counter under a file lock) when it starts
and writes its result only if no probe with a newer token has written already: an older probe that
finishes last never overwrites a newer result."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from filelock import FileLock
from packaging.version import InvalidVersion, Version

from .. import proc
from ..bundle import read_manifest
from ..errors import LlamaBundleError, VerifyError
from ..log import Log
from ..store.base import Store
from ..verify import VerifyReport, check_load, host_platform_name
from . import Backend, Reason, backend_for, explain, parse_utc_timestamp, utc_timestamp, write_atomic
from .install import Installed, install_bundle, list_installed

NVIDIA_SMI_ARGS = ("--query-gpu=name,driver_version,memory.total,memory.free", "--format=csv,noheader,nounits")
PROC_VERSION = Path("/proc/driver/nvidia/version")
SMI_TIMEOUT = 15.0
DEFAULT_TTL = 300.0
CACHE = "probe.json"
TOKEN = "probe.token"
_PROC_DRIVER = re.compile(r"NVRM version:.*?\s(\d+\.\d+(?:\.\d+)*)\s")


@dataclass(frozen=True, kw_only=True)
class Gpu:
    name: str
    driver: str
    memory_total_mib: int | None
    memory_free_mib: int | None


@dataclass(frozen=True, kw_only=True)
class GpuScan:
    gpus: tuple[Gpu, ...]
    nvidia_smi: str | None  # the program run, if found
    smi_driver: str | None
    proc_driver: str | None  # from /proc/driver/nvidia/version (Linux)
    error: str | None  # why nvidia-smi gave nothing

    @property
    def driver(self) -> str | None:
        return self.smi_driver or self.proc_driver

    @property
    def present(self) -> bool:
        """A GPU is listed, or nvidia-smi is absent but the kernel driver is loaded."""
        return bool(self.gpus) or (self.nvidia_smi is None and self.proc_driver is not None)

    def to_json(self) -> dict[str, Any]:
        return {"gpus": [vars(g) for g in self.gpus], "nvidia_smi": self.nvidia_smi, "driver": self.driver,
                "proc_driver": self.proc_driver, "nvidia_smi_error": self.error}


def parse_nvidia_smi(text: str) -> list[Gpu]:
    """`nvidia-smi --query-gpu=name,driver_version,memory.total,memory.free --format=csv,noheader,nounits` lines."""
    def mib(v: str) -> int | None:
        return int(float(v)) if re.fullmatch(r"\d+(\.\d+)?", v) else None

    out = []
    for line in text.splitlines():
        fields = [f.strip() for f in line.rsplit(",", 3)]  # a GPU's name may hold a comma, the numbers do not
        if len(fields) == 4 and re.fullmatch(r"\d+(\.\d+)+", fields[1]):
            out.append(Gpu(name=fields[0], driver=fields[1], memory_total_mib=mib(fields[2]), memory_free_mib=mib(fields[3])))
    return out


def parse_proc_version(text: str) -> str | None:
    m = _PROC_DRIVER.search(text)
    return m.group(1) if m else None


def scan_gpus(*, env: Mapping[str, str], nvidia_smi: str | None = None, proc_version: Path | None = PROC_VERSION,
              timeout: float = SMI_TIMEOUT) -> GpuScan:
    """Run nvidia-smi (given, or found on env's PATH) with a timeout; read the kernel driver's version file."""
    try:
        proc_driver = parse_proc_version(proc_version.read_text(errors="replace")) if proc_version is not None else None
    except OSError:
        proc_driver = None
    exe = nvidia_smi or shutil.which("nvidia-smi", path=env.get("PATH"))
    if exe is None:
        return GpuScan(gpus=(), nvidia_smi=None, smi_driver=None, proc_driver=proc_driver, error="nvidia-smi is not on PATH")
    try:
        done = proc.capture([exe, *NVIDIA_SMI_ARGS], env=env, timeout=timeout)
    except subprocess.TimeoutExpired:
        error: str | None = f"nvidia-smi did not answer in {timeout:.0f}s"
        gpus: list[Gpu] = []
    except OSError as e:
        error, gpus = f"nvidia-smi could not be started: {e}", []
    else:
        gpus = parse_nvidia_smi(done.stdout) if done.returncode == 0 else []
        last = (done.stdout + done.stderr).strip().splitlines()[-1:] or [""]
        error = None if gpus else f"nvidia-smi exited with {done.returncode}: {last[0].strip()}"[:300]
    return GpuScan(gpus=tuple(gpus), nvidia_smi=exe, smi_driver=gpus[0].driver if gpus else None, proc_driver=proc_driver,
                   error=error)


def driver_older(driver: str, floor: str) -> bool:
    """driver < floor, as versions (570.124.06 < 572.61)."""
    try:
        return Version(driver) < Version(floor)
    except InvalidVersion:
        def nums(v: str) -> tuple[int, ...]:
            return tuple(int(x) for x in re.findall(r"\d+", v))
        return nums(driver) < nums(floor)


@dataclass(frozen=True, kw_only=True)
class ProbeResult:
    backend: Backend
    reason: Reason
    sentence: str
    fix: str
    facts: dict[str, Any] = field(default_factory=dict)
    token: int = 0  # taken when the probe started; a newer one is never overwritten by an older one
    probed_at: int = 0  # when it started (Unix seconds; JSON: utc_timestamp, YYYY-MM-DDTHH:MM:SSZ)
    cached: bool = False

    @classmethod
    def make(cls, reason: Reason, facts: dict[str, Any], **kw: Any) -> "ProbeResult":
        sentence, fix = explain(reason, facts)
        return cls(backend=backend_for(reason), reason=reason, sentence=sentence, fix=fix, facts=facts, **kw)

    def to_json(self) -> dict[str, Any]:
        return {"schema": 1, "backend": self.backend.value, "reason": self.reason.value, "sentence": self.sentence,
                "fix": self.fix, "facts": self.facts, "token": self.token, "probed_at": utc_timestamp(self.probed_at),
                "cached": self.cached}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> "ProbeResult":
        return cls(backend=Backend(data["backend"]), reason=Reason(data["reason"]), sentence=str(data["sentence"]),
                   fix=str(data["fix"]), facts=dict(data["facts"]), token=int(data["token"]),
                   probed_at=parse_utc_timestamp(data["probed_at"]))


def with_gpu_layers(result: ProbeResult, ngl: int | None) -> ProbeResult:
    """A planned -ngl of 0 leaves a working CUDA bundle on the CPU: cuda_gpu_layers_zero."""
    if ngl is None:
        return result
    facts = {**result.facts, "ngl": ngl}
    if ngl == 0 and result.reason is Reason.OK:
        return ProbeResult.make(Reason.CUDA_GPU_LAYERS_ZERO, facts, token=result.token, probed_at=result.probed_at,
                                cached=result.cached)
    return replace(result, facts=facts)


def cuda_candidate(root: Path) -> Installed | None:
    """The most recently installed bundle with a CUDA backend for this machine."""
    host = host_platform_name()
    found = [i for i in list_installed(root) if "cuda" in i.backends and i.manifest.get("platform") == host]
    return max(found, key=lambda i: i.installed_at, default=None)


def probe(*, root: Path, env: Mapping[str, str], cache_dir: Path | None = None, max_age: float = 0.0,
          bundle: Path | None = None, nvidia_smi: str | None = None, proc_version: Path | None = PROC_VERSION,
          smi_timeout: float = SMI_TIMEOUT) -> ProbeResult:
    """Probe now, or return the cached result when it is younger than max_age and about the same bundle.
    `bundle` is an unpacked bundle directory to probe instead of the installed CUDA one."""
    target: tuple[Path, dict[str, Any]] | None
    if bundle is not None:
        target = (bundle.resolve(), read_manifest(bundle))
    else:
        inst = cuda_candidate(root)
        target = (inst.path, inst.manifest) if inst is not None else None
    context = {"bundle_dir": str(target[0]) if target else None, "bundle_key": target[1]["key"] if target else None}
    if cache_dir is not None and max_age > 0:
        last = read_cached(cache_dir)
        if last is not None and time.time() - last.probed_at < max_age and \
                {k: last.facts.get(k) for k in context} == context:
            return replace(last, cached=True)
    token = take_token(cache_dir) if cache_dir is not None else 0
    result = _probe_now(target, context, env=env, nvidia_smi=nvidia_smi, proc_version=proc_version,
                        smi_timeout=smi_timeout, token=token, started=int(time.time()))
    if cache_dir is not None:
        store_result(cache_dir, result)
    return result


def _probe_now(target: tuple[Path, dict[str, Any]] | None, context: dict[str, Any], *, env: Mapping[str, str],
               nvidia_smi: str | None, proc_version: Path | None, smi_timeout: float, token: int,
               started: int) -> ProbeResult:
    scan = scan_gpus(env=env, nvidia_smi=nvidia_smi, proc_version=proc_version, timeout=smi_timeout)
    facts: dict[str, Any] = {**scan.to_json(), **context, "host": host_platform_name()}
    facts["gpu"] = ", ".join(g.name for g in scan.gpus) or ("an NVIDIA GPU" if scan.present else None)

    def done(reason: Reason, **more: Any) -> ProbeResult:
        return ProbeResult.make(reason, {**facts, **more}, token=token, probed_at=started)

    if not scan.present:
        return done(Reason.GPU_MISSING, detail=scan.error or "no NVIDIA driver found")
    if target is None or "cuda" not in (target[1].get("backends") or []):
        return done(Reason.BINARY_MISSING_NVIDIA_DETECTED)
    root, manifest = target
    floor = (manifest.get("cuda") or {}).get("driver_floor")
    facts.update(bundle=f"{manifest.get('name') or 'bundle'} ({str(manifest['key'])[:12]})", floor=floor)
    if floor and scan.driver and driver_older(scan.driver, str(floor)):
        return done(Reason.DRIVER_TOO_OLD)
    report = VerifyReport(path=str(root), key=manifest["key"], platform=manifest["platform"], files=0, bytes=0)
    try:
        check_load(root, manifest, report)  # verify's own run of llama-server --verbose --list-devices, clean env, timeout
    except VerifyError as e:
        return done(Reason.CUDA_STARTUP_FAILED, detail=e.what + (f" ({e.why})" if e.why else ""), output=e.details)
    facts.update(backends_loaded=report.backends_loaded, devices=report.devices)
    if report.levels.get("load", "").startswith("skipped"):
        return done(Reason.CUDA_STARTUP_FAILED, detail=report.levels["load"].removeprefix("skipped: "))
    if "CUDA" not in report.backends_loaded:
        return done(Reason.CUDA_UNAVAILABLE, detail="the CUDA backend did not load")
    if not any(d.startswith("CUDA") for d in report.devices):
        return done(Reason.CUDA_UNAVAILABLE, detail="the CUDA backend loaded but listed no device")
    return done(Reason.OK)


# ------------------------------------------------------------------------------------ cache + tokens


def _lock(cache_dir: Path) -> FileLock:
    cache_dir.mkdir(parents=True, exist_ok=True)
    return FileLock(str(cache_dir / "probe.lock"), timeout=60)


def take_token(cache_dir: Path) -> int:
    """The next probe token: strictly greater than every token taken before, across processes."""
    with _lock(cache_dir):
        try:
            last = int((cache_dir / TOKEN).read_text())
        except (OSError, ValueError):
            last = 0
        write_atomic(cache_dir / TOKEN, f"{last + 1}\n")
        return last + 1


def read_cached(cache_dir: Path) -> ProbeResult | None:
    try:
        return ProbeResult.from_json(json.loads((cache_dir / CACHE).read_text(encoding="utf-8")))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def store_result(cache_dir: Path, result: ProbeResult) -> bool:
    """Write the result unless a probe that started later has already written one. True if written."""
    with _lock(cache_dir):
        last = read_cached(cache_dir)
        if last is not None and last.token > result.token:
            return False
        write_atomic(cache_dir / CACHE, json.dumps(result.to_json(), indent=2, sort_keys=True) + "\n")
        return True


# ------------------------------------------------------------------------------------ install on demand


def ensure_backend(*, store: Store | None, key: str | None, root: Path, env: Mapping[str, str], log: Log,
                   cache_dir: Path | None = None, commit: str | None = None, toolkit: str | None = None,
                   **probe_kw: Any) -> ProbeResult:
    """Probe; on binary_missing_nvidia_detected (the only reason that installs) install `key` from `store`
    and probe again. Any other reason, or a failed install, is CPU with that reason."""
    first = probe(root=root, env=env, cache_dir=cache_dir, **probe_kw)
    if first.reason is not Reason.BINARY_MISSING_NVIDIA_DETECTED or store is None or key is None:
        return first
    try:
        install_bundle(store, key, root=root, log=log, commit=commit, toolkit=toolkit)
    except LlamaBundleError as e:
        reason = Reason.BUNDLE_INVALID if getattr(e, "reason", None) is Reason.BUNDLE_INVALID else Reason.CUDA_BUNDLE_INSTALL_FAILED
        facts = {**first.facts, "detail": e.what, "install_error": e.render()}
        result = ProbeResult.make(reason, facts, token=first.token, probed_at=first.probed_at)
        if cache_dir is not None:
            store_result(cache_dir, result)
        return result
    return probe(root=root, env=env, cache_dir=cache_dir, **{**probe_kw, "max_age": 0.0})
