"""The deflate streams of a bundle's members, made before `pack` writes them: in worker threads (zlib and hashlib
release the GIL), and for a large member kept in the cache by its content (`<cache>/deflated`), so that the next
build of a bundle that carries the same NVIDIA library (540 MB of libcublasLt) copies its stream instead of
deflating it again. The stream is what zipfile makes of the same bytes at the same level (zlib's output does not
depend on how its input is cut), so the zip is the same, byte for byte, and a test holds the two together. The pass
that hashes a member (the cache lookup) or deflates it also takes its CRC-32 and size, which `pack` hands zipfile
with the stream: zipfile is never fed the member again.

A cached stream is named by the sha256 of what it inflates to, the level and zlib's version, and carries the sha256
of its own bytes: a damaged one is deflated again, never used."""

from __future__ import annotations

import hashlib
import os
import struct
import zlib
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from .. import scratch

LEVEL = 6  # bundle zips: zipfile's ZIP_DEFLATED at compresslevel 6
CHUNK = 1 << 20
CACHE_MIN = 8 << 20  # members from this size are kept in the cache (the toolkit's libraries, the CUDA module)
MAX_WAITING = 1 << 30  # bytes of members read ahead of the writer at most (one larger member is read alone)
_HEAD = struct.Struct("<32sQ")  # the stream's own sha256, the size it inflates to
_WBITS = -15  # raw deflate, as in a zip


@dataclass(frozen=True)
class Stream:
    """One member's deflate stream, the CRC-32 and size of what it inflates to (as read in the same pass), and
    whether the cache gave it."""

    data: bytes
    crc: int
    size: int
    cached: bool = False


def _name(sha: str) -> str:
    return f"{sha}.z{LEVEL}-{zlib.ZLIB_RUNTIME_VERSION}"


def _read_cached(path: Path, size: int) -> bytes | None:
    try:
        raw = path.read_bytes()
    except OSError:
        return None
    if len(raw) < _HEAD.size:
        return None
    digest, inflated = _HEAD.unpack_from(raw)
    data = raw[_HEAD.size:]
    if inflated != size or hashlib.sha256(data).digest() != digest:
        return None
    return data


def _write_cached(cache: Path, sha: str, size: int, data: bytes) -> None:
    """Best effort: a cache that cannot be written costs the next build the deflate, nothing else."""
    try:
        cache.mkdir(parents=True, exist_ok=True)
        part = f".{_name(sha)}.part-"
        tmp = scratch.owned(cache, part)
        try:
            with open(tmp, "wb") as f:
                f.write(_HEAD.pack(hashlib.sha256(data).digest(), size))
                f.write(data)
            os.replace(tmp, cache / _name(sha))
        finally:
            tmp.unlink(missing_ok=True)
    except OSError:
        pass


def deflate(path: Path, *, cache: Path | None = None) -> Stream:
    """The member at `path` deflated (LEVEL, raw), from the cache where it holds it and the member is large. A small
    member, or a large one the cache holds, is read once; a large one it lacks twice (hashed, then deflated: held
    in memory between the two it would cost a runner its size again)."""
    if cache is None or path.stat().st_size < CACHE_MIN:
        return _deflated(path)
    sha = hashlib.sha256()
    crc, read = 0, 0
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            sha.update(chunk)
            crc = zlib.crc32(chunk, crc)
            read += len(chunk)
    kept = cache / _name(sha.hexdigest())
    hit = _read_cached(kept, read)
    if hit is not None:
        os.utime(kept)  # used now: the bound removes the least recently used first
        return Stream(hit, crc, read, cached=True)
    stream = _deflated(path)
    _write_cached(cache, sha.hexdigest(), stream.size, stream.data)
    return stream


def _deflated(path: Path) -> Stream:
    z = zlib.compressobj(LEVEL, zlib.DEFLATED, _WBITS)
    parts: list[bytes] = []
    crc, read = 0, 0
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            crc = zlib.crc32(chunk, crc)
            read += len(chunk)
            parts.append(z.compress(chunk))
    parts.append(z.flush())
    return Stream(b"".join(parts), crc, read)


def streams(root: Path, names: Sequence[str], *, cache: Path | None = None,
            workers: int | None = None) -> Iterator[tuple[str, Stream]]:
    """Each member's stream in the order of `names`, made ahead in worker threads: at most MAX_WAITING bytes of
    members are being deflated or waiting for the writer (one larger member alone)."""
    sizes = {n: (root / n).stat().st_size for n in names}
    with ThreadPoolExecutor(max_workers=workers or min(32, os.cpu_count() or 1)) as pool:
        pending: list[tuple[str, Future[Stream]]] = []
        i = 0
        try:
            for name in names:
                while i < len(names) and (not pending or sum(sizes[n] for n, _ in pending) + sizes[names[i]] <= MAX_WAITING):
                    pending.append((names[i], pool.submit(deflate, root / names[i], cache=cache)))
                    i += 1
                got_name, fut = pending.pop(0)
                assert got_name == name
                yield name, fut.result()
        finally:
            for _, fut in pending:
                fut.cancel()
