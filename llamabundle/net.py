"""One requests Session for the tool; resumable, sha256-verified downloads that never leave a partial file.

`download` streams into `<dest>.part` (with the server's validator in `<dest>.part.json`), hashing the
bytes as served, and renames to `dest` only once size and sha256 check out. A dropped connection, a 5xx
or a 429 is retried with backoff, resuming with `Range` + `If-Range` where the server allows it; a
`.part` left by an interrupted run is resumed the same way by the next one (DESIGN §6).

The `.part` belongs to whoever holds `<dest>.part.lock`: processes downloading the same file to the same
place take turns, and one that finds `dest` already there with the pinned sha256 uses it as it is.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import time
from collections.abc import Callable, Iterator
from http.client import HTTPException
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urljoin, urlsplit

import requests
import urllib3
from filelock import FileLock, Timeout

from . import __version__, untrusted
from .errors import LlamaBundleError, StoreError, VerifyError
from .log import Log, ProgressHandle

CHUNK = 1 << 20
MAX_REDIRECTS = 10
MAX_DELAY = 30.0  # seconds: the longest Retry-After (or backoff) a download waits
LOCK_TIMEOUT = 3600.0  # seconds: the longest a download waits for another process downloading the same file
_sleep = time.sleep  # tests replace it

# What a connection dropped mid-body looks like, from requests, urllib3, http.client or the socket (never a
# bare OSError: a full disk while writing what arrived is not a network failure to retry).
DROPPED = (requests.RequestException, urllib3.exceptions.HTTPError, HTTPException,
            ConnectionError, TimeoutError)
# Requests that can never work: no retry.
HOPELESS = (requests.exceptions.InvalidURL, requests.exceptions.MissingSchema, requests.exceptions.InvalidSchema,
             requests.exceptions.InvalidHeader, urllib3.exceptions.LocationParseError)


class NetworkError(StoreError):
    pass


def session() -> requests.Session:
    s = requests.Session()
    s.headers["User-Agent"] = f"llamabundle/{__version__}"
    s.headers["Accept-Encoding"] = "identity"  # hashes are of the file, never of an on-the-fly encoding
    return s


def download(url: str, dest: Path, *, http: requests.Session, log: Log, sha256: str | None = None,
             connect_timeout: float = 10.0, read_timeout: float = 60.0, headers: dict[str, str] | None = None,
             size: int | None = None, retries: int = 4, backoff: float = 0.5,
             mismatch_error: type[LlamaBundleError] = VerifyError, token: str | None = None,
             sink: Sink | None = None) -> str:
    """Download url to dest atomically; return the sha256 of the bytes as served.

    `size`/`sha256`, when given, must match, else the partial file is deleted and `mismatch_error` raised
    (more bytes than `size` abort at once). Network failures raise NetworkError after `retries` retries
    (backoff doubling from `backoff` seconds); the `.part` is kept so that a later call resumes it, as it
    is on KeyboardInterrupt. `token` goes as `Authorization: Bearer` to the origin of `url` only, never to
    a redirect target elsewhere. `sink` is fed every byte of the file in order as it arrives (again from
    the start after a restart, which it is told by `reset()`), e.g. a zipstream.ZipStream unpacking on the
    fly; an error it raises discards the partial download.

    Concurrent calls for one `dest` (threads or processes) take turns on `<dest>.part.lock`; with `sha256`
    pinned, a `dest` that is already there with that digest is returned without downloading (its bytes are
    fed to `sink` all the same).
    """
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    job = _Download(url, dest, http=http, log=log, sha256=sha256.lower() if sha256 else None,
                    timeout=(connect_timeout, read_timeout), headers=dict(headers or {}), size=size,
                    retries=max(0, retries), backoff=max(0.0, backoff), mismatch_error=mismatch_error, token=token, sink=sink)
    with _exclusive(dest.with_name(dest.name + ".part.lock"), log=log, what=dest.name):
        got = job.already_there()
        return got if got is not None else job.run()


@contextlib.contextmanager
def _exclusive(path: Path, *, log: Log, what: str, timeout: float | None = None) -> Iterator[None]:
    """Hold the lock file `path`, and remove it when done. Removing a lock file is safe only if a process
    that locked it after its removal notices: so the file locked must still be the one at `path`, else it
    is locked again (on Windows filelock removes the file itself)."""
    timeout = LOCK_TIMEOUT if timeout is None else timeout
    deadline = time.monotonic() + timeout
    told = False
    for tries in range(1, 101):  # bounded: where locks do not work the file may keep changing
        lock = FileLock(str(path))
        try:
            lock.acquire(timeout=0)
        except Timeout:
            if not told:
                log.info(f"    download {what}: another process is downloading it; waiting for it")
                told = True
            try:
                lock.acquire(timeout=max(0.0, deadline - time.monotonic()))
            except Timeout:
                raise StoreError(f"another process has been downloading {path.parent / what} for over "
                                 f"{timeout / 60:.0f} minutes", why=f"it holds {path}",
                                 fix="wait for it to finish (or end it), then retry") from None
        if os.name == "nt" or _holds(lock, path) is not False or tries == 100:
            break
        lock.release()  # we locked a file its holder had removed: lock the one there now
    try:
        yield
    finally:
        try:
            if os.name != "nt" and _holds(lock, path) is True:
                path.unlink(missing_ok=True)  # while it is held: a waiter then finds it gone and locks anew
        finally:
            lock.release()


def _holds(lock: FileLock, path: Path) -> bool | None:
    """Whether `lock` holds the file that is at `path` now; None: this filelock does not tell (its file is
    then never removed)."""
    fd = getattr(getattr(lock, "_context", None), "lock_file_fd", None)
    if not isinstance(fd, int):
        return None
    try:
        return os.path.samestat(os.fstat(fd), os.stat(path))
    except OSError:
        return False


def get_page(url: str, *, http: requests.Session, headers: dict[str, str] | None = None,
             connect_timeout: float = 10.0, read_timeout: float = 60.0, retries: int = 3, backoff: float = 0.5,
             max_bytes: int = 64 << 20) -> requests.Response:
    """GET a small document (an index page, an API answer) with its body read; retried like `download`
    on dropped connections, 5xx and 429. Other statuses are the caller's to judge."""
    why = ""
    for attempt in range(max(0, retries) + 1):
        if attempt:
            _sleep(min(backoff * 2 ** (attempt - 1), MAX_DELAY))
        try:
            r = http.get(url, headers=headers or {}, timeout=(connect_timeout, read_timeout), stream=True)
        except HOPELESS as e:
            raise NetworkError(f"cannot read {url}", why=short_reason(e), fix="check the URL") from None
        except DROPPED as e:
            why = short_reason(e)
            if refused(e):
                break
            continue
        with r:
            if r.status_code == 429 or 500 <= r.status_code <= 599:
                why = f"HTTP {r.status_code}"
                continue
            try:
                body = r.raw.read(max_bytes + 1, decode_content=True)
            except DROPPED as e:
                why = short_reason(e)
                continue
            if len(body) > max_bytes:
                raise NetworkError(f"{url} is larger than {max_bytes} bytes", fix="check the URL")
            r._content = body  # read: .content and .text work after the connection is released
            return r
    raise NetworkError(f"cannot read {url}", why=why or "no answer",
                       fix="check the network (and the mirror or index URL), then retry")


def answered(r: requests.Response) -> str:
    """What came back, for a message: the URL, the HTTP status, the content type and the first bytes."""
    body = r.content
    ctype = r.headers.get("Content-Type") or "no Content-Type"
    return f"{r.url} answered HTTP {r.status_code} ({ctype}, {len(body)} bytes): {untrusted.preview(body)}"


def answer_json(r: requests.Response, *, what: str, error: type[LlamaBundleError] = NetworkError, fix: str = "",
                redact: Callable[[str], str] = lambda text: text, max_bytes: int = untrusted.MAX_BYTES) -> Any:
    """An API answer's JSON value (read body). A body that is not JSON (an HTML page from a proxy or a wrong
    URL, a cut one) or is past untrusted's limits is `error` (exit 6) naming `what` and what came back."""
    try:
        return untrusted.loads(r.content, max_bytes=max_bytes)
    except ValueError as e:  # untrusted.Untrusted, json.JSONDecodeError, UnicodeDecodeError
        limit = isinstance(e, untrusted.Untrusted)
        raise error(redact(f"{what} is {e if limit else 'not JSON'}"),
                    why=redact(answered(r) + ("" if limit else f"; {str(e)[:200]}")), fix=fix) from None


def fetch_small(get: Callable[[dict[str, str]], requests.Response], *, what: str, source: str, size: int | None,
                sha256: str | None, max_bytes: int, attempts: int, delay: Callable[[int], float],
                sleep: Callable[[float], None], log: Log, label: str = "download",
                redact: Callable[[str], str] = lambda text: text, error: type[LlamaBundleError] = StoreError,
                fix: str = "") -> bytes:
    """A small file's bytes (a manifest, a SHA256SUMS) in memory, from `get(headers)`, the caller's request (its
    own authentication and status handling) answering 200, 206 or 416. A body that ends early or drops is retried
    after `delay(n)` seconds and resumed (Range + If-Range) until it holds `size` bytes (and matches `sha256`,
    when known); when the `attempts` run out that is a NetworkError. Only content that arrived whole and is
    wrong raises `error` (with `fix`). `what` and `source` name the file and where it comes from in messages."""
    fix = fix or f"remove it from {source}, then publish again"
    if size is not None and size > max_bytes:
        raise error(f"{what} in {source} is {size} bytes, more than {max_bytes >> 20} MiB",
                    why="it is a few KiB when llamabundle publishes it", fix=fix)
    data = bytearray()
    served: str | None = None
    spliced = False  # `data` was put together from more than one response
    why, dropped = "", False
    for attempt in range(1, attempts + 1):
        if attempt > 1:
            wait = delay(attempt - 1)
            log.info(redact(f"    {label} {what}: {why}; retry {attempt - 1}/{attempts - 1} in {wait:.1f}s"))
            sleep(wait)
        headers = {"Accept": "application/octet-stream"}
        if data:
            headers["Range"] = f"bytes={len(data)}-"
            if served:
                headers["If-Range"] = served
        r = get(headers)
        with r:
            expected = size
            if r.status_code == 416:  # asked for the bytes after the end: whole already, or something changed
                if not (data and size is not None and len(data) == size):
                    data.clear()
                    why = "the server refused to resume (HTTP 416)"
                    continue
            else:
                offset = 0
                if r.status_code == 206:
                    start, _end, total = content_range(r.headers.get("Content-Range"))
                    if start != len(data):
                        why = f"the server resumed at byte {start}, not {len(data)}"
                        data.clear()
                        continue
                    offset, spliced = len(data), True
                    expected = size if size is not None else total
                else:
                    data.clear()
                    spliced, served = False, None
                served = served or validator(r.headers)
                if expected is None:
                    n = r.headers.get("Content-Length", "")
                    expected = offset + int(n) if n.isdigit() else None
                cap = (expected if expected is not None else max_bytes) + 1
                try:
                    for chunk in r.raw.stream(64 << 10, decode_content=False):  # the bytes as served
                        data += chunk
                        if len(data) >= cap:
                            break
                except DROPPED as e:
                    of = expected if expected is not None else "?"
                    why = f"the connection dropped after {len(data)} of {of} bytes ({short_reason(e)})"
                    dropped = True
                    continue
        if len(data) > max_bytes:
            raise error(f"{what} in {source} is larger than {max_bytes >> 20} MiB",
                        why="it is a few KiB when llamabundle publishes it", fix=fix)
        if expected is not None and len(data) < expected:
            why, dropped = f"the connection ended after {len(data)} of {expected} bytes", True
            continue
        dropped = False
        if expected is not None and len(data) > expected:
            why = f"the server sent more than the {expected} bytes listed"
            data.clear()
            continue
        got = hashlib.sha256(data).hexdigest()
        if sha256 is not None and got != sha256:
            if spliced:  # the pieces may be of different versions: once more, whole
                why = "the resumed body does not match the file's digest"
                data.clear()
                continue
            raise error(f"{what} in {source} does not match its digest",
                        why=f"the listing records sha256:{sha256}, the download has sha256:{got}", fix=fix)
        return bytes(data)
    trouble = "the connection dropped before the end" if dropped else "the download kept failing"
    raise NetworkError(f"cannot download {what} from {source}: {trouble}",
                       why=redact(f"{why} (gave up after {attempts} attempts)"),
                       fix="check the network and retry; nothing is known to be wrong with what is stored")


class Sink(Protocol):
    def update(self, data: bytes) -> None: ...

    def reset(self) -> None: ...


class _Digest:
    """sha256 of the bytes so far, teed into the caller's sink; a new one restarts the sink."""

    def __init__(self, sink: Sink | None) -> None:
        self.sha, self.sink = hashlib.sha256(), sink
        if sink is not None:
            sink.reset()

    def update(self, data: bytes) -> None:
        self.sha.update(data)
        if self.sink is not None:
            self.sink.update(data)

    def hexdigest(self) -> str:
        return self.sha.hexdigest()


class _Retry(Exception):
    """A transient failure: try again, resuming, while retries are left."""

    def __init__(self, why: str, *, retry_after: float | None = None) -> None:
        super().__init__(why)
        self.why = why
        self.retry_after = retry_after


class _Download:
    def __init__(self, url: str, dest: Path, *, http: requests.Session, log: Log, sha256: str | None,
                 timeout: tuple[float, float], headers: dict[str, str], size: int | None, retries: int,
                 backoff: float, mismatch_error: type[LlamaBundleError], token: str | None,
                 sink: Sink | None = None) -> None:
        self.url, self.dest, self.http, self.log, self.sha256 = url, dest, http, log, sha256
        self.timeout, self.headers, self.size, self.retries, self.backoff = timeout, headers, size, retries, backoff
        self.mismatch_error, self.token, self.sink = mismatch_error, token, sink
        self.part = dest.with_name(dest.name + ".part")
        self.meta = dest.with_name(dest.name + ".part.json")
        self.digest = _Digest(None)
        self.hashed = 0  # how many leading bytes of .part `digest` covers
        self.validator: str | None = None  # strong ETag or Last-Modified of the bytes in .part
        self.total: int | None = None  # the whole file's size as served, when the server said
        self.resumable = False  # the server offered byte ranges (Accept-Ranges: bytes, or a 206)
        self.bar: ProgressHandle | None = None

    # ------------------------------------------------------------------------------ driver

    def already_there(self) -> str | None:
        """The sha256 of `dest` when it is already the pinned file (another process downloaded it), else None."""
        if self.sha256 is None or not self.dest.is_file():
            return None
        try:
            if self.size is not None and self.dest.stat().st_size != self.size:
                return None
            digest = _Digest(self.sink)
            with open(self.dest, "rb") as f:
                while chunk := f.read(CHUNK):
                    digest.update(chunk)
        except OSError:
            return None
        if digest.hexdigest() != self.sha256:
            if self.sink is not None:
                self.sink.reset()
            return None
        self.log.info(f"    download {self.dest.name}: already there, with the pinned sha256")
        return digest.hexdigest()

    def run(self) -> str:
        with contextlib.ExitStack() as stack:
            self.stack = stack
            try:
                self._load_leftover()
                failures = 0
                while True:
                    try:
                        self._attempt()
                        break
                    except _Retry as e:
                        failures += 1
                        if failures > self.retries:
                            raise NetworkError(f"cannot download {self.url}",
                                               why=f"{e.why} (gave up after {failures} attempts)",
                                               fix="check the network or use another source; a rerun resumes "
                                                   "the partial download") from None
                        delay = min(self.backoff * 2 ** (failures - 1), MAX_DELAY)
                        if e.retry_after is not None:
                            delay = max(delay, min(e.retry_after, MAX_DELAY))
                        self.log.info(f"    download {self.dest.name}: {e.why}; retry {failures}/{self.retries}"
                                      f" in {delay:.1f}s")
                        _sleep(delay)
                got = self._verify()
            except KeyboardInterrupt:
                raise  # .part kept for a resume
            except LlamaBundleError as e:
                if self.sink is not None and not isinstance(e, NetworkError):
                    self._discard()  # the sink refused these bytes: they are of no use to a resume either
                raise  # .part kept for a resume; a mismatch has deleted it already
            except BaseException:
                self._discard()
                raise
        os.replace(self.part, self.dest)
        self.meta.unlink(missing_ok=True)
        return got

    def _load_leftover(self) -> None:
        """Adopt a `.part` from an earlier run, with its validator when it was recorded."""
        if not self.part.is_file():
            self.meta.unlink(missing_ok=True)
            return
        try:
            info = untrusted.read(self.meta, max_bytes=64 << 10)
        except (OSError, ValueError):
            info = None  # resume without If-Range; sha256/size are verified at the end anyway
        if isinstance(info, dict):
            if info.get("url") != self.url:
                self._discard()  # someone else's bytes
                return
            v, t = info.get("validator"), info.get("total")
            self.validator = v if isinstance(v, str) and v else None
            self.total = t if isinstance(t, int) and t >= 0 else None
        have = self.part.stat().st_size
        if (self.size is not None and have > self.size) or (self.total is not None and have > self.total):
            self._discard()

    # ---------------------------------------------------------------------------- one GET

    def _attempt(self) -> None:
        offset = self.part.stat().st_size if self.part.is_file() else 0
        extra: dict[str, str] = {}
        if offset:
            extra["Range"] = f"bytes={offset}-"
            if self.validator:
                extra["If-Range"] = self.validator
        r = self._get(extra)
        with r:
            status = r.status_code
            if status == 429 or 500 <= status <= 599:
                raise _Retry(f"HTTP {status}" + (f" {r.reason}" if r.reason else ""),
                             retry_after=_retry_after(r.headers.get("Retry-After")))
            if status == 416 and offset:
                self._range_not_satisfiable(r, offset)
                return
            if status not in (200, 206):
                raise NetworkError(f"GET {self.url} answered HTTP {status}", why=r.reason or "",
                                   fix="check the URL and your network; retry later")
            if "bytes" in r.headers.get("Accept-Ranges", "").lower():
                self.resumable = True
            served = validator(r.headers)
            if status == 206:
                start, _end, total = content_range(r.headers.get("Content-Range"))
                if start != offset:
                    self._discard()
                    raise _Retry(f"the server answered a range starting at {start}, not {offset}")
                if total is None:
                    total = self._length(r, offset)
                if ((self.validator and served and served != self.validator)
                        or (self.total is not None and total is not None and total != self.total)):
                    self._discard()  # the file changed under us and the server ignored If-Range
                    raise _Retry("the file changed on the server since the partial download; starting over")
                self.resumable = True
                self.validator = self.validator or served
            else:
                if offset:
                    self.log.info(f"    download {self.dest.name}: the server sent the whole file; starting over")
                offset = 0
                total = self._length(r, 0)
                self.validator = served
                self.digest, self.hashed = _Digest(self.sink), 0
            self.total = total
            if self.size is not None and total is not None and total != self.size:
                self._mismatch("size", f"the server announces {total} bytes, expected {self.size}")
            self._save_meta()
            self._hash_part(offset)
            self._stream(r, offset, total)

    def _get(self, extra: dict[str, str]) -> requests.Response:
        """GET following redirects by hand, so that credentials never leave the origin of `url`."""
        cur = self.url
        for _hop in range(MAX_REDIRECTS + 1):
            h: dict[str, str | None] = {**self.headers, **extra}
            if origin(cur) == origin(self.url):
                if self.token:
                    h = {k: v for k, v in h.items() if k.lower() != "authorization"}
                    h["Authorization"] = f"Bearer {self.token}"
            else:  # None also drops a session-level header
                h = {k: v for k, v in h.items() if k.lower() != "authorization"}
                h["Authorization"] = None
            try:
                # requests drops a header whose value is None (merge_setting), but its annotations allow no None
                r = self.http.get(cur, headers=h,  # type: ignore[arg-type]
                                  stream=True, timeout=self.timeout, allow_redirects=False)
            except HOPELESS as e:
                raise NetworkError(f"cannot download {self.url}", why=short_reason(e), fix="check the URL") from None
            except DROPPED as e:
                if refused(e):  # nobody listens there, or the name does not resolve: no point insisting
                    raise NetworkError(f"cannot download {self.url}", why=short_reason(e),
                                       fix="check the network or use another source") from None
                raise _Retry(short_reason(e)) from None
            if not r.is_redirect:
                return r
            target = urljoin(cur, r.headers["Location"])
            r.close()
            if urlsplit(target).scheme not in ("http", "https"):
                raise NetworkError(f"GET {self.url} redirected to {target}", why="not an http(s) URL",
                                   fix="check the URL")
            cur = target
        raise NetworkError(f"GET {self.url} redirected more than {MAX_REDIRECTS} times", fix="check the URL")

    def _stream(self, r: requests.Response, offset: int, total: int | None) -> None:
        done = offset
        bar = self._progress(total)
        bar.update(done, total)
        too_big = False
        with open(self.part, "ab" if offset else "wb") as out:
            try:
                for chunk in r.raw.stream(CHUNK, decode_content=False):  # the bytes as served, never decoded
                    if self.size is not None and done + len(chunk) > self.size:
                        too_big = True
                        break
                    out.write(chunk)
                    self.digest.update(chunk)
                    done += len(chunk)
                    self.hashed = done
                    bar.update(done, total)
            except DROPPED as e:
                dropped: str | None = short_reason(e)
            else:
                dropped = None
        if too_big:
            self._mismatch("size", f"the server sent more than the expected {self.size} bytes")
        if dropped is None and total is not None and done < total:
            dropped = "the body ended early"
        if dropped is not None:
            why = f"the connection dropped after {done} of {total if total is not None else '?'} bytes ({dropped})"
            if done > offset and not self.resumable:
                raise NetworkError(f"cannot download {self.url}",
                                   why=why + "; the server does not offer to resume (no Accept-Ranges: bytes)",
                                   fix="retry later or use another source")
            raise _Retry(why)

    def _range_not_satisfiable(self, r: requests.Response, offset: int) -> None:
        """HTTP 416 to `Range: bytes=<len(.part)>-`: done if the .part already holds the whole file."""
        _start, _end, total = content_range(r.headers.get("Content-Range"))
        known = total if total is not None else self.total if self.total is not None else self.size
        if known == offset:
            self.total = offset
            self._hash_part(offset)
            return
        self._discard()
        raise _Retry(f"the server refused the range of the partial download (HTTP 416 at {offset} bytes)")

    # ------------------------------------------------------------------------------ helpers

    def _verify(self) -> str:
        have = self.part.stat().st_size
        self._hash_part(have)
        got = self.digest.hexdigest()
        if self.size is not None and have != self.size:
            self._mismatch("size", f"expected {self.size} bytes, got {have}")
        if self.sha256 is not None and got != self.sha256:
            self._mismatch("sha256", f"expected {self.sha256}, got {got}")
        return got

    def _mismatch(self, what: str, why: str) -> None:
        self._discard()
        raise self.mismatch_error(f"{what} mismatch for {self.url}", why=why,
                                  fix="the file is not the pinned one; check the recipe's sha256/size or the mirror")

    def _hash_part(self, upto: int) -> None:
        """Make `digest` cover exactly the first `upto` bytes of .part (re-reading them after a resume)."""
        if self.hashed == upto:
            return
        self.digest, self.hashed = _Digest(self.sink), 0
        with open(self.part, "rb") as f:
            while self.hashed < upto:
                chunk = f.read(min(CHUNK, upto - self.hashed))
                if not chunk:
                    break
                self.digest.update(chunk)
                self.hashed += len(chunk)

    def _length(self, r: requests.Response, offset: int) -> int | None:
        n = r.headers.get("Content-Length")
        return offset + int(n) if n and n.isdigit() else None

    def _save_meta(self) -> None:
        tmp = self.meta.with_name(self.meta.name + ".tmp")
        info = {"url": self.url, "validator": self.validator, "total": self.total}
        tmp.write_text(json.dumps(info), encoding="utf-8")
        os.replace(tmp, self.meta)

    def _discard(self) -> None:
        self.part.unlink(missing_ok=True)
        self.meta.unlink(missing_ok=True)
        self.digest, self.hashed, self.validator, self.total = _Digest(self.sink), 0, None, None

    def _progress(self, total: int | None) -> ProgressHandle:
        if self.bar is None:
            self.bar = self.stack.enter_context(self.log.progress(f"download {self.dest.name}", total, unit="bytes"))
        return self.bar


def validator(headers: requests.structures.CaseInsensitiveDict[str]) -> str | None:
    """A strong ETag, else Last-Modified: what If-Range may carry (a weak ETag may not)."""
    etag = headers.get("ETag")
    if etag and not etag.startswith("W/"):
        return etag
    return headers.get("Last-Modified") or None


def content_range(value: str | None) -> tuple[int | None, int | None, int | None]:
    """`bytes 100-199/1000` → (100, 199, 1000); `bytes */1000` → (None, None, 1000)."""
    if not value:
        return None, None, None
    unit, _, rest = value.strip().partition(" ")
    if unit.lower() != "bytes":
        return None, None, None
    span, _, total = rest.partition("/")
    start = end = None
    if "-" in span:
        a, _, b = span.partition("-")
        if a.strip().isdigit() and b.strip().isdigit():
            start, end = int(a), int(b)
    return start, end, int(total) if total.strip().isdigit() else None


def _retry_after(value: str | None) -> float | None:
    if value and value.strip().isdigit():
        return float(value.strip())
    return None  # an HTTP-date, or nothing: plain backoff


def redirected(cur: str, r: requests.Response) -> str:
    """The URL a redirect answer to a request for `cur` sends to (the answer closed); an http(s) URL, else
    requests' InvalidSchema. The clients that follow redirects by hand (to keep credentials at home) use it."""
    nxt = urljoin(cur, r.headers["Location"])
    r.close()
    if urlsplit(nxt).scheme not in ("http", "https"):
        raise requests.exceptions.InvalidSchema("redirected to a URL that is not http(s)")
    return nxt


def too_many_redirects() -> requests.exceptions.TooManyRedirects:
    return requests.exceptions.TooManyRedirects(f"more than {MAX_REDIRECTS} redirects")


def origin(url: str) -> tuple[str, str, int | None]:
    """(scheme, host, port) of a URL: who may see a token sent to it."""
    u = urlsplit(url)
    scheme = u.scheme.lower()
    try:
        port = u.port
    except ValueError:
        port = None
    return scheme, (u.hostname or "").lower(), port or {"http": 80, "https": 443}.get(scheme)


def refused(e: BaseException) -> bool:
    """Whether the connection was never made (refused, unreachable, unresolvable), as opposed to lost."""
    seen: set[int] = set()
    todo: list[object] = [e]
    while todo:
        x = todo.pop()
        if not isinstance(x, BaseException) or id(x) in seen:
            continue
        seen.add(id(x))
        if isinstance(x, urllib3.exceptions.NewConnectionError):  # includes NameResolutionError
            return True
        todo += [getattr(x, "reason", None), x.__cause__, x.__context__, *x.args]
    return False


def short_reason(e: BaseException) -> str:
    """A connection failure in a few words (`connection refused`, `timed out`), else its text (300 characters)."""
    text = str(e)
    for marker in ("Failed to resolve", "Connection refused", "timed out", "Name or service not known"):
        if marker in text:
            return marker.lower()
    return text[:300]
