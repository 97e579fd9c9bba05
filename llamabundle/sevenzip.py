"""A 7z archive inside a Windows self-extractor (a PE stub, then the archive), read without running it: where
the archive starts (the first 7z signature header whose CRC is right and whose next header lies in the file),
its members with every name checked (no absolute path, drive, stream, NUL or '..'), and exactly the chosen
members extracted with a 7-Zip program when one is on PATH (7zz, 7z, 7zr), else with py7zr reading the
archive from its offset. What is extracted is checked: regular files only, exactly those asked for."""

from __future__ import annotations

import io
import lzma
import os
import shutil
import struct
import zlib
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

try:  # a dependency, but only the CUDA installer source needs it: the rest of the tool works without it
    import py7zr
    import py7zr.exceptions
except ImportError:  # pragma: no cover - exercised where py7zr is absent
    py7zr = None  # type: ignore[assignment]

from . import proc
from .errors import ToolchainError
from .log import Log

SIGNATURE = b"7z\xbc\xaf\x27\x1c"  # 7z signature header: 6 bytes, then version, start header CRC, next header
SIGNATURE_HEADER_SIZE = 32
SEVEN_ZIP_PROGRAMS = ("7zz", "7z", "7zr")
EXTRACT_TIMEOUT_S = 3600


def seven_zip_program() -> str | None:
    """The first 7-Zip program on PATH (7zz, 7z, 7zr), or None (py7zr is used then)."""
    for name in SEVEN_ZIP_PROGRAMS:
        found = shutil.which(name)
        if found:
            return found
    return None


def find_7z_offset(exe: Path, *, limit: int) -> int:
    """Where the 7z archive starts inside the self-extractor: the first 7z signature after the PE stub
    whose start header CRC is right and whose next header lies inside the file."""
    size = exe.stat().st_size
    with open(exe, "rb") as f:
        if f.read(2) != b"MZ":
            raise ToolchainError(f"{exe.name} is not a Windows executable",
                                 why="a 7-Zip self-extractor is a PE stub (MZ) and then a 7z archive",
                                 fix="pass the self-extracting installer itself")
        pos, tail = 2, b""
        end = min(size, limit)
        while pos < end:
            f.seek(pos)
            chunk = f.read(min(1 << 20, end - pos))
            if not chunk:
                break
            buf = tail + chunk
            base = pos - len(tail)
            i = buf.find(SIGNATURE)
            while i >= 0:
                at = base + i
                if _valid_signature_header(f, at, size):
                    return at
                i = buf.find(SIGNATURE, i + 1)
            tail = buf[-(len(SIGNATURE) - 1):]
            pos += len(chunk)
    raise ToolchainError(f"no 7-Zip archive found in {exe.name}",
                         why=f"no valid 7z signature header in its first {min(size, limit):,} bytes",
                         fix="pass a self-extracting installer that holds its files (not a network installer)")


def _valid_signature_header(f: io.BufferedReader, at: int, size: int) -> bool:
    here = f.tell()
    try:
        f.seek(at)
        hdr = f.read(SIGNATURE_HEADER_SIZE)
    finally:
        f.seek(here)
    if len(hdr) != SIGNATURE_HEADER_SIZE or hdr[6] != 0:  # major version 0
        return False
    (start_crc,) = struct.unpack_from("<I", hdr, 8)
    if zlib.crc32(hdr[12:32]) != start_crc:
        return False
    next_ofs: int
    next_size: int
    next_ofs, next_size, _ = struct.unpack_from("<QQI", hdr, 12)
    return 0 < next_size and at + SIGNATURE_HEADER_SIZE + next_ofs + next_size <= size


class _Window(io.RawIOBase):
    """The file from `offset` on, as a file of its own (what py7zr reads)."""

    def __init__(self, f: io.BufferedReader, offset: int) -> None:
        super().__init__()
        self._f, self._offset, self._pos = f, offset, 0
        self._size = os.fstat(f.fileno()).st_size - offset

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = io.SEEK_SET) -> int:
        new = {io.SEEK_SET: pos, io.SEEK_CUR: self._pos + pos, io.SEEK_END: self._size + pos}[whence]
        if new < 0:
            raise OSError(f"seek to {new}: before the archive start")
        self._pos = new
        return new

    def readinto(self, b: Any) -> int:
        self._f.seek(self._offset + self._pos)
        n = self._f.readinto(b) or 0
        self._pos += n
        return n


@contextmanager
def open_7z(exe: Path, offset: int) -> Iterator[Any]:
    """py7zr's SevenZipFile over the archive that starts at `offset` of the .exe."""
    with open(exe, "rb") as raw:
        window = io.BufferedReader(_Window(raw, offset), buffer_size=1 << 20)
        try:
            ar = py7zr.SevenZipFile(window, mode="r")
        except _PY7ZR_ERRORS as e:
            raise ToolchainError(f"{exe.name}: the 7z archive at offset {offset:,} cannot be read", why=_short(e),
                                 fix="the file is damaged or not the installer it should be; download it again") from None
        try:
            yield ar
        finally:
            ar.close()


_PY7ZR_ERRORS: tuple[type[BaseException], ...] = (OSError, EOFError, lzma.LZMAError, ValueError, KeyError, IndexError)
if py7zr is not None:
    _PY7ZR_ERRORS = (py7zr.exceptions.ArchiveError, OSError, EOFError, lzma.LZMAError, ValueError, KeyError, IndexError,
                     struct.error)


@dataclass(frozen=True)
class Member:
    name: str  # as stored (what py7zr and 7-Zip are asked for)
    path: PurePosixPath  # checked, with forward slashes
    is_dir: bool
    is_link: bool
    size: int


def safe_member(name: str, exe: Path) -> PurePosixPath:
    norm = name.replace("\\", "/")
    p = PurePosixPath(norm)
    bad = ("an empty name" if not norm.strip("/") else
           "an absolute path" if norm.startswith("/") or p.is_absolute() else
           "a drive letter or stream name (':')" if ":" in norm else
           "a NUL character" if "\0" in norm else
           "'..'" if ".." in p.parts else "")
    if bad:
        raise ToolchainError(f"{exe.name}: member '{name}' has {bad}",
                             why="an installer member may only write inside the directory it is extracted to",
                             fix="do not use this installer")
    return p


def list_members(ar: Any, exe: Path) -> list[Member]:
    """Every member, each name checked (one unsafe name refuses the whole installer)."""
    out = []
    for f in ar.files:
        path = safe_member(f.filename, exe)
        out.append(Member(name=f.filename, path=path, is_dir=bool(f.is_directory),
                          is_link=bool(f.is_symlink or getattr(f, "is_junction", False) or getattr(f, "is_socket", False)),
                          size=int(f.uncompressed or 0)))
    return out


def extract(exe: Path, offset: int, wanted: Sequence[Member], xdir: Path, *, log: Log,
            program: str | None = None) -> str:
    """Extract exactly `wanted` into the new directory `xdir`; returns what did it (a program path or "py7zr").

    A 7-Zip program is used when given (or found on PATH); when it fails, py7zr is tried."""
    program = program if program is not None else seven_zip_program()
    if program:
        try:
            _extract_with_program(program, exe, wanted, xdir, log=log)
            _check_extracted(xdir, wanted, exe)
            return program
        except ToolchainError as e:
            log.warn(f"{os.path.basename(program)} could not extract {exe.name} ({e.what}); trying py7zr")
            shutil.rmtree(xdir, ignore_errors=True)
    extract_with_py7zr(exe, offset, wanted, xdir)
    _check_extracted(xdir, wanted, exe)
    return "py7zr"


def _extract_with_program(program: str, exe: Path, wanted: Sequence[Member], xdir: Path, *, log: Log) -> None:
    xdir.mkdir(parents=True)
    listfile = xdir.parent / f"{xdir.name}.list"
    listfile.write_text("".join(m.path.as_posix() + "\n" for m in wanted), encoding="utf-8")
    try:
        proc.run([program, "x", "-y", "-bd", f"-o{xdir}", "-scsUTF-8", str(exe.absolute()), f"@{listfile}"], log=log,
                 error=ToolchainError, what=f"extracting {len(wanted):,} files from {exe.name}", timeout=EXTRACT_TIMEOUT_S,
                 fix="check the free disk space; remove the 7-Zip program from PATH to use py7zr instead")
    finally:
        listfile.unlink(missing_ok=True)


def extract_with_py7zr(exe: Path, offset: int, wanted: Sequence[Member], xdir: Path) -> None:
    xdir.mkdir(parents=True, exist_ok=True)
    with open_7z(exe, offset) as ar:
        try:
            ar.extract(path=xdir.absolute(), targets=[m.name for m in wanted])
        except py7zr.exceptions.UnsupportedCompressionMethodError as e:
            raise ToolchainError(f"py7zr cannot decode {exe.name}", why=_short(e),
                                 fix="install 7-Zip and put 7zz (or 7z, 7zr) on PATH, then retry") from None
        except _PY7ZR_ERRORS as e:
            raise ToolchainError(f"{exe.name} cannot be extracted", why=_short(e),
                                 fix="the file is damaged; download it again") from None


def _check_extracted(xdir: Path, wanted: Sequence[Member], exe: Path) -> None:
    """The extraction holds exactly the wanted files: regular files, no links, nothing else."""
    expect = {m.path.as_posix() for m in wanted}
    got: set[str] = set()
    for dirpath, dirnames, filenames in os.walk(xdir):
        for name in dirnames + filenames:
            p = Path(dirpath, name)
            rel = p.relative_to(xdir).as_posix()
            if p.is_symlink():
                raise ToolchainError(f"extracting {exe.name} produced the link {rel}", fix="do not use this installer")
            if name in filenames:
                if not p.is_file():
                    raise ToolchainError(f"extracting {exe.name} produced {rel}, which is not a regular file",
                                         fix="do not use this installer")
                got.add(rel)
    if got != expect:
        missing, extra = sorted(expect - got), sorted(got - expect)
        raise ToolchainError(f"extracting {exe.name} did not give the selected files",
                             why="; ".join(s for s in (f"missing {', '.join(missing[:5])}" if missing else "",
                                                        f"unexpected {', '.join(extra[:5])}" if extra else "") if s),
                             fix="the file is damaged or not the installer it should be; download it again")


def _short(e: BaseException) -> str:
    text = str(e) or type(e).__name__
    return text if len(text) < 300 else text[:297] + "..."
