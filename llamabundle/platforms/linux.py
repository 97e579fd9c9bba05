"""Linux x86-64: ELF files (`lib<target>.so`), the shared-library closure collected from the build and the
system (never the driver's libraries), RUNPATH $ORIGIN, and llama-server run natively to load the bundle."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import VerifyError
from . import base, load
from .base import Collected, HostToolchain, Products, RuntimeSources
from .load import Loaded

if TYPE_CHECKING:
    from ..bundle.manifest import Manifest
    from ..deps.policy import Policy
    from ..log import Log
    from ..recipe import HostFacts, Recipe


class Linux:
    name = "linux-x86_64"
    system = "linux"
    compilers: tuple[str, ...] = ("gcc", "clang")
    elf_machine = "EM_X86_64"  # every ELF file of its bundles is for this machine
    preloads = True  # LD_PRELOAD
    toolchain_fields: tuple[str, ...] = ()  # the toolchain: fields only some platforms take (build_host, glibc)

    def check_recipe(self, recipe: Recipe) -> None:
        return None

    def key_inputs(self, recipe: Recipe) -> dict[str, Any]:
        return {}

    def library_dirs(self, policy: Policy) -> list[Path]:
        """Where the closure looks for the system libraries the build's files need: this machine's loader paths."""
        from ..deps import elf

        return elf.system_library_dirs(policy, ldconfig_output=elf.ldconfig_cache())

    def program_file(self, target: str) -> str:
        return target

    def library_file(self, target: str) -> str:
        return f"lib{target}.so"

    def can_build_on(self, host: str, compiler: str) -> bool:
        return host == self.name


    def cmake_setup(self, recipe: Recipe, build_dir: Path) -> tuple[dict[str, str], list[tuple[str, str]], list[str]]:
        return {}, [], []

    def setup_toolchain(self, recipe: Recipe, host: HostFacts, *, env: Mapping[str, str], log: Log) -> HostToolchain:
        return base.host_compiler(recipe, host, env=env, log=log)

    def given_toolchain(self, recipe: Recipe, *, redist: Path | None) -> HostToolchain:
        return HostToolchain()

    def collect(self, plan: Products, stage: Path, *, log: Log, sources: RuntimeSources) -> Collected:
        from ..deps import elf
        from ..deps.policy import linux_policy

        policy = linux_policy()
        roots = [plan.output_dir / n for n in plan.programs + plan.backends]
        lib_dirs = [*sources.dirs, *self.library_dirs(policy)]
        # with the libraries loaded at run time without a DT_NEEDED entry (cuBLASLt's NVRTC, NVRTC's builtins)
        closure, extras = base.closure_with_extras(
            lambda files: elf.resolve_closure(files, products=[plan.output_dir], policy=policy, system_dirs=lib_dirs),
            lambda c: c.bundled, roots, sources, lib_dirs)
        products = {p.name for p in plan.output_dir.iterdir()}
        copied_in = sorted(n for n, p in closure.bundled.items() if n not in products)
        log.info(f"    bundled from the build: {len(closure.bundled) - len(copied_in)}; "
                 f"copied from the system: {', '.join(copied_in) or 'none'}")
        log.info(f"    system: {', '.join(closure.system) or 'none'}; driver: {', '.join(closure.driver) or 'none'}")
        if closure.missing:
            raise base.missing_error(closure.missing, what="libraries", verb="needed",
                                     fix="install them on the build machine (they are then copied into the bundle)")
        elf.apply_closure(closure, stage, log=log)
        return Collected(bundled=closure.bundled, roles=base.roles_of(plan, closure.bundled),
                         system_deps=closure.system_deps, glibc_floor=closure.glibc_floor,
                         why=base.reasons(plan, closure.bundled, extras=extras, importers=closure.needed_by),
                         origins={n: sources.origin_of(p, output_dir=plan.output_dir) for n, p in closure.bundled.items()})

    def licenses(self, collected: Collected, stage: Path) -> dict[str, tuple[str, str]]:
        return {}

    def check_static(self, root: Path, manifest: Manifest) -> list[str]:
        """Every DT_NEEDED of every ELF file is in the bundle or a system or driver library; RUNPATH is $ORIGIN."""
        from ..deps import elf
        from ..deps.policy import LibClass, linux_policy

        policy = linux_policy()
        present = {f.path for f in manifest.files}
        for entry in manifest.files:
            f = root / entry.path
            if not elf.is_elf(f):
                continue
            info = elf.read_elf(f)
            if info.machine != self.elf_machine:
                raise VerifyError(f"{entry.path} is built for {info.machine}, not {self.elf_machine}",
                                  why=f"a {self.name} bundle holds {self.elf_machine} binaries only",
                                  fix="rebuild the bundle")
            for dep in info.needed:
                if dep in present or policy.classify(dep) is not LibClass.OTHER:
                    continue
                raise VerifyError(f"{entry.path} needs {dep}, which is neither in the bundle nor a system or driver "
                                  "library", why="the bundle would fail to load on a clean machine",
                                  fix="rebuild the bundle")
            bad = [p for p in info.runpath if p not in ("$ORIGIN", "${ORIGIN}")]
            if bad:
                raise VerifyError(f"{entry.path} has RUNPATH {':'.join(info.runpath)}",
                                  why="only $ORIGIN keeps a bundle relocatable", fix="rebuild the bundle")
        return list(manifest.system_deps)

    def runner(self, host: str) -> list[str] | None:
        return [] if host == self.name else None

    def check_load(self, root: Path, manifest: Manifest, *, host: str, wine_prefix: Path | None,
                   keep: Mapping[str, str]) -> Loaded:
        if host != self.name:
            return Loaded(level=f"skipped: a {manifest.platform} bundle cannot run on {host}")
        return load.run_list_devices(root, exe_name=self.program_file("llama-server"), keep=keep)


LINUX = Linux()
