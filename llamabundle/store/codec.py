"""How a store keeps a bundle's files by content: each file once, as a zstd frame (level 3) named by the sha256
of the file's own bytes. zstd, not deflate: about 5 % fewer bytes than the zip's deflate on NVIDIA's libraries
and 5-12x faster to decompress, and decompressing is most of what a cache hit costs.

`pack` compresses a stream, hashing the raw bytes as it reads them; `unpack` decompresses a stream into a new
file, hashing what it writes and stopping one byte past the size the manifest gives (a frame that inflates
further is cut there). Both return what they saw; the caller compares it with the manifest (a stream cut short
gives fewer bytes, and a frame that is not zstd is a CodecError)."""

from __future__ import annotations

import hashlib
import os
import queue
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Protocol

import zstandard

from ..errors import StoreError, disk_fix
from .base import Unpacked

LEVEL = 3
CHUNK = 1 << 20
MEDIA_TYPE = "application/zstd"  # of a blob as a store serves it
SUFFIX = ".zst"


class Reader(Protocol):
    def read(self, n: int, /) -> bytes: ...


class Bounded:
    """A stream (a zip member) read as one that may hold at most `size` bytes plus one: one more shows it lies
    about its size, and no more is read."""

    def __init__(self, f: Reader, size: int) -> None:
        self.f, self.left = f, size + 1

    def read(self, n: int) -> bytes:
        chunk = self.f.read(min(n, self.left)) if self.left > 0 else b""
        self.left -= len(chunk)
        return chunk


class CodecError(ValueError):
    """A blob that is not a zstd frame of the file it claims to be."""


@dataclass(frozen=True)
class Packed:
    """What packing a file into a blob saw."""

    sha256: str  # of the raw bytes read
    size: int  # raw bytes read
    packed_size: int  # bytes written


def pack(src: Reader, out: BinaryIO, *, level: int = LEVEL) -> Packed:
    """Compress src into out (one zstd frame with its content checksum)."""
    h, raw, before = hashlib.sha256(), 0, out.tell()
    cctx = zstandard.ZstdCompressor(level=level, write_checksum=True)
    with cctx.stream_writer(out, closefd=False) as w:
        while chunk := src.read(CHUNK):
            h.update(chunk)
            raw += len(chunk)
            w.write(chunk)
    return Packed(sha256=h.hexdigest(), size=raw, packed_size=out.tell() - before)


def pack_file(path: Path, dest: Path, *, level: int = LEVEL) -> Packed:
    """Compress the file at path into the new file dest."""
    with open(path, "rb") as src, open(dest, "xb") as out:
        return pack(src, out, level=level)


class _Counting:
    def __init__(self, f: Reader) -> None:
        self.f, self.n = f, 0

    def read(self, n: int) -> bytes:
        chunk = self.f.read(n)
        self.n += len(chunk)
        return chunk


def unpack(src: Reader, out: BinaryIO, *, limit: int) -> Unpacked:
    """Decompress the zstd stream src into out, at most limit + 1 bytes (one more shows the blob lies about its
    size: the caller compares). A stream that is not zstd, or is cut short, is a CodecError. A file of PIPELINED
    bytes or more is hashed and written by two threads of their own while this one decompresses (each lets go of
    the GIL): the largest file of a bundle (NVIDIA's libcublasLt, 540 MB) sets a hit's time, and one thread doing
    all three in turn took their sum."""
    counting = _Counting(src)
    try:
        reader = zstandard.ZstdDecompressor().stream_reader(counting, read_size=CHUNK,  # type: ignore[arg-type]  # any .read()
                                                            read_across_frames=False)
        with reader:
            if limit >= PIPELINED and (os.cpu_count() or 1) > 1:
                sha256, raw = _pipelined(_chunks(reader, limit, PIPE_CHUNK), out)
            else:
                h, raw = hashlib.sha256(), 0
                for chunk in _chunks(reader, limit, CHUNK):
                    h.update(chunk)
                    raw += len(chunk)
                    out.write(chunk)
                sha256 = h.hexdigest()
    except zstandard.ZstdError as e:
        raise CodecError(f"not a zstd frame of the file ({e})") from None
    return Unpacked(sha256=sha256, size=raw, packed_size=counting.n)


PIPELINED = 64 << 20  # bytes: a file at least this large is hashed and written beside its decompression
PIPE_CHUNK = 4 << 20
PIPE_DEPTH = 4  # chunks waiting for each of the hashing and the writing thread at most (16 MiB)


def _chunks(reader: Reader, limit: int, size: int) -> Iterator[bytes]:
    """reader's bytes in pieces of at most `size`, limit + 1 of them at most."""
    raw = 0
    while raw <= limit and (chunk := reader.read(min(size, limit + 1 - raw))):
        raw += len(chunk)
        yield chunk


def _pipelined(chunks: Iterator[bytes], out: BinaryIO) -> tuple[str, int]:
    """The chunks into out and sha256, three stages at once: this thread reads them (zstd decompresses), one thread
    hashes, one writes; each gets every chunk in order. A write that fails stops the reading and is raised here;
    whatever this thread raises (an interrupt too) stops both others first."""
    h, raw = hashlib.sha256(), 0
    failed: list[BaseException] = []

    def write(chunk: bytes) -> None:
        if not failed:  # after a failed write the rest is drained, not written
            try:
                out.write(chunk)
            except BaseException as e:  # an OSError, mostly; given to the reading thread
                failed.append(e)

    stages = [(queue.Queue[bytes | None](PIPE_DEPTH), h.update), (queue.Queue[bytes | None](PIPE_DEPTH), write)]

    def drain(q: queue.Queue[bytes | None], take: Callable[[bytes], object]) -> None:
        while (chunk := q.get()) is not None:
            take(chunk)

    threads = [threading.Thread(target=drain, args=stage, daemon=True) for stage in stages]
    for t in threads:
        t.start()
    try:
        for chunk in chunks:
            if failed:
                break
            raw += len(chunk)
            for q, _ in stages:
                q.put(chunk)
    finally:
        for q, _ in stages:
            q.put(None)
        for t in threads:
            t.join()
    if failed:
        raise failed[0]
    return h.hexdigest(), raw


class Blob(Reader, Protocol):
    """A blob's bytes from a store (store.ranged.RangedStream): checked against the blob's digest once read to its
    end (`finish`); `received`: the bytes that came over the network."""
    received: int

    def finish(self) -> None: ...


def unpack_new(blob: Blob, dest: Path, *, limit: int, not_frame: Callable[[str], Exception]) -> Unpacked:
    """The blob decompressed into the new file dest (unpack, at most limit + 1 bytes), then read to its end so that
    its digest is checked: bytes that are not the blob are said so (the blob's own error) before a frame that is
    not zstd (`not_frame(why)`). A write that fails is a StoreError naming dest."""
    try:
        with open(dest, "xb") as out:
            try:
                got = unpack(blob, out, limit=limit)
            except CodecError as e:
                blob.finish()
                raise not_frame(str(e)) from None
            blob.finish()
    except OSError as e:
        raise StoreError(f"cannot write {dest}", why=e.strerror or str(e), fix=disk_fix(e)) from None
    return Unpacked(sha256=got.sha256, size=got.size, packed_size=blob.received)
