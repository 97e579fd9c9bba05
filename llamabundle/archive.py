"""Safe extraction of zip and tar archives: no absolute paths, no `..`, no links out of the tree,
no device files, bounded total size and compression ratio. A refused archive leaves nothing behind in dest."""

from __future__ import annotations

import os
import shutil
import stat
import tarfile
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


def extract_zip(archive: Path, dest: Path, *, max_total: int = MAX_TOTAL_BYTES) -> list[str]:
    """Extract a zip into dest (which must not exist yet). Returns the member names (files only)."""
    try:
        zf = zipfile.ZipFile(archive)
    except (zipfile.BadZipFile, OSError) as e:
        raise VerifyError(f"{archive.name} is not a readable zip", why=str(e),
                          fix="download it again; if it persists the published file is damaged") from None
    with zf:
        infos = zf.infolist()
        if len(infos) > MAX_MEMBERS:
            raise UnsafeArchive(f"{archive.name}: {len(infos)} members, more than {MAX_MEMBERS}")
        total = 0
        layout = Layout(archive)
        for info in infos:
            layout.add(info.filename, is_dir=info.is_dir())
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
        except (zipfile.BadZipFile, OSError, EOFError, zlib.error) as e:
            shutil.rmtree(tmp, ignore_errors=True)
            raise VerifyError(f"{archive.name} is damaged", why=str(e), fix="download it again") from None
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return names


def extract_tar(archive: Path, dest: Path, *, select: str | None = None) -> None:
    """Extract a (compressed) tar into dest (which must not exist), with tarfile's 'data' filter:
    no absolute paths, no `..`, no links leaving dest, no devices. `select` keeps one subtree prefix."""
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


def tmp_beside(dest: Path) -> Path:
    """A new directory beside dest, owned by this process, after removing those of dead owners."""
    if dest.exists():
        raise FileExistsError(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    scratch.sweep(dest.parent, [partial_prefix(dest)])
    return scratch.make_dir(dest.parent, partial_prefix(dest))
