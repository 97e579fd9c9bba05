"""What every target platform answers: how its files are named, which compilers build for it, where a
build's runtime libraries come from and how they are collected into a bundle, how a bundle is checked
statically and loaded. The pipeline, the build plan and verify ask a platform; they never test a
platform's name."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from .. import proc
from ..errors import VerifyError

if TYPE_CHECKING:
    from ..build import BuildPlan
    from ..bundle.manifest import Manifest
    from ..log import Log
    from ..recipe import Recipe

LOAD_TIMEOUT = 120  # seconds `llama-server --list-devices` may take
LOADED = re.compile(r"load_backend: loaded (\S+) backend from (.+?)\s*$")
DEVICE = re.compile(r"^\s+(\S+): (.+)$")


def no_companions(bundled: Mapping[str, Path], lib_dirs: Sequence[Path]) -> list[Path]:
    return []


@dataclass(frozen=True, kw_only=True)
class RuntimeSources:
    """Where a build's runtime libraries may be taken from beyond its own output directory (the backends'
    toolkits, searched before the system's), and the libraries loaded at run time without an import entry
    naming them that must come along with what is bundled (asked of the backends)."""
    lib_dirs: tuple[Path, ...] = ()
    companions: Callable[[Mapping[str, Path], Sequence[Path]], list[Path]] = no_companions


@dataclass(frozen=True, kw_only=True)
class Collected:
    """What collecting put into a bundle's stage directory."""
    bundled: Mapping[str, Path]  # file name in the bundle -> where it came from
    roles: Mapping[str, str]  # file name -> exe | backend | runtime | license
    system_deps: list[str]  # the system (and driver) libraries the bundle's binaries import
    glibc_floor: str | None = None


@dataclass(kw_only=True)
class Loaded:
    """What `llama-server --verbose --list-devices` said when run from inside a bundle."""
    level: str  # "passed …" or "skipped: why"
    backends: dict[str, str] = field(default_factory=dict)  # loader name (CPU, CUDA) -> file it came from
    devices: list[str] = field(default_factory=list)


@runtime_checkable
class Platform(Protocol):
    """One target platform. Implementations are module-level singletons registered in `platforms`."""

    name: str  # linux-x86_64, windows-x86_64: as recipes and bundle.json name it
    system: str  # linux, windows: the OS half of the name
    compilers: tuple[str, ...]  # the toolchain.compiler values a recipe for this platform may pick

    def program_file(self, target: str) -> str:
        """The file a CMake executable target becomes (llama-server, llama-server.exe)."""
        ...

    def library_file(self, target: str) -> str:
        """The file a CMake shared-module target becomes (libggml-cpu.so, ggml-cpu.dll)."""
        ...

    def can_build_on(self, host: str, compiler: str) -> bool:
        """Whether this version can build bundles for this platform on `host` with `compiler`."""
        ...


    def cmake_setup(self, recipe: Recipe, build_dir: Path) -> tuple[dict[str, str], list[tuple[str, str]], list[str]]:
        """Cache definitions, files to write into the build tree, and lines for the project include
        (CMAKE_PROJECT_INCLUDE) that building with the recipe's toolchain for this platform needs."""
        ...

    def runtime_dirs(self, recipe: Recipe) -> list[Path]:
        """Directories of the toolchain's runtime libraries a build for this platform may copy in."""
        ...

    def collect(self, plan: BuildPlan, stage: Path, *, log: Log, sources: RuntimeSources) -> Collected:
        """Copy the build's programs and backends into `stage` with the import closure of runtime libraries
        they need (never the system's or the driver's), and say what each file is."""
        ...

    def check_static(self, root: Path, manifest: Manifest) -> list[str]:
        """Every import of every binary of an unpacked bundle resolves inside it, in the system set or the
        driver set; raises VerifyError naming the first that does not. Returns the system imports."""
        ...

    def check_load(self, root: Path, manifest: Manifest, *, host: str, wine_prefix: Path | None) -> Loaded:
        """Run the bundle's llama-server --verbose --list-devices from `root` (a copy) on this host."""
        ...


def roles_of(plan: BuildPlan, bundled: Iterable[str]) -> dict[str, str]:
    """exe for the recipe's programs, backend for the backend modules, runtime for everything else copied in."""
    roles = {n: "exe" for n in plan.programs} | {n: "backend" for n in plan.backends}
    return roles | {n: "runtime" for n in bundled if n not in roles}


def missing_error(missing: Mapping[str, Sequence[str]], *, what: str, verb: str, fix: str) -> VerifyError:
    lines = [f"{name} ({verb} by {', '.join(by)})" for name, by in missing.items()]
    return VerifyError(f"{len(missing)} {what} needed by the bundle were not found", why="missing: " + "; ".join(lines),
                       fix=fix)


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


def run_list_devices(root: Path, *, exe_name: str) -> Loaded:
    """`<exe> --verbose --list-devices` run natively from `root` in a clean environment (nothing of the
    caller's: no LD_LIBRARY_PATH, no PATH to other libraries) and its own process group (a hang ends with
    all it started)."""
    env = {"PATH": "/usr/bin:/bin", "HOME": str(root), "LANG": "C.UTF-8", "TMPDIR": str(root.parent)}
    exe = root / exe_name
    if not exe.is_file():
        raise VerifyError(f"the bundle has no {exe_name}", fix="include llama-server in the recipe's targets")
    try:
        out = proc.capture([str(exe), "--verbose", "--list-devices"], cwd=root.parent, env=env,
                           timeout=LOAD_TIMEOUT)
    except proc.Timeout:
        raise VerifyError(f"{exe_name} --list-devices did not finish in {LOAD_TIMEOUT}s") from None
    except OSError as e:
        raise VerifyError(f"{exe_name} could not be started", why=str(e)) from None
    lines = (out.stderr + out.stdout).splitlines()
    if out.returncode != 0:
        raise VerifyError(f"{exe_name} --list-devices exited with {out.returncode}",
                          why="the bundle does not load in a clean environment",
                          details="\n".join((out.stderr + out.stdout).strip().splitlines()[-20:]))
    loaded = Loaded(level="passed")
    read_list_devices(lines, root=root, loaded=loaded, exe=exe_name)
    return loaded
