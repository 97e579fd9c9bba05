"""Linux on 64-bit Arm (data/linux_aarch64.json): ELF files as on x86-64 Linux, built natively on an arm64 machine
or cross-built on x86-64 with the distribution's cross toolchain and sysroot. Which one is the recipe's
toolchain.build_host (else this machine), and it is in the key with the glibc the build links against. Every CPU
variant's -march is tried on the compiler before the build; the runtime closure is resolved in the target's
libraries, never the build machine's; and on x86-64 the bundle is loaded under qemu-user."""

from __future__ import annotations

import functools
import re
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .. import compilers, data, proc
from ..errors import ToolchainError
from . import load
from .base import HostToolchain
from .linux import Linux
from .load import Loaded

if TYPE_CHECKING:
    from ..bundle.manifest import Manifest
    from ..deps.policy import Policy
    from ..log import Log
    from ..recipe import HostFacts, Recipe

TOOLCHAIN = "llamabundle-aarch64-toolchain.cmake"


def knowledge() -> dict[str, Any]:
    table: dict[str, Any] = data.load("linux_aarch64.json")
    return table


def _build_host() -> str:
    from . import host_name

    return host_name()


@functools.cache
def glibc_version(libc: Path) -> str | None:
    """The version libc.so.6 states in its banner ("… release version 2.36."), or None when it is not there."""
    try:
        text = libc.read_bytes()
    except OSError:
        return None
    m = re.search(knowledge()["glibc_banner"].encode(), text)
    return m.group(1).decode() if m else None


class LinuxAarch64(Linux):
    name = "linux-aarch64"
    elf_machine = "EM_AARCH64"
    toolchain_fields = ("build_host", "glibc")
    backends: tuple[str, ...] = ("cpu", "rpc")

    # ---------------------------------------------------------------------------------- the recipe and the key

    def check_recipe(self, recipe: Recipe) -> None:
        """The backends built for it (cpu and rpc: no Arm toolkit of another backend is known here), and a pinned
        compiler: every variant's -march must be known to it, which the key cannot tell of an unpinned one."""
        for i, b in enumerate(recipe.backends):
            if b not in self.backends:
                raise recipe.error(f"backends[{i}]", f"the {b} backend is not built for {self.name} by this version",
                                   fix="backends: [" + ", ".join(self.backends) + "]")
        if not recipe.toolchain.version:
            raise recipe.error("toolchain.version", f"a {self.name} recipe pins its compiler",
                               fix="e.g. toolchain: {compiler: clang, version: \"=19.1.7\"} (it must know every CPU "
                                   "variant's -march)")

    def build_host(self, recipe: Recipe) -> str:
        """The machine the build runs on: the recipe's toolchain.build_host, else this one."""
        return recipe.toolchain.build_host or _build_host()

    def is_cross(self, build_host: str) -> bool:
        return build_host != self.name

    def libc(self, build_host: str) -> list[Path]:
        k = knowledge()
        if self.is_cross(build_host):
            return [Path(k["cross"]["sysroot"]) / "lib" / "libc.so.6"]
        return [Path(p) for p in k["native"]["libc"]]

    def glibc(self, build_host: str) -> str | None:
        """The glibc the build links against: the sysroot's (cross) or this machine's (native)."""
        return next((v for p in self.libc(build_host) if (v := glibc_version(p))), None)

    def key_inputs(self, recipe: Recipe) -> dict[str, Any]:
        """Where it is built (native, or cross from which machine) and the glibc it links against: the recipe's
        pins, else what this machine has."""
        build_host = self.build_host(recipe)
        glibc = recipe.toolchain.glibc or self.glibc(build_host)
        if glibc is None:
            raise ToolchainError(f"{recipe.origin or recipe.name}: the cache key needs the glibc a {self.name} build "
                                 "links against", why=f"the recipe does not pin toolchain.glibc, and none of "
                                 f"{', '.join(map(str, self.libc(build_host)))} is here",
                                 fix=f"pin it (toolchain: {{glibc: \"2.36\"}}), or {self.install_hint(build_host)}")
        from ..digest import sha256_json

        # this file's knowledge (the variants' -march, the cross toolchain's layout) as the key derivation's data
        return {"build": {"host": build_host, "glibc": glibc, "knowledge": sha256_json(knowledge())[:16]}}

    def install_hint(self, build_host: str) -> str:
        return (knowledge()["cross"]["install"] if self.is_cross(build_host)
                else "install the compiler and libc6-dev")

    # ---------------------------------------------------------------------------------- building

    def can_build_on(self, host: str, compiler: str) -> bool:
        return host == self.name or host in knowledge()["cross"]["build_hosts"]

    def programs(self, recipe: Recipe, build_host: str, *, path: str | None) -> tuple[str, str]:
        """The C and C++ compilers: the cross toolchain's (clang takes --target) or the native ones, under their
        versioned names first (clang-19 for a clang =19.x pin)."""
        k = knowledge()
        table = k["cross" if self.is_cross(build_host) else "native"]["programs"]
        cc, cxx = table[recipe.toolchain.compiler]
        return compilers.versioned((cc, cxx), recipe.toolchain.version, path=path)

    def target_flags(self, recipe: Recipe, build_host: str) -> list[str]:
        """What the compiler needs on its command line to target aarch64: clang's --target on a cross build."""
        if self.is_cross(build_host) and recipe.toolchain.compiler == "clang":
            return [f"--target={knowledge()['triple']}"]
        return []

    def cmake_setup(self, recipe: Recipe, build_dir: Path) -> tuple[dict[str, str], list[tuple[str, str]], list[str]]:
        """On a cross build the CMake toolchain file: the target system and processor, clang's target triple, and
        the sysroot as the one root libraries and headers are found in (the compilers are setup_toolchain's)."""
        build_host = self.build_host(recipe)
        if not self.is_cross(build_host):
            return {}, [], []
        k = knowledge()
        toolchain = build_dir / TOOLCHAIN
        lines = [f"# Written by llamabundle (data/linux_aarch64.json): cross-build for {self.name} on {build_host}.",
                 "set(CMAKE_SYSTEM_NAME Linux)",
                 "set(CMAKE_SYSTEM_PROCESSOR aarch64)"]
        if recipe.toolchain.compiler == "clang":
            lines += [f"set(CMAKE_C_COMPILER_TARGET {k['triple']})", f"set(CMAKE_CXX_COMPILER_TARGET {k['triple']})"]
        lines += [f"set(CMAKE_FIND_ROOT_PATH {k['cross']['sysroot']})",
                  "set(CMAKE_FIND_ROOT_PATH_MODE_PROGRAM NEVER)",
                  "set(CMAKE_FIND_ROOT_PATH_MODE_LIBRARY ONLY)",
                  "set(CMAKE_FIND_ROOT_PATH_MODE_INCLUDE ONLY)",
                  "set(CMAKE_FIND_ROOT_PATH_MODE_PACKAGE ONLY)", ""]
        return {"CMAKE_TOOLCHAIN_FILE": str(toolchain)}, [(str(toolchain), "\n".join(lines))], []

    def setup_toolchain(self, recipe: Recipe, host: HostFacts, *, env: Mapping[str, str], log: Log) -> HostToolchain:
        """The build host the key names, the sysroot (cross), the pinned compiler, the pinned glibc, and every
        CPU variant's -march compiled by that compiler: a refusal names the variant before anything is built."""
        here = _build_host()
        build_host = self.build_host(recipe)
        if build_host != here:
            raise ToolchainError(f"{recipe.name} is built on {build_host} (toolchain.build_host); this machine is {here}",
                                 why="where it is built (natively or cross) is part of its cache key",
                                 fix=f"build it on a {build_host} machine, or change toolchain.build_host (a new key)")
        if not self.can_build_on(here, recipe.toolchain.compiler):
            raise ToolchainError(f"{self.name} bundles cannot be built on {here}")
        hint = self.install_hint(build_host)
        cc, cxx = self.programs(recipe, build_host, path=env.get("PATH"))
        if self.is_cross(build_host) and not Path(knowledge()["cross"]["sysroot"]).is_dir():
            raise ToolchainError(f"the {self.name} sysroot {knowledge()['cross']['sysroot']} is missing",
                                 why="a cross build links against the target's libraries", fix=hint)
        found = compilers.check_host(recipe.toolchain.compiler, pin=recipe.toolchain.version, keyed=host.compiler,
                                     env=env, program=cxx)
        glibc = self.glibc(build_host)
        if glibc is None:
            raise ToolchainError(f"cannot tell the glibc version of {', '.join(map(str, self.libc(build_host)))}",
                                 fix=hint)
        if recipe.toolchain.glibc and glibc != recipe.toolchain.glibc:
            raise ToolchainError(f"the build would link against glibc {glibc}, not the recipe's toolchain.glibc "
                                 f"{recipe.toolchain.glibc}", why="the glibc sets the bundle's floor and is in its key",
                                 fix="use a sysroot (or machine) with that glibc, or change toolchain.glibc (a new key)")
        self.check_variants(recipe, cc, build_host, env=env)
        how = f"cross-built on {build_host}" if self.is_cross(build_host) else "native"
        lines = (f"compiler: {recipe.toolchain.compiler} {found} ({cxx}; key: {recipe.toolchain.version})",
                 f"target: {self.name}, {how}, glibc {glibc}")
        for line in lines:
            log.info(f"    {line}")
        record = {"build_host": build_host, "glibc": glibc,
                  **({"cross_target": knowledge()["triple"]} if self.is_cross(build_host) else {})}
        return HostToolchain(compiler=found, summary=lines, record=record, compilers=(cc, cxx))

    def check_variants(self, recipe: Recipe, cc: str, build_host: str, *, env: Mapping[str, str]) -> None:
        """Each CPU variant the recipe builds, compiled (an empty file) with its -march: ggml's configure would
        only fail half-way through the build, or not at all where it tests flags quietly."""
        marchs = knowledge()["cpu_variants"]
        built = ([v for v in recipe.all_cpu_variants() if v not in recipe.cpu_variants.exclude]
                 if recipe.cmake_options.get("GGML_CPU_ALL_VARIANTS") == "ON" else [])
        with tempfile.TemporaryDirectory(prefix="llamabundle-march-") as tmp:
            src = Path(tmp) / "empty.c"
            src.write_text("int llamabundle_march_check;\n", encoding="utf-8")
            for variant in built:
                argv = [cc, *self.target_flags(recipe, build_host), f"-march={marchs[variant]}", "-c", str(src),
                        "-o", str(Path(tmp) / "empty.o")]
                try:
                    res = proc.capture(argv, env={**env, "LC_ALL": "C"}, timeout=60)
                except (OSError, proc.Timeout) as e:
                    raise ToolchainError(f"{cc} could not be run", why=str(e), fix=self.install_hint(build_host)) from None
                if res.returncode != 0:
                    said = next((ln for ln in res.stderr.splitlines() if "error" in ln), res.stderr.strip()[-200:])
                    raise ToolchainError(f"{cc} cannot build the CPU variant {variant} (-march={marchs[variant]})",
                                         why=said.strip(),
                                         fix="use a compiler that knows it (Debian 12's gcc 12 does not know "
                                             "armv9.2-a; clang 19 does), or leave the variant out: "
                                             f"cpu_variants: {{exclude: [{variant}]}} (a new key)")

    def library_dirs(self, policy: Policy) -> list[Path]:
        """The target's libraries: the sysroot's on a cross build (never this x86-64 machine's own), else this
        machine's loader paths and the usual arm64 directories."""
        k = knowledge()
        if self.is_cross(_build_host()):
            return [Path(d) for d in k["cross"]["system_dirs"]]
        return [*super().library_dirs(policy), *(Path(d) for d in k["native"]["system_dirs"])]

    # ---------------------------------------------------------------------------------- loading

    def emulator(self, *, cpu: str | None = None) -> tuple[list[str] | None, str]:
        """How this machine runs the bundle's programs under qemu-user (the argv prefix), or None with why not."""
        k = knowledge()
        qemu = shutil.which(k["qemu"]["program"])
        if qemu is None:
            return None, f"{k['qemu']['program']} is not installed ({k['qemu']['install']})"
        sysroot = k["cross"]["sysroot"]
        if not (Path(sysroot) / "lib" / "libc.so.6").is_file():
            return None, f"the {self.name} libc is not in {sysroot} ({k['cross']['install']})"
        return [qemu, "-cpu", cpu or k["qemu"]["cpu"], "-L", sysroot], ""

    def runner(self, host: str) -> list[str] | None:
        if host == self.name:
            return []
        return self.emulator()[0] if host in knowledge()["cross"]["build_hosts"] else None

    def check_load(self, root: Path, manifest: Manifest, *, host: str, wine_prefix: Path | None,
                   keep: Mapping[str, str]) -> Loaded:
        """Natively on an arm64 machine; on x86-64 under qemu-user with the sysroot's loader and libc, saying so."""
        if host == self.name:
            return load.run_list_devices(root, exe_name=self.program_file("llama-server"), keep=keep)
        if host not in knowledge()["cross"]["build_hosts"]:
            return Loaded(level=f"skipped: a {manifest.platform} bundle cannot run on {host}")
        return self.load_emulated(root, keep=keep)

    def load_emulated(self, root: Path, *, keep: Mapping[str, str], cpu: str | None = None) -> Loaded:
        """The load check under qemu-user (`cpu`: the CPU model QEMU shows; default max, every feature it has,
        so the best variant must load), or skipped with why where qemu or the target's libc is missing."""
        exe = self.program_file("llama-server")
        runner, why = self.emulator(cpu=cpu)
        if runner is None:
            return Loaded(level=f"skipped: {why}")
        loaded = load.run_list_devices(root, exe_name=exe, keep=keep, runner=runner)
        loaded.level = f"passed (under {' '.join([Path(runner[0]).name, *runner[1:]])})"
        return loaded


LINUX_AARCH64 = LinuxAarch64()

