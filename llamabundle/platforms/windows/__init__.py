"""Windows x86-64: PE files (`<target>.dll`, `.exe`), the PE import closure collected from the build and
the toolchain's runtime directories (never system or driver DLLs), and the load check, natively or under
Wine on Linux. The toolchains live beside it: `mingw` (cross-builds on Linux) and `msvc`."""

from __future__ import annotations

import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ...errors import UsageError, VerifyError
from .. import base, load
from ..base import Collected, HostToolchain, Products, RuntimeSources
from ..load import Loaded

if TYPE_CHECKING:
    from ...bundle.manifest import Manifest
    from ...deps import pe
    from ...log import Log
    from ...recipe import HostFacts, Recipe


class Windows:
    name = "windows-x86_64"
    system = "windows"
    preloads = False  # no LD_PRELOAD
    compilers: tuple[str, ...] = ("msvc", "clang", "mingw")
    toolchain_fields: tuple[str, ...] = ()

    def check_recipe(self, recipe: Recipe) -> None:
        return None

    def key_inputs(self, recipe: Recipe) -> dict[str, Any]:
        return {}

    def program_file(self, target: str) -> str:
        return f"{target}.exe"

    def library_file(self, target: str) -> str:
        return f"{target}.dll"

    def can_build_on(self, host: str, compiler: str) -> bool:
        """Natively, and cross-built on Linux with mingw."""
        return host == self.name or (compiler == "mingw" and host == "linux-x86_64")

    def cmake_setup(self, recipe: Recipe, build_dir: Path) -> tuple[dict[str, str], list[tuple[str, str]], list[str]]:
        from . import mingw

        if recipe.toolchain.compiler == "mingw":
            return mingw.cmake_setup(build_dir)
        return {}, [], []

    def setup_toolchain(self, recipe: Recipe, host: HostFacts, *, env: Mapping[str, str], log: Log) -> HostToolchain:
        """mingw: the cross compiler on PATH and its runtime directories. MSVC: Visual Studio found through
        vswhere in the recipe's msvc_version range, its toolset's _MSC_VER checked against the CUDA host
        range, and the vcvars64.bat environment captured (no developer prompt needed)."""
        from . import mingw

        if recipe.toolchain.compiler == "msvc":
            from . import msvc

            return msvc.host_toolchain(recipe, env=env, log=log)
        found = base.host_compiler(recipe, host, env=env, log=log)
        if recipe.toolchain.compiler != "mingw":
            return found
        return HostToolchain(compiler=found.compiler, summary=found.summary,
                             runtime_dirs=tuple((d, "mingw") for d in mingw.runtime_dirs()))

    def given_toolchain(self, recipe: Recipe, *, redist: Path | None) -> HostToolchain:
        from . import mingw

        if recipe.toolchain.compiler == "mingw":
            return HostToolchain(runtime_dirs=tuple((d, "mingw") for d in mingw.runtime_dirs()))
        if recipe.toolchain.compiler != "msvc":
            return HostToolchain()
        from . import msvc

        if redist is None:
            raise UsageError("--msvc-redist is needed for an MSVC bundle",
                             why="the MSVC CRT and OpenMP DLLs a clean Windows lacks come from Visual Studio's "
                                 "VC\\Redist\\MSVC\\<version> directory",
                             fix="pass --msvc-redist \"<Visual Studio>\\VC\\Redist\\MSVC\\<version>\"")
        dirs = msvc.redist_dirs(redist, openmp=recipe.runtime.openmp)
        return HostToolchain(runtime_dirs=tuple((d, "msvc-redist") for d in dirs),
                             summary=(f"MSVC redist: {redist}",))

    def collect(self, plan: Products, stage: Path, *, log: Log, sources: RuntimeSources) -> Collected:
        """The programs and backends with every DLL of their PE import closure, and the extras the backends
        ask for, found in the build's output or in the runtime directories (the CUDA toolkit's bin, the MSVC
        redist, the mingw sysroot); system and driver DLLs are never looked up or copied."""
        from ...deps import pe

        roots = [plan.output_dir / n for n in plan.programs + plan.backends]
        dirs = list(sources.dirs)
        closure, extras = base.closure_with_extras(
            lambda files: pe.resolve_closure(files, bundle_dir=plan.output_dir, extra_dirs=dirs),
            _bundled, roots, sources, dirs)
        if closure.missing:
            raise base.missing_error(closure.missing, what="DLLs", verb="imported",
                                     fix="install the runtime that provides them on the build machine (MSVC: the "
                                         "C++ x64 build tools' redist; CUDA: the component in cuda.components; "
                                         "mingw: the gcc-mingw-w64-x86-64-posix-runtime and mingw-w64-x86-64-dev "
                                         "packages)")
        imported = [d.name for d in closure.deps]
        if any(pe.pe_policy().classify(n) is pe.DllClass.MSVC_RUNTIME for n in imported):
            from .msvc import check_openmp

            check_openmp(imported, openmp=sources.openmp)
        bundled = _bundled(closure)
        for name, path in bundled.items():
            shutil.copyfile(path, stage / name)
        origins = {n: sources.origin_of(p, output_dir=plan.output_dir) for n, p in bundled.items()}
        copied_in = sorted(f"{n} ({o})" for n, o in origins.items() if o != "build")
        log.info(f"    bundled from the build: {len(bundled) - len(copied_in)}; copied in: {', '.join(copied_in) or 'none'}")
        log.info(f"    system: {', '.join(closure.system_deps) or 'none'}")
        roles = base.roles_of(plan, bundled)
        importers = {d.name: d.imported_by for d in closure.deps}
        return Collected(bundled=bundled, roles=roles, system_deps=closure.system_deps,
                         why=base.reasons(plan, bundled, extras=extras, importers=importers), origins=origins)

    def licenses(self, collected: Collected, stage: Path) -> dict[str, tuple[str, str]]:
        """The licence texts of the toolchain runtimes the bundle carries: name -> (origin, why)."""
        from ...deps import pe
        from . import mingw

        out: dict[str, tuple[str, str]] = {}
        kinds = {pe.pe_policy().classify(n) for n in collected.bundled}
        if pe.DllClass.MINGW_RUNTIME in kinds:
            out |= {n: ("mingw", "licence of the mingw-w64 runtime DLLs") for n in mingw.copy_licenses(stage)}
        if kinds & {pe.DllClass.MSVC_RUNTIME, pe.DllClass.OPENMP}:
            from .msvc import copy_notice

            out |= {n: ("llamabundle", "terms of the MSVC redistributable DLLs") for n in copy_notice(stage)}
        return out

    def check_static(self, root: Path, manifest: Manifest) -> list[str]:
        """The PE import closure of every .exe/.dll (imports and delay-imports, x64 only) stays inside the bundle."""
        from ...deps import elf, pe

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

    def runner(self, host: str) -> list[str] | None:
        """Natively only: under Wine a program runs through a launcher and a prefix (wine.py), not as a process
        of its own."""
        return [] if host == self.name else None

    def check_load(self, root: Path, manifest: Manifest, *, host: str, wine_prefix: Path | None,
                   keep: Mapping[str, str]) -> Loaded:
        from . import wine

        if host == "linux-x86_64":
            if wine_prefix is None:
                return Loaded(level="skipped: no Wine prefix was given to load a Windows bundle on Linux in")
            return wine.check_load(root, prefix=wine_prefix)
        if host != self.name:
            return Loaded(level=f"skipped: a {manifest.platform} bundle cannot run on {host}")
        return load.run_list_devices(root, exe_name=self.program_file("llama-server"), keep=keep)


def _bundled(closure: pe.PeClosure) -> dict[str, Path]:
    """What a PE closure puts into the bundle: the roots and every DLL found (never system or driver)."""
    from ...deps import pe

    roots = {b.path.name: b.path for b in closure.binaries}
    return roots | {d.path.name: d.path for d in closure.deps if d.cls not in pe.NOT_BUNDLED and d.path is not None}


WINDOWS = Windows()
