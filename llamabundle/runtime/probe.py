"""Which backend will run, and why (DESIGN §8): NVIDIA GPU and driver, the driver against the bundle's floor,
and the installed bundle's own `llama-server --verbose --list-devices`. One reason code per result. A bundle
with several GPU backends (CPU + CUDA + Vulkan) runs CUDA on NVIDIA when its checks pass, else Vulkan when it
lists a GPU, else the CPU (an explicit preference is honoured where that backend works); the result names
why the others were not chosen, the GPUs seen (one physical GPU once), and the llama-server flags.

What nvidia-smi and the kernel driver's version file say is checked before it is believed: a driver version
is 2-4 dot-separated numbers (580.65.06, 572.61), a memory size a whole number of MiB (or [N/A]), a name is
there; a line that fails is not a GPU, and the scan says what it could not read. nvidia-smi runs through
proc.capture, in a process group of its own: on its timeout it ends with whatever it started.

Results are cached as JSON with a TTL. Each probe takes a token (a counter under a file lock) when it starts
and writes its result only if no probe with a newer token has written already: an older probe that
finishes last never overwrites a newer result."""

from __future__ import annotations

import json
import re
import shutil
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from filelock import FileLock
from packaging.version import InvalidVersion, Version

from .. import backends, platforms, proc
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
from .install import Installed, install_bundle, list_installed

NVIDIA_SMI_ARGS = ("--query-gpu=name,driver_version,memory.total,memory.free", "--format=csv,noheader,nounits")
PROC_VERSION = Path("/proc/driver/nvidia/version")
SMI_TIMEOUT = 15.0
DEFAULT_TTL = 300.0
CACHE = "probe.json"
TOKEN = "probe.token"
# ASCII digits only (\d would take other scripts' digits too)
_PROC_DRIVER = re.compile(r"NVRM version:[^\n]*?\s([0-9]+(?:\.[0-9]+)+)(?=\s|\Z)")  # the line's first dotted number
_DRIVER_VERSION = re.compile(r"[0-9]{1,5}(?:\.[0-9]{1,5}){1,3}")  # 580.65.06, 572.61, 580.159.04
_MIB = re.compile(r"[0-9]{1,9}")  # nounits: whole MiB
_NOT_AVAILABLE = re.compile(r"\[[^\]]{0,40}\]|N/A")  # [N/A], [Not Supported], [Insufficient Permissions]
_MEMORY_SUFFIX = re.compile(r"\s*\([^()]*MiB[^()]*\)\s*$")  # a --list-devices line's "(143155 MiB, 142629 MiB free)"
MAX_OUTPUT_LINES = 64  # GPUs per host nvidia-smi may list; more is not a GPU list


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
          smi_timeout: float = SMI_TIMEOUT, prefer: str | None = None) -> ProbeResult:
    """Probe now, or return the cached result when it is younger than max_age and about the same bundle (and
    preference). `bundle` is an unpacked bundle directory to probe instead of the installed one; `prefer`
    (cuda, vulkan, cpu) is honoured when that backend works here."""
    target: tuple[Path, Manifest] | None
    if bundle is not None:
        target = (bundle.resolve(), read_manifest(bundle))
    else:  # NVIDIA's driver, cheaply (nvidia-smi runs after the token is taken): its CUDA bundle first
        nvidia = bool(proc_version is not None and proc_version.exists()) or \
            bool(nvidia_smi or shutil.which("nvidia-smi", path=env.get("PATH")))
        inst = gpu_candidate(root, nvidia=nvidia)
        target = (inst.path, inst.manifest) if inst is not None else None
    context = {"bundle_dir": str(target[0]) if target else None, "bundle_key": target[1].key if target else None,
               "prefer": prefer}
    if cache_dir is not None and max_age > 0:
        last = read_cached(cache_dir)
        if last is not None and 0 <= time.time() - last.probed_at < max_age and \
                {k: last.facts.get(k) for k in context} == context:
            return replace(last, cached=True)
    token = take_token(cache_dir) if cache_dir is not None else 0
    scan = scan_gpus(env=env, nvidia_smi=nvidia_smi, proc_version=proc_version, timeout=smi_timeout)
    result = _probe_now(target, context, scan=scan, token=token, started=int(time.time()), prefer=prefer,
                        wine_prefix=cache_dir / "wine" if cache_dir is not None else None)
    if cache_dir is not None:
        store_result(cache_dir, result)
    return result


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
               started: int, wine_prefix: Path | None, prefer: str | None = None) -> ProbeResult:
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

    cuda = _cuda_verdict(manifest, scan, facts, list_devices) if "cuda" in gpu_backends else None
    vulkan = _vulkan_verdict(list_devices) if "vulkan" in gpu_backends else None
    if prefer == "cpu":
        working = next((v for v in (cuda, vulkan) if v is not None and v[0] in (Reason.OK, Reason.VULKAN_OK)), None)
        return done(Reason.CPU_PREFERRED, device=(working[1].get("device") or working[1].get("cuda_device")) if working
                    else "none works here", **(working[1] if working else {}))
    if vulkan is not None and vulkan[0] is Reason.VULKAN_OK and (prefer == "vulkan" or cuda is None or cuda[0] is not Reason.OK):
        not_cuda = ("Vulkan was asked for" if prefer == "vulkan" and cuda is not None and cuda[0] is Reason.OK else
                    "the bundle has no CUDA backend" if cuda is None else
                    f"CUDA is not used: {explain(cuda[0], {**facts, **cuda[1]})[0]}")
        return done(Reason.VULKAN_OK, not_cuda=not_cuda, cuda_reason=cuda[0].value if cuda else None, **vulkan[1])
    if cuda is not None and (cuda[0] is not Reason.GPU_MISSING or vulkan is None):
        return done(cuda[0], vulkan_reason=vulkan[0].value if vulkan else None, **cuda[1],
                    **({"vulkan_detail": vulkan[1].get("detail")} if vulkan else {}))
    assert vulkan is not None
    return done(vulkan[0], cuda_reason=cuda[0].value if cuda else None, **vulkan[1])


Verdict = tuple[Reason, dict[str, Any]]
ListDevices = Callable[[], "VerifyReport | VerifyError"]


def _cuda_verdict(manifest: Manifest, scan: GpuScan, facts: dict[str, Any], list_devices: ListDevices) -> Verdict:
    """CUDA's checks, in order: an NVIDIA GPU, the driver against the bundle's floor, the backend loading
    from the bundle and listing its device."""
    if not scan.present:
        return Reason.GPU_MISSING, {"detail": scan.error or "no NVIDIA driver found"}
    floor = manifest.cuda.driver_floor if manifest.cuda is not None else None
    facts.update(floor=floor)
    if floor and not is_driver_version(floor):
        return Reason.BUNDLE_INVALID, {"detail": f"its bundle.json records the driver floor {floor[:40]!r}, "
                                                 "which is not a driver version"}
    if floor and scan.driver and driver_older(scan.driver, floor):
        return Reason.DRIVER_TOO_OLD, {}
    dev = _device_of(list_devices, "cuda", failed=Reason.CUDA_STARTUP_FAILED,
                     not_loaded=(Reason.CUDA_UNAVAILABLE, {"detail": "the CUDA backend did not load"}),
                     no_device=(Reason.CUDA_UNAVAILABLE, {"detail": "the CUDA backend loaded but listed no device"}))
    if not isinstance(dev, str):
        return dev
    return Reason.OK, {"cuda_device": dev.split(":", 1)[0]}


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
