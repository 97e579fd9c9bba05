"""Unpack a bundle zip while its bytes arrive: download, extraction and the per-file sha256 in one pass.

A zip written by `bundle.pack` (or any zip whose local headers carry the sizes, i.e. no data descriptors)
is a sequence of local entries followed by the central directory. `ZipStream` is fed those bytes in order
(`update`), writes each member into a new directory as it goes, hashing it, and at the end (`finish`)
checks the central directory against what it streamed: the same members, sizes, CRCs and offsets, regular
files only. The safety rules are archive.py's: no absolute paths, no `..`, no links, bounded size.
`reset` forgets everything (a download that starts over); nothing is left behind on failure.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import hashlib
import os
import queue
import shutil
import stat
import struct
import threading
import zlib
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from io import BufferedWriter
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hashlib import _Hash

from ..archive import (
    MAX_MEMBERS,
    MAX_RATIO,
    MAX_TOTAL_BYTES,
    RATIO_FLOOR,
    Layout,
    UnsafeArchive,
    safe_name,
)
from ..errors import VerifyError, from_os_error

LOCAL = b"PK\x03\x04"
CENTRAL = b"PK\x01\x02"
END = b"PK\x05\x06"
END64 = b"PK\x06\x06"
LOCAL_FMT = struct.Struct("<4sHHHHHIIIHH")  # 30 bytes
CENTRAL_FMT = struct.Struct("<4sHHHHHHIIIHHHHHII")  # 46 bytes
END_FMT = struct.Struct("<4sHHHHIIH")  # 22 bytes
OUT_CHUNK = 1 << 20
IN_CHUNK = 1 << 18  # compressed bytes a worker inflates at a time
MAX_DEFERRED = 64 << 20  # a larger member is inflated as it streams, never held whole
MAX_INFLIGHT = 256 << 20  # compressed bytes held for the workers at most
MAX_TAIL = 64 << 20  # the central directory of a bundle is a few KB


class NotStreamable(Exception):
    """The zip uses a layout this reader does not stream (data descriptors, zip64, another method):
    the caller extracts it from the finished file instead."""


@dataclass(frozen=True, kw_only=True)
class Member:
    """A zip member as its local header describes it."""

    name: str
    offset: int
    crc: int
    csize: int
    usize: int
    sha256: str


class _Inflating:
    """One member's data on its way to its file: inflated (or stored), its size bounded by its header, its CRC and
    sha256 computed as it is written. `done` checks size and CRC against the header and closes the file."""

    def __init__(self, label: str, *, name: str, offset: int, crc: int, csize: int, usize: int, deflated: bool,
                 out: BufferedWriter | None, target: Path) -> None:
        self.label, self.name, self.offset, self.crc, self.csize, self.usize = label, name, offset, crc, csize, usize
        self.out, self.target = out, target
        self.written = self.crc_now = 0
        self.sha: _Hash = hashlib.sha256()
        self.z = zlib.decompressobj(-15) if deflated else None

    def feed(self, piece: bytes | memoryview, *, last: bool) -> None:
        """The next compressed bytes of the member; `last`: nothing follows."""
        z = self.z
        try:
            if z is None:
                self._emit(piece)
            else:
                self._emit(z.decompress(piece, OUT_CHUNK))
                while z.unconsumed_tail:
                    self._emit(z.decompress(z.unconsumed_tail, OUT_CHUNK))
                if last:
                    self._emit(z.flush())
                    if not z.eof:
                        raise zlib.error("the deflate stream is truncated")
        except zlib.error as e:
            raise VerifyError(f"{self.label}: member '{self.name}' is damaged", why=str(e),
                              fix="download it again") from None
        except OSError as e:
            if e.filename is None:
                e.filename = str(self.target)
            raise

    def _emit(self, data: bytes | memoryview) -> None:
        if not data:
            return
        self.written += len(data)
        if self.written > self.usize:
            raise UnsafeArchive(f"{self.label}: member '{self.name}' is larger than its header says",
                                why="a zip bomb or a damaged archive", fix="do not use this archive")
        self.crc_now = zlib.crc32(data, self.crc_now)
        self.sha.update(data)
        if self.out is not None:
            self.out.write(data)

    def done(self) -> Member:
        if self.written != self.usize or self.crc_now != self.crc:
            raise VerifyError(f"{self.label}: member '{self.name}' is damaged", why="its size or CRC does not match "
                              "its header", fix="download it again")
        self.close()
        return Member(name=self.name, offset=self.offset, crc=self.crc, csize=self.csize, usize=self.usize,
                      sha256=self.sha.hexdigest())

    def close(self) -> None:
        if self.out is not None:
            out, self.out = self.out, None
            try:
                out.close()
            except OSError as e:
                if e.filename is None:
                    e.filename = str(self.target)
                raise

    def whole(self, data: bytes | bytearray) -> Member:
        """All of the member's compressed bytes at once (a worker thread's job), fed in pieces of IN_CHUNK: zlib
        hands back what it has not consumed as a new copy (unconsumed_tail) after each OUT_CHUNK of output, which
        on a whole member of tens of MB would copy its bytes over and over. The file is closed either way."""
        try:
            view = memoryview(data)
            for at in range(0, max(len(view), 1), IN_CHUNK):
                self.feed(view[at:at + IN_CHUNK], last=at + IN_CHUNK >= len(view))
            return self.done()
        finally:
            with contextlib.suppress(OSError):
                self.close()


class ZipStream:
    # set by _start (tail_at by _step, when the central directory begins)
    streamable: bool
    buf: bytearray
    pos: int
    names: set[str]
    layout: Layout
    total: int
    cur: _Inflating | None  # the member whose data is coming
    left: int  # its compressed bytes still to come
    deferred: bytearray | None  # its compressed bytes so far, when a worker inflates it once they are all here
    done: list[Member | Future[Member]]  # every member so far, in order (a future: a worker's, maybe unfinished)
    pool: ThreadPoolExecutor | None
    jobs: dict[Future[Member], tuple[_Inflating, int]]  # handed to workers, not yet seen finished: compressed size
    tail: bytearray | None
    tail_at: int

    sizes: Mapping[str, int] | None  # every file's size, from the first member (sizes_from)

    def __init__(self, dest: Path, *, label: str, max_total: int = MAX_TOTAL_BYTES,
                 sizes_from: tuple[str, Callable[[Path], Mapping[str, int]]] | None = None,
                 workers: int | None = None) -> None:
        """`sizes_from`: (the name the first member must have, what reads every other member's size from it
        once written): a zip whose first member is another, or a later member not listed there with its size,
        is NotStreamable before that member's data is read (the caller then checks the whole zip from its
        central directory, which also says what the member is). `workers`: threads that inflate the members once
        all their bytes are here, several at a time (default: the cores, at most 8; 1: each as it streams)."""
        self.dest, self.label, self.max_total, self.sizes_from = dest, label, max_total, sizes_from
        self.workers = workers if workers is not None else min(os.cpu_count() or 1, 8)
        self._start()

    # ---------------------------------------------------------------------------------- feeding

    def update(self, data: bytes) -> None:
        """Feed the next bytes. A layout this reader does not stream is not an error here: it stops
        unpacking, and `finish` raises NotStreamable so that the caller extracts the finished file."""
        if not self.streamable:
            return
        try:
            mv = memoryview(data)
            while mv:
                if self.tail is not None:
                    self._to_tail(mv)
                    break
                if self.cur is not None and not self.buf:  # member data: straight from the caller's buffer
                    n = min(self.left, len(mv))
                    self._data(mv[:n])
                    mv = mv[n:]
                    continue
                self.buf += mv  # a header, possibly split across calls
                mv = memoryview(b"")
                while self._step():
                    pass
        except NotStreamable:
            self.discard()
            self.streamable = False
        except OSError as e:  # the destination's disk (full, read-only): name the file that could not be written
            if e.filename is None:
                e.filename = str(self.cur.target) if self.cur is not None else str(self.dest)
            self.discard()
            raise from_os_error(e, doing="write") from None
        except BaseException:
            self.discard()  # a refused member leaves nothing behind
            raise

    def reset(self) -> None:
        self.discard()
        self._start()

    def discard(self) -> None:
        self.stop_workers()
        if self.cur is not None:
            with contextlib.suppress(OSError):
                self.cur.close()
            self.cur = None
        shutil.rmtree(self.dest, ignore_errors=True)

    def stop_workers(self) -> None:
        """No worker writes after this: queued jobs are cancelled (their files closed), running ones waited for."""
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)
            self.pool = None
        for job, (cur, _size) in self.jobs.items():
            if job.cancelled():  # never started: its file is still open
                with contextlib.suppress(OSError):
                    cur.close()
        self.jobs.clear()

    def _members(self) -> list[Member]:
        """Every member, the workers' waited for: the first error of one (in member order) is raised."""
        out = []
        for m in self.done:
            if isinstance(m, Future):
                try:
                    m = m.result()
                except OSError as e:
                    raise from_os_error(e, doing="write") from None
            out.append(m)
        self.done = list(out)
        return out

    def finish(self) -> list[Member]:
        """Check the central directory against the streamed members and apply their modes."""
        if not self.streamable:
            raise NotStreamable(self.label)
        try:
            if self.cur is not None or self.tail is None:
                raise VerifyError(f"{self.label} ends in the middle of a member", why="the download is incomplete",
                                  fix="download it again")
            members = self._members()
            self.stop_workers()
            try:
                modes = self._central(members)
            except NotStreamable:
                self.discard()
                raise
            for m, mode in zip(members, modes, strict=False):
                if not m.name.endswith("/"):
                    os.chmod(self.dest / m.name, 0o755 if mode & 0o111 else 0o644)
            if not self.dest.exists():
                self.dest.mkdir(parents=True)
            return members
        except BaseException:
            self.discard()
            raise

    # ---------------------------------------------------------------------------------- internals

    def _start(self) -> None:
        self.streamable = True
        self.buf = bytearray()
        self.pos = 0  # offset in the zip of buf[0]
        self.done = []
        self.names = set()
        self.layout = Layout(Path(self.label))
        self.total = 0
        self.cur = None
        self.left = 0
        self.deferred = None
        self.pool = None
        self.jobs = {}
        self.tail = None
        self.sizes = None

    def _to_tail(self, data: bytes | bytearray | memoryview) -> None:
        assert self.tail is not None
        self.tail += data
        if len(self.tail) > MAX_TAIL:
            self.discard()
            raise UnsafeArchive(f"{self.label}: a central directory of more than {MAX_TAIL} bytes")

    def _step(self) -> bool:
        """Consume what buf allows; True while progress is possible."""
        if self.cur is not None:
            if not self.buf:
                return False
            n = min(self.left, len(self.buf))
            piece = bytes(self.buf[:n])
            del self.buf[:n]
            self._data(piece)
            return True
        if len(self.buf) < 4:
            return False
        sig = bytes(self.buf[:4])
        if sig in (CENTRAL, END, END64):
            self.tail_at = self.pos
            self.tail = bytearray()
            self._to_tail(self.buf)
            self.buf = bytearray()
            return False
        if sig != LOCAL:
            raise VerifyError(f"{self.label} is not a zip file (or is damaged at offset {self.pos})",
                              fix="download it again")
        if len(self.buf) < LOCAL_FMT.size:
            return False
        (_s, _ver, flags, method, _t, _d, crc, csize, usize, nlen, xlen) = LOCAL_FMT.unpack_from(self.buf)
        head = LOCAL_FMT.size + nlen + xlen
        if len(self.buf) < head:
            return False
        if flags & 0x08 or csize == 0xFFFFFFFF or usize == 0xFFFFFFFF or method not in (0, 8):
            raise NotStreamable(f"flags {flags:#x}, method {method}")
        raw = bytes(self.buf[LOCAL_FMT.size:LOCAL_FMT.size + nlen])
        name = raw.decode("utf-8" if flags & 0x800 else "cp437", errors="replace")
        if flags & 0x41:  # encrypted (or strongly so)
            raise UnsafeArchive(f"{self.label}: member '{name}' is encrypted", why="llamabundle reads unencrypted members only",
                                fix="do not use this archive")
        path = safe_name(name, Path(self.label))
        if name in self.names:
            raise UnsafeArchive(f"{self.label}: member '{name}' appears twice", fix="do not use this archive")
        self.layout.add(name, is_dir=name.endswith("/"))
        if self.sizes_from is not None:
            first, _ = self.sizes_from
            if not self.done and name != first:
                raise NotStreamable(f"the first member is {name}, not {first}")
            if self.sizes is not None and not name.endswith("/") and self.sizes.get(name) != usize:
                raise NotStreamable(f"{name} is not listed with {usize} bytes")  # refused from the central directory
        if len(self.done) >= MAX_MEMBERS:
            raise UnsafeArchive(f"{self.label}: more than {MAX_MEMBERS} members")
        if usize > RATIO_FLOOR and usize > MAX_RATIO * max(csize, 1):
            raise UnsafeArchive(f"{self.label}: member '{name}' expands {usize // max(csize, 1)}-fold",
                                why="a zip bomb", fix="do not use this archive")
        self.total += usize
        if self.total > self.max_total:
            raise UnsafeArchive(f"{self.label}: expands to more than {self.max_total} bytes",
                                why="a zip bomb or a damaged archive", fix="do not use this archive")
        self.names.add(name)
        self.dest.mkdir(parents=True, exist_ok=True)
        target = self.dest / path
        out = None
        if name.endswith("/"):
            target.mkdir(parents=True, exist_ok=True)
        else:
            target.parent.mkdir(parents=True, exist_ok=True)
            out = open(target, "xb")
        self.cur = _Inflating(self.label, name=name, offset=self.pos, crc=crc, csize=csize, usize=usize,
                              deflated=method == 8, out=out, target=target)
        self.left = csize
        # A worker inflates it once all its bytes are here (zlib, hashlib and writes release the GIL): a deflated
        # member of bounded size, never the first when the others' sizes are read from it.
        self.deferred = (bytearray() if self.workers > 1 and method == 8 and csize <= MAX_DEFERRED
                         and not (self.sizes_from is not None and not self.done) else None)
        self._consume(head)
        if not csize:
            self._data(b"")
        return True

    def _consume(self, n: int) -> None:
        del self.buf[:n]
        self.pos += n

    def _data(self, piece: bytes | memoryview) -> None:
        """The next `piece` (at most what is left) of the current member's data; closes it at its end."""
        cur = self.cur
        assert cur is not None
        self.pos += len(piece)
        self.left -= len(piece)
        if self.deferred is not None:
            self.deferred += piece
            if self.left:
                return
            self._hand_over(cur, self.deferred)  # the worker owns it now: never written to again here
            self.deferred = None
        else:
            cur.feed(piece, last=not self.left)
            if self.left:
                return
            self.done.append(cur.done())
        self.cur = None
        if self.sizes_from is not None and len(self.done) == 1:
            self.sizes = self.sizes_from[1](self.dest)

    def _hand_over(self, cur: _Inflating, data: bytearray) -> None:
        """A worker inflates the member. At most MAX_INFLIGHT compressed bytes wait for the workers (the oldest
        job is waited for first); a worker's error stops the stream at the next member handed over."""
        for job in [j for j in self.jobs if j.done()]:
            del self.jobs[job]
            if job.exception() is not None:
                self._members()  # raises it (an earlier member's error first)
        while self.jobs and sum(size for _, size in self.jobs.values()) + len(data) > MAX_INFLIGHT:
            oldest = next(iter(self.jobs))
            concurrent.futures.wait([oldest])
            del self.jobs[oldest]
        if self.pool is None:
            self.pool = ThreadPoolExecutor(max_workers=self.workers, thread_name_prefix="zipstream")
        job = self.pool.submit(cur.whole, data)
        self.jobs[job] = (cur, len(data))
        self.done.append(job)

    def _central(self, members: list[Member]) -> list[int]:
        """Parse the central directory; it must describe exactly the streamed members. Returns their modes."""
        assert self.tail is not None
        t = bytes(self.tail)
        bad = VerifyError(f"{self.label}: the central directory does not match the members",
                          why="a damaged or crafted zip", fix="download it again; do not use this archive")
        end = t.rfind(END)
        if end < 0 or len(t) < end + END_FMT.size:
            raise VerifyError(f"{self.label} has no end of central directory", why="the download is incomplete",
                              fix="download it again")
        (_s, _disk, _cd_disk, _n_here, count, cd_size, cd_offset, _clen) = END_FMT.unpack_from(t, end)
        if count == 0xFFFF or cd_offset == 0xFFFFFFFF:
            raise NotStreamable("zip64 central directory")
        if cd_offset != self.tail_at or count != len(members) or cd_size > end:
            raise bad
        modes, at = [], 0
        for m in members:
            if t[at:at + 4] != CENTRAL or len(t) < at + CENTRAL_FMT.size:
                raise bad
            f = CENTRAL_FMT.unpack_from(t, at)
            (_sig, made_by, _ver, flags, _method, _tm, _dt, crc, csize, usize, nlen, xlen, clen,
             _disk, _iattr, eattr, offset) = f
            raw = t[at + CENTRAL_FMT.size:at + CENTRAL_FMT.size + nlen]
            name = raw.decode("utf-8" if flags & 0x800 else "cp437", errors="replace")
            if (name, crc, csize, usize, offset) != (m.name, m.crc, m.csize, m.usize, m.offset):
                raise bad
            mode = eattr >> 16 if made_by >> 8 == 3 else 0
            if stat.S_IFMT(mode) not in (0, stat.S_IFREG, stat.S_IFDIR):  # 0: no type recorded, a file
                kind = "a symbolic link" if stat.S_ISLNK(mode) else "not a regular file"
                raise UnsafeArchive(f"{self.label}: member '{name}' is {kind}", why="bundles hold regular files only",
                                    fix="do not use this archive")
            modes.append(mode)
            at += CENTRAL_FMT.size + nlen + xlen + clen
        if at != cd_size:
            raise bad
        return modes


class Pipelined:
    """A ZipStream fed from a second thread, so that receiving (and hashing, and writing the .part) overlaps
    with unpacking: hashlib, zlib and file writes release the GIL. Same interface as ZipStream; an error of
    the worker surfaces at the next `update` or at `finish`. `close()` stops the worker (call it before
    removing what it writes)."""

    def __init__(self, inner: ZipStream, *, depth: int = 64) -> None:
        self.inner, self.depth = inner, depth
        self.q: queue.Queue[bytes | None] = queue.Queue(depth)
        self.thread: threading.Thread | None = None
        self.error: BaseException | None = None

    def _work(self) -> None:
        while (item := self.q.get()) is not None:
            if self.error is None:
                try:
                    self.inner.update(item)
                except BaseException as e:  # handed to the feeding thread
                    self.error = e

    def _check(self) -> None:
        if self.error is not None:
            error, self.error = self.error, None
            raise error

    def update(self, data: bytes) -> None:
        self._check()
        if self.thread is None:
            self.thread = threading.Thread(target=self._work, name="zipstream", daemon=True)
            self.thread.start()
        self.q.put(bytes(data))

    def _join(self) -> None:
        if self.thread is not None:
            self.q.put(None)
            self.thread.join()
            self.thread = None

    def close(self) -> None:
        """Nothing writes after this: neither the feeding thread nor the inner stream's workers."""
        self._join()
        self.inner.stop_workers()

    def reset(self) -> None:
        self._join()
        self.error = None
        self.inner.reset()

    def finish(self) -> list[Member]:
        self._join()
        try:
            self._check()
        except BaseException:
            self.inner.discard()
            raise
        return self.inner.finish()


def unpack_file(archive: Path, dest: Path, *,
                sizes_from: tuple[str, Callable[[Path], Mapping[str, int]]] | None = None) -> list[Member]:
    """Stream a zip file from disk through ZipStream (one read pass). Raises NotStreamable for layouts
    it does not stream; dest is left only on success."""
    zs = ZipStream(dest, label=archive.name, sizes_from=sizes_from)
    try:
        with open(archive, "rb") as f:
            while chunk := f.read(OUT_CHUNK):
                zs.update(chunk)
        return zs.finish()
    except BaseException:
        zs.discard()
        raise
