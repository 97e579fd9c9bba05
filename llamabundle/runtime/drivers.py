"""Which GPU backends this machine could run, asked of its GPU drivers themselves: a bundle's own
`llamabundle-probe --drivers` (data/programs/llamabundle-probe.cpp) opens the NVIDIA driver (libcuda.so.1,
nvcuda.dll) and the Vulkan loader (libvulkan.so.1, vulkan-1.dll) without any ggml backend module, so a partial
install that holds only the CPU part of a bundle learns which GPU part is worth fetching.

The program runs as the load check runs a bundle (platforms/load.py): in a clean environment that keeps only
the variables the drivers' lookup reads, in a process group of its own, within a timeout. Its answer is
untrusted input: bounded in size and depth, then checked field by field as
data/schemas/llamabundle-probe.schema.json says for `--drivers` (a test holds the two together). A program
that cannot start, hangs, fails or prints anything else is a DriversError, never a traceback."""

from __future__ import annotations

import re
import signal
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .. import backends, data, proc, untrusted
from ..errors import VerifyError
from ..platforms import load

PROBE_PROGRAM = data.PROBE_PROGRAM
QUERY_TIMEOUT = 30.0  # seconds: cuInit of a healthy driver takes well under one
MAX_OUTPUT = 1 << 20  # bytes: a real answer is about 300 bytes a device, and lists at most 64 of each
MAX_DEPTH = 8  # the answer nests 5 levels
# What the drivers' lookup reads of the caller's environment: CUDA's device selection and order, and the
# Vulkan loader's driver (ICD) lookup (data/vulkan.json passthrough_env).
DRIVER_ENV: tuple[str, ...] = ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", *backends.get("vulkan").run_env)
VULKAN_TYPES = ("other", "integrated_gpu", "discrete_gpu", "virtual_gpu", "cpu")
_VERSION = re.compile(r"[0-9]+\.[0-9]+")
_API_VERSION = re.compile(r"[0-9]+\.[0-9]+\.[0-9]+")
_BUS_ID = re.compile(r"[0-9a-f]{4,}:[0-9a-f]{2,}:[0-9a-f]{2,}\.0")
FIX = "install the bundle again: its llamabundle-probe is missing or damaged"


class DriversError(VerifyError):
    """llamabundle-probe --drivers gave no answer llamabundle can read: it could not be started, ran past its
    timeout, exited with an error (a driver crashed it) or printed something other than its one JSON object."""


@dataclass(frozen=True, kw_only=True)
class Library:
    """One driver library as the program found it."""
    library: str  # the name asked of the platform's loader: libcuda.so.1, nvcuda.dll, libvulkan.so.1, vulkan-1.dll
    opened: bool
    error: str | None  # the loader's message when it did not open (dlerror; Windows' system message)
    path: str | None  # the file the loader opened, where it says
    missing: tuple[str, ...]  # the functions the program needs that the library lacks
    problems: tuple[str, ...]  # calls that failed once it opened, more devices than were listed


@dataclass(frozen=True, kw_only=True)
class CudaDevice:
    """A device as the NVIDIA driver describes it; a field it could not give is None."""
    index: int  # its ordinal: CUDA<index> to ggml-cuda where CUDA_VISIBLE_DEVICES hides none
    name: str | None  # e.g. NVIDIA H200
    compute_capability: str | None  # e.g. 9.0
    bus_id: str | None  # the PCI bus id as ggml gives it, e.g. 0000:00:06.0
    memory_total: int | None  # bytes


@dataclass(frozen=True, kw_only=True)
class VulkanDevice:
    """A physical device as the Vulkan loader lists it."""
    index: int
    name: str | None  # e.g. NVIDIA H200, llvmpipe (LLVM 15.0.6, 256 bits)
    type: str  # one of VULKAN_TYPES
    api_version: str  # e.g. 1.3.230
    vendor_id: int

    @property
    def gpu(self) -> bool:
        """Whether ggml-vulkan would run on it: it takes the discrete and integrated GPUs, else the first device
        that is not a CPU implementation (lavapipe is one: ggml-vulkan lists it only when told to)."""
        return self.type != "cpu"


@dataclass(frozen=True, kw_only=True)
class Drivers:
    """What the machine's GPU drivers said, from llamabundle-probe --drivers."""
    cuda: Library
    cuda_init: int | None  # cuInit's CUresult (0: success); None when it was not called
    cuda_init_error: str | None  # its name when it failed (CUDA_ERROR_NO_DEVICE), where the driver gives one
    cuda_driver_version: str | None  # the newest CUDA the driver runs, MAJOR.MINOR (e.g. 13.0)
    cuda_devices: tuple[CudaDevice, ...]
    vulkan: Library
    vulkan_instance: int | None  # vkCreateInstance's VkResult (0: success); None when it was not called
    vulkan_devices: tuple[VulkanDevice, ...]

    @property
    def cuda_not_opened(self) -> str | None:
        """The loader's message when the NVIDIA driver's library did not open (None: it opened)."""
        return None if self.cuda.opened else self.cuda.error or "it did not open"

    @property
    def vulkan_not_opened(self) -> str | None:
        """The loader's message when the Vulkan loader did not open (None: it opened)."""
        return None if self.vulkan.opened else self.vulkan.error or "it did not open"

    @property
    def gpu_backends(self) -> tuple[str, ...]:
        """The GPU backends that have a device to run on here, in probe's order of preference: cuda where the
        NVIDIA driver lists a device, vulkan where the Vulkan loader lists one that is not a CPU."""
        return tuple(b for b in ("cuda", "vulkan") if not self.why_not(b))

    def why_not(self, backend: str) -> str:
        """Why `backend` (cuda, vulkan) has no device here, in a few words; '' when it has one."""
        if backend == "cuda":
            lib = self.cuda
            if not lib.opened:
                return f"{lib.library} did not open: {self.cuda_not_opened}"
            if self.cuda_init is None:
                return f"{lib.library} lacks {', '.join(lib.missing) or 'cuInit'}"
            if self.cuda_init != 0:
                return f"cuInit returned {self.cuda_init}" + (f" ({self.cuda_init_error})" if self.cuda_init_error else "")
            return "" if self.cuda_devices else "the NVIDIA driver lists no device" + _problems(lib)
        if backend == "vulkan":
            lib = self.vulkan
            if not lib.opened:
                return f"{lib.library} did not open: {self.vulkan_not_opened}"
            if self.vulkan_instance is None:
                return f"{lib.library} lacks {', '.join(lib.missing) or 'vkCreateInstance'}"
            if self.vulkan_instance != 0:
                return f"vkCreateInstance returned {self.vulkan_instance}" + (
                    " (VK_ERROR_INCOMPATIBLE_DRIVER: no Vulkan driver)" if self.vulkan_instance == -9 else "")
            if any(d.gpu for d in self.vulkan_devices):
                return ""
            cpus = [d.name or "a CPU implementation" for d in self.vulkan_devices]
            return ("the Vulkan loader lists only CPU implementations: " + ", ".join(cpus) if cpus
                    else "the Vulkan loader lists no device" + _problems(lib))
        raise ValueError(f"not a GPU backend llamabundle-probe asks about: {backend!r}")


def _problems(lib: Library) -> str:
    return f" ({'; '.join(lib.problems)})" if lib.problems else ""


def query(program: Path, *, env: Mapping[str, str] | None = None, timeout: float = QUERY_TIMEOUT) -> Drivers:
    """`program --drivers` (a bundle's llamabundle-probe) run in the clean environment of its directory
    (load.clean_env) that keeps `env`, the variables the drivers' lookup reads (default: DRIVER_ENV as this
    process has them), in a process group of its own ended after `timeout` seconds; its answer read."""
    keep = dict(proc.inherited(DRIVER_ENV) if env is None else env)
    what = f"{program} --drivers"
    try:
        out = proc.capture([str(program), "--drivers"], cwd=program.parent,
                           env=load.clean_env(program.parent, keep), timeout=timeout)
    except proc.Timeout as e:
        raise DriversError(f"{what} did not finish in {timeout:g}s", why="a GPU driver did not answer (a hung "
                           "driver, or a GPU in a bad state)", details=_tail(e.stderr),
                           fix="check the GPU driver (nvidia-smi; vulkaninfo --summary), then retry") from None
    except OSError as e:
        raise DriversError(f"{program} could not be started", why=str(e), fix=FIX) from None
    if out.returncode != 0:
        killed = -out.returncode if out.returncode < 0 else None
        why = (f"it was killed by {_signal_name(killed)}: a GPU driver it opened crashed it" if killed
               else "it does not know --drivers (its bundle was built before llamabundle-probe had it)" if out.returncode == 2
               else "it gave no answer")
        raise DriversError(f"{what} exited with {out.returncode}", why=why, details=_tail(out.stderr),
                           fix="check the GPU driver (nvidia-smi; vulkaninfo --summary)" if killed else FIX)
    return parse(out.stdout, program=str(program))


def parse(stdout: str | bytes, *, program: str = PROBE_PROGRAM) -> Drivers:
    """The answer `program` printed for --drivers, read as untrusted input: DriversError unless it is one JSON
    object of at most MAX_OUTPUT bytes that the schema accepts for --drivers."""
    raw = stdout if isinstance(stdout, bytes) else stdout.encode("utf-8", "surrogatepass")
    try:
        said = untrusted.loads(raw, max_bytes=MAX_OUTPUT, max_depth=MAX_DEPTH)
    except ValueError as e:
        raise DriversError(f"{program} --drivers printed no JSON", why=str(e)[:300],
                           details=f"it printed {untrusted.preview(raw)}", fix=FIX) from None
    if why := problem(said):
        raise DriversError(f"{program} --drivers printed an answer llamabundle cannot read", why=why,
                           details=f"it printed {untrusted.preview(raw)}", fix=FIX)
    return _read(said)


_LIBRARY = {"library": str, "opened": bool, "error": (str, None), "path": (str, None), "missing": list,
            "problems": list}
_CUDA = {**_LIBRARY, "init": (int, None), "init_error": (str, None), "driver_version": (int, None),
         "cuda_version": (str, None), "device_count": (int, None), "devices": list}
_VULKAN = {**_LIBRARY, "create_instance": (int, None), "device_count": (int, None), "devices": list}
_CUDA_DEVICE = {"index": int, "name": (str, None), "compute_capability": (str, None), "device_id": (str, None),
                "memory_total": (int, None)}
_VULKAN_DEVICE = {"index": int, "name": (str, None), "type": str, "api_version": str, "vendor_id": int}
MAX_DEVICES = 64  # the program lists at most this many of each driver


def problem(said: Any) -> str:
    """What is wrong with an answer of llamabundle-probe --drivers ('' when nothing is): each field there, of
    its type, with no other, as the schema says."""
    def wrong(obj: Any, fields: Mapping[str, Any], where: str) -> str:
        return untrusted.misfit(obj, fields, where, closed=True)

    def strings(items: list[Any], where: str) -> str:
        return next((f"{where}[{i}] is {s!r:.60}" for i, s in enumerate(items) if not isinstance(s, str)), "")

    def shaped(value: str | None, pattern: re.Pattern[str], where: str) -> str:
        return f"{where} is {value!r:.60}" if value is not None and not pattern.fullmatch(value) else ""

    if not isinstance(said, dict) or said.get("program") != PROBE_PROGRAM:
        return f"not a {PROBE_PROGRAM} answer"
    if said.get("mode") != "drivers":
        return f"not the answer to --drivers (mode is {said.get('mode', 'missing')!r:.60})"
    if why := wrong(said, {"schema": int, "program": str, "mode": str, "drivers": dict}, "the answer"):
        return why
    if said["schema"] != 1:
        return f"schema {said['schema']}, not 1"
    if why := wrong(said["drivers"], {"cuda": dict, "vulkan": dict}, "drivers"):
        return why
    for name, fields, device_fields in (("cuda", _CUDA, _CUDA_DEVICE), ("vulkan", _VULKAN, _VULKAN_DEVICE)):
        lib, where = said["drivers"][name], f"drivers.{name}"
        if why := (wrong(lib, fields, where) or strings(lib["missing"], f"{where}.missing")
                   or strings(lib["problems"], f"{where}.problems")):
            return why
        if len(lib["devices"]) > MAX_DEVICES:
            return f"{where} lists {len(lib['devices'])} devices, more than {MAX_DEVICES}"
        for i, d in enumerate(lib["devices"]):
            at = f"{where}.devices[{i}]"
            if why := wrong(d, device_fields, at):
                return why
            if d["index"] < 0:
                return f"{at}.index is {d['index']}"
            if name == "cuda" and (why := shaped(d["compute_capability"], _VERSION, f"{at}.compute_capability")
                                   or shaped(d["device_id"], _BUS_ID, f"{at}.device_id")
                                   or (f"{at}.memory_total is {d['memory_total']}" if (d["memory_total"] or 0) < 0 else "")):
                return why
            if name == "vulkan" and (why := ("" if d["type"] in VULKAN_TYPES else f"{at}.type is {d['type']!r:.60}")
                                     or shaped(d["api_version"], _API_VERSION, f"{at}.api_version")
                                     or (f"{at}.vendor_id is {d['vendor_id']}" if d["vendor_id"] < 0 else "")):
                return why
    cuda, vulkan = said["drivers"]["cuda"], said["drivers"]["vulkan"]
    if why := shaped(cuda["cuda_version"], _VERSION, "drivers.cuda.cuda_version"):
        return why
    if (vulkan["device_count"] or 0) < 0:
        return f"drivers.vulkan.device_count is {vulkan['device_count']}"
    return ""


def _read(said: Mapping[str, Any]) -> Drivers:
    """A checked answer (problem() says nothing) as Drivers."""
    cuda, vulkan = said["drivers"]["cuda"], said["drivers"]["vulkan"]

    def library(lib: Mapping[str, Any]) -> Library:
        return Library(library=lib["library"], opened=lib["opened"], error=lib["error"], path=lib["path"],
                       missing=tuple(lib["missing"]), problems=tuple(lib["problems"]))

    return Drivers(
        cuda=library(cuda), cuda_init=cuda["init"], cuda_init_error=cuda["init_error"],
        cuda_driver_version=cuda["cuda_version"],
        cuda_devices=tuple(CudaDevice(index=d["index"], name=d["name"], compute_capability=d["compute_capability"],
                                      bus_id=d["device_id"], memory_total=d["memory_total"]) for d in cuda["devices"]),
        vulkan=library(vulkan), vulkan_instance=vulkan["create_instance"],
        vulkan_devices=tuple(VulkanDevice(index=d["index"], name=d["name"], type=d["type"],
                                          api_version=d["api_version"], vendor_id=d["vendor_id"])
                             for d in vulkan["devices"]))


def _tail(text: Any) -> str:
    """The last 20 lines a program wrote on stderr (what its drivers said)."""
    if isinstance(text, bytes):
        text = text.decode("utf-8", "replace")
    return "\n".join(str(text or "").strip().splitlines()[-20:])


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"
