"""One HTTP server on loopback for the tests: bound to a free port, served from a thread, and answering each
request with what a handler function the test supplies returns, `Request -> Reply`. A Reply can stream its
body in chunks, pace it, hang up part-way through it, wait before answering, or not answer at all; every
request is recorded, with what was answered and how many body bytes went out. `ranged` answers as a file
server does (Range and If-Range), `static` serves a dict of paths. The fakes of GitHub, of a package index
and of NVIDIA's redist server are built on it, as are the servers of the download tests."""

from __future__ import annotations

import http.server
import re
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from io import BufferedIOBase
from typing import Any, Literal, Self

Handler = Callable[["Request"], "Reply"]


class Request:
    """One request, as the handler sees it and as `Loopback.requests` keeps it. `headers` has lower-case
    names; the body is read (by its Content-Length) when first asked for, while the request is answered."""

    def __init__(self, method: str, path: str, headers: dict[str, str], rfile: BufferedIOBase) -> None:
        self.method = method
        self.path = path  # as sent: the query string included
        self.headers = headers
        self.status: int | None = None  # what was answered; None: no answer (yet, or ever)
        self.sent = 0  # body bytes written to the client
        self._rfile: BufferedIOBase | None = rfile
        self._body: bytes | None = None

    @property
    def body(self) -> bytes:
        if self._body is None:
            n = int(self.headers.get("content-length") or 0)
            self._body = self._rfile.read(n) if n and self._rfile is not None else b""
            self._rfile = None
        return self._body

    def __repr__(self) -> str:
        return f"Request({self.method} {self.path} -> {self.status}, {self.sent} bytes)"


@dataclass
class Reply:
    """What to answer. A bytes body gets a Content-Length unless `headers` name one (then it is sent as given:
    it may promise more than the body holds) or `length` is False; an iterable body is sent chunk by chunk,
    with no Content-Length but one in `headers`, and is closed once sent or abandoned. `cut` hangs up after
    that many body bytes, `rate` paces the body (bytes per second, in `chunk`-sized writes), `delay` waits
    (seconds) before anything is sent."""

    status: int = 200
    headers: Mapping[str, str] = field(default_factory=dict)
    body: bytes | Iterable[bytes] = b""
    length: bool = True
    cut: int | None = None
    rate: float | None = None
    chunk: int | None = None  # bytes per write of a bytes body; None: one write (256 KiB when paced)
    delay: float = 0.0
    reason: str | None = None  # the reason phrase; None: the standard one
    kind: Literal["answer", "error", "hang up"] = "answer"  # error: http.server's error page; hang up: no answer


def error(status: int, message: str | None = None, *, delay: float = 0.0) -> Reply:
    """http.server's own error answer (send_error): `message` as the reason phrase, a small HTML page."""
    return Reply(status, reason=message, delay=delay, kind="error")


def hang_up(*, delay: float = 0.0) -> Reply:
    """No answer at all: the connection closes (as after a timeout or a crash on the other side)."""
    return Reply(0, delay=delay, kind="hang up")


def ranged(req: Request, body: bytes, *, etag: str | None = None, ranges: bool = True,
           headers: Mapping[str, str] | None = None, **reply: Any) -> Reply:
    """A file server's answer to a GET of `body`: when `ranges`, 206 for a `Range: bytes=N-` or `bytes=N-M` (M past
    the end is the end) if the If-Range validator (if any) is `etag`, and 416 at or past the end; else 200 with all
    of it. Accept-Ranges (when `ranges`) and ETag (when given) come before `headers`; the other arguments are the
    Reply's."""
    size = len(body)
    rng, if_range = req.headers.get("range"), req.headers.get("if-range")
    start, end, first = 0, size - 1, {}
    m = re.fullmatch(r"bytes=([0-9]+)-([0-9]*)", rng or "")
    if ranges and m and (if_range is None or if_range == etag) and (not m.group(2) or int(m.group(2)) >= int(m.group(1))):
        start = int(m.group(1))
        end = min(size - 1, int(m.group(2))) if m.group(2) else size - 1
        if start >= size:
            return Reply(416, {"Content-Range": f"bytes */{size}", "Content-Length": "0"})
        first = {"Content-Range": f"bytes {start}-{end}/{size}"}
    hdrs = {**first, **({"Accept-Ranges": "bytes"} if ranges else {}), **({"ETag": etag} if etag else {}),
            **(headers or {})}
    return Reply(206 if first else 200, hdrs, body[start:end + 1], **reply)


def static(files: Mapping[str, bytes], *, headers: Mapping[str, str] | None = None) -> Handler:
    """A handler serving `files` (request path -> bytes, looked up at each request): 200 with `headers`, or
    http.server's 404."""

    def answer(req: Request) -> Reply:
        body = files.get(req.path)
        return error(404) if body is None else Reply(200, dict(headers or {}), body)

    return answer


class Loopback:
    """An HTTP/1.0 server on `host` (127.0.0.1 unless told), a free port, answering `methods` (others get
    http.server's 501) with `handler`, each connection in its own thread. Bound when made, so `url` is known;
    serving from `start()` (or entering it as a context manager) until `close()` (or leaving it).

    `requests` holds every request answered by the handler, in order of arrival; `errors` what the handler
    raised (the client then sees the connection close). A client hanging up is no error."""

    def __init__(self, handler: Handler, *, host: str = "127.0.0.1", methods: Iterable[str] = ("GET",)) -> None:
        self.handler = handler
        self.methods = frozenset(methods)
        self.requests: list[Request] = []
        self.errors: list[BaseException] = []
        self.lock = threading.Lock()
        self.httpd = _HTTPServer((host, 0), _Exchange)
        self.httpd.loopback = self
        self.host, self.port = host, int(self.httpd.server_address[1])
        self.url = f"http://{host}:{self.port}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, args=(0.02,), daemon=True)

    def start(self) -> Self:
        if self.thread.ident is None:
            self.thread.start()
        return self

    def close(self) -> None:
        if self.thread.ident is not None:
            self.httpd.shutdown()
        self.httpd.server_close()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def paths(self) -> list[str]:
        """The path of every request so far, in order."""
        with self.lock:
            return [r.path for r in self.requests]

    def forget(self) -> None:
        """Start the record of requests afresh."""
        with self.lock:
            self.requests.clear()


class _HTTPServer(http.server.ThreadingHTTPServer):
    daemon_threads = True
    loopback: Loopback

    def handle_error(self, request: object, client_address: object) -> None:
        exc = sys.exc_info()[1]
        if exc is not None and not isinstance(exc, ConnectionError):
            with self.loopback.lock:
                self.loopback.errors.append(exc)


class _Exchange(http.server.BaseHTTPRequestHandler):
    server: _HTTPServer

    def log_message(self, *args: object) -> None:
        pass

    def _exchange(self) -> None:
        loop = self.server.loopback
        if self.command not in loop.methods:
            self.send_error(501, f"Unsupported method ({self.command!r})")  # as http.server answers one it lacks
            return
        req = Request(self.command, self.path, {k.lower(): v for k, v in self.headers.items()}, self.rfile)
        with loop.lock:
            loop.requests.append(req)
        self._send(req, loop.handler(req))

    do_GET = do_HEAD = do_POST = do_PUT = do_PATCH = do_DELETE = do_OPTIONS = _exchange

    def _send(self, req: Request, reply: Reply) -> None:
        if reply.delay:
            time.sleep(reply.delay)
        self.close_connection = True
        if reply.kind == "hang up":
            return
        if reply.kind == "error":
            req.status = reply.status
            self.send_error(reply.status, reply.reason)
            return
        self.send_response(reply.status, reply.reason)
        for k, v in reply.headers.items():
            self.send_header(k, v)
        if isinstance(reply.body, bytes) and reply.length and not any(k.lower() == "content-length" for k in reply.headers):
            self.send_header("Content-Length", str(len(reply.body)))
        self.end_headers()
        req.status = reply.status
        chunks = reply.body
        try:
            self._write(req, reply, chunks)
        except OSError:
            pass  # the client hung up
        finally:
            close = getattr(chunks, "close", None)
            if not isinstance(chunks, bytes) and callable(close):
                close()

    def _write(self, req: Request, reply: Reply, body: bytes | Iterable[bytes]) -> None:
        chunks: Iterable[bytes | memoryview] = (
            _slices(body, reply.chunk or (256 << 10 if reply.rate else None)) if isinstance(body, bytes) else body)
        left, t0 = reply.cut, time.monotonic()
        for piece in chunks:
            if left is not None:
                if left <= 0:
                    break
                piece = piece[:left]
                left -= len(piece)
            self.wfile.write(piece)
            req.sent += len(piece)
            if reply.rate:
                ahead = t0 + req.sent / reply.rate - time.monotonic()
                if ahead > 0:
                    time.sleep(ahead)
        self.wfile.flush()


def _slices(body: bytes, size: int | None) -> Iterator[bytes | memoryview]:
    if size is None:
        yield body
        return
    view = memoryview(body)
    for i in range(0, len(view), size):
        yield view[i:i + size]
