"""Verification levels (DESIGN §7): manifest, static (imports resolve), load (llama-server loads
its backends from inside the bundle)."""

from __future__ import annotations

import os
import platform as host_platform
import queue
import re
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

from . import bundle as bundle_mod
from . import proc as procs
from . import scratch
from .backends.cuda.archs import split_archs
from .backends.cuda.fatbin import binary_archs
from .bundle.manifest import ANYTHING, Expect, Manifest
from .deps import elf, pe
from .deps.policy import LibClass, linux_policy
from .errors import LlamaBundleError, UsageError, VerifyError

LOAD_TIMEOUT = 120
WINE_TIMEOUT = 300  # a new Wine prefix boots first (20-60 s)
WINE_QUIET = 2.0  # seconds without output after the device list: the list is complete
WINE_STOPPED = "stopped after the device list: Wine 8 does not exit"
_LOADED = re.compile(r"load_backend: loaded (\S+) backend from (.+?)\s*$")
_DEVICE = re.compile(r"^\s+(\S+): (.+)$")


class Level(StrEnum):
    STATIC = "static"  # manifest, imports, RUNPATH, GPU architectures
    LOAD = "load"  # + llama-server --list-devices loads the CPU backend from inside a copy
    GPU = "gpu"  # + a CUDA device is listed and the CUDA backend came from inside the copy


@dataclass(kw_only=True)
class VerifyReport:
    path: str
    key: str
    platform: str
    files: int
    bytes: int
    levels: dict[str, str] = field(default_factory=dict)  # level -> passed | skipped: reason
    backends_loaded: dict[str, str] = field(default_factory=dict)
    devices: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {"schema": 1, **asdict(self)}

    def lines(self) -> list[str]:
        """The human summary: one line per level, loaded backend and device."""
        out = [f"{level}: {result}" for level, result in self.levels.items()]
        out += [f"{name} backend loaded from {where}" for name, where in self.backends_loaded.items()]
        out += [f"device {dev}" for dev in self.devices]
        return out


def host_platform_name() -> str:
    system = {"Linux": "linux", "Windows": "windows"}.get(host_platform.system(), host_platform.system().lower())
    machine = {"AMD64": "x86_64", "x86_64": "x86_64"}.get(host_platform.machine(), host_platform.machine())
    return f"{system}-{machine}"


@dataclass(frozen=True, kw_only=True)
class Naming:
    """How messages name the files of a bundle that is checked in a temporary directory: by the zip or
    directory the user gave (`bundle.zip:libggml-cpu.so`, `DIR/libggml-cpu.so`), never by the temporary path."""

    temps: tuple[str, ...]  # regular expressions of the temporary directories that hold the bundle's files
    origin: str  # the user's zip or directory
    is_zip: bool

    @classmethod
    def of(cls, temps: list[Path], origin: Path | str, *, is_zip: bool, partial: bool = True) -> Naming:
        """`temps`, and (partial) the `.NAME.partial-N` directory an unpack into one of them fills first."""
        pats: list[str] = []
        for t in temps:
            for variant in dict.fromkeys((str(t), str(t.resolve()))):
                pats.append(re.escape(variant))
                if partial:
                    pats.append(re.escape(str(Path(variant).parent / f".{t.name}.partial-")) + r"[0-9a-f-]+")
        return cls(temps=tuple(sorted(pats, key=len, reverse=True)), origin=str(origin), is_zip=is_zip)

    def name(self, rel: str) -> str:
        if not rel:
            return self.origin
        return f"{self.origin}:{rel}" if self.is_zip else os.path.join(self.origin, rel)

    def text(self, text: str) -> str:
        for pat in self.temps:
            text = re.sub(pat + r"(?![^/\s'\":,;()\[\]])(?:/([^\s'\":,;()\[\]]*))?",
                          lambda m: self.name(m.group(1) or ""), text)
        return text

    def error(self, e: LlamaBundleError) -> LlamaBundleError:
        """The error with its messages naming the user's paths (the same object, rewritten)."""
        e.what, e.why, e.fix, e.details = self.text(e.what), self.text(e.why), self.text(e.fix), self.text(e.details)
        e.args = (e.what, *e.args[1:])
        return e

    def report(self, r: VerifyReport) -> VerifyReport:
        r.backends_loaded = {k: self.text(v) for k, v in r.backends_loaded.items()}
        return r


SCRATCH = "verify-"


def scratch_root() -> Path:
    """Where verify unpacks and runs bundles: `<cache>/tmp`, never bare /tmp (a killed run's copy, hundreds of
    MB, is removed by the next run that uses the cache)."""
    from .recipe import Settings  # the one reader of LLAMABUNDLE_* settings

    return Settings.from_env(os.environ).cache_dir / "tmp"


def sweep_scratch(root: Path | None = None) -> None:
    """Remove the verify copies of dead runs (and those older versions left in the system temp directory)."""
    scratch.sweep(root or scratch_root(), [SCRATCH])
    scratch.sweep(Path(tempfile.gettempdir()), ["llamabundle-verify-"])


def verify_bundle(path: Path, *, level: Level, require_gpu: bool = False, wine_prefix: Path | None = None,
                  expect: Expect = ANYTHING, verified: list[Manifest] | None = None) -> VerifyReport:
    """Verify a bundle zip or directory up to `level`, trusting it (manifest.trust) against `expect`. Raises
    VerifyError naming what failed (UsageError: a path that is missing or cannot be read). Messages name
    `path`, never the temporary copy. `verified`, when given, receives the trusted manifest."""
    _check_readable(path)
    base = scratch_root()
    sweep_scratch(base)
    try:
        tmp = scratch.make_dir(base, SCRATCH)
    except OSError as e:
        raise UsageError(f"cannot make a scratch directory in {base}", why=e.strerror or str(e),
                         fix="free space there, or point LLAMABUNDLE_CACHE_DIR at a writable disk") from None
    try:
        naming = Naming.of([tmp / "bundle"], path, is_zip=path.is_file())
        try:
            if path.is_file():
                root = tmp / "bundle"
                manifest, check = bundle_mod.unpack(path, root, expect)
            else:
                manifest, check = bundle_mod.check_unpacked(path, hashes=None, expect=expect)
                root = tmp / "bundle"
                if level is not Level.STATIC:  # run a copy, never the original
                    shutil.copytree(path, root, symlinks=False)
                else:
                    root = path
            report = verify_unpacked(root, manifest, check, level=level, require_gpu=require_gpu, label=str(path),
                                     wine_prefix=wine_prefix)
        except LlamaBundleError as e:
            naming.error(e)
            raise
        except OSError as e:  # the scratch disk, not the bundle
            raise UsageError(f"cannot copy {path} into {base} to check it", why=e.strerror or str(e),
                             fix="free space there, or point LLAMABUNDLE_CACHE_DIR at a writable disk") from None
        if verified is not None:
            verified.append(manifest)
        return naming.report(report)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _check_readable(path: Path) -> None:
    """A usage error (exit 2) unless `path` is a file or directory that can be read."""
    fix = "pass a bundle zip or an unpacked bundle directory"
    if not path.exists():
        raise UsageError(f"{path} does not exist", fix=fix)
    try:
        if path.is_file():
            with open(path, "rb") as f:
                f.read(1)
        elif path.is_dir():
            os.listdir(path)
        else:
            raise UsageError(f"{path} is neither a file nor a directory", fix=fix)
    except OSError as e:
        raise UsageError(f"cannot read {path}", why=e.strerror or str(e), fix="check the path and its permissions") from None


def verify_unpacked(root: Path, manifest: Manifest, check: bundle_mod.ContentCheck, *, level: Level,
                    require_gpu: bool = False, label: str, wine_prefix: Path | None = None) -> VerifyReport:
    """The levels above the manifest, on a bundle directory whose contents were just checked (`check`).
    The load level runs the binaries in `root`: pass a copy, or a directory of one's own."""
    report = VerifyReport(path=label, key=manifest.key, platform=manifest.platform,
                          files=check.files, bytes=check.bytes)
    report.levels["manifest"] = "passed"
    check_static(root, manifest)
    report.levels["static"] = "passed"
    if manifest.cuda is not None:
        report.levels["archs"] = check_archs(root, manifest)
    if level is not Level.STATIC:
        check_load(root, manifest, report, wine_prefix=wine_prefix)
    if level is Level.GPU:
        check_gpu(manifest, report, require_gpu=require_gpu)
    return report


def check_archs(root: Path, manifest: Manifest) -> str:
    """The SASS and PTX in ggml-cuda equal what the recipe asked for and what bundle.json records."""
    assert manifest.cuda is not None
    lib = "ggml-cuda.dll" if manifest.is_windows else "libggml-cuda.so"
    if not (root / lib).is_file():
        raise VerifyError(f"bundle.json declares CUDA but the bundle has no {lib}")
    found = binary_archs(root / lib).to_json()
    cuda_inputs = manifest.inputs.get("cuda")
    asked = cuda_inputs.get("archs", ()) if isinstance(cuda_inputs, Mapping) else ()
    wanted = split_archs([str(a) for a in asked])
    recorded = manifest.cuda.archs_json()
    if found != wanted:
        raise VerifyError(f"{lib} carries SASS {found['sass']} and PTX {found['ptx']}",
                          why=f"the recipe asks for SASS {wanted['sass']} and PTX {wanted['ptx']}",
                          fix="rebuild the bundle; check CMAKE_CUDA_ARCHITECTURES reached nvcc")
    if recorded != found:
        said = f"SASS {recorded['sass']} and PTX {recorded['ptx']}"
        raise VerifyError(f"bundle.json records {said}, {lib} carries SASS {found['sass']} and PTX {found['ptx']}",
                          fix="rebuild the bundle")
    return f"passed (SASS {' '.join(found['sass']) or '-'}; PTX {' '.join(found['ptx']) or '-'})"


def nvidia_driver_present() -> bool:
    if Path("/dev/nvidiactl").exists():
        return True
    return any(Path(d, "libcuda.so.1").exists() for d in ("/usr/lib/x86_64-linux-gnu", "/usr/lib64", "/usr/local/nvidia/lib64"))


def check_gpu(manifest: Manifest, report: VerifyReport, *, require_gpu: bool) -> None:
    if "cuda" not in manifest.backends:
        report.levels["gpu"] = "skipped: the bundle has no GPU backend"
    elif report.levels.get("load", "").startswith("skipped"):
        report.levels["gpu"] = "skipped: " + report.levels["load"].removeprefix("skipped: ")
    elif "CUDA" in report.backends_loaded:
        if not any(d.startswith("CUDA") for d in report.devices):
            raise VerifyError("the CUDA backend loaded but listed no CUDA device", details="\n".join(report.devices))
        report.levels["gpu"] = "passed"
    elif nvidia_driver_present():
        raise VerifyError("an NVIDIA driver is present but the bundle's CUDA backend did not load",
                          why="ggml-cuda or a CUDA library it needs failed to load from the bundle",
                          fix="run the bundle's llama-server --verbose --list-devices to see why")
    else:
        report.levels["gpu"] = "skipped: no NVIDIA driver on this machine"
    if require_gpu and report.levels["gpu"] != "passed":
        raise VerifyError(f"GPU check {report.levels['gpu']}", why="--require-gpu was given",
                          fix="run the check on a machine with an NVIDIA GPU and driver")


def check_static(root: Path, manifest: Manifest) -> list[str] | None:
    """Every import of every binary resolves inside the bundle, in the system allowlist or the driver set.
    For a Windows bundle, returns the system and driver DLLs its binaries import."""
    if manifest.is_windows:
        return _check_static_pe(root, manifest)
    if not manifest.platform.startswith("linux"):
        raise VerifyError(f"static verification of {manifest.platform} bundles is not supported yet",
                          fix="verify it on a llamabundle version with PE support")
    policy = linux_policy()
    present = {f.path for f in manifest.files}
    for entry in manifest.files:
        f = root / entry.path
        if not elf.is_elf(f):
            continue
        info = elf.read_elf(f)
        for dep in info.needed:
            if dep in present or policy.classify(dep) is not LibClass.OTHER:
                continue
            raise VerifyError(f"{entry.path} needs {dep}, which is neither in the bundle nor a system or driver library",
                              why="the bundle would fail to load on a clean machine", fix="rebuild the bundle")
        bad = [p for p in info.runpath if p not in ("$ORIGIN", "${ORIGIN}")]
        if bad:
            raise VerifyError(f"{entry.path} has RUNPATH {':'.join(info.runpath)}",
                              why="only $ORIGIN keeps a bundle relocatable", fix="rebuild the bundle")
    return None


def _check_static_pe(root: Path, manifest: Manifest) -> list[str]:
    """The PE import closure of every .exe/.dll (imports and delay-imports, x64 only) stays inside the bundle."""
    names = [e.path for e in manifest.files]
    for name in names:
        if elf.is_elf(root / name):
            raise VerifyError(f"{name} is an ELF binary in a {manifest.platform} bundle",
                              why="a Windows bundle holds PE binaries only", fix="rebuild the bundle")
    closure = pe.resolve_closure([root / n for n in names if n.lower().endswith((".exe", ".dll"))], bundle_dir=root)
    missing = [f"{dll} (imported by {', '.join(by)}) is not in the bundle" for dll, by in closure.missing.items()]
    if missing:
        raise VerifyError("; ".join(missing), why="Windows would refuse to load these binaries on a clean machine",
                          fix="rebuild the bundle so that it collects every runtime DLL")
    return closure.system_deps


def check_load(root: Path, manifest: Manifest, report: VerifyReport, *, wine_prefix: Path | None = None) -> None:
    if manifest.platform == "windows-x86_64" and host_platform_name() == "linux-x86_64":
        check_load_wine(root, report, prefix=wine_prefix or default_wine_prefix())
        return
    if manifest.platform != host_platform_name():
        report.levels["load"] = f"skipped: a {manifest.platform} bundle cannot run on {host_platform_name()}"
        return
    exe_name = "llama-server.exe" if manifest.is_windows else "llama-server"
    exe = root / exe_name
    if not exe.is_file():
        raise VerifyError(f"the bundle has no {exe_name}", fix="include llama-server in the recipe's targets")
    env = {"PATH": "/usr/bin:/bin", "HOME": str(root), "LANG": "C.UTF-8", "TMPDIR": str(root.parent)}
    try:
        proc = procs.capture([str(exe), "--verbose", "--list-devices"], cwd=root.parent, env=env,
                             timeout=LOAD_TIMEOUT)  # its own process group: a hang ends with all it started
    except subprocess.TimeoutExpired:
        raise VerifyError(f"{exe_name} --list-devices did not finish in {LOAD_TIMEOUT}s") from None
    except OSError as e:
        raise VerifyError(f"{exe_name} could not be started", why=str(e)) from None
    tail = "\n".join((proc.stderr + proc.stdout).strip().splitlines()[-20:])
    if proc.returncode != 0:
        raise VerifyError(f"{exe_name} --list-devices exited with {proc.returncode}",
                          why="the bundle does not load in a clean environment", details=tail)
    inside = root.resolve()
    for line in (proc.stderr + proc.stdout).splitlines():
        m = _LOADED.search(line)
        if m:
            report.backends_loaded[m.group(1)] = m.group(2)
    cpu = report.backends_loaded.get("CPU")
    if cpu is None:
        raise VerifyError(f"{exe_name} did not load a CPU backend", why="no 'loaded CPU backend from' line",
                          details=tail)
    for name, where in report.backends_loaded.items():
        if not Path(where).resolve().is_relative_to(inside):
            raise VerifyError(f"the {name} backend was loaded from {where}, outside the bundle",
                              why="a library outside the bundle shadows the bundled one", details=tail)
    in_list = False
    for line in proc.stdout.splitlines():
        if line.startswith("Available devices"):
            in_list = True
            continue
        m = _DEVICE.match(line)
        if in_list and m:
            report.devices.append(f"{m.group(1)}: {m.group(2)}")
    report.levels["load"] = "passed"


# ------------------------------------------------------------------------------- Windows under Wine


def default_wine_prefix() -> Path:
    """The private Wine prefix in llamabundle's cache dir (never the user's ~/.wine)."""
    from .recipe import Settings  # the one reader of LLAMABUNDLE_* settings

    return Settings.from_env(os.environ).cache_dir / "wine"


@dataclass(frozen=True, kw_only=True)
class StreamResult:
    lines: list[str]
    returncode: int | None  # None: it was stopped
    stopped: bool


def run_until_device_list(argv: list[str], *, env: dict[str, str], cwd: Path, timeout: float | None = None,
                          quiet: float | None = None, stop: Callable[[], None] | None = None) -> StreamResult:
    """Run argv, reading stdout+stderr as they stream. Once 'Available devices:' has been seen and either
    a line that is not a device follows or the output goes quiet for `quiet` seconds, the device list is
    complete: the process group is killed (then `stop()`, e.g. wineserver -k) and the result says so."""
    try:
        p = subprocess.Popen(argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             stdin=subprocess.DEVNULL, text=True, errors="replace", start_new_session=True)
    except OSError as e:
        raise VerifyError(f"{argv[0]} could not be started", why=str(e)) from None
    assert p.stdout is not None
    timeout = WINE_TIMEOUT if timeout is None else timeout
    quiet = WINE_QUIET if quiet is None else quiet
    lines: queue.Queue[str | None] = queue.Queue()
    stream = p.stdout

    def read() -> None:
        for line in stream:
            lines.put(line)
        lines.put(None)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    seen: list[str] = []
    in_list = complete = False
    deadline = time.monotonic() + timeout
    try:
        while not complete:
            left = deadline - time.monotonic()
            if left <= 0:
                raise VerifyError(f"{' '.join(Path(a).name for a in argv)} listed no devices in {timeout:.0f}s",
                                  details="\n".join(seen[-20:]))
            try:
                line = lines.get(timeout=min(left, quiet) if in_list else min(left, 0.5))
            except queue.Empty:
                complete = in_list
                continue
            if line is None:  # it exited by itself
                return StreamResult(lines=seen, returncode=p.wait(), stopped=False)
            line = line.rstrip("\r\n")
            seen.append(line)
            if line.startswith("Available devices"):
                in_list = True
            elif in_list and not _DEVICE.match(line):
                complete = True
    finally:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                p.kill()
            p.wait()
            if stop is not None:
                stop()
        reader.join(timeout=5)
    return StreamResult(lines=seen, returncode=None, stopped=True)


def check_load_wine(root: Path, report: VerifyReport, *, prefix: Path) -> None:
    """`wine llama-server.exe --verbose --list-devices` from the bundle copy, in a private prefix; the CPU
    backend must load from inside the bundle (Wine prints Z:\\… paths). Skipped with a reason without wine."""
    from filelock import FileLock

    wine = shutil.which("wine")
    if wine is None:
        report.levels["load"] = "skipped: wine is not installed (a Windows bundle runs on Linux only under Wine)"
        return
    exe = root / "llama-server.exe"
    if not exe.is_file():
        raise VerifyError("the bundle has no llama-server.exe", fix="include llama-server in the recipe's targets")
    prefix.mkdir(parents=True, exist_ok=True)
    wine_dir = str(Path(wine).parent)
    env = {"PATH": f"{wine_dir}:/usr/bin:/bin", "HOME": str(prefix), "LANG": "C.UTF-8", "WINEPREFIX": str(prefix),
           "WINEDEBUG": "-all", "WINEDLLOVERRIDES": "mscoree,mshtml=", "TMPDIR": str(root.parent)}
    wineserver = shutil.which("wineserver", path=env["PATH"])

    def stop() -> None:
        if wineserver:
            procs.capture([wineserver, "-k"], env=env, timeout=60)

    with FileLock(str(prefix) + ".lock"):  # one run per prefix: wineserver -k ends every process in it
        res = run_until_device_list([wine, str(exe), "--verbose", "--list-devices"], env=env, cwd=root, stop=stop)
    tail = "\n".join(res.lines[-20:])
    if not res.stopped and res.returncode != 0:
        raise VerifyError(f"wine llama-server.exe --list-devices exited with {res.returncode}",
                          why="the bundle does not load under Wine", details=tail)
    inside = root.resolve()
    in_list = False
    for line in res.lines:
        m = _LOADED.search(line)
        if m:
            report.backends_loaded[m.group(1)] = wine_to_unix(m.group(2))
        if line.startswith("Available devices"):
            in_list = True
        elif in_list and (d := _DEVICE.match(line)):
            report.devices.append(f"{d.group(1)}: {d.group(2)}")
    if "CPU" not in report.backends_loaded:
        raise VerifyError("llama-server.exe did not load a CPU backend under Wine",
                          why="no 'loaded CPU backend from' line", details=tail)
    for name, where in report.backends_loaded.items():
        if not Path(where).resolve().is_relative_to(inside):
            raise VerifyError(f"the {name} backend was loaded from {where}, outside the bundle",
                              why="a DLL outside the bundle shadows the bundled one", details=tail)
    report.levels["load"] = "passed (under Wine; " + (WINE_STOPPED + ")" if res.stopped else "it exited 0)")


def wine_to_unix(path: str) -> str:
    """Z:\\tmp\\b\\x.dll -> /tmp/b/x.dll (Wine maps Z: to /); other paths unchanged."""
    m = re.match(r"^[Zz]:[\\/](.*)$", path)
    return "/" + m.group(1).replace("\\", "/") if m else path
