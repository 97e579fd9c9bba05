"""What every target platform answers: how its files are named, which compilers build for it, where a
build's runtime libraries come from and how they are collected into a bundle, how a bundle is checked
statically and loaded. The pipeline, the build plan and verify ask a platform; they never test a
platform's name."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, runtime_checkable

from ..data import MEMORY_PROGRAM, PROBE_PROGRAM
from ..errors import VerifyError
from .load import Loaded

# Why llamabundle's own programs (data/programs, built into every bundle) are in a bundle
OWN_PROGRAMS = {MEMORY_PROGRAM: "program: llama.cpp's dry run of a llama-server launch, for `llamabundle plan`",
                PROBE_PROGRAM: "program: which backends load here and why not, and their devices, as JSON"}

if TYPE_CHECKING:
    from ..bundle.manifest import Manifest
    from ..log import Log
    from ..recipe import HostFacts, Recipe

@dataclass(frozen=True, kw_only=True)
class Products:
    """What a build made that goes into the bundle: the recipe's programs and the backend modules (file names)
    in the build's output directory."""
    output_dir: Path
    programs: tuple[str, ...]
    backends: tuple[str, ...]


@dataclass(frozen=True, kw_only=True)
class Extra:
    """A library to bundle that no import entry of the bundle names (a run-time companion, a library the
    recipe asks for), and why it is there."""
    path: Path
    why: str


def no_extras(bundled: Mapping[str, Path], lib_dirs: Sequence[Path]) -> list[Extra]:
    return []


@dataclass(frozen=True, kw_only=True)
class RuntimeSources:
    """Where a build's runtime libraries may be taken from beyond its own output directory (the backends'
    toolkits, the toolchain's runtime directories: each with the origin bundle.json records for what comes
    from it), searched before the system's, and the extra libraries that must come along with what is
    bundled (asked of the backends, given what is bundled so far and the directories)."""
    lib_dirs: tuple[tuple[Path, str], ...] = ()
    extras: Callable[[Mapping[str, Path], Sequence[Path]], list[Extra]] = no_extras
    openmp: str = "auto"  # the recipe's runtime.openmp: the OpenMP runtime the bundle may carry

    @property
    def dirs(self) -> tuple[Path, ...]:
        return tuple(d for d, _ in self.lib_dirs)

    def origin_of(self, path: Path, *, output_dir: Path) -> str:
        """build (the build's own output), the origin of the runtime directory it lies in, else system."""
        if path.parent == output_dir:
            return "build"
        return next((origin for d, origin in self.lib_dirs if path.parent == d or path.is_relative_to(d)), "system")


@dataclass(frozen=True, kw_only=True)
class HostToolchain:
    """What the platform set up for the recipe's compiler before a build (or, for `bundle`, what it was
    told): the compiler version found (checked against the key), the variables laid over the build's
    environment (MSVC: what vcvars64.bat sets), the toolchain's runtime directories with their origin,
    the lines `show` and the log print, and what bundle.json's toolchain record adds (how it was built: a cross
    build's host and target, the glibc it linked against)."""
    compiler: str | None = None
    env: Mapping[str, str] = field(default_factory=dict)
    runtime_dirs: tuple[tuple[Path, str], ...] = ()
    summary: tuple[str, ...] = ()
    record: Mapping[str, str] = field(default_factory=dict)
    compilers: tuple[str, str] | None = None  # the C and C++ programs CMake is told to use (None: the family's own)


@dataclass(frozen=True, kw_only=True)
class Collected:
    """What collecting put into a bundle's stage directory."""
    bundled: Mapping[str, Path]  # file name in the bundle -> where it came from
    roles: Mapping[str, str]  # file name -> exe | backend | runtime | license
    system_deps: list[str]  # the system (and driver) libraries the bundle's binaries import
    glibc_floor: str | None = None
    why: Mapping[str, str] = field(default_factory=dict)  # file name -> why it is in the bundle
    origins: Mapping[str, str] = field(default_factory=dict)  # file name -> build | toolkit | msvc-redist | ...


@runtime_checkable
class Platform(Protocol):
    """One target platform. Implementations are module-level singletons registered in `platforms`."""

    name: str  # linux-x86_64, windows-x86_64: as recipes and bundle.json name it
    system: str  # linux, windows: the OS half of the name
    compilers: tuple[str, ...]  # the toolchain.compiler values a recipe for this platform may pick
    toolchain_fields: tuple[str, ...]  # the toolchain fields only some platforms take that it takes (build_host, glibc)
    preloads: bool  # its programs can be given a library before their own (LD_PRELOAD): RPC's ops level needs it

    def check_recipe(self, recipe: Recipe) -> None:
        """The recipe's rules this platform knows (its backends, its toolchain fields): raises recipe.error(…)."""
        ...

    def key_inputs(self, recipe: Recipe) -> dict[str, Any]:
        """The entries it adds to the key inputs (none for most: the keys of their recipes stay as they were);
        raises ToolchainError when the key needs something of this machine it lacks."""
        ...

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

    def setup_toolchain(self, recipe: Recipe, host: HostFacts, *, env: Mapping[str, str], log: Log) -> HostToolchain:
        """Before a build: find the recipe's compiler, check it against the key (and, for CUDA, against the
        host compilers the toolkit accepts), and say which environment and runtime directories it uses.
        Raises ToolchainError with the fix before anything is built."""
        ...

    def given_toolchain(self, recipe: Recipe, *, redist: Path | None) -> HostToolchain:
        """For `bundle` (a build made elsewhere): the toolchain's runtime directories, from `redist` where
        the platform needs them named (the MSVC redist), else found here."""
        ...

    def collect(self, plan: Products, stage: Path, *, log: Log, sources: RuntimeSources) -> Collected:
        """Copy the build's programs and backends into `stage` with the import closure of runtime libraries
        they need (never the system's or the driver's), and say what each file is."""
        ...

    def licenses(self, collected: Collected, stage: Path) -> dict[str, tuple[str, str]]:
        """Copy the licence texts of the toolchain runtimes the bundle carries into `stage`: name -> (origin, why)."""
        ...

    def check_static(self, root: Path, manifest: Manifest) -> list[str]:
        """Every import of every binary of an unpacked bundle resolves inside it, in the system set or the
        driver set; raises VerifyError naming the first that does not. Returns the system imports."""
        ...

    def runner(self, host: str) -> list[str] | None:
        """How `host` runs this platform's programs as plain processes: [] natively, an emulator's argv prefix
        (qemu-aarch64 …), or None where it cannot (what a backend's own load check asks: RPC's server)."""
        ...

    def check_load(self, root: Path, manifest: Manifest, *, host: str, wine_prefix: Path | None,
                   keep: Mapping[str, str]) -> Loaded:
        """Run the bundle's llama-server --verbose --list-devices from `root` (a copy) on this host, in a clean
        environment but for `keep` (the caller's variables the bundle's backends read: their driver lookup)."""
        ...


C = TypeVar("C")


def closure_with_extras(resolve: Callable[[list[Path]], C], bundled_of: Callable[[C], Mapping[str, Path]],
                        roots: Sequence[Path], sources: RuntimeSources,
                        dirs: Sequence[Path]) -> tuple[C, dict[str, str]]:
    """The import closure of the roots and of every extra library the backends ask for given what is
    bundled so far (a companion's own companions too), until nothing new is asked for. Returns the last
    closure and, for each extra, why it is there."""
    extras: dict[str, Extra] = {}
    while True:
        closure = resolve([*roots, *(e.path for e in extras.values())])
        new = [e for e in sources.extras(bundled_of(closure), dirs) if e.path.name not in extras]
        if not new:
            return closure, {name: e.why for name, e in extras.items()}
        extras.update({e.path.name: e for e in new})


def reasons(plan: Products, bundled: Iterable[str], *, extras: Mapping[str, str],
            importers: Mapping[str, Sequence[str]]) -> dict[str, str]:
    """Why each collected file is in the bundle: a program or backend of the recipe, an extra (its own
    reason), or imported by the files that import it."""
    lower = {k.lower(): v for k, v in importers.items()}
    out: dict[str, str] = {}
    for name in bundled:
        if name in plan.programs and name.split(".")[0] in OWN_PROGRAMS:
            out[name] = OWN_PROGRAMS[name.split(".")[0]]
        elif name in plan.programs:
            out[name] = "program: a target of the recipe"
        elif name in plan.backends:
            out[name] = "backend module: loaded by ggml at run time"
        elif name in extras:
            out[name] = extras[name]
        else:
            by = lower.get(name.lower(), ())
            out[name] = f"imported by {', '.join(by)}" if by else "imported"
    return out


def host_compiler(recipe: Recipe, host: HostFacts, *, env: Mapping[str, str], log: Log) -> HostToolchain:
    """A compiler found on PATH (gcc, clang, mingw): the one the key names (compilers.check_host)."""
    from ..compilers import check_host

    found = check_host(recipe.toolchain.compiler, pin=recipe.toolchain.version, keyed=host.compiler, env=env)
    line = f"compiler: {recipe.toolchain.compiler} {found} (key: {recipe.toolchain.version or '=' + found})"
    log.info(f"    {line}")
    return HostToolchain(compiler=found, summary=(line,))


def roles_of(plan: Products, bundled: Iterable[str]) -> dict[str, str]:
    """exe for the recipe's programs, backend for the backend modules, runtime for everything else copied in."""
    roles = {n: "exe" for n in plan.programs} | {n: "backend" for n in plan.backends}
    return roles | {n: "runtime" for n in bundled if n not in roles}


def missing_error(missing: Mapping[str, Sequence[str]], *, what: str, verb: str, fix: str) -> VerifyError:
    lines = [f"{name} ({verb} by {', '.join(by)})" for name, by in missing.items()]
    return VerifyError(f"{len(missing)} {what} needed by the bundle were not found", why="missing: " + "; ".join(lines),
                       fix=fix)


