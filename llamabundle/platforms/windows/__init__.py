"""Windows x86-64: PE files (`<target>.dll`, `.exe`), the PE import closure collected from the build and
the toolchain's runtime directories (never system or driver DLLs), and the load check, natively or under
Wine on Linux. The toolchains live beside it: `mingw` (cross-builds on Linux) and `msvc`."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from ...deps import elf, pe
from ...errors import VerifyError
from .. import base
from ..base import Collected, Loaded, RuntimeSources
from . import mingw, wine

if TYPE_CHECKING:
    from ...build import BuildPlan
    from ...bundle.manifest import Manifest
    from ...log import Log
    from ...recipe import Recipe


class Windows:
    name = "windows-x86_64"
    system = "windows"
    compilers: tuple[str, ...] = ("msvc", "clang", "mingw")

    def program_file(self, target: str) -> str:
        return f"{target}.exe"

    def library_file(self, target: str) -> str:
        return f"{target}.dll"

    def can_build_on(self, host: str, compiler: str) -> bool:
        """Natively, and cross-built on Linux with mingw."""
        return host == self.name or (compiler == "mingw" and host == "linux-x86_64")

    def cmake_setup(self, recipe: Recipe, build_dir: Path) -> tuple[dict[str, str], list[tuple[str, str]], list[str]]:
        if recipe.toolchain.compiler == "mingw":
            return mingw.cmake_setup(build_dir)
        return {}, [], []

    def runtime_dirs(self, recipe: Recipe) -> list[Path]:
        return mingw.runtime_dirs() if recipe.toolchain.compiler == "mingw" else []

    def collect(self, plan: BuildPlan, stage: Path, *, log: Log, sources: RuntimeSources) -> Collected:
        """The programs and backends with every DLL of their PE import closure found in the build's output or
        in the runtime directories; system and driver DLLs are never looked up or copied."""
        roots = [plan.output_dir / n for n in plan.programs + plan.backends]
        closure = pe.resolve_closure(roots, bundle_dir=plan.output_dir, extra_dirs=sources.lib_dirs)
        if closure.missing:
            raise base.missing_error(closure.missing, what="DLLs", verb="imported",
                                     fix="install the runtime that provides them on the build machine (for mingw: "
                                         "the gcc-mingw-w64-x86-64-posix-runtime and mingw-w64-x86-64-dev packages)")
        bundled = {p.name: p for p in roots} | {d.path.name: d.path for d in closure.deps
                                                if d.cls not in pe.NOT_BUNDLED and d.path is not None}
        for name, path in bundled.items():
            shutil.copyfile(path, stage / name)
        copied_in = sorted(f"{d.path.name} ({d.cls})" for d in closure.deps
                           if d.path is not None and d.path.parent != plan.output_dir)
        log.info(f"    bundled from the build: {len(bundled) - len(copied_in)}; copied from the toolchain: "
                 f"{', '.join(copied_in) or 'none'}")
        log.info(f"    system: {', '.join(closure.system_deps) or 'none'}")
        roles = base.roles_of(plan, bundled)
        if any(d.cls is pe.DllClass.MINGW_RUNTIME for d in closure.deps):
            roles |= mingw.copy_licenses(stage)
        return Collected(bundled=bundled, roles=roles, system_deps=closure.system_deps)

    def check_static(self, root: Path, manifest: Manifest) -> list[str]:
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

    def check_load(self, root: Path, manifest: Manifest, *, host: str, wine_prefix: Path | None) -> Loaded:
        if host == "linux-x86_64":
            if wine_prefix is None:
                return Loaded(level="skipped: no Wine prefix was given to load a Windows bundle on Linux in")
            return wine.check_load(root, prefix=wine_prefix)
        if host != self.name:
            return Loaded(level=f"skipped: a {manifest.platform} bundle cannot run on {host}")
        return base.run_list_devices(root, exe_name=self.program_file("llama-server"))


WINDOWS = Windows()
