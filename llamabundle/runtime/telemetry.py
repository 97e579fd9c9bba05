"""Live GPU telemetry of a running CUDA llama-server of a bundle: the driver version and, per GPU, its
utilisation and VRAM used/total (gpus.STATS_ARGS). It is read only while the server runs: the PID must be
alive and its executable (/proc/PID/exe) inside an installed CUDA bundle, or the bundle given; otherwise the
result is inactive with a stable reason (`Inactive`) and nvidia-smi is not run. A sample is cached
(runtime/results.py) and served while younger than `max_age`; concurrent callers share one nvidia-smi run
(the refresh holds a file lock, a caller that waited reads the holder's sample). Nothing here raises to the
caller: a failure is an inactive result with its reason."""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from enum import StrEnum
from pathlib import Path
from typing import Any

from filelock import FileLock
from filelock import Timeout as LockTimeout

from .. import gpus
from ..bundle import read_manifest
from ..errors import VerifyError
from ..gpus import SMI_TIMEOUT, GpuStat
from . import results
from .install import list_installed
from .results import parse_utc_timestamp, utc_timestamp

NVIDIA_SMI_ARGS = gpus.STATS_ARGS
DEFAULT_MAX_AGE = 5.0
CACHE = "telemetry.json"
REFRESH_LOCK = "telemetry.lock"
LOCK_GRACE = 5.0  # seconds a caller waits for the refresh lock beyond the holder's nvidia-smi timeout
PROC = Path("/proc")


class Inactive(StrEnum):
    """Why there is no telemetry (stable strings)."""

    SERVER_NOT_RUNNING = "server_not_running"
    NOT_BUNDLE_SERVER = "not_bundle_server"
    NO_NVIDIA_SMI = "no_nvidia_smi"
    NVIDIA_SMI_FAILED = "nvidia_smi_failed"


@dataclass(frozen=True, kw_only=True)
class Server:
    """A running llama-server of a bundle."""

    pid: int
    exe: str
    bundle_dir: str
    bundle_key: str | None


@dataclass(frozen=True, kw_only=True)
class Sample:
    """One run of nvidia-smi (what is cached): its GPUs, or why it gave none."""

    token: int  # taken before nvidia-smi ran: a sample with a newer token is never overwritten by this one
    sampled_at: int  # Unix seconds when it started (JSON: utc_timestamp)
    nvidia_smi: str
    gpus: tuple[GpuStat, ...]
    driver: str | None  # the first GPU's driver version
    failure: str | None  # why there are no GPUs (the reason is nvidia_smi_failed), else None
    warning: str | None = None  # lines of nvidia-smi's output that were not understood, left out

    def to_json(self) -> dict[str, Any]:
        return {"schema": 1, "token": self.token, "sampled_at": utc_timestamp(self.sampled_at),
                "nvidia_smi": self.nvidia_smi, "driver": self.driver, "gpus": [g.to_json() for g in self.gpus],
                "failure": self.failure, "warning": self.warning}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Sample:
        gpus = tuple(GpuStat(index=int(g["index"]), name=str(g["name"]), utilization_pct=_opt_int(g["utilization_pct"]),
                             memory_used_mib=_opt_int(g["memory_used_mib"]), memory_total_mib=_opt_int(g["memory_total_mib"]))
                     for g in data["gpus"])
        return cls(token=int(data["token"]), sampled_at=parse_utc_timestamp(data["sampled_at"]),
                   nvidia_smi=str(data["nvidia_smi"]), gpus=gpus, failure=_opt_str(data["failure"]),
                   warning=_opt_str(data.get("warning")), driver=_opt_str(data["driver"]))


def _opt_int(value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{value!r} is not an integer")
    return value


def _opt_str(value: Any) -> str | None:
    return None if value is None else str(value)


@dataclass(frozen=True, kw_only=True)
class Telemetry:
    active: bool
    reason: Inactive | None  # None when active
    detail: str  # what was found, in words
    pid: int | None
    server: Server | None = None
    nvidia_smi: str | None = None
    sample: Sample | None = None
    cached: bool = False
    age_s: float | None = None  # how old the sample is

    def to_json(self) -> dict[str, Any]:
        s, srv = self.sample, self.server
        return {"active": self.active, "reason": self.reason.value if self.reason else None, "detail": self.detail,
                "pid": self.pid, "server_exe": srv.exe if srv else None, "bundle_dir": srv.bundle_dir if srv else None,
                "bundle_key": srv.bundle_key if srv else None, "nvidia_smi": self.nvidia_smi,
                "driver": s.driver if s and self.active else None,
                "gpus": [g.to_json() for g in s.gpus] if s and self.active else [],
                "token": s.token if s else 0, "sampled_at": utc_timestamp(s.sampled_at) if s else None,
                "age_s": round(self.age_s, 3) if self.age_s is not None else None, "cached": self.cached}


# ------------------------------------------------------------------------------------ nvidia-smi's answer


def sample_gpus(exe: str, *, env: Mapping[str, str], token: int, started: int, timeout: float = SMI_TIMEOUT) -> Sample:
    """Run nvidia-smi's query once (its own process group, ended with what it started on the timeout). Never
    raises: a failure is a sample without GPUs that says why."""
    warning: str | None = None
    found: list[GpuStat] = []
    driver: str | None = None
    answer = gpus.run(exe, NVIDIA_SMI_ARGS, env=env, timeout=timeout)
    failure = answer.failure
    if answer.stdout is not None:
        found, driver, bad = gpus.read_stats(answer.stdout)
        if not found:
            failure = "nvidia-smi listed no GPU: " + ("; ".join(bad[:3]) if bad else "it printed nothing")
        elif bad:
            warning = f"nvidia-smi printed {len(bad)} line(s) that are not GPUs, left out: " + "; ".join(bad[:3])
    return Sample(token=token, sampled_at=started, nvidia_smi=exe, gpus=tuple(found),
                  driver=driver, failure=failure[:500] if failure else None,
                  warning=warning[:500] if warning else None)


# ------------------------------------------------------------------------------------ the server


def find_server(pid: int | None, *, root: Path, bundle: Path | None = None,
                proc_root: Path = PROC) -> Server | tuple[Inactive, str]:
    """The running llama-server `pid` of a CUDA bundle installed under root (or of `bundle`), or why it is not."""
    if pid is None:
        return Inactive.SERVER_NOT_RUNNING, "no server PID was given (--pid)"
    if pid <= 0:
        return Inactive.SERVER_NOT_RUNNING, f"{pid} is not a process id"
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return Inactive.SERVER_NOT_RUNNING, f"process {pid} is not running"
    except PermissionError:
        pass  # it exists, as another user's process: /proc says more
    except (OSError, OverflowError) as e:
        return Inactive.SERVER_NOT_RUNNING, f"process {pid} cannot be checked: {getattr(e, 'strerror', None) or e}"
    try:
        stat = (proc_root / str(pid) / "stat").read_text(encoding="utf-8", errors="replace")
        state = stat.rpartition(")")[2].split()[:1]
    except OSError:
        state = []
    if state in (["Z"], ["X"]):
        return Inactive.SERVER_NOT_RUNNING, f"process {pid} has exited (a zombie, not yet reaped)"
    try:
        exe = os.readlink(proc_root / str(pid) / "exe")
    except FileNotFoundError:
        return Inactive.SERVER_NOT_RUNNING, f"process {pid} is not running"
    except OSError as e:
        return Inactive.NOT_BUNDLE_SERVER, f"the executable of process {pid} cannot be read ({e.strerror or e})"
    if exe.endswith(" (deleted)"):
        return Inactive.NOT_BUNDLE_SERVER, f"process {pid} runs {exe}: its executable was removed (an older install)"
    path = Path(exe)
    if bundle is not None:
        where = bundle.expanduser().resolve()
        if not path.is_relative_to(where):
            return Inactive.NOT_BUNDLE_SERVER, f"process {pid} runs {exe}, which is not in {where}"
        try:
            key: str | None = read_manifest(where).key
        except (VerifyError, OSError, ValueError):
            key = None
        return Server(pid=pid, exe=exe, bundle_dir=str(where), bundle_key=key)
    installed = list_installed(root)
    inside = next((i for i in installed if path.is_relative_to(i.path.resolve())), None)
    if inside is None:
        return Inactive.NOT_BUNDLE_SERVER, (f"process {pid} runs {exe}, which is in no bundle installed in {root}"
                                            + ("" if installed else " (none is installed)"))
    if "cuda" not in inside.backends:
        return Inactive.NOT_BUNDLE_SERVER, f"process {pid} runs {exe} of {inside.name}, which has no CUDA backend"
    return Server(pid=pid, exe=exe, bundle_dir=str(inside.path.resolve()), bundle_key=inside.key)


# ------------------------------------------------------------------------------------ cache


def read_sample(cache_dir: Path) -> Sample | None:
    return results.read(cache_dir / CACHE, Sample.from_json)


def store_sample(cache_dir: Path, sample: Sample) -> bool:
    """Write the sample unless one whose token is newer is already there (results.store). True if written."""
    return results.store(cache_dir / CACHE, sample.to_json(), token=sample.token)


def _fresh(cache_dir: Path | None, exe: str, max_age: float, now: float) -> Sample | None:
    if cache_dir is None or max_age <= 0:
        return None
    last = read_sample(cache_dir)
    if last is None or last.nvidia_smi != exe or not 0 <= now - last.sampled_at < max_age:
        return None
    return last


def _refresh(exe: str, *, env: Mapping[str, str], cache_dir: Path | None, max_age: float, timeout: float,
             lock_timeout: float, clock: Callable[[], float]) -> tuple[Sample, bool]:
    """(the sample, whether it came from the cache): one nvidia-smi run for all callers waiting on the lock."""
    if cache_dir is None:
        return sample_gpus(exe, env=env, token=0, started=int(clock()), timeout=timeout), False
    lock = FileLock(str(cache_dir / REFRESH_LOCK), timeout=lock_timeout)
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
        lock.acquire()
        locked = True
    except (LockTimeout, OSError):  # a holder that hangs, or a cache that cannot be locked: run it unlocked
        locked = False
    try:
        if locked:
            last = _fresh(cache_dir, exe, max_age, clock())  # a caller before us refreshed it while we waited
            if last is not None:
                return last, True
        try:
            token = results.take_token(cache_dir)
        except OSError:
            token = 0
        sample = sample_gpus(exe, env=env, token=token, started=int(clock()), timeout=timeout)
        try:
            store_sample(cache_dir, sample)
        except OSError:
            pass
        return sample, False
    finally:
        if locked:
            lock.release()


def _smi(env: Mapping[str, str], nvidia_smi: str | None) -> str | tuple[Inactive, str]:
    if nvidia_smi is None:
        found = shutil.which("nvidia-smi", path=env.get("PATH"))
        return found if found else (Inactive.NO_NVIDIA_SMI, "nvidia-smi is not on PATH")
    p = Path(nvidia_smi)
    if not p.is_file() or not os.access(p, os.X_OK):
        return Inactive.NO_NVIDIA_SMI, f"{nvidia_smi} is not an executable file"
    return str(p)


# ------------------------------------------------------------------------------------ telemetry


def read_telemetry(*, root: Path, env: Mapping[str, str], pid: int | None, cache_dir: Path | None = None,
                   bundle: Path | None = None, nvidia_smi: str | None = None, max_age: float = DEFAULT_MAX_AGE,
                   timeout: float = SMI_TIMEOUT, lock_timeout: float | None = None,
                   clock: Callable[[], float] = time.time, proc_root: Path = PROC) -> Telemetry:
    """The telemetry of the CUDA llama-server `pid` (of a bundle installed under root, or of `bundle`): a cached
    sample younger than max_age, else one nvidia-smi run shared with concurrent callers. Never raises for what
    it finds: a server that is not running or not a bundle's, or nvidia-smi missing or failing, is an inactive
    result with its reason. `lock_timeout`: how long to wait for another caller's refresh (default: the
    nvidia-smi timeout and a grace), then nvidia-smi runs anyway."""
    server = find_server(pid, root=root, bundle=bundle, proc_root=proc_root)
    if not isinstance(server, Server):
        return Telemetry(active=False, reason=server[0], detail=server[1], pid=pid)
    exe = _smi(env, nvidia_smi)
    if not isinstance(exe, str):
        return Telemetry(active=False, reason=exe[0], detail=exe[1], pid=pid, server=server)
    sample = _fresh(cache_dir, exe, max_age, clock())
    cached = sample is not None
    if sample is None:
        sample, cached = _refresh(exe, env=env, cache_dir=cache_dir, max_age=max_age, timeout=timeout,
                                  lock_timeout=timeout + LOCK_GRACE if lock_timeout is None else lock_timeout,
                                  clock=clock)
    result = Telemetry(active=sample.failure is None, reason=Inactive.NVIDIA_SMI_FAILED if sample.failure else None,
                       detail="", pid=pid, server=server, nvidia_smi=exe, sample=sample, cached=cached,
                       age_s=max(0.0, clock() - sample.sampled_at))
    if sample.failure:
        return replace(result, detail=sample.failure)
    words = f"llama-server {pid} ({server.exe}) runs; {len(sample.gpus)} GPU(s), driver {sample.driver}"
    return replace(result, detail=words + (f"; {sample.warning}" if sample.warning else ""))
