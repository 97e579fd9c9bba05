"""A local blob cache: each file a machine holds once, named by its sha256 (an executable's with `.x`, mode 0755),
hard-linked into the bundle directories assembled from it (install's version directories, fetch's --out). `assemble`
downloads from a BlobStore only the files the cache lacks (each decompressed and checked against its sha256 as it is
written), hashes again every blob it reuses unless its stamp (`.verified.json`: device, inode, size, mtime, ctime
when it was last found right) shows it unchanged since (a directory that links one may have changed it), links each file
into the new directory (copies where links are refused) and writes bundle.json. `prune` removes the blobs nothing
links any more once they are older than KEEP seconds (another run may be about to link one)."""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from .. import scratch, untrusted
from ..bundle import MANIFEST
from ..bundle.manifest import FileEntry, Manifest
from ..digest import file_state, sha256_file
from ..errors import DiskError, VerifyError, disk_fix, from_os_error, in_whose
from ..log import Log
from .base import BlobStore, Entry

PREFIX = ".blob-"
EXE_SUFFIX = ".x"
KEEP = 600


@dataclass(frozen=True)
class Assembled:
    """What assembling a bundle from the blob cache took."""

    downloaded: int  # bytes read from the store (compressed)
    from_cache: int  # bytes of the files found in the cache
    files: int
    fetched: int  # files downloaded
    hashes: Mapping[str, str]  # path -> the sha256 of what was linked there, read once (the trust check reuses it)


def workers(src: object) -> int:
    """How many blobs are fetched at once: what the store says it serves in parallel (`blob_workers`; one
    where it says nothing), at most one per core."""
    return max(1, min(int(getattr(src, "blob_workers", 1)), os.cpu_count() or 1))


def blob_name(f: FileEntry) -> str:
    return f.sha256 + (EXE_SUFFIX if f.role == "exe" else "")


def assemble(src: BlobStore, entry: Entry, want: Manifest, cache: Path, dest: Path, *, log: Log) -> Assembled:
    """The files of `want` (the entry's manifest, or a part cut from it) in dest from the cache, downloading what it
    lacks; bundle.json is want's text. A blob that is not its file is a VerifyError naming the file (nothing of it
    is kept). The caller checks the assembled directory as a whole."""
    files: Sequence[FileEntry] = want.files
    cache.mkdir(parents=True, exist_ok=True)
    scratch.sweep(cache, [PREFIX])
    by_name = {blob_name(f): f for f in files}
    known = _stamps(cache)
    cores = min(8, os.cpu_count() or 1)
    with ThreadPoolExecutor(max_workers=cores) as pool:  # hashing lets go of the GIL: one core each
        ok = list(pool.map(lambda item: _cached(cache / item[0], item[1].sha256, item[1].size, known.get(item[0])),
                           by_name.items()))
    have = {name for name, cached in zip(by_name, ok, strict=True) if cached}
    need = {name: f for name, f in by_name.items() if name not in have}
    size, found = sum(f.size for f in need.values()), sum(f.size for name, f in by_name.items() if name in have)
    n = min(workers(src), max(1, len(need)))
    with log.step(f"download {len(need)} of {len(by_name)} files ({size / 1e6:.1f} MB unpacked; {found / 1e6:.1f} "
                  f"MB already here) from {src.url}" + (f", {n} at a time" if n > 1 else "")), \
            ThreadPoolExecutor(max_workers=n) as pool:  # so do zstd and the sockets
        # the largest first: the longest file sets the time, the small ones fill the other cores meanwhile
        order = sorted(need.items(), key=lambda item: -item[1].size)
        moved = sum(pool.map(lambda item: _fetch(src, entry, item[1], cache, item[0]), order))
    dest.mkdir(parents=True, exist_ok=True)
    for f in files:
        target = dest.joinpath(*f.path.split("/"))
        target.parent.mkdir(parents=True, exist_ok=True)
        blob = cache / blob_name(f)
        try:
            os.link(blob, target)
        except OSError:  # another filesystem, or links refused
            try:
                shutil.copy2(blob, target)
            except OSError as e:  # what fails is writing the copy (a full or read-only disk)
                raise DiskError(f"cannot write {target}{in_whose(target)}", why=e.strerror or str(e),
                                fix=disk_fix(e)) from None
    (dest / MANIFEST).write_text(want.text(), encoding="utf-8", newline="\n")
    _stamp(cache, known, by_name)
    return Assembled(downloaded=moved, from_cache=found, files=len(files), fetched=len(need),
                     hashes={f.path: f.sha256 for f in files})


def _fetch(src: BlobStore, entry: Entry, f: FileEntry, cache: Path, name: str) -> int:
    """The file's blob downloaded into the cache under `name`, checked against its sha256 as it is written; the
    bytes read from the store. Nothing of a blob that is not its file is kept."""
    try:
        tmp = scratch.owned(cache, PREFIX, ".part")
    except OSError as e:  # several blobs are written at once: the disk may be full before this one starts
        raise from_os_error(e) from None
    try:
        try:
            got = src.fetch_blob(entry, f, tmp)
        except VerifyError as e:  # not a blob of the file at all (not a zstd frame, the wrong digest)
            raise VerifyError(f"{f.path} ({f.sha256[:12]}) from {src.url}: {e.what}", why=e.why,
                              fix="publish the bundle again") from None
        if (got.sha256, got.size) != (f.sha256, f.size):
            raise VerifyError(f"{f.path} ({f.sha256[:12]}) from {src.url} does not match its sha256",
                              why="the store's copy changed or was damaged", fix="publish the bundle again")
        os.chmod(tmp, 0o755 if name.endswith(EXE_SUFFIX) else 0o644)
        os.replace(tmp, cache / name)
    except OSError as e:  # a write's error may come when the file is closed: it names no file, this one is it
        tmp.unlink(missing_ok=True)
        if e.filename is None:
            e.filename = str(tmp)
        raise from_os_error(e) from None
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return got.packed_size


STAMPS = ".verified.json"  # name -> the blob's file state when it was last found to be what its name says


def _stamps(cache: Path) -> dict[str, list[int]]:
    """The cache's stamps (none when the file is missing or not what this module writes)."""
    try:
        said = untrusted.loads((cache / STAMPS).read_bytes(), max_bytes=16 << 20)
    except (OSError, ValueError):
        return {}
    if not isinstance(said, dict):
        return {}
    return {k: v for k, v in said.items() if isinstance(v, list) and len(v) == 5 and all(type(x) is int for x in v)}


def _stamp(cache: Path, known: dict[str, list[int]], checked: Mapping[str, FileEntry]) -> None:
    """Record the state of each blob just checked or written (and linked: a link sets ctime too), so that the
    next assemble takes an unchanged blob without reading it. Best effort: a stamp not written costs a read."""
    now = {**known}
    for name, f in checked.items():
        try:
            st = os.stat(cache / name)
        except OSError:
            continue
        if st.st_size == f.size:
            now[name] = file_state(st)
    present = {n for n in now if (cache / n).exists()}
    scratch.replace_text(cache / STAMPS, json.dumps({n: now[n] for n in sorted(present)}), prefix=PREFIX)


def _cached(path: Path, sha256: str, size: int, state: list[int] | None = None) -> bool:
    """A blob of the cache that is what its name says: unchanged since it was found so (`state`, its stamp), or
    read again; one that is not is removed."""
    try:
        st = path.stat()
        if st.st_size == size and state is not None and file_state(st) == state:
            return True
        if st.st_size == size and sha256_file(path) == sha256:
            return True
        path.unlink()
    except OSError:
        pass
    return False


def prune(cache: Path, *, keep: float | None = None) -> None:
    """Remove the cache's blobs that nothing links any more (older than `keep`, default KEEP: another run may be
    about to link one). Errors are ignored: the next run tries again."""
    keep = KEEP if keep is None else keep
    now = time.time()
    try:
        names = [n for n in os.listdir(cache) if not n.startswith(".")]
    except OSError:
        return
    for n in names:
        try:
            st = os.stat(cache / n)
            if st.st_nlink <= 1 and now - st.st_mtime > keep:
                os.unlink(cache / n)
        except OSError:
            pass
