"""PE import closure (pefile): the imports and delay-imports of x64 Windows binaries, walked through a
bundle directory and optional extra directories, each DLL classed by data (data/pe_policy.json)."""

from __future__ import annotations

import fnmatch
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from functools import cache
from pathlib import Path
from typing import Any

import pefile

from .. import data
from ..errors import VerifyError

MACHINES = {0x8664: "AMD64", 0x14C: "I386", 0xAA64: "ARM64", 0x1C4: "ARMNT", 0x200: "IA64"}
_DIRECTORIES = [pefile.DIRECTORY_ENTRY["IMAGE_DIRECTORY_ENTRY_IMPORT"],
                pefile.DIRECTORY_ENTRY["IMAGE_DIRECTORY_ENTRY_DELAY_IMPORT"]]


class DllClass(StrEnum):
    SYSTEM = "system"  # part of every supported Windows; never bundled
    DRIVER = "driver"  # installed by the GPU driver; never bundled, recorded in system_deps
    MSVC_RUNTIME = "msvc_runtime"  # from the MSVC redist (Microsoft.VC14x.CRT)
    OPENMP = "openmp"  # vcomp140.dll or libomp140.x86_64.dll
    CUDA_RUNTIME = "cuda_runtime"  # from the CUDA toolkit's bin
    MINGW_RUNTIME = "mingw_runtime"  # from the mingw sysroot
    BUNDLED = "bundled"  # found in the bundle directory
    MISSING = "missing"  # found nowhere: the binary would not load


NOT_BUNDLED = (DllClass.SYSTEM, DllClass.DRIVER)
_NAMED = (DllClass.DRIVER, DllClass.SYSTEM, DllClass.MSVC_RUNTIME, DllClass.OPENMP, DllClass.CUDA_RUNTIME,
          DllClass.MINGW_RUNTIME)  # the classes a name alone decides, in the order they are tried


@dataclass(frozen=True, kw_only=True)
class PePolicy:
    patterns: tuple[tuple[DllClass, tuple[str, ...]], ...]  # lower-case fnmatch patterns per class

    def classify(self, name: str) -> DllClass | None:
        """The class a DLL name alone decides, or None for a library the project itself provides."""
        low = name.lower()
        for cls, patterns in self.patterns:
            if any(fnmatch.fnmatchcase(low, p) for p in patterns):
                return cls
        return None


@cache
def pe_policy() -> PePolicy:
    raw = data.load("pe_policy.json")
    patterns = tuple((cls, tuple(p.lower() for p in raw[cls.value])) for cls in _NAMED)
    policy = PePolicy(patterns=patterns)
    for driver in raw["driver"]:  # a driver DLL must never be mistaken for a system one
        assert policy.classify(driver) is DllClass.DRIVER, driver
        assert not any(fnmatch.fnmatchcase(driver.lower(), p) for p in dict(patterns)[DllClass.SYSTEM]), driver
    return policy


@dataclass(frozen=True, kw_only=True)
class PeInfo:
    path: Path
    machine: str  # AMD64, I386, ARM64, ...
    dll: bool
    imports: tuple[str, ...]  # DLL names as the import table spells them
    delay_imports: tuple[str, ...]


def is_pe(path: Path) -> bool:
    """An MZ header whose e_lfanew points at a PE signature."""
    try:
        with open(path, "rb") as f:
            head = f.read(64)
            if len(head) < 64 or head[:2] != b"MZ":
                return False
            f.seek(struct.unpack_from("<I", head, 0x3C)[0])
            return f.read(4) == b"PE\0\0"
    except OSError:
        return False


def read_pe(path: Path, *, require_x64: bool = True) -> PeInfo:
    """Machine type, imports and delay-imports (only those data directories are parsed)."""
    try:
        pe = pefile.PE(str(path), fast_load=True)
    except (pefile.PEFormatError, OSError) as e:
        raise VerifyError(f"{path.name} is not a readable PE file", why=str(e), fix="rebuild it") from None
    try:
        machine = MACHINES.get(pe.FILE_HEADER.Machine, hex(pe.FILE_HEADER.Machine))
        if require_x64 and machine != "AMD64":
            raise VerifyError(f"{path.name} is a {machine} PE file, not x64 (AMD64)",
                              why="a windows-x86_64 bundle can load only 64-bit x64 binaries", fix="rebuild it for x64")
        try:
            pe.parse_data_directories(directories=_DIRECTORIES)
        except (pefile.PEFormatError, struct.error, ValueError) as e:
            raise VerifyError(f"{path.name} has an unreadable import table", why=str(e), fix="rebuild it") from None
        names = [tuple(e.dll.decode("ascii", "replace") for e in getattr(pe, attr, ()))
                 for attr in ("DIRECTORY_ENTRY_IMPORT", "DIRECTORY_ENTRY_DELAY_IMPORT")]
        return PeInfo(path=path, machine=machine, dll=pe.is_dll(), imports=names[0], delay_imports=names[1])
    finally:
        pe.close()


@dataclass(frozen=True, kw_only=True)
class Dep:
    name: str  # as first seen in an import table
    cls: DllClass
    kind: DllClass | None  # what the name says it is (cuda_runtime for a bundled cudart64_12.dll); None: the project's own
    path: Path | None  # where it was found (None: system, driver, missing)
    imported_by: tuple[str, ...]
    delay_only: bool  # only ever delay-loaded

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "class": self.cls.value, "kind": self.kind.value if self.kind else None,
                "path": str(self.path) if self.path else None, "imported_by": list(self.imported_by),
                "delay_only": self.delay_only}


@dataclass(frozen=True, kw_only=True)
class PeClosure:
    binaries: tuple[PeInfo, ...]  # every PE file read: the roots, then what they pulled in
    deps: tuple[Dep, ...]  # sorted by lower-case name

    def of_class(self, cls: DllClass) -> tuple[Dep, ...]:
        return tuple(d for d in self.deps if d.cls is cls)

    @property
    def missing(self) -> dict[str, tuple[str, ...]]:
        """Each DLL found nowhere -> the binaries that import it."""
        return {d.name: d.imported_by for d in self.of_class(DllClass.MISSING)}

    @property
    def system_deps(self) -> list[str]:
        """System and driver DLLs the bundle relies on (bundle.json `system_deps`)."""
        return sorted((d.name for d in self.deps if d.cls in NOT_BUNDLED), key=str.lower)

    def to_json(self) -> dict[str, Any]:
        return {"schema": 1, "format": "pe",
                "binaries": [{"path": str(b.path), "machine": b.machine, "dll": b.dll, "imports": list(b.imports),
                              "delay_imports": list(b.delay_imports)} for b in self.binaries],
                "deps": [d.to_json() for d in self.deps],
                "missing": {k: list(v) for k, v in self.missing.items()}, "system_deps": self.system_deps}


def _listing(d: Path) -> dict[str, Path]:
    return {f.name.lower(): f for f in sorted(d.iterdir()) if f.is_file()} if d.is_dir() else {}


def resolve_closure(roots: Sequence[Path], *, bundle_dir: Path, extra_dirs: Sequence[Path] = (),
                    policy: PePolicy | None = None) -> PeClosure:
    """Walk imports and delay-imports from the roots. A DLL name is, in order: driver or system (by name,
    never looked up), bundled (a file in bundle_dir), found in the first extra dir that has an x64 copy
    (classed by name; `bundled` for an unclassed name), or missing. Found DLLs are walked in turn."""
    policy = policy or pe_policy()
    in_bundle = _listing(bundle_dir)
    extras = [_listing(d) for d in extra_dirs]
    infos: dict[str, PeInfo] = {}
    spelled: dict[str, str] = {}
    where: dict[str, tuple[DllClass, DllClass | None, Path | None]] = {}
    importers: dict[str, set[str]] = {}
    eager: set[str] = set()
    queue = list(roots)
    while queue:
        path = queue.pop(0)
        if path.name.lower() in infos:
            continue
        info = infos[path.name.lower()] = read_pe(path)
        for dep, delayed in [(d, False) for d in info.imports] + [(d, True) for d in info.delay_imports]:
            low = dep.lower()
            spelled.setdefault(low, dep)
            importers.setdefault(low, set()).add(path.name)
            if not delayed:
                eager.add(low)
            if low in where:
                continue
            kind = policy.classify(dep)
            if kind in NOT_BUNDLED:
                where[low] = (kind, kind, None)
            elif low in in_bundle:
                where[low] = (DllClass.BUNDLED, kind, in_bundle[low])
                queue.append(in_bundle[low])
            elif (found := _first_x64(low, extras)) is not None:
                where[low] = (kind or DllClass.BUNDLED, kind, found)
                queue.append(found)
            else:
                where[low] = (DllClass.MISSING, kind, None)
    deps = tuple(Dep(name=spelled[low], cls=cls, kind=kind, path=p, imported_by=tuple(sorted(importers[low], key=str.lower)),
                     delay_only=low not in eager) for low, (cls, kind, p) in sorted(where.items()))
    return PeClosure(binaries=tuple(infos.values()), deps=deps)


def _first_x64(low: str, listings: Sequence[dict[str, Path]]) -> Path | None:
    for listing in listings:
        f = listing.get(low)
        if f is not None and is_pe(f):
            try:
                if read_pe(f, require_x64=False).machine == "AMD64":
                    return f
            except VerifyError:
                continue
    return None
