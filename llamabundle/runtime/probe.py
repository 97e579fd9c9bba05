"""Which backend will run, and why (DESIGN §8): NVIDIA GPU and driver, the driver against the bundle's floor,
and the installed bundle's own `llama-server --verbose --list-devices`. One reason code per result. A bundle
with several GPU backends (CPU + CUDA + Vulkan) runs CUDA on NVIDIA when its checks pass, else Vulkan when it
lists a GPU, else the CPU (an explicit preference is honoured where that backend works); the result names
why the others were not chosen, the GPUs seen (one physical GPU once), and the llama-server flags.

What nvidia-smi and the kernel driver's version file say is checked before it is believed: a driver version
is 2-4 dot-separated numbers (580.65.06, 572.61), a memory size a whole number of MiB (or [N/A]), a name is
there; a line that fails is not a GPU, and the scan says what it could not read. nvidia-smi runs through
proc.capture, in a process group of its own: on its timeout it ends with whatever it started.

When the CUDA backend did not load or listed no device, probe finds out why (diagnose_cuda) and names the
cause instead of cuda_unavailable: a library of ggml-cuda's static import closure that this machine cannot
resolve (one of the bundle's, or the driver's libcuda.so.1), a GPU whose compute capability neither the
bundle's SASS nor its PTX serves, PTX as the only code for the GPU with a driver too old to JIT it, a driver
too old for the bundle's CUDA toolkit. The diagnosis runs only then, never raises, and keeps its evidence in
the facts (`cause`, `diagnosis`); when it finds nothing, or fails, the reason stays cuda_unavailable. When the
device is listed, the compute-capability and PTX checks still run (facts `kernels`): ggml-cuda lists a GPU that
no kernel of the bundle can run on, and the first kernel aborts.

Results are cached as JSON with a TTL, for the same bundle directory in the same state (a digest of its
entries' names, sizes and mtimes: a file added, removed or replaced since is probed anew). Each probe takes
a token (a counter under a file lock) when it starts and writes its result only if no probe with a newer
token has written already: an older probe that finishes last never overwrites a newer result."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from filelock import FileLock
from packaging.version import InvalidVersion, Version

from .. import backends, data, platforms, proc
from ..backends.cuda import section as cuda_section
from ..bundle import read_manifest
from ..bundle.manifest import Manifest
from ..errors import LlamaBundleError, VerifyError
from ..log import Log
from ..store.base import Store
from ..verify import VerifyReport, check_load
from . import (
    Backend,
    Reason,
    backend_for,
    explain,
    parse_utc_timestamp,
    utc_timestamp,
    write_atomic,
)
from .install import DigestList, Installed, install_bundle, list_installed

NVIDIA_SMI_ARGS = ("--query-gpu=name,driver_version,memory.total,memory.free", "--format=csv,noheader,nounits")
COMPUTE_CAP_ARGS = ("--query-gpu=compute_cap", "--format=csv,noheader")  # only when the CUDA backend failed
PROC_VERSION = Path("/proc/driver/nvidia/version")
SMI_TIMEOUT = 15.0
DEFAULT_TTL = 30.0
CACHE = "probe.json"
TOKEN = "probe.token"
# ASCII digits only (\d would take other scripts' digits too)
_PROC_DRIVER = re.compile(r"NVRM version:[^\n]*?\s([0-9]+(?:\.[0-9]+)+)(?=\s|\Z)")  # the line's first dotted number
_DRIVER_VERSION = re.compile(r"[0-9]{1,5}(?:\.[0-9]{1,5}){1,3}")  # 580.65.06, 572.61, 580.159.04
_MIB = re.compile(r"[0-9]{1,9}")  # nounits: whole MiB
_NOT_AVAILABLE = re.compile(r"\[[^\]]{0,40}\]|N/A")  # [N/A], [Not Supported], [Insufficient Permissions]
_MEMORY_SUFFIX = re.compile(r"\s*\([^()]*MiB[^()]*\)\s*$")  # a --list-devices line's "(143155 MiB, 142629 MiB free)"
MAX_OUTPUT_LINES = 64  # GPUs per host nvidia-smi may list; more is not a GPU list
_COMPUTE_CAP = re.compile(r"([0-9]{1,2})\.([0-9]{1,2})")  # 9.0, 12.0
_SMI_CUDA = re.compile(r"CUDA Version\s*:\s*([0-9]{1,3})\.([0-9]{1,3})")  # nvidia-smi's header: the newest CUDA it runs


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
    error: str | None  # why nvidia-smi gave no GPU, or what of its output was not understood

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


def is_driver_version(text: str) -> bool:
    """2-4 dot-separated numbers: how NVIDIA numbers its drivers (580.65.06 on Linux, 572.61 on Windows)."""
    return _DRIVER_VERSION.fullmatch(text) is not None


def _mib(value: str) -> tuple[int | None, bool]:
    """(MiB, understood): a whole number of MiB, or None for nvidia-smi's [N/A]-style 'not known'."""
    if _MIB.fullmatch(value):
        return int(value), True
    return None, _NOT_AVAILABLE.fullmatch(value) is not None


def read_nvidia_smi(text: str) -> tuple[list[Gpu], list[str]]:
    """`nvidia-smi --query-gpu=name,driver_version,memory.total,memory.free --format=csv,noheader,nounits` output:
    the GPUs it lists, and for each other non-empty line what is wrong with it (the line is not a GPU)."""
    gpus: list[Gpu] = []
    bad: list[str] = []
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    for line in lines[:MAX_OUTPUT_LINES]:
        fields = [f.strip() for f in line.rsplit(",", 3)]  # a GPU's name may hold a comma, the numbers do not
        why = None
        if len(fields) != 4:
            why = "not 4 comma-separated fields"
        else:
            name, driver, total, free = fields
            (total_mib, total_ok), (free_mib, free_ok) = _mib(total), _mib(free)
            if not name or not name.isprintable() or len(name) > 200:
                why = "no GPU name" if not name else "the GPU name is not printable text of at most 200 characters"
            elif not is_driver_version(driver):
                why = f"driver version {driver[:40]!r} is not a version like 580.65.06"
            elif not total_ok:
                why = f"memory.total {total[:40]!r} is not a whole number of MiB"
            elif not free_ok:
                why = f"memory.free {free[:40]!r} is not a whole number of MiB"
            else:
                gpus.append(Gpu(name=name, driver=driver, memory_total_mib=total_mib, memory_free_mib=free_mib))
                continue
        bad.append(f"{line[:100]!r}: {why}")
    if len(lines) > MAX_OUTPUT_LINES:
        bad.append(f"{len(lines) - MAX_OUTPUT_LINES} more lines after the first {MAX_OUTPUT_LINES}, not read")
    return gpus, bad


def parse_nvidia_smi(text: str) -> list[Gpu]:
    """The GPUs in nvidia-smi's CSV output (read_nvidia_smi without the reasons for the lines left out)."""
    return read_nvidia_smi(text)[0]


def parse_proc_version(text: str) -> str | None:
    """The driver version on the `NVRM version:` line of /proc/driver/nvidia/version; None when that line's
    first dotted number is not a driver version (or there is no such line)."""
    m = _PROC_DRIVER.search(text)
    return m.group(1) if m and is_driver_version(m.group(1)) else None


def _read_proc_version(path: Path | None) -> tuple[str | None, str | None]:
    """(driver version, what was wrong with the file when it exists but names none)."""
    if path is None:
        return None, None
    try:
        with open(path, "rb") as f:
            raw = f.read(65536)
    except FileNotFoundError:
        return None, None
    except OSError as e:
        return None, f"{path} cannot be read ({e.strerror or e})"
    text = raw.decode("utf-8", errors="replace")
    version = parse_proc_version(text)
    if version is None:
        first = (text.strip().splitlines() or [""])[0].strip()
        return None, f"{path} names no driver version ({first[:100]!r})"
    return version, None


def scan_gpus(*, env: Mapping[str, str], nvidia_smi: str | None = None, proc_version: Path | None = PROC_VERSION,
              timeout: float = SMI_TIMEOUT) -> GpuScan:
    """Run nvidia-smi (given, or found on env's PATH) with a timeout; read the kernel driver's version file."""
    proc_driver, proc_problem = _read_proc_version(proc_version)
    exe = nvidia_smi or shutil.which("nvidia-smi", path=env.get("PATH"))
    if exe is None:
        return GpuScan(gpus=(), nvidia_smi=None, smi_driver=None, proc_driver=proc_driver,
                       error="nvidia-smi is not on PATH" + (f"; {proc_problem}" if proc_problem else ""))
    gpus: list[Gpu] = []
    error: str | None
    try:
        # its own process group: on the timeout it is ended with everything it started
        done = proc.capture([exe, *NVIDIA_SMI_ARGS], env=env, timeout=timeout)
    except proc.Timeout:
        error = f"nvidia-smi did not answer in {timeout:g}s (it was stopped, with what it started)"
    except OSError as e:
        error = f"nvidia-smi could not be started: {e}"
    else:
        last = ((done.stdout + done.stderr).strip().splitlines()[-1:] or [""])[0].strip()
        if done.returncode != 0:
            error = f"nvidia-smi exited with {done.returncode}: {last}"
        else:
            gpus, bad = read_nvidia_smi(done.stdout)
            if not gpus:
                error = ("nvidia-smi listed no GPU: " + ("; ".join(bad[:3]) if bad else "it printed nothing")
                         + (f" ({len(bad) - 3} more lines like these)" if len(bad) > 3 else ""))
            elif bad:
                error = f"nvidia-smi printed {len(bad)} line(s) that are not GPUs, left out: " + "; ".join(bad[:3])
            else:
                error = None
    if error is not None:
        error = error[:500]
    if not gpus and error is not None and proc_problem:
        error += f"; {proc_problem}"
    return GpuScan(gpus=tuple(gpus), nvidia_smi=exe, smi_driver=gpus[0].driver if gpus else None, proc_driver=proc_driver,
                   error=error)


def driver_older(driver: str, floor: str) -> bool:
    """driver < floor, as versions (570.124.06 < 572.61). Both should pass is_driver_version (the probe checks)."""
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
    def make(cls, reason: Reason, facts: dict[str, Any], **kw: Any) -> ProbeResult:
        sentence, fix = explain(reason, facts)
        return cls(backend=backend_for(reason), reason=reason, sentence=sentence, fix=fix, facts=facts, **kw)

    def to_json(self) -> dict[str, Any]:
        return {"schema": 1, "backend": self.backend.value, "reason": self.reason.value, "sentence": self.sentence,
                "fix": self.fix, "facts": self.facts, "token": self.token, "probed_at": utc_timestamp(self.probed_at),
                "cached": self.cached}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> ProbeResult:
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


def gpu_candidate(root: Path, *, nvidia: bool = True) -> Installed | None:
    """The installed bundle for this machine to probe: the most recent one with a GPU backend, one with CUDA
    first where an NVIDIA GPU is present."""
    host = platforms.host_name()
    found = [i for i in list_installed(root) if i.manifest.platform == host and
             any(b.gpu for b in backends.of(tuple(i.backends)))]
    with_cuda = [i for i in found if "cuda" in i.backends]
    return max((with_cuda if nvidia and with_cuda else found), key=lambda i: i.installed_at, default=None)


def probe(*, root: Path, env: Mapping[str, str], cache_dir: Path | None = None, max_age: float = 0.0,
          bundle: Path | None = None, nvidia_smi: str | None = None, proc_version: Path | None = PROC_VERSION,
          smi_timeout: float = SMI_TIMEOUT, prefer: str | None = None,
          lib_dirs: Sequence[Path] | None = None) -> ProbeResult:
    """Probe now, or return the cached result when it is younger than max_age and about the same bundle (and
    preference). `bundle` is an unpacked bundle directory to probe instead of the installed one; `prefer`
    (cuda, vulkan, cpu) is honoured when that backend works here. `lib_dirs`: this machine's library
    directories, where a failed CUDA backend's imports are looked up (default: ldconfig's, then the usual)."""
    target: tuple[Path, Manifest] | None
    if bundle is not None:
        target = (bundle.resolve(), read_manifest(bundle))
    else:  # NVIDIA's driver, cheaply (nvidia-smi runs after the token is taken): its CUDA bundle first
        nvidia = bool(proc_version is not None and proc_version.exists()) or \
            bool(nvidia_smi or shutil.which("nvidia-smi", path=env.get("PATH")))
        inst = gpu_candidate(root, nvidia=nvidia)
        target = (inst.path, inst.manifest) if inst is not None else None
    context = {"bundle_dir": str(target[0]) if target else None, "bundle_key": target[1].key if target else None,
               "bundle_stamp": _stamp(target[0]) if target else None, "prefer": prefer}
    if cache_dir is not None and max_age > 0:
        last = read_cached(cache_dir)
        if last is not None and 0 <= time.time() - last.probed_at < max_age and \
                {k: last.facts.get(k) for k in context} == context:
            return replace(last, cached=True)
    token = take_token(cache_dir) if cache_dir is not None else 0
    scan = scan_gpus(env=env, nvidia_smi=nvidia_smi, proc_version=proc_version, timeout=smi_timeout)
    machine = Machine(env=env, smi_timeout=smi_timeout, lib_dirs=tuple(lib_dirs) if lib_dirs is not None else None)
    result = _probe_now(target, context, scan=scan, token=token, started=int(time.time()), prefer=prefer,
                        wine_prefix=cache_dir / "wine" if cache_dir is not None else None, machine=machine)
    if cache_dir is not None:
        store_result(cache_dir, result)
    return result


def _stamp(bundle_dir: Path) -> str | None:
    """A digest of the bundle directory's entries (name, size, mtime): what a file added, removed, replaced or
    rewritten in it changes. A few dozen stat calls."""
    try:
        entries = sorted((e.name, e.stat(follow_symlinks=False)) for e in os.scandir(bundle_dir))
    except OSError:
        return None
    listing = "\n".join(f"{name}\t{st.st_size}\t{st.st_mtime_ns}" for name, st in entries)
    return hashlib.sha256(listing.encode("utf-8", "surrogateescape")).hexdigest()[:16]


def pair_devices(devices: list[str]) -> list[dict[str, Any]]:
    """One entry per physical GPU: the same GPU seen through CUDA and Vulkan (`CUDA0: NVIDIA H200 (…)`,
    `Vulkan0: NVIDIA H200 (…)`) pairs by name, in order (llama.cpp itself skips the second one by PCI id when
    it loads a model)."""
    gpus: list[dict[str, Any]] = []
    for line in devices:
        dev, _, desc = line.partition(": ")
        name = _MEMORY_SUFFIX.sub("", desc).strip()
        family = re.sub(r"\d+$", "", dev)
        same = next((g for g in gpus if g["name"] == name and not any(re.sub(r"\d+$", "", d) == family
                                                                       for d in g["devices"])), None)
        if same is None:
            gpus.append({"name": name, "devices": [dev]})
        else:
            same["devices"].append(dev)
    return gpus


def server_flags(chosen: Backend, manifest: Manifest, device: str | None) -> tuple[list[str], dict[str, str]]:
    """The llama-server arguments and environment that make it use `chosen` (and hide the other GPU backends)."""
    has = set(manifest.backends)
    env: dict[str, str] = {}
    if chosen is Backend.CPU:
        return ["--device", "none"], env
    if chosen is Backend.CUDA and "vulkan" in has:
        env["GGML_VK_VISIBLE_DEVICES"] = ""  # set and empty: ggml-vulkan takes no device
    if chosen is Backend.VULKAN and "cuda" in has:
        env["CUDA_VISIBLE_DEVICES"] = ""
    return ["--device", device or f"{'CUDA' if chosen is Backend.CUDA else 'Vulkan'}0"], env


def _probe_now(target: tuple[Path, Manifest] | None, context: dict[str, Any], *, scan: GpuScan, token: int,
               started: int, wine_prefix: Path | None, prefer: str | None = None,
               machine: Machine | None = None) -> ProbeResult:
    facts: dict[str, Any] = {**scan.to_json(), **context, "host": platforms.host_name()}
    facts["gpu"] = ", ".join(g.name for g in scan.gpus) or ("an NVIDIA GPU" if scan.present else None)

    def done(reason: Reason, **more: Any) -> ProbeResult:
        result = ProbeResult.make(reason, {**facts, **more}, token=token, probed_at=started)
        if target is not None:
            device = {Backend.CUDA: more.get("cuda_device"), Backend.VULKAN: more.get("device")}.get(result.backend)
            args, env = server_flags(result.backend, target[1], device if isinstance(device, str) else None)
            result = replace(result, facts={**result.facts, "server_args": args, "server_env": env})
        return result

    gpu_backends = {b.name for b in backends.of(target[1].backends) if b.gpu} if target else set()
    if target is None or not gpu_backends:
        return done(Reason.BINARY_MISSING_NVIDIA_DETECTED if scan.present else Reason.GPU_MISSING,
                    **({} if scan.present else {"detail": scan.error or "no NVIDIA driver found"}))
    root, manifest = target
    facts.update(bundle=f"{manifest.name} ({manifest.key[:12]})")
    listed: dict[str, Any] = {}

    def list_devices() -> VerifyReport | VerifyError:
        """verify's own run of llama-server --verbose --list-devices (clean env, timeout), once."""
        if "report" not in listed:
            report = VerifyReport(path=str(root), key=manifest.key, platform=manifest.platform, files=0, bytes=0)
            try:
                check_load(root, manifest, report, wine_prefix=wine_prefix)
                listed["report"] = report
                facts.update(backends_loaded=report.backends_loaded, devices=report.devices,
                             gpu_devices=pair_devices([d for d in report.devices if not d.startswith("CPU")]))
            except VerifyError as e:
                listed["report"] = e
        out: VerifyReport | VerifyError = listed["report"]
        return out

    machine = machine or Machine(env={}, smi_timeout=SMI_TIMEOUT, lib_dirs=None)
    cuda = (_cuda_verdict(manifest, scan, facts, list_devices,
                          diagnose=lambda: diagnose_cuda(root, manifest, scan, machine=machine),
                          kernels=lambda: diagnose_cuda(root, manifest, scan, machine=machine, checks=KERNEL_CHECKS))
            if "cuda" in gpu_backends else None)
    vulkan = _vulkan_verdict(list_devices) if "vulkan" in gpu_backends else None
    if prefer == "cpu":
        working = next((v for v in (cuda, vulkan) if v is not None and v[0] in (Reason.OK, Reason.VULKAN_OK)), None)
        return done(Reason.CPU_PREFERRED, device=(working[1].get("device") or working[1].get("cuda_device")) if working
                    else "none works here", **(working[1] if working else {}))
    if vulkan is not None and vulkan[0] is Reason.VULKAN_OK and (prefer == "vulkan" or cuda is None or cuda[0] is not Reason.OK):
        not_cuda = ("Vulkan was asked for" if prefer == "vulkan" and cuda is not None and cuda[0] is Reason.OK else
                    "the bundle has no CUDA backend" if cuda is None else
                    f"CUDA is not used: {explain(cuda[0], {**facts, **cuda[1]})[0]}")
        return done(Reason.VULKAN_OK, not_cuda=not_cuda, cuda_reason=cuda[0].value if cuda else None, **vulkan[1],
                    **({"cuda_cause": cuda[1]["cause"]} if cuda and cuda[1].get("cause") else {}))
    if cuda is not None and (cuda[0] is not Reason.GPU_MISSING or vulkan is None):
        return done(cuda[0], vulkan_reason=vulkan[0].value if vulkan else None, **cuda[1],
                    **({"vulkan_detail": vulkan[1].get("detail")} if vulkan else {}))
    assert vulkan is not None
    return done(vulkan[0], cuda_reason=cuda[0].value if cuda else None, **vulkan[1])


Verdict = tuple[Reason, dict[str, Any]]
ListDevices = Callable[[], "VerifyReport | VerifyError"]


def _cuda_verdict(manifest: Manifest, scan: GpuScan, facts: dict[str, Any], list_devices: ListDevices, *,
                  diagnose: Callable[[], Diagnosis], kernels: Callable[[], Diagnosis]) -> Verdict:
    """CUDA's checks, in order: an NVIDIA GPU, the driver against the bundle's floor, the backend loading
    from the bundle and listing its device; when it did not load or listed none, why (`diagnose`). A listed
    device is not yet a working one: ggml-cuda lists a GPU that none of its kernels can run on (seen on the
    H200: a bundle of sm_80 SASS listed `CUDA0: NVIDIA H200`, and llama-bench aborted at its first kernel), so
    the GPUs' compute capabilities are checked against the bundle's SASS and PTX too (`kernels`)."""
    if not scan.present:
        return Reason.GPU_MISSING, {"detail": scan.error or "no NVIDIA driver found"}
    info = cuda_section.read(manifest)
    floor = info.driver_floor if info is not None else None
    facts.update(floor=floor)
    if floor and not is_driver_version(floor):
        return Reason.BUNDLE_INVALID, {"detail": f"its bundle.json records the driver floor {floor[:40]!r}, "
                                                 "which is not a driver version"}
    if floor and scan.driver and driver_older(scan.driver, floor):
        return Reason.DRIVER_TOO_OLD, {}
    dev = _device_of(list_devices, "cuda", failed=Reason.CUDA_STARTUP_FAILED,
                     not_loaded=(Reason.CUDA_UNAVAILABLE, {"detail": "the CUDA backend did not load"}),
                     no_device=(Reason.CUDA_UNAVAILABLE, {"detail": "the CUDA backend loaded but listed no device"}))
    if isinstance(dev, str):
        device = dev.split(":", 1)[0]
        try:
            found = kernels()
        except Exception as e:  # the check never takes the probe down: the device is listed
            return Reason.OK, {"cuda_device": device, "kernels": {"errors": [f"{type(e).__name__}: {e}"[:300]]}}
        evidence = {**found.evidence, "errors": list(found.errors)}
        if found.cause is None:
            return Reason.OK, {"cuda_device": device, "kernels": evidence}
        return found.cause[0], {"detail": f"the CUDA backend loaded and listed {device}, but no kernel in the bundle "
                                          "runs on it", "kernels": evidence, **found.cause[1]}
    if dev[0] is not Reason.CUDA_UNAVAILABLE:
        return dev
    try:
        found = diagnose()
    except Exception as e:  # a diagnosis never takes the probe down: the old reason, with what went wrong
        return dev[0], {**dev[1], "cause": None, "diagnosis_error": f"{type(e).__name__}: {e}"[:500]}
    if found.cause is None:
        return dev[0], {**dev[1], **found.to_facts()}
    return found.cause[0], {**dev[1], **found.to_facts(), **found.cause[1]}


def _vulkan_verdict(list_devices: ListDevices) -> Verdict:
    """Vulkan's checks: the system loader, the backend loading from the bundle (a registered driver), a GPU
    listed (ggml-vulkan lists no CPU implementation)."""
    from ..backends.vulkan import loader_path

    if loader_path() is None:
        return Reason.VULKAN_LOADER_MISSING, {"detail": "libvulkan.so.1 is not installed"}
    dev = _device_of(list_devices, "vulkan", failed=Reason.VULKAN_UNAVAILABLE,
                     not_loaded=(Reason.VULKAN_UNAVAILABLE, {"detail": "no Vulkan driver (ICD) could be loaded: the "
                                                                       "backend says nothing in a release build"}),
                     no_device=(Reason.VULKAN_NO_GPU, {"detail": "only a CPU implementation, or no device, is registered"}))
    if not isinstance(dev, str):
        return dev
    name, _, desc = dev.partition(": ")
    return Reason.VULKAN_OK, {"device": name, "device_name": _MEMORY_SUFFIX.sub("", desc)}


def _device_of(list_devices: ListDevices, backend: str, *, failed: Reason, not_loaded: Verdict,
               no_device: Verdict) -> Verdict | str:
    """The first device line of `backend` in the bundle's --list-devices, or the verdict of why there is none:
    `failed` when the bundle did not start (with verify's words), `not_loaded`, `no_device`."""
    report = list_devices()
    if isinstance(report, VerifyError):
        return failed, {"detail": report.what + (f" ({report.why})" if report.why else ""), "output": report.details}
    if report.levels.get("load", "").startswith("skipped"):
        return failed, {"detail": report.levels["load"].removeprefix("skipped: ")}
    name = backends.get(backend).loader_name  # what the loader and --list-devices call it
    if name not in report.backends_loaded:
        return not_loaded
    dev = next((d for d in report.devices if d.startswith(name)), None)
    return dev if dev is not None else no_device


# ------------------------------------------------------------------------------------ why CUDA did not come up


@dataclass(frozen=True, kw_only=True)
class Machine:
    """Where a diagnosis looks: the environment nvidia-smi runs in, its timeout, this machine's library directories."""

    env: Mapping[str, str]
    smi_timeout: float
    lib_dirs: tuple[Path, ...] | None  # None: the directories `ldconfig -p` lists, then the ELF policy's


@dataclass(frozen=True, kw_only=True)
class Diagnosis:
    """What diagnose_cuda found: the cause's verdict (None: none found), what each check saw, what it could not."""

    cause: Verdict | None
    evidence: dict[str, Any]
    errors: tuple[str, ...]

    def to_facts(self) -> dict[str, Any]:
        facts: dict[str, Any] = {"cause": None, "diagnosis": {**self.evidence, "errors": list(self.errors)}}
        if self.cause is None and self.errors:
            facts["diagnosis_error"] = "; ".join(self.errors)[:500]
        return facts


class _Look:
    """One diagnosis's view of the bundle and the machine; nvidia-smi is asked each question once, when needed."""

    def __init__(self, root: Path, manifest: Manifest, scan: GpuScan, machine: Machine) -> None:
        self.root, self.manifest, self.scan, self.machine = root, manifest, scan, machine
        self.evidence: dict[str, Any] = {}
        self.errors: list[str] = []
        self._asked: dict[tuple[str, ...], str | None] = {}

    @property
    def toolkit(self) -> str | None:
        info = cuda_section.read(self.manifest)
        return info.toolkit if info is not None and info.toolkit else None

    def smi(self, args: tuple[str, ...], what: str) -> str | None:
        """nvidia-smi's stdout for `args` (its timeout, its own process group), or None with the reason in errors."""
        if args not in self._asked:
            out: str | None = None
            if self.scan.nvidia_smi is None:
                self.errors.append(f"{what}: nvidia-smi is not on PATH")
            else:
                try:
                    done = proc.capture([self.scan.nvidia_smi, *args], env=self.machine.env, timeout=self.machine.smi_timeout)
                except proc.Timeout:
                    self.errors.append(f"{what}: nvidia-smi did not answer in {self.machine.smi_timeout:g}s")
                except OSError as e:
                    self.errors.append(f"{what}: nvidia-smi could not be started: {e}")
                else:
                    if done.returncode == 0:
                        out = done.stdout
                    else:
                        last = ((done.stdout + done.stderr).strip().splitlines()[-1:] or [""])[0].strip()
                        self.errors.append(f"{what}: nvidia-smi {' '.join(args)} exited with {done.returncode}: {last[:200]}")
            self._asked[args] = out
        return self._asked[args]

    def compute_caps(self) -> list[tuple[int, int]] | None:
        """Each listed GPU's compute capability (nvidia-smi --query-gpu=compute_cap), or None when not known."""
        if "compute_caps" not in self.evidence:
            text = self.smi(COMPUTE_CAP_ARGS, "compute capability")
            ccs: list[tuple[int, int]] | None = None
            if text is not None:
                lines = [ln.strip() for ln in text.splitlines() if ln.strip()][:MAX_OUTPUT_LINES]
                matches = [_COMPUTE_CAP.fullmatch(ln) for ln in lines]
                if lines and all(matches):
                    ccs = [(int(m[1]), int(m[2])) for m in matches if m]
                else:
                    bad = next((ln for ln, m in zip(lines, matches, strict=True) if not m), "")
                    self.errors.append("compute capability: nvidia-smi's answer is not a compute capability like 8.6"
                                       + (f" ({bad[:100]!r})" if bad else " (it printed nothing)"))
            self.evidence["compute_caps"] = [f"{a}.{b}" for a, b in ccs] if ccs is not None else None
        caps = self.evidence["compute_caps"]
        return [(int(c.split(".")[0]), int(c.split(".")[1])) for c in caps] if caps is not None else None

    def driver_cuda(self) -> tuple[int, int] | None:
        """The newest CUDA the driver runs, from nvidia-smi's header (`CUDA Version: 12.8`), or None."""
        if "driver_cuda" not in self.evidence:
            text = self.smi((), "the driver's CUDA version")
            m = _SMI_CUDA.search(text) if text is not None else None
            if text is not None and m is None:
                self.errors.append("the driver's CUDA version: nvidia-smi's header names no 'CUDA Version'")
            self.evidence["driver_cuda"] = f"{m[1]}.{m[2]}" if m else None
        got = self.evidence["driver_cuda"]
        return (int(got.split(".")[0]), int(got.split(".")[1])) if got else None

    def toolkit_floors(self) -> tuple[str | None, str | None]:
        """(the driver floor data/cuda.json gives the bundle's toolkit on its OS, the lowest floor of a release with
        the same major.minor, whose PTX ISA is the same) — None where the toolkit is not in the data."""
        toolkit = self.toolkit
        if toolkit is None:
            return None, None
        os_name = platforms.get(self.manifest.platform).system
        toolkits = data.cuda_toolkits()
        exact = toolkits.get(toolkit, {}).get("driver_floor", {}).get(os_name)
        same = [info["driver_floor"][os_name] for v, info in toolkits.items()
                if _major_minor(v) == _major_minor(toolkit) and os_name in info.get("driver_floor", {})]
        lowest = min(same, key=lambda f: tuple(int(x) for x in re.findall(r"[0-9]+", f)), default=None)
        return exact, lowest


def _major_minor(version: str) -> tuple[int, int] | None:
    nums = re.findall(r"[0-9]+", version)
    return (int(nums[0]), int(nums[1])) if len(nums) >= 2 else None


ALL_CHECKS = ("libraries", "archs", "ptx", "driver")
KERNEL_CHECKS = ("archs", "ptx")  # a GPU that no SASS or PTX serves, PTX the driver cannot JIT: listed, yet no kernel runs


def diagnose_cuda(root: Path, manifest: Manifest, scan: GpuScan, *, machine: Machine,
                  checks: Sequence[str] = ALL_CHECKS) -> Diagnosis:
    """Why the bundle's CUDA backend did not load or listed no device, in order: a library of ggml-cuda's static
    import closure that neither the bundle nor this machine has (the bundle's own, then the driver's), the GPUs'
    compute capability served by neither SASS nor PTX, PTX as their only code with a driver too old to JIT it,
    the driver too old for the bundle's toolkit. A check that cannot be made says why; none raises. `checks`
    names the ones to make (KERNEL_CHECKS: those that still apply when the device was listed)."""
    look = _Look(root, manifest, scan, machine)
    table = {"libraries": _library_cause, "archs": _arch_cause, "ptx": _ptx_cause, "driver": _driver_cause}
    for name, check in ((n, table[n]) for n in checks):
        try:
            cause = check(look)
        except Exception as e:  # one check that fails leaves the others to run
            look.errors.append(f"{name}: {type(e).__name__}: {e}"[:300])
            continue
        if cause is not None:
            return Diagnosis(cause=cause, evidence=look.evidence, errors=tuple(look.errors))
    return Diagnosis(cause=None, evidence=look.evidence, errors=tuple(look.errors))


def _library_cause(look: _Look) -> Verdict | None:
    """ggml-cuda's DT_NEEDED closure against the bundle directory and this machine's library directories (the
    loader's view with the clean environment verify runs llama-server in): a library found nowhere, or a
    driver library (libcuda.so.1, never bundled) this machine lacks."""
    from ..deps.elf import ElfInfo, is_elf, ldconfig_cache, read_elf, resolve_closure, system_library_dirs
    from ..deps.policy import linux_policy

    lib_name = platforms.get(look.manifest.platform).library_file("ggml-cuda")
    lib = look.root / lib_name
    if not lib.is_file():
        look.evidence["libraries"] = f"{lib_name} is not in the bundle"
        return _library_verdict(Reason.CUDA_LIBRARY_MISSING, lib_name, ["llama-server (ggml's backend loader)"],
                                searched=[str(look.root)])
    if not is_elf(lib):
        look.evidence["libraries"] = f"not checked: {lib_name} is not an ELF file (the PE closure is not checked here)"
        look.errors.append(f"libraries: {lib_name} is not an ELF file")
        return None
    policy = linux_policy()
    dirs = list(look.machine.lib_dirs) if look.machine.lib_dirs is not None else \
        system_library_dirs(policy, ldconfig_output=ldconfig_cache())
    closure = resolve_closure([lib], products=[look.root], policy=policy, system_dirs=dirs)
    searched = [str(look.root), *map(str, dirs)]
    if closure.missing:
        name, by = next(iter(closure.missing.items()))
        look.evidence["libraries"] = {"missing": {k: list(v) for k, v in closure.missing.items()}}
        return _library_verdict(Reason.CUDA_LIBRARY_MISSING, name, list(by), searched=searched,
                                also=[k for k in closure.missing if k != name])
    root_info: ElfInfo = read_elf(lib)

    def present(name: str) -> bool:
        for d in dirs:
            cand = d / name
            if cand.is_file() and is_elf(cand):
                try:
                    info = read_elf(cand.resolve())
                except VerifyError:
                    continue
                if (info.machine, info.elfclass) == (root_info.machine, root_info.elfclass):
                    return True
        return False

    absent = [d for d in closure.driver if not present(d)]
    look.evidence["libraries"] = {"bundled": sorted(closure.bundled), "driver": list(closure.driver),
                                  "driver_absent": absent, "searched": searched}
    if absent:
        return _library_verdict(Reason.CUDA_DRIVER_LIBRARY_MISSING, absent[0], list(closure.needed_by.get(absent[0], ())),
                                searched=[str(d) for d in dirs], also=absent[1:])
    return None


def _library_verdict(reason: Reason, name: str, by: list[str], *, searched: list[str], also: list[str] | None = None) -> Verdict:
    cause = {"code": reason.value, "library": name, "needed_by": by, "searched": searched, "also_missing": also or []}
    return reason, {"library": name, "needed_by": ", ".join(by) or "?", "cause": cause}


def _archs_of(look: _Look) -> tuple[list[str], list[str]] | None:
    cuda = cuda_section.read(look.manifest)
    if cuda is None or not (cuda.sass or cuda.ptx):
        look.errors.append("archs: bundle.json records no CUDA archs")
        return None
    return list(cuda.sass), list(cuda.ptx)


def _arch_facts(look: _Look, ccs: list[tuple[int, int]], sass: list[str], ptx: list[str]) -> dict[str, Any]:
    from ..backends.cuda.report import arch_fix

    shown = ", ".join(dict.fromkeys(f"{a}.{b}" for a, b in ccs))
    fixes = "; ".join(dict.fromkeys(arch_fix(cc, look.toolkit or "?") for cc in ccs))
    return {"compute_cap": shown, "bundle_sass": ", ".join(sass) or "none", "bundle_ptx": ", ".join(ptx) or "none",
            "arch_fix": fixes}


def _arch_cause(look: _Look) -> Verdict | None:
    """No listed GPU has SASS or PTX in the bundle that runs on it (the rules of backends.cuda.report)."""
    from ..backends.cuda.report import Status, serving

    archs = _archs_of(look)
    ccs = look.compute_caps()
    if archs is None or not ccs:
        return None
    sass, ptx = archs
    served = {f"{a}.{b}": serving((a, b), sass=sass, ptx=ptx) for a, b in ccs}
    look.evidence["served"] = {cc: {"status": str(s), "via": via} for cc, (s, via) in served.items()}
    if any(s is not Status.UNSUPPORTED for s, _via in served.values()):
        return None
    more = _arch_facts(look, ccs, sass, ptx)
    cause = {"code": Reason.CUDA_ARCH_UNSUPPORTED.value, "compute_cap": list(served), "sass": sass, "ptx": ptx,
             "toolkit": look.toolkit}
    return Reason.CUDA_ARCH_UNSUPPORTED, {**more, "cause": cause}


def _ptx_cause(look: _Look) -> Verdict | None:
    """No GPU has SASS, one runs PTX through the JIT, and the driver cannot JIT the PTX of the bundle's toolkit: it
    supports an older CUDA (nvidia-smi's header), or, without that header, it is older than every driver of
    that toolkit's major.minor in data/cuda.json."""
    from ..backends.cuda.report import Status, serving

    archs = _archs_of(look)
    ccs = look.compute_caps()
    toolkit = look.toolkit
    if archs is None or not ccs or toolkit is None or _major_minor(toolkit) is None:
        return None
    sass, ptx = archs
    served = [(cc, *serving(cc, sass=sass, ptx=ptx)) for cc in ccs]
    if any(s is Status.SASS for _cc, s, _via in served):
        return None
    jit = [(cc, via) for cc, s, via in served if s is Status.PTX_JIT]
    if not jit:
        return None
    too_old = _driver_behind(look, toolkit, for_ptx=True)
    if too_old is None:
        return None
    evidence, basis, floor = too_old
    more = _arch_facts(look, [cc for cc, _via in jit], sass, ptx)
    via = ", ".join(dict.fromkeys(v for _cc, v in jit if v))
    cause = {"code": Reason.CUDA_PTX_TOO_NEW.value, "compute_cap": [f"{a}.{b}" for (a, b), _v in jit], "ptx": via,
             "toolkit": toolkit, "driver": look.scan.driver, "driver_cuda": look.evidence.get("driver_cuda"),
             "basis": basis, "toolkit_floor": floor}
    return Reason.CUDA_PTX_TOO_NEW, {**more, "ptx_via": via, "toolkit": toolkit, "toolkit_floor": floor or "?",
                                     "driver_evidence": evidence, "cause": cause}


def _driver_behind(look: _Look, toolkit: str, *, for_ptx: bool) -> tuple[str, str, str | None] | None:
    """(words, basis, floor) when the driver is behind `toolkit`, else None. With nvidia-smi's header: its CUDA
    version below the toolkit's major.minor (PTX) or major (the runtime, by minor-version compatibility);
    without it: the driver older than data/cuda.json's floor (PTX: the lowest of the same major.minor)."""
    exact, lowest = look.toolkit_floors()
    floor = lowest if for_ptx else exact
    need = _major_minor(toolkit)
    assert need is not None
    have = look.driver_cuda()
    if have is not None:
        behind = have < need if for_ptx else have[0] < need[0]
        return (f"it supports CUDA {have[0]}.{have[1]}", "nvidia-smi: CUDA Version", floor) if behind else None
    driver = look.scan.driver
    if floor is None or driver is None or not is_driver_version(driver):
        look.errors.append(f"driver: CUDA {toolkit}'s driver floor is not in data/cuda.json" if floor is None
                           else "driver: the driver version is not known")
        return None
    if not driver_older(driver, floor):
        return None
    what = (f"the oldest driver data/cuda.json gives for CUDA {need[0]}.{need[1]}" if for_ptx else
            f"the driver of CUDA {toolkit}'s installer in data/cuda.json")
    return f"it is older than {floor}, {what}", "data/cuda.json driver floor", floor


def _driver_cause(look: _Look) -> Verdict | None:
    """The driver is too old for the bundle's CUDA runtime. Below the floor bundle.json records is driver_too_old,
    decided before the bundle runs; here: when bundle.json records no floor, below the toolkit's floor in
    data/cuda.json (or nvidia-smi's older CUDA major); with a floor it meets, nvidia-smi saying it runs an older
    CUDA major than the toolkit's (a floor recorded too low)."""
    toolkit, driver = look.toolkit, look.scan.driver
    if toolkit is None or _major_minor(toolkit) is None:
        return None
    info = cuda_section.read(look.manifest)
    recorded = info.driver_floor if info is not None else None
    if recorded:  # the bundle's own floor is met: only the driver's CUDA version can still say it is behind
        have = look.driver_cuda()
        need = _major_minor(toolkit)
        if have is None or need is None or have[0] >= need[0]:
            return None
        found: tuple[str, str, str | None] | None = (f"it supports CUDA {have[0]}.{have[1]}", "nvidia-smi: CUDA Version",
                                                     look.toolkit_floors()[0])
    else:
        found = _driver_behind(look, toolkit, for_ptx=False)
    if found is None:
        return None
    evidence, basis, floor = found
    if not recorded:
        evidence += "; the bundle records no driver floor"
    cause = {"code": Reason.CUDA_DRIVER_TOO_OLD_FOR_TOOLKIT.value, "driver": driver, "toolkit": toolkit,
             "driver_cuda": look.evidence.get("driver_cuda"), "toolkit_floor": floor, "basis": basis}
    return Reason.CUDA_DRIVER_TOO_OLD_FOR_TOOLKIT, {"toolkit": toolkit, "toolkit_floor": floor or "?",
                                                   "driver_evidence": evidence, "cause": cause}


# ------------------------------------------------------------------------------------ cache + tokens


def _lock(cache_dir: Path) -> FileLock:
    cache_dir.mkdir(parents=True, exist_ok=True)
    return FileLock(str(cache_dir / "probe.lock"), timeout=60)


def take_token(cache_dir: Path) -> int:
    """The next probe token: strictly greater than every token taken before, across processes."""
    with _lock(cache_dir):
        try:
            last = int((cache_dir / TOKEN).read_text(encoding="utf-8"))
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
                   expect_sha256: str | None = None, digests: DigestList | None = None,
                   **probe_kw: Any) -> ProbeResult:
    """Probe; on binary_missing_nvidia_detected (the only reason that installs) install `key` from `store`
    (its zip pinned by `expect_sha256` or `digests`, as install_bundle pins it) and probe again. Any other
    reason, or a failed install (a zip the pin refuses: bundle_invalid), is CPU with that reason."""
    first = probe(root=root, env=env, cache_dir=cache_dir, **probe_kw)
    if first.reason is not Reason.BINARY_MISSING_NVIDIA_DETECTED or store is None or key is None:
        return first
    try:
        install_bundle(store, key, root=root, log=log, commit=commit, toolkit=toolkit, expect_sha256=expect_sha256,
                       digests=digests)
    except LlamaBundleError as e:
        reason = Reason.BUNDLE_INVALID if getattr(e, "reason", None) is Reason.BUNDLE_INVALID else Reason.CUDA_BUNDLE_INSTALL_FAILED
        facts = {**first.facts, "detail": e.what, "install_error": e.render()}
        result = ProbeResult.make(reason, facts, token=first.token, probed_at=first.probed_at)
        if cache_dir is not None:
            store_result(cache_dir, result)
        return result
    return probe(root=root, env=env, cache_dir=cache_dir, **{**probe_kw, "max_age": 0.0})
