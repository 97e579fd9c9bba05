"""The one reader of NVIDIA's nvidia-smi and of the kernel driver's version file, for probe, plan and telemetry.

nvidia-smi runs through proc.capture with a timeout, in a process group of its own (on the timeout it ends
with whatever it started), and nothing it prints is believed unchecked: a driver version is 2-4 dot-separated
numbers (580.65.06, 572.61), a memory size a whole number of MiB (or [N/A]), a name printable text; a line
that fails is not a GPU, and the reader says what it could not read. Nothing here raises for what it finds."""

from __future__ import annotations

import re
import shutil
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from packaging.version import InvalidVersion, Version

from . import proc

SMI_TIMEOUT = 15.0
PROC_VERSION = Path("/proc/driver/nvidia/version")
MAX_OUTPUT_LINES = 64  # GPUs per host nvidia-smi may list; more is not a GPU list
SCAN_ARGS = ("--query-gpu=name,driver_version,memory.total,memory.free", "--format=csv,noheader,nounits")
COMPUTE_CAP_ARGS = ("--query-gpu=compute_cap", "--format=csv,noheader")
MEMORY_ARGS = ("--query-gpu=index,memory.free,memory.total", "--format=csv,noheader,nounits")
STATS_ARGS = ("--query-gpu=index,name,driver_version,utilization.gpu,memory.used,memory.total",
              "--format=csv,noheader,nounits")
HEADER_ARGS = ()  # plain `nvidia-smi`: its header names the newest CUDA the driver runs
MiB = 1 << 20

# ASCII digits only (\d would take other scripts' digits too)
_PROC_DRIVER = re.compile(r"NVRM version:[^\n]*?\s([0-9]+(?:\.[0-9]+)+)(?=\s|\Z)")  # the line's first dotted number
_DRIVER_VERSION = re.compile(r"[0-9]{1,5}(?:\.[0-9]{1,5}){1,3}")  # 580.65.06, 572.61, 580.159.04
_MIB = re.compile(r"[0-9]{1,9}")  # nounits: whole MiB
_NOT_AVAILABLE = re.compile(r"\[[^\]]{0,40}\]|N/A")  # [N/A], [Not Supported], [Insufficient Permissions]
_COMPUTE_CAP = re.compile(r"([0-9]{1,2})\.([0-9]{1,2})")  # 9.0, 12.0
_SMI_CUDA = re.compile(r"CUDA Version\s*:\s*([0-9]{1,3})\.([0-9]{1,3})")  # nvidia-smi's header: the newest CUDA it runs
_MEMORY_LINE = re.compile(r"([0-9]{1,3})\s*,\s*([0-9]{1,9})\s*,\s*([0-9]{1,9})")


# ------------------------------------------------------------------------------------------ running it


def find(env: Mapping[str, str], given: str | None = None) -> str | None:
    """The nvidia-smi to run: the one given, else the first on env's PATH."""
    return given or shutil.which("nvidia-smi", path=env.get("PATH"))


@dataclass(frozen=True, kw_only=True)
class Answer:
    """What one run of nvidia-smi said: its stdout, or why there is none (`failure`, in words)."""
    stdout: str | None
    failure: str | None


def run(exe: str, args: Sequence[str], *, env: Mapping[str, str], timeout: float = SMI_TIMEOUT,
        show_args: bool = False) -> Answer:
    """Run `exe` with `args`; never raises. `show_args`: the failure names the arguments too."""
    name = "nvidia-smi" + (f" {' '.join(args)}" if show_args and args else "")
    try:
        done = proc.capture([exe, *args], env=env, timeout=timeout)
    except proc.Timeout:
        return Answer(stdout=None, failure=f"nvidia-smi did not answer in {timeout:g}s (it was stopped, with what it started)")
    except OSError as e:
        return Answer(stdout=None, failure=f"nvidia-smi could not be started: {e}")
    if done.returncode != 0:
        last = ((done.stdout + done.stderr).strip().splitlines()[-1:] or ["it printed nothing"])[0].strip()
        return Answer(stdout=None, failure=f"{name} exited with {done.returncode}: {last[:300]}")
    return Answer(stdout=done.stdout, failure=None)


# ------------------------------------------------------------------------------------------ its values


def is_driver_version(text: str) -> bool:
    """2-4 dot-separated numbers: how NVIDIA numbers its drivers (580.65.06 on Linux, 572.61 on Windows)."""
    return _DRIVER_VERSION.fullmatch(text) is not None


def driver_older(driver: str, floor: str) -> bool:
    """driver < floor, as versions (570.124.06 < 572.61). Both should pass is_driver_version (callers check)."""
    try:
        return Version(driver) < Version(floor)
    except InvalidVersion:
        def nums(v: str) -> tuple[int, ...]:
            return tuple(int(x) for x in re.findall(r"\d+", v))
        return nums(driver) < nums(floor)


def mib(value: str) -> tuple[int | None, bool]:
    """(MiB, understood): a whole number of MiB, or None for nvidia-smi's [N/A]-style 'not known'."""
    if _MIB.fullmatch(value):
        return int(value), True
    return None, _NOT_AVAILABLE.fullmatch(value) is not None


def _lines(text: str) -> tuple[list[str], list[str]]:
    """(the non-empty lines read, and the note about those past MAX_OUTPUT_LINES)."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    more = [f"{len(lines) - MAX_OUTPUT_LINES} more lines after the first {MAX_OUTPUT_LINES}, not read"] \
        if len(lines) > MAX_OUTPUT_LINES else []
    return lines[:MAX_OUTPUT_LINES], more


# ------------------------------------------------------------------------------------------ the GPU scan


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


def read_nvidia_smi(text: str) -> tuple[list[Gpu], list[str]]:
    """SCAN_ARGS output: the GPUs it lists, and for each other non-empty line what is wrong with it."""
    gpus: list[Gpu] = []
    bad: list[str] = []
    lines, more = _lines(text)
    for line in lines:
        fields = [f.strip() for f in line.rsplit(",", 3)]  # a GPU's name may hold a comma, the numbers do not
        why = None
        if len(fields) != 4:
            why = "not 4 comma-separated fields"
        else:
            name, driver, total, free = fields
            (total_mib, total_ok), (free_mib, free_ok) = mib(total), mib(free)
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
    return gpus, bad + more


def parse_nvidia_smi(text: str) -> list[Gpu]:
    """The GPUs in SCAN_ARGS output (read_nvidia_smi without the reasons for the lines left out)."""
    return read_nvidia_smi(text)[0]


def parse_proc_version(text: str) -> str | None:
    """The driver version on the `NVRM version:` line of /proc/driver/nvidia/version; None when that line's
    first dotted number is not a driver version (or there is no such line)."""
    m = _PROC_DRIVER.search(text)
    return m.group(1) if m and is_driver_version(m.group(1)) else None


def read_proc_version(path: Path | None) -> tuple[str | None, str | None]:
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
    proc_driver, proc_problem = read_proc_version(proc_version)
    exe = find(env, nvidia_smi)
    if exe is None:
        return GpuScan(gpus=(), nvidia_smi=None, smi_driver=None, proc_driver=proc_driver,
                       error="nvidia-smi is not on PATH" + (f"; {proc_problem}" if proc_problem else ""))
    gpus: list[Gpu] = []
    answer = run(exe, SCAN_ARGS, env=env, timeout=timeout)
    error = answer.failure
    if answer.stdout is not None:
        gpus, bad = read_nvidia_smi(answer.stdout)
        if not gpus:
            error = ("nvidia-smi listed no GPU: " + ("; ".join(bad[:3]) if bad else "it printed nothing")
                     + (f" ({len(bad) - 3} more lines like these)" if len(bad) > 3 else ""))
        elif bad:
            error = f"nvidia-smi printed {len(bad)} line(s) that are not GPUs, left out: " + "; ".join(bad[:3])
    if error is not None:
        error = error[:500]
    if not gpus and error is not None and proc_problem:
        error += f"; {proc_problem}"
    return GpuScan(gpus=tuple(gpus), nvidia_smi=exe, smi_driver=gpus[0].driver if gpus else None,
                   proc_driver=proc_driver, error=error)


# ------------------------------------------------------------------------------------------ other questions


def read_compute_caps(text: str) -> tuple[list[tuple[int, int]] | None, str | None]:
    """COMPUTE_CAP_ARGS output: each GPU's compute capability, or (None, what is wrong)."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()][:MAX_OUTPUT_LINES]
    matches = [_COMPUTE_CAP.fullmatch(ln) for ln in lines]
    if lines and all(matches):
        return [(int(m[1]), int(m[2])) for m in matches if m], None
    bad = next((ln for ln, m in zip(lines, matches, strict=True) if not m), "")
    return None, ("nvidia-smi's answer is not a compute capability like 8.6"
                  + (f" ({bad[:100]!r})" if bad else " (it printed nothing)"))


def read_driver_cuda(text: str) -> tuple[int, int] | None:
    """The newest CUDA the driver runs, from nvidia-smi's header (`CUDA Version: 12.8`), or None."""
    m = _SMI_CUDA.search(text)
    return (int(m[1]), int(m[2])) if m else None


def read_memory(text: str, gpu: int) -> tuple[int, int]:
    """(free, total) bytes of GPU `gpu` in MEMORY_ARGS output. Raises ValueError saying what is wrong."""
    seen: list[int] = []
    for line in (ln.strip() for ln in text.splitlines() if ln.strip()):
        m = _MEMORY_LINE.fullmatch(line)
        if m is None:
            raise ValueError(f"it printed {line[:100]!r}, not 'index, memory.free, memory.total' in MiB")
        if int(m[1]) == gpu:
            return int(m[2]) * MiB, int(m[3]) * MiB
        seen.append(int(m[1]))
    if not seen:
        raise ValueError("it listed no GPU")
    raise ValueError(f"it lists GPU {', '.join(map(str, seen))}, not GPU {gpu}")


@dataclass(frozen=True, kw_only=True)
class GpuStat:
    index: int
    name: str
    utilization_pct: int | None  # None: nvidia-smi said [N/A] (a MIG instance, some GPUs)
    memory_used_mib: int | None
    memory_total_mib: int | None

    def to_json(self) -> dict[str, Any]:
        return {"index": self.index, "name": self.name, "utilization_pct": self.utilization_pct,
                "memory_used_mib": self.memory_used_mib, "memory_total_mib": self.memory_total_mib}


def read_stats(text: str) -> tuple[list[GpuStat], str | None, list[str]]:
    """STATS_ARGS output: the GPUs, the driver version (the first GPU's), and for each other non-empty line
    what is wrong with it (the line is not a GPU)."""
    gpus: list[GpuStat] = []
    driver: str | None = None
    bad: list[str] = []
    lines, more = _lines(text)
    for line in lines:
        head, _, rest = line.partition(",")
        fields = [f.strip() for f in rest.rsplit(",", 4)]  # a GPU's name may hold a comma, the numbers do not
        why = None
        if not rest or len(fields) != 5:
            why = "not 6 comma-separated fields"
        else:
            name, drv, util, used, total = fields
            (util_v, util_ok), (used_v, used_ok), (total_v, total_ok) = mib(util), mib(used), mib(total)
            if not head.strip().isascii() or not head.strip().isdigit() or len(head.strip()) > 3:
                why = f"index {head.strip()[:40]!r} is not a GPU index"
            elif not name or not name.isprintable() or len(name) > 200:
                why = "no GPU name" if not name else "the GPU name is not printable text of at most 200 characters"
            elif not is_driver_version(drv):
                why = f"driver version {drv[:40]!r} is not a version like 580.65.06"
            elif not util_ok or (util_v is not None and util_v > 100):
                why = f"utilization.gpu {util[:40]!r} is not a percentage"
            elif not used_ok:
                why = f"memory.used {used[:40]!r} is not a whole number of MiB"
            elif not total_ok:
                why = f"memory.total {total[:40]!r} is not a whole number of MiB"
            else:
                gpus.append(GpuStat(index=int(head.strip()), name=name, utilization_pct=util_v, memory_used_mib=used_v,
                                    memory_total_mib=total_v))
                driver = driver or drv
                continue
        bad.append(f"{line[:100]!r}: {why}")
    return gpus, driver, bad + more
