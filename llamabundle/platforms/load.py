"""The load check of every platform (DESIGN §7, level load): the bundle's `llama-server --verbose
--list-devices` run from inside the bundle in a clean environment, what it says read (the backends loaded and
where from, the devices listed, ggml-cuda's compute capabilities), and why no CPU variant loaded when none did.
Natively here; the Windows platform runs the same reading under Wine (windows/wine.py)."""

from __future__ import annotations

import re
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from .. import proc
from ..errors import VerifyError

LOAD_TIMEOUT = 120  # seconds `llama-server --list-devices` may take
LOADED = re.compile(r"load_backend: loaded (\S+) backend from (.+?)\s*$")
DEVICE = re.compile(r"^\s+(\S+): (.+)$")
# ggml_cuda_init's "  Device 0: NVIDIA H200, compute capability 9.0, VMM: yes" (after the log prefix)
CUDA_CC = re.compile(r"\bDevice (\d+): .*?, compute capability (\d+)\.(\d+)\b")


@dataclass(kw_only=True)
class Loaded:
    """What `llama-server --verbose --list-devices` said when run from inside a bundle."""
    level: str  # "passed …" or "skipped: why"
    backends: dict[str, str] = field(default_factory=dict)  # loader name (CPU, CUDA) -> file it came from
    devices: list[str] = field(default_factory=list)
    compute_caps: dict[str, str] = field(default_factory=dict)  # CUDA0 -> 9.0, as ggml-cuda reported them
    env: dict[str, str] = field(default_factory=dict)  # the environment the bundle ran in


def read_list_devices(lines: Sequence[str], *, root: Path, loaded: Loaded, exe: str, where: str = "",
                      translate: Callable[[str], str] | None = None) -> None:
    """Fill `loaded` from llama-server's --verbose --list-devices output: every 'loaded X backend from P' and
    the devices after 'Available devices'. The CPU backend must be among them and every backend must have
    come from inside `root` (else a library outside the bundle shadows the bundled one)."""
    tail = "\n".join(list(lines)[-20:])
    in_list = False
    for line in lines:
        m = LOADED.search(line)
        if m:
            path = m.group(2)
            loaded.backends[m.group(1)] = translate(path) if translate is not None else path
        if (cc := CUDA_CC.search(line)) and not in_list:
            loaded.compute_caps[f"CUDA{cc.group(1)}"] = f"{cc.group(2)}.{cc.group(3)}"
        if line.startswith("Available devices"):
            in_list = True
        elif in_list and (d := DEVICE.match(line)):
            loaded.devices.append(f"{d.group(1)}: {d.group(2)}")
    if "CPU" not in loaded.backends:
        raise VerifyError(f"{exe} did not load a CPU backend{where}", why="no 'loaded CPU backend from' line", details=tail)
    inside = root.resolve()
    for name, path in loaded.backends.items():
        if not Path(path).resolve().is_relative_to(inside):
            raise VerifyError(f"the {name} backend was loaded from {path}, outside the bundle",
                              why=f"a {'DLL' if exe.endswith('.exe') else 'library'} outside the bundle shadows the "
                                  "bundled one", details=tail)


def clean_env(root: Path, keep: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment a bundle is run in from `root` on this host: nothing of the caller's (no LD_LIBRARY_PATH,
    no PATH to other libraries) but `keep`, the variables a backend's driver lookup reads, and what a program
    of the platform needs (on Windows: `windows_env`)."""
    if sys.platform == "win32":  # pragma: no cover - exercised on the Windows CI job; under Wine by wine.py
        given = proc.inherited(["SystemRoot", "windir"])
        system_root = given.get("SystemRoot") or given.get("windir") or "C:\\Windows"
        return windows_env(str(root), str(root.parent), system_root, keep)
    return posix_env(str(root), str(root.parent), keep)


def posix_env(bundle: str, tmp: str, keep: Mapping[str, str] | None = None) -> dict[str, str]:
    """A Linux bundle's clean environment: the system's directories on PATH, HOME the bundle, a UTF-8 locale, the
    temporary directory beside the bundle, and `keep`."""
    return {**(keep or {}), "PATH": "/usr/bin:/bin", "HOME": bundle, "LANG": "C.UTF-8", "TMPDIR": tmp}


def planned_env(platform: str) -> dict[str, str]:
    """The clean environment the load check runs a bundle of `platform` in, as `show` prints it: <bundle> where
    it is unpacked, <tmp> beside it, %SystemRoot% as Windows sets it (a backend's driver variables are added
    when the caller has them)."""
    if platform.startswith("windows-"):
        return {**windows_env("<bundle>", "<tmp>", "%SystemRoot%"), "SystemDrive": "%SystemDrive%"}
    return posix_env("<bundle>", "<tmp>")


def windows_env(bundle: str, tmp: str, system_root: str, keep: Mapping[str, str] | None = None) -> dict[str, str]:
    """A Windows bundle's clean environment (Windows paths): what Windows itself gives a program and its DLLs
    rely on (SystemRoot and windir: Winsock, COM and the loader read them; SystemDrive), the bundle then System32
    on PATH and nothing else there, TEMP and TMP beside the bundle, and `keep`."""
    return {**(keep or {}), "SystemRoot": system_root, "windir": system_root, "SystemDrive": system_root[:2],
            "PATH": f"{bundle};{system_root}\\System32;{system_root}", "TEMP": tmp, "TMP": tmp}


def run_list_devices(root: Path, *, exe_name: str, keep: Mapping[str, str] | None = None) -> Loaded:
    """`<exe> --verbose --list-devices` run natively from `root` in a clean environment (nothing of the
    caller's: no LD_LIBRARY_PATH, no PATH to other libraries; only `keep`, the variables a backend's driver
    lookup reads) and its own process group (a hang ends with all it started).

    llama.cpp's log is written by a thread of its own, and --list-devices exits without waiting for it (the
    logger is leaked on purpose, llama.cpp issue 22142): on a busy machine its 'loaded X backend from' lines
    can be lost while the device list, printed directly, is not. So a run whose lines are incomplete (no CPU
    line, or a listed device whose backend has none) is repeated, up to LIST_ATTEMPTS runs, and the lines
    of all runs are read together (the same binary in the same environment loads the same backends)."""
    env = clean_env(root, keep)
    exe = root / exe_name
    if not exe.is_file():
        raise VerifyError(f"the bundle has no {exe_name}", fix="include llama-server in the recipe's targets")

    def run() -> list[str]:
        try:
            out = proc.capture([str(exe), "--verbose", "--list-devices"], cwd=root.parent, env=env,
                               timeout=LOAD_TIMEOUT)
        except proc.Timeout:
            raise VerifyError(f"{exe_name} --list-devices did not finish in {LOAD_TIMEOUT}s") from None
        except OSError as e:
            raise VerifyError(f"{exe_name} could not be started", why=str(e)) from None
        if out.returncode != 0:
            raise VerifyError(f"{exe_name} --list-devices exited with {out.returncode}",
                              why="the bundle does not load in a clean environment",
                              details="\n".join((out.stderr + out.stdout).strip().splitlines()[-20:]))
        return (out.stderr + out.stdout).splitlines()

    lines = until_complete(run)
    loaded = Loaded(level="passed", env=env)
    try:
        read_list_devices(lines, root=root, loaded=loaded, exe=exe_name)
    except VerifyError as e:
        if "CPU" not in loaded.backends and (why := cpu_load_diagnosis(root, env)):
            e.why = f"{e.why}; {why}"
        raise
    return loaded


LIST_ATTEMPTS = 3


def until_complete(run: Callable[[], list[str]]) -> list[str]:
    """The output lines of `run` (one --list-devices run), repeated up to LIST_ATTEMPTS times while they are
    incomplete; the 'loaded' lines of every run, then the last run's other lines."""
    said: list[str] = []
    for _ in range(LIST_ATTEMPTS):
        got = run()
        said += [line for line in got if LOADED.search(line)]
        lines = [*said, *(line for line in got if not LOADED.search(line))]
        if _complete(lines):
            break
    return lines


def _complete(lines: Sequence[str]) -> bool:
    """A 'loaded CPU backend' line, and one for the backend of every listed device (CUDA0 -> CUDA)."""
    loaded = {m.group(1) for line in lines if (m := LOADED.search(line))}
    listed, in_list = set(), False
    for line in lines:
        if line.startswith("Available devices"):
            in_list = True
        elif in_list and (d := DEVICE.match(line)) and (b := re.match(r"[A-Za-z]+", d.group(1))):
            listed.add(b.group(0))
    return "CPU" in loaded and listed <= loaded


# Run by the Python that runs llamabundle, in the bundle's clean environment: ggml's own scan is silent in a
# release build, so this says, per CPU variant, what dlopen answered and what the variant scored here.
_CPU_PROBE = r'''
import ctypes, os, sys
path = sys.argv[1]
try:
    lib = ctypes.CDLL(path, mode=os.RTLD_NOW | os.RTLD_LOCAL)
except OSError as e:
    print("not loaded:", str(e).replace(path, "").strip(": ") or "dlopen failed")
else:
    score = getattr(lib, "ggml_backend_score", None)
    print(f"score {score()}" if score is not None else "no ggml_backend_score")
'''


def cpu_load_diagnosis(root: Path, env: Mapping[str, str]) -> str:
    """Why no CPU variant of a bundle was loaded here: each `libggml-cpu*.so` loaded on its own (a process
    each: a variant that crashes on load says so) and scored, and whether the executable's directory is
    readable through /proc/self/exe (ggml looks for the variants there). '' where there are none to try."""
    variants = sorted(root.glob("libggml-cpu*.so"))
    if not variants or not sys.executable:
        return ""
    said = []
    for v in variants:
        try:
            out = proc.capture([sys.executable, "-S", "-c", _CPU_PROBE, str(v)], cwd=root.parent, env=env, timeout=30)
            answer = out.stdout.strip() or f"exit {out.returncode}: {out.stderr.strip()[-200:] or 'no output'}"
        except (proc.Timeout, OSError) as e:
            answer = f"not tried: {e}"
        said.append(f"{v.name}: {answer}")
    if not Path("/proc/self/exe").exists():
        said.append("/proc/self/exe is missing (ggml finds the variants beside the executable through it)")
    return "loaded one by one here: " + "; ".join(said)
