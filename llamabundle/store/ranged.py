"""One blob's bytes read from a byte range of a remote file: an OCI layer (the whole blob), or one zstd frame of
a GitHub release asset that holds a group of them (store.github.blobs). The bytes are hashed as they arrive and
checked against the blob's sha256 and size at the end; a connection that drops is resumed with a Range request
from where it stopped (at most `tries` times); a server that ignores Range answers 200 with the whole file, and
the bytes before the range are skipped (and counted: `received` is what came over the network)."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import requests

from .. import net
from ..log import ProgressHandle

CHUNK = 1 << 20


@dataclass(frozen=True, kw_only=True)
class Window:
    """Where the blob lies: `size` bytes from byte `start` of a remote file of `total` bytes."""
    start: int
    size: int
    total: int
    sha256: str  # 64 hex digits, of the blob's bytes


@dataclass(frozen=True, kw_only=True)
class Retry:
    """How a stream resumes: at most `tries` times, waiting `delay(n)` seconds before the n-th, said through
    `note` (already redacted by the caller's `redact`)."""
    tries: int
    delay: Callable[[int], float]
    sleep: Callable[[float], None]
    note: Callable[[str], None]
    redact: Callable[[str], str]


class RangedStream:
    """`read(n)` gives the blob's bytes; `open(headers)` makes one GET of the remote file with those headers
    (Range among them) and returns the streamed answer (200 or 206). `mismatch(why)` is raised for bytes that
    are not the blob; `where` names the server in a network error."""

    def __init__(self, window: Window, open: Callable[[dict[str, str]], requests.Response], *,  # noqa: A002
                 what: str, where: str, mismatch: Callable[[str], Exception], retry: Retry,
                 progress: ProgressHandle | None = None) -> None:
        self.w, self.open, self.what, self.where, self.mismatch = window, open, what, where, mismatch
        self.retry, self.progress = retry, progress
        self.sha = hashlib.sha256()
        self.got = 0  # bytes of the blob hashed so far
        self.received = 0  # bytes that came over the network (what a resume or an ignored Range skips included)
        self.drops = 0
        self.done = False
        self.skip = 0  # bytes to drop from the start of this answer
        self.pending = b""  # hashed, not yet handed out
        self.r: requests.Response | None = None
        self.chunks: Iterator[bytes] | None = None

    def _open(self) -> None:
        w = self.w
        first, last = w.start + self.got, w.start + w.size - 1
        headers = {"Accept": "application/octet-stream"}
        if (first, last) != (0, w.total - 1):
            headers["Range"] = f"bytes={first}-{last}"
        r = self.open(headers)
        length = r.headers.get("Content-Length", "")
        if r.status_code == 206:
            start, _end, _total = net.content_range(r.headers.get("Content-Range"))
            if start is None or start > first:
                r.close()
                raise net.NetworkError(f"cannot {self.what} from {self.where}",
                                       why=f"the server resumed at byte {start}, not {first}", fix="retry")
            self.skip = first - start
        else:
            if length.isdigit() and int(length) != w.total:
                r.close()
                raise self.mismatch(f"the server sends {length} bytes for a file of {w.total}")
            self.skip = first
        self.r, self.chunks = r, r.raw.stream(CHUNK, decode_content=False)

    def read(self, n: int = CHUNK) -> bytes:
        while True:
            if self.pending:
                chunk, self.pending = self.pending[:n], self.pending[n:]
                return chunk
            if self.done:
                return b""
            if self.chunks is None:
                self._open()
                continue
            try:
                chunk = next(self.chunks, b"")
            except net.DROPPED as e:
                self._dropped(net.short_reason(e))
                continue
            if not chunk:
                if self.got < self.w.size:
                    self._dropped(f"the body ended after {self.got} of {self.w.size} bytes")
                    continue
                self._end()
                continue
            self.received += len(chunk)
            if self.skip:
                cut = min(self.skip, len(chunk))
                chunk, self.skip = chunk[cut:], self.skip - cut
                if not chunk:
                    continue
            if self.got + len(chunk) > self.w.size:  # a 200 for the whole file, or a server that overran the range
                chunk = chunk[:self.w.size - self.got]
                self._take(chunk)
                self._end()
            else:
                self._take(chunk)

    def _take(self, chunk: bytes) -> None:
        self.sha.update(chunk)
        self.got += len(chunk)
        if self.progress is not None:
            self.progress.update(self.got, self.w.size)
        self.pending = chunk

    def _end(self) -> None:
        self.close()
        self.done = True
        if self.sha.hexdigest() != self.w.sha256:
            raise self.mismatch(f"its bytes have the sha256 {self.sha.hexdigest()}, not {self.w.sha256}")

    def finish(self) -> None:
        """Read what is left (a frame's end, or bytes past it) so that the digest is checked."""
        while self.read(CHUNK):
            pass

    def _dropped(self, why: str) -> None:
        self.close()
        self.drops += 1
        rt = self.retry
        if self.drops > rt.tries:
            raise net.NetworkError(f"cannot {self.what} from {self.where}",
                                   why=rt.redact(f"{why} (gave up after {self.drops} attempts)"),
                                   fix="check the network and retry")
        delay = rt.delay(self.drops)
        rt.note(rt.redact(f"{self.what}: {why}; resuming at byte {self.got} in {delay:.1f}s"))
        rt.sleep(delay)

    def close(self) -> None:
        if self.r is not None:
            self.r.close()
        self.r, self.chunks = None, None

    def __enter__(self) -> RangedStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
