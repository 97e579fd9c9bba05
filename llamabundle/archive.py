"""Safe extraction of zip and tar archives: no absolute paths, no `..`, no links out of the tree,
no device files, bounded total size and compression ratio; a zip's members are checked against the rules
below (check_members) before any is read. A refused archive leaves nothing behind in dest."""

from __future__ import annotations

import os
import shutil
import stat
import struct
import zipfile
import zlib
from pathlib import Path, PurePosixPath

from . import scratch
from .errors import VerifyError

MAX_TOTAL_BYTES = 16 * 1024**3
MAX_MEMBERS = 200_000
MAX_RATIO = 200  # uncompressed / compressed, per member; real bundles and redist archives stay far below
RATIO_FLOOR = 1 << 20  # members smaller than this are not ratio-checked (a few KiB of zeros compress well)


class UnsafeArchive(VerifyError):
    pass


METHODS = {0: "stored", 8: "deflated"}  # what llamabundle reads (and bundle.pack writes)
OTHER_METHODS = {1: "shrink", 6: "implode", 9: "deflate64", 12: "bzip2", 14: "lzma", 93: "zstd", 95: "xz",
                 99: "AES encryption"}
LOCAL_HEADER = struct.Struct("<4sHHHHHIIIHH")  # 30 bytes, then the name and the extra field
ZIP64_SIZE = 0xFFFFFFFF  # a 32-bit field that says "in the zip64 extra field"
ENCRYPTED, DESCRIPTOR = 0x01, 0x08  # general purpose flags: encrypted; CRC and sizes after the data
STRONG_ENCRYPTION = 0x40


def check_members(zf: zipfile.ZipFile, archive: Path, *, descriptors: bool = True) -> None:
    """Every member against what llamabundle reads, before a byte of one is: stored or deflated, not encrypted,
    its local header agreeing with the central directory (name, method, flags, CRC and sizes, which a data
    descriptor may carry instead where `descriptors` allows: bundle zips never use one), its bytes inside the
    archive before the central directory and overlapping no other member's. Raises UnsafeArchive (exit 5)."""
    def refuse(info: zipfile.ZipInfo, what: str, why: str) -> UnsafeArchive:
        return UnsafeArchive(f"{archive.name}: member '{info.filename}' {what}", why=why,
                             fix="do not use this archive (a bundle zip is written by llamabundle's pack)")
    crafted = "a damaged or crafted zip"
    end = int(getattr(zf, "start_dir", 0)) or archive.stat().st_size  # where the central directory begins
    spans: list[tuple[int, int, zipfile.ZipInfo]] = []
    with open(archive, "rb") as f:
        for info in zf.infolist():
            if info.flag_bits & (ENCRYPTED | STRONG_ENCRYPTION):
                raise refuse(info, "is encrypted", "llamabundle reads unencrypted members only")
            if info.compress_type not in METHODS:
                name = OTHER_METHODS.get(info.compress_type, "an unknown method")
                raise refuse(info, f"is compressed with method {info.compress_type} ({name})",
                             "llamabundle reads stored or deflated members only")
            if info.flag_bits & DESCRIPTOR and not descriptors:
                raise refuse(info, "is written with a data descriptor (its sizes after its data)",
                             "a bundle zip carries each member's sizes in its local header")
            f.seek(info.header_offset)
            head = f.read(LOCAL_HEADER.size)
            if len(head) < LOCAL_HEADER.size or head[:4] != b"PK\x03\x04":
                raise refuse(info, f"has no local header at offset {info.header_offset}", crafted)
            (_sig, _ver, flags, method, _t, _d, crc, csize, usize, nlen, xlen) = LOCAL_HEADER.unpack(head)
            raw = f.read(nlen)
            local_name = raw.decode("utf-8" if flags & 0x800 else "cp437", errors="replace")
            if local_name != info.orig_filename or method != info.compress_type \
                    or (flags ^ info.flag_bits) & (ENCRYPTED | DESCRIPTOR | STRONG_ENCRYPTION):
                raise refuse(info, "has a local header that disagrees with the central directory "
                             f"(name '{local_name}', method {method}, flags {flags:#x})", crafted)
            told = (info.CRC, info.compress_size, info.file_size)
            here = (crc, csize, usize)
            if flags & DESCRIPTOR:
                agree = all(h in (0, t) for h, t in zip(here, told, strict=True))
            else:
                agree = here[0] == told[0] and all(h in (t, ZIP64_SIZE) for h, t in zip(here[1:], told[1:], strict=True))
            if not agree:
                raise refuse(info, f"has CRC and sizes {here} in its local header, {told} in the central directory",
                             crafted)
            start = info.header_offset + LOCAL_HEADER.size + nlen + xlen
            if start + info.compress_size > end:
                raise refuse(info, "runs past the start of the central directory", crafted)
            spans.append((info.header_offset, start + info.compress_size, info))
    spans.sort(key=lambda s: s[0])
    for (_a, a_end, a), (b_start, _b, b) in zip(spans, spans[1:], strict=False):
        if b_start < a_end:
            raise refuse(b, f"overlaps member '{a.filename}'", "a zip bomb or a crafted zip")


def safe_name(name: str, archive: Path) -> PurePosixPath:
    p = PurePosixPath(name.replace("\\", "/"))
    drive = bool(p.parts) and ":" in p.parts[0]
    if p.is_absolute() or name.startswith(("/", "\\")) or drive:
        raise UnsafeArchive(f"{archive.name}: member '{name}' has an absolute path",
                            why="an archive member may only write inside the destination", fix="do not use this archive")
    if any(part == ".." for part in p.parts):
        raise UnsafeArchive(f"{archive.name}: member '{name}' escapes the destination with '..'",
                            why="an archive member may only write inside the destination", fix="do not use this archive")
    return p


class Layout:
    """The tree an archive's members make, member by member: a member may not be a file where another member
    is a directory, nor sit under a file (the names differ, yet they would collide on disk)."""

    def __init__(self, archive: Path) -> None:
        self.archive = archive
        self.files: set[PurePosixPath] = set()
        self.dirs: set[PurePosixPath] = set()

    def add(self, name: str, *, is_dir: bool) -> None:
        p = safe_name(name, self.archive)
        parents = [q for q in p.parents if q != PurePosixPath(".")]
        clash = next((q for q in parents if q in self.files), None)
        if clash is not None:
            raise UnsafeArchive(f"{self.archive.name}: member '{name}' is inside '{clash}', which is a file",
                                why="two members would collide on disk", fix="do not use this archive")
        if p in self.files or (not is_dir and p in self.dirs):
            raise UnsafeArchive(f"{self.archive.name}: member '{name}' collides with another member of that path",
                                why="two members would collide on disk", fix="do not use this archive")
        self.dirs.update(parents)
        (self.dirs if is_dir else self.files).add(p)


def check_zip(zf: zipfile.ZipFile, archive: Path, *, max_total: int = MAX_TOTAL_BYTES,
              descriptors: bool = True) -> list[zipfile.ZipInfo]:
    """Every member of an open zip by the rules of check_members and as what it would write: a safe name in
    a tree without collisions, a regular file or directory, within the compression ratio and, all together,
    `max_total` bytes. Returns the members; raises UnsafeArchive (exit 5) before any is read."""
    infos = zf.infolist()
    if len(infos) > MAX_MEMBERS:
        raise UnsafeArchive(f"{archive.name}: {len(infos)} members, more than {MAX_MEMBERS}")
    check_members(zf, archive, descriptors=descriptors)
    layout = Layout(archive)
    for info in infos:  # the names first: where they would land
        layout.add(info.filename, is_dir=info.is_dir())
    total = 0
    for info in infos:
        mode = info.external_attr >> 16
        if stat.S_ISLNK(mode):
            raise UnsafeArchive(f"{archive.name}: member '{info.filename}' is a symbolic link",
                                why="bundles hold regular files only", fix="do not use this archive")
        if stat.S_IFMT(mode) not in (0, stat.S_IFREG, stat.S_IFDIR):
            raise UnsafeArchive(f"{archive.name}: member '{info.filename}' is a device, pipe or socket",
                                why="bundles hold regular files only", fix="do not use this archive")
        if info.file_size > RATIO_FLOOR and info.file_size > MAX_RATIO * max(info.compress_size, 1):
            raise UnsafeArchive(f"{archive.name}: member '{info.filename}' expands {info.file_size // max(info.compress_size, 1)}"
                                f" times (more than {MAX_RATIO})", why="a zip bomb or a damaged archive",
                                fix="do not use this archive")
        total += info.file_size
        if total > max_total:
            raise UnsafeArchive(f"{archive.name}: expands to more than {max_total} bytes",
                                why="a zip bomb or a damaged archive", fix="do not use this archive")
    return infos


def extract_zip(archive: Path, dest: Path, *, max_total: int = MAX_TOTAL_BYTES, descriptors: bool = True) -> list[str]:
    """Extract a zip into dest (which must not exist yet), its members checked first (check_members;
    `descriptors`: whether a member may carry its sizes after its data). Returns the member names (files only)."""
    try:
        zf = zipfile.ZipFile(archive)
    except (zipfile.BadZipFile, OSError, ValueError) as e:  # ValueError: a name that is not UTF-8
        raise VerifyError(f"{archive.name} is not a readable zip", why=str(e),
                          fix="download it again; if it persists the published file is damaged") from None
    with zf:
        infos = check_zip(zf, archive, max_total=max_total, descriptors=descriptors)
        tmp = tmp_beside(dest)
        names = []
        try:
            for info in infos:
                target = tmp / safe_name(info.filename, archive)
                if info.is_dir():
                    target.mkdir(parents=True, exist_ok=True)
                    continue
                target.parent.mkdir(parents=True, exist_ok=True)
                written = 0
                with zf.open(info) as src, open(target, "wb") as out:
                    while chunk := src.read(1 << 20):
                        written += len(chunk)
                        if written > info.file_size:
                            raise UnsafeArchive(f"{archive.name}: member '{info.filename}' is larger than its header says")
                        out.write(chunk)
                mode = (info.external_attr >> 16) & 0o777
                os.chmod(target, 0o755 if mode & 0o111 else 0o644)
                names.append(info.filename)
            os.replace(tmp, dest)
        except (zipfile.BadZipFile, OSError, EOFError, zlib.error, NotImplementedError, RuntimeError) as e:
            shutil.rmtree(tmp, ignore_errors=True)  # (zipfile's own refusals, should a member get past check_members)
            raise VerifyError(f"{archive.name} is damaged", why=str(e), fix="download it again") from None
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return names


def extract_tar(archive: Path, dest: Path, *, select: str | None = None) -> None:
    """Extract a (compressed) tar into dest (which must not exist), with tarfile's 'data' filter:
    no absolute paths, no `..`, no links leaving dest, no devices. `select` keeps one subtree prefix."""
    import tarfile  # here: reading a bundle (a zip) does not need it

    tmp = tmp_beside(dest)
    try:
        with tarfile.open(archive) as tf:
            members: list[tarfile.TarInfo] = []
            total = 0
            for m in tf:
                if select is not None and not (m.name == select.rstrip("/") or m.name.startswith(select.rstrip("/") + "/")):
                    continue
                safe_name(m.name, archive)
                total += m.size
                if total > MAX_TOTAL_BYTES or len(members) >= MAX_MEMBERS:
                    raise UnsafeArchive(f"{archive.name}: expands beyond the limits ({MAX_TOTAL_BYTES} bytes, {MAX_MEMBERS} members)")
                members.append(m)
            tf.extractall(tmp, members=members, filter="data")
            while tf.fileobj.read(1 << 20):  # to the end: a compressed stream checks its CRC only there
                pass
        os.replace(tmp, dest)
    except tarfile.FilterError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise UnsafeArchive(f"{archive.name}: refused an unsafe member", why=str(e), fix="do not use this archive") from None
    except (tarfile.TarError, OSError, EOFError, zlib.error) as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise VerifyError(f"{archive.name} is not a readable tar archive", why=str(e), fix="download it again") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def partial_prefix(dest: Path) -> str:
    """The name prefix of the directories an extraction into `dest` fills first (`.NAME.partial-<owner>`)."""
    return f".{dest.name}.partial-"


def tmp_beside(dest: Path, *, exist_ok: bool = False) -> Path:
    """A new directory beside dest, owned by this process, after removing those of dead owners (dest must not
    exist unless `exist_ok`: the caller then decides how to replace it)."""
    if dest.exists() and not exist_ok:
        raise FileExistsError(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    scratch.sweep(dest.parent, [partial_prefix(dest)])
    return scratch.make_dir(dest.parent, partial_prefix(dest))
